# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 13 — What the GPU compiler made of your kernel
#
# In Labs 03, 08, 09 and 12 you wrote Triton kernels and ran them, most likely in the
# interpreter: that proves they compute the right numbers, and says nothing about how fast they
# would be on a GPU. Speed is decided by what the compiler makes of the kernel for one
# particular GPU: how many **registers** each thread needs (and whether some had to **spill**
# to memory), how **wide** each load and store is, whether the matrix products run on the
# **tensor cores**. You can read all of that without a GPU. The `triton` wheel carries
# NVIDIA's own back end (`ptxas`, which turns PTX into machine code, and `cuobjdump`, which
# prints it), so your laptop can compile a kernel for an H100 exactly as a launch on an H100
# would, and show you the machine code.
#
# | # | you write | checked against |
# |---|---|---|
# | 1 | `read_sass(sass)`: global loads and stores by width, spill instructions, tensor-core instructions | the SASS of real cubins, instruction by instruction |
# | 2 | `read_usage(text)` and `my_occupancy(registers, shared_bytes, num_warps, arch)` | `cuobjdump --dump-resource-usage`; NVIDIA's occupancy calculator, on five GPUs |
# | 3 | `largest_tile_without_spills(dtype, arch, candidates)` | the compiler, at other dtypes and GPUs |
# | 4 | `dot_instruction(dtype, precision, arch)`: HGMMA, HMMA or FFMA? | the compiler |
# | 5 | `transpose_kernel`: correct, **and** every global load and store 128 bits wide on an H100 | the interpreter, then the compiler |
# | 6 | `matmul_cost(...)` and `roofline_time(...)`: the time a kernel cannot beat | hand-computed answers from the datasheets |
#
# **No GPU needed.** As in the other kernel labs, the setup cell sets `TRITON_INTERPRET=1`
# before `import triton` when there is no CUDA GPU, so your kernels *run* in the interpreter
# (on a GPU they run compiled). `gpucompile` *compiles* them as well, for a GPU you need not
# have: `compile_kernel(kernel, args, kwargs, arch)` does what `kernel[grid](*args, **kwargs)`
# does on a GPU of architecture `arch`, one of `gpucompile.ARCHS` (from `"sm_75"`, a T4, to
# `"sm_90"`, an H100: Part A says which is which), and returns Triton's compiled kernel with
# its PTX and its cubin. The tile sweep of Part B prints how long each compile took.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification —
# the SASS of other kernels and GPUs, other dtypes and tile lists, your kernel at other sizes —
# and checks that Exercises 1 and 2 do their own reading: `gpucompile`'s readers
# (`read_cubin`, `memory_widths`, `occupancy`, `inspect_kernel`) raise if your code reaches them
# there. From Exercise 3 on, `inspect_kernel` is yours to use as a tool. Each exercise states
# its specification first; below it, two collapsed hints (the idea, then pseudocode) are there
# when you want them. The whole notebook
# runs in <!-- runtime:13-gpu-compiler -->about 17 s (the solution, measured on a 2-core CPU)<!-- /runtime -->, nearly all of it in the compiler and the
# disassembler; its last cell prints how long your run took.

# %%
# Colab only (anywhere else this cell does nothing): fetch the course, install what Colab
# lacks while keeping its torch (scripts/hosted.py says what and why), import from the clone.
import sys

if "google.colab" in sys.modules:
    import os
    import subprocess

    if not os.path.isdir("/content/miniqlora-moe-labs"):
        subprocess.run(["git", "clone", "--depth", "1", "https://github.com/miniqlora-moe/miniqlora-moe-labs", "/content/miniqlora-moe-labs"], check=True)
    subprocess.run([sys.executable, "/content/miniqlora-moe-labs/scripts/hosted.py"], check=True)
    sys.path.insert(0, "/content/miniqlora-moe-labs/src")
    os.chdir("/content/miniqlora-moe-labs")

# %%
import functools
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from course.notebook.harness import require_triton  # noqa: E402

require_triton("13-gpu-compiler")   # no triton (its wheels are Linux-only): say where to run

# The interpreter must be chosen before triton is imported (see Lab 03): @triton.jit decides
# at decoration time whether a function is compiled or interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep Triton's default (fused multiply-adds) and silence its notice that the default changes.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import matplotlib.pyplot as plt  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402

import gpucompile  # noqa: E402
from course.notebook import harness  # noqa: E402
from gpucompile import compile_kernel, inspect_kernel, like  # noqa: E402

INTERPRET, DEVICE = harness.triton_setup()   # one CPU thread, seed 0, and where kernels run
STARTED = time.perf_counter()

# %% [markdown]
# ## Part A — from a kernel to machine code, on a laptop
#
# A Triton kernel goes down a chain of languages, each one closer to the hardware:
#
# ```
# Python (@triton.jit) -> Triton IR -> Triton GPU IR (layouts: which thread holds what)
#     -> LLVM IR -> PTX (NVIDIA's virtual ISA) --ptxas--> cubin: SASS, the GPU's machine code
# ```
#
# Registers, spills and the real instructions only exist after `ptxas`, so that is where we
# look. `compile_kernel` takes exactly what a launch takes, minus the grid: the arguments and
# the constexprs and options (`num_warps`). It does not need the tensors' data, only what
# a launch **specializes** on: each tensor's dtype and whether its address is 16-byte aligned,
# and each integer's value class — equal to 1 (then a constant), a multiple of 16, or
# anything else. So a stand-in `like(torch.float32)` can play a 64 MiB tensor.
#
# ### Which GPU: `ARCH`
#
# The machine code is made for one architecture, which NVIDIA names `sm_XY` after the GPU's
# compute capability. These are the five `gpucompile` targets, the GPUs you are likely to
# meet:
#
# | `arch` | GPUs | what its code can use |
# |---|---|---|
# | `sm_75` (Turing) | T4 (Colab's free GPU), RTX 20 | no bfloat16 in hardware; tensor cores for float16, but Triton gives `tl.dot` none here (Part C) |
# | `sm_80` (Ampere) | A100 | tensor cores for float16, bfloat16 and TF32 (`HMMA`); asynchronous copies into shared memory (`LDGSTS`) |
# | `sm_86` (Ampere) | A10G, RTX 30 | the same instructions as `sm_80`, on a smaller SM |
# | `sm_89` (Ada) | L4, RTX 40 | as `sm_86`, plus float8 tensor cores |
# | `sm_90` (Hopper) | H100, H200 | as `sm_80`, plus the warpgroup tensor cores (`wgmma`: `HGMMA`) |
#
# Every one of them has 65 536 registers per SM; how many warps an SM holds and how much shared
# memory it gives its blocks differ (Part B's table, `gpucompile.SM_LIMITS`). The cell below
# sets `ARCH` to the architecture of the GPU this notebook runs on, and where there is none to
# `"sm_80"`, an A100, the GPU of most figures the text and the guide quote. The cells that
# explore compile for `ARCH`: change it to look at another GPU. The graded tests name their
# own architectures, and do not depend on it.

# %%
ARCH = harness.gpu_arch() or "sm_80"      # this machine's GPU, else an A100
if ARCH not in gpucompile.ARCHS:          # a GPU older or newer than the five
    print(f"gpucompile has no target {ARCH} (it has {', '.join(gpucompile.ARCHS)}): using sm_80")
    ARCH = "sm_80"
_lim = gpucompile.SM_LIMITS[ARCH]
print(f"ARCH = {ARCH!r}: {_lim['warps']} resident warps and {_lim['shared'] // 1024} KiB of "
      "shared memory per SM")

# %% [markdown]
# Here is the simplest kernel there is, `out = alpha · x`, run to check it (in the interpreter,
# or compiled on your GPU), then compiled for `ARCH` as it would be launched on 4 096 elements.

# %%
@triton.jit
def scale_kernel(x_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, alpha * x, mask=mask)


_x = torch.randn(3000, device=DEVICE)
_out = torch.empty_like(_x)
scale_kernel[(triton.cdiv(3000, 1024),)](_x, _out, 2.0, 3000, BLOCK=1024)
print(f"run on {DEVICE}: out == 2·x:", torch.equal(_out, 2.0 * _x))

F32 = like(torch.float32)
compiled = compile_kernel(scale_kernel, (F32, F32, 2.0, 4096), dict(BLOCK=1024), ARCH)
print("what the compiler kept:", sorted(compiled.asm))
print("\nthe PTX loads and stores:")
for line in compiled.asm["ptx"].splitlines():
    if "ld.global" in line or "st.global" in line:
        print("   ", line.strip())

# %% [markdown]
# `ld.global.v4.b32` is **one** instruction that loads four 32-bit values: 16 bytes, 128 bits.
# The PTX is not yet machine code, though. `ptxas` made the cubin; `cuobjdump -sass` prints its
# instructions, and `cuobjdump --dump-resource-usage` what each thread needs. Both programs
# sit in the triton wheel, next to `ptxas`. Disassembling is the slow step (`cuobjdump` starts
# NVIDIA's disassembler afresh for every cubin, however small), and the same cubin always
# prints the same text, so `cuobjdump` below remembers what it printed for each cubin: the
# notebook and its tests ask for many of them twice.

# %%
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@functools.lru_cache(maxsize=256)
def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What NVIDIA's cuobjdump prints for a cubin: `-sass` (the machine code) or
    `--dump-resource-usage` (registers, stack, shared memory per thread and block)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(CUOBJDUMP), *flags, str(path)], capture_output=True,
                              text=True, check=True, timeout=60).stdout


def sass_of(kernel, args, kwargs, arch="sm_90") -> str:
    """The SASS of `kernel` compiled as `kernel[grid](*args, **kwargs)` on a GPU of `arch`."""
    return cuobjdump(compile_kernel(kernel, args, kwargs, arch).asm["cubin"], "-sass")


def tally(sass: str, *opcodes: str) -> dict[str, int]:
    """{opcode with its modifiers: count} of the instructions whose opcode is in `opcodes`."""
    found = {}
    for line in sass.splitlines():
        words = line.split("*/", 1)[-1].split(";")[0].split()
        if words and words[0].startswith("@"):            # a guard: @P0, @!P1, @!PT ...
            words = words[1:]
        if words and words[0].split(".")[0] in opcodes:
            found[words[0]] = found.get(words[0], 0) + 1
    return found


def show(sass: str, *opcodes: str) -> None:
    """Print the instructions (guard, opcode, operands) whose opcode is in `opcodes`."""
    for line in sass.splitlines():
        code = line.split("*/", 1)[-1].split(";")[0].strip()
        words = code.split()
        if words and words[words[0].startswith("@")].split(".")[0] in opcodes:
            print("   ", code)


sass = cuobjdump(compiled.asm["cubin"], "-sass")
print("\n".join(sass.splitlines()[:12]))
print("   ...\nits global loads and stores, n = 4096:")
show(sass, "LDG", "STG")
print(cuobjdump(compiled.asm["cubin"], "--dump-resource-usage").strip())

# %% [markdown]
# How to read a SASS line:
#
# ```
#         /*0130*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;     /* 0x0000000402048981 */
#         address               guard opcode.modifiers  operands            encoding
# ```
#
# * The **guard** `@P0` / `@!P0` (a predicate register, `PT` is always true, `UP0` a uniform
#   one) makes the instruction conditional: that is how a mask becomes machine code.
# * The **opcode** comes first, its **modifiers** after dots. `LDG` loads from global memory,
#   `STG` stores to it; the width is a modifier: none = 32 bits, `.64`, `.128`, and `.U8`,
#   `.S8`, `.U16`, `.S16` for 8- and 16-bit values (unsigned or sign-extended). `.E` says the
#   address is 64-bit, `.CONSTANT`, `.EF`, `.LTC128B`, ... are caching hints, and `.SYS`
#   (which `sm_75` code spells out) the scope of the access.
# * `LDGSTS` (sm_80 and later) copies global memory straight into shared memory,
#   asynchronously: a pipelined loop's loads (`num_stages`) become these; they count as global
#   loads. `LDGDEPBAR` and `DEPBAR` only wait for them: **not** loads.
# * `LDS`/`STS`/`LDSM` touch shared memory, `LDC`/`ULDC` the constant bank (where the kernel's
#   arguments live): neither is global memory.
# * `LDL`/`STL` move data between registers and **local** memory: a per-thread stack in DRAM
#   (cached). In Triton code they mean that `ptxas` ran out of registers and **spilled**.
# * `HMMA` (the warp-wide `mma.sync`, which tensor cores have run since sm_70, Volta) and
#   `HGMMA` (the warpgroup `wgmma` of sm_90) are the **tensor cores**; `FFMA` is one fused
#   float32 multiply-add on the ordinary cores.
#
# Each thread of the `n = 4096` kernel above does two 128-bit loads and two 128-bit stores:
# 1 024 elements per program over 4 warps × 32 threads = 8 floats a thread, 32 bytes, loaded
# 16 bytes at a time. Change one thing at a time and the widths move:

