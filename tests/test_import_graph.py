"""The project's modules import each other without cycles, and the folders point one way.

Every `import` counts, also those inside functions (a lazy import still ties two modules
together: each needs the other to work) and under TYPE_CHECKING. A cycle makes a module
impossible to read, test or move on its own, so this graph must stay a DAG.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "actors", "cluster", "deploy", "load_tests")
# Which folder may import which (docs/layout.md), with no exceptions:
# scheduler <- actors <- cluster <- deploy <- load_tests <- deploy.cli. The CLI is the one
# product package that imports the harness (`tokenmux bench|loadtest|demo|profile`), so
# nothing below it, the harness included, imports the CLI. The experiments (the scripts behind
# docs/results/) sit above everything: nothing outside them imports them.
CLI = "deploy.cli"
EXPERIMENTS = "load_tests.experiments"
ALLOWED = {
    "scheduler": {"scheduler"},
    "actors": {"actors", "scheduler"},
    "cluster": {"cluster", "actors", "scheduler"},
    "deploy": {"deploy", "cluster", "actors", "scheduler"},
    CLI: {"deploy", "cluster", "actors", "scheduler", "load_tests"},
    "load_tests": set(PACKAGES),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _statements(path: Path, name: str):
    """(base, names) of each import in `name`, relative imports resolved: `import a.b` gives
    ("a.b", []), `from .x import y, z` gives ("pkg.x", ["y", "z"])."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, [a.name for a in node.names]


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports (the most specific module each import names)."""
    found = set()
    for base, names in _statements(path, name):
        # `from pkg import sub` imports the submodule; `from mod import name`, the module.
        targets = [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] or [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_among_project_modules():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_folders_import_only_in_the_allowed_direction():
    wrong = []
    for name, targets in _graph().items():
        allowed = ALLOWED[max((p for p in ALLOWED if name == p or name.startswith(p + ".")), key=len)]
        for target in targets:
            below_the_cli = _within(target, CLI) and not _within(name, CLI)
            into_experiments = _within(target, EXPERIMENTS) and not _within(name, EXPERIMENTS)
            if below_the_cli or into_experiments or not any(_within(target, a) for a in allowed):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _missing_modules(path: Path, name: str, modules: dict[str, Path]) -> list[str]:
    """Project modules that `name` imports by a name no file has (a lazy import left behind by
    a move fails only when its function runs)."""
    return [base for base, _ in _statements(path, name) if base.split(".")[0] in PACKAGES and base not in modules]


def test_every_project_import_names_a_module_that_exists():
    modules = _modules()
    missing = {name: found for name, path in modules.items() if (found := _missing_modules(path, name, modules))}
    assert not missing, f"imports of modules that do not exist: {missing}"


def test_siblings_import_siblings_not_their_package():
    """`from scheduler import deadlines` inside scheduler/ runs scheduler/__init__.py, whose
    re-exports import half the package: a module that goes through an __init__ that imports
    closes a loop (scheduler -> policy -> scheduler). A sibling is imported by its own name."""
    modules = _modules()
    reexporting = {name for name, path in modules.items()
                   if path.name == "__init__.py" and _imports(path, name, modules)}
    wrong = []
    for name, path in modules.items():
        package = name.rpartition(".")[0]
        if path.name == "__init__.py" or package not in reexporting:
            continue
        wrong += [f"{name}: from {base} import {', '.join(names)}"
                  for base, names in _statements(path, name) if names and base == package]
    assert wrong == []
