"""Save a model's LoRA as a Hugging Face PEFT adapter, and load one into a model.

`save_adapter` maps every LoRA the model holds to a target of the PEFT format (`peft_format`:
the files, key names and B's column order), so `peft.PeftModel.from_pretrained` loads ours;
`load_adapter` reads one (ours or PEFT's save_pretrained), wraps the model as its config says
(`wrap`) and copies the factors in. Linear layers are PEFT's `target_modules`; stacked expert
weights are its `target_parameters`.

`wrap_lora` and `trainable_summary` live in `wrap` and are importable from here too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from minimoe import MoEMLP, lora_scaling
from minimoe.hf import HF_NAMES

from .adapter_targets import module_slots, param_slots
from .lora import LoRALinear
from .peft_format import (
    CONFIG_NAME,
    LORA_A,
    LORA_B,
    METADATA_KEY,
    WEIGHTS_NAME,
    Target,
    compact,
    from_peft_B,
    key_prefix,
    matches,
    pattern_value,
    read_config,
    read_weights,
    to_peft_B,
    write_adapter,
)
from .wrap import (
    check_before_wrapping,
    freeze_all_but_lora,
    linear_names,
    owners,
    select_modules,
    select_params,
    trainable_summary,
    wrap_lora,
    wrap_modules,
    wrap_params,
)

__all__ = ["CONFIG_NAME", "METADATA_KEY", "NAMINGS", "WEIGHTS_NAME", "AdapterLoadReport",
           "load_adapter", "save_adapter", "trainable_summary", "wrap_lora"]

NAMINGS = ("ours", "hf")

# --- saving -----------------------------------------------------------------------------------

@dataclass
class _Entry:
    """One target as written: PEFT's key prefix and config name, the file's A and B, r, alpha."""

    name: str              # ours (the metadata and lora_norms show it)
    config_name: str       # the module path, or "module.param", as PEFT's config names it
    prefix: str
    A: torch.Tensor
    B: torch.Tensor
    r: int
    alpha: float
    scaling: float
    experts: int = 1
    is_param: bool = False


def _module_entries(model, names: str) -> list[_Entry]:
    out = []
    for name, m in module_slots(model).items():
        if not isinstance(m, LoRALinear):
            continue
        parent, _, leaf = name.rpartition(".")
        module, is_param = name, False
        if names == "hf" and leaf == "router" and isinstance(model.get_submodule(parent), MoEMLP):
            module, is_param = f"{parent}.{HF_NAMES['router'][0]}", True
        out.append(_Entry(name, f"{module}.weight" if is_param else module, key_prefix(module),
                          m.lora_A, m.lora_B, m.r, m.alpha, m.scaling, is_param=is_param))
    return out


def _expert_entry(name, module, param, depth, held) -> _Entry:
    E = held.n_experts
    return _Entry(name, f"{module}.{param}", key_prefix(module, depth), held.lora_A,
                  to_peft_B(held.lora_B.detach(), E), held.r, held.scaling * held.r,
                  held.scaling, E, True)


def _fused_gate_up(mlp: str, held: dict) -> _Entry:
    """HF fuses gate and up into gate_up_proj [E, 2F, C]: our two rank-r pairs become one pair
    of rank r_gate + r_up, A stacked and B block-diagonal per expert (exact; the ranks add)."""
    parts = [held[p] for p in ("w_gate", "w_up") if p in held]
    first = parts[0]
    E, C, F = first.n_experts, first.in_features, first.out_features
    s = first.scaling
    r = sum(p.r for p in parts)
    A = torch.cat([p.lora_A.detach().reshape(E, p.r, C) for p in parts], 1)     # [E, r, C]
    B = first.lora_A.new_zeros(E, 2 * F, r)
    col = 0
    for proj, p in held.items():
        if proj == "w_down":
            continue
        row = 0 if proj == "w_gate" else F
        B[:, row:row + F, col:col + p.r] = (p.lora_B.detach().reshape(F, E, p.r)
                                            .permute(1, 0, 2) * (p.scaling / s))
        col += p.r
    B_ours = B.permute(1, 0, 2).reshape(2 * F, E * r)
    name = f"{mlp}.{'+'.join(p for p in ('w_gate', 'w_up') if p in held)}"
    module = f"{mlp}.experts"
    depth = 1 if "w_down" in held else 0
    return _Entry(name, f"{module}.gate_up_proj", key_prefix(module, depth),
                  A.reshape(E * r, C), to_peft_B(B_ours, E), r, s * r, s, E, True)


def _param_entries(model, names: str) -> list[_Entry]:
    out = []
    for module, group in owners(param_slots(model)).items():
        held = {s.param: s.holder for s in group if s.holder is not None}
        if not held:
            continue
        if names == "hf" and isinstance(group[0].owner, MoEMLP):
            if "w_gate" in held or "w_up" in held:
                out.append(_fused_gate_up(module, held))
            if "w_down" in held:
                out.append(_expert_entry(f"{module}.w_down", f"{module}.experts", "down_proj",
                                         0, held["w_down"]))
            continue
        for i, (param, h) in enumerate(held.items()):
            out.append(_expert_entry(f"{module}.{param}", module, param, len(held) - 1 - i, h))
    return out


def _common(values: list):
    return Counter(values).most_common(1)[0][0]


def _config(model, entries: list[_Entry], target_modules, names: str) -> dict:
    loras = [m for m in module_slots(model).values() if isinstance(m, LoRALinear)]
    shared = {(float(getattr(m.dropout, "p", 0.0)), bool(m.use_rslora)) for m in loras}
    if len(shared) > 1:
        raise ValueError(f"LoRA layers differ in (dropout, use_rslora): {sorted(shared)}; one "
                         f"adapter file holds one setting")
    dropout, use_rslora = shared.pop() if shared else (0.0, False)
    if use_rslora and any(e.is_param and e.experts > 1 for e in entries):
        raise ValueError("use_rslora applies to every target of a PEFT adapter, and expert LoRA "
                         "scales by alpha / r")
    r, alpha = _common([e.r for e in entries]), _common([float(e.alpha) for e in entries])
    modules = [e.config_name for e in entries if not e.is_param]
    params = [e.config_name for e in entries if e.is_param]
    if target_modules is None:
        target_modules = compact(modules, linear_names(model)) if modules else []
    elif [n for n in linear_names(model) if matches(n, target_modules)] != modules:
        raise ValueError(f"target_modules {target_modules!r} selects "
                         f"{[n for n in linear_names(model) if matches(n, target_modules)]}, "
                         f"but the wrapped layers are {modules}")
    if names == "ours" and params:
        params = compact(params, [s.name for s in param_slots(model)])
    return {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": None,
        "revision": None,
        "target_modules": target_modules if isinstance(target_modules, str)
        else list(target_modules),
        "target_parameters": params or None,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": use_rslora,
        "rank_pattern": {e.config_name: e.r for e in entries if e.r != r},
        "alpha_pattern": {e.config_name: float(e.alpha) for e in entries
                          if not math.isclose(e.alpha, alpha)},
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "use_dora": False,
    }


def save_adapter(model: nn.Module, dir: str | Path,
                 target_modules: str | Sequence[str] | None = None, names: str = "ours") -> None:
    """Write the LoRA factors of `model` to `dir` in PEFT format, each file atomically.

    `target_modules` is recorded in the config; by default the shortest suffix list that
    selects exactly the wrapped linear layers. A given one must select exactly those.
    Expert LoRA goes under `target_parameters`. `names="hf"` writes each MoEMLP as the
    transformers block it came from (`minimoe.hf`: router -> gate.weight, w_gate + w_up ->
    experts.gate_up_proj at rank r_gate + r_up, w_down -> experts.down_proj), for
    `PeftModel.from_pretrained` on that HF model; ranks that differ from the config's `r`
    go in `rank_pattern` / `alpha_pattern`.
    """
    if names not in NAMINGS:
        raise ValueError(f"names must be one of {NAMINGS}, got {names!r}")
    entries = _module_entries(model, names) + _param_entries(model, names)
    if not entries:
        raise ValueError("model has no LoRA to save; call wrap_lora (or attach_expert_lora) "
                         "first")
    config = _config(model, entries, target_modules, names)
    factors = {}
    for e in entries:
        factors[e.prefix + LORA_A], factors[e.prefix + LORA_B] = e.A, e.B
    write_adapter(dir, config, factors,
                  [Target(e.prefix, e.name, e.experts, e.r, e.scaling) for e in entries])


# --- loading ----------------------------------------------------------------------------------

@dataclass
class AdapterLoadReport:
    """What `load_adapter` did: the targets it wrapped (empty if the model already was) and
    the keys it could not load, by name."""

    wrapped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)   # "key: file [..] vs model [..]"

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def _check_wrapped(model, names, slots, hyper, use_rslora) -> bool:
    """True when the targets are wrapped already (then with the adapter's r and scaling);
    False when none is; an error for a part-wrapped model or different settings."""
    held = {n: model.get_submodule(n) for n in names
            if isinstance(model.get_submodule(n), LoRALinear)}
    held |= {s.name: s.holder for s in slots if s.holder is not None}
    if not held:
        return False
    every = names + [s.name for s in slots]
    if len(held) != len(every):
        raise ValueError(f"the adapter targets {every}, but only {list(held)} are wrapped")
    for name, m in held.items():
        r, alpha = hyper[name]
        want = lora_scaling(alpha, r, use_rslora and name in names)
        if m.r != r or not math.isclose(m.scaling, want):
            raise ValueError(f"{name} is wrapped with r={m.r}, scaling={m.scaling}; the "
                             f"adapter has r={r}, scaling={want}")
    merged = [n for n, m in held.items() if getattr(m, "merged", False)]
    if merged:
        raise ValueError(f"unmerge these LoRA layers before loading new factors: {merged}")
    return True


def _expected(model, names, slots, hyper) -> dict[str, tuple[torch.Size, str, int]]:
    """Key -> (shape, target name, E) of every factor the adapter should hold."""
    out = {}
    for n in names:
        m = model.get_submodule(n)
        r = hyper[n][0]
        base = m.base if isinstance(m, LoRALinear) else m
        out[key_prefix(n) + LORA_A] = (torch.Size([r, base.in_features]), n, 1)
        out[key_prefix(n) + LORA_B] = (torch.Size([base.out_features, r]), n, 1)
    for group in owners(slots).values():
        for i, s in enumerate(group):
            r, E = hyper[s.name][0], s.n_experts
            prefix = key_prefix(s.module, len(group) - 1 - i)
            out[prefix + LORA_A] = (torch.Size([r * E, s.in_features]), s.name, E)
            out[prefix + LORA_B] = (torch.Size([s.out_features, r * E]), s.name, E)
    return out


def _factors(model) -> dict[str, nn.Module]:
    """Target name -> the module holding its lora_A / lora_B, after wrapping."""
    out = {n: m for n, m in module_slots(model).items() if isinstance(m, LoRALinear)}
    out |= {s.name: s.holder for s in param_slots(model) if s.holder is not None}
    return out


def load_adapter(model: nn.Module, dir: str | Path, strict: bool = True) -> AdapterLoadReport:
    """Load a PEFT-format LoRA adapter from `dir` into `model`.

    Linear targets (`target_modules`) and expert parameters (`target_parameters`, B's columns
    reordered from PEFT's layout) are wrapped if none is wrapped yet, else checked to have the
    adapter's r and scaling (`rank_pattern` / `alpha_pattern` honoured). Weights are read with
    safetensors (never pickle) and must be finite. Missing, unexpected and shape-mismatched
    keys are reported by name; with `strict` (the default) any of them raises ValueError.
    Everything is read and checked before the model is touched, so whenever this raises the
    model is left exactly as it was (not wrapped, no weight loaded).
    """
    dir = Path(dir)
    config = read_config(dir, to_load=True)
    tensors, _ = read_weights(dir)
    r0, alpha0 = config["r"], float(config["lora_alpha"])
    use_rslora = bool(config.get("use_rslora", False))
    dropout = float(config.get("lora_dropout", 0.0))
    target_modules = config.get("target_modules")
    names = select_modules(model, target_modules) if target_modules not in (None, []) else []
    slots = (select_params(model, config["target_parameters"])
             if config.get("target_parameters") else [])
    rp, ap = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    hyper = {n: (pattern_value(rp, n, r0), float(pattern_value(ap, n, alpha0)))
             for n in names + [s.name for s in slots]}
    is_wrapped = _check_wrapped(model, names, slots, hyper, use_rslora)
    if not is_wrapped:
        check_before_wrapping(model, names, slots, dropout, use_rslora)

    shapes = _expected(model, names, slots, hyper)
    report = AdapterLoadReport()
    report.missing = sorted(shapes.keys() - tensors.keys())
    report.unexpected = sorted(tensors.keys() - shapes.keys())
    common = shapes.keys() & tensors.keys()
    bad = {k for k in common if tensors[k].shape != shapes[k][0]}
    report.mismatched = sorted(f"{k}: file {list(tensors[k].shape)} vs model "
                               f"{list(shapes[k][0])}" for k in bad)
    if strict and not report.ok:
        raise ValueError(f"adapter {dir / WEIGHTS_NAME} does not fit the model: missing "
                         f"{report.missing}, unexpected {report.unexpected}, shape mismatch "
                         f"{report.mismatched}")

    if not is_wrapped:
        wrap_modules(model, names, hyper, dropout, use_rslora)
        wrap_params(model, slots, hyper)
        freeze_all_but_lora(model)
        report.wrapped = names + [s.name for s in slots]
    factors = _factors(model)
    with torch.no_grad():
        for key in sorted(common - bad):
            _, target, E = shapes[key]
            value = tensors[key]
            if key.endswith(LORA_B) and E > 1:
                value = from_peft_B(value, E)
            getattr(factors[target], key.rsplit(".", 2)[-2]).copy_(value)
    return report
