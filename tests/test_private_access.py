"""No test reaches into a private attribute of a scheduler class: tests drive the scheduler's
parts through their public verbs (a test that needs a private is a design smell, STYLE.md).

The scan reads source as AST. The private names are those scheduler/ classes define: methods
named `_x`, and attributes set as `self._x` or declared `_x: T`. A test is flagged for
`obj._x` with such a name, unless `obj` is `self`/`cls` or the test file's own classes define
`_x` (a fake's own state). Dunders (`obj.__class__`) are never private here.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _class_privates(tree: ast.AST) -> set[str]:
    """Private names the classes of `tree` define."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                name = node.attr
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name = node.target.id
            else:
                continue
            if _is_private(name):
                names.add(name)
    return names


def scheduler_privates() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "scheduler").rglob("*.py"):
        names |= _class_privates(ast.parse(path.read_text(), str(path)))
    return names


def private_accesses(source: str, privates: set[str]) -> list[str]:
    """`line: expression` of each access in `source` to a name of `privates` on another object."""
    tree = ast.parse(source)
    own = _class_privates(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in privates or node.attr in own:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_a_private_access_and_passes_public_ones():
    privates = scheduler_privates()
    assert {"_turn", "_order", "_choose"} <= privates   # names the policies define
    source = (
        "def test_x(policy):\n"
        "    policy.planner.plan(0.0)\n"
        "    assert policy._turn is None\n"
        "    assert policy.__class__.__name__\n"
        "    policy._choose(0.0)\n"
    )
    assert private_accesses(source, privates) == ["3: policy._turn", "5: policy._choose"]
    fake = "class Fake:\n    def __init__(self):\n        self._turn = 0\n\ndef test_y(f):\n    assert f._turn == 0\n"
    assert private_accesses(fake, privates) == []   # a test's own fake keeps its state


def test_no_test_touches_a_private_attribute_of_a_scheduler_class():
    privates = scheduler_privates()
    offences = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        found = private_accesses(path.read_text(), privates)
        if found:
            offences[str(path.relative_to(ROOT))] = found
    assert not offences, offences
