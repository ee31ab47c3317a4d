"""`parallel_linear`: the expert linear y = x @ W[e] over every routing slot, with autograd.

Triton backend (`ParallelLinear`, ScatterMoE's decomposition), M = T·k sorted rows:

    forward   Y  = scatter2scatter(x, W)                        # [M, N], slot or sorted order
              out[t] = Σ_j gates[t, j] · Y[t·k + j]             # with gates: [T, N]
    backward  dYg = group(dout, fan_out=k, coeff=gates)         # [M, N] sorted: gates · dout[t]
              dgates[t, j] = ⟨Y[t·k + j], dout[t]⟩
              Xg  = group(x, fan_out=k)                         # [M, K] sorted (or x if grouped)
              dW  = group_bwd_W(dYg, Xg, expert_offsets)        # [E, K, N]
              dX  = scatter2scatter(dYg, Wᵀ, x_grouped=True)    # [M, K] slot order, then
                    summed over the k slots of each token       # (kept [M, K] if grouped_in)

Expert LoRA (A [r·E, K], B [N, r·E]; expert e owns rows / columns e·r:(e+1)·r) adds
scaling · (x @ A_eᵀ) @ B_eᵀ to each slot before the gates mix them. Here it is composed from
two more parallel_linears over views A → [E, K, r], B → [E, r, N] (not yet the fused
scatter2scatter_lora / group_bwd_lora kernels), so its gradients come from the same kernels.

Torch backend: the same sorted order in plain PyTorch (gather, one matmul per expert slice,
scatter), differentiated by autograd.
"""

from __future__ import annotations

import torch

from . import ops

BACKENDS = ("torch", "triton")


def _combine(Y: torch.Tensor, gates: torch.Tensor, k: int) -> torch.Tensor:
    """Y [T·k, N] in slot order, gates [T, k] -> [T, N] = Σ_j gates[t, j] · Y[t·k + j]."""
    T, N = gates.shape[0], Y.shape[1]
    return torch.bmm(gates.to(Y.dtype).unsqueeze(1), Y.view(T, k, N)).squeeze(1)


class ParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W, gates, k, sei, ssi, offsets, grouped_in, grouped_out):
        Y = ops.scatter2scatter(x, W, sei, ssi, k, x_grouped=grouped_in,
                                y_grouped=grouped_out)                       # [M, N]
        out = Y if gates is None else _combine(Y, gates, k)                 # [T, N] w/ gates
        ctx.save_for_backward(x, W, gates, sei, ssi, offsets, Y if gates is not None else None)
        ctx.k, ctx.grouped_in, ctx.grouped_out = k, grouped_in, grouped_out
        return out

    @staticmethod
    def backward(ctx, dout):
        x, W, gates, sei, ssi, offsets, Y = ctx.saved_tensors
        k, E = ctx.k, W.shape[0]
        dout = dout.contiguous()
        dgates = None
        if gates is not None:                                   # dout [T, N]
            T, N = dout.shape
            dgates = (Y.view(T, k, N).float() * dout.float().unsqueeze(1)).sum(-1)   # [T, k]
            dgates = dgates.to(gates.dtype)
            dYg = ops.group(dout, ssi, fan_out=k, coeff=gates)                        # [M, N]
        elif ctx.grouped_out:
            dYg = dout                                          # already sorted, [M, N]
        else:
            dYg = ops.group(dout, ssi, fan_out=1)                                     # [M, N]
        Xg = x if ctx.grouped_in else ops.group(x, ssi, fan_out=k)                    # [M, K]
        dW = ops.group_bwd_W(dYg, Xg, offsets, E) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            dXs = ops.scatter2scatter(dYg, W.transpose(1, 2), sei, ssi, 1, x_grouped=True,
                                      y_grouped=ctx.grouped_in)                       # [M, K]
            dx = dXs if ctx.grouped_in or k == 1 else dXs.view(-1, k, dXs.shape[1]).sum(1)
        return dx, dW, dgates, None, None, None, None, None, None


