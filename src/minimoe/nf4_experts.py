"""Frozen NF4 experts: dequantize only the experts a batch routed tokens to (QLoRA on MoE).

A stacked expert weight W [E, K, N] (the minimoe layout) is stored once as NF4 with double
quantization (miniquant, blocksize 64 by default): row-major, so expert e owns elements
e·K·N .. (e+1)·K·N, and with K·N a multiple of the blocksize no block is shared by two
experts — what `selective_dequantize_nf4` needs to read one expert without its neighbours.

Per call, from the routing that `flatten_sort_count` produced:

    counts   = diff(expert_offsets)                     # tokens (slots) per expert [E]
    active   = nonzero(counts)                          # experts with tokens, ascending
    Wc       = selective_dequantize_nf4(q, active)      # [n_active, K, N]: the only copy
    remap    = full(E, -1); remap[active] = arange(n_active)
    sei_c    = remap[sorted_expert_idxs]                # compact ids 0..n_active-1
    offs_c   = expert_offsets[active]                   # end rows of the active experts
    A_c, B_c = the active experts' LoRA rows / columns  # [r·n_active, K], [N, r·n_active]
    out      = parallel_linear(x, Wc, k, sei_c, ssi, offs_c, gates, lora_A=A_c, lora_B=B_c)

The sorted order does not change (active experts keep their relative order), so
`sorted_scattered_idxs` is reused as is. The transient dequantized buffer is n_active·K·N
elements instead of E·K·N; an expert without tokens is never read. The NF4 storage is held as
buffers and `Wc` is a fresh tensor outside autograd, so gradients reach x, the gates and the
LoRA factors only (selecting the active LoRA slices is an index, so the unused experts' LoRA
rows get exactly-zero gradients). Under autograd the call is checkpointed: the forward keeps
its inputs, not Wc, and the backward dequantizes again — as bitsandbytes' 4-bit matmul does
for a dense layer — so no dequantized weight lives between forward and backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from miniquant.linear import NF4Buffers
from miniquant.nf4 import NF4Weight, quantize_nf4
from miniquant.triton_dequant import selective_dequantize_nf4, selective_dequantize_nf4_torch

from .experts import init_expert_lora
from .ops import check_expert_lora
from .parallel_experts import parallel_linear

__all__ = ["NF4Experts", "active_experts", "nf4_parallel_linear", "quantize_experts"]


def quantize_experts(W: torch.Tensor, blocksize: int = 64, double_quant: bool = True
                     ) -> NF4Weight:
    """W [E, K, N] -> NF4Weight of that shape; each expert's K·N must be whole blocks."""
    if W.dim() != 3:
        raise ValueError(f"W must be [E, K, N], got shape {tuple(W.shape)}")
    E, K, N = W.shape
    if (K * N) % blocksize:
        raise ValueError(f"each expert's K·N = {K * N} elements must be a multiple of the "
                         f"blocksize {blocksize}, so that no block spans two experts")
    return quantize_nf4(W.detach(), blocksize=blocksize, double_quant=double_quant)


def active_experts(expert_offsets: torch.Tensor) -> torch.Tensor:
    """Inclusive end offsets [E] -> int64 ids of the experts with at least one row, ascending."""
    counts = torch.diff(expert_offsets, prepend=expert_offsets.new_zeros(1))
    return torch.nonzero(counts > 0).reshape(-1)


def _compact_lora(lora_A, lora_B, active: torch.Tensor, shape):
    """A [r·E, K], B [N, r·E] -> the active experts' slices [r·n, K], [N, r·n] (autograd)."""
    if lora_A is None and lora_B is None:
        return None, None
    E, K, N = shape
    r, n = check_expert_lora(lora_A, lora_B, E, K, N), active.numel()
    A_c = lora_A.reshape(E, r, K).index_select(0, active).reshape(n * r, K)
    B_c = lora_B.reshape(N, E, r).index_select(1, active).reshape(N, n * r)
    return A_c, B_c


