"""The grading journal: one result file per (student, lab), so an interrupted run resumes.

    OUT/journal/<student>/<lab>.json = {"key": {...}, "row": {...}, "feedback": bool}

`key` names everything the grade depends on: the submitted file's sha256, the lab source's
sha256 (solutions/NN-name.py: its tests and points) and the cell time limit. A later run
reuses an entry whose key is unchanged (and whose feedback file, if it wrote one, is still
there) instead of grading again. Each file is written atomically once its grade is final,
so a run killed mid-way loses at most the submission it was grading.
"""

from __future__ import annotations

import json
from pathlib import Path

from .atomic import atomic_write_text
from .hashing import sha256_file


def entry_path(out: Path, student: str, lab: str) -> Path:
    return out / "journal" / student / f"{lab}.json"


def feedback_path(out: Path, student: str, lab: str) -> Path:
    return out / "feedback" / student / f"{lab}.html"


def grading_key(submission: Path, lab_source: Path, timeout: int) -> dict:
    return {"submission_sha256": sha256_file(submission),
            "lab_source_sha256": sha256_file(lab_source), "timeout_s": timeout}


def load(out: Path, student: str, lab: str, key: dict) -> dict | None:
    """The journaled row (a dict of GradeRow fields) for this key, or None: grade it again."""
    path = entry_path(out, student, lab)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):    # absent, or not ours: grade again and overwrite it
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    if entry.get("feedback") and not feedback_path(out, student, lab).is_file():
        return None
    return entry.get("row")


def save(out: Path, student: str, lab: str, key: dict, row: dict) -> None:
    entry = {"key": key, "row": row,
             "feedback": feedback_path(out, student, lab).is_file()}
    atomic_write_text(entry_path(out, student, lab), json.dumps(entry, indent=1) + "\n")
