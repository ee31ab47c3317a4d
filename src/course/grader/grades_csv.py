"""grades.csv: one row per (student, lab), written so no spreadsheet evaluates a cell and no
terminal obeys one (`neutralise`), and settled against the row it would replace so that no
run erases a grade (`settle`, `merge_into`)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field, replace
from pathlib import Path

from labkit.atomic import atomic_write_text

from .printable import printable


@dataclass
class GradeRow:
    student: str
    lab: str
    score: float
    max_score: float
    status: str        # "graded[; notes]", "timed out: ...", "not submitted", ...
    seconds: float = 0.0                         # wall time grading it (not in grades.csv)
    tests: dict = field(default_factory=dict)    # {grade_id: points earned}, for gradebook.db
    # The submission's nearest source and its score, for a person to read, never a grade:
    # "reference 0.93", "student alice 0.71", "" (similarity.py; set after grading)
    nearest: str = ""

    def as_list(self) -> list:
        return [self.student, self.lab, f"{self.score:g}", f"{self.max_score:g}", self.status,
                self.nearest]


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def neutralise(cell: str) -> str:
    """A text cell no spreadsheet evaluates and no terminal obeys: `printable`, then a
    leading ' before a formula character (after any spaces)."""
    cell = printable(cell)
    return "'" + cell if cell.lstrip().startswith(FORMULA_START) else cell


def _restore(cell: str) -> str:
    quoted = cell.startswith("'") and cell[1:].lstrip().startswith(FORMULA_START)
    return cell[1:] if quoted else cell


def read_csv(path: Path) -> list[GradeRow]:
    """The rows of an earlier grades.csv (none if there is none; one written before the
    `nearest` column gives "" there)."""
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return [GradeRow(_restore(r["student"]), _restore(r["lab"]), float(r["score"]),
                         float(r["max_score"]), _restore(r["status"]),
                         nearest=_restore(r.get("nearest") or ""))
                for r in csv.DictReader(f)]


def write_csv(rows: list[GradeRow], path: Path) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["student", "lab", "score", "max_score", "status", "nearest"])
    writer.writerows([neutralise(r.student), neutralise(r.lab), score, top, neutralise(status),
                      neutralise(nearest)]
                     for r in sorted(rows, key=lambda r: (r.student, r.lab))
                     for _, _, score, top, status, nearest in [r.as_list()])
    atomic_write_text(path, buf.getvalue())


LOWER = "; lower than the recorded "


def is_grade(row: GradeRow) -> bool:
    """A score read from a notebook of the lab ("graded", "timed out"), as opposed to "not
    submitted", "not a readable notebook" or "grading error"."""
    return row.status.startswith(("graded", "timed out"))


def settle(row: GradeRow, recorded: GradeRow | None, why: str) -> tuple[GradeRow, str]:
    """The row to keep for row's (student, lab) where grades.csv holds `recorded`, and what
    the console is to say ("" for nothing). No row erases a grade: "not submitted" never
    replaces a recorded row, an unreadable file or a grading error only a recorded row that
    is no grade either (said); a lower grade replaces a grade with the recorded score and
    `why` in its status ("graded; lower than the recorded 11 / 11 (the submission
    changed)", said), and a row that is the recorded one less that note keeps it."""
    if recorded is None:
        return row, ""
    if not is_grade(row):
        if row.status == "not submitted":
            return recorded, ""
        if not is_grade(recorded):
            return row, ""
        return recorded, (f"{row.student} {row.lab}: {row.status}; kept the recorded "
                          f"{recorded.score:g} / {recorded.max_score:g}")
    same = (row.score, row.max_score) == (recorded.score, recorded.max_score)
    if same and recorded.status.startswith(row.status + LOWER):
        return recorded, ""
    if not is_grade(recorded) or row.score * recorded.max_score >= recorded.score * row.max_score:
        return row, ""
    was = f"{recorded.score:g} / {recorded.max_score:g} ({why})"
    return (replace(row, status=row.status + LOWER + was),
            f"{row.student} {row.lab}: {row.score:g} / {row.max_score:g}{LOWER}{was}")


def merge_into(path: Path, rows: list[GradeRow], why: str = "merged") -> list[GradeRow]:
    """Write `path` as its own rows updated with `rows`, in order, each settled against the
    row it would replace (`settle`, `why` naming where it comes from; what it says is
    printed); the merged rows. Shards of a class merge the same way."""
    merged = {(r.student, r.lab): r for r in read_csv(path)}
    for row in rows:
        merged[(row.student, row.lab)], line = settle(row, merged.get((row.student, row.lab)),
                                                      why)
        if line:
            print(printable(line))
    write_csv(list(merged.values()), path)
    return sorted(merged.values(), key=lambda r: (r.student, r.lab))


def summary_table(rows: list[GradeRow]) -> str:
    """Students × labs, each cell "score / max"; then every row whose status is not plain;
    each line `printable`."""
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
    return "\n".join(printable(line) for line in lines)
