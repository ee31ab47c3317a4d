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
# # Lab 01 — Quantization basics: absmax, groups, error, outliers
#
# A weight matrix of MiniGPT holds float32 numbers: 32 bits each. QLoRA stores the frozen base
# model in about 4 bits per weight. Before the 4-bit format of Lab 02 (NF4), this lab builds
# the plain integer schemes it grew from, and measures what they cost:
#
# | # | you write | what it teaches |
# |---|---|---|
# | 1 | `quantize_absmax_int8(w, dim=None)` / `dequantize_absmax_int8(q, scale)` | one scale per tensor, or per row |
# | 2 | `quantize_symmetric_per_group(w, bits, group_size)` / its dequantizer | 2..8 bits, one scale per group of weights |
# | 3 | `quant_error(w, bits, group_size)` | how error grows with the group size |
# | 4 | `wasted_fraction(q, bits, group_size)` | what one outlier does to its group |
#
# Your functions must agree **exactly** — the same integer codes, the same scales — with the
# course's reference, `miniquant` (`src/miniquant/intquant.py`). Exercises 1 and 2 ask you to
# write that reference yourself, so calling it there is off-limits: the tests switch it off
# while they run your code.
#
# **How to work.** Run the cells from top to bottom. Where you see
# `raise NotImplementedError()`, replace it with your code. Each exercise is followed by test
# cells: run them, and if one fails, read the message — it says what was expected and what
# came. Grading runs more (hidden) checks of the same specification, so make your function
# right, not just green. Each exercise states its **specification** first (inputs, outputs,
# the rules that matter, what is off-limits), which is enough to solve it; below it, folded
# **hints** go from the idea to pseudocode, for when you want them. The whole notebook runs
# in <!-- runtime:01-quant-basics -->about 5 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import math

import matplotlib.pyplot as plt
import torch

import minigpt
import miniquant
import miniquant.intquant as intquant

# Small tensors: one CPU thread is faster than several that wait for each other.
torch.set_num_threads(1)
torch.manual_seed(0)
print("torch", torch.__version__, "| threads:", torch.get_num_threads())

# The weight we study throughout: the first block's MLP up-projection of the base model.
base = minigpt.load_base("dense").eval()
W = base.blocks[0].mlp.up_proj.weight.detach().clone()
print(f"blocks.0.mlp.up_proj.weight: shape {tuple(W.shape)}, {W.numel():,d} weights, "
      f"std {W.std():.4f}, absmax {W.abs().max():.4f}")


# Helpers for the test cells below (you do not need to read them to do the exercises).
def _codes_equal(got, want, where, ratio=None):
    """Assert two integer code tensors are equal; say how many differ, where, and by how much,
    and which rounding rule they break when `ratio` (the exact w / scale) tells."""
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    assert got.dtype == torch.int8, f"{where}: codes should be torch.int8, got {got.dtype}"
    assert got.shape == want.shape, \
        f"{where}: codes should have shape {tuple(want.shape)}, got {tuple(got.shape)}"
    bad = (got != want).nonzero()
    if len(bad):
        first = [tuple(i.tolist()) for i in bad[:4]]
        shown = [(i, int(want[i]), int(got[i])) for i in first]
        raise AssertionError(f"{where}: {len(bad)} of {want.numel()} codes differ; "
                             f"(index, expected, got): {shown}{_rounding_rule(got, want, ratio)}")


def _rounding_rule(got, want, ratio):
    """Why codes differ, when the exact w / scale of the differing ones tells."""
    if ratio is None:
        return ""
    g = got.float()
    if torch.equal(g, ratio.trunc()):
        return ". These codes are w / scale truncated toward zero: round to the nearest " \
               "code with torch.round"
    if torch.equal(g, (ratio + 0.5).floor()) or \
            torch.equal(g, ratio.sign() * (ratio.abs() + 0.5).floor()):
        return ". Each of these weights sits on a tie, exactly halfway between two codes: " \
               "torch.round sends a tie to the even code, not always up or away from zero"
    r = ratio[got != want]
    off = (r - r.floor() - 0.5).abs()            # distance from the midpoint between two codes
    if (off < 1e-4).all():
        return ". These weights sit within an ulp of a midpoint between two codes: divide by " \
               "the scale, w / scale, exactly as specified (multiplying by qmax / absmax " \
               "rounds them to the other side)"
    return ""


# %% [markdown]
# ## Part A — The integer grid
#
# **Symmetric** $b$-bit quantization replaces each weight $w$ by an integer code
# $q \in \{-q_{max}, \dots, q_{max}\}$ with $q_{max} = 2^{b-1} - 1$ (127 for 8 bits, 7 for 4
# bits), and one float **scale** $s$ shared by many weights:
#
# $$ s = \frac{\max |w|}{q_{max}}, \qquad q = \mathrm{clamp}\big(\mathrm{round}(w / s),
# -q_{max}, q_{max}\big), \qquad \hat w = q \cdot s .$$
#
# The largest $|w|$ lands exactly on $\pm q_{max}$, zero stays exactly zero, and the grid is
# the same on both sides (so the code $-2^{b-1}$, e.g. $-128$, is never used: one level given
# up for symmetry). Every other weight moves to the nearest grid point, so its error is at
# most $s/2$.
#
# **Rounding.** `torch.round` rounds to the nearest integer and sends an exact half to the
# nearest **even** integer ("banker's rounding", the IEEE default; Python's `round` does the
# same). Rounding halves always up would push values on a tie one way, a small bias that adds
# up over millions of weights; half-to-even has none. It also decides which code you get on a
# tie, and your codes must equal the reference's, so use `torch.round`.

# %%
x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4999, 2.5001])
print("x                 ", x.tolist())
print("torch.round(x)    ", torch.round(x).tolist(), " <- halves go to the even neighbour")
print("floor(x + 0.5)    ", torch.floor(x + 0.5).tolist(), " <- halves always up")
print("x.to(torch.int8)  ", x.to(torch.int8).tolist(), " <- truncation toward zero: wrong")

for bits in (2, 3, 4, 8):
    qmax = 2 ** (bits - 1) - 1
    print(f"{bits} bits: codes -{qmax}..{qmax}, {2 * qmax + 1} levels")


# %% [markdown]
# ## Part B — Exercise 1: absmax int8, per tensor and per row
#
# **Specification.** Write `quantize_absmax_int8(w, dim=None)`, returning `(q, scale)`, and
# `dequantize_absmax_int8(q, scale)`:
#
# * `w` is a float16, bfloat16 or float32 tensor of any shape; compute in **float32**
#   (`w.float()`), whatever `w`'s dtype.
# * `dim=None`: one scale for the whole tensor, `scale = absmax / 127` as a **0-d float32
#   tensor** (`absmax` is the largest $|w|$ — the largest magnitude, which may belong to a
#   negative weight).
# * `dim=d`: one scale per slice along `d`: the absmax is taken over dimension `d` and kept as
#   a size-1 dimension (`keepdim=True`), so that it broadcasts. On an `[out, in]` weight,
#   `dim=-1` gives one scale per output row, of shape `[out, 1]`; `dim=0` gives `[1, in]`.
# * codes: `q = round(w / scale)` with `torch.round`, clamped to `[-127, 127]`, as
#   `torch.int8` of `w`'s shape. Divide by the scale exactly as written (multiplying by
#   `127 / absmax` instead can move a weight that sits on a tie by one code).
# * a slice (or tensor) that is all zeros gets scale 0 and codes 0 — no NaN.
# * `dequantize_absmax_int8(q, scale)` returns `q · scale` as float32 (the scale broadcasts).
#
# Off-limits: `miniquant.quantize_absmax_int8` and the rest of `miniquant`'s integer
# quantizers are the reference the tests compare you with; they are switched off while your
# functions run. Write it with torch operations.
#
# <details><summary>Hint 1: the idea</summary>
#
# Both cases are one reduction: `x.abs().amax()` for the whole tensor, or
# `x.abs().amax(dim=dim, keepdim=True)` along a dimension, which keeps the shape that
# broadcasts against `x`. The only trap left is the all-zero slice: its scale is 0, and
# `0 / 0` is NaN. Divide by a "safe" scale that is 1 where the true scale is 0 (the codes
# then come out 0), and return the true scale.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# x      = float32(w)
# absmax = max |x| over everything (0-d)   or   over dim, keepdim
# scale  = absmax / 127
# safe   = scale where scale > 0, else 1
# q      = int8(clamp(round(x / safe), -127, 127))
# return q, scale                              # dequantize: float32(q) * scale
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "absmax_int8", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_absmax_int8(w: torch.Tensor, dim: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 of w's shape, scale float32): scale = absmax / 127 per tensor or along `dim`."""
    ### BEGIN SOLUTION
    x = w.float()
    absmax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = absmax / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))   # all-zero: codes 0
    q = torch.round(x / safe).clamp(-127, 127).to(torch.int8)
    return q, scale
    ### END SOLUTION


