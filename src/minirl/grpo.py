"""The GRPO loss: a clipped policy gradient with group-relative advantages and an optional KL.

For completion token t of sequence i, with ratio ρ = exp(logp − old_logp) (the policy that
is being trained over the one that sampled), advantage A_i (`group_advantages`, the same for
every token of the sequence) and ε = clip_eps:

    ℓ_it = −min(ρ·A_i, clip(ρ, 1−ε, 1+ε)·A_i) + β · KL_it
    KL_it = exp(ref − logp) − (ref − logp) − 1        (the k3 estimator, ≥ 0, β = kl_coef)

The min makes the objective pessimistic: once ρ has moved past 1 ± ε in the direction the
advantage favours, the clipped term wins and its gradient is 0, so several optimizer steps
on one batch of samples cannot push the policy far from the one that produced it. On the
first step on fresh samples ρ = 1 and the loss is the plain policy gradient −A·logp.

k3 is an unbiased estimate of KL(policy ‖ reference) from samples of the policy that, unlike
log(p/ref), is never negative; its gradient pulls logp towards ref, and it is what keeps a
model that is rewarded on one task from forgetting the others.

Averaging: each sequence's token losses are averaged over its own completion tokens, then
the sequences are averaged (the GRPO paper's 1/G Σ_i 1/|o_i| Σ_t). Every completion counts
the same whatever its length; a token of a long completion therefore counts less than one of
a short one (the length bias Dr. GRPO points out; summing over all tokens instead, as DAPO
does, is the alternative). The stats are averaged the same way.
"""

from __future__ import annotations

import math

import torch


def _check_same(name: str, t, shape: torch.Size) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != shape or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of shape {list(shape)} "
                         f"(as logp), got {getattr(t, 'dtype', type(t).__name__)} "
                         f"{list(getattr(t, 'shape', []))}")


def _check_args(logp, old_logp, advantages, mask, clip_eps, ref_logp, kl_coef) -> None:
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(f"logp must be a floating-point [sequences, tokens] tensor, got "
                         f"{getattr(logp, 'dtype', type(logp).__name__)} "
                         f"{list(getattr(logp, 'shape', []))}")
    _check_same("old_logp", old_logp, logp.shape)
    if ref_logp is not None:
        _check_same("ref_logp", ref_logp, logp.shape)
    B = logp.shape[0]
    if not isinstance(advantages, torch.Tensor) or advantages.shape != (B,) \
            or not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor of shape [{B}], one per "
                         f"sequence (group_advantages(...).flatten(), rows in Samples order), "
                         f"got {getattr(advantages, 'dtype', type(advantages).__name__)} "
                         f"{list(getattr(advantages, 'shape', []))}")
    if not isinstance(mask, torch.Tensor) or mask.shape != logp.shape \
            or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor of shape {list(logp.shape)} (as logp), "
                         f"got {getattr(mask, 'dtype', type(mask).__name__)} "
                         f"{list(getattr(mask, 'shape', []))}")
    empty = (~mask.any(dim=1)).nonzero()
    if len(empty):
        raise ValueError(f"mask row {int(empty[0])} has no completion token; every sequence "
                         f"needs at least one (its <eos> counts)")
    if not torch.isfinite(advantages).all():
        raise ValueError("advantages must be finite")
    if not (isinstance(clip_eps, int | float) and math.isfinite(clip_eps) and clip_eps > 0):
        raise ValueError(f"clip_eps must be a finite number > 0, got {clip_eps!r}")
    if not (isinstance(kl_coef, int | float) and math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp (the reference's token log-probs, "
                         f"reference_logprobs)")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None,
              kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, stats) for logp, old_logp, ref_logp [B, T], advantages [B], mask [B, T] bool.

    Gradients reach `logp` only (old_logp, ref_logp and advantages are constants). stats:
    `clip_fraction` (tokens where the clipped term is the one taken: ρ > 1+ε with A > 0, or
    ρ < 1−ε with A < 0), `mean_ratio`, and `mean_kl` (k3; present when ref_logp is given,
    whether or not kl_coef > 0), each a float averaged like the loss.
    """
    _check_args(logp, old_logp, advantages, mask, clip_eps, ref_logp, kl_coef)
    m = mask.to(logp.dtype)                                               # [B, T]
    A = advantages.detach().to(logp.dtype)[:, None]                       # [B, 1]
    ratio = torch.where(mask, logp - old_logp.detach(), 0.0).exp()        # [B, T]
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    per_token = -torch.min(ratio * A, clipped * A)                        # [B, T]
    is_clipped = ((ratio > 1 + clip_eps) & (A > 0)) | ((ratio < 1 - clip_eps) & (A < 0))

    def seq_mean(t: torch.Tensor) -> torch.Tensor:                        # [B, T] -> []
        return ((t * m).sum(dim=1) / m.sum(dim=1)).mean()

    stats = {"clip_fraction": seq_mean(is_clipped.to(m.dtype)), "mean_ratio": seq_mean(ratio)}
    if ref_logp is not None:
        d = torch.where(mask, ref_logp.detach() - logp, 0.0)              # [B, T]
        kl = d.exp() - d - 1                                              # k3, 0 off the mask
        if kl_coef:     # not 0 · kl: an overflowed kl of a stats-only reference would be NaN
            per_token = per_token + kl_coef * kl
        stats["mean_kl"] = seq_mean(kl)
    loss = seq_mean(per_token)
    values = torch.stack([v.detach() for v in stats.values()]).tolist()  # one host sync
    return loss, dict(zip(stats, values, strict=True))
