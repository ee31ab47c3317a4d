"""Which of the instructor's ordinary cells the trusted test kernel runs (`setup_cells`).

The learner's kernel runs every cell of their notebook; the trusted kernel runs only what its
tests need: the cells that import, and the cells that define a name a test (or such a cell)
reads. A demo that defines nothing a test reads would only repeat, in the trusted kernel,
work the learner's kernel already did.
"""

from __future__ import annotations

import nbformat

from course.grader.tests_setup import setup_cells


def _cell(source: str, **nbgrader) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    if nbgrader:
        cell.metadata["nbgrader"] = nbgrader
    return cell


def _lab(*cells) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=list(cells))


SOLUTION = dict(solution=True, grade=False, grade_id="double")
TEST = dict(solution=False, grade=True, grade_id="test_double", points=1)


def test_imports_and_what_the_tests_read_run_demos_do_not():
    lab = _lab(
        _cell("import torch\nfrom course.notebook import harness"),        # 0 imports
        _cell("print('a demo of the data')\nfor i in range(3):\n    print(i)"),  # 1 demo
        _cell("SIZE = 4"),                                                  # 2 read by 3
        _cell("def make(n=SIZE):\n    return torch.arange(n)"),             # 3 read by a test
        _cell("UNUSED = make(9)"),                                          # 4 nobody reads
        _cell("def double(x):\n    return 2 * x", **SOLUTION),              # 5 the learner's
        _cell("shown = double(make())\nprint(shown)"),                      # 6 demo of theirs
        _cell("want = 2 * make()"),                                         # 7 read by a test
        _cell("assert (double(make()) == want).all()", **TEST),             # 8
    )
    assert setup_cells(lab) == [0, 2, 3, 7]


def test_a_demo_of_the_learners_code_runs_when_a_test_reads_what_it_defines():
    lab = _lab(
        _cell("import torch"),
        _cell("def double(x):\n    return 2 * x", **SOLUTION),
        _cell("result = double(torch.ones(2))\nprint(result)"),             # 2 read below
        _cell("assert result.tolist() == [2.0, 2.0]", **TEST),
    )
    assert setup_cells(lab) == [0, 2]


def test_the_latest_definition_above_the_reader_is_the_one_that_runs():
    lab = _lab(
        _cell("import torch"),
        _cell("LIMIT = 1"),                                                 # shadowed
        _cell("LIMIT = 2"),
        _cell("def double(x):\n    return 2 * x", **SOLUTION),
        _cell("assert double(LIMIT) == 4", **TEST),
        _cell("LIMIT = 3"),                                                 # below the test
    )
    assert setup_cells(lab) == [0, 2]


def test_an_import_cell_that_names_the_learners_code_and_a_jupyter_only_cell_do_not_run():
    only = _cell("import ipywidgets\nipywidgets.IntSlider()")
    only.metadata["tags"] = ["jupyter-only"]
    lab = _lab(
        _cell("import torch"),
        _cell("def double(x):\n    return 2 * x", **SOLUTION),
        _cell("import math\nprint(double(math.pi))"),                       # reads theirs
        only,
        _cell("assert double(1) == 2", **TEST),
    )
    assert setup_cells(lab) == [0]
