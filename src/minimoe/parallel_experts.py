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
scaling · (x @ A_eᵀ) @ B_eᵀ to each slot before the gates mix them. Fused (default):

    forward   Y  = scatter2scatter_lora(x, W, A, B)             # base + LoRA in one kernel
    backward  dA, dB = group_bwd_lora(dYg, Xg, A, B)            # one kernel, both factors
              dX  = scatter2scatter_lora(dYg, Wᵀ, Bᵀ, Aᵀ)      # dY W_eᵀ + s (dY B_e) A_e

Split (`lora_path="split"`): two more parallel_linears over views A -> [E, K, r],
B -> [E, r, N], so A and B get their gradients from the dW and dX rules above.

Torch backend: the same sorted order in plain PyTorch (gather, one matmul per expert slice,
scatter), differentiated by autograd.
"""

from __future__ import annotations

import torch

from . import ops

BACKENDS = ("torch", "triton")
LORA_PATHS = ("fused", "split")


def _combine(Y: torch.Tensor, gates: torch.Tensor, k: int) -> torch.Tensor:
    """Y [T·k, N] in slot order, gates [T, k] -> [T, N] = Σ_j gates[t, j] · Y[t·k + j]."""
    T, N = gates.shape[0], Y.shape[1]
    return torch.bmm(gates.to(Y.dtype).unsqueeze(1), Y.view(T, k, N)).squeeze(1)


class ParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W, gates, k, sei, ssi, offsets, grouped_in, grouped_out,
                lora_A=None, lora_B=None, scaling=1.0):
        if lora_A is None:
            Y = ops.scatter2scatter(x, W, sei, ssi, k, x_grouped=grouped_in,
                                    y_grouped=grouped_out)                   # [M, N]
        else:
            Y = ops.scatter2scatter_lora(x, W, lora_A, lora_B, scaling, sei, ssi, k,
                                         x_grouped=grouped_in, y_grouped=grouped_out)
        out = Y if gates is None else _combine(Y, gates, k)                 # [T, N] w/ gates
        ctx.save_for_backward(x, W, gates, sei, ssi, offsets, Y if gates is not None else None,
                              lora_A, lora_B)
        ctx.k, ctx.grouped_in, ctx.grouped_out = k, grouped_in, grouped_out
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, dout):
        x, W, gates, sei, ssi, offsets, Y, lora_A, lora_B = ctx.saved_tensors
        k, E = ctx.k, W.shape[0]
        need = ctx.needs_input_grad
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
        dW = ops.group_bwd_W(dYg, Xg, offsets, E) if need[1] else None
        dA = dB = dx = None
        if lora_A is not None and (need[9] or need[10]):
            dA, dB = ops.group_bwd_lora(dYg, Xg, lora_A, lora_B, offsets, ctx.scaling)
        if need[0]:
            # dX = dY @ W_eᵀ (+ s · (dY @ B_e) @ A_e): the forward kernel on transposed weights.
            Wt = W.transpose(1, 2)                                                    # [E, N, K]
            if lora_A is None:
                dXs = ops.scatter2scatter(dYg, Wt, sei, ssi, 1, x_grouped=True,
                                          y_grouped=ctx.grouped_in)                   # [M, K]
            else:
                dXs = ops.scatter2scatter_lora(dYg, Wt, lora_B.t(), lora_A.t(), ctx.scaling,
                                               sei, ssi, 1, x_grouped=True,
                                               y_grouped=ctx.grouped_in)
            dx = dXs if ctx.grouped_in or k == 1 else dXs.view(-1, k, dXs.shape[1]).sum(1)
        return dx, dW, dgates, None, None, None, None, None, None, dA, dB, None


def _torch_parallel_linear(x, W, k, sei, ssi, offsets, gates, grouped_in, grouped_out):
    """The sort-based PyTorch path: same order, same math, autograd does the backward."""
    Xg = x if grouped_in else x[ssi // k]                                  # [M, K] sorted
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    Yg = torch.cat([Xg[s:e] @ W[i] for i, (s, e) in enumerate(zip(starts, ends, strict=True))])
    if grouped_out:
        return Yg                                                           # [M, N] sorted
    # Back to slot order by gathering with the inverse permutation (row of each slot): unlike
    # index_copy, whose backward keeps its source, a gather saves only the indices.
    row = torch.empty_like(ssi).scatter_(0, ssi, torch.arange(ssi.numel(), device=ssi.device))
    Y = Yg[row]                                                             # [M, N] slot order
    return Y if gates is None else _combine(Y, gates, k)


def _split_lora(x, W, k, idx, gates, grouped_in, grouped_out, lora_A, lora_B, scaling, backend):
    """The split path: base + scaling · (x A_eᵀ) B_eᵀ per slot from three parallel_linears
    over views A -> [E, K, r], B -> [E, r, N] (their gradients come from the same rules)."""
    E, K, N = W.shape
    r = ops.check_expert_lora(lora_A, lora_B, E, K, N)
    WA = lora_A.reshape(E, r, K).transpose(1, 2)                            # [E, K, r]
    WB = lora_B.reshape(N, E, r).permute(1, 2, 0)                           # [E, r, N]
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
                    backend: str = "triton", lora_path: str = "fused") -> torch.Tensor:
    """Expert linear over the routing slots: x [T, K] (or [M, K] sorted if grouped_in),
    W [E, K, N] -> [M, N] (slot order, or sorted if grouped_out), or [T, N] with gates [T, k]
    combining each token's k outputs. Indices from `flatten_sort_count`. With lora_A
    [r·E, K] and lora_B [N, r·E], each slot adds scaling · (x @ A_eᵀ) @ B_eᵀ: on the triton
    backend fused into the base kernels (`lora_path="fused"`, scatter2scatter_lora and
    group_bwd_lora) or as separate expert linears (`"split"`, what the torch backend does)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if lora_path not in LORA_PATHS:
        raise ValueError(f"lora_path must be one of {LORA_PATHS}, got {lora_path!r}")
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
    has_lora = lora_A is not None or lora_B is not None
    if has_lora and (backend == "torch" or lora_path == "split"):
        idx = (sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)
        return _split_lora(x, W, k, idx, gates, grouped_in, grouped_out, lora_A, lora_B,
                           scaling, backend)
    if backend == "torch":
        return _torch_parallel_linear(x, W, k, sorted_expert_idxs, sorted_scattered_idxs,
                                      expert_offsets, gates, grouped_in, grouped_out)
    if has_lora:
        ops.check_expert_lora(lora_A, lora_B, *W.shape)
    return ParallelLinear.apply(x, W, gates, k, sorted_expert_idxs, sorted_scattered_idxs,
                                expert_offsets, grouped_in, grouped_out, lora_A, lora_B,
                                float(scaling))
