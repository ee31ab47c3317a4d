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
# # Lab 04 — LoRA from scratch, interchangeable with PEFT
#
# Fine-tuning every weight of a model costs, per weight, the weight itself, its gradient and
# two AdamW moments: 16 bytes a parameter in float32, about 112 GB for a 7-billion-parameter
# model before a single activation is stored. **LoRA** (Hu et al., 2021) freezes the weight
# $W$ `[out, in]` of a linear layer and trains a low-rank update beside it,
#
# $$ y = x W^\top + b + s \cdot (x A^\top) B^\top, \qquad A\ [r, \text{in}],\quad
#    B\ [\text{out}, r],\quad r \ll \text{in}, \text{out}, $$
#
# so a layer trains $r \cdot (\text{in} + \text{out})$ numbers instead of
# $\text{in} \cdot \text{out}$. In this lab you build the layer, a backward pass that never
# forms the `[out, in]` product $B A$, merging, the rule that picks which layers to adapt, and
# the adapter files that Hugging Face [PEFT](https://github.com/huggingface/peft) reads and
# writes; each piece is checked against the course's reference package `minituner` and against
# PEFT itself.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `MyLoRALinear`: initialisation, scaling, forward | `minituner.LoRALinear` and PEFT's `lora.Linear` |
# | 2 | `LoRAMatmul`: an autograd Function with a hand-written backward | `gradcheck` in float64; no `[out, in]` tensor anywhere (recorded) |
# | 3 | `delta_weight`, `merge`, `unmerge` | a round trip to 1e-6; refusing an NF4 base |
# | 4 | `wrap(model, target_modules, ...)`, `count_trainable(model)` | PEFT's `target_modules` rule and its parameter count |
# | 5 | `save_peft_adapter`, `load_peft_adapter` | `PeftModel.from_pretrained` gives the same logits, both ways |
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification —
# other shapes, ranks, dtypes, and checks that your code does not call `minituner` or PEFT to
# do the work. Each exercise states its **specification** first (inputs, outputs, the rules
# that matter, what is off-limits), which is enough to solve it; below it, folded **hints** go
# from the idea to pseudocode, for when you want them. No GPU is needed: the whole notebook
# runs in <!-- runtime:04-lora -->about 14 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import copy
import json
import logging
import math
import re
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import safetensors.torch
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# miniquant imports bitsandbytes, which logs a warning about an optional CPU kernel package.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import peft  # noqa: E402

import minigpt  # noqa: E402
import miniquant  # noqa: E402
import minituner  # noqa: E402
from course.notebook.harness import forbid, randn, reference  # noqa: E402
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks  # noqa: E402

torch.set_num_threads(1)   # small matrices: one thread is faster than several on a busy CPU
torch.manual_seed(0)
print("torch", torch.__version__, "| peft", peft.__version__,
      "| threads:", torch.get_num_threads())


SMALL = MiniGPTConfig(n_layer=2, n_head=2, n_embd=32, d_ff=48, block_size=16)


def small_gpt(seed=0) -> MiniGPT:
    """A tiny random MiniGPT (2 blocks, width 32): what the tests wrap and save."""
    torch.manual_seed(seed)
    return MiniGPT(SMALL).eval()


def randomize_lora(model: nn.Module, seed=1, std=0.1) -> None:
    """Give every lora_A / lora_B parameter random values, so that the adapter does something
    (a fresh one does nothing: B is zero). Works on your models and on PEFT's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


class _Holder(nn.Module):
    """A one-layer model, so that PEFT can wrap a single linear layer."""

    def __init__(self, layer):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


def peft_linear(base: nn.Linear, r, alpha, dropout=0.0, use_rslora=False, A=None, B=None):
    """PEFT's lora.Linear over a copy of `base` (optionally with the given factors)."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, use_rslora=use_rslora,
                          target_modules=["proj"])
    layer = peft.get_peft_model(_Holder(copy.deepcopy(base)), cfg).base_model.model.proj
    with torch.no_grad():
        if A is not None:
            layer.lora_A["default"].weight.copy_(A)
        if B is not None:
            layer.lora_B["default"].weight.copy_(B)
    return layer


# %% [markdown]
# ### PEFT's layer, for a first look
#
# PEFT replaces a targeted `nn.Linear` with its own `lora.Linear`, which keeps the original
# layer as `base_layer` and holds the factors in dictionaries keyed by an *adapter name*
# (`"default"` unless you choose one), because one layer can carry several adapters. Its
# `lora_A` and `lora_B` are themselves bias-free `nn.Linear` layers: `lora_A` maps `in → r`,
# so its weight is `[r, in]`; `lora_B` maps `r → out`, weight `[out, r]`.

# %%
demo = peft_linear(nn.Linear(40, 24), r=4, alpha=8)
print(demo)
print("scaling:", demo.scaling, "| trainable:",
      [(n, tuple(p.shape)) for n, p in demo.named_parameters() if p.requires_grad])
print("B at initialisation is all zero:", bool((demo.lora_B["default"].weight == 0).all()))

# %% [markdown]
# ## Part A — Exercise 1: the LoRA layer
#
# **Specification.** Write `MyLoRALinear(base, r=8, alpha=16.0, dropout=0.0,
# use_rslora=False)`, an `nn.Module` around a frozen `nn.Linear`:
#
# * raise `ValueError` unless `r` is a positive `int` (not a `bool`, not a float);
# * keep `base` (the `nn.Linear` you were given, the same object) as `self.base` and
#   **freeze** its parameters (`requires_grad = False`);
# * store `self.r`, `self.alpha`, `self.use_rslora` and `self.scaling`, a Python float:
#   $s = \alpha / r$, or $s = \alpha / \sqrt{r}$ with `use_rslora=True`;
# * `self.lora_A`: an `nn.Parameter` `[r, in]` drawn uniform on
#   $[-1/\sqrt{\text{in}},\ 1/\sqrt{\text{in}}]$ (PyTorch's `nn.Linear` initialisation,
#   `nn.init.kaiming_uniform_(A, a=math.sqrt(5))`); `self.lora_B`: an `nn.Parameter`
#   `[out, r]` of **zeros**; both with the **dtype and device of `base.weight`** (as PEFT
#   does);
# * `self.dropout`: `nn.Dropout(dropout)` when `dropout > 0`, else `nn.Identity()`;
# * `self.merged = False` (Exercise 3 sets it);
# * `forward(x)` for `x` of shape `[..., in]` → `[..., out]`: when `self.merged` is true,
#   `self.base(x)` alone (the update is then inside the base weight); otherwise
#   `base(x) + scaling · (dropout(x) · Aᵀ) · Bᵀ`, with the parentheses where they are: never
#   form `B·A` (the next exercise says why). Dropout acts on the input of the **LoRA path
#   only**, in training mode only: the frozen base sees the undropped $x$.
#
# Off-limits: `minituner.LoRALinear` and PEFT (the tests switch them off while they build and
# call your layer).
#
# **Why these choices.** $B$ starts at zero, so $\Delta W = s\,BA = 0$ and a fresh adapter
# leaves the model exactly as it was: fine-tuning starts from the pretrained model, not from a
# perturbed one. $A$ starts random; `kaiming_uniform_` with `a = √5` hides a simple
# distribution: the gain for `a = √5` is $\sqrt{2/(1+a^2)} = \sqrt{1/3}$, so the bound is
# $\sqrt{1/3}\cdot\sqrt{3/\text{fan\_in}} = 1/\sqrt{\text{in}}$. Why not both at zero? The
# gradients (you derive them in Exercise 2) are $dB = s\, dY^\top (x A^\top)$ and
# $dA = s\,(dY\, B)^\top x$. With $A = B = 0$ both vanish and training never starts. With
# $B = 0$ and $A$ random, $dB \ne 0$ at the first step, and $A$ starts moving from the second.
#
# The scaling $s = \alpha / r$ lets you change $r$ at a fixed $\alpha$ without re-tuning the
# learning rate much — in the original paper's Adam setting. With **rsLoRA** (Kalajdzievski,
# 2023, `use_rslora=True` in PEFT) $s = \alpha / \sqrt{r}$: the paper shows that with
# $\alpha/r$ the updates shrink as the rank grows, so large ranks learn slower than they
# should, and that $\alpha/\sqrt{r}$ keeps learning stable across ranks. **Dropout**
# (`lora_dropout` in PEFT) regularises the update, not the pretrained model.
#
# <details><summary>Hint 1: the idea</summary>
#
# Read the shapes off `base.weight`, which is `[out, in]`. Create each factor with
# `torch.empty` / `torch.zeros` and `dtype=base.weight.dtype, device=base.weight.device`,
# wrap it in `nn.Parameter`, and initialise `lora_A` in place with `nn.init`.
# `base.requires_grad_(False)` freezes the weight and the bias at once. In the forward,
# `t.t()` transposes a factor; `@` broadcasts over the leading dimensions of `x`, so
# `[..., in]` inputs need no reshaping.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# __init__(base, r, alpha, dropout, use_rslora):
#     r not a positive int (bool excluded) -> ValueError
#     freeze base;  self.base = base;  store r, alpha, use_rslora
#     self.scaling = alpha / sqrt(r) if use_rslora else alpha / r
#     out, in = base.weight.shape
#     self.lora_A = Parameter(empty(r, in)),  kaiming_uniform_(a=sqrt(5))   # base's dtype, device
#     self.lora_B = Parameter(zeros(out, r))                                 # base's dtype, device
#     self.dropout = Dropout(dropout) if dropout > 0 else Identity();  self.merged = False
#
# forward(x):
#     if merged: return base(x)
#     return base(x) + scaling * ((dropout(x) @ lora_Aᵀ) @ lora_Bᵀ)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "lora_layer", "locked": false, "schema_version": 3, "solution": true, "task": false}
class MyLoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable rank-r update: y = base(x) + s·(drop(x)·Aᵀ)·Bᵀ."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 use_rslora: bool = False):
        super().__init__()
        ### BEGIN SOLUTION
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"r must be a positive int, got {r!r}")
        base.requires_grad_(False)
        self.base = base
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, w.shape[1], dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], r, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        if self.merged:
            return self.base(x)
        return self.base(x) + self.scaling * ((self.dropout(x) @ self.lora_A.t())
                                              @ self.lora_B.t())
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_lora_init", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import (
    fetch_dir,
    in_learner,
    is_instance,
    is_subclass,
    learner_dir,
    send_dir,
    share,
)
from course.notebook.forbid import bindings

_WHY = "this exercise must be done without the reference (minituner) or PEFT"
# each reference as an (owner, name) pair where it is bound: forbid swaps every binding of it
_REFERENCE = [next((o, n) for o, n in bindings(obj) if not isinstance(o, dict))
              for obj in reference("04-lora").values()] + [
    (peft, "get_peft_model"), (peft, "LoraConfig"), (peft.PeftModel, "from_pretrained"),
    (peft.PeftModel, "save_pretrained")]


def _forbid_reference():
    """While the block runs, minituner's LoRA code and PEFT's entry points raise if called
    (also through names the notebook imported from them)."""
    return forbid(_REFERENCE, globals(), why=_WHY)


def _randomize(model, seed=1, std=0.1):
    """randomize_lora's values, loaded with load_state_dict (also into a model your code
    holds)."""
    g = torch.Generator().manual_seed(seed)
    new = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) * std
           for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n}
    model.load_state_dict(new, strict=False)


def _check_init(n_in, n_out, r, alpha, use_rslora=False, dtype=torch.float32, bias=True, what=""):
    where = f"{what}MyLoRALinear(nn.Linear({n_in}, {n_out}), r={r}, alpha={alpha}" \
            f"{', use_rslora=True' if use_rslora else ''}) over {dtype}"
    torch.manual_seed(r + n_in)
    base = share(nn.Linear(n_in, n_out, bias=bias, dtype=dtype))   # held where your code runs
    w0 = base.weight.detach().clone()
    with _forbid_reference():
        layer = MyLoRALinear(base, r=r, alpha=alpha, use_rslora=use_rslora)
    want_s = alpha / (math.sqrt(r) if use_rslora else r)
    assert layer.base is base, f"{where}: self.base should be the layer you were given " \
                               f"(the same object, not a copy)"
    assert isinstance(layer.scaling, float) and math.isclose(layer.scaling, want_s), \
        f"{where}: expected scaling {want_s!r} (alpha / {'sqrt(r)' if use_rslora else 'r'}), " \
        f"got {layer.scaling!r}"
    for name, p, shape in (("lora_A", layer.lora_A, (r, n_in)), ("lora_B", layer.lora_B,
                                                                  (n_out, r))):
        assert isinstance(p, nn.Parameter) and p.shape == shape and p.dtype == dtype, \
            f"{where}: {name} should be an nn.Parameter of shape {shape} and dtype {dtype}, got " \
            f"{type(p).__name__} {tuple(getattr(p, 'shape', ()))} {getattr(p, 'dtype', '')}"
    assert torch.equal(layer.lora_B, torch.zeros_like(layer.lora_B)), \
        f"{where}: lora_B must start at zero (got max |B| = {layer.lora_B.abs().max().item():.3g})"
    trainable = sorted(n for n, p in layer.named_parameters() if p.requires_grad)
    assert trainable == ["lora_A", "lora_B"], \
        f"{where}: only lora_A and lora_B may be trainable; trainable parameters: {trainable}"
    assert torch.equal(base.weight, w0), f"{where}: building the layer changed the base weight"
    assert layer.merged is False, f"{where}: self.merged should start False"
    return layer


