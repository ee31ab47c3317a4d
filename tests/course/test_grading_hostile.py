"""A hostile class graded beside honest students on several labs (issue 31's families).

Every attacker wrote none of the exercises and attacks the grading instead, from inside its
kernel; each must score 0, with status plain "graded" (nothing to review: the attacks have
no effect on a verdict). The honest student, the same lab's solution, gets full marks, and
the one who also prints IPython's history after every cell gets full marks with no hidden
test line in any page. One `course grade` run, two jobs at a time.

    guard       what got blank notebooks full marks when the tests ran in the learner's
                kernel: the kernel's own class's run_cell rewritten, a line transformer, an
                instance attribute on the shell's compiler, gc searched for a secret
    equal       every exercise answered by objects whose == is always true, and torch's
                comparisons (allclose, equal, testing.assert_close) patched to agree
    captured    every reference the lab rebuilds captured before anything else runs, and
                each exercise answered by calling the capture with the same name
    history     the solution, plus In / _ih and every cell's source printed as it runs
"""

from __future__ import annotations

import copy
import csv
import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import generate_assignments, source_notebook
from course.grader import journal
from course.grader.tests_setup import HIDDEN, learner_names, meta

ROOT = Path(__file__).resolve().parents[2]
LABS = ["00-setup-minigpt", "01-quant-basics", "02-nf4", "07-moe-routing", "12-grpo"]
pytestmark = [pytest.mark.notebooks,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")]

GUARD = r'''
import gc
shell = get_ipython()
_run = type(shell).run_cell
type(shell).run_cell = lambda self, cell, *a, **k: _run(self, "pass", *a, **k)
shell.input_transformer_manager.line_transforms.append(lambda lines: ["pass\n"])
shell.compile.ast_parse = lambda *a, **k: __import__("ast").parse("pass")
print([o for o in gc.get_objects() if isinstance(o, dict) and "secret" in o][:3])
'''
EQUAL = r'''
import torch
class AlwaysEqual(list):
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __hash__ = None
    def __getattr__(self, name):
        return AlwaysEqual()
    def __call__(self, *a, **k):
        return AlwaysEqual()
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
'''
CAPTURED = r'''
from course.notebook.harness import reference
_CAPTURED = dict(reference({lab!r}))
def _pick(name):
    for key in (name, name.removeprefix("my_"), name.removeprefix("My")):
        if key in _CAPTURED:
            return _CAPTURED[key]
    return next(iter(_CAPTURED.values()))
'''


def answer_all(names: list[str], body: str) -> str:
    """Definitions of every learner name: a function (or class) doing `body`."""
    return "\n".join(f"def {n}(*args, **kwargs):\n    {body}\n" for n in names)


def hostile(lab: str) -> dict[str, object]:
    """{student: notebook} for `lab`: the honest ones and the attackers."""
    source = source_notebook(ROOT / "solutions" / f"{lab}.py")
    release = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    names = learner_names(source)
    first = next(i for i, c in enumerate(release.cells) if meta(c).get("solution"))

    def with_cells(nb, *codes, at=first):
        nb = copy.deepcopy(nb)
        for code in reversed(codes):
            nb.cells.insert(at, nbformat.v4.new_code_cell(code))
        return nb

    def blanked(nb, code):       # every solution cell replaced by `code`
        nb = copy.deepcopy(nb)
        for cell in nb.cells:
            if meta(cell).get("solution"):
                cell.source = code
        return nb

    honest = copy.deepcopy(release)       # the release with every solution cell filled in
    solutions = {meta(c)["grade_id"]: c for c in source.cells if meta(c).get("solution")}
    for i, cell in enumerate(honest.cells):
        if meta(cell).get("solution"):
            honest.cells[i] = copy.deepcopy(solutions[meta(cell)["grade_id"]])
    history = with_cells(honest, "get_ipython().events.register('pre_run_cell', lambda info: "
                                 "print('NEXT CELL:', info.raw_cell))", at=1)
    history.cells.append(nbformat.v4.new_code_cell("print(In)\nprint(_ih)"))
    return {
        "honest": honest,
        "history": history,
        "guard": with_cells(release, GUARD),
        "equal": with_cells(blanked(release, "pass"), EQUAL
                            + answer_all(names, "return AlwaysEqual()"), at=len(release.cells)),
        "captured": with_cells(blanked(release, "pass"), CAPTURED.format(lab=lab), "\n".join(
            f"def {n}(*args, **kwargs):\n    return _pick({n!r})(*args, **kwargs)\n"
            for n in names), at=first),
    }


def full_marks(lab: str) -> float:
    source = source_notebook(ROOT / "solutions" / f"{lab}.py")
    return float(sum(meta(c).get("points", 0) for c in source.cells if meta(c).get("grade")))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    subs, out, course = tmp / "subs", tmp / "out", tmp / "course"
    for lab in LABS:
        for student, nb in hostile(lab).items():
            (subs / student).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, subs / student / f"{lab}.ipynb")
    generate_assignments(ROOT, LABS, course)
    proc = subprocess.run([sys.executable, "-m", "course", "grade", str(subs), "--out", str(out),
                           "--course", str(course), "--jobs", "2"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[proc.stdout.find("student "):])      # the class table, for -rA
    with open(out / "grades.csv", encoding="utf-8") as f:
        rows = {(r["student"], r["lab"]): r for r in csv.DictReader(f)}
    return rows, out


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.parametrize("student", ["guard", "equal", "captured"])
def test_an_attacker_scores_nothing(graded, lab, student):
    rows, _ = graded
    row = rows[(student, lab)]
    assert float(row["score"]) == 0 and row["status"] == "graded", row


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.parametrize("student", ["honest", "history"])
def test_honest_students_get_full_marks(graded, lab, student):
    rows, _ = graded
    row = rows[(student, lab)]
    assert float(row["score"]) == full_marks(lab) and row["status"] == "graded", row


@pytest.mark.parametrize("lab", LABS)
def test_no_page_shows_a_hidden_test_or_its_inputs(graded, lab):
    _, out = graded
    source = source_notebook(ROOT / "solutions" / f"{lab}.py")
    visible = "\n".join(HIDDEN.sub("", c.source) for c in source.cells)
    hidden = {line.strip() for c in source.cells if meta(c).get("grade")
              for m in HIDDEN.finditer(c.source) for line in m.group(1).splitlines()
              if len(line.strip()) > 25 and not line.strip().startswith("# case:")
              and line.strip() not in visible}
    for student in hostile(lab):
        page = html.unescape(re.sub(r"<[^>]+>", "", (
            out / "feedback" / journal.student_key(student) / f"{lab}.html").read_text()))
        leaked = [line for line in hidden if line in page]
        assert not leaked, f"{student}'s page for {lab} shows hidden lines: {leaked[:3]}"
