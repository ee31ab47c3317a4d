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
# # Lab 03 — NF4 dequantization in Triton, whole or expert by expert
#
# In Lab 02 you stored a weight as NF4: two 4-bit codes a byte plus one float32 scale per
# block. Before a matrix product can use it, the weight must be turned back into floats, and
# this happens at **every forward and backward pass** of a QLoRA model. That makes
# dequantization one of the hot loops of QLoRA, and it is small enough to write as your first
# GPU kernel. In this lab you write it in [Triton](https://triton-lang.org), then a variant
# that dequantizes only the experts of a Mixture-of-Experts weight that a batch actually uses.
#
# | # | you write | what it teaches |
# |---|---|---|
# | 1 | `axpy_kernel` + `axpy(alpha, x, y)` | programs, blocks, offsets, **masks**, launching |
# | 2 | `unpack_nibbles_kernel` + `my_unpack_nibbles(packed, n)` | integer bit work inside a kernel |
# | 3 | `nf4_dequant_kernel` + `my_dequantize_nf4(q)` | the whole NF4 dequant: codes, table lookup, block scales |
# | 4 | `selective_dequant_kernel` + `my_selective_dequantize(q, active)` | gather by expert id: read only what you need |
# | 5 | `dequant_traffic(shape, ...)` | bytes moved, GB/s, why dequant is memory-bound |
#
# **No GPU needed.** Triton kernels normally compile for an NVIDIA GPU. Triton also ships an
# *interpreter* that runs the same kernel source on the CPU with NumPy, one program after
# another: switched on by the environment variable `TRITON_INTERPRET=1`, which must be set
# **before** `import triton`. The setup cell does that when no CUDA GPU is present; on a GPU
# the very same kernels run compiled. The interpreter is slow (it is for correctness, not
# speed), so every test here uses small shapes: a few thousand elements at most.
#
# **How to work.** Run the cells from top to bottom. Where you see `raise NotImplementedError()`,
# replace it with your code. Each exercise states its **specification** first (arguments,
# output, the rules that matter, what is off-limits), which is enough to solve it; below it,
# folded **hints** go from the idea to pseudocode, for when you want them. Each exercise is
# followed by a test cell that prints what was expected and what came when it fails; among
# other things, the tests check that your wrappers really launch your kernels and do not call
# the reference implementations in `miniquant`. Grading runs more (hidden) checks of the same
# specification. The whole notebook runs in <!-- runtime:03-triton-dequant -->about 4 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import os
import time

import torch

from course.notebook.harness import require_triton

require_triton("03-triton-dequant")   # no triton (its wheels are Linux-only): say where to run

# The interpreter must be chosen before triton is imported: @triton.jit decides at decoration
# time whether a function is compiled or interpreted, and the helpers in triton.language
# (tl.interleave, tl.cdiv, ...) are decorated when triton itself is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import triton
import triton.language as tl

import miniquant
import miniquant.triton_dequant
from course.notebook import harness
from miniquant import NF4_CODE, NF4Weight, dequantize_nf4, quantize_nf4
from miniquant.nf4 import pack_nibbles, unpack_nibbles

INTERPRET, DEVICE = harness.triton_setup()   # one CPU thread, seed 0, and where kernels run

# %% [markdown]
# ## Part A — Triton in five minutes
#
# A Triton kernel is a Python function decorated with `@triton.jit`. You launch it on a
# **grid** of *programs*: `kernel[grid](args...)` with `grid = (g0,)` or `(g0, g1)`. Every
# program runs the same code; `tl.program_id(axis)` tells it which one it is. Unlike CUDA,
# where you write what **one thread** does, a Triton program works on whole **blocks**
# (small arrays) at once:
#
# * `tl.arange(0, BLOCK)` is the block `[0, 1, ..., BLOCK-1]`; `BLOCK` must be a power of two
#   and a compile-time constant (annotate the parameter `BLOCK: tl.constexpr`).
# * Tensors arrive as **pointers** to their first element. `ptr + offsets` is a block of
#   pointers; `tl.load(ptrs, mask=..., other=...)` reads them, `tl.store(ptrs, values,
#   mask=...)` writes. No bounds checks are done for you: the **mask** is the bounds check.
# * Arithmetic on blocks is element-wise, with NumPy-like broadcasting; `tl.where`,
#   `>>`, `&`, `.to(dtype)` work as you would expect.
#
# The usual 1-D pattern: program `p` handles elements `p*BLOCK ... p*BLOCK + BLOCK - 1`, and
# you launch `triton.cdiv(n, BLOCK)` programs. When `n` is not a multiple of `BLOCK`, the last
# program's block runs past the end of the tensor, and its out-of-range lanes must be masked
# off, on the loads *and* on the store.
#
# The kernel below writes, for each element, the id of the program that wrote it. Run it and
# look at how 10 elements are cut into blocks of 4.

# %%
@triton.jit
def whoami_kernel(out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)          # this program's element offsets
    mask = offs < n                                   # lanes past the end do nothing
    tl.store(out_ptr + offs, pid + tl.zeros([BLOCK], dtype=tl.int32), mask=mask)


n, BLOCK = 10, 4
owner = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
grid = (triton.cdiv(n, BLOCK),)
whoami_kernel[grid](owner, n, BLOCK=BLOCK)
print(f"n = {n}, BLOCK = {BLOCK}, grid = {grid}")
print("program that wrote each element:", owner.tolist())

# %% [markdown]
# **Interpreter facts worth knowing** (they come back in the pitfalls of the guide):
#
# * Keep the arithmetic in **float32**. The interpreter computes with NumPy and has no
#   bfloat16 arithmetic; a kernel that computes in float32 and converts only at the store
#   behaves the same interpreted and compiled.
# * It is slow: every program is a step of a Python loop over NumPy arrays, so the cost grows
#   with the number of programs. Prefer fewer, larger blocks (a `BLOCK` of 1024 in the
#   wrappers) and small test shapes.
# * An exception inside a kernel (a typo, a shape mismatch) is raised as a Python exception
#   with a traceback that points into your kernel. Compiled kernels are stricter: there the
#   same mistake is a compile error.
#
# ## Exercise 1 — `axpy`: the masked element-wise kernel
#
# **Specification.**
#
# * `axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr)`: program `p`
#   computes `out[i] = alpha * x[i] + y[i]` for every `i` in `p*BLOCK ... p*BLOCK + BLOCK - 1`
#   with `i < n`, and must not read or write any element at `i >= n`. The tests launch your
#   kernel themselves with their own `BLOCK` and check that memory past `n` is left untouched.
# * The wrapper `axpy(alpha, x, y, block=1024)` raises `ValueError` unless `x` and `y` are
#   float32 tensors of the same shape on the same device; works on contiguous copies
#   (`.contiguous()`: the kernel assumes element `i` sits at `ptr + i`, which is false for,
#   say, a transposed tensor); allocates the output, launches `axpy_kernel` on a grid of
#   `triton.cdiv(n, block)` programs, and returns a tensor of `x`'s shape.
# * The arithmetic happens in the kernel: the wrapper uses `torch` only to check, allocate
#   and reshape (the tests check that it launches `axpy_kernel`).
#
# <details><summary>Hint 1: the idea</summary>
#
# Start from `whoami_kernel` above: it already computes the offsets of a program and the
# mask. Load `x` and `y` at those offsets with the same mask (give `other=0.0` for the masked
# lanes), compute, and store with the mask. In the wrapper, `torch.empty_like(x)` allocates
# an output of the same shape; a contiguous output can be handed to the kernel as it is.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# kernel:  offs = program_id(0) * BLOCK + arange(0, BLOCK);  mask = offs < n
#          x = load(x_ptr + offs, mask, other=0);  y = load(y_ptr + offs, mask, other=0)
#          store(out_ptr + offs, alpha * x + y, mask)
# wrapper: check dtypes, shapes, devices (ValueError);  x, y = contiguous copies
#          out = empty like x;  axpy_kernel[(cdiv(n, block),)](x, y, out, alpha, n, BLOCK=block)
#          return out
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "axpy", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    """out[i] = alpha * x[i] + y[i] for i in this program's block, i < n."""
    ### BEGIN SOLUTION
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, alpha * x + y, mask=mask)
    ### END SOLUTION


