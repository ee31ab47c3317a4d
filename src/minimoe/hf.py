"""Hugging Face MoE blocks (transformers 5) and minimoe: the weights, the names, expert LoRA.

transformers 5 stores a sparse-MoE block's experts as two stacked parameters in the (out, in)
layout of `nn.Linear`, gate and up fused, and calls the router `gate`:

    HF (Mixtral, Qwen-MoE, OLMoE, DeepSeek)  minimoe.MoEMLP
    mlp.gate.weight          [E, C]          mlp.router.weight   [E, C]
    mlp.experts.gate_up_proj [E, 2F, C]      mlp.w_gate [E, C, F] = gate_up_proj[:, :F]ᵀ
                                             mlp.w_up   [E, C, F] = gate_up_proj[:, F:]ᵀ
    mlp.experts.down_proj    [E, C, F]       mlp.w_down [E, F, C] = down_proj ᵀ
    mlp.gate.e_score_correction_bias [E]     mlp.router_bias [E]   (DeepSeek-V3, float32)

(ᵀ swaps the last two dimensions.) `moe_from_hf` copies a block into a `MoEMLP`;
`HF_NAMES` is the same table by name, which `minituner.save_adapter(..., names="hf")` uses to
write an adapter for the HF model.

`HFExperts` runs an HF experts module itself through minimoe's sorted dispatch
(`parallel_linear`), with expert LoRA on the parameters named: A [r·E, in], B [out, r·E],
expert e owning rows / columns e·r:(e+1)·r, as every expert LoRA here. Its `forward` has the
HF module's signature, so it replaces `block.experts` in place and the block's router,
top-k and mixing stay HF's own.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .experts import init_expert_lora
from .moe import MoEMLP
from .parallel_experts import ExpertLoRA, parallel_linear
from .routing import flatten_sort_count

__all__ = ["HF_NAMES", "HFExperts", "is_hf_experts", "moe_from_hf"]

# Our MoEMLP name -> (HF module, HF parameter) inside one MoE block.
HF_NAMES = {"router": ("gate", "weight"), "w_gate": ("experts", "gate_up_proj"),
            "w_up": ("experts", "gate_up_proj"), "w_down": ("experts", "down_proj")}
HF_EXPERT_PARAMS = ("gate_up_proj", "down_proj")     # registration order in transformers 5


def is_hf_experts(module: nn.Module) -> bool:
    """An HF experts module: 3-D gate_up_proj [E, 2F, C] and down_proj [E, C, F], an act_fn."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3
            and down.dim() == 3 and hasattr(module, "act_fn") and not isinstance(module, HFExperts)
            and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1])


def _router_options(router: nn.Module) -> dict:
    """MoEMLP's router options for an HF router module: DeepSeek-V3's (a selection bias),
    DeepSeek-V2's (a `topk_method`), else softmax top-k renormalised per `norm_topk_prob`
    (Mixtral has none and renormalises)."""
    if isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor):
        return dict(method="group_topk", n_group=router.num_group,
                    topk_group=router.topk_group, group_score="top2_sum", scoring="sigmoid",
                    renormalize=bool(router.norm_topk_prob),
                    routed_scaling_factor=float(router.routed_scaling_factor))
    topk_method = getattr(router, "topk_method", None)
    if topk_method is not None:          # DeepSeek-V2's router never renormalises
        scaling = dict(renormalize=False,
                       routed_scaling_factor=float(router.routed_scaling_factor))
        if topk_method == "greedy":
            return dict(method="softmax_topk", **scaling)
        if topk_method == "group_limited_greedy":
            return dict(method="group_topk", n_group=router.num_group,
                        topk_group=router.topk_group, group_score="max", scoring="softmax",
                        **scaling)
        raise ValueError(f"the router's topk_method must be 'greedy' or "
                         f"'group_limited_greedy', got {topk_method!r}")
    return dict(renormalize=bool(getattr(router, "norm_topk_prob", True)))


