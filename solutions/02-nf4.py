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
# # Lab 02 — NF4, bit for bit with bitsandbytes
#
# QLoRA keeps the frozen base model in **NF4** ("4-bit NormalFloat"): 16 levels placed at the
# quantiles of a normal distribution, one float32 scale per block of 64 weights, two codes per
# byte, and optionally a second, 8-bit quantization of the scales themselves. In this lab you
# rebuild every piece of that format and check it, byte for byte, against
# [bitsandbytes](https://github.com/bitsandbytes-foundation/bitsandbytes), the library that
# QLoRA, PEFT and Transformers use.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `nf4_codebook()`: the 16 levels from normal quantiles | `bitsandbytes.functional.get_4bit_type("nf4")`, bit for bit |
# | 2 | `nf4_indices(w, blocksize)`: blockwise scaling and nearest code | the codes and absmax of `quantize_4bit(..., quant_type="nf4")` |
# | 3 | `pack_nibbles(idx)` / `unpack_nibbles(packed, n)` | the packed bytes of `quantize_4bit` |
# | 4 | `nf4_dequantize(idx, absmax, ...)`: back to floats | `miniquant.dequantize_nf4` (and a bitsandbytes bug you will meet) |
# | 5 | `double_quantize_absmax(absmax)` and `nf4_bits_per_param(...)` | `quantize_nf4(..., double_quant=True)` and `NF4Weight.nbytes` |
#
# "Close enough" is not the goal here. A QLoRA adapter is trained against one exact set of
# dequantized weights; if your quantizer picks another code for one weight in a million, an
# adapter trained with bitsandbytes no longer sees the model it was trained on. So every test
# below compares with `torch.equal`, never with a tolerance.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails. Each exercise
# states its specification first (inputs, outputs, the rules that matter, what is
# off-limits); that is enough to solve it. Below the specification, folded hints go from the
# idea to pseudocode: open them when you want them. Grading runs more (hidden) checks of the
# same specification. The whole notebook runs in <!-- runtime:02-nf4 -->about 8 s (the solution, measured on a 2-core CPU)<!-- /runtime -->,
# and no GPU is needed.

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
import logging
import math

import matplotlib.pyplot as plt
import torch

# bitsandbytes looks for an optional CPU kernel package on import and logs a warning when it is
# absent; nothing in this lab needs it.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import bitsandbytes  # noqa: E402
import bitsandbytes.functional as bnbF  # noqa: E402

import minigpt  # noqa: E402
import miniquant  # noqa: E402
from course.notebook.bridged import in_learner  # noqa: E402
from course.notebook.harness import forbid, randn  # noqa: E402

torch.set_num_threads(1)   # small tensors: one thread is faster than several on a busy CPU
torch.manual_seed(0)
print("torch", torch.__version__, "| bitsandbytes", bitsandbytes.__version__,
      "| threads:", torch.get_num_threads())


# %% [markdown]
# ### The oracle, and one trap in its defaults
#
# `bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type=...)` returns
# `(packed, quant_state)`: the packed codes (`uint8`, shape `[ceil(n/2), 1]`) and a
# `QuantState` holding the per-block `absmax`, the code table, the shape and the dtype.
# **Its `quant_type` defaults to `"fp4"`**, a different 4-bit format. Every call in this lab
# passes `quant_type="nf4"`; forget it and nothing matches, without any error.

# %%
w_demo = randn(2, 64, seed=1)
packed_nf4, state_nf4 = bnbF.quantize_4bit(w_demo, blocksize=64, quant_type="nf4")
packed_fp4, state_fp4 = bnbF.quantize_4bit(w_demo, blocksize=64)          # the default!
print("packed:", tuple(packed_nf4.shape), packed_nf4.dtype, "| absmax:", state_nf4.absmax,
      "| quant_type:", state_nf4.quant_type)
print("default quant_type:", state_fp4.quant_type,
      "| bytes equal to the nf4 ones:", (packed_fp4 == packed_nf4).sum().item(), "of",
      packed_nf4.numel())

