"""grpo_loss's loss family (TRL's names): the four aggregations, clip-higher, sequence-level
importance sampling (GSPO), the KL bias correction and micro-batch `totals`, each against the
definition written token by token; and numbers worked by hand on one batch."""

from __future__ import annotations

import pytest
import torch
from test_grpo import random_case

from minirl import grpo_loss
from minirl.grpo import LOSS_TYPES


def loop_loss(logp, old, adv, mask, eps, eps_high=None, level="token", ref=None, beta=0.0,
              correct=False, loss_type="grpo", L=None):
    """The family written token by token (autograd through scalar ops)."""
    eps_high = eps if eps_high is None else eps_high
    B, T = logp.shape
    rows = [[t for t in range(T) if mask[i, t]] for i in range(B)]
    per_seq, total, tokens = [], 0.0, 0
    for i, ts in enumerate(rows):
        seq_ratio = torch.exp(sum(logp[i, t] - old[i, t] for t in ts) / len(ts))
        terms = []
        for t in ts:
            ratio = seq_ratio if level == "sequence" else torch.exp(logp[i, t] - old[i, t])
            clipped = min(max(ratio, torch.tensor(1 - eps)), torch.tensor(1 + eps_high))
            term = -torch.minimum(ratio * adv[i], clipped * adv[i])
            if ref is not None and beta:
                d = ref[i, t] - logp[i, t]
                kl = torch.exp(d) - d - 1
                term = term + beta * (kl * ratio if correct else kl)
            terms.append(term)
        per_seq.append(sum(terms) / len(terms))
        total, tokens = total + sum(terms), tokens + len(terms)
    if loss_type == "grpo":
        return sum(per_seq) / B
    if loss_type in ("bnpo", "dapo"):
        return total / tokens
    return total / (B * L)


def check(options: dict, **loop_options):
    logp, old, adv, mask, ref = random_case()
    loss, _ = grpo_loss(logp, old, adv, mask, 0.2, ref_logp=ref, kl_coef=0.1, **options)
    want = loop_loss(logp, old, adv, mask, 0.2, ref=ref, beta=0.1, **loop_options)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(loss, want, msg=lambda m: f"{options}: the loss\n{m}")
    torch.testing.assert_close(grad, want_grad, msg=lambda m: f"{options}: the gradient\n{m}")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_aggregation_matches_the_loop(loss_type):
    check(dict(loss_type=loss_type, max_completion_length=9), loss_type=loss_type, L=9)


def test_clip_higher_matches_the_loop():
    check(dict(epsilon_high=0.28), eps_high=0.28)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_level_importance_sampling_matches_the_loop(loss_type):
    check(dict(importance_sampling_level="sequence", loss_type=loss_type), level="sequence",
          loss_type=loss_type)


def test_kl_bias_correction_matches_the_loop():
    check(dict(kl_bias_correction=True), correct=True)
    check(dict(kl_bias_correction=True, importance_sampling_level="sequence"), correct=True,
          level="sequence")


# One batch worked by hand: fresh samples (ratio 1, so ℓ_it = −A_i), completion lengths
# [1, 9, 3, 7, 2, 5], advantages [1, −1, 0.5, 0.5, −2, 1]:
#   grpo     mean_i(−A_i)                 = −(1 − 1 + .5 + .5 − 2 + 1)/6       = 0
#   bnpo     Σ −A_i·|o_i| / Σ|o_i|        = −(1 − 9 + 1.5 + 3.5 − 4 + 5)/27    = 2/27
#   dr_grpo  Σ −A_i·|o_i| / (6 · 9)       = 2/54
LENGTHS, ADV = [1, 9, 3, 7, 2, 5], [1.0, -1.0, 0.5, 0.5, -2.0, 1.0]
BY_HAND = {"grpo": 0.0, "bnpo": 2 / 27, "dapo": 2 / 27, "dr_grpo": 2 / 54}


