"""Autograde a folder of submissions; every student gets a row, whatever they sent.

    SUBMISSIONS/<student>/<NN-name>.ipynb          (also "NN-name (1).ipynb", "NN-name-Copy1",
    SUBMISSIONS/<student>/<NN-name>/<NN-name>.ipynb  ...: the newest is graded, the rest named)
    SUBMISSIONS/submitted/<student>/<NN-name>/...  (an nbgrader course after `nbgrader collect`)

Each submission is graded by course.grader.autograde in a kernel of its own inside a bubblewrap
sandbox (course.grader.sandbox), `jobs` at a time. The tests come from solutions/ (never from the
student's file or a database the student could reach). Each final row is journaled at once
(course.grader.journal), bound to the hashes of the submission, the lab's tests and the grader; a
re-run grades only what changed. Then `grades.csv` is merged with the rows of earlier runs,
the feedback pages are written, and the scores are recorded in nbgrader's gradebook.db. Each
row's `nearest` column names the source its code is closest to (course.grader.similarity): a
hint for a person, never a grade.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, replace
from hashlib import sha256
from pathlib import Path

import nbformat
from tqdm import tqdm

from labkit.atomic import atomic_write_text
from labkit.errors import InputError

from ..authoring.build import CELL_TIMEOUT_S, graded_test_cells, lab_names, source_notebook
from ..authoring.edition import grading_src
from . import cgroup, journal, similarity
from .autograde import grade_notebook
from .feedback import render
from .gradebook import record
from .grades_csv import GradeRow, read_csv, settle, summary_table, write_csv
from .printable import printable
from .sandbox import Sandbox

MAX_NOTEBOOK_BYTES = 50 << 20
COPY_SUFFIX = re.compile(r"^(?:\s*\(\d+\)|[-_ ]copy\d*|-Copy\d+|[-_ ].*)?$", re.IGNORECASE)


def student_root(submissions: Path) -> Path:
    """The folder whose subfolders are the students (see the module docstring)."""
    if not submissions.is_dir():
        raise InputError(f"SUBMISSIONS folder not found: {submissions}")
    nested = submissions / "submitted"
    return nested if nested.is_dir() else submissions


def lab_of(path: Path, labs: list[str]) -> str | None:
    """The lab a notebook file name is for: `NN-name.ipynb`, or a copy of it as browsers and
    Jupyter name them (`NN-name (1)`, `NN-name-Copy1`, `NN-name_final`)."""
    if path.suffix.lower() != ".ipynb":
        return None
    stem = path.stem.strip()
    for lab in sorted(labs, key=len, reverse=True):
        if stem.lower().startswith(lab.lower()) and COPY_SUFFIX.match(stem[len(lab):]):
            return lab
    return None


def _newest(paths: list[Path], lab: str) -> Path:
    """The newest file (then the exact name, then the last name) of several for one lab."""
    return max(paths, key=lambda p: (p.stat().st_mtime, p.stem == lab, str(p)))


def find_submissions(submissions: Path, labs: list[str]
                     ) -> tuple[list[str], dict[tuple[str, str], Path], dict[str, list[str]]]:
    """Students (their folders' names as `printable` shows them); {(student, lab):
    notebook}; per student, notes on files not graded."""
    students, found, notes = [], {}, {}
    root = student_root(submissions)
    keys: dict[str, str] = {}
    folders: dict[str, str] = {}
    for student_dir in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
        # The student is named as every output shows them: no escapes or control characters.
        student = printable(student_dir.name) or "?"
        if student_dir.is_symlink():    # could be another student's folder, or solutions/
            notes.setdefault(student, []).append("the student folder is a symbolic link: "
                                                 "not graded")
            continue
        if not student_dir.is_dir():
            continue
        if student in folders:
            raise InputError(f"student folders {folders[student]!r} and {student_dir.name!r} "
                             f"would share the row {student!r} in grades.csv (control "
                             "characters are left out of names): rename one")
        folders[student] = student_dir.name
        if (key := journal.student_key(student)) in keys:
            raise InputError(f"students {keys[key]!r} and {student!r} would share the "
                             f"feedback and journal folder {key!r}: rename one")
        keys[key] = student
        students.append(student)
        by_lab: dict[str, list[Path]] = {}
        for f in sorted(student_dir.rglob("*")):
            rel = f.relative_to(student_dir)
            if any(part.startswith(".") for part in rel.parts):
                continue
            if f.is_symlink():      # could point at solutions/ or another student's work
                notes.setdefault(student, []).append(f"{rel} (a symbolic link)")
                continue
            if not f.is_file():
                continue
            if lab := lab_of(f, labs):
                by_lab.setdefault(lab, []).append(f)
            elif f.name != "timestamp.txt":
                notes.setdefault(student, []).append(f"{rel} (not a lab notebook)")
        for lab, paths in by_lab.items():
            found[(student, lab)] = chosen = _newest(paths, lab)
            notes.setdefault(student, []).extend(
                f"{p.relative_to(student_dir)} (older copy; graded "
                f"{chosen.relative_to(student_dir)})" for p in paths if p != chosen)
            if not notes[student]:
                del notes[student]
    return students, found, notes


def tests_digest(source_nb) -> str:
    """sha256 of what in the source decides a grade: each test cell's id, points and source,
    and every other code cell but the solutions, with its tags (the trusted kernel runs some
    as the tests' setup; a jupyter-only one is left out of the learner's run)."""
    tests = [(c.metadata.nbgrader.grade_id, c.metadata.nbgrader.get("points"), c.source)
             for c in graded_test_cells(source_nb)]
    others = [(c.get("id"), c.metadata.get("tags", []), c.source) for c in source_nb.cells
              if c.cell_type == "code" and not c.metadata.get("nbgrader", {}).get("grade")
              and not c.metadata.get("nbgrader", {}).get("solution")]
    return sha256(repr((tests, others)).encode()).hexdigest()


def max_points(source_nb) -> float:
    return float(sum(c.metadata.nbgrader.get("points", 0) for c in graded_test_cells(source_nb)))


def _status(outcome) -> str:
    if outcome.timed_out:
        return "timed out: " + "; ".join([outcome.timed_out, *outcome.notes])
    return "; ".join(["graded", *outcome.notes])


def grade_one(student: str, lab: str, notebook: Path, source_nb, sandbox: Sandbox,
              slot: int, timeout: int, out: Path) -> GradeRow:
    """Grade one submission and write its feedback page; never raises for a bad submission.
    A submission that is no readable notebook writes no page: the one there, if any, is the
    recorded grade's, which such a row never replaces (`settle`)."""
    start, max_score = time.perf_counter(), max_points(source_nb)
    try:
        if notebook.stat().st_size > MAX_NOTEBOOK_BYTES:
            raise ValueError(f"{notebook.stat().st_size} bytes, over {MAX_NOTEBOOK_BYTES}")
        nb = nbformat.read(notebook, as_version=4)
        if not isinstance(nb.get("cells"), list):
            raise ValueError("no cells")
    except Exception as e:  # any failure to parse means "not a notebook"; nothing of the
        # file is echoed (a parser's message quotes its bytes)
        return GradeRow(student, lab, 0, max_score, f"not a readable notebook "
                        f"({type(e).__name__})", time.perf_counter() - start)
    outcome = grade_notebook(nb, source_nb, sandbox, slot, timeout,
                             total_timeout=timeout * 20 + 600, lab=lab)
    status = _status(outcome)
    tests = {c.test.grade_id: c.earned for c in outcome.cells if c.kind == "test"}
    atomic_write_text(journal.feedback_path(out, student, lab),
                      render(student, lab, outcome.score, max_score, status, outcome.cells))
    return GradeRow(student, lab, outcome.score, max_score, status,
                    time.perf_counter() - start, tests)


