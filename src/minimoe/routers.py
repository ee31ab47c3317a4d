"""Routers: turn router logits into per-token expert choices and mixing weights.

Router math runs in float32 whatever the model dtype: softmax over a few experts in bf16
flips top-k choices between otherwise identical runs.

Three routers, one shape of answer — `(weights [T, k] float32, experts [T, k] int64)`,
ordered by the score that *selected* the experts, best first:

- `softmax_topk`: softmax over all E experts, keep the k largest (Switch, Mixtral).
- `sigmoid_topk`: independent sigmoid scores; an optional `bias` [E] is added only to
  choose the experts, the weights are the unbiased scores (DeepSeek-V3's
  auxiliary-loss-free balancing; `update_selection_bias` is its update rule).
- `group_topk`: the sigmoid router limited to `topk_group` of `n_group` expert groups
  (DeepSeek-V2/V3). A group's score is the **max** selection score of its experts
  (DeepSeek-V2's rule; V3 sums each group's top two instead). Max is defined for groups of
  one expert, and with `topk_group == n_group` the router is exactly `sigmoid_topk`.

Ties are broken deterministically towards the **lower index** (expert or group): selection
is a stable descending sort, not `torch.topk`, whose tie order is unspecified.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

METHODS = ("softmax_topk", "sigmoid_topk", "group_topk")


def route(logits: torch.Tensor, k: int, method: str = "softmax_topk", renormalize: bool = True,
          *, bias: torch.Tensor | None = None, n_group: int | None = None,
          topk_group: int | None = None, routed_scaling_factor: float = 1.0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), best expert first.

    renormalize: rescale the k kept weights to sum to 1 (Mixtral, DeepSeek-V3); otherwise
    they keep their softmax mass (Switch, k=1) or their raw sigmoid scores.
    bias [E] (sigmoid_topk, group_topk only): added to the scores for selection only.
    n_group, topk_group (group_topk only): E experts in n_group equal contiguous groups;
    top-k is taken within the topk_group best groups.
    routed_scaling_factor: multiplies the final weights (DeepSeek's; 1.0 leaves them).
    """
    _check(logits, k, method, bias, n_group, topk_group, routed_scaling_factor)
    if bias is not None:
        bias = bias.float()
    return _route(logits.float(), k, method, renormalize, bias, n_group, topk_group,
                  routed_scaling_factor)


def _route(logits, k, method, renormalize, bias, n_group, topk_group, routed_scaling_factor):
    """The router math, unchecked, in the dtype of `logits` (float64 for gradcheck)."""
    if method == "softmax_topk":
        scores = F.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    select = scores.detach()                  # the choice is discrete: no gradient through it
    if bias is not None:
        select = select + bias.to(select.dtype)
    if method == "group_topk":
        T, E = select.shape
        group_score = select.view(T, n_group, E // n_group).amax(dim=-1)        # [T, G]
        groups = _topk_stable(group_score, topk_group)                          # [T, g]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.repeat_interleave(E // n_group, dim=1)                      # [T, E]
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


def _check(logits, k, method, bias, n_group, topk_group, routed_scaling_factor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    n_experts = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        raise ValueError(f"k must be in 1..{n_experts} (the number of experts), got {k}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    # One check (one host sync): +Inf gives NaN weights (inf/inf), -Inf a zero-mass choice.
    if not torch.isfinite(logits).all():
        bad = "NaN" if torch.isnan(logits).any() else "±Inf"
        raise NonFiniteLogitsError(f"logits contain {bad}: router logits must be finite "
                                   "(a non-finite router input or weight)")
    if bias is not None:
        if method == "softmax_topk":
            raise ValueError("bias is a selection bias of sigmoid_topk / group_topk only")
        if bias.shape != (n_experts,):
            raise ValueError(f"bias must have shape ({n_experts},), got {tuple(bias.shape)}")
        if not torch.isfinite(bias).all():
            raise ValueError("bias must be finite")
    if not (isinstance(routed_scaling_factor, (int, float)) and routed_scaling_factor > 0):
        raise ValueError(f"routed_scaling_factor must be > 0, got {routed_scaling_factor!r}")
    if method != "group_topk":
        if n_group is not None or topk_group is not None:
            raise ValueError(f"n_group / topk_group are for method='group_topk', not {method!r}")
        return
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 \
            or n_experts % n_group:
        raise ValueError(f"n_group must be a positive divisor of the {n_experts} experts, "
                         f"got {n_group!r}")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) \
            or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in 1..{n_group} (n_group), got {topk_group!r}")
    if k > topk_group * (n_experts // n_group):
        raise ValueError(f"k={k} exceeds the {topk_group * (n_experts // n_group)} experts in "
                         f"topk_group={topk_group} groups of {n_experts // n_group}")


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


def load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer auxiliary loss  N · Σ_i f_i · P_i  (1.0 when perfectly balanced).

    f_i: fraction of the T·k routing slots that chose expert i (not differentiable);
    P_i: mean router probability of expert i over the T tokens (carries the gradient).
    """
    n_experts = logits.shape[1]
    probs = F.softmax(logits.float(), dim=-1)                       # [T, E]
    counts = torch.bincount(experts.flatten(), minlength=n_experts)  # [E]
    f = counts.float() / experts.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss  mean over tokens of logsumexp(logits)²  (float32).

    Penalises large router logits, which round badly and make the softmax brittle.
    `logits` is [..., E]; the mean runs over every leading position.
    """
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
