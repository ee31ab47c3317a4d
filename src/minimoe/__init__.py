"""minimoe: Mixture-of-Experts routing and expert dispatch.

Now: the softmax top-k router, the Switch load-balancing loss, and a plain PyTorch
dispatch MoE MLP that MiniGPT-MoE is pretrained with. The Triton kernels (scatter2scatter,
group, group_bwd_W, LoRA forms) arrive with Labs 07–10; see BLUEPRINT.md.
"""

from .moe import MoEMLP, dispatch_torch, expert_swiglu
from .routing import load_balancing_loss, route

__all__ = ["MoEMLP", "dispatch_torch", "expert_swiglu", "load_balancing_loss", "route"]
