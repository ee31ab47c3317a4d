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
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from course.authoring.build import source_notebook
from course.grader import grades_csv, grading, journal, jupyter_kernel, sandbox
from course.grader.feedback import render
from course.grader.plan import Cell, Test, plan
from course.grader.printable import LINE_CONTROL, printable
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
    row = grades_csv.GradeRow(evil, LAB, 1, 2, evil)
    grades_csv.write_csv([row], path)
    with open(path, newline="", encoding="utf-8") as f:
        raw = list(csv.reader(f))[1]
    shown = printable(evil)                     # a tab or carriage return is a space there
    assert raw[0] == raw[4] == "'" + shown, raw
    assert [(r.student, r.status) for r in grades_csv.read_csv(path)] == [(shown, shown)]
    text = path.read_bytes()
    grades_csv.merge_into(path, [])                            # a merge adds no second quote
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


@pytest.mark.parametrize("where", ["course/grader/plan.py", "course/authoring/edition.py",
                                   "minimoe/__init__.py", "miniquant/nf4.py"])
def test_the_journal_key_covers_the_grader_the_stub_lists_and_the_references(tmp_path,
                                                                              monkeypatch, where):
    """A grade depends on the grader's code, on which names the student edition stubs, and
    on the references the trusted tests call: a change to any of them grades again."""
    import importlib.util

    for package in journal.GRADED_PACKAGES:
        shutil.copytree(Path(importlib.util.find_spec(package).origin).parent,
                        tmp_path / package)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found(name) if name not in
                        journal.GRADED_PACKAGES else importlib.util.spec_from_file_location(
                            name, tmp_path / name / "__init__.py"))
    before = journal.grader_sha256()
    with open(tmp_path / where, "a", encoding="utf-8") as f:
        f.write("\n# edited\n")
    assert journal.grader_sha256() != before, f"editing {where} left the journal key as it was"


@pytest.mark.parametrize("own_env", [True, False])
def test_without_a_sandbox_a_kernels_temporary_files_go_with_it(monkeypatch, own_env):
    """`make check` (own_env) and --unsafe-no-sandbox run kernels on the host: what their code
    and the bridge's folders (learner_dir) put in temporary files is removed with them."""
    import tempfile

    from course.grader.autograde import grade_notebook

    host = Path(tempfile.mkdtemp(prefix="host-", dir="/tmp"))   # short: ZMQ's ipc paths
    monkeypatch.setenv("TMPDIR", str(host))                      # fit in 107 characters
    monkeypatch.setattr(tempfile, "tempdir", None)
    nb = nbformat.v4.new_notebook()
    test = nbformat.v4.new_code_cell("from course.notebook.bridged import learner_dir\n"
                                     "assert learner_dir()")
    test.metadata["nbgrader"] = {"schema_version": 3, "locked": True, "solution": False,
                                 "task": False, "grade": True, "grade_id": "t", "points": 1}
    nb.cells = [nbformat.v4.new_code_cell("import tempfile\nfolder = tempfile.mkdtemp()\n"
                                          "open(tempfile.mkstemp()[1], 'w').close()\n"
                                          "print(tempfile.gettempdir())"), test]
    out = grade_notebook(nb, nb, sandbox.Sandbox(ROOT, unsafe=True, own_env=own_env),
                         timeout=60)
    assert [c.earned for c in out.cells if c.kind == "test"] == [1], out.notes
    scratch = Path(out.cells[0].outputs[0]["text"].strip())
    assert scratch.name == "tmp" and not scratch.exists(), \
        f"the kernel's temporary folder {scratch} is not its own, removed with it"
    # the zygote's folder is the grading run's, removed when the grading process exits
    left = sorted(p.name for p in host.iterdir() if not p.name.startswith("labkit-zygote-"))
    shutil.rmtree(host, ignore_errors=True)
    assert not left, f"a kernel run without a sandbox left temporary files on the host: {left}"


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
    plain = next(c for c in reversed(kinds["other"])
                 if "jupyter-only" not in c.metadata.get("tags", []))
    plain.metadata["tags"] = ["jupyter-only"]
    assert grading.tests_digest(source) != digest, "a jupyter-only tag changes the key"


# No run erases a grade (grades_csv.settle): a fake grade_one scores a notebook by the "score" in
# its metadata; what is not a notebook goes through the real one ("not a readable notebook").
LAB1 = "01-quant-basics"


def notebook(path: Path, score: float, notes: tuple = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(metadata={"score": score, "notes": list(notes)}),
                   path)
    return path


