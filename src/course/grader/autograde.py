"""Grade one notebook: the instructor's tests, run in the student's sandboxed kernel, and
proven to have run.

    plan(student notebook, instructor notebook) -> cells to run, in the student's order,
        every test cell taken from the instructor's source (hidden part included), a missing
        one put back after the cell it followed; grade_ids that are not this lab's tests
        are ordinary code
    run_plan(cells, sandbox):
        fresh kernel; install the guard (kernel_guard.py); fingerprint F0
        for each cell:
            student code -> run it (time limit; a cell that swallows the interrupt or kills
                            the kernel: restart, replay what ran before it, skip it)
            test         -> fingerprint == F0, or "tampering detected" and no more tests;
                            run its chunks (visible, then hidden); it earns its points when
                            every chunk ran without error and the last one published
                            HMAC(label) under this run's secret: proof that its body ran
"""

from __future__ import annotations

import ast
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

from ..authoring.build import graded_test_cells
from .jupyter_kernel import MAX_SUBMISSION_BYTES, PROOF_MIME, Kernel, Reply
from .sandbox import Sandbox

HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS[ \t]*\n(.*?)"
                    r"^[ \t]*### END HIDDEN TESTS[ \t]*$\n?", re.MULTILINE | re.DOTALL)
GUARD_SOURCE = (Path(__file__).parent / "kernel_guard.py").read_text()
MAX_RESTARTS = 3


def meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


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


@dataclass
class Cell:
    kind: str                      # "markdown", "code" (the student's) or "test"
    source: str
    test: Test | None = None
    outputs: list = field(default_factory=list)
    status: str = "not run"        # "ok", "error", "timeout", "killed", "dead", "tampered"...
    error: str = ""
    hidden_failed: bool = False
    earned: float = 0.0


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
            planned.append(Cell("code", c.source))
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


@dataclass
class Outcome:
    cells: list[Cell]
    notes: list[str]
    tampering: list[str] = field(default_factory=list)
    timed_out: str = ""            # why the whole submission was stopped, if it was

    @property
    def score(self) -> float:
        return sum(c.earned for c in self.cells)


class Run:
    """One submission's execution: the kernel, its guard, and the restarts."""

    def __init__(self, sandbox: Sandbox, slot: int, timeout: float):
        self.sandbox, self.slot, self.timeout = sandbox, slot, timeout
        self.secret, self.name = secrets.token_hex(16), f"__labkit_{secrets.token_hex(6)}__"
        self.kernel: Kernel | None = None
        self.budget = [MAX_SUBMISSION_BYTES]      # output characters left, across restarts
        self.uid = sandbox.uid(slot)              # one per submission (restarts keep it)
        self.baseline: dict = {}
        self.counter = 0

    def mac(self, text: str) -> str:
        return hmac.new(self.secret.encode(), text.encode(), sha256).hexdigest()

    def label(self) -> str:
        self.counter += 1
        return f"{self.name}:{self.counter}"

    def start(self) -> None:
        """A fresh kernel with the guard installed, and the fingerprint before student code."""
        self.close()
        self.kernel = Kernel(self.sandbox, self.slot, self.budget, self.uid)
        setup = (f"_d = {{'__name__': 'labkit_guard'}}\nexec({GUARD_SOURCE!r}, _d)\n"
                 f"_d['install']({self.secret!r}, {self.name!r})\ndel _d\n")
        reply = self.kernel.run(setup, timeout=60, silent=True)
        if not reply.ok:
            raise RuntimeError(f"the grader's guard did not install: {reply.error}")
        self.baseline = self.fingerprint()
        if not self.baseline:
            raise RuntimeError("the grader's guard gave no fingerprint in a fresh kernel")

    def fingerprint(self) -> dict:
        """The guard's state, or {} when it did not answer, or answered without the secret."""
        label = self.label()
        reply = self.kernel.run("", timeout=60, silent=True,
                                expressions={"fp": f"{self.name}.fingerprint({label!r})"})
        try:
            text = json.loads(ast.literal_eval(reply.expressions["fp"]["data"]["text/plain"]))
            state = json.dumps(text["state"], sort_keys=True)
            return text["state"] if hmac.compare_digest(text["mac"],
                                                        self.mac(label + state)) else {}
        except (KeyError, TypeError, ValueError):
            return {}

    def changes(self) -> list[str]:
        """What differs from the baseline fingerprint (empty: untampered)."""
        now = self.fingerprint()
        if not now:
            return ["the grader's guard in the kernel was removed or did not answer"]
        return sorted(k for k in self.baseline.keys() | now.keys()
                      if self.baseline.get(k) != now.get(k))

    def proven(self, reply: Reply, label: str) -> bool:
        """Whether the test's last line published this label's HMAC; removes it from outputs."""
        proofs = [o for o in reply.outputs if PROOF_MIME in o.get("data", {})]
        for o in proofs:
            reply.outputs.remove(o)
        return any(hmac.compare_digest(str(o["data"][PROOF_MIME]), self.mac(label))
                   for o in proofs)

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None


