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
# # Lab 10 — LoRA on the experts: split and fused kernels, dA/dB, NF4 experts
#
# Labs 08 and 09 built a trainable expert linear from two kernels (`scatter2scatter` and
# `group_bwd_W`) and a gather. QLoRA on a Mixture-of-Experts freezes those expert weights and
# trains a small LoRA per expert instead. With `E` experts of `W[e]` `[K, N]` and rank `r`,
# this course stores the adapters of **all** experts in two matrices
# (docs/ARCHITECTURE.md, Expert LoRA):
#
# * `lora_A` `[r·E, K]` — expert `e` owns the rows `e·r:(e+1)·r`, called `A_e` `[r, K]`;
# * `lora_B` `[N, r·E]` — expert `e` owns the columns `e·r:(e+1)·r`, called `B_e` `[N, r]`;
#
# and each routing slot `s` of token `t` sent to expert `e` computes
#
# $$Y[s] = x_t\, W[e] \;+\; \text{scaling}\cdot (x_t A_e^\top)\, B_e^\top .$$
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `split_lora_linear(...)`: the LoRA as two more expert linears over views of `A`, `B` | output and every gradient of `reference.linear_loop` with LoRA |
# | 2 | `scatter2scatter_lora_kernel` + `my_scatter2scatter_lora(...)`: base **and** LoRA in one tile | `linear_loop` on awkward shapes (`T = 1`, `r` = 1 and 3, empty experts, `k = 3`) |
# | 3 | `group_bwd_lora_kernel` + `my_group_bwd_lora(...)` → `(dA, dB)` | a per-row outer-product loop; exact zeros for experts without tokens |
# | 4 | `MyLoRAParallelLinear` (autograd Function) + `my_lora_parallel_linear(...)` | dx, dW, dgates, dA, dB of `linear_loop` |
# | 5 | `nf4_lora_linear(...)`: NF4 experts, dequantizing only those with tokens | `parallel_linear` on the fully dequantized weight; poisoned unused experts never read |
#
# **No GPU needed.** As in Labs 03, 08 and 09 the setup cell sets `TRITON_INTERPRET=1` before
# `import triton` when there is no CUDA GPU, so every kernel runs in Triton's interpreter
# (NumPy, **float32 only**). Shapes stay tiny: a few dozen tokens, `K`, `N` of 16–40.
#
# **How to work.** Run the cells in order; replace each `raise NotImplementedError()` with
# your code; run the test cell below and read its message if it fails (it prints what was
# expected and what came). Grading runs more hidden checks of the same specification and
# switches off, while your code runs, the `minimoe` pieces this lab rebuilds
# (`scatter2scatter_lora`, `group_bwd_lora`, `parallel_linear` with LoRA, `ParallelLinear`,
# `nf4_parallel_linear`, `NF4Experts`, `ExpertLinear`, their kernels, and the naive loops).
# Building blocks you may use: `flatten_sort_count`, `group`, `group_bwd_W`, the
# `miniquant` selective dequantizers and, in Exercise 1 only, `parallel_linear_from_indices`
# **without** LoRA. Each exercise states its specification first; below it, two collapsed hints (the idea,
# then pseudocode) are there when you want them. The whole notebook
# runs in <!-- runtime:10-moe-lora -->about 14 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import contextlib
import os
import time

import torch

from course.notebook.harness import require_triton  # noqa: E402

require_triton("10-moe-lora")   # no triton (its wheels are Linux-only): say where to run

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
from minimoe import (  # noqa: E402
    flatten_sort_count,
    group,
    group_bwd_W,
    parallel_linear_from_indices,
    quantize_experts,
)
from minimoe.reference import linear_loop  # noqa: E402
from miniquant import NF4Weight  # noqa: E402
from miniquant.triton_dequant import (  # noqa: E402
    selective_dequantize_nf4,  # noqa: F401  (the Lab 03 kernel: allowed in Exercise 5)
    selective_dequantize_nf4_torch,
)

INTERPRET, DEVICE = harness.triton_setup()   # one CPU thread, seed 0, and where kernels run

# %% [markdown]
# ## Part A — the math of expert LoRA
#
# Notation from Labs 08–09: `x` `[T, K]`, `W` `[E, K, N]`, `expert_idxs` `[T, k]`, gates
# `[T, k]`; slot `s = t·k + j`, `M = T·k`; `flatten_sort_count` gives `sei` (expert of each
# sorted row), `ssi` (slot of each sorted row) and the end offsets; expert `e` owns the sorted
# rows `offsets[e-1] … offsets[e]-1`. `dY` is the gradient of the per-slot output (gate
# already applied: Lab 09's `grouped_dy`), `X_e`, `dY_e` the sorted rows of expert `e`.
#
# Reading the LoRA factors of expert `e` as two more expert weights,
#
# $$W_A[e] = A_e^\top \;[K, r], \qquad W_B[e] = B_e^\top \;[r, N],$$
#
# the LoRA update of a row is just **two more expert linears in a row**: `h = x W_A[e]`
# (`[r]`), then `h W_B[e]` (`[N]`). That is the **split** path (Exercise 1). The **fused**
# path (Exercise 2) does the same inside the base GEMM's tile: the tile already loads the
# `x` rows for `x W[e]`, so it also multiplies them by `A_eᵀ` (a `[BLOCK_K, r]` tile), keeps
# the `[BLOCK_M, r]` product in registers, and adds `scaling · (x A_eᵀ) B_eᵀ` before the
# store — no `[M, r]` tensor in memory and no second pass over `x`.
#
# The gradients (chain rule per slot, summed over expert `e`'s rows):
#
# $$dB_e = \text{scaling}\cdot dY_e^\top\,(X_e A_e^\top) \;[N, r], \qquad
#   dA_e = \text{scaling}\cdot (dY_e B_e)^\top X_e \;[r, K],$$
#
# $$dX_e = dY_e W[e]^\top + \text{scaling}\cdot (dY_e B_e)\, A_e .$$
#
# `dX` is the fused forward again with `W → Wᵀ`, `A → Bᵀ` (`[r·E, N]`) and `B → Aᵀ`
# (`[K, r·E]`): the same kernel, transposed views. `dA` and `dB` are one kernel with two
# launches (Exercise 3): both have the form
#
# $$\text{OUT}[p,\ e r + j] = \text{scaling}\cdot \sum_{m \in e} U[m, p]\,\big(V[m]\, L[:, e r:(e+1) r]\big)[j]$$
#
# with `(U, V, L, OUT) = (dY, X, Aᵀ, dB)` for `dB` and `(X, dY, B, dAᵀ)` for `dA`. Each
# program owns one expert's `r` columns of one tile of `P` rows: **no atomics**, and an expert
# without rows stores exact zeros. A worked case: one token, `E = 1`, `r = 1`:

# %% tags=["jupyter-only"]
_x = torch.tensor([[1.0, 2.0]])                   # [T=1, K=2]
_W = torch.zeros(1, 2, 3)                         # the base does not matter for dA, dB
_A = torch.tensor([[0.5, -1.0]])                  # [r·E=1, K]
_B = torch.tensor([[1.0], [0.0], [2.0]])          # [N=3, r·E=1]
_dy = torch.tensor([[1.0, 1.0, -1.0]])            # [M=1, N]
_Ar, _Br = _A.clone().requires_grad_(), _B.clone().requires_grad_()
linear_loop(_x, _W, torch.tensor([[0]]), None, _Ar, _Br, 2.0).backward(_dy)
# x·Aᵀ = 0.5 - 2 = -1.5;  dy·B = 1 - 2 = -1
print("dB by autograd:", _Br.grad.flatten().tolist(), " by hand 2·dyᵀ·(x·Aᵀ):",
      (2.0 * _dy[0] * -1.5).tolist())
print("dA by autograd:", _Ar.grad.flatten().tolist(), " by hand 2·(dy·B)·x:",
      (2.0 * -1.0 * _x[0]).tolist())

# %% [markdown]
# ## Exercise 1 — the split path with the kernels you already have
#
# **Specification.** `split_lora_linear(x, W, k, sorted_expert_idxs, sorted_scattered_idxs,
# expert_offsets, lora_A, lora_B, scaling, gates=None)` returns the expert linear with LoRA of
# the formula above: `Y` `[M, N]` in slot order, or with gates `[T, N]`,
# `out[t] = Σ_j gates[t, j] · Y[t·k + j]`. `lora_A` is `[r·E, K]`, `lora_B` `[N, r·E]`. It is
# built out of `minimoe.parallel_linear_from_indices` calls **without** LoRA (Lab 09's
# Function, taking the index tensors: it already has a backward for `x`, `W` and the gates), on
# the LoRA factors seen as expert weights
# `W_A`, `W_B`. The rules that matter:
#
# * `W_A`, `W_B` are **views** of `lora_A`, `lora_B` (reshapes and transposes, no copies), so
#   that autograd carries their gradients back to `lora_A`, `lora_B`;
# * `B`'s experts are **column** blocks: expert `e` owns columns `e·r:(e+1)·r` of `lora_B`;
# * `scaling` multiplies the LoRA term once.
#
# The tests compare the output and the gradients of `x`, `W`, the gates, `lora_A` and `lora_B`
# with autograd of `reference.linear_loop(..., lora_A, lora_B, scaling)`. While they run,
# `parallel_linear_from_indices` refuses LoRA arguments (and the `split` path of `minimoe`).
#
# <details><summary>Hint 1: the idea</summary>
#
# Three expert linears: the base in slot order, then `h = x · W_A[e]` `[M, r]` kept in
# **sorted** order (`grouped_out=True`), then `h · W_B[e]` reading those sorted rows
# (`grouped_in=True`) and writing slot order. For the views, `lora_A.reshape(E, r, K)` gives
# expert `e` its `r` consecutive rows; `lora_B.reshape(E, r, N)` would not, because `B`'s
# experts are column blocks: reshape to `[N, E, r]` first and move the axes.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# WA = lora_A.reshape(E, r, K).transpose(1, 2)               # [E, K, r] view
# WB = lora_B.reshape(N, E, r).permute(1, 2, 0)              # [E, r, N] view
# base = parallel_linear_from_indices(x, W, k, sei, ssi, offs)                     # [M, N] slots
# h    = parallel_linear_from_indices(x, WA, k, sei, ssi, offs, grouped_out=True)  # [M, r] sorted
# d    = parallel_linear_from_indices(h, WB, k, sei, ssi, offs, grouped_in=True)   # [M, N] slots
# Y = base + scaling * d
# return Y if gates is None else (gates[..., None] * Y.view(T, k, N)).sum(1)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "split_lora", "locked": false, "schema_version": 3, "solution": true, "task": false}
def split_lora_linear(x: torch.Tensor, W: torch.Tensor, k: int,
                      sorted_expert_idxs: torch.Tensor, sorted_scattered_idxs: torch.Tensor,
                      expert_offsets: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                      scaling: float, gates: torch.Tensor | None = None) -> torch.Tensor:
    """Expert linear + expert LoRA over the slots: [M, N] slot order, or [T, N] with gates."""
    ### BEGIN SOLUTION
    E, K, N = W.shape
    r = lora_A.shape[0] // E
    idx = (sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)
    WA = lora_A.reshape(E, r, K).transpose(1, 2)                        # [E, K, r]
    WB = lora_B.reshape(N, E, r).permute(1, 2, 0)                       # [E, r, N]
    base = parallel_linear_from_indices(x, W, k, *idx)                  # [M, N] slot order
    h = parallel_linear_from_indices(x, WA, k, *idx, grouped_out=True)  # [M, r] sorted
    d = parallel_linear_from_indices(h, WB, k, *idx, grouped_in=True)   # [M, N] slot order
    Y = base + scaling * d
    if gates is None:
        return Y
    T = gates.shape[0]
    return (gates.to(Y.dtype).unsqueeze(-1) * Y.view(T, k, N)).sum(1)   # [T, N]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_split_lora", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# What this lab rebuilds, the loops the tests compare with, and the full dequantizers: each
# raises if your code reaches it (under any name).
_REF = harness.reference("10-moe-lora")        # minimoe's and miniquant's REFERENCE tables
# each named by where it lives, an (owner, name) pair of the course packages, and by itself
from course.notebook.forbid import bindings  # noqa: E402