def dequantize_absmax_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q · scale in float32."""
    ### BEGIN SOLUTION
    return q.float() * scale.float()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_absmax_int8", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# What the tests switch off while your code runs, here in a locked cell: the later test
# cells use it too.
import numpy as np  # noqa: E402

from course.notebook.harness import forbid  # noqa: E402


def _reference_called(*args, **kwargs):
    raise AssertionError("this exercise must not call the miniquant reference "
                         "(quantize_absmax_int8, quantize_symmetric_per_group, ... from "
                         "miniquant): write it with torch operations")


@contextlib.contextmanager
def reference_disabled():
    """Used by the tests: inside this block, miniquant's integer quantizers raise if called
    (every name bound to them is switched off where your code runs, and their code too)."""
    names = ["quantize_absmax_int8", "dequantize_absmax_int8", "quantize_symmetric_per_group",
             "dequantize_symmetric_per_group", "round_to_grid"]
    saved = {name: getattr(intquant, name).__code__ for name in names}
    with forbid([(intquant, name) for name in names], globals(),
                why="this exercise must not call the miniquant reference: write it with torch "
                    "operations"):
        try:
            for name in names:
                getattr(intquant, name).__code__ = _reference_called.__code__
            yield
        finally:
            for name, code in saved.items():
                getattr(intquant, name).__code__ = code


def _naive_absmax(w, dim=None):
    """The expected (codes, scale, dequantized), one slice at a time in numpy float32: each
    slice along `dim` (the whole tensor when None) gets absmax / 127, its codes rint(w /
    scale) (numpy's rint also sends a tie to the even integer), clipped to ±127, or 0 when the
    slice is all zeros."""
    x = w.detach().float().numpy()
    moved = x.reshape(1, -1) if dim is None else np.moveaxis(x, dim, -1)
    lines = moved.reshape(-1, moved.shape[-1])                    # [n_slices, slice length]
    codes = np.zeros(lines.shape, dtype=np.int8)
    deq = np.zeros(lines.shape, dtype=np.float32)
    scales = np.zeros(len(lines), dtype=np.float32)
    for i, line in enumerate(lines):
        scales[i] = np.abs(line).max() / np.float32(127)          # float32 division
        if scales[i] > 0:
            codes[i] = np.clip(np.rint(line / scales[i]), -127, 127)
        deq[i] = codes[i].astype(np.float32) * scales[i]
    if dim is None:
        return (torch.from_numpy(codes).reshape(w.shape), torch.tensor(scales[0]),
                torch.from_numpy(deq).reshape(w.shape))
    back = [torch.from_numpy(np.ascontiguousarray(np.moveaxis(a.reshape(shape), -1, dim)))
            for a, shape in ((codes, moved.shape), (scales, moved.shape[:-1] + (1,)),
                             (deq, moved.shape))]
    return tuple(back)


def _check_absmax(w, dim=None, want_q=None, want_scale=None):
    """Compare with a loop over slices in numpy (and with hand-worked codes/scale when given)."""
    where = f"quantize_absmax_int8(w of shape {tuple(w.shape)}, {w.dtype}, dim={dim})"
    loop_q, loop_scale, loop_deq = _naive_absmax(w, dim)
    x = w.float().clone()                                   # before your call, which gets w
    signed_max = x.amax() if dim is None else x.amax(dim=dim, keepdim=True)
    with reference_disabled():
        got = quantize_absmax_int8(w, dim=dim)
        assert isinstance(got, tuple) and len(got) == 2, f"{where}: expected (q, scale)"
        q, scale = got
        deq = dequantize_absmax_int8(q, scale)
    # the scale first: a wrong scale makes every code wrong
    assert isinstance(scale, torch.Tensor) and scale.dtype == torch.float32, \
        f"{where}: scale should be a float32 tensor, got {getattr(scale, 'dtype', type(scale))}"
    assert scale.shape == loop_scale.shape, \
        f"{where}: scale should have shape {tuple(loop_scale.shape)}, got {tuple(scale.shape)}" + \
        ("" if dim is None else " (the absmax along dim is kept as a size-1 dimension, "
                                "keepdim=True, so that it broadcasts)")
    why = (" (that is max(w) / 127: the absmax is the largest magnitude, max |w|, which may "
           "belong to a negative weight)" if torch.allclose(scale, signed_max / 127) else
           " (that is absmax / 128: qmax = 2**(8-1) - 1 = 127)"
           if torch.allclose(scale, loop_scale * 127 / 128) else "")
    if want_scale is not None:
        torch.testing.assert_close(scale, want_scale, msg=lambda m: f"{where} scale{why}: {m}")
    torch.testing.assert_close(scale, loop_scale, rtol=0, atol=0,
                               msg=lambda m: f"{where}: scale should be absmax / 127{why}:\n{m}")
    ratio = x / torch.where(loop_scale > 0, loop_scale, torch.ones_like(loop_scale))
    if want_q is not None:
        _codes_equal(q, want_q, where + " (worked by hand)", ratio)
    _codes_equal(q, loop_q, where, ratio)
    assert isinstance(deq, torch.Tensor) and deq.dtype == torch.float32, \
        f"dequantize_absmax_int8 should return float32, got {getattr(deq, 'dtype', type(deq))}"
    torch.testing.assert_close(deq, loop_deq, msg=lambda m: f"dequantize_absmax_int8 after "
                                                           f"{where}:\n{m}")
    return q, scale, deq


# worked by hand: absmax 127 makes the scale exactly 1, so w / scale is w
_check_absmax(torch.tensor([2.5, 3.5, -2.5, 0.5, 127.0]),
              want_q=torch.tensor([2, 4, -2, 0, 127], dtype=torch.int8),
              want_scale=torch.tensor(1.0))
# the largest magnitude is negative: absmax 254, scale 2; 5/2 = 2.5 -> 2, 7/2 = 3.5 -> 4
_check_absmax(torch.tensor([-254.0, 5.0, 7.0, -3.0]),
              want_q=torch.tensor([-127, 2, 4, -2], dtype=torch.int8),
              want_scale=torch.tensor(2.0))
# one element: it is its own absmax
_check_absmax(torch.tensor([-0.3]), want_q=torch.tensor([-127], dtype=torch.int8))
# all zeros: scale 0, codes 0, and no NaN on the way back
_q, _s, _deq = _check_absmax(torch.zeros(3, 4), want_q=torch.zeros(3, 4, dtype=torch.int8),
                             want_scale=torch.tensor(0.0))
assert not _deq.isnan().any(), "dequantizing an all-zero tensor gave NaN"
# 254 weights built to sit on (or within an ulp of) the midpoints between two codes:
# dividing by the scale, as specified, decides them as the loop does
_s = torch.tensor(0.3) / 127
_check_absmax(torch.cat([(torch.arange(-127, 127) + 0.5) * _s, torch.tensor([0.3])]))
# random weights
_check_absmax(torch.randn(5, 13, generator=torch.Generator().manual_seed(0)))
# bfloat16 weights: the scale and the codes are computed in float32 (w.float() first)
try:
    _check_absmax((torch.randn(4, 9, generator=torch.Generator().manual_seed(7)) * 3)
                  .to(torch.bfloat16))
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: compute in float32 (w.float() first), whatever the "
                         "dtype of w; the scale is a float32 tensor") from _e
print("quantize_absmax_int8 (per tensor) matches the hand-worked cases and a loop over "
      "slices in numpy")

### BEGIN HIDDEN TESTS
# case: random weights of several shapes (error bound, code range)
_g = torch.Generator().manual_seed(1)
for _shape in [(7,), (3, 4, 9), (1, 1), (64, 33)]:
    _w = torch.randn(*_shape, generator=_g) * 3
    _q, _s, _deq = _check_absmax(_w)
    # half a step, plus float32's rounding of code × scale (a weight on a tie: 0.5 step + 1 ulp)
    _err = (_w - _deq).abs() - _deq.abs() * torch.finfo(torch.float32).eps
    assert (_err <= _s / 2).all(), f"shape {_shape}: max error {_err.max()} > scale/2 = {_s / 2}"
    assert _q.abs().max() == 127 and _q.min() >= -127, \
        f"shape {_shape}: codes should reach ±127 and never -128, got {_q.min()}..{_q.max()}"
# case: float16 and bfloat16 weights
for _dt in (torch.float16, torch.bfloat16):
    _check_absmax((torch.randn(6, 10, generator=_g) * 5).to(_dt))
# case: the real weight, and the same weight transposed (not contiguous)
_check_absmax(W)
_check_absmax(W.T)
# case: many exact ties, of both parities
_ = _check_absmax(torch.cat([torch.arange(-10, 11) + 0.5, torch.tensor([127.0])]),
                  want_q=torch.tensor([*torch.round(torch.arange(-10, 11) + 0.5).tolist(), 127],
                                      dtype=torch.int8))
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_absmax_int8_per_row", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# worked by hand, dim=-1: row scales 1, 0 and 2 (a square matrix, so a scale broadcast along
# the wrong dimension cannot go unnoticed)
_w = torch.tensor([[127.0, 63.5, -1.5],
                   [0.0, 0.0, 0.0],
                   [-254.0, 1.0, 3.0]])
_check_absmax(_w, dim=-1,
              want_q=torch.tensor([[127, 64, -2], [0, 0, 0], [-127, 0, 2]], dtype=torch.int8),
              want_scale=torch.tensor([[1.0], [0.0], [2.0]]))
# random rows, one with a 50x larger range
_w = torch.randn(6, 11, generator=torch.Generator().manual_seed(1))
_w[2] *= 50
_q, _s, _ = _check_absmax(_w, dim=-1)
# each row is quantized as if it were alone
for _r in range(6):
    _qr, _sr, _ = _naive_absmax(_w[_r])
    assert torch.equal(_q[_r], _qr) and _s[_r, 0] == _sr, \
        f"row {_r}: expected the per-tensor result of that row alone (scale {_sr}), " \
        f"got scale {_s[_r, 0]}"
print("quantize_absmax_int8 (per row) matches the hand-worked case and a loop over rows")

### BEGIN HIDDEN TESTS
# case: a matrix, per column and dim=1
_g = torch.Generator().manual_seed(2)
_check_absmax(_w, dim=0)
_check_absmax(_w, dim=1)
# case: a 3-d tensor, every dim (positive and negative)
_w3 = torch.randn(3, 5, 7, generator=_g)
for _d in (0, 1, 2, -1, -2):
    _check_absmax(_w3, dim=_d)
# case: the real weight per row, and in bfloat16 per column
_check_absmax(W, dim=-1)
_check_absmax(W.to(torch.bfloat16), dim=0)
# case: the real weight per row, error bound
_q, _s, _deq = _check_absmax(W, dim=-1)
assert ((W - _deq).abs() - _deq.abs() * torch.finfo(torch.float32).eps <= _s / 2).all(), \
    "per-row error above scale/2"
### END HIDDEN TESTS

# %% [markdown]
# ### Why one scale per row helps
#
# One scale for the whole tensor must cover its single largest weight, so every row pays for
# the widest row's range. The up-projection's rows differ: the plot shows each row's absmax.
# With per-row scales a narrow row gets a fine grid of its own. The relative error
# $\lVert W - \hat W \rVert_F / \lVert W \rVert_F$ roughly halves, and the price is one float32
# scale per row instead of one in total.

# %%
q_t, s_t = quantize_absmax_int8(W)
q_r, s_r = quantize_absmax_int8(W, dim=-1)
err_t = ((W - dequantize_absmax_int8(q_t, s_t)).norm() / W.norm()).item()
err_r = ((W - dequantize_absmax_int8(q_r, s_r)).norm() / W.norm()).item()
print(f"per tensor: 1 scale,   relative error {err_t:.4f}")
print(f"per row   : {s_r.numel()} scales, relative error {err_r:.4f}  ({err_t / err_r:.1f}x less)")

row_absmax = W.abs().amax(dim=1)
fig, ax = plt.subplots(figsize=(8, 3))
ax.plot(row_absmax, lw=0.8, label="absmax of each row")
ax.axhline(W.abs().max(), color="tab:red", ls="--", label="absmax of the whole tensor")
ax.set_xlabel("output row of blocks.0.mlp.up_proj")
ax.set_ylabel("|w| max")
ax.set_ylim(0, 1.35 * W.abs().max())
ax.set_title("Rows have different ranges: one scale for all wastes the grid on narrow rows")
ax.legend(loc="upper right", ncols=2)
plt.show()


# %% [markdown]
# ## Part C — Exercise 2: symmetric quantization per group, 2 to 8 bits
#
# Per row is one choice of "which weights share a scale". The general one, used by GPTQ, AWQ,
# bitsandbytes and Lab 02's NF4, is the **group** (or block): a fixed number of consecutive
# weights.
#
# **Specification.** Write `quantize_symmetric_per_group(w, bits=8, group_size=64)` and
# `dequantize_symmetric_per_group(q, scales, group_size=64)` with **exactly** this layout:
#
# * flatten `w` **row-major** (`w.reshape(-1)`: the last index varies fastest) and cut it into
#   groups of `group_size` consecutive elements. The last group may be **partial** (when
#   `group_size` does not divide `w.numel()`); its absmax covers only its own elements. A
#   group may span several rows, and `group_size` may exceed `w.numel()` (one partial group).
# * `qmax = 2**(bits-1) - 1`; each group's `scale = absmax / qmax` (float32); codes
#   `round(w / scale)` (`torch.round`), clamped to `[-qmax, qmax]`; an all-zero group gets
#   scale 0 and codes 0. Compute in float32 whatever `w`'s dtype.
# * return `(q, scales)`: `q` as `torch.int8` **of `w`'s shape** (whatever `bits`; Lab 02 packs
#   4-bit codes two per byte, here we keep one code per byte), `scales` float32 of shape
#   `[n_groups]` with `n_groups = ceil(w.numel() / group_size)`.
# * raise `ValueError` if `bits` is not an integer in 2..8, or `group_size` is not an integer
#   ≥ 1 (in both functions).
# * `dequantize_symmetric_per_group` gives each code its group's scale and returns float32 of
#   `q`'s shape.
#
# Off-limits: `miniquant.quantize_symmetric_per_group` and its dequantizer are the reference
# the tests compare you with; they are switched off while your functions run.
#
# <details><summary>Hint 1: the idea</summary>
#
# Make the groups the rows of a matrix: flatten, pad the flat vector with zeros up to a
# multiple of `group_size` (`torch.nn.functional.pad` or `torch.cat`; zeros do not change an
# absmax), and `reshape(-1, group_size)`. Then it is Exercise 1 with `dim=1` and `qmax`
# instead of 127. Afterwards, drop the padding and give the codes `w`'s shape again.
# `w.reshape(-1)` works on a non-contiguous tensor where `w.view(-1)` does not. Going back,
# `torch.repeat_interleave` expands one scale per group into one per element.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# check bits (int, 2..8) and group_size (int, >= 1), else raise ValueError
# qmax   = 2**(bits-1) - 1
# flat   = float32(w) flattened row-major;  n = numel
# groups = flat padded with zeros to a multiple of group_size, as rows of group_size
# scales = max |groups| per row / qmax
# q      = int8(clamp(round(groups / safe(scales)), -qmax, qmax))
# return q flattened, first n, reshaped to w.shape;  scales
#
# dequantize: per_element = repeat each scale group_size times, first numel(q)
#             return (float32(q) flattened * per_element) reshaped to q.shape
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "per_group", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quantize_symmetric_per_group(w: torch.Tensor, bits: int = 8, group_size: int = 64
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 of w's shape, scales float32 [ceil(numel / group_size)]), row-major groups."""
    ### BEGIN SOLUTION
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 2..8, got {bits!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    qmax = 2 ** (bits - 1) - 1
    flat = w.reshape(-1).float()
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, -n % group_size))
    groups = padded.reshape(-1, group_size)                       # [n_groups, group_size]
    scales = groups.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q.reshape(-1)[:n].reshape(w.shape), scales
    ### END SOLUTION