def axpy(alpha: float, x: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """alpha * x + y computed by axpy_kernel; x and y float32 of one shape."""
    ### BEGIN SOLUTION
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    if x.shape != y.shape or x.device != y.device:
        raise ValueError(f"x and y must share shape and device: {tuple(x.shape)} on {x.device} "
                         f"vs {tuple(y.shape)} on {y.device}")
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    axpy_kernel[(triton.cdiv(n, block),)](x, y, out, alpha, n, BLOCK=block)
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_axpy", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Helpers used by this and the later test cells. While a test runs your code inside
# `_no_reference()`, miniquant's dequantization and unpacking raise if reached (under any name).
_REFERENCE = [(harness.resolve(_path.rpartition(".")[0]), _path.rpartition(".")[2])
              for _path in miniquant.REFERENCE["03-triton-dequant"].values()]


def _no_reference(*yours):
    """harness.forbid(...) of the references, and of the functions of yours in `yours`."""
    return harness.forbid([*_REFERENCE, *yours], globals(),
                  why="this exercise must be done with your own kernel, without it")


def _launches(kernel, call, what):
    """With `kernel` switched off, call() must fail by reaching it: `what` launches it."""
    harness.must_reach([kernel], call, f"{what} did not launch its kernel: the work must "
                       "happen in the kernel", globals())


def _rejects(what, call):
    """call() must raise ValueError; `what` names the call and the input it got."""
    try:
        call()
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as e:
        raise AssertionError(f"{what}: expected ValueError, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: expected ValueError, nothing was raised")


def _check_axpy(n_or_shape, alpha=2.5, seed=0):
    shape = (n_or_shape,) if isinstance(n_or_shape, int) else n_or_shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(DEVICE)
    y = torch.randn(shape, generator=g).to(DEVICE)
    want = alpha * x + y                           # before the call: it may not move it
    got = axpy(alpha, x, y)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, \
        f"axpy on shape {tuple(shape)}: expected a tensor of shape {tuple(want.shape)}, got " \
        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
    full = want.numel() // 1024 * 1024             # elements in whole blocks of the default 1024
    flat, flat_want = got.reshape(-1), want.reshape(-1)
    why = " (the last, partial block was not computed: launch triton.cdiv(n, block) programs)" \
        if torch.allclose(flat[:full], flat_want[:full]) \
        and not torch.allclose(flat[full:], flat_want[full:]) else ""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"axpy({alpha}, x, y), shape {tuple(shape)}{why}:\n{m}")