# %%
U8, F16 = like(torch.uint8), like(torch.float16)
_cases = [("float32, n = 4096, BLOCK = 1024", F32, 4096, 1024),
          ("float32, n = 1000 (not a multiple of 16)", F32, 1000, 1024),
          ("float32, n = 4096, BLOCK = 256", F32, 4096, 256),
          ("float16, n = 4096, BLOCK = 1024", F16, 4096, 1024),
          ("float16, x = t[1:] (2 bytes past 16-byte alignment)",
           like(torch.float16, aligned=False), 4096, 1024),
          ("uint8,   n = 4096, BLOCK = 1024", U8, 4096, 1024),
          ("uint8,   n = 4096, BLOCK = 2048", U8, 4096, 2048)]
print(f"{'scale_kernel on ' + ARCH + ', 4 warps':<54} global loads, stores")
for _what, _t, _n, _block in _cases:
    _sass = sass_of(scale_kernel, (_t, _t, 2.0, _n), dict(BLOCK=_block), ARCH)
    _counts = {**tally(_sass, "LDG"), **tally(_sass, "STG")}
    print(f"{_what:<54} " + ", ".join(f"{c} × {op}" for op, c in _counts.items()))

# %% [markdown]
# The rule behind the table: a thread loads its contiguous run of elements in as few
# instructions as possible, at most 16 bytes each, **if** the compiler can prove that 16
# bytes are contiguous, aligned and either all in or all out of the mask.
#
# * `n = 1000`: the mask `offs < n` may cut a vector anywhere, so every element is loaded
#   alone (32 bits). `n = 4096` arrives **specialized** as a multiple of 16 (Triton checks
#   every integer argument at launch), and the mask is known constant over runs of 16.
# * `BLOCK = 256` over 128 threads is 2 floats a thread: 64-bit loads. `uint8` at `BLOCK =
#   1024`: 8 bytes a thread, 64 bits; `BLOCK = 2048` gives 16 bytes, 128 bits.
# * A view such as `t[1:]` starts 2 bytes past an aligned address: no vector load can start
#   there, and the whole kernel falls back to 16-bit loads.
#
# On a GPU the width matters because every instruction costs an issue slot and a pass through
# the load/store unit: four 32-bit loads move what one 128-bit load moves, with four times the
# instructions. Memory-bound kernels (copy, dequantization, element-wise ops) reach the DRAM
# bandwidth only with wide, coalesced accesses.

# %% [markdown]
# A matrix product looks different. Here is the plain tiled matmul, the core of Lab 08's
# kernel without the gather and the scatter: each program accumulates a `BLOCK_M × BLOCK_N`
# tile of `C` over a loop on `K`. `PRECISION` is `tl.dot`'s `input_precision`: `"ieee"`
# multiplies float32 exactly, `"tf32"` lets the tensor cores round float32 inputs to TF32
# (10 bits of mantissa). Run it to check it first; then compile it in float16 for an A100
# (and for `ARCH`, if that is another GPU) and count its memory and math instructions.

# %%
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """C[M, N] = A[M, K] @ B[K, N], all row-major with unit column stride."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                   # [BM]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN]
    rk = tl.arange(0, BLOCK_K)                                                # [BK]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)                        # [BM, BN]
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)   # [BM, BK]
        b = tl.load(b_ptr + (k0 + rk)[:, None] * stride_bk + rn[None, :],
                    mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)   # [BK, BN]
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_launch(dtype, tile, precision="ieee", size=4096):
    """(args, kwargs) of matmul_kernel for [size, size] @ [size, size] in `dtype`, with
    tile = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), as a launch passes them."""
    block_m, block_n, block_k, warps = tile
    t = like(dtype)
    return ((t, t, t, size, size, size, size, size, size),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
                 num_warps=warps, num_stages=3))


_a, _b = harness.randn(40, 56, seed=1).to(DEVICE), harness.randn(56, 48, seed=2).to(DEVICE)
_c = torch.empty(40, 48, device=DEVICE)
matmul_kernel[(3, 3)](_a, _b, _c, 40, 48, 56, 56, 48, 48, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16,
                      PRECISION="ieee")
print(f"run on {DEVICE}: max |C - A @ B| =", (_c - _a @ _b).abs().max().item())

for _arch in dict.fromkeys(("sm_80", ARCH)):           # sm_80, and ARCH if it is another
    _sass = sass_of(matmul_kernel, *matmul_launch(torch.float16, (64, 64, 32, 4)), _arch)
    print(f"matmul_kernel, float16, 64×64×32 tiles, 4 warps, {_arch}:")
    print("   ", tally(_sass, "LDG", "LDGSTS", "LDGDEPBAR", "STG", "LDS", "LDSM", "STS", "HMMA",
                       "HGMMA", "FFMA", "LDL", "STL"))

# %% [markdown]
# No `LDG` at all on `sm_80`: with `num_stages=3` the loop is **pipelined**, its tiles of `A`
# and `B` copied asynchronously into shared memory by `LDGSTS` while earlier tiles are
# multiplied; `LDGDEPBAR` closes each batch of copies and `DEPBAR` waits for one. `LDSM` moves
# the tiles from shared memory into registers for the `HMMA`s, the tensor-core instructions;
# the result leaves in 128-bit `STG`s.
#
# `sm_86` and `sm_89` get the same code. On `sm_90` the tiles arrive the same way and two
# `HGMMA`s per iteration do the products (Part C). On `sm_75`, a T4, none of it is left: there
# are no asynchronous copies before `sm_80`, so the tiles go through registers (`LDG`, then
# `STS` into shared memory), and Triton gives `tl.dot` no tensor cores there: the float16
# tiles are converted to float32 and multiplied by 1 024 `FFMA`s a thread, in so many
# registers that `ptxas` spills (`LDL`, `STL`).
#
# ## Exercise 1 — read SASS: load and store widths, spills, tensor cores
#
# **Specification.** `read_sass(sass)` takes the text `cuobjdump -sass` prints (a `str`: headers,
# instruction lines, encoding lines) and returns a dict:
#
# * `"loads"`: `{bits: count}` of the global loads, the `LDG` and `LDGSTS` instructions, by
#   width in bits (`int` keys; no entries with a count of 0);
# * `"stores"`: the same for the global stores, `STG`;
# * `"local"`: the number of `LDL` and `STL` instructions (spill traffic in the code);
# * `"tensor_core"`: the number of `HMMA` and `HGMMA` instructions.
#
# The rules that matter:
#
# * **An instruction is a line that starts with its address**, `/*0130*/`; its **opcode** is
#   the first word after the address and the optional guard (`@P0`, `@!P1`, `@!PT`, `@UP0`),
#   and its modifiers follow the opcode after dots. Other lines (headers, the second half of
#   an encoding) are not instructions.
# * **Compare the opcode whole**, never a substring of the line: `LDGDEPBAR` and `LDGSTS` both
#   start with `LDG`, and `ULDC.64` ends like a 64-bit load and is none.
# * **Count every instruction, guarded or not** (`@!PT` never runs, but it is in the code).
# * **The width is the first modifier among** `U8`, `S8` (8), `U16`, `S16` (16), `64`, `128`;
#   none of these means 32. Other modifiers may follow the width (`LDG.E.64.STRONG.GPU`, which
#   Triton emits for `cache_modifier=".cg"`) or carry digits without being one (`LTC128B`,
#   `64x64x16`).
#
# Off-limits: `gpucompile`'s own readers (`read_cubin`, `memory_widths`, `occupancy`,
# `inspect_kernel`); they raise if reached while the tests run your function. Python's `re`
# and `collections` are yours.
#
# <details><summary>Hint 1: the idea</summary>
#
# Read the text line by line and token by token rather than searching all of it with one
# pattern: split a line on whitespace, keep it only if its first token is an address, drop the
# next token if it starts with `@`, and the token after that is `OPCODE.MOD.MOD`. Splitting
# that token at its dots gives the opcode and the list of modifiers, and the width is the
# first modifier found in a small table of the six width names. The snippet in the test cell
# has one line for each trap above; if your totals differ from the ones written beside it,
# print your reading of it line by line.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# WIDTH = {U8: 8, S8: 8, U16: 16, S16: 16, "64": 64, "128": 128}
# loads, stores = {}, {};  local = tensor_core = 0
# for line in sass.splitlines():
#     words = line.split()
#     if not words or words[0] is not of the form /*hex*/: skip the line
#     words = words[1:];  if words[0] starts with "@": words = words[1:]
#     opcode, *mods = words[0] without a trailing ";", split at "."
#     bits = WIDTH[m] for the first m in mods that is in WIDTH, else 32
#     if opcode in (LDG, LDGSTS):     loads[bits] += 1
#     elif opcode == STG:             stores[bits] += 1
#     elif opcode in (LDL, STL):      local += 1
#     elif opcode in (HMMA, HGMMA):   tensor_core += 1
# return {"loads": loads, "stores": stores, "local": local, "tensor_core": tensor_core}
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "read_sass", "locked": false, "schema_version": 3, "solution": true, "task": false}
def read_sass(sass: str) -> dict:
    """{"loads": {bits: n}, "stores": {bits: n}, "local": n, "tensor_core": n} of SASS text."""
    ### BEGIN SOLUTION
    instruction = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)"
                             r"((?:\.\w+)*)", re.MULTILINE)
    width = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
    loads, stores = {}, {}
    local = tensor_core = 0
    for m in instruction.finditer(sass):
        opcode, modifiers = m.group(1), m.group(2).split(".")[1:]
        bits = next((width[mod] for mod in modifiers if mod in width), 32)
        if opcode in ("LDG", "LDGSTS"):
            loads[bits] = loads.get(bits, 0) + 1
        elif opcode == "STG":
            stores[bits] = stores.get(bits, 0) + 1
        elif opcode in ("LDL", "STL"):
            local += 1
        elif opcode in ("HMMA", "HGMMA"):
            tensor_core += 1
    return {"loads": loads, "stores": stores, "local": local, "tensor_core": tensor_core}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_read_sass", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
from course.notebook.forbid import bindings

# gpucompile's own readers raise while your readers (Exercises 1 and 2) run.
_READERS = list(harness.reference("13-gpu-compiler").values())
# each named by a module attribute that binds it, (module, name): forbid then switches off
# every binding of it, here and where your code runs
_READERS = [next((o, n) for o, n in bindings(t) if not isinstance(o, dict)) for t in _READERS]
_WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


def _no_reader():
    return harness.forbid(_READERS, globals(),
                          why="Exercises 1 and 2 read the compiler's output themselves")


def _instructions(sass):
    """(opcode, modifiers) of every instruction of cuobjdump -sass text, token by token."""
    found = []
    for line in sass.splitlines():
        words = line.split()
        if len(words) < 2 or not re.fullmatch(r"/\*[0-9a-f]+\*/", words[0]):
            continue
        words = words[1:]
        if words[0].startswith("@"):
            words = words[1:]
        opcode, *modifiers = words[0].rstrip(";").split(".")
        found.append((opcode, modifiers))
    return found


def _expected_reading(sass):
    """The reading of `sass` that read_sass must return."""
    want = {"loads": {}, "stores": {}, "local": 0, "tensor_core": 0}
    for opcode, modifiers in _instructions(sass):
        bits = next((_WIDTH[m] for m in modifiers if m in _WIDTH), 32)
        kind = {"LDG": "loads", "LDGSTS": "loads", "STG": "stores"}.get(opcode)
        if kind:
            want[kind][bits] = want[kind].get(bits, 0) + 1
        want["local"] += opcode in ("LDL", "STL")
        want["tensor_core"] += opcode in ("HMMA", "HGMMA")
    return want


def _normalised(reading, what):
    assert isinstance(reading, dict) and set(reading) >= {"loads", "stores", "local",
                                                          "tensor_core"}, \
        f"read_sass({what}) must return a dict with keys loads, stores, local, tensor_core; " \
        f"got {reading!r:.200}"
    out = dict(reading)
    for key in ("loads", "stores"):
        out[key] = {int(k): v for k, v in reading[key].items() if v}
    return out


def _check_sass(sass, what):
    with _no_reader():
        got = _normalised(read_sass(sass), what)
    want = _expected_reading(sass)
    for key in ("loads", "stores", "local", "tensor_core"):
        assert got[key] == want[key], \
            f"read_sass of {what}: {key} expected {want[key]}, got {got[key]}"
    return got


_SNIPPET = """
        code for sm_90a
                Function : demo
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;          /* 0x00000a00ff017b82 */
                                                                   /* 0x000fe20000000800 */
        /*0010*/                   ULDC.64 UR4, c[0x0][0x208] ;    /* 0x0000820000047ab9 */
        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E R8, desc[UR4][R2.64+0x800] ;
        /*0040*/               @P1 LDG.E.U8 R9, desc[UR4][R6.64] ;
        /*0044*/                   LDG.E.S16 R11, desc[UR4][R6.64+0x2] ;
        /*0048*/              @!P2 LDG.E.64.STRONG.GPU R14, desc[UR4][R6.64+0x40] ;
        /*0050*/                   LDGSTS.E.BYPASS.LTC128B.128 [R10], desc[UR4][R12.64] ;
        /*0060*/                   LDGDEPBAR ;
        /*0070*/                   DEPBAR.LE SB0, 0x1 ;
        /*0080*/                   LDS.128 R12, [R10] ;
        /*0090*/                   STL.64 [R1+0x8], R12 ;
        /*00a0*/                   LDL.LU R13, [R1+0x8] ;
        /*00b0*/                   HMMA.16816.F32.BF16 R16, R12, R14, R16 ;
        /*00c0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8].tnspB, R24 ;
        /*00d0*/                   FFMA R0, R1, R2, R0 ;
        /*00e0*/              @!P0 STG.E.U16 desc[UR4][R2.64], R0 ;
        /*00f0*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0100*/                   STG.E desc[UR4][R2.64+0x10], R8 ;
        /*0110*/                   EXIT ;