def _check_a_distribution(n_in, r, what=""):
    layer = _check_init(n_in, 8, r, alpha=2 * r, what=what)
    a = layer.lora_A.detach().double()
    bound = 1 / math.sqrt(n_in)
    where = f"{what}lora_A of MyLoRALinear(nn.Linear({n_in}, 8), r={r})"
    assert a.abs().max() <= bound * (1 + 1e-6), \
        f"{where}: expected every entry in [-1/sqrt(in), 1/sqrt(in)] = ±{bound:.5f} " \
        f"(kaiming_uniform_ with a=sqrt(5)); got max |A| = {a.abs().max().item():.5f}"
    want_std = bound / math.sqrt(3)
    assert abs(a.std().item() - want_std) < 0.06 * want_std, \
        f"{where}: expected the std of U(-b, b), b/sqrt(3) = {want_std:.5f}; got " \
        f"{a.std().item():.5f} (a constant or a normal init does not fit)"
    assert abs(a.mean().item()) < 0.05 * bound, \
        f"{where}: expected mean ≈ 0, got {a.mean().item():.5f}"


_layer = _check_init(40, 24, r=4, alpha=16.0)
_check_init(40, 24, r=4, alpha=8.0, use_rslora=True)
_check_a_distribution(256, r=64)
# a float64 base: the factors take the base weight's dtype
try:
    _check_init(12, 10, r=2, alpha=4.0, dtype=torch.float64, what="float64 base: ")
except (AssertionError, RuntimeError) as _e:
    raise AssertionError(f"{_e}\nRule: create lora_A and lora_B with dtype=base.weight.dtype "
                         "and device=base.weight.device") from _e
# a rank that is not a positive int
try:
    with _forbid_reference():
        MyLoRALinear(nn.Linear(8, 8), r=0)
except ValueError:
    pass
except Exception as _e:
    raise AssertionError(f"MyLoRALinear(nn.Linear(8, 8), r=0) raised {type(_e).__name__}: {_e}"
                         "\nRule: check r first and raise ValueError unless it is a positive "
                         "int") from _e
else:
    raise AssertionError("MyLoRALinear(nn.Linear(8, 8), r=0) should raise ValueError (rule: r "
                         "must be a positive int)")
# a fresh adapter is the identity on the base layer's output
_x = randn(2, 3, 40, seed=1)
_got = _layer(_x)
assert isinstance(_got, torch.Tensor) and _got.shape == (2, 3, 24), \
    f"forward on x [2, 3, 40]: expected shape (2, 3, 24), got {tuple(getattr(_got, 'shape', ()))}"
assert torch.equal(_got, _layer.base(_x)), \
    f"a fresh adapter must leave the output unchanged (B = 0); max difference " \
    f"{(_got - _layer.base(_x)).abs().max().item():.3g}"
print("MyLoRALinear: shapes, dtypes, frozen base, B = 0, A ~ U(±1/sqrt(in)), alpha/r and "
      "alpha/sqrt(r) all as specified")

### BEGIN HIDDEN TESTS
# case: a base without bias
_check_init(13, 7, r=3, alpha=5.0, bias=False, what="hidden: ")
# case: rsLoRA with a large rank, out > in
_check_init(17, 33, r=16, alpha=8.0, use_rslora=True, what="hidden: ")
# case: rank 1
_check_init(9, 5, r=1, alpha=1.0, what="hidden: ")
# case: a float64 base, and its forward
_l64 = _check_init(12, 10, r=2, alpha=4.0, dtype=torch.float64, what="hidden: ")
_x64 = randn(3, 12, seed=2, dtype=torch.float64)
assert _l64(_x64).dtype == torch.float64 and torch.equal(_l64(_x64), _l64.base(_x64)), \
    "hidden: a float64 base should give float64 factors and an unchanged float64 output"
# case: the distribution of lora_A for a wide layer
_check_a_distribution(1000, r=16, what="hidden: ")
# case: two layers drawn one after the other, and the dropout module
_l1, _l2 = MyLoRALinear(nn.Linear(20, 6), r=4), MyLoRALinear(nn.Linear(20, 6), r=4)
assert not torch.equal(_l1.lora_A, _l2.lora_A), "hidden: two fresh layers got the same lora_A"
assert isinstance(_l1.dropout, nn.Identity), \
    f"hidden: dropout=0 should give nn.Identity(), got {_l1.dropout}"
_ld = MyLoRALinear(nn.Linear(20, 6), r=4, dropout=0.25)
assert isinstance(_ld.dropout, nn.Dropout) and _ld.dropout.p == 0.25, \
    f"hidden: dropout=0.25 should give nn.Dropout(p=0.25), got {_ld.dropout}"
# case: more ranks that are not positive ints
for _r in (0, -2, 2.5, "4"):
    try:
        MyLoRALinear(nn.Linear(8, 8), r=_r)
    except ValueError:
        pass
    else:
        raise AssertionError(f"hidden: MyLoRALinear(..., r={_r!r}) should raise ValueError")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_lora_forward", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _twin_layers(n_in, n_out, r, alpha, dropout=0.0, use_rslora=False, bias=True, seed=0,
                 with_ref=False):
    """Yours and PEFT's layer over copies of one base, with one random A and B (with_ref:
    minituner's too, in the middle; None otherwise)."""
    torch.manual_seed(seed)
    base = nn.Linear(n_in, n_out, bias=bias)
    A, B = randn(r, n_in, seed=seed + 1) * 0.3, randn(n_out, r, seed=seed + 2) * 0.3
    with _forbid_reference():
        mine = MyLoRALinear(copy.deepcopy(base), r=r, alpha=alpha, dropout=dropout,
                            use_rslora=use_rslora)
    ref = None
    if with_ref:
        ref = minituner.LoRALinear(copy.deepcopy(base), r=r, alpha=alpha, dropout=dropout,
                                   use_rslora=use_rslora)
        ref.load_state_dict({"lora_A": A, "lora_B": B}, strict=False)
    theirs = peft_linear(base, r, alpha, dropout, use_rslora, A, B)
    mine.load_state_dict({"lora_A": A, "lora_B": B}, strict=False)
    return mine, ref, theirs


def _dense_lora(x, W, b, A, B, s):
    """base(x) + s·(x·Aᵀ)·Bᵀ the textbook way, in float64: x·(W + s·B·A)ᵀ + b, then cast to
    x's dtype (the dense [out, in] product, not the factored one the layer computes)."""
    W_eff = W.double() + s * (B.double() @ A.double())               # [out, in]
    y = x.double() @ W_eff.t()                                       # [..., out]
    return (y if b is None else y + b.double()).to(x.dtype)


def _check_forward(n_in, n_out, r, alpha, x_shape, use_rslora=False, bias=True, what="",
                   with_ref=False):
    where = f"{what}in={n_in}, out={n_out}, r={r}, alpha={alpha}, rslora={use_rslora}, " \
            f"x {tuple(x_shape)}"
    mine, ref, theirs = _twin_layers(n_in, n_out, r, alpha, use_rslora=use_rslora, bias=bias,
                                     with_ref=with_ref)
    x = randn(*x_shape, seed=3)
    # expectations first: the dense float64 formula, with s = alpha / r or alpha / sqrt(r)
    s = alpha / (math.sqrt(r) if use_rslora else r)
    base = theirs.base_layer
    with torch.no_grad():
        want = _dense_lora(x, base.weight, base.bias, theirs.lora_A["default"].weight,
                           theirs.lora_B["default"].weight, s)
        want_peft = theirs(x)
        want_ref = ref(x) if ref is not None else None
    with _forbid_reference():
        got = mine(x)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, \
        f"{where}: expected output shape {tuple(want.shape)}, got " \
        f"{tuple(getattr(got, 'shape', ()))}"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: (
        f"{where}: your forward differs from base(x) + s·(x·Aᵀ)·Bᵀ with s = {s!r} "
        f"(computed densely in float64 as x·(W + s·B·A)ᵀ + b):\n{m}"))
    if want_ref is not None:
        torch.testing.assert_close(got, want_ref, rtol=1e-5, atol=1e-5, msg=lambda m: (
            f"{where}: your forward differs from minituner.LoRALinear's:\n{m}"))
    torch.testing.assert_close(got, want_peft, rtol=1e-5, atol=1e-5, msg=lambda m: (
        f"{where}: your forward differs from PEFT's lora.Linear:\n{m}"))
    return mine, theirs


_check_forward(40, 24, 4, 8.0, (2, 5, 40))
# dropout: only on the LoRA path, only in training mode; same RNG draws as PEFT
_mine, _, _theirs = _twin_layers(40, 24, 4, 8.0, dropout=0.5)
_x = randn(6, 40, seed=4)
_mine.eval()
_theirs.eval()
torch.testing.assert_close(_mine(_x), _theirs(_x), rtol=1e-5, atol=1e-5,
                           msg=lambda m: f"dropout 0.5, eval mode (no dropout):\n{m}")
_mine.train()
_theirs.train()
torch.manual_seed(7)
_y_mine = _mine(_x)
torch.manual_seed(7)
_y_theirs = _theirs(_x)
torch.testing.assert_close(_y_mine, _y_theirs, rtol=1e-5, atol=1e-5, msg=lambda m: (
    f"dropout 0.5 in training mode, same seed: yours differs from PEFT's (apply self.dropout "
    f"to the input x of the LoRA path, once):\n{m}"))
_mine.load_state_dict({"lora_B": torch.zeros(24, 4)}, strict=False)
torch.manual_seed(7)
_d = (_mine(_x) - _mine.base(_x)).abs().max().item()
assert _d == 0, f"with B = 0 and dropout in training mode, the output must equal base(x) " \
                f"exactly (dropout belongs on the LoRA path only); max difference {_d:.3g}"
# a layer marked merged: the update is inside the base weight already
_mine, _, _ = _twin_layers(40, 24, 4, 8.0, seed=1)
_mine.merged = True
_d = (_mine(_x) - _mine.base(_x)).abs().max().item()
assert _d == 0, f"with self.merged = True the forward must return base(x) alone (the update is " \
                f"already inside the weight); max difference {_d:.3g}"
print("MyLoRALinear.forward matches minituner.LoRALinear and PEFT, dropout included")

### BEGIN HIDDEN TESTS
# case: a base without bias, 2-D x
_check_forward(13, 7, 3, 5.0, (4, 13), bias=False, what="hidden: ", with_ref=True)
# case: rsLoRA, 4-D x
_check_forward(17, 33, 16, 8.0, (2, 3, 2, 17), use_rslora=True, what="hidden: ",
               with_ref=True)
# case: rank 1, 1-D x
_check_forward(9, 5, 1, 1.0, (9,), what="hidden: 1-D x, ", with_ref=True)
# case: a layer marked merged
_mine, _, _ = _twin_layers(12, 10, 2, 4.0)
_mine.merged = True
_x = randn(3, 12, seed=5)
assert torch.equal(_mine(_x), _mine.base(_x)), "hidden: with merged = True, return base(x)"
_mine.merged = False
# case: which parameters a backward reaches
_mine(_x).square().sum().backward()
assert _mine.lora_A.grad is not None and _mine.lora_B.grad is not None, \
    "hidden: lora_A and lora_B got no gradient"
assert _mine.base.weight.grad is None and _mine.base.bias.grad is None, \
    "hidden: the frozen base got a gradient"
### END HIDDEN TESTS

# %% [markdown]
# ### Why A is random and B is zero, measured
#
# One backward pass through a fresh layer, and through a layer with both factors at zero. With
# $B = 0$ the gradient of $A$ is zero at the first step ($dA = s\,(dY B)^\top x$), but that of
# $B$ is not; after one step $B \ne 0$ and $A$ moves too. With both at zero, nothing ever
# moves.

# %%
def first_step_grads(zero_a):
    torch.manual_seed(0)
    layer = MyLoRALinear(nn.Linear(64, 32), r=8, alpha=16.0)
    if zero_a:
        with torch.no_grad():
            layer.lora_A.zero_()
    x, target = randn(16, 64, seed=1), randn(16, 32, seed=2)
    (layer(x) - target).square().mean().backward()
    return layer.lora_A.grad.norm().item(), layer.lora_B.grad.norm().item()


for label, zero_a in (("A random, B = 0 (LoRA)", False), ("A = 0,    B = 0", True)):
    ga, gb = first_step_grads(zero_a)
    print(f"{label:<24} |dL/dA| = {ga:.4f}   |dL/dB| = {gb:.4f}")