def _launch_axpy(n, BLOCK, alpha=-1.5, extra_programs=0, seed=1):
    """Launch axpy_kernel directly on buffers longer than n; what lies past n must survive."""
    g = torch.Generator().manual_seed(seed)
    pad = BLOCK + 3
    x = torch.randn(n + pad, generator=g).to(DEVICE)
    y = torch.randn(n + pad, generator=g).to(DEVICE)
    out = torch.full((n + pad,), 1234.5, device=DEVICE)
    grid = (triton.cdiv(n, BLOCK) + extra_programs,)
    want = alpha * x[:n] + y[:n]
    with harness.outputs(out):                     # the buffer the kernel writes
        axpy_kernel[grid](x, y, out, alpha, n, BLOCK=BLOCK)
    where = f"axpy_kernel[{grid}](..., n={n}, BLOCK={BLOCK})"
    torch.testing.assert_close(out[:n], want, rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{where}, elements 0..n-1:\n{m}")
    touched = (out[n:] != 1234.5).nonzero().flatten()
    assert touched.numel() == 0, \
        f"{where} wrote past the end: out[n + {touched[:5].tolist()}] changed " \
        f"(expected the sentinel 1234.5, got {out[n:][touched[:5]].tolist()}). Mask the store."


# The kernel first, launched directly on buffers with sentinels past n: an unmasked store
# fails here with a message (through the wrapper it would write past the end of a tensor).
_launch_axpy(7, BLOCK=4)
_launch_axpy(10, BLOCK=16)       # one program, most of its lanes masked
for _n in (1, 7, 1000):          # 7 and 1000 are not multiples of any power-of-two block
    _check_axpy(_n)
# a transposed (non-contiguous) input: the wrapper makes contiguous copies
_x = torch.randn(6, 3).to(DEVICE).T
_y = torch.randn(3, 6).to(DEVICE)
_want = 2.0 * _x + _y
torch.testing.assert_close(axpy(2.0, _x, _y), _want, rtol=1e-6, atol=1e-6,
                           msg=lambda m: "axpy with a transposed x: the kernel assumes element "
                                         f"i at ptr + i, so pass .contiguous() copies:\n{m}")
# inputs the wrapper must refuse
_rejects("axpy with float64 x and y", lambda: axpy(
    1.0, torch.zeros(3, dtype=torch.float64, device=DEVICE),
    torch.zeros(3, dtype=torch.float64, device=DEVICE)))
_rejects("axpy with shapes (3,) and (4,)", lambda: axpy(
    1.0, torch.zeros(3, device=DEVICE), torch.zeros(4, device=DEVICE)))
# the arithmetic happens in the kernel: the wrapper launches axpy_kernel
_launches(axpy_kernel, lambda: _check_axpy(50, seed=4), "axpy")
print("axpy matches alpha * x + y, and the kernel leaves memory past n alone")

### BEGIN HIDDEN TESTS
# case: axpy through the wrapper, several sizes and alphas
_check_axpy(4096, alpha=0.0)
_check_axpy((13, 11), alpha=-3.25, seed=2)
_check_axpy(1, alpha=1e-3, seed=3)
# case: the kernel launched directly, lanes past n masked
for _n, _b in ((1, 16), (33, 16), (1000, 64), (1024, 128)):
    _launch_axpy(_n, BLOCK=_b, seed=_n)
_launch_axpy(20, BLOCK=8, extra_programs=2)   # whole programs beyond n: all lanes masked
# case: a transposed (non-contiguous) input
_x = torch.randn(9, 5).to(DEVICE).T
_y = torch.randn(5, 9).to(DEVICE)
torch.testing.assert_close(axpy(0.5, _x, _y), 0.5 * _x + _y, rtol=1e-6, atol=1e-6,
                           msg=lambda m: f"axpy with a transposed x (use .contiguous()):\n{m}")
# case: inputs the wrapper must refuse
for _bad in ((torch.zeros(3), torch.zeros(4)), (torch.zeros(3, dtype=torch.float64),) * 2,
             (torch.zeros(2, 3), torch.zeros(3, 2))):
    try:
        axpy(1.0, *(t.to(DEVICE) for t in _bad))
    except ValueError:
        pass
    else:
        raise AssertionError(f"axpy accepted x {_bad[0].dtype}{tuple(_bad[0].shape)} and "
                             f"y {_bad[1].dtype}{tuple(_bad[1].shape)}; expected ValueError")
# case: the wrapper launches the kernel
_launches(axpy_kernel, lambda: _check_axpy(100, seed=5), "axpy")
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 2 — unpacking nibbles inside a kernel
#
# NF4 stores two 4-bit codes in each byte, in bitsandbytes' order: element `2i` in the **high**
# nibble of byte `i`, element `2i+1` in the **low** nibble; an odd count leaves a pad nibble in
# the low half of the last byte. For example:
#
# ```
# packed bytes   0x12        0xAB        0x70
# codes          1,  2       10, 11      7, (pad)        n = 5
# ```
#
# **Specification.**
#
# * `unpack_nibbles_kernel(packed_ptr, codes_ptr, n, BLOCK: tl.constexpr)`: program `p`
#   writes the codes of elements `p*BLOCK ... p*BLOCK + BLOCK - 1` (those `< n`) into the
#   uint8 output `codes_ptr`, element `j` being the high nibble of byte `j // 2` when `j` is
#   even and its low nibble when `j` is odd. `BLOCK` is an even power of two. The pad nibble
#   of an odd count must not be written (the tests put sentinels past `n`).
# * `my_unpack_nibbles(packed, n, block=1024)` raises `ValueError` unless `packed` is a 1-D
#   uint8 tensor of exactly `ceil(n / 2)` bytes with `n >= 1`, launches your kernel, and
#   returns the `n` codes as a uint8 tensor of shape `[n]`.
#
# Off-limits: the reference, `miniquant.nf4.unpack_nibbles`, is what the tests compare you
# with; it is switched off while your wrapper runs.
#
# <details><summary>Hint 1: the idea</summary>
#
# Two ways to get there; either is fine:
#
# * **element-major**: for each element offset `j`, load byte `j // 2` and pick its high or
#   low nibble with `tl.where(j % 2 == 0, b >> 4, b & 15)` (every byte is loaded twice, but
#   the second load hits the cache);
# * **byte-major**: load the program's `BLOCK // 2` bytes once, and lay out the high and low
#   nibbles in element order with `tl.interleave(b >> 4, b & 15)`.
#
# Either way, mask on the *element* count `n`, not on the byte count, or the pad nibble of
# an odd `n` is written.
#
# </details>
#
# <details><summary>Hint 2: pseudocode (element-major)</summary>
#
# ```text
# kernel:  j = program_id(0) * BLOCK + arange(0, BLOCK);  mask = j < n
#          b = load(packed_ptr + j // 2, mask, other=0)
#          store(codes_ptr + j, uint8(where(j % 2 == 0, b >> 4, b & 15)), mask)
# wrapper: check n >= 1, packed 1-D uint8 with (n + 1) // 2 bytes (ValueError)
#          codes = empty(n, uint8);  launch on cdiv(n, block) programs;  return codes
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "unpack_nibbles", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def unpack_nibbles_kernel(packed_ptr, codes_ptr, n, BLOCK: tl.constexpr):
    """codes[j] = high nibble of packed[j // 2] if j is even, else its low nibble; j < n."""
    ### BEGIN SOLUTION
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = j < n
    b = tl.load(packed_ptr + j // 2, mask=in_range, other=0)
    code = tl.where(j % 2 == 0, b >> 4, b & 15)
    tl.store(codes_ptr + j, code.to(tl.uint8), mask=in_range)
    ### END SOLUTION


def my_unpack_nibbles(packed: torch.Tensor, n: int, block: int = 1024) -> torch.Tensor:
    """uint8 [ceil(n/2)] packed codes -> uint8 [n] codes, high nibble first."""
    ### BEGIN SOLUTION
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError("packed must be a 1-D uint8 tensor")
    if packed.numel() != (n + 1) // 2:
        raise ValueError(f"{n} codes need {(n + 1) // 2} bytes, got {packed.numel()}")
    packed = packed.contiguous()
    codes = torch.empty(n, dtype=torch.uint8, device=packed.device)
    unpack_nibbles_kernel[(triton.cdiv(n, block),)](packed, codes, n, BLOCK=block)
    return codes
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_unpack_nibbles", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _random_packed(n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n,), dtype=torch.uint8, generator=g)
    return codes, pack_nibbles(codes)


def _check_unpack(n, seed=0, garbage_pad=False):
    codes, packed = _random_packed(n, seed)
    if garbage_pad and n % 2:
        packed[-1] |= 0x0D                 # whatever the pad nibble holds is not a code
    want = unpack_nibbles(packed, n)
    assert torch.equal(want, codes)
    got = my_unpack_nibbles(packed.to(DEVICE), n)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got.shape == (n,), \
        f"my_unpack_nibbles(..., n={n}): expected a uint8 tensor of shape ({n},), got " \
        f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}"
    got = got.cpu()
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, \
        f"my_unpack_nibbles(..., n={n}) differs from unpack_nibbles at {bad.numel()} positions, " \
        f"first j = {bad[:6].tolist()}: expected {want[bad[:6]].tolist()}, got " \
        f"{got[bad[:6]].tolist()} (bytes {[hex(b) for b in packed[bad[:6] // 2].tolist()]})"


def _launch_unpack(n, BLOCK, seed=1):
    codes, packed = _random_packed(n, seed)
    out = torch.full((n + BLOCK + 2,), 0xEE, dtype=torch.uint8, device=DEVICE)
    grid = (triton.cdiv(n, BLOCK),)
    with harness.outputs(out):
        unpack_nibbles_kernel[grid](packed.to(DEVICE), out, n, BLOCK=BLOCK)
    out = out.cpu()
    where = f"unpack_nibbles_kernel[{grid}](..., n={n}, BLOCK={BLOCK})"
    swapped = torch.stack([packed & 15, packed >> 4], 1).reshape(-1)[:n]
    why = " (the nibbles are swapped: even j takes the high nibble, b >> 4)" \
        if torch.equal(out[:n], swapped) else ""
    assert torch.equal(out[:n], codes), \
        f"{where}: expected codes {codes[:12].tolist()}..., got {out[:12].tolist()}...{why}"
    assert (out[n:] == 0xEE).all(), \
        f"{where} wrote past n: out[n:n+4] = {out[n:n + 4].tolist()}, expected [238, ...]" + (
            " (the pad nibble of an odd n was written: mask on the element count n, not on "
            "the byte count)" if n % 2 and (out[n + 1:] == 0xEE).all() else "")


_launch_unpack(7, BLOCK=4)            # odd count: the pad nibble must not be written
# worked by hand: 0x12 0xAB 0x70 -> 1, 2, 10, 11, 7 (the pad nibble of 0x70 is dropped)
_hand = my_unpack_nibbles(torch.tensor([0x12, 0xAB, 0x70], dtype=torch.uint8, device=DEVICE), 5)
assert _hand.tolist() == [1, 2, 10, 11, 7], \
    f"bytes 0x12 0xAB 0x70, n = 5: expected [1, 2, 10, 11, 7], got {_hand.tolist()}"
for _n in (1, 7, 999, 1000):
    _check_unpack(_n, seed=_n)
_rejects("my_unpack_nibbles(4 bytes, n=5): 5 codes need 3 bytes", lambda: my_unpack_nibbles(
    torch.zeros(4, dtype=torch.uint8, device=DEVICE), 5))
# off-limits: the reference is switched off, and the wrapper must launch your kernel
_codes, _packed = _random_packed(41, 10)
with _no_reference():
    _got = my_unpack_nibbles(_packed.to(DEVICE), 41).cpu()
assert torch.equal(_got, _codes), "my_unpack_nibbles is wrong once the reference is unavailable"
_launches(unpack_nibbles_kernel, lambda: my_unpack_nibbles(_packed.to(DEVICE), 41),
          "my_unpack_nibbles")
print("my_unpack_nibbles matches miniquant.nf4.unpack_nibbles, high nibble first")

### BEGIN HIDDEN TESTS
# case: my_unpack_nibbles on odd and even counts
_check_unpack(4097, seed=3, garbage_pad=True)
_check_unpack(2, seed=4)
# case: the kernel launched directly, pad nibble and lanes past n
for _n, _b in ((1, 2), (9, 8), (130, 64), (1001, 256)):
    _launch_unpack(_n, BLOCK=_b, seed=_n)
# case: every byte value, in order
_all = torch.arange(256, dtype=torch.uint8)
_want = torch.stack([_all >> 4, _all & 15], 1).reshape(-1)
_got = my_unpack_nibbles(_all.to(DEVICE), 512).cpu()
assert torch.equal(_got, _want), f"bytes 0..255: first mismatch at " \
    f"{(_got != _want).nonzero().flatten()[:4].tolist()}"
# case: inputs the wrapper must refuse
for _args in ((torch.zeros(3, dtype=torch.uint8), 7), (torch.zeros(4, dtype=torch.uint8), 5),
              (torch.zeros(3, dtype=torch.int32), 5), (torch.zeros(2, 2, dtype=torch.uint8), 7),
              (torch.zeros(0, dtype=torch.uint8), 0)):
    try:
        my_unpack_nibbles(_args[0].to(DEVICE), _args[1])
    except ValueError:
        pass
    else:
        raise AssertionError(f"my_unpack_nibbles accepted {_args[0].dtype} "
                             f"{tuple(_args[0].shape)} with n = {_args[1]}; expected ValueError")
# case: the reference off-limits, and the wrapper launches the kernel
_codes, _packed = _random_packed(301, 9)
with _no_reference():
    _got = my_unpack_nibbles(_packed.to(DEVICE), 301).cpu()
assert torch.equal(_got, _codes), "my_unpack_nibbles is wrong once the reference is unavailable"
_launches(unpack_nibbles_kernel, lambda: my_unpack_nibbles(_packed.to(DEVICE), 301),
          "my_unpack_nibbles")
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 3 — the NF4 dequantization kernel
#
# An `NF4Weight` `q` of `n = q.numel` elements holds (Lab 02):
#
# * `q.packed`: uint8 `[ceil(n/2)]`, the codes two a byte, high nibble first;
# * `q.absmax`: float32 `[ceil(n / q.blocksize)]`, one scale per block of `q.blocksize`
#   consecutive elements of the row-major flattened weight (with double quantization the
#   scales are stored as 8-bit codes, and the property `q.absmax` dequantizes them for you:
#   use it);
# * `q.shape`, `q.blocksize`, and `q.dtype` (the dtype that was quantized).
#
# Element `j` of the flattened weight is
#
# $$w_j = \mathrm{NF4}[\,c_j\,] \cdot \mathrm{absmax}[\,\lfloor j / \mathrm{blocksize} \rfloor\,]$$
#
# where $c_j$ is its 4-bit code and `NF4` the 16-entry table `miniquant.NF4_CODE`.
#
# **Specification.**
#
# * `nf4_dequant_kernel(packed_ptr, absmax_ptr, code_ptr, out_ptr, n, BLOCKSIZE:
#   tl.constexpr, BLOCK: tl.constexpr)`: program `p` writes the float32 values $w_j$ of
#   elements `p*BLOCK ... p*BLOCK + BLOCK - 1` (those `< n`) into `out_ptr`. The level is
#   **looked up in the table** at `code_ptr`, a float32 `[16]` tensor (do not type the 16
#   values into the kernel: the tests pass other tables too), and multiplied **once, in
#   float32**, by the scale of block `j // BLOCKSIZE`. `BLOCKSIZE` and `BLOCK` are
#   independent: a program may span several scale blocks (`BLOCK > BLOCKSIZE`) or a fraction
#   of one.
# * `my_dequantize_nf4(q, block=1024)` raises `ValueError` if `q` is not an `NF4Weight`,
#   launches your kernel on `triton.cdiv(n, block)` programs with the scales `q.absmax`, and
#   returns a **float32** tensor of shape `q.shape`, **bit-identical** to
#   `dequantize_nf4(q, torch.float32)` (the tests use `torch.equal`): it is one float32
#   multiply of the same two numbers, so there is no excuse for rounding differences.
#
# Off-limits: `dequantize_nf4`, `NF4Weight.dequantize`, `q.codes()`, `unpack_nibbles` and
# everything in `miniquant.triton_dequant`; they are switched off while your wrapper runs.
# Your `my_unpack_nibbles` is fine but not needed.
#
# <details><summary>Hint 1: the idea</summary>
#
# It is Exercise 2 with two more loads. Unpack the code of each element `j` as before,
# convert it to `tl.int32`, and use it as an offset: `tl.load(code_ptr + code)` is a gather
# of 16 possible addresses. The scale of element `j` sits at `absmax_ptr + j // BLOCKSIZE`,
# for every element separately, not once per program. In the wrapper, the table
# `NF4_CODE` and the scales must live on the weight's device, and `q.absmax` works with and
# without double quantization (`q.block_absmax` is `None` with it).
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# kernel:  j = program_id(0) * BLOCK + arange(0, BLOCK);  mask = j < n
#          b     = load(packed_ptr + j // 2, mask, other=0)
#          code  = int32(where(j % 2 == 0, b >> 4, b & 15))
#          level = load(code_ptr + code, mask, other=0.0)
#          scale = load(absmax_ptr + j // BLOCKSIZE, mask, other=0.0)
#          store(out_ptr + j, level * scale, mask)
# wrapper: check q is an NF4Weight (ValueError);  n = q.numel
#          packed, absmax = q.packed, q.absmax (float32, flat, on the device)
#          code = NF4_CODE on the device;  out = empty(n, float32)
#          launch on cdiv(n, block) programs with BLOCKSIZE=q.blocksize;  return out as q.shape
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "nf4_dequant", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def nf4_dequant_kernel(packed_ptr, absmax_ptr, code_ptr, out_ptr, n,
                       BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr):
    """out[j] = code[nibble j] * absmax[j // BLOCKSIZE] (float32) for j in this block, j < n."""
    ### BEGIN SOLUTION
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = j < n
    b = tl.load(packed_ptr + j // 2, mask=in_range, other=0)
    code = tl.where(j % 2 == 0, b >> 4, b & 15).to(tl.int32)
    level = tl.load(code_ptr + code, mask=in_range, other=0.0)
    scale = tl.load(absmax_ptr + j // BLOCKSIZE, mask=in_range, other=0.0)
    tl.store(out_ptr + j, level * scale, mask=in_range)
    ### END SOLUTION


def my_dequantize_nf4(q: NF4Weight, block: int = 1024) -> torch.Tensor:
    """float32 tensor of q.shape: NF4_CODE[code] * absmax of its block, by nf4_dequant_kernel."""
    ### BEGIN SOLUTION
    if not isinstance(q, NF4Weight):
        raise ValueError(f"q must be an NF4Weight, got {type(q).__name__}")
    device = q.packed.device
    n = q.numel
    packed = q.packed.reshape(-1).contiguous()
    absmax = q.absmax.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    code = NF4_CODE.to(device=device, dtype=torch.float32).contiguous()
    out = torch.empty(n, dtype=torch.float32, device=device)
    nf4_dequant_kernel[(triton.cdiv(n, block),)](packed, absmax, code, out, n,
                                                 BLOCKSIZE=q.blocksize, BLOCK=block)
    return out.reshape(q.shape)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nf4_dequant_kernel", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _launch_nf4(n, blocksize, BLOCK, table=None, seed=0):
    """Launch nf4_dequant_kernel directly, with sentinels past n, against a loop in Python."""
    g = torch.Generator().manual_seed(seed)
    codes, packed = _random_packed(n, seed)
    absmax = torch.rand(-(-n // blocksize), generator=g) + 0.5
    table = NF4_CODE if table is None else table
    want = torch.tensor([table[int(codes[j])].item() * absmax[j // blocksize].item()
                         for j in range(n)], dtype=torch.float32)   # float32 product of floats
    out = torch.full((n + BLOCK + 1,), -999.0, device=DEVICE)
    grid = (triton.cdiv(n, BLOCK),)
    with harness.outputs(out):
        nf4_dequant_kernel[grid](packed.to(DEVICE), absmax.to(DEVICE), table.to(DEVICE), out,
                                 n, BLOCKSIZE=blocksize, BLOCK=BLOCK)
    out = out.cpu()
    where = f"nf4_dequant_kernel[{grid}](..., n={n}, BLOCKSIZE={blocksize}, BLOCK={BLOCK})"
    bad = (out[:n] != want).nonzero().flatten()
    j = torch.arange(n)
    per_program = absmax[(j // BLOCK).clamp(max=absmax.numel() - 1)]
    swapped = torch.stack([packed & 15, packed >> 4], 1).reshape(-1)[:n].long()
    first = absmax[(j // BLOCK * BLOCK // blocksize).clamp(max=absmax.numel() - 1)]
    why = (" (each element took the scale of its program, j // BLOCK: element j takes "
           "absmax[j // BLOCKSIZE])" if torch.equal(out[:n], table[codes.long()] * per_program)
           else " (each element took the scale of its program's first element: load the scale "
           "of block j // BLOCKSIZE for every element, not once per program)"
           if torch.equal(out[:n], table[codes.long()] * first)
           else " (the nibbles are swapped: even j takes the high nibble, b >> 4)"
           if torch.equal(out[:n], table[swapped] * absmax[j // blocksize]) else "")
    assert bad.numel() == 0, \
        f"{where}: {bad.numel()} of {n} values differ, first at j = {bad[:4].tolist()}: " \
        f"expected {want[bad[:4]].tolist()}, got {out[bad[:4]].tolist()} " \
        f"(codes {codes[bad[:4]].tolist()}, blocks {(bad[:4] // blocksize).tolist()}){why}"
    assert (out[n:] == -999.0).all(), \
        f"{where} wrote past n: {out[n:n + 4].tolist()}. Mask the store with j < n"


_launch_nf4(100, blocksize=32, BLOCK=64)      # a program spans two scale blocks
_launch_nf4(77, blocksize=128, BLOCK=16)      # a scale block spans several programs
# another 16-level table: the kernel must look levels up in code_ptr, not hard-code NF4
_launch_nf4(45, blocksize=32, BLOCK=32, table=torch.arange(16, dtype=torch.float32) - 7.5)
print("nf4_dequant_kernel matches a Python loop, including on another code table")

### BEGIN HIDDEN TESTS
# case: one element, and a count past a multiple of BLOCK
_launch_nf4(1, blocksize=64, BLOCK=16, seed=1)
_launch_nf4(257, blocksize=64, BLOCK=64, seed=2)
# case: another code table, BLOCK larger than the blocksize
_launch_nf4(130, blocksize=32, BLOCK=128, seed=3,
            table=torch.linspace(-3.0, 5.0, 16, dtype=torch.float32) ** 3)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_my_dequantize_nf4", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _check_dequant(shape, blocksize=64, double_quant=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 3).to(dtype)
    q = quantize_nf4(w.to(DEVICE), blocksize=blocksize, double_quant=double_quant)
    want = dequantize_nf4(q, torch.float32)
    where = f"shape {tuple(shape)}, blocksize {blocksize}, double_quant={double_quant}, {dtype}"
    try:
        got = my_dequantize_nf4(q)
    except (AttributeError, TypeError) as e:
        raise AssertionError(f"{where}: {type(e).__name__}: {e}" + (
            " (with double quantization q.block_absmax is None: the scales are q.absmax, "
            "which dequantizes them)" if double_quant else "")) from e
    assert isinstance(got, torch.Tensor) and got.shape == want.shape \
        and got.dtype == torch.float32, \
        f"{where}: expected float32 of shape {tuple(want.shape)}, got " \
        f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}" + (
            " (reshape the flat output to q.shape)" if isinstance(got, torch.Tensor)
            and got.numel() == want.numel() and got.shape != want.shape else "")
    if not torch.equal(got, want):
        diff = (got != want).reshape(-1).nonzero().flatten()
        raise AssertionError(
            f"{where}: {diff.numel()} of {want.numel()} values differ from dequantize_nf4, first "
            f"at flat index {diff[:4].tolist()}: expected {want.reshape(-1)[diff[:4]].tolist()}, "
            f"got {got.reshape(-1)[diff[:4]].tolist()}")


# worked by hand: codes 7, 15, 0 (bytes 0x7F, 0x07 with pad 7), absmax 2 -> 0, 2, -2
_q = NF4Weight(torch.tensor([0x7F, 0x07], dtype=torch.uint8, device=DEVICE), (3,),
               torch.float32, 32, block_absmax=torch.tensor([2.0], device=DEVICE))
_got = my_dequantize_nf4(_q)
assert _got.tolist() == [0.0, 2.0, -2.0], f"codes 7, 15, 0 with absmax 2: expected " \
    f"[0.0, 2.0, -2.0], got {_got.tolist() if isinstance(_got, torch.Tensor) else _got}"

for _n in (1, 63, 65, 1000):
    _check_dequant((_n,), seed=_n)
_check_dequant((17, 40), blocksize=32)
_check_dequant((3, 5, 7), blocksize=128)
_check_dequant((1000,), double_quant=True, seed=7)
_check_dequant((17, 40), blocksize=32, double_quant=True, seed=8)
_rejects("my_dequantize_nf4(a plain tensor)",
         lambda: my_dequantize_nf4(torch.zeros(4, device=DEVICE)))
# off-limits: the references are switched off, and the wrapper must launch your kernel
_q = quantize_nf4(torch.randn(5, 48).to(DEVICE), blocksize=32, double_quant=True)
_want = dequantize_nf4(_q, torch.float32)
with _no_reference():
    _got = my_dequantize_nf4(_q)
assert torch.equal(_got, _want), "my_dequantize_nf4 is wrong once the reference is unavailable"
_launches(nf4_dequant_kernel, lambda: my_dequantize_nf4(_q), "my_dequantize_nf4")
print("my_dequantize_nf4 is bit-identical to dequantize_nf4 on the visible shapes")

### BEGIN HIDDEN TESTS
# case: shapes, blocksizes and double quantization
_check_dequant((2, 96), blocksize=64, seed=11)           # rows not a multiple of blocksize
_check_dequant((6, 80), blocksize=32, double_quant=True, seed=12)
_check_dequant((5, 1, 33), blocksize=128, double_quant=True, seed=13)
_check_dequant((100, 201), blocksize=32, double_quant=True, seed=14)   # > 256 scale blocks
# case: weights quantized from bfloat16 and float16
_check_dequant((31, 17), blocksize=64, dtype=torch.bfloat16, seed=15)
_check_dequant((3, 3, 3), blocksize=32, dtype=torch.float16, seed=16)
# case: arguments the wrapper must refuse
for _bad in (torch.zeros(4), None, (torch.zeros(2, dtype=torch.uint8), torch.ones(1))):
    try:
        my_dequantize_nf4(_bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"my_dequantize_nf4 accepted a {type(_bad).__name__}; "
                             "expected ValueError")
# case: the reference off-limits, and the wrapper launches the kernel
_w = torch.randn(9, 70).to(DEVICE)
for _dq in (False, True):
    _q = quantize_nf4(_w, blocksize=64, double_quant=_dq)
    _want = dequantize_nf4(_q, torch.float32)
    with _no_reference():
        _got = my_dequantize_nf4(_q)
    assert torch.equal(_got, _want), "my_dequantize_nf4 is wrong once the reference is unavailable"
    _launches(nf4_dequant_kernel, lambda _q=_q: my_dequantize_nf4(_q), "my_dequantize_nf4")
### END HIDDEN TESTS

# %% [markdown]
# ### Yours beside the reference
#
# `miniquant.triton_dequantize_nf4` is the course's version of the same kernel. Two design
# choices differ from the simplest solution, and both are worth reading in
# `src/miniquant/triton_dequant.py`:
#
# * it tiles by **bytes**: each program loads 1024 packed bytes once (one contiguous read)
#   and spreads them into 2048 values with `tl.join` + `tl.reshape`, the builtins behind
#   `tl.interleave`;
# * it can store float16 or bfloat16 directly, rounding once at the store, so no float32
#   copy of the weight is ever written.
#
# Both give the same bits as the PyTorch reference, and as yours.

# %% tags=["jupyter-only"]
_w = torch.randn(64, 96).to(DEVICE)
for _dq in (False, True):
    _q = quantize_nf4(_w, blocksize=64, double_quant=_dq)
    t0 = time.perf_counter()
    mine = my_dequantize_nf4(_q)
    t1 = time.perf_counter()
    ref = miniquant.triton_dequantize_nf4(_q, torch.float32)
    t2 = time.perf_counter()
    print(f"double_quant={_dq!s:5}: yours == triton_dequantize_nf4 == dequantize_nf4: "
          f"{torch.equal(mine, ref) and torch.equal(ref, dequantize_nf4(_q, torch.float32))}"
          f"   ({(t1 - t0) * 1e3:.1f} ms vs {(t2 - t1) * 1e3:.1f} ms"
          f"{', interpreter' if INTERPRET else ''})")

# %% [markdown]
# ## Exercise 4 — selective dequantization of MoE experts
#
# A Mixture-of-Experts layer stores `E` expert matrices as one weight `[E, out, in]`. Each
# token is routed to a few experts (top-2 of 8 in Mixtral), so a small batch touches only
# some of them. Frozen NF4 experts (QLoRA on an MoE model, Lab 10) must be dequantized
# before use, and dequantizing **all** `E` of them to use two wastes both the memory traffic
# and a transient float buffer `E / k` times larger than needed. Selective dequantization
# reads and writes only the listed experts.
#
# The layout makes this cheap. With `M = out * in` elements per expert and `M` a multiple of
# the blocksize (so that no scale block straddles two experts, and `M` is even), expert `e`
# owns bytes `e*M/2 ... (e+1)*M/2 - 1` of `packed` and scales
# `e*M/blocksize ... (e+1)*M/blocksize - 1` of `absmax`.
#
# **Specification.** Write `selective_dequant_kernel(packed_ptr, absmax_ptr, code_ptr,
# ids_ptr, out_ptr, expert_numel, BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr)`, launched on
# a **2-D grid** `(triton.cdiv(M, BLOCK), n_active)`: program `(t, r)` loads the expert id
# `e = ids[r]` (an int64 tensor) and writes elements `t*BLOCK ... t*BLOCK + BLOCK - 1`
# (those `< M`) of output row `r` (row `r` starts at `out_ptr + r*M`), computed from expert
# `e`'s bytes and scales only, and writes nothing past its row.
#
# Then `my_selective_dequantize(q_experts, active, block=1024)`, returning float32
# `[len(active), out, in]` whose row `r` is expert `active[r]` (repeats allowed, order kept):
#
# * raise `ValueError` if `q_experts` is not an `NF4Weight` of 3 dimensions, if `M` is not a
#   multiple of `q_experts.blocksize`, if `active` is not a 1-D integer tensor, or if an id
#   is outside `0 ... E-1` (negative ids included);
# * an empty `active` returns an empty `[0, out, in]` tensor (careful: `active.min()` of an
#   empty tensor raises);
# * the scales: `q_experts.block_absmax` without double quantization (read in place, only the
#   listed experts' entries are touched by the kernel); with double quantization use
#   `q_experts.absmax` (it dequantizes every expert's 8-bit scale code, a vector 1/64 the
#   size of the weight at blocksize 64; the reference is smarter here, see below).
#
# The tests **poison** every expert that is not listed: its bytes become `0xFF` and, without
# double quantization, its scales `NaN`. Read one byte or scale of the wrong expert and the
# comparison fails.
#
# Off-limits: `dequantize_nf4`, the reference `selective_dequantize_nf4` and your own
# `my_dequantize_nf4`, with everything that was off-limits in Exercise 3; they are switched
# off while your wrapper runs.
#
# <details><summary>Hint 1: the idea</summary>
#
# Inside the kernel, everything is Exercise 3 with offsets. The element offset `j` now counts
# inside one expert (`j < expert_numel`); expert `e`'s bytes start at
# `packed_ptr + e * expert_numel // 2`, its scales at element `e * expert_numel` of the
# flattened weight (add it to `j` *before* dividing by `BLOCKSIZE`), and the output row is
# `r`, not `e`: an id may repeat. Convert the program ids and `e` to `tl.int64` before
# multiplying, so that large experts do not overflow 32 bits. In the wrapper, do every check
# before the kernel runs, and test `active.numel()` before `active.min()`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# kernel:  t, r = program_id(0), program_id(1) as int64;  e = int64(load(ids_ptr + r))
#          j = t * BLOCK + arange(0, BLOCK);  mask = j < expert_numel
#          b     = load(packed_ptr + e * (expert_numel // 2) + j // 2, mask, other=0)
#          level = load(code_ptr + int32(nibble of b for j), mask, other=0.0)
#          scale = load(absmax_ptr + (e * expert_numel + j) // BLOCKSIZE, mask, other=0.0)
#          store(out_ptr + r * expert_numel + j, level * scale, mask)
# wrapper: validate q_experts (NF4Weight, 3-D, M % blocksize == 0) and active (1-D integer,
#          ids in 0..E-1 when not empty), else ValueError
#          out = empty((len(active), out, in), float32);  if active is empty: return out
#          scales = q.absmax if double quantized else q.block_absmax
#          launch on (cdiv(M, block), len(active)) programs;  return out
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "selective_dequant", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def selective_dequant_kernel(packed_ptr, absmax_ptr, code_ptr, ids_ptr, out_ptr, expert_numel,
                             BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, j] = expert ids[r]'s element j, for j in tile program_id(0), row program_id(1)."""
    ### BEGIN SOLUTION
    tile = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    e = tl.load(ids_ptr + row).to(tl.int64)
    j = tile * BLOCK + tl.arange(0, BLOCK)                 # element offset inside the expert
    in_range = j < expert_numel
    b = tl.load(packed_ptr + e * (expert_numel // 2) + j // 2, mask=in_range, other=0)
    code = tl.where(j % 2 == 0, b >> 4, b & 15).to(tl.int32)
    level = tl.load(code_ptr + code, mask=in_range, other=0.0)
    scale = tl.load(absmax_ptr + (e * expert_numel + j) // BLOCKSIZE, mask=in_range, other=0.0)
    tl.store(out_ptr + row * expert_numel + j, level * scale, mask=in_range)
    ### END SOLUTION


def my_selective_dequantize(q_experts: NF4Weight, active: torch.Tensor,
                            block: int = 1024) -> torch.Tensor:
    """float32 [len(active), out, in]: row r is expert active[r] of the [E, out, in] weight."""
    ### BEGIN SOLUTION
    if not isinstance(q_experts, NF4Weight) or len(q_experts.shape) != 3:
        raise ValueError("q_experts must be an NF4Weight of shape [E, out, in]")
    n_experts, d_out, d_in = q_experts.shape
    expert_numel = d_out * d_in
    if expert_numel % q_experts.blocksize:
        raise ValueError(f"out*in = {expert_numel} is not a multiple of the blocksize "
                         f"{q_experts.blocksize}: a scale block would straddle two experts")
    if (not isinstance(active, torch.Tensor) or active.dim() != 1
            or active.dtype.is_floating_point or active.dtype.is_complex
            or active.dtype == torch.bool):
        raise ValueError("active must be a 1-D integer tensor of expert ids")
    if active.numel() and (int(active.min()) < 0 or int(active.max()) >= n_experts):
        raise ValueError(f"expert ids must lie in [0, {n_experts}), got {active.tolist()}")
    device = q_experts.packed.device
    out = torch.empty((active.numel(), d_out, d_in), dtype=torch.float32, device=device)
    if active.numel() == 0:
        return out
    ids = active.to(device=device, dtype=torch.int64).contiguous()
    scales = q_experts.absmax if q_experts.double_quant else q_experts.block_absmax
    scales = scales.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    code = NF4_CODE.to(device=device, dtype=torch.float32).contiguous()
    grid = (triton.cdiv(expert_numel, block), active.numel())
    selective_dequant_kernel[grid](q_experts.packed.contiguous(), scales, code, ids, out,
                                   expert_numel, BLOCKSIZE=q_experts.blocksize, BLOCK=block)
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_selective_dequantize", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _poisoned(q, active):
    """A copy of q in which every expert not in `active` has bytes 0xFF and NaN scales (or,
    with double quantization, 0xFF scale codes)."""
    E = q.shape[0]
    others = sorted(set(range(E)) - set(torch.as_tensor(active).tolist()))
    packed = q.packed.clone().view(E, -1)
    packed[others] = 0xFF
    if q.double_quant:
        codes = q.absmax_codes.clone().view(E, -1)
        codes[others] = 0xFF
        return NF4Weight(packed.reshape(-1), q.shape, q.dtype, q.blocksize,
                         absmax_codes=codes.reshape(-1), absmax_scales=q.absmax_scales,
                         absmax_offset=q.absmax_offset), others
    absmax = q.block_absmax.clone().view(E, -1)
    absmax[others] = float("nan")
    return NF4Weight(packed.reshape(-1), q.shape, q.dtype, q.blocksize,
                     block_absmax=absmax.reshape(-1)), others


def _check_selective(E, d_out, d_in, active, blocksize=64, double_quant=False, seed=0,
                     forbid=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, d_out, d_in, generator=g) * (1 + torch.arange(E))[:, None, None]
    q = quantize_nf4(w.to(DEVICE), blocksize=blocksize, double_quant=double_quant)
    active = torch.tensor(active, dtype=torch.int64)
    want = dequantize_nf4(q, torch.float32)[active.to(DEVICE)]         # from the clean weight
    poisoned, others = _poisoned(q, active)
    where = (f"[E={E}, {d_out}, {d_in}], blocksize {blocksize}, double_quant={double_quant}, "
             f"active {active.tolist()} (experts {others} poisoned)")
    try:
        if forbid:
            with _no_reference(my_dequantize_nf4):
                got = my_selective_dequantize(poisoned, active.to(DEVICE))
            _launches(selective_dequant_kernel,
                      lambda: my_selective_dequantize(poisoned, active.to(DEVICE)),
                      f"my_selective_dequantize, {where}")
        else:
            got = my_selective_dequantize(poisoned, active.to(DEVICE))
    except (AttributeError, TypeError) as e:
        raise AssertionError(f"{where}: {type(e).__name__}: {e}" + (
            " (with double quantization q.block_absmax is None: the scales are q.absmax)"
            if double_quant else "")) from e
    assert isinstance(got, torch.Tensor) and got.shape == want.shape \
        and got.dtype == torch.float32, \
        f"{where}: expected float32 of shape {tuple(want.shape)}, got " \
        f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}"
    for r in range(len(active)):
        if not torch.equal(got[r], want[r]):
            bad = (got[r] != want[r]).reshape(-1).nonzero().flatten()
            raise AssertionError(
                f"{where}: output row {r} (expert {int(active[r])}) differs at "
                f"{bad.numel()} of {want[r].numel()} elements, first flat index "
                f"{bad[:3].tolist()}: expected {want[r].reshape(-1)[bad[:3]].tolist()}, got "
                f"{got[r].reshape(-1)[bad[:3]].tolist()}"
                + (" — NaN means a poisoned scale was read" if got[r].isnan().any() else ""))


# The kernel first, launched directly: a tile longer than an expert (BLOCK 256 > M = 128)
# must not write past its row; the sentinels after the last row must survive.
_qd = quantize_nf4(torch.randn(3, 4, 32).to(DEVICE), blocksize=64)
_ids = torch.tensor([2, 0], dtype=torch.int64)
_want = dequantize_nf4(_qd, torch.float32)[_ids.to(DEVICE)].reshape(-1)
_pq, _ = _poisoned(_qd, _ids)
_out = torch.full((2 * 128 + 256,), -999.0, device=DEVICE)
with harness.outputs(_out):
    selective_dequant_kernel[(1, 2)](_pq.packed, _pq.block_absmax, NF4_CODE.to(DEVICE),
                                     _ids.to(DEVICE), _out, 128, BLOCKSIZE=64, BLOCK=256)
# what two wrong offsets give: expert e's codes with expert 0's scales, or the reverse
_lv = NF4_CODE[unpack_nibbles(_qd.packed.cpu(), 384).long()].view(3, 128)       # [E, M]
_sc = _qd.block_absmax.cpu().repeat_interleave(64).view(3, 128)                 # [E, M]
_why = (" (expert e's scales start at absmax[e*M // BLOCKSIZE]: add e * expert_numel to j "
        "before dividing by BLOCKSIZE)" if torch.equal(_out[:256].cpu(), (_lv[_ids] * _sc[0])
                                                       .reshape(-1)) else
        " (expert e's bytes start at packed_ptr + e * M / 2)"
        if torch.equal(_out[:256].cpu(), (_lv[0] * _sc[_ids]).reshape(-1)) else
        " (row r starts at out_ptr + r*M: the output row is r, not the expert id e)")
assert torch.equal(_out[:256], _want), \
    f"selective_dequant_kernel[(1, 2)] with BLOCK=256 > M=128: {(_out[:256] != _want).sum()} " \
    f"of 256 values differ from the reference{_why}"
assert (_out[256:] == -999.0).all(), \
    "selective_dequant_kernel[(1, 2)] with BLOCK=256 > M=128 wrote past the last row: mask " \
    "the store with j < expert_numel"

_check_selective(5, 6, 32, [3, 0, 3])               # repeats and order kept
_check_selective(4, 4, 16, [2], blocksize=32, seed=1)
_check_selective(4, 8, 32, [1, 3], double_quant=True, seed=2)
try:
    _empty = my_selective_dequantize(quantize_nf4(torch.randn(3, 4, 16).to(DEVICE), 32),
                                     torch.tensor([], dtype=torch.int64, device=DEVICE))
except RuntimeError as _e:
    raise AssertionError(f"empty active: my_selective_dequantize raised {_e}. An empty active "
                         "returns an empty [0, out, in] tensor; test active.numel() before "
                         "active.min()") from _e
assert isinstance(_empty, torch.Tensor) and tuple(_empty.shape) == (0, 4, 16), \
    f"empty active: expected shape (0, 4, 16), got {tuple(getattr(_empty, 'shape', ()))}"
# off-limits: the references and your my_dequantize_nf4 are switched off, and the wrapper
# must launch selective_dequant_kernel
_check_selective(4, 4, 32, [2, 0], blocksize=32, seed=8, forbid=True)
print("my_selective_dequantize reads only the listed experts and matches the reference")

### BEGIN HIDDEN TESTS
# case: several experts, repeats and orders, with and without double quantization
_check_selective(6, 16, 64, [5, 4, 3, 2, 1, 0], blocksize=128, seed=3)    # all, reversed
_check_selective(8, 16, 128, [7, 0, 6], blocksize=32, double_quant=True, seed=4)  # 512 blocks
_check_selective(3, 2, 64, [1], blocksize=64, seed=5)
# case: the references off-limits, and the wrapper launches the kernel
_check_selective(7, 12, 48, [6, 2, 2, 4], blocksize=64, seed=6, forbid=True)
_check_selective(5, 8, 64, [0, 4], blocksize=32, double_quant=True, seed=7, forbid=True)
# case: the kernel launched directly, several tiles per expert
_qd = quantize_nf4(torch.randn(4, 6, 32).to(DEVICE), blocksize=64)
_ids = torch.tensor([2, 1], dtype=torch.int64)
_want = dequantize_nf4(_qd, torch.float32)[_ids.to(DEVICE)]
_pq, _ = _poisoned(_qd, _ids)
_out = torch.full((2, 6, 32), -999.0, device=DEVICE)
with harness.outputs(_out):
    selective_dequant_kernel[(triton.cdiv(192, 64), 2)](
        _pq.packed, _pq.block_absmax, NF4_CODE.to(DEVICE), _ids.to(DEVICE), _out, 192,
        BLOCKSIZE=64, BLOCK=64)
assert torch.equal(_out, _want), "selective_dequant_kernel[(3, 2)] with BLOCK=64 differs from " \
    f"the reference at {(_out != _want).sum().item()} elements"
# case: the kernel launched directly, one tile longer than an expert
_buf = torch.full((192 + 256,), -999.0, device=DEVICE)
_out = _buf[:192].view(1, 6, 32)                  # a view: the sentinels after it must survive
with harness.outputs(_buf):
    selective_dequant_kernel[(1, 1)](
        _pq.packed, _pq.block_absmax, NF4_CODE.to(DEVICE), _ids[1:].to(DEVICE), _out, 192,
        BLOCKSIZE=64, BLOCK=256)                  # one tile, masked past M = 192
assert torch.equal(_out[0], _want[1]), "selective_dequant_kernel with BLOCK=256 > M differs"
assert (_buf[192:] == -999.0).all(), \
    "selective_dequant_kernel with BLOCK=256 > M wrote past the expert's M elements"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_selective_bad_inputs", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _expect_value_error(what, q, active):
    _rejects(what, lambda: my_selective_dequantize(q, active))     # from test_axpy's cell


_q3 = quantize_nf4(torch.randn(4, 4, 16).to(DEVICE), blocksize=64)
_expect_value_error("expert id 4 of E = 4", _q3, torch.tensor([0, 4], device=DEVICE))
_expect_value_error("expert id -1", _q3, torch.tensor([-1], device=DEVICE))
_expect_value_error("float ids", _q3, torch.tensor([0.0, 2.0], device=DEVICE))
_expect_value_error("out*in = 40 with blocksize 32 (a scale block would straddle two experts)",
                    quantize_nf4(torch.randn(2, 4, 10).to(DEVICE), 32),
                    torch.tensor([1], device=DEVICE))
print("bad expert ids raise ValueError")

### BEGIN HIDDEN TESTS
# case: ids of the wrong dtype or shape
_expect_value_error("float ids", _q3, torch.tensor([0.0, 1.0], device=DEVICE))
_expect_value_error("2-D ids", _q3, torch.tensor([[0, 1]], device=DEVICE))
# case: weights the wrapper must refuse
_expect_value_error("a 2-D weight", quantize_nf4(torch.randn(8, 16).to(DEVICE), 64),
                    torch.tensor([0], device=DEVICE))
_expect_value_error("out*in = 48 with blocksize 32",
                    quantize_nf4(torch.randn(3, 4, 12).to(DEVICE), 32),
                    torch.tensor([0], device=DEVICE))
_expect_value_error("not an NF4Weight", torch.randn(2, 4, 16), torch.tensor([0]))
### END HIDDEN TESTS

# %% [markdown]
# ### What the reference does with double-quantized scales
#
# With double quantization your wrapper calls `q_experts.absmax`, which dequantizes the scale
# codes of **all** experts (in PyTorch) before the kernel reads the listed experts' entries.
# The reference, `miniquant.selective_dequantize_nf4`, dequantizes only the listed experts'
# codes into a compact scale vector ordered like `active`, so every byte it reads belongs to
# a listed expert, apart from a few float32 group scales (256 codes share one, and a group
# may straddle two experts).
#
# The cell below takes 16 experts of `16 x 128` at blocksize 32: 64 scale codes per expert,
# so one group of 256 codes covers 4 experts. With `active = [1, 6]` only groups 0 and 1 are
# needed. It poisons the other experts' bytes and codes, and sets the group scales of groups
# 2 and 3 (experts 8-15) to NaN.

# %% tags=["jupyter-only"]
_q16 = quantize_nf4(torch.randn(16, 16, 128).to(DEVICE), blocksize=32, double_quant=True)
_a16 = torch.tensor([1, 6], device=DEVICE)
_want16 = dequantize_nf4(_q16, torch.float32)[_a16]
_p16, _ = _poisoned(_q16, _a16)
_group_scales = _p16.absmax_scales.clone()
_group_scales[2:] = float("nan")
_p16 = NF4Weight(_p16.packed, _p16.shape, _p16.dtype, _p16.blocksize,
                 absmax_codes=_p16.absmax_codes, absmax_scales=_group_scales,
                 absmax_offset=_p16.absmax_offset)
print("NaN in the whole q.absmax:", _p16.absmax.isnan().sum().item(), "of", _p16.n_blocks)
print("reference selective_dequantize_nf4 exact:",
      torch.equal(miniquant.selective_dequantize_nf4(_p16, _a16, torch.float32), _want16))
print("my_selective_dequantize exact:           ",
      torch.equal(my_selective_dequantize(_p16, _a16), _want16))
print(f"scale codes dequantized: yours {_p16.n_blocks}, "
      f"the reference's {len(_a16) * _p16.n_blocks // 16}")

# %% [markdown]
# Both are exact: the NaN group scales reach only the other experts' float32 scales, which
# your kernel never loads. What differs is the work done before the kernel: `q.absmax`
# touches every code and every group scale, the reference only the listed ones. Here that is
# 1 024 codes against 128; for a layer with 64 experts of which 6 are active, about ten times
# fewer.
#
# ## Exercise 5 — memory traffic, and why dequantization is memory-bound
#
# Each output element costs a handful of integer operations, one table lookup and one
# multiply; against that, it moves half a byte in, a share of a float32 scale in, and 2 or 4
# bytes out. An H100 computes about 67 float32 TFLOP/s but moves about 3.35 TB/s from DRAM:
# some 20 operations per byte, roughly 50 per bfloat16 output element (about 2.6 bytes
# moved), of which dequantization needs fewer than ten. So the time of a dequantization
# kernel is the time of its memory traffic, and the honest unit for it is **GB/s**: bytes
# moved over seconds, to be compared with what the same GPU reaches on a plain copy.
#
# `benchmarks/bench_dequant.py` counts, for a weight of `n` elements without double
# quantization:
#
# * read: the packed codes, `ceil(n/2)` bytes, plus the float32 scales, `4 * ceil(n /
#   blocksize)` bytes (the 64-byte code table lives in cache and is not counted);
# * written: the output, `n * element_size(out_dtype)` bytes;
#
# and reports `GB/s = (read + written) / seconds / 1e9`, next to a copy of an output-sized
# tensor (`2 * n * element_size`: read once, written once).
#
# **Specification.** `dequant_traffic(shape, blocksize=64, out_dtype=torch.bfloat16)` takes
# a shape (a tuple or `torch.Size`), a blocksize and an output dtype, and returns the pair of
# Python ints `(bytes_read, bytes_written)` that the benchmark counts for a dequantization of
# a weight of that shape. Plain arithmetic: no quantizing, no tensors of that size.
#
# <details><summary>Hint 1: the idea</summary>
#
# Three counts, all ceilings or products of integers: the number of elements (the product
# of the shape), the packed bytes (half of it, rounded up), the number of scale blocks (a
# ceiling division). `torch.empty((), dtype=out_dtype).element_size()` gives the bytes of one
# output element without allocating anything large. Keep everything in Python `int`s.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# n       = product of shape
# read    = ceil(n / 2) + 4 * ceil(n / blocksize)
# written = n * bytes per element of out_dtype
# return read, written
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "dequant_traffic", "locked": false, "schema_version": 3, "solution": true, "task": false}
def dequant_traffic(shape, blocksize: int = 64, out_dtype: torch.dtype = torch.bfloat16
                    ) -> tuple[int, int]:
    """(bytes read, bytes written) by an NF4 dequantization of a weight of `shape`."""
    ### BEGIN SOLUTION
    n = 1
    for d in shape:
        n *= int(d)
    read = (n + 1) // 2 + 4 * (-(-n // blocksize))
    written = n * torch.empty((), dtype=out_dtype).element_size()
    return read, written
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_dequant_traffic", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_traffic(shape, blocksize, out_dtype, want):
    got = dequant_traffic(shape, blocksize, out_dtype)
    n = 1
    for d in shape:
        n *= int(d)
    nbytes, blocks = -(-n // 2), -(-n // blocksize)
    why = {(n // 2 + 4 * blocks, want[1]): "an odd count still fills a last byte: ceil(n / 2)",
           (nbytes + 4 * (n // blocksize), want[1]):
               "a partial last block has a scale too: ceil(n / blocksize) scales",
           **{(nbytes + k * blocks, want[1]): "the scales are float32, 4 bytes each"
              for k in (1, 2, 8)},
           **{(want[0], n * k): "the bytes of an output element depend on out_dtype"
              for k in (1, 2, 4, 8) if n * k != want[1]}}.get(tuple(got), "")
    assert tuple(got) == want and all(isinstance(v, int) for v in got), \
        f"dequant_traffic({shape}, {blocksize}, {out_dtype}): expected {want}, got {got}" + (
            f" ({why})" if why else "")


# Llama-7B's q_proj, by hand: 16 777 216 weights -> 8 MiB of codes, 1 MiB of scales, 32 MiB out
_check_traffic((4096, 4096), 64, torch.bfloat16, (8_388_608 + 1_048_576, 33_554_432))
_check_traffic((7,), 64, torch.float32, (4 + 4, 28))
# what a real NF4Weight holds, and what the output takes
for _shape, _bs in (((17, 40), 32), ((3, 5, 7), 128)):
    _q = quantize_nf4(torch.randn(_shape), blocksize=_bs)
    _want = (_q.packed.numel() + 4 * _q.absmax.numel(), torch.empty(_shape).nbytes)
    _check_traffic(_shape, _bs, torch.float32, _want)
print("dequant_traffic counts the same bytes as benchmarks/bench_dequant.py")

### BEGIN HIDDEN TESTS
# case: real layer shapes and small counts
_check_traffic((14336, 4096), 64, torch.float16, (29_360_128 + 3_670_016, 117_440_512))
_check_traffic((1,), 32, torch.bfloat16, (1 + 4, 2))
_check_traffic((65,), 64, torch.bfloat16, (33 + 8, 130))
_check_traffic((8, 14336, 4096), 128, torch.float32,
               (234_881_024 + 14_680_064, 1_879_048_192))
_check_traffic(torch.Size([3, 1, 129]), 256, torch.float16, (194 + 8, 774))
### END HIDDEN TESTS

# %% [markdown]
# ### The transient memory of selective vs full dequantization
#
# Take one projection of a Mixtral-8x7B layer, `w1` of shape `[8, 14336, 4096]`, stored in
# NF4. To run the experts a batch routed to, the layer needs their weights in bfloat16 for a
# moment. Full dequantization writes all eight; selective dequantization writes only the
# `k` distinct experts the batch used, and reads only theirs. The bars come from your
# `dequant_traffic`; the last line checks the same proportion on real tensors from your
# `my_selective_dequantize`.

# %%
E, D_OUT, D_IN = 8, 14336, 4096
full_read, full_written = dequant_traffic((E, D_OUT, D_IN), 64, torch.bfloat16)
ks = list(range(1, E + 1))
sel = [dequant_traffic((k, D_OUT, D_IN), 64, torch.bfloat16) for k in ks]
GiB = 2**30

fig, ax = plt.subplots(figsize=(8, 3.8))
width = 0.4
ax.bar([k - width / 2 for k in ks], [full_written / GiB] * E, width,
       label="full dequant: bf16 buffer", color="tab:gray")
ax.bar([k + width / 2 for k in ks], [w / GiB for _, w in sel], width,
       label="selective: bf16 buffer", color="tab:blue")
ax.plot([k + width / 2 for k in ks], [(r + w) / GiB for r, w in sel], "o-", color="tab:orange",
        label="selective: bytes read + written")
ax.axhline((full_read + full_written) / GiB, color="tab:red", ls="--",
           label="full: bytes read + written")
ax.set_xticks(ks)
ax.set_ylim(0, 1.65)
ax.set_xlabel("distinct experts used by the batch (k of 8)")
ax.set_ylabel("GiB")
ax.set_title("Mixtral-8x7B w1 [8, 14336, 4096], NF4 blocksize 64 -> bf16, one layer")
ax.legend(fontsize=8, loc="upper left", ncol=2)
plt.show()

print(f"full: read {full_read / GiB:.3f} GiB, write {full_written / GiB:.3f} GiB per layer; "
      f"top-2 decode of one token (k = 2) needs {sel[1][1] / full_written:.0%} of the buffer")
_q = quantize_nf4(torch.randn(8, 16, 64).to(DEVICE), blocksize=64)
_part = my_selective_dequantize(_q, torch.tensor([3, 5], device=DEVICE))
_full = my_dequantize_nf4(_q)
print(f"on a small [8, 16, 64] weight: selective {_part.nbytes} bytes vs full {_full.nbytes} "
      f"bytes = {_part.nbytes / _full.nbytes:.2f} (k/E = {2 / 8:.2f})")

# %% [markdown]
# ### What a benchmark measures, and a smoke test here
#
# On a GPU, `python benchmarks/bench_dequant.py` times the Triton kernel, the PyTorch
# reference, bitsandbytes and a plain copy on weights of real sizes (`4096 x 14336`, ...),
# with CUDA events, after warm-up, flushing the L2 cache before each repeat so that a weight
# is read from DRAM and not from cache; it reports GB/s with your formula, and each method's
# fraction of the copy's GB/s. The course's target (docs/ARCHITECTURE.md, Performance targets)
# is at least 80 % of the copy and at least bitsandbytes. A kernel that gets there is limited
# by DRAM and nothing else; one that does not usually reads or writes with narrow, uncoalesced
# accesses, or launches too few programs to keep every multiprocessor busy.
#
# **Here, on a CPU, no such measurement is possible.** The interpreter runs each program in
# Python and NumPy; the numbers below time the interpreter, not the kernel, and only show
# that the formula and the timing code work. Do not compare them with anything.

# %% tags=["jupyter-only"]
_q = quantize_nf4(torch.randn(256, 256).to(DEVICE), blocksize=64)
_read, _written = dequant_traffic((256, 256), 64, torch.float32)
for name, fn in (("my_dequantize_nf4", lambda: my_dequantize_nf4(_q)),
                 ("dequantize_nf4 (PyTorch)", lambda: dequantize_nf4(_q, torch.float32))):
    fn()                                                   # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        if not INTERPRET:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    secs = sorted(times)[1]
    print(f"{name:<26} {secs * 1e3:8.2f} ms  {(_read + _written) / secs / 1e9:8.3f} GB/s"
          f"{'   <- Triton INTERPRETER timing, not kernel performance' if INTERPRET and 'my' in name else ''}")

# %% [markdown]
# ## Where this goes next
#
# You now have the whole path from packed bytes to floats as a kernel, and a variant that
# touches only the experts a batch needs. Lab 04 turns to LoRA, the trainable half of QLoRA;
# Lab 06 puts a LoRA adapter on top of a frozen NF4 base whose weights are dequantized by
# exactly this kind of kernel at every step; Lab 10 uses selective dequantization for frozen
# NF4 experts, remapping the ids of the experts that received tokens to a compact range.
#
# ### Reflection
#
# 1. Your kernel loads a float32 scale for every element, although `BLOCKSIZE` consecutive
#    elements share it. Why does that cost almost nothing in DRAM traffic? What would change
#    if `BLOCKSIZE` were smaller than the number of elements one memory transaction covers?
# 2. The code table is loaded from memory with a gather instead of being written into the
#    kernel as 16 constants. Name one thing this buys you, and say why the gather is not a
#    performance problem in a memory-bound kernel.
# 3. Selective dequantization requires `out * in` to be a multiple of the blocksize. What
#    would go wrong for an expert whose first block is shared with the previous expert, and
#    what would a kernel have to do to support it anyway?
# 4. At batch size 1 with top-2 routing, selective dequantization writes a quarter of
#    Mixtral's buffer. In a training batch of 4 096 tokens, how many of the 8 experts will
#    the batch use, and what does that say about when selective dequantization pays off?
# 5. Dequantizing to a bf16 buffer and then calling a matrix product writes and re-reads the
#    whole buffer. Sketch what a kernel that fuses dequantization into the matrix product
#    would save, in bytes, for one `[14336, 4096]` weight.

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. The `BLOCKSIZE` elements that share a scale load the same address, so within a program
#    the loads fall in the same cache line and DRAM delivers each scale once: 4 bytes per 64
#    elements, 0.0625 bytes per element against 0.5 bytes of codes and 2 or 4 bytes of
#    output (it is the `4 * ceil(n / blocksize)` term of `dequant_traffic`, about 11 % of the
#    bytes read and 2.4 % of the whole traffic for Mixtral's `w1` in bf16). If `BLOCKSIZE`
#    were smaller than what one transaction covers, every transaction of codes would need
#    several distinct scales: the scale stream grows as $4/B$ bytes per element (0.5 at
#    $B = 8$, as much as the codes), so scales stop being negligible and the kernel moves
#    noticeably more bytes per weight.
# 2. It makes the kernel a generic 16-level dequantizer: the same code serves NF4, FP4 or any
#    other table (the test passes `arange(16) - 7.5` and a cubic table), and the levels are
#    bit-identical to `NF4_CODE` instead of typed decimals. The table is 64 bytes: after the
#    first access it sits in L1 (or shared memory), so its loads cost no DRAM bandwidth, and
#    DRAM bandwidth is what bounds the kernel (0.5 bytes in and 2–4 bytes out per element, for
#    a handful of operations).
# 3. The shared block's absmax was computed over elements of both experts, and expert `e`'s
#    first elements would need the scale of a block that starts in expert `e - 1`: reading it
#    breaks "read only the listed experts" (a poisoned neighbour's NaN scale would reach the
#    output), and with an odd `M` an expert would even start in the middle of a byte. A
#    kernel that supports it computes everything from global element offsets: the byte
#    `(e*M + j) // 2`, the nibble from the parity of `e*M + j`, the scale
#    `(e*M + j) // BLOCKSIZE`, and accepts that it reads up to two scale entries (and one
#    byte) shared with neighbouring experts.
# 4. With 4 096 tokens routed top-2 over 8 experts, an expert is missed by one token with
#    probability 6/8, and by all of them with probability $(3/4)^{4096} \approx 0$: the batch
#    uses all 8 experts, and selective dequantization saves nothing for the layer as a whole.
#    It pays off when few tokens are in flight (decoding: `k = 2` needs 25 % of the buffer,
#    as the chart prints) or when experts are many and each step routes to few of them. In
#    Lab 10 it bounds the transient buffer by the experts that actually received tokens,
#    and processing experts in chunks bounds it further.
# 5. For `[14336, 4096]` in bf16, `dequant_traffic` gives 33 030 144 bytes read (codes and
#    scales) and 117 440 512 bytes written. Unfused, the matrix product then reads the
#    117 440 512-byte buffer back, about 268 MB of traffic in all; fused, only the 33 MB of
#    codes and scales are read. The fused kernel saves $2 \times 117\,440\,512 \approx
#    235$ MB per weight and per pass, roughly eight times less traffic for the weight.