def by_hand_batch():
    mask = torch.arange(9)[None, :] < torch.tensor(LENGTHS)[:, None]           # [6, 9]
    logp = torch.full((6, 9), -1.0, dtype=torch.float64, requires_grad=True)
    return logp, logp.detach().clone(), torch.tensor(ADV, dtype=torch.float64), mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_hand_worked_batch(loss_type):
    logp, old, adv, mask = by_hand_batch()
    loss, _ = grpo_loss(logp, old, adv, mask, loss_type=loss_type, max_completion_length=9)
    assert loss.item() == pytest.approx(BY_HAND[loss_type], abs=1e-12)
    # the gradient of a token is −A_i times its weight: 1/(B·|o_i|), 1/Σ|o|, or 1/(B·L)
    (grad,) = torch.autograd.grad(loss, logp)
    weight = {"grpo": 1 / (6 * torch.tensor(LENGTHS, dtype=torch.float64)),
              "bnpo": torch.full((6,), 1 / 27, dtype=torch.float64),
              "dapo": torch.full((6,), 1 / 27, dtype=torch.float64),
              "dr_grpo": torch.full((6,), 1 / 54, dtype=torch.float64)}[loss_type]
    want = torch.where(mask, (-adv * weight)[:, None], 0.0)
    torch.testing.assert_close(grad, want)


def test_under_grpo_a_long_completions_tokens_count_less():
    """The length bias: the 9-token row's tokens get 1/9 of the 1-token row's gradient."""
    logp, old, adv, mask = by_hand_batch()
    loss, _ = grpo_loss(logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[1, 0].abs() == pytest.approx(grad[0, 0].abs() / 9)
    loss, _ = grpo_loss(logp, old, adv, mask, loss_type="dapo")
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[1, 0].abs() == pytest.approx(grad[0, 0].abs())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batch_parts_add_up_to_the_whole_batch(loss_type, level):
    logp, old, adv, mask, ref = random_case()
    options = dict(loss_type=loss_type, importance_sampling_level=level,
                   max_completion_length=9, epsilon_high=0.3)
    whole, _ = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, **options)
    (want,) = torch.autograd.grad(whole, logp)
    totals = (5, int(mask.sum()))
    parts = [grpo_loss(logp[r], old[r], adv[r], mask[r], ref_logp=ref[r], kl_coef=0.1,
                       totals=totals, **options)[0] for r in (slice(0, 2), slice(2, 5))]
    (grad,) = torch.autograd.grad(sum(parts), logp)
    if loss_type == "bnpo":     # each part over its own tokens, weighted by its share (TRL's)
        want = sum(len(range(5)[r]) / 5 * loop_loss(
            logp[r], old[r], adv[r], mask[r], 0.2, 0.3, level, ref[r], 0.1, loss_type="bnpo")
            for r in (slice(0, 2), slice(2, 5)))
        torch.testing.assert_close(sum(parts), want)
        assert not torch.allclose(sum(parts), whole)
        return
    torch.testing.assert_close(sum(parts), whole)
    torch.testing.assert_close(grad, want)


def test_gspo_clips_whole_sequences():
    """One sequence whose mean log-ratio is 0.5 (ρ = 1.65 > 1.2) with A > 0 is clipped as a
    whole: no gradient on any of its tokens, though one token's own ratio is inside."""
    logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.05, -1.95]], dtype=torch.float64)                  # 0.05, 0.95
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask,
                            importance_sampling_level="sequence")
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad == 0).all() and stats["clip_fraction"] == 1.0
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0] != 0 and grad[0, 1] == 0 and stats["clip_fraction"] == 0.5


def test_clip_higher_lets_a_rising_token_go_further():
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - 0.22                                       # ρ = 1.246
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.tensor([[True]])
    (clipped,) = torch.autograd.grad(grpo_loss(logp, old, adv, mask)[0], logp)
    (free,) = torch.autograd.grad(grpo_loss(logp, old, adv, mask, epsilon_high=0.28)[0], logp)
    assert clipped.item() == 0 and free.item() == pytest.approx(-torch.exp(torch.tensor(0.22)))


@pytest.mark.parametrize("options, message", [
    (dict(loss_type="token_mean"), "loss_type must be one of"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(epsilon_high=-0.1), "epsilon_high must be"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level must be"),
    (dict(kl_bias_correction=1), "kl_bias_correction must be True or False"),
    (dict(totals=(5,)), "totals must be"),
])
def test_bad_family_arguments_are_named(options, message):
    logp, old, adv, mask, _ = random_case()
    with pytest.raises(ValueError, match=message):
        grpo_loss(logp, old, adv, mask, **options)