_REFERENCE = [(bindings(t)[0], t) for t in _REF.values()]
# Exercise 1 may run parallel_linear (the Lab 09 Function) without LoRA.
_BASE_PL = tuple(_REF[name] for name in ("parallel_linear", "parallel_linear_from_indices",
                                          "ParallelLinear", "torch_parallel_linear",
                                          "scatter2scatter_kernel"))
_pl_reference = minimoe.parallel_linear_from_indices
_pl_one_form = minimoe.parallel_linear


def _base_only(x, W, routing, *, lora=None, **kwargs):
    """parallel_linear without LoRA (Exercise 1's building block)."""
    if lora is not None:
        raise AssertionError("parallel_linear_from_indices was called with LoRA while your code "
                             "ran: Exercise 1 builds the LoRA from views, without lora_A / lora_B")
    return _pl_one_form(x, W, routing, **kwargs)


@contextlib.contextmanager
def _no_reference(base_linear=False):
    """While the block runs, what this lab rebuilds raises if reached; with `base_linear`,
    parallel_linear (and the scatter2scatter kernel under it) stays usable without LoRA."""
    if not base_linear:
        with harness.forbid([where for where, _ in _REFERENCE], globals()):
            yield
        return
    # (parallel_linear with LoRA reaches the forbidden LoRA references whichever path it takes;
    # _base_only only says so more plainly where the tests run beside your code)
    with harness.forbid([where for where, t in _REFERENCE if t not in _BASE_PL], globals()), \
            harness.swap(minimoe.parallel_linear, _base_only, globals()):
        yield


def _must_reach(target, call, what):
    """`call()` must fail once `target` (or each of a list of targets) is switched off: your
    code reaches it (a launch of a kernel, a call of a function), under whatever name."""
    with _no_reference():
        harness.must_reach(target if isinstance(target, list) else [target], call, what,
                           globals())


def _problem(T, K, N, E, k, r, seed=0, **routing):
    """x [T, K], W [E, K, N], expert_idxs [T, k], gates [T, k], dout [T, N],
    A [r·E, K], B [N, r·E] (B non-zero, so the LoRA term shows)."""
    return harness.expert_problem(T, K, N, E, k, seed, r=r, device=DEVICE, **routing)


RTOL = 1e-5   # relative to the largest entry of the expected tensor (float32 sums)
SCALING = 0.5


def _zero_lora(dA, dB, idx, E, what):
    """Experts that received no token must have exactly-zero LoRA gradients."""
    used = torch.bincount(idx.reshape(-1).cpu(), minlength=E) > 0
    r = dA.shape[0] // E
    for e in (~used).nonzero().flatten().tolist():
        a, b = dA[e * r:(e + 1) * r].detach().cpu(), dB[:, e * r:(e + 1) * r].detach().cpu()
        for name, blk in (("dA", a), ("dB", b)):
            assert torch.equal(blk, torch.zeros_like(blk)), \
                f"{what}: expert {e} received no token, so its {name} slice must be exactly 0; " \
                f"got max |{name}_{e}| = {float(blk.abs().nan_to_num(1e30).max()):.3g}" \
                f"{' (NaN: write zeros)' if blk.isnan().any() else ''}"


def _slips(x, W, idx, gates, A, B):
    """(scaling, gates, A, B, what) of the usual slips of the LoRA term, as the loop's inputs
    that reproduce each one."""
    E, K, N = W.shape[0], A.shape[1], B.shape[0]
    r = A.shape[0] // E
    out = [(SCALING ** 2, gates, A, B, "scaling is applied twice: it multiplies the LoRA "
            "term once"),
           (1.0, gates, A, B, "the LoRA term is not multiplied by scaling"),
           (0.0, gates, A, B, "the LoRA term is missing"),
           (SCALING, gates, A, B.reshape(E * r, N).T, "B's experts are column blocks: "
            "expert e owns columns e·r:(e+1)·r of lora_B, not rows of a reshape"),
           (SCALING, gates, A.reshape(E, K, r).transpose(1, 2).reshape(E * r, K), B,
            "A_e is the rows e·r:(e+1)·r of lora_A, and W_A[e] = A_eᵀ is their transpose, "
            "not a reshape"),
           (SCALING, gates, B.T, A.T, "A and B are swapped")]
    if gates is not None:
        out.append((SCALING, torch.ones_like(gates), A, B, "the gates weight each slot: "
                    "out[t] = Σ_j gates[t, j] · Y[t·k + j]"))
    return [(s, g, a, b, why) for s, g, a, b, why in out if a.shape == A.shape]


def _slip_hint(got, x, W, idx, gates, A, B, post=lambda y: y, grad=None, dout=None):
    """' (what went wrong)' when `got` is the output (or, with `grad` and `dout`, the gradient
    named by `grad`) of a usual slip, else ''."""
    got = got.detach().float().cpu()
    for scaling, g, a, b, why in _slips(x, W, idx, gates, A, B):
        if grad is None:
            want = post(linear_loop(x, W, idx, g, a, b, scaling))
        else:
            want = dict(zip(("out", "dx", "dW", "dgates", "dA", "dB"),
                            harness.loop_grads(x, W, idx, g, dout, a, b, scaling),
                            strict=True))[grad]
        if want is not None and want.shape == got.shape and \
                torch.allclose(got, want.float().cpu(), rtol=1e-4, atol=1e-5):
            return f" ({why})"
    return ""


def _close(got, want, where, hint=lambda: ""):
    """harness.assert_close, with `hint()` (what a usual slip would give) added on failure."""
    try:
        harness.assert_close(got, want, where)
    except AssertionError as err:
        raise AssertionError(f"{err}{hint() if isinstance(got, torch.Tensor) else ''}") \
            from None


