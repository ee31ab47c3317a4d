"""minimoe: Mixture-of-Experts routing and expert dispatch.

Now: softmax, sigmoid (selection-only bias) and group-limited top-k routers, the Switch
load-balancing and z losses, and a plain PyTorch
dispatch MoE MLP that MiniGPT-MoE is pretrained with, on any of the routers (the selection
bias updated by `update_router_biases` after each step); the ScatterMoE dispatch (sort once into
a validated `Routing`, Triton scatter2scatter / group / group_bwd_W, `parallel_linear` on a
Routing with autograd and expert LoRA as one `ExpertLoRA` value, and
`parallel_linear_from_indices` for index tensors) behind
`MoEMLP(backend="triton")`; frozen NF4 experts (`NF4Experts`, `nf4_parallel_linear`) that
dequantize only the experts with tokens; expert LoRA fused into the kernels
(`scatter2scatter_lora`, `group_bwd_lora`) or split, and `attach_expert_lora` to put it on a
`MoEMLP` over a float or an NF4 base; `minimoe.hf` for Hugging Face MoE blocks (their
weights into a `MoEMLP`, their experts through the dispatch with expert LoRA). See
BLUEPRINT.md.

`import minimoe` needs no triton (wheels for Linux only) and sets no environment variable:
the Triton kernels (`minimoe.kernels`) load at their first launch, or at the first access of
`minimoe.kernels`, and only then is triton imported, with its interpreter chosen on a machine
without CUDA. Without triton the torch backend works and a launch raises
`TritonUnavailableError`.
"""

import importlib

from . import reference
from .experts import ExpertLinear, lora_scaling
from .moe import (
    MoEMLP,
    attach_expert_lora,
    dispatch_torch,
    dispatch_triton,
    expert_swiglu,
    saved_per_token,
    update_router_biases,
)
from .nf4_experts import NF4Experts, nf4_parallel_linear, quantize_experts
from .ops import group, group_bwd_lora, group_bwd_W, scatter2scatter, scatter2scatter_lora
from .parallel_experts import ExpertLoRA, parallel_linear, parallel_linear_from_indices
from .routers import (
    NonFiniteLogitsError,
    load_balancing_loss,
    route,
    router_z_loss,
    update_selection_bias,
)
from .routing import Routing, flatten_sort_count


def __getattr__(name: str):
    if name == "kernels":                  # the kernel module, as `minimoe.kernels.…`
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Lab -> {public name: dotted path} of what the lab rebuilds (docs/ARCHITECTURE.md, Lab sources).
_LOOPS = {"linear_loop": "minimoe.reference.linear_loop",
          "moe_loop": "minimoe.reference.moe_loop"}
_DISPATCH = {"dispatch_torch": "minimoe.moe.dispatch_torch",
             "dispatch_triton": "minimoe.moe.dispatch_triton"}
_PARALLEL_LINEAR = {"parallel_linear": "minimoe.parallel_experts.parallel_linear",
                    "parallel_linear_from_indices":
                        "minimoe.parallel_experts.parallel_linear_from_indices",
                    "ParallelLinear": "minimoe.parallel_experts.ParallelLinear",
                    "torch_parallel_linear": "minimoe.parallel_experts._torch_parallel_linear",
                    "torch_parallel_linear_dx": "minimoe.parallel_experts.torch_parallel_linear_dx"}
REFERENCE = {
    "07-moe-routing": {
        "route": "minimoe.routers.route", "route_math": "minimoe.routers._route",
        "topk_stable": "minimoe.routers._topk_stable",
        "load_balancing_loss": "minimoe.routers.load_balancing_loss",
        "router_z_loss": "minimoe.routers.router_z_loss",
        "update_selection_bias": "minimoe.routers.update_selection_bias",
        "flatten_sort_count": "minimoe.routing.flatten_sort_count",
        "expert_swiglu": "minimoe.moe.expert_swiglu",
        "parallel_linear": "minimoe.parallel_experts.parallel_linear",
        "parallel_linear_from_indices": "minimoe.parallel_experts.parallel_linear_from_indices",
        **_DISPATCH, **_LOOPS,
    },
    "08-moe-forward-kernel": {
        **_LOOPS, **_PARALLEL_LINEAR, **_DISPATCH,
        "combine": "minimoe.parallel_experts._combine",
        "scatter2scatter": "minimoe.ops.scatter2scatter", "group": "minimoe.ops.group",
        "scatter2scatter_launch": "minimoe.ops._scatter2scatter",
        "scatter2scatter_kernel": "minimoe.kernels._scatter2scatter_kernel",
        "group_kernel": "minimoe.kernels._group_kernel",
    },
    "09-moe-backward-kernels": {
        **_LOOPS, **_PARALLEL_LINEAR, **_DISPATCH,
        "group_bwd_W": "minimoe.ops.group_bwd_W",
        "group_bwd_W_kernel": "minimoe.kernels._group_bwd_W_kernel",
    },
    "10-moe-lora": {
        **_LOOPS, **_PARALLEL_LINEAR, **_DISPATCH,
        "scatter2scatter_lora": "minimoe.ops.scatter2scatter_lora",
        "group_bwd_lora": "minimoe.ops.group_bwd_lora",
        "split_lora": "minimoe.parallel_experts._split_lora",
        "compact_lora": "minimoe.nf4_experts._compact_lora",
        "nf4_ungated_torch": "minimoe.nf4_experts._ungated_torch",
        "nf4_parallel_linear": "minimoe.nf4_experts.nf4_parallel_linear",
        "NF4Experts": "minimoe.nf4_experts.NF4Experts",
        "ExpertLinear": "minimoe.experts.ExpertLinear",
        "scatter2scatter_kernel": "minimoe.kernels._scatter2scatter_kernel",
        "group_bwd_lora_kernel": "minimoe.kernels._group_bwd_lora_kernel",
    },
}
# Named above for the tests that switch them off around one exercise, but given to the
# learner to build on in another: the grader does not stub these in the learner's kernel
# (course.grader.stubs).
GIVEN = {"10-moe-lora": (*_PARALLEL_LINEAR, "scatter2scatter_kernel")}
# Named by several labs, written in a later one than the first (the others switch them off):
# the student edition keeps these stubs until that lab is released (course.authoring.edition).
WRITTEN = dict.fromkeys(_PARALLEL_LINEAR, "09-moe-backward-kernels")

__all__ = ["GIVEN", "REFERENCE", "WRITTEN", "ExpertLinear", "ExpertLoRA", "MoEMLP", "NF4Experts",
           "NonFiniteLogitsError", "Routing", "attach_expert_lora", "dispatch_torch",
           "dispatch_triton", "expert_swiglu", "flatten_sort_count", "group", "group_bwd_W",
           "group_bwd_lora", "load_balancing_loss", "lora_scaling", "nf4_parallel_linear",
           "parallel_linear", "parallel_linear_from_indices", "quantize_experts", "reference",
           "route", "router_z_loss", "saved_per_token", "scatter2scatter", "scatter2scatter_lora",
           "update_router_biases", "update_selection_bias"]