"""
# One instruction at a time first, each with the rule it checks.
_RULES = [   # (instruction, what it adds to the reading, the rule)
    ("LDG.E R8, desc[UR4][R2.64+0x800]", {"loads": {32: 1}},
     "an instruction without a width modifier is 32 bits wide"),
    ("LDG.E.U8 R9, desc[UR4][R6.64]", {"loads": {8: 1}}, "U8 is an 8-bit load"),
    ("LDG.E.S8 R9, desc[UR4][R6.64]", {"loads": {8: 1}},
     "S8 is an 8-bit load too: signed (sign-extended) loads S8 and S16 are as wide as U8 and U16"),
    ("LDG.E.U16 R9, desc[UR4][R6.64]", {"loads": {16: 1}}, "U16 is a 16-bit load"),
    ("LDG.E.S16 R9, desc[UR4][R6.64]", {"loads": {16: 1}},
     "S16 is a 16-bit load too: signed (sign-extended) loads S8 and S16 are as wide as U8 and U16"),
    ("@!P0 LDG.E.128 R4, desc[UR4][R2.64]", {"loads": {128: 1}},
     "a guarded instruction (@P0, @!P0, @!PT, @UP0) counts like any other"),
    ("LDG.E.64.STRONG.GPU R14, desc[UR4][R6.64+0x40]", {"loads": {64: 1}},
     "the width is the first width modifier, not the last modifier"),
    ("LDGSTS.E.BYPASS.LTC128B.128 [R10], desc[UR4][R12.64]", {"loads": {128: 1}},
     "LDGSTS, the asynchronous copy from global to shared memory, counts as a global load "
     "(LTC128B is a cache hint, not a width)"),
    ("LDGDEPBAR", {}, "compare the opcode whole: LDGDEPBAR only waits for LDGSTS copies"),
    ("ULDC.64 UR4, c[0x0][0x208]", {}, "compare the opcode whole: ULDC.64 reads the constant "
     "bank"),
    ("STG.E.U16 desc[UR4][R2.64], R0", {"stores": {16: 1}}, "U16 is a 16-bit store"),
    ("STL.64 [R1+0x8], R12", {"local": 1}, "STL and LDL, spill traffic, count in local"),
    ("LDL.LU R13, [R1+0x8]", {"local": 1}, "STL and LDL, spill traffic, count in local"),
    ("HMMA.16816.F32.BF16 R16, R12, R14, R16", {"tensor_core": 1},
     "HMMA is a tensor-core instruction"),
    ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8].tnspB, R24", {"tensor_core": 1},
     "HGMMA, the warpgroup MMA of sm_90, is a tensor-core instruction too"),
]
for _code, _adds, _rule in _RULES:
    _want = {"loads": {}, "stores": {}, "local": 0, "tensor_core": 0, **_adds}
    with _no_reader():
        _got = _normalised(read_sass(f"        /*0040*/ {_code} ;\n"), f"`{_code}`")
    assert {k: _got[k] for k in _want} == _want, \
        f"read_sass of the one instruction `{_code}`: expected {_want}, got " \
        f"{ {k: _got[k] for k in _want} }: {_rule}"
_got = _check_sass(_SNIPPET, "the snippet in this cell")
# by hand: LDG.E.128, LDG.E, LDG.E.U8, LDG.E.S16, LDG.E.64.STRONG.GPU, LDGSTS...128 (not
# LDGDEPBAR)
assert _got["loads"] == {128: 2, 64: 1, 32: 1, 16: 1, 8: 1}, \
    f"read_sass of the snippet: loads by hand are {{128: 2, 64: 1, 32: 1, 16: 1, 8: 1}}, got " \
    f"{_got['loads']}"
assert _got["stores"] == {16: 1, 128: 1, 32: 1} and _got["local"] == 2, _got
_check_sass(sass_of(scale_kernel, (F32, F32, 2.0, 4096), dict(BLOCK=1024)),
            "scale_kernel, float32, n = 4096, sm_90")
_check_sass(sass_of(scale_kernel, (F32, F32, 2.0, 1000), dict(BLOCK=1024)),
            "scale_kernel, float32, n = 1000, sm_90")
_check_sass(sass_of(matmul_kernel, *matmul_launch(torch.float16, (64, 64, 32, 4)), "sm_80"),
            "matmul_kernel, float16, 64×64×32, sm_80 (LDGSTS, LDGDEPBAR, HMMA)")
print("read_sass reads each rule's instruction, the snippet, scale_kernel's and "
      "matmul_kernel's SASS instruction by instruction")

### BEGIN HIDDEN TESTS
# case: scale_kernel in several dtypes and blocks, sm_90
for _t, _n, _block in ((like(torch.float32), 4096, 256), (like(torch.float16), 4096, 1024),
                       (like(torch.float16, aligned=False), 4096, 1024),
                       (like(torch.uint8), 4096, 1024), (like(torch.uint8), 4096, 2048)):
    _check_sass(sass_of(scale_kernel, (_t, _t, 2.0, _n), dict(BLOCK=_block)),
                f"scale_kernel, {_t.dtype}, n = {_n}, BLOCK = {_block}, sm_90"
                + ("" if _t.data_ptr() == 0 else ", unaligned"))
# case: scale_kernel in int8 and int64, sm_80
for _t, _n in ((like(torch.int8), 1000), (like(torch.int64), 4096)):
    _check_sass(sass_of(scale_kernel, (_t, _t, 2.0, _n), dict(BLOCK=512), "sm_80"),
                f"scale_kernel, {_t.dtype}, n = {_n}, sm_80")
# case: matmul_kernel, bfloat16, sm_90
_check_sass(sass_of(matmul_kernel, *matmul_launch(torch.bfloat16, (64, 64, 32, 4)), "sm_90"),
            "matmul_kernel, bfloat16, 64×64×32, sm_90 (HGMMA)")
# case: matmul_kernel, float32, large tile, sm_80
_got = _check_sass(sass_of(matmul_kernel, *matmul_launch(torch.float32, (128, 128, 32, 4)),
                           "sm_80"), "matmul_kernel, float32, 128×128×32, 4 warps, sm_80 (LDL, STL)")
### END HIDDEN TESTS

# %% [markdown]
# ## Part B — registers, spills and occupancy
#
# A streaming multiprocessor (SM) runs many warps at once and switches to another whenever
# one waits for memory: that is how a GPU hides DRAM latency. How many can be resident at
# once is limited by what each block takes of the SM's fixed budget:
#
# | per SM | sm_75 (T4) | sm_80 (A100) | sm_86 (A10G) | sm_89 (L4) | sm_90 (H100) |
# |---|---|---|---|---|---|
# | 32-bit registers | 65 536 | 65 536 | 65 536 | 65 536 | 65 536 |
# | resident warps | 32 | 64 | 48 | 48 | 64 |
# | resident blocks | 16 | 32 | 16 | 24 | 32 |
# | shared memory for blocks | 64 KiB | 164 KiB | 100 KiB | 100 KiB | 228 KiB |
# | shared memory the driver reserves per block | 0 | 1 KiB | 1 KiB | 1 KiB | 1 KiB |
# | shared memory allocation unit | 256 B | 128 B | 128 B | 128 B | 128 B |
#
# (CUDA C++ Programming Guide, "Compute Capabilities" table; the allocation rules below are
# those of NVIDIA's own occupancy calculator, `cuda_occupancy.h`, which the triton wheel
# ships in `triton/backends/nvidia/include/`.)
#
# **Registers.** A thread may use at most 255 registers; when `ptxas` needs more it
# **spills**: it stores values to the thread's stack in local memory (`STL`) and loads them back
# (`LDL`). Registers are handed out per warp in units of 256: a thread asking for `r` registers
# makes its warp take `r·32` rounded up to a multiple of 256. And an SM is four
# **sub-partitions**, each with its own warp scheduler and a quarter of the register file,
# 16 384 registers; a warp runs on one of them and takes its registers there. So the registers
# allow a whole number of warps *per sub-partition*, `16384 // regs_per_warp`, four times that
# per SM. Dividing the whole file, `65536 // regs_per_warp`, counts warps that straddle two
# sub-partitions and can be up to 3 too many: at 97 registers (3 328 a warp) it says 19, and
# 16 fit.
#
# `cuobjdump --dump-resource-usage` prints `REG` (registers per thread) and `STACK`
# (bytes of stack per thread, which in Triton code is spill space; `LOCAL` counts too, but
# Triton leaves it 0). Triton's shared memory is not in the cubin: the launch asks for it,
# `compiled.metadata.shared` bytes per block.
#
# **Occupancy** is the share of the SM's warp slots the kernel can fill. With `lim =
# SM_LIMITS[arch]`, the table above:
#
# ```
# regs_per_warp    = ceil(registers · 32 / 256) · 256          # units of 256
# warps_by_regs    = 4 · (16384 // regs_per_warp)              # whole warps per sub-partition
# shared_per_block = ceil((shared_bytes + reserved) / unit) · unit
# blocks per SM    = min(lim.blocks,                            # block slots
#                        lim.warps // num_warps,                # warp slots
#                        warps_by_regs // num_warps,            # registers, whole blocks
#                        lim.shared // shared_per_block)        # shared memory (if any)
# occupancy        = blocks per SM · num_warps / lim.warps
# ```
#
# ## Exercise 2 — read the resource usage, compute the occupancy
#
# **Specification.**
#
# * `read_usage(text)`: from `cuobjdump --dump-resource-usage` output (one kernel), return
#   `{"registers": REG, "spill_bytes": STACK + LOCAL}` as ints.
# * `my_occupancy(registers, shared_bytes, num_warps, arch="sm_90")`: the formula above with the
#   limits of `SM_LIMITS[arch]` (below), a float in `[0, 1]`; 0 when one block does not fit.
#   `registers` is 1 to 255, `num_warps` 1 to 32 (a block has at most 1 024 threads).
#   The rules that matter: registers go to a warp in units of 256, and to one of the 4
#   sub-partitions of 16 384 registers, each holding a whole number of warps; every division
#   is a whole number of warps or blocks; an SM holds at most `lim["blocks"]` blocks,
#   however small; each block's shared memory is its `shared_bytes` plus what the driver
#   reserves, rounded up to the allocation unit, and a block that takes none (on sm_75, with
#   no reserve) is not limited by it. Take every limit from `SM_LIMITS[arch]`: they differ
#   between GPUs.
#
# Off-limits: `gpucompile.occupancy` and `read_cubin` (they raise while the tests run
# your code): do the arithmetic yourself.
#
# <details><summary>Hint 1: the idea</summary>
#
# The fields of the resource usage are `NAME:number` pairs on one line; one regular expression
# finds them all, and a field that is absent counts as 0. For the occupancy, compute the four
# limits on blocks per SM separately, take the smallest, and only then turn blocks into warps.
# The usual slips are the roundings, each done *before* the division it feeds: `registers ·
# 32` up to a multiple of 256 (18 registers: 576 rounds up to 768), then warps per
# sub-partition (16 384 // 768 = 21, so 84 warps), and the shared bytes plus the reserve up to
# the allocation unit. The comments in the test cell work each of its cases this way.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# read_usage:   fields = {name: int(value) for each "NAME:value" in text}
#               return {"registers": fields[REG], "spill_bytes": STACK + LOCAL (0 if absent)}
# my_occupancy: lim = SM_LIMITS[arch]
#               regs_per_warp = ceil(registers * 32 / 256) * 256
#               warps_by_regs = 4 * ((lim.registers // 4) // regs_per_warp)
#               blocks = min(lim.blocks, lim.warps // num_warps, warps_by_regs // num_warps)
#               shared = ceil((shared_bytes + lim.reserved) / lim.shared_unit) * lim.shared_unit
#               if shared > 0:
#                   blocks = min(blocks, lim.shared // shared)
#               return blocks * num_warps / lim.warps
# ```
#
# </details>

# %%
SM_LIMITS = gpucompile.SM_LIMITS   # per SM; shared memory in bytes: usable, reserved per block
print(f"{'arch':<6}" + "".join(f"{k:>12}" for k in SM_LIMITS["sm_90"]))
for arch, lim in SM_LIMITS.items():
    print(f"{arch:<6}" + "".join(f"{v:>12,}" for v in lim.values())
          + ("   <- ARCH" if arch == ARCH else ""))
print(cuobjdump(compiled.asm["cubin"], "--dump-resource-usage"))


# %% nbgrader={"grade": false, "grade_id": "occupancy", "locked": false, "schema_version": 3, "solution": true, "task": false}
def read_usage(text: str) -> dict:
    """{"registers": REG, "spill_bytes": STACK + LOCAL} of cuobjdump --dump-resource-usage."""
    ### BEGIN SOLUTION
    fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}
    return {"registers": fields["REG"],
            "spill_bytes": fields.get("STACK", 0) + fields.get("LOCAL", 0)}
    ### END SOLUTION


def my_occupancy(registers: int, shared_bytes: int, num_warps: int, arch: str = "sm_90"
                 ) -> float:
    """Resident warps per SM / SM_LIMITS[arch]["warps"], limited by blocks, warps, registers
    (in 4 sub-partitions) and shared memory."""
    ### BEGIN SOLUTION
    lim = SM_LIMITS[arch]
    regs_per_warp = -(-registers * 32 // 256) * 256                    # units of 256
    warps_by_registers = 4 * (lim["registers"] // 4 // regs_per_warp)  # per sub-partition
    blocks = min(lim["blocks"], lim["warps"] // num_warps, warps_by_registers // num_warps)
    unit = lim["shared_unit"]
    shared_per_block = -(-(shared_bytes + lim["reserved"]) // unit) * unit
    if shared_per_block:
        blocks = min(blocks, lim["shared"] // shared_per_block)
    return blocks * num_warps / lim["warps"]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_occupancy", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_usage(kernel, args, kwargs, arch, what):
    usage = cuobjdump(compile_kernel(kernel, args, kwargs, arch).asm["cubin"],
                      "--dump-resource-usage")
    fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    want = {"registers": fields["REG"],
            "spill_bytes": fields.get("STACK", 0) + fields.get("LOCAL", 0)}
    with _no_reader():
        got = read_usage(usage)
    for key in ("registers", "spill_bytes"):
        assert got.get(key) == want[key], \
            f"read_usage of {what}: {key} expected {want[key]}, got {got.get(key)}"


def _check_occupancy(registers, shared, warps, arch, want=None, rule=""):
    if want is None:
        want = gpucompile.occupancy(arch, registers, shared, warps)
    call = f"my_occupancy(registers={registers}, shared_bytes={shared}, num_warps={warps}, " \
           f"arch={arch!r})"
    try:
        with _no_reader():
            got = my_occupancy(registers, shared, warps, arch)
    except ZeroDivisionError as e:
        raise AssertionError(f"{call}: ZeroDivisionError ({e}); {rule}") from None
    assert isinstance(got, float | int) and abs(got - want) < 1e-9, \
        f"{call}: expected {want}, got {got}" + (f": {rule}" if rule else "")


with _no_reader():
    _u = read_usage("Resource usage:\n Common:\n  GLOBAL:0\n Function k:\n  REG:255 STACK:528 "
                    "SHARED:0 LOCAL:8 CONSTANT[0]:416 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
assert _u == {"registers": 255, "spill_bytes": 536}, \
    f"read_usage of 'REG:255 STACK:528 ... LOCAL:8': expected registers 255, spill_bytes 536, " \
    f"got {_u} (spill_bytes is STACK + LOCAL)"
_check_usage(scale_kernel, (F32, F32, 2.0, 4096), dict(BLOCK=1024), "sm_90", "scale_kernel")
# worked by hand: 18 registers -> 768 per warp -> 16384 // 768 = 21 a sub-partition, 84 warps
# -> 21 blocks of 4; the warp slots allow 16
_check_occupancy(18, 0, 4, "sm_90", want=1.0, rule="the warp slots: 64 // 4 = 16 blocks")
# the rounding: 97 registers, 3104 -> 3328 per warp -> 4 a sub-partition -> 4 blocks of 4
_check_occupancy(97, 0, 4, "sm_90", want=0.25,
                 rule="registers go to a warp in units of 256: 97 · 32 = 3 104 rounds up to "
                      "3 328, 4 warps a sub-partition, 16 an SM (3 104 would allow 5, 20)")
# the sub-partitions: 16 warps of 1, not 65536 // 3328 = 19
_check_occupancy(97, 0, 1, "sm_90", want=0.25,
                 rule="each of the 4 sub-partitions holds 16 384 registers and a whole number "
                      "of warps: 16 384 // 3 328 = 4 warps, 16 an SM, where 65 536 // 3 328 = "
                      "19 counts warps split between sub-partitions")
_check_occupancy(80, 0, 1, "sm_90", want=0.375,
                 rule="each of the 4 sub-partitions holds 16 384 registers and a whole number "
                      "of warps: 2 560 a warp, 16 384 // 2 560 = 6, 24 an SM (not 25)")
# 255 registers: 8160 -> 8192 per warp -> 2 a sub-partition, 8 warps -> 2 blocks of 4 warps
_check_occupancy(255, 0, 4, "sm_90", want=0.125)
# the block slots: 1-warp blocks of 24 registers would fit 64 an SM, but 32 is the most
_check_occupancy(24, 0, 1, "sm_80", want=0.5,
                 rule="the block slots: an SM holds at most SM_LIMITS[arch]['blocks'] blocks, "
                      "32 on sm_80, however small")
# 96 registers: 3072 per warp -> 5 a sub-partition, 20 warps -> 5 blocks; shared 16 KiB + 1 KiB:
# 167936 // 17408 = 9
_check_occupancy(96, 16384, 4, "sm_80", want=0.3125)
# the reserved KiB: 41984 + 1024 B a block -> 167936 // 43008 = 3 blocks (4 without it)
_check_occupancy(32, 41984, 4, "sm_80", want=0.1875,
                 rule="each block also takes the 1 KiB the driver reserves (SM_LIMITS[arch]"
                      "['reserved']): 41 984 + 1 024 = 43 008 B, 3 blocks in 164 KiB")
# the allocation unit: 54926 + 1024 = 55950 -> 56064 (128-byte units) -> 2 blocks (3 unrounded)
_check_occupancy(32, 54926, 4, "sm_80", want=0.125,
                 rule="shared memory goes to a block in units of SM_LIMITS[arch]['shared_unit'] "
                      "(128 bytes on sm_80): 55 950 B round up to 56 064, 2 blocks in 164 KiB")
# another GPU: sm_86 has 48 warp slots and 16 block slots
_check_occupancy(16, 0, 1, "sm_86", want=1 / 3,
                 rule="take every limit from SM_LIMITS[arch]: sm_86 holds 16 blocks and 48 "
                      "warps, so 16 one-warp blocks are 1/3 of it")
# sm_75: 256-byte units, no reserve: 9300 -> 9472 B a block, 6 blocks (7 in 128-byte units)
_check_occupancy(32, 9300, 1, "sm_75", want=6 / 32,
                 rule="take every limit from SM_LIMITS[arch]: sm_75 reserves nothing and "
                      "allocates shared memory in units of 256 bytes: 9 300 B take 9 472, 6 "
                      "blocks in 64 KiB")
_check_occupancy(64, 0, 8, "sm_75", want=1.0,
                 rule="on sm_75 a block without shared memory takes none (no reserve): shared "
                      "memory does not limit it")
print("read_usage reads REG and STACK; my_occupancy agrees with the hand-worked cases")

### BEGIN HIDDEN TESTS
# case: few registers, one warp
_check_occupancy(16, 0, 1, "sm_90", want=0.5)               # the 32-block limit
# case: large shared memory
_check_occupancy(58, 148480, 8, "sm_90", want=0.125)        # shared memory: one block
# case: more shared memory than an A100 has
_check_occupancy(40, 200_000, 4, "sm_80", want=0.0)         # does not fit in 164 KiB
# case: a grid of registers, warps and shared memory on five GPUs
_occ_cases = [(_regs, _shared, _warps, _arch) for _arch in SM_LIMITS
              for _regs in (*range(16, 256, 7), 80, 97, 255)
              for _warps in (1, 2, 3, 4, 6, 8, 16, 32)
              for _shared in (0, 1000, 9300, 16384, 41984, 50176, 54926, 99328, 148480)]
_wants = [gpucompile.occupancy(_a, _r, _s, _w) for _r, _s, _w, _a in _occ_cases]
with _no_reader():                  # one switch-off for all the cases, not one per case
    _gots = [my_occupancy(*_case) for _case in _occ_cases]
for _case, _want, _got in zip(_occ_cases, _wants, _gots, strict=True):
    assert isinstance(_got, float | int) and abs(_got - _want) < 1e-9, \
        "my_occupancy(registers={}, shared_bytes={}, num_warps={}, arch={!r}): expected " \
        "{}, got {}".format(*_case, _want, _got)
# case: usage of scale_kernel, float16, sm_80
_check_usage(scale_kernel, (F16, F16, 2.0, 1000), dict(BLOCK=2048, num_warps=8), "sm_80",
             "scale_kernel, float16, n = 1000, sm_80")
# case: usage of matmul_kernel, float32, large tile
_check_usage(matmul_kernel, *matmul_launch(torch.float32, (128, 128, 32, 4)), "sm_80",
             "matmul_kernel, float32, 128×128×32, 4 warps (it spills)")
### END HIDDEN TESTS

# %% [markdown]
# ### A tile's cost in registers
#
# Registers matter most in a matrix product: each program holds its `BLOCK_M × BLOCK_N`
# accumulator in registers, spread over its threads. Here is `matmul_kernel` for `ARCH` in
# float32 (`"ieee"`, no tensor cores), at growing tiles. `inspect_kernel` compiles and reads
# in one call (the reading you just wrote, and a few more numbers); from here on it is your
# tool too. The last column is each compile's time: Triton keeps what it compiled in its cache
# (`~/.triton/cache`), so run the cell a second time and watch that column drop.

# %% tags=["jupyter-only"]
FP32_TILES = [(64, 64, 32, 4), (64, 64, 32, 8), (128, 64, 32, 4), (128, 128, 32, 4),
              (128, 128, 32, 8)]
sweep = {}
print(f"{'BLOCK_M×N×K, warps':<20}{'registers':>10}{'spill B':>9}{'LDL/STL':>9}"
      f"{'shared B':>10}{'occupancy':>11}{'compile s':>11}   on {ARCH}")
for _tile in FP32_TILES:
    _r = inspect_kernel(matmul_kernel, *matmul_launch(torch.float32, _tile), ARCH)
    sweep[_tile] = _r
    print(f"{'{}×{}×{}, {}'.format(*_tile):<20}{_r.registers:>10}{_r.spill_bytes:>9}"
          f"{_r.local_instructions:>9}{_r.shared_bytes:>10}{_r.occupancy:>11.3f}"
          f"{_r.compile_s:>11.2f}")

# %% [markdown]
# Read the table row by row:
#
# * A `64 × 64` float32 accumulator is 4 096 values; over 4 warps (128 threads) that is 32
#   registers a thread for the accumulator alone, and the operands, addresses and loop state
#   come on top. With 8 warps the same tile is spread over twice the threads, and each needs
#   far fewer registers.
# * Double the tile to `128 × 64` with 4 warps and the accumulator takes 64 registers a
#   thread (8 192 values over 128 threads), 168 in all on each of the five GPUs: under the
#   limit, and yet `ptxas` spills 8 bytes for `sm_86`, `sm_89` and `sm_90` (not for `sm_75`
#   and `sm_80`). At `128 × 128` the accumulator takes 128 registers, still well under the
#   limit of 255. What pushes that thread to 255 and into spills is everything else the
#   `FFMA` loop keeps live next to the accumulator: the strips of `A` and `B` each thread
#   multiplies (the FMA operands), and the 64-bit addresses and masks of its loads, kept for
#   the stages of the software-pipelined loop (`num_stages=3`). `ptxas` then keeps a stack of
#   values behind them, with `LDL`/`STL` instructions in and around the `K` loop. A spill
#   costs a round trip through the L1 cache (DRAM if it misses) for a value that a register
#   would hold for free, and inside the loop it costs that at every iteration. (Which tiles
#   spill, and by how much, is the compiler's call: with the triton this course installs,
#   3.7.1, `128 × 128` spills 64 bytes for `sm_80`, 72 for `sm_86`, `sm_89` and `sm_90`, 104
#   for `sm_75`; other versions draw the line elsewhere. The table above is the truth.)
# * With 8 warps `128 × 128` fits again, at one block of 8 warps per SM (0.125 of the 64 warp
#   slots of `sm_80` and `sm_90`; the smaller tiles keep more warps resident): big tiles buy
#   data reuse — each element loaded from memory feeds `BLOCK_N` or `BLOCK_M` multiply-adds —
#   and pay in resident warps.
#
# ## Exercise 3 — the largest tile that does not spill
#
# **Specification.** `largest_tile_without_spills(dtype, arch, candidates)` takes a torch
# dtype, an architecture (one of `gpucompile.ARCHS`) and a list of candidates `(BLOCK_M,
# BLOCK_N, BLOCK_K, num_warps)`. It compiles `matmul_kernel` for each candidate as
# `matmul_launch(dtype, tile)` launches it, on `arch`, and returns the candidate with the
# largest tile area `BLOCK_M · BLOCK_N` among those whose spill (`STACK + LOCAL`) is 0 bytes;
# on a tie, the earlier in the list; `None` when every candidate spills. The answer must come
# from the compiler, not from a table of the sweep above: the tests ask about other dtypes,
# GPUs and lists.
#
# <details><summary>Hint 1: the idea</summary>
#
# `inspect_kernel` gives `spill_bytes` directly and will do. It also disassembles the whole
# cubin, though, and the SASS of a spilling kernel is a megabyte of text; the spill is in the
# resource usage alone, so `compile_kernel` + `cuobjdump(cubin, "--dump-resource-usage")` +
# your `read_usage` gives the same number for less. For the tie, only replace the best so far
# when a tile is strictly larger.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# best = None
# for tile in candidates:
#     cubin = compile_kernel(matmul_kernel, *matmul_launch(dtype, tile), arch).asm["cubin"]
#     spill = read_usage(cuobjdump(cubin, "--dump-resource-usage"))["spill_bytes"]
#     if spill == 0 and (best is None or area(tile) > area(best)): best = tile
# return best
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "largest_tile", "locked": false, "schema_version": 3, "solution": true, "task": false}
def largest_tile_without_spills(dtype: torch.dtype, arch: str, candidates: list[tuple]
                                ) -> tuple | None:
    """The candidate (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of largest BLOCK_M·BLOCK_N whose
    compiled matmul_kernel spills nothing; None if all spill."""
    ### BEGIN SOLUTION
    best = None
    for tile in candidates:
        cubin = compile_kernel(matmul_kernel, *matmul_launch(dtype, tile), arch).asm["cubin"]
        spill = read_usage(cuobjdump(cubin, "--dump-resource-usage"))["spill_bytes"]
        if spill == 0 and (best is None or tile[0] * tile[1] > best[0] * best[1]):
            best = tile
    return best
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_largest_tile", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _spill_bytes(kernel, args, kwargs, arch):
    """STACK + LOCAL bytes per thread of the compiled kernel, as cuobjdump reports them."""
    usage = cuobjdump(compile_kernel(kernel, args, kwargs, arch).asm["cubin"],
                      "--dump-resource-usage")
    return sum(int(v) for v in re.findall(r"\b(?:STACK|LOCAL):(\d+)", usage))


def _check_tile(dtype, arch, candidates):
    spill = {t: _spill_bytes(matmul_kernel, *matmul_launch(dtype, t), arch) for t in candidates}
    fits = [t for t in candidates if spill[t] == 0]
    want = max(fits, key=lambda t: t[0] * t[1], default=None)     # max keeps the first
    got = largest_tile_without_spills(dtype, arch, list(candidates))
    got = None if got is None else tuple(got)
    spills = ", ".join(f"{t}: {spill[t]} B" for t in candidates)
    area = {t: t[0] * t[1] for t in candidates}
    why = ""
    if got != want and want is None:
        why = "every candidate spills, so return None"
    elif got != want and got in spill and spill[got]:
        why = f"{got} spills {spill[got]} B: only candidates that spill 0 bytes count"
    elif got != want and got in area and want is not None and area[got] == area[want]:
        why = f"a tie: {got} and {want} have the same area BLOCK_M · BLOCK_N, and the " \
              "earlier candidate in the list wins"
    elif got != want and got in area and want is not None and area[got] < area[want]:
        why = f"{want} has the larger area BLOCK_M · BLOCK_N ({area[want]} against " \
              f"{area[got]}), and it does not spill"
    assert got == want, \
        f"largest_tile_without_spills({dtype}, {arch!r}, {list(candidates)}): expected " \
        f"{want}, got {got} (the compiler's spills: {spills})" + (f": {why}" if why else "")


_check_tile(torch.float32, "sm_80", [(64, 64, 32, 4), (128, 64, 32, 4), (128, 128, 32, 4),
                                     (128, 128, 32, 8)])
_check_tile(torch.float32, "sm_80", [(64, 64, 32, 8), (64, 64, 32, 4)])      # a tie: the first
_check_tile(torch.float32, "sm_80", [(128, 128, 32, 4)])                     # all spill: None
_check_tile(torch.float32, "sm_80", [(128, 128, 32, 4), (128, 64, 32, 4)])   # the first spills
print("largest_tile_without_spills picks what the compiler allows")

### BEGIN HIDDEN TESTS
# case: float16 on sm_90
_check_tile(torch.float16, "sm_90", [(128, 128, 32, 4), (128, 256, 32, 4), (256, 128, 32, 8)])
### END HIDDEN TESTS

# %% [markdown]
# ## Part C — tensor cores
#
# A tensor core multiplies small matrix tiles in one instruction. `HMMA` (`mma.sync`, on
# every GPU since Volta, sm_70) works per warp, with both operands in registers: on an A100
# an `HMMA.16816` is a `16 × 8 × 16` product-accumulate. On an H100 an `HGMMA.64x64x16`
# (`wgmma`) is a `64 × 64 × 16` one per **warpgroup** of 4 warps, reading `B` from shared
# memory and `A` from shared memory or from registers. That is where the datasheets' large numbers come from: an H100 SXM does about 989
# TFLOP/s of dense bfloat16 on its tensor cores and 67 TFLOP/s of float32 on its ordinary
# cores. Whether your `tl.dot` gets them is decided at compile time, by the operand types
# and `input_precision`, and the SASS says which it got.
#
# ## Exercise 4 — which instruction does the multiply-adds?
#
# **Specification.** `dot_instruction(dtype, precision, arch, tile=(64, 64, 32, 4))` compiles
# `matmul_kernel` as `matmul_launch(dtype, tile, precision)` launches it on `arch` and returns
# a string: `"HGMMA"` if its SASS has an `HGMMA` instruction, else `"HMMA"` if it has an
# `HMMA`, else `"FFMA"` (the dot was done with float32 fused multiply-adds). The answer must
# come from the compiled code, for any dtype, precision and GPU; the table below prints your
# answers for the float types on an A100, an H100 and your `ARCH`.
#
# <details><summary>Hint 1: the idea</summary>
#
# `sass_of` gives the text. Your `read_sass` counts `HMMA` and `HGMMA` together, so it cannot
# tell them apart: collect the set of opcodes instead (the same token-by-token reading as in
# Exercise 1, or a regular expression anchored after the `*/` of the address and the optional
# guard), then test for `HGMMA` first.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# sass = sass_of(matmul_kernel, *matmul_launch(dtype, tile, precision), arch)
# opcodes = {opcode of every instruction line of sass}
# return "HGMMA" if "HGMMA" in opcodes else "HMMA" if "HMMA" in opcodes else "FFMA"
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "dot_instruction", "locked": false, "schema_version": 3, "solution": true, "task": false}
def dot_instruction(dtype: torch.dtype, precision: str, arch: str,
                    tile: tuple = (64, 64, 32, 4)) -> str:
    """What matmul_kernel's tl.dot became on `arch`: "HGMMA", "HMMA" or "FFMA"."""
    ### BEGIN SOLUTION
    sass = sass_of(matmul_kernel, *matmul_launch(dtype, tile, precision), arch)
    opcodes = set(re.findall(r"\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)", sass))
    return next((op for op in ("HGMMA", "HMMA") if op in opcodes), "FFMA")
    ### END SOLUTION


# %%
DOT_CASES = [(torch.float16, "ieee"), (torch.bfloat16, "ieee"), (torch.float32, "ieee"),
             (torch.float32, "tf32")]
dot_archs = list(dict.fromkeys(("sm_80", "sm_90", ARCH)))     # ARCH too, if it is another
try:
    print(f"{'operands, input_precision':<28}" + "".join(f"{_a:>8}" for _a in dot_archs))
    for _dtype, _prec in DOT_CASES:
        print(f"{str(_dtype)[6:] + ', ' + _prec:<28}"
              + "".join(f"{dot_instruction(_dtype, _prec, _a):>8}" for _a in dot_archs))
except NotImplementedError:
    print("(finish Exercise 4 to fill the table)")


# %% nbgrader={"grade": true, "grade_id": "test_dot_instruction", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_dot(dtype, precision, arch, tile=(64, 64, 32, 4)):
    opcodes = {op for op, _ in _instructions(sass_of(matmul_kernel,
                                                     *matmul_launch(dtype, tile, precision),
                                                     arch))}
    want = "HGMMA" if "HGMMA" in opcodes else "HMMA" if "HMMA" in opcodes else "FFMA"
    assert want != "FFMA" or "FFMA" in opcodes, "the matmul has neither tensor cores nor FFMA?"
    got = dot_instruction(dtype, precision, arch, tile)
    why = ""
    if got == "FFMA" and dtype == torch.float32 and precision == "tf32":
        why = "input_precision 'tf32' takes float32 to the tensor cores: compile with the " \
              "precision given"
    elif got == "HGMMA" and arch == "sm_80":
        why = "sm_80 has no HGMMA: compile for the arch given"
    elif got == "HGMMA" and want == "HMMA":
        why = "the tile decides too: with fewer than 4 warps or 64 rows for a warpgroup the " \
              "H100 code falls back to HMMA, so compile the tile given"
    elif got == "HMMA" and want == "HGMMA":
        why = "HGMMA (sm_90's warpgroup MMA) must be told apart from HMMA: look for each " \
              "opcode, not for a tensor-core count"
    assert got == want, \
        f"dot_instruction({dtype}, {precision!r}, {arch!r}, tile={tile}): the compiled SASS " \
        f"has {'an ' + want if want != 'FFMA' else 'no tensor-core'} instruction, so expected " \
        f"{want!r}; got {got!r}" + (f": {why}" if why else "")


for _dtype, _prec in DOT_CASES:
    _check_dot(_dtype, _prec, "sm_90")
_check_dot(torch.float16, "ieee", "sm_80")
_check_dot(torch.float16, "ieee", "sm_90", tile=(32, 32, 32, 4))     # too few rows for HGMMA
print("dot_instruction reads the four cases on sm_90, float16 on sm_80 and a 32-row tile "
      "right")

### BEGIN HIDDEN TESTS
# case: the other dtypes on sm_80
for _dtype, _prec in DOT_CASES[1:]:
    _check_dot(_dtype, _prec, "sm_80")
# case: one warp on sm_90, no warpgroup
_check_dot(torch.bfloat16, "ieee", "sm_90", tile=(64, 64, 32, 1))
### END HIDDEN TESTS

# %% [markdown]
# Five things to take from the table:
#
# * From `sm_80` on, half-precision operands (`float16`, `bfloat16`) always go to the tensor
#   cores, and the instruction depends on the GPU: `HMMA` on an A100 (and on `sm_86` and
#   `sm_89`), `HGMMA` on an H100. The same Triton source gets the better instruction on the
#   newer GPU without a change, as long as the launch gives a warpgroup something to share:
#   with fewer than 4 warps, or a 32-row tile (`tile=(32, 32, 32, 4)`), the H100 code falls
#   back to `HMMA`.
# * `float32` with `"ieee"` gets **no** tensor cores: every multiply-add is an `FFMA`, and
#   the ceiling is the float32 one (67 TFLOP/s on an H100, 19.5 on an A100).
# * `float32` with `"tf32"` does reach the tensor cores from `sm_80` on (at TF32's
#   rounding). `minimoe`'s kernels take this as their `PRECISION` argument, and PyTorch's
#   `torch.backends.cuda.matmul.allow_tf32` is the same switch for `torch.matmul`.
# * On an H100, the `HGMMA` count is small (a few per loop iteration) because each one is a
#   `64 × N × 16` product; an `HMMA` is `16 × 8 × 16`, so the A100 code has many more.
# * On a T4 (`sm_75`) every row is `FFMA`. Turing's tensor cores take float16, but the triton
#   this course installs (3.7.1) gives `tl.dot` tensor cores from `sm_80` on only, and Turing
#   has no bfloat16 at all: both kinds of tile are converted to float32 (bfloat16 by integer
#   shifts) and multiplied on the ordinary cores, in twice the registers (the float16 tile of
#   Part A spills). Everything compiles and computes the right numbers on a T4, at float32's
#   speed; `"tf32"` makes no difference there.
#
# ## Part D — your own kernel, 128 bits wide
#
# A transpose is the classic memory-access problem: `out[n, m] = x[m, n]`. One row of `x` is
# contiguous in memory, but it becomes a **column** of `out`. The obvious kernel — one program
# per row, reading along it and writing down a column — reads wide and writes one element at a
# time, each store `stride_om` elements from the last:

# %%
@triton.jit
def transpose_rows_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om, BLOCK_N: tl.constexpr):
    """out[n, m] = x[m, n]: one program per row m of x, BLOCK_N columns at a time."""
    m = tl.program_id(0)
    rn = tl.arange(0, BLOCK_N)
    for n0 in range(0, N, BLOCK_N):
        x = tl.load(x_ptr + m * stride_xm + n0 + rn, mask=n0 + rn < N)
        tl.store(out_ptr + (n0 + rn) * stride_om + m, x, mask=n0 + rn < N)


