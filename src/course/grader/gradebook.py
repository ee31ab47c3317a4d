"""Record the grader's scores in nbgrader's gradebook.db (for the formgrader and `nbgrader
export`). Only the grader writes it, from outside every sandbox, after grading.

A locked or busy database is retried for `wait` seconds; what still cannot be recorded is
said in the row's status, and grading never stops for it: grades.csv is the record.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from ..authoring.build import generate_assignments


def _retry(action, wait: float):
    """Run `action` until it succeeds or `wait` seconds pass; the last exception, if any."""
    deadline, delay = time.monotonic() + wait, 0.5
    while True:
        try:
            action()
            return None
        except Exception as e:  # sqlite's "database is locked", nbgrader's RuntimeError
            if time.monotonic() + delay > deadline:
                return e
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _write(course: Path, row) -> None:
    from nbgrader.api import Gradebook, MissingEntry

    with warnings.catch_warnings(), Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        warnings.simplefilter("ignore")    # SQLAlchemy's autoflush notes on remove + add
        gb.update_or_create_student(row.student)
        try:
            gb.remove_submission(row.lab, row.student)
        except MissingEntry:
            pass
        gb.add_submission(row.lab, row.student)
        for grade_id, earned in row.tests.items():
            gb.find_grade(grade_id, row.lab, row.lab, row.student).auto_score = earned
        gb.db.commit()


def record(course: Path, root: Path, rows: list, wait: float) -> None:
    """Write each graded row's test scores to course/gradebook.db; a failure goes into the
    row's status ("; not in gradebook.db: ...")."""
    graded = [r for r in rows if r.tests]
    if not graded:
        return
    labs = sorted({r.lab for r in graded})
    if error := _retry(lambda: generate_assignments(root, labs, course), wait):
        failed = {r.lab: error for r in graded}
    else:
        failed = {}
    for row in graded:
        error = failed.get(row.lab) or _retry(lambda row=row: _write(course, row), wait)
        if error:
            wait = 0.0          # waited once already: the rest try once each
            reason = str(error).strip().splitlines()[-1][:160] if str(error).strip() else ""
            row.status += f"; not in gradebook.db: {type(error).__name__} {reason}"
