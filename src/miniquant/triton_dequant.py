"""Triton NF4 dequantization: the whole weight, or only the experts a batch routed to (Lab 03).

This module checks, allocates and launches; the kernel itself is in dequant_kernel.py, which
imports triton and is imported at the first launch, so that this module (and with it
`NF4Experts`' PyTorch path, `selective_dequantize_nf4_torch`) works without triton. There a
launch raises `triton_env.TritonUnavailableError`. The kernel itself lives in
`dequant_kernel.py`, read from there at each launch, so that a lab's swap of it is seen.

An `NF4Weight` of n elements holds `packed` (ceil(n/2) uint8, bitsandbytes' order: element 2i
in the high nibble of byte i, element 2i+1 in the low nibble, an odd count padded) and one
float32 scale (`absmax`) per block of `blocksize` consecutive row-major elements:

    w[j] = NF4_CODE[code(j)] * absmax[j // blocksize]          (in float32, then cast)

The kernel, one program per tile of BYTES packed bytes of one output row of M elements:

    # grid = (cdiv(ceil(M / 2), BYTES), n_rows)
    row   = program_id(1)
    seg   = src[row] if GATHER else row             # which stored segment (expert) to read
    k     = tile * BYTES + arange(BYTES)            # byte offsets inside the segment
    b     = load(packed + seg * (M // 2) + k)       # BYTES bytes, one contiguous read
    idx   = interleave(b >> 4, b & 15)              # 2*BYTES codes, in element order
    j     = tile * 2*BYTES + arange(2*BYTES)        # element offsets inside the segment,
                                                    # held as [SCALES, ROW]: one block a row
    sseg  = row if SCALES_BY_ROW else seg           # where this row's scales sit
    s     = load(absmax + (sseg * M + j[:, 0]) // BLOCKSIZE)    # [SCALES]: one load a block
    out[row, j] = (code[idx] * s[:, None]).to(out dtype)        # masked: j < M

A tile starts on a block (2*BYTES is a multiple of BLOCKSIZE) or lies inside one (BLOCKSIZE
4096 > 2*BYTES): SCALES = ceil(2*BYTES / BLOCKSIZE) blocks of ROW = 2*BYTES / SCALES elements.

`triton_dequantize_nf4` is the one-row case (M = n, seg = 0). `selective_dequantize_nf4` of
an `[E, out, in]` weight sets M = out * in and reads, for output row r, expert `active[r]`
only: its M/2 packed bytes and its M/blocksize scales (M must be a multiple of blocksize, so
no block belongs to two experts). Without double quantization the kernel reads those scales
in place from `block_absmax`. With double quantization each scale is stored as an 8-bit code
(plus one float32 per 256 codes and an offset); `_expert_scales` then dequantizes, in
PyTorch, only the codes of the listed experts, into a compact vector ordered like `active`
(SCALES_BY_ROW), instead of the whole `.absmax`. It reads the listed experts' codes, the
float32 nested scales of the 256-code groups those codes fall in (a group can straddle two
experts, so a neighbour's group scale may be read, never its codes) and the offset.

Running on a CPU: the Triton interpreter. `triton.jit` decides at *decoration* time whether
a function becomes a compiled `JITFunction` or an `InterpretedFunction`, by reading
`triton.knobs.runtime.interpret`, which (triton 3.x) reads the environment variable
`TRITON_INTERPRET` at each access. So `miniquant.triton_env` (where the kernel module gets
triton) sets `TRITON_INTERPRET=1` when no CUDA device is present and the variable is unset,
before it imports triton, and the kernel is interpreted even if triton was imported earlier by
something else. What that cannot fix: the helpers in `triton.language.standard`
(`tl.interleave`, `tl.cdiv`, `tl.sum`, `tl.sigmoid`, ...) are themselves `@triton.jit`
functions, decorated when triton was first imported; if that happened with the variable
unset they stay compiled, and calling one from an interpreted kernel fails with "Cannot call
@triton.jit'd outside of the scope of a kernel" (seen with triton 3.9). The kernel therefore
uses builtins only (`tl.join` + `tl.reshape` rather than `tl.interleave`), and
runs whichever module imported triton first; the tests check this in a fresh process. An
explicit `TRITON_INTERPRET` (0 or 1) is always respected; note that setting it affects every
kernel decorated afterwards in the process, which on a machine without CUDA is the only way
they can run at all. The interpreter computes with NumPy: the arithmetic stays in float32
and only the store casts. fp16 stores round correctly there, but its float32 -> bfloat16
conversion truncates (triton 3.9 passes it no rounding mode), which leaves about half of the
values one bf16 ulp off; in the interpreter the kernel therefore rounds to nearest even with
integer operations on the bits (BF16_BY_HAND), and a compiled kernel uses the hardware
conversion.
"""