# A cell a spreadsheet would evaluate as a formula starts with one of these (OWASP's list).
class _Grader:
    """What every job shares: the course, the sources, the sandbox, the slots, and the rows
    grades.csv held when the run began (`recorded`, which no row of the run erases)."""

    def __init__(self, root: Path, out: Path, labs: list[str], sandbox: Sandbox, jobs: int,
                 timeout: int, force: bool = False):
        self.root, self.out, self.sandbox, self.timeout = root, out, sandbox, timeout
        # Each lab's learner kernels see the student edition it is graded in as <course>/src
        # (course.authoring.edition), built once per run here and removed with the grader.
        editions = Path(tempfile.mkdtemp(prefix="course-editions-"))
        weakref.finalize(self, shutil.rmtree, editions, ignore_errors=True)
        self.sandboxes = {lab: sandbox if sandbox.unsafe else replace(
            sandbox, src=grading_src(root, editions / lab, lab)) for lab in labs}
        self.force = force
        self.sources = {lab: source_notebook(root / "solutions" / f"{lab}.py") for lab in labs}
        self.recorded = {(r.student, r.lab): r for r in read_csv(out / "grades.csv")}
        self.slots: queue.Queue[int] = queue.Queue()
        for slot in range(jobs):
            self.slots.put(slot)

    def key(self, notebook: Path, lab: str) -> dict:
        return journal.grading_key(notebook, tests_digest(self.sources[lab]), self.timeout)

    def settle(self, row: GradeRow, why: str = "", key: dict | None = None
               ) -> tuple[GradeRow, str]:
        """`settle` against the recorded row; the row kept is journaled under `key` when it
        is this run's own (the journal says what grades.csv says)."""
        recorded = self.recorded.get((row.student, row.lab))
        kept, line = settle(row, recorded, why)
        if key is not None and kept is not recorded:
            journal.save(self.out, row.student, row.lab, key, asdict(kept))
        return kept, line

    def known(self, student: str, lab: str, notebook: Path | None
              ) -> tuple[GradeRow, str] | None:
        """The settled row of a (student, lab) that needs no grading (no notebook, one that
        cannot be read, or one unchanged since the journal's run); None: grade it."""
        top = max_points(self.sources[lab])
        if notebook is None:
            return self.settle(GradeRow(student, lab, 0, top, "not submitted"))
        try:
            key = self.key(notebook, lab)
        except OSError as e:        # gone, or unreadable, since it was found
            return self.settle(GradeRow(student, lab, 0, top,
                                        f"not a readable notebook ({type(e).__name__})"))
        saved = not self.force and journal.load(self.out, student, lab, key)
        if not saved:
            return None
        row = GradeRow(**saved)
        kept, line = self.settle(row, "unchanged since the journal's run; the recorded grade "
                                      "came from elsewhere")
        if kept.status != row.status and kept is not self.recorded.get((student, lab)):
            journal.save(self.out, student, lab, key, asdict(kept))   # lowered: noted there too
        return kept, line

    def grade(self, student: str, lab: str, notebook: Path) -> tuple[GradeRow, str]:
        """Grade in a free slot; the row settled and journaled (an internal error is not
        journaled: the next run retries it), and what the console is to say."""
        slot = self.slots.get()
        try:
            key = self.key(notebook, lab)
            why = (journal.changes(self.out, student, lab, key) or "graded again with the "
                   "same submission, tests, grader and time limit")
            row = grade_one(student, lab, notebook, self.sources[lab], self.sandboxes[lab],
                            slot, self.timeout, self.out)
        except Exception as e:  # our failure, not the student's: report it, retry next run
            return self.settle(GradeRow(student, lab, 0, max_points(self.sources[lab]),
                               f"grading error (will be retried): {type(e).__name__}: {e}"))
        finally:
            self.slots.put(slot)
        return self.settle(row, why, key)


