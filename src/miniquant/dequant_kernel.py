"""The Triton kernel of NF4 dequantization (private: launch it through `triton_dequant.py`,
whose docstring has the algorithm as pseudocode and the reasons behind its builtins-only body).

Importing this module imports triton (through `miniquant.triton_env`, which chooses the
interpreter first on a machine without CUDA); `triton_dequant` imports it at the first launch.
"""

from __future__ import annotations

from .triton_env import interpreted, tl, triton


@triton.jit
def _nf4_dequant_kernel(
    packed_ptr,  # *uint8, flat: 2 codes per byte, element 2i in the high nibble of byte i
    absmax_ptr,  # *float32, flat: one scale per BLOCKSIZE consecutive elements
    code_ptr,  # *float32 [16]: the NF4 levels, indexed by the 4-bit code
    src_ptr,  # *int64 [n_rows]: the stored segment (expert) each output row reads; if GATHER
    out_ptr,  # *float32 | *float16 | *bfloat16 [n_rows, seg_numel], contiguous
    seg_numel,  # M: elements per segment (the whole tensor, or one expert; even if GATHER)
    seg_bytes,  # ceil(M / 2): packed bytes per segment (its own argument: see below)
    BLOCKSIZE: tl.constexpr,  # elements per scale; constexpr so that // is a shift
    BYTES: tl.constexpr,  # packed bytes per program (a power of two); it writes 2*BYTES values
    GATHER: tl.constexpr,  # True: segment = src[row]; False: segment = row (the one row, 0)
    SCALES_BY_ROW: tl.constexpr,  # True: row r's scales sit at r * M/BLOCKSIZE (compacted)
    BF16_BY_HAND: tl.constexpr,  # True: bf16 output rounded with integer ops (interpreter only)
):
    tile = tl.program_id(0).to(tl.int64)  # int64: an expert stack can pass 2**31 elements
    row = tl.program_id(1).to(tl.int64)
    if GATHER:
        seg = tl.load(src_ptr + row).to(tl.int64)
    else:
        seg = row
    if SCALES_BY_ROW:
        scale_seg = row
    else:
        scale_seg = seg

    # The tile as SCALES rows of one block each (ROW elements, ROW // 2 bytes): tiles start on
    # a block, since 2*BYTES is a multiple of BLOCKSIZE, or a block holds whole tiles
    # (BLOCKSIZE > 2*BYTES: one row, one scale).
    SCALES: tl.constexpr = (2 * BYTES + BLOCKSIZE - 1) // BLOCKSIZE
    ROW: tl.constexpr = 2 * BYTES // SCALES
    rows = tl.arange(0, SCALES)

    # [SCALES, ROW // 2] byte offsets inside the segment; M is even whenever seg > 0, so
    # segment seg starts at byte seg * seg_bytes. The bound is an argument rather than
    # (M + 1) // 2 because Triton vectorises a masked load only if it can prove the mask
    # constant over a vector: an argument that is a multiple of 16 is specialized as such at
    # launch, M + 1 is not.
    k = tile * BYTES + rows[:, None] * (ROW // 2) + tl.arange(0, ROW // 2)[None, :]
    b = tl.load(packed_ptr + seg * seg_bytes + k, mask=k < seg_bytes, other=0)

    # [SCALES, ROW] codes in element order: join makes [SCALES, ROW // 2, 2] (high, low) pairs
    # and the row-major reshape lays them out hi0, lo0, hi1, lo1, ... This is what
    # tl.interleave does, but join and reshape are builtins (triton_dequant.py says why).
    idx = tl.reshape(tl.join(b >> 4, b & 15), [SCALES, ROW]).to(tl.int32)

    # [SCALES, ROW] element offsets inside the segment; an odd M's pad nibble lands on j == M.
    j = tile * (2 * BYTES) + rows[:, None] * ROW + tl.arange(0, ROW)[None, :]
    in_seg = j < seg_numel

    # The table is 64 bytes: these gathers stay in L1. idx is in [0, 16) even where masked.
    level = tl.load(code_ptr + idx)
    # [SCALES]: one load per block. Segments are whole blocks (or seg = 0), so the segment's
    # first block plus the tile's; a block is in the segment if its first element is.
    block = (scale_seg * seg_numel) // BLOCKSIZE + (tile * (2 * BYTES)) // BLOCKSIZE + rows
    first = tile * (2 * BYTES) + rows * ROW
    scale = tl.load(absmax_ptr + block, mask=first < seg_numel, other=0.0)

    # One float32 multiply, exactly the reference's; rounded once (to nearest even) at the store.
    w = level * scale[:, None]
    if BF16_BY_HAND:
        # Round float32 -> bfloat16 to nearest even on the bits: add 0x7FFF plus the lowest
        # kept bit, keep the high 16 bits (a carry into the exponent is the right answer).
        bits = w.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = w.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * seg_numel + j, y, mask=in_seg)


def interpreting() -> bool:
    """Whether the kernel was built for the interpreter (decided when this module loaded)."""
    return interpreted(_nf4_dequant_kernel)
