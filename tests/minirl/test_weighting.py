"""minirl.weighting: the rewarded JSONL reader (errors by line), per-group weights against a
hand computation and a loop, and the weighted SequenceData."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import TOK

from minirl import group_weights, read_rewarded_jsonl, rewarded_sequence_data, sft_pairs
from minituner import SequenceData, reward_weights

RECORDS = [
    {"prompt": "rev:ab=", "answer": "ba", "reward": 1.0},
    {"prompt": "rev:ab=", "answer": "ab", "reward": 0.0},
    {"prompt": "sort:ca=", "answer": "ac", "reward": 1},
    {"prompt": "rev:ab=", "answer": "b", "reward": 0.5},
    {"prompt": "sort:ca=", "answer": "ac", "reward": 1.0},
]


def write(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_reads_records_and_groups_them_by_prompt(tmp_path):
    lines = [json.dumps(r) for r in RECORDS]
    path = write(tmp_path / "r.jsonl", lines[:2] + ["", "   "] + lines[2:])   # blank lines skipped
    rec = read_rewarded_jsonl(path)
    assert len(rec) == 5
    assert rec.prompts == [r["prompt"] for r in RECORDS]
    assert rec.answers == [r["answer"] for r in RECORDS]
    assert rec.rewards.dtype == torch.float64
    assert rec.rewards.tolist() == [1.0, 0.0, 1.0, 0.5, 1.0]
    assert rec.groups.tolist() == [0, 0, 1, 0, 1]


def test_other_field_names(tmp_path):
    lines = [json.dumps({"q": "a=", "a": "x", "score": -2, "id": [1, 2]}),
             json.dumps({"q": "b=", "a": "y", "score": 3.5, "id": [1, 2]}),
             json.dumps({"q": "c=", "a": "z", "score": 0, "id": 7})]
    rec = read_rewarded_jsonl(write(tmp_path / "r.jsonl", lines), reward_field="score",
                              group_field="id", prompt_field="q", answer_field="a")
    assert rec.prompts == ["a=", "b=", "c="] and rec.rewards.tolist() == [-2.0, 3.5, 0.0]
    assert rec.groups.tolist() == [0, 0, 1]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a=", "answer": "x"}', r"line 2: the record has no 'reward' field \(its "
                                        r"fields: \['answer', 'prompt'\]\)"),
    ('{"answer": "x", "reward": 1}', r"line 2: the record has no 'prompt' field"),
    ('{"prompt": "a=", "answer": "x", "reward": NaN}', r"line 2: 'reward' must be a finite"),
    ('{"prompt": "a=", "answer": "x", "reward": -Infinity}', r"line 2: 'reward' must be a fin"),
    ('{"prompt": "a=", "answer": "x", "reward": "1.0"}', r"line 2: 'reward' must be a finite "
                                                         r"number, got '1.0'"),
    ('{"prompt": "a=", "answer": "x", "reward": true}', r"line 2: 'reward' must be a finite"),
    ('{"prompt": "a=", "answer": 3, "reward": 1}', r"line 2: 'prompt' and 'answer' must be"),
    ('{"prompt": "a=", "answer": "x", "reward": 1', r"line 2: not valid JSON"),
    ('[1, 2]', r"line 2: expected a JSON object, got list"),
])
def test_bad_records_are_named_by_line(tmp_path, line, message):
    path = write(tmp_path / "r.jsonl", [json.dumps(RECORDS[0]), line, json.dumps(RECORDS[1])])
    with pytest.raises(ValueError, match=message):
        read_rewarded_jsonl(path)


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no records"):
        read_rewarded_jsonl(write(tmp_path / "r.jsonl", ["", " "]))


def loop_weights(rewards, groups):
    """Per group in Python floats: shift the minimum to 0, divide by the mean; 0 for groups
    whose rewards are all equal."""
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, k in enumerate(groups) if k == g]
        low = min(rewards[i] for i in idx)
        mean = sum(rewards[i] - low for i in idx) / len(idx)
        for i in idx:
            out[i] = (rewards[i] - low) / mean if mean > 0 else 0.0
    return out


def test_group_weights_hand_computed():
    # a: one right of four -> weight 4 on it; b: all right -> nothing to prefer; c: 0.5 vs 0
    rewards = [1, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.0]
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 2
    w = group_weights(rewards, groups)
    assert w.dtype == torch.float32
    assert w.tolist() == [4, 0, 0, 0, 0, 0, 0, 0, 2, 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_weights_match_a_loop_for_interleaved_groups(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (40,), generator=g).double() / 3 - 0.5
    groups = torch.randint(0, 7, (40,), generator=g)
    got = group_weights(rewards, groups)
    want = torch.tensor(loop_weights(rewards.tolist(), groups.tolist()), dtype=torch.float32)
    torch.testing.assert_close(got, want)
    for k in groups.unique():                     # mean 1 within each group with variance
        w = got[groups == k]
        assert w.sum() == 0 or abs(w.mean() - 1) < 1e-6


def test_each_groups_weights_ignore_its_offset_and_scale():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.3, 0.9, 0.6])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    shifted = rewards.clone()
    shifted[3:] = 10 * shifted[3:] - 4
    torch.testing.assert_close(group_weights(rewards, groups), group_weights(shifted, groups))


def test_per_group_weights_do_not_favour_the_solved_prompt():
    # A prompt the model solves (4 of 4 right) and a hard one (1 of 4 right).
    rewards = [1, 1, 1, 1, 1, 0, 0, 0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    global_w, group_w = reward_weights(rewards), group_weights(rewards, groups)
    assert global_w[:4].sum() == 4 * global_w[4]        # globally, solved prompt: 4× the weight
    assert group_w.tolist() == [0, 0, 0, 0, 4, 0, 0, 0]  # per group: the hard prompt's answer


def test_group_weights_refusals():
    with pytest.raises(ValueError, match="at least one value"):
        group_weights([], [])
    with pytest.raises(ValueError, match="3 rewards, 2 groups"):
        group_weights([1.0, 0.0, 1.0], [0, 0])
    with pytest.raises(ValueError, match=r"rewards\[2\] is nan"):
        group_weights([1.0, 0.0, math.nan], [0, 0, 1])
    with pytest.raises(ValueError, match="groups must hold integer ids or hashable labels"):
        group_weights([1.0, 0.0], torch.tensor([0.0, 0.0]))


def test_rewarded_sequence_data(tmp_path):
    path = write(tmp_path / "r.jsonl", [json.dumps(r) for r in RECORDS])
    rec = read_rewarded_jsonl(path)
    data = rewarded_sequence_data(rec)
    plain = SequenceData.from_pairs(sft_pairs(rec.prompts, rec.answers), TOK.pad_id)
    assert torch.equal(data.tokens, plain.tokens)
    assert torch.equal(data.answer_mask, plain.answer_mask)
    # group "rev:ab=": rewards 1, 0, 0.5 -> 2, 0, 1; group "sort:ca=": equal rewards -> 0
    assert data.weights.tolist() == [2.0, 0.0, 0.0, 1.0, 0.0]
    assert plain.tokens[0, :10].tolist() == TOK.encode("rev:ab=ba") + [TOK.eos_id]


def test_rewarded_sequence_data_without_any_reward_variance(tmp_path):
    lines = [json.dumps({"prompt": p, "answer": "x", "reward": r})
             for p, r in [("a=", 1.0), ("b=", 0.0), ("a=", 1.0)]]
    rec = read_rewarded_jsonl(write(tmp_path / "r.jsonl", lines))
    with pytest.raises(ValueError, match="no prompt group among the 3 records has rewards that "
                                         "differ.*SequenceData.with_rewards"):
        rewarded_sequence_data(rec)
