"""The capstone (Lab 11) on a learner's own pieces: every piece it lists runs, and when a run
on them leaves the reference's, `mine.blame` and the capstone's curve check name the piece
whose swap back to the reference restores agreement.

The solutions' notebooks are saved as a learner's, as `make check` saves them; for a bug, one
saved module is edited and its record resealed (as if the bug had gone through `make check`).
A short QLoRA run of a tiny MoE is the run `blame` repeats.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from course.authoring.build import graded_test_cells, source_notebook
from course.notebook.mine import blame, save, use
from course.notebook.pieces import PIECES
from minigpt import MiniGPT, MiniGPTConfig
from minimoe import MoEMLP
from minituner.qlora import wrap_minigpt_qlora

ROOT = Path(__file__).resolve().parents[2]
(QUANTIZE, DEQUANTIZE, EXPERTS_CPU, DEQUANT_KERNEL, SELECTIVE_KERNEL, LORA, S2S, PL,
 LORA_PL) = (p.name for p in PIECES)
TINY = MiniGPTConfig(n_layer=2, n_head=2, n_embd=32, d_ff=32, block_size=8, n_experts=4,
                     top_k=2)
# Lab 04's backward with dy scaled in place: the same gradients for x, A and B, but dy is the
# gradient buffer autograd also hands to the residual branch, which now gets s·dy (and so
# do the blocks below: the tiny model needs two).
LORA_IN_PLACE = ("""\
        dy_b = dy @ B                                      # [T, r]
        dx = dy @ W + s * (dy_b @ A)                       # [T, in]
        dA = s * (dy_b.t() @ x)                            # [r, in]
        dB = s * (dy.t() @ xa)                             # [out, r]""", """\
        dx = dy @ W                                        # [T, in]
        dy = dy.mul_(s)                                    # scale once, in place
        dy_b = dy @ B                                      # [T, r]
        dx = dx + dy_b @ A
        dA = dy_b.t() @ x                                  # [r, in]
        dB = dy.t() @ xa                                   # [out, r]""")
# Lab 02's dequantization with the block scales tiled (repeat) instead of repeated element by
# element: both pieces that call nf4_dequantize (attention weights, CPU expert path) now
# scale codes by another block's absmax.
SCALES_TILED = ("scales = absmax.float().repeat_interleave(blocksize)[:n]",
                "scales = absmax.float().repeat(blocksize)[:n]")


def save_solutions(root: Path, labs) -> Path:
    """`root` as a learner's checkout in which `make check` passed every lab of `labs`."""
    for lab in labs:
        nb = source_notebook(ROOT / "solutions" / f"{lab}.py")
        save(root, lab, nb, {c.metadata.nbgrader.grade_id: True for c in graded_test_cells(nb)},
             ROOT / "solutions" / f"{lab}.py")
    return root