def grade(submissions: Path, root: Path, out: Path | None = None,
          timeout: int = CELL_TIMEOUT_S, force: bool = False, course: Path | None = None,
          jobs: int | None = None, unsafe_no_sandbox: bool = False,
          gradebook_wait: float = 30.0) -> list[GradeRow]:
    """Autograde every submission; merge out/grades.csv, write out/feedback/; the rows."""
    root = root.resolve()
    out = (out or root / "build" / "grades").resolve()
    jobs = jobs or os.cpu_count() or 1
    labs = lab_names(root)
    students, found, notes = find_submissions(submissions.resolve(), labs)
    if not students:
        raise InputError(f"SUBMISSIONS {submissions} holds no student folders")
    why_not = "no sandbox" if unsafe_no_sandbox else cgroup.why_not()
    sandbox = Sandbox(root, unsafe=unsafe_no_sandbox, cgroups=not why_not)
    sandbox.check()
    print(cgroup.summary(sandbox.limits, why_not, os.geteuid() == 0 and not unsafe_no_sandbox))
    graded_labs = sorted({lab for _, lab in found}) or labs
    grader = _Grader(root, out, graded_labs, sandbox, jobs, timeout, force)
    rows, todo, said = [], [], []
    for student in students:
        for lab in graded_labs:
            if (known := grader.known(student, lab, found.get((student, lab)))) is None:
                todo.append((student, lab, found[(student, lab)]))
            else:
                rows.append(known[0])
                said += [known[1]] if known[1] else []
    print(f"{len(rows)} row(s) need no grading (not submitted, unreadable, or unchanged since "
          f"the journal's run); grading {len(todo)} submission(s), {jobs} at a time"
          + (" WITHOUT A SANDBOX" if unsafe_no_sandbox else " in bubblewrap sandboxes"))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool, \
            tqdm(total=len(todo), unit="submission", desc="grading") as bar:
        futures = [pool.submit(grader.grade, *job) for job in todo]
        for future in as_completed(futures):
            row, line = future.result()
            rows.append(row)
            said += [line] if line else []
            bar.update()
            bar.write(printable(line or f"{row.student:<20} {row.lab:<24} {row.score:g}/"
                                f"{row.max_score:g}  {row.status}  [{row.seconds:.1f} s]"))
    elapsed = time.perf_counter() - start
    rows.sort(key=lambda r: (r.student, r.lab))
    nearest, similar = similarity.nearest_sources(root, found, grader.sources)
    for row in rows:    # a row kept from grades.csv keeps what it says of its own submission
        if row is not grader.recorded.get((row.student, row.lab)):
            row.nearest = nearest.get((row.student, row.lab), "")
    record(course or root / "build" / "course", root, rows, gradebook_wait)
    # This run's rows, settled against the recorded ones already (_Grader.settle).
    write_csv(list({**grader.recorded, **{(r.student, r.lab): r for r in rows}}.values()),
              out / "grades.csv")
    print(summary_table(rows))
    print(similarity.summary(rows, similar))
    for line in said:
        print(printable(line))
    for student, lines in sorted(notes.items()):
        print(printable(f"{student}: not graded: " + "; ".join(lines)))
    if todo:
        print(f"graded {len(todo)} submission(s) in {elapsed:.1f} s with {jobs} job(s): "
              f"{60 * len(todo) / elapsed:.2f} submissions per minute")
    print(f"wrote {out / 'grades.csv'} and feedback in {out / 'feedback'}")
    return rows
