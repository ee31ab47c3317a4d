"""What an NVIDIA GPU compiler makes of a Triton kernel, read on a machine with no GPU.

The triton wheel carries NVIDIA's back end (`ptxas`, `cuobjdump`), so a kernel compiles all
the way to a cubin for any architecture on a laptop CPU. `compile_kernel` does what a launch
on that GPU would do, from the launch's own arguments:

    kernel[grid](*args, **constexprs_and_options)      # on a GPU
    compile_kernel(kernel, args, kwargs, "sm_90")       # here: the same compilation

for any of `ARCHS`: sm_75 (T4), sm_80 (A100), sm_86 (A10G, RTX 30), sm_89 (L4, RTX 40) and
sm_90 (H100).

Triton specializes a launch on its arguments: the element type of each tensor, whether each
pointer is 16-byte aligned and each integer a multiple of 16 (`tt.divisibility`, which is what
lets it vectorise), integers equal to 1 become constants. `compile_kernel` runs Triton's own
binder on `args`, so the report sees the kernel a real launch would get. Tensors may be
stand-ins (`like(torch.bfloat16)`): only the dtype and alignment of a pointer matter.

`read_cubin` then reads the machine code:

- registers per thread and stack bytes (ptxas spills registers to the stack: `spill_bytes`);
- static shared memory, and the theoretical occupancy those allow (`occupancy`, by the
  rule of NVIDIA's occupancy calculator, for sm_75 to sm_90);
- global memory instructions by access width in bits (`LDG.E.U8` = 8, `LDG.E` = 32,
  `LDG.E.128` = 128; the asynchronous copies `LDGSTS` of a pipelined loop count as loads);
- tensor-core instructions: `HMMA` (mma.sync, sm_70 and up) and `HGMMA` (wgmma, sm_90).
  Triton (3.3 and later) emits neither below sm_80: there every `tl.dot` becomes FMAs on
  float32, float16 included, although sm_75's tensor cores take float16.

Works in a process that runs kernels in the interpreter too: an interpreted kernel is
compiled from its Python source (`.fn`), so a notebook can compile the kernel it just ran.
The @triton.jit helpers it calls (`tl.zeros`, `tl.sum`, `tl.cdiv`, a notebook's own) were
interpreted too when triton was imported that way; while it compiles, `compile_kernel` puts
compiled twins of them in their place, and the interpreted ones back afterwards.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# The SMs' limits for occupancy, per architecture (CUDA C++ Programming Guide, "Compute
# Capabilities" table; the allocation rules are those of NVIDIA's occupancy calculator,
# cuda_occupancy.h, which the triton wheel ships in backends/nvidia/include): 32-bit registers,
# resident warps and blocks, shared memory usable by blocks, the shared memory the driver
# reserves per block, and the unit shared memory is allocated in.
SM_LIMITS = {
    "sm_75": dict(registers=65536, warps=32, blocks=16, shared=64 * 1024, reserved=0,
                  shared_unit=256),
    "sm_80": dict(registers=65536, warps=64, blocks=32, shared=164 * 1024, reserved=1024,
                  shared_unit=128),
    "sm_86": dict(registers=65536, warps=48, blocks=16, shared=100 * 1024, reserved=1024,
                  shared_unit=128),
    "sm_89": dict(registers=65536, warps=48, blocks=24, shared=100 * 1024, reserved=1024,
                  shared_unit=128),
    "sm_90": dict(registers=65536, warps=64, blocks=32, shared=228 * 1024, reserved=1024,
                  shared_unit=128),
}
SUB_PARTITIONS = 4         # an SM's register file is 4 banks of 16 384, one per warp scheduler
REGISTER_UNIT = 256        # registers go to a warp in units of 256
MAX_REGISTERS = 255        # per thread: ptxas spills past it
MAX_WARPS_PER_BLOCK = 32   # 1 024 threads
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")   # T4, A100, A10G, L4, H100

_WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


class like:  # noqa: N801  (reads as a value: like(torch.bfloat16))
    """A stand-in for a tensor argument: the binder only asks a pointer's dtype and address."""

    def __init__(self, dtype: torch.dtype, aligned: bool = True):
        self.dtype = dtype
        self._ptr = 0 if aligned else 2

    def data_ptr(self) -> int:
        return self._ptr


