"""Symmetric integer quantization: absmax int8 and per-group 2..8-bit (Lab 01).

Symmetric means zero maps to zero and the grid is the same on both sides: a b-bit code
q lies in [-qmax, qmax] with qmax = 2^(b-1) - 1 (the code -2^(b-1) is never used), and
w ≈ q · scale with scale = absmax / qmax, so the largest |w| of a group lands exactly on
±qmax. Rounding is torch.round: to the nearest integer, half to even. Each element's error
is then at most scale/2, so one outlier that inflates the absmax hurts every element that
shares its scale; smaller groups contain the damage.

All arithmetic is float32; dequantization returns float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the quantizers accept


def check_weight(w, name: str = "w") -> None:
    """Raise ValueError unless `w` is a non-empty, finite float16/bfloat16/float32 tensor."""
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {w.dtype}")
    if w.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(w.shape)}")
    bad = (~torch.isfinite(w)).sum().item()
    if bad:
        raise ValueError(f"{name} must be finite, got {bad} NaN/Inf value(s)")


def quantize_absmax_int8(w: torch.Tensor, dim: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax int8: q = round(w / scale), scale = absmax / 127.

    dim=None: one scale for the whole tensor (a 0-d float32 tensor). dim=d: the absmax is
    taken along d, one scale per slice, kept as a size-1 dim so that it broadcasts (dim=-1
    on an [out, in] weight gives per-row scales [out, 1]). Returns (q int8 of w's shape,
    scale float32). An all-zero slice gets scale 0 and codes 0.
    """
    check_weight(w, "w")
    x = w.float()
    absmax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = absmax / 127
    return round_to_grid(x, scale, 127), scale


def dequantize_absmax_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q · scale in float32 (scale broadcasts: 0-d, or the keepdim shape of the quantizer)."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise ValueError(f"q must be an int8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    return q.float() * scale.float()


def quantize_symmetric_per_group(w: torch.Tensor, bits: int = 8, group_size: int = 64
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric b-bit quantization with one scale per group of `group_size` elements.

    Layout: w is flattened row-major and cut into groups of `group_size` consecutive
    elements; the last group may be partial (then its absmax covers only its own elements).
    Returns (q int8 of w's shape, values in [-qmax, qmax]; scales float32 [n_groups] with
    n_groups = ceil(w.numel() / group_size)). q keeps w's shape so that the round trip
    gives back w's shape without passing it separately.
    """
    check_weight(w, "w")
    qmax = check_bits(bits)
    check_group_size(group_size)
    flat = w.reshape(-1).float()
    groups = F.pad(flat, (0, -flat.numel() % group_size)).reshape(-1, group_size)
    scales = groups.abs().amax(dim=1) / qmax
    q = round_to_grid(groups, scales[:, None], qmax).reshape(-1)[: flat.numel()]
    return q.reshape(w.shape), scales


def dequantize_symmetric_per_group(q: torch.Tensor, scales: torch.Tensor,
                                   group_size: int = 64) -> torch.Tensor:
    """q · scale of its group, float32 of q's shape (the layout of the quantizer)."""
    check_group_size(group_size)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise ValueError(f"q must be an int8 tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    n_groups = -(-q.numel() // group_size)
    if not isinstance(scales, torch.Tensor) or scales.numel() != n_groups:
        got = scales.numel() if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(f"scales must hold ceil({q.numel()}/{group_size}) = {n_groups} "
                         f"values, got {got}")
    per_element = scales.float().reshape(-1).repeat_interleave(group_size)[: q.numel()]
    return (q.reshape(-1).float() * per_element).reshape(q.shape)


def round_to_grid(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """round(x / scale) clamped to [-qmax, qmax], int8; a zero scale gives code 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe).clamp(-qmax, qmax).to(torch.int8)


def check_bits(bits) -> int:
    """Validate `bits` (an int in 2..8) and return qmax = 2^(bits-1) - 1."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 2..8, got {bits!r}")
    return 2 ** (bits - 1) - 1


def check_group_size(group_size) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
