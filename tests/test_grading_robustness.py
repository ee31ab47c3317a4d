"""`labkit grade` on lab 00 with one student per kind of submission, good and bad.

One grading run (module fixture, about 3 minutes on 2 cores) gives every case its row; the
expected scores come from the nbgrader metadata of the test cells that should pass, never
from hardcoded numbers. Then the resume path: a second run grades nothing, and an
interrupted run keeps the rows it had finished.
"""

from __future__ import annotations

import copy
import csv
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import grading
from labkit.course import source_notebook

ROOT = Path(__file__).resolve().parents[1]
LAB = "00-setup-minigpt"
TIMEOUT_S = 20      # lab 00's slowest cell takes about a second
pytestmark = pytest.mark.notebooks


def meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def owners(nb) -> dict[str, str]:
    """{test grade_id: grade_id of the solution cell above it}: what each test checks."""
    result, current = {}, None
    for cell in nb.cells:
        if meta(cell).get("solution"):
            current = meta(cell)["grade_id"]
        elif meta(cell).get("grade"):
            result[meta(cell)["grade_id"]] = current
    return result


def points_of(nb, solved: set[str]) -> float:
    """Points of the test cells that check the `solved` solution cells."""
    owner = owners(nb)
    return sum(meta(c)["points"] for c in nb.cells
               if meta(c).get("grade") and not meta(c).get("solution")
               and owner[meta(c)["grade_id"]] in solved)


def index_of(nb, grade_id: str) -> int:
    return next(i for i, c in enumerate(nb.cells) if meta(c).get("grade_id") == grade_id)


class Lab:
    """The lab's release (what students get) and source (instructor) notebooks."""

    def __init__(self):
        self.source = source_notebook(ROOT / "solutions" / f"{LAB}.py")
        self.release = nbformat.read(ROOT / "labs" / LAB / f"{LAB}.ipynb", as_version=4)
        self.solutions = [meta(c)["grade_id"] for c in self.source.cells
                          if meta(c).get("solution")]
        self.tests = list(owners(self.source))
        self.max = points_of(self.source, set(self.solutions))

    def submission(self, solved: set[str]):
        """The release with the solution cells of `solved` filled in from the source."""
        nb = copy.deepcopy(self.release)
        for grade_id in solved:
            nb.cells[index_of(nb, grade_id)] = copy.deepcopy(
                self.source.cells[index_of(self.source, grade_id)])
        return nb


def cases(lab: Lab) -> dict[str, tuple[object, float, str]]:
    """{student: (notebook or bytes, expected score, expected status substring)}."""
    everything = set(lab.solutions)
    first, last = lab.solutions[0], lab.solutions[-1]
    full = lab.submission(everything)
    loop = lab.submission(everything - {first})
    loop.cells[index_of(loop, first)].source += "\nwhile True:\n    pass\n"
    crash = lab.submission(everything)
    crash.cells[index_of(crash, lab.solutions[1])].source = "import os\nos._exit(1)\n"
    deleted = lab.submission(everything)
    del deleted.cells[index_of(deleted, lab.tests[-1])]
    edited = lab.submission(set())
    for test in lab.tests:                  # every test made to pass, one with its points up
        edited.cells[index_of(edited, test)].source = "pass\n"
    edited.cells[index_of(edited, lab.tests[0])].metadata.nbgrader["points"] = 100
    del edited.cells[index_of(edited, lab.tests[1])].metadata["nbgrader"]   # un-marked
    duplicated = lab.submission(everything)
    i = index_of(duplicated, first)
    duplicated.cells.insert(i + 1, copy.deepcopy(duplicated.cells[i]))
    duplicated.cells[i + 1].id = "student-copy"
    loud = lab.submission(everything)
    big = nbformat.v4.new_code_cell("print('\\n'.join(['x' * 49] * 100_000))")  # 5 MB
    big.outputs = [nbformat.v4.new_output("stream", name="stdout", text="y" * 5_000_000)]
    loud.cells.insert(1, big)
    partial = {first, last}
    return {
        "full": (full, lab.max, "graded"),
        "blank": (lab.submission(set()), 0, "graded"),
        "partial": (lab.submission(partial), points_of(lab.source, partial), "graded"),
        "loop": (loop, points_of(lab.source, everything - {first}), "time limit"),
        "crash": (crash, 0, "kernel died"),
        "deleted": (deleted, lab.max, f"from the gradebook: {lab.tests[-1]} (deleted)"),
        "edited": (edited, 0, f"from the gradebook: {lab.tests[0]} (edited)"),
        "duplicated": (duplicated, lab.max, f"duplicate grade_id {first}"),
        "loud": (loud, lab.max, "graded"),
        "garbage": (b"\x00\xffnot json at all" * 1000, 0, "not a readable notebook"),
    }