# %% [markdown]
# ## Part B — Exercise 2: the backward pass, by hand
#
# **Specification.** Write `LoRAMatmul`, a `torch.autograd.Function`:
#
# * `forward(ctx, x, A, B, W, scaling)` with `x [T, in]`, `A [r, in]`, `B [out, r]`, the
#   frozen `W [out, in]` and a float `scaling` $s$: return $y = x W^\top + s\,(x A^\top) B^\top$
#   (`[T, out]`), and save what the backward needs (`ctx.save_for_backward(...)` for tensors,
#   `ctx.scaling = ...` for the float);
# * `backward(ctx, dy)` with $dY$ `[T, out]`: return `(dX, dA, dB, None, None)` (five values,
#   one per input of `forward`: `None` for `W`, which is frozen, and for `scaling`), with
#
#   $$ dX = dY\, W + s\,(dY B)\, A \ \ [T, \text{in}], \qquad
#      dA = s\,(dY B)^\top x \ \ [r, \text{in}], \qquad
#      dB = s\, dY^\top (x A^\top) \ \ [\text{out}, r]. $$
#
# Rules: no tensor of shape `[out, in]` or `[in, out]` may be *created* on the way, in the
# forward or the backward (views of `W` such as `W.t()` are fine; a copy such as
# `W.t().contiguous()` is not, and neither is a gradient for `W`); no `torch.autograd.grad`
# inside the backward; no `minituner`; and `dy` is read-only: autograd hands the same tensor
# to the other branches of the graph (the residual stream around a layer), so scaling it in
# place (`dy.mul_(s)`, `dy *= s`) corrupts their gradients. `lora_matmul` below is how the
# tests call your Function.
#
# **Where the formulas come from.** Write $h = x A^\top$ (`[T, r]`). The forward is
# $y = x W^\top + s\, h B^\top$, and the chain rule gives
#
# $$ dB = s\, dY^\top h \quad [\text{out}, r] \qquad dh = s\, dY B \quad [T, r] $$
# $$ dA = dh^\top x \quad [r, \text{in}] \qquad dX = dY\, W + dh\, A \quad [T, \text{in}] $$
#
# Every product on the LoRA path has $r$ as one of its dimensions: nothing of size
# `[out, in]` is ever formed. Compare the textbook form $y = x\,(W + s\,BA)^\top$: it forms
# $BA$ in the forward (and autograd keeps it for the backward), then its gradient
# $s\, dY^\top x$, `[out, in]` again. For the `[14336, 4096]` MLP projection of a 7B-class
# model that is 235 MB per tensor in float32, per layer.
#
# Autograd, given the parenthesised form `(x @ A.T) @ B.T` of Exercise 1, already finds these
# rank-sized gradients. Why write them by hand, then?
#
# * Because in Labs 09–10 you implement them as Triton kernels for Mixture-of-Experts layers,
#   where no autograd writes them for you: this is the derivation those kernels follow.
# * Because a Function decides **what is saved** for the backward. Over a quantized base
#   (Lab 06), autograd would save the dequantized `[out, in]` float weight of every layer
#   until the backward pass, which is exactly the memory QLoRA exists to avoid; a Function can
#   save the small NF4 storage and dequantize again in the backward
#   (`minituner.lora_linear` takes a callable for `W` for this reason).
#
# <details><summary>Hint 1: the idea</summary>
#
# Compute $h = x A^\top$ once in the forward and save it with `x`, `A`, `B` and `W`: the
# backward needs $h$ for `dB`, and saving it costs only `[T, r]`. In the backward, compute
# $dY B$ (`[T, r]`) once and use it twice. Write each product with its shapes beside it
# (`[r, T] @ [T, in]`): a transpose in the wrong place gives `dAᵀ`, and `dY.t() @ x` is
# the `[out, in]` gradient of `W`, which is forbidden.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# forward(ctx, x, A, B, W, s):
#     h = x @ Aᵀ                                   # [T, r]
#     save x, h, A, B, W;  ctx.scaling = s
#     return x @ Wᵀ + s * (h @ Bᵀ)                 # [T, out]
#
# backward(ctx, dy):
#     dyB = dy @ B                                 # [T, r]
#     dX  = dy @ W + s * (dyB @ A)                 # [T, in]
#     dA  = s * (dyBᵀ @ x)                         # [r, in]
#     dB  = s * (dyᵀ @ h)                          # [out, r]
#     return dX, dA, dB, None, None
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "lora_function", "locked": false, "schema_version": 3, "solution": true, "task": false}
class LoRAMatmul(torch.autograd.Function):
    """y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with a backward that never forms an [out, in] tensor."""

    @staticmethod
    def forward(ctx, x, A, B, W, scaling):
        ### BEGIN SOLUTION
        xa = x @ A.t()                                     # [T, r]
        ctx.save_for_backward(x, xa, A, B, W)
        ctx.scaling = scaling
        return x @ W.t() + scaling * (xa @ B.t())
        ### END SOLUTION

    @staticmethod
    def backward(ctx, dy):
        ### BEGIN SOLUTION
        x, xa, A, B, W = ctx.saved_tensors
        s = ctx.scaling
        dy_b = dy @ B                                      # [T, r]
        dx = dy @ W + s * (dy_b @ A)                       # [T, in]
        dA = s * (dy_b.t() @ x)                            # [r, in]
        dB = s * (dy.t() @ xa)                             # [out, r]
        return dx, dA, dB, None, None
        ### END SOLUTION


def lora_matmul(x, A, B, W, scaling):
    """Your Function, called the way the tests call it."""
    return LoRAMatmul.apply(x, A, B, W, scaling)


# %% [markdown]
# ### A recorder of every tensor an operation creates
#
# To *prove* that no `[out, in]` tensor appears, we watch every operation PyTorch runs. A
# `TorchDispatchMode` sees each ATen operation (the level below autograd, so the backward pass
# is seen too) with its inputs and its outputs. The recorder below notes, for each output,
# the operation, its shape and its size in bytes, and whether the operation returns a view
# (no new memory) or a new tensor.

