"""The learner's own code carried to the capstone: course.notebook.mine and pieces.

The solutions' notebooks are saved the way `make check` saves a learner's passing notebook;
`use("mine")` must then run them wherever the packages call the reference, fall back by name
where a piece is not done, and leave the packages as they were. The last test runs the
capstone (Lab 11's solution) on those pieces and checks it gets the reference's numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import nbformat
import pytest
import torch

import miniquant
import minituner.lora
from course.authoring.build import graded_test_cells, source_notebook
from course.notebook.mine import choose, definitions, save, saved, use
from course.notebook.pieces import PIECES

ROOT = Path(__file__).resolve().parents[2]
CPU_LABS = ("02-nf4", "04-lora")


def _save_solution(root: Path, lab: str, passed: bool = True) -> Path:
    nb = source_notebook(ROOT / "solutions" / f"{lab}.py")
    tests = {c.metadata.nbgrader.grade_id: passed for c in graded_test_cells(nb)}
    return save(root, lab, nb, tests, ROOT / "solutions" / f"{lab}.py")


@pytest.fixture(scope="module")
def learner(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("learner")
    for lab in sorted({p.lab for p in PIECES}):
        _save_solution(root, lab)
    return root


def _nb(*cells: tuple[str, dict]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for source, meta in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata.update(meta)
        nb.cells.append(cell)
    return nb


def test_definitions_keep_what_a_later_lab_can_import():
    test = {"nbgrader": {"grade": True, "solution": False, "grade_id": "t"}}
    answer = {"nbgrader": {"grade": False, "solution": True, "grade_id": "a"}}
    src = definitions(_nb(
        ("import os\nos.environ.setdefault('X', '1')\nimport torch\nbase = object()", {}),
        ("TABLE = torch.zeros(3)\nW = base\nLOOKUP = base.thing\n"
         "@staticmethod\ndef f(x):\n    return x + TABLE\n_g = 1\ndef _helper():\n    pass",
         answer),
        ("def test_only():\n    pass\nCONST = 3", test),
        ("def broken(:", {}),
        ("class K:\n    pass\nMORE, ALSO = TABLE, K\nf(1)", {}),
    ))
    scope: dict = {}
    exec(compile(src, "saved", "exec"), scope)          # runs without the notebook's globals
    assert {"os", "torch", "TABLE", "f", "K", "MORE", "ALSO"} <= set(scope)
    for dropped in ("base", "W", "LOOKUP", "_g", "_helper", "test_only", "CONST", "broken"):
        assert dropped not in scope, dropped
    assert "@staticmethod\ndef f(x):" in src             # decorators travel with the function
    assert "setdefault" not in src and "f(1)" not in src


def test_record_detects_a_module_edited_by_hand(tmp_path):
    path = _save_solution(tmp_path, "04-lora")
    s = saved(tmp_path, "04-lora")
    assert s is not None and "test_lora_backward" in s.passed and s.failed == []
    path.write_text(path.read_text() + "\nX = 1\n")
    assert saved(tmp_path, "04-lora") is None
    assert not choose(tmp_path)[5].yours


def test_choose_falls_back_by_name_with_the_reason(tmp_path, monkeypatch):
    _save_solution(tmp_path, "02-nf4", passed=False)
    by_name = {c.piece: c for c in choose(tmp_path)}
    nf4 = by_name[PIECES[0].name]
    assert not nf4.yours and "test_nf4_indices_match_bnb" in nf4.why
    assert "nothing saved from 04-lora" in by_name[PIECES[5].name].why
    _save_solution(tmp_path, "02-nf4")
    assert choose(tmp_path)[0].yours
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    assert not any(c.yours for c in choose(tmp_path))
    assert "grading" in choose(tmp_path)[0].why


def test_use_swaps_the_pieces_in_and_puts_the_reference_back(learner, capsys):
    originals = (miniquant.quantize_nf4, miniquant.dequantize_nf4, minituner.lora.lora_linear)
    w = torch.randn(37, 29, generator=torch.Generator().manual_seed(0))   # odd numel
    ref_q = miniquant.quantize_nf4(w, 64, double_quant=True)
    with use("mine", root=learner) as choices:
        assert all(c.yours for c in choices), [(c.piece, c.why) for c in choices]
        assert miniquant.quantize_nf4 is not originals[0]
        q = miniquant.quantize_nf4(w, 64, double_quant=True)
        got = miniquant.dequantize_nf4(q)
        with pytest.raises(ValueError, match="w"):
            miniquant.quantize_nf4(torch.tensor([1.0, float("nan")]))   # the package's check
    assert "yours" in capsys.readouterr().out
    assert (miniquant.quantize_nf4, miniquant.dequantize_nf4,
            minituner.lora.lora_linear) == originals
    for name in ("packed", "absmax_codes", "absmax_scales", "absmax_offset"):
        assert torch.equal(getattr(q, name), getattr(ref_q, name)), name
    assert torch.equal(got, miniquant.dequantize_nf4(ref_q))


def test_the_learners_lora_function_trains_like_the_reference(learner):
    g = torch.Generator().manual_seed(1)
    x, W = torch.randn(5, 12, generator=g), torch.randn(7, 12, generator=g)
    A, B = torch.randn(3, 12, generator=g), torch.randn(7, 3, generator=g)

    def run():
        a, b, xx = (t.clone().requires_grad_(True) for t in (A, B, x))
        y = minituner.lora.lora_linear(xx, a, b, W, 0.5)
        y.square().sum().backward()
        return y.detach(), xx.grad, a.grad, b.grad

    with use("mine", root=learner, quiet=True) as choices:
        assert next(c for c in choices if c.lab == "04-lora").yours
        mine = run()
    for got, want in zip(mine, run(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_module_that_fails_to_load_falls_back(tmp_path, capsys):
    _save_solution(tmp_path, "04-lora")
    path = tmp_path / "work" / "mine" / "04-lora.py"
    broken = path.read_text() + "\nBOOM = 1 // 0\n"
    path.write_text(broken)
    record = path.with_suffix(".json")
    meta = json.loads(record.read_text())
    meta["sha256"] = hashlib.sha256(broken.encode()).hexdigest()
    record.write_text(json.dumps(meta))
    with use("mine", root=tmp_path) as choices:
        lora = next(c for c in choices if c.lab == "04-lora")
        assert not lora.yours and "ZeroDivisionError" in lora.why
        assert minituner.lora.lora_linear.__module__ == "minituner.lora"
    assert "failed to load" in capsys.readouterr().out


def test_use_rejects_an_unknown_switch():
    with pytest.raises(ValueError, match="which"), use("theirs"):
        pass


@pytest.mark.notebooks
def test_capstone_runs_on_the_learners_pieces(learner, tmp_path):
    """Lab 11's solution with every lab's solution saved as a learner's: every piece is the
    learner's, and the run gets the reference run's numbers."""
    from nbclient import NotebookClient

    nb = source_notebook(ROOT / "solutions" / "11-capstone-qlora-moe.py")
    env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}
    os.environ.pop("NBGRADER_EXECUTION", None)
    os.environ["MINIQLORA_ROOT"] = str(learner)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    n = len(PIECES)
    assert f"{n} of {n} pieces were yours" in text, text[-2000:]
    em = re.search(r"rev exact match: yours (\S+) -> (\S+), reference (\S+) -> (\S+)", text)
    assert em and em.group(1, 2) == em.group(3, 4), em and em.group(0)
    assert float(em.group(2)) > float(em.group(1)), "rev was not learned"
    gap = re.search(r"largest smoothed gap (\S+) at step", text)
    assert gap and float(gap.group(1)) <= 1e-6, gap and gap.group(0)
    kernels = re.search(r"kernels of yours on the Triton path: (.*)", text)
    assert kernels and "my_lora_parallel_linear" in kernels.group(1)