def _check_split(T, K, N, E, k, r, seed=0, gated=True, **routing):
    x, W, idx, gates, dout, A, B = _problem(T, K, N, E, k, r, seed, **routing)
    if not gated:
        gates = None
        dout = torch.randn(T * k, N, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    want = harness.loop_grads(x, W, idx, gates, dout, A, B, SCALING)
    sei, ssi, offs = flatten_sort_count(idx, E)
    xr, Wr, Ar, Br = harness.leaf(x), harness.leaf(W), harness.leaf(A), harness.leaf(B)
    gr = None if gates is None else harness.leaf(gates)
    with _no_reference(base_linear=True):
        out = split_lora_linear(xr, Wr, k, sei, ssi, offs, Ar, Br, SCALING, gates=gr)
        out.backward(dout)
    where = f"split_lora_linear(gates={'[T, k]' if gated else None}), {harness.describe(x, W, idx, r)}"
    _close(out, want[0], f"{where}: output", lambda: _slip_hint(out, x, W, idx, gates, A, B))
    for name, got, w in zip(("dx", "dW", "dgates", "dA", "dB"),
                            (xr.grad, Wr.grad, None if gr is None else gr.grad, Ar.grad, Br.grad),
                            want[1:], strict=True):
        if w is not None:
            assert got is not None, f"{where}: {name} is None — did the graph reach it?"
            _close(got, w, f"{where}: {name}",
                   lambda got=got, name=name: _slip_hint(got, x, W, idx, gates, A, B,
                                                         grad=name, dout=dout))
    _zero_lora(Ar.grad, Br.grad, idx, E, where)


_check_split(7, 24, 40, 4, 2, 2)
_check_split(9, 40, 24, 4, 3, 3, seed=1, gated=False, skip=2)
print("split_lora_linear matches reference.linear_loop with LoRA: output, dx, dW, dgates, dA, dB")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1) with r = 1
_check_split(1, 24, 24, 4, 2, 1, seed=2)
# case: top-1 routing over two of eight experts
_check_split(13, 24, 40, 8, 1, 4, seed=3, only=[2, 5])
# case: k = 3 with the first expert unused
_check_split(12, 40, 24, 8, 3, 2, seed=4, skip=0)
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 2 — the fused forward kernel: base GEMM and LoRA in one tile
#
# **Specification.** `scatter2scatter_lora_kernel` (signature below, the arguments of your
# Lab 08 `scatter2scatter_kernel` plus `A`, `B`, `R`, `scaling`, their strides and `BLOCK_R`;
# grid `(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))`) computes, for each sorted row `i < M` of its
# tile and each column `n < N` of its block,
#
# `Y[yrow(i), n] = X[xrow(i)] · W[e_i, :, n] + scaling · (X[xrow(i)] · A_eᵀ) · B_eᵀ[:, n]`
#
# with `e = e_i`, `A_e = A[e·R : (e+1)·R]` and `B_e = B[:, e·R : (e+1)·R]`, and writes nothing
# else. The rules that matter:
#
# * **one pass over `x`**: the `x` tiles the base product loads also feed `x · A_eᵀ`, kept as
#   a `[BLOCK_M, BLOCK_R]` float32 accumulator; no `[M, r]` tensor in memory;
# * **`BLOCK_R ≥ 16`, a power of two, with `rr < R` masked** on both factor loads: a GPU's
#   `tl.dot` needs every dimension ≥ 16, so `R` is padded, and the padded columns must load as
#   zeros (unmasked, they read the next expert's rows of `A`);
# * **strides for every tensor**, `A` and `B` included: Exercise 4 launches this kernel on
#   transposed views (`Bᵀ`, `Aᵀ`);
# * float32 accumulators and `tl.dot(..., input_precision="ieee")`, as in Lab 08, and the
#   same masks (rows, `K`, `N`) and expert-spanning tiles.
#
# Then `my_scatter2scatter_lora(X, W, lora_A, lora_B, scaling, sorted_expert_idxs,
# sorted_scattered_idxs, k, x_grouped=False, y_grouped=False, block_m=32, block_n=32,
# block_k=32)` → `Y` `[M, N]`: raise `ValueError` unless `X` is 2-D and `W` 3-D with the same
# `K`, `lora_A` is `[r·E, K]` and `lora_B` `[N, r·E]` for some `r ≥ 1`, `1 ≤ k ≤ E`, `X` has
# `M / k` rows (or `M` with `x_grouped`), and (under the interpreter) the tensors are
# float32; allocate `Y`, take `BLOCK_R = rank_block(r)` (below), launch **your** kernel (the
# tests check the launch). Do not copy `lora_A` / `lora_B` to contiguous memory: pass their
# strides.
#
# <details><summary>Hint 1: the idea</summary>
#
# Inside the loop over the tile's experts, next to the base accumulator, keep `xa` for the
# current expert: in the `K` loop, load the `[BLOCK_K, BLOCK_R]` tile of `A_eᵀ` (rows
# `e·R + rr` of `A`, read through its strides as a transposed tile) and add `dot(x, a)` to
# `xa` with the same `x` tile. After the `K` loop, load the `[BLOCK_R, BLOCK_N]` tile of
# `B_eᵀ` and add `dot(scaling · xa, b)` to the base accumulator, before the next expert. A row
# of another expert was loaded as zeros, so its `xa` is zero and needs no extra mask.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# rr = arange(BLOCK_R);  r_mask = rr < R           # BLOCK_R: R padded to a power of two >= 16
# for e in e_first .. e_last:
#     rows = m_mask & (e_i == e)
#     xa = zeros([BLOCK_M, BLOCK_R], float32)      # x @ A_eᵀ for this tile's rows
#     for k0 in 0 .. K step BLOCK_K:
#         x  = X[xrow, k0:]        (masked rows, k < K)                  # [BM, BK]
#         w  = W[e, k0:, n]        (masked k < K, n < N)                 # [BK, BN]
#         a  = A[e·R + rr, k0:]ᵀ   (masked k < K, rr < R)                # [BK, BR]
#         acc += dot(x, w);   xa += dot(x, a)       # the same x tile feeds both
#     b = B[n, e·R + rr]ᵀ          (masked rr < R, n < N)                # [BR, BN]
#     acc += dot(scaling · xa, b)
# Y[yrow, n] = acc                                  (masked rows < M, n < N)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "scatter2scatter_lora", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def scatter2scatter_lora_kernel(
    X,              # [rows of X, K] input: token rows (scattered) or sorted rows (X_GROUPED)
    W,              # [E, K, N] expert weights
    Y,              # [M, N] output: slot order, or sorted order (Y_GROUPED)
    A,              # [R·E, K] LoRA A (any strides); expert e owns rows e·R:(e+1)·R
    B,              # [N, R·E] LoRA B (any strides); expert e owns columns e·R:(e+1)·R
    expert_ids,     # [M] int64 sorted_expert_idxs (non-decreasing)
    scattered_ids,  # [M] int64 sorted_scattered_idxs (slot s = token * FAN_OUT + j)
    M, K, N, R,     # sizes (runtime ints); R = LoRA rank per expert
    scaling,        # LoRA scaling (float)
    sxm, sxk,       # strides of X
    swe, swk, swn,  # strides of W
    sym, syn,       # strides of Y
    sar, sak,       # strides of A
    sbn, sbr,       # strides of B
    FAN_OUT: tl.constexpr,    # k: slots per token (X row of slot s is s // FAN_OUT)
    X_GROUPED: tl.constexpr,  # True: X row of sorted row i is i
    Y_GROUPED: tl.constexpr,  # True: output row of sorted row i is i (else its slot)
    BLOCK_M: tl.constexpr,    # sorted rows per program
    BLOCK_N: tl.constexpr,    # output columns per program
    BLOCK_K: tl.constexpr,    # reduction step
    BLOCK_R: tl.constexpr,    # R padded to a power of two, >= 16
):
    """Y[yrow(i), n] = X[xrow(i)] @ W[e, :, n] + scaling · (X[xrow(i)] @ A_eᵀ) @ B_eᵀ[:, n]."""
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
    rr = tl.arange(0, BLOCK_R)                                      # [BR]
    r_mask = rr < R
    e_first = tl.load(expert_ids + pid_m * BLOCK_M)                 # sorted ids: the ends
    e_last = tl.load(expert_ids + tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1)  # bound them
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for e in range(e_first, e_last + 1):
        rows = m_mask & (e_i == e)                                  # [BM] this expert's rows
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)         # x @ A_eᵀ
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + kk) < K
            x = tl.load(X + xrow[:, None] * sxm + (k0 + kk)[None, :] * sxk,
                        mask=rows[:, None] & k_mask[None, :], other=0.0)       # [BM, BK]
            w = tl.load(W + e * swe + (k0 + kk)[:, None] * swk + n[None, :] * swn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)     # [BK, BN]
            a = tl.load(A + (e * R + rr)[None, :] * sar + (k0 + kk)[:, None] * sak,
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)     # [BK, BR]
            x = x.to(tl.float32)
            acc += tl.dot(x, w.to(tl.float32), input_precision="ieee")
            xa += tl.dot(x, a.to(tl.float32), input_precision="ieee")
        b = tl.load(B + n[None, :] * sbn + (e * R + rr)[:, None] * sbr,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)         # [BR, BN]
        acc += tl.dot(xa * scaling, b.to(tl.float32), input_precision="ieee")
    tl.store(Y + yrow[:, None] * sym + n[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
    ### END SOLUTION


def rank_block(r: int) -> int:
    """BLOCK_R for rank r: the next power of two, at least 16."""
    return max(16, 1 << (max(r, 1) - 1).bit_length())


def my_scatter2scatter_lora(X: torch.Tensor, W: torch.Tensor, lora_A: torch.Tensor,
                            lora_B: torch.Tensor, scaling: float,
                            sorted_expert_idxs: torch.Tensor,
                            sorted_scattered_idxs: torch.Tensor, k: int,
                            x_grouped: bool = False, y_grouped: bool = False,
                            block_m: int = 32, block_n: int = 32, block_k: int = 32
                            ) -> torch.Tensor:
    """Y [M, N]: X[xrow(i)] @ W[e_i] + scaling · (X[xrow(i)] @ A_eᵀ) @ B_eᵀ, by your kernel."""
    ### BEGIN SOLUTION
    for name, t, dim in (("X", X, 2), ("W", W, 3), ("lora_A", lora_A, 2), ("lora_B", lora_B, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim:
            raise ValueError(f"{name} must be a {dim}-D tensor")
        if INTERPRET and t.dtype != torch.float32:
            raise ValueError(f"{name} is {t.dtype}, but the Triton interpreter is float32-only")
    E, K, N = W.shape
    if X.shape[1] != K:
        raise ValueError(f"X {tuple(X.shape)} and W {tuple(W.shape)} must share K")
    rE = lora_A.shape[0]
    if rE < E or rE % E or lora_A.shape[1] != K or tuple(lora_B.shape) != (N, rE):
        raise ValueError(f"lora_A must be [r·E, K] = [r·{E}, {K}] and lora_B [N, r·E] = "
                         f"[{N}, r·{E}], got {tuple(lora_A.shape)} and {tuple(lora_B.shape)}")
    if not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"k must be an int in 1..{E}, got {k!r}")
    M = sorted_expert_idxs.shape[0]
    if X.shape[0] != (M if x_grouped else M // k) or M % k:
        raise ValueError(f"X has {X.shape[0]} rows; expected {'M' if x_grouped else 'M / k'} "
                         f"with M = {M}, k = {k}")
    r = rE // E
    sei = sorted_expert_idxs.long().contiguous()
    ssi = sorted_scattered_idxs.long().contiguous()
    Y = torch.empty(M, N, dtype=X.dtype, device=X.device)                  # [M, N]
    if M == 0:
        return Y
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    scatter2scatter_lora_kernel[grid](
        X, W, Y, lora_A, lora_B, sei, ssi, M, K, N, r, float(scaling),
        X.stride(0), X.stride(1), W.stride(0), W.stride(1), W.stride(2),
        Y.stride(0), Y.stride(1), lora_A.stride(0), lora_A.stride(1),
        lora_B.stride(0), lora_B.stride(1),
        FAN_OUT=k, X_GROUPED=x_grouped, Y_GROUPED=y_grouped,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=rank_block(r))
    return Y
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_scatter2scatter_lora_kernel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _in_nan(t, rows, cols):
    """t [a, b] as the top-left view of a buffer of NaN with `rows`, `cols` more of each."""
    buf = torch.full((t.shape[0] + rows, t.shape[1] + cols), float("nan"), device=t.device)
    buf[:t.shape[0], :t.shape[1]] = t
    return buf[:t.shape[0], :t.shape[1]]


def _launch_s2s_lora(T, K, N, E, k, r, x_grouped=False, y_grouped=False, BLOCK_M=16,
                     BLOCK_N=16, BLOCK_K=16, seed=0, transposed_lora=False, poison=False,
                     **routing):
    """Launch scatter2scatter_lora_kernel directly (strided views, NaN around Y; with
    `poison`, NaN past lora_A's r·E rows and lora_B's r·E columns)."""
    x, W, idx, _, _, A0, B0 = _problem(T, K, N, E, k, r, seed, **routing)
    A, B = A0, B0
    M = T * k
    sei, ssi, _ = flatten_sort_count(idx, E)
    want = linear_loop(x, W, idx, None, A, B, SCALING)                # [M, N] slot order
    X = x[ssi // k] if x_grouped else x
    X = X.T.contiguous().T                                             # column-major view
    if y_grouped:
        want = want[ssi]
    if transposed_lora:                                                # same values, other strides
        A, B = A.T.contiguous().T, B.T.contiguous().T
    if poison:                                 # what a padded rank column rr >= R would read
        A, B = _in_nan(A, 16, 0), _in_nan(B, 0, 16)
    ybuf = torch.full((M + 3, N + 5), float("nan"), device=DEVICE)
    Y = ybuf[:M, :N]
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    # the kernel gets the whole buffer (same first element and strides as the view Y), so
    # that a write outside Y shows in ybuf
    with harness.outputs(ybuf):
        scatter2scatter_lora_kernel[grid](
            X, W, ybuf, A, B, sei, ssi, M, K, N, r, SCALING,
            X.stride(0), X.stride(1), W.stride(0), W.stride(1), W.stride(2),
            Y.stride(0), Y.stride(1), A.stride(0), A.stride(1), B.stride(0), B.stride(1),
            FAN_OUT=k, X_GROUPED=x_grouped, Y_GROUPED=y_grouped,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_R=rank_block(r))
    where = (f"scatter2scatter_lora_kernel[{grid}] (x_grouped={x_grouped}, y_grouped="
             f"{y_grouped}), {harness.describe(x, W, idx, r)}, BLOCK_M/N/K/R = "
             f"{BLOCK_M}/{BLOCK_N}/{BLOCK_K}/{rank_block(r)}"
             + (", lora_A and lora_B followed by NaN" if poison else ""))
    assert not Y.isnan().any(), \
        f"{where}: NaN in Y at {Y.isnan().nonzero()[0].tolist()}: " + \
        ("the factors are followed by NaN, so the padded rank columns rr >= R of BLOCK_R "
         "were loaded: mask rr < R on both the A and the B load (other=0)" if poison else
         "an output row was never stored, or a load read past its tensor (mask rr < R on "
         "the A and the B load, k < K on the x and W loads)")
    _close(Y, want, where, lambda: _slip_hint(Y, x, W, idx, None, A0, B0,
                                              post=lambda y: y[ssi] if y_grouped else y))
    outside = ybuf.clone()
    outside[:M, :N] = float("nan")
    assert outside.isnan().all(), f"{where} wrote outside Y[:M, :N]: mask the store"


_launch_s2s_lora(7, 24, 40, 4, 2, 2)                     # partial K and N tiles
_launch_s2s_lora(9, 40, 24, 4, 3, 3, seed=1, skip=2)     # r = 3, k = 3, expert 2 empty
_launch_s2s_lora(5, 24, 24, 4, 2, 1, seed=2, x_grouped=True, y_grouped=True)   # r = 1
_launch_s2s_lora(9, 24, 40, 4, 2, 3, seed=8, poison=True)   # r = 3 of BLOCK_R 16, NaN after
print("scatter2scatter_lora_kernel matches reference.linear_loop with LoRA")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1)
_launch_s2s_lora(1, 24, 40, 4, 2, 2, seed=3)
# case: row tiles that span two experts
_launch_s2s_lora(33, 40, 40, 8, 2, 4, seed=4, only=[1, 6])
# case: LoRA factors with transposed strides, k = 3
_launch_s2s_lora(12, 24, 40, 8, 3, 3, seed=5, skip=0, transposed_lora=True)
# case: a single expert with blocks of 32
_launch_s2s_lora(7, 40, 24, 1, 1, 2, seed=6, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)
# case: r = 17 (a larger BLOCK_R), y_grouped=True
_launch_s2s_lora(20, 24, 24, 4, 2, 17, seed=7, y_grouped=True)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_my_scatter2scatter_lora", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_s2s_lora(T, K, N, E, k, r, seed=0, x_grouped=False, y_grouped=False, **routing):
    x, W, idx, _, _, A, B = _problem(T, K, N, E, k, r, seed, **routing)
    sei, ssi, _ = flatten_sort_count(idx, E)
    want = linear_loop(x, W, idx, None, A, B, SCALING)
    X = x[ssi // k] if x_grouped else x
    if y_grouped:
        want = want[ssi]
    def call():
        return my_scatter2scatter_lora(X, W, A, B, SCALING, sei, ssi, k, x_grouped=x_grouped,
                                       y_grouped=y_grouped)
    with _no_reference():
        got = call()
    where = (f"my_scatter2scatter_lora(x_grouped={x_grouped}, y_grouped={y_grouped}), "
             f"{harness.describe(x, W, idx, r)}")
    _must_reach(scatter2scatter_lora_kernel, call,
                f"{where}: scatter2scatter_lora_kernel was not launched")
    _close(got, want, where, lambda: _slip_hint(got, x, W, idx, None, A, B,
                                                post=lambda y: y[ssi] if y_grouped else y))


_check_s2s_lora(7, 24, 40, 4, 2, 2)
_check_s2s_lora(9, 40, 24, 4, 3, 3, seed=1, skip=1, y_grouped=True)
# LoRA factors that do not fit: refused with a ValueError, before any launch
_xv, _Wv, _iv, _, _, _Av, _Bv = _problem(4, 24, 40, 4, 2, 2, seed=20)
_sv = flatten_sort_count(_iv, 4)[:2]
harness.assert_rejects("my_scatter2scatter_lora", [
    ("lora_B transposed ([r·E, N] instead of [N, r·E])",
     lambda: my_scatter2scatter_lora(_xv, _Wv, _Av, _Bv.T, 1.0, *_sv, 2)),
    ("lora_A with the wrong K", lambda: my_scatter2scatter_lora(_xv, _Wv, _Av[:, :-1], _Bv,
                                                                1.0, *_sv, 2))],
    lambda: harness.forbid([scatter2scatter_lora_kernel], globals(),
                           why="LoRA factors of the wrong shape must raise ValueError before "
                               "the launch"))
print("my_scatter2scatter_lora matches linear_loop and launches your kernel")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1) with r = 1
_check_s2s_lora(1, 40, 24, 4, 2, 1, seed=2)
# case: x_grouped=True over three of eight experts
_check_s2s_lora(13, 24, 40, 8, 2, 3, seed=3, x_grouped=True, only=[0, 3, 7])
# case: top-1 routing, eight experts
_check_s2s_lora(33, 40, 40, 8, 1, 2, seed=4)
# case: bad inputs (shapes, k, dtypes)
_x, _W, _i, _, _, _A, _B = _problem(4, 24, 40, 4, 2, 2, seed=5)
_s = flatten_sort_count(_i, 4)[:2]
_bad_calls = [
    ("lora_A with r·E not a multiple of E", lambda: my_scatter2scatter_lora(
        _x, _W, _A[:-1], _B[:, :-1], 1.0, *_s, 2)),
    ("lora_A with the wrong K", lambda: my_scatter2scatter_lora(
        _x, _W, _A[:, :-1], _B, 1.0, *_s, 2)),
    ("lora_B with the wrong N", lambda: my_scatter2scatter_lora(
        _x, _W, _A, _B[:-1], 1.0, *_s, 2)),
    ("lora_B transposed", lambda: my_scatter2scatter_lora(_x, _W, _A, _B.T, 1.0, *_s, 2)),
    ("X with the wrong K", lambda: my_scatter2scatter_lora(_x[:, :-1], _W, _A, _B, 1.0, *_s, 2)),
    ("k larger than E", lambda: my_scatter2scatter_lora(_x[:1], _W, _A, _B, 1.0, *_s, 8)),
]
if INTERPRET:
    _bad_calls.append(("float64 under the interpreter", lambda: my_scatter2scatter_lora(
        _x.double(), _W.double(), _A.double(), _B.double(), 1.0, *_s, 2)))
harness.assert_rejects("my_scatter2scatter_lora", _bad_calls, _no_reference)
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 3 — `group_bwd_lora`: dA and dB in one kernel, no atomics
#
# **Specification.** `group_bwd_lora_kernel` (signature below) is launched on the grid
# `(E, cdiv(P, BLOCK_P))`. Program `(e, pp)` owns the tile `OUT[pp·BLOCK_P : …, e·R : (e+1)·R]`
# and writes every element of it inside `P × R·E`:
#
# `OUT[p, e·R + j] = scaling · Σ_{m = start … end-1} U[m, p] · (V[m] · L[:, e·R + j])`
#
# over expert `e`'s sorted rows, `start = offsets[e-1]` (0 for `e = 0`) … `end = offsets[e]`.
# The rules that matter, as in Lab 09: rows masked against `end` (the next expert's rows
# follow), `rr < R` masked, **always store** (an expert without rows writes its zeros: the
# tests fill `OUT` with NaN), **no atomics** (the test looks), strides for every tensor,
# float32 accumulators with `input_precision="ieee"`.
#
# The same kernel gives both gradients (Part A): `dB = kernel(U=dY, V=X, L=Aᵀ)` with
# `P = N, Q = K`, and `dAᵀ = kernel(U=X, V=dY, L=B)` with `P = K, Q = N`.
#
# Then `my_group_bwd_lora(DY, X, lora_A, lora_B, expert_offsets, scaling, block_m=32,
# block_p=32, block_q=32)` → `(dA [r·E, K], dB [N, r·E])`: `DY` `[M, N]` and `X` `[M, K]`
# grouped (sorted) rows; raise `ValueError` on mismatched rows, LoRA shapes that do not fit
# (`E = len(expert_offsets)`), offsets that are not non-decreasing ending at `M`, or (under
# the interpreter) non-float32 data; allocate both outputs and launch **your** kernel twice
# (the tests count the launches), without copying `A` or `dA` into a transposed layout.
#
# <details><summary>Hint 1: the idea</summary>
#
# A program walks its expert's rows in steps of `BLOCK_M`. For each step it first builds
# `V_rows · L_e` `[BLOCK_M, BLOCK_R]` in an inner loop over `Q`, then adds
# `U_rowsᵀ · (V L_e)` `[BLOCK_P, BLOCK_R]` to its accumulator; `scaling` multiplies once, at
# the store. Transposes cost nothing when they are only strides: `Aᵀ` is `A` with its two
# strides swapped, and `dAᵀ` is written through the transposed strides of `dA` (pass
# `dA.stride(1), dA.stride(0)` as `OUT`'s strides).
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# acc = zeros([BLOCK_P, BLOCK_R], float32)
# for m0 in start .. end step BLOCK_M:                     # rows masked against end
#     vl = zeros([BLOCK_M, BLOCK_R])
#     for q0 in 0 .. Q step BLOCK_Q:
#         vl += dot(V[rows, q0:], L[q0:, e·R + rr])         # V_e @ L_e: [BM, BR]
#     acc += dot(trans(U[rows, p]), vl)                     # [BP, BM] @ [BM, BR]
# OUT[p, e·R + rr] = scaling · acc                          # masked p < P, rr < R — always
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "group_bwd_lora", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def group_bwd_lora_kernel(
    U,              # [M, P] grouped rows; their columns index OUT's rows
    V,              # [M, Q] grouped rows multiplied into the LoRA factor
    L,              # [Q, R·E] LoRA factor (any strides); expert e owns columns e·R:(e+1)·R
    OUT,            # [P, R·E] gradient (any strides); every element of column block e written
    offsets,        # [E] int64 expert_offsets (inclusive cumulative counts = end rows)
    P, Q, R,        # sizes
    scaling,        # LoRA scaling
    sum_, sup,      # strides of U
    svm, svq,       # strides of V
    slq, slr,       # strides of L
    sop, sor,       # strides of OUT
    BLOCK_M: tl.constexpr,    # rows per reduction step
    BLOCK_P: tl.constexpr,    # OUT rows per program
    BLOCK_Q: tl.constexpr,    # inner step over Q
    BLOCK_R: tl.constexpr,    # R padded to a power of two, >= 16
):
    """OUT[p, e·R + j] = scaling · Σ_{rows m of e} U[m, p] · (V[m] @ L[:, e·R + j])."""
    ### BEGIN SOLUTION
    e = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)          # [BP]
    p_mask = p < P
    rr = tl.arange(0, BLOCK_R)                                      # [BR]
    r_mask = rr < R
    qq = tl.arange(0, BLOCK_Q)
    mm = tl.arange(0, BLOCK_M)
    start = tl.load(offsets + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets + e)
    acc = tl.zeros((BLOCK_P, BLOCK_R), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = (m0 + mm) < end
        vl = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)         # V[rows] @ L_e
        for q0 in range(0, Q, BLOCK_Q):
            q_mask = (q0 + qq) < Q
            v = tl.load(V + (m0 + mm)[:, None] * svm + (q0 + qq)[None, :] * svq,
                        mask=rows[:, None] & q_mask[None, :], other=0.0)      # [BM, BQ]
            lf = tl.load(L + (q0 + qq)[:, None] * slq + (e * R + rr)[None, :] * slr,
                         mask=q_mask[:, None] & r_mask[None, :], other=0.0)   # [BQ, BR]
            vl += tl.dot(v.to(tl.float32), lf.to(tl.float32), input_precision="ieee")
        u = tl.load(U + (m0 + mm)[:, None] * sum_ + p[None, :] * sup,
                    mask=rows[:, None] & p_mask[None, :], other=0.0)          # [BM, BP]
        acc += tl.dot(tl.trans(u.to(tl.float32)), vl, input_precision="ieee")
    tl.store(OUT + p[:, None] * sop + (e * R + rr)[None, :] * sor,
             (acc * scaling).to(OUT.dtype.element_ty), mask=p_mask[:, None] & r_mask[None, :])
    ### END SOLUTION


def my_group_bwd_lora(DY: torch.Tensor, X: torch.Tensor, lora_A: torch.Tensor,
                      lora_B: torch.Tensor, expert_offsets: torch.Tensor, scaling: float,
                      block_m: int = 32, block_p: int = 32, block_q: int = 32
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dA [r·E, K], dB [N, r·E]) from grouped DY [M, N] and X [M, K], by your kernel."""
    ### BEGIN SOLUTION
    for name, t in (("DY", DY), ("X", X), ("lora_A", lora_A), ("lora_B", lora_B)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor")
        if INTERPRET and t.dtype != torch.float32:
            raise ValueError(f"{name} is {t.dtype}, but the Triton interpreter is float32-only")
    if DY.shape[0] != X.shape[0]:
        raise ValueError(f"DY {tuple(DY.shape)} and X {tuple(X.shape)} must have the same rows")
    offs = expert_offsets
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1 or offs.numel() < 1 \
            or offs.dtype.is_floating_point or offs.dtype == torch.bool:
        raise ValueError("expert_offsets must be a non-empty 1-D integer tensor [E]")
    M, N, K, E = DY.shape[0], DY.shape[1], X.shape[1], offs.shape[0]
    rE = lora_A.shape[0]
    if rE < E or rE % E or lora_A.shape[1] != K or tuple(lora_B.shape) != (N, rE):
        raise ValueError(f"lora_A must be [r·E, K] = [r·{E}, {K}] and lora_B [N, r·E] = "
                         f"[{N}, r·{E}], got {tuple(lora_A.shape)} and {tuple(lora_B.shape)}")
    offs = offs.long().contiguous()
    if int(offs[-1]) != M or (offs < 0).any() or (offs[1:] < offs[:-1]).any():
        raise ValueError(f"expert_offsets must be non-decreasing end rows ending at M={M}, "
                         f"got {offs.tolist()}")
    r = rE // E
    dA = torch.empty(rE, K, dtype=X.dtype, device=X.device)                # [r·E, K]
    dB = torch.empty(N, rE, dtype=X.dtype, device=X.device)                # [N, r·E]
    A, B = lora_A, lora_B
    # dB = kernel(U=DY, V=X, L=Aᵀ);  dAᵀ = kernel(U=X, V=DY, L=B), both via strides only.
    for U, V, L, sl, OUT, so in (
            (DY, X, A, (A.stride(1), A.stride(0)), dB, (dB.stride(0), dB.stride(1))),
            (X, DY, B, (B.stride(0), B.stride(1)), dA, (dA.stride(1), dA.stride(0)))):
        P, Q = U.shape[1], V.shape[1]
        group_bwd_lora_kernel[(E, triton.cdiv(P, block_p))](
            U, V, L, OUT, offs, P, Q, r, float(scaling), U.stride(0), U.stride(1),
            V.stride(0), V.stride(1), *sl, *so,
            BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_Q=block_q, BLOCK_R=rank_block(r))
    return dA, dB
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_group_bwd_lora_kernel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _bwd_lora_problem(T, K, N, E, k, r, seed=0, **routing):
    """Grouped X [M, K], DY [M, N], A, B, offsets, and dA, dB by a per-row outer-product loop."""
    x, W, idx, _, _, A, B = _problem(T, K, N, E, k, r, seed, **routing)
    sei, ssi, offs = flatten_sort_count(idx, E)
    Xg = x[ssi // k]                                                   # [M, K] sorted
    DYg = torch.randn(T * k, N, generator=torch.Generator().manual_seed(seed + 7)).to(DEVICE)
    dA, dB = torch.zeros_like(A), torch.zeros_like(B)
    for i in range(T * k):
        e = int(sei[i])
        Ae, Be = A[e * r:(e + 1) * r], B[:, e * r:(e + 1) * r]          # [r, K], [N, r]
        dB[:, e * r:(e + 1) * r] += SCALING * torch.outer(DYg[i], Ae @ Xg[i])
        dA[e * r:(e + 1) * r] += SCALING * torch.outer(DYg[i] @ Be, Xg[i])
    return Xg, DYg, A, B, offs, idx, dA, dB


def _bwd_lora_hint(name, got, Xg, DYg, A, B, offs, want):
    """' (what went wrong)' when `got` (dA or dB) is what a usual slip gives, else ''."""
    got = got.detach().float().cpu()
    E, r = offs.numel(), A.shape[0] // offs.numel()
    from_zero = torch.zeros_like(A if name == "dA" else B)   # every expert's sum from row 0
    for e in range(E):
        end = int(offs[e])
        Ae, Be = A[e * r:(e + 1) * r], B[:, e * r:(e + 1) * r]
        if name == "dB":
            from_zero[:, e * r:(e + 1) * r] = SCALING * DYg[:end].T @ (Xg[:end] @ Ae.T)
        else:
            from_zero[e * r:(e + 1) * r] = SCALING * (DYg[:end] @ Be).T @ Xg[:end]
    for wrong, why in ((want / SCALING, "not multiplied by scaling"),
                       (want * SCALING, "scaling is applied twice"),
                       (from_zero, "each expert sums over its own rows only, "
                        "offsets[e-1] … offsets[e]-1, not from row 0"),
                       (want.T.contiguous().view(want.shape), "dA holds dAᵀ's layout: write "
                        "dAᵀ through the transposed strides of dA, (dA.stride(1), "
                        "dA.stride(0))")):
        if wrong.shape == got.shape and torch.allclose(got, wrong.float().cpu(), rtol=1e-4,
                                                       atol=1e-5):
            return f" ({why})"
    return ""


def _launch_bwd_lora(T, K, N, E, k, r, BLOCK_M=16, BLOCK_P=16, BLOCK_Q=16, seed=0, **routing):
    """Launch group_bwd_lora_kernel directly for dB and for dAᵀ into NaN-filled buffers."""
    Xg, DYg, A, B, offs, idx, wantA, wantB = _bwd_lora_problem(T, K, N, E, k, r, seed, **routing)
    where0 = (f"M={Xg.shape[0]}, K={K}, N={N}, E={E}, r={r}, rows per expert "
              f"{torch.bincount(idx.reshape(-1).cpu(), minlength=E).tolist()}, "
              f"BLOCK_M/P/Q = {BLOCK_M}/{BLOCK_P}/{BLOCK_Q}")
    At = A.T                                                           # [K, r·E] view
    dBbuf = torch.full((N + 2, r * E + 3), float("nan"), device=DEVICE)
    dAbuf = torch.full((r * E + 1, K + 4), float("nan"), device=DEVICE)
    dB, dA = dBbuf[:N, :r * E], dAbuf[:r * E, :K]
    dAt = dA.T                                                         # [K, r·E] view
    for name, U, V, L, OUT, want, buf, inner in (
            ("dB", DYg, Xg, At, dB, wantB, dBbuf, (slice(None, N), slice(None, r * E))),
            ("dA", Xg, DYg, B, dAt, wantA, dAbuf, (slice(None, r * E), slice(None, K)))):
        P, Q = U.shape[1], V.shape[1]
        grid = (E, triton.cdiv(P, BLOCK_P))
        # the kernel gets the whole buffer at OUT's first element (offset 0) with OUT's
        # strides, so that a write outside OUT shows in buf
        with harness.outputs(buf):
            group_bwd_lora_kernel[grid](
                U, V, L, buf, offs, P, Q, r, SCALING, U.stride(0), U.stride(1), V.stride(0),
                V.stride(1), L.stride(0), L.stride(1), OUT.stride(0), OUT.stride(1),
                BLOCK_M=BLOCK_M, BLOCK_P=BLOCK_P, BLOCK_Q=BLOCK_Q, BLOCK_R=rank_block(r))
        got = buf[inner]
        where = f"group_bwd_lora_kernel[{grid}] for {name}, {where0}"
        assert not got.isnan().any(), \
            f"{where}: NaN left in {name} at {got.isnan().nonzero()[0].tolist()}: an element " \
            "was never written (store even when the expert has no rows) or a row past `end` " \
            "was read"
        _close(got, want, where, lambda got=got, name=name, want=want: _bwd_lora_hint(
            name, got, Xg, DYg, A, B, offs, want))
        outside = buf.clone()
        outside[inner] = float("nan")
        assert outside.isnan().all(), f"{where} wrote outside {name}: mask p < P and rr < R"
    _zero_lora(dAbuf[:r * E, :K], dBbuf[:N, :r * E], idx, E, where0)


harness.assert_no_atomics(group_bwd_lora_kernel, "each program owns its tile of one expert's "
                          "columns, so no atomics are needed")
_launch_bwd_lora(7, 24, 40, 4, 2, 2)                     # partial tiles
_launch_bwd_lora(9, 40, 24, 4, 3, 3, seed=1, skip=2)     # r = 3, expert 2 without rows
print("group_bwd_lora_kernel matches a per-row outer-product loop for dA and dB, zeros for "
      "empty experts")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1) with r = 1
_launch_bwd_lora(1, 24, 40, 4, 2, 1, seed=2)
# case: only the first and the last expert used
_launch_bwd_lora(33, 40, 24, 8, 2, 2, seed=3, only=[0, 7])
# case: blocks of 32, k = 3, first expert unused
_launch_bwd_lora(12, 24, 40, 8, 3, 4, seed=4, skip=0, BLOCK_M=32, BLOCK_P=32, BLOCK_Q=32)
# case: a single expert with r = 17 (a larger BLOCK_R)
_launch_bwd_lora(7, 40, 40, 1, 1, 17, seed=5)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_my_group_bwd_lora", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_my_bwd_lora(T, K, N, E, k, r, seed=0, **routing):
    Xg, DYg, A, B, offs, idx, wantA, wantB = _bwd_lora_problem(T, K, N, E, k, r, seed, **routing)
    with _no_reference():
        got = my_group_bwd_lora(DYg, Xg, A, B, offs, SCALING)
    where = (f"my_group_bwd_lora, M={Xg.shape[0]}, K={K}, N={N}, E={E}, r={r}, rows per "
             f"expert {torch.bincount(idx.reshape(-1).cpu(), minlength=E).tolist()}")
    assert isinstance(got, tuple) and len(got) == 2, \
        f"{where}: expected (dA, dB), got {type(got).__name__}"
    _must_reach(group_bwd_lora_kernel, lambda: my_group_bwd_lora(DYg, Xg, A, B, offs, SCALING),
                f"{where}: group_bwd_lora_kernel was not launched")
    _close(got[0], wantA, f"{where}: dA",
           lambda: _bwd_lora_hint("dA", got[0], Xg, DYg, A, B, offs, wantA))
    _close(got[1], wantB, f"{where}: dB",
           lambda: _bwd_lora_hint("dB", got[1], Xg, DYg, A, B, offs, wantB))
    _zero_lora(got[0], got[1], idx, E, where)


_check_my_bwd_lora(7, 24, 40, 4, 2, 2)
_check_my_bwd_lora(9, 40, 24, 8, 3, 3, seed=1, skip=5)
# inputs the kernel cannot trust: refused with a ValueError, before any launch
_Xv, _DYv, _Av, _Bv, _offv, _, _, _ = _bwd_lora_problem(7, 24, 40, 4, 2, 2, seed=21)
harness.assert_rejects("my_group_bwd_lora", [
    ("expert_offsets that end at M - 1",
     lambda: my_group_bwd_lora(_DYv, _Xv, _Av, _Bv, _offv - 1, 1.0)),
    ("lora_B of the wrong N", lambda: my_group_bwd_lora(_DYv, _Xv, _Av, _Bv[:-1], _offv, 1.0))],
    lambda: harness.forbid([group_bwd_lora_kernel], globals(),
                           why="bad offsets or LoRA shapes must raise ValueError before the "
                               "launch"))
print("my_group_bwd_lora matches the loop and launches your kernel")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1) with r = 1
_check_my_bwd_lora(1, 40, 24, 4, 2, 1, seed=2)
# case: every row to one expert
_check_my_bwd_lora(13, 24, 24, 8, 1, 2, seed=3, only=[3])
# case: non-contiguous X and lora_A
_Xg, _DYg, _A, _B, _offs, _, _wA, _wB = _bwd_lora_problem(7, 24, 40, 4, 2, 2, seed=4)
with _no_reference():
    _gA, _gB = my_group_bwd_lora(_DYg, _Xg.T.contiguous().T, _A.T.contiguous().T, _B, _offs,
                                 SCALING)
harness.assert_close(_gA, _wA, "my_group_bwd_lora with non-contiguous X and lora_A: dA")
harness.assert_close(_gB, _wB, "my_group_bwd_lora with non-contiguous X and lora_A: dB")
# case: bad inputs (shapes, offsets)
_bad_calls = [
    ("DY with other rows", lambda: my_group_bwd_lora(_DYg[:-1], _Xg, _A, _B, _offs, 1.0)),
    ("lora_A of the wrong K", lambda: my_group_bwd_lora(_DYg, _Xg, _A[:, :-1], _B, _offs, 1.0)),
    ("lora_B of the wrong N", lambda: my_group_bwd_lora(_DYg, _Xg, _A, _B[:-1], _offs, 1.0)),
    ("offsets not ending at M", lambda: my_group_bwd_lora(_DYg, _Xg, _A, _B, _offs - 1, 1.0)),
    ("decreasing offsets", lambda: my_group_bwd_lora(_DYg, _Xg, _A, _B, _offs.flip(0), 1.0)),
    ("float offsets", lambda: my_group_bwd_lora(_DYg, _Xg, _A, _B, _offs.float(), 1.0)),
]
harness.assert_rejects("my_group_bwd_lora", _bad_calls, _no_reference)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_my_group_bwd_lora_launches", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import in_learner  # noqa: E402


def _launches_of_group_bwd_lora(DYg, Xg, A, B, offs, scaling):
    """How many times my_group_bwd_lora launches group_bwd_lora_kernel (a spy on it, where
    your code runs)."""
    with harness.spy_on(my_group_bwd_lora.__globals__, group_bwd_lora_kernel) as spy:
        my_group_bwd_lora(DYg, Xg, A, B, offs, scaling)
    return len(spy.grids)


def _check_launches(T, K, N, E, k, r, seed=0, what="", **routing):
    Xg, DYg, A, B, offs, _, _, _ = _bwd_lora_problem(T, K, N, E, k, r, seed, **routing)
    # in-process check: my_group_bwd_lora launches group_bwd_lora_kernel twice (dB, dA)
    launches = in_learner(_launches_of_group_bwd_lora, DYg, Xg, A, B, offs, SCALING)
    assert launches >= 2, \
        f"{what}my_group_bwd_lora, M={Xg.shape[0]}, K={K}, N={N}, E={E}, r={r}: expected " \
        f"group_bwd_lora_kernel launched twice (once for dB, once for dA), got {launches}"


_check_launches(7, 24, 40, 4, 2, 2, seed=0)
_check_launches(9, 40, 24, 8, 3, 3, seed=1)
print("my_group_bwd_lora computes both dB and dA with your kernel")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1) with r = 1
_check_launches(1, 40, 24, 4, 2, 1, seed=2, what="hidden: ")
# case: every row to one expert
_check_launches(13, 24, 24, 8, 1, 2, seed=3, what="hidden: ", only=[3])
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 4 — the autograd Function with fused LoRA
#
# **Specification.** `MyLoRAParallelLinear.forward(ctx, x, W, gates, lora_A, lora_B, scaling,
# k, sei, ssi, offsets, grouped_in, grouped_out)` computes `Y` `[M, N]` with **your**
# `my_scatter2scatter_lora` (`x_grouped=grouped_in`, `y_grouped=grouped_out`) and returns
# `out[t] = Σ_j gates[t, j] · Y[t·k + j]` `[T, N]` with gates, `Y` without.
#
# `MyLoRAParallelLinear.backward(ctx, dout)` returns twelve values, in the forward's order:
# `(dx, dW, dgates, dA, dB, None, …)`. The rules that matter:
#
# * `dA, dB` come from **your** `my_group_bwd_lora`, and `dx` from **your** fused kernel
#   again, on transposed weights (the tests count the calls: `my_scatter2scatter_lora` at
#   least twice, forward and `dx`);
# * `dW` only if `W` needs a gradient (in QLoRA it never does; `minimoe.group_bwd_W` is
#   yours to use);
# * `dx` sums each token's `k` slots (not with `grouped_in`); `dgates` is `None` without
#   gates.
#
# `my_lora_parallel_linear(x, W, k, sei, ssi, offsets, lora_A, lora_B, scaling, gates=None,
# grouped_in=False, grouped_out=False)` raises `ValueError` for gates with `grouped_out=True`
# and returns `MyLoRAParallelLinear.apply(...)`.
#
# <details><summary>Hint 1: the idea</summary>
#
# This is Lab 09's Function with two more inputs. Save `x`, `W`, `gates`, `lora_A`, `lora_B`,
# the indices and (with gates) `Y`. In the backward, `dYg` is `group(dout, ssi, fan_out=k,
# coeff=gates)` with gates, `dout` itself with `grouped_out`, else `group(dout, ssi)`; `Xg` is
# `x` if `grouped_in`, else `group(x, ssi, fan_out=k)`. For `dx`, Part A's rule
# `dX = dY Wᵀ + scaling · (dY B_e) A_e` is the fused forward with `W → Wᵀ`, `A → Bᵀ`,
# `B → Aᵀ`: `lora_B.t()` and `lora_A.t()` are views, and your launcher passes their strides.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# backward: dgates = (Y.view(T, k, N) * dout[:, None, :]).sum(-1)        # with gates
#           dYg = group(dout, ssi, fan_out=k, coeff=gates)   | dout | group(dout, ssi)
#           Xg  = x if grouped_in else group(x, ssi, fan_out=k)
#           dW  = group_bwd_W(dYg, Xg, offsets, E)                         # if needed
#           dA, dB = my_group_bwd_lora(dYg, Xg, lora_A, lora_B, offsets, scaling)
#           dXs = my_scatter2scatter_lora(dYg, W.transpose(1, 2), lora_B.t(), lora_A.t(),
#                                         scaling, sei, ssi, 1, x_grouped=True,
#                                         y_grouped=grouped_in)            # [M, K]
#           dx  = dXs if grouped_in else dXs.view(T, k, K).sum(1)
#           return dx, dW, dgates, dA, dB, None × 7
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "lora_parallel_linear", "locked": false, "schema_version": 3, "solution": true, "task": false}
class MyLoRAParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W, gates, lora_A, lora_B, scaling, k, sei, ssi, offsets, grouped_in,
                grouped_out):
        ### BEGIN SOLUTION
        Y = my_scatter2scatter_lora(x, W, lora_A, lora_B, scaling, sei, ssi, k,
                                    x_grouped=grouped_in, y_grouped=grouped_out)   # [M, N]
        if gates is None:
            out = Y
        else:
            T, N = gates.shape[0], Y.shape[1]
            out = (gates.to(Y.dtype).unsqueeze(-1) * Y.view(T, k, N)).sum(1)    # [T, N]
        ctx.save_for_backward(x, W, gates, lora_A, lora_B, sei, ssi, offsets,
                              None if gates is None else Y)
        ctx.k, ctx.scaling = k, scaling
        ctx.grouped_in, ctx.grouped_out = grouped_in, grouped_out
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, dout):
        ### BEGIN SOLUTION
        x, W, gates, A, B, sei, ssi, offsets, Y = ctx.saved_tensors
        k, s, E = ctx.k, ctx.scaling, W.shape[0]
        need = ctx.needs_input_grad
        dout = dout.contiguous()
        dgates = None
        if gates is not None:
            T, N = dout.shape
            dgates = (Y.view(T, k, N) * dout.unsqueeze(1)).sum(-1).to(gates.dtype)   # [T, k]
            dYg = group(dout, ssi, fan_out=k, coeff=gates)                           # [M, N]
        elif ctx.grouped_out:
            dYg = dout
        else:
            dYg = group(dout, ssi, fan_out=1)
        Xg = x if ctx.grouped_in else group(x, ssi, fan_out=k)                       # [M, K]
        dW = group_bwd_W(dYg, Xg, offsets, E) if need[1] else None
        dA = dB = None
        if need[3] or need[4]:
            dA, dB = my_group_bwd_lora(dYg, Xg, A, B, offsets, s)
        dx = None
        if need[0]:
            dXs = my_scatter2scatter_lora(dYg, W.transpose(1, 2), B.t(), A.t(), s, sei, ssi, 1,
                                          x_grouped=True, y_grouped=ctx.grouped_in)  # [M, K]
            dx = dXs if ctx.grouped_in or k == 1 else dXs.view(-1, k, dXs.shape[1]).sum(1)
        return dx, dW, dgates, dA, dB, None, None, None, None, None, None, None
        ### END SOLUTION


def my_lora_parallel_linear(x: torch.Tensor, W: torch.Tensor, k: int,
                            sorted_expert_idxs: torch.Tensor,
                            sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor,
                            lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                            gates: torch.Tensor | None = None, grouped_in: bool = False,
                            grouped_out: bool = False) -> torch.Tensor:
    """Expert linear + fused expert LoRA over the slots, differentiable through your kernels."""
    ### BEGIN SOLUTION
    if gates is not None and grouped_out:
        raise ValueError("gates mix each token's k outputs: use grouped_out=False with gates")
    return MyLoRAParallelLinear.apply(x, W, gates, lora_A, lora_B, float(scaling), k,
                                      sorted_expert_idxs, sorted_scattered_idxs,
                                      expert_offsets, grouped_in, grouped_out)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_lora_parallel_linear", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _check_fn(T, K, N, E, k, r, seed=0, gated=True, grouped_in=False, grouped_out=False,
              W_grad=True, **routing):
    x, W, idx, gates, dout, A, B = _problem(T, K, N, E, k, r, seed, **routing)
    sei, ssi, offs = flatten_sort_count(idx, E)
    gates = gates if gated else None
    if not gated:
        dout = torch.randn(T * k, N, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    if grouped_in or grouped_out:
        # no loop for sorted layouts: minimoe's torch path (split LoRA), checked by its tests
        xin = x[ssi // k] if grouped_in else x
        refs = [harness.leaf(t) for t in (xin, W, A, B)] + [None if gates is None else harness.leaf(gates)]
        out = _pl_reference(refs[0], refs[1], k, sei, ssi, offs, gates=refs[4],
                            grouped_in=grouped_in, grouped_out=grouped_out, lora_A=refs[2],
                            lora_B=refs[3], scaling=SCALING, backend="torch")
        out.backward(dout)
        want = (out.detach(), refs[0].grad, refs[1].grad,
                None if gates is None else refs[4].grad, refs[2].grad, refs[3].grad)
        x = xin
    else:
        want = harness.loop_grads(x, W, idx, gates, dout, A, B, SCALING)
    xr, Ar, Br = harness.leaf(x), harness.leaf(A), harness.leaf(B)
    Wr = harness.leaf(W) if W_grad else W.clone()
    gr = None if gates is None else harness.leaf(gates)
    def forward():
        return my_lora_parallel_linear(xr, Wr, k, sei, ssi, offs, Ar, Br, SCALING, gates=gr,
                                       grouped_in=grouped_in, grouped_out=grouped_out)
    where = (f"my_lora_parallel_linear(gates={'[T, k]' if gated else None}, grouped_in="
             f"{grouped_in}, grouped_out={grouped_out}), {harness.describe(x, W, idx, r)}")
    # your pieces are reached: each fails while switched off (a failed backward leaves no grad)
    _must_reach(my_scatter2scatter_lora, forward,
                f"{where}: expected my_scatter2scatter_lora in the forward")
    with _no_reference():
        out = forward()
    _must_reach(my_scatter2scatter_lora, lambda: out.backward(dout, retain_graph=True),
                f"{where}: expected my_scatter2scatter_lora for dx in the backward")
    _must_reach(my_group_bwd_lora, lambda: out.backward(dout, retain_graph=True),
                f"{where}: the backward did not call my_group_bwd_lora")
    with _no_reference():
        out.backward(dout)
    loop = not (grouped_in or grouped_out)          # the slips are replayed on the loop
    _close(out, want[0], f"{where}: output",
           lambda: _slip_hint(out, x, W, idx, gates, A, B) if loop else "")
    for name, got, w in zip(("dx", "dW", "dgates", "dA", "dB"),
                            (xr.grad, Wr.grad if W_grad else None,
                             None if gr is None else gr.grad, Ar.grad, Br.grad),
                            want[1:], strict=True):
        if name == "dW" and not W_grad:
            assert Wr.grad is None
            continue
        if w is None:
            assert got is None, f"{where}: {name} should be None (no gates), got a tensor"
        else:
            assert got is not None, f"{where}: {name} is None"
            _close(got, w, f"{where}: {name}", lambda got=got, name=name: _slip_hint(
                got, x, W, idx, gates, A, B, grad=name, dout=dout) if loop else "")
    _zero_lora(Ar.grad, Br.grad, idx, E, where)


_check_fn(7, 24, 40, 4, 2, 2)
_check_fn(9, 40, 24, 4, 3, 3, seed=1, skip=2)
_check_fn(7, 24, 24, 4, 2, 1, seed=2, gated=False)
_xv, _Wv, _iv, _gv, _, _Av, _Bv = _problem(4, 24, 24, 4, 2, 2, seed=22)
harness.assert_rejects("my_lora_parallel_linear", [
    ("gates together with grouped_out=True",
     lambda: my_lora_parallel_linear(_xv, _Wv, 2, *flatten_sort_count(_iv, 4), _Av, _Bv, 1.0,
                                     gates=_gv, grouped_out=True))], _no_reference)
print("my_lora_parallel_linear: output, dx, dW, dgates, dA and dB match reference.linear_loop")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1)
_check_fn(1, 24, 40, 4, 2, 2, seed=3)
# case: all tokens on two of eight experts
_check_fn(13, 40, 40, 8, 2, 4, seed=4, only=[1, 6])
# case: a single expert (E = 1)
_check_fn(7, 24, 24, 1, 1, 2, seed=5)
# case: a frozen W (no gradient for W), k = 3
_check_fn(12, 40, 24, 8, 3, 3, seed=6, skip=0, W_grad=False)
# case: no gates, grouped_out=True
_check_fn(7, 24, 40, 4, 2, 2, seed=7, gated=False, grouped_out=True)
# case: grouped_in=True (the down projection)
_check_fn(7, 40, 24, 4, 2, 2, seed=8, grouped_in=True)
# case: gates together with grouped_out=True
_xx, _WW, _ii, _gg, _, _AA, _BB = _problem(4, 24, 24, 4, 2, 2, seed=9)
try:
    with _no_reference():
        my_lora_parallel_linear(_xx, _WW, 2, *flatten_sort_count(_ii, 4), _AA, _BB, 1.0,
                                gates=_gg, grouped_out=True)
except ValueError:
    pass
else:
    raise AssertionError("my_lora_parallel_linear accepted gates with grouped_out=True; "
                         "expected ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ### Fused and split, side by side
#
# Both paths compute the same numbers; they differ in traffic. The split path writes and
# reads an `[M, r]` tensor `h` in memory and runs three dispatch kernels (plus three
# backward passes); the fused one keeps `x·A_eᵀ` in registers and loads each `x` tile once.
# On a GPU this is what keeps the LoRA overhead small over the base kernel (the course's
# target is ≤ 20%, measured by `benchmarks/bench_moe.py`); under the interpreter the
# timings below only count Python work, not memory traffic.

# %%
_x, _W, _idx, _g, _dout, _A, _B = harness.expert_problem(33, 40, 40, 8, 2, seed=60, r=4,
                                                          device=DEVICE)
_ss = flatten_sort_count(_idx, 8)
try:
    _res = {}
    for _name, _fn in (("split (Ex. 1)", split_lora_linear), ("fused (Ex. 4)", my_lora_parallel_linear)):
        _xr, _Ar, _Br = harness.leaf(_x), harness.leaf(_A), harness.leaf(_B)
        _t0 = time.perf_counter()
        _o = _fn(_xr, _W, 2, *_ss, _Ar, _Br, 0.5, gates=_g)
        _t1 = time.perf_counter()
        _o.backward(_dout)
        _t2 = time.perf_counter()
        _res[_name] = (_o.detach(), _xr.grad, _Ar.grad, _Br.grad)
        print(f"{_name:>14}: forward {1e3 * (_t1 - _t0):6.1f} ms, backward "
              f"{1e3 * (_t2 - _t1):6.1f} ms "
              f"({'interpreter: not a kernel timing' if INTERPRET else DEVICE})")
    for _i, _what in enumerate(("out", "dx", "dA", "dB")):
        _a, _b = _res["split (Ex. 1)"][_i], _res["fused (Ex. 4)"][_i]
        print(f"  max |split − fused| in {_what}: {float((_a - _b).abs().max()):.2e}")
except NotImplementedError:
    print("(finish Exercises 1-4 to compare the two paths)")

# %% [markdown]
# ## Exercise 5 — NF4 experts, dequantizing only those with tokens
#
# QLoRA keeps the frozen experts in NF4 (`minimoe.quantize_experts(W)` quantizes an
# `[E, K, N]` weight so that no 64-element block spans two experts). Each forward needs a
# float copy of the expert weights — but only of the experts this batch routed tokens to.
#
# **Specification.** `nf4_lora_linear(x, q, k, sorted_expert_idxs, sorted_scattered_idxs,
# expert_offsets, lora_A, lora_B, scaling, gates=None, stats=None)` takes the frozen expert
# weights as an `NF4Weight` `q` of shape `[E, K, N]` and returns what
# `my_lora_parallel_linear` returns on the dequantized weight. The rules that matter:
#
# * **one dequantized copy, of the active experts only**: exactly one call of
#   `selective_dequantize_nf4_torch` (or `selective_dequantize_nf4`, the Lab 03 kernel,
#   slower under the interpreter), by the name the setup cell imports, with the ids of the
#   experts that have at least one row, ascending; a full dequantize is switched off in the
#   tests, and the unused experts' bytes are never read (the tests poison them);
# * **compact expert ids** for the `n` active experts: the routing indices and offsets must
#   refer to rows `0 … n-1` of the dequantized `[n, K, N]` weight (the active experts need
#   not be contiguous from 0);
# * **the active experts' LoRA slices by indexing `lora_A`, `lora_B`** (no copies, no new
#   leaves), so that autograd sends their gradients back and exactly-zero gradients to the
#   unused experts' slices;
# * if `stats` is a dict, put `active` (list of ints), `n_active` and `dequant_bytes` (the
#   bytes of the dequantized copy) into it.
#
# The tests compare with autograd of the naive loop (`reference.linear_loop` with LoRA) on
# the **fully** dequantized weight (output and the x, gates, A, B gradients), then
# **poison** the unused experts' NF4 bytes and scales and check the output does not move.
#
# <details><summary>Hint 1: the idea</summary>
#
# The counts per expert are the differences of the end offsets (`torch.diff` with a 0
# prepended); the active experts are those with a count above 0. A table `remap` of size `E`
# with `remap[active] = 0 … n-1` turns `sei` into compact ids; the compact offsets are the
# active experts' end offsets, and `ssi` stays as it is (the active experts keep their
# order). For the LoRA, view `lora_A` as `[E, r, K]` and `lora_B` as `[N, E, r]`, index the
# expert axis with `active`, and reshape back.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# counts = diff(expert_offsets, prepend 0);  active = nonzero(counts > 0);  n = len(active)
# Wc = selective_dequantize_nf4_torch(q, active, dtype=x.dtype)               # [n, K, N]
# remap = full(E, -1);  remap[active] = arange(n)
# sei_c = remap[sei];  offs_c = expert_offsets[active]
# A_c = lora_A.reshape(E, r, K)[active].reshape(n * r, K)
# B_c = lora_B.reshape(N, E, r)[:, active].reshape(N, n * r)
# stats: active, n_active = n, dequant_bytes = Wc.numel() * Wc.element_size()
# return my_lora_parallel_linear(x, Wc, k, sei_c, ssi, offs_c, A_c, B_c, scaling, gates)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "nf4_lora", "locked": false, "schema_version": 3, "solution": true, "task": false}
def nf4_lora_linear(x: torch.Tensor, q: NF4Weight, k: int, sorted_expert_idxs: torch.Tensor,
                    sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor,
                    lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
                    gates: torch.Tensor | None = None, stats: dict | None = None
                    ) -> torch.Tensor:
    """my_lora_parallel_linear with a frozen NF4 weight q [E, K, N], dequantizing only the
    experts that received rows."""
    ### BEGIN SOLUTION
    E, K, N = q.shape
    counts = torch.diff(expert_offsets, prepend=expert_offsets.new_zeros(1))      # [E]
    active = torch.nonzero(counts > 0).reshape(-1)                                # [n]
    n = active.numel()
    Wc = selective_dequantize_nf4_torch(q, active, dtype=x.dtype)                 # [n, K, N]
    remap = torch.full((E,), -1, dtype=torch.long, device=active.device)
    remap[active] = torch.arange(n, device=active.device)
    sei_c = remap[sorted_expert_idxs]                                             # [M] 0..n-1
    offs_c = expert_offsets[active]                                               # [n]
    r = lora_A.shape[0] // E
    A_c = lora_A.reshape(E, r, K)[active].reshape(n * r, K)                       # [r·n, K]
    B_c = lora_B.reshape(N, E, r)[:, active].reshape(N, n * r)                    # [N, r·n]
    if stats is not None:
        stats.update(active=active.tolist(), n_active=n,
                     dequant_bytes=Wc.numel() * Wc.element_size())
    return my_lora_parallel_linear(x, Wc, k, sei_c, sorted_scattered_idxs, offs_c, A_c, B_c,
                                   scaling, gates=gates)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nf4_lora", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import share  # noqa: E402

_SELECTIVE = [selective_dequantize_nf4_torch, selective_dequantize_nf4]


def _poison(q, keep):
    """Overwrite every stored byte and block scale of the experts not in `keep`, in place:
    codes 0xFF (level +1.0 everywhere) and NaN / 0xFF scales."""
    E = q.shape[0]
    for t in (q.packed, q.block_absmax, q.absmax_codes):
        if t is None:
            continue
        per_expert = t.view(E, -1)
        for e in range(E):
            if e not in keep:
                per_expert[e] = float("nan") if t.is_floating_point() else 0xFF


def _check_nf4(T, K, N, E, k, r, seed=0, gated=True, double_quant=True, reference=False,
               **routing):
    """nf4_lora_linear against autograd of the naive loop on the dequantized weight; with
    `reference` (graded runs only: the fused LoRA path of minimoe is a stub in the student
    edition), the loop is first checked against minimoe's parallel_linear."""
    x, W, idx, gates, dout, A, B = _problem(T, K, N, E, k, r, seed, **routing)
    gates = gates if gated else None
    if not gated:
        dout = torch.randn(T * k, N, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    q = quantize_experts(W, double_quant=double_quant)
    ss = flatten_sort_count(idx, E)
    used = sorted(set(idx.reshape(-1).tolist()))
    # the expectation: autograd of the naive loop (reference.linear_loop with LoRA, one
    # x[t] @ (W[e] + scaling · B_e A_e) per slot) on the fully dequantized weight [E, K, N]
    Wd = q.dequantize()
    want = dict(zip(("out", "dx", "dW", "dgates", "dA", "dB"),
                    harness.loop_grads(x, Wd, idx, gates, dout, A, B, SCALING), strict=True))
    if reference:
        harness.assert_close(_pl_reference(x, Wd, k, *ss, gates=gates, lora_A=A, lora_B=B,
                                           scaling=SCALING), want["out"],
                             "minimoe.parallel_linear with LoRA against the loop (the reference "
                             "itself)")
    xr, Ar, Br = harness.leaf(x), harness.leaf(A), harness.leaf(B)
    gr = None if gates is None else harness.leaf(gates)
    stats = share({})        # filled in by your code, in place: `share` keeps it where it runs
    with _no_reference():
        out = nf4_lora_linear(xr, q, k, *ss, Ar, Br, SCALING, gates=gr, stats=stats)
        out.backward(dout)
    where = (f"nf4_lora_linear(gates={'[T, k]' if gated else None}, double_quant="
             f"{double_quant}), {harness.describe(x, W, idx, r)}")
    got_stats = {key: stats[key] if key in stats else None
                 for key in ("active", "n_active", "dequant_bytes")}
    assert got_stats["active"] == used and got_stats["n_active"] == len(used), \
        f"{where}: stats active/n_active: expected {used}/{len(used)} (the experts with rows, " \
        f"ascending), got {got_stats['active']}/{got_stats['n_active']}"
    assert got_stats["dequant_bytes"] == len(used) * K * N * 4, \
        f"{where}: stats dequant_bytes: expected {len(used)} · {K} · {N} · 4 = " \
        f"{len(used) * K * N * 4} (one float32 copy of the active experts), got " \
        f"{got_stats['dequant_bytes']}"
    _must_reach(_SELECTIVE, lambda: nf4_lora_linear(x, q, k, *ss, A, B, SCALING, gates=gates),
                f"{where}: neither selective_dequantize_nf4_torch nor selective_dequantize_nf4 "
                "was called: dequantize the active experts with one of them")
    _close(out, want["out"], f"{where}: output",
           lambda: _slip_hint(out, x, Wd, idx, gates, A, B))
    for name, got in (("dx", xr.grad), ("dA", Ar.grad), ("dB", Br.grad)) + \
            ((("dgates", gr.grad),) if gated else ()):
        assert got is not None, f"{where}: {name} is None"
        _close(got, want[name], f"{where}: {name}",
               lambda got=got, name=name: _slip_hint(got, x, Wd, idx, gates, A, B,
                                                     grad=name, dout=dout))
    _zero_lora(Ar.grad, Br.grad, idx, E, where)
    # poison the unused experts: the output must not move, gradients must stay finite
    _poison(q, keep=used)
    xp = harness.leaf(x)
    with _no_reference():
        again = nf4_lora_linear(xp, q, k, *ss, A, B, SCALING, gates=gates)
        again.sum().backward()
    assert torch.equal(again.detach(), out.detach()), \
        f"{where}: after poisoning experts {sorted(set(range(E)) - set(used))} (no tokens) the " \
        f"output changed by {float((again - out).abs().nan_to_num(1e30).max()):.3g}: an " \
        "unused expert was read"
    assert torch.isfinite(xp.grad).all(), f"{where}: dx not finite after poisoning"


_check_nf4(7, 16, 24, 5, 2, 2, only=[0, 1, 3])     # experts 2 and 4 unused
_check_nf4(9, 24, 40, 6, 1, 3, seed=1, gated=False, only=[1, 4])
print("nf4_lora_linear matches the loop on the dequantized weight, fills in the stats "
      "and never reads an unused expert")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1), eight experts
_check_nf4(1, 16, 24, 8, 2, 1, seed=2, reference=True)
# case: every expert used, without double quantization
_check_nf4(12, 24, 40, 4, 3, 2, seed=3, double_quant=False, reference=True)
# case: only the first and the last expert used
_check_nf4(9, 16, 24, 6, 2, 2, seed=4, reference=True, only=[5, 0])
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_nf4_lora_one_dequantize", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import in_learner  # noqa: E402


def _dequantize_calls(x, q, k, ss, A, B, scaling, gates):
    """The selective dequantize calls of nf4_lora_linear (a spy on both, where your code runs):
    the expert ids each got and the bytes it returned."""
    with harness.spy_on(nf4_lora_linear.__globals__, selective_dequantize_nf4_torch,
                        selective_dequantize_nf4) as (sp_t, sp_k):
        nf4_lora_linear(x, q, k, *ss, A, B, scaling, gates=gates)
    return [((args[1] if len(args) > 1 else kwargs.get("active")).tolist(),
             Wc.numel() * Wc.element_size()) for args, kwargs, Wc in sp_t.results + sp_k.results]


def _check_one_dequantize(T, K, N, E, k, r, seed=0, what="", **routing):
    x, W, idx, g, _, A, B = _problem(T, K, N, E, k, r, seed, **routing)
    used = sorted(set(idx.reshape(-1).tolist()))
    where = f"{what}nf4_lora_linear, {harness.describe(x, W, idx, r)}"
    # in-process check: one selective dequantize call, of exactly the active experts
    calls = in_learner(_dequantize_calls, x, quantize_experts(W), k, flatten_sort_count(idx, E),
                       A, B, SCALING, g)
    assert len(calls) == 1, \
        f"{where}: expected one selective dequantize call (one copy of all the active " \
        f"experts), got {len(calls)}"
    assert tuple(calls[0]) == (used, len(used) * K * N * 4), \
        f"{where}: dequantized experts {calls[0][0]} ({calls[0][1]} bytes); expected exactly " \
        f"the active ones {used}, ascending ({len(used) * K * N * 4} bytes)"


_check_one_dequantize(7, 16, 24, 5, 2, 2, seed=0, only=[0, 1, 3])
_check_one_dequantize(9, 24, 40, 6, 1, 3, seed=1, only=[1, 4])
print("nf4_lora_linear dequantizes the active experts in one call")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1), eight experts
_check_one_dequantize(1, 16, 24, 8, 2, 1, seed=2, what="hidden: ")
# case: every expert used
_check_one_dequantize(12, 24, 40, 4, 3, 2, seed=3, what="hidden: ")
# case: only the first and the last expert used
_check_one_dequantize(9, 16, 24, 6, 2, 2, seed=4, what="hidden: ", only=[5, 0])
### END HIDDEN TESTS

# %% [markdown]
# ### How big is the transient float copy?
#
# The dequantized buffer `Wc` lives only during the call, and its size is set by how many
# experts the batch touched, not by `E`. With 8 experts of `K = 32`, `N = 64` and 16 tokens
# routed top-1 over the first 1, 2, 4 or 8 experts, the bars show the bytes your
# `nf4_lora_linear` reported (its `stats`), next to a full dequantize and the NF4 storage
# held all the time (double quantization, ≈ 4.13 bits per weight).

# %%
_E, _K, _N, _T = 8, 32, 64, 16
_gb = torch.Generator().manual_seed(7)
_Wb = (torch.randn(_E, _K, _N, generator=_gb) / _K ** 0.5).to(DEVICE)
_qb = quantize_experts(_Wb)
_Ab = (torch.randn(2 * _E, _K, generator=_gb) / _K ** 0.5).to(DEVICE)
_Bb = torch.zeros(_N, 2 * _E, device=DEVICE)
_xb = torch.randn(_T, _K, generator=_gb).to(DEVICE)
_full = _E * _K * _N * 4
_bytes = []
try:
    for _n in (1, 2, 4, 8):
        _st = {}
        _ib = (torch.arange(_T) % _n).reshape(_T, 1).to(DEVICE)           # spread over _n experts
        with torch.no_grad():
            nf4_lora_linear(_xb, _qb, 1, *flatten_sort_count(_ib, _E), _Ab, _Bb, 1.0, stats=_st)
        _bytes.append(_st["dequant_bytes"])
        print(f"{_n}/{_E} experts active: dequant buffer {_st['dequant_bytes']:>6} B "
              f"= {_st['dequant_bytes'] / _full:.3f} of a full dequantize ({_full} B)")
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.bar([str(n) for n in (1, 2, 4, 8)], _bytes, color="tab:blue", label="your dequant buffer")
    ax.axhline(_full, ls="--", color="tab:red", label=f"full dequantize ({_full} B)")
    ax.axhline(_qb.nbytes, ls=":", color="tab:green",
               label=f"NF4+DQ storage ({_qb.nbytes} B, {_qb.bits_per_param:.3f} bits/param)")
    ax.set_xlabel(f"active experts (of {_E})")
    ax.set_ylabel("bytes (float32)")
    ax.set_title(f"transient dequantized expert weights, K={_K}, N={_N}", fontsize=9)
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
except NotImplementedError:
    print("(finish Exercise 5 to measure the buffer)")

# %% [markdown]
# ### Experts without tokens learn nothing — exactly
#
# A toy regression: 4 experts, NF4 base, LoRA `r = 2` on every expert (B starts at zero), and
# a router that only ever picks experts 0 and 2. The target adds a hidden low-rank change to
# each expert. A few SGD steps on `A` and `B` through your `nf4_lora_linear`: the curves are
# the Frobenius norm of each expert's update `‖scaling · B_e A_e‖`. Experts 1 and 3 never
# receive a token, so their `dA`, `dB` slices are exact zeros and their update stays **0.0**,
# not "small" — which is what makes it safe to hold LoRA for every expert and train only
# the ones a batch reaches.

# %%
_E, _K, _N, _r, _T = 4, 16, 24, 2, 24
_gt = torch.Generator().manual_seed(11)
_Wt = (torch.randn(_E, _K, _N, generator=_gt) / _K ** 0.5).to(DEVICE)
_qt = quantize_experts(_Wt)
_delta = (torch.randn(_E, _K, 2, generator=_gt) @ torch.randn(_E, 2, _N, generator=_gt)
          / _K).to(DEVICE)                                              # hidden change [E, K, N]
_xt = torch.randn(_T, _K, generator=_gt).to(DEVICE)
_it = torch.tensor([0, 2])[torch.randint(0, 2, (_T, 1), generator=_gt)].to(DEVICE)   # 0 or 2
_target = torch.stack([_xt[t] @ (_Wt[e] + _delta[e]) for t, e in enumerate(_it[:, 0].tolist())])
_sc = 2.0 / _r
_At = harness.leaf((torch.randn(_r * _E, _K, generator=_gt) / _K ** 0.5).to(DEVICE))
_Bt = harness.leaf(torch.zeros(_N, _r * _E, device=DEVICE))
_sst = flatten_sort_count(_it, _E)
_norms, _losses = [], []
try:
    for _step in range(12):
        _out = nf4_lora_linear(_xt, _qt, 1, *_sst, _At, _Bt, _sc)               # [T, N] (k=1)
        _loss = ((_out - _target) ** 2).mean()
        _At.grad = _Bt.grad = None
        _loss.backward()
        with torch.no_grad():
            _At -= 2.0 * _At.grad
            _Bt -= 2.0 * _Bt.grad
            _norms.append([float((_sc * _Bt[:, e * _r:(e + 1) * _r] @ _At[e * _r:(e + 1) * _r])
                                 .norm()) for e in range(_E)])
        _losses.append(float(_loss.detach()))
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.4))
    for e in range(_E):
        ax0.plot(range(1, 13), [nr[e] for nr in _norms], marker="o", ms=3,
                 label=f"expert {e}" + (" (no tokens)" if e in (1, 3) else ""))
    ax0.set_xlabel("SGD step")
    ax0.set_ylabel("‖scaling · B_e A_e‖_F")
    ax0.set_title("per-expert LoRA update", fontsize=9)
    ax0.legend(fontsize=8)
    ax1.plot(range(1, 13), _losses, color="tab:purple")
    ax1.set_xlabel("SGD step")
    ax1.set_ylabel("MSE")
    ax1.set_title("toy regression loss", fontsize=9)
    plt.tight_layout()
    plt.show()
    print("update norms after the last step:", [f"{v:.4f}" for v in _norms[-1]])
    print("experts 1 and 3 exactly zero:",
          all(_norms[-1][e] == 0.0 for e in (1, 3)), "| loss", f"{_losses[0]:.4f} -> {_losses[-1]:.4f}")
