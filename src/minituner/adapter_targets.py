"""Where LoRA can live in a model: the modules and the expert parameters a target may name.

Two kinds of target, as PEFT's LoraConfig has them (their layout on disk: `peft_format`):

- a module (`target_modules`): an nn.Linear / QuantizedLinear, wrapped in `LoRALinear`.
- an expert parameter (`target_parameters`, "module.param"): a stacked weight [E, ·, ·] with
  a rank-r pair per expert: a `MoEMLP`'s w_gate, w_up, w_down ([E, in, out];
  `MoEMLP.is_transposed` tells PEFT) and an HF experts module's gate_up_proj, down_proj
  ([E, out, in]; raw, or wrapped in `minimoe.hf.HFExperts`), in registration order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from minimoe import MoEMLP
from minimoe.hf import HF_EXPERT_PARAMS, HFExperts, is_hf_experts
from minimoe.moe import PROJECTIONS
from miniquant import QuantizedLinear

from .lora import LoRALinear
from .peft_format import (  # noqa: F401  (peft_format's names, importable from here too)
    KEY_PREFIX,
    compact,
    from_peft_B,
    key_prefix,
    matches,
    pattern_value,
    to_peft_B,
)

LINEAR_TYPES = (nn.Linear, QuantizedLinear)


def module_slots(model: nn.Module) -> dict[str, nn.Module]:
    """Every named module LoRA could be asked for, outside LoRA wrappers' insides: name -> module.
    (A target name that lands on one of these must be a linear layer or is refused by name.)"""
    out, inside = {}, []
    for name, m in model.named_modules():
        if not name or any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, (LoRALinear, HFExperts)):
            inside.append(name)
        out[name] = m
    return out


@dataclass
class ParamSlot:
    """One expert parameter of the model: `module.param` in PEFT's terms (its holder of LoRA,
    if wrapped, in `holder`), E experts, per-expert shape (out, in), its index among the
    module's expert parameters in registration order."""

    module: str
    param: str
    n_experts: int
    out_features: int
    in_features: int
    index: int
    owner: nn.Module            # the MoEMLP, the raw HF experts module or the HFExperts
    holder: nn.Module | None    # the module holding lora_A / lora_B (None: not wrapped)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"


def _lora_holder(m) -> nn.Module | None:
    return m if isinstance(getattr(m, "lora_A", None), torch.Tensor) else None


def param_slots(model: nn.Module) -> list[ParamSlot]:
    """The expert parameters of `model`: each MoEMLP's w_gate / w_up / w_down (float
    Parameters or expert modules from `attach_expert_lora`) and each HF experts module's
    gate_up_proj / down_proj."""
    slots = []
    for name, m in module_slots(model).items():
        if isinstance(m, MoEMLP):
            for i, p in enumerate(PROJECTIONS):
                w = getattr(m, p)
                E, K, N = (w.n_experts, w.in_features, w.out_features) if isinstance(
                    w, nn.Module) else w.shape
                slots.append(ParamSlot(name, p, E, N, K, i, m, _lora_holder(w)))
        elif isinstance(m, HFExperts) or is_hf_experts(m):
            base = m.base if isinstance(m, HFExperts) else m
            for i, p in enumerate(HF_EXPERT_PARAMS):
                E, n_out, n_in = getattr(base, p).shape
                held = m.lora[p] if isinstance(m, HFExperts) and p in m.lora else None
                slots.append(ParamSlot(name, p, E, n_out, n_in, i, m, held))
    return slots


def unsupported(model: nn.Module, name: str, m: nn.Module) -> str:
    """Why wrap_lora cannot put LoRA on module `name`, and what to name instead."""
    why = f"{name} is a {type(m).__name__}, not an nn.Linear or a miniquant QuantizedLinear"
    if isinstance(m, MoEMLP):
        return (f"{why}: give its experts LoRA with target_parameters={list(PROJECTIONS)} "
                f"(or target its 'router')")
    if is_hf_experts(m) or isinstance(m, HFExperts):
        return f"{why}: give its experts LoRA with target_parameters={list(HF_EXPERT_PARAMS)}"
    params = [p for p, _ in m.named_parameters(recurse=False)]
    if params:
        return (f"{why}; it holds parameters {params} that minituner cannot adapt (PEFT puts "
                f"LoRA on them through target_parameters; here this module stays frozen)")
    return f"{why}; name its linear layers instead"
