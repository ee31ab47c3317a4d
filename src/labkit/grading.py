"""Autograde a folder of submissions with nbgrader; every student gets a row, whatever they sent.

Input layouts, detected per file:   SUBMISSIONS/<student>/<NN-name>.ipynb
                               or   SUBMISSIONS/<student>/<NN-name>/<NN-name>.ipynb
and when SUBMISSIONS holds a `submitted/` folder (an nbgrader course after `nbgrader
collect`), the students are read from SUBMISSIONS/submitted/ instead.
Each (student, lab) is autograded in its own nbgrader process, so a submission that loops
forever (cell timeout) or kills its kernel costs only its own row. Each final row is
journaled (labkit.journal) before the next submission starts: an interrupted run resumes
where it stopped, and an unchanged submission is not graded twice unless `force`.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook, MissingEntry

from . import journal
from .atomic import atomic_write_text
from .course import CELL_TIMEOUT_S, generate_assignments, lab_names, nbgrader
from .errors import InputError

STUDENT_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
# What nbgrader's autograde log says, and the status note it becomes.
LOG_NOTES = [
    (re.compile(r"Timeout waiting for execute reply|CellTimeoutError|timed out", re.I),
     "a cell hit the time limit"),
    (re.compile(r"DeadKernelError|Kernel died", re.I),
     "the kernel died (a cell ended the Python process: os._exit, crash, out of memory)"),
]


@dataclass
class GradeRow:
    student: str
    lab: str
    score: float
    max_score: float
    status: str        # "graded", "not submitted", or what went wrong, in words
    seconds: float = 0.0   # wall time spent grading it (not in grades.csv)

    def as_list(self) -> list:
        return [self.student, self.lab, f"{self.score:g}", f"{self.max_score:g}", self.status]


def student_root(submissions: Path) -> Path:
    """The folder whose subfolders are the students (see the module docstring)."""
    if not submissions.is_dir():
        raise InputError(f"SUBMISSIONS folder not found: {submissions}")
    nested = submissions / "submitted"
    return nested if nested.is_dir() else submissions


def find_submissions(submissions: Path, labs: list[str]
                     ) -> tuple[list[str], dict[tuple[str, str], Path], dict[str, list[str]]]:
    """Students; {(student, lab): notebook path}; per student the files that were not graded."""
    students, found, ignored = [], {}, {}
    root = student_root(submissions)
    for student_dir in sorted(p for p in root.iterdir()
                              if p.is_dir() and not p.name.startswith(".")):
        student = student_dir.name
        if not STUDENT_ID.match(student):
            raise InputError(f"SUBMISSIONS: student folder name {student!r} must use "
                             "letters, digits, _ . -")
        students.append(student)
        for lab in labs:
            for candidate in (student_dir / f"{lab}.ipynb", student_dir / lab / f"{lab}.ipynb"):
                if candidate.is_file():
                    found[(student, lab)] = candidate
        for f in sorted(student_dir.rglob("*")):
            rel = f.relative_to(student_dir)
            if (f.is_file() and f not in found.values() and f.name != "timestamp.txt"
                    and not any(part.startswith(".") for part in rel.parts)):
                ignored.setdefault(student, []).append(str(rel))
    return students, found, ignored


def test_cells(nb: nbformat.NotebookNode) -> dict[str, nbformat.NotebookNode]:
    """{grade_id: cell} of the autograded test cells (the last copy of a repeated id)."""
    return {c.metadata.nbgrader.grade_id: c for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("grade") and "grade_id" in c.metadata.nbgrader
            and not c.metadata.nbgrader.get("solution")}


def tampered_tests(nb: nbformat.NotebookNode, release: nbformat.NotebookNode) -> list[str]:
    """Status notes on test cells the student edited or deleted (nbgrader restores them)."""
    theirs, ours = test_cells(nb), test_cells(release)
    edited = [g for g, cell in ours.items() if g in theirs
              and (theirs[g].source.strip() != cell.source.strip()
                   or theirs[g].metadata.nbgrader.get("points") != cell.metadata.nbgrader.points)]
    deleted = [g for g in ours if g not in theirs]
    return (["test cells restored from the gradebook: "
             + ", ".join([f"{g} (edited)" for g in edited] + [f"{g} (deleted)" for g in deleted])]
            if edited or deleted else [])


def drop_duplicate_ids(nb: nbformat.NotebookNode) -> list[str]:
    """Un-mark every copy of a repeated grade_id but the last, in place; the repeated ids.

    nbgrader 0.9.6 means to do the same (DeduplicateIds) but then fails on the un-marked
    cells when it restores missing cells, so the submission is cleaned before it sees it.
    """
    seen, dups = set(), set()
    for cell in reversed(nb.cells):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in seen:
            dups.add(grade_id)
            del cell.metadata["nbgrader"]
        elif grade_id:
            seen.add(grade_id)
    return sorted(dups)


def log_notes(log: str) -> list[str]:
    """Status notes from nbgrader's autograde log: time limits, dead kernels."""
    return [note for pattern, note in LOG_NOTES if pattern.search(log)]