def _restart(run: Run, cells: list[Cell], upto: int) -> None:
    """A fresh kernel with every cell before `upto` that ran re-run, quietly, in order."""
    run.start()
    for cell in cells[:upto]:
        if cell.kind == "code" and cell.status in ("ok", "error"):
            code = [cell.source]
        elif cell.kind == "test" and cell.status in ("ok", "error"):
            code = [chunk for _, chunk in cell.test.chunks]
        else:
            continue
        for chunk in code:
            if run.kernel.run(chunk, run.timeout, history=False).status not in ("ok", "error"):
                raise RuntimeError("a cell that ran before failed to run again after a restart")


def _run_test(run: Run, cell: Cell) -> None:
    """Run a test cell's chunks; it earns its points only with the proof of its last line."""
    label = run.label()
    for k, (hidden, code) in enumerate(cell.test.chunks):
        last = k == len(cell.test.chunks) - 1
        reply = run.kernel.run(code + (f"\n{run.name}.proof({label!r})\n" if last else ""),
                               run.timeout, history=not hidden)
        proven = run.proven(reply, label) if last else True
        if not hidden:
            cell.outputs += reply.outputs
        cell.status, cell.error = reply.status, reply.error
        if not reply.ok:
            cell.hidden_failed = hidden
            return
        if not proven:
            cell.status = "unproven"
            return
    cell.earned = cell.test.points


def run_plan(cells: list[Cell], notes: list[str], sandbox: Sandbox, slot: int = 0,
             timeout: float = 300, total_timeout: float = 3600) -> Outcome:
    """Execute the planned cells (see the module docstring); never raises for bad code."""
    outcome, run = Outcome(cells, list(notes)), Run(sandbox, slot, timeout)
    deadline, restarts = time.monotonic() + total_timeout, 0
    try:
        run.start()
        for i, cell in enumerate(cells):
            if cell.kind == "markdown":
                continue
            if time.monotonic() > deadline:
                outcome.timed_out = (f"the submission ran longer than {total_timeout:g} s in "
                                     "all; the tests after that point did not run")
                break
            if cell.kind == "test":
                if changed := run.changes():
                    outcome.tampering.append(f"before {cell.test.grade_id}: "
                                             + ", ".join(changed[:8]))
                    cell.status = "tampered"
                    break
                _run_test(run, cell)
                if cell.status == "unproven":
                    outcome.tampering.append(f"{cell.test.grade_id} did not report that its "
                                             "body ran (its code was skipped or rewritten)")
                    break
            else:
                reply = run.kernel.run(cell.source, timeout)
                cell.outputs, cell.status, cell.error = reply.outputs, reply.status, reply.error
            if cell.status in ("killed", "dead"):
                restarts += 1
                what = ("swallowed the time-limit interrupt (or sent more output than the "
                        "grader takes in one message)" if cell.status == "killed"
                        else "ended the kernel (os._exit, crash, out of memory)")
                if restarts > MAX_RESTARTS:
                    outcome.notes.append(f"cell {i + 1} {what}; {MAX_RESTARTS} restarts "
                                         "used up, the tests after it did not run")
                    break
                outcome.notes.append(f"cell {i + 1} {what}: the kernel was restarted and "
                                     "grading went on without it")
                _restart(run, cells, i)
            elif cell.status == "timeout":
                outcome.notes.append(f"cell {i + 1} hit the {timeout:g} s time limit "
                                     "and was interrupted")
    finally:
        run.close()
    return outcome


def grade_notebook(student_nb, source_nb, sandbox: Sandbox, slot: int = 0,
                   timeout: float = 300, total_timeout: float = 3600) -> Outcome:
    """plan + run_plan: the graded cells of one submission."""
    cells, notes = plan(student_nb, source_nb)
    return run_plan(cells, notes, sandbox, slot, timeout, total_timeout)
