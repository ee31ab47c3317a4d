"""How far a LoRA adapter moved each weight: ‖s·B·A‖_F per module and, for experts, per expert.

Reads any PEFT-format adapter directory (minituner's `save_adapter`, or PEFT's
`save_pretrained`, expert LoRA included); weights only through safetensors, never pickle.

    for each LoRA target (key prefix P, E experts, rank r, scaling s):
        A = P + "lora_A.weight"   [r·E, in]    expert e owns rows e·r:(e+1)·r
        B = P + "lora_B.weight"   [out, r·E]   PEFT's order: column j·E + e is B_e's column j
        ‖s·B_e·A_e‖_F = |s|·sqrt(Σ (B_eᵀB_e) ⊙ (A_e·A_eᵀ))      two r×r Gram matrices

The identity is ‖BA‖²_F = tr(AᵀBᵀBA) = tr((BᵀB)(AAᵀ)): r²·(in+out) work per expert, and no
[out, in] product is ever formed, however large the layer.

Where E, r and s come from: our files carry safetensors metadata "minituner.targets" (name,
E, r, s per key prefix). PEFT's files do not; then r and alpha follow adapter_config.json
(`rank_pattern` / `alpha_pattern` by PEFT's rule), a prefix is an expert parameter when a
`target_parameters` entry names a parameter of its module, and E = rows of A // r. PEFT nests
one wrapper per targeted parameter of a module (`<module>.base_layer.….lora_A.weight`) in the
module's registration order, which the file does not record: such targets are named
`<module>[base_layer×d]`.

CLI: python -m minituner.lora_norms DIR [--plot PNG] [--grid] [--top N]
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minimoe import lora_scaling

from .norms_report import grid, norms_table, plot_norms
from .peft_format import (
    CONFIG_NAME,
    KEY_PREFIX,
    LORA_A,
    LORA_B,
    METADATA_KEY,
    WEIGHTS_NAME,
    AdapterError,
    Target,
    matches,
    pattern_value,
    read_config,
    read_targets,
    read_weights,
    split_prefix,
)

__all__ = ["AdapterError", "TargetNorms", "adapter_norms", "grid", "main", "norms_table",
           "plot_norms", "total_norm", "update_norms"]

_NESTED = "[base_layer×"


@dataclass
class TargetNorms:
    """‖s·B_e·A_e‖_F of one LoRA target: one entry for a module, E for an expert parameter."""

    name: str
    experts: list[float]
    total: float = field(init=False)    # ‖whole update‖_F = sqrt(Σ_e experts[e]²)

    def __post_init__(self):
        self.total = math.sqrt(sum(x * x for x in self.experts))


def update_norms(lora_A: torch.Tensor, lora_B: torch.Tensor, experts: int,
                 scaling: float) -> torch.Tensor:
    """‖s·B_e·A_e‖_F for e < E, float64 [E], without forming any [out, in] product.

    lora_A [r·E, in] (expert e: rows e·r:(e+1)·r); lora_B [out, r·E] in PEFT's column order
    (column j·E + e is expert e's j-th). A module is E = 1.
    """
    if experts < 1 or lora_A.ndim != 2 or lora_B.ndim != 2 or lora_A.shape[0] % experts \
            or lora_B.shape[1] != lora_A.shape[0]:
        raise ValueError(f"expected lora_A [r·E, in] and lora_B [out, r·E] with E={experts}, "
                         f"got {list(lora_A.shape)} and {list(lora_B.shape)}")
    A, B = lora_A.detach().to(torch.float64), lora_B.detach().to(torch.float64)
    r = A.shape[0] // experts
    A3 = A.reshape(experts, r, A.shape[1])                  # [E, r, in]
    B3 = B.reshape(B.shape[0], r, experts).permute(2, 0, 1)  # [E, out, r]
    gram_A = A3 @ A3.transpose(1, 2)                        # [E, r, r]
    gram_B = B3.transpose(1, 2) @ B3                        # [E, r, r]
    # Σ of the product of two PSD matrices is ≥ 0; rounding may dip a zero just below it.
    squares = (gram_A * gram_B).sum(dim=(1, 2)).clamp_min(0.0)   # [E]
    return abs(scaling) * squares.sqrt()


# --- reading the directory ---------------------------------------------------------------

def _pairs(keys: list[str], path: Path) -> tuple[list[str], list[str]]:
    """The key prefixes holding a lora_A / lora_B pair, and the keys that are neither."""
    a = {k[:-len(LORA_A)] for k in keys if k.endswith("." + LORA_A)}
    b = {k[:-len(LORA_B)] for k in keys if k.endswith("." + LORA_B)}
    for have, lack in ((a, b), (b, a)):
        for p in sorted(have - lack):
            key, other = (p + LORA_A, p + LORA_B) if have is a else (p + LORA_B, p + LORA_A)
            raise AdapterError(f"{path}: {key} has no {other} beside it")
    if not a:
        raise AdapterError(f"{path}: no *.lora_A.weight / *.lora_B.weight tensors")
    for p in sorted(a):
        if not p.startswith(KEY_PREFIX):
            raise AdapterError(f"{path}: {p}{LORA_A} is not under {KEY_PREFIX!r} (PEFT's "
                               f"layout)")
    ignored = sorted(k for k in keys if not k.endswith(("." + LORA_A, "." + LORA_B)))
    return sorted(a), ignored


def _check_shapes(path: Path, t: Target, a: list[int], b: list[int]) -> None:
    """A [r·E, in] and B [out, r·E] for the target's r and E."""
    rows = t.r * t.experts
    if a[0] != rows:
        raise AdapterError(f"{path}: {t.prefix}{LORA_A} is {a}, expected {rows} rows "
                           f"(r·E = {t.r}·{t.experts} for {t.name})")
    if b[1] != rows:
        raise AdapterError(f"{path}: {t.prefix}{LORA_B} is {b}, expected {rows} columns "
                           f"(as many as {LORA_A} has rows)")


# --- E, r and s of each pair: from adapter_config.json, as PEFT does ----------------------

def _rank_alpha(config: dict, key: str) -> tuple[int, float]:
    return (pattern_value(config.get("rank_pattern") or {}, key, config["r"]),
            pattern_value(config.get("alpha_pattern") or {}, key, config["lora_alpha"]))


def _scaling(config: dict, r: int, alpha: float) -> float:
    return lora_scaling(alpha, r, config.get("use_rslora", False))


def _param_keys(config: dict, module: str) -> list[str]:
    """`module.param` for every target_parameters entry naming a parameter of `module`
    (entry "experts.down_proj": module suffix "experts"; an entry without a dot: any)."""
    keys = []
    for entry in config.get("target_parameters") or []:
        suffix, _, param = entry.rpartition(".")
        if not suffix or module == suffix or module.endswith("." + suffix):
            keys.append(f"{module}.{param}")
    return list(dict.fromkeys(keys))


def _config_targets(config: dict, prefixes: list[str], rows: dict[str, int],
                    path: Path) -> list[Target]:
    """Targets of a file without our metadata: modules and expert parameters, grouped by the
    module holding them (one prefix per nesting depth)."""
    groups: dict[str, dict[int, str]] = {}
    for p in prefixes:
        module, depth = split_prefix(p)
        groups.setdefault(module, {})[depth] = p
    targets = []
    for module, levels in groups.items():
        keys = _param_keys(config, module)
        nested = max(levels) > 0
        in_modules = bool(config.get("target_modules")) and matches(module,
                                                                    config["target_modules"])
        if keys and (nested or not in_modules):
            targets += _param_targets(config, module, levels, keys, rows, path)
        elif nested:
            raise AdapterError(f"{path}: {levels[max(levels)]}{LORA_A} is nested in base_layer, "
                               f"but no target_parameters entry names a parameter of {module}")
        else:
            r, alpha = _rank_alpha(config, module)
            targets.append(Target(levels[0], module, 1, r, _scaling(config, r, alpha)))
    return targets


def _param_targets(config: dict, module: str, levels: dict[int, str], keys: list[str],
                   rows: dict[str, int], path: Path) -> list[Target]:
    """The expert-parameter targets of one module. Which parameter sits at which depth is the
    model's registration order, not in the file: try every assignment of the candidate
    parameters to the depths whose ranks divide the rows of A, preferring those that give
    every depth the same E (one experts module); r and alpha must come out the same."""
    depths = sorted(levels)
    if len(depths) > len(keys):
        raise AdapterError(f"{path}: {module} holds {len(depths)} nested LoRA pairs, but "
                           f"target_parameters names only {keys} of its parameters")
    cands = [(k, *_rank_alpha(config, k)) for k in keys]          # (key, r, alpha)
    for d in depths:
        n = rows[levels[d]]
        if not any(n % r == 0 for _, r, _ in cands):
            raise AdapterError(f"{path}: {levels[d]}{LORA_A} has {n} rows, expected a multiple "
                               f"of r = {' or '.join(sorted({str(r) for _, r, _ in cands}))} "
                               f"(r / rank_pattern of {CONFIG_NAME} for {keys})")
    fits = [a for a in itertools.permutations(cands, len(depths))
            if all(rows[levels[d]] % c[1] == 0 for d, c in zip(depths, a, strict=True))]
    same_e = [a for a in fits
              if len({rows[levels[d]] // c[1] for d, c in zip(depths, a, strict=True)}) == 1]
    fits = same_e or fits
    targets = []
    for i, d in enumerate(depths):
        choices = {(a[i][1], a[i][2]) for a in fits}
        if len(choices) != 1:
            raise AdapterError(f"{path}: cannot tell r and alpha of {levels[d]}{LORA_A} "
                               f"({rows[levels[d]]} rows): {keys} fit as {sorted(choices)}")
        (r, alpha), = choices
        name = keys[0] if len(keys) == 1 and depths == [0] else f"{module}{_NESTED}{d}]"
        targets.append(Target(levels[d], name, rows[levels[d]] // r, r,
                               _scaling(config, r, alpha)))
    return targets


def _natural(name: str) -> list:
    """Sort key putting blocks.2 before blocks.10."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _shape(path: Path, key: str, t: torch.Tensor) -> list[int]:
    """The shape of tensor `key`, which must be a matrix."""
    if t.ndim != 2:
        raise AdapterError(f"{path}: {key} has shape {list(t.shape)}, expected a matrix (only "
                           f"linear / parameter LoRA, not conv or embedding LoRA)")
    return list(t.shape)


def _read(dir: Path) -> tuple[list[TargetNorms], list[str]]:
    """The norms of every target of the adapter in `dir`, and the tensor keys ignored."""
    config = read_config(dir)
    tensors, metadata = read_weights(dir)
    path = dir / WEIGHTS_NAME
    prefixes, ignored = _pairs(list(tensors), path)
    shapes = {k: _shape(path, k, tensors[k]) for p in prefixes for k in (p + LORA_A, p + LORA_B)}
    raw = metadata.get(METADATA_KEY)
    if raw is not None:
        targets = read_targets(path, raw, prefixes)
    else:
        rows = {p: shapes[p + LORA_A][0] for p in prefixes}
        targets = sorted(_config_targets(config, prefixes, rows, path),
                         key=lambda t: _natural(t.name))
    for t in targets:
        _check_shapes(path, t, shapes[t.prefix + LORA_A], shapes[t.prefix + LORA_B])
    norms = [TargetNorms(t.name, update_norms(tensors[t.prefix + LORA_A],
                                              tensors[t.prefix + LORA_B],
                                              t.experts, t.scaling).tolist())
             for t in targets]
    return norms, ignored


def adapter_norms(dir: str | Path) -> list[TargetNorms]:
    """‖s·B_e·A_e‖_F of every target of the PEFT-format adapter in `dir`: in our metadata's
    order, else by name. Raises AdapterError (a ValueError) naming the file and key."""
    return _read(Path(dir))[0]


def total_norm(source: str | Path | list[TargetNorms]) -> float:
    """‖the adapter's whole update‖_F = sqrt(Σ over targets of total²), from a directory or
    from `adapter_norms`' list."""
    norms = source if isinstance(source, list) else adapter_norms(source)
    return math.sqrt(sum(t.total ** 2 for t in norms))


# --- command line ------------------------------------------------------------------------

def _summary(dir: Path, norms: list[TargetNorms]) -> str:
    experts = [t for t in norms if len(t.experts) > 1]
    n = sum(len(t.experts) for t in norms)
    text = (f"{dir}: {n} updates in {len(norms)} LoRA targets "
            f"({len(norms) - len(experts)} modules")
    if experts:
        sizes = "/".join(str(e) for e in sorted({len(t.experts) for t in experts}))
        text += f", {len(experts)} expert parameters × {sizes} experts"
    return text + ")"


def _notes(norms: list[TargetNorms], ignored: list[str]) -> list[str]:
    notes = []
    if any(_NESTED in t.name for t in norms):
        notes.append("a name ending [base_layer×d] is the parameter PEFT wrapped d levels deep; "
                     "with n parameters of a module targeted, the i-th in the module's "
                     "registration order sits at d = n-1-i (HF Mixtral experts: gate_up_proj "
                     "×1, down_proj ×0); the file does not record that order")
    if ignored:
        notes.append(f"ignored {len(ignored)} tensors that are not lora_A / lora_B weights, "
                     f"e.g. {ignored[0]}")
    return notes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minituner.lora_norms",
        description="‖s·B·A‖_F of every LoRA update in a PEFT-format adapter directory, per "
                    "module and per expert, largest first.")
    p.add_argument("dir", type=Path, help="adapter directory (adapter_config.json + "
                                          "adapter_model.safetensors)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="also write a heatmap / bar chart")
    p.add_argument("--grid", action="store_true",
                   help="print markdown tables (targets × experts, projections × blocks) "
                        "instead of the ranking")
    p.add_argument("--top", type=int, metavar="N", help="print only the N largest updates")
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI: 0 on success; 2 with a one-line `error:` on stderr for a bad argument or an
    adapter this module cannot read."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:             # argparse has printed usage and the error
        return e.code if isinstance(e.code, int) else 2
    problem = ("--top must be at least 1" if args.top is not None and args.top < 1 else
               "--top ranks the lines; --grid prints every target" if args.top and args.grid
               else None)
    try:
        if problem:
            raise AdapterError(problem)
        norms, ignored = _read(args.dir)
        if args.plot:
            plot_norms(norms, args.plot)
    except (AdapterError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.grid:
        print(_summary(args.dir, norms))
    print(grid(norms) if args.grid else norms_table(norms, args.top))
    for note in _notes(norms, ignored):
        print(f"note: {note}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