def _gradebook(course: Path) -> Gradebook:
    return Gradebook(f"sqlite:///{course / 'gradebook.db'}")


def _scores(course: Path, student: str, lab: str) -> tuple[float, float] | None:
    with _gradebook(course) as gb:
        try:
            sub = gb.find_submission(lab, student)
        except MissingEntry:
            return None
        return sub.score, sub.max_score


def _max_score(course: Path, lab: str) -> float:
    with _gradebook(course) as gb:
        return gb.find_assignment(lab).max_score


def _stage(course: Path, student: str, lab: str, notebook: Path,
           cleaned: nbformat.NotebookNode | None) -> None:
    """Put the submission (or its `cleaned` copy) where nbgrader reads it:
    course/submitted/<student>/<lab>/, and the student in the gradebook."""
    target = course / "submitted" / student / lab / f"{lab}.ipynb"
    if notebook.resolve() != target.resolve():    # else grading the course's own submitted/
        shutil.rmtree(target.parent, ignore_errors=True)
        target.parent.mkdir(parents=True)
        shutil.copy(notebook, target)
        stamp = notebook.parent / "timestamp.txt"      # nbgrader's, for late penalties
        if stamp.is_file() and notebook.parent.name == lab:
            shutil.copy(stamp, target.parent / "timestamp.txt")
    if cleaned is not None:
        nbformat.write(cleaned, target)
    with _gradebook(course) as gb:
        gb.update_or_create_student(student)


def _autograde(course: Path, student: str, lab: str, timeout: int) -> str:
    """nbgrader autograde of one submission; its log."""
    try:
        proc = nbgrader(course, "autograde", lab, "--student", student, "--force",
                        f"--Execute.timeout={timeout}", check=False,
                        timeout=timeout * 40 + 300)
        return proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        return "ERROR the autograder did not finish in time"


def _feedback(course: Path, student: str, lab: str, out: Path) -> None:
    nbgrader(course, "generate_feedback", lab, "--student", student, "--force", check=False)
    html = course / "feedback" / student / lab / f"{lab}.html"
    if html.is_file():
        dest = journal.feedback_path(out, student, lab)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(html, dest)


def grade_one(course: Path, student: str, lab: str, notebook: Path, timeout: int,
              out: Path) -> GradeRow:
    """Autograde one submission and write its feedback; never raises for a bad submission."""
    start = time.perf_counter()
    max_score = _max_score(course, lab)
    journal.feedback_path(out, student, lab).unlink(missing_ok=True)
    try:
        nb = nbformat.read(notebook, as_version=4)
    except Exception as e:  # any parse failure means "not a notebook"
        return GradeRow(student, lab, 0, max_score, f"not a readable notebook "
                        f"({type(e).__name__}: {str(e)[:120]})", time.perf_counter() - start)
    notes = tampered_tests(nb, nbformat.read(course / "release" / lab / f"{lab}.ipynb",
                                             as_version=4))
    if dups := drop_duplicate_ids(nb):
        notes.append(f"duplicate grade_id {', '.join(dups)}: only the last copy was graded")
    _stage(course, student, lab, notebook, nb if dups else None)
    log = _autograde(course, student, lab, timeout)
    notes = log_notes(log) + notes
    scores = _scores(course, student, lab)
    if scores is None or not (course / "autograded" / student / lab).is_dir():
        reason = "; ".join(notes) or next(
            (ln.strip()[:200] for ln in log.splitlines() if "ERROR" in ln), "no reason given")
        return GradeRow(student, lab, 0, max_score, f"not graded, score 0: {reason}",
                        time.perf_counter() - start)
    _feedback(course, student, lab, out)
    return GradeRow(student, lab, scores[0], scores[1], "; ".join(["graded", *notes]),
                    time.perf_counter() - start)


