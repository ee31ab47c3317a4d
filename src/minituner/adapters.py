"""Wrap a model with LoRA, and save / load adapters in Hugging Face PEFT format.

On disk an adapter is the directory PEFT's `save_pretrained` writes: `adapter_config.json`
(a `LoraConfig`) and `adapter_model.safetensors` with keys
`base_model.model.<module path>[.base_layer…].lora_A.weight` / `.lora_B.weight` (no adapter
name), so `peft.PeftModel.from_pretrained` loads ours and `load_adapter` loads PEFT's. Linear
layers are PEFT's `target_modules`; stacked expert weights are its `target_parameters`, laid
out as `adapter_targets` describes. Ours also carry safetensors metadata
`"minituner.targets"` (our name, E, r, scaling per key prefix) for `lora_norms`; PEFT ignores
it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
import torch.nn as nn

from minigpt.atomic import atomic_path
from minimoe import MoEMLP, attach_expert_lora
from minimoe.experts import init_expert_lora
from minimoe.hf import HF_NAMES, HFExperts
from miniquant.linear import compile_target

from .adapter_targets import (
    LINEAR_TYPES,
    ParamSlot,
    compact,
    from_peft_B,
    key_prefix,
    matches,
    module_slots,
    param_slots,
    pattern_value,
    to_peft_B,
    unsupported,
)
from .lora import LoRALinear, check_lora_args

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
METADATA_KEY = "minituner.targets"
NAMINGS = ("ours", "hf")

# PEFT LoraConfig options this module cannot honour: a config that sets one of them to
# anything but its neutral value is refused rather than loaded wrongly.
_NEUTRAL = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "lora_bias": False,
            "modules_to_save": None, "layers_to_transform": None, "exclude_modules": None,
            "layer_replication": None, "trainable_token_indices": None}

_matches = matches      # the name Lab 04 forbids while its exercises run


def _linear_names(model: nn.Module) -> list[str]:
    """Names of the layers LoRA may wrap: nn.Linear, QuantizedLinear and LoRALinear itself."""
    return [n for n, m in module_slots(model).items()
            if isinstance(m, (LoRALinear, *LINEAR_TYPES))]


def _check_targets(name: str, targets) -> None:
    if isinstance(targets, str):
        compile_target(name, targets)
    elif not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{name} must be a regex string or a non-empty list of name "
                         f"suffixes, got {targets!r}")


def _select(model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
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
                         f"linear layers are {_linear_names(model)}")
    return [n for n, _ in named]


def _select_params(model: nn.Module, target_parameters: Sequence[str]) -> list[ParamSlot]:
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


def _owners(slots: list[ParamSlot]) -> dict[str, list[ParamSlot]]:
    """Slots grouped by the module holding them, each group in registration order."""
    out: dict[str, list[ParamSlot]] = {}
    for s in sorted(slots, key=lambda s: (s.module, s.index)):
        out.setdefault(s.module, []).append(s)
    return out


def _wrap_params(model: nn.Module, slots: list[ParamSlot], hyper: dict) -> None:
    """Give each named expert parameter its LoRA: `attach_expert_lora` on a MoEMLP (float
    base), `HFExperts` in place of an HF experts module; then any parameter whose (r, alpha)
    differs from its module's first (a rank_pattern) gets its own."""
    for module, group in _owners(slots).items():
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


def _freeze_all_but_lora(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(name.rpartition(".")[2] in ("lora_A", "lora_B"))


def _check_before_wrapping(model, modules: list[str], slots: list[ParamSlot], dropout,
                           use_rslora) -> None:
    already = [n for n in modules if isinstance(model.get_submodule(n), LoRALinear)]
    already += [s.name for s in slots if s.holder is not None or isinstance(s.owner, HFExperts)]
    if already:
        raise ValueError(f"already wrapped with LoRA: {already}")
    if slots and (dropout or use_rslora):
        raise ValueError(f"expert LoRA (target_parameters) takes no dropout and scales by "
                         f"alpha / r; got dropout={dropout}, use_rslora={use_rslora}")
    for module, group in _owners(slots).items():
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
    names = _select(model, target_modules) if target_modules is not None else []
    slots = _select_params(model, target_parameters) if target_parameters else []
    _check_before_wrapping(model, names, slots, dropout, use_rslora)
    for name in names:
        model.set_submodule(name, LoRALinear(model.get_submodule(name), r=r, alpha=alpha,
                                             dropout=dropout, use_rslora=use_rslora))
    _wrap_params(model, slots, {s.name: (r, float(alpha)) for s in slots})
    _freeze_all_but_lora(model)
    return names + [s.name for s in slots]


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
    for module, group in _owners(param_slots(model)).items():
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
        target_modules = compact(modules, _linear_names(model)) if modules else []
    elif [n for n in _linear_names(model) if matches(n, target_modules)] != modules:
        raise ValueError(f"target_modules {target_modules!r} selects "
                         f"{[n for n in _linear_names(model) if matches(n, target_modules)]}, "
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
    tensors = {}
    for e in entries:
        tensors[f"{e.prefix}lora_A.weight"] = e.A.detach().cpu().contiguous()
        tensors[f"{e.prefix}lora_B.weight"] = e.B.detach().cpu().contiguous()
    targets = [{"prefix": e.prefix, "name": e.name, "experts": e.experts, "r": e.r,
                "scaling": e.scaling} for e in entries]
    dir = Path(dir)
    with atomic_path(dir / CONFIG_NAME) as cfg_tmp, atomic_path(dir / WEIGHTS_NAME) as w_tmp:
        w_tmp.write_bytes(_safetensors_bytes(tensors, {"format": "pt",
                                                       METADATA_KEY: json.dumps(targets)}))
        cfg_tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _safetensors_bytes(tensors: dict, metadata: dict) -> bytes:
    """A safetensors file whose bytes depend on the tensors and metadata alone. safetensors
    writes `__metadata__` from a hash map, so with two entries their order (and the file's
    sha256) changes from process to process; the header is re-written with sorted keys. The
    tensors' offsets are relative to the data after the header, so they stay valid."""
    raw = safetensors.torch.save(tensors, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8:8 + n]), sort_keys=True, separators=(",", ":"))
    header += " " * (-len(header) % 8)             # the format pads the header to 8 bytes
    return len(header).to_bytes(8, "little") + header.encode() + raw[8 + n:]


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


