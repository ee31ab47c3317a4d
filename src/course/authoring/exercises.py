"""Prove every exercise is graded (blank one solution region at a time, some test must fail),
and find the notebook a learner's `check` runs (course.grader.check runs it).

A region is the code between `### BEGIN SOLUTION` and `### END SOLUTION`; blanking it the
way nbgrader does (the region becomes `CODE_STUB` at its indentation)
gives the learner's starting point for that exercise alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from labkit.errors import InputError

from ..learner import WORK, notebook_to_check, release_notebook_path, released_labs
from ..quiet import client_options
from .build import CELL_TIMEOUT_S, CODE_STUB, graded_test_cells, lab_names, source_notebook

REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION[ \t]*$",
                    re.MULTILINE | re.DOTALL)


def regions(nb: nbformat.NotebookNode) -> list[tuple[int, int]]:
    """(cell index, region index within the cell) of every solution region."""
    return [(i, j) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for j, _ in enumerate(REGION.finditer(cell.source))]


def blank(nb: nbformat.NotebookNode, cell: int, region: int) -> nbformat.NotebookNode:
    """A copy of `nb` with one solution region replaced by the nbgrader stub."""
    nb = nbformat.from_dict(nb)
    matches = list(REGION.finditer(nb.cells[cell].source))
    m = matches[region]
    stub = f"{m.group(1)}{CODE_STUB}"
    src = nb.cells[cell].source
    nb.cells[cell].source = src[:m.start()] + stub + src[m.end():]
    return nb


def error_of(cell: nbformat.NotebookNode) -> str | None:
    """'ename: evalue' of an executed cell's first error output, or None if it passed."""
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            return f"{o.get('ename', '?')}: {o.get('evalue', '')}"
    return None


def test_results(nb: nbformat.NotebookNode, cwd: Path, timeout: int = CELL_TIMEOUT_S
                 ) -> dict[str, bool]:
    """Execute `nb` in place; return {grade_id: passed} for every graded test cell."""
    # A cell over the time limit is interrupted and counts as an error, like in nbgrader.
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name="python3", resources={"metadata": {"path": str(cwd)}},
                            **client_options())
    client.execute()
    return {cell.metadata["nbgrader"]["grade_id"]: error_of(cell) is None
            for cell in graded_test_cells(nb)}


def failed_setup(nb: nbformat.NotebookNode) -> tuple[int, int, str] | None:
    """(cell index, code cell number from 1, error) of an executed notebook's first failing
    cell when it is a setup cell: neither a test nor a solution, and above every solution
    cell, so that no learner code has run yet (e.g. an ImportError). None otherwise."""
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    for number, (i, cell) in enumerate(code, start=1):
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            return None
        if (error := error_of(cell)) is not None:
            return None if meta.get("grade") else (i, number, error)
    return None


def check_exercises(root: Path, labs: list[str] | None = None) -> bool:
    """Print a lab × exercise table; True when every blanked region fails some test."""
    root = root.resolve()
    known = lab_names(root)
    unknown = sorted(set(labs or []) - set(known))
    if unknown:
        raise InputError(f"unknown lab(s) {unknown}; available: {known}")
    ok = True
    print(f"{'lab':<24} {'exercise (cell:region)':<32} {'tests failing when blanked'}")
    for name in labs or known:
        nb = source_notebook(root / "solutions" / f"{name}.py")
        cwd = root / "labs" / name      # where a learner runs the notebook
        baseline = test_results(nbformat.from_dict(nb), cwd)
        if not all(baseline.values()):
            failing = [k for k, v in baseline.items() if not v]
            print(f"{name:<24} {'(solution)':<32} FAILS ON THE SOLUTION: {failing}")
            ok = False
            continue
        for cell, region in regions(nb):
            grade_id = nb.cells[cell].metadata.get("nbgrader", {}).get("grade_id", "?")
            failing = [k for k, v in test_results(blank(nb, cell, region), cwd).items()
                       if not v]
            label = f"{grade_id} ({cell}:{region})"
            print(f"{name:<24} {label:<32} {', '.join(failing) or 'NONE: UNGRADED'}",
                  flush=True)      # a row every notebook run: minutes apart on slow labs
            ok &= bool(failing)
    return ok


def notebook_for_check(root: Path, lab: str, notebook: Path | None
                       ) -> tuple[Path, nbformat.NotebookNode]:
    """The path and contents of the notebook `self_check` runs; InputError if unusable.

    `notebook`, else the learner's copy work/<lab>.ipynb, else (saying so) the blank release.
    """
    if lab not in (known := released_labs(root)):
        raise InputError(f"unknown lab {lab!r}; available: {known}")
    path = (notebook or notebook_to_check(root, lab)).resolve()
    if notebook is None and path == release_notebook_path(root, lab).resolve():
        print(f"no copy of yours at {WORK}/{lab}.ipynb yet (`make lab` makes it): checking the "
              f"blank release {path.relative_to(root)}, whose tests all fail")
    named = f"--notebook {path}" if notebook else str(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # absent, or not a notebook
        raise InputError(f"{named} is not a readable notebook "
                         f"({type(e).__name__}: {str(e)[:120]})") from e
    if not graded_test_cells(nb):
        raise InputError(f"{named} has no graded test cells: is it a lab notebook?")
    return path, nb
