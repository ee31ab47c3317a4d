"""Group-relative advantages: how much better each answer is than its siblings.

GRPO has no value network. The baseline for an answer is the mean reward of the G answers
sampled for the same prompt, and the scale is their standard deviation:

    A[p, g] = (r[p, g] − mean_g r[p]) / (std_g r[p] + eps)

std is the sample standard deviation (Bessel's correction, as TRL's GRPOTrainer), so the
numbers compare with TRL's. Normalising within the group makes an easy prompt (most answers
right) and a hard one (few right) give signals of the same size.

A group whose rewards are all equal (every answer right, or every answer wrong) has nothing
to prefer: its advantages are exactly 0, so it adds no gradient (but still costs its
samples; `variance_fraction` is the share of groups that teach something). The arithmetic
alone does not give that: the float mean of equal values can differ from them in the last
bit (3 × 0.1 / 3 = 0.10000000000000002), the std then comes out near 1e-16 instead of 0, and
that rounding error over (std + eps) is a meaningless advantage (0/0 with eps = 0).

eps only keeps the division finite. The default 1e-6 is small beside the std of any group
whose rewards differ at all here (exact match moves in steps of 1, partial credit in steps of
1/n for answers of at most a few dozen characters), so A is the plain z-score to about 1e-5.
TRL hard-codes 1e-4; pass eps=1e-4 for its numbers. The difference shows only on nearly equal
groups: [0.2, 0.25, 0.2, 0.2] gives A = 1.49994 for the 0.25 with 1e-6 and 1.49402 with 1e-4.

`scale` (TRL's `scale_rewards`): "group" divides by each group's std as above; "batch" by
the std of every reward in the batch (one scale for all groups, so a group whose rewards
barely differ gets small advantages instead of ±1-sized ones); "none" keeps r − mean, the
Dr. GRPO choice, which does not up-weight low-variance (too easy or too hard) prompts.
A group whose rewards are all equal gets 0 under every scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _check_rewards(rewards, min_group: int) -> torch.Tensor:
    """rewards as float64 [P, G], finite, P >= 1, G >= min_group."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group_size] (one row per prompt's group), "
                         f"got shape {list(r.shape)}")
    P, G = r.shape
    if P == 0 or G == 0:
        raise ValueError(f"rewards is empty (shape [{P}, {G}]); it needs at least one group")
    if G < min_group:
        raise ValueError(f"rewards has groups of {G} sample(s); GRPO needs at least "
                         f"{min_group} samples per group (group_size >= {min_group}): an "
                         f"answer is judged against the other answers to the same prompt")
    bad = (~torch.isfinite(r)).nonzero()
    if len(bad):
        p, g = bad[0].tolist()
        raise ValueError(f"rewards[{p}, {g}] is {r[p, g].item()}; every reward must be finite "
                         f"({len(bad)} non-finite value(s))")
    return r


SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor | Sequence[Sequence[float]], eps: float = 1e-6,
                     scale: str = "group") -> torch.Tensor:
    """rewards [P, G] -> float32 advantages [P, G] (see the module doc); G >= 2."""
    if not (isinstance(eps, int | float) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} (TRL's scale_rewards), got {scale!r}")
    r = _check_rewards(rewards, min_group=2)
    mean = r.mean(dim=1, keepdim=True)                                   # [P, 1]
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)                      # [P, 1] no variance
    if scale == "none":
        return torch.where(flat, 0.0, r - mean).float()
    std = r.std(dim=1, keepdim=True) if scale == "group" else r.std()    # [P, 1] or []
    return torch.where(flat, 0.0, (r - mean) / (std + eps)).float()


def variance_fraction(rewards: torch.Tensor | Sequence[Sequence[float]]) -> float:
    """Share of groups (rows of rewards [P, G]) whose rewards are not all equal: the groups
    that give GRPO any signal. A group of one sample has no variance."""
    r = _check_rewards(rewards, min_group=1)
    return (r != r[:, :1]).any(dim=1).double().mean().item()
