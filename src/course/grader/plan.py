"""What runs, in which order, when one notebook is graded: the learner's cells as they
submitted them, every test cell taken from the instructor's source (its hidden part
included), a test they deleted put back after the cell it followed, a cell the source tags
jupyter-only left out (it needs what the learner's kernel does not have).

    plan(student notebook, instructor notebook) -> ([Cell], notes on what was repaired)

grade_ids that are not this lab's tests are ordinary code (said in a note); a duplicated
test id runs every copy, and the tests see the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..authoring.build import graded_test_cells, jupyter_only
from .tests_setup import HIDDEN, meta


@dataclass
class Test:
    grade_id: str
    points: float
    chunks: list[tuple[bool, str]]   # (hidden, code) in order
    visible: str                     # the cell as the learner sees it

    @classmethod
    def from_cell(cls, cell) -> Test:
        chunks, start = [], 0
        for m in HIDDEN.finditer(cell.source):
            chunks += [(False, cell.source[start:m.start()]), (True, m.group(1))]
            start = m.end()
        chunks.append((False, cell.source[start:]))
        chunks = [(h, c) for h, c in chunks if c.strip()] or [(False, "pass")]
        visible = "".join(c for h, c in chunks if not h)
        return cls(meta(cell)["grade_id"], float(meta(cell).get("points", 0)), chunks, visible)

    @property
    def has_hidden(self) -> bool:
        return any(hidden for hidden, _ in self.chunks)


@dataclass
class Cell:
    kind: str                      # "markdown", "code" (the student's) or "test"
    source: str
    test: Test | None = None
    outputs: list = field(default_factory=list)
    status: str = "not run"        # "ok", "error", "timeout", "killed", "dead", "jupyter-only"
    error: str = ""
    hidden_failed: bool = False
    hidden_case: str = ""          # the label of the hidden case that failed
    earned: float = 0.0
    exercise: str = ""             # a code cell that is one of the lab's exercises: its id


def _anchor(source_nb, test_id: str, student_cells: list) -> int:
    """Index in `student_cells` after which a missing test goes: after the student's copy of
    the nearest earlier source cell (matched by grade_id, else by cell id); -1 at the top."""
    cells = source_nb.cells
    position = next(i for i, c in enumerate(cells) if meta(c).get("grade_id") == test_id)
    for earlier in reversed(cells[:position]):
        for j in range(len(student_cells) - 1, -1, -1):
            theirs = student_cells[j]
            if (meta(earlier).get("grade_id") and meta(theirs).get("grade_id")
                    == meta(earlier)["grade_id"]) or (earlier.get("id") and theirs.get("id")
                                                      == earlier.get("id")):
                return j
    return -1


def plan(student_nb, source_nb) -> tuple[list[Cell], list[str]]:
    """The cells to run (see the module docstring) and status notes on what was repaired."""
    tests = {meta(c)["grade_id"]: Test.from_cell(c) for c in graded_test_cells(source_nb)}
    known = {meta(c).get("grade_id") for c in source_nb.cells} - {None}
    cells = [c for c in student_nb.cells if c.cell_type in ("code", "markdown")]
    last = {meta(c).get("grade_id"): i for i, c in enumerate(cells) if meta(c).get("grade_id")}
    counts: dict[str, int] = {}
    for c in cells:
        if g := meta(c).get("grade_id"):
            counts[g] = counts.get(g, 0) + 1
    edited = [g for g, i in last.items() if g in tests and (
        cells[i].source.strip() != tests[g].visible.strip()
        or float(meta(cells[i]).get("points", tests[g].points)) != tests[g].points
        or not meta(cells[i]).get("grade"))]
    missing = [g for g in tests if g not in last]
    only = [c for c in source_nb.cells if c.cell_type == "code" and jupyter_only(c)]
    only_ids = {c.get("id") for c in only} - {None}
    only_code = {c.source.strip() for c in only}
    inserts: dict[int, list[Test]] = {}
    for g in missing:
        inserts.setdefault(_anchor(source_nb, g, cells), []).append(tests[g])
    planned = [Cell("test", t.visible, t) for t in inserts.get(-1, [])]
    for i, c in enumerate(cells):
        g = meta(c).get("grade_id")
        if c.cell_type == "markdown":
            planned.append(Cell("markdown", c.source))
        elif g in tests and last[g] == i:
            planned.append(Cell("test", tests[g].visible, tests[g]))
        else:
            planned.append(Cell("code", c.source, exercise=g if g in known else ""))
            if not g and (c.get("id") in only_ids or c.source.strip() in only_code):
                planned[-1].status = "jupyter-only"
        planned += [Cell("test", t.visible, t) for t in inserts.get(i, [])]
    notes = []
    if edited or missing:
        notes.append("test cells restored from the instructor's source: " + ", ".join(
            [f"{g} (edited)" for g in edited] + [f"{g} (deleted)" for g in missing]))
    if unknown := sorted({meta(c).get("grade_id") for c in cells} - known - {None}):
        notes.append(f"grade_id not in this lab, run as ordinary cells: {', '.join(unknown)}")
    if dups := sorted(g for g, n in counts.items() if n > 1 and g in known):
        notes.append(f"duplicate grade_id {', '.join(dups)}: every copy ran in order; "
                     "the tests saw the last")
    return planned, notes
