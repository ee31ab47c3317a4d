"""The MoE MLP: a router picks k of E SwiGLU experts per token and mixes their outputs.

Expert weights are stored stacked, in the [E, K, N] (in, out) layout the dispatch kernels
use: expert e computes  y = (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .parallel_linear import parallel_linear
from .routing import load_balancing_loss, route
from .sort import flatten_sort_count

BACKENDS = ("torch", "triton")


def expert_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens: x [n, C], w_gate/w_up [C, F], w_down [F, C] -> [n, C]."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def dispatch_torch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
                   ) -> torch.Tensor:
    """Plain PyTorch dispatch: for each expert, gather its tokens, run it, scatter-add back.

    x [T, C]; weights, experts [T, k]; returns [T, C]. Experts with no tokens are skipped.
    """
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y = expert_swiglu(x[token], w_gate[e], w_up[e], w_down[e])
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


def dispatch_triton(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
                    ) -> torch.Tensor:
    """ScatterMoE dispatch: sort the slots once, three `parallel_linear`s over sorted rows.

    x [T, C]; weights, experts [T, k]; returns [T, C]. Same math as `dispatch_torch`.
    """
    k = experts.shape[1]
    idx = flatten_sort_count(experts, w_gate.shape[0])          # 3 × [T·k] / [E]
    g = parallel_linear(x, w_gate, k, *idx, grouped_out=True)   # [T·k, F] sorted
    u = parallel_linear(x, w_up, k, *idx, grouped_out=True)     # [T·k, F] sorted
    h = F.silu(g) * u                                           # [T·k, F] sorted
    # Down projection from sorted rows back to tokens, the k outputs mixed by the gates.
    return parallel_linear(h, w_down, k, *idx, gates=weights, grouped_in=True)  # [T, C]


class MoEMLP(nn.Module):
    """Top-k routed SwiGLU experts. After each forward, `aux_loss` holds the balancing loss."""

    def __init__(self, n_embd: int, d_ff: int, n_experts: int, top_k: int,
                 backend: str = "torch"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in 1..n_experts={n_experts}, got {top_k}")
        self.n_experts, self.top_k, self.backend = n_experts, top_k, backend
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(n_experts, n_embd, d_ff))   # [E, C, F]
        self.w_up = nn.Parameter(torch.empty(n_experts, n_embd, d_ff))     # [E, C, F]
        self.w_down = nn.Parameter(torch.empty(n_experts, d_ff, n_embd))   # [E, F, C]
        self.aux_loss = torch.zeros(())
        self.last_experts: torch.Tensor | None = None  # [T, k] choices of the last forward
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.router.weight, self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(p, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                        # [T, C]
        # Router in float32 whatever the model dtype (see routing.py).
        logits = F.linear(x.float(), self.router.weight.float())           # [T, E]
        # k=1 keeps the softmax probability (Switch): renormalised it would be exactly 1 and
        # the router would learn from the balancing loss alone.
        weights, experts = route(logits, self.top_k, renormalize=self.top_k > 1)  # [T, k]
        self.aux_loss = load_balancing_loss(logits, experts)
        self.last_experts = experts.detach()
        dispatch = dispatch_triton if self.backend == "triton" else dispatch_torch
        out = dispatch(x, weights, experts, self.w_gate, self.w_up, self.w_down)
        return out.reshape(shape)