# %%
class ShapeRecorder(TorchDispatchMode):
    """Records (op, shape, bytes, is_view) for every tensor each ATen op returns."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.records.append((str(func), tuple(t.shape), t.numel() * t.element_size(),
                                     func.is_view))
        return out


def record(fn):
    """Run fn() under a ShapeRecorder; return the records."""
    with ShapeRecorder() as rec:
        fn()
    return rec.records


def naive_lora(x, A, B, W, scaling):
    """The textbook form: builds s·B·A, [out, in]."""
    return x @ (W + scaling * (B @ A)).t()


# A small example: forward and backward of the naive form, op by op
_x = randn(6, 40, seed=1).requires_grad_()
_A, _B = randn(4, 40, seed=2).requires_grad_(), randn(24, 4, seed=3).requires_grad_()
_W = randn(24, 40, seed=4)
_dy = randn(6, 24, seed=5)
for op, shape, nbytes, is_view in record(lambda: naive_lora(_x, _A, _B, _W, 2.0).backward(_dy)):
    flag = "   <- [out, in]" if shape == (24, 40) and not is_view else ""
    print(f"{op:<26} {str(shape):<10} {nbytes:>6} bytes{' (view)' if is_view else ''}{flag}")

# %% nbgrader={"grade": true, "grade_id": "test_lora_backward", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _grads(fn, x, A, B, W, s, dy):
    x, A, B = (t.detach().clone().requires_grad_() for t in (x, A, B))
    y = fn(x, A, B, W, s)
    y.backward(dy)
    return y.detach(), x.grad, A.grad, B.grad


def _backward_rule(error):
    """The rule an error of autograd's about a backward's return value points at."""
    text = str(error)
    if "incorrect number of gradients" in text:
        return "Rule: backward returns one value per input of forward: five, None for W and " \
               "for scaling"
    if "invalid gradient" in text:
        return "Rule: each gradient has its input's shape, dA [r, in] = s·(dY·B)ᵀ·x and " \
               "dB [out, r] = s·dYᵀ·(x·Aᵀ); a transpose in the wrong place gives dAᵀ or dBᵀ"
    return "Rule: see the formulas of the specification"


def _likely_rule(name, got, x, A, B, W, s, dy):
    """Which rule a wrong gradient breaks, when it is one of the usual slips (else '')."""
    dy_b = dy @ B
    base, lora = dy @ W, s * (dy_b @ A)
    slips = {"dA": [(s * s * (dy_b.t() @ x), "the scaling s is applied twice"),
                    (dy_b.t() @ x, "the scaling s is missing")],
             "dB": [(s * s * (dy.t() @ (x @ A.t())), "the scaling s is applied twice"),
                    (dy.t() @ (x @ A.t()), "the scaling s is missing")],
             "dX": [(s * base + lora, "the scaling s multiplies the LoRA part only, not dY·W"),
                    (base + lora / s, "the scaling s is missing in the LoRA part"),
                    (base, "the LoRA part s·(dY·B)·A is missing")]}
    for want, rule in slips.get(name, []):
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            return f"\nLikely: {rule}."
    return ""


def _check_grads(T, n_in, n_out, r, s, seed=0, what=""):
    where = f"{what}x [{T}, {n_in}], A [{r}, {n_in}], B [{n_out}, {r}], scaling {s}"
    x, A, B = randn(T, n_in, seed=seed), randn(r, n_in, seed=seed + 1), randn(n_out, r,
                                                                                seed=seed + 2)
    W, dy = randn(n_out, n_in, seed=seed + 3), randn(T, n_out, seed=seed + 4)
    want = _grads(naive_lora, x, A, B, W, s, dy)
    try:
        with _forbid_reference():
            got = _grads(lora_matmul, x, A, B, W, s, dy)
    except (AssertionError, NotImplementedError):
        raise
    except Exception as e:
        raise AssertionError(f"{where}: forward + backward raised {type(e).__name__}: {e}\n"
                             f"{_backward_rule(e)}") from e
    for name, g, w in zip(("y", "dX", "dA", "dB"), got, want, strict=True):
        assert isinstance(g, torch.Tensor) and g.shape == w.shape, \
            f"{where}: {name} expected shape {tuple(w.shape)}, got " \
            f"{tuple(g.shape) if isinstance(g, torch.Tensor) else g}"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4, msg=lambda m, name=name, g=g: (
            f"{where}: {name} differs from autograd of x·(W + s·B·A)ᵀ:\n{m}"
            f"{_likely_rule(name, g, x, A, B, W, s, dy)}"))


def _gradcheck(T, n_in, n_out, r, s, seed=0, what=""):
    x = randn(T, n_in, seed=seed, dtype=torch.float64).requires_grad_()
    A = randn(r, n_in, seed=seed + 1, dtype=torch.float64).requires_grad_()
    B = randn(n_out, r, seed=seed + 2, dtype=torch.float64).requires_grad_()
    W = randn(n_out, n_in, seed=seed + 3, dtype=torch.float64)
    try:
        ok = torch.autograd.gradcheck(lambda x, A, B: lora_matmul(x, A, B, W, s), (x, A, B))
    except RuntimeError as e:          # torch.autograd.GradcheckError is a RuntimeError
        raise AssertionError(f"{what}gradcheck (float64, T={T}, in={n_in}, out={n_out}, r={r}, "
                             f"scaling {s}) failed: your backward is not the derivative of "
                             f"your forward.\n{str(e)[:1500]}") from None
    assert ok


assert is_subclass(LoRAMatmul, torch.autograd.Function), "LoRAMatmul must subclass " \
    "torch.autograd.Function"
_check_grads(6, 40, 24, 4, 2.0)
_gradcheck(5, 7, 6, 3, 0.7)
print("LoRAMatmul: gradcheck passes in float64, and y, dX, dA, dB equal autograd's on the "
      "naive form")

### BEGIN HIDDEN TESTS
# case: gradcheck at rank 1, out > in
_gradcheck(4, 9, 11, 1, 2.5, seed=10, what="hidden: ")          # rank 1, out > in
# case: gradcheck with r = out
_gradcheck(8, 16, 5, 5, 0.125, seed=11, what="hidden: ")        # r = out
# case: gradients against autograd, odd sizes
_check_grads(33, 17, 9, 6, 1 / math.sqrt(6), seed=12, what="hidden: ")
# case: gradients against autograd, a single token
_check_grads(1, 64, 48, 8, 4.0, seed=13, what="hidden: ")
# case: torch.autograd.grad switched off
with forbid([(torch.autograd, "grad")], globals(), why=_WHY):
    _check_grads(5, 12, 10, 2, 3.0, seed=14, what="hidden (autograd.grad switched off): ")
# case: only x needs a gradient
_x = randn(4, 6, seed=15).requires_grad_()
lora_matmul(_x, randn(2, 6), randn(3, 2), randn(3, 6), 1.5).sum().backward()
assert _x.grad is not None and _x.grad.shape == (4, 6), "hidden: dX missing when A, B are frozen"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_lora_backward_memory", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _weight_sized(fn, n_out, n_in):
    """The new (non-view) tensors of shape [out, in] or [in, out] that fn() creates."""
    return [(op, shape) for op, shape, _, is_view in record(fn)
            if not is_view and shape in ((n_out, n_in), (n_in, n_out))]


# in-process check: the ops your forward + backward run (ShapeRecorder, where your code runs)
# create no [out, in] tensor, and the output's grad_fn is LoRAMatmul's backward
def _record_lora_matmul(T, n_in, n_out, r, s, seed):
    x = randn(T, n_in, seed=seed).requires_grad_()
    A = randn(r, n_in, seed=seed + 1).requires_grad_()
    B = randn(n_out, r, seed=seed + 2).requires_grad_()
    W, dy = randn(n_out, n_in, seed=seed + 3), randn(T, n_out, seed=seed + 4)
    grad_fn = type(lora_matmul(x, A, B, W, s).grad_fn).__name__
    records = record(lambda: lora_matmul(x, A, B, W, s).backward(dy))
    return records, grad_fn, [t.grad is not None for t in (x, A, B)]


def _check_no_out_by_in(T, n_in, n_out, r, s=2.0, seed=0, what=""):
    assert len({T, n_in, n_out, r}) == 4
    where = f"{what}T={T}, in={n_in}, out={n_out}, r={r}"
    with _forbid_reference():
        records, grad_fn, have_grads = in_learner(_record_lora_matmul, T, n_in, n_out, r, s, seed)
    assert grad_fn == "LoRAMatmulBackward", \
        f"{where}: the output's grad_fn should be LoRAMatmul's backward, got {grad_fn}"
    bad = [(op, tuple(shape)) for op, shape, _, is_view in records
           if not is_view and tuple(shape) in ((n_out, n_in), (n_in, n_out))]
    assert not bad, f"{where}: your forward + backward created {len(bad)} weight-sized " \
                    f"tensor(s): {bad}. Keep every LoRA product at rank size (and compute no " \
                    f"gradient for the frozen W)."
    shapes = [tuple(shape) for _, shape, _, _ in records]
    assert (r, n_in) in shapes and (n_out, r) in shapes, \
        f"{where}: the recorder saw no dA [r, in] or dB [out, r]; was the backward run?"
    assert all(have_grads), f"{where}: x, A and B should all get a gradient"
    # the check can fail: the naive form creates [out, in] tensors
    x = randn(T, n_in, seed=seed).requires_grad_()
    A = randn(r, n_in, seed=seed + 1).requires_grad_()
    B = randn(n_out, r, seed=seed + 2).requires_grad_()
    W, dy = randn(n_out, n_in, seed=seed + 3), randn(T, n_out, seed=seed + 4)
    assert _weight_sized(lambda: naive_lora(x, A, B, W, s).backward(dy), n_out, n_in)


# in-process check: autograd hands your backward a gradient that other branches share (the
# residual stream around a layer); scaling it in place (dy.mul_(s), dy *= s) corrupts theirs
def _probe_incoming_gradient(T, n_in, n_out, r, s, seed):
    x = randn(T, n_in, seed=seed).requires_grad_()
    A = randn(r, n_in, seed=seed + 1).requires_grad_()
    B = randn(n_out, r, seed=seed + 2).requires_grad_()
    W, dy = randn(n_out, n_in, seed=seed + 3), randn(T, n_out, seed=seed + 4)
    kept = dy.clone()
    lora_matmul(x, A, B, W, s).backward(dy)
    changed = (dy - kept).abs().max().item()
    stream = randn(T, n_out, seed=seed + 5).requires_grad_()      # h = 1.5·stream + layer(x)
    h = stream * 1.5 + lora_matmul(x, A, B, W, s)
    (h * kept).sum().backward()
    ratio = (stream.grad / (1.5 * kept)).abs().max().item()
    return changed, ratio


def _check_incoming_gradient(T, n_in, n_out, r, s, seed=0):
    where = f"T={T}, in={n_in}, out={n_out}, r={r}, scaling {s}"
    with _forbid_reference():
        changed, ratio = in_learner(_probe_incoming_gradient, T, n_in, n_out, r, s, seed)
    rule = "Rule: never modify the incoming gradient in place (dy.mul_(s), dy *= s): autograd " \
           "shares it with the other branches of the graph, such as the residual stream; " \
           "write s * (...) into new tensors"
    assert changed == 0, f"{where}: your backward modified the incoming gradient dY in place " \
                         f"(max change {changed:.3g}).\n{rule}"
    assert abs(ratio - 1) < 1e-5, f"{where}: in h = 1.5·stream + LoRAMatmul(x), the gradient " \
                                  f"of the stream came out {ratio:.3g} times too large: your " \
                                  f"backward modified the shared incoming gradient in place." \
                                  f"\n{rule}"


_check_no_out_by_in(6, 40, 24, 4)
_check_no_out_by_in(9, 17, 33, 5, s=0.5, seed=20)
_check_no_out_by_in(3, 64, 48, 1, s=16.0, seed=21)
_check_no_out_by_in(10, 30, 20, 16, s=1.0, seed=22)
_check_incoming_gradient(6, 40, 24, 4, 2.0, seed=23)
print("LoRAMatmul: forward + backward create no [out, in] or [in, out] tensor (the naive form "
      "creates several), and leave the incoming gradient untouched")

### BEGIN HIDDEN TESTS
# case: no weight-sized tensor, other sizes
_check_no_out_by_in(7, 48, 20, 3, s=0.25, seed=30, what="hidden: ")
_check_no_out_by_in(2, 12, 72, 6, s=4.0, seed=31, what="hidden: ")
# case: the incoming gradient untouched, other sizes
_check_incoming_gradient(5, 18, 30, 2, 0.5, seed=32)
### END HIDDEN TESTS

# %% [markdown]
# ### Your Function inside the layer
#
# `FastLoRALinear` is your `MyLoRALinear` with its forward routed through your Function (for a
# layer without dropout: with dropout, the LoRA path sees $x \odot m$ for a random mask $m$,
# and the LoRA part of $dX$ is multiplied by $m$ again; `minituner.lora_linear` takes the mask
# as an extra argument). Both forms must give the same outputs and gradients.

# %%
class FastLoRALinear(MyLoRALinear):
    def forward(self, x):
        if self.merged or (self.training and isinstance(self.dropout, nn.Dropout)):
            return super().forward(x)
        x2 = x.reshape(-1, x.shape[-1])
        y = lora_matmul(x2, self.lora_A, self.lora_B, self.base.weight, self.scaling)
        if self.base.bias is not None:
            y = y + self.base.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


torch.manual_seed(0)
slow = MyLoRALinear(nn.Linear(128, 448), r=8, alpha=16.0)
fast = FastLoRALinear(copy.deepcopy(slow.base), r=8, alpha=16.0)
with torch.no_grad():
    slow.lora_B.normal_(0, 0.1)
    fast.load_state_dict(slow.state_dict())
x = randn(4, 20, 128, seed=1)
for layer in (slow, fast):
    layer(x).square().mean().backward()
print("max |y difference|:", (slow(x) - fast(x)).abs().max().item())
print("max |dA difference|:", (slow.lora_A.grad - fast.lora_A.grad).abs().max().item(),
      "| max |dB difference|:", (slow.lora_B.grad - fast.lora_B.grad).abs().max().item())

# %% [markdown]
# ### How much memory the naive form costs
#
# The recorder also works on the **meta** device, where tensors have a shape and a dtype but
# no storage: operations compute only the shapes of their results. That lets us "run" a
# forward and backward at the sizes of real models for free. Below, for a batch of
# $T = 2048$ tokens and rank 16, the largest tensor created **on the LoRA path** by the naive
# form and by your Function, in float32. Tensors of the layer's input and output shapes
# (`[T, in]`, `[T, out]`) are left out: the frozen base layer creates those anyway.

# %%
T_TOKENS, RANK = 2048, 16
LAYERS = {"MiniGPT q_proj\n128 x 128": (128, 128), "MiniGPT up_proj\n448 x 128": (448, 128),
          "7B q_proj\n4096 x 4096": (4096, 4096), "7B up_proj\n11008 x 4096": (11008, 4096),
          "Mixtral expert w1\n14336 x 4096": (14336, 4096)}


def lora_path_bytes(fn, n_out, n_in, T=T_TOKENS, r=RANK):
    """(largest, total) bytes of the new tensors fn creates on the LoRA path, on 'meta'."""
    x = torch.empty(T, n_in, device="meta", requires_grad=True)
    A = torch.empty(r, n_in, device="meta", requires_grad=True)
    B = torch.empty(n_out, r, device="meta", requires_grad=True)
    W, dy = torch.empty(n_out, n_in, device="meta"), torch.empty(T, n_out, device="meta")
    sizes = [nbytes for _, shape, nbytes, is_view in record(lambda: fn(x, A, B, W, 2.0)
                                                            .backward(dy))
             if not is_view and shape not in ((T, n_in), (T, n_out), ())]
    return max(sizes), sum(sizes)


def human(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


rows = []
print(f"{'layer [out x in]':<34} {'naive: largest':>15} {'total':>10} "
      f"{'yours: largest':>15} {'total':>10}")
for label, (n_out, n_in) in LAYERS.items():
    naive_max, naive_sum = lora_path_bytes(naive_lora, n_out, n_in)
    mine_max, mine_sum = lora_path_bytes(lora_matmul, n_out, n_in)
    rows.append((label, naive_max, mine_max))
    print(f"{label.replace(chr(10), ' '):<34} {human(naive_max):>15} {human(naive_sum):>10} "
          f"{human(mine_max):>15} {human(mine_sum):>10}")

fig, ax = plt.subplots(figsize=(10, 4))
pos = torch.arange(len(rows)).float()
bars1 = ax.bar(pos - 0.2, [r[1] for r in rows], width=0.4, label="naive x·(W + s·B·A)ᵀ")
bars2 = ax.bar(pos + 0.2, [r[2] for r in rows], width=0.4, label="decomposed (your Function)")
ax.bar_label(bars1, labels=[human(r[1]) for r in rows], fontsize=8)
ax.bar_label(bars2, labels=[human(r[2]) for r in rows], fontsize=8)
ax.set_yscale("log")
ax.set_xticks(pos, [r[0] for r in rows], fontsize=8)
ax.set_ylabel("bytes (float32, log scale)")
ax.set_title(f"Largest tensor on the LoRA path, forward + backward (T = {T_TOKENS}, r = {RANK})")
ax.legend()
plt.show()

# %% [markdown]
# The naive form's largest tensor is the size of the weight itself, and it creates several
# (the product, its scaled copy, the sum, and the gradient of the sum); yours is `[out, r]`
# or `[T, r]`, a few hundred times smaller at the sizes of real models. The comparison is
# $\text{in} \cdot \text{out}$ against $r \cdot \max(\text{in}, \text{out}, T)$: on
# MiniGPT's `128 x 128` layer, 2048 tokens at rank 16 make `[T, r]` *larger* than the weight,
# and the decomposition buys nothing. It pays exactly where memory is scarce.
#
# ## Part C — Exercise 3: merging, and why an NF4 base refuses
#
# For inference, an adapter can be folded into the weight: $W' = W + s\,BA$. The merged layer
# is a plain linear layer again, with no extra latency. `unmerge` subtracts the update back, to
# continue training or to swap in another adapter.
#
# **Specification.** Three functions, for any layer that has `.base` (an `nn.Linear`),
# `.lora_A`, `.lora_B`, `.scaling` and `.merged` (yours; the tests also pass them a
# `minituner.LoRALinear`):
#
# * `delta_weight(layer)`: $s \cdot B A$, a tensor `[out, in]`;
# * `merge(layer)`: if `layer.base` is a `miniquant.QuantizedLinear` (an NF4 base), raise
#   `ValueError` with a message that says why (re-quantization, below) and change nothing;
#   if already merged, do nothing (merging twice must not add the update twice); else add
#   the delta to `layer.base.weight` **in place** — the same `Parameter` object, updated
#   inside `torch.no_grad()` so that it stays frozen and outside any graph, cast to the
#   weight's dtype — and set `layer.merged = True`;
# * `unmerge(layer)`: if not merged, do nothing; else subtract the delta in place the same way
#   and set `layer.merged = False`.
#
# In floating point $(W + \Delta) - \Delta$ is not exactly $W$, but it is within a few ulps:
# the tests ask for the round trip to hold to $10^{-6}$ for weights of order 1.
#
# <details><summary>Hint 1: the idea</summary>
#
# `isinstance(layer.base, miniquant.QuantizedLinear)` is the NF4 test; check it before
# anything else. In-place updates of a `Parameter` are `weight.add_(...)` and
# `weight.sub_(...)`; under `torch.no_grad()` autograd does not record them, while outside it
# the frozen weight would silently join the graph of the trainable factors. Replacing the
# Parameter (`base.weight = nn.Parameter(...)`) breaks every optimizer and every reference
# to it.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# delta_weight(layer):  return layer.scaling * (layer.lora_B @ layer.lora_A)
#
# merge(layer):
#     base is a QuantizedLinear -> ValueError("... re-quantizing would lose the update ...")
#     if layer.merged: return
#     with no_grad: layer.base.weight.add_(delta_weight(layer) in the weight's dtype)
#     layer.merged = True
#
# unmerge(layer):
#     if not layer.merged: return
#     with no_grad: layer.base.weight.sub_(delta_weight(layer) in the weight's dtype)
#     layer.merged = False
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "merge", "locked": false, "schema_version": 3, "solution": true, "task": false}
def delta_weight(layer) -> torch.Tensor:
    """s · B · A, [out, in]."""
    ### BEGIN SOLUTION
    return layer.scaling * (layer.lora_B @ layer.lora_A)
    ### END SOLUTION


def merge(layer) -> None:
    """Fold s·B·A into a float base weight in place; refuse an NF4 base; idempotent."""
    ### BEGIN SOLUTION
    if isinstance(layer.base, miniquant.QuantizedLinear):
        raise ValueError("cannot merge into an NF4 QuantizedLinear: W + s·B·A would have to be "
                         "re-quantized, which rounds it again and loses most of the update; "
                         "keep the adapter separate or merge into a dequantized float weight")
    if layer.merged:
        return
    with torch.no_grad():
        w = layer.base.weight
        w.add_(delta_weight(layer).to(w.dtype))
    layer.merged = True
    ### END SOLUTION


def unmerge(layer) -> None:
    """Subtract s·B·A from the base weight again; a no-op if not merged."""
    ### BEGIN SOLUTION
    if not layer.merged:
        return
    with torch.no_grad():
        w = layer.base.weight
        w.sub_(delta_weight(layer).to(w.dtype))
    layer.merged = False
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_merge_unmerge", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_merge(layer, x, what=""):
    where = f"{what}{layer._get_name()}(in={layer.lora_A.shape[1]}, " \
            f"out={layer.lora_B.shape[0]}, r={layer.lora_A.shape[0]}) over {layer.base.weight.dtype}"
    tol = dict(rtol=0, atol=1e-6) if layer.base.weight.dtype != torch.float64 else \
        dict(rtol=0, atol=1e-12)
    w0 = layer.base.weight.detach().clone()
    replaced = "the base weight is tied to another module here (`base.tied.weight`, as an " \
               "embedding and an output head can share one): update the Parameter in place " \
               "(add_ / sub_ under torch.no_grad()), do not replace it"
    want_delta = layer.scaling * (layer.lora_B.detach() @ layer.lora_A.detach())
    with _forbid_reference():
        got_delta = delta_weight(layer)
    assert isinstance(got_delta, torch.Tensor) and got_delta.shape == w0.shape, \
        f"{where}: delta_weight should have the weight's shape [out, in] = {tuple(w0.shape)}, got " \
        f"{tuple(getattr(got_delta, 'shape', ()))}"
    torch.testing.assert_close(got_delta.detach(), want_delta, **tol, msg=lambda m: (
        f"{where}: delta_weight differs from scaling · B · A:\n{m}"))
    with torch.no_grad():
        y0 = layer(x)
    with _forbid_reference():
        merge(layer)
    assert layer.merged is True, f"{where}: merge should set layer.merged = True"
    assert torch.equal(layer.base.tied.weight, layer.base.weight), \
        f"{where}: merge must change the weight in place, not replace the Parameter: {replaced}"
    torch.testing.assert_close(layer.base.weight.detach(), w0 + want_delta, **tol,
                               msg=lambda m: f"{where}: merged weight != W + s·B·A:\n{m}")
    assert not layer.base.weight.requires_grad and layer.base.weight.grad_fn is None, \
        f"{where}: after merge the base weight requires grad or has a grad_fn " \
        f"({layer.base.weight.grad_fn}); update it inside torch.no_grad()"
    with torch.no_grad():
        torch.testing.assert_close(layer(x), y0, rtol=1e-5, atol=1e-5, msg=lambda m: (
            f"{where}: the merged layer computes something else than before:\n{m}"))
    with _forbid_reference():
        merge(layer)
    torch.testing.assert_close(layer.base.weight.detach(), w0 + want_delta, **tol,
                               msg=lambda m: f"{where}: merging twice added the update twice:\n{m}")
    with _forbid_reference():
        unmerge(layer)
    assert layer.merged is False, f"{where}: unmerge should set layer.merged = False"
    assert torch.equal(layer.base.tied.weight, layer.base.weight), \
        f"{where}: unmerge must work in place: {replaced}"
    torch.testing.assert_close(layer.base.weight.detach(), w0, **tol, msg=lambda m: (
        f"{where}: merge then unmerge should give back the original weight (unmerge must "
        f"subtract the s·B·A that merge added):\n{m}"))
    with _forbid_reference():
        unmerge(layer)
    torch.testing.assert_close(layer.base.weight.detach(), w0, **tol, msg=lambda m: (
        f"{where}: unmerge of an unmerged layer must do nothing:\n{m}"))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), y0, rtol=1e-5, atol=1e-5)


def _random_layer(cls, n_in, n_out, r, alpha=8.0, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    base = nn.Linear(n_in, n_out, dtype=dtype)
    base.tied = nn.Module()            # a second holder of the same weight Parameter
    base.tied.weight = base.weight
    layer = cls(base, r=r, alpha=alpha, **kw)
    _randomize(layer, seed=seed + 1, std=0.3)
    return layer


_check_merge(_random_layer(MyLoRALinear, 40, 24, 4), randn(3, 40, seed=1))
_check_merge(_random_layer(MyLoRALinear, 40, 24, 4, seed=2, use_rslora=True),
             randn(3, 40, seed=3), what="(rsLoRA) ")
# an NF4 base refuses, and stays untouched
torch.manual_seed(4)
with _forbid_reference():
    _q = MyLoRALinear(nn.Linear(64, 32), r=4)
_q.base = miniquant.QuantizedLinear.from_linear(nn.Linear(64, 32))
_randomize(_q, seed=5)
_packed = _q.base.packed.clone()
try:
    with _forbid_reference():
        merge(_q)
except ValueError as e:
    print("merge on an NF4 base refused:", e)
except Exception as _e:
    raise AssertionError(f"merge on an NF4 base raised {type(_e).__name__}: {_e}\nRule: check "
                         "isinstance(layer.base, miniquant.QuantizedLinear) first and raise "
                         "ValueError") from _e
else:
    raise AssertionError("merge on a layer whose base is a miniquant.QuantizedLinear should "
                         "raise ValueError")
assert _q.merged is False and torch.equal(_q.base.packed, _packed), \
    "a refused merge must leave the layer as it was (merged False, NF4 storage unchanged)"
print("delta_weight / merge / unmerge: exact round trip, idempotent, in place")

### BEGIN HIDDEN TESTS
# case: 3-D x, odd sizes
_check_merge(_random_layer(MyLoRALinear, 13, 7, 3, alpha=5.0, seed=6), randn(2, 4, 13, seed=7),
             what="hidden: ")
# case: rsLoRA with a large rank, out > in
_check_merge(_random_layer(MyLoRALinear, 17, 33, 16, use_rslora=True, seed=8),
             randn(5, 17, seed=9), what="hidden: ")
# case: a float64 base
_check_merge(_random_layer(MyLoRALinear, 12, 10, 2, dtype=torch.float64, seed=10),
             randn(3, 12, seed=11, dtype=torch.float64), what="hidden: ")
# case: against PEFT's delta and merged weight
_mine, _, _theirs = _twin_layers(20, 12, 4, 6.0, use_rslora=True, seed=12)
with torch.no_grad():
    torch.testing.assert_close(delta_weight(_mine), _theirs.get_delta_weight("default"),
                               rtol=1e-5, atol=1e-6)
    merge(_mine)
    _theirs.merge(adapter_names=["default"])
    torch.testing.assert_close(_mine.base.weight, _theirs.base_layer.weight, rtol=1e-5,
                               atol=1e-6)
# case: merging with gradients enabled
_l = _random_layer(MyLoRALinear, 8, 6, 2, seed=13)
assert _l.lora_A.requires_grad and torch.is_grad_enabled()
merge(_l)
assert _l.base.weight.grad_fn is None and not _l.base.weight.requires_grad
### END HIDDEN TESTS

# %% [markdown]
# ### Why merging into NF4 would destroy the update
#
# An NF4 weight is stored as one of 16 levels times a per-block scale (Lab 02). Merging into
# it means computing $W_q + \Delta W$ in float and quantizing **again**: every weight snaps to
# the nearest level of its block. The gaps between neighbouring levels are between 0.08 and
# 0.28 times the block's absmax, so rounding can move a weight by up to half a gap times the
# absmax — while a LoRA update is typically much smaller than that. Most weights snap back to
# their old code (their update is lost), and the few that jump move by a whole gap (their
# update is replaced by rounding noise).
#
# Below, on a weight of the pretrained MiniGPT: rank-8 updates of growing size (their RMS
# relative to the weight's RMS) are merged into the NF4 weight by re-quantization, and we
# measure what survives.

# %%
base_model = minigpt.load_base("dense").eval()
W = base_model.blocks[0].attn.q_proj.weight.detach()
q = miniquant.quantize_nf4(W, blocksize=64)
Wq = q.dequantize()
half_gap = ((miniquant.NF4_CODE[1:] - miniquant.NF4_CODE[:-1]).max() / 2).item()

rel_sizes = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
lost, rel_err = [], []
print(f"{'update RMS / weight RMS':>24} {'weights whose code did not move':>32} "
      f"{'|kept - update| / |update|':>27} {'max rounding / bound':>21}")
for rel in rel_sizes:
    delta = randn(W.shape[0], 8, seed=1) @ randn(8, W.shape[1], seed=2)
    delta = delta * (rel * W.pow(2).mean().sqrt() / delta.pow(2).mean().sqrt())
    q2 = miniquant.quantize_nf4(Wq + delta, blocksize=64)
    kept = q2.dequantize() - Wq                         # the update that survives
    same_code = (q2.codes() == q.codes()).float().mean().item()
    err = ((kept - delta).norm() / delta.norm()).item()
    # rounding error of each weight against half the largest gap times its block's absmax
    bound = (half_gap * q2.absmax).repeat_interleave(64)[: W.numel()].reshape(W.shape)
    ratio = ((q2.dequantize() - (Wq + delta)).abs() / bound).max().item()
    assert ratio <= 1 + 1e-6
    lost.append(same_code)
    rel_err.append(err)
    print(f"{rel:>24.3f} {same_code:>32.1%} {err:>27.2f} {ratio:>21.2f}")

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.semilogx(rel_sizes, lost, "o-", label="share of weights whose NF4 code did not move")
ax.semilogx(rel_sizes, rel_err, "s-", label="|kept update - update| / |update|")
ax.axhline(1.0, color="k", lw=0.8, ls=":")
ax.set_xlabel("size of the LoRA update (RMS relative to the weight's RMS)")
ax.set_title("Merging into NF4 by re-quantization: what is left of the update")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# For updates of a few percent of the weight's scale (a typical fine-tune), most codes do not
# move and the error of what is kept is as large as the update itself: the merged model is not
# the fine-tuned model. Hence `merge` refuses, and the honest options are: keep the adapter
# separate (serve NF4 base + LoRA, as QLoRA does), or dequantize and merge into a float weight
# (`minituner.LoRALinear.merge_and_dequantize`), and re-quantize only knowingly, measuring what
# it costs.
#
# ## Part D — Exercise 4: choosing the layers to adapt
#
# PEFT picks layers with `target_modules`, matched against each module's full name
# (`blocks.0.attn.q_proj`).
#
# **Specification.** Write `wrap(model, target_modules, r=8, alpha=16.0, dropout=0.0,
# use_rslora=False) -> list[str]`, which changes `model` in place:
#
# * raise `ValueError` if `r` is not a positive int, **before** touching the model;
# * the candidates are the model's `nn.Linear` modules (no norm, block or embedding), in
#   `model.named_modules()` order; a candidate named `name` matches when
#   * `target_modules` is a **list of strings** and some entry `t` equals `name` or is a
#     *suffix made of whole name components*, `name.endswith("." + t)` (so `"q_proj"`
#     matches `blocks.1.attn.q_proj`, but `"proj"` matches nothing);
#   * `target_modules` is a **string**: a regular expression that must match the **whole**
#     name, `re.fullmatch` (`r"blocks\.\d+\.mlp\..*"` selects every MLP projection, while
#     `r"mlp\.up_proj"` matches nothing; it would with `re.search`);
# * if nothing matches, raise `ValueError` with a message that lists the names of all the
#   model's `nn.Linear` modules (what the user could have meant), leaving the model untouched
#   (nothing wrapped, nothing frozen);
# * replace each match by a `MyLoRALinear` around it (the original `nn.Linear` object becomes
#   its `base`), with `r`, `alpha`, `dropout` and `use_rslora`;
# * freeze every parameter of the model, then unfreeze the `lora_A` and `lora_B` of the new
#   layers; return the list of wrapped names.
#
# And `count_trainable(model) -> (trainable, total)`: parameter counts as Python `int`s over
# `model.parameters()`.
#
# Off-limits: `minituner.wrap_lora`, `minituner.trainable_summary` and PEFT.
#
# A pattern that also matches other modules (a block, a norm) skips them here, as
# `minituner.wrap_lora` does; PEFT instead raises an error when a pattern matches a module
# type it cannot adapt, such as an `RMSNorm` (and it can adapt `nn.Embedding`, which we leave
# alone).
#
# <details><summary>Hint 1: the idea</summary>
#
# Work in two passes: first collect the matching names (a list comprehension over
# `named_modules()` with `isinstance(m, nn.Linear)` and a small `matches(name)` helper), then
# replace them. Changing a model while iterating over `named_modules()` goes wrong, and
# collecting first also lets you raise before anything changed.
# `model.get_submodule(name)` fetches a layer and `model.set_submodule(name, new)` does the
# parent lookup for you. `model.requires_grad_(False)` freezes everything at once.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# wrap(model, target_modules, r, alpha, dropout, use_rslora):
#     r not a positive int -> ValueError
#     candidates = [name for name, m in model.named_modules() if m is an nn.Linear]
#     matches(name) = fullmatch(target_modules, name)                    if a string
#                     any(name == t or name ends with "." + t for t in target_modules)  else
#     names = [n for n in candidates if matches(n)]
#     if not names: ValueError listing candidates
#     for n in names: model.set_submodule(n, MyLoRALinear(model.get_submodule(n), r, alpha, ...))
#     model.requires_grad_(False)
#     for n in names: unfreeze model.get_submodule(n).lora_A and .lora_B
#     return names
#
# count_trainable(model): (sum of numel of the parameters that require grad, sum of all numel)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "wrap", "locked": false, "schema_version": 3, "solution": true, "task": false}
def wrap(model: nn.Module, target_modules, r: int = 8, alpha: float = 16.0,
         dropout: float = 0.0, use_rslora: bool = False) -> list[str]:
    """Replace the nn.Linear layers selected by target_modules with MyLoRALinear, in place."""
    ### BEGIN SOLUTION
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"r must be a positive int, got {r!r}")
    candidates = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    def matches(name):
        if isinstance(target_modules, str):
            return re.fullmatch(target_modules, name) is not None
        return any(name == t or name.endswith("." + t) for t in target_modules)

    names = [n for n in candidates if matches(n)]
    if not names:
        raise ValueError(f"target_modules {target_modules!r} matches no nn.Linear module; "
                         f"the model's linear layers are {candidates}")
    for name in names:
        model.set_submodule(name, MyLoRALinear(model.get_submodule(name), r=r, alpha=alpha,
                                               dropout=dropout, use_rslora=use_rslora))
    model.requires_grad_(False)
    for name in names:
        layer = model.get_submodule(name)
        layer.lora_A.requires_grad_(True)
        layer.lora_B.requires_grad_(True)
    return names
    ### END SOLUTION


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) numbers of parameters."""
    ### BEGIN SOLUTION
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_wrap", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _peft_selection(target_modules, r=8, alpha=16.0):
    """The layers PEFT wraps in small_gpt() for target_modules, and its parameter counts."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules)
    model = peft.get_peft_model(small_gpt(), cfg)
    names = [n.removeprefix("base_model.model.") for n, m in model.named_modules()
             if isinstance(m, peft.tuners.lora.LoraLayer)]
    return names, model.get_nb_trainable_parameters()


def _lora_counts(names, r):
    """(trainable, total) of small_gpt() with rank-r factors on `names`, by hand: each layer
    adds r·in (A) + out·r (B) trainable numbers to the base model's parameters."""
    base = small_gpt()
    lora = sum(r * (base.get_submodule(n).in_features + base.get_submodule(n).out_features)
               for n in names)
    return lora, sum(p.numel() for p in base.parameters()) + lora


