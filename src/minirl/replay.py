"""Replay: mix examples of the pretraining tasks into fine-tuning data, so they are not forgotten.

Training on one task moves weights the other tasks use too; without replay (or a KL to the
reference) a model rewarded on the held-out task loses `sort`. Replay keeps a share of every
batch or dataset on the old tasks, as plain SFT examples with their correct answers.

`fraction` is the share of the result that is replay: n examples become
n + round(n · f / (1 − f)), so f = 0.2 makes one example in five a replay one. The replay
examples are the first ones of `minigpt.tasks.make_mixture` (the tasks interleaved), so the
same seed gives the same examples, and the combined list is shuffled from the seed.

In a reward-weighted dataset the replay rows get weight `weight` (default 1: plain SFT).
For GRPO, replay prompts in the sampled batch mostly give groups without reward variance
(the model still solves them), hence no signal until it starts to forget; a supervised term
on `replay_examples` (minituner's `sequence_loss`) or the KL acts at once.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import torch

from minigpt import CharTokenizer, tasks
from minigpt.tasks import Example
from minituner import SequenceData

from .weighting import sft_pairs


def replay_count(n: int, fraction: float) -> int:
    """Replay examples to add to `n` so that they make `fraction` of the result."""
    if not (isinstance(fraction, int | float) and 0.0 <= fraction < 1.0):
        raise ValueError(f"fraction must be in [0, 1) (the share of replay in the result), "
                         f"got {fraction!r}")
    return round(n * fraction / (1.0 - fraction))


def replay_examples(n: int, seed: int, task_names: list[str] | None = None,
                    split: str = "train") -> list[Example]:
    """`n` examples of the pretraining tasks (or `task_names`), interleaved, from `seed`."""
    names = tasks.PRETRAIN_TASKS if task_names is None else task_names
    if not names:
        raise ValueError("task_names is empty; replay needs at least one task")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return tasks.make_mixture(names, math.ceil(n / len(names)), seed, split)[:n]


def mix_replay(examples: list[Example], fraction: float, seed: int,
               task_names: list[str] | None = None, split: str = "train") -> list[Example]:
    """`examples` plus replay examples making `fraction` of the result, shuffled from `seed`."""
    extra = replay_examples(replay_count(len(examples), fraction), seed, task_names, split)
    mixed = list(examples) + extra
    random.Random(f"replay/{seed}").shuffle(mixed)
    return mixed


def add_replay(data: SequenceData, fraction: float, seed: int, weight: float = 1.0,
               task_names: list[str] | None = None, tokenizer: CharTokenizer | None = None
               ) -> SequenceData:
    """`data` with replay rows appended (`fraction` of the result), padded to one length.

    Rows keep their order, replay last (the training loop shuffles). If `data` has weights,
    the replay rows get `weight`; an unweighted `data` stays unweighted.
    """
    if not (isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0):
        raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
    extra = replay_examples(replay_count(len(data), fraction), seed, task_names)
    if not extra:
        return data
    tok = tokenizer or CharTokenizer()
    rep = SequenceData.from_pairs(sft_pairs([e.prompt for e in extra],
                                            [e.answer for e in extra], tok), tok.pad_id)
    n, L = len(data), max(data.tokens.shape[1], rep.tokens.shape[1])
    tokens = torch.full((n + len(rep), L), tok.pad_id, dtype=torch.long)     # [N + R, L]
    answer_mask = torch.zeros((n + len(rep), L), dtype=torch.bool)
    for part, rows in ((data, slice(0, n)), (rep, slice(n, None))):
        tokens[rows, :part.tokens.shape[1]] = part.tokens
        answer_mask[rows, :part.answer_mask.shape[1]] = part.answer_mask
    weights = None if data.weights is None else torch.cat(
        [data.weights, torch.full((len(rep),), float(weight))])
    return replace(data, tokens=tokens, answer_mask=answer_mask,
                   lengths=torch.cat([data.lengths, rep.lengths]), weights=weights)
