"""NF4: 4-bit NormalFloat blockwise quantization with optional double quantization (Lab 02).

A weight is flattened row-major and cut into blocks of `blocksize` consecutive values (the
last block may be partial). Each block is divided by its absolute maximum, so its values lie
in [-1, 1], and each value is replaced by the index of the nearest of 16 code values: the
NF4 codebook, quantiles of a standard normal, so that weights drawn from a normal fill the
16 bins about equally. Two indices share a byte. Storage: 4 bits a weight plus one float32
absmax a block (0.5 bits a weight at blocksize 64), or, with double quantization, an 8-bit
code a block plus a float32 per 256 blocks (≈ 0.127 bits a weight).

Every rule matches bitsandbytes 0.50's `quantize_4bit(..., quant_type="nf4")` on CPU bit for
bit (docs/ARCHITECTURE.md, NF4); tests/miniquant/test_bnb_parity.py holds that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dynamic import (
    ROUNDINGS,
    code_cells,
    dequantize_blockwise_8bit,
    nearest_code_in_cells,
    quantize_blockwise_8bit,
    scale_blocks,
)
from .intquant import check_weight

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # the blocksizes bitsandbytes accepts
NESTED_BLOCKSIZE = 256   # absmax values sharing one float32 scale under double quantization
NF4_OFFSET = 0.9677083   # the outermost quantile probability (QLoRA / bitsandbytes)
ZERO_CODE = 7            # the index of 0.0 in the codebook; pads an odd element count
NF4_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements a CPU handles per pass (≈ 0.5 MB of float32, so a pass's temporaries stay in its L2
# cache); a multiple of every blocksize, so only the last pass can hold a partial block.
CPU_SPAN = 1 << 17


def nf4_codebook() -> torch.Tensor:
    """The 16 NF4 values, float32, sorted, index 7 exactly 0, ends exactly -1 and 1.

    8 positive quantiles at probabilities linspace(0.9677083, 0.5, 9) without the 0.5, 7
    negative ones at linspace(0.9677083, 0.5, 8) without the 0.5, and a zero. The order of
    roundings is what makes the table bit-identical to bitsandbytes': probabilities in
    float32 (a float32 linspace), quantiles in float64, rounded to float32, then divided by
    the maximum in float32. Computing everything in float64 and rounding once at the end
    leaves 10 of the 16 values off, by one to six ulps (docs/ARCHITECTURE.md, NF4).
    """
    positive = torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float32)[:-1]
    negative = torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float32)[:-1]
    quantiles = torch.cat([torch.special.ndtri(positive.double()),
                           torch.zeros(1, dtype=torch.float64),
                           -torch.special.ndtri(negative.double())]).float()
    quantiles = quantiles.sort().values
    return quantiles / quantiles.max()


NF4_CODE = nf4_codebook()
NF4_CELLS = code_cells(NF4_CODE)    # the tables that find the nearest code (miniquant.dynamic)
# int64 [256]: byte b's two levels, NF4_CODE[b >> 4] then NF4_CODE[b & 15], as one 8-byte
# word, so that one gather per byte yields both floats in element order.
NF4_BYTE_LEVELS = torch.stack([NF4_CODE.repeat_interleave(16), NF4_CODE.repeat(16)], dim=1
                              ).view(torch.int64).reshape(256)


@dataclass(frozen=True)
class NF4Config:
    """How a weight is quantized to NF4: the one place its defaults are written. Built (and
    checked) once where a caller gives it; the functions that quantize take it as
    `nf4_config=`, or its fields as keywords (`NF4Config.of`)."""

    blocksize: int = 64                 # consecutive weights sharing one absmax (BLOCKSIZES)
    double_quant: bool = True           # absmax to 8-bit codes, 256 a float32 scale (QLoRA)
    nested_rounding: str = "nearest"    # those codes: nearest, or "bnb_cpu" (bitsandbytes' CPU)

    def __post_init__(self):
        check_blocksize(self.blocksize)
        if not isinstance(self.double_quant, bool):
            raise ValueError(f"double_quant must be a bool, got {self.double_quant!r}")
        check_nested_rounding(self.nested_rounding)

    @classmethod
    def of(cls, nf4_config: NF4Config | None = None, **fields) -> NF4Config:
        """`nf4_config`, or one built from the keyword fields a caller gave (those left at
        `FROM_CONFIG` take NF4Config's defaults); both at once is a ValueError."""
        given = {k: v for k, v in fields.items() if v is not FROM_CONFIG}
        if nf4_config is None:
            return cls(**given)
        if not isinstance(nf4_config, NF4Config):
            raise ValueError(f"nf4_config must be an NF4Config, got {type(nf4_config).__name__}")
        if given:
            raise ValueError(f"pass nf4_config or {', '.join(given)}, not both")
        return nf4_config


class _FromConfig:
    """The default of a keyword that NF4Config holds: not given, so nf4_config's value (or
    NF4Config's default) is used. A real value, None included, is checked as given."""

    def __repr__(self) -> str:
        return "<NF4Config's>"


FROM_CONFIG = _FromConfig()


@dataclass(eq=False)
class NF4Weight:
    """A weight quantized to NF4: packed 4-bit codes plus per-block scales.

    The scales are held either as float32 absmax values (`block_absmax`) or, with double
    quantization, as 8-bit codes of (absmax - offset) in the signed dynamic map with one
    float32 scale per 256 blocks and a float32 offset; `.absmax` gives float32 either way.
    """

    packed: torch.Tensor        # uint8 [ceil(numel/2)]: two codes a byte, first in the high nibble
    shape: torch.Size           # the original weight's shape
    dtype: torch.dtype          # the original weight's dtype: what dequantize() returns by default
    blocksize: int              # consecutive (row-major) elements sharing one absmax
    block_absmax: torch.Tensor | None = None    # float32 [n_blocks]; None when double-quantized
    absmax_codes: torch.Tensor | None = None    # uint8 [n_blocks]: (absmax - offset), dynamic map
    absmax_scales: torch.Tensor | None = None   # float32 [ceil(n_blocks/256)]: their block absmax
    absmax_offset: torch.Tensor | None = None   # float32 []: the mean of the absmax vector

    def __post_init__(self):
        self.shape = torch.Size(self.shape)
        check_blocksize(self.blocksize)
        if self.dtype not in NF4_DTYPES:
            raise ValueError(f"dtype must be one of {NF4_DTYPES}, got {self.dtype}")
        if self.numel < 1:
            raise ValueError(f"shape must hold at least one element, got {tuple(self.shape)}")
        expect_tensor("packed", self.packed, torch.uint8, (self.numel + 1) // 2)
        self.packed = self.packed.reshape(-1)
        nested = (self.absmax_codes, self.absmax_scales, self.absmax_offset)
        if self.block_absmax is not None:
            if any(t is not None for t in nested):
                raise ValueError("give block_absmax or the nested absmax, not both")
            expect_tensor("block_absmax", self.block_absmax, torch.float32, self.n_blocks)
        else:
            if any(t is None for t in nested):
                raise ValueError("give block_absmax, or absmax_codes, absmax_scales and "
                                 "absmax_offset together")
            expect_tensor("absmax_codes", self.absmax_codes, torch.uint8, self.n_blocks)
            expect_tensor("absmax_scales", self.absmax_scales, torch.float32,
                          -(-self.n_blocks // NESTED_BLOCKSIZE))
            expect_tensor("absmax_offset", self.absmax_offset.reshape(-1), torch.float32, 1)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // self.blocksize)

    @property
    def double_quant(self) -> bool:
        return self.block_absmax is None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def absmax(self) -> torch.Tensor:
        """float32 [n_blocks]: the per-block scales, dequantizing the nested ones if needed."""
        if not self.double_quant:
            return self.block_absmax
        centred = dequantize_blockwise_8bit(self.absmax_codes, self.absmax_scales,
                                            NESTED_BLOCKSIZE)
        return centred + self.absmax_offset

    @property
    def nbytes(self) -> int:
        """Bytes of storage held: packed codes plus the absmax or its nested form."""
        return nf4_bytes(self.numel, self.blocksize, self.double_quant)

    @property
    def bits_per_param(self) -> float:
        """8·nbytes/numel: 4.5 at blocksize 64, ≈ 4.127 with double quantization."""
        return 8 * self.nbytes / self.numel

    def codes(self) -> torch.Tensor:
        """uint8 [numel]: the unpacked 4-bit codebook indices, row-major."""
        return unpack_nibbles(self.packed, self.numel)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self, dtype)

    def to(self, device: torch.device | str) -> NF4Weight:
        """A copy with every tensor on `device`."""
        def move(t):
            return None if t is None else t.to(device)

        return NF4Weight(move(self.packed), self.shape, self.dtype, self.blocksize,
                         move(self.block_absmax), move(self.absmax_codes),
                         move(self.absmax_scales), move(self.absmax_offset))


def nf4_bytes(numel: int, blocksize: int = NF4Config.blocksize,
              double_quant: bool = NF4Config.double_quant) -> int:
    """Bytes of an NF4 tensor of `numel` elements, without building one: the packed nibbles
    (ceil(numel/2)), plus a float32 absmax per block, or with double quantization a uint8 code
    per block, a float32 scale per 256 blocks and one float32 offset. `NF4Weight.nbytes` is
    this function of its own fields (the tests hold it equal to the tensors' storage)."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be a positive int, got {numel!r}")
    check_blocksize(blocksize)
    blocks = -(-numel // blocksize)
    if double_quant:
        scales = blocks + 4 * -(-blocks // NESTED_BLOCKSIZE) + 4
    else:
        scales = 4 * blocks
    return -(-numel // 2) + scales


def quantize_nf4(w: torch.Tensor, blocksize: int = NF4Config.blocksize,
                 double_quant: bool = False,
                 nested_rounding: str = NF4Config.nested_rounding) -> NF4Weight:
    """Quantize a float16/bfloat16/float32 weight of any shape to NF4.

    In float32: flatten row-major, scale each block into [-1, 1] by its absmax (full blocks
    multiply by 1/absmax, a trailing partial block divides), pick the nearest code (a value
    on a midpoint between two codes takes the lower one), pack two codes a byte. With
    `double_quant`, the absmax vector is centred on its mean and quantized to 8 bits in blocks
    of 256 with the signed dynamic map, each centred absmax going to its nearest code; pass
    `nested_rounding="bnb_cpu"` to round as bitsandbytes' CPU kernel does instead (the same
    nested codes as theirs, bit for bit; see miniquant.dynamic). Plain NF4 by default (the
    quantizers above it default to NF4Config's double quantization).
    """
    check_weight(w, "w")
    NF4Config(blocksize, double_quant, nested_rounding)      # checks the three
    packed, absmax = _quantize_codes(w.reshape(-1), blocksize)
    if not double_quant:
        return NF4Weight(packed, w.shape, w.dtype, blocksize, block_absmax=absmax)
    offset = absmax.mean()
    codes, scales = quantize_blockwise_8bit(absmax - offset, NESTED_BLOCKSIZE,
                                            rounding=nested_rounding)
    return NF4Weight(packed, w.shape, w.dtype, blocksize, absmax_codes=codes,
                     absmax_scales=scales, absmax_offset=offset)


def _quantize_codes(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [ceil(n/2)], absmax float32 [n_blocks]) of a flat weight, a span at a time
    (CPU_SPAN elements on a CPU, where its temporaries then stay in cache; all on a GPU)."""
    n = flat.numel()
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32, device=flat.device)
    cells = tuple(t.to(flat.device) for t in NF4_CELLS)
    span = _span(flat)
    for start in range(0, n, span):
        scaled, span_absmax = scale_blocks(flat[start:start + span].float(), blocksize)
        first_block = start // blocksize
        absmax[first_block:first_block + span_absmax.numel()] = span_absmax
        span_packed = pack_nibbles(nearest_code_in_cells(scaled, cells))
        packed[start // 2:start // 2 + span_packed.numel()] = span_packed
    return packed, absmax


def dequantize_nf4(q: NF4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The PyTorch reference: code[idx] · absmax of its block, in float32, then cast.

    Returns a tensor of q.shape and `dtype` (default: the dtype that was quantized; any
    floating-point dtype). On a CPU it works CPU_SPAN elements at a time, so that only the
    output leaves the cache.
    """
    check_float_dtype("dtype", dtype)
    out = torch.empty(q.numel, dtype=dtype or q.dtype, device=q.device)
    absmax = q.absmax
    levels = NF4_BYTE_LEVELS.to(q.device)
    span = _span(out)
    for start in range(0, q.numel, span):
        _dequantize_span(q.packed[start // 2:(start + span + 1) // 2], levels,
                         absmax[start // q.blocksize:], q.blocksize, out[start:start + span])
    return out.view(q.shape)


def _dequantize_span(packed: torch.Tensor, levels: torch.Tensor, absmax: torch.Tensor,
                     blocksize: int, out: torch.Tensor) -> None:
    """Fill `out` (the elements of `packed`, an odd count's pad left out) with code · absmax.

    `packed` starts on a block; `absmax` holds the scales from that block on. The product is
    computed in float32 and cast by the copy into `out`, as `.to()` would.
    """
    values = torch.index_select(levels, 0, packed.int()).view(torch.float32)    # [2·bytes]
    full = values.numel() // blocksize                                          # whole blocks
    values[:full * blocksize].view(full, blocksize).mul_(absmax[:full, None])
    if full * blocksize < values.numel():                   # a partial block (and any pad)
        values[full * blocksize:].mul_(absmax[full])
    out.copy_(values[:out.numel()])


def _span(t: torch.Tensor) -> int:
    """Elements per pass over `t`: CPU_SPAN on a CPU, all of `t` (at least 1) elsewhere."""
    return CPU_SPAN if t.device.type == "cpu" else max(t.numel(), 1)


def pack_nibbles(idx: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..15 [n] -> uint8 [ceil(n/2)]: element 2i high nibble, 2i+1 low.

    An odd count is padded with the code of zero (7), as bitsandbytes does.
    """
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_full((1,), ZERO_CODE)])
    return (idx[0::2] << 4) | idx[1::2]


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [ceil(n/2)] -> uint8 codes [n]."""
    return torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n]


def check_float_dtype(name: str, dtype) -> None:
    """Raise ValueError unless `dtype` is None or a floating-point torch.dtype: dequantizing
    to an integer dtype would truncate every weight to 0 or ±1."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return
    raise ValueError(f"{name} must be a floating-point torch.dtype (e.g. torch.float32) or "
                     f"None, got {dtype!r}")


def check_nested_rounding(nested_rounding) -> None:
    """Raise ValueError unless `nested_rounding` is one of ROUNDINGS ("nearest", "bnb_cpu").
    NF4Config calls it when built, which every entry point that quantizes to NF4 does up
    front, before changing anything."""
    if nested_rounding not in ROUNDINGS:
        raise ValueError(f"nested_rounding must be one of {ROUNDINGS}, got {nested_rounding!r}")


def check_blocksize(blocksize) -> None:
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize!r}")


def expect_tensor(name: str, t, dtype: torch.dtype, numel: int) -> None:
    """Raise ValueError unless `t` is a tensor of `dtype` with `numel` elements."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != numel:
        got = (f"{t.dtype} with {t.numel()} elements" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{name} must be a {dtype} tensor with {numel} elements, got {got}")
