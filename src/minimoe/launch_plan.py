"""How a dot kernel launches on one GPU: which tile list, which `tl.dot` precision, and why.

The dot kernels (`DOT_KERNELS`) have two configuration lists (kernels.configs): 16-bit tiles
sized for tensor cores and float32 tiles for the FMA units. From sm_80 each input dtype gets
its own list, and float32 products are exact ("ieee") unless PyTorch's matmuls may use TF32
(`torch.set_float32_matmul_precision("high")`). Below sm_80 Triton compiles no tensor-core dot,
so every dtype gets the float32 tiles and exact products, and a launch with 16-bit inputs
warns once per device (`device_plan`). The interpreter never asks: it always computes in
float32 (ops._launch).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch

DOT_KERNELS = ("scatter2scatter", "group_bwd_W", "group_bwd_lora")

# Triton has compiled no tensor-core dot below compute capability 8.0 since 3.3, which dropped
# Volta's MMA and lowers every tl.dot there to FMAs on float32 (triton-lang/triton#5066):
# Turing's tensor cores (float16, no bfloat16 or TF32) go unused. The 16-bit tiles, sized
# for tensor cores, then spill thousands of bytes a thread (benchmarks/compile_report.py).
TENSOR_CORES = (8, 0)


class DotPlan(NamedTuple):
    """How a dot kernel launches for one device and input dtype."""

    bits: int              # configuration list (kernels.configs): 16 tensor-core tiles, 32 FMA
    precision: str         # tl.dot's input_precision: "ieee" (exact) | "tf32"
    fallback: str | None   # why the launch is not what the dtype asks for; None when it is


def dot_plan(capability: tuple[int, int], dtype: torch.dtype, tf32: bool = False) -> DotPlan:
    """The launch of a dot kernel (`DOT_KERNELS`) for inputs of `dtype` on a device of compute
    `capability` (major, minor); tf32: PyTorch's matmuls may use TF32
    (`torch.get_float32_matmul_precision() != "highest"`).

    From sm_80: 16-bit inputs on tensor cores with the 16-bit tiles, float32 with the float32
    tiles, exact or TF32. Below (`TENSOR_CORES`) every product is a float32 FMA: the float32
    tiles for every dtype (the kernel widens its 16-bit tiles in registers, and stores in the
    input dtype), and "ieee" (no TF32 there, a permission PyTorch drops the same way)."""
    bits = 32 if dtype == torch.float32 else 16
    if tuple(capability) >= TENSOR_CORES:
        return DotPlan(bits, "tf32" if tf32 and bits == 32 else "ieee", None)
    arch = f"sm_{capability[0]}{capability[1]}"
    if bits == 32:
        why = f"exact float32 products: {arch} has no TF32 tensor cores" if tf32 else None
        return DotPlan(32, "ieee", why)
    name = str(dtype).removeprefix("torch.")
    lacks = (f"{arch} has no bfloat16 tensor cores, and " if dtype == torch.bfloat16
             else f"on {arch} ")
    return DotPlan(32, "ieee", f"{name} products in float32 on the FMA units, with the float32 "
                               f"tiles: {lacks}Triton compiles no tensor-core dot below sm_80")


@functools.cache
def capability(index: int) -> tuple[str, tuple[int, int]]:
    """(name, compute capability) of CUDA device `index`."""
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


@functools.cache
def warn_once(device: str, fallback: str) -> None:
    """Say once per device and fallback (one per dtype) that dot launches fall back, and why."""
    warnings.warn(f"minimoe: {device}: {fallback}. Expect the MoE kernels several times "
                  f"slower than on an sm_80 or later GPU.", stacklevel=2)


def device_plan(device: torch.device, dtype: torch.dtype) -> DotPlan:
    """dot_plan for a CUDA device, warning (once) when 16-bit inputs fall back."""
    name, cc = capability(device.index if device.index is not None else 0)
    plan = dot_plan(cc, dtype, torch.get_float32_matmul_precision() != "highest")
    if plan.fallback and dtype != torch.float32:
        warn_once(name, plan.fallback)
    return plan