def dequantize_symmetric_per_group(q: torch.Tensor, scales: torch.Tensor,
                                   group_size: int = 64) -> torch.Tensor:
    """Each code times its group's scale: float32 of q's shape."""
    ### BEGIN SOLUTION
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    per_element = scales.float().reshape(-1).repeat_interleave(group_size)[: q.numel()]
    return (q.reshape(-1).float() * per_element).reshape(q.shape)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_per_group_quantize", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _naive_per_group(w, bits, group_size):
    """The expected (codes int8 of w's shape, scales float32 [n_groups]), one group of the
    row-major flat w at a time, in numpy float32: scale = absmax / qmax, codes rint(w / scale)
    (numpy's rint also sends a tie to the even integer) clipped to ±qmax, 0 in a zero group."""
    qmax = np.float32(2 ** (bits - 1) - 1)
    flat = w.detach().float().reshape(-1).numpy()
    codes = np.zeros(flat.shape, dtype=np.int8)
    scales = np.zeros(-(-flat.size // group_size), dtype=np.float32)
    for g, start in enumerate(range(0, flat.size, group_size)):
        group = flat[start:start + group_size]                    # the last may be partial
        scales[g] = np.abs(group).max() / qmax                    # float32 division
        if scales[g] > 0:
            codes[start:start + group_size] = np.clip(np.rint(group / scales[g]), -qmax, qmax)
    return torch.from_numpy(codes).reshape(w.shape), torch.from_numpy(scales)


def _check_per_group(w, bits, group_size, want_q=None, want_scales=None):
    where = (f"quantize_symmetric_per_group(w of shape {tuple(w.shape)}, {w.dtype}, "
             f"bits={bits}, group_size={group_size})")
    loop_q, loop_scales = _naive_per_group(w, bits, group_size)
    x = w.float().clone()                                   # before your call, which gets w
    absmax = torch.stack([g.abs().max() for g in x.reshape(-1).split(group_size)])
    with reference_disabled():
        got = quantize_symmetric_per_group(w, bits=bits, group_size=group_size)
    assert isinstance(got, tuple) and len(got) == 2, f"{where}: expected (q, scales)"
    q, scales = got
    # the scales first: a wrong scale makes every code of its group wrong
    n_groups = -(-w.numel() // group_size)
    assert isinstance(scales, torch.Tensor) and scales.dtype == torch.float32, \
        f"{where}: scales should be float32, got {getattr(scales, 'dtype', type(scales))}"
    assert scales.shape == (n_groups,), \
        f"{where}: scales should have shape ({n_groups},) = ceil({w.numel()}/{group_size}), " \
        f"got {tuple(scales.shape)}"
    qmax = 2 ** (bits - 1) - 1
    why = next((f" (that is absmax / {other}: qmax = 2**(bits-1) - 1 = {qmax})"
                for other in (2 ** bits - 1, 2 ** (bits - 1))
                if torch.allclose(scales, absmax / other)), "")
    if want_scales is not None:
        torch.testing.assert_close(scales, want_scales, msg=lambda m: f"{where} scales{why}: {m}")
    torch.testing.assert_close(scales, loop_scales, rtol=0, atol=0,
                               msg=lambda m: f"{where}: scales should be absmax / qmax{why}:\n{m}")
    per = loop_scales.repeat_interleave(group_size)[: w.numel()].reshape(w.shape)
    ratio = x / torch.where(per > 0, per, torch.ones_like(per))
    if want_q is not None:
        _codes_equal(q, want_q, where + " (worked by hand)", ratio)
    _codes_equal(q, loop_q, where + " vs a loop over groups", ratio)
    return q, scales


# worked by hand, bits=4 (qmax 7), groups of 3 over 7 weights: scales 1, 2 and 2/7
# group 1 [7, 3.5, -1]   / 1   -> 7, 4 (3.5 is a tie: to even), -1
# group 2 [14, -7, 0.5]  / 2   -> 7, -4 (-3.5: to even), 0 (0.25)
# group 3 [2]            / 2/7 -> 7 (a partial group of one element)
_check_per_group(torch.tensor([[7.0, 3.5, -1.0, 14.0, -7.0, 0.5, 2.0]]), 4, 3,
                 want_q=torch.tensor([[7, 4, -1, 7, -4, 0, 7]], dtype=torch.int8),
                 want_scales=torch.tensor([1.0, 2.0, 2.0 / 7.0]))
# a partial last group uses only its own elements: scales 100/127 and 0.5/127
_check_per_group(torch.cat([torch.full((8,), 100.0), torch.tensor([0.5, -0.25])]), 8, 8,
                 want_scales=torch.tensor([100.0, 0.5]) / 127)
# weights on (or within an ulp of) the midpoints between codes, in groups of 2·qmax + 1:
# dividing by the scale, as specified, decides them as the loop does
for _bits in (8, 4):
    _qmax = 2 ** (_bits - 1) - 1
    _w = torch.cat([torch.cat([(torch.arange(-_qmax, _qmax) + 0.5) * (_a / _qmax), _a[None]])
                    for _a in torch.tensor([0.3, 1.7, 0.05, 3.3])])
    _check_per_group(_w, _bits, 2 * _qmax + 1)
# random weights; groups that span rows and do not divide the length
_g = torch.Generator().manual_seed(0)
_check_per_group(torch.randn(5, 13, generator=_g), 8, 8)
_check_per_group(torch.randn(65, generator=_g), 4, 64)
# a transposed (non-contiguous) weight is grouped in its logical row-major order
try:
    _check_per_group(torch.randn(6, 5, generator=_g).T, 4, 8)
except RuntimeError as _e:
    raise AssertionError("quantize_symmetric_per_group failed on a transposed (non-contiguous) "
                         f"weight: {_e}. Flatten with w.reshape(-1), which copies when it must; "
                         "w.view(-1) cannot") from _e
# bfloat16 weights: computed in float32
try:
    _check_per_group((torch.randn(3, 10, generator=_g) * 4).to(torch.bfloat16), 4, 16)
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: compute in float32 (w.float() first), whatever the "
                         "dtype of w; the scales are float32") from _e
# an all-zero group between two others: scale 0 and codes 0, no NaN
_w = torch.randn(24, generator=_g)
_w[8:16] = 0
_q, _s = _check_per_group(_w, 3, 8)
assert _s[1] == 0 and not _q[8:16].any(), \
    f"an all-zero group should get scale 0 and codes 0; got scale {_s[1].item()} and codes " \
    f"{_q[8:16].tolist()}"
# bad arguments raise ValueError
for _kw, _rule in (({"bits": 1}, "bits must be an integer in 2..8"),
                   ({"bits": 9}, "bits must be an integer in 2..8"),
                   ({"group_size": 0}, "group_size must be an integer >= 1")):
    try:
        with reference_disabled():
            quantize_symmetric_per_group(torch.ones(4), **{"bits": 8, "group_size": 64, **_kw})
    except ValueError:
        continue
    raise AssertionError(f"quantize_symmetric_per_group(torch.ones(4), {_kw}) should raise "
                         f"ValueError: {_rule}")
print("quantize_symmetric_per_group matches the hand-worked cases and a loop over groups")

### BEGIN HIDDEN TESTS
# case: every bit width 2..8, shapes and group sizes (partial groups, one group, size 1)
_g = torch.Generator().manual_seed(3)
for _bits in range(2, 9):
    for _shape, _gs in [((1,), 64), ((65,), 64), ((5, 13), 8), ((3, 4, 9), 7), ((100,), 1),
                        ((10, 10), 100), ((10, 10), 1000), ((7, 9), 16)]:
        _w = torch.randn(*_shape, generator=_g)
        _q, _s = _check_per_group(_w, _bits, _gs)
        _qmax = 2 ** (_bits - 1) - 1
        assert _q.min() >= -_qmax and _q.max() <= _qmax, \
            f"bits={_bits}: codes should lie in [-{_qmax}, {_qmax}], got {_q.min()}..{_q.max()}"
# case: bfloat16 and float16 weights
_check_per_group((torch.randn(9, 14, generator=_g) * 4).to(torch.bfloat16), 4, 32)
_check_per_group((torch.randn(9, 14, generator=_g) * 4).to(torch.float16), 8, 20)
# case: the real weight, transposed (not contiguous) and as it is
_check_per_group(W.T, 4, 64)
_check_per_group(W, 8, 100)
# case: an all-zero group in the middle
_w = torch.randn(24, generator=_g)
_w[8:16] = 0
_q, _s = _check_per_group(_w, 3, 8)
assert _s[1] == 0 and not _q[8:16].any(), "an all-zero group should get scale 0 and codes 0"
# case: invalid bits or group_size (including non-integers)
for _kw in ({"bits": 1}, {"bits": 9}, {"bits": 4.0}, {"group_size": 0}, {"group_size": -8},
            {"group_size": 2.5}):
    try:
        quantize_symmetric_per_group(torch.ones(4), **{"bits": 8, "group_size": 64, **_kw})
    except ValueError:
        continue
    raise AssertionError(f"quantize_symmetric_per_group(..., {_kw}) should raise ValueError")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_per_group_dequantize", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _naive_dequantize(q, scales, group_size):
    """The expected ŵ, one group of the row-major flat q at a time, in numpy float32: each
    code times its group's scale."""
    flat = q.reshape(-1).numpy().astype(np.float32)
    out = np.zeros(flat.shape, dtype=np.float32)
    for g, start in enumerate(range(0, flat.size, group_size)):
        out[start:start + group_size] = flat[start:start + group_size] * scales[g].numpy()
    return torch.from_numpy(out).reshape(q.shape)


def _check_per_group_round_trip(w, bits, group_size):
    """Dequantize the loop's codes; compare with the loop's ŵ; check |w - ŵ| <= scale / 2."""
    where = (f"dequantize_symmetric_per_group after quantizing w of shape {tuple(w.shape)} "
             f"with bits={bits}, group_size={group_size}")
    q, scales = _naive_per_group(w, bits, group_size)
    want = _naive_dequantize(q, scales, group_size)
    per_element = scales.repeat_interleave(group_size)[: w.numel()].reshape(w.shape)
    with reference_disabled():
        got = dequantize_symmetric_per_group(q, scales, group_size=group_size)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, \
        f"{where}: expected a float32 tensor, got {getattr(got, 'dtype', type(got).__name__)}"
    assert got.shape == w.shape, f"{where}: expected shape {tuple(w.shape)}, got {tuple(got.shape)}"
    torch.testing.assert_close(got, want,
                               msg=lambda m: f"{where}, vs a loop over groups:\n{m}")
    # half a step, plus float32's rounding of code × scale (a weight on a tie: 0.5 step + 1 ulp)
    excess = ((w.float() - got).abs() - got.abs() * torch.finfo(torch.float32).eps
              - per_element / 2)
    assert (excess <= 0).all(), \
        f"{where}: |w - ŵ| exceeds scale/2 at {excess.argmax().item()} (flat index)"


# worked by hand: the codes and scales of the first hand-worked case above
_q = torch.tensor([[7, 4, -1, 7, -4, 0, 7]], dtype=torch.int8)
_s = torch.tensor([1.0, 2.0, 2.0 / 7.0])
try:
    _deq = dequantize_symmetric_per_group(_q, _s, group_size=3)
except RuntimeError as _e:
    raise AssertionError(f"dequantize_symmetric_per_group(7 codes, 3 scales, group_size=3) "
                         f"failed: {_e}. The last group may be partial: give each of the "
                         "q.numel() codes its group's scale, and no more") from _e
_why = " (each code took scales[i % 3]: code i has its own group's scale, scales[i // 3], " \
       "as repeat_interleave gives, not repeat)" \
    if torch.allclose(_deq.float(), _q.float() * _s.repeat(3)[:7]) else ""
torch.testing.assert_close(_deq, torch.tensor([[7.0, 4.0, -1.0, 14.0, -8.0, 0.0, 2.0]]),
                           msg=lambda m: f"dequantize_symmetric_per_group, worked by hand"
                                         f"{_why}:\n{m}")
_g = torch.Generator().manual_seed(0)
_check_per_group_round_trip(torch.randn(5, 13, generator=_g), 4, 8)
_check_per_group_round_trip(torch.randn(3, 4, 9, generator=_g), 8, 7)
print("dequantize_symmetric_per_group matches a loop over groups; every error is within "
      "scale/2")

### BEGIN HIDDEN TESTS
# case: several bit widths, shapes and group sizes
_g = torch.Generator().manual_seed(4)
for _bits in (2, 3, 5, 6, 7, 8):
    for _shape, _gs in [((1,), 64), ((65,), 64), ((100,), 1), ((10, 10), 1000), ((6, 7), 5)]:
        _check_per_group_round_trip(torch.randn(*_shape, generator=_g), _bits, _gs)
# case: the real weight, as it is and transposed
_check_per_group_round_trip(W, 4, 64)
_check_per_group_round_trip(W.T, 8, 96)
# case: a bfloat16 weight
_check_per_group_round_trip(torch.randn(6, 10, generator=_g).to(torch.bfloat16), 4, 16)
# case: an invalid group_size
try:
    dequantize_symmetric_per_group(torch.ones(4, dtype=torch.int8), torch.ones(1), group_size=0)
except ValueError:
    pass
else:
    raise AssertionError("dequantize_symmetric_per_group(..., group_size=0) should raise "
                         "ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ### What a group looks like at 4 bits
#
# The first 64 weights of row 0 on the 15-level grid of their group: each dot moves to the
# nearest level, the largest one lands exactly on $+7$ or $-7$.

# %%
q4, s4 = quantize_symmetric_per_group(W, bits=4, group_size=64)
w4 = dequantize_symmetric_per_group(q4, s4, group_size=64)
first = W.reshape(-1)[:64]
fig, ax = plt.subplots(figsize=(9, 3))
for level in range(-7, 8):
    ax.axhline(level * s4[0], color="0.85", lw=0.8, zorder=0)
ax.scatter(range(64), first, s=14, label="w (float32)")
ax.scatter(range(64), w4.reshape(-1)[:64], s=14, marker="x", label="dequantized (4 bits)")
ax.set_xlabel("position in group 0")
ax.set_title(f"Group 0 at 4 bits: scale {s4[0]:.4f}, grid lines at the 15 levels")
ax.legend()
plt.show()


# %% [markdown]
# ## Part D — Exercise 3: measuring the error
#
# To compare schemes we need one number.
#
# **Specification.** Write `quant_error(w, bits=8, group_size=64)`: quantize `w` per group
# and dequantize it, then return the **relative Frobenius error**
#
# $$ \mathrm{err}(w) = \frac{\lVert w - \hat w \rVert_F}{\lVert w \rVert_F} $$
#
# as a Python `float`, computed in float32 against `w.float()`.
#
# * `group_size=None` means one group holding the whole tensor (per-tensor quantization).
# * an all-zero `w` has error `0.0` (not NaN).
# * Use your own functions from Exercise 2: finish them first (in a student repository,
#   `miniquant.quantize_symmetric_per_group` is a stub until Lab 01's solutions are
#   released).
#
# <details><summary>Hint 1: the idea</summary>
#
# "One group holding the whole tensor" is just `group_size = w.numel()`, so `None` needs no
# code path of its own. `torch.linalg.norm` or `.norm()` of a tensor of any shape is its
# Frobenius norm. Check for a zero norm before dividing, and turn the 0-d result into a
# Python float with `.item()`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# x  = float32(w);  gs = numel(x) if group_size is None else group_size
# q, scales = quantize_symmetric_per_group(x, bits, gs)
# x_hat     = dequantize_symmetric_per_group(q, scales, gs)
# return 0.0 if norm(x) == 0 else (norm(x - x_hat) / norm(x)).item()
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "quant_error", "locked": false, "schema_version": 3, "solution": true, "task": false}
def quant_error(w: torch.Tensor, bits: int = 8, group_size: int | None = 64) -> float:
    """‖w − ŵ‖_F / ‖w‖_F after symmetric per-group quantization (group_size=None: per tensor)."""
    ### BEGIN SOLUTION
    x = w.float()
    gs = x.numel() if group_size is None else group_size
    q, scales = quantize_symmetric_per_group(x, bits=bits, group_size=gs)
    deq = dequantize_symmetric_per_group(q, scales, group_size=gs)
    norm = x.norm()
    if norm == 0:
        return 0.0
    return ((x - deq).norm() / norm).item()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_quant_error", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_error(w, bits, group_size, want=None):
    call = f"quant_error(w of shape {tuple(w.shape)}, {w.dtype}, bits={bits}, " \
           f"group_size={group_size})"
    x = w.float().clone()                                   # before your call, which gets w
    gs = x.numel() if group_size is None else group_size
    # the definition, on the ŵ of the loops over groups above: ‖w − ŵ‖_F / ‖w‖_F
    x_hat = _naive_dequantize(*_naive_per_group(x, bits, gs), gs)
    want = ((x - x_hat).norm() / x.norm()).item() if want is None else want
    try:
        got = quant_error(w, bits=bits, group_size=group_size)
    except (ValueError, TypeError) as e:
        raise AssertionError(f"{call} raised {type(e).__name__}: {e}" + (
            " (group_size=None means one group holding the whole tensor)"
            if group_size is None else "")) from e
    assert type(got) is float, f"{call}: expected a Python float, got {type(got).__name__}"
    why = (" (an all-zero w has error 0.0, not NaN: check ‖w‖ = 0 before dividing)"
           if math.isnan(got) else
           " (that is the squared ratio: divide the norms, not their squares)"
           if math.isclose(got, want**2, rel_tol=1e-4) else
           " (that is ‖w − ŵ‖ / ‖ŵ‖: the error is relative to ‖w‖, the original weights)"
           if math.isclose(got, ((x - x_hat).norm() / x_hat.norm()).item(), rel_tol=1e-5)
           else "")
    assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7), \
        f"{call}: expected {want:.7f}, got {got:.7f}{why}"


# worked by hand: bits=2 has qmax 1, so [1, 0.5] -> codes [1, 0] (0.5 is a tie: to even)
# -> ŵ = [1, 0], error ‖[0, 0.5]‖ / ‖[1, 0.5]‖ = 0.5 / sqrt(1.25)
_check_error(torch.tensor([1.0, 0.5]), 2, 2, want=0.5 / math.sqrt(1.25))
# weights already on the grid: no error at all
_check_error(torch.arange(-7.0, 8.0), 4, 15, want=0.0)
# all zeros: 0.0, not NaN
_check_error(torch.zeros(4, 4), 8, 4, want=0.0)
_g = torch.Generator().manual_seed(0)
_check_error(torch.randn(5, 13, generator=_g), 4, 8)
_check_error(torch.randn(5, 13, generator=_g), 8, None)
print("quant_error matches the hand-worked cases and the definition")

### BEGIN HIDDEN TESTS
# case: the real weight, several bit widths and group sizes (None included)
for _bits in (2, 3, 4, 6, 8):
    for _gs in (1, 7, 64, 4096, None):
        _check_error(W, _bits, _gs)
# case: a bfloat16 weight, and a 3-d weight
_check_error(W.to(torch.bfloat16), 4, 64)
_check_error(torch.randn(3, 4, 9, generator=_g), 5, 10)
# case: group_size=None against per-tensor absmax int8 (miniquant's)
_qt, _st = miniquant.quantize_absmax_int8(W)
_want = ((W - miniquant.dequantize_absmax_int8(_qt, _st)).norm() / W.norm()).item()
_check_error(W, 8, None, want=_want)
# case: the error across bit widths 2..8
_errs = [quant_error(W, bits=_b, group_size=64) for _b in range(2, 9)]
assert _errs == sorted(_errs, reverse=True), f"error should fall as bits grow, got {_errs}"
### END HIDDEN TESTS

# %% [markdown]
# ### Error against group size
#
# Small groups have small scales (a group's absmax is that of a few weights), so small errors;
# but each group carries a float32 scale. The plot sweeps the group size from 16 to 4096 at 4
# and 8 bits on the real weight and on a Gaussian matrix of the same shape and standard
# deviation.
#
# Two things to read off it. The step is $s = \text{absmax} / q_{max}$, so going from 4 to 8
# bits makes it $127 / 7 \approx 18$ times finer, and the 8-bit curves sit about 18 times
# lower at every group size. And the curves are not alike: a Gaussian
# group's absmax grows slowly with its size (like $\sqrt{2 \ln n}$), so its error creeps up;
# the real weight's error climbs faster once a group is longer than a row (128 weights, dashed
# line), because a group then mixes rows of different ranges (Part B's plot) and takes the
# widest one's scale.
#
# A check that we understand the error: if rounding errors are spread uniformly over
# $[-s/2, s/2]$, their mean square is $s^2/12$; the last lines print this prediction beside
# the measurement.

# %%
g = torch.Generator().manual_seed(0)
G = torch.randn(W.shape, generator=g) * W.std()          # Gaussian, same shape and std as W
group_sizes = [2 ** k for k in range(4, 13)]              # 16 ... 4096
errors = {(name, bits): [quant_error(M, bits, gs) for gs in group_sizes]
          for name, M in (("up_proj", W), ("Gaussian", G)) for bits in (4, 8)}

fig, ax = plt.subplots(figsize=(8, 4.5))
for (name, bits), errs in errors.items():
    ax.plot(group_sizes, errs, marker="o", ls="-" if name == "up_proj" else ":",
            color="tab:blue" if bits == 4 else "tab:orange", label=f"{name}, {bits} bits")
ax.axvline(W.shape[1], color="0.5", ls="--", lw=1)
ax.text(W.shape[1] * 1.05, 0.02, "one row", color="0.4")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("group size (weights per scale)")
ax.set_ylabel("relative error ‖W − Ŵ‖ / ‖W‖")
ax.set_title("Symmetric per-group quantization of blocks.0.mlp.up_proj.weight")
ax.legend()
plt.show()

for bits in (4, 8):
    q, s = quantize_symmetric_per_group(W, bits=bits, group_size=64)
    per_element = s.repeat_interleave(64)[: W.numel()]
    predicted = ((per_element ** 2 / 12).mean().sqrt() / W.pow(2).mean().sqrt()).item()
    print(f"{bits} bits, groups of 64: measured {quant_error(W, bits, 64):.5f}, "
          f"predicted from s²/12 {predicted:.5f}")

# %% [markdown]
# ### What it costs: bits per parameter
#
# The codes are not the whole storage: each group also stores its scale (float32 here, 32
# bits). Spread over the group, that adds $32 / \text{group size}$ bits to every weight:
# int8 with groups of 64 costs $8 + 32/64 = 8.5$ bits per parameter, int4 with groups of 64
# costs $4.5$. The table counts the storage exactly (codes at their nominal width, as if
# packed, plus one float32 per scale actually returned) and puts the error beside it. The
# two rows after it preview Lab 02: NF4 uses 4-bit codes on a non-uniform grid, and double
# quantization shrinks the scales themselves to 8 bits.

# %%
def scheme_row(name, bits, n_scales, err):
    return name, bits + 32 * n_scales / W.numel(), err


rows = [("float32", 32.0, 0.0),
        ("bfloat16", 16.0, ((W - W.bfloat16().float()).norm() / W.norm()).item()),
        scheme_row("int8 per tensor", 8, s_t.numel(), err_t),
        scheme_row("int8 per row", 8, s_r.numel(), err_r)]
for bits, gs in [(8, 64), (4, 32), (4, 64), (4, 128), (3, 64)]:
    n_scales = quantize_symmetric_per_group(W, bits, gs)[1].numel()
    rows.append(scheme_row(f"int{bits} groups of {gs}", bits, n_scales, quant_error(W, bits, gs)))

print(f"{'scheme':<42}{'bits/param':>11}{'rel. error':>12}")
for name, bpp, err in rows:
    print(f"{name:<42}{bpp:>11.3f}{err:>12.5f}")

# %% tags=["jupyter-only"]
for dq in (False, True):
    nf4 = miniquant.quantize_nf4(W, blocksize=64, double_quant=dq)
    name = f"NF4 blocks of 64{' + double quant' if dq else ''} (Lab 02)"
    print(f"{name:<42}{nf4.bits_per_param:>11.3f}"
          f"{((W - nf4.dequantize()).norm() / W.norm()).item():>12.5f}")


# %% [markdown]
# ## Part E — Exercise 4: outliers, and the levels they waste
#
# A group's scale is set by its single largest weight. If one weight is 20 times larger than
# the others, the scale is 20 times coarser, and the others crowd into the few levels around
# zero: most of the grid is never used. Let us count that waste.
#
# **Specification.** Write `wasted_fraction(q, bits, group_size)` which takes the **codes**
# of a per-group quantization (the `q` of Exercise 2: int8, any shape, same row-major groups)
# and returns, for each group, the fraction of the $2 q_{max} + 1$ levels that the group's
# *other* weights cannot reach because of its largest one:
#
# * let $k$ be the **second-largest** $|q|$ in the group (the largest $|q|$ after removing one
#   element of largest $|q|$; a group of a single element has $k = 0$);
# * the other weights all lie in the $2k + 1$ levels $-k, \dots, k$, so the wasted fraction is
#   $$ 1 - \frac{2k + 1}{2 q_{max} + 1} .$$
# * return a float32 tensor of shape `[n_groups]`, `n_groups = ceil(q.numel() / group_size)`;
#   the last group may be partial, and `group_size` may be 1.
#
# Without an outlier the two largest weights of a group are close, $k \approx q_{max}$, and
# almost nothing is wasted.
#
# <details><summary>Hint 1: the idea</summary>
#
# As in Exercise 2, pad the flat codes with zeros and make the groups the rows of a matrix: a
# padded zero never raises $k$. `torch.topk(..., 2)` or `torch.sort` along each row gives the
# two largest magnitudes, but `topk` with `k = 2` raises on a row of one element
# (`group_size=1`): one extra column of zeros gives every group a second element. Cast the
# codes to a wider integer or float type before `abs()`, to be safe.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# qmax   = 2**(bits-1) - 1
# mags   = |float(q)| flattened, padded with zeros to a multiple of group_size
# groups = mags as rows of group_size, plus one column of zeros
# k      = second largest of each row          (topk(2) along the row, take the second)
# return float32(1 - (2k + 1) / (2 qmax + 1))
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "wasted_fraction", "locked": false, "schema_version": 3, "solution": true, "task": false}
def wasted_fraction(q: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Per group: 1 − (2k + 1) / (2·qmax + 1), k = the second-largest |code| of the group."""
    ### BEGIN SOLUTION
    qmax = 2 ** (bits - 1) - 1
    flat = q.reshape(-1).float().abs()
    groups = torch.nn.functional.pad(flat, (0, -flat.numel() % group_size))
    groups = groups.reshape(-1, group_size)                       # [n_groups, group_size]
    # one more zero per group, so that a group of one element has a second largest: 0
    groups = torch.nn.functional.pad(groups, (0, 1))
    k = groups.topk(2, dim=1).values[:, 1]
    return 1 - (2 * k + 1) / (2 * qmax + 1)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_wasted_fraction", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _naive_wasted(q, bits, group_size):
    qmax = 2 ** (bits - 1) - 1
    flat = [abs(int(c)) for c in q.reshape(-1)]
    out = []
    for start in range(0, len(flat), group_size):
        mags = sorted(flat[start:start + group_size], reverse=True)
        k = mags[1] if len(mags) > 1 else 0
        out.append(1 - (2 * k + 1) / (2 * qmax + 1))
    return torch.tensor(out, dtype=torch.float32)


def _ks(q, group_size, magnitude=True):
    """Per group, its codes (|q| or signed) and one padding zero or more, largest first."""
    flat = q.reshape(-1).float()
    flat = flat.abs() if magnitude else flat
    groups = torch.nn.functional.pad(flat, (0, -flat.numel() % group_size))
    groups = torch.nn.functional.pad(groups.reshape(-1, group_size), (0, 1))
    return groups.sort(dim=1, descending=True).values


def _check_wasted(q, bits, group_size, want=None):
    call = f"wasted_fraction(q of shape {tuple(q.shape)}, bits={bits}, group_size={group_size})"
    want = _naive_wasted(q, bits, group_size) if want is None else want
    mags, signed = _ks(q, group_size), _ks(q, group_size, False)      # before your call
    got = wasted_fraction(q, bits, group_size)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, \
        f"{call}: expected a float32 tensor, got {getattr(got, 'dtype', type(got).__name__)}"
    assert got.shape == want.shape, \
        f"{call}: expected shape {tuple(want.shape)} (one value per group), got " \
        f"{tuple(got.shape)}" + (" (the last, partial group is missing)"
                                 if got.shape[0] == want.shape[0] - 1 else "")
    levels = 2 * (2 ** (bits - 1) - 1) + 1
    k = ((1 - got) * levels - 1) / 2                     # the k your values stand for
    why = (" (that k is the largest |code| of each group, the outlier itself: k is the "
           "second largest)" if torch.allclose(k, mags[:, 0], atol=1e-3) else
           " (that k comes from signed codes: take magnitudes |q|, a large negative code "
           "counts too)" if torch.allclose(k, signed[:, 1], atol=1e-3)
           else "")
    torch.testing.assert_close(got, want, msg=lambda m: f"{call}{why}:\n{m}")


# worked by hand, 8 bits (255 levels), groups of 4:
# group 1 [127, 1, -1, 0]: the others reach only -1..1       -> k = 1,   1 - 3/255
# group 2 [-127, 120, 3, 0]: no outlier, the grid is used    -> k = 120, 1 - 241/255
# group 3 [5]: a partial group of one element                -> k = 0,   1 - 1/255
_check_wasted(torch.tensor([127, 1, -1, 0, -127, 120, 3, 0, 5], dtype=torch.int8), 8, 4,
              want=torch.tensor([1 - 3 / 255, 1 - 241 / 255, 1 - 1 / 255]))
# two weights share the largest magnitude: nothing is wasted
_check_wasted(torch.tensor([[-7, 2], [7, 0]], dtype=torch.int8), 4, 4, want=torch.tensor([0.0]))
# real codes, with one outlier injected
_w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
_w[2, 5] = 30.0
_q, _ = _naive_per_group(_w, bits=8, group_size=32)
_check_wasted(_q, 8, 32)
# group_size 1: every group has one element, so k = 0 everywhere
try:
    _check_wasted(torch.tensor([2, -1, 3, 0], dtype=torch.int8), 3, 1,
                  want=torch.full((4,), 1 - 1 / 7))
except RuntimeError as _e:
    raise AssertionError(f"wasted_fraction(..., group_size=1) failed: {_e}. A group of one "
                         "element has no second-largest |code| (k = 0); topk(2) needs a "
                         "second element, such as one padded zero") from _e
print("wasted_fraction matches the hand-worked cases and a loop over groups")

### BEGIN HIDDEN TESTS
# case: bit widths, shapes and group sizes (partial groups, size 1, one group)
_g = torch.Generator().manual_seed(5)
for _bits in (2, 4, 8):
    for _shape, _gs in [((1,), 64), ((65,), 64), ((5, 13), 8), ((3, 4, 9), 7), ((10, 10), 1),
                        ((10, 10), 1000)]:
        _w = torch.randn(*_shape, generator=_g)
        _check_wasted(miniquant.quantize_symmetric_per_group(_w, _bits, _gs)[0], _bits, _gs)
# case: an all-zero group
_check_wasted(torch.zeros(8, dtype=torch.int8), 3, 8, want=torch.tensor([1 - 1 / 7]))
# case: group_size 1 at 3 bits
_check_wasted(torch.tensor([3, -3, 1], dtype=torch.int8), 3, 1,
              want=torch.full((3,), 1 - 1 / 7))
# case: the real weight with one outlier injected
_wo = W.clone()
_wo[3, 17] = 20 * W.abs().max()
_q, _ = miniquant.quantize_symmetric_per_group(_wo, bits=8, group_size=64)
_check_wasted(_q, 8, 64)
_frac = wasted_fraction(_q, 8, 64)
_hit = (3 * W.shape[1] + 17) // 64
assert _frac[_hit] > 0.9 and _frac.argmax() == _hit, \
    f"the outlier's group ({_hit}) should waste > 90% of its levels and the most; got " \
    f"{_frac[_hit]:.3f}, largest at group {_frac.argmax().item()}"
### END HIDDEN TESTS

# %% [markdown]
# ### One outlier, three ways to share scales
#
# Real networks have outliers: a few values far larger than the rest (LLM.int8() found hidden
# features up to about 20× larger than the others in large models; weight matrices have
# milder outliers of their own). Below we put one weight of growing
# size into our matrix, at row 3, column 17, and quantize with one scale per tensor, per row,
# and per group of 64.
#
# We measure the error **on the other weights only**: the outlier itself is quantized almost
# exactly (it *is* the absmax), and because it dominates $\lVert W \rVert$, including it would
# make every scheme look good.
#
# * **Per tensor**, the error grows in proportion to the outlier: at 100× the whole matrix
#   rounds to zero (error near 1).
# * **Per row**, only the outlier's 127 row-mates suffer; **per group of 64**, only its 63
#   group-mates. Their error grows until those few weights all round to zero, then stops:
#   the damage is capped by the size of the row or group (about 1/448 or 1/896 of the
#   matrix), not by the size of the outlier.
# * At 4 bits with groups of 64 the curve barely moves: the ordinary rounding error of 4 bits
#   is already larger than what one lost group adds.
# * The right panel shows why: the outlier's group wastes nearly all of its levels, every
#   other group almost none. With one scale for the tensor, every weight is in "the outlier's
#   group".
#
# That is why NF4 (Lab 02), like bitsandbytes and QLoRA, quantizes in **blocks of 64**: an
# outlier can damage at most 63 neighbours, and 64 is small enough to keep the error low while
# the scale costs only 0.5 bit per weight (0.127 with double quantization).

# %%
factors = [1, 2, 5, 10, 20, 50, 100]
outlier_at = (3, 17)
others = torch.ones(W.shape, dtype=torch.bool)
others[outlier_at] = False


def error_on_others(w, deq):
    return ((w - deq)[others].norm() / w[others].norm()).item()


curves = {"int8 per tensor": [], "int8 per row": [], "int8 groups of 64": [],
          "int4 groups of 64": []}
wasted_in_group, wasted_elsewhere = [], []
for f in factors:
    Wo = W.clone()
    Wo[outlier_at] = f * W.abs().max()
    curves["int8 per tensor"].append(error_on_others(Wo, dequantize_absmax_int8(
        *quantize_absmax_int8(Wo))))
    curves["int8 per row"].append(error_on_others(Wo, dequantize_absmax_int8(
        *quantize_absmax_int8(Wo, dim=-1))))
    for bits in (8, 4):
        q, s = quantize_symmetric_per_group(Wo, bits=bits, group_size=64)
        curves[f"int{bits} groups of 64"].append(
            error_on_others(Wo, dequantize_symmetric_per_group(q, s, group_size=64)))
        if bits == 8:
            frac = wasted_fraction(q, 8, 64)
            hit = (outlier_at[0] * W.shape[1] + outlier_at[1]) // 64
            wasted_in_group.append(frac[hit].item())
            wasted_elsewhere.append(torch.cat([frac[:hit], frac[hit + 1:]]).mean().item())

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
for name, errs in curves.items():
    ax1.plot(factors, errs, marker="o", label=name)
ax1.set_xscale("log")
ax1.set_yscale("log")
ax1.set_xlabel("outlier size (× the matrix's original absmax)")
ax1.set_ylabel("relative error on the other weights")
ax1.set_title("One outlier in blocks.0.mlp.up_proj")
ax1.legend()
ax2.plot(factors, wasted_in_group, marker="o", color="tab:red", label="the outlier's group")
ax2.plot(factors, wasted_elsewhere, marker="o", color="tab:green",
         label="every other group (mean)")
ax2.set_xscale("log")
ax2.set_ylim(0, 1)
ax2.set_xlabel("outlier size (× the matrix's original absmax)")
ax2.set_ylabel("wasted fraction of the 255 levels")
ax2.set_title("int8, groups of 64: levels the outlier's neighbours cannot use")
ax2.legend()
plt.show()

print(f"{'outlier':>8}" + "".join(f"{name:>20}" for name in curves))
for i, f in enumerate(factors):
    print(f"{f:>7}x" + "".join(f"{curves[name][i]:>20.4f}" for name in curves))

# %% [markdown]
# ## Where this goes next
#
# You can now quantize any weight to 2..8 bits with one scale per tensor, row or group, and
# you have seen the trade: smaller groups mean smaller error and fewer weights hurt by an
# outlier, at the price of more scales to store. Two things remain wasteful. The uniform grid
# spends as many levels on the rare large weights as on the crowd near zero, although
# weights are roughly normal; and a float32 scale every 64 weights adds half a bit. Lab 02
# answers both with NF4 — 16 levels placed at the quantiles of a normal distribution — and
# double quantization of the scales, bit-for-bit with bitsandbytes.
#
# ### Reflection
#
# 1. Symmetric quantization gives up one level (−128 at 8 bits, −8 at 4 bits) and assumes the
#    weights are centred on zero. What does an *asymmetric* scheme (a scale and a zero point
#    per group) gain on a group whose weights all lie in [0.1, 0.5]? Why is that rare for
#    weights of a trained linear layer, and common for activations after a ReLU?
# 2. With half-to-even rounding, 0.5 → 0 and 1.5 → 2. Construct a set of weights on which
#    "round half up" would bias the mean of the dequantized weights, and say why
#    half-to-even does not.
# 3. From the table: int4 with groups of 32 costs about as many bits as int5 with no
#    per-group scales would. Which would you expect to have the smaller error on this weight,
#    and why? Check it with `quant_error`.
# 4. The real weight's error grew faster than the Gaussian's once groups were longer than a
#    row. Would grouping along columns (transpose first) be better or worse here? What would
#    you check before choosing a group direction for a real model?
# 5. An outlier of 100× destroys its group of 64. Suggest a way to keep that weight exact
#    without giving up groups of 64 (LLM.int8() and SpQR each do a version of it), and
#    estimate what it costs in bits per parameter.

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. A symmetric grid for that group spans $[-0.5, 0.5]$, and the weights only reach codes
#    from about $0.2\,q_{max}$ to $q_{max}$: at 8 bits roughly 100 of the 255 levels. A scale
#    plus a zero point maps $[0.1, 0.5]$ onto all 256 levels, a step about 2.5 times finer,
#    for one extra number per group. Trained linear weights are close to zero-mean (the
#    up-projection has std 0.059 around 0), so their groups straddle zero and the zero
#    point buys little; after a ReLU every activation is $\ge 0$, and a symmetric grid
#    leaves its whole negative half, one bit, unused.
# 2. With absmax 7 at 4 bits the scale is exactly 1, so the weights
#    $[0.5, 1.5, 2.5, 3.5, 7]$ sit on ties. Round half up gives codes $[1, 2, 3, 4, 7]$:
#    every tie moves up by 0.5, and the mean of the dequantized weights rises by 0.4.
#    Half-to-even gives $[0, 2, 2, 4, 7]$: the ties move down, up, down, up, and the mean is
#    unchanged. Over many ties the even neighbour is above as often as below, so the errors
#    cancel on average instead of adding up over millions of weights.
# 3. Both cost 5.0 bits per parameter. int5 per tensor halves the step of int4 but must
#    cover the tensor's absmax (0.311); a group of 32 has an absmax of about 0.13, so its
#    4-bit step is about as fine, and no outlier elsewhere in the matrix can widen it.
#    Measured: `quant_error(W, 4, 32)` = 0.0947 against `quant_error(W, 5, None)` = 0.1012, a
#    small win for the groups; on a weight with outliers the gap would be much larger.
# 4. Worse at small groups: at int4 with groups of 64, quantizing `W.T` gives 0.119 instead
#    of 0.105, because the rows of `up_proj` have different ranges (Part B's plot) and a
#    group running down a column mixes 64 of them, taking the widest one's scale. Before
#    choosing, measure how the absmax varies along each axis of the real layers and the
#    error in both directions, and check which axis the matrix-multiply kernel reads
#    contiguously, since the groups have to follow the layout it dequantizes.
# 5. Store the outlier apart, as an (index, value) pair in a sparse side table, and set it
#    to 0 in the dense matrix before quantizing, so that its group's scale is that of the
#    other 63 weights; at dequantization, add the stored value back. SpQR does this for
#    individual weights, LLM.int8() for whole feature columns in float16. With a 32-bit
#    index and a 16-bit value, one outlier per 10 000 weights costs
#    $48 / 10\,000 \approx 0.005$ bits per parameter, against a group error that grows from
#    0.0058 to 0.0327 (int8, groups of 64) at 100× in the table above.
