"""The signed 8-bit dynamic map and blockwise 8-bit quantization (used by NF4 double quant).

The dynamic map (Dettmers, "8-Bit Approximations for Parallelism in Deep Learning") is a
256-entry table of sorted values in [-1, 1]: for each decade 10^-6 … 10^0 it holds the
midpoints of a linear grid on [0.1, 1] scaled by that decade, with more points in the larger
decades, in both signs, plus 0 and 1. Small magnitudes keep their relative precision, which
suits the centred absmax vector that double quantization stores.

The arithmetic copies bitsandbytes' `create_dynamic_map(signed=True)` step for step (float32
`linspace`, float32 midpoints, a Python-float decade times a float32 tensor) so that the table
is bit-identical to theirs; blockwise quantization follows the rules of their PyTorch
reference kernel (nearest code, a value on a midpoint goes to the lower code). That search is
a binary search over the midpoints (`nearest_code`), or, for a code as short as NF4's,
`nearest_code_in_cells`: the same indices from two table lookups keyed by a float's top bits.

bitsandbytes' CPU kernel rounds differently: it first snaps the scaled value to one of
65536 evenly spaced points on [-1, 1] and takes the code nearest to that point, through a
precomputed table. A value within half a table step of a midpoint between two codes can then
land on the neighbour, and near 0, where the map's codes are closer together than the table's
points, a few codes away. `rounding="bnb_cpu"` reproduces that rule exactly, so the course can
show both: the nearest code (the definition, and their GPU rule) and their CPU's codes.
"""

from __future__ import annotations

import torch

EXPONENT_BITS = 7        # decades 10^-6 … 10^0 (bitsandbytes' default max_exponent_bits)
ABSMAX_FLOOR = 1e-38     # a block's absmax is clamped to this before taking its reciprocal
ROUNDINGS = ("nearest", "bnb_cpu")
LUT_POINTS = 65536       # bitsandbytes' CPU table: evenly spaced points on [-1, 1]
CELL_SHIFT = 20          # a float32's top 12 bits (sign, exponent, 3 mantissa bits) name its cell


def dynamic_map() -> torch.Tensor:
    """The signed dynamic map: float32 [256], sorted, from -1 to 1, containing 0.

    Decade i (i = 0..6, scale 10^(i-6)) contributes the 2^i midpoints of a linspace of
    2^i + 1 points on [0.1, 1], positive and negative: 2·(1 + 2 + … + 64) = 254 values,
    plus 0 and 1 = 256.
    """
    values = []
    for i in range(EXPONENT_BITS):
        grid = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (grid[:-1] + grid[1:]) / 2.0
        decade = 10 ** (i - (EXPONENT_BITS - 1))
        values.append(decade * means)
        values.append(-decade * means)
    values.append(torch.tensor([0.0, 1.0]))
    return torch.cat(values).sort().values


DYNAMIC_CODE = dynamic_map()