def transpose_launch(dtype, M, N, stride_xm=None, stride_om=None, blocks=(64, 64), warps=4):
    """(args, kwargs) of a transpose of x [M, N] into out [N, M] for transpose_kernel."""
    t = like(dtype)
    return ((t, t, M, N, stride_xm or N, stride_om or M),
            dict(BLOCK_M=blocks[0], BLOCK_N=blocks[1], num_warps=warps))


_x = harness.randn(37, 53).to(DEVICE)
_out = torch.empty(53, 37, device=DEVICE)
transpose_rows_kernel[(37,)](_x, _out, 37, 53, 53, 37, BLOCK_N=16)
print(f"run on {DEVICE}: correct:", torch.equal(_out, _x.T))
_sass = sass_of(transpose_rows_kernel, (F32, F32, 4096, 4096, 4096, 4096), dict(BLOCK_N=256),
                ARCH)
print(f"transpose_rows_kernel, float32, 4096 × 4096 on {ARCH}:")
show(_sass, "LDG", "STG")

# %% [markdown]
# One 64-bit load (two floats along the row) and two 32-bit stores: every float that goes
# out is a store of its own, and the two floats of a thread land `4 096 · 4` bytes apart. Each
# store instruction of a warp writes its 32 floats into 32 different rows: 32 separate 32-byte
# memory sectors for 128 bytes of data, where a store along a row would fill 4.
#
# The fix is to work on a **2-D tile**: a program loads a `BLOCK_M × BLOCK_N` tile of `x`,
# whose rows are contiguous, and stores it as the `BLOCK_N × BLOCK_M` tile of `out`, whose rows
# are contiguous too. In between the data must change hands between threads (the thread that
# loaded `x[m, n0:n0+4]` does not hold `x[m0:m0+4, n]`); Triton does that for you, through
# shared memory, when the load and the store need different layouts.
#
# ## Exercise 5 — a transpose whose every global access is 128 bits
#
# **Specification.** `transpose_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om, BLOCK_M,
# BLOCK_N)`, with `BLOCK_M` and `BLOCK_N` constexpr powers of two:
#
# * `x` is `[M, N]` with row stride `stride_xm` (elements within a row are contiguous), `out` is
#   `[N, M]` with row stride `stride_om` (larger than `M` in the tests); write
#   `out[n, m] = x[m, n]` for every `m < M`, `n < N`, and nothing else (the tests surround
#   `out` with sentinels and use sizes that are not multiples of the block);
# * the grid is `(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))`: program `(i, j)` owns rows
#   `i·BLOCK_M …` of `x` and columns `j·BLOCK_N …`;
# * compiled for an H100 (`transpose_launch(torch.float32, 4096, 4096)`: sizes and strides
#   multiples of 16, 4 warps, 64 × 64 tiles), **every** global load and store must be 128 bits
#   wide. Check it with `sass_of` and your `read_sass` before you run the test.
#
# Keep the argument order: the tests launch your kernel directly. `tl.program_id`,
# `tl.arange`, `tl.load`, `tl.store`, comparisons and arithmetic are all it needs.
#
# <details><summary>Hint 1: the idea</summary>
#
# Give the program a 2-D tile: a column of row indices `rm[:, None]` and a row of column
# indices `rn[None, :]` make a `[BLOCK_M, BLOCK_N]` block of addresses into `x`, contiguous
# along `n`. For the store, compute the addresses of the same elements in `out`, which is
# contiguous along `m`, from the same two index vectors; the same mask then serves both. The
# compiler sees that the load and the store want different thread layouts and swaps the tile
# through shared memory, which is what makes both 128 bits wide. (`tl.trans(tile)` works too,
# but then the store's pointers and mask must be the transposed `[BLOCK_N, BLOCK_M]` ones.)
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# rm   = program_id(0) * BLOCK_M + arange(BLOCK_M)          # rows of x
# rn   = program_id(1) * BLOCK_N + arange(BLOCK_N)          # columns of x
# mask = (rm[:, None] < M) & (rn[None, :] < N)              # [BLOCK_M, BLOCK_N]
# tile = load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask)
# store(out_ptr + rn[None, :] * stride_om + rm[:, None], tile, mask)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "transpose_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def transpose_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n, m] = x[m, n] for the BLOCK_M × BLOCK_N tile of x this program owns."""
    ### BEGIN SOLUTION
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                   # [BM] rows of x
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN] cols of x
    mask = (rm[:, None] < M) & (rn[None, :] < N)                              # [BM, BN]
    tile = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :], mask=mask)  # [BM, BN]
    tl.store(out_ptr + rn[None, :] * stride_om + rm[:, None], tile, mask=mask)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_transpose_correct", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _launch_transpose(M, N, block_m, block_n, pad_x=0, pad_out=0, seed=0, hint=""):
    """Launch transpose_kernel on x [M, N] (row stride N + pad_x) into out [N, M] (row stride
    M + pad_out) inside a buffer of sentinels; say where it went wrong, if it did, and `hint`
    (the rule the case is there for) when elements of out are wrong."""
    x = harness.randn(M, N + pad_x, seed=seed).to(DEVICE)[:, :N]
    # out is buf[1:N + 1, :M], a view with a row of sentinels before it and one after, so
    # that a store before out's first row, past its last row or past its columns shows
    buf = torch.full((N + 2, M + pad_out), -7.5, device=DEVICE)
    out = buf[1:N + 1, :M]
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    with harness.outputs(buf):                     # the buffer the kernel writes, out in it
        transpose_kernel[grid](x, out, M, N, x.stride(0), out.stride(0), BLOCK_M=block_m,
                               BLOCK_N=block_n)
    where = (f"transpose_kernel[{grid}], x [{M}, {N}] (row stride {x.stride(0)}), out [{N}, "
             f"{M}] (row stride {out.stride(0)}), BLOCK_M={block_m}, BLOCK_N={block_n}")
    bad = (out != x.T).nonzero()
    unwritten = int((out == -7.5).sum())
    if unwritten:
        hint = f"{unwritten} of them never written: program (i, j) of the grid (cdiv(M, " \
               "BLOCK_M), cdiv(N, BLOCK_N)) owns rows i·BLOCK_M... of x and columns " \
               "j·BLOCK_N..." + (f"; {hint}" if hint else "")
    assert bad.numel() == 0, \
        f"{where}: {len(bad)} of {M * N} elements wrong, first out[{bad[0, 0]}, {bad[0, 1]}] = " \
        f"{out[bad[0, 0], bad[0, 1]].item():.4g}, expected x[{bad[0, 1]}, {bad[0, 0]}] = " \
        f"{x[bad[0, 1], bad[0, 0]].item():.4g}" + (f" ({hint})" if hint else "")
    outside = buf.clone()
    outside[1:N + 1, :M] = -7.5
    spill = (outside != -7.5).nonzero()
    if len(spill):
        r, c = spill[0].tolist()
        place = ("in the row before out" if r == 0 else "in the row after out" if r == N + 1
                 else f"past out's last column, in out's row {r - 1}, column {c}")
        raise AssertionError(f"{where}: wrote {len(spill)} element(s) outside out, the first "
                             f"{place} (mask the store)")


