"""The grading journal: one result file per (student, lab), so an interrupted run resumes.

    OUT/journal/<student key>/<lab>.json = {"key": {...}, "row": {...}, "feedback": bool}

`key` names everything the grade depends on: the submitted file's sha256, the sha256 of the
lab's test cells in the instructor's source, the code (the grader's, the student edition's
stub lists and builder, and the packages whose references the trusted tests call), and
the cell time limit. A later run reuses an entry only when its key is the same (and its
feedback page is still there); anything else is graded again. Each file is written
atomically once its grade is final, so a run killed mid-way loses at most the submissions it
was grading. Student folder names may be anything a file system allows; `student_key` makes
a safe path of one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path

from labkit.atomic import atomic_write_text
from labkit.hashing import sha256_file

from ..notebook.harness import REFERENCE_PACKAGES

# The packages whose code a grade depends on: the course's (grader, edition, harness) and
# every package a lab's tests or stubs reach.
GRADED_PACKAGES = ("course", *REFERENCE_PACKAGES)


def student_key(student: str) -> str:
    """A safe folder name for `student`: an ASCII form of the name and a hash of the whole
    name, always, so that no folder name can take another student's key (`Jos_Garc_a-…`
    beside `José García` gets its own hash)."""
    ascii_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", student).strip("._")[:40] or "student"
    return f"{ascii_name}-{hashlib.sha256(student.encode()).hexdigest()[:16]}"


def entry_path(out: Path, student: str, lab: str) -> Path:
    return out / "journal" / student_key(student) / f"{lab}.json"


def feedback_path(out: Path, student: str, lab: str) -> Path:
    return out / "feedback" / student_key(student) / f"{lab}.html"


def grader_sha256() -> str:
    """The sha256 of every Python file of GRADED_PACKAGES, each with its path."""
    digest = hashlib.sha256()
    for package in GRADED_PACKAGES:
        folder = Path(importlib.util.find_spec(package).origin).parent
        for file in sorted(folder.rglob("*.py")):
            digest.update(f"{package}/{file.relative_to(folder).as_posix()}\0".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def grading_key(submission: Path, tests_sha256: str, timeout: int) -> dict:
    return {"submission_sha256": sha256_file(submission), "tests_sha256": tests_sha256,
            "grader_sha256": grader_sha256(), "timeout_s": timeout}


def load(out: Path, student: str, lab: str, key: dict) -> dict | None:
    """The journaled row (a dict of GradeRow fields) for this key, or None: grade it again."""
    path = entry_path(out, student, lab)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):    # absent, or not ours: grade again and overwrite it
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    row = entry.get("row")
    if not isinstance(row, dict) or row.get("student") != student or row.get("lab") != lab:
        return None
    if entry.get("feedback") and not feedback_path(out, student, lab).is_file():
        return None
    return row


# What a change of each part of the key means, for a grade lower than the recorded one.
CHANGES = {"submission_sha256": "the submission changed",
           "tests_sha256": "the lab's tests changed",
           "grader_sha256": "the grader or a reference changed",
           "timeout_s": "the time limit changed"}


def changes(out: Path, student: str, lab: str, key: dict) -> str:
    """What differs between the journaled key of (student, lab) and `key`, in words ("the
    submission changed, the lab's tests changed"; "" when nothing does), or that there is no
    entry. Read it before `save` replaces the entry."""
    try:
        old = json.loads(entry_path(out, student, lab).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        old = None
    if not isinstance(old, dict):
        return "no journal entry for the recorded grade"
    return ", ".join(words for part, words in CHANGES.items() if old.get(part) != key.get(part))


def save(out: Path, student: str, lab: str, key: dict, row: dict) -> None:
    entry = {"key": key, "row": row,
             "feedback": feedback_path(out, student, lab).is_file()}
    atomic_write_text(entry_path(out, student, lab), json.dumps(entry, indent=1) + "\n")
