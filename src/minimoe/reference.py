"""The naive references every kernel is checked against: Python loops over tokens and slots.

Deliberately slow and obvious — one matrix-vector product per (token, chosen expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_linear(v: torch.Tensor, W: torch.Tensor, e: int, lora_A=None, lora_B=None,
                  scaling: float = 1.0) -> torch.Tensor:
    """One expert on one vector: v [K] @ W[e] (+ scaling · (v @ A_eᵀ) @ B_eᵀ) -> [N]."""
    out = v @ W[e]
    if lora_A is not None:
        r = lora_A.shape[0] // W.shape[0]
        out = out + scaling * ((v @ lora_A[e * r:(e + 1) * r].T) @ lora_B[:, e * r:(e + 1) * r].T)
    return out


def linear_loop(x: torch.Tensor, W: torch.Tensor, expert_idxs: torch.Tensor,
                gates: torch.Tensor | None = None, lora_A: torch.Tensor | None = None,
                lora_B: torch.Tensor | None = None, scaling: float = 1.0) -> torch.Tensor:
    """One expert linear per routing slot: x [T, K], W [E, K, N], expert_idxs [T, k].

    Without gates: [T·k, N] with row t·k + j = y(t, e) for e = expert_idxs[t, j], where
    y(t, e) = x[t] @ W[e]  (+ scaling · (x[t] @ A_eᵀ) @ B_eᵀ with lora_A [r·E, K] and lora_B
    [N, r·E], A_e = lora_A[e·r:(e+1)·r], B_e = lora_B[:, e·r:(e+1)·r]).
    With gates [T, k]: [T, N] with row t = Σ_j gates[t, j] · y(t, expert_idxs[t, j]).
    """
    T, k = expert_idxs.shape
    rows = []
    for t in range(T):
        ys = [expert_linear(x[t], W, int(expert_idxs[t, j]), lora_A, lora_B, scaling)
              for j in range(k)]                                          # k × [N]
        if gates is None:
            rows.extend(ys)
        else:
            rows.append(sum(gates[t, j].to(ys[j].dtype) * ys[j] for j in range(k)))
    return torch.stack(rows)


def moe_loop(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
             w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
             lora: tuple | None = None, scaling: float = 1.0) -> torch.Tensor:
    """SwiGLU MoE, token by token: x [T, C], weights/experts [T, k], w_gate/w_up [E, C, F],
    w_down [E, F, C] -> [T, C] = Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]).

    `lora`: optional ((A, B) of gate, of up, of down), each A [r·E, in], B [out, r·E],
    added to its projection with `scaling` as in `linear_loop`.
    """
    T, k = experts.shape
    ab = lora or ((None, None),) * 3
    rows = []
    for t in range(T):
        out = torch.zeros_like(x[t])
        for j in range(k):
            e = int(experts[t, j])
            h = (F.silu(expert_linear(x[t], w_gate, e, *ab[0], scaling))
                 * expert_linear(x[t], w_up, e, *ab[1], scaling))                     # [F]
            out = out + weights[t, j].to(x.dtype) * expert_linear(h, w_down, e, *ab[2],
                                                                  scaling)           # [C]
        rows.append(out)
    return torch.stack(rows)
