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
# # Lab 08 — The MoE forward kernel: gather, grouped GEMM and scatter in one pass
#
# In Lab 07 each token chose `k` of `E` experts, and the naive MoE looped over experts in
# Python. Here you write the kernel that replaces that loop in
# [ScatterMoE](https://arxiv.org/abs/2403.08245)'s decomposition, the one `minimoe` uses:
#
# 1. **sort once**: flatten the `[T, k]` choices into `M = T·k` routing *slots* (slot
#    `s = t·k + j`) and sort them by expert (`flatten_sort_count`, from Lab 07);
# 2. **one kernel** walks the sorted rows in tiles: it *gathers* each row's token from `x`,
#    multiplies it by its expert's weight, and *scatters* the result straight to the row's
#    slot. No copy of `x` in sorted order, no padding of experts to a common size, no Python
#    loop over experts.
#
# A tile of sorted rows may hold rows of **several** experts (the boundary between two experts
# falls wherever the counts put it); the kernel loops over the experts present in its tile
# and masks the rows of the others. That is the whole trick, and the reason the kernel needs
# no padding.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `sorted_expert_linear(x, W, expert_idxs)`: the sorted dispatch in PyTorch | `reference.linear_loop` |
# | 2 | `group_kernel` + `my_group(X, ssi, fan_out, coeff)`: rows into sorted order | `minimoe.group` |
# | 3 | `scatter2scatter_kernel`: gather + per-expert GEMM + scatter | `reference.linear_loop`, `minimoe.scatter2scatter` |
# | 4 | `my_scatter2scatter(...)` (checks, allocation, grid) and `moe_linear(x, W, expert_idxs, gates)` | `minimoe.parallel_linear` forward |
# | 5 | `dispatch_work(tokens_per_expert, block_m)`: rows and tiles each approach computes | hand-counted values |
#
# **No GPU needed.** As in Lab 03, the setup cell sets `TRITON_INTERPRET=1` **before**
# `import triton` when there is no CUDA GPU, and every kernel runs in Triton's interpreter
# (NumPy, one program after another, float32 only). The interpreter is slow, so the tests use
# tiny shapes: at most a few dozen tokens. On a GPU the same kernels run compiled.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification —
# other sizes, an expert without tokens, every token to one expert, `k = 3`, bad inputs —
# and checks that your code does not call the `minimoe` functions it rebuilds (the tests
# switch them off while your code runs) and that your wrappers launch your kernels. Each
# exercise states its specification first; below it, two collapsed hints (the idea, then
# pseudocode) are there when you want them. The whole notebook
# runs in <!-- runtime:08-moe-forward-kernel -->about 5 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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

from course.notebook.harness import require_triton  # noqa: E402

require_triton("08-moe-forward-kernel")   # no triton (its wheels are Linux-only): say where to run

# The interpreter must be chosen before triton is imported (see Lab 03): @triton.jit decides
# at decoration time whether a function is compiled or interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import minimoe  # noqa: E402
import minimoe.kernels  # noqa: E402
import minimoe.parallel_experts  # noqa: E402
from course.notebook import harness  # noqa: E402
from minimoe import flatten_sort_count  # noqa: E402
from minimoe.reference import linear_loop  # noqa: E402

INTERPRET, DEVICE = harness.triton_setup()   # one CPU thread, seed 0, and where kernels run

# %% [markdown]
# ## Part A — slots, the sorted order, and tiles that span experts
#
# Notation used throughout (and in `src/minimoe/kernels.py`):
#
# * `x` `[T, K]` tokens, `W` `[E, K, N]` one `K × N` weight per expert, `expert_idxs` `[T, k]`;
# * **slot** `s = t·k + j` is token `t`'s `j`-th choice; there are `M = T·k` slots;
# * `flatten_sort_count(expert_idxs, E)` returns
#   - `sorted_expert_idxs` `[M]` (**sei**): the expert of each sorted row, non-decreasing;
#   - `sorted_scattered_idxs` `[M]` (**ssi**): the slot of each sorted row; its token is
#     `ssi[i] // k`;
#   - `expert_offsets` `[E]`: inclusive cumulative counts, i.e. the **end** row of each
#     expert: expert `e` owns sorted rows `offsets[e-1] … offsets[e] - 1` (with
#     `offsets[-1]` read as 0);
# * "**scattered**" tensors are in slot order (row `s`), "**grouped**" ones in sorted order
#   (row `i`).
#
# The expert linear every exercise computes is, for every sorted row `i`,
#
# $$Y[\,\mathrm{ssi}[i]\,] = x[\,\mathrm{ssi}[i] // k\,] \; W[\,\mathrm{sei}[i]\,],$$
#
# i.e. `Y[t·k + j] = x[t] @ W[expert_idxs[t, j]]`, `[M, N]` in slot order: exactly what
# `reference.linear_loop(x, W, expert_idxs)` computes with a loop.

# %%
demo_idx = torch.tensor([[2, 0], [4, 2], [2, 3], [0, 2], [4, 1], [2, 4]])     # T = 6, k = 2
sei, ssi, offsets = flatten_sort_count(demo_idx, num_experts=5)
print("expert_idxs (slot order):", demo_idx.reshape(-1).tolist())
print("sorted row i           :", list(range(len(sei))))
print("sorted_expert_idxs     :", sei.tolist())
print("sorted_scattered_idxs  :", ssi.tolist(), " (slot of each sorted row)")
print("token = ssi // k       :", (ssi // 2).tolist())
print("expert_offsets (ends)  :", offsets.tolist())

# %% [markdown]
# A kernel program takes `BLOCK_M` consecutive sorted rows (a **tile**). With `BLOCK_M = 4`
# the 12 sorted rows above make three tiles, `[0, 0, 1, 2 | 2, 2, 2, 2 | 3, 4, 4, 4]`, and the
# boundaries between experts do not fall on tile boundaries: the first tile holds rows of
# experts 0, 1 and 2, the second of 2 only, the third of 3 and 4. The picture shows a larger skewed routing: each column is a sorted
# row coloured by its expert, the vertical lines cut the rows into tiles of 16, and the
# numbers count the experts each tile must loop over.

# %%
def _expert_strip(ax, experts, block_m, E, title):
    cmap = plt.get_cmap("tab10", E)
    ax.imshow(experts[None, :].numpy(), aspect="auto", cmap=cmap, vmin=-0.5, vmax=E - 0.5,
              interpolation="nearest")
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)


_g = torch.Generator().manual_seed(3)
_T, _k, _E, _BM = 40, 2, 6, 16
_probs = torch.tensor([0.35, 0.25, 0.0, 0.2, 0.15, 0.05])          # expert 2 gets no token
_demo = torch.multinomial(_probs.expand(_T, _E), _k, replacement=False, generator=_g)
_sei, _ssi, _off = flatten_sort_count(_demo, _E)
fig, axes = plt.subplots(2, 1, figsize=(10, 2.8), constrained_layout=True)
_expert_strip(axes[0], _demo.reshape(-1), _BM, _E,
              f"slot order: slot s = t·k + j (T = {_T}, k = {_k}, E = {_E})")
_expert_strip(axes[1], _sei, _BM, _E,
              f"sorted order (flatten_sort_count), tiles of BLOCK_M = {_BM}")
for _t0 in range(0, len(_sei), _BM):
    _t1 = min(_t0 + _BM, len(_sei)) - 1
    axes[1].axvline(_t0 - 0.5, color="black", lw=2)
    _n = int(_sei[_t1] - _sei[_t0]) + 1
    axes[1].text((_t0 + _t1) / 2, 0, f"{_n} expert{'s' if _n > 1 else ''}", ha="center",
                 va="center", fontsize=9, color="white", weight="bold")
axes[1].set_xlabel("row")
_handles = [plt.Rectangle((0, 0), 1, 1, color=plt.get_cmap("tab10", _E)(e)) for e in range(_E)]
fig.legend(_handles, [f"expert {e}" for e in range(_E)], loc="outside right center", fontsize=8)
plt.show()
print("tokens per expert:", torch.bincount(_sei, minlength=_E).tolist(),
      "| expert_offsets:", _off.tolist())

# %% [markdown]
# ## Exercise 1 — the sorted dispatch in plain PyTorch
#
# Before any kernel, write the algorithm with PyTorch operations, in the order the kernel will
# follow.
#
# **Specification.** `sorted_expert_linear(x, W, expert_idxs)` takes `x` `[T, K]` (floating),
# `W` `[E, K, N]` (same dtype) and `expert_idxs` `[T, k]` (integers in `0 … E-1`; an expert may
# get no token) and returns `Y` `[T·k, N]` in **slot order** and in `x`'s dtype, with
# `Y[t·k + j] = x[t] @ W[expert_idxs[t, j]]`. The rule that matters is *how*: sort the slots
# by expert once (`flatten_sort_count`), gather the rows in that order, do **one matrix
# product per expert** on its contiguous slice of sorted rows, and scatter the results back
# to slot order; no loop over tokens.
#
# Off-limits: `reference.linear_loop`, `minimoe.parallel_linear` and everything in
# `minimoe.ops` / `minimoe.kernels` are switched off while the tests run your function;
# `flatten_sort_count` is yours to use.
#
# <details><summary>Hint 1: the idea</summary>
#
# After the sort, expert `e` owns the sorted rows `offsets[e-1] … offsets[e] - 1`, so its
# tokens sit next to each other and one `@` handles them all. The sorted row `i` reads token
# `ssi[i] // k` and its result belongs to slot `ssi[i]`: the same index vector does the gather
# and the scatter. Part A's printout of the 12-row example shows every one of these numbers.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# sei, ssi, offsets = flatten_sort_count(expert_idxs, E)
# Xg = x[ssi // k]                                   # gather: [M, K] in sorted order
# Yg = zeros(M, N);  start = 0
# for e, end in enumerate(offsets):                  # one product per expert
#     if end > start: Yg[start:end] = Xg[start:end] @ W[e]
#     start = end
# Y = empty(M, N);  Y[ssi] = Yg                      # scatter back to slot order
# return Y
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "sorted_expert_linear", "locked": false, "schema_version": 3, "solution": true, "task": false}
def sorted_expert_linear(x: torch.Tensor, W: torch.Tensor, expert_idxs: torch.Tensor
                         ) -> torch.Tensor:
    """Y [T·k, N], Y[t·k + j] = x[t] @ W[expert_idxs[t, j]], by sort, gather, one matmul per
    expert, scatter."""
    ### BEGIN SOLUTION
    T, k = expert_idxs.shape
    E, N = W.shape[0], W.shape[2]
    sei, ssi, offsets = flatten_sort_count(expert_idxs, E)
    Xg = x[ssi // k]                                                    # [M, K] sorted
    Yg = torch.zeros(T * k, N, dtype=x.dtype, device=x.device)          # [M, N] sorted
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            Yg[start:end] = Xg[start:end] @ W[e]
        start = end
    Y = torch.empty_like(Yg)
    Y[ssi] = Yg                                                         # [M, N] slot order
    return Y
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_sorted_expert_linear", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# What this lab rebuilds, and the loops the tests compare with: while a test runs your code
# inside `harness.forbid(_REFERENCE, globals())`, each of them raises if reached (under any name).
_REFERENCE = [(harness.resolve(_path.rpartition(".")[0]), _path.rpartition(".")[2])
              for _path in minimoe.REFERENCE["08-moe-forward-kernel"].values()]


def _launches(kernel, call, what):
    """With `kernel` switched off, call() must fail by reaching it: `what` launches it."""
    harness.must_reach([kernel], call, f"{what} did not launch its kernel: the work must "
                       "happen in the kernel", globals())


def _problem(T, K, N, E, k, seed=0, **routing):
    """x [T, K], W [E, K, N], expert_idxs [T, k] (the harness's awkward MoE problem)."""
    return harness.expert_problem(T, K, N, E, k, seed, device=DEVICE, **routing)[:3]


def _likely(got, candidates, rtol=1e-5, atol=1e-5):
    """'\nLikely rule broken: <rule>' for the first {rule: what breaking it computes} entry
    that `got` equals, '' if none does."""
    for rule, value in candidates.items():
        if isinstance(got, torch.Tensor) and got.shape == value.shape and torch.allclose(
                got.float().cpu(), value.float().cpu(), rtol=rtol, atol=atol):
            return f"\nLikely rule broken: {rule}"
    return ""


def _close(got, want, what, rtol=1e-5, atol=1e-5, hint=""):
    """got == want within tolerance, row by row; `hint` (the likely rule broken) ends the
    message."""
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, \
        f"{what}: expected a tensor of shape {tuple(want.shape)}, got " \
        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: expected dtype {want.dtype}, got {got.dtype}"
    bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)
    if bad.any():
        rows = bad.any(-1).nonzero().flatten()[:6].tolist()
        raise AssertionError(
            f"{what}: {int(bad.any(-1).sum())} of {want.shape[0]} rows differ, first rows "
            f"{rows}; row {rows[0]}: expected {want[rows[0], :4].tolist()}..., got "
            f"{got[rows[0], :4].tolist()}...{hint}")