_launch_transpose(37, 53, 16, 16)
_launch_transpose(64, 32, 32, 16, pad_x=5, pad_out=3, seed=1,
                  hint="here the rows are padded: x's rows are stride_xm apart and out's "
                       "stride_om apart, and the sizes N and M are not the strides")
print("transpose_kernel transposes, masks its edges and follows the strides")

### BEGIN HIDDEN TESTS
# case: one row
_launch_transpose(1, 70, 16, 32, seed=2)
# case: one column
_launch_transpose(70, 1, 32, 16, seed=3)
# case: blocks larger than the matrix, padded strides
_launch_transpose(5, 7, 64, 64, pad_x=1, pad_out=9, seed=4)
# case: padded rows of x, rectangular blocks
_launch_transpose(100, 48, 16, 64, pad_x=16, seed=5)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_transpose_widths", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import in_learner


# in-process check: the SASS of your transpose_kernel (compiled where your code runs)
def _sass_of_transpose(args, kwargs, arch):
    """sass_of(transpose_kernel, args, kwargs, arch) where your kernel is defined; a refusal
    of the compiler as text starting with "refused: "."""
    try:
        return sass_of(transpose_kernel, args, kwargs, arch)
    except Exception as e:
        return f"refused: {type(e).__name__}: {str(e)[-500:]}"


