"""Put LoRA on a model, as PEFT's LoraConfig selects: `wrap_lora` and its pieces.

Linear layers named by `target_modules` get a `LoRALinear` around them; expert parameters named
by `target_parameters` get expert LoRA (`minimoe.attach_expert_lora` on a MoEMLP,
`minimoe.hf.HFExperts` around an HF experts module). `load_adapter` wraps through the same
functions; the files themselves are `peft_format`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from minimoe import MoEMLP, attach_expert_lora
from minimoe.experts import init_expert_lora
from minimoe.hf import HFExperts
from miniquant.linear import compile_target

from .adapter_targets import LINEAR_TYPES, ParamSlot, module_slots, param_slots, unsupported
from .lora import LoRALinear, check_lora_args
from .peft_format import matches


def linear_names(model: nn.Module) -> list[str]:
    """Names of the layers LoRA may wrap: nn.Linear, QuantizedLinear and LoRALinear itself."""
    return [n for n, m in module_slots(model).items()
            if isinstance(m, (LoRALinear, *LINEAR_TYPES))]


def _check_targets(name: str, targets) -> None:
    if isinstance(targets, str):
        compile_target(name, targets)
    elif not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{name} must be a regex string or a non-empty list of name "
                         f"suffixes, got {targets!r}")


def select_modules(model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    """The linear layers `target_modules` names. A regex string is a filter over the linear
    layers (it also matches containers such as `blocks.1`, which hold the layers it means);
    a suffix in a list names modules one by one, and one that is not a linear layer is an
    error saying why and what to name instead (never a silent skip)."""
    _check_targets("target_modules", target_modules)
    by_name = not isinstance(target_modules, str)
    named = [(n, m) for n, m in module_slots(model).items() if matches(n, target_modules)
             and (by_name or isinstance(m, (LoRALinear, *LINEAR_TYPES)))]
    bad = [unsupported(model, n, m) for n, m in named
           if not isinstance(m, (LoRALinear, *LINEAR_TYPES))]
    if bad:
        raise ValueError("target_modules names modules LoRA cannot wrap: " + "; ".join(bad))
    if not named:
        raise ValueError(f"target_modules {target_modules!r} matches no linear layer (a string "
                         f"is a full-match regex, a list holds name suffixes); the model's "
                         f"linear layers are {linear_names(model)}")
    return [n for n, _ in named]


def select_params(model: nn.Module, target_parameters: Sequence[str]) -> list[ParamSlot]:
    """The expert parameters `target_parameters` names (PEFT's suffix rule on module.param)."""
    _check_targets("target_parameters", target_parameters)
    if isinstance(target_parameters, str):
        raise ValueError(f"target_parameters must be a list of names, got {target_parameters!r}")
    slots = param_slots(model)
    chosen = [s for s in slots if matches(s.name, target_parameters)]
    found = {t for t in target_parameters for s in chosen if matches(s.name, [t])}
    for t in (t for t in target_parameters if t not in found):
        other = [f"{n}.{p} ({type(m).__name__})" for n, m in module_slots(model).items()
                 for p, _ in m.named_parameters(recurse=False) if matches(f"{n}.{p}", [t])]
        what = (f"names {other[:3]}, which minituner cannot adapt (expert LoRA goes on a "
                f"MoEMLP's {[s.param for s in slots[:3]]} or an HF experts module's "
                f"gate_up_proj / down_proj)" if other else "matches no parameter")
        raise ValueError(f"target_parameters entry {t!r} {what}; the model's expert parameters "
                         f"are {[s.name for s in slots]}")
    return chosen


def trainable_summary(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; NF4 buffers of QuantizedLinear are not counted."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def owners(slots: list[ParamSlot]) -> dict[str, list[ParamSlot]]:
    """Slots grouped by the module holding them, each group in registration order."""
    out: dict[str, list[ParamSlot]] = {}
    for s in sorted(slots, key=lambda s: (s.module, s.index)):
        out.setdefault(s.module, []).append(s)
    return out


def wrap_modules(model: nn.Module, names: list[str], hyper: dict, dropout: float,
                 use_rslora: bool) -> None:
    """A `LoRALinear` around each named linear layer, with its (r, alpha) from `hyper`."""
    for n in names:
        r, alpha = hyper[n]
        model.set_submodule(n, LoRALinear(model.get_submodule(n), r=r, alpha=alpha,
                                          dropout=dropout, use_rslora=use_rslora))


def wrap_params(model: nn.Module, slots: list[ParamSlot], hyper: dict) -> None:
    """Give each named expert parameter its LoRA: `attach_expert_lora` on a MoEMLP (float
    base), `HFExperts` in place of an HF experts module; then any parameter whose (r, alpha)
    differs from its module's first (a rank_pattern) gets its own."""
    for module, group in owners(slots).items():
        owner, params = group[0].owner, tuple(s.param for s in group)
        r, alpha = hyper[group[0].name]
        if isinstance(owner, MoEMLP):
            attach_expert_lora(owner, r=r, alpha=alpha, nf4=False, projections=params)
            holders = {p: getattr(owner, p) for p in params}
        else:
            wrapper = HFExperts(owner, r=r, alpha=alpha, params=params)
            model.set_submodule(module, wrapper)
            holders = wrapper.lora
        for s in group[1:]:
            if hyper[s.name] != (r, alpha):
                init_expert_lora(holders[s.param], s.n_experts, s.in_features, s.out_features,
                                 *hyper[s.name], holders[s.param].lora_A.device)


def freeze_all_but_lora(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(name.rpartition(".")[2] in ("lora_A", "lora_B"))


def check_before_wrapping(model, modules: list[str], slots: list[ParamSlot], dropout,
                          use_rslora) -> None:
    """Refuse targets that hold LoRA already, and settings expert LoRA cannot take."""
    already = [n for n in modules if isinstance(model.get_submodule(n), LoRALinear)]
    already += [s.name for s in slots if s.holder is not None or isinstance(s.owner, HFExperts)]
    if already:
        raise ValueError(f"already wrapped with LoRA: {already}")
    if slots and (dropout or use_rslora):
        raise ValueError(f"expert LoRA (target_parameters) takes no dropout and scales by "
                         f"alpha / r; got dropout={dropout}, use_rslora={use_rslora}")
    for module, group in owners(slots).items():
        owner = group[0].owner
        if isinstance(owner, MoEMLP) and not all(
                isinstance(getattr(owner, p), nn.Parameter) for p in ("w_gate", "w_up", "w_down")):
            raise ValueError(f"{module}'s experts are already expert modules; attach_expert_lora "
                             f"builds them with their LoRA in one step")


def wrap_lora(model: nn.Module, target_modules: str | Sequence[str] | None, r: int = 8,
              alpha: float = 16.0, dropout: float = 0.0, use_rslora: bool = False,
              target_parameters: Sequence[str] | None = None) -> list[str]:
    """Put LoRA, in place, on each linear layer `target_modules` selects (a `LoRALinear`
    around it) and on each expert parameter `target_parameters` names (expert LoRA: a
    MoEMLP's w_gate / w_up / w_down, an HF experts module's gate_up_proj / down_proj), then
    freeze every parameter except the LoRA factors.

    Both follow PEFT: a regex matched against the whole name, or a list of name suffixes
    (for parameters, of "module.param"). Returns the names wrapped. Raises ValueError, with
    the model untouched, when nothing matches (listing what could), when a named module is
    not a linear layer (saying why, and what to name instead), or when a target already
    holds LoRA.
    """
    check_lora_args(r, alpha, dropout)     # before anything changes
    if target_modules is None and not target_parameters:
        raise ValueError("give target_modules, target_parameters, or both")
    names = select_modules(model, target_modules) if target_modules is not None else []
    slots = select_params(model, target_parameters) if target_parameters else []
    check_before_wrapping(model, names, slots, dropout, use_rslora)
    hyper = {n: (r, alpha) for n in names} | {s.name: (r, float(alpha)) for s in slots}
    wrap_modules(model, names, hyper, dropout, use_rslora)
    wrap_params(model, slots, hyper)
    freeze_all_but_lora(model)
    return names + [s.name for s in slots]
