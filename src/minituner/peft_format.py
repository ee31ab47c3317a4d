"""The Hugging Face PEFT LoRA adapter on disk: what is in the directory and how it is named.

    adapter_config.json         a LoraConfig: peft_type "LORA", r, lora_alpha, lora_dropout,
                                use_rslora, target_modules / target_parameters, rank_pattern,
                                alpha_pattern (PEFT's rules: `matches`, `pattern_value`)
    adapter_model.safetensors   per target, under key prefix P = `key_prefix(module, depth)`:
        P + "lora_A.weight"     [r·E, in]    expert e owns rows e·r:(e+1)·r   (a module: E = 1)
        P + "lora_B.weight"     [out, r·E]   PEFT's column j·E + e is expert e's j-th
                                             (`to_peft_B` / `from_peft_B`; minimoe holds e·r + j)
        ours also carry safetensors metadata "minituner.targets", a `Target` per key prefix
        (our name, E, r, scaling), which PEFT ignores and `lora_norms` reads

A module target (`target_modules`) hangs at `base_model.model.<module>.`. An expert parameter
(`target_parameters`, "module.param") hangs off the module holding it; with n of a module's
parameters targeted PEFT nests n wrappers in the module's registration order, the first
innermost, so the i-th is stored under `<module>.` + `base_layer.`·(n−1−i).

Everything that reads or writes these files goes through here: `read_config` (the one
validator of adapter_config.json), `read_weights` and `write_adapter`. What a model holds
(`adapter_targets`), putting LoRA on it (`wrap`) and mapping it to these files (`adapters`:
`save_adapter`, `load_adapter`; `lora_norms`) live beside it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from minigpt.atomic import atomic_path

from .lora import check_lora_args

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
METADATA_KEY = "minituner.targets"
KEY_PREFIX = "base_model.model."
LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"

# LoraConfig options this package reads only at these values. DoRA's update is not s·B·A, so
# no reader here takes it; the others change which layers hold the factors or how a model
# applies them (a bias, a transposed base, extra trained modules, ...), so `load_adapter`
# refuses them, while `lora_norms`, which reads only the factors, need not.
CHANGES_THE_UPDATE = {"use_dora": False}
CHANGES_THE_MODEL = {"bias": "none", "fan_in_fan_out": False, "lora_bias": False,
                     "modules_to_save": None, "layers_to_transform": None,
                     "exclude_modules": None, "layer_replication": None,
                     "trainable_token_indices": None}


class AdapterError(ValueError):
    """An adapter directory that does not hold a PEFT LoRA adapter this package can read; the
    message names the file, the field or key, and what was expected."""


class AdapterNotFoundError(AdapterError, FileNotFoundError):
    """The directory, adapter_config.json or adapter_model.safetensors is not there."""


# --- names and layout -------------------------------------------------------------------------

def key_prefix(module: str, depth: int = 0) -> str:
    """The key prefix of a target: `base_model.model.<module>.` plus `base_layer.`·depth."""
    return f"{KEY_PREFIX}{module}." + "base_layer." * depth


def split_prefix(prefix: str) -> tuple[str, int]:
    """The inverse of `key_prefix`: 'base_model.model.m.base_layer.base_layer.' -> ('m', 2)."""
    module, depth = prefix[len(KEY_PREFIX):-1], 0
    while module.endswith(".base_layer"):
        module, depth = module[:-len(".base_layer")], depth + 1
    return module, depth


def to_peft_B(B: torch.Tensor, E: int) -> torch.Tensor:
    """B [out, r·E] with expert e in columns e·r:(e+1)·r -> PEFT's order (column j·E + e)."""
    out, rE = B.shape
    return B.reshape(out, E, rE // E).transpose(1, 2).reshape(out, rE)


def from_peft_B(B: torch.Tensor, E: int) -> torch.Tensor:
    """PEFT's expert B [out, r·E] (column j·E + e) -> ours (columns e·r:(e+1)·r)."""
    out, rE = B.shape
    return B.reshape(out, rE // E, E).transpose(1, 2).reshape(out, rE)


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


def pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern rule: the first pattern p (dict order) with
    `re.match(rf"(.*\\.)?({p})$", key)` gives the value, else `default`."""
    for p, value in patterns.items():
        if re.match(rf"(.*\.)?({p})$", key):
            return value
    return default


# --- adapter_config.json ----------------------------------------------------------------------

def _regex(path: Path, what: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise AdapterError(f"{path}: {what} {pattern!r} is not a regex ({e})") from None


def _names(path: Path, key: str, value, allow_regex: bool) -> None:
    """target_modules (a regex string or a list of names) / target_parameters (a list)."""
    if allow_regex and isinstance(value, str):
        _regex(path, key, value)
    elif value is not None and (not isinstance(value, list)
                                or not all(isinstance(t, str) for t in value)):
        raise AdapterError(f"{path}: {key} is {value!r}, expected "
                           + ("a regex string, " if allow_regex else "")
                           + "a list of names or null")


def _lora_args(path: Path, r, alpha, dropout, names: tuple[str, str, str]) -> None:
    """`check_lora_args` (the rule LoRALinear's own arguments follow), naming the file."""
    try:
        check_lora_args(r, alpha, dropout, names=names)
    except ValueError as e:
        raise AdapterError(f"{path}: {e}") from None


def _check_values(path: Path, config: dict) -> None:
    """r a positive int, lora_alpha finite and > 0, lora_dropout in [0, 1), use_rslora a
    bool, and every rank_pattern / alpha_pattern key a regex with a value of the same rule.
    JSON may hold 4.9, 1e999 (inf) or NaN: they are refused, not truncated or propagated."""
    for key in ("r", "lora_alpha"):
        if config.get(key) is None:
            raise AdapterError(f"{path}: missing {key!r}")
    _lora_args(path, config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0),
               ("r", "lora_alpha", "lora_dropout"))
    for key, is_rank in (("rank_pattern", True), ("alpha_pattern", False)):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise AdapterError(f"{path}: {key} is {patterns!r}, expected an object")
        for p, v in patterns.items():
            _regex(path, f"{key} key", p)
            _lora_args(path, v if is_rank else 1, 1.0 if is_rank else v, 0.0,
                       (f"{key}[{p!r}]",) * 3)
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterError(f"{path}: use_rslora is {config['use_rslora']!r}, expected true or "
                           f"false")


def read_config(dir: str | Path, *, to_load: bool = False) -> dict:
    """The LoraConfig in `dir`/adapter_config.json, checked: a JSON object, peft_type "LORA",
    no DoRA, r / lora_alpha / lora_dropout / use_rslora and the patterns as `_check_values`
    says, target_modules and target_parameters well formed and at least one of them given.
    `to_load` (load_adapter) also refuses the options that change how a model applies the
    factors (CHANGES_THE_MODEL). Raises AdapterNotFoundError for a missing directory or file,
    AdapterError (a ValueError) for the rest."""
    dir = Path(dir)
    path = dir / CONFIG_NAME
    if not path.is_file():
        why = "no such directory" if not dir.is_dir() else "not a PEFT adapter directory"
        raise AdapterNotFoundError(f"no {CONFIG_NAME} in {dir}: {why}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    neutral = CHANGES_THE_UPDATE | (CHANGES_THE_MODEL if to_load else {})
    unsupported = {k: config[k] for k, v in neutral.items()
                   if config.get(k, v) not in (v, None, [], {})}
    if unsupported:
        plain = {k: neutral[k] for k in unsupported}
        raise AdapterError(f"{path}: unsupported LoRA options {unsupported} (plain LoRA has "
                           f"{plain})")
    _check_values(path, config)
    _names(path, "target_modules", config.get("target_modules"), allow_regex=True)
    _names(path, "target_parameters", config.get("target_parameters"), allow_regex=False)
    if config.get("target_modules") is None and not config.get("target_parameters"):
        raise AdapterError(f"{path}: missing 'target_modules' (and no 'target_parameters')")
    return config


# --- adapter_model.safetensors ----------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One LoRA pair of a file as our metadata records it: key prefix, our name, E, r, s."""

    prefix: str
    name: str
    experts: int
    r: int
    scaling: float


def read_weights(dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of `dir`/adapter_model.safetensors (never pickle) and its metadata. Every
    tensor must be floating-point and finite."""
    dir = Path(dir)
    path = dir / WEIGHTS_NAME
    if not path.is_file():
        found = sorted(p.name for p in dir.glob("adapter_model.*"))
        raise AdapterNotFoundError(f"no {WEIGHTS_NAME} in {dir}" + (
            f" (found {found}; only safetensors are read, never pickle)" if found else ""))
    try:
        with safetensors.safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
    except safetensors.SafetensorError as e:
        raise AdapterError(f"{path}: not a readable safetensors file ({e})") from None
    for k, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterError(f"{path}: {k} has dtype {t.dtype}, expected a floating-point "
                               f"type")
    bad = sorted(k for k, t in tensors.items() if not torch.isfinite(t).all())
    if bad:
        raise AdapterError(f"{path}: NaN or Inf in {bad}; the adapter weights must be finite")
    return tensors, metadata


def _number(where: str, name: str, value, integer: bool = False):
    """`value` if it is a positive int (`integer`) or a finite real; else AdapterError."""
    ok = not isinstance(value, bool) and (
        isinstance(value, int) and value > 0 if integer
        else isinstance(value, int | float) and math.isfinite(value))
    if not ok:
        raise AdapterError(f"{where}: {name} is {value!r}, expected "
                           + ("a positive int" if integer else "a finite number"))
    return value


def read_targets(path: Path, raw: str, prefixes: list[str]) -> list[Target]:
    """The targets our metadata (`raw`, the METADATA_KEY entry) describes; it must describe
    exactly the file's key `prefixes`."""
    where = f"{path}: metadata {METADATA_KEY}"
    try:
        entries = json.loads(raw)
    except json.JSONDecodeError as e:
        raise AdapterError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(entries, list):
        raise AdapterError(f"{where} is a {type(entries).__name__}, expected a list")
    targets = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not {"prefix", "name", "experts", "r", "scaling"} <= set(e):
            raise AdapterError(f"{where}[{i}] is {e!r}, expected an object with prefix, "
                               f"name, experts, r, scaling")
        at = f"{where}[{e['prefix']!r}]"
        targets.append(Target(str(e["prefix"]), str(e["name"]),
                              _number(at, "experts", e["experts"], integer=True),
                              _number(at, "r", e["r"], integer=True),
                              float(_number(at, "scaling", e["scaling"]))))
    described = [t.prefix for t in targets]
    for p in described:
        if p not in prefixes or described.count(p) > 1:
            raise AdapterError(f"{where} names prefix {p!r} " + (
                "twice" if p in prefixes else f"but the file has no {p}{LORA_A}"))
    for p in prefixes:
        if p not in described:
            raise AdapterError(f"{path}: {p}{LORA_A} is not described in metadata "
                               f"{METADATA_KEY}")
    return targets


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


def write_adapter(dir: str | Path, config: dict, factors: dict[str, torch.Tensor],
                  targets: list[Target]) -> None:
    """Write `config` and the `factors` (key -> tensor, saved from CPU copies) with our
    metadata for `targets` to `dir`, each file atomically (minigpt.atomic)."""
    tensors = {k: t.detach().cpu().contiguous() for k, t in factors.items()}
    metadata = {"format": "pt", METADATA_KEY: json.dumps([asdict(t) for t in targets])}
    dir = Path(dir)
    with atomic_path(dir / CONFIG_NAME) as cfg_tmp, atomic_path(dir / WEIGHTS_NAME) as w_tmp:
        w_tmp.write_bytes(_safetensors_bytes(tensors, metadata))
        cfg_tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
