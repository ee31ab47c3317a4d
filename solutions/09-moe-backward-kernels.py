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
# # Lab 09 — The MoE backward pass: dX, dW and the gate gradients as kernels
#
# In Lab 08 you wrote the forward half of ScatterMoE's dispatch: sort the `T·k` routing slots
# once, then one kernel (`scatter2scatter`) gathers each slot's token, multiplies it by its
# expert's weight and scatters the result, with no padding. Training needs the backward pass
# too, and [ScatterMoE](https://arxiv.org/abs/2403.08245) gets it from very few pieces:
#
# * the **gate gradients** are dot products of each expert output with the output gradient;
# * the **input gradient** `dX` is the forward kernel **again**, with `Wᵀ`, followed by a sum
#   over each token's `k` copies;
# * the **weight gradient** `dW[e] = Σ xᵀ·dy` over the rows routed to expert `e` is one new
#   kernel, `group_bwd_W` (llama.cpp calls the same operation `OUT_PROD_ID`): a grouped outer
#   product, one program per (expert, K tile, N tile), **no atomics**, and exact zeros for an
#   expert that received no token.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `backward_by_hand(x, W, expert_idxs, gates, dout)`: dx, dW, dgates in PyTorch, no autograd | autograd of `reference.linear_loop` |
# | 2 | `group_bwd_W_kernel` + `my_group_bwd_W(DY, X, expert_offsets, E)` | a per-expert loop, `minimoe.group_bwd_W` |
# | 3 | `grouped_dy(dout, ssi, k, gates)` and `input_grad(dYg, W, sei, ssi, k, grouped_in)` | the gated `dY`; `dx` of autograd |
# | 4 | `MyParallelLinear` (an autograd Function) + `my_parallel_linear(...)` | every gradient of `linear_loop`; a whole SwiGLU MoE step against `reference.moe_loop` |
#
# **No GPU needed.** As in Labs 03 and 08, the setup cell sets `TRITON_INTERPRET=1` **before**
# `import triton` when there is no CUDA GPU, and every kernel runs in Triton's interpreter
# (NumPy, one program after another, **float32 only**). The tests use tiny shapes: a few
# dozen tokens, `K` and `N` of 24 or 40. On a GPU the same kernels run compiled.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification —
# an expert without tokens, every token to one expert, `k = 3`, `T = 1`, `E = 1` — and checks
# that your code does not call the `minimoe` backward it rebuilds (the tests switch it off
# while your code runs) and that your wrappers launch your kernels. You may use the forward
# pieces you built in Lab 08, as `minimoe` has them: `flatten_sort_count`, `group` and
# `scatter2scatter`. Each exercise states its specification first; below it, two collapsed
# hints (the idea, then pseudocode) are there when you want them. The whole notebook
# runs in <!-- runtime:09-moe-backward-kernels -->about 9 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import torch.nn.functional as F

from course.notebook.harness import require_triton  # noqa: E402

require_triton("09-moe-backward-kernels")   # no triton (its wheels are Linux-only): say where to run

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
from minimoe import MoEMLP, flatten_sort_count, group, route, scatter2scatter  # noqa: E402
from minimoe.reference import linear_loop, moe_loop  # noqa: E402

INTERPRET, DEVICE = harness.triton_setup()   # one CPU thread, seed 0, and where kernels run

# %% [markdown]
# ## Part A — the backward math
#
# Notation from Lab 08 (and `src/minimoe/kernels.py`): `x` `[T, K]`, `W` `[E, K, N]`,
# `expert_idxs` `[T, k]`, gates `g` `[T, k]`; slot `s = t·k + j`, `M = T·k` slots;
# `flatten_sort_count` gives `sei` (expert of each sorted row), `ssi` (slot of each sorted
# row) and `expert_offsets` (end row of each expert). "Grouped" = sorted order (row `i`),
# "scattered" = slot order (row `s`).
#
# The gated expert linear and its output gradient `dout` `[T, N]`:
#
# $$Y[s] = x[s /\!/ k]\; W[e(s)], \qquad \mathrm{out}[t] = \sum_j g[t,j]\; Y[t k + j].$$
#
# Differentiating each piece (the chain rule, one slot at a time):
#
# * **gates**: $\partial \mathrm{out}[t] / \partial g[t,j] = Y[tk+j]$, so
#   $dg[t,j] = \langle Y[tk+j],\, \mathrm{dout}[t]\rangle$ — the forward must **save `Y`**;
# * **slot outputs**: $dY[tk+j] = g[t,j]\cdot \mathrm{dout}[t]$ — the gate multiplies;
# * **weights**: $dW[e] = \sum_{s:\,e(s)=e} x[s/\!/k]^\top\, dY[s]$ — a sum of outer products
#   over the slots routed to `e`; an expert with no slot gets **exactly zero**;
# * **input**: $dx[t] = \sum_j dY[tk+j]\; W[e(tk+j)]^\top$ — the forward map with `Wᵀ`,
#   then a sum over the token's `k` copies.
#
# In the sorted order of the kernels, `dYg[i] = g[ssi[i]] · dout[ssi[i] // k]` is exactly
# `group(dout, ssi, fan_out=k, coeff=gates)` (Lab 08's `group`), `Xg = group(x, ssi,
# fan_out=k)`, and expert `e` owns the contiguous rows `offsets[e-1] … offsets[e]-1` of both:
# that is why `dW` needs **no atomics** — each expert's rows are one slice, summed by one
# program.
#
# Autograd of the naive loop is the ground truth every test uses. Run it on a tiny case:

# %%
def _loop_grads(x, W, idx, gates, dout):
    """Reference gradients: torch.autograd through reference.linear_loop (float32)."""
    xr, Wr = x.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    gr = None if gates is None else gates.detach().clone().requires_grad_()
    out = linear_loop(xr, Wr, idx, gr)
    out.backward(dout)
    return xr.grad, Wr.grad, None if gr is None else gr.grad


# %% tags=["jupyter-only"]
_g = torch.Generator().manual_seed(0)
_x, _W = torch.randn(3, 4, generator=_g), torch.randn(3, 4, 2, generator=_g)
_idx = torch.tensor([[0, 2], [2, 0], [0, 2]])             # expert 1 gets no token
_gates = torch.rand(3, 2, generator=_g)
_dout = torch.randn(3, 2, generator=_g)
_dx, _dW, _dg = _loop_grads(_x, _W, _idx, _gates, _dout)
print("dgates from autograd:\n", _dg)
print("<Y, dout> by hand   :\n", torch.stack([torch.stack([(_x[t] @ _W[_idx[t, j]]) @ _dout[t]
                                                          for j in range(2)]) for t in range(3)]))
print("dW[1] (expert without tokens):", _dW[1].abs().max().item())

# %% [markdown]
# ### Why not `torch.autograd.gradcheck`?
#
# `gradcheck` compares analytic gradients with finite differences, and needs **float64**
# to make the differences accurate. The Triton interpreter is float32-only (and on a GPU,
# float64 `tl.dot` is not what the kernel would run in training anyway). So this lab checks
# gradients the other way around: in float32, against autograd of the naive loop, with a
# stated tolerance — here `1e-5` relative to the largest entry of each gradient (float32 has
# about 7 significant digits; sums of a few dozen products lose one or two of them). The loop
# itself can be gradchecked in float64, which is what makes it a trustworthy reference:

# %% tags=["jupyter-only"]
_x64 = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
_W64 = torch.randn(3, 3, 2, dtype=torch.float64, requires_grad=True)
_g64 = torch.rand(2, 2, dtype=torch.float64, requires_grad=True)
print("gradcheck of reference.linear_loop in float64:",
      torch.autograd.gradcheck(lambda a, b, c: linear_loop(a, b, torch.tensor([[0, 2], [1, 0]]), c),
                               (_x64, _W64, _g64)))
try:
    scatter2scatter(_x64.detach(), _W64.detach(), *flatten_sort_count(torch.tensor([[0, 2], [1, 0]]), 3)[:2], 2)
except ValueError as err:
    print("the Triton path in float64:", err)