def _check_sorted_linear(T, K, N, E, k, seed=0, **routing):
    x, W, idx = _problem(T, K, N, E, k, seed, **routing)
    want = linear_loop(x, W, idx)
    with harness.forbid(_REFERENCE, globals()):
        got = sorted_expert_linear(x, W, idx)
    _close(got, want, f"sorted_expert_linear, {harness.describe(x, W, idx)}")


# worked by hand: W[e] = (e + 1)·I, so every output row is its token times (expert + 1)
_x = torch.arange(6.0).reshape(3, 2).to(DEVICE)
_W = torch.stack([(e + 1) * torch.eye(2) for e in range(3)]).to(DEVICE)
_idx = torch.tensor([[2, 0], [1, 2], [0, 1]]).to(DEVICE)
try:
    _got = sorted_expert_linear(_x, _W, _idx)
except IndexError as _err:
    raise AssertionError(f"sorted_expert_linear(x [3, 2], ..., expert_idxs [3, 2]): an index "
                         f"out of range ({_err}); sorted row i reads the TOKEN ssi[i] // k "
                         f"(x has T rows, there are T·k slots)") from _err
_want = torch.tensor([[0, 3], [0, 1], [4, 6], [6, 9], [4, 5], [8, 10]], dtype=torch.float32)
_ssi = flatten_sort_count(_idx.cpu(), 3)[1]
assert isinstance(_got, torch.Tensor) and torch.equal(_got.cpu(), _want), \
    f"x = [[0,1],[2,3],[4,5]], W[e] = (e+1)·I, expert_idxs = [[2,0],[1,2],[0,1]]: expected " \
    f"rows {_want.tolist()} (slot order), got {_got.tolist() if hasattr(_got, 'tolist') else _got}" \
    + _likely(_got, {"scatter the sorted rows back to slot order, Y[ssi] = Yg (your rows are "
                     "in sorted order)": _want[_ssi],
                     "scatter the sorted rows back to slot order, Y[ssi] = Yg (Yg[ssi] "
                     "gathers a second time)": _want[_ssi][_ssi]})
_check_sorted_linear(7, 24, 40, 4, 2)
_check_sorted_linear(33, 40, 24, 8, 2, seed=1)
print("sorted_expert_linear matches reference.linear_loop")

### BEGIN HIDDEN TESTS
# case: an expert with no tokens
_check_sorted_linear(9, 24, 24, 4, 2, seed=2, skip=1)           # an expert with no tokens
# case: k = 3
_check_sorted_linear(11, 40, 24, 8, 3, seed=3)                   # k = 3
# case: one token
_check_sorted_linear(1, 24, 40, 4, 2, seed=4)                    # T = 1
# case: one expert
_check_sorted_linear(5, 24, 24, 1, 1, seed=5)                    # E = 1
# case: every token to one expert, or an expert unused
_check_sorted_linear(13, 24, 40, 8, 1, seed=6, only=[5])         # every token to expert 5
_check_sorted_linear(6, 40, 40, 8, 3, seed=7, skip=0)            # expert 0 unused
# case: float64 inputs
_x64, _W64, _i64 = _problem(5, 24, 24, 4, 2, seed=8)
_y64 = sorted_expert_linear(_x64.double(), _W64.double(), _i64)
assert _y64.dtype == torch.float64, f"float64 input: expected float64 output, got {_y64.dtype}"
### END HIDDEN TESTS

