"""Routers: turn router logits into per-token expert choices and mixing weights.

Router math runs in float32 whatever the model dtype: softmax over a few experts in bf16
flips top-k choices between otherwise identical runs.

Three routers, one shape of answer — `(weights [T, k] float32, experts [T, k] int64)`,
ordered by the score that *selected* the experts, best first:

- `softmax_topk`: softmax over all E experts, keep the k largest (Switch, Mixtral).
- `sigmoid_topk`: independent sigmoid scores; an optional `bias` [E] is added only to
  choose the experts, the weights are the unbiased scores (DeepSeek-V3's
  auxiliary-loss-free balancing; `update_selection_bias` is its update rule).
- `group_topk`: top-k limited to the `topk_group` best of `n_group` equal contiguous expert
  groups. `scoring` scores the experts: "sigmoid" (DeepSeek-V3, the default) or "softmax"
  (DeepSeek-V2's group_limited_greedy); the selection bias works with either. `group_score`
  ranks the groups by their experts' selection scores (bias included):
  "top2_sum" (DeepSeek-V3, the default) sums each group's two best, "max" (DeepSeek-V2)
  takes its best. A group of one expert has no second score: both rules give that expert's
  own score (transformers' DeepseekV3TopkRouter raises there, as it takes topk(2) of each
  group). With `topk_group == n_group`, or groups of one, a sigmoid group_topk is exactly
  `sigmoid_topk`.

Ties are broken deterministically towards the **lower index** (expert or group): selection
is a stable descending sort, not `torch.topk`, whose tie order is unspecified. (A group's
top-2 sum takes values only, so its tie order does not matter.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

METHODS = ("softmax_topk", "sigmoid_topk", "group_topk")
BIASED = ("sigmoid_topk", "group_topk")        # the routers that take a selection bias
GROUP_SCORES = ("top2_sum", "max")             # group_topk's group ranking; V3's first
SCORINGS = ("sigmoid", "softmax")              # group_topk's expert scores; V3's first


def route(logits: torch.Tensor, k: int, method: str = "softmax_topk", renormalize: bool = True,
          *, bias: torch.Tensor | None = None, n_group: int | None = None,
          topk_group: int | None = None, routed_scaling_factor: float = 1.0,
          group_score: str = "top2_sum", scoring: str = "sigmoid"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), best expert first.

    renormalize: rescale the k kept weights to sum to 1 (Mixtral, DeepSeek-V3); otherwise
    they keep their softmax mass (Switch, k=1) or their raw sigmoid scores.
    bias [E] (sigmoid_topk, group_topk only): added to the scores for selection only.
    n_group, topk_group, group_score, scoring (group_topk only): E experts in n_group equal
    contiguous groups, ranked by group_score ("top2_sum" | "max"); top-k is taken within the
    topk_group best groups; the experts scored by scoring ("sigmoid" | "softmax").
    routed_scaling_factor: multiplies the final weights (DeepSeek's; 1.0 leaves them).
    """
    _check(logits, k, method, bias, n_group, topk_group, routed_scaling_factor, group_score,
           scoring)
    if bias is not None:
        bias = bias.float()
    return _route(logits.float(), k, method, renormalize, bias, n_group, topk_group,
                  routed_scaling_factor, group_score=group_score, scoring=scoring)


def _route(logits, k, method, renormalize, bias, n_group, topk_group, routed_scaling_factor,
           group_score="top2_sum", scoring="sigmoid"):
    """The router math, unchecked, in the dtype of `logits` (float64 for gradcheck)."""
    softmax = method == "softmax_topk" or (method == "group_topk" and scoring == "softmax")
    scores = F.softmax(logits, dim=-1) if softmax else torch.sigmoid(logits)
    select = scores.detach()                  # the choice is discrete: no gradient through it
    if bias is not None:
        select = select + bias.to(select.dtype)
    if method == "group_topk":
        T, E = select.shape
        size = E // n_group
        grouped = select.view(T, n_group, size)                                  # [T, G, S]
        if group_score == "max":
            group = grouped.amax(dim=-1)                                         # [T, G]
        else:     # the two best of each group (one, in groups of one expert), summed
            group = grouped.topk(min(2, size), dim=-1).values.sum(dim=-1)        # [T, G]
        groups = _topk_stable(group, topk_group)                                 # [T, g]
        keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.repeat_interleave(size, dim=1)                               # [T, E]
        select = select.masked_fill(~keep, float("-inf"))
    experts = _topk_stable(select, k)
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, experts


