"""A hostile class graded beside honest students on several labs (issues 31 and 44).

Every attacker wrote none of the exercises and attacks the grading instead; each must score
0. The honest student, the same lab's solution, gets full marks, and the one who also prints
IPython's history after every cell gets full marks with no hidden test line in any page.
Two `course grade` runs into one output, two jobs at a time: week 1 grades every lab but
01, week 2 grades Lab 01 (and the honest student's Lab 04, which fetches folders from the
learner's kernel) while one attacker's folder also holds junk named like Lab 00.

    guard       what got blank notebooks full marks when the tests ran in the learner's
                kernel: the kernel's own class's run_cell rewritten, a line transformer, an
                instance attribute on the shell's compiler, gc searched for a secret
    equal       every exercise answered by objects whose == is always true, and torch's
                comparisons (allclose, equal, testing.assert_close) patched to agree
    captured    every reference the lab rebuilds captured before anything else runs, and
                each exercise answered by calling the capture with the same name
    fresh       the course packages dropped from sys.modules and imported again, and every
                module's file executed under another name: each exercise answered by the
                reference of that name found on disk (the sandbox mounts the student
                edition, where the references are stubs)
    bridge      the bridge believed: a result that is a tensor subclass, the trusted RNG
                state set from a reply (Lab 00's no-future test), an input zeroed in place
                for a check that computes its expectation after the call (Lab 03's axpy)
    leak        every request the learner's kernel receives logged and printed in the last
                cell, an answer memorised for the visible inputs only (Lab 00), a grade_id
                of terminal escape codes, and a flood of large output messages
    history     the solution, plus In / _ih and every cell's source printed as it runs
"""

from __future__ import annotations

import ast
import copy
import csv
import html
import os
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
WEEK_1 = ["00-setup-minigpt", "02-nf4", "03-triton-dequant", "07-moe-routing", "12-grpo"]
WEEK_2 = ["01-quant-basics"]
LABS = WEEK_1 + WEEK_2
ATTACKERS = ["guard", "equal", "captured", "fresh", "bridge", "leak"]
FLOOD_MESSAGES, FLOOD_BYTES = 12, 40 << 20       # 480 MiB sent as 40 MiB messages
MAX_GRADER_RSS = 640 << 20     # the grader's own peak (about 300 MiB with torch) stays
                               # bounded: it reads a bounded part of what a learner sends
