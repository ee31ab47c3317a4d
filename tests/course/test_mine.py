"""The learner's own code carried to the capstone: course.notebook.mine and pieces.

The solutions' notebooks are saved the way `make check` saves a learner's passing notebook;
`use("mine")` must then run them wherever the packages call the reference, count the calls
each piece receives, fall back by name where a piece is not done (or was edited by hand), and
leave the packages as they were. test_capstone_pieces.py runs the capstone on them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import nbformat
import pytest
import torch

import minimoe
import miniquant
import minituner.lora
from course.authoring.build import graded_test_cells, source_notebook
from course.notebook.closure import definitions
from course.notebook.mine import choose, ran, save, saved, use
from course.notebook.pieces import PIECES
from miniquant.triton_env import import_triton, triton_installed

ROOT = Path(__file__).resolve().parents[2]
CPU_LABS = ("02-nf4", "04-lora")
QUANTIZE, DEQUANTIZE, EXPERTS_CPU, DEQUANT_KERNEL, SELECTIVE_KERNEL, LORA, S2S, PL, LORA_PL = (
    p.name for p in PIECES)

# As the capstone's setup cell does: Triton's interpreter chosen (no CUDA) before anything in
# this session imports triton without it (torch's checkpoint does), or the learner's kernels,
# which call triton.language helpers, cannot run on a CPU.
if triton_installed():
    import_triton()


def _save_solution(root: Path, lab: str, passed: bool = True) -> Path:
    nb = source_notebook(ROOT / "solutions" / f"{lab}.py")
    tests = {c.metadata.nbgrader.grade_id: passed for c in graded_test_cells(nb)}
    return save(root, lab, nb, tests, ROOT / "solutions" / f"{lab}.py").path


def _save_edited(root: Path, lab: str, edit, notebook: Path | None = None):
    """Save `lab`'s solution with `edit(source of the cell defining nf4_indices)` applied."""
    nb = source_notebook(ROOT / "solutions" / f"{lab}.py")
    cell = next(c for c in nb.cells if "\ndef nf4_indices(" in "\n" + c.source)
    cell.source = edit(cell.source)
    tests = {c.metadata.nbgrader.grade_id: True for c in graded_test_cells(nb)}
    return save(root, lab, nb, tests, notebook or ROOT / "solutions" / f"{lab}.py")


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
    src = src.source
    scope: dict = {}
    exec(compile(src, "saved", "exec"), scope)          # runs without the notebook's globals
    assert {"os", "torch", "TABLE", "f", "K", "MORE", "ALSO"} <= set(scope)
    for dropped in ("base", "W", "LOOKUP", "_g", "_helper", "test_only", "CONST", "broken"):
        assert dropped not in scope, dropped
    assert "@staticmethod\ndef f(x):" in src             # decorators travel with the function
    assert "setdefault" not in src and "f(1)" not in src


def test_record_detects_a_module_edited_by_hand(tmp_path, capsys):
    path = _save_solution(tmp_path, "02-nf4")
    s = saved(tmp_path, "02-nf4")
    assert s is not None and not s.edited and "test_nibbles" in s.passed and s.failed == []
    assert choose(tmp_path)[0].yours
    path.write_text(path.read_text() + "\nX = 1\n")
    assert saved(tmp_path, "02-nf4").edited
    for c in choose(tmp_path)[:3]:                      # the three pieces of Lab 02
        assert not c.yours and "edited by hand" in c.why and "make check LAB=02-nf4" in c.why, \
            c.why
    original = miniquant.quantize_nf4
    with use("mine", root=tmp_path) as choices:
        assert miniquant.quantize_nf4 is original       # the reference stands in
        assert ran(choices) == {}
    assert "02-nf4.py was edited by hand" in capsys.readouterr().out


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