@pytest.fixture
def fake_grading(monkeypatch):
    """grade(subs, out) with the fake grade_one, one job, no kernels; the rows."""
    real = grading.grade_one

    def fake(student, lab, path, source_nb, box, slot, timeout, out):
        try:
            meta = json.loads(path.read_text())["metadata"]
        except (ValueError, KeyError):
            return real(student, lab, path, source_nb, box, slot, timeout, out)
        page = journal.feedback_path(out, student, lab)
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text("page")
        return grades_csv.GradeRow(student, lab, meta["score"], grading.max_points(source_nb),
                                "; ".join(["graded", *meta["notes"]]))

    monkeypatch.setattr(grading, "grade_one", fake)
    return lambda subs, out: grading.grade(subs, ROOT, out, jobs=1, unsafe_no_sandbox=True,
                                           course=out / "course")


def rows_of(out: Path) -> dict:
    return {(r.student, r.lab): r for r in grades_csv.read_csv(out / "grades.csv")}


def journaled(out: Path, student: str, lab: str) -> tuple:
    row = json.loads(journal.entry_path(out, student, lab).read_text())["row"]
    return row["score"], row["status"]


def test_a_second_week_into_the_same_output_erases_no_grade(tmp_path, fake_grading, capsys):
    """Lab 00 graded, then Lab 01 into the same output while bob's folder also holds a junk
    file named like Lab 00: every Lab 00 grade stays, "not submitted" goes only where
    nothing was recorded, the junk is reported, and the journal says what grades.csv says."""
    week1, week2, out = tmp_path / "week1", tmp_path / "week2", tmp_path / "out"
    notebook(week1 / "ann" / f"{LAB}.ipynb", 11)
    notebook(week1 / "bob" / f"{LAB}.ipynb", 7)
    fake_grading(week1, out)
    for student in ("ann", "bob", "cy"):
        notebook(week2 / student / f"{LAB1}.ipynb", 3)
    (week2 / "bob" / f"{LAB} (2).ipynb").write_bytes(b"\x00\xff junk")
    capsys.readouterr()
    fake_grading(week2, out)
    said, rows = capsys.readouterr().out, rows_of(out)
    for student, score in [("ann", 11), ("bob", 7)]:
        row = rows[(student, LAB)]
        assert (row.score, row.status) == (score, "graded"), (
            f"no run erases a grade: grading Lab 01 made {student}'s recorded Lab 00 grade "
            f"{score} / 11 into {row.score:g} ({row.status})")
        assert journaled(out, student, LAB) == (row.score, row.status), \
            "the journal must say what grades.csv says"
    page = journal.feedback_path(out, "bob", LAB)
    assert page.is_file() and page.read_text() == "page", \
        "the junk file took away the feedback page of bob's recorded Lab 00 grade"
    assert rows[("cy", LAB)].status == "not submitted", \
        '"not submitted" where nothing was ever recorded'
    assert (f"bob {LAB}: not a readable notebook (UnicodeDecodeError); kept the recorded "
            "7 / 11") in said, "an unreadable file is reported, and the recorded grade kept"
    assert {rows[(s, LAB1)].score for s in ("ann", "bob", "cy")} == {3}


def test_a_lower_grade_says_why_and_a_rerun_keeps_it(tmp_path, fake_grading, capsys):
    subs, out = tmp_path / "subs", tmp_path / "out"
    notebook(subs / "ann" / f"{LAB}.ipynb", 11)
    fake_grading(subs, out)
    notebook(subs / "ann" / f"{LAB}.ipynb", 5, ("cell 3 hit the 300 s time limit",))
    capsys.readouterr()
    fake_grading(subs, out)
    said, row = capsys.readouterr().out, rows_of(out)[("ann", LAB)]
    why = "; lower than the recorded 11 / 11 (the submission changed)"
    assert (row.score, row.status) == (5, "graded; cell 3 hit the 300 s time limit" + why), \
        "a grade lower than the recorded one names that one and why it changed"
    assert f"ann {LAB}: 5 / 11{why}" in said, "the console says a grade went down"
    assert journaled(out, "ann", LAB) == (row.score, row.status), \
        "the journal must say what grades.csv says"
    before = (out / "grades.csv").read_bytes()
    fake_grading(subs, out)
    assert (out / "grades.csv").read_bytes() == before, "a rerun keeps the note, once"


