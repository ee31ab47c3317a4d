"""Prove every exercise is graded: blank one solution region at a time, some test must fail.

A region is the code between `### BEGIN SOLUTION` and `### END SOLUTION`; blanking it the
way nbgrader does (the region becomes `CODE_STUB` at its indentation)
gives the learner's starting point for that exercise alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from .course import CELL_TIMEOUT_S, CODE_STUB, lab_names, source_notebook
from .errors import InputError

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


def test_results(nb: nbformat.NotebookNode, cwd: Path, timeout: int = CELL_TIMEOUT_S
                 ) -> dict[str, bool]:
    """Execute `nb`; return {grade_id: passed} for every graded test cell."""
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    results = {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            results[meta["grade_id"]] = not any(o.get("output_type") == "error"
                                                for o in cell.get("outputs", []))
    return results


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
            print(f"{name:<24} {label:<32} {', '.join(failing) or 'NONE: UNGRADED'}")
            ok &= bool(failing)
    return ok
