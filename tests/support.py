"""Helpers several test modules share (tests/ is on pytest's pythonpath): a tiny MiniGPT, task
data, a model with zero-gradient extras, poisoned NF4 experts, and notebook cells with nbgrader
metadata. No tests here."""

from __future__ import annotations

import nbformat
import torch
import torch.nn as nn

from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks
from miniquant.nf4 import NF4Weight
from minituner import SequenceData, TrainConfig

TOK = CharTokenizer()
SMALL = dict(block_size=24, n_layer=1, n_head=2, n_embd=16, d_ff=32)


def quiet(**kw) -> TrainConfig:
    return TrainConfig(**{"progress": False, **kw})


def task_data(task="copy", n=8, seed=0) -> SequenceData:
    exs = tasks.make_examples(task, n, seed=seed)
    return SequenceData.from_pairs([(TOK.encode(ex.prompt), TOK.encode(ex.answer) + [TOK.eos_id])
                                    for ex in exs])


def small_model(seed=0, **kw) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(MiniGPTConfig(**{**SMALL, **kw}))


class ZeroGradExtras(nn.Module):
    """A bigram model plus a 1-D and a 2-D parameter that get exactly-zero gradients, so that
    AdamW changes them only through weight decay."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TOK.vocab_size, 8)
        self.head = nn.Linear(8, TOK.vocab_size)
        self.vec = nn.Parameter(torch.ones(5))
        self.mat = nn.Parameter(torch.ones(3, 4))

    def forward(self, x):
        return self.head(self.emb(x)) + 0.0 * (self.vec.sum() + self.mat.sum())


def poison(q: NF4Weight, keep: list[int]) -> None:
    """Overwrite every stored byte and scale of the experts not in `keep`, in place."""
    n_experts = q.shape[0]
    for t in (q.packed, q.block_absmax, q.absmax_codes):
        if t is None:
            continue
        per_expert = t.view(n_experts, -1)
        for e in range(n_experts):
            if e not in keep:
                per_expert[e] = float("nan") if t.is_floating_point() else 0xFF


def nbgrader_cell(source: str, grade_id: str | None = None, test: bool = False):
    """A code cell; with `grade_id`, a one-point test cell (`test`) or a solution cell."""
    cell = nbformat.v4.new_code_cell(source)
    if grade_id:
        cell.metadata["nbgrader"] = {"grade": test, "grade_id": grade_id, "locked": test,
                                     "points": 1 if test else 0, "schema_version": 3,
                                     "solution": not test, "task": False}
    return cell