def _check_wrap(target_modules, r=8, alpha=16.0, want_names=None, with_peft=True, what="",
                with_ref=False):
    where = f"{what}wrap(small_gpt(), {target_modules!r}, r={r}, alpha={alpha})"
    assert want_names is not None or with_peft or with_ref
    # expectations first: PEFT's selection and counts (and minituner's, with with_ref)
    if with_peft:
        peft_names, peft_counts = _peft_selection(target_modules, r, alpha)
        assert want_names is None or peft_names == want_names
    if with_ref:
        ref = small_gpt()
        ref_names = minituner.wrap_lora(ref, target_modules, r=r, alpha=alpha)
        ref_counts = minituner.trainable_summary(ref)
    want_counts = _lora_counts(want_names if want_names is not None
                               else peft_names if with_peft else ref_names, r)
    if with_peft:
        assert peft_counts == want_counts, (peft_counts, want_counts)
    if with_ref:
        assert ref_counts == want_counts, (ref_counts, want_counts)
    model = share(small_gpt())
    idx = torch.randint(0, 45, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx)
    with _forbid_reference():
        names = wrap(model, target_modules, r=r, alpha=alpha)
        counts = count_trainable(model)
    assert isinstance(names, list), f"{where}: expected a list of names, got {type(names).__name__}"
    if want_names is not None:
        assert names == want_names, f"{where}: expected {want_names}, got {names}"
    if with_ref:
        assert names == ref_names, f"{where}: minituner.wrap_lora wraps {ref_names}, you " \
                                   f"returned {names}"
    if with_peft:
        assert names == peft_names, f"{where}: PEFT wraps {peft_names}, you returned {names}"
    wrapped = [n for n, m in model.named_modules() if is_instance(m, MyLoRALinear)]
    assert wrapped == names, f"{where}: the model holds MyLoRALinear at {wrapped}, you " \
                             f"returned {names}"
    assert all(model.get_submodule(n).scaling == alpha / r for n in names), \
        f"{where}: the layers should have r={r}, alpha={alpha}"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    want_trainable = [f"{n}.lora_{ab}" for n in names for ab in "AB"]
    assert trainable == want_trainable, \
        f"{where}: trainable parameters should be exactly the LoRA factors {want_trainable}; " \
        f"got {trainable}"
    assert isinstance(counts, tuple) and len(counts) == 2 and all(isinstance(c, int)
                                                                  for c in counts), \
        f"count_trainable should return a tuple of two ints, got {counts!r}"
    slips = {(want_counts[1], want_counts[0]): "\nLikely: the order is (trainable, total).",
             (want_counts[0], want_counts[1] - want_counts[0]):
                 "\nLikely: total must count every parameter, the adapter's own included."}
    assert counts == want_counts, \
        f"{where}: count_trainable gives (trainable, total) = {counts}; expected {want_counts} " \
        f"(r·(in + out) per wrapped layer, plus the base model's parameters; PEFT's " \
        f"get_nb_trainable_parameters() agrees)" \
        f"{slips.get(counts, '')}"
    with torch.no_grad():
        torch.testing.assert_close(model(idx), before, rtol=0, atol=0, msg=lambda m: (
            f"{where}: a freshly wrapped model must compute what it computed before:\n{m}"))
    return model


