"""Hidden tests: every graded test has one (`course build` refuses a lab otherwise), and they
run after the learner's last cell, so no cell of the learner's can print what their code
received from a hidden test (docs/ARCHITECTURE.md, Grading). Toy labs graded as `make check`
grades them, with the hidden parts on: a few seconds each."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from support import nbgrader_cell as _cell

from course.authoring import build
from course.authoring.build import build_course, lab_names, require_hidden
from course.grader.autograde import grade_notebook
from course.grader.sandbox import Sandbox
from labkit.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ('# %% nbgrader={{"grade": false, "grade_id": "{gid}", "locked": false, '
            '"schema_version": 3, "solution": true, "task": false}}\n{code}\n\n')
TEST = ('# %% nbgrader={{"grade": true, "grade_id": "{gid}", "locked": true, "points": 1, '
        '"schema_version": 3, "solution": false, "task": false}}\n{code}\n\n')
HIDDEN = "### BEGIN HIDDEN TESTS\n# case: another input\n{code}\n### END HIDDEN TESTS"


def test_build_refuses_a_graded_test_without_a_hidden_part(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "generate_assignments", lambda *a, **k: pytest.fail(
        "the build went on to nbgrader with graded tests that have no hidden part"))
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "00-toy.py").write_text(
        SOLUTION.format(gid="f", code="def f(x):\n    return x + 1")
        + TEST.format(gid="test_hidden", code="assert f(1) == 2\n"
                      + HIDDEN.format(code="assert f(2) == 3"))
        + TEST.format(gid="test_bare", code="assert f(3) == 4")
        + TEST.format(gid="test_empty", code="assert f(4) == 5\n" + HIDDEN.format(code="")
                      .replace("# case: another input\n", "")))
    with pytest.raises(InputError) as refused:
        build_course(tmp_path)
    message = str(refused.value)
    assert "solutions/00-toy.py: test_bare, test_empty" in message, message
    assert "test_hidden" not in message, message


def test_every_lab_has_a_hidden_part_in_every_graded_test():
    require_hidden(ROOT, lab_names(ROOT))


def _test(name: str, visible: str, hidden: str, student: bool = False):
    """A test cell of the source (with its hidden part) or, for `student`, of the release."""
    return _cell(visible if student else visible + "\n" + HIDDEN.format(code=hidden) + "\n",
                 f"test_{name}", test=True)


def _grade(source_cells: list, student_cells: list):
    out = grade_notebook(nbformat.v4.new_notebook(cells=student_cells),
                         nbformat.v4.new_notebook(cells=source_cells),
                         Sandbox(ROOT, unsafe=True, own_env=True), timeout=60)
    return out, {c.test.grade_id: c for c in out.cells if c.kind == "test"}


def _printed(cells) -> str:
    return "".join(str(o.get("text", "")) + str(o.get("data", "")) + str(o.get("traceback", ""))
                   for c in cells for o in c.outputs)


# f's and g's tests: the hidden part checks another input, and that it runs in the namespace
# its own visible part left (test_g's visible part rebinds _k before test_f's hidden part runs)
TEST_F = ('_k = "f"\nassert f(1) == 2, "f(1) must be 2"',
          'assert _k == "f", f"test_f\'s hidden part sees _k = {_k!r}"\nassert f(41) == 42')
TEST_G = ('_k = "g"\nassert g(2) == 4, "g(2) must be 4"',
          'assert _k == "g", f"test_g\'s hidden part sees _k = {_k!r}"\nassert g(50) == 100')


@pytest.mark.notebooks
def test_hidden_inputs_reach_no_cell_of_the_learner():
    """The learner's f records every input it gets and prints it; their last cell prints the
    record: it holds the visible input only, and no output holds a hidden one."""
    f = ("CALLS = []\n\ndef f(x):\n    CALLS.append(x)\n    print('f got', x)\n"
         "    return x + 1")
    source = [_cell("import math"), _cell("def f(x):\n    return x + 1", "f"), _test("f", *TEST_F),
              _cell("def g(x):\n    return 2 * x", "g"), _test("g", *TEST_G)]
    student = [source[0], _cell(f, "f"), _test("f", *TEST_F, student=True), source[3],
               _test("g", *TEST_G, student=True), _cell("print('requests:', CALLS)")]
    out, tests = _grade(source, student)
    assert [t.earned for t in tests.values()] == [1, 1], \
        [(t.test.grade_id, t.status, t.error) for t in tests.values()]
    assert "f got 1" in _printed([tests["test_f"]]), "the visible call's printing is shown"
    assert "requests: [1]\n" in _printed(out.cells[-1:]), \
        f"the learner's last cell ran after a hidden test: {_printed(out.cells[-1:])!r}"
    for hidden in ("41", "50"):
        assert hidden not in _printed(out.cells) + " ".join(out.notes), \
            f"the hidden input {hidden} reached the feedback: {_printed(out.cells)!r}"


@pytest.mark.notebooks
def test_hidden_tests_survive_restarts_and_crash_unnamed():
    """A restart after a test's visible part (its objects gone): the test's hidden part still
    runs and passes. A crash in a hidden call: that test earns nothing, the note names no exit
    status (the learner's code chose it, and could spell a hidden input with it), and the
    tests after it still run."""
    h = ("def h(x):\n    return x", "h")
    source = [_cell("import os"), _cell("def f(x):\n    return x + 1", "f"), _test("f", *TEST_F),
              _cell("def g(x):\n    return 2 * x", "g"), _test("g", *TEST_G), _cell(*h),
              _test("h", "assert h(3) == 3", "assert h(60) == 60")]
    g = "def g(x):\n    if x == 50:\n        os._exit(9)\n    return 2 * x"
    student = [*source[:2], _test("f", *TEST_F, student=True), _cell("os._exit(3)"),
               _cell(g, "g"), _test("g", *TEST_G, student=True), _cell(*h),
               _test("h", "assert h(3) == 3", "", student=True)]
    out, tests = _grade(source, student)
    assert {g: t.earned for g, t in tests.items()} == {"test_f": 1, "test_g": 0, "test_h": 1}, \
        [(t.test.grade_id, t.status, t.error, out.notes) for t in tests.values()]
    assert tests["test_g"].hidden_failed and tests["test_g"].hidden_case == "another input"
    assert any("(test test_g) ended the kernel in its hidden tests" in n for n in out.notes), \
        out.notes
    assert any("status 3" in n for n in out.notes), out.notes      # a cell's own crash: named
    assert not any("status 9" in n for n in out.notes), out.notes