def moe_from_hf(block: nn.Module, backend: str = "torch") -> MoEMLP:
    """A `MoEMLP` with an HF sparse-MoE block's weights (copies; see the module table).

    Reads top_k and the router from the block's router: softmax top-k renormalised per
    `norm_topk_prob` (Mixtral renormalises); DeepSeek-V2's `topk_method` (greedy: softmax
    top-k; group_limited_greedy: softmax-scored group_topk ranking groups by their max) with
    its routed_scaling_factor and no renormalisation; DeepSeek-V3's sigmoid group_topk
    (top-2-sum groups), its e_score_correction_bias copied into `router_bias`. Copies a
    Qwen2-MoE shared expert (sigmoid-gated) or DeepSeek's shared experts (not gated) when
    there is one.
    """
    experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
    if not is_hf_experts(experts) or not isinstance(getattr(router, "weight", None),
                                                    torch.Tensor):
        raise ValueError(f"block must be a transformers sparse-MoE block with .gate.weight and "
                         f".experts.gate_up_proj / .down_proj, got {type(block).__name__}")
    E, two_f, C = experts.gate_up_proj.shape
    F = two_f // 2
    top_k = getattr(router, "top_k", None) or block.top_k
    shared = getattr(block, "shared_expert", None)         # Qwen2-MoE: sigmoid-gated
    gated = shared is not None
    if shared is None:
        shared = getattr(block, "shared_experts", None)    # DeepSeek-V2/V3: not gated
    shared_d_ff = shared.gate_proj.out_features if shared is not None else 0
    m = MoEMLP(C, F, E, top_k, backend=backend, shared_d_ff=shared_d_ff, shared_gated=gated,
               **_router_options(router))
    gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    with torch.no_grad():
        m.router.weight.copy_(router.weight)
        if m.has_router_bias and hasattr(router, "e_score_correction_bias"):
            m.router_bias.copy_(router.e_score_correction_bias)
        m.w_gate.copy_(gu[:, :F].transpose(1, 2))
        m.w_up.copy_(gu[:, F:].transpose(1, 2))
        m.w_down.copy_(down.transpose(1, 2))
        if shared_d_ff:
            m.shared_w_gate.copy_(shared.gate_proj.weight.T)
            m.shared_w_up.copy_(shared.up_proj.weight.T)
            m.shared_w_down.copy_(shared.down_proj.weight.T)
        if gated:
            m.shared_gate.copy_(block.shared_expert_gate.weight.T)
    return m.to(gu.dtype)


class _ExpertLoRAParams(nn.Module):
    """The LoRA of one stacked expert parameter [E, out, in]: lora_A [r·E, in], lora_B
    [out, r·E], scaling α/r (`experts.init_expert_lora`)."""

    def __init__(self, E: int, n_in: int, n_out: int, r: int, alpha: float, device):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = E, n_in, n_out
        init_expert_lora(self, E, n_in, n_out, r, alpha, device)


class HFExperts(nn.Module):
    """An HF experts module (frozen) through minimoe's dispatch, with expert LoRA.

    `params` names which of gate_up_proj / down_proj get LoRA (rank r each). The HF module is
    kept as `base`; `lora[name]` holds each LoRA. forward(hidden_states [T, C], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, C], as the HF module's.
    """

    def __init__(self, experts: nn.Module, r: int = 8, alpha: float = 16.0,
                 params: tuple[str, ...] = HF_EXPERT_PARAMS, backend: str = "torch"):
        super().__init__()
        if not is_hf_experts(experts):
            raise ValueError(f"experts must be a transformers experts module with 3-D "
                             f"gate_up_proj and down_proj, got {type(experts).__name__}")
        unknown = [p for p in params if p not in HF_EXPERT_PARAMS]
        if unknown or not params:
            raise ValueError(f"params must be a non-empty subset of {HF_EXPERT_PARAMS}, "
                             f"got {params!r}")
        experts.requires_grad_(False)
        self.base, self.backend = experts, backend
        self.n_experts = experts.gate_up_proj.shape[0]
        self.lora = nn.ModuleDict()
        for name in HF_EXPERT_PARAMS:            # registration order, as PEFT nests them
            if name in params:
                E, n_out, n_in = getattr(experts, name).shape
                self.lora[name] = _ExpertLoRAParams(E, n_in, n_out, r, alpha,
                                                    experts.gate_up_proj.device)
        self.train(experts.training)

    def _linear(self, name: str, x, routing, **kw) -> torch.Tensor:
        W = getattr(self.base, name).transpose(1, 2)                   # [E, in, out]
        held = self.lora[name] if name in self.lora else None
        lora = None if held is None else ExpertLoRA(held.lora_A.to(x.dtype),
                                                    held.lora_B.to(x.dtype), held.scaling)
        return parallel_linear(x, W, routing, lora=lora, backend=self.backend, **kw)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        routing = flatten_sort_count(top_k_index, self.n_experts)
        gu = self._linear("gate_up_proj", hidden_states, routing, grouped_out=True)  # [T·k, 2F]
        gate, up = gu.chunk(2, dim=-1)
        h = self.base.act_fn(gate) * up                                             # [T·k, F]
        return self._linear("down_proj", h, routing, grouped_in=True,
                            gates=top_k_weights.to(h.dtype))                        # [T, C]

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, lora on {list(self.lora)}"
