"""Where a LoRA adapter lives in a model, and how PEFT lays each kind out on disk.

Two kinds of target, as PEFT's LoraConfig has them:

- a module (`target_modules`): an nn.Linear / QuantizedLinear wrapped in `LoRALinear`. Keys
  `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], the
  tensors as held.
- an expert parameter (`target_parameters`): a stacked weight [E, ·, ·] with a rank-r pair per
  expert. Held here as A [r·E, in], B [out, r·E], expert e owning rows / columns e·r:(e+1)·r
  (minimoe). PEFT's `ParamWrapper` stores the same A, but B's columns in the order j·E + e
  (`to_peft_B` / `from_peft_B`, a column permutation). The keys hang off the module that
  holds the parameter; when n of its parameters are targeted PEFT nests n wrappers in the
  module's registration order, the first innermost, so the i-th is stored under
  `<module>.` + `base_layer.`·(n−1−i).

Expert parameters here: a `MoEMLP`'s w_gate, w_up, w_down ([E, in, out]; `MoEMLP.is_transposed`
tells PEFT) and an HF experts module's gate_up_proj, down_proj ([E, out, in]; raw, or wrapped
in `minimoe.hf.HFExperts`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from minimoe import MoEMLP
from minimoe.hf import HF_EXPERT_PARAMS, HFExperts, is_hf_experts
from minimoe.moe import PROJECTIONS
from miniquant import QuantizedLinear

from .lora import LoRALinear

KEY_PREFIX = "base_model.model."


def to_peft_B(B: torch.Tensor, E: int) -> torch.Tensor:
    """B [out, r·E] with expert e in columns e·r:(e+1)·r -> PEFT's order (column j·E + e)."""
    out, rE = B.shape
    return B.reshape(out, E, rE // E).transpose(1, 2).reshape(out, rE)


def from_peft_B(B: torch.Tensor, E: int) -> torch.Tensor:
    """PEFT's expert B [out, r·E] (column j·E + e) -> ours (columns e·r:(e+1)·r)."""
    out, rE = B.shape
    return B.reshape(out, rE // E, E).transpose(1, 2).reshape(out, rE)


def key_prefix(module: str, depth: int = 0) -> str:
    """The key prefix of a target: `base_model.model.<module>.` plus `base_layer.`·depth."""
    return f"{KEY_PREFIX}{module}." + "base_layer." * depth


def pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern rule: the first pattern p (dict order) with
    `re.match(rf"(.*\\.)?({p})$", key)` gives the value, else `default`."""
    for p, value in patterns.items():
        if re.match(rf"(.*\.)?({p})$", key):
            return value
    return default


def matches(name: str, targets: str | Sequence[str]) -> bool:
    """PEFT's rule: a string is a regex matched against the whole name; a list holds
    suffixes, each matching a name equal to it or ending with "." + it."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def compact(names: list[str], candidates: list[str]) -> list[str]:
    """The shortest suffix list (last 1, 2, ... name components) that selects exactly `names`
    among `candidates`; the full names when no shorter list does."""
    for depth in (1, 2):
        suffixes = sorted({".".join(n.split(".")[-depth:]) for n in names})
        if [c for c in candidates if matches(c, suffixes)] == names:
            return suffixes
    return list(names)


# --- what a model holds ------------------------------------------------------------------

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
