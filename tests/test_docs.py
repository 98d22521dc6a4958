"""docs/structures.md names every module, one line each, and nothing that is gone."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "actors", "cluster", "deploy", "load_tests")


def _modules() -> set[str]:
    found = set()
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            if file.name != "__init__.py":
                found.add(file.relative_to(ROOT).as_posix())
    return found


def test_structures_lists_every_module_once():
    text = (ROOT / "docs" / "structures.md").read_text()
    listed = re.findall(r"^- `([\w/]+\.py)`", text, flags=re.M)
    assert len(listed) == len(set(listed)), "a module is listed twice"
    modules = _modules()
    assert sorted(modules - set(listed)) == [], "modules missing from docs/structures.md"
    assert sorted(set(listed) - modules) == [], "docs/structures.md lists modules that do not exist"