ATTN_QV = [f"blocks.{i}.attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
_m = _check_wrap(["q_proj", "v_proj"], want_names=ATTN_QV)
assert count_trainable(_m) == (2048, 23008), \
    f"q_proj + v_proj at r=8: expected (2048, 23008), got {count_trainable(_m)}"
_check_wrap(r"blocks\.\d+\.mlp\.(gate|up|down)_proj", r=4, alpha=8.0,
            want_names=[f"blocks.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up",
                                                                              "down")])
# dropout and rsLoRA reach the layers
_m = share(small_gpt())
with _forbid_reference():
    wrap(_m, ["o_proj"], r=4, alpha=8.0, dropout=0.1, use_rslora=True)
_l = _m.blocks[1].attn.o_proj
assert is_instance(_l, MyLoRALinear) and _l.use_rslora is True and _l.scaling == 4.0, \
    f"wrap(small_gpt(), ['o_proj'], r=4, alpha=8.0, dropout=0.1, use_rslora=True): " \
    f"blocks.1.attn.o_proj has scaling {_l.scaling!r}, expected alpha / sqrt(r) = 4.0 " \
    f"(pass use_rslora on to MyLoRALinear)"
assert getattr(_l.dropout, "p", 0.0) == 0.1, \
    f"wrap(..., dropout=0.1): blocks.1.attn.o_proj has dropout {_l.dropout} (pass dropout on " \
    f"to MyLoRALinear)"
print("wrap selects what PEFT selects (suffix list and full-match regex), freezes the rest; "
      "count_trainable agrees with PEFT")

### BEGIN HIDDEN TESTS
# case: the output head alone
_check_wrap(["lm_head"], r=2, alpha=2.0, want_names=["lm_head"], what="hidden: ",
            with_ref=True)
# case: a regex that also matches a block's norms and submodules
_check_wrap(r"blocks\.1\..*", r=3, alpha=6.0, with_peft=False, what="hidden: ",
            with_ref=True)
# case: a regex that matches every module
_check_wrap(r".*", r=1, alpha=1.0, with_peft=False, what="hidden: ", with_ref=True)
# case: a multi-part suffix in the list
_check_wrap(["k_proj", "blocks.0.mlp.down_proj"], what="hidden: ",      # a multi-part suffix
            with_ref=True)
# case: a regex with a character class
_check_wrap(r"blocks\.0\.attn\.[qk]_proj", what="hidden: ", with_ref=True)
# case: dropout and rsLoRA passed to wrap
_m = share(small_gpt())
wrap(_m, ["o_proj"], r=4, alpha=8.0, dropout=0.1, use_rslora=True)
_l = _m.blocks[1].attn.o_proj
assert is_instance(_l, MyLoRALinear) and _l.scaling == 4.0 and _l.dropout.p == 0.1, \
    "hidden: wrap(..., dropout=0.1, use_rslora=True) did not reach the layers"
# case: the base of a wrapped layer
_m = share(small_gpt())
_orig = _m.blocks[0].attn.q_proj
wrap(_m, ["q_proj"])
assert _m.blocks[0].attn.q_proj.base is _orig, "hidden: the base should be the original layer"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_wrap_bad_inputs", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _expect_value_error(target_modules, r=8, what="", must_list=(), rule=""):
    where = f"{what}wrap(small_gpt(), {target_modules!r}, r={r!r})"
    model = share(small_gpt())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with _forbid_reference():
            wrap(model, target_modules, r=r)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError(f"{where} should raise ValueError{rule}")
    for name in must_list:
        assert name in msg, f"{where}: the error should list the model's linear layers " \
                            f"(e.g. {name!r}); it says: {msg}"
    assert not any(is_instance(m, MyLoRALinear) for m in model.modules()), \
        f"{where}: the model was changed before the error"
    assert all(p.requires_grad for p in model.parameters()), \
        f"{where}: parameters were frozen before the error"
    assert list(model.state_dict()) == list(state)
    return msg


_expect_value_error(["q_proj"], r=0)
_msg = _expect_value_error(["qkv"], must_list=("blocks.0.attn.q_proj", "blocks.1.mlp.down_proj",
                                               "lm_head"))
assert "tok_emb" not in _msg, f"only nn.Linear names are candidates; the message lists " \
                              f"tok_emb: {_msg}"
_expect_value_error(["_proj"], rule=": a list entry is a suffix of whole name components "
                    "(name == t or name.endswith('.' + t)), and '_proj' is none")
_expect_value_error(r"attn\.v_proj", rule=": a string is a regex that must match the whole "
                    "name (re.fullmatch, not re.search or re.match)")
print("wrap refuses a bad rank and a pattern that matches nothing, and names the candidates:")
print(" ", _msg[:160], "...")

### BEGIN HIDDEN TESTS
# case: a negative rank
_expect_value_error(["q_proj"], r=-3, what="hidden: ")
# case: a float rank
_expect_value_error(["q_proj"], r=2.5, what="hidden: ")
# case: a suffix that is part of a name component
_expect_value_error(["proj"], what="hidden (suffixes are whole components): ",
                    must_list=("blocks.0.attn.k_proj",))
# case: a regex that matches only the end of names
_expect_value_error(r"mlp\.gate_proj", what="hidden (a regex must match the whole name): ",
                    must_list=("blocks.0.mlp.gate_proj",))
# case: a regex naming a module that is no nn.Linear
_expect_value_error(r"blocks\.0\.attn", what="hidden (an attention module is no nn.Linear): ")
# case: an empty list
_msg = _expect_value_error([], what="hidden: ")
### END HIDDEN TESTS

# %% [markdown]
# ### What LoRA trains, counted
#
# Each adapted layer trains $r\,(\text{in} + \text{out})$ numbers. Below, with your `wrap` and
# `count_trainable` on the pretrained MiniGPT (width 128, MLP width 448), for four common
# choices of targets: the LoRA paper's `q_proj` + `v_proj`, all attention projections, all
# attention and MLP projections (what the QLoRA paper found necessary to match full
# fine-tuning), and every linear layer including the output head.

# %%
TARGETS = {"q_proj, v_proj": ["q_proj", "v_proj"],
           "attention (q, k, v, o)": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "attention + MLP": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"],
           "every linear (+ lm_head)": r".*"}
RANKS = [1, 2, 4, 8, 16, 32, 64]
total_base = base_model.num_params()
counts = {}
for label, target in TARGETS.items():
    counts[label] = []
    for r in RANKS:
        model = copy.deepcopy(base_model)
        wrap(model, target, r=r)
        counts[label].append(count_trainable(model)[0])

print(f"base model: {total_base:,d} parameters")
print(f"{'targets':<26}" + "".join(f"{'r=' + str(r):>10}" for r in RANKS))
for label, row in counts.items():
    print(f"{label:<26}" + "".join(f"{c:>10,d}" for c in row))

fig, ax = plt.subplots(figsize=(7.5, 4))
for label, row in counts.items():
    ax.loglog(RANKS, row, "o-", label=label)
ax.axhline(total_base, color="k", ls="--", lw=1, label="full fine-tuning (all parameters)")
ax.set_xticks(RANKS, [str(r) for r in RANKS])
ax.set_xlabel("rank r")
ax.set_ylabel("trainable parameters")
ax.set_title("Trainable parameters of LoRA on the pretrained MiniGPT")
ax.legend(fontsize=8)
plt.show()
print(f"attention + MLP at r=8: {counts['attention + MLP'][3] / total_base:.1%} of the base "
      "model's parameters")