# %% [markdown]
# ## Part A — Exercise 1: the NF4 codebook
#
# A block of weights drawn from a normal distribution and divided by its absolute maximum
# lands in $[-1, 1]$, crowded around 0. Evenly spaced levels (int4) waste most of their
# resolution on the sparse tails. NF4 instead puts its levels at **quantiles of the standard
# normal**, so that each level receives about the same share of the weights.
#
# The table is asymmetric: **8 positive levels, 7 negative levels, and an exact 0** (16 in
# all). Keeping an exact zero matters: padding and zero weights must come back as zero.
# (Where does 0.9677083 below come from? It is the mean of $1 - \frac{1}{2\cdot 15}$ and
# $1 - \frac{1}{2\cdot 16}$: it keeps the outermost quantile finite, since $\Phi^{-1}(1) =
# \infty$.)
#
# **Specification.** `nf4_codebook()` takes no argument and returns a new float32 tensor of
# shape `[16]`, sorted ascending, equal **bit for bit** to bitsandbytes' table
# (`create_normal_map(offset=0.9677083)`), which is defined with these roundings:
#
# * probabilities in **float32**: the positive side is `torch.linspace(0.9677083, 0.5, 9)`
#   without its last value (8 probabilities), the negative side
#   `torch.linspace(0.9677083, 0.5, 8)` without its last value (7 probabilities);
# * quantiles $\Phi^{-1}(p)$ in **float64** (the float32 probabilities converted first),
#   computed with **`torch.special.ndtri`**: the positive levels are $\Phi^{-1}(p)$, the
#   negative ones $-\Phi^{-1}(p)$, plus a single $0$;
# * the 16 quantiles **rounded to float32**, sorted, then **divided by their maximum in
#   float32**, so that index 7 is exactly 0 and the ends exactly $-1$ and $1$.
#
# The rule that matters is this order of roundings. The same formula evaluated all in float64
# and rounded once at the end gives a table in which 10 of the 16 values differ from
# bitsandbytes', by up to 6 units in the last place (ulps; the cell after the test prints the
# count and the distance for each recipe). One ulp of a code moves a weight's dequantized
# value, and moves the midpoints that decide which code a weight gets.
#
# Off-limits: `miniquant.nf4_codebook`, `miniquant.NF4_CODE`, bitsandbytes' `get_4bit_type`
# and `create_normal_map`, and a hard-coded table of values. The tests compare you against
# those tables, switch them off while your function runs, and check that it calls
# `torch.special.ndtri` by that name.
#
# <details><summary>Hint 1: the idea</summary>
#
# Treat each dtype in the specification as an instruction, not a suggestion: make the
# `linspace` in float32, convert to float64 only to call `ndtri`, and come back to float32
# before any division. If the test reports a few values a few ulps off, one of your steps
# runs in another precision than the specification says; the table after the test shows what
# each wrong order gives.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# pos = linspace(0.9677083, 0.5, 9) in float32, drop the last      # 8 probabilities
# neg = linspace(0.9677083, 0.5, 8) in float32, drop the last      # 7 probabilities
# q   = concat(ndtri(float64(pos)), [0.0], -ndtri(float64(neg)))   # 16 float64 quantiles
# q   = sort(float32(q))
# return q / max(q)                                                # float32 division
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "nf4_codebook", "locked": false, "schema_version": 3, "solution": true, "task": false}
def nf4_codebook() -> torch.Tensor:
    """The 16 NF4 levels: float32, sorted, index 7 exactly 0, ends exactly -1 and 1."""
    ### BEGIN SOLUTION
    positive = torch.linspace(0.9677083, 0.5, 9, dtype=torch.float32)[:-1]
    negative = torch.linspace(0.9677083, 0.5, 8, dtype=torch.float32)[:-1]
    quantiles = torch.cat([torch.special.ndtri(positive.double()),
                           torch.zeros(1, dtype=torch.float64),
                           -torch.special.ndtri(negative.double())]).float()
    quantiles = quantiles.sort().values
    return quantiles / quantiles.max()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nf4_codebook", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _ulps_apart(a, b):
    """How many float32 steps separate a and b, element by element."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


_bnb_code = bnbF.get_4bit_type("nf4", device="cpu")
got = nf4_codebook()
assert isinstance(got, torch.Tensor), f"expected a tensor, got {type(got).__name__}"
assert got.shape == (16,), f"expected shape (16,), got {tuple(got.shape)} (8 positive " \
    "levels from linspace(0.9677083, 0.5, 9) without its last value, 7 negative levels from " \
    "linspace(0.9677083, 0.5, 8) without its last value, and one 0)"
assert got.dtype == torch.float32, f"expected float32, got {got.dtype}"
assert (got[1:] > got[:-1]).all(), \
    f"the values must be strictly increasing (sorted), got {got.tolist()}"
# the ends within an ulp or two here; exactly -1 and 1 is part of the bit-for-bit check below
assert got[7] == 0 and (got[[0, 15]].abs() - 1).abs().max() < 1e-6, \
    f"index 7 must be exactly 0 and the ends exactly -1 and 1 (the quantiles divided by " \
    f"their maximum); got {got[7]}, {got[0]}, {got[15]}"
_q64 = torch.cat([torch.special.ndtri(torch.linspace(0.9677083, 0.5, 9)[:-1].double()),
                  torch.zeros(1, dtype=torch.float64),
                  -torch.special.ndtri(torch.linspace(0.9677083, 0.5, 8)[:-1].double())]).sort()
assert not torch.equal(got, (_q64.values / _q64.values.max()).float()), \
    "your table divides in float64 and rounds at the end: round the quantiles to float32 " \
    "before the division, then divide in float32"
if not torch.equal(got, _bnb_code):
    _off = (got != _bnb_code).nonzero().flatten().tolist()
    raise AssertionError(
        f"{len(_off)} of 16 values differ from bitsandbytes' table, at indices {_off}; "
        f"distance in float32 ulps: {_ulps_apart(got, _bnb_code)[_off].tolist()}\n"
        f"expected {[f'{v:.10f}' for v in _bnb_code[_off].tolist()]}\n"
        f"got      {[f'{v:.10f}' for v in got[_off].tolist()]}\n"
        "(a few ulps at several indices? check the order of roundings: float32 "
        "probabilities, float64 quantiles, float32 before the division)")
assert torch.equal(got, miniquant.NF4_CODE), "differs from miniquant.NF4_CODE"
# Derived, not copied: the reference tables are poisoned, the functions that return them
# refuse to run, and torch.special.ndtri is watched while nf4_codebook() runs.
# in-process check: nf4_codebook derives the table (calls torch.special.ndtri) with the reference tables poisoned
def _codebook_with_tables_off():
    from unittest import mock as _mock

    import bitsandbytes.functional as _bnbF
    import torch as _torch

    import __main__
    import miniquant as _mq
    from course.notebook import harness

    ns = vars(__main__)
    poison = _torch.zeros(16)
    saved_code = ns.get("CODE")
    try:
        if saved_code is not None:
            ns["CODE"] = poison
        with harness.swap(_mq.NF4_CODE, poison, ns), \
                harness.forbid([(_mq.nf4, "nf4_codebook"), (_bnbF, "get_4bit_type"),
                         (_bnbF, "create_normal_map")],
                        ns, why="nf4_codebook must derive the codebook, not copy it"), \
                _mock.patch.object(_torch.special, "ndtri", wraps=_torch.special.ndtri) as spy:
            fresh = ns["nf4_codebook"]()
    finally:
        if saved_code is not None:
            ns["CODE"] = saved_code
    return fresh, spy.call_count


_fresh, _ndtri_calls = in_learner(_codebook_with_tables_off)
assert torch.equal(_fresh, _bnb_code), \
    f"with the reference tables switched off, nf4_codebook() returned {_fresh.tolist()}"
assert _ndtri_calls > 0, \
    "nf4_codebook() never called torch.special.ndtri: derive the table, do not copy it"
print("nf4_codebook() equals bitsandbytes' NF4 table bit for bit:")
print([f"{v:+.8f}" for v in got.tolist()])

### BEGIN HIDDEN TESTS
# case: the values of the design document
_design = torch.tensor([-1.0, -0.69619280, -0.52507305, -0.39491749, -0.28444138, -0.18477343,
                        -0.09105004, 0.0, 0.07958030, 0.16093020, 0.24611230, 0.33791524,
                        0.44070983, 0.56261700, 0.72295684, 1.0])
torch.testing.assert_close(got, _design, atol=1e-7, rtol=0)
# case: against the all-float64 recipe
_p = torch.linspace(0.9677083, 0.5, 9, dtype=torch.float64)[:-1]
_n = torch.linspace(0.9677083, 0.5, 8, dtype=torch.float64)[:-1]
_q = torch.cat([torch.special.ndtri(_p), torch.zeros(1, dtype=torch.float64),
                -torch.special.ndtri(_n)]).sort().values
_all64 = (_q / _q.max()).float()
assert (_all64 != _bnb_code).sum() == 10, "the float64 variant should differ in 10 places"
assert (got != _all64).sum() == 10, \
    "your table is the all-float64-then-round variant: round the quantiles before dividing"
# case: two calls, the first result modified
_a = nf4_codebook()
_a[3] = 123.0
assert torch.equal(nf4_codebook(), _bnb_code), "modifying the result changed the next call's"
### END HIDDEN TESTS

# %% [markdown]
# ### The order of roundings, measured
#
# Four other ways to evaluate "the same" formula: how many of their 16 values differ from
# bitsandbytes' table, and by how many float32 ulps at most. Only bitsandbytes' own order of
# roundings gives zero.

# %%
def codebook_variant(prob_dtype, quantile_dtype, round_before_divide):
    pos = torch.linspace(0.9677083, 0.5, 9, dtype=prob_dtype)[:-1].to(quantile_dtype)
    neg = torch.linspace(0.9677083, 0.5, 8, dtype=prob_dtype)[:-1].to(quantile_dtype)
    q = torch.cat([torch.special.ndtri(pos), torch.zeros(1, dtype=quantile_dtype),
                   -torch.special.ndtri(neg)]).sort().values
    if round_before_divide:
        q = q.float()
    return (q / q.max()).float()


bnb_code = bnbF.get_4bit_type("nf4", device="cpu")
for label, args in [("float32 probs, float64 quantiles, round, divide (bnb)",
                     (torch.float32, torch.float64, True)),
                    ("all float64, round at the end", (torch.float64, torch.float64, False)),
                    ("all float32", (torch.float32, torch.float32, True)),
                    ("float32 probs, float64 quantiles and division", (torch.float32,
                                                                       torch.float64, False)),
                    ("float64 probs and quantiles, round, divide", (torch.float64,
                                                                   torch.float64, True))]:
    table = codebook_variant(*args)
    ulps = (table.view(torch.int32).long() - bnb_code.view(torch.int32).long()).abs()
    print(f"{label:<55} {(table != bnb_code).sum().item():2d} of 16 values differ, "
          f"by up to {ulps.max().item()} ulps")

# %% [markdown]
# ### What the levels look like
#
# Left: the 16 levels over a histogram of normal samples scaled by $1/\Phi^{-1}(0.9677083)$
# (so that the outermost quantile sits at $\pm 1$), with the decision boundaries (midpoints
# between neighbouring levels) dashed. Right: how often each code is used when blocks of 64
# normal weights are quantized, NF4 against symmetric int4 with one scale per 64 weights
# (`miniquant.quantize_symmetric_per_group`, Lab 01). The more evenly the codes are used, the
# more information each 4 bits carries (the entropy, printed in the legend, is at most 4 bits).

# %%
CODE = miniquant.NF4_CODE          # from here on, the reference table: exercises 2-5 use it

# %% tags=["jupyter-only"]
z = randn(64 * 4096, seed=2)
top = torch.special.ndtri(torch.tensor(0.9677083, dtype=torch.float64)).item()

nf4_codes = miniquant.quantize_nf4(z).codes().long()
int4_codes, _ = miniquant.quantize_symmetric_per_group(z, bits=4, group_size=64)


def usage(codes, n):
    p = torch.bincount(codes, minlength=n).float() / codes.numel()
    return p, -(p[p > 0] * p[p > 0].log2()).sum().item()


p_nf4, h_nf4 = usage(nf4_codes, 16)
p_int4, h_int4 = usage(int4_codes.long() + 7, 15)

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4), layout="constrained")
ax1.hist((z / top).numpy(), bins=200, range=(-1.6, 1.6), density=True, color="0.8",
         label=f"N(0, 1) / {top:.4f}")
for v in CODE.tolist():
    ax1.axvline(v, color="tab:red", lw=1.2)
for m in ((CODE[:-1] + CODE[1:]) / 2).tolist():
    ax1.axvline(m, color="tab:blue", lw=0.8, ls="--")
ax1.plot([], [], color="tab:red", label="NF4 levels")
ax1.plot([], [], color="tab:blue", ls="--", label="midpoints (decision boundaries)")
ax1.set_title("The 16 NF4 levels sit at normal quantiles")
ax1.legend(loc="upper left", fontsize=8)
ax2.bar(torch.arange(16) - 0.2, p_nf4, width=0.4, label=f"NF4 (entropy {h_nf4:.2f} bits)")
ax2.bar(torch.arange(1, 16) + 0.2, p_int4, width=0.4,
        label=f"int4 symmetric (entropy {h_int4:.2f} bits)")
ax2.set_xlabel("code (int4 shifted by +8 to align its zero with NF4's index 7)")
ax2.set_ylabel("share of weights")
ax2.set_title("Code usage on normal weights, blocks of 64")
ax2.legend(fontsize=8)
plt.show()

# %% [markdown]
# (NF4's codes 0 and 15 are used less than the middle ones because, in each block of 64, the
# element holding the absmax always lands exactly on $\pm 1$, and few others get there. Int4
# piles most weights onto its 5 central codes.)
#
# ## Part B — Exercise 2: blockwise scaling and the nearest code
#
# **Specification.** `nf4_indices(w, blocksize=64)` takes a weight `w` of any shape and
# floating dtype (float32, float16, bfloat16; possibly non-contiguous) and returns
# `(idx, absmax)`:
#
# * `idx`: a `uint8` tensor of shape `[n]`, `n = w.numel()`, one code in 0..15 per element in
#   row-major order (not packed yet);
# * `absmax`: a float32 tensor of shape `[ceil(n / blocksize)]`, one scale per block.
#
# Both must equal what bitsandbytes' `quantize_4bit(w, blocksize, quant_type="nf4")` stores
# (its CPU path is our oracle), which follows these rules:
#
# * **Blocks.** The work is in **float32**, on the weight **flattened row-major**: a block is
#   `blocksize` *consecutive* elements of that flat vector, and blocks run across row
#   boundaries. The last block is partial when `blocksize` does not divide `n`.
# * **Full blocks multiply by the reciprocal:** with `absmax = max |x|` over the block, the
#   scaled value is `x * (1 / max(absmax, 1e-38))`. The stored `absmax` is the true one (0
#   for an all-zero block); the floor `1e-38` only keeps the reciprocal finite.
# * **A trailing partial block divides:** with `a = max(max |x|, 1e-38)`, the scaled value is
#   `x / a`, and the floored `a` is what is stored (an all-zero trailing block stores `1e-38`).
#   Multiplying by a reciprocal and dividing differ in the last bit now and then, and that is
#   enough to change a code: the visible tests include such values.
# * **Nearest code, ties to the lower one.** With `CODE` the sorted table (defined above) and
#   its 15 float32 midpoints `(CODE[:-1] + CODE[1:]) / 2`, the code of a scaled value `s` is
#   the number of midpoints **strictly below** `s`. A value exactly on a midpoint takes the
#   lower code; values a hair outside $[-1, 1]$ get code 0 or 15.
#
# Off-limits: `miniquant.quantize_nf4`, the helpers in `miniquant.dynamic` (`scale_blocks`,
# `nearest_code`, `quantize_blockwise_8bit`) and bitsandbytes; the tests switch them off
# while your function runs. You will use the same scaling rule again in Exercise 5, so a
# helper that takes the code table as an argument is welcome.
#
# <details><summary>Hint 1: the idea</summary>
#
# Split the flat vector into its full blocks, which a `reshape(-1, blocksize)` turns into the
# rows of a matrix, and the tail that is left over; scale the two parts by their own rules,
# then concatenate. For the nearest code, compare with the midpoints rather than with the
# codes themselves: `argmin(|s - CODE|)` agrees almost everywhere, but on a value exactly on a
# midpoint the two float32 distances are not always equal, and it picks the upper code for
# some midpoints. `torch.bucketize` against the midpoints does the counting in one line —
# read its documentation to see which side a value equal to a boundary goes with
# `right=False` and with `right=True`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# flat   = float32(w) flattened row-major;  n = numel;  full = n - n % blocksize
# blocks = flat[:full] as rows of blocksize
# absmax = max |blocks| per row                             # stored as is
# scaled = blocks * (1 / max(absmax, 1e-38)) per row
# if full < n:
#     a      = max(max |flat[full:]|, 1e-38)                # stored floored
#     absmax = append a;   scaled = append flat[full:] / a
# mids = (CODE[:-1] + CODE[1:]) / 2
# idx  = bucketize(scaled, mids, right=False) as uint8
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "nf4_indices", "locked": false, "schema_version": 3, "solution": true, "task": false}
def nf4_indices(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes [numel], float32 absmax [ceil(numel / blocksize)]) of w, row-major."""
    ### BEGIN SOLUTION
    flat = w.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).reshape(-1)
    if full < n:
        tail = flat[full:]
        tail_absmax = tail.abs().amax().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail_absmax[None]])
        scaled = torch.cat([scaled, tail / tail_absmax])
    midpoints = (CODE[:-1] + CODE[1:]) / 2
    idx = torch.bucketize(scaled, midpoints)           # right=False: ties go to the lower code
    return idx.to(torch.uint8), absmax
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nf4_indices_match_bnb", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _bnb_indices(w, blocksize):
    """bitsandbytes' codes (unpacked here, high nibble first) and absmax."""
    packed, state = bnbF.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    p = packed.reshape(-1)
    return torch.stack([p >> 4, p & 0xF], dim=1).reshape(-1)[: w.numel()], state.absmax


