"""Routers: turn router logits into per-token expert choices and mixing weights.

Router math runs in float32 whatever the model dtype: softmax over a few experts in bf16
flips top-k choices between otherwise identical runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, k: int, method: str = "softmax_topk", renormalize: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), best expert first.

    softmax_topk: softmax over all E experts, keep the k largest; with `renormalize` the k
    kept weights are rescaled to sum to 1 (Mixtral), otherwise they keep their softmax mass
    (Switch, k=1).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    n_experts = logits.shape[1]
    if not 1 <= k <= n_experts:
        raise ValueError(f"k must be in 1..{n_experts} (the number of experts), got {k}")
    if method != "softmax_topk":
        raise ValueError(f"method must be 'softmax_topk', got {method!r}")
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


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