# %% [markdown]
# On a model this small, rank 64 on every layer approaches the size of the model itself (a
# `128 x 128` weight has only 16 384 entries, and rank 64 trains 16 384 too). On a 7B model,
# whose projections are `4096` wide, rank 16 on every attention and MLP projection is about
# 40 million parameters, 0.6 % of the model.
#
# ## Part E — Exercise 5: adapter files PEFT can read
#
# `model.save_pretrained(dir)` of a PEFT model writes a directory with two files (and a
# `README.md` model card):
#
# * `adapter_config.json`: the `LoraConfig` (`peft_type: "LORA"`, `r`, `lora_alpha`,
#   `target_modules`, `lora_dropout`, `bias`, `use_rslora`, ...);
# * `adapter_model.safetensors`: only the LoRA factors, under the names they have in PEFT's
#   model **minus the adapter name**. In memory PEFT's parameter is
#   `base_model.model.blocks.0.attn.q_proj.lora_A.default.weight`; on disk it is
#   `base_model.model.blocks.0.attn.q_proj.lora_A.weight`. (`base_model.model.` is the path
#   from the `PeftModel` to your model; `.weight` because PEFT's `lora_A` is an `nn.Linear`.)
#
# Safetensors holds raw tensors and a JSON header, nothing executable: unlike a pickled
# `torch.save` file, loading it cannot run code. The cell below shows PEFT's own names.

# %%
peft_model = peft.get_peft_model(small_gpt(), peft.LoraConfig(r=4, lora_alpha=8,
                                                               target_modules=["q_proj"]))
print("in memory:", [k for k in peft_model.state_dict() if "lora" in k][:2])
with tempfile.TemporaryDirectory() as d:
    peft_model.save_pretrained(d)
    print("files:    ", sorted(p.name for p in Path(d).iterdir()))
    print("on disk:  ", sorted(safetensors.torch.load_file(Path(d) / "adapter_model.safetensors"))[:2])
    cfg = json.loads((Path(d) / "adapter_config.json").read_text())
    print("config:   ", {k: cfg[k] for k in ("peft_type", "r", "lora_alpha", "target_modules",
                                              "lora_dropout", "bias", "use_rslora")})

# %% [markdown]
# **Specification.** Write `save_peft_adapter(model, directory, target_modules)`:
#
# * find the `MyLoRALinear` layers of `model` (raise `ValueError` if there is none);
# * write `directory/adapter_config.json` with at least `peft_type` (`"LORA"`), `r`,
#   `lora_alpha`, `target_modules` (a list if you were given a list, the regex string
#   otherwise), `lora_dropout` (the layers' dropout probability, 0.0 without dropout),
#   `bias` (`"none"`), `use_rslora`, and `task_type` (`None`); all layers share one setting;
# * write `directory/adapter_model.safetensors` with `safetensors.torch.save_file` (never a
#   `torch.save` pickle), one entry per factor, named
#   `base_model.model.<layer name>.lora_A.weight` / `.lora_B.weight` (no adapter name);
#   create `directory` if needed.
#
# And `load_peft_adapter(model, directory) -> list[str]`, for a model without adapters: read
# the config (raise `ValueError` unless `peft_type` is `"LORA"`), `wrap` the model with its
# `target_modules`, `r`, `lora_alpha`, `lora_dropout` and `use_rslora`, read the tensors with
# `safetensors.torch.load_file` and copy each factor into its layer; raise `ValueError` naming
# the keys that are missing from the file, before copying anything. Return the wrapped names.
#
# Off-limits: `minituner.save_adapter` / `load_adapter`, and PEFT (the tests use them to
# check you).
#
# <details><summary>Hint 1: the idea</summary>
#
# A dict comprehension over `named_modules()` with `isinstance(m, MyLoRALinear)` gives the
# layers and their names; the first layer carries `r`, `alpha`, `use_rslora` and its
# `dropout` (an `nn.Dropout` has `.p`; an `nn.Identity` has none). `json.dumps` refuses a
# set and a tensor: write plain Python values. `save_file` wants a dict of contiguous tensors
# without autograd history (`.detach().contiguous()`). Loading is the same names in reverse:
# build the list of expected keys from the names `wrap` returns, compare it with the file's
# keys, and copy under `torch.no_grad()`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# save_peft_adapter(model, directory, target_modules):
#     layers = {name: m for name, m in model.named_modules() if m is a MyLoRALinear}
#     none -> ValueError;  first = any one of them
#     config = {peft_type: "LORA", task_type: None, r: first.r, lora_alpha: first.alpha,
#               target_modules: the string, or list(target_modules), lora_dropout: p or 0.0,
#               bias: "none", use_rslora: first.use_rslora}
#     tensors = {PREFIX + name + ".lora_A.weight": A, PREFIX + name + ".lora_B.weight": B, ...}
#     mkdir directory;  write the JSON;  save_file(tensors, directory/adapter_model.safetensors)
#
# load_peft_adapter(model, directory):
#     config = JSON;  peft_type != "LORA" -> ValueError
#     tensors = load_file(...)
#     names = wrap(model, config's target_modules, r, lora_alpha, lora_dropout, use_rslora)
#     missing = expected keys not in tensors;  any -> ValueError naming them
#     with no_grad: copy each tensor into its layer's lora_A / lora_B
#     return names
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "adapters", "locked": false, "schema_version": 3, "solution": true, "task": false}
PREFIX = "base_model.model."


def save_peft_adapter(model: nn.Module, directory, target_modules) -> None:
    """Write model's LoRA factors as a PEFT adapter: adapter_config.json + .safetensors."""
    ### BEGIN SOLUTION
    layers = {n: m for n, m in model.named_modules() if isinstance(m, MyLoRALinear)}
    if not layers:
        raise ValueError("the model has no MyLoRALinear layer; call wrap first")
    first = next(iter(layers.values()))
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "r": first.r,
        "lora_alpha": first.alpha,
        "target_modules": target_modules if isinstance(target_modules, str)
        else list(target_modules),
        "lora_dropout": float(getattr(first.dropout, "p", 0.0)),
        "bias": "none",
        "use_rslora": first.use_rslora,
    }
    tensors = {}
    for name, m in layers.items():
        tensors[f"{PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().contiguous()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    safetensors.torch.save_file(tensors, str(directory / "adapter_model.safetensors"),
                                metadata={"format": "pt"})
    ### END SOLUTION


def load_peft_adapter(model: nn.Module, directory) -> list[str]:
    """Wrap model as the adapter's config says and load its factors; return the names."""
    ### BEGIN SOLUTION
    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"not a LoRA adapter: peft_type is {config.get('peft_type')!r}")
    tensors = safetensors.torch.load_file(str(directory / "adapter_model.safetensors"))
    names = wrap(model, config["target_modules"], r=config["r"], alpha=config["lora_alpha"],
                 dropout=config.get("lora_dropout", 0.0) or 0.0,
                 use_rslora=config.get("use_rslora", False))
    keys = [f"{PREFIX}{n}.lora_{ab}.weight" for n in names for ab in "AB"]
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise ValueError(f"the adapter file lacks {missing}")
    with torch.no_grad():
        for name in names:
            layer = model.get_submodule(name)
            layer.lora_A.copy_(tensors[f"{PREFIX}{name}.lora_A.weight"])
            layer.lora_B.copy_(tensors[f"{PREFIX}{name}.lora_B.weight"])
    return names
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_save_adapter", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
_IDX = torch.randint(0, 45, (2, 16), generator=torch.Generator().manual_seed(1))


def _check_save(target_modules, r=4, alpha=8.0, dropout=0.0, use_rslora=False, what="",
                with_ref=False):
    where = f"{what}an adapter on {target_modules!r}, r={r}, alpha={alpha}, " \
            f"dropout={dropout}, rslora={use_rslora}"
    model = share(small_gpt())
    names = wrap(model, target_modules, r=r, alpha=alpha, dropout=dropout, use_rslora=use_rslora)
    _randomize(model, seed=r)
    model.eval()
    with torch.no_grad():
        ours = model(_IDX)
    folder = learner_dir()                 # a folder your code can write to
    with _forbid_reference():
        save_peft_adapter(model, str(Path(folder) / "adapter"), target_modules)
    d = fetch_dir(folder) / "adapter"
    files = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    assert files == ["adapter_config.json", "adapter_model.safetensors"], \
        f"{where}: expected the two files adapter_config.json and " \
        f"adapter_model.safetensors in the directory, found {files}"
    cfg = json.loads((d / "adapter_config.json").read_text())
    want_cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": dropout,
                "bias": "none", "use_rslora": use_rslora,
                "target_modules": target_modules if isinstance(target_modules, str)
                else list(target_modules)}
    if isinstance(cfg.get("target_modules"), list):       # any order will do
        cfg["target_modules"] = sorted(cfg["target_modules"])
        want_cfg["target_modules"] = sorted(want_cfg["target_modules"])
    for k, v in want_cfg.items():
        assert k in cfg and cfg[k] == v, \
            f"{where}: adapter_config.json should hold {k} = {v!r}, got {cfg.get(k, '(none)')!r}"
    tensors = safetensors.torch.load_file(d / "adapter_model.safetensors")
    want_keys = sorted(f"{PREFIX}{n}.lora_{ab}.weight" for n in names for ab in "AB")
    assert sorted(tensors) == want_keys, \
        f"{where}: the safetensors keys should be {want_keys[:2]}...; got {sorted(tensors)[:4]}" \
        + ("\nLikely: on disk PEFT's names carry no adapter name ('default')"
           if any(".default." in k for k in tensors) else "")
    for n in names:
        for ab in "AB":
            assert torch.equal(tensors[f"{PREFIX}{n}.lora_{ab}.weight"],
                               getattr(model.get_submodule(n), f"lora_{ab}")), \
                f"{where}: {n}.lora_{ab} was saved with other values"
    # PEFT loads it onto a fresh copy of the base model: same logits
    theirs = peft.PeftModel.from_pretrained(small_gpt(), str(d)).eval()
    with torch.no_grad():
        got = theirs(_IDX)
    torch.testing.assert_close(got, ours, rtol=0, atol=1e-6, msg=lambda m: (
        f"{where}: PeftModel.from_pretrained(your adapter) computes other logits than "
        f"your model:\n{m}"))
    assert theirs.peft_config["default"].use_rslora == use_rslora
    # and so does a fresh base model whose weights get W + s·B·A from the file, s computed
    # here from r, alpha and use_rslora (a dense merge: no LoRA layer involved)
    dense = small_gpt()
    s = alpha / (math.sqrt(r) if use_rslora else r)
    with torch.no_grad():
        for n in names:
            w = dense.get_submodule(n).weight
            w.copy_((w.double() + s * (tensors[f"{PREFIX}{n}.lora_B.weight"].double()
                                       @ tensors[f"{PREFIX}{n}.lora_A.weight"].double())).float())
        torch.testing.assert_close(dense(_IDX), ours, rtol=0, atol=1e-5, msg=lambda m: (
            f"{where}: the base model with W + s·B·A (s = {s!r}) merged from your file computes "
            f"other logits than your model:\n{m}"))
    if with_ref:                       # and so does the reference loader
        ref = small_gpt()
        minituner.load_adapter(ref, d)
        ref.eval()                     # the layers it creates start in training mode
        with torch.no_grad():
            torch.testing.assert_close(ref(_IDX), ours, rtol=0, atol=1e-6)
    assert (ours - small_gpt()(_IDX)).abs().max() > 1e-3, "the adapter should change the logits"


_check_save(["q_proj", "v_proj", "down_proj"])
_check_save(["o_proj"], r=2, alpha=4.0, dropout=0.1, use_rslora=True)
try:
    with _forbid_reference():
        save_peft_adapter(small_gpt(), learner_dir(), ["q_proj"])
except ValueError:
    pass
except Exception as _e:
    raise AssertionError(f"save_peft_adapter on a model without MyLoRALinear layers raised "
                         f"{type(_e).__name__}: {_e}\nRule: raise ValueError when there is no "
                         "LoRA layer to save") from _e
else:
    raise AssertionError("save_peft_adapter on a model without MyLoRALinear layers should raise "
                         "ValueError (there is nothing to save; wrap first)")
print("save_peft_adapter: PeftModel.from_pretrained loads your files and computes your logits")

### BEGIN HIDDEN TESTS
# case: a regex target, rsLoRA
_check_save(r"blocks\.\d+\.attn\.(k|o)_proj", r=3, alpha=6.0, use_rslora=True, what="hidden: ",
            with_ref=True)
# case: the output head, with dropout
_check_save(["up_proj", "lm_head"], r=2, alpha=16.0, dropout=0.1, what="hidden: ",
            with_ref=True)
# case: a model without LoRA layers
try:
    save_peft_adapter(small_gpt(), learner_dir(), ["q_proj"])
except ValueError:
    pass
else:
    raise AssertionError("hidden: save_peft_adapter on a model without LoRA layers should "
                         "raise ValueError")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_load_adapter", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_load(target_modules, r=4, alpha=8, use_rslora=False, what=""):
    where = f"{what}a PEFT adapter on {target_modules!r}, r={r}, lora_alpha={alpha}, " \
            f"rslora={use_rslora}"
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                          use_rslora=use_rslora)
    theirs = peft.get_peft_model(small_gpt(), cfg)
    randomize_lora(theirs, seed=r + 1)
    theirs.eval()
    want_names = [n.removeprefix(PREFIX) for n, m in theirs.named_modules()
                  if isinstance(m, peft.tuners.lora.LoraLayer)]
    with tempfile.TemporaryDirectory() as d:
        theirs.save_pretrained(d)
        mine = share(small_gpt())
        with _forbid_reference():
            names = load_peft_adapter(mine, send_dir(d))
    assert isinstance(names, list) and names == want_names, \
        f"{where}: expected the wrapped names {want_names}, got {names}"
    mine.eval()
    want_s = alpha / (math.sqrt(r) if use_rslora else r)
    scalings = {n: mine.get_submodule(n).scaling for n in names}
    assert all(math.isclose(v, want_s) for v in scalings.values()), \
        f"{where}: the loaded layers have scaling {scalings}; the config says {want_s!r} " \
        f"(pass r, lora_alpha and use_rslora from adapter_config.json on to wrap)"
    with torch.no_grad():
        want, got = theirs(_IDX), mine(_IDX)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: (
        f"{where}: your model with the loaded adapter computes other logits than PEFT's:\n{m}"))