@pytest.fixture(scope="module")
def learner(tmp_path_factory) -> Path:
    """A learner who finished Labs 02 and 04 (the pieces a CPU run calls)."""
    return save_solutions(tmp_path_factory.mktemp("learner"), ("02-nf4", "04-lora"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A learner who finished every lab with a piece (02-10)."""
    return save_solutions(tmp_path_factory.mktemp("finished"), sorted({p.lab for p in PIECES}))


def run_capstone(learner: Path, cwd: Path, upto: str | None = None):
    """Lab 11's solution notebook run as a learner's kernel runs it (no grading, no Triton
    mode chosen beforehand), on the pieces saved under `learner`; only the cells up to the
    first whose source contains `upto`, if given. Returns the notebook, outputs filled in."""
    from nbclient import NotebookClient

    nb = source_notebook(ROOT / "solutions" / "11-capstone-qlora-moe.py")
    if upto is not None:
        nb.cells = nb.cells[:next(i for i, c in enumerate(nb.cells) if upto in c.source) + 1]
    env = dict(os.environ)
    for name in ("NBGRADER_EXECUTION", "TRITON_INTERPRET"):
        os.environ.pop(name, None)
    os.environ["MINIQLORA_ROOT"] = str(learner)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env)
    return nb


def with_bug(learner: Path, to: Path, lab: str, old: str, new: str) -> Path:
    """A copy of `learner` whose saved `lab` has `old` replaced by `new`, its record resealed
    (the bug went through `make check`)."""
    shutil.copytree(learner, to)
    module = to / "work" / "mine" / f"{lab}.py"
    text = module.read_text()
    assert text.count(old) == 1, f"{lab}'s saved code changed: {old!r} is not in it once"
    text = text.replace(old, new)
    module.write_text(text)
    record = module.with_suffix(".json")
    meta = json.loads(record.read_text())
    meta["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    record.write_text(json.dumps(meta))
    return to


def short_run() -> list[float]:
    """Three AdamW steps of QLoRA (NF4 attention and experts, LoRA on both) on a tiny MoE."""
    torch.manual_seed(0)
    model = MiniGPT(TINY)
    for m in model.modules():
        if isinstance(m, MoEMLP):
            m.backend = "torch"
    wrap_minigpt_qlora(model, r=4, alpha=8.0, quant_scheme="nf4_per_group_32")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, TINY.vocab_size, (4, TINY.block_size + 1),
                           generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def agrees():
    want = short_run()                                   # the reference's
    return lambda losses: max(abs(a - b) / abs(b) for a, b in zip(losses, want,
                                                                    strict=True)) <= 1e-6


def test_blame_names_the_piece_whose_swap_restores_agreement(learner, tmp_path, agrees):
    root = with_bug(learner, tmp_path / "bug", "04-lora", *LORA_IN_PLACE)
    with use("mine", root=root, quiet=True) as choices:
        assert not agrees(short_run()), "the bug should move the short run"
    assert next(c for c in choices if c.piece == LORA).yours
    verdict = blame(short_run, agrees, root)
    assert f"{LORA} (work/mine/04-lora.py) restores agreement" in verdict, verdict
    assert "make check LAB=04-lora" in verdict, verdict
    assert not any(p in verdict for p in (QUANTIZE, DEQUANTIZE, EXPERTS_CPU)), verdict


def test_blame_swaps_pieces_back_together_when_no_single_one_restores(learner, tmp_path,
                                                                      agrees):
    root = with_bug(learner, tmp_path / "bug", "02-nf4", *SCALES_TILED)
    verdict = blame(short_run, agrees, root)
    assert verdict.startswith("no single piece restores agreement"), verdict
    assert all(p in verdict for p in (QUANTIZE, DEQUANTIZE, EXPERTS_CPU)), verdict
    assert LORA not in verdict, verdict


def test_blame_says_when_it_cannot_tell(learner, agrees):
    assert "agrees with the reference even with all your pieces" in blame(
        short_run, agrees, learner)
    assert "not in your pieces" in blame(short_run, lambda losses: False, learner)


@pytest.mark.notebooks
def test_the_capstone_names_the_piece_that_moved_its_run(learner, tmp_path):
    """The capstone, run to its curve check on a learner whose Lab 04 Function scales dy in
    place: the check fails, and its message names the LoRA Function."""
    from nbclient.exceptions import CellExecutionError

    root = with_bug(learner, tmp_path / "bug", "04-lora", *LORA_IN_PLACE)
    with pytest.raises(CellExecutionError) as failed:
        run_capstone(root, tmp_path, upto="CURVE_TOL = ")
    message = str(failed.value)
    assert "your pieces' run left the reference's by" in message, message[-2000:]
    assert f"{LORA} (work/mine/04-lora.py) restores agreement" in message, message[-2000:]


@pytest.mark.notebooks
def test_the_capstone_runs_every_piece_it_lists(finished, tmp_path):
    """Lab 11's solution with every lab's solution saved as a learner's: every piece is the
    learner's, every one of them runs (the kernels in Part F), and the run gets the
    reference run's numbers."""
    nb = run_capstone(finished, tmp_path)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    n = len(PIECES)
    assert f"{n} of {n} pieces were yours, 4 of them ran in training" in text, text[-2000:]
    em = re.search(r"rev exact match: yours (\S+) -> (\S+), reference (\S+) -> (\S+)", text)
    assert em and em.group(1, 2) == em.group(3, 4), em and em.group(0)
    assert float(em.group(2)) > float(em.group(1)), "rev was not learned"
    gap = re.search(r"largest smoothed gap (\S+) at step", text)
    assert gap and float(gap.group(1)) <= 1e-6, gap and gap.group(0)
    kernels = re.search(r"kernels of yours on the Triton path \(calls\): (.*)", text)
    assert kernels, text[-2000:]
    for piece in (DEQUANT_KERNEL, SELECTIVE_KERNEL, S2S, PL, LORA_PL):
        assert re.search(rf"{re.escape(piece)} [1-9]", kernels.group(1)), (piece, kernels[0])
    assert "pieces of yours never called in this notebook: none" in text, text[-2000:]