# %% [markdown]
# ## Exercise 1 — the backward by hand, in PyTorch
#
# **Specification.** `backward_by_hand(x, W, expert_idxs, gates, dout)` takes `x` `[T, K]`,
# `W` `[E, K, N]`, `expert_idxs` `[T, k]`, `gates` `[T, k]` and the output gradient `dout`
# `[T, N]` (all float32 but the ids) and returns `(dx, dW, dgates)` with shapes `[T, K]`,
# `[E, K, N]`, `[T, k]`: the gradients of the gated expert linear above, by the four rules of
# Part A. The rules that matter:
#
# * **no autograd**: the tests call it under `torch.no_grad()`, with inputs that do not
#   require gradients; plain PyTorch in slot order is fine, no sorting needed;
# * **the gate goes into `dY`**, so into `dW` and `dx`, but not into `dgates`;
# * **an expert without tokens gets `dW[e]` exactly 0**;
# * **`dx` sums the `k` slots of each token.**
#
# Off-limits: `reference.linear_loop` and everything in `minimoe.parallel_linear` /
# `minimoe.ops` are switched off while the tests run your function.
#
# <details><summary>Hint 1: the idea</summary>
#
# Work per slot, `M = T·k` rows: repeat each token row `k` times so that row `s` is token
# `s // k`, and take each slot's expert from the flattened `expert_idxs`. The forward did not
# save anything for you here, so recompute `Y` first. `dW` is a sum of outer products into
# the rows of each slot's expert: start from zeros and add, which also leaves unused experts
# at exactly zero (`index_add_` does it in one call). Check the hand-worked case in the test
# cell against your reading of the four rules before the random ones.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# xs = x.repeat_interleave(k, 0);  e = expert_idxs.reshape(-1)          # [M, K], [M]
# Y  = xs[s] @ W[e[s]] for every slot s                                  # [M, N]
# dgates = Σ_n Y.view(T, k, N) * dout[:, None, :]                        # [T, k]
# dY = gates.reshape(M, 1) * dout.repeat_interleave(k, 0)               # [M, N]
# dW = zeros_like(W);  dW.index_add_(0, e, outer(xs[s], dY[s]) for every s)
# dx = (dY[s] @ W[e[s]]ᵀ for every s).view(T, k, K).sum(1)               # [T, K]
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "backward_by_hand", "locked": false, "schema_version": 3, "solution": true, "task": false}
def backward_by_hand(x: torch.Tensor, W: torch.Tensor, expert_idxs: torch.Tensor,
                     gates: torch.Tensor, dout: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of out[t] = Σ_j gates[t, j] · x[t] @ W[expert_idxs[t, j]] given dout [T, N]:
    (dx [T, K], dW [E, K, N], dgates [T, k])."""
    ### BEGIN SOLUTION
    T, k = expert_idxs.shape
    K, N = W.shape[1], W.shape[2]
    e = expert_idxs.reshape(-1).long()                                   # [M]
    xs = x.repeat_interleave(k, 0)                                       # [M, K]
    We = W[e]                                                            # [M, K, N]
    Y = torch.einsum("mk,mkn->mn", xs, We)                               # [M, N]
    dgates = (Y.view(T, k, N) * dout.unsqueeze(1)).sum(-1)               # [T, k]
    dY = gates.reshape(-1, 1).to(dout.dtype) * dout.repeat_interleave(k, 0)   # [M, N]
    dW = torch.zeros_like(W).index_add_(0, e, xs.unsqueeze(2) * dY.unsqueeze(1))
    dxs = torch.einsum("mn,mkn->mk", dY, We)                             # [M, K]
    dx = dxs.view(T, k, K).sum(1)                                        # [T, K]
    return dx, dW, dgates.to(gates.dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_backward_by_hand", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# The backward this lab rebuilds, and the loops the tests compare with: each raises if your
# code reaches it (under any name). The forward pieces (flatten_sort_count, group,
# scatter2scatter and their kernels) stay available. Each is named by where it lives, an
# (owner, name) pair of the course packages, and by the object itself (for `allow`).
from course.notebook.forbid import bindings  # noqa: E402

_REFERENCE = [(bindings(t)[0], t) for t in harness.reference("09-moe-backward-kernels").values()]


def _no_reference(*allow):
    """harness.forbid(...) of the references, but for the objects in `allow`."""
    return harness.forbid([where for where, t in _REFERENCE if t not in allow], globals())


def _must_reach(target, call, what):
    """`call()` must fail once `target` (or each of a list of targets) is switched off: your
    code reaches it (a launch of a kernel, a call of a function), under whatever name."""
    with _no_reference():
        harness.must_reach(target if isinstance(target, list) else [target], call, what,
                           globals())


def _problem(T, K, N, E, k, seed=0, **routing):
    """x [T, K], W [E, K, N], expert_idxs [T, k], gates [T, k] (positive), dout [T, N]."""
    return harness.expert_problem(T, K, N, E, k, seed, device=DEVICE, **routing)[:5]


RTOL = 1e-5   # relative to the largest entry of the expected tensor (see Part A)


def _zero_experts(dW, idx, what):
    """Experts that received no token must have exactly-zero gradients."""
    used = torch.bincount(idx.reshape(-1).cpu(), minlength=dW.shape[0]) > 0
    for e in (~used).nonzero().flatten().tolist():
        blk = dW[e].detach().cpu()
        assert torch.equal(blk, torch.zeros_like(blk)), \
            f"{what}: expert {e} received no token, so dW[{e}] must be exactly 0; got max " \
            f"|dW[{e}]| = {float(blk.abs().nan_to_num(1e30).max()):.3g} " \
            f"({'NaN' if blk.isnan().any() else 'garbage'}: allocate with zeros or write zeros)"


def _likely(got, candidates):
    """'\nLikely rule broken: <rule>' for the first {rule: what breaking it computes} entry
    that `got` equals (within RTOL), '' if none does."""
    for rule, value in candidates.items():
        if isinstance(got, torch.Tensor) and got.shape == value.shape and torch.allclose(
                got.detach().float().cpu(), value.float().cpu(), rtol=RTOL,
                atol=RTOL * float(value.abs().max())):
            return f"\nLikely rule broken: {rule}"
    return ""


def _dW_of(xs, dY, e, E):
    """Σ over slots s of outer(xs[s], dY[s]) into expert e[s]'s block: [E, K, N]."""
    return torch.zeros(E, xs.shape[1], dY.shape[1]).index_add_(0, e, xs[:, :, None] * dY[:, None])


def _by_hand_rule(name, got, x, idx, gates, dout, want):
    """The rule a wrong gradient of backward_by_hand most likely broke, in words."""
    T, k = idx.shape
    x, gates, dout, want = x.cpu(), gates.cpu(), dout.cpu(), want.cpu()
    e, dY = idx.reshape(-1).cpu(), gates.reshape(-1, 1) * dout.repeat_interleave(k, 0)
    if name == "dx" and isinstance(got, torch.Tensor) and got.shape == (T * k, x.shape[1]):
        return "\nLikely rule broken: dx sums the k slots of each token ([T, K], not [T·k, K])"
    if name == "dgates":
        return _likely(got, {"dgates[t, j] = <Y[t·k + j], dout[t]>: no gate in it":
                             want * gates})
    if name == "dW":
        return _likely(got, {
            "the gate goes into dY = gate · dout, so into dW":
                _dW_of(x.repeat_interleave(k, 0), dout.repeat_interleave(k, 0), e, len(want)),
            "slot s = t·k + j belongs to token s // k (repeat_interleave)":
                _dW_of(x.repeat(k, 1), dY, e, len(want))})
    return ""


def _check_by_hand(T, K, N, E, k, seed=0, **routing):
    x, W, idx, gates, dout = _problem(T, K, N, E, k, seed, **routing)
    want = _loop_grads(x, W, idx, gates, dout)
    with _no_reference(), torch.no_grad():
        got = backward_by_hand(x, W, idx, gates, dout)
    assert isinstance(got, tuple) and len(got) == 3, \
        f"backward_by_hand must return (dx, dW, dgates), got {type(got).__name__}"
    where = f"backward_by_hand, {harness.describe(x, W, idx)}"
    for name, gt, wt in zip(("dx", "dW", "dgates"), got, want, strict=True):
        try:
            harness.assert_close(gt, wt, f"{where}: {name}")
        except AssertionError as err:
            raise AssertionError(f"{err}{_by_hand_rule(name, gt, x, idx, gates, dout, wt)}") \
                from err
    _zero_experts(got[1], idx, where)


# worked by hand: one token, two experts, W[e] = (e + 1)·I
_x = torch.tensor([[1.0, 2.0]])
_Wh = torch.stack([torch.eye(2), 2 * torch.eye(2), 3 * torch.eye(2)])
_ih, _gh, _dh = torch.tensor([[0, 2]]), torch.tensor([[0.25, 0.75]]), torch.tensor([[1.0, -1.0]])
with _no_reference(), torch.no_grad():
    _dxh, _dWh, _dgh = backward_by_hand(_x, _Wh, _ih, _gh, _dh)
# Y = [x, 3x] = [[1, 2], [3, 6]]: dgates = [<Y0, dout>, <Y1, dout>] = [-1, -3];
# dx = (0.25·1 + 0.75·3)·dout = 2.5·dout
assert torch.allclose(_dgh, torch.tensor([[-1.0, -3.0]])), \
    f"dgates for Y = [[1, 2], [3, 6]], dout = [1, -1]: expected [[-1, -3]], got {_dgh.tolist()}" \
    + _likely(_dgh, {"dgates[t, j] = <Y[t·k + j], dout[t]>: no gate in it":
                     torch.tensor([[-0.25, -2.25]])})
assert _dxh.shape == (1, 2), \
    f"dx for one token: expected shape [T, K] = [1, 2], got {list(_dxh.shape)} (dx sums the " \
    f"k slots of each token)"
assert torch.allclose(_dxh, torch.tensor([[2.5, -2.5]])), \
    f"dx: expected 0.25·W[0]·dout + 0.75·W[2]·dout = [[2.5, -2.5]], got {_dxh.tolist()}" \
    + _likely(_dxh, {"the gate goes into dY = gate · dout, so into dx":
                     torch.tensor([[4.0, -4.0]])})
assert torch.equal(_dWh[1], torch.zeros(2, 2)), f"dW[1] (no token) must be 0, got {_dWh[1]}"
assert torch.allclose(_dWh[2], 0.75 * torch.outer(_x[0], _dh[0])), \
    f"dW[2]: expected 0.75 · outer(x, dout) = {(0.75 * torch.outer(_x[0], _dh[0])).tolist()}, " \
    f"got {_dWh[2].tolist()} (did the gate go into dY?)"
_check_by_hand(7, 24, 40, 4, 2)
_check_by_hand(33, 40, 24, 8, 2, seed=1)
print("backward_by_hand matches autograd of reference.linear_loop (dx, dW, dgates)")

### BEGIN HIDDEN TESTS
# case: k = 3 with an expert that gets no token
_check_by_hand(9, 24, 24, 4, 3, seed=2, skip=2)
# case: a single token (T = 1)
_check_by_hand(1, 40, 24, 4, 2, seed=3)
# case: a single token with k = 3
_check_by_hand(1, 24, 40, 4, 3, seed=4)
# case: a single expert (E = 1, k = 1)
_check_by_hand(7, 24, 24, 1, 1, seed=5)
# case: every token routed to one expert (k = 1)
_check_by_hand(13, 40, 40, 8, 1, seed=6, only=[5])
# case: k = 3 with the first expert unused
_check_by_hand(12, 24, 40, 8, 3, seed=7, skip=0)
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 2 — `group_bwd_W`: the weight gradient as a Triton kernel
#
# In sorted order, expert `e`'s rows are the slice `start = offsets[e-1]` (0 for `e = 0`) to
# `end = offsets[e]` of both the grouped inputs `Xg` `[M, K]` and the grouped output
# gradients `DYg` `[M, N]`, and
#
# $$dW[e] = Xg[\mathrm{start}:\mathrm{end}]^\top \; DYg[\mathrm{start}:\mathrm{end}] \qquad [K, N].$$
#
# **Specification.** `group_bwd_W_kernel` (signature below) is launched on the grid
# `(E, cdiv(K, BLOCK_K), cdiv(N, BLOCK_N))`. Program `(e, pk, pn)` owns the tile
# `dW[e, pk·BLOCK_K : …, pn·BLOCK_N : …]`, writes every element of it that lies inside `K × N`,
# and writes nothing else; nobody else writes that tile. The rules that matter:
#
# * **rows of expert `e` only**: `start = offsets[e-1]` (0 for `e = 0`: the element before
#   `offsets` is not yours to read) to `end = offsets[e]`; the kernel gets no `M`, and the
#   next expert's rows follow directly, so `end` is the bound of every load;
# * **always store**: an expert with no rows still writes its zeros, because the wrapper may
#   hand you uninitialised memory (`torch.empty`); the tests fill `DW` with NaN first;
# * **no atomics** (the tests look for them), a float32 accumulator, and
#   `tl.dot(..., input_precision="ieee")`: on a GPU a float32 dot is otherwise TF32 (10-bit
#   mantissa: errors near `1e-3`, far outside this lab's tolerance); the interpreter ignores
#   the flag;
# * strides for every tensor; block sizes are powers of two `≥ 16` (a GPU's `tl.dot` needs
#   16).
#
# Then `my_group_bwd_W(DY, X, expert_offsets, E, block_m=32, block_k=32, block_n=32)` →
# `[E, K, N]`: raise `ValueError` unless `DY` `[M, N]` and `X` `[M, K]` are 2-D float32 (under
# the interpreter) with the same `M`, and `expert_offsets` is an `[E]` integer tensor that is
# non-decreasing and ends at `M`; make the inputs contiguous (offsets as int64), allocate
# `DW` (either way: your kernel writes every element) and launch **your** kernel (the tests
# check the launch). `minimoe.group_bwd_W` and its kernel are switched off while the tests
# run yours.
#
# <details><summary>Hint 1: the idea</summary>
#
# A program walks its expert's rows in steps of `BLOCK_M` (a loop with runtime bounds
# `range(start, end, BLOCK_M)` is fine in Triton), loads a `[BLOCK_M, BLOCK_K]` block of `X`
# and a `[BLOCK_M, BLOCK_N]` block of `DY` with the rows masked against `end`, and adds
# `xᵀ · dy` to a `[BLOCK_K, BLOCK_N]` accumulator. For `start`, a masked load
# (`mask=e > 0, other=0`) reads nothing when `e = 0`. The store sits after the loop, outside
# any condition on the row count.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# k = pk·BLOCK_K + arange(BLOCK_K);  n = pn·BLOCK_N + arange(BLOCK_N)
# start, end = offsets[e-1] (masked: 0 when e = 0), offsets[e]
# acc = zeros([BLOCK_K, BLOCK_N], float32)
# for m0 in range(start, end, BLOCK_M):          # runtime bounds: fine in a Triton loop
#     rows = m0 + arange(BLOCK_M);  r_mask = rows < end
#     x  = X [rows, k]   (masked r_mask & k < K, other 0)     # [BLOCK_M, BLOCK_K]
#     dy = DY[rows, n]   (masked r_mask & n < N, other 0)     # [BLOCK_M, BLOCK_N]
#     acc += tl.dot(tl.trans(x), dy, input_precision="ieee")
# DW[e, k, n] = acc   (masked k < K and n < N)   # an expert with no rows stores its zeros
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "group_bwd_W", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def group_bwd_W_kernel(
    DY,             # [M, N] output gradient, sorted order
    X,              # [M, K] inputs, sorted order
    DW,             # [E, K, N] weight gradient (every element written)
    offsets,        # [E] int64 expert_offsets (inclusive cumulative counts = end rows)
    K, N,           # sizes
    sdym, sdyn,     # strides of DY
    sxm, sxk,       # strides of X
    swe, swk, swn,  # strides of DW
    BLOCK_M: tl.constexpr,    # rows per reduction step
    BLOCK_K: tl.constexpr,    # rows of dW[e] per program
    BLOCK_N: tl.constexpr,    # columns of dW[e] per program
):
    """DW[e, k, n] = Σ_{rows m of expert e} X[m, k] · DY[m, n] for this program's tile."""
    ### BEGIN SOLUTION
    e = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)          # [BK]
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)          # [BN]
    k_mask = k < K
    n_mask = n < N
    start = tl.load(offsets + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets + e)
    mm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        r_mask = (m0 + mm) < end
        x = tl.load(X + (m0 + mm)[:, None] * sxm + k[None, :] * sxk,
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)   # [BM, BK]
        dy = tl.load(DY + (m0 + mm)[:, None] * sdym + n[None, :] * sdyn,
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BM, BN]
        acc += tl.dot(tl.trans(x.to(tl.float32)), dy.to(tl.float32), input_precision="ieee")
    tl.store(DW + e * swe + k[:, None] * swk + n[None, :] * swn, acc.to(DW.dtype.element_ty),
             mask=k_mask[:, None] & n_mask[None, :])
    ### END SOLUTION


