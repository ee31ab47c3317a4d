"""minirl.rewards: exact match, partial credit (hand-computed), and score's refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minigpt.tasks import Example
from minirl import exact_match, partial_credit, score

EX = Example("copy", "copy:abc=", "abc")


@pytest.mark.parametrize("completion, want", [
    ("abc", 1.0), ("ab", 0.0), ("abcd", 0.0), ("", 0.0), ("ABC", 0.0), ("cba", 0.0)])
def test_exact_match(completion, want):
    assert exact_match(EX, completion) == want


@pytest.mark.parametrize("completion, want", [
    ("abc", 1.0),        # exact
    ("ab", 2 / 3),       # one missing: 2 hits of 3 positions
    ("abcd", 3 / 4),     # one extra: 3 hits of 4 positions
    ("xbc", 2 / 3),      # one wrong
    ("bca", 0.0),        # right letters, wrong positions
    ("", 0.0),           # nothing
    ("abcabc", 3 / 6),   # the answer twice: the extra length costs half
    ("a", 1 / 3),
])
def test_partial_credit_hand_computed(completion, want):
    assert partial_credit(EX, completion) == pytest.approx(want, abs=1e-12)


def test_partial_credit_is_in_unit_interval_and_one_only_for_the_answer():
    for completion in ["", "a", "ab", "abc", "abcd", "zzz", "abd", "cab", "abcc"]:
        c = partial_credit(EX, completion)
        assert 0.0 <= c <= 1.0
        assert (c == 1.0) == (completion == EX.answer)
    assert partial_credit(Example("t", "p=", ""), "") == 1.0


def test_score_pairs_rewards_with_examples():
    other = Example("add", "add:1+2=", "3")
    r = score(exact_match, [EX, other, EX], ["abc", "4", "ab"])
    assert r.dtype == torch.float32 and r.tolist() == [1.0, 0.0, 0.0]
    r = score(partial_credit, [EX, other], ["ab", "3"])
    assert r.tolist() == pytest.approx([2 / 3, 1.0])


def test_score_accepts_a_learners_function_returning_bool_or_numpy():
    r = score(lambda ex, c: c == ex.answer, [EX, EX], ["abc", "x"])
    assert r.tolist() == [1.0, 0.0]
    r = score(lambda ex, c: np.float64(len(c)), [EX], ["abcd"])
    assert r.tolist() == [4.0]


def test_score_refuses_empty_and_unpaired_input():
    with pytest.raises(ValueError, match="examples is empty"):
        score(exact_match, [], [])
    with pytest.raises(ValueError, match="2 examples and 1 completions"):
        score(exact_match, [EX, EX], ["abc"])


def test_a_reward_that_raises_is_named_with_the_example():
    def picky(ex, completion):
        if completion == "boom":
            raise KeyError("no such key")
        return 1.0

    with pytest.raises(RuntimeError, match=r"picky raised on example 1 \(prompt 'copy:abc='") \
            as info:
        score(picky, [EX, EX], ["abc", "boom"])
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_named(bad):
    with pytest.raises(ValueError, match=rf"returned {bad} on example 0 \(prompt 'copy:abc='"):
        score(lambda ex, c: bad, [EX], ["abc"])


@pytest.mark.parametrize("bad", ["1.0", None, torch.tensor(1.0), [1.0]])
def test_a_reward_that_is_not_a_number_is_named(bad):
    with pytest.raises(ValueError, match=r"must return a real number, got .* on example 0"):
        score(lambda ex, c: bad, [EX], ["abc"])