def _check_wide(dtype, M, N, stride_xm=None, stride_om=None, blocks=(64, 64), warps=4,
                arch="sm_90"):
    args, kwargs = transpose_launch(dtype, M, N, stride_xm, stride_om, blocks, warps)
    where = f"transpose_kernel, {dtype}, x [{M}, {N}], strides {args[4]} / {args[5]}, " \
            f"blocks {blocks}, {warps} warps, on {arch}"
    sass = in_learner(_sass_of_transpose, args, kwargs, arch)
    assert not sass.startswith("refused: "), \
        f"{where}: the compiler refused your kernel: {sass[len('refused: '):]}"
    widths = _expected_reading(sass)
    for kind in ("loads", "stores"):
        assert widths[kind] and set(widths[kind]) == {128}, \
            f"{where}: every global {kind[:-1]} must be 128 bits wide; the SASS has " \
            f"{widths[kind]} ({{bits: instructions}}). Tile in 2-D, contiguous along N for " \
            f"the loads and along M for the stores."


_check_wide(torch.float32, 4096, 4096)
_check_wide(torch.float16, 2048, 512, stride_xm=4096, stride_om=2048)
_check_wide(torch.float32, 1024, 4096, blocks=(32, 64), arch="sm_80")
print("transpose_kernel compiles to 128-bit global loads and stores on an H100 and an A100, "
      "in float32 and float16")

