"""The shape of the code, read from its imports with `ast` (docs/how_it_works.md, "The map"):
no import circles, imports point down the layers only, the worker process's package imports only
what the worker may load and the trainer side never imports it, and no module grows past 400
lines. Every import counts, also one inside a function."""

from __future__ import annotations

import ast
import os

import pytest

from conftest import REPO

# lower layers first; a module may import its own layer and those before it, never one after
LAYERS = (
    ("asyncckpt.errors", "asyncckpt.protocol", "asyncckpt.config", "asyncckpt.report", "asyncckpt.train_state",
     "asyncckpt.command"),
    ("asyncckpt.storage",),
    ("asyncckpt.layout", "asyncckpt.formats", "asyncckpt.memory_file", "asyncckpt.replica_wire",
     "asyncckpt.replica_server"),
    ("asyncckpt.loading",),
    ("asyncckpt.save",),
    ("asyncckpt.doors",),
    ("asyncckpt.cli",),
    ("asyncckpt", "asyncckpt.__main__", "asyncckpt.lightning", "asyncckpt.transformers", "asyncckpt.torch_dcp",
     "asyncckpt.testing"),
)
# what the worker process may load of the library (the rest is the trainer's side)
WORKER_MAY_IMPORT = ("asyncckpt", "asyncckpt.errors", "asyncckpt.protocol", "asyncckpt.formats", "asyncckpt.layout",
                     "asyncckpt.storage", "asyncckpt.memory_file", "asyncckpt.replica_wire",
                     "asyncckpt.replica_server")
MAX_LINES = 400


def package_modules(folder: str, package: str) -> dict[str, str]:
    """module name -> file, for every .py under `folder` (installed as `package`)."""
    found = {}
    for directory, _, names in os.walk(os.path.join(REPO, folder)):
        for name in names:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(directory, name), os.path.join(REPO, folder))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join([package, *parts])] = os.path.join(directory, name)
    return found


MODULES = {**package_modules("asyncckpt", "asyncckpt"), **package_modules("worker", "asyncckpt_worker"),
           **package_modules("benchmarks/savebench", "savebench"), **package_modules("benchmarks/gpubench", "gpubench"),
           **package_modules("benchmarks/scalesim", "scalesim")}


def imports_of(module: str) -> set[str]:
    """The library modules `module` imports (relative imports resolved; `from pkg import mod`
    counts as mod when mod is a module)."""
    path = MODULES[module]
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]
        else:
            continue
        for target in targets:
            while target not in MODULES and "." in target:  # `import a.b.c` of a module: its nearest library module
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def layer_of(module: str) -> int:
    best = None
    for n, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or (module.startswith(prefix + ".") and prefix != "asyncckpt"):
                if best is None or len(prefix) > best[1]:
                    best = (n, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_there_is_no_import_circle():
    """Tarjan's strongly connected components: any of more than one module is a circle."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert circles == []


def test_imports_point_down_the_layers():
    library = [m for m in GRAPH if m.partition(".")[0] == "asyncckpt"]
    upward = [f"{m} -> {t}" for m in library for t in sorted(GRAPH[m])
              if t.partition(".")[0] == "asyncckpt" and layer_of(t) > layer_of(m)]
    assert upward == []


def test_the_worker_package_imports_only_the_worker_side_and_the_trainer_never_imports_it():
    worker = [m for m in GRAPH if m.partition(".")[0] == "asyncckpt_worker"]
    assert worker, "no worker modules found"
    beyond = [f"{m} -> {t}" for m in worker for t in sorted(GRAPH[m])
              if t.partition(".")[0] == "asyncckpt" and not any(t == a or t.startswith(a + ".") and a != "asyncckpt"
                                                                 for a in WORKER_MAY_IMPORT)]
    assert beyond == []
    trainer = [f"{m} -> {t}" for m in GRAPH if m.partition(".")[0] == "asyncckpt" for t in GRAPH[m]
               if t.partition(".")[0] == "asyncckpt_worker"]
    assert trainer == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.partition(".")[0] in ("asyncckpt", "asyncckpt_worker")))
def test_no_module_is_over_400_lines(module):
    with open(MODULES[module]) as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_LINES, f"{module}: {lines} lines; split it by job"


def test_the_checks_see_a_circle_an_upward_import_and_a_worker_import(monkeypatch):
    """The checks above fail where they should: fed a graph with each fault, they find it."""
    monkeypatch.setitem(GRAPH, "asyncckpt.errors", GRAPH["asyncckpt.errors"] | {"asyncckpt.save.checkpointer"})
    with pytest.raises(AssertionError):
        test_imports_point_down_the_layers()
    with pytest.raises(AssertionError):
        test_there_is_no_import_circle()
    monkeypatch.setitem(GRAPH, "asyncckpt_worker.main", GRAPH["asyncckpt_worker.main"] | {"asyncckpt.save.client"})
    with pytest.raises(AssertionError):
        test_the_worker_package_imports_only_the_worker_side_and_the_trainer_never_imports_it()


def test_every_package_of_the_tree_is_installed():
    """pyproject.toml lists the packages one by one: a folder left out installs without its
    modules (a fresh `make venv` failed once when a folder was renamed)."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    packages = {m for m, path in MODULES.items() if path.endswith("__init__.py") and m.partition(".")[0] in
                ("asyncckpt", "asyncckpt_worker")}
    assert packages == listed
