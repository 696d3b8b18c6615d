"""The fenced code blocks of a Markdown file, for the tests that run the docs' examples."""

from __future__ import annotations

import re
from dataclasses import dataclass

FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    language: str  # "python", "" for a plain block, ...
    first_line: int  # 1-based line number of the block's first line of code
    code: str


def code_blocks(path: str) -> list[Block]:
    """Every ```-fenced block of the file, in order. An unclosed fence is an error."""
    blocks, language, start, lines = [], None, 0, []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fence = FENCE.match(line.rstrip("\n"))
            if language is None and fence:
                language, start, lines = fence.group(1), number + 1, []
            elif language is not None and line.rstrip() == "```":
                blocks.append(Block(language, start, "".join(lines)))
                language = None
            elif language is not None:
                lines.append(line)
    if language is not None:
        raise AssertionError(f"{path}:{start - 1}: code block never closed")
    return blocks


def python_blocks(path: str) -> list[Block]:
    return [b for b in code_blocks(path) if b.language == "python"]