### BEGIN HIDDEN TESTS
# case: bfloat16 on an L4, rectangular tiles
_check_wide(torch.bfloat16, 512, 1024, blocks=(64, 32), arch="sm_89")
# case: padded strides and 8 warps on an A10G
_check_wide(torch.float32, 768, 256, stride_xm=512, stride_om=1024, warps=8, arch="sm_86")
### END HIDDEN TESTS

# %% [markdown]
# What did the compiler do with your tile? The shared memory it asks for is the staging area
# where the threads swap the tile around; and if the sizes stop being multiples of 16, the
# compiler can no longer prove a 16-byte run in bounds, and the widths fall back:

# %%
try:
    for _M, _N in ((4096, 4096), (4096, 1000), (1000, 4096)):
        _c = compile_kernel(transpose_kernel, *transpose_launch(torch.float32, _M, _N), ARCH)
        _w = read_sass(cuobjdump(_c.asm["cubin"], "-sass"))
        _usage = cuobjdump(_c.asm["cubin"], "--dump-resource-usage")
        _shared = int(re.search(r"SHARED:(\d+)", _usage)[1]) + _c.metadata.shared
        print(f"x [{_M}, {_N}]: loads {_w['loads']}, stores {_w['stores']}, "
              f"{read_usage(_usage)['registers']} registers, {_shared} B of shared memory "
              "per block")
except (NotImplementedError, CompilationError):
    print("(finish Exercises 1, 2 and 5 to see your kernel's widths)")

# %% [markdown]
# ## Part E — the roofline: the time a kernel cannot beat
#
# A kernel needs at least the time to move its bytes between DRAM and the chip, and at least
# the time to do its arithmetic at the GPU's peak rate. Whichever is longer bounds it:
#
# $$t \ \ge\ \max\left(\frac{\text{bytes moved}}{\text{bandwidth}},\ \frac{\text{FLOPs}}{\text{peak FLOP/s}}\right)$$
#
# The ratio FLOPs / byte is the kernel's **arithmetic intensity**. Below the GPU's own ratio of
# peak to bandwidth (the "ridge point": 989·10¹² / 3.35·10¹² ≈ 295 FLOP/byte for bfloat16 on an
# H100) a kernel is **memory-bound**, above it **compute-bound**. The peaks, from NVIDIA's
# datasheets (H100 Tensor Core GPU datasheet, SXM5 column; A100 Tensor Core GPU datasheet,
# 80 GB SXM column). The datasheets print the tensor-core figures **with sparsity** (marked
# `*`); the dense numbers below are half of those.
#
# | per second | H100 SXM | A100 SXM 80 GB |
# |---|---|---|
# | DRAM bandwidth (HBM3 / HBM2e) | 3.35 TB/s | 2.039 TB/s |
# | bfloat16 / float16 tensor cores, dense | 989 TFLOP/s | 312 TFLOP/s |
# | TF32 tensor cores, dense | 494.5 TFLOP/s | 156 TFLOP/s |
# | float32, ordinary cores (FFMA) | 67 TFLOP/s | 19.5 TFLOP/s |
#
# The bound is ideal on purpose: it assumes that every byte crosses DRAM once (the caches do
# the rest) and that the arithmetic units never wait. Real kernels get close to one of the two
# lines, never past it; how close is what a profiler tells you on a GPU.
#
# ## Exercise 6 — predict a kernel's time
#
# **Specification.**
#
# * `matmul_cost(M, N, K, in_bytes=2, out_bytes=2)`: the `(FLOPs, bytes)` of
#   `C[M, N] = A[M, K] @ B[K, N]` at the roofline's ideal: `2·M·N·K` FLOPs (one multiply and
#   one add per term), `A` and `B` read once (`in_bytes` per element), `C` written once
#   (`out_bytes`). Python ints.
# * `roofline_time(flops, bytes_moved, gpu="H100 SXM", math="bf16")`: `(seconds, bound)` with
#   the peaks of `PEAKS[gpu]` (`math` one of `"bf16"`, `"tf32"`, `"fp32"`), `bound` the string
#   `"memory"` or `"compute"`, whichever time is the larger (`"compute"` on a tie). The peak is
#   the one of `math`: a float32 `"ieee"` dot runs on `FFMA` and is bounded by `"fp32"`, 67
#   TFLOP/s on an H100, not by the tensor cores' 989. Units are decimal (1 TB/s = 10¹² B/s).
#
# <details><summary>Hint 1: the idea</summary>
#
# Two divisions and a comparison: bytes over bandwidth, FLOPs over the chosen peak, and the
# larger of the two is the bound. Check the visible test's first case by hand: a 4096³
# bfloat16 matmul is 2 · 4096³ = 137 438 953 472 FLOPs and 3 · 4096² · 2 = 100 663 296 bytes,
# so 139 µs of compute against 30 µs of memory on an H100.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# matmul_cost:   return 2*M*N*K, (M*K + K*N) * in_bytes + M*N * out_bytes
# roofline_time: t_mem = bytes_moved / PEAKS[gpu]["bandwidth"]
#                t_cmp = flops / PEAKS[gpu][math]
#                return (t_cmp, "compute") if t_cmp >= t_mem else (t_mem, "memory")
# ```
#
# </details>

# %%
PEAKS = {   # NVIDIA datasheets: bytes/s and dense FLOP/s (tensor-core sparse figures halved)
    "H100 SXM": dict(bandwidth=3.35e12, bf16=989e12, tf32=494.5e12, fp32=67e12),
    "A100 SXM": dict(bandwidth=2.039e12, bf16=312e12, tf32=156e12, fp32=19.5e12),
}


# %% nbgrader={"grade": false, "grade_id": "roofline", "locked": false, "schema_version": 3, "solution": true, "task": false}
def matmul_cost(M: int, N: int, K: int, in_bytes: int = 2, out_bytes: int = 2
                ) -> tuple[int, int]:
    """(FLOPs, bytes moved) of C[M, N] = A[M, K] @ B[K, N]: A, B read once, C written once."""
    ### BEGIN SOLUTION
    return 2 * M * N * K, (M * K + K * N) * in_bytes + M * N * out_bytes
    ### END SOLUTION


def roofline_time(flops: float, bytes_moved: float, gpu: str = "H100 SXM", math: str = "bf16"
                  ) -> tuple[float, str]:
    """(seconds, "memory" | "compute"): the larger of bytes / bandwidth and flops / peak."""
    ### BEGIN SOLUTION
    peak = PEAKS[gpu]
    t_memory = bytes_moved / peak["bandwidth"]
    t_compute = flops / peak[math]
    return (t_compute, "compute") if t_compute >= t_memory else (t_memory, "memory")
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_roofline", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_cost(args, want):
    M, N, K, in_bytes, out_bytes = (*args, 2, 2)[:5]
    got = tuple(matmul_cost(*args))
    why = {M * N * K: "one multiply and one add per term: 2·M·N·K FLOPs",
           (M * K + K * N + M * N) * in_bytes: "C is written at out_bytes per element, A and B "
                                              "read at in_bytes",
           (M * K + K * N) * in_bytes + 2 * M * N * out_bytes: "C is written once, not read"}
    hint = next((why[v] for v, w in zip(got, want, strict=False) if v != w and v in why), "")
    assert got == want and all(isinstance(v, int) for v in got), \
        f"matmul_cost{args}: expected {want} (ints), got {got}" + (f": {hint}" if hint else "")


def _check_time(flops, nbytes, gpu, math, want_s, want_bound):
    got = roofline_time(flops, nbytes, gpu, math)
    assert isinstance(got, tuple) and len(got) == 2, \
        f"roofline_time must return (seconds, bound), got {got!r}"
    t_memory, t_compute = nbytes / PEAKS[gpu]["bandwidth"], flops / PEAKS[gpu][math]
    hint = ""
    if t_memory == t_compute and got[1] != "compute":
        hint = "a tie: both times are equal here (the ridge point), and the specification " \
               "calls a tie 'compute'"
    elif math != "bf16" and abs(got[0] - flops / PEAKS[gpu]["bf16"]) <= 1e-9 * got[0]:
        hint = f"use the peak of math, PEAKS[gpu][{math!r}], not the bf16 tensor cores'"
    elif got[0] and abs(got[0] - min(t_memory, t_compute)) <= 1e-9 * got[0]:
        hint = "the bound is the larger of the two times, not the smaller"
    assert abs(got[0] - want_s) <= 1e-9 * want_s and got[1] == want_bound, \
        f"roofline_time({flops:.4g} FLOPs, {nbytes:.4g} bytes, {gpu!r}, {math!r}): expected " \
        f"({want_s:.6g} s, {want_bound!r}), got ({got[0]:.6g} s, {got[1]!r})" + \
        (f": {hint}" if hint else "")


# 4096³ in bfloat16: 2·4096³ FLOPs; 3 matrices of 4096² · 2 bytes
_check_cost((4096, 4096, 4096), (137_438_953_472, 100_663_296))
_check_cost((1, 14336, 4096, 2, 4), (117_440_512, 117_506_048))      # a GEMV, fp32 out
_check_time(137_438_953_472, 100_663_296, "H100 SXM", "bf16", 137_438_953_472 / 989e12,
            "compute")                                              # 139 µs; memory 30 µs
_check_time(117_440_512, 117_506_048, "A100 SXM", "bf16", 117_506_048 / 2.039e12, "memory")
# the peak of `math`: float32 without tensor cores is bounded by 67 TFLOP/s, not 989
_check_time(137_438_953_472, 201_326_592, "H100 SXM", "fp32", 137_438_953_472 / 67e12,
            "compute")                                              # 2051 µs
# on the ridge point both times are 2 s: a tie, which is "compute"
_check_time(2 * 989e12, 2 * 3.35e12, "H100 SXM", "bf16", 2.0, "compute")
print("matmul_cost and roofline_time agree with the hand-computed cases")

### BEGIN HIDDEN TESTS
# case: a matrix-vector product
_check_cost((8192, 1, 64), (1_048_576, 1_065_088))
# case: a small odd-sized product
_check_cost((3, 5, 7, 4, 4), (210, 4 * (21 + 35 + 15)))
# case: A100, tf32
_check_time(137_438_953_472, 201_326_592, "A100 SXM", "tf32", 137_438_953_472 / 156e12, "compute")
# case: H100, fp32
_check_time(1e9, 1e9, "H100 SXM", "fp32", 1e9 / 3.35e12, "memory")
# case: H100, bf16, few bytes
_check_time(3.35e12 * 2, 2.0, "H100 SXM", "bf16", 3.35e12 * 2 / 989e12, "compute")
# case: A100, tf32, on the ridge point
_check_time(3 * 156e12, 3 * 2.039e12, "A100 SXM", "tf32", 3.0, "compute")  # the ridge: a tie
### END HIDDEN TESTS

