"""Frozen NF4 experts: dequantize only the experts a batch routed tokens to (QLoRA on MoE).

A stacked expert weight W [E, K, N] (the minimoe layout) is stored once as NF4 with double
quantization (miniquant, blocksize 64 by default): row-major, so expert e owns elements
e·K·N .. (e+1)·K·N, and with K·N a multiple of the blocksize no block is shared by two
experts — what `selective_dequantize_nf4` needs to read one expert without its neighbours.

Per call, from the Routing that `flatten_sort_count` produced:

    active   = experts with rows, ascending             # from the Routing's host offsets
    Wc       = selective_dequantize_nf4(q, active)      # [n_active, K, N]: the only copy
    compact  = routing.compacted()                      # ids remapped to 0..n_active-1,
                                                        # offsets = expert_offsets[active]
    A_c, B_c = the active experts' LoRA rows / columns  # [r·n_active, K], [N, r·n_active]
    out      = parallel_linear(x, Wc, compact, gates, lora=ExpertLoRA(A_c, B_c, scaling))

The sorted order does not change (active experts keep their relative order), so
`sorted_scattered_idxs` is reused as is. The transient dequantized buffer is n_active·K·N
elements instead of E·K·N; an expert without tokens is never read. The NF4 storage is held as
buffers and `Wc` is a fresh tensor outside autograd, so gradients reach x, the gates and the
LoRA factors only (selecting the active LoRA slices is an index, so the unused experts' LoRA
rows get exactly-zero gradients).

Under autograd no dequantized weight lives between forward and backward: the backward
dequantizes again, as bitsandbytes' 4-bit matmul does for a dense layer. Without gates on the
torch backend (a MoE MLP's gate and up projections) that is all the base needs, dX = dY·Wcᵀ:
`_FrozenNF4Linear` dequantizes and multiplies once each way, and only the LoRA term is
checkpointed (rerun in the backward: its gathered inputs and x·Aᵀ are not kept). Otherwise
(gates, whose gradient reads the outputs; the Triton kernels, which take the weight whole)
the whole call is checkpointed: it keeps its inputs and reruns in the backward, base
products included. Either way the same operations as autograd through the call, in the same
order: the same bits.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from miniquant.linear import NF4Buffers
from miniquant.nf4 import FROM_CONFIG, NF4Config, NF4Weight, quantize_nf4
from miniquant.triton_dequant import selective_dequantize_nf4, selective_dequantize_nf4_torch

from .experts import init_expert_lora
from .ops import check_expert_lora
from .parallel_experts import (
    ExpertLoRA,
    check_gates,
    expert_lora,
    expert_lora_weights,
    parallel_linear,
    torch_parallel_linear_dx,
)
from .routing import Routing

__all__ = ["NF4Experts", "active_experts", "nf4_parallel_linear", "quantize_experts"]


def quantize_experts(W: torch.Tensor, blocksize: int = FROM_CONFIG,
                     double_quant: bool = FROM_CONFIG, nested_rounding: str = FROM_CONFIG, *,
                     nf4_config: NF4Config | None = None) -> NF4Weight:
    """W [E, K, N] -> NF4Weight of that shape, as `nf4_config` (or its fields as keywords;
    miniquant.NF4Config's defaults) says; each expert's K·N must be whole blocks."""
    cfg = NF4Config.of(nf4_config, blocksize=blocksize, double_quant=double_quant,
                       nested_rounding=nested_rounding)
    if W.dim() != 3:
        raise ValueError(f"W must be [E, K, N], got shape {tuple(W.shape)}")
    E, K, N = W.shape
    if (K * N) % cfg.blocksize:
        raise ValueError(f"each expert's K·N = {K * N} elements must be a multiple of the "
                         f"blocksize {cfg.blocksize}, so that no block spans two experts")
    return quantize_nf4(W.detach(), **dataclasses.asdict(cfg))


def active_experts(expert_offsets: torch.Tensor) -> torch.Tensor:
    """Inclusive end offsets [E] -> int64 ids of the experts with at least one row, ascending.
    (A Routing knows them without a sync: `Routing.active_experts()`.)"""
    counts = torch.diff(expert_offsets, prepend=expert_offsets.new_zeros(1))
    return torch.nonzero(counts > 0).reshape(-1)


def _compact_lora(lora: ExpertLoRA | None, active: torch.Tensor, shape) -> ExpertLoRA | None:
    """A [r·E, K], B [N, r·E] -> the active experts' slices [r·n, K], [N, r·n] (autograd)."""
    if lora is None:
        return None
    E, K, N = shape
    r, n = check_expert_lora(lora.A, lora.B, E, K, N), active.numel()
    A_c = lora.A.reshape(E, r, K).index_select(0, active).reshape(n * r, K)
    B_c = lora.B.reshape(N, E, r).index_select(1, active).reshape(N, n * r)
    return ExpertLoRA(A_c, B_c, lora.scaling)


def nf4_parallel_linear(x: torch.Tensor, q: NF4Weight, routing: Routing, *,
                        gates: torch.Tensor | None = None, grouped_in: bool = False,
                        grouped_out: bool = False, lora: ExpertLoRA | None = None,
                        backend: str = "triton", stats: dict | None = None,
                        lora_path: str = "fused") -> torch.Tensor:
    """`parallel_linear` with a frozen NF4 weight q [E, K, N]: same arguments and result,
    computed in x's dtype, dequantizing only the experts that received rows.

    If `stats` is a dict it receives `active` (the expert ids, list), `n_active`,
    `n_experts` and `dequant_bytes` (nbytes of the transient compact weight buffer).
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a Routing (flatten_sort_count, Routing.from_indices), "
                        f"got {type(routing).__name__}")
    if not isinstance(q, NF4Weight) or len(q.shape) != 3:
        raise ValueError("q must be an [E, K, N] NF4Weight (see quantize_experts)")
    E, K, N = q.shape
    if routing.n_experts != E:
        raise ValueError(f"the routing is over {routing.n_experts} experts, q has {E}")
    check_gates(routing, gates, grouped_out)
    lora_A, lora_B, scaling = ExpertLoRA(*lora) if lora is not None else (None, None, 1.0)
    active, compact = routing.compacted()          # ids renumbered 0..n-1, sorted order kept
    n = len(active)
    if n < routing.k:
        # A top-k router gives k distinct experts per token, so n >= k whenever T >= 1.
        raise ValueError(f"only {n} experts received rows, fewer than k={routing.k}")
    # The kernel on a GPU (or in the interpreter); the same bits from PyTorch on backend="torch".
    dequant = selective_dequantize_nf4 if backend == "triton" else selective_dequantize_nf4_torch
    ids = torch.tensor(active, dtype=torch.int64)            # host ids: checked without a sync
    ids_dev = ids.to(x.device)
    if stats is not None:
        stats.update(active=active, n_active=n, n_experts=E,
                     dequant_bytes=n * K * N * x.element_size())

    dtype = x.dtype

    def weight() -> torch.Tensor:
        """The active experts dequantized: [n, K, N] in x's dtype, outside autograd. It holds
        q and the host ids, no activation: `_FrozenNF4Linear` keeps it outside autograd's
        saved tensors, where a checkpoint around the call could not drop it."""
        Wc = dequant(q, ids, dtype=dtype)
        assert not Wc.requires_grad and Wc.grad_fn is None, "the NF4 weight must stay frozen"
        return Wc

    def expert_linear(x, gates, lora_A, lora_B):
        Wc = weight()                                                          # [n, K, N]
        lora_c = _compact_lora(expert_lora(lora_A, lora_B, scaling), ids_dev, q.shape)
        return parallel_linear(x, Wc, compact, gates=gates, grouped_in=grouped_in,
                               grouped_out=grouped_out, lora=lora_c, backend=backend,
                               lora_path=lora_path)

    if not torch.is_grad_enabled():
        return expert_linear(x, gates, lora_A, lora_B)
    # The backward needs Wc (dX = dY·Wcᵀ); saving it would keep n·K·N floats per projection
    # alive until then, the very copy QLoRA avoids: the backward dequantizes again.
    if backend == "torch" and gates is None:          # and needs no output: nothing rerun
        return _ungated_torch(x, weight, compact, expert_lora(lora_A, lora_B, scaling),
                              ids_dev, q.shape, grouped_in, grouped_out)
    # Checkpointing the call keeps only its inputs and reruns it in the backward, Wc and the
    # outputs dgates reads included.
    return checkpoint(expert_linear, x, gates, lora_A, lora_B, use_reentrant=False)


class _FrozenNF4Linear(torch.autograd.Function):
    """x -> the frozen NF4 expert linear on the torch backend, without gates or LoRA; its
    gradient goes to x only. The forward dequantizes and multiplies; the backward dequantizes
    again for dX = dY·Wcᵀ, the only product it needs. Nothing of size K·N lives in between,
    and, unlike a checkpoint, the forward's products are not computed twice: without gates
    the backward never reads the output."""

    @staticmethod
    def forward(ctx, x, weight, routing, grouped_in, grouped_out):
        ctx.weight, ctx.routing, ctx.n_rows = weight, routing, x.shape[0]
        ctx.grouped = grouped_in, grouped_out
        return parallel_linear(x, weight(), routing, grouped_in=grouped_in,
                               grouped_out=grouped_out, backend="torch")            # [M, N]

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch_parallel_linear_dx(dout, ctx.weight(), ctx.routing, *ctx.grouped,
                                          ctx.n_rows)                       # [rows of x, K]
        return dx, None, None, None, None


def _ungated_torch(x, weight, compact, lora, ids, shape, grouped_in, grouped_out):
    """The torch backend without gates, under autograd: the base through `_FrozenNF4Linear`,
    plus scaling · (x A_eᵀ) B_eᵀ as the split path computes it, checkpointed (it keeps x only
    and recomputes its gathered inputs and x·Aᵀ, small beside the base). The same operations
    as the checkpointed call, so the same bits, less the base's second forward."""
    base = _FrozenNF4Linear.apply(x, weight, compact, grouped_in, grouped_out)    # [M, N]
    if lora is None:
        return base

    def lora_term(x, lora_A, lora_B):
        lora_c = _compact_lora(ExpertLoRA(lora_A, lora_B), ids, shape)
        WA, WB = expert_lora_weights(lora_c, len(ids), *shape[1:])         # [n, K, r], [n, r, N]
        h = parallel_linear(x, WA, compact, grouped_in=grouped_in, grouped_out=True,
                            backend="torch")                                # [M, r] sorted
        return parallel_linear(h, WB, compact, grouped_in=True, grouped_out=grouped_out,
                               backend="torch")                             # [M, N]

    d = checkpoint(lora_term, x, lora.A, lora.B, use_reentrant=False)      # [M, N]
    # base + scaling · d, in place: the same bits without two more [M, N] buffers (neither
    # the Function nor the checkpoint reads its output back).
    return base.add_(d.mul_(lora.scaling))


class NF4Experts(NF4Buffers):
    """A frozen [E, K, N] expert linear held in NF4 (buffers), with optional trainable expert
    LoRA (`experts.init_expert_lora`): `lora_A` [r·E, K] (kaiming-uniform, a=√5), `lora_B`
    [N, r·E] (zeros), scaling α/r.

    `forward(x, routing, *, gates=None, grouped_in=False, grouped_out=False, backend=None)`
    is `nf4_parallel_linear`; `last_stats` holds its stats (active experts, dequant-buffer
    bytes) after each call.
    """

    def __init__(self, weight: NF4Weight, r: int = 0, alpha: float = 16.0,
                 backend: str = "triton"):
        super().__init__()
        if len(weight.shape) != 3:
            raise ValueError(f"weight must be an [E, K, N] NF4Weight, got {tuple(weight.shape)}")
        self.n_experts, self.in_features, self.out_features = weight.shape
        self.backend, self.lora_path = backend, "fused"
        self.hold_nf4(weight)
        init_expert_lora(self, *weight.shape, r, alpha, weight.device)
        self.last_stats: dict = {}

    @classmethod
    def from_weight(cls, W: torch.Tensor, blocksize: int = FROM_CONFIG,
                    double_quant: bool = FROM_CONFIG, r: int = 0, alpha: float = 16.0,
                    backend: str = "triton", nested_rounding: str = FROM_CONFIG, *,
                    nf4_config: NF4Config | None = None) -> NF4Experts:
        """`quantize_experts(W, ...)` with these NF4 settings, held as buffers, with expert
        LoRA of rank `r` (none for r=0)."""
        cfg = NF4Config.of(nf4_config, blocksize=blocksize, double_quant=double_quant,
                           nested_rounding=nested_rounding)
        return cls(quantize_experts(W, nf4_config=cfg), r=r, alpha=alpha, backend=backend)

    def forward(self, x: torch.Tensor, routing: Routing, *, gates: torch.Tensor | None = None,
                grouped_in: bool = False, grouped_out: bool = False,
                backend: str | None = None) -> torch.Tensor:
        self.last_stats = {}
        lora = None if self.lora_A is None else ExpertLoRA(self.lora_A, self.lora_B, self.scaling)
        return nf4_parallel_linear(x, self.weight_nf4, routing, gates=gates,
                                   grouped_in=grouped_in, grouped_out=grouped_out, lora=lora,
                                   backend=backend or self.backend, stats=self.last_stats,
                                   lora_path=self.lora_path)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, in={self.in_features}, out={self.out_features}, "
                f"nf4 blocksize={self._static_fields.get('blocksize')}, r={self.r}")