def _check_indices(w, blocksize=64, what=""):
    where = f"{what}shape {tuple(w.shape)} {w.dtype}, blocksize {blocksize}"
    want_idx, want_absmax = _bnb_indices(w, blocksize)
    flat = w.reshape(-1).float().clone()                # before your call, which gets w
    signed = torch.stack([b.max() for b in flat.split(blocksize)])
    got = nf4_indices(w, blocksize)
    assert isinstance(got, tuple) and len(got) == 2, \
        f"{where}: expected a tuple (idx, absmax), got {type(got).__name__}"
    idx, absmax = got
    n_blocks = -(-w.numel() // blocksize)
    assert isinstance(idx, torch.Tensor) and idx.dtype == torch.uint8 \
        and idx.shape == (w.numel(),), \
        f"{where}: idx should be uint8 of shape ({w.numel()},), got " \
        f"{getattr(idx, 'dtype', type(idx).__name__)} {tuple(getattr(idx, 'shape', ()))}"
    assert isinstance(absmax, torch.Tensor) and absmax.dtype == torch.float32 \
        and absmax.shape == (n_blocks,), \
        f"{where}: absmax should be float32 of shape ({n_blocks},), got " \
        f"{getattr(absmax, 'dtype', type(absmax).__name__)} {tuple(getattr(absmax, 'shape', ()))}" \
        + (" (the work is in float32, whatever w's dtype)"
           if getattr(absmax, "dtype", None) == w.dtype != torch.float32 else "")
    bad = (absmax != want_absmax).nonzero().flatten()
    why = " (that is each block's largest value: the absmax is the largest magnitude, " \
          "max |w|)" if len(bad) and torch.equal(absmax[bad], signed[bad]) else ""
    assert len(bad) == 0, \
        f"{where}: {len(bad)} of {n_blocks} absmax values differ from bitsandbytes'; first at " \
        f"block {bad[0].item()}: expected {want_absmax[bad[0]].item()!r}, got " \
        f"{absmax[bad[0]].item()!r}{why}"
    bad = (idx != want_idx).nonzero().flatten()
    if len(bad):
        i = bad[0].item()
        x = flat[i].item()
        raise AssertionError(
            f"{where}: {len(bad)} of {w.numel()} codes differ from bitsandbytes'; first at flat "
            f"position {i} (block {i // blocksize}, value {x!r}, block absmax "
            f"{want_absmax[i // blocksize].item()!r}): expected code {want_idx[i].item()} "
            f"({CODE[want_idx[i]].item():+.6f}), got {idx[i].item()} "
            f"({CODE[min(int(idx[i]), 15)].item():+.6f})")


# worked by hand: one partial block with absmax 1; 0.5 is below the midpoint 0.5017 of
# codes 12 and 13, 0.3 above the midpoint 0.2920 of codes 10 and 11
_idx, _absmax = nf4_indices(torch.tensor([0.5, -1.0, 0.0, 0.3]))
assert _idx.tolist() == [12, 0, 7, 11] and _absmax.tolist() == [1.0], \
    f"nf4_indices([0.5, -1, 0, 0.3]): expected ([12, 0, 7, 11], [1.0]), " \
    f"got ({_idx.tolist()}, {_absmax.tolist()})"
_check_indices(randn(3, 70, seed=1))                 # rows cross block boundaries; partial end
_check_indices(randn(100, seed=2), blocksize=32)
_check_indices(randn(5, 13, seed=3, dtype=torch.float16))
# Off-limits: the reference and bitsandbytes are switched off while yours runs.
_w = randn(7, 9, seed=6)
_want = _bnb_indices(_w, 32)                        # bitsandbytes' codes and absmax, before
with forbid([(miniquant.nf4, "quantize_nf4"), (miniquant.dynamic, "scale_blocks"),
             (miniquant.dynamic, "nearest_code"), (miniquant.dynamic, "quantize_blockwise_8bit"),
             (bnbF, "quantize_4bit")], globals(), why="nf4_indices must not call it"):
    _got = nf4_indices(_w, 32)
assert torch.equal(_got[0], _want[0]) and torch.equal(_got[1], _want[1]), \
    "with the reference switched off, nf4_indices gave other codes or absmax"
print("nf4_indices agrees with bitsandbytes' codes and absmax on the visible cases")

### BEGIN HIDDEN TESTS
# case: shapes, blocksizes and dtypes (partial blocks, one block, a large block)
for _shape, _bs, _dtype in [((1,), 64, torch.float32), ((63,), 64, torch.float32),
                            ((65,), 64, torch.bfloat16), ((4, 16, 24), 64, torch.float32),
                            ((3, 1001), 256, torch.float32), ((3, 1001), 128, torch.bfloat16),
                            ((2, 96), 64, torch.float16), ((6, 80), 32, torch.float32),
                            ((4096 + 7,), 4096, torch.float32)]:
    _check_indices(randn(*_shape, seed=_bs + len(_shape), dtype=_dtype), _bs, "hidden: ")
# case: huge outliers in some blocks
_w = randn(4096 + 33, seed=4)
_w[[5, 700, 4100]] = torch.tensor([1e4, -1e4, 1e4])
_check_indices(_w, 64, "outliers: ")
# case: a transposed (non-contiguous) weight
_w = randn(40, 24, seed=5).T
_check_indices(_w.contiguous(), 64, "transposed (contiguous copy): ")
_ti, _ta = nf4_indices(_w, 64)
_ri, _ra = nf4_indices(_w.contiguous(), 64)
assert torch.equal(_ti, _ri) and torch.equal(_ta, _ra), \
    "a transposed (non-contiguous) weight gave other codes than its contiguous copy"
### END HIDDEN TESTS

# %% [markdown]
# The three rules that the random tests above rarely exercise get a test of their own: values
# exactly on a midpoint, all-zero blocks, and multiply-versus-divide.

# %% nbgrader={"grade": true, "grade_id": "test_nf4_indices_rules", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Ties. With a power-of-two absmax the scaling is exact, so every value below sits exactly on
# a float32 midpoint of the table, once in a full block and once in a trailing partial block.
_mids = (CODE[:-1] + CODE[1:]) / 2
for _a in (1.0, 0.5):
    _block = torch.cat([torch.tensor([_a]), _mids * _a])                 # 16 values
    _w = torch.cat([_block, torch.zeros(16), _block])                   # 32 full + 16 partial
    _idx, _ = nf4_indices(_w, 32)
    _want = [15] + list(range(15))                                      # the LOWER code
    for _part, _got in (("full block", _idx[:16]), ("partial block", _idx[32:])):
        assert _got.tolist() == _want, \
            f"values exactly on the midpoints (absmax {_a}, {_part}): expected the lower " \
            f"codes {_want}, got {_got.tolist()}"
    _check_indices(_w, 32, f"midpoints, absmax {_a}: ")

# All-zero blocks: a full one stores absmax 0, a trailing partial one stores 1e-38;
# every zero gets code 7.
_w = randn(1000, seed=7)
_w[64:192] = 0
_w[960:] = 0
_idx, _absmax = nf4_indices(_w, 64)
assert _absmax[1] == 0 and _absmax[2] == 0, \
    f"all-zero full blocks should store absmax 0, got {_absmax[1:3].tolist()}"
assert _absmax[-1] == torch.tensor(1e-38), \
    f"an all-zero trailing partial block should store 1e-38, got {_absmax[-1].item()!r}"
assert (_idx[64:192] == 7).all() and (_idx[960:] == 7).all(), \
    f"zeros should get code 7, got {_idx[64:192].unique().tolist()} / {_idx[960:].unique().tolist()}"
_check_indices(_w, 64, "all-zero blocks: ")
_check_indices(torch.zeros(5, 13), 64, "all zeros: ")

# Multiply versus divide. With absmax 7, each of these four values lands on one side of a
# midpoint as x * (1/7) and on the other as x / 7: the same five numbers get other codes in
# a full block (multiply by the reciprocal) and in a trailing partial block (divide).
_xs = torch.tensor([7.0, -3.2199666500091553, -0.31867510080337524, 0.8417867422103882,
                    6.030349254608154])
_w = torch.cat([_xs, torch.zeros(32 - 5), _xs])                         # 32 full + 5 partial
_idx, _ = nf4_indices(_w, 32)
assert _idx[:5].tolist() == [15, 2, 6, 9, 15], \
    f"full block of absmax 7: expected codes [15, 2, 6, 9, 15], got {_idx[:5].tolist()}. " \
    "Rule: a full block is scaled by multiplying with the reciprocal, x * (1 / absmax), as " \
    "bitsandbytes does; x / absmax differs in the last bit here and crosses a midpoint"
assert _idx[32:].tolist() == [15, 3, 7, 8, 14], \
    f"trailing partial block of absmax 7: expected codes [15, 3, 7, 8, 14], got " \
    f"{_idx[32:].tolist()}. Rule: a trailing partial block is scaled by dividing, x / absmax; " \
    "x * (1 / absmax) differs in the last bit here and crosses a midpoint"
print("ties go to the lower code; zero blocks store 0 (full) and 1e-38 (partial); full blocks "
      "multiply by 1/absmax, a partial block divides")

### BEGIN HIDDEN TESTS
# case: multiply versus divide, another absmax
# (with absmax 3, each of these six values lands on one side of a midpoint when multiplied
# by 1/3 and on the other when divided by 3)
_xs = torch.tensor([3.0, -1.83189857006073, -1.019038200378418, -0.41373518109321594,
                    0.11937045305967331, 1.1679376363754272, 1.9283608198165894])
_w = torch.cat([_xs, torch.zeros(32 - 7), _xs])                         # 32 full + 7 partial
_idx, _absmax = nf4_indices(_w, 32)
assert _idx[:7].tolist() == [15, 1, 3, 5, 8, 12, 14], \
    f"full block: expected x * (1/absmax) codes [15, 1, 3, 5, 8, 12, 14], got {_idx[:7].tolist()}"
assert _idx[32:].tolist() == [15, 2, 4, 6, 7, 11, 13], \
    f"partial block: expected x / absmax codes [15, 2, 4, 6, 7, 11, 13], got {_idx[32:].tolist()}"
_check_indices(_w, 32, "multiply vs divide: ")
# case: values exactly on negative midpoints
_w = torch.cat([torch.tensor([-2.0]), -_mids * 2.0])
_check_indices(_w, 32, "negative midpoints: ")
# case: a weight of one element
_check_indices(torch.tensor([0.0]), 64, "a single zero: ")
_check_indices(torch.tensor([-3.5]), 64, "a single negative value: ")
### END HIDDEN TESTS

# %% [markdown]
# ## Part C — Exercise 3: two codes per byte
#
# A code needs 4 bits, so bitsandbytes stores two per byte.
#
# **Specification.**
#
# * `pack_nibbles(idx)`: `idx` a uint8 tensor of `n` codes in 0..15 (flatten it if it is not
#   1-D). Returns a uint8 tensor of shape `[ceil(n / 2)]` in which byte `i` holds element `2i`
#   in the **high** nibble and element `2i + 1` in the **low** nibble:
#   `byte = (idx[2i] << 4) | idx[2i+1]`. An odd `n` is padded with **code 7** (zero) to fill
#   the last byte.
# * `unpack_nibbles(packed, n)`: `packed` uint8 bytes of any shape (bitsandbytes returns
#   `[ceil(n / 2), 1]`); returns the first `n` codes, uint8, shape `[n]`. It inverts
#   `pack_nibbles`.
#
# Off-limits: `miniquant.nf4.pack_nibbles`, `miniquant.nf4.unpack_nibbles`,
# `NF4Weight.codes` and bitsandbytes.
#
# <details><summary>Hint 1: the idea</summary>
#
# No loop is needed: the even-indexed codes (`idx[0::2]`) are the high halves and the
# odd-indexed ones (`idx[1::2]`) the low halves, so one shift and one OR make all the bytes at
# once. Going back, `>> 4` and `& 0xF` give the two halves of every byte; interleave them
# again and cut to `n`. Keep everything uint8 so that `<< 4` cannot spill into a ninth bit.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# pack:   idx = flatten(idx) as uint8;  if n is odd: append 7
#         return (idx[0::2] << 4) | idx[1::2]
# unpack: p = flatten(packed)
#         return stack([p >> 4, p & 0xF], dim=1) flattened, first n
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "nibbles", "locked": false, "schema_version": 3, "solution": true, "task": false}
def pack_nibbles(idx: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n] -> uint8 [ceil(n/2)]: element 2i in the high nibble; odd n padded with 7."""
    ### BEGIN SOLUTION
    idx = idx.reshape(-1).to(torch.uint8)
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_full((1,), 7)])
    return (idx[0::2] << 4) | idx[1::2]
    ### END SOLUTION


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [ceil(n/2)] -> the first n uint8 codes."""
    ### BEGIN SOLUTION
    packed = packed.reshape(-1)
    return torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nibbles", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _as_list(t):
    return t.tolist() if isinstance(t, torch.Tensor) else t


