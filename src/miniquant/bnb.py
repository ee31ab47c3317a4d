"""Convert NF4 weights to and from bitsandbytes' (packed, QuantState) pair.

bitsandbytes is a test dependency, not a runtime one: it is imported inside the functions,
so `import miniquant` works without it. The bytes need no conversion (our packed layout is
theirs); only the container differs: they shape the packed codes [ceil(n/2), 1] and keep
the scales in a `QuantState`, nested in a second QuantState under double quantization.

`quiet_bitsandbytes()` drops, at its logger, the one warning bitsandbytes 0.50 logs at import
on a CPU with AVX512-BF16 ("Failed to load CPU gemm_4bit_forward from kernels-community"):
it looks for an optional package of faster CPU kernels that nothing here needs. `to_bnb`
calls it before importing bitsandbytes; so does the kernel of `make check` (course.quiet).
"""

from __future__ import annotations

import logging

import torch

from .dynamic import DYNAMIC_CODE
from .nf4 import NESTED_BLOCKSIZE, NF4_CODE, NF4Weight

CPU_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"
CPU_KERNEL_WARNING = "Failed to load CPU gemm_4bit_forward"


class _NoCpuKernelWarning(logging.Filter):
    """Drops the record that starts with CPU_KERNEL_WARNING; passes every other one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CPU_KERNEL_WARNING)


_NO_CPU_KERNEL_WARNING = _NoCpuKernelWarning()


def quiet_bitsandbytes() -> None:
    """Drop bitsandbytes' warning about its optional CPU kernel package (see the module
    docstring); call it before bitsandbytes is imported. Adding it twice is a no-op."""
    logging.getLogger(CPU_KERNEL_LOGGER).addFilter(_NO_CPU_KERNEL_WARNING)


def to_bnb(q: NF4Weight):
    """(packed uint8 [ceil(n/2), 1], bitsandbytes QuantState) holding the same codes and scales.

    `bitsandbytes.functional.dequantize_4bit(*to_bnb(q))` dequantizes it with their kernels.
    """
    quiet_bitsandbytes()
    from bitsandbytes.functional import QuantState

    common = dict(shape=q.shape, dtype=q.dtype, blocksize=q.blocksize, quant_type="nf4",
                  code=NF4_CODE.to(q.device))
    if not q.double_quant:
        state = QuantState(absmax=q.block_absmax, **common)
    else:
        nested = QuantState(absmax=q.absmax_scales, code=DYNAMIC_CODE.to(q.device),
                            blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        state = QuantState(absmax=q.absmax_codes, offset=q.absmax_offset, state2=nested,
                           **common)
    return q.packed.reshape(-1, 1), state


def from_bnb(packed: torch.Tensor, quant_state) -> NF4Weight:
    """The NF4Weight holding what bitsandbytes' `quantize_4bit(..., quant_type="nf4")` made.

    Raises ValueError for a state we cannot hold: not NF4, a missing shape, a 4-bit or
    nested code table other than ours, or a nested blocksize other than 256.
    """
    if quant_state.quant_type != "nf4":
        raise ValueError(f"quant_state.quant_type must be 'nf4', got {quant_state.quant_type!r}")
    if quant_state.shape is None:
        raise ValueError("quant_state.shape must be set (the original weight's shape), got None")
    expect_code("quant_state.code", quant_state.code, NF4_CODE)
    bytes_ = packed.contiguous().reshape(-1)
    if bytes_.dtype != torch.uint8:
        bytes_ = bytes_.view(torch.uint8)
    common = (bytes_, quant_state.shape, quant_state.dtype, quant_state.blocksize)
    if not quant_state.nested:
        return NF4Weight(*common, block_absmax=quant_state.absmax)
    nested = quant_state.state2
    if nested.blocksize != NESTED_BLOCKSIZE:
        raise ValueError(f"quant_state.state2.blocksize must be {NESTED_BLOCKSIZE}, "
                         f"got {nested.blocksize}")
    expect_code("quant_state.state2.code", nested.code, DYNAMIC_CODE)
    offset = torch.as_tensor(quant_state.offset, dtype=torch.float32,
                             device=bytes_.device).reshape(())
    return NF4Weight(*common, absmax_codes=quant_state.absmax, absmax_scales=nested.absmax,
                     absmax_offset=offset)


def expect_code(name: str, code: torch.Tensor | None, ours: torch.Tensor) -> None:
    """Raise ValueError unless `code` (when given) is our table, value for value."""
    if code is not None and not torch.equal(code.detach().float().cpu(), ours):
        raise ValueError(f"{name} must equal miniquant's table ({ours.numel()} values), "
                         f"got a different one")