# %% [markdown]
# ### Your kernels on the roofline
#
# Now predict, with your functions, the kernels of this course at the sizes of a real model,
# and let the compiler say which ceiling applies to each. The `scatter2scatter` kernel (Lab 08,
# in `minimoe`'s version) on Mixtral-8x7B's expert projection `w1` (`E = 8` experts of
# `4096 × 14336`, top-2 routing):
#
# * in a training step of 4 096 tokens, every expert gets about a thousand rows: 8 192 rows of
#   `x` gathered, all 8 weights read, 8 192 rows of output written;
# * decoding one token, only the 2 experts it was routed to have rows, so only their weights
#   are read, for two rows of output.
#
# Lab 03's dequantization of the same weight (NF4, blocksize 64, to bfloat16) has almost no
# arithmetic: half a byte and a share of a float32 scale in, two bytes out per element.

# %%
try:
    T, k, E, D, H = 4096, 2, 8, 4096, 14336

    def _moe(rows, experts):
        """(FLOPs, bytes) of the expert linear: rows of x in, experts' W read, rows out."""
        return 2 * rows * D * H, 2 * (rows * D + experts * D * H + rows * H)

    _n = E * D * H
    kernels = {
        "matmul 4096³, bf16": matmul_cost(4096, 4096, 4096),
        "matmul 4096³, fp32 (ieee: FFMA)": matmul_cost(4096, 4096, 4096, 4, 4),
        "scatter2scatter, 4096 tokens": _moe(T * k, E),
        "scatter2scatter, 1 token": _moe(k, k),
        "NF4 dequant of w1 -> bf16": (6 * _n, _n // 2 + 4 * _n // 64 + 2 * _n),
    }
    maths = {"matmul 4096³, fp32 (ieee: FFMA)": "fp32"}
    print(f"{'kernel':<34}{'FLOP/byte':>10}{'H100 SXM':>22}{'A100 SXM':>22}")
    for name, (flops, nbytes) in kernels.items():
        cells = []
        for gpu in PEAKS:
            secs, bound = roofline_time(flops, nbytes, gpu, maths.get(name, "bf16"))
            cells.append(f"{secs * 1e6:9.1f} µs {bound:>7}")
        print(f"{name:<34}{flops / nbytes:>10.1f}" + "".join(f"{c:>22}" for c in cells))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    _x = [2 ** (e / 4) for e in range(-8, 57)]                    # FLOP/byte, 0.25 ... 16384
    for gpu, style in zip(PEAKS, ("-", "--"), strict=True):
        for math, color in (("bf16", "tab:blue"), ("tf32", "tab:green"), ("fp32", "tab:orange")):
            peak, bw = PEAKS[gpu][math], PEAKS[gpu]["bandwidth"]
            ax.plot(_x, [min(peak, i * bw) / 1e12 for i in _x], style, color=color, lw=1.2,
                    label=f"{gpu}, {math}")
    for (name, (flops, nbytes)), below in zip(kernels.items(), (False, False, True, True, True),
                                              strict=True):
        secs, _ = roofline_time(flops, nbytes, "H100 SXM", maths.get(name, "bf16"))
        ax.plot(flops / nbytes, flops / secs / 1e12, "ko", ms=5)
        ax.annotate(name, (flops / nbytes, flops / secs / 1e12), fontsize=7,
                    xytext=(4, -11 if below else 5), textcoords="offset points")
    ax.set_ylim(0.3, 3000)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of DRAM traffic)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title("Roofline: H100 SXM (solid) and A100 SXM (dashed); the kernels on the H100",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    plt.show()
except NotImplementedError:
    print("(finish Exercise 6 to predict the times)")

# %% [markdown]
# The dequantization's FLOPs are a generous count (a few integer and float operations per
# element): at under 3 FLOP/byte it is memory-bound on any GPU, as Lab 03 argued. Decoding one
# token is memory-bound too: the kernel's whole time is reading two experts' weights, which is
# why quantizing those weights speeds decoding up. The training step and the large matmul are
# compute-bound, and there the instruction decides the ceiling: the same float32 matmul is
# bounded by 67 TFLOP/s with `FFMA` and by 494.5 with TF32 tensor cores.
#
# The prediction uses the bfloat16 peak for the MoE kernel only if the kernel really runs on
# the tensor cores. The compiler says so: here is `minimoe`'s `scatter2scatter` kernel (Lab 08)
# compiled as a bfloat16 launch on the Mixtral shapes would compile it on an H100, read with
# your `read_sass`.

# %% tags=["jupyter-only"]
import minimoe.kernels  # noqa: E402

S2S = harness.reference("08-moe-forward-kernel")["scatter2scatter_kernel"]
_B, _I = like(torch.bfloat16), like(torch.int64)
D, H = 4096, 14336                    # x [T, D] in slot order, W [E, D, H], y [T·k, H]
_launch = dict(X=_B, W=_B, Y=_B, expert_ids=_I, scattered_ids=_I, tile_start=_I, tile_end=_I,
               K=D, N=H, sxm=D, sxk=1, swe=D * H, swk=H, swn=1, sym=H, syn=1,
               A=_B, B=_B, R=16, scaling=2.0, sar=D, sak=1, sbn=16, sbr=1,      # LoRA: unused
               FAN_OUT=2, X_GROUPED=False, Y_GROUPED=False, HAS_LORA=False, PRECISION="ieee",
               BLOCK_M=minimoe.kernels.TILE_M, BLOCK_N=128, BLOCK_K=64, BLOCK_R=16,
               num_warps=8, num_stages=3)
_r = inspect_kernel(S2S, (), _launch, "sm_90")
print(f"scatter2scatter, bf16, {_launch['BLOCK_M']}×128×64 tiles, 8 warps, on sm_90: "
      f"{_r.registers} registers, {_r.spill_bytes} B spilled, {_r.shared_bytes} B of shared "
      f"memory, occupancy {_r.occupancy:.3f}")
try:
    _w = read_sass(sass_of(S2S, (), _launch, "sm_90"))
    print(f"  your read_sass: loads {_w['loads']}, stores {_w['stores']}, "
          f"{_w['tensor_core']} tensor-core instructions (HGMMA), {_w['local']} LDL/STL")
except NotImplementedError:
    print("(finish Exercise 1 to read its SASS)")
print(f"\nthis notebook ran in {time.perf_counter() - STARTED:.0f} s (kernel start to here)")

# %% [markdown]
# The `64`-bit loads are the `int64` routing indices; the `128`-bit ones the asynchronous
# copies of `x` and `W` tiles into shared memory; the output leaves in 128-bit stores; the
# products are `HGMMA`s. So the bfloat16 tensor-core ceiling is the right one for the training
# step. Whether the kernel gets near it is a question for a GPU: `benchmarks/bench_moe.py` times
# it there.
#
# ## Where this goes next
#
# Every kernel in this course can now be read this way before it ever meets a GPU: after
# changing a tile size or `num_warps`, compile for the GPUs it will run on (`ARCH`, `sm_80`,
# `sm_90`, ...), check registers, spills, widths and the dot's instruction, and put the kernel
# on the roofline. On a GPU, NVIDIA Nsight Compute reports the same numbers measured (achieved
# occupancy, bytes moved, the share of peak reached), and `triton.testing.do_bench` times the
# kernel; the prediction says what the measurement should be compared with.
#
# ### Reflection
#
# 1. Lab 03's kernel loads its packed codes 8 bytes per thread (64-bit loads, at 1 024 bytes
#    over 4 warps). How would you make them 128-bit, and what would it cost in registers and in
#    the number of programs for a small weight? Try it with `inspect_kernel` on
#    `harness.reference("03-triton-dequant")["nf4_dequant_kernel"]`.
# 2. The float32 `128 × 128` tile spills with 4 warps and not with 8. Which numbers of the
#    occupancy formula changed between the two, and why is the 8-warp version still at one
#    block per SM?
# 3. Why does a spill cost more inside the `k` loop than before it or after it? Look for where
#    the `LDL`/`STL` instructions of the spilling tile sit in its SASS.
# 4. The roofline says a 1-token decode step through the MoE layer takes the time of reading
#    two experts. How much faster would it be with the experts stored in NF4 and dequantized
#    inside the matmul kernel, and what would then limit it?
# 5. Your transpose reaches 128-bit accesses by staging the tile in shared memory. What would
#    happen to the stores if `BLOCK_M` were 2 for float32? Predict the width, then compile it.

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. A thread issues one 128-bit load when it owns 16 contiguous bytes of codes: double `BYTES`
#    to 2048 at 4 warps, or keep 1024 bytes over 2 warps. Compiled for sm_90 with bfloat16
#    output (`inspect_kernel` on `_nf4_dequant_kernel`, `M = 4096 · 14336`), the code load goes
#    from one `LDG.E.64` to one `LDG.E.128` either way, registers rise from 32 to 56 (each
#    thread now decodes 32 values), occupancy falls from 1.0 to 0.5625, and the per-element
#    gathers from the code table stay 32-bit (32 of them become 64). Each program covers twice
#    the weight, so a 512 × 512 weight (131 072 packed bytes) gets 64 programs instead of 128:
#    fewer than the H100's 132 SMs, which leaves half of them idle on a kernel that is only
#    memory-bound if it keeps every SM busy.
# 2. With 4 warps the tile takes 255 registers: 255 · 32 rounds up to 8 192 per warp, so
#    each sub-partition's 16 384 registers hold 2 warps, 8 an SM, 2 blocks; and its 65 536 B
#    of shared memory (plus 1 KiB) also allow 2 blocks on an A100: 2 · 4 = 8 warps, 0.125.
#    With 8 warps the registers per thread drop to 166 (the accumulator, the operand strips
#    and the addresses are spread over twice the threads): 5 312 round up to 5 376 per warp,
#    3 warps a sub-partition, 12 an SM, and 12 // 8 = 1 block of 8 warps, again 0.125. What
#    changed are the registers per thread and the warps per block; the register term stays
#    the limit, because a block of 8 warps at 166 registers (43 008) still needs more than half
#    the register file. (Figures of triton 3.7.1, the version the course installs; the
#    reasoning holds for whatever your table shows.)
# 3. In the SASS of the `128 × 128 × 32`, 4-warp tile on sm_80 (triton 3.7.1), the `K` loop is
#    the code between the backward branch at `0x13cb0` and its target `0x1ad0`. Its 16 local
#    instructions split in two: 8 `STL.64` before the loop store eight 64-bit values (register
#    pairs: addresses) once per program, and 8 `LDL.64` inside the loop read them back at
#    every iteration, 128 times for `K = 4096`: about 1 000 local loads per thread, not 16.
#    Spill bytes alone (64) do not say this; where the spill code sits decides whether it
#    costs a few percent or dominates the loop.
# 4. In bfloat16 the two experts' `w1` weights are 2 · 4096 · 14336 · 2 B = 235 MB, 70.1 µs at
#    3.35 TB/s. In NF4 they are 0.5 B per weight plus a float32 absmax per 64 (0.0625 B), 66 MB,
#    about 19.7 µs: 3.6 times faster (18.1 µs, 3.9 times, with double quantization). It stays
#    memory-bound: about 3.6 FLOP per byte, far below the H100's ridge of 295. What comes next
#    is the dequantization arithmetic on the ordinary cores: a handful of integer and float
#    operations per weight, about 0.7 GFLOP at 67 TFLOP/s, some 10 µs, which the kernel must
#    overlap with the loads to stay at the memory bound; and at 20 µs, a kernel launch's few
#    microseconds start to count too.
# 5. With `BLOCK_M = 2` a row of the stored tile holds 2 floats, 8 contiguous bytes, so a store
#    can be at most 64 bits wide. Compiled on sm_90 (4 warps, `x [4096, 4096]`): with
#    `BLOCK_N = 64` the tile has 128 elements for 128 threads, one each, and both loads and
#    stores fall to 32 bits; with `BLOCK_N = 256` the loads are 128-bit and the stores two
#    `STG.E.64`. The shared-memory staging can only make an access as wide as the contiguous
#    run on its side of the tile.
