"""A test cell that fails half way (the learner's code crashed its kernel, or an assertion)
keeps the helpers it defines below the failure (tests_setup.definitions), so the tests of
later exercises still run; a toy lab graded as `make check` grades it."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from support import nbgrader_cell as _cell

from course.grader.autograde import grade_notebook
from course.grader.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.notebooks


def _lab(f_body: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=[
        _cell("import math"),
        _cell(f"def f(x):\n{f_body}", "f"),
        _cell("assert f(1) == 1, 'f(1) must be 1'\n\n"
              "def _twice(x):\n    return 2 * x\n\nLIMIT = 3", "test_f", test=True),
        _cell("def g(x):\n    return x + x", "g"),
        _cell("assert g(2) == _twice(2) and LIMIT == 3", "test_g", test=True),
    ])


@pytest.mark.parametrize("f_body, error", [
    ("    import os\n    os._exit(7)", "your code crashed while this test ran it"),
    ("    return 2", "AssertionError: f(1) must be 1"),
])
def test_helpers_below_a_failure_reach_later_tests(f_body, error):
    source, student = _lab("    return x"), _lab(f_body)
    out = grade_notebook(student, source, Sandbox(ROOT, unsafe=True, own_env=True),
                         timeout=60, hidden=False)
    tests = {c.test.grade_id: c for c in out.cells if c.kind == "test"}
    assert tests["test_f"].earned == 0 and error in tests["test_f"].error, tests["test_f"].error
    assert tests["test_g"].earned == 1, f"test_g: {tests['test_g'].error}"