@dataclass
class KernelReport:
    """One compiled kernel: what ptxas made of it for one architecture."""

    kernel: str
    arch: str                     # one of ARCHS
    num_warps: int
    num_stages: int
    registers: int                # per thread
    spill_bytes: int              # stack frame per thread: registers ptxas spilled
    shared_bytes: int             # shared memory per block (static + what the launch asks)
    occupancy: float              # resident warps per SM / the most it can hold
    global_loads: dict[str, int] = field(default_factory=dict)   # width in bits -> count
    global_stores: dict[str, int] = field(default_factory=dict)
    local_instructions: int = 0   # LDL/STL: spill traffic in the code
    tensor_core_instructions: int = 0
    compile_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _tools() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _jit(kernel):
    """A compilable JITFunction for `kernel` (an interpreted kernel is rebuilt from its source)."""
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, JITFunction):
        return kernel
    fn = getattr(kernel, "fn", None)
    if fn is None:
        raise ValueError(f"kernel must be a @triton.jit function, got {type(kernel).__name__}")
    return JITFunction(fn)


@contextlib.contextmanager
def _compiled_helpers(fn):
    """While the body runs, every interpreted @triton.jit function `fn` can reach (through its
    globals, triton.language's modules, and theirs in turn) is a compiled JITFunction: the code
    generator can only inline those, and calling an interpreted one from it leaves
    triton.language patched for the interpreter, which breaks every later compile."""
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    spaces = [vars(m) for name, m in list(sys.modules.items())
              if m is not None and name.startswith("triton.language")] + [fn.__globals__]
    swapped, seen = [], set()
    while spaces:
        space = spaces.pop()
        if id(space) in seen:
            continue
        seen.add(id(space))
        for name, value in list(space.items()):
            if isinstance(value, InterpretedFunction):
                swapped.append((space, name, value))
                space[name] = JITFunction(value.fn, **value.kwargs)
                spaces.append(value.fn.__globals__)
    try:
        yield
    finally:
        for space, name, value in reversed(swapped):
            space[name] = value


def _arch_number(arch: str) -> int:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    return int(arch[3:])


