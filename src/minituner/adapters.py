"""Wrap a model's linear layers with LoRA, and save / load adapters in Hugging Face PEFT format.

On disk an adapter is the directory PEFT's `save_pretrained` writes: `adapter_config.json`
(a `LoraConfig`) and `adapter_model.safetensors` with keys
`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight` (no adapter name), so
`peft.PeftModel.from_pretrained` loads ours and `load_adapter` loads PEFT's.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
import torch.nn as nn

from minigpt.atomic import atomic_path
from miniquant import QuantizedLinear
from miniquant.linear import compile_target

from .lora import LoRALinear, check_lora_args

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

# PEFT LoraConfig options this module cannot honour: a config that sets one of them to
# anything but its neutral value is refused rather than loaded wrongly.
_NEUTRAL = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "lora_bias": False,
            "modules_to_save": None, "layers_to_transform": None, "exclude_modules": None,
            "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None,
            "target_parameters": None, "trainable_token_indices": None}


def _linear_names(model: nn.Module) -> list[str]:
    """Names of the layers LoRA may wrap: nn.Linear, QuantizedLinear and LoRALinear itself,
    but not the base layer held inside a LoRALinear."""
    names, inside = [], []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, LoRALinear):
            inside.append(name)
            names.append(name)
        elif isinstance(m, (nn.Linear, QuantizedLinear)):
            names.append(name)
    return names


def _matches(name: str, target_modules: str | Sequence[str]) -> bool:
    """PEFT's rule: a string is a regex matched against the whole name; a list holds
    suffixes, each matching a name equal to it or ending with "." + it."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def _select(model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    if isinstance(target_modules, str):
        compile_target("target_modules", target_modules)
    elif not target_modules or not all(isinstance(t, str) for t in target_modules):
        raise ValueError(f"target_modules must be a regex string or a non-empty list of name "
                         f"suffixes, got {target_modules!r}")
    candidates = _linear_names(model)
    names = [n for n in candidates if _matches(n, target_modules)]
    if not names:
        raise ValueError(f"target_modules {target_modules!r} matches no linear layer (a string "
                         f"is a full-match regex, a list holds name suffixes); the model's "
                         f"linear layers are {candidates}")
    return names


def trainable_summary(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; NF4 buffers of QuantizedLinear are not counted."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def wrap_lora(model: nn.Module, target_modules: str | Sequence[str], r: int = 8,
              alpha: float = 16.0, dropout: float = 0.0, use_rslora: bool = False) -> list[str]:
    """Replace, in place, each nn.Linear / QuantizedLinear selected by `target_modules` with
    a LoRALinear, and freeze every parameter except the LoRA factors.

    `target_modules` is a regex matched against the full module name, or a list of name
    suffixes (as PEFT). Returns the names wrapped; `trainable_summary(model)` gives the
    trainable / total counts. Raises ValueError when nothing matches (listing the linear
    layers) or when a selected layer is already a LoRALinear.
    """
    check_lora_args(r, alpha, dropout)     # before anything changes
    names = _select(model, target_modules)
    already = [n for n in names if isinstance(model.get_submodule(n), LoRALinear)]
    if already:
        raise ValueError(f"already wrapped with LoRA: {already}")
    for name in names:
        model.set_submodule(name, LoRALinear(model.get_submodule(name), r=r, alpha=alpha,
                                             dropout=dropout, use_rslora=use_rslora))
    for p in model.parameters():
        p.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_A.requires_grad_(True)
            m.lora_B.requires_grad_(True)
    return names


def _lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _compact_targets(model: nn.Module, wrapped: list[str]) -> list[str]:
    """The shortest PEFT target list selecting exactly `wrapped`: the last name components
    (e.g. ["q_proj", "v_proj"]) when they select nothing else, else the full names."""
    suffixes = sorted({n.rpartition(".")[2] for n in wrapped})
    if [n for n in _linear_names(model) if _matches(n, suffixes)] == wrapped:
        return suffixes
    return wrapped