def _check_patterns(path: Path, config: dict) -> None:
    for key, check in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise ValueError(f"{path}: {key} must be an object, got {patterns!r}")
        for p, v in patterns.items():
            try:
                compile_target(f"{key} key", p)
                check_lora_args(v if check == "r" else 1, v if check != "r" else 1.0, 0.0,
                                names=(f"{key}[{p!r}]",) * 3)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None


def _read_config(dir: Path) -> dict:
    """The adapter's LoraConfig, checked: r a positive int, lora_alpha finite and > 0,
    lora_dropout in [0, 1), patterns of the same, no option this module cannot honour."""
    path = dir / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {dir}: not a PEFT adapter directory")
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    for key in ("r", "lora_alpha"):
        if config.get(key) is None:
            raise ValueError(f"{path}: missing {key!r}")
    if config.get("target_modules") is None and not config.get("target_parameters"):
        raise ValueError(f"{path}: missing 'target_modules' (and no 'target_parameters')")
    unsupported_opts = {k: config[k] for k, neutral in _NEUTRAL.items()
                        if config.get(k, neutral) not in (neutral, None, [], {})}
    if unsupported_opts:
        raise ValueError(f"{path}: unsupported LoRA options {unsupported_opts}")
    # JSON may hold 4.9, 1e999 (inf) or NaN: refuse them rather than truncate or propagate.
    try:
        check_lora_args(config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0),
                        names=("r", "lora_alpha", "lora_dropout"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    _check_patterns(path, config)
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors (safetensors, never pickle); every value must be finite."""
    if not path.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {path.parent} (found {CONFIG_NAME}; "
                                f"only safetensors adapters are read)")
    tensors = safetensors.torch.load_file(str(path))
    bad = sorted(k for k, t in tensors.items()
                 if t.is_floating_point() and not torch.isfinite(t).all())
    if bad:
        raise ValueError(f"{path}: NaN or Inf in {bad}; the adapter weights must be finite")
    return tensors


def _scaling(r: int, alpha: float, use_rslora: bool) -> float:
    return alpha / (math.sqrt(r) if use_rslora else r)


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
        want = _scaling(r, alpha, use_rslora and name in names)
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
        out[f"{key_prefix(n)}lora_A.weight"] = (torch.Size([r, base.in_features]), n, 1)
        out[f"{key_prefix(n)}lora_B.weight"] = (torch.Size([base.out_features, r]), n, 1)
    for group in _owners(slots).values():
        for i, s in enumerate(group):
            r, E = hyper[s.name][0], s.n_experts
            prefix = key_prefix(s.module, len(group) - 1 - i)
            out[f"{prefix}lora_A.weight"] = (torch.Size([r * E, s.in_features]), s.name, E)
            out[f"{prefix}lora_B.weight"] = (torch.Size([s.out_features, r * E]), s.name, E)
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
    config = _read_config(dir)
    weights_path = dir / WEIGHTS_NAME
    tensors = _read_weights(weights_path)
    r0, alpha0 = config["r"], float(config["lora_alpha"])
    use_rslora = bool(config.get("use_rslora", False))
    dropout = float(config.get("lora_dropout", 0.0))
    target_modules = config.get("target_modules")
    names = _select(model, target_modules) if target_modules not in (None, []) else []
    slots = (_select_params(model, config["target_parameters"])
             if config.get("target_parameters") else [])
    rp, ap = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    hyper = {n: (pattern_value(rp, n, r0), float(pattern_value(ap, n, alpha0)))
             for n in names + [s.name for s in slots]}
    is_wrapped = _check_wrapped(model, names, slots, hyper, use_rslora)
    if not is_wrapped:
        _check_before_wrapping(model, names, slots, dropout, use_rslora)

    shapes = _expected(model, names, slots, hyper)
    report = AdapterLoadReport()
    report.missing = sorted(shapes.keys() - tensors.keys())
    report.unexpected = sorted(tensors.keys() - shapes.keys())
    common = shapes.keys() & tensors.keys()
    bad = {k for k in common if tensors[k].shape != shapes[k][0]}
    report.mismatched = sorted(f"{k}: file {list(tensors[k].shape)} vs model "
                               f"{list(shapes[k][0])}" for k in bad)
    if strict and not report.ok:
        raise ValueError(f"adapter {weights_path} does not fit the model: missing "
                         f"{report.missing}, unexpected {report.unexpected}, shape mismatch "
                         f"{report.mismatched}")

    if not is_wrapped:
        for n in names:
            r, alpha = hyper[n]
            model.set_submodule(n, LoRALinear(model.get_submodule(n), r=r, alpha=alpha,
                                              dropout=dropout, use_rslora=use_rslora))
        _wrap_params(model, slots, hyper)
        _freeze_all_but_lora(model)
        report.wrapped = names + [s.name for s in slots]
    factors = _factors(model)
    with torch.no_grad():
        for key in sorted(common - bad):
            _, target, E = shapes[key]
            value = tensors[key]
            if key.endswith("lora_B.weight") and E > 1:
                value = from_peft_B(value, E)
            getattr(factors[target], key.rsplit(".", 2)[-2]).copy_(value)
    return report
