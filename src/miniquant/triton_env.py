"""Import triton so that the course's kernels can run on any machine.

Without a CUDA device, Triton kernels only run through its interpreter, which must be chosen
before `triton` is imported (`TRITON_INTERPRET=1`; see miniquant/triton_dequant.py for what
that decision can and cannot affect). This module is the one place that makes the choice:
every kernel module (miniquant.triton_dequant, minimoe.kernels) imports `triton` and `tl` from
here, and nothing imports it before Triton code is needed (`import miniquant` does not; its
Triton names load on first access). An explicit `TRITON_INTERPRET` is always respected.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (must follow the TRITON_INTERPRET decision above)
import triton.language as tl  # noqa: E402


def interpreted(kernel) -> bool:
    """Whether a @triton.jit kernel was built for the interpreter (decided at decoration)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def not_on_cuda(name: str, device: torch.device) -> ValueError:
    """The error for a tensor a compiled (CUDA) kernel cannot read."""
    return ValueError(f"{name} is on {device}, but Triton compiles for CUDA here: move it to a "
                      "GPU, or run on CPU with TRITON_INTERPRET=1 set before triton is imported")


__all__ = ["interpreted", "not_on_cuda", "tl", "triton"]
