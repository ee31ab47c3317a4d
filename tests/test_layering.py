"""The import graph of the packages under src/ runs one way (docs/ARCHITECTURE.md, Layers):

    miniquant <- minimoe <- minigpt <- minituner <- minirl      the model packages
    labkit                                                      experiments; imports none
    gpucompile                                                  Lab 13's compiler probe; none
    course: learner, quiet <- notebook <- authoring <- grader   the course, one way inside too

Nothing imports course, minirl or gpucompile but course (and the lab notebooks); no model
package imports labkit or course."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MODEL_PACKAGES = {"miniquant", "minimoe", "minigpt", "minituner"}
PACKAGES = MODEL_PACKAGES | {"minirl", "labkit", "gpucompile", "course"}
COURSE_BASE = {"course.learner", "course.quiet"}
# What each part may import of the packages (course parts: also of the course's parts).
ALLOWED = {
    "miniquant": set(),
    "minimoe": {"miniquant"},
    "minigpt": {"minimoe", "miniquant"},
    "minituner": {"miniquant", "minimoe", "minigpt"},
    "minirl": {"miniquant", "minimoe", "minigpt", "minituner"},
    "labkit": set(),
    "gpucompile": set(),
    "course.learner": {"labkit"},
    "course.quiet": {"miniquant"},
    "course.notebook": MODEL_PACKAGES | {"minirl", "labkit"} | COURSE_BASE,
    "course.authoring": {"labkit", "course.notebook"} | COURSE_BASE,
    "course.grader": {"labkit", "course.authoring", "course.notebook"} | COURSE_BASE,
    "course.labserver": {"labkit", "course.authoring"} | COURSE_BASE,
    "course.__init__": set(),
    "course.__main__": {"labkit", "course.authoring", "course.grader", "course.notebook",
                        "course.labserver"} | COURSE_BASE,
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts)


def imported(path: Path) -> set[str]:
    """Dotted names of every import in a module (any nesting), relative ones resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            # from .x (level 1) is a sibling of this module: its package's parts, less level-1
            package = module_name(path.parent).split(".") if node.level else []
            base = package[:len(package) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} if node.module else {f"{module}.{a.name}" for a in node.names}
    return names


def part_of(name: str) -> str | None:
    """The part a dotted module name belongs to: a package, or a course part."""
    root = name.split(".")[0]
    if root not in PACKAGES:
        return None
    if root != "course":
        return root
    parts = name.split(".")
    return "course.__init__" if len(parts) == 1 else f"course.{parts[1]}"


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_follow_the_layering(part):
    files = [f for f in sorted(SRC.rglob("*.py")) if part_of(module_name(f)) == part]
    assert files
    offenders = {}
    for f in files:
        reached = {part_of(n) for n in imported(f)} - {None, part}
        if bad := {r for r in reached if r not in ALLOWED[part]}:
            offenders[str(f.relative_to(SRC))] = sorted(bad)
    assert offenders == {}, f"imports against the layering (part {part}): {offenders}"


def test_every_module_has_a_part():
    assert {module_name(f) for f in SRC.rglob("*.py")
            if part_of(module_name(f)) not in ALLOWED} == set()


def test_the_check_sees_an_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from labkit.atomic import atomic_path\n")
    assert "labkit.atomic" in imported(module)


def test_the_check_resolves_a_relative_import():
    grader = SRC / "course" / "grader" / "grading.py"
    assert part_of("course.authoring.build") in {part_of(n) for n in imported(grader)}
    assert "course.labserver" not in ALLOWED["course.grader"]   # a sibling, never imported