def quantize_blockwise_8bit(x: torch.Tensor, blocksize: int = 256,
                            code: torch.Tensor | None = None, rounding: str = "nearest"
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor to 8-bit indices into `code`, one absmax per block.

    x is flattened row-major and cut into blocks of `blocksize` consecutive values; the last
    block may be partial. Returns (codes uint8 [x.numel()], absmax float32 [n_blocks]).
    Full blocks are scaled by multiplying with 1/absmax, a partial last block by dividing by
    its absmax (the two differ in the last bit, and bitsandbytes does exactly this); an
    all-zero block keeps absmax 0 (full) or stores the floor 1e-38 (partial), as theirs does.
    `rounding` is "nearest" or "bnb_cpu" (see the module docstring).
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    code = DYNAMIC_CODE if code is None else code
    code = code.to(x.device)
    flat = x.reshape(-1).float()
    scaled, absmax = scale_blocks(flat, blocksize)
    pick = nearest_code if rounding == "nearest" else lut_code
    return pick(scaled, code).to(torch.uint8), absmax


def dequantize_blockwise_8bit(codes: torch.Tensor, absmax: torch.Tensor, blocksize: int = 256,
                              code: torch.Tensor | None = None) -> torch.Tensor:
    """code[codes] · absmax of each block, float32 [codes.numel()] (flat)."""
    code = DYNAMIC_CODE if code is None else code
    values = code.to(codes.device)[codes.reshape(-1).long()]
    return values * absmax.repeat_interleave(blocksize)[: values.numel()]


def scale_blocks(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale each block of a flat float32 tensor into [-1, 1]; returns (scaled, absmax).

    Full blocks: x · (1 / max(absmax, 1e-38)), clamped to [-1, 1]. A trailing partial block:
    x / max(absmax, 1e-38), and it is the clamped absmax that is stored for it.
    """
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    inverse = 1.0 / absmax.clamp(min=ABSMAX_FLOOR)
    scaled = (blocks * inverse[:, None]).clamp_(-1, 1).reshape(-1)
    if full < n:
        tail = flat[full:]
        tail_absmax = tail.abs().amax().clamp(min=ABSMAX_FLOOR)
        absmax = torch.cat([absmax, tail_absmax[None]])
        scaled = torch.cat([scaled, (tail / tail_absmax).clamp(-1, 1)])
    return scaled, absmax


def nearest_code(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted `code`; a value on a midpoint takes the lower.

    `bucketize` against the midpoints returns i with midpoint[i-1] < x <= midpoint[i], so a
    value equal to midpoint[i] gets index i, the code below that midpoint. Returns int64.
    """
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, midpoints)


def code_cells(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of `nearest_code_in_cells` for a sorted float32 `code` of at most 256 entries:
    (first uint8 [4096], threshold float32 [4096]).

    The float32 numbers whose bit patterns share their top 12 bits form an interval, a cell
    (about 1/16 of an octave wide). first[c] is nearest_code of the cell's lowest number (the
    count of midpoints below it) and threshold[c] the next midpoint (inf past the last). If no
    cell holds two midpoints, nearest_code(x) = first[c] + (x > threshold[c]) for every finite
    x in cell c, ties included. Raises ValueError for a code whose midpoints lie closer (the
    dynamic map's do, near 1).
    """
    code = code.cpu().float()
    starts = torch.arange(1 << (32 - CELL_SHIFT), dtype=torch.int64) << CELL_SHIFT
    bits = torch.stack([starts, starts + (1 << CELL_SHIFT) - 1])        # [2, 4096] first, last
    ends = torch.where(bits >= 2**31, bits - 2**32, bits).int().view(torch.float32)
    low, high = ends.aminmax(dim=0)             # [4096]: a negative cell's first bits are its top
    midpoints = (code[:-1] + code[1:]) / 2
    first, last = torch.bucketize(low, midpoints), torch.bucketize(high, midpoints)
    if (last - first > 1)[~low.isnan()].any():
        raise ValueError("code has two midpoints in one cell: search it with nearest_code")
    threshold = torch.cat([midpoints, torch.tensor([torch.inf])])[first]
    return first.to(torch.uint8), threshold


def nearest_code_in_cells(scaled: torch.Tensor, cells: tuple[torch.Tensor, torch.Tensor]
                          ) -> torch.Tensor:
    """nearest_code(scaled, code), uint8, for finite float32 `scaled` and cells =
    code_cells(code) on scaled's device: two 4096-entry lookups and one comparison per value
    instead of a binary search (on a CPU, over 10x faster than `bucketize` on inputs that fit
    in its cache)."""
    first, threshold = cells
    cell = (scaled.view(torch.int32) >> CELL_SHIFT) & ((1 << (32 - CELL_SHIFT)) - 1)  # [n] int32
    above = scaled > torch.index_select(threshold, 0, cell)
    return torch.index_select(first, 0, cell).add_(above.view(torch.uint8))


def lut_code(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU rule: the code nearest to the table point nearest to each value.

    Point j of the table is -1 + 2j/65535; a value in [-1, 1] snaps to the point
    round((x + 1) / 2 · 65535), and the table holds nearest_code of every point. Returns int64.
    """
    points = -1.0 + (2.0 * torch.arange(LUT_POINTS, dtype=torch.float32, device=code.device)
                     ) / (LUT_POINTS - 1)
    table = nearest_code(points, code)
    return table[((scaled.clamp(-1, 1) + 1.0) * 0.5 * (LUT_POINTS - 1) + 0.5).long()]