from __future__ import annotations

import functools
import importlib

import torch

from .dynamic import DYNAMIC_CODE
from .nf4 import NESTED_BLOCKSIZE, NF4_CODE, NF4_DTYPES, NF4Weight
from .triton_env import not_on_cuda

__all__ = ["selective_dequantize_nf4", "triton_dequantize_nf4"]

# Packed bytes per program (2 * BYTES outputs). On a GPU, 1024 bytes over 4 warps is 8 bytes
# in and 16 values out per thread: wide, coalesced loads and stores. In the interpreter the
# cost is per program, so large tiles are also the fast choice there.
BYTES_PER_PROGRAM = 1024
NUM_WARPS = 4


# Why the levels come from a tensor in memory rather than a constexpr chain of 15 tl.where
# selects: they then live in one place (`NF4_CODE`, bit-exact with bitsandbytes) instead of
# being retyped as Python float literals, the same kernel serves any 16-level code (FP4), and
# in a kernel bound by DRAM bandwidth a 16-entry gather from L1 costs no more than the selects.
@functools.cache
def _on_device(table: str, device: torch.device) -> torch.Tensor:
    """NF4_CODE or DYNAMIC_CODE on `device`, copied once (a host-to-device copy per call would
    cost more than the kernel on small weights)."""
    source = NF4_CODE if table == "nf4" else DYNAMIC_CODE
    return source.to(device=device, dtype=torch.float32).contiguous()


@functools.cache
def _kernel_module():
    """miniquant.dequant_kernel, imported at the first launch: that imports triton (choosing
    the interpreter without CUDA), or raises TritonUnavailableError without it (not cached)."""
    return importlib.import_module(".dequant_kernel", __package__)


def _interpreting() -> bool:
    """Whether our kernel was built for the interpreter (decided when it was first loaded)."""
    return _kernel_module().interpreting()


def _check_weight(q, name: str, dtype: torch.dtype | None, kernel: bool = True) -> torch.dtype:
    """Validate the NF4Weight (on a device the kernel can run on, if `kernel`) and the output
    dtype; return the dtype to produce."""
    if not isinstance(q, NF4Weight):
        raise ValueError(f"{name} must be an NF4Weight, got {type(q).__name__}")
    if kernel and q.packed.device.type != "cuda" and not _interpreting():
        raise not_on_cuda(name, q.packed.device)
    dtype = q.dtype if dtype is None else dtype
    if dtype not in NF4_DTYPES:
        raise ValueError(f"dtype must be one of {NF4_DTYPES}, got {dtype}")
    return dtype