def test_use_counts_the_calls_it_hands_to_each_piece(learner, capsys):
    """One count per call a stand-in hands to the learner's code; a case the piece does not
    cover (LoRA dropout, bitsandbytes' rounding) runs the reference and is not counted."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(16, 32, generator=g), torch.randn(5, 32, generator=g)
    A, B = torch.randn(4, 32, generator=g), torch.randn(16, 4, generator=g)
    with use("mine", root=learner) as choices:
        q = miniquant.quantize_nf4(w, 64)
        miniquant.quantize_nf4(w, 64, double_quant=True)
        miniquant.quantize_nf4(w, 64, double_quant=True, nested_rounding="bnb_cpu")
        miniquant.dequantize_nf4(q)
        minituner.lora.lora_linear(x, A, B, w, 0.5)
        minituner.lora.lora_linear(x, A, B, w, 0.5, mask=torch.ones_like(x))
        assert ran(choices)[QUANTIZE] == 2              # live inside the block
    assert ran(choices) == {QUANTIZE: 2, DEQUANTIZE: 1, EXPERTS_CPU: 0, DEQUANT_KERNEL: 0,
                            SELECTIVE_KERNEL: 0, LORA: 1, S2S: 0, PL: 0, LORA_PL: 0}
    out = capsys.readouterr().out.split("your pieces that ran in this block (calls):")[1]
    assert re.search(rf"{re.escape(QUANTIZE)}\s+2\n", out), out
    assert re.search(rf"{re.escape(S2S)}\s+loaded, never called", out), out
    with use("mine", root=learner, quiet=True, reference=[LORA]) as choices:
        minituner.lora.lora_linear(x, A, B, w, 0.5)
    lora = next(c for c in choices if c.piece == LORA)
    assert not lora.yours and lora.calls == 0 and "kept on the reference" in lora.why
    with pytest.raises(ValueError, match="names no piece"), use("mine", reference=["LoRA"]):
        pass


@pytest.mark.skipif(not triton_installed(), reason="the kernels need triton")
def test_the_counts_follow_the_kernels_that_ran(learner):
    """parallel_linear without LoRA runs Lab 09's Function, whose forward and input gradient
    are Lab 08's scatter2scatter; with LoRA it runs Lab 10's fused kernels instead; an NF4
    expert layer on the Triton path dequantizes with Lab 03's selective kernel."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, generator=g).to(device).requires_grad_(True)
    W = torch.randn(2, 16, 8, generator=g).to(device).requires_grad_(True)
    A, B = torch.randn(4, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
    routing = minimoe.flatten_sort_count(torch.tensor([[0, 1], [1, 0], [1, 0]], device=device), 2)
    with use("mine", root=learner, quiet=True) as plain:
        minimoe.parallel_linear(x, W, routing, backend="triton").sum().backward()
    calls = ran(plain)
    assert calls[PL] == 1 and calls[S2S] == 2 and calls[LORA_PL] == 0, calls   # forward, dX
    want = (x.grad.clone(), W.grad.clone())
    x.grad = W.grad = None
    minimoe.parallel_linear(x, W, routing, backend="torch").sum().backward()
    for got, ref in zip(want, (x.grad, W.grad), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    with use("mine", root=learner, quiet=True) as lora:
        minimoe.parallel_linear(x.detach(), W.detach(), routing, backend="triton",
                                lora=(A.requires_grad_(True), B, 0.5)).sum().backward()
    calls = ran(lora)
    assert calls[LORA_PL] == 1 and calls[PL] == 0 and calls[S2S] == 0, calls
    experts = minimoe.NF4Experts.from_weight(torch.randn(2, 32, 16, generator=g), blocksize=32)
    experts = experts.to(device)
    with use("mine", root=learner, quiet=True) as nf4:
        experts(torch.randn(3, 32, generator=g).to(device), routing, backend="triton")
    calls = ran(nf4)
    assert calls[SELECTIVE_KERNEL] == 1 and calls[PL] == 1 and calls[EXPERTS_CPU] == 0, calls


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


def test_a_piece_travels_with_its_helpers_whatever_their_names(tmp_path):
    """Lab 02's nf4_indices written through private helpers, one of them shared with
    unpack_nibbles, a private table and a class: all saved, and the capstone's quantize and
    dequantize run the learner's code to the reference's bits (no NameError)."""
    def edit(source):
        source = source.replace("def nf4_indices(", "def _nf4_indices(", 1)
        return source + (
            "\n\n_ONE = 1\n\n\nclass _Box:\n    def __init__(self, v):\n        self.v = v"
            "\n\n\ndef _x(v):\n    return _Box(v).v * _ONE\n\n\n"
            "def nf4_indices(w, blocksize=64):\n    return _x(_nf4_indices(w, blocksize))\n")

    record = _save_edited(tmp_path, "02-nf4", edit)
    assert {"_nf4_indices", "_x", "_Box", "_ONE", "nf4_indices"} <= set(record.names)
    assert not record.incomplete, record.incomplete
    module = (tmp_path / "work" / "mine" / "02-nf4.py").read_text()
    unpack = module.replace("def unpack_nibbles(", "def _unpack(", 1) + (
        "\n\ndef unpack_nibbles(packed, n):\n    return _x(_unpack(packed, n))\n")
    assert unpack.count("def _x(") == 1
    w = torch.randn(37, 29, generator=torch.Generator().manual_seed(0))
    ref = miniquant.dequantize_nf4(miniquant.quantize_nf4(w, 64))
    with use("mine", root=tmp_path, quiet=True) as choices:
        got = miniquant.dequantize_nf4(miniquant.quantize_nf4(w, 64))
        counts = ran(choices)
    assert counts[QUANTIZE] >= 1 and counts[DEQUANTIZE] >= 1, counts
    assert torch.equal(got, ref)


def test_a_helper_shared_by_two_pieces_is_saved_once():
    src = definitions(_nb(("import torch\ndef _half(x):\n    return x / 2\n"
                           "def a(x):\n    return _half(x)\ndef b(x):\n    return _half(x) + 1\n"
                           "def _unused():\n    pass", {})))
    assert src.source.count("def _half(") == 1 and "_unused" not in src.source
    scope: dict = {}
    exec(compile(src.source, "saved", "exec"), scope)
    assert scope["a"](4) == 2 and scope["b"](4) == 3


def test_loading_a_saved_module_runs_no_function_of_the_notebook():
    """A value a helper reads is saved only when it needs no function of the notebook's:
    `model = train()` stays in the notebook, and the helper reading it is named incomplete."""
    src = definitions(_nb(("import torch\ndef _train():\n    raise SystemExit('trained')\n"
                           "model = _train()\n_codes = torch.arange(3)\n"
                           "def predict(x):\n    return model(x) + _codes", {})))
    assert "model = _train()" not in src.source and "_codes = torch.arange(3)" in src.source
    assert src.incomplete == {"predict": ["model"]}, src.incomplete
    exec(compile(src.source, "saved", "exec"), {})


def test_each_pieces_uses_are_the_names_its_adapter_calls():
    called = set(re.findall(r"\bm\.([A-Za-z_]\w*)", (ROOT / "src" / "course" / "notebook"
                                                     / "pieces.py").read_text()))
    assert called == {n for p in PIECES for n in p.uses}, \
        "Piece.uses must name exactly what the adapters call on the learner's module"


def test_a_module_of_the_learners_own_beside_the_notebook_imports(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_codes.py").write_text("def identity(t):\n    return t\n")
    record = _save_edited(tmp_path, "02-nf4", lambda source: "import my_codes\n" + source.replace(
        "def nf4_indices(", "def _inner(", 1) + "\n\ndef nf4_indices(w, blocksize=64):\n"
        "    return my_codes.identity(_inner(w, blocksize))\n", work / "02-nf4.ipynb")
    assert not record.incomplete
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with use("mine", root=tmp_path, quiet=True) as choices:
        q = miniquant.quantize_nf4(w, 64)
        assert choices[0].yours and ran(choices)[QUANTIZE] == 1, choices[0].why
    assert torch.equal(q.packed, miniquant.quantize_nf4(w, 64).packed)


def test_a_piece_needing_a_value_computed_at_run_time_stays_on_the_reference(tmp_path,
                                                                             capsys):
    """A helper reading a notebook global that only a run computes cannot be saved: the
    record names it, and the pieces calling it (here through another helper) fall back."""
    record = _save_edited(tmp_path, "02-nf4", lambda source: source.replace(
        "def nf4_indices(", "def _inner(", 1) + (
        "\n\nfor scale in (1.0,):\n    pass\n\n\n"
        "def _scaled(v):\n    return v * scale\n\n\ndef nf4_indices(w, blocksize=64):\n"
        "    return _inner(_scaled(w), blocksize)\n"))
    assert record.incomplete == {"_scaled": ["scale"], "nf4_indices": ["_scaled"]}, \
        record.incomplete
    by_name = {c.piece: c for c in choose(tmp_path)}
    assert not by_name[QUANTIZE].yours and "your nf4_indices needs _scaled" in \
        by_name[QUANTIZE].why, by_name[QUANTIZE].why
    assert by_name[DEQUANTIZE].yours, by_name[DEQUANTIZE].why
    (tmp_path / "work" / "mine" / "02-nf4.json").write_text(json.dumps(
        {**json.loads((tmp_path / "work" / "mine" / "02-nf4.json").read_text()),
         "names": ["unpack_nibbles"]}))
    assert "defines no nf4_dequantize" in choose(tmp_path)[1].why


def test_use_rejects_an_unknown_switch():
    with pytest.raises(ValueError, match="which"), use("theirs"):
        pass
