"""minirl.advantages: against a plain Python loop, equal groups, and every refusal."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from minirl import group_advantages, variance_fraction


def loop_advantages(rows: list[list[float]], eps: float) -> list[list[float]]:
    """The definition, one group at a time, in Python floats."""
    out = []
    for r in rows:
        if len(set(r)) == 1:
            out.append([0.0] * len(r))
            continue
        mean, std = statistics.fmean(r), statistics.stdev(r)     # stdev: Bessel's n - 1
        out.append([(x - mean) / (std + eps) for x in r])
    return out


@pytest.mark.parametrize("rows", [
    [[1.0, 0.0]],                                                # one prompt, G = 2
    [[0.0, 1.0, 1.0], [0.5, 0.25, 0.0], [2.0, 2.0, 2.0]],        # G = 3, one equal group
    [[0.3, -1.0, 7.5, 0.3, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0]],
])
def test_matches_a_loop(rows):
    got = group_advantages(torch.tensor(rows, dtype=torch.float64), eps=1e-4)
    assert got.dtype == torch.float32 and got.shape == (len(rows), len(rows[0]))
    torch.testing.assert_close(got, torch.tensor(loop_advantages(rows, 1e-4)),
                               rtol=1e-6, atol=1e-6)


def test_one_right_answer_of_two():
    # mean 0.5, sample std sqrt(0.5): ±0.5 / 0.7071
    got = group_advantages([[1.0, 0.0]], eps=0.0)
    assert got[0].tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)])


@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7998991818010589, 0.0, -7.25, 1e30])
@pytest.mark.parametrize("G", [2, 3, 9])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_equal_rewards_give_exactly_zero(value, G, eps):
    # In float64 the mean of 3 copies of 0.1 is 0.10000000000000002, and the std of 9 copies
    # of 0.7998991818010589 is 1.2e-16, not 0: the rule, not the arithmetic, gives 0 (and
    # with eps = 0, not 0/0).
    got = group_advantages(torch.full((2, G), value, dtype=torch.float64), eps=eps)
    assert torch.equal(got, torch.zeros(2, G))


def test_advantages_sum_to_zero_within_each_group():
    r = torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
    assert group_advantages(r).sum(dim=1).abs().max() < 1e-5


def test_variance_fraction():
    assert variance_fraction([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25]]) == 0.5
    assert variance_fraction([[1.0, 1.0]]) == 0.0
    assert variance_fraction([[1.0], [0.0]]) == 0.0            # one sample: no variance


def test_group_of_one_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="GRPO needs at least 2 samples per group"):
        group_advantages([[1.0], [0.0]])


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)])
def test_empty_is_refused(shape):
    with pytest.raises(ValueError, match="rewards is empty"):
        group_advantages(torch.zeros(shape))
    with pytest.raises(ValueError, match="rewards is empty"):
        variance_fraction(torch.zeros(shape))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2)])
def test_wrong_rank_is_refused(shape):
    with pytest.raises(ValueError, match=r"rewards must be \[prompts, group_size\]"):
        group_advantages(torch.zeros(shape))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_named_by_position(bad):
    r = torch.zeros(3, 4)
    r[2, 1] = bad
    with pytest.raises(ValueError, match=rf"rewards\[2, 1\] is {bad}"):
        group_advantages(r)
    with pytest.raises(ValueError, match=r"rewards\[2, 1\]"):
        variance_fraction(r)


@pytest.mark.parametrize("eps", [-1e-6, math.nan, math.inf, "0"])
def test_bad_eps_is_refused(eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        group_advantages([[1.0, 0.0]], eps=eps)