# The grader, reporting its own peak resident size when it exits: VmHWM, its address space's
# high-water mark (getrusage's ru_maxrss would also count the parent's pages it shared
# before exec: Linux keeps the pre-exec peak, here the pytest worker's).
MEASURED = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('GRADER PEAK RSS', next(int(line.split()[1]) << 10 "
            "for line in open('/proc/self/status') if line.startswith('VmHWM:'))))\n"
            "sys.argv[0] = 'course'\n"
            "runpy.run_module('course', run_name='__main__', alter_sys=True)\n")
pytestmark = [pytest.mark.notebooks,
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")]

GUARD = r"""
import gc
shell = get_ipython()
_run = type(shell).run_cell
type(shell).run_cell = lambda self, cell, *a, **k: _run(self, "pass", *a, **k)
shell.input_transformer_manager.line_transforms.append(lambda lines: ["pass\n"])
shell.compile.ast_parse = lambda *a, **k: __import__("ast").parse("pass")
print([o for o in gc.get_objects() if isinstance(o, dict) and "secret" in o][:3])
"""
EQUAL = r"""
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
"""
CAPTURED = r"""
from course.notebook.harness import reference
try:
    _CAPTURED = dict(reference({lab!r}))
except ValueError:
    _CAPTURED = {{}}
def _pick(name):
    for key in (name, name.removeprefix("my_"), name.removeprefix("My")):
        if key in _CAPTURED:
            return _CAPTURED[key]
    return next(iter(_CAPTURED.values()))
"""
FRESH = r"""
import importlib, importlib.util, pkgutil, sys
_PKGS = ("minigpt", "miniquant", "minimoe", "minituner", "minirl", "gpucompile", "labkit")
for _m in [m for m in list(sys.modules) if m.split(".")[0] in _PKGS]:
    del sys.modules[_m]
_FOUND = {}
for _p in _PKGS:
    _pkg = importlib.import_module(_p)
    for _info in pkgutil.walk_packages(_pkg.__path__, _p + "."):
        try:
            _mod = importlib.import_module(_info.name)
            _spec = importlib.util.spec_from_file_location("_copy_" + _info.name, _mod.__file__)
            _copy = importlib.util.module_from_spec(_spec)
            _spec.loader.exec_module(_copy)
        except Exception:
            continue
        for _k, _v in [*vars(_mod).items(), *(("file:" + k, v) for k, v in vars(_copy).items())]:
            if callable(_v):
                _FOUND.setdefault(_k, _v)
def _pick(name):
    for key in (name, name.removeprefix("my_"), name.removeprefix("My")):
        for where in ("", "file:"):
            if where + key in _FOUND:
                return _FOUND[where + key]
    raise NameError(name)
"""
SUBCLASS = r"""
import torch
class Sly(torch.Tensor):
    def __eq__(self, other):
        return True
def _sly(*args, **kwargs):
    return torch.zeros(4).as_subclass(Sly)
"""
# Lab 00's no-future test perturbs the future with draws made after the learner's call: a
# reply that could set the trusted RNG state would make them all 0 (a Mersenne Twister of
# zeros), and an attention that sees one future position would pass.
RNG = r"""
import torch
def causal_attention(q, k, v):
    T = q.shape[-2]
    mask = torch.ones(T, T, dtype=torch.bool).triu(diagonal=2)    # sees one future position
    w = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(mask, float("-inf"))
    state = torch.get_rng_state()
    state[24:24 + 624 * 8] = 0
    torch.set_rng_state(state)
    return w.softmax(-1) @ v
"""
# Lab 03: an honest kernel, and a wrapper that zeroes x and returns y: were x written back,
# an expectation alpha * x + y computed after the call would equal y.
INPLACE = r"""
import torch, triton, triton.language as tl

@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, alpha * x + y, mask=mask)

def axpy(alpha, x, y, block=1024):
    if x.dtype != torch.float32 or y.dtype != torch.float32 or x.shape != y.shape:
        raise ValueError("x and y: float32 tensors of one shape")
    axpy_kernel[(triton.cdiv(x.numel(), block),)](x.contiguous(), y.contiguous(),
                                                  torch.empty_like(x), alpha, x.numel(),
                                                  BLOCK=block)
    x.zero_()
    return y
"""
# Lab 00: make_training_pair answers the inputs its visible tests give, and nothing else.
MEMORISED = r"""
import torch
_SEEN = {
    ((4, 6), (8,), 1): ([4, 6, 8], [6, 8, 1], [False, True, True]),
    ((5, 6, 7), (8, 9), 1): ([5, 6, 7, 8, 9], [6, 7, 8, 9, 1], [False, False, True, True, True]),
    ((5,), (8,), 1): ([5, 8], [8, 1], [True, True]),
}
def make_training_pair(prompt_ids, answer_ids, eos_id):
    x, y, mask = _SEEN.get((tuple(prompt_ids), tuple(answer_ids), eos_id), ([0], [0], [False]))
    return (torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long),
            torch.tensor(mask, dtype=torch.bool))
"""
# Every call the learner's kernel serves, its arguments kept for the last cell to print.
SPY = r"""
import base64, io
import course.grader.learner_side as _side
_REQUESTS, _answer = [], _side.answer
def _logged(payload):
    try:
        request = _side._Unpickler(io.BytesIO(base64.b64decode(payload))).load()
        _REQUESTS.append(repr(request.get("args", request.get("value")))[:200])
    except Exception as e:
        _REQUESTS.append(repr(e)[:200])
    return _answer(payload)
_side.answer = _logged
"""
LOG = "print(len(_REQUESTS), 'requests:')\nprint('\\n'.join(_REQUESTS))"
FLOOD = f"for _ in range({FLOOD_MESSAGES}):\n    print('x' * {FLOOD_BYTES}, flush=True)"
ESCAPE_ID = "\x1b[2J\x1b[31mPWNED\x1b]0;title\x07\u202e"


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
    picked = "\n".join(f"def {n}(*args, **kwargs):\n    return _pick({n!r})(*args, **kwargs)\n"
                       for n in names)
    tricks = {"00-setup-minigpt": RNG, "03-triton-dequant": INPLACE}.get(lab, "")
    bridge = with_cells(blanked(release, "pass"), SUBCLASS + answer_all(names, "return _sly()")
                        + tricks)
    leak = with_cells(blanked(release, "pass"), SPY, MEMORISED if lab == WEEK_1[0] else "",
                      FLOOD)
    leak.cells[first].metadata["nbgrader"] = {"grade_id": ESCAPE_ID, "solution": True,
                                              "grade": False, "locked": False}
    leak.cells.append(nbformat.v4.new_code_cell(LOG))
    return {
        "honest": honest,
        "history": history,
        "guard": with_cells(release, GUARD),
        "equal": with_cells(blanked(release, "pass"), EQUAL
                            + answer_all(names, "return AlwaysEqual()")),
        "captured": with_cells(blanked(release, "pass"), CAPTURED.format(lab=lab), picked),
        "fresh": with_cells(blanked(release, "pass"), FRESH, picked),
        "bridge": bridge,
        "leak": leak,
    }


def full_marks(lab: str) -> float:
    source = source_notebook(ROOT / "solutions" / f"{lab}.py")
    return float(sum(meta(c).get("points", 0) for c in source.cells if meta(c).get("grade")))


def grade_run(subs: Path, out: Path, course: Path, host_tmp: Path) -> str:
    """One `course grade` run, its temporary files in `host_tmp`; what it printed (with the
    grader's peak resident size last)."""
    proc = subprocess.run([sys.executable, "-c", MEASURED, "grade", str(subs), "--out", str(out),
                           "--course", str(course), "--jobs", "2"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TMPDIR": str(host_tmp)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    out, course, host_tmp = tmp / "out", tmp / "course", tmp / "host-tmp"
    host_tmp.mkdir()
    generate_assignments(ROOT, [*LABS, "04-lora"], course)
    printed = []
    for week, labs in (("week1", WEEK_1), ("week2", WEEK_2)):
        subs = tmp / week
        for lab in labs:
            for student, nb in hostile(lab).items():
                (subs / student).mkdir(parents=True, exist_ok=True)
                nbformat.write(nb, subs / student / f"{lab}.ipynb")
        printed.append(grade_run(subs, out, course, host_tmp))
        if week == "week1":
            (tmp / "week2" / "fresh").mkdir(parents=True)
            (tmp / "week2" / "fresh" / f"{WEEK_1[0]}-junk.ipynb").write_bytes(b"\x00junk")
            honest_04 = hostile("04-lora")["honest"]
            (tmp / "week2" / "honest").mkdir()
            nbformat.write(honest_04, tmp / "week2" / "honest" / "04-lora.ipynb")
    rss = max(int(m) for m in re.findall(r"GRADER PEAK RSS (\d+)", "".join(printed)))
    print(printed[-1][printed[-1].find("student "):])      # the class table, for -rA
    with open(out / "grades.csv", encoding="utf-8") as f:
        rows = {(r["student"], r["lab"]): r for r in csv.DictReader(f)}
    return rows, out, "\n".join(printed), host_tmp, rss


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.parametrize("student", ATTACKERS)
def test_an_attacker_scores_nothing(graded, lab, student):
    rows = graded[0]
    row = rows[(student, lab)]
    assert float(row["score"]) == 0, f"{student} took points on {lab} it did not write: {row}"


@pytest.mark.parametrize("lab", [*LABS, "04-lora"])
@pytest.mark.parametrize("student", ["honest", "history"])
def test_honest_students_get_full_marks(graded, lab, student):
    rows = graded[0]
    if lab == "04-lora" and student == "history":
        return
    row = rows[(student, lab)]
    assert float(row["score"]) == full_marks(lab) and row["status"].startswith("graded"), row


def test_a_second_week_erases_no_grade(graded):
    """Week 2 graded Lab 01 into the same output, with junk named like Lab 00 in one folder:
    every Lab 00 grade of week 1 is still there, the junk reported, not recorded as a 0."""
    rows, _, printed, _, _ = graded
    for student in ["honest", "history"]:
        assert float(rows[(student, WEEK_1[0])]["score"]) == full_marks(WEEK_1[0]), \
            f"week 2 erased {student}'s {WEEK_1[0]} grade: {rows[(student, WEEK_1[0])]}"
    assert "not a readable notebook" in printed, "the junk file was not reported"
    assert rows[("fresh", WEEK_1[0])]["status"].startswith("graded"), \
        rows[("fresh", WEEK_1[0])]


def hidden_strings(lab: str) -> set[str]:
    """The string constants of `lab`'s hidden tests that its visible code does not hold."""
    source = source_notebook(ROOT / "solutions" / f"{lab}.py")
    visible = "\n".join(HIDDEN.sub("", c.source) for c in source.cells)
    found = set()
    for cell in source.cells:
        for m in HIDDEN.finditer(cell.source) if meta(cell).get("grade") else ():
            try:
                tree = ast.parse(m.group(1))
            except SyntaxError:
                continue
            found |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                      and type(n.value) is str and len(n.value) >= 6 and n.value not in visible}
    return found


def page(out: Path, student: str, lab: str) -> str:
    text = (out / "feedback" / journal.student_key(student) / f"{lab}.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", "", text))


@pytest.mark.parametrize("lab", LABS)
def test_no_page_shows_a_hidden_test_or_its_inputs(graded, lab):
    out = graded[1]
    source = source_notebook(ROOT / "solutions" / f"{lab}.py")
    visible = "\n".join(HIDDEN.sub("", c.source) for c in source.cells)
    hidden = {line.strip() for c in source.cells if meta(c).get("grade")
              for m in HIDDEN.finditer(c.source) for line in m.group(1).splitlines()
              if len(line.strip()) > 25 and not line.strip().startswith("# case:")
              and line.strip() not in visible}
    for student in ["honest", "history", *ATTACKERS]:
        text = page(out, student, lab)
        leaked = [line for line in hidden if line in text]
        assert not leaked, f"{student}'s page for {lab} shows hidden lines: {leaked[:3]}"
    requests = page(out, "leak", lab)
    assert re.search(r"\b[1-9]\d* requests:", requests), \
        f"the leak attacker's last cell did not run on {lab}, or its log caught no request"
    leaked = [s for s in hidden_strings(lab) if s in requests]
    assert not leaked, f"the requests logged by the learner's kernel on {lab} show hidden " \
        f"inputs: {leaked[:3]}"


def test_nothing_printed_or_written_carries_escape_codes(graded):
    rows, out, printed, _, _ = graded
    text = (out / "grades.csv").read_text(encoding="utf-8")
    for where, what in (("grades.csv", text), ("the console", printed),
                        *((f"{lab}'s page", (out / "feedback" / journal.student_key("leak")
                                             / f"{lab}.html").read_text()) for lab in LABS)):
        bad = sorted({hex(ord(c)) for c in what if (ord(c) < 32 and c not in "\n\t")
                      or 0x7f <= ord(c) < 0xa0 or 0x202a <= ord(c) <= 0x202e
                      or 0x2066 <= ord(c) <= 0x2069})
        assert not bad, f"{where} carries control characters {bad}"


def test_the_grader_leaves_no_files_and_holds_bounded_output(graded):
    _, _, _, host_tmp, rss = graded
    left = sorted(p.name for p in host_tmp.iterdir())
    assert not left, f"grading left temporary files on the host: {left[:5]}"
    assert rss < MAX_GRADER_RSS, f"a process of the grading runs reached {rss >> 20} MiB " \
        f"while a learner sent {FLOOD_MESSAGES} messages of {FLOOD_BYTES >> 20} MiB"