def _swapped(bytes_):
    return [((b & 0xF) << 4) | (b >> 4) for b in bytes_]


for _codes, _bytes in [([1, 2], [0x12]), ([15, 0], [0xF0]), ([1, 2, 3], [0x12, 0x37]),
                       ([0, 15, 7, 7], [0x0F, 0x77])]:
    _got = pack_nibbles(torch.tensor(_codes, dtype=torch.uint8))
    assert isinstance(_got, torch.Tensor) and _got.dtype == torch.uint8, \
        f"pack_nibbles should return a uint8 tensor, got {getattr(_got, 'dtype', type(_got))}"
    _why = (" (the nibbles are swapped: element 2i goes in the high nibble)"
            if _got.tolist() == _swapped(_bytes) else
            " (an odd count is padded with code 7, NF4's zero, not with 0)"
            if _got.tolist() == [*_bytes[:-1], _bytes[-1] & 0xF0] and len(_codes) % 2 else "")
    assert _got.tolist() == _bytes, \
        f"pack_nibbles({_codes}): expected bytes {[hex(b) for b in _bytes]}, " \
        f"got {[hex(b) for b in _as_list(_got)]}{_why}"
    _back = unpack_nibbles(_got, len(_codes))
    _back_list = _as_list(_back)
    _why = "" if not isinstance(_back_list, list) else (
        " (the high nibble of a byte is element 2i: it comes first)"
        if _back_list[:2] == _codes[:2][::-1] != _codes[:2] else
        " (return the first n codes only: the padding is not a code)"
        if len(_back_list) > len(_codes) else "")
    assert isinstance(_back, torch.Tensor) and _back.dtype == torch.uint8 \
        and _back.tolist() == _codes, \
        f"unpack_nibbles({[hex(b) for b in _bytes]}, {len(_codes)}): expected {_codes}, " \
        f"got {_back_list}{_why}"

# bitsandbytes' own codes, packed by you, give bitsandbytes' bytes
_w = randn(3, 71, seed=8)
_packed, _state = bnbF.quantize_4bit(_w, blocksize=64, quant_type="nf4")
_p = _packed.reshape(-1)
_codes = torch.stack([_p >> 4, _p & 0xF], dim=1).reshape(-1)[: _w.numel()]
_mine = pack_nibbles(_codes)
assert torch.equal(_mine, _p), \
    f"packing bitsandbytes' codes of a (3, 71) weight: {(_mine != _p).sum().item()} of " \
    f"{_p.numel()} bytes differ (first: expected {_p[:4].tolist()}, got {_mine[:4].tolist()})"
assert torch.equal(unpack_nibbles(_packed, _w.numel()), _codes), \
    "unpacking bitsandbytes' bytes (shape [ceil(n/2), 1]) did not give their codes"
# Off-limits: the reference and bitsandbytes are switched off while yours runs.
_c = torch.randint(0, 16, (33,), generator=torch.Generator().manual_seed(10), dtype=torch.uint8)
with forbid([(miniquant.nf4, "pack_nibbles"), (miniquant.nf4, "unpack_nibbles"),
             (miniquant.NF4Weight, "codes"), (bnbF, "quantize_4bit")], globals(),
            why="pack_nibbles / unpack_nibbles must not call it"):
    _pk = pack_nibbles(_c)
    _back = unpack_nibbles(_pk, 33)
assert torch.equal(_back, _c) and _pk[-1].item() == (int(_c[32]) << 4) | 7, \
    "with the reference switched off, unpack_nibbles(pack_nibbles(idx), 33) is not idx, or the " \
    "last byte is not the 33rd code padded with 7"
print("pack_nibbles / unpack_nibbles agree with bitsandbytes' byte order")