def write(subs: Path, student: str, content, nested: bool) -> None:
    folder = subs / student / LAB if nested else subs / student
    folder.mkdir(parents=True)
    path = folder / f"{LAB}.ipynb"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        nbformat.write(content, path)


def run_grade(subs: Path, out: Path, course: Path, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "labkit", "grade", str(subs), "--out", str(out),
                           "--course", str(course), "--timeout", str(TIMEOUT_S), *flags],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_rows(out: Path) -> dict[str, dict]:
    with open(out / "grades.csv") as f:
        return {r["student"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """(cases, submissions dir, out dir, course dir, the run's stdout), graded once."""
    tmp = tmp_path_factory.mktemp("grading")
    subs, out, course = tmp / "subs", tmp / "out", tmp / "course"
    expected = cases(Lab())
    for k, (student, (content, _, _)) in enumerate(expected.items()):
        write(subs, student, content, nested=k % 2 == 1)   # both layouts
    (subs / "absent").mkdir()
    proc = run_grade(subs, out, course)
    return expected, subs, out, course, proc.stdout


@pytest.mark.parametrize("student", ["full", "blank", "partial", "loop", "crash", "deleted",
                                     "edited", "duplicated", "loud", "garbage"])
def test_each_case_gets_its_score_and_status(graded, student):
    expected, _, out, _, _ = graded
    row = read_rows(out)[student]
    _, score, status = expected[student]
    assert (float(row["score"]), float(row["max_score"])) == (score, Lab().max), row
    assert status in row["status"], row


def test_every_student_has_a_row_feedback_and_a_summary(graded):
    expected, _, out, _, stdout = graded
    rows = read_rows(out)
    assert sorted(rows) == sorted([*expected, "absent"])
    assert rows["absent"]["status"] == "not submitted"
    for student in ("full", "loop", "deleted", "edited", "duplicated", "loud"):
        assert (out / "feedback" / student / f"{LAB}.html").is_file(), student
    assert (out / "feedback" / "loud" / f"{LAB}.html").stat().st_size < 2_000_000
    table = stdout[stdout.index("student "):]
    for student, (_, score, _) in expected.items():
        assert f"{score:g} / {Lab().max:g}" in next(
            ln for ln in table.splitlines() if ln.startswith(student + " "))
    assert "problems:" in table and "garbage 00-setup-minigpt: not a readable" in table


def test_a_second_run_reuses_the_journal(graded):
    expected, subs, out, course, _ = graded
    before = (out / "grades.csv").read_text()
    proc = run_grade(subs, out, course)
    assert proc.stdout.count("kept from the journal") == len(expected)
    assert (out / "grades.csv").read_text() == before


def test_an_interrupted_run_keeps_finished_rows(graded, tmp_path, monkeypatch):
    """Students a, b finish, c interrupts the run; the next run grades only c."""
    _, _, _, course, _ = graded
    subs, out = tmp_path / "subs", tmp_path / "out"
    for student in "abc":
        write(subs, student, f"not a notebook {student}".encode(), nested=False)
    real, called = grading.grade_one, []

    def interrupted(course, student, *args):
        if student == "c":
            raise KeyboardInterrupt
        return real(course, student, *args)

    monkeypatch.setattr(grading, "grade_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=course)
    assert (out / "journal" / "a" / f"{LAB}.json").is_file()
    assert (out / "journal" / "b" / f"{LAB}.json").is_file()

    def counted(course, student, *args):
        called.append(student)
        return real(course, student, *args)

    monkeypatch.setattr(grading, "grade_one", counted)
    rows = grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=course)
    assert called == ["c"] and [r.student for r in rows] == ["a", "b", "c"]
    (subs / "b" / f"{LAB}.ipynb").write_bytes(b"changed")
    grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=course)
    assert called == ["c", "b"]                     # a changed submission is graded again
    grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=course, force=True)
    assert called == ["c", "b", "a", "b", "c"]


def test_nbgrader_submitted_layout_is_found(tmp_path):
    """SUBMISSIONS/submitted/<student>/<lab>/<lab>.ipynb, as `nbgrader collect` leaves it."""
    lab_dir = tmp_path / "submitted" / "ann" / LAB
    lab_dir.mkdir(parents=True)
    (lab_dir / f"{LAB}.ipynb").write_text("{}")
    (lab_dir / "timestamp.txt").write_text("2026-01-01 00:00:00")
    (lab_dir / "notes.txt").write_text("extra")
    students, found, ignored = grading.find_submissions(tmp_path, [LAB])
    assert students == ["ann"] and found == {("ann", LAB): lab_dir / f"{LAB}.ipynb"}
    assert ignored == {"ann": [f"{LAB}/notes.txt"]}
