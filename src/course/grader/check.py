"""`make check LAB=NN-name`: a learner's notebook graded as the grader grades it, visible tests
only.

The learner's cells run in a kernel of their own and the lab's visible tests (from the
release notebook, so an edited test cell is put back) in a trusted kernel, through the same
bridge as grading (autograde.py), so the verdict is the one the grader will give; there is
no sandbox (it is the learner's own machine, and both kernels have their environment). The
hidden tests exist only in solutions/ and run when the notebook is graded. The file is read,
never written.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

from ..authoring.build import CELL_TIMEOUT_S
from ..authoring.exercises import notebook_for_check
from ..learner import release_notebook_path
from ..notebook.mine import save
from .autograde import cell_name, grade_notebook
from .sandbox import Sandbox


def _setup_failure(cells) -> tuple[int, str] | None:
    """(index, error) of the first learner cell that failed above every test (an import
    error, triton missing): the tests below it cannot run. None otherwise."""
    for i, cell in enumerate(cells):
        if cell.kind == "test":
            return None
        if cell.kind == "code" and cell.status not in ("ok", "not run", "jupyter-only"):
            return i, " ".join(cell.error.split())
    return None


def self_check(root: Path, lab: str, notebook: Path | None = None,
               timeout: int = CELL_TIMEOUT_S) -> bool:
    """Print each visible test with its points and, for a failure, its whole message, then
    each of the learner's cells that failed (a failing assertion in an ordinary cell fails
    the check too: the capstone checks its run that way); True when nothing failed."""
    root = root.resolve()
    path, nb = notebook_for_check(root, lab, notebook)
    release = nbformat.read(release_notebook_path(root, lab), as_version=4)
    outcome = grade_notebook(nb, release, Sandbox(root, unsafe=True, own_env=True),
                             timeout=timeout, total_timeout=timeout * 20 + 600, hidden=False,
                             lab=lab)
    print(f"{lab}: visible tests of {path}")
    if setup := _setup_failure(outcome.cells):
        named = cell_name(setup[0], outcome.cells[setup[0]], quote=True)
        print(f"  setup {named} failed: {setup[1]}; the tests below it cannot run")
    for note in outcome.notes:
        print(f"  note: {note}")
    if only := [i + 1 for i, c in enumerate(outcome.cells) if c.status == "jupyter-only"]:
        many = len(only) > 1
        print(f"  note: cell{'s' * many} {', '.join(map(str, only))} run{'s' * (not many)} in "
              f"Jupyter only, not here: {'they need' if many else 'it needs'} the library's "
              "version of what this lab asks you to write (or what such a cell made), a stub "
              "while the notebook is graded")
    passed: dict[str, bool] = {}
    earned = total = 0.0
    for cell in (c for c in outcome.cells if c.kind == "test"):
        grade_id, points, ok = cell.test.grade_id, cell.test.points, cell.earned > 0
        passed[grade_id] = ok or points == 0 and cell.status == "ok"
        earned, total = earned + cell.earned, total + points
        print(f"  {'PASS' if passed[grade_id] else 'FAIL'}  {grade_id:<40} "
              f"{cell.earned:g} / {points:g}")
        if not passed[grade_id]:
            message = cell.error if cell.status != "not run" else "not run"
            if setup:
                message = f"cannot run: setup cell {setup[0] + 1} failed"
            print(_indented(message), end="")
    broken = [(i, c) for i, c in enumerate(outcome.cells) if c.kind == "code"
              and c.status not in ("ok", "not run", "jupyter-only")]
    if setup:               # named above; the cells after it failed for want of what it made
        if after := [i + 1 for i, _ in broken[1:]]:
            print(f"  FAIL  cell{'s' * (len(after) > 1)} {', '.join(map(str, after))} failed "
                  f"too (after setup cell {setup[0] + 1})")
    else:
        for i, cell in broken:
            why = ("it calls an exercise you have not finished" if cell.error.startswith(
                "NotImplementedError") else "your own cell failed")
            print(f"  FAIL  {cell_name(i, cell, quote=True)}: {why}\n"
                  f"{_indented(cell.error or cell.status)}", end="")
    print(f"{earned:g} / {total:g} points from the visible tests "
          "(the grader also runs hidden tests)")
    if path != release_notebook_path(root, lab).resolve() and any(passed.values()):
        saved = save(root, lab, nbformat.read(path, as_version=4), passed, path)
        print(f"your definitions are saved to {saved.path.relative_to(root)}: `use(\"mine\")` "
              f"runs the pieces whose tests passed (`python -m course mine` lists them)")
        for name, lacking in saved.incomplete.items():
            print(f"  not saved whole: {name} needs {', '.join(lacking)}, which your notebook "
                  "computes at run time (make it an argument, or a constant or function of "
                  "its own); a piece calling it stays on the reference")
    return all(passed.values()) and not broken


def _indented(message: str, most: int = 60) -> str:
    """The whole message (expected, got and the rule), indented; at most `most` lines."""
    lines = message.splitlines() or [""]
    more = f"        ... ({len(lines) - most} more lines)\n" if len(lines) > most else ""
    return "".join(f"        {line}\n" for line in lines[:most]) + more
