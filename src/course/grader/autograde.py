"""Grade one notebook: the learner's cells run in their sandboxed kernel, the lab's tests in
a trusted kernel that never runs learner code and reaches it only as data (the bridge:
trusted_side.py, learner_side.py, wire.py).

    plan(student notebook, instructor notebook) -> cells to run (plan.py)
    run_plan(cells, sandbox):
        the learner's kernel (sandboxed; what the lab asks them to write is a stub there,
        stubs.py) and the trusted kernel (the grader's own Python, connected to it)
        for each cell, in order:
            student code -> the learner's kernel (time limit; a cell that swallows the
                            interrupt or kills the kernel: a fresh one, its cells replayed)
            test         -> the trusted kernel: the source's setup cells before it
                            (tests_setup.py), the learner's names bound, its visible chunks
                            (their output shown); when they pass, the namespace they leave
                            is kept for its hidden chunks
        then, after the learner's last cell, each test whose visible part passed:
            its kept namespace put back, its hidden chunks case by case (a failure names
            only the case); it earns its points when every chunk passed. No cell of the
            learner's runs after their code has seen a hidden input, and nothing their
            process prints from then on is shown.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import threading
import time
from dataclasses import dataclass

from .jupyter_kernel import MAX_SUBMISSION_BYTES, Kernel
from .plan import Cell, Test, plan
from .sandbox import Sandbox
from .tests_setup import cases, definitions, learner_names, meta, setup_cells
from .zygote import Zygote

MAX_RESTARTS = 3
# The hidden chunks run after the learner's last cell, when later tests have rebound names
# and changed objects: the trusted kernel keeps each test's namespace (a shallow copy, the
# RNG state, the bridge's copies of learner tensors to write back) when its visible part
# passed, and puts it back before its hidden part. Only dunder names, which no lab uses.
_TRUSTED_HELPERS = """
def __restore__(namespace, kept):
    import torch
    space, rng, copies = kept
    bridge = namespace["__bridge__"]
    now = {name: namespace[name] for name in ("__bridge__", "__kept__", "__restore__")}
    bridge.bind({}, [])             # the learner's side forgets the graphs kept for backward
    namespace.clear()
    namespace.update(space)
    namespace.update(now)
    torch.set_rng_state(rng)
    bridge.copies[:] = copies