def summary_table(rows: list[GradeRow]) -> str:
    """Students × labs, each cell "score / max"; then every row whose status is not plain."""
    students = sorted({r.student for r in rows})
    labs = sorted({r.lab for r in rows})
    cell = {(r.student, r.lab): f"{r.score:g} / {r.max_score:g}" for r in rows}
    width = max([len(s) for s in students] + [7])
    col = max(len(lab) for lab in labs)
    lines = [f"{'student':<{width}}  " + "  ".join(f"{lab:>{col}}" for lab in labs)]
    for s in students:
        lines.append(f"{s:<{width}}  " + "  ".join(f"{cell.get((s, lab), '-'):>{col}}"
                                                 for lab in labs))
    problems = [r for r in rows if r.status != "graded"]
    if problems:
        lines.append("problems:")
        lines += [f"  {r.student} {r.lab}: {r.status}" for r in problems]
    return "\n".join(lines)


def _grade_or_resume(course: Path, root: Path, student: str, lab: str, notebook: Path,
                     timeout: int, out: Path, force: bool) -> tuple[GradeRow, bool]:
    """(row, whether it came from the journal); a new final row is journaled at once."""
    key = journal.grading_key(notebook, root / "solutions" / f"{lab}.py", timeout)
    if not force and (saved := journal.load(out, student, lab, key)) is not None:
        return GradeRow(**saved), True
    try:
        row = grade_one(course, student, lab, notebook, timeout, out)
    except Exception as e:  # our failure, not the student's: report it, retry next run
        return GradeRow(student, lab, 0, _max_score(course, lab),
                        f"grading error (will be retried): {type(e).__name__}: {e}"), False
    journal.save(out, student, lab, key, asdict(row))
    return row, False


def write_csv(rows: list[GradeRow], path: Path) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["student", "lab", "score", "max_score", "status"])
    writer.writerows(r.as_list() for r in rows)
    atomic_write_text(path, buf.getvalue())


def grade(submissions: Path, root: Path, out: Path | None = None,
          timeout: int = CELL_TIMEOUT_S, force: bool = False,
          course: Path | None = None) -> list[GradeRow]:
    """Autograde every submission; write out/grades.csv and out/feedback/; return the rows.

    `course` is the nbgrader course directory to grade in (default build/course).
    """
    root = root.resolve()
    out = (out or root / "build" / "grades").resolve()
    labs = lab_names(root)
    students, found, ignored = find_submissions(submissions.resolve(), labs)
    if not students:
        raise InputError(f"SUBMISSIONS {submissions} holds no student folders")
    graded_labs = sorted({lab for _, lab in found}) or labs
    course = generate_assignments(root, graded_labs, course and course.resolve())
    rows = []
    for student in students:
        for lab in graded_labs:
            if (student, lab) in found:
                row, resumed = _grade_or_resume(course, root, student, lab,
                                                found[(student, lab)], timeout, out, force)
            else:
                row, resumed = GradeRow(student, lab, 0, _max_score(course, lab),
                                        "not submitted"), False
            rows.append(row)
            how = "unchanged, kept from the journal" if resumed else f"{row.seconds:.1f} s"
            print(f"{student:<20} {lab:<24} {row.score:g}/{row.max_score:g}  {row.status}"
                  f"  [{how}]", flush=True)
    write_csv(rows, out / "grades.csv")
    print(summary_table(rows))
    for student, files in sorted(ignored.items()):
        print(f"{student}: not graded (not named <NN-name>.ipynb for a lab of {labs}): "
              + ", ".join(files))
    print(f"wrote {out / 'grades.csv'} and feedback in {out / 'feedback'}")
    return rows