def my_group_bwd_W(DY: torch.Tensor, X: torch.Tensor, expert_offsets: torch.Tensor, E: int,
                   block_m: int = 32, block_k: int = 32, block_n: int = 32) -> torch.Tensor:
    """dW [E, K, N], dW[e] = X[rows of e]ᵀ @ DY[rows of e] (grouped rows), by your kernel."""
    ### BEGIN SOLUTION
    for name, t in (("DY", DY), ("X", X)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor")
        if INTERPRET and t.dtype != torch.float32:
            raise ValueError(f"{name} is {t.dtype}, but the Triton interpreter is float32-only")
    if DY.dtype != X.dtype or DY.shape[0] != X.shape[0]:
        raise ValueError(f"DY {DY.dtype}{tuple(DY.shape)} and X {X.dtype}{tuple(X.shape)} "
                         "must share dtype and rows")
    if not isinstance(E, int) or E < 1:
        raise ValueError(f"E must be a positive int, got {E!r}")
    offs = expert_offsets
    if not isinstance(offs, torch.Tensor) or offs.dtype.is_floating_point \
            or offs.dtype == torch.bool or offs.shape != (E,):
        raise ValueError(f"expert_offsets must be an integer tensor of shape [{E}]")
    M, K, N = X.shape[0], X.shape[1], DY.shape[1]
    offs = offs.long().contiguous()
    if int(offs[-1]) != M or (offs < 0).any() or (offs[1:] < offs[:-1]).any():
        raise ValueError(f"expert_offsets must be non-decreasing end rows ending at M={M}, "
                         f"got {offs.tolist()}")
    DY, X = DY.contiguous(), X.contiguous()
    DW = torch.empty(E, K, N, dtype=X.dtype, device=X.device)
    grid = (E, triton.cdiv(K, block_k), triton.cdiv(N, block_n))
    group_bwd_W_kernel[grid](DY, X, DW, offs, K, N, DY.stride(0), DY.stride(1),
                             X.stride(0), X.stride(1), DW.stride(0), DW.stride(1), DW.stride(2),
                             BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n)
    return DW
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_group_bwd_W_kernel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _where_rows(Xg, DYg, E, idx):
    return (f"M={Xg.shape[0]}, K={Xg.shape[1]}, N={DYg.shape[1]}, E={E}, rows per expert "
            f"{torch.bincount(idx.reshape(-1).cpu(), minlength=E).tolist()}")


def _grouped_problem(T, K, N, E, k, seed=0, **routing):
    """Grouped X [M, K], DY [M, N], offsets [E], and dW by a per-expert loop."""
    x, W, idx, gates, dout = _problem(T, K, N, E, k, seed, **routing)
    sei, ssi, offs = flatten_sort_count(idx, E)
    g = torch.Generator().manual_seed(seed + 7)
    Xg = x[ssi // k]                                                   # [M, K]
    DYg = torch.randn(T * k, N, generator=g).to(DEVICE)                # [M, N]
    want = torch.zeros(E, K, N, device=DEVICE)
    start = 0
    for e, end in enumerate(offs.tolist()):
        for i in range(start, end):
            want[e] += torch.outer(Xg[i], DYg[i])
        start = end
    return Xg, DYg, offs, idx, want


def _launch_bwd_W(T, K, N, E, k, BLOCK_M=16, BLOCK_K=16, BLOCK_N=16, seed=0, guard=False,
                  **routing):
    """Launch group_bwd_W_kernel directly on strided views over NaN-filled buffers. The
    element just before `offsets` always holds M (read it as expert 0's start, and expert 0
    gets no rows); `guard` says so in every message."""
    Xg, DYg, offs, idx, want = _grouped_problem(T, K, N, E, k, seed, **routing)
    M = Xg.shape[0]
    offs = torch.cat([torch.tensor([M], device=DEVICE), offs])[1:]
    xbuf = torch.full((M + BLOCK_M, K + 3), float("nan"), device=DEVICE)
    xbuf[:M, :K] = Xg
    ybuf = torch.full((M + BLOCK_M, N + 5), float("nan"), device=DEVICE)
    ybuf[:M, :N] = DYg
    X, DY = xbuf[:M, :K], ybuf[:M, :N]          # past row M and column K / N: NaN, never read
    wbuf = torch.full((E + 1, K + 2, N + 4), float("nan"), device=DEVICE)
    DW = wbuf[:E, :K, :N]                       # starts as NaN: every element must be written
    grid = (E, triton.cdiv(K, BLOCK_K), triton.cdiv(N, BLOCK_N))
    # the kernel gets the whole buffer (same first element and strides as the view DW), so
    # that a write outside dW[:, :K, :N] shows in wbuf
    with harness.outputs(wbuf):
        group_bwd_W_kernel[grid](DY, X, wbuf, offs, K, N, DY.stride(0), DY.stride(1),
                                 X.stride(0), X.stride(1), DW.stride(0), DW.stride(1),
                                 DW.stride(2), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
                                 BLOCK_N=BLOCK_N)
    where = (f"group_bwd_W_kernel[{grid}], {_where_rows(Xg, DYg, E, idx)}, "
             f"BLOCK_M/K/N = {BLOCK_M}/{BLOCK_K}/{BLOCK_N}")
    if guard or (DW[0].cpu() == 0).all() and (want[0].cpu() != 0).any():
        where += (f" (offsets sits right after the value {M}: expert 0's start must be 0, "
                  "from a masked load of offsets[e - 1], mask=e > 0, other=0)")
    outside = wbuf.clone()
    outside[:E, :K, :N] = float("nan")
    assert outside.isnan().all(), \
        f"{where} wrote outside dW[:, :K, :N]: mask the store with k < K and n < N"
    rows = torch.diff(offs.cpu(), prepend=torch.zeros(1, dtype=offs.dtype))    # [E]
    nan_experts = DW.isnan().flatten(1).any(1).cpu()                            # [E]
    assert not nan_experts.any(), \
        f"{where}: NaN left in dW at {DW.isnan().nonzero()[0].tolist()} — " + (
            "an element was never written: store the accumulator even when the expert has "
            "no rows (its zeros)" if (rows[nan_experts] == 0).all() else
            "a row past `end` was read (NaN in the tests): mask the rows against end")
    harness.assert_close(DW, want, where)
    _zero_experts(DW, idx, where)


harness.assert_no_atomics(group_bwd_W_kernel, "each program owns its dW tile, so no atomics "
                          "are needed (and they make the sum order non-deterministic)")
_launch_bwd_W(7, 24, 40, 4, 2)                       # partial K and N tiles
_launch_bwd_W(33, 40, 24, 8, 2, seed=1)              # rows loop over several BLOCK_M steps
_launch_bwd_W(9, 24, 24, 4, 3, seed=2, skip=2)       # k = 3, expert 2 without rows
_launch_bwd_W(7, 24, 24, 4, 2, seed=12, guard=True)  # offsets[-1] is not expert 0's start
print("group_bwd_W_kernel matches a per-expert loop, writes exact zeros for empty experts, "
      "stays inside dW")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1), several experts without rows
_launch_bwd_W(1, 24, 40, 4, 2, seed=3)
# case: a single expert (E = 1)
_launch_bwd_W(7, 40, 40, 1, 1, seed=4)
# case: every row to one expert
_launch_bwd_W(33, 24, 24, 8, 1, seed=5, only=[3])
# case: the first expert without rows, k = 3
_launch_bwd_W(33, 24, 40, 8, 3, seed=6, skip=0)
# case: the last expert without rows
_launch_bwd_W(33, 40, 24, 4, 2, seed=7, skip=3)
# case: empty experts between used ones
_launch_bwd_W(12, 40, 24, 8, 2, seed=8, only=[0, 2, 7])
# case: blocks of 32
_launch_bwd_W(33, 40, 40, 8, 2, BLOCK_M=32, BLOCK_K=32, BLOCK_N=32, seed=9)
# case: blocks larger than K and N (one tile per expert)
_launch_bwd_W(7, 24, 24, 4, 2, BLOCK_M=64, BLOCK_K=64, BLOCK_N=64, seed=10)
# case: unequal BLOCK_K and BLOCK_N
_launch_bwd_W(20, 24, 40, 4, 2, BLOCK_M=16, BLOCK_K=32, BLOCK_N=16, seed=11)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_my_group_bwd_W", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
_bwd_W_reference = minimoe.group_bwd_W          # bound before it is switched off


def _check_my_bwd_W(T, K, N, E, k, seed=0, reference=False, **routing):
    """my_group_bwd_W against the per-expert loop of _grouped_problem; with `reference`
    (graded runs only: minimoe's version is a stub in the student edition), the loop is first
    checked against minimoe.group_bwd_W."""
    Xg, DYg, offs, idx, want = _grouped_problem(T, K, N, E, k, seed, **routing)
    if reference:
        harness.assert_close(_bwd_W_reference(DYg, Xg, offs, E), want,
                             "minimoe.group_bwd_W against the loop (the reference itself)")
    with _no_reference():
        got = my_group_bwd_W(DYg, Xg, offs, E)
    where = f"my_group_bwd_W, {_where_rows(Xg, DYg, E, idx)}"
    _must_reach(group_bwd_W_kernel, lambda: my_group_bwd_W(DYg, Xg, offs, E),
                f"{where}: group_bwd_W_kernel was not launched")
    harness.assert_close(got, want, where)
    _zero_experts(got, idx, where)


# your kernel first, on the padded buffers of the test above: a mask it lacks there would
# make it read or write past the exact-size tensors of your wrapper and crash the process
_launch_bwd_W(7, 24, 40, 4, 2)
_check_my_bwd_W(7, 24, 40, 4, 2)
_check_my_bwd_W(33, 40, 24, 8, 2, seed=1, skip=5)
# offsets the kernel cannot trust: refused with a ValueError, before any launch
_Xv, _DYv, _offv, _, _ = _grouped_problem(7, 24, 40, 4, 2, seed=13)
for _what, _call in (
        ("expert_offsets that end at M - 1", lambda: my_group_bwd_W(_DYv, _Xv, _offv - 1, 4)),
        ("expert_offsets [7, 3, 10, 14] (not non-decreasing)",
         lambda: my_group_bwd_W(_DYv, _Xv, torch.tensor([7, 3, 10, 14], device=DEVICE), 4))):
    harness.assert_rejects("my_group_bwd_W", [(_what, _call)], lambda _what=_what: harness.forbid(
        [group_bwd_W_kernel], globals(),
        why=f"{_what} must raise ValueError before the launch"))
print("my_group_bwd_W matches a per-expert loop and launches your kernel")

### BEGIN HIDDEN TESTS
# case: a single token and a single expert
_check_my_bwd_W(1, 24, 24, 1, 1, seed=2, reference=True)
# case: k = 3 over three of eight experts
_check_my_bwd_W(13, 40, 40, 8, 3, seed=3, reference=True, only=[1, 6, 7])
# case: a non-contiguous X
_Xg, _DYg, _offs, _idx, _want = _grouped_problem(7, 24, 40, 4, 2, seed=4)
_Xt = _Xg.T.contiguous().T
with _no_reference():
    harness.assert_close(my_group_bwd_W(_DYg, _Xt, _offs, 4), _want, "my_group_bwd_W with a non-contiguous X")
# case: bad inputs (shapes, offsets, dtypes)
_bad_calls = [
    ("DY with other rows", lambda: my_group_bwd_W(_DYg[:-1], _Xg, _offs, 4)),
    ("1-D X", lambda: my_group_bwd_W(_DYg, _Xg[:, 0], _offs, 4)),
    ("offsets of the wrong length", lambda: my_group_bwd_W(_DYg, _Xg, _offs[:-1], 4)),
    ("offsets not ending at M", lambda: my_group_bwd_W(_DYg, _Xg, _offs - 1, 4)),
    ("decreasing offsets", lambda: my_group_bwd_W(_DYg, _Xg, _offs.flip(0), 4)),
    ("float offsets", lambda: my_group_bwd_W(_DYg, _Xg, _offs.float(), 4)),
]
if INTERPRET:
    _bad_calls.append(("float64 under the interpreter",
                       lambda: my_group_bwd_W(_DYg.double(), _Xg.double(), _offs, 4)))
harness.assert_rejects("my_group_bwd_W", _bad_calls, _no_reference)
### END HIDDEN TESTS

# %% [markdown]
# ### Which programs exist, and what each one loops over
#
# The grid of `group_bwd_W` does not depend on the routing: every expert gets its
# `cdiv(K, BLOCK_K) · cdiv(N, BLOCK_N)` programs whether it received 60 rows or none. What
# the routing changes is how many rows each program's loop walks: the busiest expert's
# programs take the longest (on a GPU, that is the tail of the launch), and an empty
# expert's programs run no iteration and only store zeros. The picture takes a skewed
# top-2 routing of 48 tokens over 8 experts and your kernel's tiling for `K = N = 40` with
# blocks of 32 (2 × 2 tiles per expert); the check below it confirms the empty experts' blocks
# came out exactly zero.

# %%
_gs = torch.Generator().manual_seed(5)
_Es, _Ts, _ks, _Ks, _Ns, _B = 8, 48, 2, 40, 40, 32
_pop = torch.tensor([0.30, 0.22, 0.0, 0.18, 0.12, 0.0, 0.10, 0.08])     # experts 2 and 5: none
_choice = torch.multinomial(_pop.expand(_Ts, _Es), _ks, replacement=False, generator=_gs)
_sei_s, _ssi_s, _off_s = flatten_sort_count(_choice, _Es)
_rows = torch.diff(_off_s, prepend=torch.zeros(1, dtype=torch.long))    # rows per expert
_nk, _nn = triton.cdiv(_Ks, _B), triton.cdiv(_Ns, _B)
_map = _rows[:, None].expand(_Es, _nk * _nn).float()                   # [E, programs per e]

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1, 1.2]})
ax0.bar(range(_Es), _rows.tolist(), color=["tab:red" if r == 0 else "tab:blue" for r in _rows])
ax0.set_xlabel("expert")
ax0.set_ylabel("sorted rows (token slots)")
ax0.set_title(f"rows per expert: T={_Ts}, top-{_ks} of {_Es}", fontsize=9)
im = ax1.imshow(_map.T.numpy(), cmap="Blues", aspect="auto")
for e in range(_Es):
    for p in range(_nk * _nn):
        r = int(_rows[e])
        ax1.text(e, p, f"{r} rows\n{triton.cdiv(r, _B)} steps" if r else "0 rows\nstores 0",
                 ha="center", va="center", fontsize=7, color="red" if r == 0 else "black")
