"""`course check LAB`: a learner runs the visible tests of their notebook (lab 00, ~20 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course.authoring import exercises
from course.authoring.build import graded_test_cells, lab_names, source_notebook

ROOT = Path(__file__).resolve().parents[2]
LAB = "00-setup-minigpt"
pytestmark = pytest.mark.notebooks


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "course", "check", *args],
                          capture_output=True, text=True, cwd=ROOT)


def release_test_ids() -> list[str]:
    nb = nbformat.read(ROOT / "labs" / LAB / f"{LAB}.ipynb", as_version=4)
    return [c.metadata.nbgrader.grade_id for c in graded_test_cells(nb)]


def test_the_release_fails_every_test(checkout):
    proc = check(LAB, "--root", str(checkout))    # no copy in work/: the blank release
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"checking the blank release labs/{LAB}/{LAB}.ipynb" in proc.stdout
    for grade_id in release_test_ids():
        assert f"FAIL  {grade_id} " in proc.stdout, proc.stdout
    assert "PASS" not in proc.stdout
    assert "it calls an exercise you have not finished\n        NotImplementedError" \
        in proc.stdout and "your own cell failed" not in proc.stdout, proc.stdout
    assert not (checkout / "work" / "mine").exists()      # nothing of the blank release saved


def test_the_solution_passes_every_test(tmp_path, checkout):
    notebook = tmp_path / "mine.ipynb"
    nbformat.write(source_notebook(ROOT / "solutions" / f"{LAB}.py"), notebook)
    before = notebook.read_bytes()
    proc = check(LAB, "--notebook", str(notebook), "--root", str(checkout))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for grade_id in release_test_ids():
        assert f"PASS  {grade_id} " in proc.stdout, proc.stdout
    assert notebook.read_bytes() == before          # the learner's file is never written
    # ... but its definitions are saved for `use("mine")`, with the tests that passed
    record = json.loads((checkout / "work" / "mine" / f"{LAB}.json").read_text())
    assert record["passed"] == sorted(release_test_ids()) and record["failed"] == []
    assert "def make_training_pair" in (checkout / "work" / "mine" / f"{LAB}.py").read_text()
    assert f"saved to work/mine/{LAB}.py" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["99-nope"], "unknown lab '99-nope'"),
    ([LAB, "--notebook", "no/such.ipynb"], "--notebook"),
])
def test_bad_input_exits_2(args, message):
    proc = check(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_check_kernel_starts_quietly(tmp_path, capfd):
    """Neither ipykernel's warning about unencrypted TCP (the kernel's own stderr) nor
    bitsandbytes' about its optional CPU kernels (a cell's output) reaches the learner."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import logging\nimport bitsandbytes\n"
                                          "logging.getLogger('bitsandbytes.backends.cpu.ops')"
                                          ".warning('other warnings still show')")]
    exercises.test_results(nb, tmp_path)
    shown = capfd.readouterr().err + "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert "without encryption" not in shown, "start the kernel with CurveZMQ keys"
    assert "gemm_4bit_forward" not in shown, "filter bitsandbytes' warning at its logger"
    assert "other warnings still show" in shown, "filter that one warning, not the logger"


def test_a_crash_and_a_failing_cell_are_named_and_cost_only_themselves(tmp_path, checkout):
    """A segfault while a test calls the learner's code names the test and says what a
    segfault usually is; the tests after it still run; an assertion failing in an ordinary
    cell (the capstone checks its run that way) fails the check with its whole message."""
    nb = source_notebook(ROOT / "solutions" / f"{LAB}.py")
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "tokenizer":
            cell.source = cell.source.replace("    ids = []\n",
                                              "    import ctypes; ctypes.string_at(0)\n", 1)
    nb.cells.append(nbformat.v4.new_code_cell(
        "assert 1 == 2, 'your run left the reference by 14.3 %; expected 0, got 0.143'"))
    nb.cells += [nbformat.v4.new_code_cell(f"import os\nos._exit({k})") for k in (3, 4, 5, 6)]
    notebook = tmp_path / "mine.ipynb"
    nbformat.write(nb, notebook)
    proc = check(LAB, "--notebook", str(notebook), "--root", str(checkout))
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    assert "(test test_encode) ended the kernel: your code crashed while this test ran it: the " \
           "Python process crashed (a segfault is usually an out-of-range load or store in a " \
           "Triton kernel)" in out, out
    assert "FAIL  test_encode " in out and "PASS  test_make_training_pair " in out, out
    assert "PASS  test_state_dict_sha256 " in out, out      # after the crash and the cap
    assert "3 restarts used up" in out, out
    assert "your own cell failed\n        AssertionError: your run left the reference " \
           "by 14.3 %; expected 0, got 0.143" in out, out


def test_a_jupyter_only_cell_is_not_run_while_graded(tmp_path, checkout):
    """A cell the release tags jupyter-only (it calls what is a stub while graded) is left
    out, matched by id or by its code; the same failure in a cell of the learner's fails."""
    release_path = checkout / "labs" / LAB / f"{LAB}.ipynb"
    release = nbformat.read(release_path, as_version=4)
    demo = nbformat.v4.new_code_cell("raise RuntimeError('the library is a stub here')",
                                     metadata={"tags": ["jupyter-only"]}, id="demo")
    release.cells.append(demo)
    nbformat.write(release, release_path)
    nb = source_notebook(ROOT / "solutions" / f"{LAB}.py")
    nb.cells += [nbformat.v4.new_code_cell("raise RuntimeError('edited')", id="demo"),
                 nbformat.v4.new_code_cell(demo.source, id="pasted"),
                 nbformat.v4.new_code_cell("raise RuntimeError('mine')")]
    notebook = tmp_path / "mine.ipynb"
    nbformat.write(nb, notebook)
    proc = check(LAB, "--notebook", str(notebook), "--root", str(checkout))
    n = len([c for c in nb.cells if c.cell_type in ("code", "markdown")])
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    # the lab's own jupyter-only cells, then these two
    assert f", {n - 2}, {n - 1} run in Jupyter only, not here" in out, out
    assert f"FAIL  cell {n} (raise RuntimeError('mine')): your own cell failed\n" \
           "        RuntimeError: mine" in out, out
    assert "RuntimeError: edited" not in out and "stub here" not in out, out


KERNEL_LABS = [lab for lab in lab_names(ROOT)
               if "require_triton(" in (ROOT / "solutions" / f"{lab}.py").read_text()]


@pytest.mark.slow
@pytest.mark.parametrize("lab", KERNEL_LABS)
def test_a_kernel_labs_solution_checks_clean(lab, tmp_path):
    """Every visible test passes and none of the lab's own cells fails while graded: a cell
    that needs what is a stub there is tagged jupyter-only (the labs without kernels are
    checked so, without triton, in tests/test_without_triton.py)."""
    (tmp_path / "labs" / lab).mkdir(parents=True)
    release = ROOT / "labs" / lab / f"{lab}.ipynb"
    (tmp_path / "labs" / lab / release.name).write_bytes(release.read_bytes())
    notebook = tmp_path / "mine.ipynb"
    nbformat.write(source_notebook(ROOT / "solutions" / f"{lab}.py"), notebook)
    proc = check(lab, "--notebook", str(notebook), "--root", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    nb = nbformat.read(release, as_version=4)
    for grade_id in [c.metadata.nbgrader.grade_id for c in graded_test_cells(nb)]:
        assert f"PASS  {grade_id} " in proc.stdout, proc.stdout[-3000:]
