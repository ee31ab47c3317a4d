"""minirl.grpo_loss: against a per-token loop, hand-derived one-token gradients, clipping
on and off, the KL, and the argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from minirl import grpo_loss


def loop_loss(logp, old, adv, mask, eps, ref=None, beta=0.0):
    """The definition written token by token (autograd through scalar ops)."""
    per_seq = []
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logp[i, t] - old[i, t])
            clipped = min(max(ratio, torch.tensor(1 - eps)), torch.tensor(1 + eps))
            term = -torch.minimum(ratio * adv[i], clipped * adv[i])
            if ref is not None:
                d = ref[i, t] - logp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            terms.append(term)
        per_seq.append(sum(terms) / len(terms))
    return sum(per_seq) / len(per_seq)


def random_case(B=5, T=7, seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp.detach() + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([1, T, 3, T - 2, 2][:B])               # rows of different lengths
    start = torch.tensor([2, 0, 1, 1, 4][:B])
    pos = torch.arange(T)
    mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
    return logp, old, adv, mask, ref


@pytest.mark.parametrize("clip_eps", [0.1, 0.2, 0.5])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_loss_and_gradient_match_a_loop(clip_eps, kl_coef):
    logp, old, adv, mask, ref = random_case()
    loss, stats = grpo_loss(logp, old, adv, mask, clip_eps, ref_logp=ref, kl_coef=kl_coef)
    (grad,) = torch.autograd.grad(loss, logp)
    want = loop_loss(logp, old, adv, mask, clip_eps, ref, kl_coef)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert (grad[~mask] == 0).all()
    assert 0 < stats["clip_fraction"] < 1       # the spread puts tokens on both sides
    assert stats["mean_kl"] > 0


def ratio_case(log_ratio: float, adv: float):
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - log_ratio
    return logp, old, torch.tensor([adv], dtype=torch.float64), torch.tensor([[True]])


@pytest.mark.parametrize("log_ratio, adv, clipped", [
    (0.1, 2.0, False),     # ρ = 1.105 inside [0.8, 1.2]
    (0.5, 2.0, True),      # ρ = 1.65 > 1.2 and A > 0: clipped, no gradient
    (0.5, -2.0, False),    # ρ > 1.2 but A < 0: the unclipped term is the smaller one
    (-0.5, -2.0, True),    # ρ = 0.61 < 0.8 and A < 0: clipped
    (-0.5, 2.0, False),    # ρ < 0.8 but A > 0: not clipped
    (0.0, -1.5, False),    # ρ = 1: the plain policy gradient
])
def test_one_token_gradient_is_the_hand_derived_one(log_ratio, adv, clipped):
    logp, old, A, mask = ratio_case(log_ratio, adv)
    loss, stats = grpo_loss(logp, old, A, mask, clip_eps=0.2)
    loss.backward()
    rho = math.exp(log_ratio)
    # loss = −ρ·A with ρ = exp(logp − old): d loss / d logp = −A·ρ, or 0 when the clip holds.
    want_grad = 0.0 if clipped else -adv * rho
    want_loss = -adv * (min(max(rho, 0.8), 1.2) if clipped else rho)
    assert logp.grad.item() == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert stats["clip_fraction"] == float(clipped)
    assert stats["mean_ratio"] == pytest.approx(rho)


def test_one_token_kl_gradient_is_the_hand_derived_one():
    logp, old, A, mask = ratio_case(0.0, 1.0)
    ref = torch.tensor([[-1.3]], dtype=torch.float64)
    loss, stats = grpo_loss(logp, old, A, mask, ref_logp=ref, kl_coef=0.1)
    loss.backward()
    d = -1.3 - (-1.0)
    # k3 = e^d − d − 1, d = ref − logp: d k3 / d logp = 1 − e^d
    assert stats["mean_kl"] == pytest.approx(math.exp(d) - d - 1)
    assert logp.grad.item() == pytest.approx(-1.0 + 0.1 * (1 - math.exp(d)), rel=1e-12)


def test_kl_is_zero_when_policy_is_the_reference():
    logp, old, adv, mask, _ = random_case(seed=1)
    with_kl, stats = grpo_loss(logp, old, adv, mask, ref_logp=logp.detach(), kl_coef=0.5)
    without, _ = grpo_loss(logp, old, adv, mask)
    assert stats["mean_kl"] == 0.0
    g1 = torch.autograd.grad(with_kl, logp)[0]
    g2 = torch.autograd.grad(without, logp)[0]
    assert torch.equal(with_kl, without) and torch.equal(g1, g2)


def test_on_fresh_samples_the_loss_is_minus_the_mean_advantage():
    logp, _, adv, mask, _ = random_case(seed=2)
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask)
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert stats == {"clip_fraction": 0.0, "mean_ratio": 1.0}
    (grad,) = torch.autograd.grad(loss, logp)
    # each completion token of sequence i: −A_i / (|o_i| · B)
    want = -adv[:, None] / mask.sum(1, keepdim=True) / len(adv) * mask
    torch.testing.assert_close(grad, want)


def test_constants_get_no_gradient():
    logp, old, adv, mask, ref = random_case(seed=3)
    old, adv, ref = (t.clone().requires_grad_() for t in (old, adv, ref))
    loss, _ = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1)
    loss.backward()
    assert logp.grad is not None
    assert old.grad is None and adv.grad is None and ref.grad is None


def test_a_stats_only_reference_does_not_change_the_loss():
    logp, old, adv, mask, ref = random_case(seed=4)
    loss, stats = grpo_loss(logp, old, adv, mask, ref_logp=ref)
    plain, _ = grpo_loss(logp, old, adv, mask)
    assert torch.equal(loss, plain) and stats["mean_kl"] > 0


def test_float32_inputs():
    logp, old, adv, mask, ref = (t.float() if t.is_floating_point() else t
                                 for t in random_case(seed=5))
    loss, _ = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("name, bad, message", [
    ("logp", torch.zeros(5), r"logp must be a floating-point \[sequences, tokens\]"),
    ("logp", torch.zeros(5, 7, dtype=torch.long), "logp must be a floating-point"),
    ("old_logp", torch.zeros(5, 6), r"old_logp must be a floating-point tensor of shape \[5, 7\]"),
    ("ref_logp", torch.zeros(4, 7), r"ref_logp must be .* shape \[5, 7\]"),
    ("advantages", torch.zeros(5, 1), r"advantages must be .* shape \[5\]"),
    ("advantages", torch.zeros(5, dtype=torch.long), r"advantages must be a floating-point"),
    ("mask", torch.ones(5, 7), r"mask must be a bool tensor of shape \[5, 7\]"),
])
def test_bad_arguments_are_named(name, bad, message):
    logp, old, adv, mask, ref = random_case()
    args = dict(logp=logp, old_logp=old, advantages=adv, mask=mask, ref_logp=ref)
    args[name] = bad
    with pytest.raises(ValueError, match=message):
        grpo_loss(**args)


def test_an_empty_mask_row_is_named():
    logp, old, adv, mask, _ = random_case()
    mask[3] = False
    with pytest.raises(ValueError, match="mask row 3 has no completion token"):
        grpo_loss(logp, old, adv, mask)


def test_bad_coefficients_and_missing_reference():
    logp, old, adv, mask, ref = random_case()
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
        grpo_loss(logp, old, adv, mask, kl_coef=0.1)
    for bad in (0.0, -0.2, math.nan):
        with pytest.raises(ValueError, match="clip_eps must be a finite number > 0"):
            grpo_loss(logp, old, adv, mask, clip_eps=bad)
    for bad in (-0.1, math.inf):
        with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
            grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=bad)
    adv[1] = math.nan
    with pytest.raises(ValueError, match="advantages must be finite"):
        grpo_loss(logp, old, adv, mask)
