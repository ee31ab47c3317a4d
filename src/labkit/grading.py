"""Autograde a folder of submissions with nbgrader; every student gets a row, whatever they sent.

Input layouts (per student folder):  SUBMISSIONS/<student>/<NN-name>.ipynb
                               or    SUBMISSIONS/<student>/<NN-name>/<NN-name>.ipynb (nbgrader's)
Each (student, lab) is autograded in its own nbgrader process, so a submission that loops
forever (cell timeout) or kills its kernel costs only its own row, and a run that is
interrupted keeps every row already written to the gradebook.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook, MissingEntry

from .atomic import atomic_write_text
from .course import CELL_TIMEOUT_S, generate_assignments, lab_names, nbgrader
from .errors import InputError

STUDENT_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class GradeRow:
    student: str
    lab: str
    score: float
    max_score: float
    status: str        # "graded", "not submitted", or what went wrong, in words

    def as_list(self) -> list:
        return [self.student, self.lab, f"{self.score:g}", f"{self.max_score:g}", self.status]


def find_submissions(submissions: Path, labs: list[str]) -> tuple[dict, dict[str, list[str]]]:
    """{(student, lab): notebook path}, and per student the files that were not graded."""
    if not submissions.is_dir():
        raise InputError(f"submissions folder not found: {submissions}")
    found, ignored = {}, {}
    for student_dir in sorted(p for p in submissions.iterdir() if p.is_dir()):
        student = student_dir.name
        if not STUDENT_ID.match(student):
            raise InputError(f"student folder name {student!r} must use letters, digits, _ . -")
        for lab in labs:
            for candidate in (student_dir / f"{lab}.ipynb", student_dir / lab / f"{lab}.ipynb"):
                if candidate.is_file():
                    found[(student, lab)] = candidate
        for f in sorted(student_dir.rglob("*")):
            if f.is_file() and f not in found.values() and not f.name.startswith("."):
                ignored.setdefault(student, []).append(str(f.relative_to(student_dir)))
    return found, ignored


def _unreadable(path: Path) -> str | None:
    try:
        nbformat.read(path, as_version=4)
    except Exception as e:  # any parse failure means "not a notebook"
        return f"not a readable notebook ({type(e).__name__}: {str(e)[:120]})"
    return None


def _scores(course: Path, student: str, lab: str) -> tuple[float, float] | None:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        try:
            sub = gb.find_submission(lab, student)
        except MissingEntry:
            return None
        return sub.score, sub.max_score


def _max_score(course: Path, lab: str) -> float:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return gb.find_assignment(lab).max_score


def grade_one(course: Path, student: str, lab: str, notebook: Path, timeout: int,
              out: Path) -> GradeRow:
    """Autograde one submission and write its feedback; never raises for a bad submission."""
    max_score = _max_score(course, lab)
    if problem := _unreadable(notebook):
        return GradeRow(student, lab, 0, max_score, problem)
    target = course / "submitted" / student / lab
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shutil.copy(notebook, target / f"{lab}.ipynb")
    nbgrader(course, "db", "student", "add", student)
    try:
        proc = nbgrader(course, "autograde", lab, "--student", student, "--force",
                        f"--Execute.timeout={timeout}", check=False,
                        timeout=timeout * 40 + 300)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        log = "ERROR the autograder did not finish in time"
    scores = _scores(course, student, lab)
    graded = (course / "autograded" / student / lab).is_dir()
    if scores is None or ("ERROR" in log and not graded):
        reason = next((ln for ln in log.splitlines() if "ERROR" in ln), "autograde failed")
        return GradeRow(student, lab, 0, max_score, f"autograde failed: {reason.strip()[:200]}")
    status = "graded"
    if "Timeout" in log or "timed out" in log.lower():
        status = "graded; a cell hit the time limit"
    elif "DeadKernelError" in log or "Kernel died" in log:
        status = "graded; the kernel died"
    nbgrader(course, "generate_feedback", lab, "--student", student, "--force", check=False)
    html = course / "feedback" / student / lab / f"{lab}.html"
    if html.is_file():
        (out / "feedback" / student).mkdir(parents=True, exist_ok=True)
        shutil.copy(html, out / "feedback" / student / f"{lab}.html")
    return GradeRow(student, lab, scores[0], scores[1], status)


def summary_table(rows: list[GradeRow]) -> str:
    students = sorted({r.student for r in rows})
    labs = sorted({r.lab for r in rows})
    cell = {(r.student, r.lab): f"{r.score:g}/{r.max_score:g}" for r in rows}
    width = max([len(s) for s in students] + [7])
    lines = [f"{'student':<{width}}  " + "  ".join(f"{lab:>18}" for lab in labs)]
    for s in students:
        lines.append(f"{s:<{width}}  " + "  ".join(f"{cell.get((s, lab), '-'):>18}"
                                                 for lab in labs))
    return "\n".join(lines)


def grade(submissions: Path, root: Path, out: Path | None = None,
          timeout: int = CELL_TIMEOUT_S) -> list[GradeRow]:
    """Autograde every submission; write out/grades.csv and out/feedback/; return the rows."""
    root = root.resolve()
    out = (out or root / "build" / "grades").resolve()
    labs = lab_names(root)
    found, ignored = find_submissions(submissions.resolve(), labs)
    rows = []
    students = sorted({s for s, _ in found} | {p.name for p in submissions.iterdir()
                                                if p.is_dir()})
    graded_labs = sorted({lab for _, lab in found}) or labs
    course = generate_assignments(root, graded_labs)
    for student in students:
        for lab in graded_labs:
            if (student, lab) in found:
                row = grade_one(course, student, lab, found[(student, lab)], timeout, out)
            else:
                row = GradeRow(student, lab, 0, _max_score(course, lab), "not submitted")
            rows.append(row)
            print(f"{student:<20} {lab:<24} {row.score:g}/{row.max_score:g}  {row.status}")
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["student", "lab", "score", "max_score", "status"])
    writer.writerows(r.as_list() for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "grades.csv", buf.getvalue())
    print(summary_table(rows))
    for student, files in sorted(ignored.items()):
        print(f"{student}: not graded (not named <NN-name>.ipynb for a lab of {labs}): "
              + ", ".join(files))
    print(f"wrote {out / 'grades.csv'} and feedback in {out / 'feedback'}")
    return rows
