"""What the grader does with hostile names, files and outputs, without running a kernel.

Keys: a student's key always carries a hash of the whole name (no folder can take another
student's feedback and journal). Collection: a symlinked student folder is skipped and
reported. grades.csv: no cell a spreadsheet evaluates, and merging reads back what it wrote.
Statuses echo nothing of a file. Outputs: only text, PNG and JPEG are kept, capped per cell
and per submission. Cleanup removes any tree, however deep or locked, and never raises. The
sandbox: a size-limited /tmp, no nested user namespaces, a fresh uid per submission (root).
Feedback: a hidden failure shows nothing of its error. The journal key: what in the source
decides a grade (tests, their setup, jupyter-only tags), not the solutions.
"""

from __future__ import annotations

import csv
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import source_notebook
from course.grader import grading, journal, jupyter_kernel, sandbox
from course.grader.autograde import Cell, Test, plan
from course.grader.feedback import render
from labkit.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
LAB = "00-setup-minigpt"


def test_a_key_always_carries_a_hash_of_the_whole_name():
    jose = journal.student_key("José García")
    assert jose.startswith("Jos_Garc_a-") and len(jose) == len("Jos_Garc_a-") + 16
    assert journal.student_key(jose) != jose                # a folder named after the key
    assert journal.student_key("alice") != "alice"          # plain names are hashed too
    assert len({journal.student_key(s) for s in ("a b", "a_b", "a-b", "a.b", "..", ".")}) == 6


def test_a_symlinked_student_folder_is_skipped_and_reported(tmp_path):
    (tmp_path / "ann").mkdir()
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "ann" / f"{LAB}.ipynb")
    (tmp_path / "eve").symlink_to(tmp_path / "ann")
    students, found, notes = grading.find_submissions(tmp_path, [LAB])
    assert students == ["ann"] and list(found) == [("ann", LAB)]
    assert notes == {"eve": ["the student folder is a symbolic link: not graded"]}


def test_two_students_sharing_a_key_are_refused(tmp_path, monkeypatch):
    for name in ("ann", "bob"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(journal, "student_key", lambda student: "same")
    with pytest.raises(InputError, match="'ann' and 'bob' would share"):
        grading.find_submissions(tmp_path, [LAB])


@pytest.mark.parametrize("evil", ["=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1)",
                                  "\t=1", "\r=1"])
def test_grades_csv_holds_no_formula_and_reads_back(tmp_path, evil):
    path = tmp_path / "grades.csv"
    row = grading.GradeRow(evil, LAB, 1, 2, evil)
    grading.write_csv([row], path)
    with open(path, newline="", encoding="utf-8") as f:
        raw = list(csv.reader(f))[1]
    assert raw[0] == raw[4] == "'" + evil, raw
    assert [(r.student, r.status) for r in grading.read_csv(path)] == [(evil, evil)]
    text = path.read_bytes()
    grading.merge_into(path, [])                            # a merge adds no second quote
    assert path.read_bytes() == text


def test_a_status_echoes_nothing_of_a_file(tmp_path):
    bad = tmp_path / "x.ipynb"
    bad.write_text('{"cells": SECRET-CONTENT-FROM-THE-FILE')
    row = grading.grade_one("ann", LAB, bad, source_notebook(ROOT / "solutions" / f"{LAB}.py"),
                            None, 0, 10, tmp_path)
    assert row.status.startswith("not a readable notebook (") and "SECRET" not in row.status


def stream(text: str) -> dict:
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def test_only_text_png_and_jpeg_are_kept():
    outputs: list = []
    jupyter_kernel._cap(outputs, nbformat.v4.new_output(
        "display_data", data={"text/html": "<script>x</script>", "image/png": "iVBO",
                              "application/javascript": "alert(1)"}))
    jupyter_kernel._cap(outputs, nbformat.v4.new_output(
        "display_data", data={"text/html": "<b>only html</b>"}))
    assert [sorted(o["data"]) for o in outputs] == [["image/png"], ["text/plain"]]
    assert "only html" not in str(outputs)


def test_output_is_capped_per_cell_across_mime_types(monkeypatch):
    monkeypatch.setattr(jupyter_kernel, "MAX_CELL_BYTES", 10_000)
    outputs: list = []
    for _ in range(20):                  # each under the per-image cap, together over the cell's
        jupyter_kernel._cap(outputs, nbformat.v4.new_output(
            "display_data", data={"image/png": "A" * 1_900, "text/plain": "B" * 100}))
    assert outputs[-1]["text"] == "[output cut by the grader]\n"
    assert sum(jupyter_kernel.size(o) for o in outputs[:-1]) <= 10_000


def test_output_is_capped_per_submission_across_cells():
    budget = [5_000]
    kept = 0
    for _ in range(10):                  # ten cells, each under the cell's cap
        outputs: list = []
        jupyter_kernel._cap(outputs, stream("x" * 1_000), budget)
        jupyter_kernel._cap(outputs, nbformat.v4.new_output(
            "display_data", data={"image/jpeg": "J" * 900}), budget)
        kept += sum(jupyter_kernel.size(o) for o in outputs if o.get("name") != "labkit")
    assert kept <= 5_000 and budget[0] >= 0


def test_cleanup_removes_a_deep_and_locked_tree_and_never_raises(tmp_path):
    top = tmp_path / "private"
    deep = top
    top.mkdir()
    for _ in range(1_500):               # deeper than Python's recursion limit
        deep = deep / "d"
        deep.mkdir()
    locked = top / "locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "f").write_text("x")
    locked.chmod(0)
    jupyter_kernel.remove_tree(top)
    assert not top.exists()
    jupyter_kernel.remove_tree(top)      # gone already: still no error


def argv_of(box: sandbox.Sandbox, uid=None) -> list[str]:
    return box.command(["python"], Path("/tmp/p"), 0, uid)


def test_the_sandbox_has_a_small_tmp_and_no_nested_user_namespaces(monkeypatch):
    box = sandbox.Sandbox(ROOT)
    args = argv_of(box)
    i = args.index("--tmpfs")
    assert args[i - 2:i] == ["--size", str(box.limits.tmp_bytes)] and args[i + 1] == "/tmp"
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    assert "--disable-userns" in argv_of(box) and "--unshare-user" in argv_of(box)


def test_each_submission_gets_a_fresh_uid_as_root(monkeypatch):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    box = sandbox.Sandbox(ROOT)
    uids = [box.uid(slot=0) for _ in range(3)]
    assert len(set(uids)) == 3 and all(u >= 200_000 for u in uids)
    assert f"--reuid={uids[1]}" in argv_of(box, uids[1])


def test_a_hidden_failure_shows_its_case_label_and_nothing_of_its_error():
    test = Test("test_x", 2.0, [(False, "f(1)"), (True, "# case: a tie\nassert f(2) == 3")],
                "f(1)")
    cell = Cell("test", test.visible, test, status="error", hidden_failed=True,
                hidden_case="a tie", error="LEAK_assert_f_2_eq_3: AssertionError('f(2) == 3')")
    page = render("ann", LAB, 0, 2, "graded", [cell])
    assert "failed a hidden test: a tie" in page and "LEAK" not in page and "f(2)" not in page


def test_a_jupyter_only_cell_says_it_was_not_run_while_graded():
    source = source_notebook(ROOT / "solutions" / f"{LAB}.py")
    source.cells.append(nbformat.v4.new_code_cell("compare()", id="demo",
                                                  metadata={"tags": ["jupyter-only"]}))
    student = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("compare()",
                                                                        id="demo")])
    demo = [c for c in plan(student, source)[0] if c.kind == "code"]
    assert [c.status for c in demo] == ["jupyter-only"]
    page = render("ann", LAB, 0, 2, "graded", demo)
    assert "Not run when graded: the lab runs this cell in Jupyter only" in page


