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

The routing travels as one `routing.Routing`, checked once where it was made: the launches
trust it (`trusted=True`) and the torch path slices by its host copy of the offsets, so no
call here syncs with the host. `parallel_linear` takes that Routing only; the index-tensor
forms (the course's and ScatterMoE's, docs/ARCHITECTURE.md, Sorted routing) are
`parallel_linear_from_indices`, which checks them into a Routing first (one sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import ops
from .routing import Routing

BACKENDS = ("torch", "triton")
LORA_PATHS = ("fused", "split")


class ExpertLoRA(NamedTuple):
    """Expert LoRA of an [E, K, N] expert linear, one value: A [r·E, K], B [N, r·E] (expert e
    owns rows / columns e·r:(e+1)·r), and the factor on its product."""
    A: torch.Tensor
    B: torch.Tensor
    scaling: float = 1.0


def expert_lora(lora_A, lora_B, scaling: float = 1.0) -> ExpertLoRA | None:
    """The index form's lora_A, lora_B, scaling as one value (None without LoRA).

    The index form: docs/ARCHITECTURE.md, Sorted routing."""
    return None if lora_A is None and lora_B is None else ExpertLoRA(lora_A, lora_B, scaling)


def _combine(Y: torch.Tensor, gates: torch.Tensor, k: int) -> torch.Tensor:
    """Y [T·k, N] in slot order, gates [T, k] -> [T, N] = Σ_j gates[t, j] · Y[t·k + j]."""
    T, N = gates.shape[0], Y.shape[1]
    return torch.bmm(gates.to(Y.dtype).unsqueeze(1), Y.view(T, k, N)).squeeze(1)


class ParallelLinear(torch.autograd.Function):
    """The Triton path. The routing was validated when it was made: every launch is trusted."""

    @staticmethod
    def forward(ctx, x, W, gates, routing, grouped_in, grouped_out, lora_A=None, lora_B=None,
                scaling=1.0):
        sei, ssi, offsets = routing
        k = routing.k
        if lora_A is None:
            Y = ops.scatter2scatter(x, W, sei, ssi, k, x_grouped=grouped_in,
                                    y_grouped=grouped_out, trusted=True,
                                    routing=routing)                         # [M, N]
        else:
            Y = ops.scatter2scatter_lora(x, W, lora_A, lora_B, scaling, sei, ssi, k,
                                         x_grouped=grouped_in, y_grouped=grouped_out,
                                         trusted=True, routing=routing)
        out = Y if gates is None else _combine(Y, gates, k)                 # [T, N] w/ gates
        ctx.save_for_backward(x, W, gates, sei, ssi, offsets, Y if gates is not None else None,
                              lora_A, lora_B)
        ctx.k, ctx.grouped_in, ctx.grouped_out = k, grouped_in, grouped_out
        ctx.scaling, ctx.routing = scaling, routing     # its row tiles serve the backward too
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
            dYg = ops.group(dout, ssi, fan_out=k, coeff=gates, trusted=True)          # [M, N]
        elif ctx.grouped_out:
            dYg = dout                                          # already sorted, [M, N]
        else:
            dYg = ops.group(dout, ssi, fan_out=1, trusted=True)                       # [M, N]
        Xg = x if ctx.grouped_in else ops.group(x, ssi, fan_out=k, trusted=True)      # [M, K]
        dW = ops.group_bwd_W(dYg, Xg, offsets, E, trusted=True) if need[1] else None
        dA = dB = dx = None
        if lora_A is not None and (need[6] or need[7]):
            dA, dB = ops.group_bwd_lora(dYg, Xg, lora_A, lora_B, offsets, ctx.scaling,
                                        trusted=True)
        if need[0]:
            # dX = dY @ W_eᵀ (+ s · (dY @ B_e) @ A_e): the forward kernel on transposed weights.
            Wt = W.transpose(1, 2)                                                    # [E, N, K]
            if lora_A is None:
                dXs = ops.scatter2scatter(dYg, Wt, sei, ssi, 1, x_grouped=True,
                                          y_grouped=ctx.grouped_in, trusted=True,
                                          routing=ctx.routing)                        # [M, K]
            else:
                dXs = ops.scatter2scatter_lora(dYg, Wt, lora_B.t(), lora_A.t(), ctx.scaling,
                                               sei, ssi, 1, x_grouped=True,
                                               y_grouped=ctx.grouped_in, trusted=True,
                                               routing=ctx.routing)
            dx = dXs if ctx.grouped_in or k == 1 else dXs.view(-1, k, dXs.shape[1]).sum(1)
        return dx, dW, dgates, None, None, None, dA, dB, None


def _torch_parallel_linear(x, W, routing, gates, grouped_in, grouped_out):
    """The sort-based PyTorch path: same order, same math, autograd does the backward. The
    expert slices come from the routing's host copy of the offsets (no sync)."""
    _, ssi, _ = routing
    k = routing.k
    Xg = x if grouped_in else x[ssi // k]                                  # [M, K] sorted
    # One view per expert: split's backward is one cat, where a slice per expert would each
    # give back a zero-filled [M, K] gradient for autograd to sum.
    Yg = torch.cat([Xe @ We for Xe, We in zip(Xg.split(routing.counts()), W.unbind(0),
                                              strict=True)])                # [M, N] sorted
    if grouped_out:
        return Yg                                                           # [M, N] sorted
    # Back to slot order by gathering with the inverse permutation (row of each slot): unlike
    # index_copy, whose backward keeps its source, a gather saves only the indices.
    Y = Yg[_inverse(ssi)]                                                   # [M, N] slot order
    return Y if gates is None else _combine(Y, gates, k)


def _inverse(ssi: torch.Tensor) -> torch.Tensor:
    """The sorted row of each slot [M]: the inverse of the permutation ssi."""
    return torch.empty_like(ssi).scatter_(0, ssi, torch.arange(ssi.numel(), device=ssi.device))


def torch_parallel_linear_dx(dout, W, routing, grouped_in, grouped_out, n_rows):
    """dx of `_torch_parallel_linear` without gates, for a W that gets no gradient, computed
    as autograd computes it there, op for op (the same bits): dout [M, N] -> [n_rows, K].
    For a caller that rebuilds W in its backward rather than keep it (nf4_experts)."""
    _, ssi, _ = routing
    if grouped_out:
        dYg = dout                                                          # [M, N] sorted
    else:   # the gather's backward: accumulate into zeros at the gathered rows
        dYg = dout.new_zeros(dout.shape).index_put_((_inverse(ssi),), dout, accumulate=True)
    dXg = torch.cat([dYe.mm(We.t()) for dYe, We in zip(dYg.split(routing.counts()),
                                                       W.unbind(0), strict=True)])   # [M, K]
    if grouped_in:
        return dXg
    return dXg.new_zeros(n_rows, W.shape[1]).index_put_((ssi // routing.k,), dXg,
                                                        accumulate=True)    # [T, K]


def expert_lora_weights(lora: ExpertLoRA, E: int, K: int, N: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors as expert weights, views (their gradients reach A and B): A [r·E, K] ->
    [E, K, r], B [N, r·E] -> [E, r, N]. Checks their shapes against W [E, K, N]."""
    r = ops.check_expert_lora(lora.A, lora.B, E, K, N)
    return lora.A.reshape(E, r, K).transpose(1, 2), lora.B.reshape(N, E, r).permute(1, 2, 0)


def _split_lora(x, W, routing, gates, grouped_in, grouped_out, lora, backend):
    """The split path: base + scaling · (x A_eᵀ) B_eᵀ per slot from three parallel_linears
    over views A -> [E, K, r], B -> [E, r, N] (their gradients come from the same rules)."""
    WA, WB = expert_lora_weights(lora, *W.shape)                        # [E, K, r], [E, r, N]
    go = grouped_out and gates is None
    base = parallel_linear(x, W, routing, grouped_in=grouped_in, grouped_out=go,
                           backend=backend)                             # [M, N]
    h = parallel_linear(x, WA, routing, grouped_in=grouped_in, grouped_out=True,
                        backend=backend)                                # [M, r] sorted
    d = parallel_linear(h, WB, routing, grouped_in=True, grouped_out=go, backend=backend)
    y = base + lora.scaling * d                                         # [M, N]
    return y if gates is None else _combine(y, gates, routing.k)       # [T, N] with gates


def check_gates(routing: Routing, gates, grouped_out: bool) -> None:
    """Gates mix each token's k slots: a floating [T, k] tensor for the routing's T tokens and
    k slots, with the output in slot order (not grouped)."""
    if gates is None:
        return
    if grouped_out:
        raise ValueError("gates combine slots into tokens: use grouped_out=False with gates")
    if not isinstance(gates, torch.Tensor) or not gates.is_floating_point():
        raise ValueError(f"gates must be a floating tensor [T, k], got "
                         f"{getattr(gates, 'dtype', type(gates).__name__)}")
    if gates.shape != (routing.n_tokens, routing.k):
        raise ValueError(f"gates must have shape [{routing.n_tokens}, {routing.k}] (T, k), got "
                         f"{tuple(gates.shape)}")


def parallel_linear(x: torch.Tensor, W: torch.Tensor, routing: Routing, *,
                    gates: torch.Tensor | None = None, grouped_in: bool = False,
                    grouped_out: bool = False, lora: ExpertLoRA | None = None,
                    backend: str = "triton", lora_path: str = "fused") -> torch.Tensor:
    """Expert linear over the routing's slots, with autograd.

    `routing` from `flatten_sort_count` or `Routing.from_indices`: validated when it was made,
    trusted here (no host sync). x [T, K] (or [M, K] sorted rows if grouped_in), W [E, K, N]
    -> [M, N] (slot order, or sorted if grouped_out), or [T, N] with gates [T, k] mixing each
    token's k outputs. `lora=ExpertLoRA(A [r·E, K], B [N, r·E], scaling)` adds
    scaling · (x @ A_eᵀ) @ B_eᵀ to each slot: on the triton backend fused into the base
    kernels (`lora_path="fused"`: scatter2scatter_lora, group_bwd_lora) or as separate expert
    linears (`"split"`, what the torch backend does). Index tensors (the course's index form
    and ScatterMoE's; docs/ARCHITECTURE.md, Sorted routing) go through
    `parallel_linear_from_indices`."""
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing (flatten_sort_count, Routing.from_indices); "
                        f"index tensors go to parallel_linear_from_indices, got "
                        f"{type(routing).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if lora_path not in LORA_PATHS:
        raise ValueError(f"lora_path must be one of {LORA_PATHS}, got {lora_path!r}")
    if not isinstance(W, torch.Tensor) or W.dim() != 3 or W.shape[0] != routing.n_experts:
        raise ValueError(f"W must be [E, K, N] with E = {routing.n_experts} (the routing's "
                         f"experts), got {tuple(getattr(W, 'shape', ()))}")
    rows = routing.n_rows if grouped_in else routing.n_tokens
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape != (rows, W.shape[1]):
        what = "M sorted rows" if grouped_in else "T tokens"
        raise ValueError(f"x must be [{rows}, {W.shape[1]}] ({what}, K), "
                         f"got {tuple(getattr(x, 'shape', ()))}")
    if routing.sorted_expert_idxs.device != x.device:
        raise ValueError(f"routing is on {routing.sorted_expert_idxs.device}, x on {x.device}")
    check_gates(routing, gates, grouped_out)
    if lora is not None:
        lora = ExpertLoRA(*lora)
        ops.check_expert_lora(lora.A, lora.B, *W.shape)
        if backend == "torch" or lora_path == "split":
            return _split_lora(x, W, routing, gates, grouped_in, grouped_out, lora, backend)
    if backend == "torch":
        return _torch_parallel_linear(x, W, routing, gates, grouped_in, grouped_out)
    A, B, scaling = lora if lora is not None else (None, None, 1.0)
    return ParallelLinear.apply(x, W, gates, routing, grouped_in, grouped_out, A, B,
                                float(scaling))


def parallel_linear_from_indices(x: torch.Tensor, W: torch.Tensor, k: int,
                                 sorted_expert_idxs: torch.Tensor,
                                 sorted_scattered_idxs: torch.Tensor,
                                 expert_offsets: torch.Tensor,
                                 gates: torch.Tensor | None = None, grouped_in: bool = False,
                                 grouped_out: bool = False, lora_A: torch.Tensor | None = None,
                                 lora_B: torch.Tensor | None = None, scaling: float = 1.0,
                                 backend: str = "triton", lora_path: str = "fused"
                                 ) -> torch.Tensor:
    """`parallel_linear` in the index form, for two conventions:

    - the course's (docs/ARCHITECTURE.md, Sorted routing): `(x, W, k, sorted_expert_idxs,
      sorted_scattered_idxs, expert_offsets, gates=None, grouped_in=False, grouped_out=False,
      lora_A=None, lora_B=None, scaling=1.0, backend="triton")`, the expert LoRA as its three
      parts;
    - ScatterMoE's output projection: `(h, W2, 1, sei, ssi, offsets, grouped_in=True,
      gates=gates)` with gates [T, top_k]: k = 1 there, and the sorted rows are read with
      top_k slots per token, top_k taken from the gates.

    The indices are checked into a Routing once (`Routing.from_indices`, one host sync):
    inconsistent ones are a ValueError naming the argument, never a wrong answer."""
    if not isinstance(W, torch.Tensor) or W.dim() != 3:
        raise ValueError(f"W must be [E, K, N], got {tuple(getattr(W, 'shape', ()))}")
    routing = Routing.from_indices(sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, k,
                                   W.shape[0])
    top_k = gates.shape[1] if isinstance(gates, torch.Tensor) and gates.dim() == 2 else 1
    if k == 1 and grouped_in and not grouped_out and top_k > 1:           # ScatterMoE's
        routing = routing.with_k(top_k)
    return parallel_linear(x, W, routing, gates=gates, grouped_in=grouped_in,
                           grouped_out=grouped_out, lora=expert_lora(lora_A, lora_B, scaling),
                           backend=backend, lora_path=lora_path)
