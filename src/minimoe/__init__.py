"""minimoe: Mixture-of-Experts routing and expert dispatch.

Now: softmax, sigmoid (selection-only bias) and group-limited top-k routers, the Switch
load-balancing and z losses, and a plain PyTorch
dispatch MoE MLP that MiniGPT-MoE is pretrained with; the ScatterMoE dispatch (sort once,
Triton scatter2scatter / group / group_bwd_W, `parallel_linear` with autograd) behind
`MoEMLP(backend="triton")`; frozen NF4 experts (`NF4Experts`, `nf4_parallel_linear`) that
dequantize only the experts with tokens. Fused LoRA kernels arrive with Lab 10; see BLUEPRINT.md.
"""

from . import reference
from .moe import MoEMLP, dispatch_torch, dispatch_triton, expert_swiglu
from .nf4_experts import NF4Experts, nf4_parallel_linear, quantize_experts
from .ops import group, group_bwd_W, scatter2scatter
from .parallel_linear import parallel_linear
from .routing import load_balancing_loss, route, router_z_loss, update_selection_bias
from .sort import flatten_sort_count

__all__ = ["MoEMLP", "NF4Experts", "dispatch_torch", "dispatch_triton", "expert_swiglu",
           "flatten_sort_count", "group", "group_bwd_W", "load_balancing_loss",
           "nf4_parallel_linear", "parallel_linear", "quantize_experts", "reference", "route",
           "router_z_loss", "scatter2scatter", "update_selection_bias"]