ax1.set_xticks(range(_Es), [f"e={e}" for e in range(_Es)])
ax1.set_yticks(range(_nk * _nn), [f"K tile {p // _nn}, N tile {p % _nn}" for p in range(_nk * _nn)])
ax1.set_title(f"program (e, K tile, N tile): grid = ({_Es}, {_nk}, {_nn}), BLOCK_M = {_B}",
              fontsize=9)
plt.colorbar(im, ax=ax1, label="rows looped over")
plt.tight_layout()
plt.show()

_Xs = torch.randn(_Ts * _ks, _Ks, generator=_gs).to(DEVICE)
_DYs = torch.randn(_Ts * _ks, _Ns, generator=_gs).to(DEVICE)
try:
    _dWs = my_group_bwd_W(_DYs, _Xs, _off_s.to(DEVICE), _Es, block_m=_B, block_k=_B, block_n=_B)
    for e in (_rows == 0).nonzero().flatten().tolist():
        print(f"expert {e}: no rows, dW[{e}] exactly zero: {bool((_dWs[e] == 0).all())}")
    print("busiest expert's programs loop", int(_rows.max()), "rows; the reduction depth of "
          "dW is the expert's token count, not M")
except NotImplementedError:
    print("(write my_group_bwd_W in Exercise 2 to run the check)")