__kept__ = {}
"""
_KEEP = ("__kept__[{gid!r}] = (dict(globals()), __import__('torch').get_rng_state(), "
         "list(__bridge__.copies))")
_ZYGOTES: dict[Sandbox, Zygote] = {}   # one per kind of trusted kernel, for the whole run
_ZYGOTES_LOCK = threading.Lock()


def _zygote(trusted: Sandbox) -> Zygote | None:
    """The grading run's zygote for trusted kernels; None for a learner's `make check` (one
    submission, on a machine whose GPU a fork after torch's import could cost) and where
    forking a process that imported torch is unsafe or impossible (macOS, Windows)."""
    if sys.platform != "linux" or trusted.own_env:
        return None
    with _ZYGOTES_LOCK:
        if trusted not in _ZYGOTES:
            _ZYGOTES[trusted] = Zygote(trusted)
            atexit.register(_ZYGOTES[trusted].close)
        return _ZYGOTES[trusted]


@dataclass
class Outcome:
    cells: list[Cell]
    notes: list[str]
    timed_out: str = ""            # why the whole submission was stopped, if it was

    @property
    def score(self) -> float:
        return sum(c.earned for c in self.cells)


class Run:
    """One submission's two kernels and the restarts; `hidden=False` runs visible tests only
    (the learner's self-check)."""

    def __init__(self, sandbox: Sandbox, source_nb, slot: int = 0, timeout: float = 300,
                 hidden: bool = True, lab: str = ""):
        self.sandbox, self.slot, self.timeout, self.hidden = sandbox, slot, timeout, hidden
        self.lab, self.names = lab, learner_names(source_nb)
        self.setup = [(i, source_nb.cells[i].source) for i in setup_cells(source_nb)]
        self.position = {meta(c)["grade_id"]: i for i, c in enumerate(source_nb.cells)
                         if meta(c).get("grade")}
        self.learner: Kernel | None = None
        self.trusted: Kernel | None = None
        self.budget = [MAX_SUBMISSION_BYTES]      # output characters left, across restarts
        self.uid = sandbox.uid(slot)              # one per submission (restarts keep it)
        self.setup_done = 0
        self.hidden_now = False                   # the trusted kernel's __bridge__.hidden
        self.generation = 0                       # the learner's kernels started so far
        self.kept: dict[str, int] = {}            # grade_id -> generation, of the tests
                                                  # whose namespace the trusted kernel keeps

    def start(self) -> None:
        """Fresh kernels: the learner's with the bridge's server and the lab's stubs, the
        trusted one with a client of it. Both start at once, and the trusted kernel imports
        its side while the learner's imports its own."""
        self.close()
        trusted = dataclasses.replace(self.sandbox, unsafe=True, cgroups=False)
        self.trusted = Kernel(trusted, self.slot, self.budget, wait=False,
                              zygote=_zygote(trusted))
        self.start_learner(before_import=self._preload)
        self.setup_done, self.hidden_now, self.kept = 0, False, {}

    def _preload(self) -> None:
        self.trusted.wait_until_ready()
        self.trusted.send("import course.grader.trusted_side\n" + _TRUSTED_HELPERS)

    def start_learner(self, before_import=None) -> None:
        """A fresh learner's kernel, and the trusted kernel's bridge to it (what the trusted
        kernel defined stays; proxies into the old kernel fail as a dead kernel's)."""
        if self.learner is not None:
            self.learner.close()
        self.learner = Kernel(self.sandbox, self.slot, self.budget, self.uid)
        self.generation += 1
        if before_import is not None:
            before_import()
        start = (f"import course.grader.learner_side\nimport course.grader.stubs\n"
                 f"course.grader.stubs.install({self.lab!r})\n")
        reply = self.learner.run(start, timeout=120, silent=True)
        if not reply.ok:
            raise RuntimeError(f"the learner's kernel did not start the bridge: {reply.error}")
        connect = (f"from course.grader.trusted_side import Bridge\n"
                   f"__bridge__ = Bridge({self.learner.connection()!r}, timeout={self.timeout})"
                   "\ndel Bridge\n")
        reply = self.trusted.run(connect, timeout=120, silent=True)
        if not reply.ok:
            raise RuntimeError(f"the trusted kernel did not connect: {reply.error}")
        self.hidden_now = False                   # a new Bridge shows the learner's printing

    def alive(self) -> bool:
        return self.learner.alive() and self.trusted.alive()

    # bind and quiet are sent without waiting for their replies (nothing is read of them):
    # the trusted kernel runs its requests in order, so the next `run` waits behind them.
    def bind(self) -> None:
        self.trusted.send(f"__bridge__.bind(globals(), {self.names!r})")

    def pause(self) -> None:
        """Free the learner's kernel for a cell of theirs (the bridge's serving loop ends),
        the learner's printing shown again."""
        self.trusted.run("__bridge__.hidden = False\n__bridge__.pause()", 30, silent=True)
        self.hidden_now = False

    def quiet(self, hidden: bool) -> None:
        """Drop (hidden tests) or show the learner's printing during the bridge's calls."""
        if hidden != self.hidden_now:
            self.trusted.send(f"__bridge__.hidden = {hidden}")
            self.hidden_now = hidden

    def prepare(self, test: Test) -> None:
        """Run the source's setup cells that come before `test` and have not run yet."""
        upto = self.position[test.grade_id]
        while self.setup_done < len(self.setup) and self.setup[self.setup_done][0] < upto:
            self.bind()
            self.trusted.run(self.setup[self.setup_done][1], self.timeout, silent=True)
            self.setup_done += 1
        self.bind()

    def keep(self, test: Test) -> None:
        """Keep the namespace `test`'s visible part left, for its hidden part."""
        self.trusted.send(_KEEP.format(gid=test.grade_id))
        self.kept[test.grade_id] = self.generation

    def close(self) -> None:
        for kernel in (self.learner, self.trusted):
            if kernel is not None:
                kernel.close()
        self.learner = self.trusted = None


def _run_test(run: Run, cell: Cell, replay: bool = False) -> None:
    """Run a test cell's visible chunks in the trusted kernel. When they pass, the test earns
    its points, or, with hidden chunks to run after the learner's last cell, its namespace is
    kept for them (`_run_hidden`)."""
    try:
        _run_visible(run, cell, replay)
    finally:
        run.pause()


def _run_visible(run: Run, cell: Cell, replay: bool) -> None:
    run.prepare(cell.test)
    run.quiet(replay)
    for hidden, code in cell.test.chunks:
        if hidden:
            continue
        reply = run.trusted.run(code, run.timeout, history=not replay)
        if not replay:
            cell.outputs += reply.outputs
        cell.status, cell.error = reply.status, reply.error
        if not reply.ok:
            if run.trusted.alive():         # the helpers below the failure, for later tests
                code = definitions("\n".join(c for _, c in cell.test.chunks))
                run.trusted.run(code, run.timeout, silent=True, history=False)
            return
    if run.hidden and cell.test.has_hidden:
        run.keep(cell.test)
    elif not replay:
        cell.earned = cell.test.points


def _run_hidden(run: Run, cell: Cell) -> None:
    """A test's hidden chunks, case by case, in the namespace its visible part left, the
    learner's printing dropped; the test earns its points when all pass. If the learner's
    kernel was restarted since, the objects the visible part made there are gone: the
    learner's names are bound afresh and the visible part runs again, quietly, first."""
    test = cell.test
    run.quiet(True)
    failed, reply = "hidden tests", run.trusted.run(
        f"__restore__(globals(), __kept__.pop({test.grade_id!r}))", run.timeout, silent=True,
        history=False)
    parts = [case for hidden, code in test.chunks if hidden for case in cases(code)]
    if run.kept.pop(test.grade_id) != run.generation:
        run.bind()
        parts = [("hidden tests", code) for hidden, code in test.chunks if not hidden] + parts
    for label, part in parts if reply.ok else []:
        reply = run.trusted.run(part, run.timeout, history=False)
        if not reply.ok:
            failed = label
            break
    cell.status, cell.error = reply.status, reply.error
    if reply.ok:
        cell.earned = test.points
    else:
        cell.hidden_failed, cell.hidden_case = True, failed


def _restart(run: Run, cells: list[Cell], upto: int) -> None:
    """A fresh learner's kernel with every code cell before `upto` that ran re-run, quietly,
    in order. The trusted kernel keeps what the tests defined (a test cell that died half
    way still defined its helpers); if it died too, it starts afresh and the tests that ran
    are replayed as well."""
    fresh = not run.trusted.alive()
    if fresh:
        run.start()
    else:
        run.start_learner()
    for cell in cells[:upto]:
        if cell.status not in ("ok", "error"):
            continue
        if cell.kind == "code":
            if run.learner.run(cell.source, run.timeout, history=False).status not in (
                    "ok", "error"):
                raise RuntimeError("a cell that ran before failed to run again after a restart")
        elif cell.kind == "test" and fresh:
            _run_test(run, Cell("test", cell.source, cell.test), replay=True)


def cell_name(i: int, cell: Cell, quote: bool = False) -> str:
    """How a note names a cell: its number (from 1, text cells counted), and the exercise or
    test it is; with `quote`, an ordinary cell by how its code starts, too (for `make check`
    only: a grading status echoes nothing of a submission)."""
    if cell.kind == "test":
        return f"cell {i + 1} (test {cell.test.grade_id})"
    if cell.exercise:
        return f"cell {i + 1} (exercise {cell.exercise})"
    first = next((line.strip() for line in cell.source.splitlines()
                  if line.strip() and not line.lstrip().startswith("#")), "") if quote else ""
    return f"cell {i + 1}" + (f" ({first[:40]}{'…' if len(first) > 40 else ''})" if first
                              else "")


def run_plan(cells: list[Cell], notes: list[str], sandbox: Sandbox, source_nb, slot: int = 0,
             timeout: float = 300, total_timeout: float = 3600, hidden: bool = True,
             lab: str = "") -> Outcome:
    """Execute the planned cells, then the hidden tests (see the module docstring); never
    raises for bad code. A test whose hidden part never ran (the total time ran out) earns
    nothing: its visible part alone could be answered from memory."""
    outcome = Outcome(cells, list(notes))
    run = Run(sandbox, source_nb, slot, timeout, hidden, lab)
    deadline = time.monotonic() + total_timeout
    try:
        run.start()
        _run_cells(run, outcome, deadline, total_timeout)
        if not outcome.timed_out:
            _run_hidden_tests(run, outcome, deadline, total_timeout)
    finally:
        run.close()
    for cell in cells:
        if cell.kind == "test" and cell.status == "ok" and cell.test.grade_id in run.kept:
            cell.status, cell.error = "not run", "its hidden tests did not run"
    return outcome


def _over_time(total_timeout: float, what: str) -> str:
    return f"the submission ran longer than {total_timeout:g} s in all; {what} did not run"


def _run_cells(run: Run, outcome: Outcome, deadline: float, total_timeout: float) -> None:
    """Every cell in order: the learner's in their kernel, the tests' visible parts."""
    cells, restarts, crashed = outcome.cells, 0, set()
    for i, cell in enumerate(cells):
        if cell.kind == "markdown" or cell.status == "jupyter-only":
            continue
        if time.monotonic() > deadline:
            outcome.timed_out = _over_time(total_timeout, "the tests after that point, and "
                                           "the hidden tests (after your last cell),")
            return
        if cell.kind == "code" and restarts > MAX_RESTARTS and (
                not cell.exercise or cell.exercise in crashed):
            continue                # after the cap: the tests and exercises that never crashed
        if cell.kind == "test":
            _run_test(run, cell)
            if not run.learner.alive():
                cell.status = "dead"
                cell.error = (f"your code crashed while this test ran it: "
                              f"{run.learner.cause_of_death()}")
        else:
            reply = run.learner.run(cell.source, run.timeout)
            cell.outputs, cell.status, cell.error = reply.outputs, reply.status, reply.error
            if cell.status == "dead":
                cell.error = run.learner.cause_of_death()
        if cell.status in ("killed", "dead") or not run.alive():
            # A crash costs only that cell: a test's or an exercise's first crash is
            # free (the source has few), other cells of the learner get MAX_RESTARTS.
            if cell.kind == "code" and cell.exercise and cell.exercise not in crashed:
                crashed.add(cell.exercise)
            else:
                restarts += cell.kind == "code"
            what = (f"{cell_name(i, cell)} "
                    + ("swallowed the time-limit interrupt" if cell.status == "killed"
                       else f"ended the kernel: {cell.error or 'the kernel died'}"))
            if restarts > MAX_RESTARTS:
                outcome.notes.append(f"{what}; {MAX_RESTARTS} restarts used up: your other "
                                     "cells after it did not run; the exercises and tests did")
            else:
                outcome.notes.append(f"{what}; the kernel was restarted and grading went on "
                                     "without it")
            _restart(run, cells, i)
        elif cell.status == "timeout":
            outcome.notes.append(f"{cell_name(i, cell)} hit the {run.timeout:g} s time limit "
                                 "and was interrupted")


def _run_hidden_tests(run: Run, outcome: Outcome, deadline: float,
                      total_timeout: float) -> None:
    """The hidden part of every test whose visible part passed, after the learner's last
    cell. A note on a crash here names the test, never the cause: an exit status the
    learner's code chose could carry a hidden input."""
    for i, cell in enumerate(outcome.cells):
        if cell.kind != "test" or cell.status != "ok" or cell.test.grade_id not in run.kept:
            continue
        if time.monotonic() > deadline:
            outcome.timed_out = _over_time(total_timeout, "the hidden tests after that point")
            return
        _run_hidden(run, cell)
        if cell.status in ("killed", "dead") or not run.alive():
            cell.status, cell.error = "dead", "the kernel ended during the hidden tests"
            outcome.notes.append(f"{cell_name(i, cell)} ended the kernel in its hidden tests; "
                                 "the kernel was restarted and grading went on without it")
            _restart(run, outcome.cells, len(outcome.cells))
        elif cell.status == "timeout":
            outcome.notes.append(f"{cell_name(i, cell)} hit the {run.timeout:g} s time limit "
                                 "in its hidden tests")


def grade_notebook(student_nb, source_nb, sandbox: Sandbox, slot: int = 0,
                   timeout: float = 300, total_timeout: float = 3600, hidden: bool = True,
                   lab: str = "") -> Outcome:
    """plan + run_plan: the graded cells of one submission."""
    cells, notes = plan(student_nb, source_nb)
    return run_plan(cells, notes, sandbox, source_nb, slot, timeout, total_timeout, hidden,
                    lab)