def _torch_parallel_linear(x, W, k, sei, ssi, offsets, gates, grouped_in, grouped_out):
    """The sort-based PyTorch path: same order, same math, autograd does the backward."""
    Xg = x if grouped_in else x[ssi // k]                                  # [M, K] sorted
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    Yg = torch.cat([Xg[s:e] @ W[i] for i, (s, e) in enumerate(zip(starts, ends, strict=True))])
    if grouped_out:
        return Yg                                                           # [M, N] sorted
    Y = torch.empty_like(Yg).index_copy(0, ssi, Yg)                        # [M, N] slot order
    return Y if gates is None else _combine(Y, gates, k)


def _expert_lora_weights(lora_A, lora_B, E: int, K: int, N: int):
    """A [r·E, K], B [N, r·E] -> views WA [E, K, r], WB [E, r, N] (expert e: rows e·r:(e+1)·r)."""
    if lora_A is None or lora_B is None:
        raise ValueError("lora_A and lora_B must be given together")
    rE = lora_A.shape[0]
    if lora_A.dim() != 2 or lora_B.dim() != 2 or rE % E or lora_A.shape[1] != K \
            or tuple(lora_B.shape) != (N, rE):
        raise ValueError(f"lora_A must be [r·E, K] = [r·{E}, {K}] and lora_B [N, r·E] = "
                         f"[{N}, r·{E}], got {tuple(lora_A.shape)} and {tuple(lora_B.shape)}")
    r = rE // E
    return lora_A.reshape(E, r, K).transpose(1, 2), lora_B.reshape(N, E, r).permute(1, 2, 0)


def _with_lora(x, W, k, idx, gates, grouped_in, grouped_out, lora_A, lora_B, scaling, backend):
    """Base + scaling · LoRA per slot, then the gates: four parallel_linears, autograd."""
    E, K, N = W.shape
    WA, WB = _expert_lora_weights(lora_A, lora_B, E, K, N)             # [E, K, r], [E, r, N]
    go = grouped_out and gates is None
    base = parallel_linear(x, W, k, *idx, grouped_in=grouped_in, grouped_out=go,
                           backend=backend)                             # [M, N]
    h = parallel_linear(x, WA, k, *idx, grouped_in=grouped_in, grouped_out=True,
                        backend=backend)                                # [M, r] sorted
    d = parallel_linear(h, WB, k, *idx, grouped_in=True, grouped_out=go, backend=backend)
    y = base + scaling * d                                              # [M, N]
    return y if gates is None else _combine(y, gates, k)               # [T, N] with gates


def parallel_linear(x: torch.Tensor, W: torch.Tensor, k: int, sorted_expert_idxs: torch.Tensor,
                    sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor,
                    gates: torch.Tensor | None = None, grouped_in: bool = False,
                    grouped_out: bool = False, lora_A=None, lora_B=None, scaling: float = 1.0,
                    backend: str = "triton") -> torch.Tensor:
    """Expert linear over the routing slots: x [T, K] (or [M, K] sorted if grouped_in),
    W [E, K, N] -> [M, N] (slot order, or sorted if grouped_out), or [T, N] with gates [T, k]
    combining each token's k outputs. Indices from `flatten_sort_count`. With lora_A
    [r·E, K] and lora_B [N, r·E], each slot adds scaling · (x @ A_eᵀ) @ B_eᵀ."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if W.dim() != 3 or not 1 <= k <= W.shape[0]:
        raise ValueError(f"W must be [E, K, N] and k in 1..E, got W {tuple(W.shape)}, k={k}")
    if expert_offsets.shape != (W.shape[0],):
        raise ValueError(f"expert_offsets must have shape [{W.shape[0]}] (E), "
                         f"got {tuple(expert_offsets.shape)}")
    if gates is not None:
        if grouped_out:
            raise ValueError("gates combine slots into tokens: use grouped_out=False with gates")
        M = sorted_scattered_idxs.shape[0]
        if gates.shape != (M // k, k):
            raise ValueError(f"gates must have shape [{M // k}, {k}], got {tuple(gates.shape)}")
    if lora_A is not None or lora_B is not None:
        idx = (sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)
        return _with_lora(x, W, k, idx, gates, grouped_in, grouped_out, lora_A, lora_B,
                          scaling, backend)
    if backend == "torch":
        return _torch_parallel_linear(x, W, k, sorted_expert_idxs, sorted_scattered_idxs,
                                      expert_offsets, gates, grouped_in, grouped_out)
    return ParallelLinear.apply(x, W, gates, k, sorted_expert_idxs, sorted_scattered_idxs,
                                expert_offsets, grouped_in, grouped_out)