except NotImplementedError:
    print("(finish Exercise 5 to train the toy adapters)")

# %% [markdown]
# ## Where this goes next
#
# `minimoe.attach_expert_lora(mlp, r, alpha, nf4=True)` puts exactly what you built into a
# `MoEMLP`: the three SwiGLU projections become `NF4Experts` (frozen NF4, selective dequant)
# with expert LoRA, fused by default. Lab 11 trains that on MiniGPT-MoE (QLoRA), prints the
# memory table and extrapolates it to Mixtral's shapes.
#
# ### Reflection
#
# 1. The fused kernel recomputes `x·A_eᵀ` once per `N` tile (every program of a row tile
#    does it). How much extra work is that for `N = 4096`, `BLOCK_N = 64`, `r = 16`, and when
#    would precomputing `h = x·A_eᵀ` once (the split path) win instead?
# 2. `BLOCK_R` is at least 16 even for `r = 1`. What fraction of the LoRA `tl.dot` work is
#    padding at `r = 1, 4, 8, 16`, and why is it still cheap next to the base GEMM?
# 3. `dA` and `dB` come from one kernel with swapped roles. Write out which tensor plays
#    `U`, `V`, `L` for each and why `dA` is written through transposed strides.
# 4. With NF4 experts, what is the peak float memory of one MoE layer's forward with
#    selective dequant versus a full dequantize, for Mixtral-8x7B (`E = 8`, top-2,
#    `K = 4096`, `N = 14336`) when a micro-batch touches all 8 experts — and when would
#    selective dequant not save anything?
# 5. Why must the LoRA slices of the active experts be taken by indexing (autograd) rather
#    than by copying into a new leaf tensor? What would go wrong in the optimizer step?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. Every program `(pid_m, pid_n)` recomputes `x · A_eᵀ` over the whole `K`: with
#    `N = 4096` and `BLOCK_N = 64` that is done 64 times per row tile where once would do.
#    Per program the extra `tl.dot` is `BLOCK_M · K · BLOCK_R` against the base's
#    `BLOCK_M · K · BLOCK_N`, so `BLOCK_R / BLOCK_N = 16 / 64 = 25 %` more multiply-adds (12.5 %
#    at `BLOCK_N = 128`), where computing `h` once costs `16 / 4096 ≈ 0.4 %`. The split path
#    pays instead in memory: a second full read of `x` to make `h`, an `[M, r]` tensor written
#    and read back, two more launches. It wins when the layer is compute-bound (large
#    training batches, large `N`); the fused kernel wins when memory or launches dominate
#    (small batches, decode), which is where its single pass over `x` matters.
# 2. With `BLOCK_R = 16` the padded share of the LoRA dots is `(16 - r) / 16`: 94 % at
#    `r = 1`, 75 % at 4, 50 % at 8, 0 at 16; the padded columns are masked loads, so they cost
#    arithmetic, not bytes. That arithmetic is small next to the base GEMM: the `A`-side dot
#    is `BLOCK_R / BLOCK_N` of the base (the 25 % or 12.5 % above, whatever `r`), the `B`-side
#    dot `BLOCK_R / K` of it (0.4 % at `K = 4096`), and the base itself is `K · N`
#    multiply-adds per row against `16 · (K + N)` for the LoRA.
# 3. `dB`: `U = dY` (its columns index `dB`'s rows, `P = N`), `V = X` (`Q = K`), `L = Aᵀ`
#    `[K, r·E]`, which is `A` read with its two strides swapped; the kernel computes
#    `scaling · dY_eᵀ (X_e A_eᵀ)`, exactly `dB_e`. `dA`: `U = X` (`P = K`), `V = dY` (`Q = N`),
#    `L = B` `[N, r·E]`; the kernel computes `scaling · X_eᵀ (dY_e B_e)`, which is `dA_eᵀ`
#    `[K, r]`: the kernel's output always has the expert's `r` columns as its last axis.
#    Writing it through `dA`'s transposed strides (`dA.stride(1), dA.stride(0)`) lands it as
#    `dA` `[r·E, K]` with no transpose copy and one kernel for both gradients.
# 4. One Mixtral `w1` expert is 4096 · 14336 = 58.7 M weights: 117 MB in bf16. A micro-batch
#    that reaches 2 experts dequantizes 235 MB for that projection; one that reaches all 8
#    dequantizes 940 MB, the same as a full dequantize, on top of the 242 MB of NF4+DQ
#    storage (4.127 bits per weight). The notebook's bars show the same proportions,
#    `n / 8` of a full dequantize. Selective dequant stops saving as soon as every expert
#    gets a token: with top-2 of 8 and roughly uniform routing an expert stays empty with
#    probability `0.75^T`, 1 % at `T = 16` and 0.01 % at `T = 32`, so in training it saves
#    nothing and the gain is at decode and in tiny batches, or with many more experts
#    (64 or 128), where a batch leaves more of them idle.
# 5. Indexing keeps `A_c`, `B_c` in the graph of `lora_A`, `lora_B`: autograd scatters their
#    gradients back into the right slices and writes exact zeros into the unused experts'
#    slices, so the toy regression's experts 1 and 3 stay at 0.0000. A copy into a new leaf
#    cuts the graph: `lora_A.grad` stays `None`, and the optimizer skips the whole tensor, so
#    no expert learns. Exact zeros are not free either: AdamW still applies weight decay to
#    the unused slices, and Adam's moments from earlier steps keep moving them (a zero
#    gradient decays `m` and `v` but does not stop the update). Separate per-expert
#    parameters with `None` gradients would be left alone; in one `[r·E, K]` tensor, the
#    unused experts' adapters drift unless the optimizer masks them.