# %% [markdown]
# Three passes over memory: the gather writes a sorted copy `Xg` of `M × K`, the products
# write `Yg`, the scatter copies `Yg` into `Y`. And the Python loop launches one matrix
# product per expert, which for 64 or 256 small experts costs more in launch overhead than
# in arithmetic. The kernels below fuse the gather and the scatter into the matrix product,
# and replace the loop over experts with one launch.
#
# ## Exercise 2 — `group`: rows into sorted order, in a kernel
#
# Some steps do need a sorted copy (the backward pass of Lab 09 needs `x` and the output
# gradient in sorted order). The `group` kernel makes it, optionally scaling each row:
#
# $$\mathrm{out}[i, n] = X[\,\mathrm{ssi}[i] // \mathrm{FAN\_OUT},\ n\,]
#   \cdot \big(\mathrm{coeff}[\,\mathrm{ssi}[i]\,]\ \text{if HAS\_COEFF else } 1\big)$$
#
# With `FAN_OUT = k` it gathers token rows (each token appears `k` times); with `FAN_OUT = 1`
# it reorders slot rows. `coeff` holds one number per slot (e.g. the gates, flattened).
#
# **Specification.** `group_kernel(X, coeff, out, scattered_ids, M, N, sxm, sxn, som, son,
# FAN_OUT, HAS_COEFF, BLOCK_M, BLOCK_N)` computes the formula above for one tile, launched on
# the grid `(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))`: program `(p, q)` writes rows `p·BLOCK_M …`
# and columns `q·BLOCK_N …` of `out`, masked to `< M` and `< N`, and nothing outside them.
# The rules that matter:
#
# * **Use the strides**: element `(r, n)` of `X` is at `X + r·sxm + n·sxn`, of `out` at
#   `out + i·som + n·son` (the tests pass views whose rows are longer than `N`);
# * compute in float32 (`.to(tl.float32)`), convert to `out`'s type at the store
#   (`.to(out.dtype.element_ty)`);
# * when `HAS_COEFF` is false, `coeff` is a dummy pointer: do not load from it.
#
# `my_group(X, sorted_scattered_idxs, fan_out=1, coeff=None, block_m=64, block_n=64)` returns
# `out` `[M, N]` in `X`'s dtype, `M = X.shape[0] · fan_out`, computed by **your**
# `group_kernel` (the tests check that it was launched). It raises `ValueError` unless `X` is
# a 2-D floating tensor, `fan_out >= 1`, `sorted_scattered_idxs` a 1-D integer tensor of `M`
# entries and `coeff` (if given) a floating tensor of `M` elements (any shape: flatten it).
# It makes the inputs contiguous (`int64` ids) before the launch.
#
# Off-limits: `minimoe.group` and its kernel (switched off while the tests run your code).
#
# <details><summary>Hint 1: the idea</summary>
#
# Each program first loads the slot ids of its `BLOCK_M` rows (masked, with `other=0` so the
# masked rows still form a valid address), turns them into rows of `X` with `// FAN_OUT`, and
# then loads a `[BLOCK_M, BLOCK_N]` block with a 2-D mask: rows `< M` and columns `< N`. The
# same 2-D mask guards the store. The wrapper is Lab 03's pattern: check, make contiguous,
# allocate, launch, return; under `HAS_COEFF = False` pass any tensor (e.g. `X`) as the dummy.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# i = pid(0) * BLOCK_M + arange(BLOCK_M);  n = pid(1) * BLOCK_N + arange(BLOCK_N)   # int64
# rows = i < M;  mask = rows[:, None] & (n < N)[None, :]
# s = load(scattered_ids + i, rows, other=0)
# x = load(X + (s // FAN_OUT)[:, None] * sxm + n[None, :] * sxn, mask, other=0) as float32
# if HAS_COEFF: x *= load(coeff + s, rows, other=0)[:, None]
# store(out + i[:, None] * som + n[None, :] * son, x as out's dtype, mask)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "group", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def group_kernel(
    X,              # [rows of X, N] input rows
    coeff,          # [M] per-slot scale (read only if HAS_COEFF)
    out,            # [M, N] output, sorted order
    scattered_ids,  # [M] int64 sorted_scattered_idxs
    M, N,           # sizes
    sxm, sxn,       # strides of X
    som, son,       # strides of out
    FAN_OUT: tl.constexpr,    # X row of slot s is s // FAN_OUT
    HAS_COEFF: tl.constexpr,  # multiply each row by coeff[slot]
    BLOCK_M: tl.constexpr,    # rows per program
    BLOCK_N: tl.constexpr,    # columns per program
):
    """out[i, n] = X[ssi[i] // FAN_OUT, n] (* coeff[ssi[i]]) for this program's tile."""
    ### BEGIN SOLUTION
    i = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)    # [BM]
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)    # [BN]
    m_mask = i < M
    mask = m_mask[:, None] & (n < N)[None, :]
    s_i = tl.load(scattered_ids + i, mask=m_mask, other=0)
    x = tl.load(X + (s_i // FAN_OUT)[:, None] * sxm + n[None, :] * sxn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_COEFF:
        c = tl.load(coeff + s_i, mask=m_mask, other=0.0).to(tl.float32)
        x = x * c[:, None]
    tl.store(out + i[:, None] * som + n[None, :] * son, x.to(out.dtype.element_ty), mask=mask)
    ### END SOLUTION


def my_group(X: torch.Tensor, sorted_scattered_idxs: torch.Tensor, fan_out: int = 1,
             coeff: torch.Tensor | None = None, block_m: int = 64, block_n: int = 64
             ) -> torch.Tensor:
    """[M, N] with row i = X[ssi[i] // fan_out] (· coeff[ssi[i]]), M = X.shape[0] · fan_out."""
    ### BEGIN SOLUTION
    if not isinstance(X, torch.Tensor) or X.dim() != 2 or not X.dtype.is_floating_point:
        raise ValueError("X must be a 2-D floating tensor [rows, N]")
    if not isinstance(fan_out, int) or fan_out < 1:
        raise ValueError(f"fan_out must be an int >= 1, got {fan_out!r}")
    M, N = X.shape[0] * fan_out, X.shape[1]
    ssi = sorted_scattered_idxs
    if (not isinstance(ssi, torch.Tensor) or ssi.dim() != 1 or ssi.shape[0] != M
            or ssi.dtype.is_floating_point or ssi.dtype == torch.bool):
        raise ValueError(f"sorted_scattered_idxs must be a 1-D integer tensor of M = {M} "
                         f"entries, got {getattr(ssi, 'dtype', type(ssi).__name__)} "
                         f"{tuple(getattr(ssi, 'shape', ()))}")
    if coeff is not None:
        if (not isinstance(coeff, torch.Tensor) or not coeff.dtype.is_floating_point
                or coeff.numel() != M):
            raise ValueError(f"coeff must be a floating tensor of M = {M} elements")
        coeff = coeff.reshape(-1).contiguous()
    X = X.contiguous()
    ssi = ssi.to(torch.int64).contiguous()
    out = torch.empty(M, N, dtype=X.dtype, device=X.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    group_kernel[grid](X, X if coeff is None else coeff, out, ssi, M, N,
                       X.stride(0), X.stride(1), out.stride(0), out.stride(1),
                       FAN_OUT=fan_out, HAS_COEFF=coeff is not None,
                       BLOCK_M=block_m, BLOCK_N=block_n)
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_group", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _launch_group(T, N, k, E=4, BLOCK_M=16, BLOCK_N=16, with_coeff=True, seed=0):
    """Launch group_kernel directly on strided views; whatever lies outside must survive."""
    g = torch.Generator().manual_seed(seed)
    M = T * k
    _, ssi, _ = flatten_sort_count(harness.expert_routing(T, k, E, seed), E)
    Xbuf = torch.randn(T, N + 5, generator=g)
    X = Xbuf[:, :N]                                          # rows of N + 5: stride 0 = N + 5
    coeff = torch.rand(M, generator=g) + 0.5
    want = X[ssi // k] * (coeff[ssi][:, None] if with_coeff else 1.0)
    Xbuf, coeff, ssi = Xbuf.to(DEVICE), coeff.to(DEVICE), ssi.to(DEVICE)
    X = Xbuf[:, :N]
    buf = torch.full((M + BLOCK_M, N + 7), -999.0, device=DEVICE)
    out = buf[:, :N]
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    with harness.outputs(buf):                           # the buffer the kernel writes
        group_kernel[grid](X, coeff if with_coeff else X, out, ssi, M, N, X.stride(0),
                           X.stride(1), out.stride(0), out.stride(1), FAN_OUT=k,
                           HAS_COEFF=with_coeff, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    where = (f"group_kernel[{grid}](..., M={M}, N={N}, FAN_OUT={k}, HAS_COEFF={with_coeff}, "
             f"BLOCK_M={BLOCK_M}, BLOCK_N={BLOCK_N}), X and out with row strides "
             f"{X.stride(0)} and {out.stride(0)}")
    buf = buf.cpu()
    assert (buf[:, N:] == -999.0).all(), \
        f"{where} wrote columns past out[:, :N]: mask the columns with n < N"
    assert (buf[M:] == -999.0).all(), \
        f"{where} wrote rows past out[:M]: mask the rows with i < M (load and store)"
    xrows = Xbuf.cpu()[ssi.cpu() // k, :N]                           # [M, N] unscaled
    scale = coeff.cpu()[ssi.cpu()][:, None] if with_coeff else 1.0
    packed = Xbuf.cpu().flatten()[((ssi.cpu() // k) * N)[:, None] + torch.arange(N)]
    hint = _likely(buf[:M, :N], {
        "HAS_COEFF: multiply each row by coeff[ssi[i]], the scale of its slot": xrows,
        "coeff is read at the slot ssi[i], not at the sorted row i":
            xrows * coeff.cpu()[:M, None],
        "address X by its strides (sxm, sxn): its rows are longer than N": packed * scale},
        rtol=1e-6, atol=1e-6) if (with_coeff or X.stride(0) != N) else ""
    _close(buf[:M, :N], want, where, rtol=1e-6, atol=1e-6, hint=hint)


def _naive_group(X, ssi, fan_out, coeff=None):
    """Sorted row by sorted row, in Python: row i = X[ssi[i] // fan_out], times
    coeff.flatten()[ssi[i]] when a coeff is given. [M, N] in X's dtype."""
    c = None if coeff is None else coeff.reshape(-1)
    rows = [X[s // fan_out] if c is None else X[s // fan_out] * c[s] for s in ssi.tolist()]
    return torch.stack(rows) if rows else X.new_empty(0, X.shape[1])


def _check_my_group(T, N, k, E=4, with_coeff=False, seed=0, check_spy=False, library=False):
    """my_group against the row-by-row loop above (library=True, for grading: against
    minimoe.group)."""
    g = torch.Generator().manual_seed(seed)
    _, ssi, _ = flatten_sort_count(harness.expert_routing(T, k, E, seed), E)
    X = torch.randn(T, N, generator=g).to(DEVICE)
    coeff = (torch.rand(T, k, generator=g) + 0.5).to(DEVICE) if with_coeff else None
    ssi = ssi.to(DEVICE)
    want = minimoe.group(X, ssi, fan_out=k, coeff=coeff) if library else \
        _naive_group(X, ssi, k, coeff)
    with harness.forbid(_REFERENCE, globals()):
        got = my_group(X, ssi, fan_out=k, coeff=coeff)
    where = f"my_group(X [{T}, {N}], ssi, fan_out={k}, coeff {'[T, k]' if with_coeff else None})"
    _close(got, want, where, rtol=1e-6, atol=1e-6)
    if check_spy:
        _launches(group_kernel, lambda: my_group(X, ssi, fan_out=k, coeff=coeff), where)


_launch_group(7, 24, 2)                          # rows and columns both end mid-tile
_launch_group(5, 40, 3, with_coeff=False, seed=1)
_check_my_group(7, 24, 2, check_spy=True)                 # my_group must launch group_kernel
_check_my_group(9, 40, 3, with_coeff=True, seed=2)
for _what, _args in (("sorted_scattered_idxs of 11 entries for M = 12",
                      (torch.zeros(6, 24), torch.arange(11), 2)),
                     ("fan_out = 0", (torch.zeros(6, 24), torch.arange(0), 0))):
    with harness.forbid([group_kernel], globals(),
                        why=f"{_what} must be refused with a ValueError before any launch"):
        try:
            my_group(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in _args))
        except ValueError:
            continue
    raise AssertionError(f"my_group accepted {_what}; expected a ValueError")
print("group_kernel and my_group match a row-by-row gather, strides and masks included")

### BEGIN HIDDEN TESTS
# case: the kernel launched directly, several tile sizes and routings
_launch_group(1, 24, 1, E=1, BLOCK_M=16, BLOCK_N=32, seed=3)
_launch_group(33, 40, 2, E=8, BLOCK_M=16, BLOCK_N=16, seed=4)
_launch_group(11, 24, 3, E=8, BLOCK_M=32, BLOCK_N=16, seed=5)
# case: my_group with and without coeff, and the wrapper launches the kernel
_check_my_group(33, 24, 2, E=8, with_coeff=True, seed=6, check_spy=True, library=True)
_check_my_group(4, 40, 1, with_coeff=False, seed=7, check_spy=True, library=True)
# case: coeff given flat [M]
_Xg = torch.randn(6, 24).to(DEVICE)
_, _ssig, _ = flatten_sort_count(harness.expert_routing(6, 2, 4, 8), 4)
_cg = (torch.rand(12) + 0.5).to(DEVICE)
_close(my_group(_Xg, _ssig.to(DEVICE), 2, _cg), minimoe.group(_Xg, _ssig.to(DEVICE), 2, _cg),
       "my_group with a flat coeff [M]", rtol=1e-6, atol=1e-6)
# case: inputs the wrapper must refuse
for _what, _args in (("1-D X", (torch.zeros(6), _ssig, 2)),
                     ("fan_out = 0", (_Xg.cpu(), _ssig, 0)),
                     ("ssi of the wrong length", (_Xg.cpu(), _ssig[:-1], 2)),
                     ("float ssi", (_Xg.cpu(), _ssig.float(), 2)),
                     ("coeff of the wrong size", (_Xg.cpu(), _ssig, 2, torch.ones(5)))):
    try:
        my_group(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in _args))
    except ValueError:
        pass
    else:
        raise AssertionError(f"my_group accepted {_what}; expected ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 3 — `scatter2scatter`: gather + per-expert GEMM + scatter
#
# Now the kernel that does the expert linear in one pass. For every sorted row `i` of its
# tile it reads the row of `X` it needs, multiplies by the weight of its expert, and writes
# the result to the row of `Y` it belongs to.
#
# **Specification.** `scatter2scatter_kernel` (signature below, launched on the grid
# `(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))`; program `(p, q)` owns sorted rows `p·BLOCK_M …` and
# output columns `q·BLOCK_N …`) computes, for each sorted row `i < M` of its tile and each
# column `n < N` of its block,
#
# `Y[yrow(i), n] = Σ_k X[xrow(i), k] · W[sei[i], k, n]`, where `xrow(i) = i` if `X_GROUPED`
# else `ssi[i] // FAN_OUT`, and `yrow(i) = i` if `Y_GROUPED` else `ssi[i]`,
#
# and writes nothing else. The rules that matter:
#
# * **A tile may hold rows of several experts** (`sei` is non-decreasing, and expert
#   boundaries fall anywhere): each row must be multiplied by its own expert's weight, with no
#   padding and no copy of `X`.
# * **Masks at every edge**: rows `i < M`, columns `n < N`, and the reduction `k < K` (the
#   tests fill `X`'s columns past `K` with `NaN` and surround `Y` with sentinels).
# * **float32 accumulation**, `tl.dot(..., input_precision="ieee")` (on a GPU a float32 dot is
#   otherwise TF32 and misses the tolerance; the interpreter ignores the flag); convert to
#   `Y`'s type only at the store. Block sizes are at least 16.
# * **Strides, not shapes**: address `X` by `sxm, sxk`, `W` by `swe, swk, swn`, `Y` by
#   `sym, syn`; the tests pass views whose rows are longer than `N`.
# * **Offsets in int64**: convert the program ids with `.to(tl.int64)` before multiplying
#   (harmless here, but on a GPU `row · stride` passes 2³¹; the ids you load are int64).
#
# The tests launch your kernel directly with `BLOCK_M = 16` (so tiles span experts) and
# `BLOCK_K = BLOCK_N = 16` on `K, N ∈ {24, 40}` (so the last K and N tiles are partial).
#
# <details><summary>Hint 1: the idea</summary>
#
# Loop over the experts present in the tile, and in each pass let only that expert's rows
# load real values: the other rows load as zeros (through the mask), so they add nothing to
# the accumulator in that pass. Each row thus contributes only in the pass of its own expert.
# Because the ids are sorted, the first and the last row of the tile bound its experts: load
# `sorted_expert_idxs[pid_m·BLOCK_M]` and `sorted_expert_idxs[min(pid_m·BLOCK_M + BLOCK_M, M)
# - 1]` (two scalar loads; the `min` keeps the last, partial tile inside the tensor), and loop
# `for e in range(e_first, e_last + 1)`. Experts in between that received no token cost a
# pass of zeros and are otherwise harmless. The store happens once, after all passes, masked
# by `i < M` (not by one expert's rows).
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# # grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
# i     = pid_m * BLOCK_M + arange(BLOCK_M)          # sorted rows of this tile (mask i < M)
# e_i   = sorted_expert_idxs[i];  s_i = sorted_scattered_idxs[i]
# xrow  = i if X_GROUPED else s_i // FAN_OUT         # which row of X each sorted row reads
# yrow  = i if Y_GROUPED else s_i                    # where its output goes
# n     = pid_n * BLOCK_N + arange(BLOCK_N)          # output columns (mask n < N)
# acc   = zeros([BLOCK_M, BLOCK_N], float32)
# for e in e_first .. e_last:                        # the experts present in this tile
#     rows = (i < M) & (e_i == e)                    # a tile may span several experts
#     for k0 in 0 .. K step BLOCK_K:                 # mask k0 + arange(BLOCK_K) < K
#         x = X[xrow, k0:k0+BLOCK_K]   masked by rows (other rows load as 0)   # [BM, BK]
#         w = W[e, k0:k0+BLOCK_K, n]                                            # [BK, BN]
#         acc += dot(x, w)
# Y[yrow, n] = acc                                   # masked by i < M and n < N
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "scatter2scatter_kernel", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def scatter2scatter_kernel(
    X,              # [rows of X, K] input: token rows (scattered) or sorted rows (X_GROUPED)
    W,              # [E, K, N] expert weights
    Y,              # [M, N] output: slot order, or sorted order (Y_GROUPED)
    expert_ids,     # [M] int64 sorted_expert_idxs (non-decreasing)
    scattered_ids,  # [M] int64 sorted_scattered_idxs (slot s = token * FAN_OUT + j)
    M, K, N,        # sizes (runtime ints)
    sxm, sxk,       # strides of X
    swe, swk, swn,  # strides of W
    sym, syn,       # strides of Y
    FAN_OUT: tl.constexpr,    # k: slots per token (X row of slot s is s // FAN_OUT)
    X_GROUPED: tl.constexpr,  # True: X row of sorted row i is i
    Y_GROUPED: tl.constexpr,  # True: output row of sorted row i is i (else its slot)
    BLOCK_M: tl.constexpr,    # sorted rows per program
    BLOCK_N: tl.constexpr,    # output columns per program
    BLOCK_K: tl.constexpr,    # reduction step
):
    """Y[yrow(i), n] = X[xrow(i)] @ W[expert_ids[i], :, n] for this program's tile."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # [BM] sorted rows
    m_mask = i < M
    e_i = tl.load(expert_ids + i, mask=m_mask, other=-1)            # [BM]
    s_i = tl.load(scattered_ids + i, mask=m_mask, other=0)          # [BM]
    if X_GROUPED:
        xrow = i
    else:
        xrow = s_i // FAN_OUT
    if Y_GROUPED:
        yrow = i
    else:
        yrow = s_i
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BN]
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)                                      # [BK]
    e_first = tl.load(expert_ids + pid_m * BLOCK_M)                 # ids are sorted: the
    e_last = tl.load(expert_ids + tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1)  # ends bound
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for e in range(e_first, e_last + 1):
        rows = m_mask & (e_i == e)                                  # [BM] this expert's rows
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + kk) < K
            x = tl.load(X + xrow[:, None] * sxm + (k0 + kk)[None, :] * sxk,
                        mask=rows[:, None] & k_mask[None, :], other=0.0)      # [BM, BK]
            w = tl.load(W + e * swe + (k0 + kk)[:, None] * swk + n[None, :] * swn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)    # [BK, BN]
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    tl.store(Y + yrow[:, None] * sym + n[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_scatter2scatter_kernel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _launch_s2s(T, K, N, E, k, x_grouped=False, y_grouped=False, BLOCK_M=16, BLOCK_N=16,
                BLOCK_K=16, seed=0, **routing):
    """Launch scatter2scatter_kernel directly on strided views; compare with linear_loop.
    Past every tensor's end lies poison, so that a read the rules forbid changes the result
    instead of crashing: NaN after X's rows and columns, the id -1 after the expert ids."""
    x, W, idx = _problem(T, K, N, E, k, seed, **routing)
    M = T * k
    sei, ssi, _ = flatten_sort_count(idx, E)
    want = linear_loop(x, W, idx)                                      # [M, N] slot order
    if y_grouped:
        want = want[ssi]                                               # sorted order
    xin = x[ssi // k] if x_grouped else x                              # [M or T, K]
    xbuf = torch.full((M + BLOCK_M, K + 3), float("nan"), device=DEVICE)
    xbuf[:xin.shape[0], :K] = xin
    X = xbuf[:xin.shape[0], :K]            # its columns K.. and rows past its end are NaN
    ids = torch.full((2, M + BLOCK_M), -1, dtype=torch.int64, device=DEVICE)
    ids[0, :M], ids[1, :M] = sei, ssi
    sei_, ssi_ = ids[0, :M], ids[1, :M]    # what follows them is -1: never read it
    buf = torch.full((M + BLOCK_M, N + 5), -999.0, device=DEVICE)
    Y = buf[:, :N]
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    with harness.outputs(buf):                           # the buffer the kernel writes
        scatter2scatter_kernel[grid](
            X, W, Y, sei_, ssi_, M, K, N, X.stride(0), X.stride(1),
            W.stride(0), W.stride(1), W.stride(2), Y.stride(0), Y.stride(1),
            FAN_OUT=k, X_GROUPED=x_grouped, Y_GROUPED=y_grouped,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    where = (f"scatter2scatter_kernel[{grid}], {harness.describe(x, W, idx)}, x_grouped={x_grouped}, "
             f"y_grouped={y_grouped}, BLOCK_M/N/K = {BLOCK_M}/{BLOCK_N}/{BLOCK_K}")
    _close(buf[:M, :N], want, where, hint=_s2s_rule(buf, want, ssi, y_grouped, BLOCK_M))
    outside = buf.clone()
    outside[:M, :N] = -999.0
    assert (outside == -999.0).all(), \
        f"{where} wrote outside Y[:M, :N]: mask the store with i < M and n < N"


def _s2s_rule(buf, want, ssi, y_grouped, BLOCK_M):
    """The rule a wrong output of scatter2scatter_kernel most likely broke, in words."""
    M, N = want.shape
    got = buf[:M, :N].cpu()
    want = want.cpu()
    zero = (got == 0).all(1) & (want != 0).any(1)                       # [M] rows left at 0
    in_sorted = zero if y_grouped else zero[ssi.cpu()]                  # by sorted row
    tail = (M // BLOCK_M) * BLOCK_M                                     # the partial tile
    rule = ""
    if torch.isnan(got).all():
        rule = ("NaN everywhere: the X tile read the columns past K (NaN in the tests): mask "
                "the reduction with k < K")
    elif torch.isnan(got).any():
        rule = ("NaN rows: a row of X past its end was read: the X row of sorted row i is "
                "ssi[i] // k, the token (i itself when X_GROUPED)")
    elif torch.allclose(buf.cpu().flatten()[:M * N].view(M, N), want, atol=1e-5):
        rule = "address Y by its strides (sym, syn): its rows are longer than N"
    elif (got == -999.0).any():
        rule = ("rows kept the sentinel -999: mask the store with i < M, once after all the "
                "passes (not with one expert's rows)")
    elif tail < M and in_sorted[tail:].all() and not in_sorted[:tail].any():
        rule = ("the last, partial tile computed nothing: read its last expert id at "
                "min(pid·BLOCK_M + BLOCK_M, M) - 1 (past M lie other values: here -1)")
    elif zero.any():
        rule = ("rows came out as zeros: loop over every expert of the tile, e_first to "
                "e_last INCLUSIVE (range(e_first, e_last + 1))")
    elif not y_grouped and torch.allclose(got, want[ssi.cpu()], atol=1e-5):
        rule = ("the rows are in sorted order: with Y_GROUPED false, sorted row i writes row "
                "ssi[i], its slot")
    elif ((got - want).abs().max() < 1e-2 * want.abs().max()):
        rule = ("small errors: multiply and accumulate in float32 (float32 tiles into "
                "tl.dot, a float32 accumulator)")
    return f"\nLikely rule broken: {rule}" if rule else ""


_launch_s2s(7, 24, 40, 4, 2)                        # partial K and N tiles
_launch_s2s(33, 40, 24, 8, 2, seed=1)               # 66 sorted rows: tiles span experts
_launch_s2s(9, 24, 24, 4, 3, seed=2, skip=2)        # k = 3, expert 2 without tokens
print("scatter2scatter_kernel matches reference.linear_loop (slot order in and out)")

### BEGIN HIDDEN TESTS
# case: one token, one expert
_launch_s2s(1, 24, 40, 4, 2, seed=3)                               # T = 1
_launch_s2s(1, 40, 24, 1, 1, seed=4)                               # T = 1, E = 1
_launch_s2s(7, 40, 40, 1, 1, seed=5)                               # E = 1
# case: every token to one expert, unused experts, gaps inside a tile
_launch_s2s(33, 24, 24, 8, 1, seed=6, only=[3])                    # every token to expert 3
_launch_s2s(33, 24, 40, 8, 3, seed=7, skip=0)                      # k = 3, expert 0 unused
_launch_s2s(33, 40, 24, 4, 2, seed=8, skip=3)                      # last expert unused
_launch_s2s(12, 40, 24, 8, 2, seed=9, only=[0, 2, 7])              # gaps inside a tile
# case: larger and single tiles
_launch_s2s(33, 40, 40, 8, 2, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, seed=10)
_launch_s2s(7, 24, 24, 4, 2, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, seed=11)   # one tile
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_scatter2scatter_grouped", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
for _KN, _flags, _rule in (((24, 40), {"x_grouped": True, "seed": 12},  # X in sorted order
                            "with X_GROUPED the X row of sorted row i is i itself"),
                           ((40, 24), {"y_grouped": True, "seed": 13},  # Y in sorted order
                            "with Y_GROUPED sorted row i writes row i itself")):
    try:
        _launch_s2s(7, *_KN, 4, 2, **_flags)
    except AssertionError as _e:
        raise AssertionError(f"{_e}\nRule: {_rule}") from _e
print("scatter2scatter_kernel handles x_grouped and y_grouped")

### BEGIN HIDDEN TESTS
# case: x_grouped and y_grouped together, an unused expert
_launch_s2s(33, 24, 24, 8, 3, x_grouped=True, y_grouped=True, seed=14, skip=4)
# case: x_grouped with one token
_launch_s2s(1, 40, 40, 4, 2, x_grouped=True, seed=15)
# case: y_grouped, every token to one expert
_launch_s2s(13, 24, 40, 8, 1, y_grouped=True, seed=16, only=[6])
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 4 — the launcher, and a gated MoE linear
#
# A kernel is only as safe as the function that launches it: a wrong shape or an id out of
# range makes the kernel read or write outside its tensors: in the interpreter that gives
# wrong values or crashes the Python process (a segmentation fault), on a GPU a fault or,
# worse, silently wrong values.
#
# **Specification.** `my_scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k,
# x_grouped=False, y_grouped=False, block_m=64, block_n=64, block_k=32)` returns `Y` `[M, N]`
# (`M = len(sorted_expert_idxs)`, `X`'s dtype), the expert linear of Exercise 3. It must raise a `ValueError` **whose message names the
# offending argument** (`"X"`, `"W"`, `"k"`, `"sorted_expert_idxs"`,
# `"sorted_scattered_idxs"`) when:
#
# * `X` or `W` is not a tensor, `X` is not 2-D or `W` not 3-D, or their `K`s differ;
# * `X` and `W` have different dtypes (name both);
# * under the interpreter (`INTERPRET`), `X` or `W` is not float32: the interpreter has no
#   bfloat16 arithmetic (say so in the message); compiled on a GPU, float16 and bfloat16 are
#   fine, and the tensors must be on the GPU;
# * `k` is not in `1 … E` (a token cannot choose more distinct experts than there are);
# * `sorted_expert_idxs` is not a 1-D integer tensor, or its values are outside `0 … E-1`;
# * `sorted_scattered_idxs` is not a 1-D integer tensor of the same length `M`, or its values
#   are outside `0 … M-1`;
# * `M` is not a multiple of `k`, or `X` has the wrong number of rows (`M // k` tokens, or
#   `M` rows when `x_grouped`) — name `"X"`.
#
# Otherwise it makes `X`, `W` and the ids contiguous (ids as int64), allocates `Y`, and
# launches **your** `scatter2scatter_kernel` on the grid `(cdiv(M, block_m), cdiv(N, block_n))`
# (the tests check the launch); when `M = 0` it returns the empty `Y` without launching.
#
# Finally `moe_linear(x, W, expert_idxs, gates)`: `x` `[T, K]`, `expert_idxs` and `gates`
# `[T, k]` → `[T, N]` with row `t = Σ_j gates[t, j] · x[t] @ W[expert_idxs[t, j]]`, computed
# through `my_scatter2scatter`. It raises `ValueError` naming `"gates"` if `gates` is not
# `[T, k]`. This is the forward pass of `minimoe.parallel_linear(..., gates=gates)`, which the
# tests switch off while yours runs.
#
# <details><summary>Hint 1: the idea</summary>
#
# Check in the order of the list, so that each message can name the argument it is about;
# index tensors need a min and a max only when they are not empty. For `moe_linear`, sort with
# `flatten_sort_count`, get `Y` `[T·k, N]` in slot order from `my_scatter2scatter`: slot
# `t·k + j` is row `j` of token `t`, so a reshape to `[T, k, N]` lines the rows up with
# `gates` `[T, k]`, and a weighted sum over `k` mixes them.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# my_scatter2scatter:
#     check X, W (tensors, dims, same K, same dtype, float32 under INTERPRET), k in 1..E
#     check sei: 1-D integer, values in 0..E-1;  M = len(sei)
#     check ssi: 1-D integer, length M, values in 0..M-1
#     check M % k == 0 and X rows == (M if x_grouped else M // k)
#     X, W, ids contiguous (ids int64);  Y = empty(M, N, dtype of X)
#     if M == 0: return Y
#     scatter2scatter_kernel[(cdiv(M, block_m), cdiv(N, block_n))](..., FAN_OUT=k, ...)
#     return Y
# moe_linear:
#     check gates is [T, k];  sei, ssi, _ = flatten_sort_count(expert_idxs, E)
#     Y = my_scatter2scatter(x, W, sei, ssi, k)                   # [T·k, N] slot order
#     return (gates[..., None] * Y.view(T, k, N)).sum(1)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "launcher", "locked": false, "schema_version": 3, "solution": true, "task": false}
def my_scatter2scatter(X: torch.Tensor, W: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                       sorted_scattered_idxs: torch.Tensor, k: int, x_grouped: bool = False,
                       y_grouped: bool = False, block_m: int = 64, block_n: int = 64,
                       block_k: int = 32) -> torch.Tensor:
    """Y [M, N]: Y[yrow(i)] = X[xrow(i)] @ W[sorted_expert_idxs[i]], by scatter2scatter_kernel."""
    ### BEGIN SOLUTION
    for name, t in (("X", X), ("W", W)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if INTERPRET and t.dtype != torch.float32:
            raise ValueError(f"{name} is {t.dtype}, but the Triton interpreter is float32-only")
        if not INTERPRET and t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; compiled Triton needs a CUDA tensor")
    if X.dtype != W.dtype:
        raise ValueError(f"X ({X.dtype}) and W ({W.dtype}) must have the same dtype")
    if X.dim() != 2 or W.dim() != 3 or X.shape[1] != W.shape[1]:
        raise ValueError(f"X must be [rows, K] and W [E, K, N] with the same K, got X "
                         f"{tuple(X.shape)} and W {tuple(W.shape)}")
    E, K, N = W.shape
    if not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"k must be an int in 1..{E} (the number of experts), got {k!r}")

    def index(t, name, length, hi):
        if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point
                or t.dtype == torch.bool or (length is not None and t.shape[0] != length)):
            raise ValueError(f"{name} must be a 1-D integer tensor"
                             + (f" of {length} entries" if length is not None else ""))
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= hi):
            raise ValueError(f"{name} must lie in 0..{hi - 1}, got "
                             f"{int(t.min())}..{int(t.max())}")
        return t.to(device=X.device, dtype=torch.int64).contiguous()

    sei = index(sorted_expert_idxs, "sorted_expert_idxs", None, E)
    M = sei.shape[0]
    ssi = index(sorted_scattered_idxs, "sorted_scattered_idxs", M, M)
    rows = M if x_grouped else M // k
    if M % k or X.shape[0] != rows:
        raise ValueError(f"X has {X.shape[0]} rows; expected {rows} "
                         f"({'M' if x_grouped else 'M / k'} with M = {M}, k = {k})")
    X, W = X.contiguous(), W.contiguous()
    Y = torch.empty(M, N, dtype=X.dtype, device=X.device)
    if M == 0:
        return Y
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    scatter2scatter_kernel[grid](
        X, W, Y, sei, ssi, M, K, N, X.stride(0), X.stride(1),
        W.stride(0), W.stride(1), W.stride(2), Y.stride(0), Y.stride(1),
        FAN_OUT=k, X_GROUPED=x_grouped, Y_GROUPED=y_grouped,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return Y
    ### END SOLUTION


def moe_linear(x: torch.Tensor, W: torch.Tensor, expert_idxs: torch.Tensor,
               gates: torch.Tensor) -> torch.Tensor:
    """[T, N]: row t = Σ_j gates[t, j] · x[t] @ W[expert_idxs[t, j]]."""
    ### BEGIN SOLUTION
    T, k = expert_idxs.shape
    if not isinstance(gates, torch.Tensor) or tuple(gates.shape) != (T, k):
        raise ValueError(f"gates must have shape [T, k] = [{T}, {k}], got "
                         f"{tuple(getattr(gates, 'shape', ()))}")
    sei, ssi, _ = flatten_sort_count(expert_idxs, W.shape[0])
    Y = my_scatter2scatter(x, W, sei, ssi, k)                          # [T·k, N] slot order
    return (gates.to(Y.dtype).unsqueeze(-1) * Y.view(T, k, -1)).sum(1)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_launcher_checks", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _expect_value_error(what, names, fn):
    try:
        fn()
    except ValueError as err:
        missing = [n for n in names if n not in str(err)]
        assert not missing, f"{what}: the ValueError must name {names}, got: {err}"
        return
    except NotImplementedError:
        raise
    except Exception as err:
        raise AssertionError(f"{what}: expected ValueError, got {type(err).__name__}: "
                             f"{err}") from err
    raise AssertionError(f"{what}: expected ValueError, nothing was raised")


_x, _W, _idx = _problem(6, 24, 40, 4, 2, seed=20)
_sei, _ssi, _ = flatten_sort_count(_idx, 4)
with harness.forbid(_REFERENCE, globals()):
    _Y = my_scatter2scatter(_x, _W, _sei, _ssi, 2)
_close(_Y, linear_loop(_x, _W, _idx), f"my_scatter2scatter, {harness.describe(_x, _W, _idx)}")
_launches(scatter2scatter_kernel, lambda: my_scatter2scatter(_x, _W, _sei, _ssi, 2),
          "my_scatter2scatter")
_expect_value_error("k = 5 > E = 4 (rule: k in 1..E)", ["k"],
                    lambda: my_scatter2scatter(_x, _W, _sei, _ssi, 5))
_expect_value_error("X float32, W float64 (rule: one dtype for X and W)", ["W"],
                    lambda: my_scatter2scatter(_x, _W.double(), _sei, _ssi, 2))
if INTERPRET:
    _expect_value_error("bfloat16 under the interpreter", ["X"],
                        lambda: my_scatter2scatter(_x.bfloat16(), _W.bfloat16(), _sei, _ssi, 2))
# inputs that would send the kernel outside its tensors: refused before any launch
with harness.forbid([scatter2scatter_kernel], globals(),
                    why="these inputs would make it read or write outside its tensors; "
                        "check them and raise ValueError before launching"):
    _expect_value_error("an expert id 4 with E = 4 (rule: expert ids in 0..E-1)",
                        ["sorted_expert_idxs"],
                        lambda: my_scatter2scatter(_x, _W, torch.full_like(_sei, 4), _ssi, 2))
    _expect_value_error("a slot id 12 with M = 12 (rule: slot ids in 0..M-1)",
                        ["sorted_scattered_idxs"],
                        lambda: my_scatter2scatter(_x, _W, _sei, torch.full_like(_ssi, 12), 2))
    _expect_value_error("X with 4 rows for M = 12, k = 2 (rule: X has M // k rows)", ["X"],
                        lambda: my_scatter2scatter(_x[:4], _W, _sei, _ssi, 2))
    _expect_value_error("k = 6 > E = 4, X with M // k = 2 rows (rule: k in 1..E)", ["k"],
                        lambda: my_scatter2scatter(_x[:2], _W, _sei, _ssi, 6))
print("my_scatter2scatter launches your kernel and names the argument it refuses")

### BEGIN HIDDEN TESTS
# case: bad k, expert ids or slot ids
_expect_value_error("k = 0", ["k"], lambda: my_scatter2scatter(_x, _W, _sei, _ssi, 0))
_expect_value_error("an expert id -1", ["sorted_expert_idxs"],
                    lambda: my_scatter2scatter(_x, _W, _sei - 1, _ssi, 2))
_expect_value_error("float expert ids", ["sorted_expert_idxs"],
                    lambda: my_scatter2scatter(_x, _W, _sei.float(), _ssi, 2))
_expect_value_error("slot id 12 with M = 12", ["sorted_scattered_idxs"],
                    lambda: my_scatter2scatter(_x, _W, _sei, _ssi + 1, 2))
_expect_value_error("sorted_scattered_idxs shorter than M", ["sorted_scattered_idxs"],
                    lambda: my_scatter2scatter(_x, _W, _sei, _ssi[:-2], 2))
# case: X or W of the wrong shape or dtype
_expect_value_error("X with 5 rows for M = 12, k = 2", ["X"],
                    lambda: my_scatter2scatter(_x[:5], _W, _sei, _ssi, 2))
_expect_value_error("X with K = 40, W with K = 24", ["X"],
                    lambda: my_scatter2scatter(torch.zeros(6, 40, device=DEVICE), _W, _sei,
                                               _ssi, 2))
_expect_value_error("W 2-D", ["W"], lambda: my_scatter2scatter(_x, _W[0], _sei, _ssi, 2))
_expect_value_error("X float64, W float32", ["X"],
                    lambda: my_scatter2scatter(_x.double(), _W, _sei, _ssi, 2))
if INTERPRET:
    _expect_value_error("W bfloat16 under the interpreter", ["W"],
                        lambda: my_scatter2scatter(_x, _W.bfloat16(), _sei, _ssi, 2))
    _expect_value_error("float16 under the interpreter", ["X"],
                        lambda: my_scatter2scatter(_x.half(), _W.half(), _sei, _ssi, 2))
# case: grouped flags, a non-contiguous W
_Xg = _x[_ssi // 2]
_close(my_scatter2scatter(_Xg, _W, _sei, _ssi, 2, x_grouped=True, y_grouped=True),
       linear_loop(_x, _W, _idx)[_ssi], "my_scatter2scatter(x_grouped=True, y_grouped=True)")
_Wt = _W.transpose(1, 2).contiguous().transpose(1, 2)               # same values, strided
_close(my_scatter2scatter(_x, _Wt, _sei, _ssi, 2), linear_loop(_x, _W, _idx),
       "my_scatter2scatter with a non-contiguous W")
# case: M = 0
with harness.forbid([scatter2scatter_kernel], globals(),
                    why="M = 0: return an empty [0, N] without launching"):
    _Y0 = my_scatter2scatter(torch.zeros(0, 24, device=DEVICE), _W,
                             torch.zeros(0, dtype=torch.int64, device=DEVICE),
                             torch.zeros(0, dtype=torch.int64, device=DEVICE), 2)
assert tuple(_Y0.shape) == (0, 40), \
    f"M = 0: expected an empty [0, 40] without a launch, got {tuple(_Y0.shape)}"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_moe_linear", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_moe_linear(T, K, N, E, k, seed=0, library=False, **routing):
    """moe_linear against linear_loop with gates, the token-by-token loop (library=True, for
    grading: against minimoe.parallel_linear's forward, itself checked against the loop)."""
    x, W, idx = _problem(T, K, N, E, k, seed, **routing)
    g = torch.Generator().manual_seed(seed + 7)
    gates = torch.softmax(torch.randn(T, k, generator=g), -1).to(DEVICE)
    want = linear_loop(x, W, idx, gates=gates)                          # [T, N]
    if library:
        sei, ssi, offsets = flatten_sort_count(idx, E)
        ref = minimoe.parallel_linear_from_indices(x, W, k, sei, ssi, offsets, gates=gates)
        _close(ref, want, "parallel_linear vs linear_loop (setup)")
        want = ref
    with harness.forbid(_REFERENCE, globals()):
        got = moe_linear(x, W, idx, gates)
    where = f"moe_linear, {harness.describe(x, W, idx)}"
    Y = linear_loop(x, W, idx)                                          # [T·k, N] slot order
    _close(got, want.detach(), where, hint=_likely(got, {
        "weight each of a token's k rows by its gate": Y.view(T, k, N).sum(1),
        "slot t·k + j is row j of token t: view Y as [T, k, N]":
            (gates[..., None] * Y.view(k, T, N).transpose(0, 1)).sum(1)}))
    _launches(scatter2scatter_kernel, lambda: moe_linear(x, W, idx, gates), where)


_check_moe_linear(7, 24, 40, 4, 2)
_check_moe_linear(33, 40, 24, 8, 2, seed=1)
_x, _W, _idx = _problem(4, 24, 24, 4, 2, seed=6)
_expect_value_error("gates [T, 1] for k = 2", ["gates"],
                    lambda: moe_linear(_x, _W, _idx, torch.ones(4, 1, device=DEVICE)))
print("moe_linear matches reference.linear_loop with gates")

### BEGIN HIDDEN TESTS
# case: one token, k = 3, one expert used, one expert in all
_check_moe_linear(1, 24, 24, 4, 2, seed=2, library=True)                     # T = 1
_check_moe_linear(11, 24, 40, 8, 3, seed=3, library=True, skip=5)   # k = 3, an unused expert
_check_moe_linear(9, 40, 40, 4, 1, seed=4, library=True, only=[2])  # every token to one expert
_check_moe_linear(5, 24, 24, 1, 1, seed=5, library=True)                     # E = 1
# case: gates of the wrong shape
_x, _W, _idx = _problem(4, 24, 24, 4, 2, seed=6)
_expect_value_error("gates [T, k+1]", ["gates"],
                    lambda: moe_linear(_x, _W, _idx, torch.ones(4, 3, device=DEVICE)))
### END HIDDEN TESTS

# %% [markdown]
# ### Putting it together: a SwiGLU MoE layer on your kernel
#
# An MoE MLP is three expert linears. Gate and up projections read the tokens and write
# their outputs in **sorted** order (`y_grouped=True`), the activation works row by row in
# that order, and the down projection reads sorted rows (`x_grouped=True`) and writes slot
# order, where the gates mix each token's `k` outputs. No sorted copy of `x` is ever made.
# The cell compares this with `reference.moe_loop`, the token-by-token loop.

# %% tags=["jupyter-only"]
def my_moe_swiglu(x, weights, experts, w_gate, w_up, w_down):
    T, k = experts.shape
    sei, ssi, _ = flatten_sort_count(experts, w_gate.shape[0])
    g = my_scatter2scatter(x, w_gate, sei, ssi, k, y_grouped=True)        # [M, F] sorted
    u = my_scatter2scatter(x, w_up, sei, ssi, k, y_grouped=True)          # [M, F] sorted
    h = torch.nn.functional.silu(g) * u                                   # [M, F] sorted
    y = my_scatter2scatter(h, w_down, sei, ssi, k, x_grouped=True)        # [M, C] slots
    return (weights.to(y.dtype).unsqueeze(-1) * y.view(T, k, -1)).sum(1)  # [T, C]


_gm = torch.Generator().manual_seed(5)
_C, _F, _Em, _Tm, _km = 32, 48, 8, 24, 2
_xm = torch.randn(_Tm, _C, generator=_gm).to(DEVICE)
_wm = [(torch.randn(_Em, a, b, generator=_gm) / a ** 0.5).to(DEVICE)
       for a, b in ((_C, _F), (_C, _F), (_F, _C))]
_wts, _exp = minimoe.route(torch.randn(_Tm, _Em, generator=_gm).to(DEVICE), _km)
_t0 = time.perf_counter()
_mine = my_moe_swiglu(_xm, _wts, _exp, *_wm)
_t1 = time.perf_counter()
_loop = minimoe.reference.moe_loop(_xm, _wts, _exp, *_wm)
print(f"SwiGLU MoE, T={_Tm}, top-{_km} of {_Em}: max |yours - moe_loop| = "
      f"{(_mine - _loop).abs().max().item():.2e}  ({(_t1 - _t0) * 1e3:.0f} ms for three launches"
      f"{', interpreter' if INTERPRET else ''})")

# %% [markdown]
# ## Exercise 5 — what padding would cost
#
# The simplest batched MoE gives every expert a buffer of the same size and runs one batched
# matmul (`torch.bmm` over `[E, capacity, K]`): every expert is padded to the busiest
# expert's count. Kernels that tile each expert separately pad only to a multiple of the tile
# height `BLOCK_M`. The sorted kernel pads nothing: it computes `M` rows in `cdiv(M, BLOCK_M)`
# tiles, but a tile that spans experts makes one pass per expert in its range.
#
# **Specification.** `dispatch_work(tokens_per_expert, block_m)` takes the token counts per
# expert (a list of Python ints, or a 1-D integer tensor) and a tile height, and returns a
# `dict` of **Python ints** (not tensors):
#
# | key | meaning |
# |---|---|
# | `"rows_sorted"` | `M = Σ c_e`, the rows the sorted kernel computes |
# | `"rows_block_padded"` | `Σ_e ceil(c_e / block_m) · block_m`: each expert padded to whole tiles |
# | `"rows_bmm"` | `E · max_e c_e`: every expert padded to the busiest one |
# | `"tiles_sorted"` | `ceil(M / block_m)`, the programs along M of the sorted kernel |
# | `"passes_sorted"` | Σ over those tiles of `e_last - e_first + 1`: the expert passes of Exercise 3's loop, counting empty experts inside a tile's range |
#
# Worked example: counts `[5, 0, 3, 8]`, `block_m = 4`: sorted rows 0–4 are expert 0,
# 5–7 expert 2, 8–15 expert 3, so `rows_sorted = 16`, `rows_block_padded = 8 + 0 + 4 + 8 = 20`,
# `rows_bmm = 4 · 8 = 32`, `tiles_sorted = 4`, and the tiles' ranges are 0–0, 0–2, 3–3, 3–3:
# `passes_sorted = 1 + 3 + 1 + 1 = 6`. With no rows at all, everything is 0.
#
# <details><summary>Hint 1: the idea</summary>
#
# The first four entries are one line each. For the passes, rebuild the sorted expert ids
# (expert `e` repeated `c_e` times: the same list `flatten_sort_count` would give), cut it
# into tiles of `block_m`, and add `last - first + 1` per tile, exactly as the kernel of
# Exercise 3 decides its loop. Turn a tensor input into a list of ints first, and every
# result is a Python int for free.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# counts = [int(c) for c in tokens_per_expert];  M = sum(counts)
# ids = [e for e, c in enumerate(counts) for _ in range(c)]
# tiles = ceil(M / block_m)
# passes = Σ over t < tiles of ids[min(t*block_m + block_m, M) - 1] - ids[t*block_m] + 1
# return {rows_sorted: M, rows_block_padded: Σ ceil(c / block_m) * block_m,
#         rows_bmm: len(counts) * max(counts, default 0), tiles_sorted: tiles,
#         passes_sorted: passes}
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "dispatch_work", "locked": false, "schema_version": 3, "solution": true, "task": false}
def dispatch_work(tokens_per_expert, block_m: int) -> dict:
    """Rows and tiles of the sorted, block-padded and bmm-padded dispatch (Python ints)."""
    ### BEGIN SOLUTION
    counts = [int(c) for c in (tokens_per_expert.tolist()
                               if isinstance(tokens_per_expert, torch.Tensor)
                               else tokens_per_expert)]
    M = sum(counts)
    experts = [e for e, c in enumerate(counts) for _ in range(c)]     # sorted expert ids
    tiles = -(-M // block_m)
    passes = sum(experts[min(t * block_m + block_m, M) - 1] - experts[t * block_m] + 1
                 for t in range(tiles))
    return {"rows_sorted": M,
            "rows_block_padded": sum(-(-c // block_m) * block_m for c in counts),
            "rows_bmm": len(counts) * max(counts, default=0),
            "tiles_sorted": tiles,
            "passes_sorted": passes}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_dispatch_work", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_work(counts, block_m, want):
    got = dispatch_work(counts, block_m)
    assert isinstance(got, dict), f"dispatch_work: expected a dict, got {type(got).__name__}"
    got = {key: got.get(key) for key in want}
    wrong = "".join(f"\n  {key}: expected {want[key]}, got {got[key]!r} ({_MEANING[key]})"
                    for key in want if got[key] != want[key])
    assert got == want and all(isinstance(v, int) for v in got.values()), \
        f"dispatch_work({counts}, block_m={block_m}):\n  expected {want}\n  got      {got}" \
        f"{wrong or ' (every value must be a Python int)'}"


_MEANING = {"rows_sorted": "M, the sum of the counts",
            "rows_block_padded": "each expert padded UP to whole tiles, ceil(c / block_m) "
                                 "· block_m",
            "rows_bmm": "E times the busiest expert's count",
            "tiles_sorted": "ceil(M / block_m), the partial last tile included",
            "passes_sorted": "Σ over tiles of e_last - e_first + 1, the empty experts "
                             "inside a tile's range included"}


_check_work([5, 0, 3, 8], 4, {"rows_sorted": 16, "rows_block_padded": 20, "rows_bmm": 32,
                              "tiles_sorted": 4, "passes_sorted": 6})
_check_work([16, 16], 16, {"rows_sorted": 32, "rows_block_padded": 32, "rows_bmm": 32,
                           "tiles_sorted": 2, "passes_sorted": 2})
_check_work(torch.tensor([2, 0, 0, 5]), 4, {"rows_sorted": 7, "rows_block_padded": 12,
                                            "rows_bmm": 20, "tiles_sorted": 2,
                                            "passes_sorted": 4 + 1})  # a tensor in, ints out
print("dispatch_work counts what each approach computes")

### BEGIN HIDDEN TESTS
# case: small hand-made counts
_check_work([0, 0, 0], 16, {"rows_sorted": 0, "rows_block_padded": 0, "rows_bmm": 0,
                            "tiles_sorted": 0, "passes_sorted": 0})
_check_work([1, 1, 1, 1, 1], 64, {"rows_sorted": 5, "rows_block_padded": 320, "rows_bmm": 5,
                                  "tiles_sorted": 1, "passes_sorted": 5})
_check_work(torch.tensor([0, 7, 0, 0, 2]), 4,
            {"rows_sorted": 9, "rows_block_padded": 12, "rows_bmm": 35, "tiles_sorted": 3,
             "passes_sorted": 1 + 4 + 1})               # tile 1 spans experts 1..4
_check_work([3, 0, 0, 1], 4, {"rows_sorted": 4, "rows_block_padded": 8, "rows_bmm": 12,
                              "tiles_sorted": 1, "passes_sorted": 4})
_check_work([100], 32, {"rows_sorted": 100, "rows_block_padded": 128, "rows_bmm": 100,
                        "tiles_sorted": 4, "passes_sorted": 4})
# case: a random routing
_cnt = torch.bincount(harness.expert_routing(50, 2, 8, 30).reshape(-1), minlength=8)
_ids = torch.repeat_interleave(torch.arange(8), _cnt)
_want_passes = sum(int(_ids[min(t + 16, 100) - 1] - _ids[t]) + 1 for t in range(0, 100, 16))
_got = dispatch_work(_cnt, 16)
assert _got["passes_sorted"] == _want_passes and _got["rows_sorted"] == 100, \
    f"dispatch_work({_cnt.tolist()}, 16): expected passes_sorted {_want_passes}, got {_got}"
### END HIDDEN TESTS

# %% [markdown]
# ### Rows computed for a skewed routing
#
# A realistic router is not balanced: a few experts are popular, some get almost nothing
# (that is what Lab 07's balancing losses fight). The chart takes 512 tokens, top-2 of 16
# experts with Zipf-like popularity, and counts with your `dispatch_work`, at three tile
# heights, what each approach costs:
#
# * the padded approaches must **materialise** padded buffers (`rows_block_padded` or
#   `rows_bmm` rows of `K` inputs and `N` outputs, written and read again), and compute all
#   of those rows;
# * the sorted kernel reads and writes exactly `M` rows, in place, with no buffer; but each
#   of its expert passes runs a full `BLOCK_M`-row `tl.dot` (the other experts' rows are
#   zeros), so its matrix-unit work is `passes_sorted · BLOCK_M` rows.
#
# Look at the second and third bars before believing that "no padding" means "no wasted
# arithmetic": every expert boundary inside a tile costs a whole extra pass, so in this
# masked-loop form the sorted kernel does more `tl.dot` work than padding per expert, at
# every tile height of the printout: +21.9 % against +10.9 % extra rows at `BLOCK_M = 16`
# (twice as much), +93.8 % against +56.2 % at 64, +187.5 % against +137.5 % at 128. What it
# saves is memory (no padded copies of `x` and `Y`), launches (one, whatever `E`), and the
# bookkeeping of a padded layout; both stay far below padding to the busiest expert. (Production kernels go further, e.g. by giving each tile one expert
# through a padded *index* rather than padded data.)
# %%
_gz = torch.Generator().manual_seed(0)
_Ez, _Tz, _kz = 16, 512, 2
_pop = 1.0 / torch.arange(1, _Ez + 1) ** 1.1                             # Zipf-like
_choice = torch.multinomial(_pop.expand(_Tz, _Ez), _kz, replacement=False, generator=_gz)
_counts = torch.bincount(_choice.reshape(-1), minlength=_Ez)
_blocks = [16, 64, 128]
_works = [dispatch_work(_counts, b) for b in _blocks]

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.3]})
ax0.bar(range(_Ez), _counts.tolist(), color="tab:blue")
ax0.set_xlabel("expert")
ax0.set_ylabel("rows (token slots)")
ax0.set_title(f"tokens per expert: T={_Tz}, top-{_kz} of {_Ez}", fontsize=9)
_w = 0.2
_bars = (("rows_sorted", "sorted: rows read and written (M)", "tab:green"),
         ("dot_sorted", "sorted: dot work (passes · BLOCK_M)", "tab:olive"),
         ("rows_block_padded", "padded to BLOCK_M per expert", "tab:orange"),
         ("rows_bmm", "bmm: padded to the busiest expert", "tab:red"))
for _wk, _b in zip(_works, _blocks, strict=True):
    _wk["dot_sorted"] = _wk["passes_sorted"] * _b
for j, (key, label, color) in enumerate(_bars):
    ax1.bar([i + (j - 1.5) * _w for i in range(len(_blocks))], [w[key] for w in _works], _w,
            label=label, color=color)
ax1.set_xticks(range(len(_blocks)), [f"BLOCK_M = {b}" for b in _blocks])
ax1.set_ylabel("rows")
ax1.set_title(f"rows held or computed for M = {_works[0]['rows_sorted']} real rows", fontsize=9)
ax1.legend(fontsize=7)
plt.tight_layout()
plt.show()
for b, w in zip(_blocks, _works, strict=True):
    print(f"BLOCK_M={b:>3}: padded per expert {w['rows_block_padded'] / w['rows_sorted'] - 1:+6.1%}"
          f", bmm {w['rows_bmm'] / w['rows_sorted'] - 1:+6.1%} rows; sorted: {w['tiles_sorted']}"
          f" tiles, {w['passes_sorted']} expert passes = dot work "
          f"{w['dot_sorted'] / w['rows_sorted'] - 1:+6.1%}")

# %% [markdown]
# ## Where this goes next
#
# `scatter2scatter` is the forward half of the MoE dispatch. Lab 09 derives the backward
# pass from the same pieces: the input gradient is **this kernel again** with `Wᵀ`
# (`scatter2scatter(dY, W.transpose(1, 2), k=1, x_grouped=True)`), the weight gradient is the
# scattered outer product `dW[e] = Σ Xg[i]ᵀ dYg[i]` over expert `e`'s sorted rows (the
# `group_bwd_W` kernel, which needs the `group`ed copies you wrote in Exercise 2), and the
# gate gradients are dot products. Lab 10 adds LoRA to the experts.
#
# ### Reflection
#
# 1. In Exercise 3 a row of expert `e` is loaded as zeros in every pass of the other experts
#    of its tile. How much extra `tl.dot` work is that for a tile that spans 3 experts? The
#    chart shows this work can exceed padding each expert to a multiple of `BLOCK_M`; what
#    does the sorted kernel save instead, and how would you choose `BLOCK_M` on a GPU?
# 2. The gather reads `X[s // k]`, so every token's row is read `k` times, by different
#    tiles. Compare the memory traffic with making a sorted copy `Xg` first (Exercise 1).
# 3. Why must the expert ids be sorted for the "first and last row bound the experts" trick?
#    What would go wrong, and what would the symptom be, if `sorted_scattered_idxs` were
#    sorted but `sorted_expert_idxs` were passed in slot order?
# 4. The tiles along `M` are independent and write disjoint rows of `Y`: no atomics are
#    needed. Which of `x_grouped` / `y_grouped` would you choose for the gate, up and down
#    projections of an MoE MLP, and why (see the SwiGLU cell)?
# 5. The chart counts rows. At decode time (`T = 1`, top-2 of 64 experts) what are
#    `rows_sorted`, `rows_block_padded` and `rows_bmm` with `BLOCK_M = 64`, and what does that
#    say about which approach suits inference?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. A tile that spans 3 experts makes 3 passes, each a full `BLOCK_M × BLOCK_N` product over
#    `K`: three times the `tl.dot` work of a single-expert tile, two passes of it on rows
#    loaded as zeros. On the chart's skewed routing (M = 1024 rows, 16 experts) that is +21.9 %
#    dot work at `BLOCK_M = 16` (78 passes over 64 tiles) against +10.9 % for padding each
#    expert, and +187.5 % against +137.5 % at 128. What the sorted kernel saves is memory and
#    launches: no padded copies of `x` and `Y` (padding to the busiest expert holds +396.9 %
#    rows), one launch whatever `E`. On a GPU this argues for a `BLOCK_M` well below the
#    typical tokens per expert (so few tiles straddle a boundary), yet large enough (64 or
#    128) to keep the tensor cores fed and to reuse each weight tile over many rows.
# 2. The gather reads `k · T · K` elements of `x` (each token row `k` times, from the cache or
#    DRAM) and writes nothing extra. A sorted copy first reads `T · K`, writes `k · T · K` and
#    reads them back in the product: `(1 + 2k) · T · K`, 2.5 times the gather's traffic at
#    `k = 2`, plus an allocation of `M × K`. The output side is the same story: scattering
#    from the accumulator writes `Y` once, where a grouped `Yg` is written, read and written
#    again.
# 3. The tile's loop visits `e_first … e_last` and trusts that every row's expert lies in that
#    range, which holds only if the ids are non-decreasing. In slot order the first and last
#    ids of a tile are arbitrary: the range can be empty (first 3, last 1) or miss the experts
#    in between, and rows whose expert is outside it are never accumulated and come out as
#    zeros. Worse, `sei[i]` would then be the expert of slot `i`, not of slot `ssi[i]`, so
#    even the rows that are computed use another slot's expert. Nothing raises: the symptom is
#    wrong rows and zero rows, which only a comparison with `linear_loop` reveals.
# 4. Gate and up read the tokens where they are (`x_grouped=False`, gathering `x[s // k]`) and
#    write sorted rows (`y_grouped=True`), so the SiLU product works on rows that are
#    contiguous per expert and no sorted copy of `x` is made. The down projection reads those
#    sorted rows (`x_grouped=True`) and writes slot order (`y_grouped=False`), where the
#    `[T, k, N]` view lets the gates mix each token's `k` rows. The SwiGLU cell does exactly
#    this and matches `moe_loop` to 3.6e-07.
# 5. Two rows on two experts: `rows_sorted = 2`, `rows_block_padded = 2 · 64 = 128`,
#    `rows_bmm = 64 · 1 = 64`, one tile. Padding multiplies the arithmetic by 32 to 64, but at
#    decode the arithmetic is negligible: the kernel's time is reading the weights of the
#    experts it visits, two `K × N` matrices for the sorted kernel against all 64 for the
#    padded `bmm`. One caveat of the masked loop of Exercise 3: the single tile loops over
#    every expert between the two chosen ones and loads their weights too (experts 5 and 40
#    give 36 passes), so a decode kernel should skip experts without rows, as production
#    kernels do.