def test_a_hidden_chunk_splits_at_its_case_labels():
    from course.grader.tests_setup import cases

    code = "x = 1\n# case: a float64 base\nassert x\nfor i in range(2):\n    pass\n" \
           "# case: a tie\nassert x == 1\n"
    assert [label for label, _ in cases(code)] == ["hidden tests", "a float64 base", "a tie"]
    assert "".join(part for _, part in cases(code)) == code


def test_a_test_that_kills_the_learners_kernel_keeps_its_helpers():
    """The learner's code ends its kernel half way through a test cell: only that kernel
    restarts, so the helper the cell defined before it died serves the next test."""
    from course.grader.autograde import grade_notebook

    def cell(source, **nbgrader):
        c = nbformat.v4.new_code_cell(source)
        if nbgrader:
            c.metadata["nbgrader"] = {"schema_version": 3, "locked": True, "solution": False,
                                      "task": False, **nbgrader}
        return c

    nb = nbformat.v4.new_notebook()
    nb.cells = [cell("import os"),
                cell("def f(x):\n    return x + 1\ndef boom():\n    os._exit(1)",
                     grade=False, grade_id="sol", solution=True, locked=False),
                cell("def _helper(v):\n    assert f(v) == v + 1\n_helper(1)\nboom()",
                     grade=True, grade_id="t1", points=1),
                cell("_helper(2)", grade=True, grade_id="t2", points=1)]
    out = grade_notebook(nb, nb, sandbox.Sandbox(ROOT, unsafe=True), timeout=30)
    status = {c.test.grade_id: (c.status, c.earned) for c in out.cells if c.kind == "test"}
    assert status == {"t1": ("dead", 0), "t2": ("ok", 1)}, (status, out.notes)


def test_the_journal_key_covers_the_tests_setup_and_tags_not_the_solutions():
    """A row is reused only while what decides it is unchanged: the test cells, the ordinary
    cells the trusted kernel may run as their setup, and which cells are jupyter-only."""
    source = source_notebook(ROOT / "solutions" / f"{LAB}.py")
    digest = grading.tests_digest(source)
    kinds = {"solution": [], "test": [], "other": []}
    for cell in (c for c in source.cells if c.cell_type == "code"):
        nbg = cell.metadata.get("nbgrader", {})
        kinds["solution" if nbg.get("solution") else "test" if nbg.get("grade")
              else "other"].append(cell)
    for kind, changed in [("solution", False), ("test", True), ("other", True)]:
        cell = kinds[kind][-1]
        saved = cell.source
        cell.source += "\n# edited"
        assert (grading.tests_digest(source) != digest) is changed, kind
        cell.source = saved
    kinds["other"][-1].metadata["tags"] = ["jupyter-only"]
    assert grading.tests_digest(source) != digest, "a jupyter-only tag changes the key"
