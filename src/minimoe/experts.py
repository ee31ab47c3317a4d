"""Expert linears with LoRA: a frozen stacked weight [E, K, N] plus trainable per-expert LoRA.

Layout (docs/ARCHITECTURE.md, Expert LoRA): `lora_A` [r·E, K], `lora_B` [N, r·E]; expert e
owns rows / columns e·r:(e+1)·r, so expert e adds scaling · (x @ A_eᵀ) @ B_eᵀ to its rows.
A starts kaiming-uniform (a=√5) and B at zero, as PEFT does, so a fresh adapter changes
nothing.

Two holders of the frozen weight share this module's LoRA setup and call signature:
`ExpertLinear` (float, the "LoRA on a float MoE" baseline) and `nf4_experts.NF4Experts`
(NF4, dequantized only where tokens went); `moe.attach_expert_lora` swaps them into a `MoEMLP`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .parallel_experts import ExpertLoRA, parallel_linear
from .routing import Routing


def lora_scaling(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The factor s of a LoRA update s·B·A: alpha / r, or alpha / sqrt(r) with rsLoRA (as
    PEFT). Every LoRA of the course (minituner's layers and adapter files, expert LoRA here)
    takes it from this function."""
    return alpha / (math.sqrt(r) if use_rslora else r)


def init_expert_lora(module: nn.Module, E: int, K: int, N: int, r: int, alpha: float,
                     device) -> None:
    """Give `module` lora_A [r·E, K], lora_B [N, r·E] and scaling α/r (r = 0: no LoRA)."""
    if not isinstance(r, int) or r < 0:
        raise ValueError(f"r must be an int >= 0 (0 = no LoRA), got {r!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    module.r, module.scaling = r, lora_scaling(alpha, r) if r else 1.0
    if r:
        module.lora_A = nn.Parameter(torch.empty(r * E, K, device=device))
        module.lora_B = nn.Parameter(torch.zeros(N, r * E, device=device))
        nn.init.kaiming_uniform_(module.lora_A, a=math.sqrt(5))
    else:
        module.lora_A = module.lora_B = None


class ExpertLinear(nn.Module):
    """A frozen float expert weight [E, K, N] (the same Parameter, not a copy) + expert LoRA.

    `forward(x, routing, *, gates=None, grouped_in=False, grouped_out=False, backend=None)`
    is `parallel_linear` with the LoRA (`lora_path`: "fused" kernels or the "split" path;
    see parallel_linear). `backend` given at call time wins (a MoEMLP passes its own); the
    attribute serves standalone use.
    """

    def __init__(self, weight: nn.Parameter, r: int = 8, alpha: float = 16.0,
                 backend: str = "triton"):
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise ValueError(f"weight must be an [E, K, N] tensor, got "
                             f"{getattr(weight, 'shape', type(weight).__name__)}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.weight.requires_grad_(False)
        self.n_experts, self.in_features, self.out_features = weight.shape
        self.backend, self.lora_path = backend, "fused"
        init_expert_lora(self, *weight.shape, r, alpha, weight.device)

    def forward(self, x: torch.Tensor, routing: Routing, *, gates: torch.Tensor | None = None,
                grouped_in: bool = False, grouped_out: bool = False,
                backend: str | None = None) -> torch.Tensor:
        lora = None if self.lora_A is None else ExpertLoRA(self.lora_A, self.lora_B, self.scaling)
        return parallel_linear(x, self.weight, routing, gates=gates, grouped_in=grouped_in,
                               grouped_out=grouped_out, lora=lora,
                               backend=backend or self.backend, lora_path=self.lora_path)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, in={self.in_features}, "
                f"out={self.out_features}, r={self.r}")
