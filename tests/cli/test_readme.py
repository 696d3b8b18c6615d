"""The README stays a three-minute read that works: short, no line over 100 characters outside
code blocks, no undefined in-house words, links that lead somewhere, and every Python block of it
(and every self-contained one of docs/usage.md) runs as written, in a fresh directory."""

from __future__ import annotations

import ast
import builtins
import os
import re
import sys

import pytest

from conftest import REPO, run_cpu_script
from readme_blocks import Block, code_blocks, python_blocks

README = os.path.join(REPO, "README.md")
USAGE = os.path.join(REPO, "docs", "usage.md")
MAX_LINES = 120
MAX_WIDTH = 100
# the code's own names for things, which a newcomer has not been told
JARGON = ("door", "slab", "sharing", "retention")


def prose_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of every line outside ``` code blocks."""
    inside, lines = False, []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.startswith("```"):
                inside = not inside
            elif not inside:
                lines.append((number, line.rstrip("\n")))
    return lines


def test_the_readme_is_short_and_narrow():
    with open(README) as f:
        total = sum(1 for _ in f)
    assert total <= MAX_LINES, f"README.md: {total} lines (at most {MAX_LINES}): move detail into docs/"
    wide = [f"{n}: {len(line)} characters" for n, line in prose_lines(README) if len(line) > MAX_WIDTH]
    assert wide == [], f"README.md lines over {MAX_WIDTH} characters outside code blocks: {wide}"


def test_the_readme_uses_no_undefined_in_house_words():
    found = [f"{n}: {word!r}" for n, line in prose_lines(README) for word in JARGON
             if re.search(rf"\b{word}", line, re.IGNORECASE)]
    assert found == []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", [README, USAGE])
def test_every_link_to_a_file_of_the_checkout_and_its_section_exists(path):
    broken = []
    for n, line in prose_lines(path):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(file):
                broken.append(f"{n}: {target} (no such file)")
            elif anchor:
                headings = [slug(text) for _, text in prose_lines(file) if text.startswith("#")
                            for text in [text.lstrip("#")]]
                if anchor not in headings:
                    broken.append(f"{n}: {target} (no such section)")
    assert broken == [], f"{os.path.relpath(path, REPO)}: {broken}"


def free_names(code: str) -> set[str]:
    """Names a block reads but neither defines nor imports: a block with none runs on its own."""
    tree = ast.parse(code)
    defined, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return read - defined


def runnable_blocks() -> list:
    blocks = [pytest.param(block, id=f"README.md:{block.first_line}") for block in python_blocks(README)]
    blocks += [pytest.param(block, id=f"docs/usage.md:{block.first_line}") for block in python_blocks(USAGE)
               if not free_names(block.code)]
    return blocks


def test_the_readme_has_python_blocks_and_usage_a_self_contained_one():
    assert python_blocks(README), "README.md: no Python block"
    assert any(not free_names(b.code) for b in python_blocks(USAGE)), "docs/usage.md: no self-contained block"
    assert free_names("import os\nprint(os.sep, undefined_thing)") == {"undefined_thing"}


@pytest.mark.parametrize("block", runnable_blocks())
def test_the_python_block_runs_as_written(block: Block, tmp_path):
    """Each block in a fresh interpreter and an empty directory (the README's loop is also killed
    and resumed, from an installed wheel: test_install.py)."""
    (tmp_path / "block.py").write_text(block.code)
    done = run_cpu_script([sys.executable, "block.py"], timeout_s=240, cwd=str(tmp_path))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr


def test_every_block_is_closed_and_named():
    """An unclosed fence swallows the rest of the file; a Python block without its language is not run."""
    for path in (README, USAGE):
        for block in code_blocks(path):
            looks_python = re.search(r"^(import |from \w+ import )", block.code, re.MULTILINE)
            assert block.language == "python" or not looks_python, f"{path}:{block.first_line}: mark it ```python"