def compile_kernel(kernel, args: tuple, kwargs: dict, arch: str = "sm_90"):
    """Compile `kernel` as `kernel[grid](*args, **kwargs)` would on a GPU of `arch`.

    kwargs: the constexprs and launch options (`num_warps`, `num_stages`) of the launch.
    Returns Triton's CompiledKernel (`.asm["cubin"]`, `["ptx"]`, `["ttgir"]`, ...).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = _jit(kernel)
    target = GPUTarget("cuda", _arch_number(arch), 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound,
                                                           specialization, options)
    source = ASTSource(jit, signature, constexprs, attrs)
    with _compiled_helpers(jit.fn):
        return triton.compile(source, target=target, options=options.__dict__)


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = _tools() / "cuobjdump"
    if not tool.exists():
        raise RuntimeError(f"{tool} is missing: this triton wheel has no NVIDIA tools (the "
                           "Linux x86-64 and aarch64 wheels ship them)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([str(tool), *flags, str(path)],
                              capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"cuobjdump {' '.join(flags)} failed: {done.stderr.strip()}")
    return done.stdout


def memory_widths(sass: str, op: str) -> dict[str, int]:
    """Count of `op` instructions (LDG, STG, LDGSTS) in `sass` by access width in bits."""
    widths: Counter = Counter()
    for match in re.finditer(rf"\b{op}(?![A-Z0-9_])((?:\.[A-Z0-9_]+)*)", sass):
        suffixes = match.group(1).split(".")[1:]
        bits = next((_WIDTH[s] for s in suffixes if s in _WIDTH), 32)
        widths[str(bits)] += 1
    return dict(sorted(widths.items(), key=lambda kv: int(kv[0])))


def occupancy(arch: str, registers: int, shared_bytes: int, num_warps: int) -> float:
    """Theoretical occupancy, by NVIDIA's rule (cuda_occupancy.h): resident warps per SM over
    the most an SM holds; 0.0 when one block does not fit.

    Blocks per SM are limited by the block slots, the warp slots, the registers and the shared
    memory. Registers go to a warp in units of 256 (`registers · 32` rounded up), and from one
    of the SM's 4 sub-partitions of 16 384: a sub-partition holds a whole number of warps, so
    97 registers (3 328 a warp) allow 4 · (16 384 // 3 328) = 16 warps, not 65 536 // 3 328 =
    19. A block's shared memory is what it asks plus the driver's reserve, rounded up to the
    allocation unit."""
    if arch not in SM_LIMITS:
        raise ValueError(f"arch must be one of {tuple(SM_LIMITS)}, got {arch!r}")
    lim = SM_LIMITS[arch]
    if not 1 <= num_warps <= MAX_WARPS_PER_BLOCK or registers > MAX_REGISTERS:
        return 0.0
    blocks = min(lim["blocks"], lim["warps"] // num_warps)
    regs_per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    if regs_per_warp:
        warps_per_partition = lim["registers"] // SUB_PARTITIONS // regs_per_warp
        blocks = min(blocks, warps_per_partition * SUB_PARTITIONS // num_warps)
    unit = lim["shared_unit"]
    shared_per_block = -(-(shared_bytes + lim["reserved"]) // unit) * unit
    if shared_per_block:
        blocks = min(blocks, lim["shared"] // shared_per_block)
    return blocks * num_warps / lim["warps"]


def read_cubin(cubin: bytes, arch: str, num_warps: int, dynamic_shared: int = 0) -> dict:
    """Registers, spills, shared memory, occupancy, memory widths and tensor-core counts.

    dynamic_shared: the shared memory the launch asks for besides the cubin's static
    allocation (Triton allocates all of its buffers dynamically: `metadata.shared`)."""
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    shared = found.get("SHARED", 0) + dynamic_shared
    sass = _cuobjdump(cubin, "-sass")
    loads = Counter(memory_widths(sass, "LDG")) + Counter(memory_widths(sass, "LDGSTS"))
    return dict(
        registers=found.get("REG", 0),
        spill_bytes=found.get("STACK", 0) + found.get("LOCAL", 0),
        shared_bytes=shared,
        occupancy=occupancy(arch, found.get("REG", 0), shared, num_warps),
        global_loads=dict(sorted(loads.items(), key=lambda kv: int(kv[0]))),
        global_stores=memory_widths(sass, "STG"),
        local_instructions=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        tensor_core_instructions=len(re.findall(r"\b(?:HMMA|HGMMA)\b", sass)),
    )


def inspect_kernel(kernel, args: tuple, kwargs: dict, arch: str = "sm_90") -> KernelReport:
    """Compile (`compile_kernel`) and read (`read_cubin`) one launch configuration."""
    start = time.perf_counter()
    compiled = compile_kernel(kernel, args, kwargs, arch)
    seconds = time.perf_counter() - start
    num_warps = kwargs.get("num_warps", 4)
    return KernelReport(kernel=_jit(kernel).__name__, arch=arch, num_warps=num_warps,
                        num_stages=kwargs.get("num_stages", 3), compile_s=round(seconds, 2),
                        **read_cubin(compiled.asm["cubin"], arch, num_warps,
                                     compiled.metadata.shared))


# Lab -> {public name: dotted path} of what the lab rebuilds (docs/ARCHITECTURE.md, Lab sources).
REFERENCE = {
    "13-gpu-compiler": {
        "read_cubin": "gpucompile.read_cubin", "memory_widths": "gpucompile.memory_widths",
        "occupancy": "gpucompile.occupancy", "inspect_kernel": "gpucompile.inspect_kernel",
    },
}

__all__ = ["REFERENCE", "ARCHS", "SM_LIMITS", "KernelReport", "compile_kernel", "inspect_kernel",
           "like", "memory_widths", "occupancy", "read_cubin"]