def test_a_merge_never_erases_a_grade_and_says_when_it_lowers_one(tmp_path, capsys):
    path = tmp_path / "grades.csv"
    grades_csv.write_csv([grades_csv.GradeRow("ann", LAB, 11, 11, "graded"),
                       grades_csv.GradeRow("bob", LAB, 9, 11, "graded"),
                       grades_csv.GradeRow("cy", LAB, 0, 11, "not submitted")], path)
    shard = [grades_csv.GradeRow("ann", LAB, 0, 11, "not submitted"),
             grades_csv.GradeRow("bob", LAB, 0, 11, "not a readable notebook (ValueError)"),
             grades_csv.GradeRow("cy", LAB, 0, 11, "not a readable notebook (ValueError)")]
    grades_csv.merge_into(path, shard, "merged from b.csv")
    rows = rows_of(tmp_path)
    assert [(rows[(s, LAB)].score, rows[(s, LAB)].status) for s in ("ann", "bob", "cy")] == [
        (11, "graded"), (9, "graded"), (0, "not a readable notebook (ValueError)")], \
        "a row without a grade never replaces a grade (it may replace another such row)"
    assert f"bob {LAB}: not a readable notebook (ValueError); kept the recorded 9 / 11" in \
        capsys.readouterr().out
    lower = [grades_csv.GradeRow("ann", LAB, 4, 11, "graded")]
    grades_csv.merge_into(path, lower, "merged from c.csv")
    assert rows_of(tmp_path)[("ann", LAB)].status == \
        "graded; lower than the recorded 11 / 11 (merged from c.csv)", "--merge says why"
    text = path.read_bytes()
    grades_csv.merge_into(path, lower, "merged from c.csv")
    assert path.read_bytes() == text, "merging the same rows again changes nothing"


# Nothing the grader prints or writes carries a terminal escape, a control character or a
# bidi override (course.grader.printable). EVIL is a student folder's name.
EVIL = "eve\x1b]0;pwned\x07\x1b[2J\u202etxe.\x9b31m\x1b]8;;x\x1b\\link\x1b]8;;\x1b\\"


@pytest.mark.parametrize("text, shown", [
    ("ann\x1b[31mred\x1b[0m", "annred"), ("\x1b]8;;http://x\x1b\\click\x1b]8;;\x1b\\", "click"),
    ("title\x1b]0;pwned\x07", "title"), ("a\x1b(Bb\x1bc", "ab"),
    ("a\u202eevil\u2066\u2069", "aevil"),
    ("c1\x9b2J\x85\x90dcs\x9c", "c1"), ("tab\tnew\nline\r\n", "tab new line "),
    ("lone\x1b", "lone"), ("nul\x00del\x7f", "nuldel"), ("José García", "José García")])
def test_printable_strips_escapes_and_controls(text, shown):
    assert printable(text) == shown
    assert printable(printable(text)) == shown, "a second pass changes nothing"
    assert not LINE_CONTROL.search(printable(text, lines=True))


def test_escapes_never_reach_the_csv_the_page_or_the_console(tmp_path, fake_grading, capsys):
    subs, out = tmp_path / "subs", tmp_path / "out"
    notebook(subs / EVIL / f"{LAB}.ipynb", 11,
             ("grade_id not in this lab, run as ordinary cells: \x1b[31mtest_x\x1b]0;t\x07",))
    fake_grading(subs, out)
    cell = Cell("code", "print(1)", outputs=[stream("\x1b[31mred\x1b]8;;http://x\x07a\u202e")])
    page = render(EVIL, LAB, 0, 11, "graded; \x1b[2J", [cell])
    for where, text in [("the console", capsys.readouterr().out), ("the feedback page", page),
                        ("grades.csv", (out / "grades.csv").read_text(encoding="utf-8"))]:
        assert not LINE_CONTROL.search(text), (
            f"{where} holds {LINE_CONTROL.findall(text)}: everything the grader prints or "
            "writes goes through course.grader.printable")
    assert ("evetxe.link", LAB) in rows_of(out), "the student is named as outputs show them"


def test_two_folders_printing_alike_are_refused(tmp_path):
    for name in ("ann", "ann\x1b[0m"):
        (tmp_path / name).mkdir()
    with pytest.raises(InputError, match="would share the row 'ann' in grades.csv"):
        grading.find_submissions(tmp_path, [LAB])


# What the grader holds of a kernel's output is bounded in bytes, whatever the kernel sends
# (jupyter_kernel.connect, relay.py): a fake kernel's iopub floods a client that reads nothing.
FAKE_KERNEL = """
import sys, zmq
iopub = zmq.Context().socket(zmq.XPUB)
iopub.bind(sys.argv[1])
iopub.recv()                              # a subscriber is there
frame = b"x" * (8 << 20)
if sys.argv[2] == "many":                 # 30 messages of 8 MiB
    for _ in range(30):
        iopub.send(frame, copy=False)
elif sys.argv[2] == "large":              # 12 messages of 40 MiB, each over MAX_MESSAGE
    for _ in range(12):
        iopub.send(frame * 5, copy=False)
elif sys.argv[2] == "huge":               # one frame over MAX_FRAME
    iopub.send(b"x" * (300 << 20), copy=False)
else:                                     # one message of 40 frames of 8 MiB
    iopub.send_multipart([frame] * 40, copy=False)
print("sent", flush=True)
sys.stdin.readline()                      # the grader drained what it did not read: a reply
iopub.send(b"hello")
sys.stdin.read()
"""


def rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.parametrize("flood, through", [("many", "client"), ("many", "relay"),
                                            ("multipart", "relay"), ("large", "relay")])
def test_a_flood_of_output_is_held_in_bytes(tmp_path, flood, through):
    """320 MiB sent while the grader reads nothing: it holds a few messages' worth, and once
    it has drained them (as Kernel.run does before a request), the kernel's next message
    arrives."""
    from course.grader.relay import Relay

    info = {"transport": "ipc", "ip": str(tmp_path / "kernel"), "shell_port": 1,
            "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5, "key": "k",
            "signature_scheme": "hmac-sha256"}
    kernel = subprocess.Popen([sys.executable, "-c", FAKE_KERNEL, f"ipc://{info['ip']}-2",
                               flood], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    relay = Relay(info) if through == "relay" else None
    client = jupyter_kernel.connect(relay.connection() if relay else info)
    try:
        client.start_channels(shell=False, stdin=False, hb=False, control=False)
        before = rss_mib()
        assert kernel.stdout.readline() == b"sent\n"
        time.sleep(2)                       # what ZMQ would take in has arrived
        held = rss_mib() - before
        assert held < 100, (
            f"the grader holds {held:.0f} MiB of output it has not read: what it holds of a "
            "kernel's output must be bounded in bytes (QUEUED messages per socket; a "
            "relay passing only messages of at most MAX_MESSAGE bytes)")
        socket, deadline = client.iopub_channel.socket, time.monotonic() + 20
        while socket.poll(1000) and time.monotonic() < deadline:
            socket.recv_multipart(copy=False)
        kernel.stdin.write(b"reply\n")
        kernel.stdin.flush()
        assert socket.poll(10_000) and socket.recv_multipart()[-1] == b"hello", \
            "after the flood, the kernel's next message must still arrive"
    finally:
        client.stop_channels()
        client.context.destroy(linger=0)
        kernel.kill()
        if relay:
            relay.close()


def test_a_frame_past_the_relays_cap_ends_the_relay_at_once(tmp_path):
    """ZMQ drops a connection that sends a frame over MAX_FRAME, and what was sent meanwhile
    is lost (the kernel's idle status among it): the relay ends, so the grader counts the
    kernel dead now rather than at the cell's time limit."""
    from course.grader.relay import Relay

    info = {"transport": "ipc", "ip": str(tmp_path / "kernel"), "shell_port": 1,
            "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5, "key": "k",
            "signature_scheme": "hmac-sha256"}
    kernel = subprocess.Popen([sys.executable, "-c", FAKE_KERNEL, f"ipc://{info['ip']}-2",
                               "huge"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    relay = Relay(info)
    client = jupyter_kernel.connect(relay.connection())
    try:
        client.start_channels(shell=False, stdin=False, hb=False, control=False)
        assert kernel.stdout.readline() == b"sent\n"
        deadline = time.monotonic() + 10
        while relay.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not relay.alive(), "a frame over MAX_FRAME dropped the kernel's connection: " \
            "the relay must end then, not leave the grader waiting for the time limit"
    finally:
        client.stop_channels()
        client.context.destroy(linger=0)
        kernel.kill()
        relay.close()


def test_past_its_read_cap_a_requests_output_is_dropped_unread_and_said_once(monkeypatch):
    from jupyter_client.session import Session

    monkeypatch.setattr(jupyter_kernel, "MAX_READ", 1_000)
    kernel = object.__new__(jupyter_kernel.Kernel)
    kernel.client = SimpleNamespace(session=Session(key=b"k"))
    kernel.budget = [jupyter_kernel.MAX_SUBMISSION_BYTES]
    outputs, taken = [], [0]
    packed = json.dumps({"name": "stdout", "text": "y" * 600}).encode()
    for _ in range(5):
        msg = {"header": {"msg_type": "stream"}, "content": packed}
        kernel._take(outputs, msg, len(packed), taken)
    assert [o["name"] for o in outputs] == ["stdout", "labkit"], (
        "past MAX_READ bytes a request's output is dropped unread, said once")
    assert taken == [5 * len(packed)], "every message's bytes are counted"