def _hyper(modules: dict[str, LoRALinear]) -> dict:
    """The one (r, alpha, dropout, use_rslora) shared by all LoRA layers."""
    seen = {(m.r, float(m.alpha), float(getattr(m.dropout, "p", 0.0)), bool(m.use_rslora))
            for m in modules.values()}
    if len(seen) > 1:
        raise ValueError(f"LoRA layers differ in (r, alpha, dropout, use_rslora): "
                         f"{sorted(seen)}; one adapter file holds one setting")
    r, alpha, dropout, use_rslora = seen.pop()
    return {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": use_rslora}


def save_adapter(model: nn.Module, dir: str | Path,
                 target_modules: str | Sequence[str] | None = None) -> None:
    """Write the LoRA factors of `model` to `dir` in PEFT format, each file atomically.

    `target_modules` is recorded in the config; by default the shortest suffix list that
    selects exactly the wrapped layers. A given one must select exactly those layers.
    """
    modules = _lora_modules(model)
    if not modules:
        raise ValueError("model has no LoRALinear layer to save; call wrap_lora first")
    wrapped = list(modules)
    if target_modules is None:
        target_modules = _compact_targets(model, wrapped)
    else:
        selected = [n for n in _linear_names(model) if _matches(n, target_modules)]
        if selected != wrapped:
            raise ValueError(f"target_modules {target_modules!r} selects {selected}, but the "
                             f"wrapped layers are {wrapped}")
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "revision": None,
        "target_modules": target_modules if isinstance(target_modules, str)
        else list(target_modules),
        **_hyper(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_dora": False,
    }
    tensors = {}
    for name, m in modules.items():
        tensors[f"{KEY_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().cpu().contiguous()
        tensors[f"{KEY_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().cpu().contiguous()
    dir = Path(dir)
    with atomic_path(dir / CONFIG_NAME) as cfg_tmp, atomic_path(dir / WEIGHTS_NAME) as w_tmp:
        safetensors.torch.save_file(tensors, str(w_tmp), metadata={"format": "pt"})
        cfg_tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@dataclass
class AdapterLoadReport:
    """What `load_adapter` did: the layers it wrapped (empty if the model already was) and
    the keys it could not load, by name."""

    wrapped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)   # "key: file [..] vs model [..]"

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def _read_config(dir: Path) -> dict:
    """The adapter's LoraConfig, checked: r a positive int, lora_alpha finite and > 0,
    lora_dropout in [0, 1), no option this module cannot honour."""
    path = dir / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {dir}: not a PEFT adapter directory")
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    for key in ("r", "lora_alpha", "target_modules"):
        if config.get(key) is None:
            raise ValueError(f"{path}: missing {key!r}")
    unsupported = {k: config[k] for k, neutral in _NEUTRAL.items()
                   if config.get(k, neutral) not in (neutral, None, [], {})}
    if unsupported:
        raise ValueError(f"{path}: unsupported LoRA options {unsupported}")
    # JSON may hold 4.9, 1e999 (inf) or NaN: refuse them rather than truncate or propagate.
    try:
        check_lora_args(config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0),
                        names=("r", "lora_alpha", "lora_dropout"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
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


def _expected_shapes(model: nn.Module, to_wrap: list[str], r: int) -> dict[str, torch.Size]:
    """Key -> shape of every LoRA factor the model will hold: the LoRALinear layers it has,
    and those `wrap_lora` would add on the layers `to_wrap` (A [r, in], B [out, r])."""
    shapes = {}
    for name, m in _lora_modules(model).items():
        shapes[f"{KEY_PREFIX}{name}.lora_A.weight"] = m.lora_A.shape
        shapes[f"{KEY_PREFIX}{name}.lora_B.weight"] = m.lora_B.shape
    for name in to_wrap:
        base = model.get_submodule(name)
        shapes[f"{KEY_PREFIX}{name}.lora_A.weight"] = torch.Size([r, base.in_features])
        shapes[f"{KEY_PREFIX}{name}.lora_B.weight"] = torch.Size([base.out_features, r])
    return shapes


def load_adapter(model: nn.Module, dir: str | Path, strict: bool = True) -> AdapterLoadReport:
    """Load a PEFT-format LoRA adapter from `dir` into `model`.

    Wraps the layers the config targets if none is wrapped yet, else checks that the
    existing wrapping has the config's r, alpha and use_rslora. Weights are read with
    safetensors (never pickle) and must be finite. Missing, unexpected and shape-mismatched
    keys are reported by name; with `strict` (the default) any of them raises ValueError.
    Everything is read and checked before the model is touched, so whenever this raises the
    model is left exactly as it was (not wrapped, no weight loaded).
    """
    dir = Path(dir)
    config = _read_config(dir)
    weights_path = dir / WEIGHTS_NAME
    tensors = _read_weights(weights_path)
    r, alpha = config["r"], float(config["lora_alpha"])
    use_rslora = bool(config.get("use_rslora", False))
    targets = config["target_modules"]
    selected = _select(model, targets)
    wrapped = [n for n in selected if isinstance(model.get_submodule(n), LoRALinear)]
    if wrapped and wrapped != selected:
        raise ValueError(f"the adapter targets {selected}, but only {wrapped} are wrapped")
    expected_scaling = alpha / (math.sqrt(r) if use_rslora else r)
    for name in wrapped:
        m = model.get_submodule(name)
        if m.r != r or not math.isclose(m.scaling, expected_scaling):
            raise ValueError(f"{name} is wrapped with r={m.r}, scaling={m.scaling}; the "
                             f"adapter has r={r}, scaling={expected_scaling}")
    merged = [n for n, m in _lora_modules(model).items() if m.merged]
    if merged:
        raise ValueError(f"unmerge these LoRA layers before loading new factors: {merged}")

    to_wrap = [] if wrapped else selected
    shapes = _expected_shapes(model, to_wrap, r)
    report = AdapterLoadReport()
    report.missing = sorted(shapes.keys() - tensors.keys())
    report.unexpected = sorted(tensors.keys() - shapes.keys())
    common = shapes.keys() & tensors.keys()
    bad = {k for k in common if tensors[k].shape != shapes[k]}
    report.mismatched = sorted(f"{k}: file {list(tensors[k].shape)} vs model "
                               f"{list(shapes[k])}" for k in bad)
    if strict and not report.ok:
        raise ValueError(f"adapter {weights_path} does not fit the model: missing "
                         f"{report.missing}, unexpected {report.unexpected}, shape mismatch "
                         f"{report.mismatched}")

    if to_wrap:
        report.wrapped = wrap_lora(model, targets, r=r, alpha=alpha,
                                   dropout=float(config.get("lora_dropout", 0.0)),
                                   use_rslora=use_rslora)
    params = {}
    for name, m in _lora_modules(model).items():
        params[f"{KEY_PREFIX}{name}.lora_A.weight"] = m.lora_A
        params[f"{KEY_PREFIX}{name}.lora_B.weight"] = m.lora_B
    with torch.no_grad():
        for key in common - bad:
            params[key].copy_(tensors[key])
    return report
