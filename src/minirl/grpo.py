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

The loss family (TRL's names and meanings, `GRPOTrainer`'s loss):

- `loss_type` says how token losses become one number, for B sequences of |o_i| completion
  tokens (L = max_completion_length):

      grpo     1/B Σ_i 1/|o_i| Σ_t ℓ_it      each completion counts the same (the paper's)
      bnpo     Σ_it ℓ_it / Σ_i |o_i|         each token counts the same, over this batch
      dapo     Σ_it ℓ_it / Σ_i |o_i|         the same over the whole batch of an update
      dr_grpo  Σ_it ℓ_it / (B · L)           a constant: no length term at all (Dr. GRPO)

  Under "grpo" a token of a long completion counts less than one of a short one: a long
  wrong answer is pushed down less per token than a short one (the length bias Dr. GRPO
  points out). bnpo and dapo differ only when a batch is split into micro-batches
  (`totals`): bnpo averages over each micro-batch's own tokens, dapo over the whole batch's.
- `epsilon_high`: the upper clip bound 1 + epsilon_high (DAPO's clip-higher) where the lower
  stays 1 − clip_eps; None: the same ε both ways.
- `importance_sampling_level="sequence"` (GSPO): one ratio per sequence,
  exp(mean_t (logp − old_logp)), clipped and applied to every token of it.
- `kl_bias_correction`: k3 is an estimate under samples of the policy; when they came from
  the old policy, weighting it by the importance ratio makes it an unbiased estimate of the
  current policy's KL (DeepSeek-V3.2; TRL's `use_bias_correction_kl`).

The stats are per-sequence means, averaged over the sequences, whatever the loss type.
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


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def check_family(loss_type, epsilon_high, importance_sampling_level, kl_bias_correction,
                  max_completion_length, totals) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if epsilon_high is not None and not (isinstance(epsilon_high, int | float)
                                         and math.isfinite(epsilon_high) and epsilon_high > 0):
        raise ValueError(f"epsilon_high must be None or a finite number > 0, got "
                         f"{epsilon_high!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}")
    if not isinstance(kl_bias_correction, bool):
        raise ValueError(f"kl_bias_correction must be True or False, got "
                         f"{kl_bias_correction!r}")
    if loss_type == "dr_grpo" and not (isinstance(max_completion_length, int)
                                       and max_completion_length >= 1):
        raise ValueError(f"loss_type='dr_grpo' divides by max_completion_length (the "
                         f"sampling cap, max_new_tokens): an int >= 1, got "
                         f"{max_completion_length!r}")
    if totals is not None and not (isinstance(totals, tuple) and len(totals) == 2
                                   and all(isinstance(n, int) and n >= 1 for n in totals)):
        raise ValueError(f"totals must be None or (sequences, completion tokens) of the whole "
                         f"batch, two ints >= 1, got {totals!r}")


def _aggregate(per_token: torch.Tensor, m: torch.Tensor, loss_type: str,
               max_completion_length: int | None, totals: tuple[int, int] | None
               ) -> torch.Tensor:
    """per_token [B, T] and the float mask m [B, T] -> the loss (see the module doc). With
    `totals` (the whole batch's sequences and tokens) the part of it these rows carry, so that
    the parts of a batch split into micro-batches sum to the whole batch's loss."""
    B = per_token.shape[0]
    n_seq, n_tok = totals or (B, None)
    if loss_type == "grpo":
        per_seq = (per_token * m).sum(dim=1) / m.sum(dim=1)                   # [B]
        return per_seq.mean() if totals is None else per_seq.sum() / n_seq
    total = (per_token * m).sum()
    if loss_type == "bnpo":
        return total / m.sum() * (B / n_seq)
    if loss_type == "dapo":
        return total / (m.sum() if n_tok is None else n_tok)
    return total / (n_seq * max_completion_length)                          # dr_grpo


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None,
              kl_coef: float = 0.0, *, loss_type: str = "grpo",
              epsilon_high: float | None = None, importance_sampling_level: str = "token",
              kl_bias_correction: bool = False, max_completion_length: int | None = None,
              totals: tuple[int, int] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, stats) for logp, old_logp, ref_logp [B, T], advantages [B], mask [B, T] bool.

    Gradients reach `logp` only (old_logp, ref_logp and advantages are constants). stats:
    `clip_fraction` (tokens where the clipped term is the one taken: ρ > 1+ε_high with A > 0,
    or ρ < 1−ε with A < 0), `mean_ratio`, and `mean_kl` (k3, bias-corrected when asked;
    present when ref_logp is given, whether or not kl_coef > 0), each a float averaged over
    each sequence's tokens, then over the sequences.

    The keywords are the loss family of the module doc: `loss_type`, `epsilon_high`,
    `importance_sampling_level`, `kl_bias_correction`; `max_completion_length` (dr_grpo's
    constant); `totals` = (sequences, completion tokens) of the whole batch when these rows
    are one micro-batch of it (the losses of the parts then add up to the whole's).
    """
    _check_args(logp, old_logp, advantages, mask, clip_eps, ref_logp, kl_coef)
    check_family(loss_type, epsilon_high, importance_sampling_level, kl_bias_correction,
                  max_completion_length, totals)
    eps_high = clip_eps if epsilon_high is None else epsilon_high
    m = mask.to(logp.dtype)                                               # [B, T]
    A = advantages.detach().to(logp.dtype)[:, None]                       # [B, 1]
    log_ratio = torch.where(mask, logp - old_logp.detach(), 0.0)          # [B, T]
    if importance_sampling_level == "sequence":                           # GSPO: [B, 1]
        log_ratio = (log_ratio.sum(dim=1) / m.sum(dim=1))[:, None]
    ratio = log_ratio.exp()                                               # [B, T] or [B, 1]
    clipped = ratio.clamp(1 - clip_eps, 1 + eps_high)
    per_token = -torch.min(ratio * A, clipped * A).expand_as(m)           # [B, T]
    is_clipped = ((ratio > 1 + eps_high) & (A > 0)) | ((ratio < 1 - clip_eps) & (A < 0))

    def seq_mean(t: torch.Tensor) -> torch.Tensor:                        # [B, T] -> []
        return ((t.expand_as(m) * m).sum(dim=1) / m.sum(dim=1)).mean()

    stats = {"clip_fraction": seq_mean(is_clipped.to(m.dtype)), "mean_ratio": seq_mean(ratio)}
    if ref_logp is not None:
        d = torch.where(mask, ref_logp.detach() - logp, 0.0)              # [B, T]
        kl = d.exp() - d - 1                                              # k3, 0 off the mask
        if kl_bias_correction:
            kl = kl * ratio
        if kl_coef:     # not 0 · kl: an overflowed kl of a stats-only reference would be NaN
            per_token = per_token + kl_coef * kl
        stats["mean_kl"] = seq_mean(kl)
    loss = _aggregate(per_token, m, loss_type, max_completion_length, totals)
    values = torch.stack([v.detach() for v in stats.values()]).tolist()  # one host sync
    return loss, dict(zip(stats, values, strict=True))