### BEGIN HIDDEN TESTS
# case: even and odd numbers of codes, against a byte-by-byte loop
_g = torch.Generator().manual_seed(9)
for _n in [1, 2, 3, 4, 5, 17, 64, 127, 1000, 1001]:
    _c = torch.randint(0, 16, (_n,), generator=_g, dtype=torch.uint8)
    _pk = pack_nibbles(_c)
    assert _pk.shape == (-(-_n // 2),), f"n={_n}: expected {(-(-_n // 2),)} bytes, got {tuple(_pk.shape)}"
    _want = [(int(_c[2 * i]) << 4) | (int(_c[2 * i + 1]) if 2 * i + 1 < _n else 7)
             for i in range(-(-_n // 2))]
    assert _pk.tolist() == _want, f"n={_n}: bytes differ from the byte-by-byte loop"
    assert torch.equal(unpack_nibbles(_pk, _n), _c), f"n={_n}: unpack(pack(idx)) != idx"
# case: a single code
assert pack_nibbles(torch.tensor([5], dtype=torch.uint8)).tolist() == [0x57], \
    "a single code 5 should pack to 0x57 (padded with code 7)"
# case: every byte value, and unpacking fewer codes than the bytes hold
_all = torch.arange(256, dtype=torch.int32).to(torch.uint8)
assert unpack_nibbles(_all, 512).tolist() == [v for b in range(256) for v in (b >> 4, b & 15)]
assert unpack_nibbles(_all, 5).tolist() == [0, 0, 0, 1, 0]
### END HIDDEN TESTS

# %% [markdown]
# ### Byte for byte with bitsandbytes
#
# Your exercises 2 and 3 together are a complete NF4 quantizer. Run it on every weight of the
# pretrained MiniGPT (`minigpt.load_base("dense")`, Lab 00) and on awkward random shapes, in
# three dtypes and several blocksizes, and count how many bytes and scales agree with
# bitsandbytes.

# %%
base = minigpt.load_base("dense").eval()
cases = [(name, p.detach(), 64) for name, p in base.named_parameters()]
cases += [(f"randn{shape} {dtype} bs{bs}", randn(*shape, seed=11, dtype=dtype), bs)
          for shape in [(1,), (3,), (65,), (2, 96), (6, 80), (3, 5, 7), (3, 1001)]
          for dtype in (torch.float32, torch.float16, torch.bfloat16)
          for bs in (32, 64, 256)]

n_bytes = n_bytes_equal = n_scales = n_scales_equal = 0
mismatched = []
for name, w, bs in cases:
    idx, absmax = nf4_indices(w, bs)
    mine = pack_nibbles(idx)
    theirs, state = bnbF.quantize_4bit(w, blocksize=bs, quant_type="nf4")
    bytes_equal = (mine == theirs.reshape(-1)).sum().item()
    scales_equal = (absmax == state.absmax).sum().item()
    if bytes_equal < theirs.numel() or scales_equal < state.absmax.numel():
        mismatched.append(name)
    n_bytes += theirs.numel()
    n_bytes_equal += bytes_equal
    n_scales += state.absmax.numel()
    n_scales_equal += scales_equal
print(f"{len(cases)} tensors ({sum(w.numel() for _, w, _ in cases):,d} weights)")
print(f"byte for byte with bitsandbytes: {n_bytes_equal:,d} of {n_bytes:,d} packed bytes equal")
print(f"bit for bit with bitsandbytes:   {n_scales_equal:,d} of {n_scales:,d} absmax values equal")
print("tensors with a difference:", mismatched or "none")

# %% [markdown]
# ## Part D — Exercise 4: dequantization
#
# Going back is one gather and one multiply.
#
# **Specification.** `nf4_dequantize(idx, absmax, blocksize, shape, dtype=torch.float32)`
# takes `idx`, the uint8 codes `[n]` in row-major order, `absmax`, float32
# `[ceil(n / blocksize)]`, the block size, the weight's `shape` (with `n` elements) and a
# dtype. It returns a tensor of that `shape` and `dtype` whose element $i$ (flat, row-major)
# is $\texttt{CODE}[\mathrm{idx}_i] \cdot \mathrm{absmax}_{\lfloor i / \mathrm{blocksize}
# \rfloor}$. The rule: the product is formed **in float32**, and cast to `dtype` only at the
# end (QLoRA computes in bfloat16, but rounds once, after the product).
#
# Off-limits: `miniquant.dequantize_nf4`, `NF4Weight.dequantize`,
# `miniquant.triton_dequantize_nf4`, and bitsandbytes' `dequantize_4bit` (see below why you
# would not want it anyway).
#
# <details><summary>Hint 1: the idea</summary>
#
# Indexing the table with the codes (`CODE[idx.long()]`) gathers all the values at once. Each
# block's scale has to be repeated `blocksize` times to sit beside its elements;
# `repeat_interleave` does that, and the last block may be shorter than `blocksize`, so cut
# the repeated vector to `n`. Casting the two factors to bfloat16 before multiplying rounds
# twice and gives other values now and then.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# values = CODE[idx as long]                                # [n] float32
# scales = repeat each absmax blocksize times, first n      # [n] float32
# return (values * scales) reshaped to shape, then cast to dtype
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "nf4_dequantize", "locked": false, "schema_version": 3, "solution": true, "task": false}
def nf4_dequantize(idx: torch.Tensor, absmax: torch.Tensor, blocksize: int, shape,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """CODE[idx] * absmax of each element's block, float32, reshaped to `shape`, then cast."""
    ### BEGIN SOLUTION
    n = idx.numel()
    values = CODE[idx.reshape(-1).long()]
    scales = absmax.float().repeat_interleave(blocksize)[:n]
    return (values * scales).reshape(shape).to(dtype)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nf4_dequantize", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _loop_dequant(idx, absmax, blocksize, shape, dtype=torch.float32):
    """The expected values, one block at a time: CODE[code] * that block's absmax, a float32
    product, cast to dtype once at the end."""
    flat = idx.reshape(-1).long()
    blocks = [CODE[flat[start:start + blocksize]] * absmax[b]
              for b, start in enumerate(range(0, flat.numel(), blocksize))]
    return torch.cat(blocks).reshape(shape).to(dtype)


def _check_codes_dequant(idx, absmax, blocksize, shape, dtype, where):
    """nf4_dequantize(idx, absmax, ...) against the loop over blocks, value for value."""
    want = _loop_dequant(idx, absmax, blocksize, shape, dtype)     # before your call
    n = idx.numel()
    values = CODE[idx.long()]
    cast_first = values.to(dtype) * absmax.repeat_interleave(blocksize)[:n].to(dtype)
    cycled = (values * absmax.repeat(blocksize)[:n]).to(dtype)
    idx0, absmax0 = idx.clone(), absmax.clone()
    got = nf4_dequantize(idx, absmax, blocksize, shape, dtype)
    assert isinstance(got, torch.Tensor) and got.shape == shape and got.dtype == dtype, \
        f"{where}: expected a {dtype} tensor of shape {tuple(shape)}, got " \
        f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}"
    bad = (got != want).reshape(-1).nonzero().flatten()
    if len(bad):
        i = bad[0].item()
        why = (f" (the factors were cast to {dtype} before the product: form the product in "
               "float32 and cast once, at the end)"
               if torch.equal(got.reshape(-1), cast_first) else
               " (element i takes absmax[i // blocksize], as repeat_interleave gives; repeat "
               "cycles through the blocks)"
               if torch.equal(got.reshape(-1), cycled) else "")
        raise AssertionError(
            f"{where}: {len(bad)} of {n} values differ from CODE[idx] * absmax of each block "
            f"(a loop over blocks); first at flat position {i} (code {idx0[i].item()}, block "
            f"{i // blocksize}, absmax {absmax0[i // blocksize].item()!r}): expected "
            f"{want.reshape(-1)[i].item()!r}, got {got.reshape(-1)[i].item()!r}{why}")


def _check_dequant(w, blocksize=64, what=""):
    """Dequantize bitsandbytes' codes and absmax of w (Exercise 2's oracle)."""
    idx, absmax = _bnb_indices(w, blocksize)
    _check_codes_dequant(idx, absmax, blocksize, w.shape, w.dtype,
                         f"{what}shape {tuple(w.shape)} {w.dtype}, blocksize {blocksize}")


# by hand: codes 15, 0, 7, 12 of one (partial) block with absmax 2
try:
    _got = nf4_dequantize(torch.tensor([15, 0, 7, 12], dtype=torch.uint8), torch.tensor([2.0]),
                          64, (2, 2))
except (RuntimeError, IndexError) as _e:
    raise AssertionError(
        f"nf4_dequantize(4 codes, one absmax, blocksize 64, (2, 2)) failed: {_e}. " + (
            "uint8 indices are read as a boolean mask: index the table with idx.long()"
            if "mask" in str(_e) else
            "The last block may be partial: cut the repeated absmax to the n codes")) from _e
_want = torch.tensor([[2.0, -2.0], [0.0, 2 * CODE[12].item()]])
assert torch.equal(_got, _want), f"expected {_want.tolist()}, got {_got.tolist()}"
_check_dequant(randn(3, 70, seed=12))
_check_dequant(randn(100, seed=13), blocksize=32)
_check_dequant(randn(5, 13, seed=14, dtype=torch.bfloat16))
# Off-limits: the reference and bitsandbytes are switched off while yours runs.
import miniquant.triton_dequant  # noqa: E402  (loaded lazily: its entry point is switched off too)

_idx, _am = _bnb_indices(randn(3, 30, seed=11), 32)
_want = _loop_dequant(_idx, _am, 32, (3, 30))
with forbid([(miniquant.nf4, "dequantize_nf4"), (miniquant.NF4Weight, "dequantize"),
             (miniquant.triton_dequant, "triton_dequantize_nf4"), (bnbF, "dequantize_4bit")],
            globals(),
            why="nf4_dequantize must not call it"):
    _got = nf4_dequantize(_idx, _am, 32, (3, 30))
assert torch.equal(_got, _want), \
    "with the reference switched off, nf4_dequantize gave other values for a (3, 30) weight"
print("nf4_dequantize equals CODE[idx] * absmax, block by block, bit for bit on the visible "
      "cases")

### BEGIN HIDDEN TESTS
# case: shapes, blocksizes and dtypes
for _shape, _bs, _dtype in [((1,), 64, torch.float32), ((2, 96), 64, torch.float16),
                            ((6, 80), 64, torch.bfloat16), ((4, 16, 24), 128, torch.float32),
                            ((3, 1001), 256, torch.float16)]:
    _w = randn(*_shape, seed=_bs + 1, dtype=_dtype)
    _check_dequant(_w, _bs, what="hidden: ")
    _q = miniquant.quantize_nf4(_w, _bs)
    assert torch.equal(nf4_dequantize(_q.codes(), _q.absmax, _bs, _shape, _dtype),
                       miniquant.dequantize_nf4(_q)), \
        f"shape {_shape} {_dtype}, blocksize {_bs}: differs from miniquant.dequantize_nf4"
# case: the absmax of a double-quantized weight
_q = miniquant.quantize_nf4(randn(64 * 300 + 5, seed=15), 64, double_quant=True)
_check_codes_dequant(_q.codes(), _q.absmax, 64, (64 * 300 + 5,), torch.float32,
                     "double quant: shape (19205,) torch.float32, blocksize 64")
assert torch.equal(nf4_dequantize(_q.codes(), _q.absmax, 64, (64 * 300 + 5,)),
                   miniquant.dequantize_nf4(_q)), \
    "double quant: differs from miniquant.dequantize_nf4"
# case: a float32 weight, dequantized to bfloat16
_q = miniquant.quantize_nf4(randn(9, 7, seed=16), 32)
_got = nf4_dequantize(_q.codes(), _q.absmax, 32, (9, 7), torch.bfloat16)
assert torch.equal(_got, miniquant.dequantize_nf4(_q, torch.bfloat16)), \
    "dtype=bfloat16: cast the float32 product at the end, not the factors before"
# case: against an element-by-element loop
_w = randn(3, 30, seed=17)
_q = miniquant.quantize_nf4(_w, 32)
_c, _am = _q.codes(), _q.absmax
_loop = torch.stack([CODE[int(_c[i])] * _am[i // 32] for i in range(_w.numel())]).reshape(3, 30)
assert torch.equal(nf4_dequantize(_c, _am, 32, (3, 30)), _loop), "differs from the element loop"
### END HIDDEN TESTS

# %% [markdown]
# ### A finding: bitsandbytes' CPU `dequantize_4bit` is wrong for some shapes
#
# With bitsandbytes 0.50.2 on CPU, `dequantize_4bit` gives wrong values for **some multi-row
# weights whose row length is not a multiple of the blocksize**, for example `(2, 96)` or
# `(6, 80)` at blocksize 64 — although the packed codes and the absmax that `quantize_4bit`
# produced for the same weight are right (you just checked them byte for byte). Its native
# kernel walks the weight as rows × columns, and for these shapes it does not give each
# element the absmax of its *row-major* block. Odd row lengths never reach that kernel (they
# take a PyTorch fallback, which is right), and row lengths that are a multiple of the
# blocksize hide the mistake because every row then starts a new block.
#
# The cell below quantizes with bitsandbytes, then dequantizes two ways: with their
# `dequantize_4bit`, and with your `nf4_dequantize` applied to **their own** codes and absmax.
# Then it sweeps the row length of a 3-row weight to find which lengths go wrong (measured
# here: exactly the multiples of 16 that are not multiples of the blocksize). The lesson for
# testing: compare a dequantizer with `code[idx] · absmax` computed from the codes, never with
# another implementation's output taken on trust. (If a newer bitsandbytes fixes this, the
# "differ" column drops to 0 everywhere: then the finding is history.)

# %%
def bnb_dequant_errors(w, blocksize=64):
    """(values that differ, max |difference|): their dequantize_4bit vs their codes · absmax."""
    packed, state = bnbF.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    from_their_codes = nf4_dequantize(unpack_nibbles(packed, w.numel()), state.absmax,
                                      blocksize, w.shape)
    theirs = bnbF.dequantize_4bit(packed, state).reshape(w.shape)  # 1-D comes back as [1, n]
    return (theirs != from_their_codes).sum().item(), (theirs - from_their_codes).abs().max().item()


print(f"{'shape':<12}{'values':>8}{'differ':>8}{'max |diff|':>12}")
for shape in [(2, 96), (6, 80), (3, 32), (4, 128), (3, 5, 7), (96,)]:
    differ, gap = bnb_dequant_errors(randn(*shape, seed=7))
    print(f"{str(shape):<12}{math.prod(shape):>8}{differ:>8}{gap:>12.4f}")

wrong = [n for n in range(2, 260, 2) if bnb_dequant_errors(randn(3, n, seed=n))[0]]
print("\nshape (3, n), blocksize 64, n even in 2..258: wrong for n =", wrong)

# %% [markdown]
# ## Part E — Exercise 5: double quantization and the storage bill
#
# At blocksize 64, each block stores one float32 absmax: $32/64 = 0.5$ extra bits per weight,
# on top of the 4 bits of the code. QLoRA's **double quantization** shrinks that overhead by
# quantizing the absmax vector itself, the same blockwise way, with 8 bits. Storage becomes
# one byte per block plus one float32 per 256 blocks plus an offset:
# $8/64 + 32/(64 \cdot 256) \approx 0.127$ bits per weight instead of $0.5$.
#
# **Specification.**
#
# * `double_quantize_absmax(absmax, nested_block=256)` takes the float32 `absmax` of
#   Exercise 2 (`[n_blocks]`) and returns `(codes, scales, offset)`: `codes` uint8
#   `[n_blocks]`, `scales` float32 `[ceil(n_blocks / nested_block)]`, `offset` a float32 0-d
#   tensor, equal to the `absmax_codes`, `absmax_scales` and `absmax_offset` that
#   `miniquant.quantize_nf4(w, double_quant=True)` stores. The rules:
#   * **offset** `= absmax.mean()` in float32 (`torch.mean`); the rest works on the centred
#     `absmax - offset` (the absmax values are all positive; centring them lets a signed
#     8-bit map cover them);
#   * **nested blocks** of `nested_block` consecutive centred values are scaled **exactly as
#     in Exercise 2**: a full block multiplies by `1 / max(block absmax, 1e-38)` and stores
#     its true block absmax, a trailing partial block divides by `max(block absmax, 1e-38)`
#     and stores that floored value;
#   * **codes**: the nearest entry of the signed dynamic map `DYNAMIC_CODE` (given below:
#     256 sorted float32 values in $[-1, 1]$, dense near 0; see `src/miniquant/dynamic.py`),
#     **ties to the lower entry**, as in Exercise 2.
# * `nf4_bits_per_param(numel, blocksize=64, double_quant=False, nested_block=256)` returns,
#   as a Python float, the exact storage of an NF4 weight of `numel` elements in bits per
#   weight, `8 * bytes / numel`, counting the bytes as `NF4Weight.nbytes` does:
#   `ceil(numel / 2)` bytes of packed codes, plus either 4 bytes per block, or (with double
#   quantization) 1 byte per block, 4 bytes per nested block and 4 bytes of offset.
#
# Off-limits: `quantize_nf4`, `miniquant.quantize_blockwise_8bit` and the helpers of
# `miniquant.dynamic`; `DYNAMIC_CODE` itself is the table you are given.
#
# <details><summary>Hint 1: the idea</summary>
#
# Nothing here is new: it is Exercise 2 again, on a different vector, with a different
# table and a different block size. If you wrote Exercise 2 around a helper that takes the
# values, the block size and the code table, `double_quantize_absmax` is the mean, a
# subtraction and one call. Counting storage is integer arithmetic: the number of blocks and
# of nested blocks are ceilings, and the only division is the last one.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# double_quantize_absmax(absmax, nested_block):
#     offset  = mean(float32 absmax)
#     centred = absmax - offset
#     codes, scales = the Exercise 2 scaling of centred, blocks of nested_block,
#                     nearest entry of DYNAMIC_CODE (midpoints, ties low)
#     return uint8 codes, float32 scales, offset
#
# nf4_bits_per_param(numel, blocksize, double_quant, nested_block):
#     n_blocks = ceil(numel / blocksize);  bytes = ceil(numel / 2)
#     bytes   += n_blocks + 4 * ceil(n_blocks / nested_block) + 4   if double_quant
#                else 4 * n_blocks
#     return 8 * bytes / numel
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "double_quant", "locked": false, "schema_version": 3, "solution": true, "task": false}
DYNAMIC_CODE = miniquant.DYNAMIC_CODE


def double_quantize_absmax(absmax: torch.Tensor, nested_block: int = 256
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 codes [n], float32 scales [ceil(n / nested_block)], float32 0-d offset)."""
    ### BEGIN SOLUTION
    absmax = absmax.reshape(-1).float()
    offset = absmax.mean()
    centred = absmax - offset
    n = centred.numel()
    full = n - n % nested_block
    blocks = centred[:full].reshape(-1, nested_block)
    scales = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / scales.clamp(min=1e-38))[:, None]).reshape(-1)
    if full < n:
        tail = centred[full:]
        tail_scale = tail.abs().amax().clamp(min=1e-38)
        scales = torch.cat([scales, tail_scale[None]])
        scaled = torch.cat([scaled, tail / tail_scale])
    midpoints = (DYNAMIC_CODE[:-1] + DYNAMIC_CODE[1:]) / 2
    codes = torch.bucketize(scaled, midpoints).to(torch.uint8)
    return codes, scales, offset
    ### END SOLUTION


def nf4_bits_per_param(numel: int, blocksize: int = 64, double_quant: bool = False,
                       nested_block: int = 256) -> float:
    """Bits of storage per weight of an NF4 weight with `numel` elements."""
    ### BEGIN SOLUTION
    n_blocks = -(-numel // blocksize)
    nbytes = -(-numel // 2)
    if double_quant:
        nbytes += n_blocks + 4 * -(-n_blocks // nested_block) + 4
    else:
        nbytes += 4 * n_blocks
    return 8 * nbytes / numel
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_double_quantize_absmax", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _loop_dq(absmax, nested_block=256):
    """The expected (codes, scales, offset), by the rules above, one nested block at a time;
    a code is the number of DYNAMIC_CODE's midpoints strictly below the scaled value (ties
    low), counted by comparing with all 255 of them."""
    offset = absmax.float().mean()                          # torch.mean in float32
    centred = absmax.float() - offset
    mids = (DYNAMIC_CODE[:-1] + DYNAMIC_CODE[1:]) / 2
    codes, scales = [], []
    for start in range(0, centred.numel(), nested_block):
        block = centred[start:start + nested_block]
        if len(block) == nested_block:          # full: times the reciprocal, true scale kept
            scales.append(block.abs().max())
            scaled = block * (1 / scales[-1].clamp(min=1e-38))
        else:                                   # trailing partial: divided, floor kept
            scales.append(block.abs().max().clamp(min=1e-38))
            scaled = block / scales[-1]
        codes.append((mids[None, :] < scaled[:, None]).sum(dim=1))
    return torch.cat(codes).to(torch.uint8), torch.stack(scales), offset


def _check_dq(w, blocksize=64, what=""):
    absmax = _bnb_indices(w, blocksize)[1]              # bitsandbytes' absmax of w's blocks
    want_codes, want_scales, want_offset = _loop_dq(absmax)        # before your call
    where = f"{what}{absmax.numel()} blocks"
    got = double_quantize_absmax(absmax)
    assert isinstance(got, tuple) and len(got) == 3, \
        f"{where}: expected a tuple (codes, scales, offset), got {type(got).__name__}"
    codes, scales, offset = got
    for name, t, dtype, numel in (("codes", codes, torch.uint8, want_codes.numel()),
                                  ("scales", scales, torch.float32, want_scales.numel()),
                                  ("offset", offset, torch.float32, 1)):
        assert isinstance(t, torch.Tensor) and t.dtype == dtype and t.numel() == numel, \
            f"{where}: {name} should be {dtype} with {numel} element(s), got " \
            f"{getattr(t, 'dtype', type(t).__name__)} with {getattr(t, 'numel', lambda: '?')()}"
    assert torch.equal(offset.reshape(()), want_offset), \
        f"{where}: offset expected {want_offset.item()!r}, got {offset.reshape(()).item()!r}"
    assert torch.equal(scales, want_scales), \
        f"{where}: scales expected {want_scales.tolist()}, got {scales.tolist()}"
    bad = (codes != want_codes).nonzero().flatten()
    assert len(bad) == 0, \
        f"{where}: {len(bad)} of {want_codes.numel()} codes differ from the nearest entries of " \
        f"DYNAMIC_CODE (a loop over nested blocks); first at block {bad[0].item()}: expected " \
        f"{want_codes[bad[0]].item()}, got {codes[bad[0]].item()}"


# by hand: absmax [1, 3] -> offset 2, centred [-1, 1], one partial nested block of scale 1;
# -1 goes to the lowest entry of the map (-0.993, code 0), 1 to the highest (1.0, code 255)
_c, _s, _o = double_quantize_absmax(torch.tensor([1.0, 3.0]))
assert _c.tolist() == [0, 255] and _s.tolist() == [1.0] and float(_o) == 2.0, \
    f"double_quantize_absmax([1, 3]): expected ([0, 255], [1.0], 2.0), " \
    f"got ({_c.tolist()}, {_s.tolist()}, {float(_o)})" + (
        " (scale 3 is the largest absmax itself: subtract the offset first and scale the "
        "centred values)" if _s.tolist() == [3.0] else "")
# The offset is the float32 torch.mean; for this vector a float64 mean rounded to float32
# lands one ulp away (0.81464726 instead of 0.81464720).
_am = randn(1000, seed=30).abs()
_c, _s, _o = double_quantize_absmax(_am)
assert torch.equal(_o.reshape(()), _am.mean()), \
    f"offset: expected {_am.mean().item()!r} (absmax.mean() in float32), got " \
    f"{_o.reshape(()).item()!r}. Rule: the offset is the float32 torch.mean of absmax; a " \
    "float64 mean or another summation order moves it by an ulp, and a few codes with it"

# Ties first (the scaling checks below rely on them): centred [16, 7, -16, -7, 0, ...] with
# scale 16 puts 7/16 = 0.4375 exactly on the midpoint between the map's entries 214 and 215,
# and -0.4375 between 39 and 40.
_v = torch.full((256,), 100.0)
_v[:4] += torch.tensor([16.0, 7.0, -16.0, -7.0])
for _part, _vv in (("full", _v), ("partial", _v[:255])):
    _c, _, _ = double_quantize_absmax(_vv)
    assert _c[:4].tolist() == [255, 214, 0, 39], \
        f"{_part} nested block, values exactly on midpoints of DYNAMIC_CODE: expected the " \
        f"lower entries [255, 214, 0, 39], got {_c[:4].tolist()}. Rule: ties go to the lower " \
        "code, as in Exercise 2"

# The scaling rule of Exercise 2, once more. Integer absmax values around 2000 with the
# centred values [1000, 775, -1000, -775, 0, ...]: the offset is exactly 2000 and the
# centred values exact, and 775 * (1/1000) and 775 / 1000 fall on either side of a midpoint
# of the dynamic map (codes 239 and 238; the quotient lands exactly on the midpoint and
# goes to the lower code).
_v = torch.full((256,), 2000.0)
_v[:4] += torch.tensor([1000.0, 775.0, -1000.0, -775.0])
_c, _s, _o = double_quantize_absmax(_v)                                  # one full nested block
assert _c[:4].tolist() == [255, 239, 0, 15] and _s.tolist() == [1000.0] and float(_o) == 2000, \
    f"one full nested block: expected codes [255, 239, 0, 15], scales [1000.0], offset 2000; " \
    f"got {_c[:4].tolist()}, {_s.tolist()}, {float(_o)}. Rule: a full nested block is " \
    "scaled by multiplying with the reciprocal, x * (1 / scale), as bitsandbytes does"
_c, _s, _o = double_quantize_absmax(_v[:255])                            # one partial block
assert _c[:4].tolist() == [255, 238, 0, 15] and _s.tolist() == [1000.0] and float(_o) == 2000, \
    f"one partial nested block: expected codes [255, 238, 0, 15], scales [1000.0], offset " \
    f"2000; got {_c[:4].tolist()}, {_s.tolist()}, {float(_o)}. Rule: a trailing partial " \
    "nested block is scaled by dividing, x / scale"

# All absmax equal: the centred values are all zero; a full nested block stores scale 0, a
# trailing partial one the floor 1e-38, and every code is the map's zero (index 127).
_c, _s, _o = double_quantize_absmax(torch.full((260,), 0.25))
assert (_c == 127).all() and _s.tolist() == [0.0, torch.tensor(1e-38).item()] \
    and float(_o) == 0.25, \
    f"260 equal absmax values: expected codes all 127, scales [0.0, 1e-38], offset 0.25; got " \
    f"codes {_c.unique().tolist()}, scales {_s.tolist()}, offset {float(_o)}. Rule: store " \
    "the true scale of a full nested block and the floored one of a partial block"

_check_dq(randn(64 * 300 + 5, seed=18))            # 301 blocks: one full nested block + 45
_check_dq(randn(4, 128, 512, seed=19))             # 4096 blocks: 16 full nested blocks
# Off-limits: the reference and bitsandbytes are switched off while yours runs.
_am = _bnb_indices(randn(64 * 300 + 5, seed=26), 64)[1]
_want = _loop_dq(_am)
with forbid([(miniquant.nf4, "quantize_nf4"), (miniquant.dynamic, "quantize_blockwise_8bit"),
             (miniquant.dynamic, "scale_blocks"), (miniquant.dynamic, "nearest_code"),
             (bnbF, "quantize_blockwise")], globals(),
            why="double_quantize_absmax must not call it"):
    _c, _s, _o = double_quantize_absmax(_am)
assert torch.equal(_c, _want[0]) and torch.equal(_s, _want[1]), \
    "with the reference switched off, double_quantize_absmax gave other codes or scales"
print("double_quantize_absmax follows the rules (a loop over nested blocks) on the visible cases")

### BEGIN HIDDEN TESTS
# case: a single block
_check_dq(randn(10, seed=20), what="hidden: ")
# case: numbers of blocks around the nested block size
_check_dq(randn(64 * 256, seed=21), what="hidden: ")
_check_dq(randn(64 * 513, seed=22), what="hidden: ")
# case: many blocks, other blocksizes, a bfloat16 weight
_check_dq(randn(300, 1001, seed=23), blocksize=32, what="hidden: ")
_check_dq(randn(3, 1001, seed=24, dtype=torch.bfloat16), blocksize=128, what="hidden: ")
# case: blocks that all have the same absmax
_w = torch.ones(64 * 300)
_c, _s, _o = double_quantize_absmax(miniquant.quantize_nf4(_w).absmax)
assert (_c == 127).all() and _s.tolist() == [0.0, torch.tensor(1e-38).item()] and _o == 1, \
    f"constant absmax: expected codes 127, scales [0, 1e-38], offset 1; got {_c.unique()}, " \
    f"{_s.tolist()}, {_o}"
# case: another nested blocksize
_am = randn(1000, seed=25).abs()
_wc, _ws = miniquant.quantize_blockwise_8bit(_am - _am.mean(), 64)
_c, _s, _o = double_quantize_absmax(_am, nested_block=64)
assert torch.equal(_c, _wc) and torch.equal(_s, _ws) and torch.equal(_o.reshape(()), _am.mean()), \
    "nested_block=64 differs from miniquant.quantize_blockwise_8bit(absmax - mean, 64)"
# case: multiply versus divide in a full and a partial nested block
# (integers that sum to exactly 0, so the offset is 0 and the centred values are exact;
# 48936 * (1/65521) and 48936 / 65521 fall on either side of a midpoint of the dynamic map)
_v = torch.zeros(256)
_v[:4] = torch.tensor([65521.0, 48936.0, -57228.0, -57229.0])
_c, _s, _o = double_quantize_absmax(_v)
assert _c[:2].tolist() == [255, 236] and _s.tolist() == [65521.0] and float(_o) == 0, \
    f"full nested block: expected codes [255, 236] (multiply by 1/scale), scale 65521, " \
    f"offset 0; got {_c[:2].tolist()}, {_s.tolist()}, {float(_o)}"
_c, _s, _o = double_quantize_absmax(_v[:255])
assert _c[:2].tolist() == [255, 237] and _s.tolist() == [65521.0], \
    f"partial nested block: expected codes [255, 237] (divide by the scale), scale 65521; " \
    f"got {_c[:2].tolist()}, {_s.tolist()}"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_nf4_bits_per_param", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _bnb_bits(shape, blocksize=64, double_quant=False):
    """8 * bytes / numel of what bitsandbytes stores for an NF4 weight of that shape: the
    packed codes, the absmax (float32, or uint8 codes with double quantization) and, with
    double quantization, the nested float32 scales and the float32 offset."""
    packed, state = bnbF.quantize_4bit(torch.zeros(shape), blocksize=blocksize,
                                       quant_type="nf4", compress_statistics=double_quant)
    held = [packed, state.absmax] + ([state.state2.absmax, state.offset] if double_quant else [])
    return 8 * sum(t.numel() * t.element_size() for t in held) / math.prod(shape)


def _check_bits(shape, blocksize=64, double_quant=False):
    want = _bnb_bits(shape, blocksize, double_quant)
    numel = math.prod(shape)
    got = nf4_bits_per_param(numel, blocksize, double_quant)
    assert isinstance(got, float), f"expected a Python float, got {type(got).__name__}"
    floor_blocks = numel // blocksize
    floor_bytes = -(-numel // 2) + (floor_blocks + 4 * -(-floor_blocks // 256) + 4
                                    if double_quant else 4 * floor_blocks)
    why = " (a partial last block stores a scale too: ceil(numel / blocksize) blocks)" \
        if math.isclose(got, 8 * floor_bytes / numel, rel_tol=1e-12) else ""
    assert math.isclose(got, want, rel_tol=1e-12), \
        f"numel {numel}, blocksize {blocksize}, double_quant {double_quant}: expected " \
        f"{want!r} bits/param (what bitsandbytes stores), got {got!r}{why}"


_n = 64 * 256 * 16
assert nf4_bits_per_param(_n) == 4.5, f"expected exactly 4.5, got {nf4_bits_per_param(_n)}" + (
    " (that is bytes per weight: a byte is 8 bits)" if nf4_bits_per_param(_n) == 4.5 / 8 else "")
_dq = 4 + 8 / 64 + 32 / (64 * 256) + 32 / _n
_got = nf4_bits_per_param(_n, 64, True)
assert math.isclose(_got, _dq, rel_tol=1e-12), \
    f"double quant: expected {_dq} (4 + 8/64 + 32/(64*256) + 32/n), got {_got}" + (
        " (32/n is missing: the float32 offset is stored too)"
        if math.isclose(_got, _dq - 32 / _n, rel_tol=1e-12) else "")
# worked by hand: 1000 weights in blocks of 64 are 500 bytes of codes and 16 blocks (15 full,
# one of 40): 16 float32 absmax (64 bytes, 564 in all), or 16 uint8 codes + one nested
# float32 scale + the float32 offset (24 bytes, 524 in all); with 15 blocks, 560 and 523
for _nested, _bytes, _floor_bytes in [(False, 564, 560), (True, 524, 523)]:
    _got = nf4_bits_per_param(1000, 64, _nested)
    assert math.isclose(_got, 8 * _bytes / 1000, rel_tol=1e-12), \
        f"nf4_bits_per_param(1000, 64, {_nested}): expected 8 * {_bytes} / 1000 = " \
        f"{8 * _bytes / 1000}, got {_got}" + (
            " (a partial last block stores a scale too: ceil(1000 / 64) = 16 blocks)"
            if math.isclose(_got, 8 * _floor_bytes / 1000, rel_tol=1e-12) else "")
for _args in [((1000,), 64, False), ((1000,), 64, True), ((3, 1001), 128, True)]:
    _check_bits(*_args)
print("nf4_bits_per_param matches what bitsandbytes stores on the visible cases")

### BEGIN HIDDEN TESTS
# case: sizes, blocksizes, with and without double quantization
for _shape in [(1,), (3,), (63,), (65,), (64 * 256 + 1,), (5, 7, 9)]:
    for _bs in (32, 64, 4096):
        for _dq in (False, True):
            _check_bits(_shape, _bs, _dq)
# case: another nested blocksize
_got = nf4_bits_per_param(64 * 1000, 64, True, nested_block=128)
_want = 8 * (32 * 1000 + 1000 + 4 * 8 + 4) / (64 * 1000)
assert math.isclose(_got, _want, rel_tol=1e-12), f"nested_block=128: expected {_want}, got {_got}"
### END HIDDEN TESTS

# %% [markdown]
# ### Double quantization against bitsandbytes
#
# Your nested codes, measured against bitsandbytes' `quantize_4bit(...,
# compress_statistics=True)`. The offset and the nested float32 scales agree bit for bit. A
# few 8-bit codes do not, and it is not your bug: bitsandbytes' **CPU** 8-bit quantizer scales
# each value, rounds it to one of 65 536 evenly spaced points of $[-1, 1]$ and looks the code
# up in a precomputed table for *that* point, not for the value itself. A value within half a
# table step of a midpoint between two codes can land on the neighbour; near 0, where the
# dynamic map is denser than the table, a few codes away. Our rule (nearest code, ties low) is
# the one of their PyTorch and CUDA kernels. `miniquant.quantize_nf4(...,
# nested_rounding="bnb_cpu")` rounds through the same table and reproduces every one of their
# CPU codes: the last column below.

# %% tags=["jupyter-only"]
for shape, bs in [((64 * 1000 + 5,), 64), ((4, 128, 512), 64), ((300, 1001), 32)]:
    w = randn(*shape, seed=6)
    _, absmax = nf4_indices(w, bs)
    codes, scales, offset = double_quantize_absmax(absmax)
    _, state = bnbF.quantize_4bit(w, blocksize=bs, quant_type="nf4", compress_statistics=True)
    same = (codes == state.absmax).sum().item()
    lut = miniquant.quantize_nf4(w, bs, double_quant=True, nested_rounding="bnb_cpu")
    print(f"{str(shape):<14} bs {bs:<3} offset equal: {torch.equal(offset, state.offset)}, "
          f"scales equal: {torch.equal(scales, state.state2.absmax)}, "
          f"codes equal: {same} of {codes.numel()} ({same / codes.numel():.2%}), "
          f"with the table rule: {torch.equal(lut.absmax_codes, state.absmax)}")
    # what the nested codes cost in accuracy: the absmax comes back to within ~1 %
    back = DYNAMIC_CODE[codes.long()] * scales.repeat_interleave(256)[: codes.numel()] + offset
    rel = ((back - absmax).abs() / absmax).max().item()
    print(f"{'':<14} absmax recovered from the 8-bit codes: max relative error {rel:.3%}")

# %% [markdown]
# ### The storage bill, measured
#
# `NF4Weight.nbytes` counts the bytes a quantized weight actually holds. Below, a 1024 × 1024
# weight at four blocksizes, with and without double quantization: measured, your formula, and
# the large-weight limit $4 + 32/B$ (plain) or $4 + 8/B + 32/(256 B)$ (double quantized). The
# bits per parameter are what a memory budget is made of: at 4.127 instead of 16 bits, a 7B
# model's weights drop from 14 GB (bfloat16) to about 3.6 GB.

# %% tags=["jupyter-only"]
w_big = randn(1024, 1024, seed=27)
rows = []
print(f"{'blocksize':>9} {'double quant':>13} {'nbytes':>10} {'bits/param':>11} "
      f"{'yours':>9} {'limit':>9}")
for bs in (32, 64, 128, 256):
    for dq in (False, True):
        q = miniquant.quantize_nf4(w_big, bs, double_quant=dq)
        limit = 4 + 8 / bs + 32 / (256 * bs) if dq else 4 + 32 / bs
        mine = nf4_bits_per_param(w_big.numel(), bs, dq)
        rows.append((bs, dq, q.bits_per_param))
        print(f"{bs:>9} {str(dq):>13} {q.nbytes:>10,d} {q.bits_per_param:>11.4f} "
              f"{mine:>9.4f} {limit:>9.4f}")
        assert math.isclose(mine, q.bits_per_param, rel_tol=1e-12)

# bitsandbytes holds the same bytes for the same weight
packed, state = bnbF.quantize_4bit(w_big, blocksize=64, quant_type="nf4",
                                   compress_statistics=True)
bnb_bytes = (packed.numel() + state.absmax.numel() * state.absmax.element_size()
             + 4 * state.state2.absmax.numel() + 4)
print(f"bitsandbytes, blocksize 64, double quant: {bnb_bytes:,d} bytes = "
      f"{8 * bnb_bytes / w_big.numel():.4f} bits/param")

fig, ax = plt.subplots(figsize=(7, 3.5))
labels = [f"{bs}" for bs in (32, 64, 128, 256)]
plain = [b for _, dq, b in rows if not dq]
nested = [b for _, dq, b in rows if dq]
x = torch.arange(4)
bars1 = ax.bar(x - 0.2, plain, width=0.4, label="NF4")
bars2 = ax.bar(x + 0.2, nested, width=0.4, label="NF4 + double quant")
ax.bar_label(bars1, fmt="%.3f", fontsize=8)
ax.bar_label(bars2, fmt="%.3f", fontsize=8)
ax.axhline(4, color="k", lw=0.8, ls=":")
ax.set_xticks(x, labels)
ax.set_xlabel("blocksize")
ax.set_ylabel("bits per parameter")
ax.set_ylim(3.8, 5.2)
ax.set_title("Storage of a 1024 x 1024 weight (measured from NF4Weight.nbytes)")
ax.legend()
plt.show()

# %% [markdown]
# ## Part F — Is NF4 better than int4 on a real weight?
#
# Both formats spend 4 bits a weight and one scale per 64 weights. On one MLP weight of the
# pretrained MiniGPT, compare the error of NF4 (your pipeline; with and without double
# quantization) with that of symmetric int4 per group of 64 (`miniquant`, Lab 01).

# %%
W = base.blocks[0].mlp.up_proj.weight.detach()
idx, absmax = nf4_indices(W, 64)
err_nf4 = nf4_dequantize(idx, absmax, 64, W.shape) - W
codes, scales, offset = double_quantize_absmax(absmax)
absmax_dq = DYNAMIC_CODE[codes.long()] * scales.repeat_interleave(256)[: codes.numel()] + offset
err_dq = nf4_dequantize(idx, absmax_dq, 64, W.shape) - W
q4, s4 = miniquant.quantize_symmetric_per_group(W, bits=4, group_size=64)
err_int4 = miniquant.dequantize_symmetric_per_group(q4, s4, group_size=64) - W


def rms(e):
    return e.pow(2).mean().sqrt().item()


print(f"weight blocks.0.mlp.up_proj {tuple(W.shape)}, std {W.std().item():.4f}")
for label, e in [("NF4, blocksize 64", err_nf4), ("NF4 + double quant", err_dq),
                 ("int4 symmetric, group 64", err_int4)]:
    print(f"{label:<26} RMS error {rms(e):.6f}  ({rms(e) / W.std().item():.2%} of the "
          f"weight's std)  max |error| {e.abs().max().item():.5f}")
print(f"int4 / NF4 RMS error: {rms(err_int4) / rms(err_nf4):.2f}")

fig, ax = plt.subplots(figsize=(7, 3.5))
lim = 3 * rms(err_int4)
for label, e in [("NF4", err_nf4), ("int4 symmetric", err_int4)]:
    ax.hist(e.reshape(-1).numpy(), bins=120, range=(-lim, lim), histtype="step", lw=1.5,
            label=f"{label} (RMS {rms(e):.5f})")
ax.set_xlabel("dequantized - original")
ax.set_ylabel("count")
ax.set_title("Quantization error on blocks.0.mlp.up_proj, 4 bits, one scale per 64")
ax.legend()
plt.show()

# %% [markdown]
# NF4's RMS error is lower: most weights sit near the middle of their block's range, where
# NF4's levels are dense. Its *largest* error is higher, though: the gap between its two top
# levels (0.723 and 1.0) is almost twice int4's step of 1/7, and the few weights that fall in
# it pay for the density elsewhere. (The spike at exactly 0 in both histograms is the absmax
# element of each block, which both formats store exactly.) Which of the two errors matters
# depends on the model; QLoRA's ablations found NF4 better in practice.
#
# ## Where this goes next
#
# You have rebuilt the NF4 format that QLoRA trains on: the table, the blockwise codes, the
# byte layout and the nested scales, each identical to bitsandbytes'. The expensive step at
# training time is the one you wrote in Exercise 4, because it runs on every forward pass:
# Lab 03 writes it as a Triton kernel (and one that dequantizes only the experts a batch
# uses), and Lab 06 puts a LoRA adapter on top of NF4 weights.
#
# ### Reflection
#
# 1. The NF4 table has 8 positive levels and 7 negative ones. What would a symmetric table
#    with 16 levels have to give up, and why does that matter for padding and for weights
#    that are exactly zero?
# 2. Full blocks multiply by a reciprocal, a partial block divides. Neither is "more correct".
#    Why, then, does a reimplementation have to copy the choice, and how would you have found
#    it without reading bitsandbytes' source?
# 3. The absmax element of each block always gets code 0 or 15. What share of the codes is
#    spent that way at blocksize 64 and at 4096, and what does a larger block cost instead?
# 4. Double quantization saves 0.373 bits per weight. For a 7B model, how many megabytes is
#    that, and how does it compare with the memory of a rank-16 LoRA adapter on the same
#    model's attention projections?
# 5. bitsandbytes' CPU `dequantize_4bit` returned wrong values for `(2, 96)` while its codes
#    were right. Which of your tests would have caught a bug like this in your own code, and
#    which would not?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. A symmetric table with 16 levels has no level at 0: zero sits on the midpoint between
#    the two innermost levels, so padding and weights that are exactly zero come back as
#    $\pm$ the smallest level times the block's absmax, never as 0. The other symmetric
#    choice keeps an exact zero with 7 levels on each side and leaves the 16th code unused,
#    as int4 does (the code-usage figure shows int4 on 15 codes). NF4 keeps the zero and
#    spends the 16th code on an eighth positive level; with its levels at quantiles as well,
#    its code usage in the figure reaches an entropy of 3.89 bits against int4's 3.50.
# 2. Both scalings are correct to within one ulp, but a code is decided by which side of a
#    midpoint a value falls, so a one-ulp difference next to a midpoint gives another code,
#    and another dequantized weight than the one an adapter was trained against. Copying the
#    rule is the only way to get "byte for byte" (the sweep prints 500,863 of 500,863 bytes
#    equal). From outside you would find it by differential testing: quantize many random
#    weights with both implementations, collect the few mismatched values, notice that they
#    all sit within an ulp of a midpoint, and try both scalings on them, separately for full
#    blocks and for the trailing partial block, which is what the absmax-7 check of
#    `test_nf4_indices_rules` does.
# 3. Each block has at least one element on $\pm 1$, so at least 1/64 = 1.6 % of the codes
#    at blocksize 64 and 1/4096 = 0.02 % at 4096 are spent on the absmax elements; on
#    `blocks.0.mlp.up_proj` the share of codes 0 and 15 measures 3.8 % and 0.12 %. The larger
#    block costs accuracy instead: its absmax is about 4.5 weight standard deviations instead
#    of 2.4, so most weights crowd into fewer central levels, and the RMS error on that
#    weight rises from 0.00540 to 0.00734 (measured with `miniquant.quantize_nf4`). It saves
#    storage: 4.0078 instead of 4.5 bits per weight.
# 4. $7 \cdot 10^9 \times (4.5 - 4.127) / 8 \approx 326$ MB. A rank-16 LoRA on the four
#    attention projections of a 7B Llama (32 layers, width 4096) has
#    $32 \cdot 4 \cdot 16 \cdot (4096 + 4096) \approx 16.8$ M parameters, about 34 MB in
#    bfloat16: double quantization saves roughly ten times the adapter's size, which is why
#    QLoRA turns it on by default.
# 5. The bug gives an element the absmax of the wrong block when rows do not start at block
#    boundaries. `test_nf4_dequantize` would catch it in its visible `(3, 70)` and `(5, 13)`
#    cases and its hidden `(2, 96)`, `(6, 80)` and `(3, 1001)` cases, because each compares
#    with `CODE[idx] * absmax` of flat row-major blocks. The hand-worked `(2, 2)` case (one
#    block), the 1-D `(100,)` case and any shape whose row length is a multiple of the
#    blocksize would let it through, for the same reason the sweep found no error at
#    `(4, 128)` or `(96,)`.