def nf4_parallel_linear(x: torch.Tensor, q: NF4Weight, k: int, sorted_expert_idxs: torch.Tensor,
                        sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor,
                        gates: torch.Tensor | None = None, grouped_in: bool = False,
                        grouped_out: bool = False, lora_A=None, lora_B=None,
                        scaling: float = 1.0, backend: str = "triton",
                        stats: dict | None = None, lora_path: str = "fused") -> torch.Tensor:
    """`parallel_linear` with a frozen NF4 weight q [E, K, N]: same arguments and result,
    computed in x's dtype, dequantizing only the experts that received rows.

    If `stats` is a dict it receives `active` (the expert ids, list), `n_active`,
    `n_experts` and `dequant_bytes` (nbytes of the transient compact weight buffer).
    """
    if not isinstance(q, NF4Weight) or len(q.shape) != 3:
        raise ValueError("q must be an [E, K, N] NF4Weight (see quantize_experts)")
    E = q.shape[0]
    if expert_offsets.shape != (E,):
        raise ValueError(f"expert_offsets must have shape [{E}] (E), "
                         f"got {tuple(expert_offsets.shape)}")
    active = active_experts(expert_offsets)                                    # [n]
    n = active.numel()
    if n < k:
        # A top-k router gives k distinct experts per token, so n >= k whenever T >= 1.
        raise ValueError(f"only {n} experts received rows, fewer than k={k}")
    # The kernel on a GPU (or in the interpreter); the same bits from PyTorch on backend="torch".
    dequant = selective_dequantize_nf4 if backend == "triton" else selective_dequantize_nf4_torch
    remap = torch.full((E,), -1, dtype=torch.int64, device=active.device)
    remap[active] = torch.arange(n, device=active.device)
    sei_c = remap[sorted_expert_idxs]                                          # [M] in 0..n-1
    offs_c = expert_offsets[active]                                            # [n]
    if stats is not None:
        K, N = q.shape[1:]
        stats.update(active=active.tolist(), n_active=n, n_experts=E,
                     dequant_bytes=n * K * N * x.element_size())

    def expert_linear(x, gates, lora_A, lora_B):
        Wc = dequant(q, active.to(q.device), dtype=x.dtype)                    # [n, K, N]
        assert not Wc.requires_grad and Wc.grad_fn is None, "the NF4 weight must stay frozen"
        A_c, B_c = _compact_lora(lora_A, lora_B, active, q.shape)
        return parallel_linear(x, Wc, k, sei_c, sorted_scattered_idxs, offs_c, gates=gates,
                               grouped_in=grouped_in, grouped_out=grouped_out, lora_A=A_c,
                               lora_B=B_c, scaling=scaling, backend=backend,
                               lora_path=lora_path)

    if not torch.is_grad_enabled():
        return expert_linear(x, gates, lora_A, lora_B)
    # The backward needs Wc (dX = dY·Wcᵀ); saving it would keep n·K·N floats per projection
    # alive until then, the very copy QLoRA avoids. Checkpointing the call keeps only its
    # inputs and rebuilds Wc (and the expert linear's intermediates) in the backward.
    return checkpoint(expert_linear, x, gates, lora_A, lora_B, use_reentrant=False)


class NF4Experts(NF4Buffers):
    """A frozen [E, K, N] expert linear held in NF4 (buffers), with optional trainable expert
    LoRA (`experts.init_expert_lora`): `lora_A` [r·E, K] (kaiming-uniform, a=√5), `lora_B`
    [N, r·E] (zeros), scaling α/r.

    `forward(x, k, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, gates=None,
    grouped_in=False, grouped_out=False, backend=None)` is `nf4_parallel_linear`;
    `last_stats` holds its stats (active experts, dequant-buffer bytes) after each call.
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
    def from_weight(cls, W: torch.Tensor, blocksize: int = 64, double_quant: bool = True,
                    r: int = 0, alpha: float = 16.0, backend: str = "triton") -> NF4Experts:
        return cls(quantize_experts(W, blocksize, double_quant), r=r, alpha=alpha,
                   backend=backend)

    def forward(self, x, k, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
                gates=None, grouped_in=False, grouped_out=False, backend=None):
        self.last_stats = {}
        return nf4_parallel_linear(x, self.weight_nf4, k, sorted_expert_idxs,
                                   sorted_scattered_idxs, expert_offsets, gates=gates,
                                   grouped_in=grouped_in, grouped_out=grouped_out,
                                   lora_A=self.lora_A, lora_B=self.lora_B,
                                   scaling=self.scaling, backend=backend or self.backend,
                                   stats=self.last_stats, lora_path=self.lora_path)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, in={self.in_features}, out={self.out_features}, "
                f"nf4 blocksize={self._static_fields.get('blocksize')}, r={self.r}")