_check_load(["k_proj", "up_proj"])
_check_load(["v_proj"], r=2, alpha=8, use_rslora=True)
# a file that lacks a key, and a config that is not LoRA: ValueError, before copying anything
_m = share(small_gpt())
wrap(_m, ["k_proj"], r=2, alpha=4.0)
_ld = learner_dir()
save_peft_adapter(_m, _ld, ["k_proj"])
_d = fetch_dir(_ld)
_t = safetensors.torch.load_file(Path(_d) / "adapter_model.safetensors")
_key = f"{PREFIX}blocks.0.attn.k_proj.lora_A.weight"
del _t[_key]
safetensors.torch.save_file(_t, str(Path(_d) / "adapter_model.safetensors"))
try:
    with _forbid_reference():
        load_peft_adapter(small_gpt(), send_dir(_d))
except ValueError as e:
    assert _key in str(e), f"the error should name the missing key {_key}; it says: {e}"
except KeyError as e:
    raise AssertionError(f"a file without {_key} raised KeyError({e}); rule: compare the "
                         f"expected keys with the file's first and raise ValueError naming "
                         f"the missing ones") from e
else:
    raise AssertionError(f"a file without {_key} should raise ValueError naming it")
save_peft_adapter(_m, _ld, ["k_proj"])           # complete again, but not a LoRA config
_d = fetch_dir(_ld)
_cfg = json.loads((Path(_d) / "adapter_config.json").read_text())
(Path(_d) / "adapter_config.json").write_text(json.dumps({**_cfg, "peft_type": "LOHA"}))
try:
    with _forbid_reference():
        load_peft_adapter(small_gpt(), send_dir(_d))
except ValueError:
    pass
else:
    raise AssertionError("an adapter_config.json with peft_type 'LOHA' should raise "
                         "ValueError (rule: only peft_type 'LORA' is loaded)")
print("load_peft_adapter: an adapter saved by PEFT gives PEFT's logits in your model")

### BEGIN HIDDEN TESTS
# case: an rsLoRA adapter on three attention projections
_check_load(["q_proj", "v_proj", "o_proj"], r=3, alpha=6, use_rslora=True, what="hidden: ")
# case: a regex target
_check_load(r".*mlp\.(gate|down)_proj", r=2, alpha=16, what="hidden: ")
# case: a round trip through your own save, then a file that lacks a key
_m = share(small_gpt())
wrap(_m, ["q_proj", "v_proj"], r=4, alpha=8.0)
_randomize(_m, seed=9)
_ld = learner_dir()
save_peft_adapter(_m, _ld, ["q_proj", "v_proj"])
_m2 = share(small_gpt())
load_peft_adapter(_m2, _ld)
with torch.no_grad():
    assert torch.equal(_m2.eval()(_IDX), _m.eval()(_IDX)), "hidden: save -> load round trip"
_d = fetch_dir(_ld)
_t = safetensors.torch.load_file(Path(_d) / "adapter_model.safetensors")
_key = f"{PREFIX}blocks.1.attn.v_proj.lora_B.weight"
del _t[_key]
safetensors.torch.save_file(_t, str(Path(_d) / "adapter_model.safetensors"))
try:
    load_peft_adapter(small_gpt(), send_dir(_d))
except ValueError as e:
    assert _key in str(e), f"hidden: the error should name the missing key {_key}: {e}"
else:
    raise AssertionError("hidden: a file without one of the keys should raise ValueError")
# case: a config of another PEFT type
_cfg = json.loads((Path(_d) / "adapter_config.json").read_text())
_cfg["peft_type"] = "IA3"
(Path(_d) / "adapter_config.json").write_text(json.dumps(_cfg))
try:
    load_peft_adapter(small_gpt(), send_dir(_d))
except ValueError:
    pass
else:
    raise AssertionError("hidden: peft_type 'IA3' should raise ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ## Part F — All of it together: a few steps of LoRA on the pretrained model
#
# Your pieces, end to end, on the pretrained MiniGPT: `wrap` every attention and MLP
# projection at rank 8, train the adapter for 60 steps with the course's training loop
# (`minituner.train`, AdamW on the parameters that require gradients: only your factors) on
# the task the base model never saw (`rev`, reversing a word), then merge it, save it, and
# load it into PEFT. Lab 05 does the real fine-tune; this is a smoke test of your code.

# %% tags=["jupyter-only"]
tok = CharTokenizer()
examples = tasks.make_examples(tasks.HELD_OUT, 512, seed=0)
data = minituner.SequenceData.from_pairs(
    [(tok.encode(ex.prompt), tok.encode(ex.answer) + [tok.eos_id]) for ex in examples],
    pad_id=tok.pad_id)

model = minigpt.load_base("dense")
names = wrap(model, TARGETS["attention + MLP"], r=8, alpha=16.0)
trainable, total = count_trainable(model)
print(f"{len(names)} layers wrapped; trainable {trainable:,d} of {total:,d} (base + adapter, "
      f"{trainable / total:.1%})")
frozen_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}

cfg = minituner.TrainConfig(steps=60, batch_size=32, lr=3e-3, warmup_steps=5, log_every=5,
                            progress=False)
t0 = time.perf_counter()
result = minituner.train(model, data, cfg)
print(f"60 steps in {time.perf_counter() - t0:.1f} s; loss {result.losses[0]:.2f} -> "
      f"{result.losses[-1]:.2f}")
unchanged = all(torch.equal(v, model.state_dict()[k]) for k, v in frozen_before.items())
print("every frozen weight unchanged:", unchanged)
assert unchanged

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot([cfg.log_every * (i + 1) for i in range(len(result.losses))], result.losses, "o-")
ax.set_xlabel("step")
ax.set_ylabel(f"loss (mean of {cfg.log_every} steps)")
ax.set_title(f"LoRA r=8 on attention + MLP, task '{tasks.HELD_OUT}'")
plt.show()

# %% tags=["jupyter-only"]
model.eval()
idx = data.tokens[:4]                      # four padded prompt + answer sequences
with torch.no_grad():
    logits = model(idx)
    layers = [model.get_submodule(n) for n in names]
    for layer in layers:
        merge(layer)
    merged_logits = model(idx)
    for layer in layers:
        unmerge(layer)
    print("merged vs adapter, max |logit difference|:",
          f"{(merged_logits - logits).abs().max().item():.2e}")

with tempfile.TemporaryDirectory() as d:
    save_peft_adapter(model, d, TARGETS["attention + MLP"])
    adapter_bytes = (Path(d) / "adapter_model.safetensors").stat().st_size
    theirs = peft.PeftModel.from_pretrained(minigpt.load_base("dense"), d).eval()
    with torch.no_grad():
        peft_logits = theirs(idx)
print("PEFT with your adapter vs your model, max |logit difference|:",
      f"{(peft_logits - logits).abs().max().item():.2e}")
print(f"adapter file: {adapter_bytes / 1024:.0f} KB; base checkpoint: "
      f"{minigpt.base_path('dense').stat().st_size / 1024:.0f} KB")

# %% [markdown]
# ## Where this goes next
#
# You have built LoRA from its pieces: a layer that starts as the identity, a backward pass
# that stays at rank size, merging (and why NF4 refuses it), PEFT's selection rule, and files
# PEFT reads and writes. Lab 05 fine-tunes MiniGPT on the held-out task for real and measures
# what rank and targets buy; Lab 06 puts the same layer over a frozen **NF4** base (QLoRA),
# where the Function's freedom to dequantize again in the backward instead of saving the
# dequantized weight matters; Labs 09–10 write the same three gradient formulas as Triton
# kernels for Mixture-of-Experts layers.
#
# ### Reflection
#
# 1. B starts at zero and A at random. What would go wrong with the opposite choice (A zero,
#    B random)? Work out $dA$ and $dB$ at the first step.
# 2. With $s = \alpha / r$, doubling the rank at a fixed $\alpha$ halves $s$. With AdamW, whose
#    step size hardly depends on the gradient's scale, what does that do to how fast
#    $s\,BA$ can change, and why does $\alpha/\sqrt{r}$ behave differently?
# 3. Your Function saves `x`, `x·Aᵀ`, `A`, `B` and `W`. Which of these are new memory and
#    which already exist? What would you save instead over an NF4 base, and what would the
#    backward then have to recompute?
# 4. Dropout on the LoRA path multiplies $x$ by a random mask $m$. Derive the LoRA part of
#    $dX$ with dropout, and say why $dA$ must use $x \odot m$, not $x$.
# 5. The memory chart says the decomposition buys nothing on MiniGPT's `128 x 128` layers at
#    2048 tokens. At what number of tokens $T$ does `[T, r]` outgrow `[out, in]` for a
#    `4096 x 4096` projection at rank 16, and is that a batch you would meet in practice?
# 6. PEFT's on-disk names drop the adapter name (`default`). What does that buy when one
#    model carries two adapters, and what must a loader do to put a file into an adapter that
#    is not called `default`?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. Nothing fatal, as long as exactly one factor is zero: $\Delta W = s\,B\cdot 0 = 0$, so the
#    model still starts unchanged. At the first step $dB = s\,dY^\top (x A^\top) = 0$ because
#    $x A^\top = 0$, while $dA = s\,(dY B)^\top x \ne 0$: the mirror image of the printout
#    above ($|dL/dA| = 0$, $|dL/dB| = 0.4366$ for the LoRA convention). What goes wrong is
#    compatibility and scale: PEFT's files and `minituner` assume B is the zero factor, and a
#    random B of `[out, r]` drawn like `nn.Linear(r, out)` has entries up to $1/\sqrt{r}$
#    (0.35 at r = 8) instead of A's $1/\sqrt{\text{in}}$ (0.09 for in = 128), so the first
#    updates of $\Delta W$ are larger; analyses of LoRA's training dynamics (Hayou et al.,
#    2024) find the usual choice tolerates larger learning rates.
# 2. AdamW moves every entry of A and B by about the learning rate per step, whatever $s$ is,
#    so $s\,BA$ changes by roughly $s$ times a sum of $r$ rank-one terms; for directions that
#    are not aligned that sum grows like $\sqrt{r}$, and the change scales like
#    $s\sqrt{r} = \alpha/\sqrt{r}$ under $s = \alpha/r$: doubling the rank slows learning by
#    about $1/\sqrt 2$, so high ranks underuse their capacity. With $s = \alpha/\sqrt{r}$ the
#    product $s\sqrt{r} = \alpha$ does not depend on $r$, which is rsLoRA's argument for
#    rank-stable learning.
# 3. `A`, `B` and `W` are parameters that exist anyway: saving them keeps a reference, no copy.
#    `x` is the layer's input activation; it is held until the backward only because `dA`
#    needs it (with a frozen W, the base path alone would not), so it costs `[T, in]`.
#    `x·Aᵀ` is new but only `[T, r]`. Over an NF4 base, `W` is not a float tensor at all:
#    saving the dequantized `[out, in]` weight would hold exactly the memory QLoRA removes, so
#    save the packed NF4 storage (or a callable that dequantizes it) and dequantize again in
#    the backward for $dX = dY\,W$, one extra dequantization per layer per step.
# 4. With $y = xW^\top + s\,((x \odot m) A^\top) B^\top$, the LoRA part of $dX$ is
#    $s\,((dY B) A) \odot m$: the gradient flows back through the same mask. $dA$ is
#    $s\,(dY B)^\top (x \odot m)$ because A multiplies the dropped input; using $x$ would be
#    the gradient of a function the forward never computed (gradcheck would fail), and the
#    dropped features would be trained as if they had been seen. `minituner.lora_linear`
#    saves `x_d = x * mask` for `dA` and multiplies the LoRA part of `dX` by `mask`.
# 5. `[T, r]` outgrows `[out, in]` when $T r > \text{out} \cdot \text{in}$, here
#    $T > 4096 \cdot 4096 / 16 = 1\,048\,576$ tokens in one step on one device. Fine-tuning
#    batches are thousands to tens of thousands of tokens per device (8 sequences of 2048
#    are 16 384), so for the projections of real models the decomposition always wins; it
#    loses only on layers as small as MiniGPT's, where nothing is short of memory anyway.
# 6. A file is not tied to a slot: the same model can load two files as two named adapters
#    (say `default` and `rev`) and switch between them, or load one file into several models,
#    without renaming anything on disk. A loader that puts a file into an adapter called
#    `rev` must insert the name into every key
#    (`...q_proj.lora_A.weight` → `...q_proj.lora_A.rev.weight`), create that adapter's
#    layers from the config first, and then copy; PEFT does this in
#    `PeftModel.load_adapter(path, adapter_name="rev")`.