# %% [markdown]
# ## Exercise 3 — the gated output gradient and dX through the forward kernel
#
# Two small functions that the autograd Function of Exercise 4 will call.
#
# **Specification.** `grouped_dy(dout, sorted_scattered_idxs, k, gates=None)` → `dYg`
# `[M, N]` in sorted order:
#
# * with gates, `dout` is the gradient of the **mixed** output `[T, N]`, and
#   `dYg[i] = gates[s_i] · dout[s_i // k]` (`s_i = ssi[i]`, `gates` read flat as `[M]`);
# * without gates, `dout` is the gradient of the per-slot output `[M, N]` in **slot order**,
#   and `dYg[i] = dout[s_i]`.
#
# `input_grad(dYg, W, sorted_expert_idxs, sorted_scattered_idxs, k, grouped_in=False)` → `dx`:
# the input of sorted row `i` is multiplied by `W[e_i]` in the forward, so its gradient is
# `dYg[i] @ W[e_i]ᵀ`. Then:
#
# * `grouped_in=False` (the forward read token rows `x[s // k]`): the `k` slots of token `t`
#   (`t·k … t·k + k - 1`) are summed → `[T, K]`;
# * `grouped_in=True` (the forward read sorted rows `x[i]` directly, as MoE's down
#   projection does): one gradient per sorted row → `[M, K]`, no sum.
#
# Both run under `torch.no_grad()` in the tests (no autograd), and the `minimoe` backward is
# switched off; the forward pieces `group` and `scatter2scatter` are yours to use.
#
# <details><summary>Hint 1: the idea</summary>
#
# Lab 08's `group(X, ssi, fan_out, coeff)` does exactly the gathers of `grouped_dy`. For
# `input_grad`, `dYg[i] @ W[e_i]ᵀ` is the forward map with `Wᵀ` in place of `W`: **the
# forward kernel again**, reading the sorted rows of `dYg` (`x_grouped=True`, `k = 1`: each
# sorted row reads its own row) and writing either slot order, where a token's `k` copies are
# consecutive rows, or sorted order. `W.transpose(1, 2)` is a view; `scatter2scatter` makes
# it contiguous (one copy of `W`).
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# grouped_dy: gates None -> group(dout, ssi, fan_out=1)
#             else       -> group(dout, ssi, fan_out=k, coeff=gates)
# input_grad: dXs = scatter2scatter(dYg, W.transpose(1, 2), sei, ssi, 1,
#                                   x_grouped=True, y_grouped=grouped_in)   # [M, K]
#             return dXs if grouped_in else dXs.view(T, k, K).sum(1)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "dx", "locked": false, "schema_version": 3, "solution": true, "task": false}
def grouped_dy(dout: torch.Tensor, sorted_scattered_idxs: torch.Tensor, k: int,
               gates: torch.Tensor | None = None) -> torch.Tensor:
    """dYg [M, N] sorted: gates[s_i] · dout[s_i // k] with gates, dout[s_i] without."""
    ### BEGIN SOLUTION
    if gates is None:
        return group(dout, sorted_scattered_idxs, fan_out=1)
    return group(dout, sorted_scattered_idxs, fan_out=k, coeff=gates)
    ### END SOLUTION