def _launch(q, scales, src, out, seg_numel, gather, scales_by_row):
    """Run the kernel over out's rows ([n_rows, seg_numel] view); see the module docstring."""
    packed = q.packed.reshape(-1).contiguous()
    seg_bytes = (seg_numel + 1) // 2
    grid = (-(-seg_bytes // BYTES_PER_PROGRAM), out.shape[0])             # cdiv: byte tiles
    _kernel_module()._nf4_dequant_kernel[grid](
        packed,
        scales,
        _on_device("nf4", packed.device),
        src,
        out,
        seg_numel,
        seg_bytes,
        BLOCKSIZE=q.blocksize,
        BYTES=BYTES_PER_PROGRAM,
        GATHER=gather,
        SCALES_BY_ROW=scales_by_row,
        BF16_BY_HAND=out.dtype == torch.bfloat16 and _interpreting(),
        num_warps=NUM_WARPS,
    )


def triton_dequantize_nf4(q: NF4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize `q` with one Triton kernel: a tensor of `q.shape` in `dtype` (default
    `q.dtype`), bit-identical to `dequantize_nf4(q, dtype)` (float32 product, then cast).

    With double quantization `q.absmax` first dequantizes the scales (PyTorch, a vector
    1/blocksize the size of the weight).
    """
    dtype = _check_weight(q, "q", dtype)
    n = q.numel
    scales = q.absmax.to(q.packed.device).reshape(-1).contiguous()
    out = torch.empty(tuple(q.shape), dtype=dtype, device=q.packed.device)
    # src is never read when GATHER is False (a constexpr branch): any tensor will do.
    _launch(q, scales, q.packed, out.view(1, n), n, gather=False, scales_by_row=False)
    return out


def _expert_scales(q: NF4Weight, ids: torch.Tensor, blocks_per_expert: int) -> torch.Tensor:
    """float32 [len(ids) * blocks_per_expert]: the double-quantized scales of experts `ids`,
    in that order, bit-identical to the same entries of `q.absmax`.

    Same float32 operations as `q.absmax` (dynamic-map level times the 256-block group's
    scale, then plus the offset), on the listed experts' blocks only.
    """
    blocks = (ids[:, None] * blocks_per_expert + torch.arange(blocks_per_expert, device=ids.device))
    blocks = blocks.reshape(-1)
    levels = _on_device("dynamic", ids.device)[q.absmax_codes.reshape(-1)[blocks].long()]
    centred = levels * q.absmax_scales.reshape(-1)[blocks // NESTED_BLOCKSIZE]
    return (centred + q.absmax_offset.reshape(-1)).contiguous()


def _check_selective(q_experts: NF4Weight, active, dtype, kernel: bool
                     ) -> tuple[torch.dtype, int]:
    """Validate selective-dequant arguments -> (output dtype, elements per expert)."""
    dtype = _check_weight(q_experts, "q_experts", dtype, kernel)
    shape = tuple(q_experts.shape)
    if len(shape) != 3:
        raise ValueError(f"q_experts must have shape [E, out, in], got {shape}")
    n_experts, d_out, d_in = shape
    expert_numel = d_out * d_in
    if expert_numel % q_experts.blocksize:
        raise ValueError(
            f"q_experts: each expert's out*in = {expert_numel} elements must be a multiple of "
            f"the blocksize {q_experts.blocksize}, so that no block is shared by two experts"
        )
    if not isinstance(active, torch.Tensor) or active.dim() != 1:
        raise ValueError("active must be a 1-D tensor of expert ids")
    if active.dtype.is_floating_point or active.dtype.is_complex or active.dtype == torch.bool:
        raise ValueError(f"active must hold integer expert ids, got {active.dtype}")
    if active.numel() and (int(active.min()) < 0 or int(active.max()) >= n_experts):
        raise ValueError(f"active ids must lie in [0, {n_experts}), got {active.tolist()}")
    return dtype, expert_numel


def _active_scales(q_experts: NF4Weight, ids: torch.Tensor, expert_numel: int) -> torch.Tensor:
    """float32 [len(ids) · blocks per expert]: the listed experts' absmax, in that order."""
    blocks_per_expert = expert_numel // q_experts.blocksize
    if q_experts.double_quant:
        return _expert_scales(q_experts, ids, blocks_per_expert)
    return q_experts.block_absmax.view(-1, blocks_per_expert)[ids].reshape(-1)


def selective_dequantize_nf4(
    q_experts: NF4Weight, active: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Dequantize only experts `active` of an `[E, out, in]` NF4 weight.

    Returns `[len(active), out, in]` in `dtype` (default `q_experts.dtype`) whose row r is
    expert `active[r]` (repeats allowed, order kept): bit-identical to
    `dequantize_nf4(q_experts, dtype)[active]`, while reading only those experts' packed
    bytes and scales. Each expert's out*in elements must be a whole number of blocks.
    """
    dtype, expert_numel = _check_selective(q_experts, active, dtype, kernel=True)
    _, d_out, d_in = q_experts.shape
    device = q_experts.packed.device
    out = torch.empty((active.numel(), d_out, d_in), dtype=dtype, device=device)
    if active.numel() == 0:
        return out
    ids = active.to(device=device, dtype=torch.int64).contiguous()
    if q_experts.double_quant:
        scales = _active_scales(q_experts, ids, expert_numel)
        by_row = True
    else:
        scales = q_experts.block_absmax.reshape(-1).contiguous()  # read in place, listed only
        by_row = False
    rows = out.view(active.numel(), expert_numel)
    _launch(q_experts, scales, ids, rows, expert_numel, gather=True, scales_by_row=by_row)
    return out


def selective_dequantize_nf4_torch(
    q_experts: NF4Weight, active: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`selective_dequantize_nf4` in plain PyTorch (no Triton): the same result, bit for bit,
    reading only the listed experts' bytes and scales. The fast path on a CPU, where the
    kernel runs in the interpreter."""
    dtype, expert_numel = _check_selective(q_experts, active, dtype, kernel=False)
    n_experts, d_out, d_in = q_experts.shape
    device = q_experts.packed.device
    ids = active.to(device=device, dtype=torch.int64)
    # A whole number of (even-sized) blocks per expert: expert e owns bytes e·numel/2 ...
    packed = q_experts.packed.view(n_experts, expert_numel // 2)[ids]           # [n, numel/2]
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1)                   # high first
    blocks = expert_numel // q_experts.blocksize
    scales = _active_scales(q_experts, ids, expert_numel).view(ids.numel(), blocks)
    values = _on_device("nf4", device)[codes.int()].view(ids.numel(), blocks,
                                                         q_experts.blocksize)
    # In place: one float32 buffer of the active experts, as the kernel writes.
    return values.mul_(scales[..., None]).reshape(ids.numel(), d_out, d_in).to(dtype)
