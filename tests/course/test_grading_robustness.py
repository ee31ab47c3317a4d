"""`course grade` on lab 00 with a hostile class: one student per kind of submission.

One grading run, two jobs at a time, each submission in its bubblewrap sandbox (module
fixture, about 2 minutes on 2 cores), gives every case its row; the expected scores come
from the nbgrader metadata of the test cells that should pass, never from hardcoded numbers.
Then: what the hostile students tried left solutions/, the course, the grades and the other
students untouched; no feedback page shows a hidden test; --jobs 1 gives the same rows; a
second run grades nothing; an interrupted run keeps what it finished; a locked gradebook
is a status, not a crash; grades.csv files merge.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import html
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import generate_assignments, lab_names, source_notebook
from course.grader import grades_csv, grading, journal
from course.grader.tests_setup import HIDDEN

ROOT = Path(__file__).resolve().parents[2]
LAB = "00-setup-minigpt"
TIMEOUT_S = 20      # lab 00's slowest cell takes about a second
OLD_KEY = "Jos_Garc_a-978edf99a5"   # José García's key before keys always carried a hash
pytestmark = [pytest.mark.notebooks,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")]


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

    def hidden_lines(self) -> list[str]:
        """A distinctive line of every hidden test block: none may reach a feedback page."""
        return [max(m.group(1).splitlines(), key=len).strip()
                for c in self.source.cells for m in HIDDEN.finditer(c.source)]


def with_cell(nb, code: str, at: int = 1):
    nb = copy.deepcopy(nb)
    nb.cells.insert(at, nbformat.v4.new_code_cell(code))
    return nb


def attacks(tmp: Path) -> dict[str, str]:
    """Code cells of the hostile students; paths are the real ones, as an attacker's guess."""
    course, out, subs = tmp / "course", tmp / "out", tmp / "subs"
    return {
        # every later cell becomes `pass` (how a blank notebook got 11/11 before)
        "transformer": "get_ipython().input_transformers_post.append(lambda lines: ['pass\\n'])",
        # rewrite a stored test in the gradebook, as nbgrader would restore it
        "gradebook": f"""
import sqlite3
for db in [{str(course / 'gradebook.db')!r}, {str(ROOT / 'build/course/gradebook.db')!r}]:
    try:
        c = sqlite3.connect(db)
        c.execute("update source_cell set source = 'pass'")
        c.commit()
        print("rewrote", db)
    except Exception as e:
        print("could not:", e)
""",
        # a detached process that waits, then rewrites the grades and writes into solutions/
        "detached": f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", '''
import time, pathlib
time.sleep(4)
for p in [{str(out / 'grades.csv')!r}, {str(ROOT / 'solutions' / 'pwned.py')!r}]:
    try:
        pathlib.Path(p).write_text("student,lab,score,max_score,status\\\\nfull,{LAB},0,11,graded\\\\n")
    except Exception:
        pass
'''], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("started")
""",
        # print the solutions, the course sources and another student's notebook
        "snoop": f"""
import os
for p in [{str(ROOT / 'solutions')!r}, {str(course / 'source')!r}, {str(subs / 'full')!r},
          {str(ROOT / 'build')!r}, {str(out)!r}]:
    try:
        for name in os.listdir(p):
            print(p, name, open(os.path.join(p, name), errors="replace").read()[:20000])
    except Exception as e:
        print("no", p, type(e).__name__)
""",
        # print every later cell's source: the hidden tests
        "hidden": "get_ipython().events.register('pre_run_cell', "
                  "lambda info: print('NEXT CELL:', info.raw_cell))",
        # a trace function that turns a failing test into a passing one
        "tracer": "import sys\nsys.settrace(lambda *a: None)",
        # a patched AssertionError that never fires
        "builtins": "import builtins\nbuiltins.AssertionError = type('A', (Exception,), {})",
    }


def cases(lab: Lab, tmp: Path) -> dict[str, tuple[object, float, str]]:
    """{student: (notebook or bytes, expected score, expected status substring)}."""
    everything = set(lab.solutions)
    first, last = lab.solutions[0], lab.solutions[-1]
    full, blank = lab.submission(everything), lab.submission(set())
    without_first = points_of(lab.source, everything - {first})
    loop = lab.submission(everything - {first})
    loop.cells[index_of(loop, first)].source += "\nwhile True:\n    pass\n"
    bare = lab.submission(everything - {first})
    bare.cells[index_of(bare, first)].source += (
        "\nimport time\nwhile True:\n    try:\n        time.sleep(0.05)\n    except:\n"
        "        pass\n")
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
    loud = with_cell(full, "print('\\n'.join(['x' * 49] * 100_000))")        # 5 MB
    flood = with_cell(full, "print('x' * 100_000_000)")     # one 100 MB message
    loud.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="y" * 5_000_000)]
    other = source_notebook(ROOT / "solutions" / "01-quant-basics.py")
    pasted = copy.deepcopy(full)
    pasted.cells.insert(3, copy.deepcopy(next(c for c in other.cells if meta(c).get("solution"))))
    pasted.cells.insert(4, copy.deepcopy(next(c for c in other.cells if meta(c).get("grade"))))
    partial = {first, last}
    # the tests run apart from the learner's kernel: an attack there on a blank notebook
    # changes nothing (test_grading_hostile.py has the families on several labs)
    hostile = {name: (with_cell(blank, code), 0, "graded")
               for name, code in attacks(tmp).items()}
    for name in ("gradebook", "detached", "snoop"):     # harmless in the sandbox: full marks
        hostile[name] = (with_cell(full, attacks(tmp)[name]), lab.max, "graded")
    return {
        "full": (full, lab.max, "graded"),
        "blank": (blank, 0, "graded"),
        "partial": (lab.submission(partial), points_of(lab.source, partial), "graded"),
        "loop": (loop, without_first, "time limit"),
        "bare-except": (bare, without_first, "swallowed the time-limit interrupt"),
        "crash": (crash, points_of(lab.source, everything - {lab.solutions[1]}),
                  "ended the kernel"),
        "deleted": (deleted, lab.max, f"instructor's source: {lab.tests[-1]} (deleted)"),
        "edited": (edited, 0, f"instructor's source: {lab.tests[0]} (edited)"),
        "duplicated": (duplicated, lab.max, f"duplicate grade_id {first}"),
        "loud": (loud, lab.max, "graded"),
        "flood": (flood, lab.max, "graded"),        # the message dropped, the kernel kept
        "pasted": (pasted, lab.max, "grade_id not in this lab"),
        "garbage": (b"\x00\xffnot json at all" * 1000, 0, "not a readable notebook"),
        "José García": (full, lab.max, "graded"),
        # a folder named as José's key once was: its page and journal must stay its own
        OLD_KEY: (blank, 0, "graded"),
        # IPython's input history printed after every test: it must hold no hidden test
        "history": (with_cell(full, "print(In)\nprint(_ih)\nprint(_i, _ii)",
                              at=len(full.cells)), lab.max, "graded"),
        **hostile,
    }


def write(subs: Path, student: str, content, nested: bool, name: str = f"{LAB}.ipynb") -> Path:
    folder = subs / student / LAB if nested else subs / student
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        nbformat.write(content, path)
    return path


def run_grade(subs: Path, out: Path, course: Path, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "course", "grade", str(subs), "--out", str(out),
                           "--course", str(course), "--timeout", str(TIMEOUT_S), *flags],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_rows(out: Path) -> dict[str, dict]:
    with open(out / "grades.csv", encoding="utf-8") as f:
        return {r["student"]: r for r in csv.DictReader(f)}


def tree_digest(path: Path) -> str:
    """sha256 over the names and bytes of every file under `path`."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


def stored_tests(course: Path) -> list[tuple]:
    with sqlite3.connect(course / "gradebook.db") as db:
        return sorted(db.execute("select name, source from source_cell").fetchall())


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """(cases, tmp dir, the run's stdout, the solutions digest before), graded once."""
    tmp = tmp_path_factory.mktemp("grading")
    subs, out, course = tmp / "subs", tmp / "out", tmp / "course"
    lab = Lab()
    expected = cases(lab, tmp)
    for k, (student, (content, _, _)) in enumerate(expected.items()):
        write(subs, student, content, nested=k % 2 == 1)   # both layouts
    (subs / "absent").mkdir()
    # a file name from a browser download, and an older copy beside a newer one
    write(subs, "renamed", lab.submission(set(lab.solutions)), False, f"{LAB} (1).ipynb")
    old = write(subs, "two-copies", lab.submission(set()), False)
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    write(subs, "two-copies", lab.submission(set(lab.solutions)), False, f"{LAB}-Copy1.ipynb")
    expected["renamed"] = (None, lab.max, "graded")
    expected["two-copies"] = (None, lab.max, "graded")
    generate_assignments(ROOT, [LAB], course)
    before = {"solutions": tree_digest(ROOT / "solutions"), "tests": stored_tests(course)}
    proc = run_grade(subs, out, course, "--jobs", "2")
    time.sleep(6)                                     # the detached process had its chance
    return expected, tmp, proc.stdout, before


CASES = ["full", "blank", "partial", "loop", "bare-except", "crash", "deleted", "edited",
         "duplicated", "loud", "flood", "pasted", "garbage", "José García", "renamed", "two-copies",
         "transformer", "gradebook", "detached", "snoop", "hidden", "tracer", "builtins"]


@pytest.mark.parametrize("student", CASES)
def test_each_case_gets_its_score_and_status(graded, student):
    expected, tmp, _, _ = graded
    row = read_rows(tmp / "out")[student]
    _, score, status = expected[student]
    assert (float(row["score"]), float(row["max_score"])) == (score, Lab().max), row
    assert status in row["status"], row


def test_a_message_over_the_graders_cap_is_dropped_and_said(graded):
    """A 100 MB print: the relay lets it go and says so in the cell's output; the kernel
    goes on, so the submission keeps its points (the row above) without a restart."""
    _, tmp, _, _ = graded
    page = (tmp / "out" / "feedback" / journal.student_key("flood") / f"{LAB}.html").read_text()
    assert "was dropped" in page and "restarted" not in page, \
        "a message over relay.MAX_MESSAGE is dropped with a notice, the kernel kept"


def test_hostile_students_changed_nothing_outside_their_sandbox(graded):
    expected, tmp, _, before = graded
    assert tree_digest(ROOT / "solutions") == before["solutions"]
    assert not (ROOT / "solutions" / "pwned.py").exists()
    assert stored_tests(tmp / "course") == before["tests"]
    rows = read_rows(tmp / "out")
    assert float(rows["full"]["score"]) == Lab().max
    page = (tmp / "out" / "feedback" / journal.student_key("gradebook") / f"{LAB}.html").read_text()
    assert "rewrote /" not in page and page.count("could not: unable to open database") == 2


def test_no_feedback_shows_a_hidden_test_or_unescaped_html(graded):
    _, tmp, _, _ = graded
    pages = list((tmp / "out" / "feedback").rglob("*.html"))
    assert len(pages) >= 15
    hidden = Lab().hidden_lines()
    snoop = (tmp / "out" / "feedback" / journal.student_key("snoop") / f"{LAB}.html").read_text()
    assert "# %% nbgrader=" not in snoop and snoop.count("FileNotFoundError") == 5
    for page in pages:
        text = page.read_text()
        for line in hidden:
            assert line not in text, f"{page} shows hidden test line {line!r}"
        assert "<script" not in text.lower()


def test_student_html_is_escaped(tmp_path):
    from course.grader.feedback import render
    from course.grader.plan import Cell
    cell = Cell("code", "<b>x</b>", outputs=[
        nbformat.v4.new_output("display_data", data={"text/html": "<script>alert(1)</script>",
                                                     "text/plain": "<script>alert(1)</script>"}),
        nbformat.v4.new_output("display_data", data={"image/png": "not base64 <script>"})])
    page = render("<img src=x onerror=alert(1)>", LAB, 1, 2, "graded", [cell])
    assert "<script" not in page and "<img src=x" not in page and "&lt;script&gt;" in page


def test_every_student_has_a_row_feedback_and_a_summary(graded):
    expected, tmp, stdout, _ = graded
    rows = read_rows(tmp / "out")
    assert sorted(rows) == sorted([*expected, "absent"])
    assert rows["absent"]["status"] == "not submitted"
    assert (tmp / "out" / "feedback" / journal.student_key("José García")
            / f"{LAB}.html").is_file()
    assert (tmp / "out" / "feedback" / journal.student_key("loud") / f"{LAB}.html"
            ).stat().st_size < 2_000_000
    jose, namesake = (tmp / "out" / "feedback" / journal.student_key(s) / f"{LAB}.html"
                      for s in ("José García", OLD_KEY))
    assert "José García" in jose.read_text() and OLD_KEY not in jose.read_text()
    assert OLD_KEY in namesake.read_text() and "José" not in namesake.read_text()
    assert f"{LAB}.ipynb (older copy; graded {LAB}-Copy1.ipynb)" in stdout
    assert "submissions per minute" in stdout and "problems:" in stdout


def test_jobs_1_gives_the_same_rows(graded, tmp_path):
    expected, tmp, _, _ = graded
    subset = ["full", "partial", "loop", "crash", "transformer", "pasted"]
    subs = tmp_path / "subs"
    for student in subset:
        shutil.copytree(tmp / "subs" / student, subs / student)
    run_grade(subs, tmp_path / "out", tmp / "course", "--jobs", "1")
    one, two = read_rows(tmp_path / "out"), read_rows(tmp / "out")
    for student in subset:
        assert one[student] == two[student]


def test_a_second_run_reuses_the_journal_and_merges(graded, tmp_path):
    expected, tmp, _, _ = graded
    before = (tmp / "out" / "grades.csv").read_text()
    proc = run_grade(tmp / "subs", tmp / "out", tmp / "course")
    assert "grading 0 submission(s)" in proc.stdout
    assert (tmp / "out" / "grades.csv").read_text() == before
    # a run over one student keeps everyone else's rows
    shard = tmp_path / "shard"
    shutil.copytree(tmp / "subs" / "blank", shard / "blank")
    run_grade(shard, tmp / "out", tmp / "course")
    assert (tmp / "out" / "grades.csv").read_text() == before


def test_shards_merge(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    grades_csv.write_csv([grades_csv.GradeRow("ann", LAB, 3, 11, "graded"),
                       grades_csv.GradeRow("bob", LAB, 5, 11, "graded")], a)
    grades_csv.write_csv([grades_csv.GradeRow("bob", LAB, 7, 11, "graded"),
                       grades_csv.GradeRow("cy", LAB, 11, 11, "graded")], b)
    proc = subprocess.run([sys.executable, "-m", "course", "grade", "--merge", str(a), str(b),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = read_rows(tmp_path / "out")
    assert {s: float(r["score"]) for s, r in rows.items()} == {"ann": 3, "bob": 7, "cy": 11}


def test_an_interrupted_run_keeps_finished_rows(graded, tmp_path, monkeypatch):
    """Students a, b finish, c interrupts the run; the next run grades only c."""
    _, tmp, _, _ = graded
    subs, out = tmp_path / "subs", tmp_path / "out"
    for student in "abc":
        write(subs, student, f"not a notebook {student}".encode(), nested=False)
    real, called = grading.grade_one, []

    def interrupted(student, *args):
        if student == "c":
            raise KeyboardInterrupt
        return real(student, *args)

    monkeypatch.setattr(grading, "grade_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=tmp / "course", jobs=1)
    assert (journal.entry_path(out, "a", LAB)).is_file()
    assert (journal.entry_path(out, "b", LAB)).is_file()

    def counted(student, *args):
        called.append(student)
        return real(student, *args)

    monkeypatch.setattr(grading, "grade_one", counted)
    rows = grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=tmp / "course", jobs=1)
    assert called == ["c"] and [r.student for r in rows] == ["a", "b", "c"]
    (subs / "b" / f"{LAB}.ipynb").write_bytes(b"changed")
    grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=tmp / "course", jobs=1)
    assert called == ["c", "b"]                     # a changed submission is graded again
    entry = journal.entry_path(out, "a", LAB)
    entry.write_text(entry.read_text().replace('"score": 0', '"score": 11'))
    grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=tmp / "course", jobs=1)
    assert called == ["c", "b"]                     # the key still matches: kept as journaled
    entry.write_text(re.sub(r'"tests_sha256": "\w+"', '"tests_sha256": "x"', entry.read_text()))
    grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=tmp / "course", jobs=1)
    assert called == ["c", "b", "a"]                # an entry for other tests: graded again
    grading.grade(subs, ROOT, out, timeout=TIMEOUT_S, course=tmp / "course", force=True, jobs=1)
    assert called[3:] == ["a", "b", "c"]


def test_a_locked_gradebook_is_a_status_not_a_crash(graded, tmp_path):
    _, tmp, _, _ = graded
    course = tmp_path / "course"
    shutil.copytree(tmp / "course", course)
    subs = tmp_path / "subs"
    shutil.copytree(tmp / "subs" / "full", subs / "full")
    lock = sqlite3.connect(course / "gradebook.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        rows = grading.grade(subs, ROOT, tmp_path / "out", timeout=TIMEOUT_S, course=course,
                             jobs=1, gradebook_wait=2)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert rows[0].score == Lab().max and "not in gradebook.db" in rows[0].status
    assert "not in gradebook.db" in read_rows(tmp_path / "out")["full"]["status"]


def test_the_outer_time_limit_records_timed_out():
    """A submission over its total time gets "timed out", and only what ran before counts."""
    from course.grader.autograde import grade_notebook
    from course.grader.grading import _status
    from course.grader.sandbox import Sandbox
    lab = Lab()
    slow = with_cell(lab.submission(set(lab.solutions)), "import time\ntime.sleep(4)")
    outcome = grade_notebook(slow, lab.source, Sandbox(ROOT), timeout=TIMEOUT_S,
                             total_timeout=2)
    assert outcome.score == 0 and _status(outcome).startswith("timed out: the submission ran")


def test_submissions_found_by_any_name(tmp_path):
    """SUBMISSIONS/submitted/<student>/<lab>/<lab>.ipynb, copies, odd folder names."""
    lab_dir = tmp_path / "submitted" / "ann" / LAB
    lab_dir.mkdir(parents=True)
    (lab_dir / f"{LAB}.ipynb").write_text("{}")
    (lab_dir / "timestamp.txt").write_text("2026-01-01 00:00:00")
    (lab_dir / "notes.txt").write_text("extra")
    (tmp_path / "submitted" / "Zoë O'Neil").mkdir()
    (tmp_path / "submitted" / "Zoë O'Neil" / f"{LAB} (2).ipynb").write_text("{}")
    (tmp_path / "submitted" / "eve").mkdir()          # a link to someone else's work
    (tmp_path / "submitted" / "eve" / f"{LAB}.ipynb").symlink_to(lab_dir / f"{LAB}.ipynb")
    students, found, notes = grading.find_submissions(tmp_path, [LAB])
    assert students == ["Zoë O'Neil", "ann", "eve"]
    zoe = tmp_path / "submitted" / "Zoë O'Neil" / f"{LAB} (2).ipynb"
    assert found == {("ann", LAB): lab_dir / f"{LAB}.ipynb", ("Zoë O'Neil", LAB): zoe}
    assert notes == {"ann": [f"{LAB}/notes.txt (not a lab notebook)"],
                     "eve": [f"{LAB}.ipynb (a symbolic link)"]}
    assert grading.lab_of(Path(f"{LAB}-Copy1.ipynb"), [LAB]) == LAB
    assert grading.lab_of(Path("01-quant-basics.ipynb"), [LAB]) is None
    keys = {journal.student_key(s) for s in ["Zoë O'Neil", "José García", "..", "a" * 100]}
    assert len(keys) == 4 and all(re.fullmatch(r"[A-Za-z0-9_.-]+", k) for k in keys)


def test_no_bubblewrap_refuses_and_says_how_to_install(monkeypatch):
    from course.grader import sandbox
    from labkit.errors import InputError
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None)
    with pytest.raises(InputError, match="apt-get install bubblewrap.*--unsafe-no-sandbox"):
        sandbox.Sandbox(ROOT).check()
    sandbox.Sandbox(ROOT, unsafe=True).check()          # refusing is the sandbox's job only


def test_unsafe_no_sandbox_still_grades_apart():
    """Without bubblewrap (--unsafe-no-sandbox) the grading itself is the same."""
    from course.grader.autograde import grade_notebook
    from course.grader.sandbox import Sandbox
    lab = Lab()
    full = lab.submission(set(lab.solutions))
    outcome = grade_notebook(full, lab.source, Sandbox(ROOT, unsafe=True), timeout=TIMEOUT_S,
                             lab=LAB)
    assert outcome.score == lab.max, [(c.test.grade_id, c.error) for c in outcome.cells
                                      if c.kind == "test" and not c.earned]
    cheat = with_cell(lab.submission(set()), attacks(Path("/nonexistent"))["transformer"])
    outcome = grade_notebook(cheat, lab.source, Sandbox(ROOT, unsafe=True), timeout=TIMEOUT_S,
                             lab=LAB)
    assert outcome.score == 0


@pytest.mark.parametrize("lab", lab_names(ROOT))
def test_feedback_of_every_lab_hides_its_hidden_tests(lab):
    """Every test cell of every lab, passed or failed in its hidden part: no hidden line."""
    from course.grader.feedback import render
    from course.grader.plan import plan
    source = source_notebook(ROOT / "solutions" / f"{lab}.py")
    release = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    cells, _ = plan(release, source)
    tests = [c for c in cells if c.kind == "test"]
    for k, cell in enumerate(tests):
        cell.status, cell.hidden_failed = ("ok", False) if k % 2 else ("error", True)
        cell.hidden_case = "a labelled case" if k % 4 == 0 else ""
        cell.error = "AssertionError: secret expected value"
    page = render("student", lab, 0, 1, "graded", cells)
    visible = "\n".join(c.source for c in cells)
    hidden = [line.strip() for c in source.cells for m in HIDDEN.finditer(c.source)
              for line in m.group(1).splitlines() if len(line.strip()) > 20]
    assert hidden, f"{lab} has no hidden tests"
    for line in hidden:
        if line not in visible:
            assert line not in page and html.escape(line) not in page, (lab, line)
    assert "secret expected value" not in page