def _topk_stable(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, largest first, ties to the lower index."""
    return x.sort(dim=-1, descending=True, stable=True).indices[:, :k]


class NonFiniteLogitsError(ValueError, FloatingPointError):
    """Logits that hold NaN or Inf: a router's here, a language model's in minirl (which
    imports this class). Called directly, the function got bad input (a ValueError); inside
    a model in training it is divergence (a FloatingPointError, which minituner's NaN guard
    turns into a recorded stop instead of a crash)."""


def _check(logits, k, method, bias, n_group, topk_group, routed_scaling_factor, group_score,
           scoring) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    n_experts = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        raise ValueError(f"k must be in 1..{n_experts} (the number of experts), got {k}")
    check_router(method, n_experts, k, n_group=n_group, topk_group=topk_group,
                 routed_scaling_factor=routed_scaling_factor, group_score=group_score,
                 scoring=scoring)
    if bias is not None:
        if method not in BIASED:
            raise ValueError(f"bias is a selection bias of {' / '.join(BIASED)} only, "
                             f"not {method!r}")
        if bias.shape != (n_experts,):
            raise ValueError(f"bias must have shape ({n_experts},), got {tuple(bias.shape)}")
    # One check (one host sync) for logits and bias: +Inf logits give NaN weights (inf/inf),
    # -Inf a zero-mass choice.
    finite = torch.isfinite(logits).all()
    if bias is not None:
        finite = finite & torch.isfinite(bias).all()
    if not finite:
        if torch.isfinite(logits).all():
            raise ValueError("bias must be finite")
        bad = "NaN" if torch.isnan(logits).any() else "±Inf"
        raise NonFiniteLogitsError(f"logits contain {bad}: router logits must be finite "
                                   "(a non-finite router input or weight)")


def check_router(method: str, n_experts: int | None = None, k: int | None = None, *,
                 n_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0, group_score: str = "top2_sum",
                 scoring: str = "sigmoid", prefix: str = "") -> None:
    """ValueError naming the argument (after `prefix`, e.g. "moe_") unless `route` accepts
    these options for `n_experts` experts, k per token. n_experts (and k) None: only what
    does not depend on them is checked (a config without experts yet)."""
    if method not in METHODS:
        raise ValueError(f"{prefix}method must be one of {METHODS}, got {method!r}")
    if isinstance(routed_scaling_factor, bool) or not (
            isinstance(routed_scaling_factor, (int, float)) and routed_scaling_factor > 0
            and math.isfinite(routed_scaling_factor)):
        raise ValueError(f"{prefix}routed_scaling_factor must be a finite number > 0, "
                         f"got {routed_scaling_factor!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"{prefix}group_score must be one of {GROUP_SCORES}, "
                         f"got {group_score!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"{prefix}scoring must be one of {SCORINGS}, got {scoring!r}")
    if method != "group_topk":
        if n_group is not None or topk_group is not None:
            raise ValueError(f"{prefix}n_group / {prefix}topk_group are for the 'group_topk' "
                             f"router, not {method!r}")
        if group_score != GROUP_SCORES[0] or scoring != SCORINGS[0]:
            raise ValueError(f"{prefix}group_score / {prefix}scoring are for the 'group_topk' "
                             f"router, not {method!r}")
        return
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 \
            or (n_experts is not None and n_experts % n_group):
        raise ValueError(f"{prefix}n_group must be a positive divisor of the "
                         f"{n_experts if n_experts is not None else 'number of'} experts, "
                         f"got {n_group!r}")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) \
            or not 1 <= topk_group <= n_group:
        raise ValueError(f"{prefix}topk_group must be in 1..{n_group} ({prefix}n_group), "
                         f"got {topk_group!r}")
    if n_experts is not None and k is not None and k > topk_group * (n_experts // n_group):
        size = n_experts // n_group
        raise ValueError(f"k={k} experts per token exceeds the {topk_group * size} experts in "
                         f"{prefix}topk_group={topk_group} groups of {size}")


def update_selection_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float
                          ) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step: bias + rate · sign(mean load − load).

    Underloaded experts go up by `rate`, overloaded ones down, exactly-average ones stay.
    Returns a new float32 tensor; call it after each step with that step's counts, e.g.
    `torch.bincount(experts.flatten(), minlength=E)`.
    """
    if bias.dim() != 1:
        raise ValueError(f"bias must be [experts], got shape {tuple(bias.shape)}")
    if tokens_per_expert.shape != bias.shape:
        raise ValueError(f"tokens_per_expert must have shape {tuple(bias.shape)}, "
                         f"got {tuple(tokens_per_expert.shape)}")
    if not rate >= 0:
        raise ValueError(f"rate must be >= 0, got {rate!r}")
    load = tokens_per_expert.float()
    return bias.float() + rate * torch.sign(load.mean() - load)


def load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor, *,
                        scoring: str = "softmax") -> torch.Tensor:
    """Switch Transformer auxiliary loss  N · Σ_i f_i · P_i  (1.0 when perfectly balanced).

    f_i: fraction of the T·k routing slots that chose expert i (not differentiable);
    P_i: mean router probability of expert i over the T tokens (carries the gradient).
    scoring="softmax": the probabilities are softmax(logits) (Switch). scoring="sigmoid":
    each token's sigmoid scores divided by their sum, s_i / Σ_j s_j — DeepSeek-V3's
    complementary balance loss, taken over all T tokens rather than per sequence — so a
    sigmoid router is pushed through the scores it selects with.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    n_experts = logits.shape[1]
    if scoring == "softmax":
        probs = F.softmax(logits.float(), dim=-1)                   # [T, E]
    else:
        s = torch.sigmoid(logits.float())                           # [T, E]
        probs = s / s.sum(dim=-1, keepdim=True)
    counts = torch.bincount(experts.flatten(), minlength=n_experts)  # [E]
    f = counts.float() / experts.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss  mean over tokens of logsumexp(logits)²  (float32).

    Penalises large router logits, which round badly and make the softmax brittle.
    `logits` is [..., E]; the mean runs over every leading position.
    """
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
