"""minirl.replay: the replay share, seeding, the tasks drawn, and replay rows in SequenceData."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from support import TOK

from minigpt import tasks
from minirl import add_replay, mix_replay, replay_count, replay_examples, sft_pairs
from minituner import SequenceData

HELD = tasks.make_examples(tasks.HELD_OUT, 30, seed=0)


@pytest.mark.parametrize("n, fraction, want", [(30, 0.0, 0), (30, 0.25, 10), (30, 0.5, 30),
                                               (1, 0.2, 0), (4, 0.2, 1), (9, 0.9, 81)])
def test_replay_count_makes_fraction_of_the_result(n, fraction, want):
    assert replay_count(n, fraction) == want


@pytest.mark.parametrize("fraction", [1.0, -0.1, math.nan, "0.2"])
def test_bad_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\)"):
        replay_count(10, fraction)


def test_mix_replay_adds_pretraining_examples_at_the_fraction():
    mixed = mix_replay(HELD, 0.25, seed=3)
    assert len(mixed) == 40
    counts = Counter(ex.task for ex in mixed)
    assert counts[tasks.HELD_OUT] == 30
    assert sum(counts[t] for t in tasks.PRETRAIN_TASKS) == 10
    assert len([t for t in tasks.PRETRAIN_TASKS if counts[t]]) >= 3     # several tasks
    assert Counter(mixed) == Counter(HELD) + Counter(replay_examples(10, seed=3))
    assert mixed[:30] != HELD                                           # shuffled in


def test_mix_replay_is_seeded():
    assert mix_replay(HELD, 0.2, seed=1) == mix_replay(HELD, 0.2, seed=1)
    assert mix_replay(HELD, 0.2, seed=1) != mix_replay(HELD, 0.2, seed=2)
    assert sorted(mix_replay(HELD, 0.0, seed=1), key=str) == sorted(HELD, key=str)


def test_replay_examples_from_chosen_tasks():
    exs = replay_examples(7, seed=0, task_names=["sort"])
    assert len(exs) == 7 and {ex.task for ex in exs} == {"sort"}
    assert Counter(exs) == Counter(tasks.make_examples("sort", 7, seed=0))   # shuffled
    with pytest.raises(ValueError, match="task_names is empty"):
        replay_examples(3, seed=0, task_names=[])


def weighted_data() -> SequenceData:
    data = SequenceData.from_pairs(sft_pairs([e.prompt for e in HELD[:6]],
                                             [e.answer for e in HELD[:6]]), TOK.pad_id)
    return data.with_rewards([1.0, 0.0, 0.5, 1.0, 0.0, 0.0])


def test_add_replay_appends_rows_with_their_weight():
    data = weighted_data()
    mixed = add_replay(data, 0.25, seed=0, weight=0.5)
    assert len(mixed) == 8
    assert torch.equal(mixed.weights, torch.cat([data.weights, torch.full((2,), 0.5)]))
    L = data.tokens.shape[1]
    assert torch.equal(mixed.tokens[:6, :L], data.tokens) and (mixed.tokens[:6, L:] == 0).all()
    assert torch.equal(mixed.answer_mask[:6, :L], data.answer_mask)
    extra = replay_examples(2, seed=0)
    want = SequenceData.from_pairs(sft_pairs([e.prompt for e in extra],
                                             [e.answer for e in extra]), TOK.pad_id)
    for row in range(2):
        n = int(want.lengths[row])
        assert mixed.tokens[6 + row, :n].tolist() == want.tokens[row, :n].tolist()
        assert torch.equal(mixed.answer_mask[6 + row, :n], want.answer_mask[row, :n])
    assert torch.equal(mixed.lengths, torch.cat([data.lengths, want.lengths]))


def test_add_replay_keeps_unweighted_data_unweighted():
    data = SequenceData.from_pairs(sft_pairs(["ab="], ["ba"]), TOK.pad_id)
    mixed = add_replay(data, 0.75, seed=0)
    assert len(mixed) == 4 and mixed.weights is None
    assert add_replay(data, 0.0, seed=0) is data


@pytest.mark.parametrize("weight", [-1.0, math.inf])
def test_add_replay_refuses_a_bad_weight(weight):
    with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
        add_replay(weighted_data(), 0.5, seed=0, weight=weight)