def input_grad(dYg: torch.Tensor, W: torch.Tensor, sorted_expert_idxs: torch.Tensor,
               sorted_scattered_idxs: torch.Tensor, k: int, grouped_in: bool = False
               ) -> torch.Tensor:
    """dx [T, K] (sum over each token's k slots), or [M, K] sorted if grouped_in."""
    ### BEGIN SOLUTION
    dXs = scatter2scatter(dYg, W.transpose(1, 2), sorted_expert_idxs, sorted_scattered_idxs, 1,
                          x_grouped=True, y_grouped=grouped_in)          # [M, K]
    if grouped_in or k == 1:
        return dXs
    return dXs.view(-1, k, dXs.shape[1]).sum(1)                          # [T, K]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_grouped_dy", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_grouped_dy(T, N, E, k, seed=0, gated=True, **routing):
    x, W, idx, gates, dout = _problem(T, 24, N, E, k, seed, **routing)
    sei, ssi, _ = flatten_sort_count(idx, E)
    if gated:
        want = gates.reshape(-1)[ssi, None] * dout[ssi // k]
    else:
        dout = torch.randn(T * k, N, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        gates, want = None, dout[ssi]
    where = f"grouped_dy(gates={'[T, k]' if gated else None}), {harness.describe(x, W, idx)}"
    try:
        with _no_reference():
            got = grouped_dy(dout, ssi, k, gates)
    except ValueError as err:
        raise AssertionError(f"{where}: raised ValueError: {err}" + ("" if gated else (
            "\nWithout gates dout is already per slot [M, N], so each sorted row reads its "
            "own slot (fan_out=1)"))) from err
    hint = "" if not gated else _likely(got, {
        "the gate multiplies dout: dYg[i] = gates[s_i] · dout[s_i // k]": dout[ssi // k]})
    try:
        harness.assert_close(got, want, where + (" — did the gate multiply dout?" if gated else ""))
    except AssertionError as err:
        raise AssertionError(f"{err}{hint}") from err


_check_grouped_dy(7, 40, 4, 2)
_check_grouped_dy(7, 24, 4, 2, seed=1, gated=False)
print("grouped_dy puts gates · dout into sorted order")

### BEGIN HIDDEN TESTS
# case: k = 3 with an expert without tokens
_check_grouped_dy(9, 24, 4, 3, seed=2, skip=1)
# case: a single token (T = 1)
_check_grouped_dy(1, 40, 4, 2, seed=3)
# case: every token to one expert (k = 1)
_check_grouped_dy(13, 40, 8, 1, seed=4, only=[2])
# case: no gates, k = 3
_check_grouped_dy(9, 40, 8, 3, seed=5, gated=False)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_input_grad", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_input_grad(T, K, N, E, k, seed=0, grouped_in=False, **routing):
    x, W, idx, gates, dout = _problem(T, K, N, E, k, seed, **routing)
    sei, ssi, _ = flatten_sort_count(idx, E)
    dYg = gates.reshape(-1)[ssi, None] * dout[ssi // k]                # [M, N] sorted
    if grouped_in:
        # the forward read sorted rows xg [M, K]: out[t] = Σ_j g · xg[i(t, j)] @ W[e]
        xg = x[ssi // k].detach().clone().requires_grad_()
        Yg = torch.einsum("mk,mkn->mn", xg, W[sei])
        Y = torch.empty_like(Yg).index_copy(0, ssi, Yg)
        (gates.unsqueeze(-1) * Y.view(T, k, N)).sum(1).backward(dout)
        want = xg.grad
    else:
        want = _loop_grads(x, W, idx, gates, dout)[0]
    with _no_reference(), torch.no_grad():
        got = input_grad(dYg, W, sei, ssi, k, grouped_in=grouped_in)
    cands = {"grouped_in=True: one gradient per SORTED row i, in sorted order (y_grouped)":
             torch.zeros_like(want).index_copy(0, ssi, want)} if grouped_in else {}
    if K == N:                                     # dYg[i] @ W[e_i], untransposed, fits
        dxs = torch.einsum("mn,mnk->mk", dYg, W[sei])                   # [M, K] sorted
        cands["dx = dYg[i] @ W[e_i]ᵀ: the forward map with W transposed"] = dxs if grouped_in \
            else torch.zeros_like(dxs).index_copy(0, ssi, dxs).view(T, k, K).sum(1)
    try:
        harness.assert_close(got, want, f"input_grad(grouped_in={grouped_in}), "
                             f"{harness.describe(x, W, idx)}"
                             + ("" if grouped_in else " — the k copies of a token must be summed"))
    except AssertionError as err:
        raise AssertionError(f"{err}{_likely(got, cands)}") from err


_check_input_grad(5, 24, 24, 4, 2, seed=7)                  # K = N: W and Wᵀ have one shape
_check_input_grad(7, 24, 40, 4, 2)
_check_input_grad(9, 40, 24, 4, 3, seed=1, skip=2)
_check_input_grad(7, 24, 24, 4, 2, seed=2, grouped_in=True)
print("input_grad matches the dx of autograd (scatter2scatter with Wᵀ, summed over k)")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1)
_check_input_grad(1, 40, 40, 4, 2, seed=3)
# case: a single expert (E = 1, k = 1)
_check_input_grad(7, 24, 40, 1, 1, seed=4)
# case: all tokens on two of eight experts
_check_input_grad(33, 40, 24, 8, 2, seed=5, only=[4, 6])
# case: grouped_in=True with k = 3 and the first expert unused
_check_input_grad(12, 24, 40, 8, 3, seed=6, grouped_in=True, skip=0)
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 4 — the autograd Function
#
# Put the pieces together as `minimoe.parallel_linear` does: a `torch.autograd.Function`
# whose forward runs the Lab 08 kernel and whose backward runs yours.
#
# **Specification.** `MyParallelLinear.forward(ctx, x, W, gates, k, sei, ssi, offsets,
# grouped_in, grouped_out)` computes `Y[yrow(i)] = x[xrow(i)] @ W[sei[i]]` `[M, N]` (the
# forward of Lab 08, with `x_grouped=grouped_in`, `y_grouped=grouped_out`); with `gates`
# (`[T, k]`, only with `grouped_out=False`) it returns `out[t] = Σ_j gates[t, j] ·
# Y[t·k + j]` `[T, N]`, without gates `Y` itself.
#
# `MyParallelLinear.backward(ctx, dout)` returns one gradient per forward input, in order:
# `(dx, dW, dgates, None, None, None, None, None, None)`, with `dgates` `None` when there are
# no gates. The rules that matter:
#
# * `dW` comes from **your** `my_group_bwd_W` (the tests check the call) and has exact zeros
#   for experts without tokens;
# * `dgates` needs the per-slot outputs `Y`: save them in the forward (only with gates);
# * `dout` may arrive non-contiguous.
#
# `my_parallel_linear(x, W, k, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
# gates=None, grouped_in=False, grouped_out=False)` raises `ValueError` if `gates` is given
# together with `grouped_out=True`, and returns `MyParallelLinear.apply(...)`. It has the
# signature of `minimoe.parallel_linear` (without LoRA), so the last test slots it into
# `minimoe.MoEMLP(backend="triton")` in place of the reference and trains a SwiGLU MoE step.
#
# <details><summary>Hint 1: the idea</summary>
#
# The forward is `scatter2scatter` and the gate mix of Lab 08; save `x`, `W`, `gates`, the
# three index tensors and `Y` with `ctx.save_for_backward` (tensors, `None` allowed), and put
# `k` and the two flags on `ctx` directly. The backward chains this lab's pieces: `dgates`
# from `Y` and `dout`, the sorted `dYg` from `grouped_dy` (or `dout` itself when
# `grouped_out`: it is already sorted), the sorted inputs `Xg` (`x` itself when `grouped_in`,
# else `group(x, ssi, fan_out=k)`), then `dW` and `dx`. `ctx.needs_input_grad` says which
# gradients anyone asked for, if you want to skip the others.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# forward:  Y = scatter2scatter(x, W, sei, ssi, k, x_grouped=grouped_in, y_grouped=grouped_out)
#           out = Y if gates is None else (gates[..., None] * Y.view(T, k, N)).sum(1)
#           save x, W, gates, sei, ssi, offsets, (Y if gates else None); ctx.k, flags = ...
# backward: dout = dout.contiguous()
#           if gates: dgates = (Y.view(T, k, N) * dout[:, None, :]).sum(-1)
#                     dYg = grouped_dy(dout, ssi, k, gates)
#           else:     dYg = dout if grouped_out else grouped_dy(dout, ssi, k)
#           Xg = x if grouped_in else group(x, ssi, fan_out=k)
#           dW = my_group_bwd_W(dYg, Xg, offsets, E)
#           dx = input_grad(dYg, W, sei, ssi, k, grouped_in)
#           return dx, dW, dgates, None × 6
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "parallel_linear", "locked": false, "schema_version": 3, "solution": true, "task": false}
class MyParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W, gates, k, sei, ssi, offsets, grouped_in, grouped_out):
        ### BEGIN SOLUTION
        Y = scatter2scatter(x, W, sei, ssi, k, x_grouped=grouped_in, y_grouped=grouped_out)
        if gates is None:
            out = Y
        else:
            T, N = gates.shape[0], Y.shape[1]
            out = (gates.to(Y.dtype).unsqueeze(-1) * Y.view(T, k, N)).sum(1)    # [T, N]
        ctx.save_for_backward(x, W, gates, sei, ssi, offsets, None if gates is None else Y)
        ctx.k, ctx.grouped_in, ctx.grouped_out = k, grouped_in, grouped_out
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, dout):
        ### BEGIN SOLUTION
        x, W, gates, sei, ssi, offsets, Y = ctx.saved_tensors
        k, E = ctx.k, W.shape[0]
        dout = dout.contiguous()
        dgates = None
        if gates is not None:
            T, N = dout.shape
            dgates = (Y.view(T, k, N) * dout.unsqueeze(1)).sum(-1).to(gates.dtype)    # [T, k]
            dYg = grouped_dy(dout, ssi, k, gates)
        elif ctx.grouped_out:
            dYg = dout
        else:
            dYg = grouped_dy(dout, ssi, k)
        Xg = x if ctx.grouped_in else group(x, ssi, fan_out=k)
        dW = my_group_bwd_W(dYg, Xg, offsets, E) if ctx.needs_input_grad[1] else None
        dx = input_grad(dYg, W, sei, ssi, k, ctx.grouped_in) if ctx.needs_input_grad[0] else None
        return dx, dW, dgates, None, None, None, None, None, None
        ### END SOLUTION


def my_parallel_linear(x: torch.Tensor, W: torch.Tensor, k: int,
                       sorted_expert_idxs: torch.Tensor, sorted_scattered_idxs: torch.Tensor,
                       expert_offsets: torch.Tensor, gates: torch.Tensor | None = None,
                       grouped_in: bool = False, grouped_out: bool = False) -> torch.Tensor:
    """The expert linear over the routing slots, differentiable through your kernels."""
    ### BEGIN SOLUTION
    if gates is not None and grouped_out:
        raise ValueError("gates mix each token's k outputs: use grouped_out=False with gates")
    return MyParallelLinear.apply(x, W, gates, k, sorted_expert_idxs, sorted_scattered_idxs,
                                  expert_offsets, grouped_in, grouped_out)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_parallel_linear", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _run_pl(which, x, W, idx, gates, dout, grouped_in=False, grouped_out=False):
    """(output, dx, dW, dgates) of `which`: "yours" (my_parallel_linear) or "torch"
    (minimoe's backend="torch": a stub in the student edition, so only graded runs and the
    Jupyter-only cells below call it)."""
    E, k = W.shape[0], idx.shape[1]
    sei, ssi, offs = flatten_sort_count(idx, E)
    xin = x[ssi // k] if grouped_in else x
    kw = dict(grouped_in=grouped_in, grouped_out=grouped_out)
    xr, Wr = harness.leaf(xin), harness.leaf(W)
    gr = None if gates is None else harness.leaf(gates)
    args = (xr, Wr, k, sei, ssi, offs)
    if which == "torch":
        out = minimoe.parallel_linear_from_indices(*args, gates=gr, **kw, backend="torch")
        out.backward(dout)
    else:
        with _no_reference():
            out = my_parallel_linear(*args, gates=gr, **kw)
        # the backward reaches my_group_bwd_W: it fails while that is switched off
        _must_reach(my_group_bwd_W, lambda: out.backward(dout, retain_graph=True),
                    "the backward of MyParallelLinear did not call my_group_bwd_W")
        with _no_reference():
            out.backward(dout)
    return out.detach(), xr.grad, Wr.grad, None if gr is None else gr.grad


def _ours_and_torch(x, W, idx, gates, dout, grouped_in=False, grouped_out=False):
    """(your output and gradients, minimoe's backend="torch" output and gradients)."""
    return (_run_pl("yours", x, W, idx, gates, dout, grouped_in, grouped_out),
            _run_pl("torch", x, W, idx, gates, dout, grouped_in, grouped_out))


def _check_pl(T, K, N, E, k, seed=0, gated=True, grouped_in=False, grouped_out=False,
              reference=False, **routing):
    """my_parallel_linear against autograd of reference.linear_loop (slot order in and out);
    the sorted layouts (grouped_in / grouped_out, graded runs only) and, with `reference`,
    the slot-order cases too are also run through minimoe's backend="torch"."""
    x, W, idx, gates, dout = _problem(T, K, N, E, k, seed, **routing)
    if not gated:
        dout = torch.randn(T * k, N, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    gates = gates if gated else None
    # the expectations, before your code runs
    if not grouped_in and not grouped_out:              # the naive loop, where it applies
        loop = linear_loop(x, W, idx, gates)
        want_grads = _loop_grads(x, W, idx, gates, dout)
        if reference:
            ref = _run_pl("torch", x, W, idx, gates, dout)
            harness.assert_close(ref[0], loop, "minimoe backend='torch' against the loop (the "
                                 "reference itself)")
    else:
        ref = _run_pl("torch", x, W, idx, gates, dout, grouped_in, grouped_out)
        loop, want_grads = ref[0], ref[1:]
    ungated = {"mix each token's k rows with its gates":
               linear_loop(x, W, idx).view(T, k, N).sum(1)} if gated and not grouped_in else {}
    ours = _run_pl("yours", x, W, idx, gates, dout, grouped_in, grouped_out)
    where = (f"my_parallel_linear(gates={'[T, k]' if gated else None}, grouped_in={grouped_in},"
             f" grouped_out={grouped_out}), {harness.describe(x, W, idx)}")
    try:
        harness.assert_close(ours[0], loop, f"{where}: output")
    except AssertionError as err:
        raise AssertionError(f"{err}{_likely(ours[0], ungated)}") from err
    for name, got, want in zip(("dx", "dW", "dgates"), ours[1:], want_grads, strict=True):
        if want is None:
            assert got is None, f"{where}: {name} should be None (no gates), got a tensor"
        else:
            assert got is not None, \
                f"{where}: no {name} came back (the gate gradient is <Y[t·k + j], dout[t]>)" \
                if name == "dgates" else f"{where}: no {name} came back"
            gated_dg = {"dgates[t, j] = <Y[t·k + j], dout[t]>: no gate in it": want * gates
                        } if name == "dgates" else {}
            try:
                harness.assert_close(got, want, f"{where}: {name}")
            except AssertionError as err:
                raise AssertionError(f"{err}{_likely(got, gated_dg)}") from err
    _zero_experts(ours[2], idx, f"{where}: dW")
    return ours


_check_pl(7, 24, 40, 4, 2)
_check_pl(9, 40, 24, 4, 3, seed=1, skip=2)
_check_pl(7, 24, 24, 4, 2, seed=2, gated=False)
_xv, _Wv, _iv, _gv, _ = _problem(4, 24, 24, 4, 2, seed=14)
harness.assert_rejects("my_parallel_linear", [
    ("gates together with grouped_out=True",
     lambda: my_parallel_linear(_xv, _Wv, 2, *flatten_sort_count(_iv, 4), gates=_gv,
                                grouped_out=True))], _no_reference)
print("my_parallel_linear: output, dx, dW and dgates match autograd of reference.linear_loop")

### BEGIN HIDDEN TESTS
# case: a single token (T = 1)
_check_pl(1, 24, 40, 4, 2, seed=3, reference=True)
# case: a single expert (E = 1)
_check_pl(7, 40, 40, 1, 1, seed=4, reference=True)
# case: all tokens on two of eight experts
_check_pl(33, 24, 24, 8, 2, seed=5, reference=True, only=[1, 6])
# case: k = 3 with the first expert unused
_check_pl(12, 40, 24, 8, 3, seed=6, reference=True, skip=0)
# case: no gates, grouped_out=True
_check_pl(7, 24, 40, 4, 2, seed=7, gated=False, grouped_out=True)
# case: grouped_in=True (the down projection)
_check_pl(7, 40, 24, 4, 2, seed=8, grouped_in=True)
# case: no gates, grouped_in and grouped_out, k = 3
_check_pl(9, 24, 24, 8, 3, seed=9, gated=False, grouped_in=True, grouped_out=True, skip=3)
# case: gates together with grouped_out=True
_xx, _WW, _ii, _gg, _ = _problem(4, 24, 24, 4, 2, seed=10)
_ss = flatten_sort_count(_ii, 4)
try:
    with _no_reference():
        my_parallel_linear(_xx, _WW, 2, *_ss, gates=_gg, grouped_out=True)
except ValueError:
    pass
else:
    raise AssertionError("my_parallel_linear accepted gates with grouped_out=True; expected "
                         "ValueError")
# case: only x requires a gradient
_xr = harness.leaf(_xx)
with _no_reference():
    my_parallel_linear(_xr, _WW, 2, *_ss, gates=_gg).sum().backward()
harness.assert_close(_xr.grad,
                     _loop_grads(_xx, _WW, _ii, _gg, torch.ones(4, 24, device=DEVICE))[0],
                     "my_parallel_linear: dx when W and gates do not require gradients")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_moe_step", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _moe_step(C, Fd, E, k, T, seed=0):
    """One forward/backward of MoEMLP(backend="triton") (its parallel_linear replaced by
    yours) and of reference.moe_loop on the same parameters and routing."""
    torch.manual_seed(seed)
    moe = MoEMLP(C, Fd, E, k, backend="triton").to(DEVICE)
    moe.reset_parameters(std=0.3)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=g).to(DEVICE)
    dout = torch.randn(T, C, generator=g).to(DEVICE)
    xa = harness.leaf(x)
    # minimoe.parallel_linear is yours wherever it is bound, the rest of the backward is off
    with _no_reference(minimoe.dispatch_triton, minimoe.parallel_linear), \
            harness.swap(minimoe.parallel_linear, harness.accept_routing(my_parallel_linear), globals()):
        out = moe(xa)
        out.backward(dout)
    grads = {"x": xa.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    # the loop on copies of the same parameters, routed by the same (float32) router
    ref = {n: harness.leaf(p) for n, p in moe.named_parameters()}
    xb = harness.leaf(x)
    logits = F.linear(xb, ref["router.weight"])
    weights, experts = route(logits, k, renormalize=k > 1)
    assert torch.equal(experts, moe.last_experts), "routing differs between the two runs"
    out_loop = moe_loop(xb, weights, experts, ref["w_gate"], ref["w_up"], ref["w_down"])
    out_loop.backward(dout)
    want = {"x": xb.grad, **{n: p.grad for n, p in ref.items()}}
    where = f"MoEMLP(backend='triton') with my_parallel_linear, C={C}, F={Fd}, E={E}, k={k}, T={T}"
    harness.assert_close(out.detach(), out_loop.detach(), f"{where}: output")
    for name in want:
        harness.assert_close(grads[name], want[name], f"{where}: gradient of {name}")
    for name in ("w_gate", "w_up", "w_down"):
        _zero_experts(grads[name], experts, f"{where}: {name}")
    return grads, want


_moe_step(24, 40, 4, 2, 9)
print("a SwiGLU MoE step through my_parallel_linear matches reference.moe_loop: x, router, "
      "w_gate, w_up, w_down")

### BEGIN HIDDEN TESTS
# case: eight experts, top-2
_moe_step(40, 24, 8, 2, 13, seed=1)
# case: top-1 routing (the Switch gate)
_moe_step(24, 24, 4, 1, 7, seed=2)
# case: k = 3 with few tokens (empty experts)
_moe_step(24, 40, 8, 3, 5, seed=3)
# case: a single expert
_ = _moe_step(40, 40, 1, 1, 3, seed=4)
### END HIDDEN TESTS

# %% [markdown]
# ### How far from the loop, shape by shape
#
# Both your Function and `minimoe`'s `backend="torch"` path (the same sorted order in
# PyTorch, differentiated by autograd) are compared here with autograd of the naive loop. The
# bars are the largest gradient error of each (over dx, dW and dgates), relative to the
# largest entry of that gradient; the dashed line is the tolerance the tests use. Errors near
# `1e-7` are float32 rounding (the sums run in a different order); a missing gate, a missing
# sum over `k` or a garbage `dW` block would show as `1e-1` or more.

# %% tags=["jupyter-only"]
_shapes = [(7, 24, 40, 4, 2), (9, 40, 24, 4, 3), (33, 40, 40, 8, 2), (1, 24, 24, 4, 2),
           (13, 24, 40, 8, 1)]
_errs = {"yours": [], "torch backend": []}
try:
    for _i, (T, K, N, E, k) in enumerate(_shapes):
        x, W, idx, gates, dout = _problem(T, K, N, E, k, seed=50 + _i)
        want = _loop_grads(x, W, idx, gates, dout)
        ours, ref = _ours_and_torch(x, W, idx, gates, dout)
        for key, res in (("yours", ours), ("torch backend", ref)):
            _errs[key].append(max(float((g - w).abs().max() / w.abs().max())
                                  for g, w in zip(res[1:], want, strict=True)))
    fig, ax = plt.subplots(figsize=(9, 3.4))
    _w = 0.38
    for j, (key, color) in enumerate((("yours", "tab:green"), ("torch backend", "tab:gray"))):
        ax.bar([i + (j - 0.5) * _w for i in range(len(_shapes))],
               [max(e, 1e-10) for e in _errs[key]], _w, label=key, color=color)
    ax.axhline(RTOL, ls="--", color="tab:red", label=f"test tolerance {RTOL:g}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(_shapes)), [f"T={s[0]} K={s[1]} N={s[2]}\nE={s[3]} k={s[4]}"
                                        for s in _shapes], fontsize=8)
    ax.set_ylabel("max |grad − loop grad| / max |loop grad|")
    ax.set_title("largest gradient error against autograd of reference.linear_loop (float32)",
                 fontsize=9)
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    for s, a, b in zip(_shapes, _errs["yours"], _errs["torch backend"], strict=True):
        print(f"T,K,N,E,k = {s}: yours {a:.2e}, torch backend {b:.2e}")
except NotImplementedError:
    print("(finish Exercises 2-4 to draw the comparison)")

# %% [markdown]
# ### A word on timing
#
# On this CPU both paths run in the Triton interpreter or in PyTorch, so timings say nothing
# about the kernels. `benchmarks/bench_moe.py` (on an NVIDIA GPU) times forward and
# forward+backward of `parallel_linear` at Mixtral, Qwen3-MoE and OLMoE shapes against the
# sorted PyTorch path and a per-expert loop; its `--tiny` mode is the interpreter smoke test.
# The backward costs about twice the forward (two GEMM-sized kernels, `dX` and `dW`, for one
# in the forward), which is where the `×3` of its fwd+bwd TFLOP/s count comes from.

# %% tags=["jupyter-only"]
_x, _W, _idx, _gates, _dout = _problem(33, 40, 40, 8, 2, seed=60)
_ss = flatten_sort_count(_idx, 8)
try:
    for _name, _fn in (("yours", my_parallel_linear),
                       ("minimoe (triton)", minimoe.parallel_linear_from_indices)):
        _xr, _Wr, _gr = harness.leaf(_x), harness.leaf(_W), harness.leaf(_gates)
        _t0 = time.perf_counter()
        _o = _fn(_xr, _Wr, 2, *_ss, gates=_gr)
        _t1 = time.perf_counter()
        _o.backward(_dout)
        _t2 = time.perf_counter()
        print(f"{_name:>17}: forward {1e3 * (_t1 - _t0):6.1f} ms, backward {1e3 * (_t2 - _t1):6.1f} ms "
              f"({'interpreter: not a kernel timing' if INTERPRET else DEVICE})")
except NotImplementedError:
    print("(finish Exercise 4 to time it)")

# %% [markdown]
# ## Where this goes next
#
# You now have every piece of a trainable MoE layer built from two kernels and a gather.
# Lab 10 puts LoRA on the experts: `A` `[r·E, K]` and `B` `[N, r·E]`, where expert `e` owns
# rows (columns) `e·r:(e+1)·r` — viewed as `[E, K, r]` and `[E, r, N]` weights, their
# gradients are exactly the `dW` and `dX` rules of this lab — and freezes the experts in NF4,
# dequantizing only those that received tokens.
#
# ### Reflection
#
# 1. `group_bwd_W`'s grid has `E · cdiv(K, BLOCK_K) · cdiv(N, BLOCK_N)` programs whatever the
#    routing. What is the longest program's work for the skewed routing above, and how would
#    you split the reduction of a very busy expert over several programs — and what would
#    that cost you (hint: atomics, or a second pass)?
# 2. Why does `dX` not need a new kernel, while `dW` does? Write both as sums over sorted
#    rows and point at the index that is shared by the rows of one output element.
# 3. The forward saves `Y` `[M, N]` for the gate gradients. What would it cost to recompute
#    `Y` in the backward instead, and when would that trade be worth making?
# 4. A `dW` allocated with `torch.empty` works in your kernel because every program stores.
#    Which other implementation of the same sum (for example one with atomics, or one that
#    launches programs only for experts with tokens) would then return garbage, and how?
# 5. `gradcheck` needs float64; the interpreter has only float32. What would a float32
#    finite-difference check of `dW` with a step of `1e-3` give for the error, and why is a
#    comparison with autograd of a loop a better test here?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. The skewed routing gives rows `[23, 25, 0, 23, 9, 0, 11, 5]` per expert, and the grid is
#    `(8, 2, 2)`: 32 programs, each as long as its expert's rows. The four programs of
#    expert 1 (25 rows) finish last, together with those of experts 0 and 3; at `BLOCK_M = 32`
#    each is a single reduction step, while the 8 programs of experts 2 and 5 only store
#    zeros. On a GPU, with thousands of rows on a popular expert, those programs form the
#    tail of the launch. Splitting a busy expert's rows into `P` chunks (split-K over rows)
#    gives `P` partial tiles, which must then be added: with `tl.atomic_add` into a zeroed
#    `dW` (an extra memset, a float32 sum order that changes from run to run, no float16
#    atomics), or into a `[P, K, N]` buffer reduced by a second kernel (`P` times the memory
#    of the tile and a second launch).
# 2. `dX[t] = Σ over the sorted rows i of token t: dY[i] · W[e_i]ᵀ` has the same shape as the
#    forward, `Y[s_i] = x[t_i] · W[e_i]`: each row is a product with its own expert's matrix,
#    so `scatter2scatter` with `Wᵀ` does it and the sum over `k` comes after.
#    `dW[e] = Σ over the rows i with e_i = e: x[t_i]ᵀ · dY[i]` sums over rows that share the
#    **expert index**, a reduction along the sorted dimension into one `[K, N]` tile per
#    expert: a different loop structure (over rows, inside a program that owns the tile),
#    hence a new kernel.
# 3. Saving `Y` costs `M · N` values per expert linear: for Mixtral's `w2` (`N = 4096`, top-2)
#    at 4 096 tokens, 8 192 · 4 096 · 2 B = 64 MiB per layer in bf16, 2 GiB over 32 layers.
#    Recomputing it is one more `scatter2scatter` in the backward, a third more GEMM work for
#    that layer (forward + dX + dW becomes four products instead of three). It pays when
#    activation memory is what limits the batch or the sequence length, as in activation
#    checkpointing; it does not when compute is the bottleneck. Only `dgates` needs `Y`, so
#    without gates nothing is saved at all.
# 4. Any version that does not write every element of `dW`: one that accumulates with
#    `tl.atomic_add` (it adds to whatever `torch.empty` held, so every expert is wrong, not
#    only the empty ones), and one that launches programs only for experts with tokens (the
#    empty experts' blocks keep the old memory: the NaNs of the direct-launch tests, or
#    silent garbage in training). This kernel launches every `(e, K tile, N tile)` program
#    and stores its accumulator unconditionally, so an empty expert writes exact zeros, which
#    the program-map cell confirms for experts 2 and 5.
# 5. In float32 a central difference with `h = 1e-3` on the loss `Σ out · dout` (about 20 in
#    magnitude) carries a rounding error of order `eps · |loss| / h ≈ 1e-7 · 20 / 1e-3`:
#    measured on the `(7, 24, 40, 4, 2)` problem over 200 random entries of `dW`, absolute
#    errors of 3e-4 (median) to 1.3e-3, 1.2e-4 relative to the largest gradient entry, twelve
#    times this lab's tolerance. Such a check cannot tell a small bug from rounding. Autograd
#    of the loop computes the same gradients in float32 with another summation order, and
#    agrees with the kernels to 1.4e-7–2.3e-7 (the chart), while the loop itself passes
#    `gradcheck` in float64: an oracle that is both exact in its math and tight in float32.
