"""The import graph between the packages under src/ runs one way (README, Layout):
miniquant <- minimoe <- minigpt <- minituner <- minirl; none of them imports labkit, and
labkit's experiment half imports none of them (only the course's lab harness reaches the
packages the labs are about). Nothing imports minirl, the top of the model packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MODEL_PACKAGES = ("miniquant", "minimoe", "minigpt", "minituner")
PACKAGES = MODEL_PACKAGES + ("minirl", "labkit")
# What each part may import of the others (minituner: minigpt for its atomic writer only).
ALLOWED = {
    "miniquant": set(),
    "minimoe": {"miniquant"},
    "minigpt": {"minimoe", "miniquant"},
    "minituner": {"miniquant", "minimoe", "minigpt"},
    "minirl": {"miniquant", "minimoe", "minigpt", "minituner"},
    "labkit": set(),
    "labkit/course": set(MODEL_PACKAGES) | {"labkit"},
}


def imported_roots(path: Path) -> set[str]:
    """Top-level package names of every import statement in a module (any nesting)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def part_of(path: Path) -> str:
    rel = path.relative_to(SRC).as_posix()
    return "labkit/course" if rel.startswith("labkit/course/") else rel.split("/")[0]


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_follow_the_layering(part):
    files = [f for f in sorted(SRC.rglob("*.py")) if part_of(f) == part]
    assert files
    offenders = {str(f.relative_to(SRC)): sorted(bad) for f in files
                 if (bad := (imported_roots(f) & set(PACKAGES)) - ALLOWED[part] - {part})}
    assert offenders == {}


def test_the_check_sees_an_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from labkit.atomic import atomic_path\n")
    assert "labkit" in imported_roots(module)
