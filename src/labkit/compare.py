"""Compare two metric trees number by number and name every number that moved."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Moved:
    key: str        # dotted path, e.g. "dense.exact_match.add" or "dense.loss_curve[3]"
    recorded: object
    now: object

    def __str__(self) -> str:
        return f"{self.key}: recorded {self.recorded!r}, now {self.now!r}"


def flatten(tree, prefix: str = "") -> dict:
    """{"a": {"b": [1, 2]}} -> {"a.b[0]": 1, "a.b[1]": 2}."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(tree, list | tuple):
        out = {}
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: tree}


def tolerance_for(key: str, tolerances: dict) -> tuple[float, float]:
    """(rtol, atol) for `key`: the longest matching prefix in `tolerances`, else "default"."""
    best = tolerances.get("default", {"rtol": 0.0, "atol": 0.0})
    best_len = -1
    for prefix, tol in tolerances.items():
        if prefix != "default" and key.startswith(prefix) and len(prefix) > best_len:
            best, best_len = tol, len(prefix)
    return float(best.get("rtol", 0.0)), float(best.get("atol", 0.0))


def _same(a, b, rtol: float, atol: float) -> bool:
    numeric = (int, float)
    if isinstance(a, numeric) and isinstance(b, numeric) and not isinstance(a, bool):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b if rtol == atol == 0.0 else abs(a - b) <= atol + rtol * abs(a)
    return a == b


def compare_metrics(recorded: dict, now: dict, tolerances: dict | None = None) -> list[Moved]:
    """Every leaf that differs; `tolerances=None` demands bit-identical numbers."""
    old, new = flatten(recorded), flatten(now)
    moved = []
    for key in sorted(old.keys() | new.keys()):
        rtol, atol = (0.0, 0.0) if tolerances is None else tolerance_for(key, tolerances)
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if not _same(a, b, rtol, atol):
            moved.append(Moved(key, a, b))
    return moved
