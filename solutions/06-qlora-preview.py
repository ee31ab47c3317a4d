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
# # Lab 06 — QLoRA preview: an NF4 base under a LoRA adapter
#
# LoRA (Lab 04) removes the gradients and the AdamW state of the frozen weights, but the
# weights themselves are still there, in 16 or 32 bits: 12.6 GiB for a 7-billion-parameter
# model in bfloat16 before anything trains. **QLoRA** (Dettmers et al., 2023) stores that
# frozen base in **NF4** (Lab 02: 4-bit codes, one scale per block of 64, the scales
# themselves quantized to 8 bits) and trains float LoRA factors on top:
#
# $$ y = x\,\mathrm{dequant}(W_{\text{NF4}})^\top + s\cdot(x A^\top) B^\top, $$
#
# where the gradient flows through the dequantized weight to $x$, never into the codes. Two
# questions decide whether that works: does an adapter see the same model on the 4-bit base
# as on the float one, and what does the memory bill actually become? In this lab you compose
# the pieces of Labs 02 and 04, measure both, and extrapolate to 7B.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `qlora_wrap(model, r, alpha, blocksize, double_quant)`: quantize, then wrap | `minituner.qlora.wrap_minigpt_qlora`, same structure and logits; refuses the wrong order |
# | 2 | `logit_parity(model_a, model_b, tokens)` | hand-computed values; experiment 06's tolerance on the real adapter |
# | 3 | `held(model, optimizer)`: bytes of weights, gradients, optimizer state | `minituner.memory.held_bytes`, tensor by tensor |
# | 4 | `nf4_storage_bytes(...)`, `predict_bytes(shape, regime, ...)` | `NF4Weight.nbytes`; `minituner.memory.predict_training`, up to LLaMA-7B |
# | 5 | `swap_adapter(model, directory)`: a second adapter into the same NF4 model | fresh loads, bit for bit; the NF4 buffers untouched |
#
# The adapters come from experiment 05 (`experiments/05-lora-finetune`): `rev_replay` was
# trained on the held-out task `rev` with replay of the other tasks, `rev_only` on `rev`
# alone. Experiment 06 (`experiments/06-qlora-preview`) is the full-size version of this lab:
# a whole epoch of QLoRA, 200 evaluation examples per task, a manifest to reproduce it.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification —
# other ranks, blocksizes, models, bad inputs. You may use the course packages (`miniquant`,
# `minituner`, `labkit`) except the one function each exercise rebuilds; the tests switch that
# one off while your code runs. Each exercise states its **specification** first (inputs,
# outputs, the rules that matter, what is off-limits), which is enough to solve it; below it,
# folded **hints** go from the idea to pseudocode, for when you want them. No GPU is needed:
# the whole notebook runs in <!-- runtime:06-qlora-preview -->about 18 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F

# miniquant imports bitsandbytes, which logs a warning about an optional CPU kernel package.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import minigpt  # noqa: E402
import miniquant  # noqa: E402
import minituner  # noqa: E402
import minituner.qlora  # noqa: E402
from course.notebook.harness import forbid, pairs_of, randn, randomize_lora  # noqa: E402
from labkit import measure  # noqa: E402
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, evaluate, tasks  # noqa: E402
from minigpt.checkpoint import repo_root  # noqa: E402
from miniquant import QuantizedLinear, quantize_model  # noqa: E402
from minituner import LoRALinear, load_adapter, memory, save_adapter, wrap_lora  # noqa: E402
from minituner.activations import saved_activation_bytes  # noqa: E402
from minituner.qlora import wrap_minigpt_qlora  # noqa: E402

torch.set_num_threads(1)   # small matrices: one thread is faster than several on a busy CPU
torch.manual_seed(0)
print("torch", torch.__version__, "| threads:", torch.get_num_threads())

MiB, GiB = 2**20, 2**30
ROOT = repo_root()          # the course checkout, wherever this notebook runs from
# The seven projections of every MiniGPT block (a full-match regex, as PEFT takes it).
BLOCK_PROJECTIONS = r"blocks\.\d+\.(attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
ADAPTERS = {name: ROOT / "experiments" / "05-lora-finetune" / f"adapter_{name}"
            for name in ("rev_replay", "rev_only")}
for _name, _dir in ADAPTERS.items():
    assert (_dir / "adapter_model.safetensors").is_file(), (
        f"adapter {_name!r} not found in {_dir}: run `python -m labkit run "
        f"experiments/05-lora-finetune` from the repository root first")
TOLERANCE = json.loads((ROOT / "experiments" / "06-qlora-preview" / "config.json")
                       .read_text())["logit_tolerance"]
print("adapters:", {k: str(v.relative_to(ROOT)) for k, v in ADAPTERS.items()})
print("experiment 06's tolerance:", TOLERANCE)

tok = CharTokenizer()


def fixed_prompts(per_task=32, seed=0):
    """[6 · per_task, L] prompt + answer tokens of evaluation examples of every task, padded."""
    examples = [e for t in tasks.TASKS for e in tasks.make_examples(t, per_task, seed, "eval")]
    return minituner.SequenceData.from_pairs(pairs_of(examples, tok), pad_id=tok.pad_id).tokens


SMALL = MiniGPTConfig(n_layer=2, n_head=2, n_embd=32, d_ff=48, block_size=16)


def small_gpt(seed=0, config=SMALL) -> MiniGPT:
    """A tiny random MiniGPT (2 blocks, width 32): what most tests quantize and wrap."""
    torch.manual_seed(seed)
    return MiniGPT(config).eval()


def float_lora(adapter=None) -> MiniGPT:
    """The pretrained float32 MiniGPT with LoRA (r=8, alpha=16) on its block projections."""
    model = minigpt.load_base("dense")
    wrap_lora(model, BLOCK_PROJECTIONS, r=8, alpha=16.0)
    if adapter is not None:
        load_adapter(model, adapter)
    return model.eval()


def reference_qlora(adapter=None) -> MiniGPT:
    """The same over an NF4 base, built by the reference (minituner.qlora)."""
    model = minigpt.load_base("dense")
    wrap_minigpt_qlora(model, r=8, alpha=16.0)
    if adapter is not None:
        load_adapter(model, adapter)
    return model.eval()


PROMPTS = fixed_prompts()
print("fixed evaluation prompts:", tuple(PROMPTS.shape))


# %% [markdown]
# ## Part A — Exercise 1: quantize first, then wrap
#
# `miniquant.quantize_model(model, target, blocksize, double_quant)` replaces every
# `nn.Linear` whose full name matches the regex `target` with a `QuantizedLinear`: NF4 codes
# and scales as **buffers** (no optimizer can see them), dequantized on every forward.
# `minituner.wrap_lora(model, target, r, alpha)` puts a `LoRALinear` around every matching
# `nn.Linear` **or** `QuantizedLinear` and freezes everything but the factors. QLoRA is the
# two, in this order. The other order does not fail loudly where you would expect: once a
# projection is a `LoRALinear`, it is no longer an `nn.Linear`, and the float layer inside
# it is called `blocks.0.attn.q_proj.base`, which the block pattern does not match. Watch:

# %%
wrong = minigpt.load_base("dense")
wrap_lora(wrong, BLOCK_PROJECTIONS, r=8, alpha=16.0)
try:
    quantize_model(wrong, BLOCK_PROJECTIONS)
except ValueError as e:
    print("quantize after wrap:", str(e)[:150], "...")
# The error is the lucky outcome. In a script that skips it (or a quantizer that only warns),
# training goes on with the base in float32 and nothing saved; and a looser pattern that
# reaches inside the LoRA layers (`...q_proj.base`) would round any adapter merged in between
# into the 4-bit codes. So: quantize the plain model, then wrap.
right = minigpt.load_base("dense")
quantize_model(right, BLOCK_PROJECTIONS)
wrap_lora(right, BLOCK_PROJECTIONS, r=8, alpha=16.0)
for label, model in (("wrapped, never quantized", wrong), ("quantized, then wrapped", right)):
    w = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    print(f"{label:<26} weights held: {w / MiB:6.2f} MiB")
print(right.blocks[0].attn.q_proj)

# %% [markdown]
# **Specification.** Write `qlora_wrap(model, r=8, alpha=16.0, blocksize=64, double_quant=True,
# target=BLOCK_PROJECTIONS) -> list[str]`, in place:
#
# * if the model already holds **any** `LoRALinear` (anywhere, not only on `target`), raise
#   `ValueError` with a message that says the base must be quantized first — and raise it
#   **before changing anything** (a model half quantized when the error comes is worse than
#   one untouched);
# * quantize every `nn.Linear` matching `target` to NF4 with the given `blocksize` and
#   `double_quant` (`quantize_model`, or `QuantizedLinear.from_linear` layer by layer);
# * wrap the same layers with LoRA (`wrap_lora`, or `LoRALinear` and your own freezing);
# * return the wrapped names, in the model's order.
#
# Afterwards the only trainable tensors are the float32 `lora_A` / `lora_B`; the embeddings,
# norms and `lm_head` stay float32 and frozen, as in QLoRA (a small share of a large model,
# and the most sensitive to rounding). Off-limits: `minituner.qlora.wrap_minigpt_qlora`, the
# reference the hidden tests compare you with.
#
# <details><summary>Hint 1: the idea</summary>
#
# The whole exercise is the order of three things: look, quantize, wrap. Look first, over
# every module (`model.named_modules()` with `isinstance(m, LoRALinear)`), so that the error
# comes while the model is still untouched; then the two library calls above, with the same
# `target`, the quantizer with `blocksize` and `double_quant`, the wrapper with `r` and
# `alpha`. `wrap_lora` already returns the wrapped names in the model's order.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# qlora_wrap(model, r, alpha, blocksize, double_quant, target):
#     lora = [name for name, m in model.named_modules() if m is a LoRALinear]
#     if lora: raise ValueError("... already holds LoRA layers: quantize the base first ...")
#     quantize_model(model, target, blocksize=blocksize, double_quant=double_quant)
#     return wrap_lora(model, target, r=r, alpha=alpha)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "qlora_wrap", "locked": false, "schema_version": 3, "solution": true, "task": false}
def qlora_wrap(model: nn.Module, r: int = 8, alpha: float = 16.0, blocksize: int = 64,
               double_quant: bool = True, target: str = BLOCK_PROJECTIONS) -> list[str]:
    """Quantize the linears matching `target` to NF4, then wrap them with LoRA (in place)."""
    ### BEGIN SOLUTION
    wrapped = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    if wrapped:
        raise ValueError(f"the model already holds LoRA layers ({wrapped[:3]}"
                         f"{' ...' if len(wrapped) > 3 else ''}): QLoRA quantizes the base "
                         f"first and wraps it second; start from the plain model")
    quantize_model(model, target, blocksize=blocksize, double_quant=double_quant)
    return wrap_lora(model, target, r=r, alpha=alpha)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_qlora_wrap", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import send_dir, share

_NO_REFERENCE_WRAP = [minituner.qlora.wrap_minigpt_qlora]


def _structure(model):
    return [(n, m.__class__.__name__) for n, m in model.named_modules()]


def _randomize(model, seed=1, std=0.1):
    """randomize_lora's values, loaded with load_state_dict (also into a model your code
    holds)."""
    g = torch.Generator().manual_seed(seed)
    new = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) * std
           for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n}
    model.load_state_dict(new, strict=False)


def _projections(n_layer):
    """The names of the seven projections of every block, in the model's order (what
    BLOCK_PROJECTIONS matches in a MiniGPT of n_layer blocks)."""
    return [f"blocks.{i}.{p}" for i in range(n_layer)
            for p in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _qlora_fixture(model, r=8, alpha=16.0, blocksize=64, double_quant=True, names=None):
    """A QLoRA model for the tests, built one named layer at a time from the library's
    pieces (Lab 02's QuantizedLinear.from_linear, Lab 04's LoRALinear), then every
    parameter but the factors frozen; names: every block projection unless given. In place;
    returns the model."""
    names = _projections(model.config.n_layer) if names is None else names
    for n in names:
        q = QuantizedLinear.from_linear(model.get_submodule(n), blocksize=blocksize,
                                        double_quant=double_quant)
        model.set_submodule(n, LoRALinear(q, r=r, alpha=alpha))
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith((".lora_A", ".lora_B")))
    return model


def _fixture_qlora(adapter=None):
    """reference_qlora's model (the pretrained MiniGPT, NF4 under r=8 LoRA, the adapter
    loaded), built with _qlora_fixture."""
    model = _qlora_fixture(minigpt.load_base("dense"), r=8, alpha=16.0)
    if adapter is not None:
        load_adapter(model, adapter)
    return model.eval()


def _check_qlora_wrap(make, r=8, alpha=16.0, blocksize=64, double_quant=True, what="",
                      with_ref=False):
    where = f"{what}qlora_wrap(r={r}, alpha={alpha}, blocksize={blocksize}, " \
            f"double_quant={double_quant})"
    mine, ref, plain = share(make()), make(), make()     # yours: changed in place, read back
    # expectations first: the names by hand, the model layer by layer
    want_names = _projections(plain.config.n_layer)
    _qlora_fixture(ref, r=r, alpha=alpha, blocksize=blocksize, double_quant=double_quant)
    if with_ref:
        ref2 = make()
        torch.manual_seed(5)
        assert wrap_minigpt_qlora(ref2, r=r, alpha=alpha, double_quant=double_quant,
                                  quant_scheme=f"nf4_per_group_{blocksize}") == want_names
        assert _structure(ref2) == _structure(ref)
        assert all(torch.equal(a, b) for a, b in zip(ref.buffers(), ref2.buffers(),
                                                     strict=True))
    torch.manual_seed(5)
    try:
        with forbid(_NO_REFERENCE_WRAP, globals()):
            names = qlora_wrap(mine, r=r, alpha=alpha, blocksize=blocksize,
                               double_quant=double_quant)
    except ValueError as e:
        raise AssertionError(f"{where} on a plain model raised ValueError: {e}\nRule: quantize "
                             f"first, wrap second (a wrapped projection is no nn.Linear any "
                             f"more, so a quantizer run after wrap_lora finds nothing)") from e
    assert names == want_names, f"{where}: expected the wrapped names {want_names[:3]}... " \
                                f"({len(want_names)}), got {names}"
    assert _structure(mine) == _structure(ref), \
        f"{where}: the module tree differs from the expected one (each block projection a " \
        f"LoRALinear around a QuantizedLinear); first differences: " \
        f"{[(a, b) for a, b in zip(_structure(mine), _structure(ref), strict=False) if a != b][:3]}"
    for name in names:
        layer = mine.get_submodule(name)
        assert isinstance(layer.base, QuantizedLinear), \
            f"{where}: {name}.base should be a QuantizedLinear, got {type(layer.base).__name__}"
        assert layer.r == r and layer.scaling == ref.get_submodule(name).scaling, \
            f"{where}: {name} has r={layer.r}, scaling {layer.scaling}; expected r={r}, " \
            f"scaling {alpha / r} (pass r and alpha on to the wrapper)"
        for ab in ("lora_A", "lora_B"):
            p = getattr(layer, ab)
            assert p.dtype == torch.float32 and p.requires_grad, \
                f"{where}: {name}.{ab} should be float32 and trainable, got {p.dtype}, " \
                f"requires_grad={p.requires_grad}"
    trainable = sorted(n for n, p in mine.named_parameters() if p.requires_grad)
    want_trainable = sorted(n for n, p in ref.named_parameters() if p.requires_grad)
    assert trainable == want_trainable, \
        f"{where}: trainable parameters should be exactly the LoRA factors " \
        f"({len(want_trainable)}); extra: {sorted(set(trainable) - set(want_trainable))[:4]}, " \
        f"missing: {sorted(set(want_trainable) - set(trainable))[:4]}"
    plain_params = dict(plain.named_parameters())
    for n, p in mine.named_parameters():
        if "lora_" not in n:
            assert p.dtype == torch.float32 and not p.requires_grad, \
                f"{where}: {n} should stay float32 and frozen, got {p.dtype}, " \
                f"requires_grad={p.requires_grad}"
            assert n in plain_params and torch.equal(p, plain_params[n]), \
                f"{where}: {n} changed (only block projections are quantized)"
    ref_buffers = dict(ref.named_buffers())
    for n, b in mine.named_buffers():
        assert n in ref_buffers and torch.equal(b, ref_buffers[n]), \
            f"{where}: NF4 buffer {n} differs from QuantizedLinear.from_linear's (blocksize " \
            f"or double_quant?)"
    assert sorted(ref_buffers) == sorted(dict(mine.named_buffers())), \
        f"{where}: expected the buffers {sorted(ref_buffers)[:4]}..., got " \
        f"{sorted(dict(mine.named_buffers()))[:4]}..."
    # same factors -> the same logits, bit for bit
    _randomize(mine, seed=r)
    _randomize(ref, seed=r)
    x = torch.randint(0, mine.config.vocab_size, (3, min(12, mine.config.block_size)),
                      generator=torch.Generator().manual_seed(2))
    mine.eval()
    ref.eval()
    with torch.no_grad():
        got, want = mine(x), ref(x)
    assert torch.equal(got, want), \
        f"{where}: with the same LoRA factors your model computes other logits than the same " \
        f"layers built one by one (max difference {(got - want).abs().max().item():.3g})"
    if with_ref:
        _randomize(ref2, seed=r)
        with torch.no_grad():
            assert torch.equal(got, ref2.eval()(x))
    return mine


_check_qlora_wrap(small_gpt)
_check_qlora_wrap(small_gpt, r=4, alpha=8.0, blocksize=32, double_quant=False)
_q = _check_qlora_wrap(lambda: minigpt.load_base("dense"))
# `target` decides which layers are quantized and wrapped
_m = share(small_gpt())
with forbid(_NO_REFERENCE_WRAP, globals()):
    _names = qlora_wrap(_m, target=r"blocks\.0\.attn\.(q|v)_proj")
assert _names == ["blocks.0.attn.q_proj", "blocks.0.attn.v_proj"] \
    and isinstance(_m.blocks[1].attn.q_proj, nn.Linear), \
    f"qlora_wrap(model, target=r'blocks\\.0\\.attn\\.(q|v)_proj') wrapped {_names}; rule: " \
    f"quantize and wrap exactly the layers matching `target`, leave the others nn.Linear"
print(f"qlora_wrap: {len([m for m in _q.modules() if isinstance(m, LoRALinear)])} layers, NF4 "
      f"under float32 LoRA factors, everything else float32 and frozen; logits equal those of "
      f"the same layers built one by one")

### BEGIN HIDDEN TESTS
# case: rank 4, blocksize 32
_check_qlora_wrap(lambda: small_gpt(3), r=4, alpha=8.0, blocksize=32, with_ref=True,
                  what="hidden: ")
# case: blocksize 128 without double quantization
_check_qlora_wrap(small_gpt, r=2, alpha=16.0, blocksize=128, double_quant=False,
                  with_ref=True, what="hidden: ")
# case: three blocks of width 48, rank 1
_check_qlora_wrap(lambda: small_gpt(1, MiniGPTConfig(n_layer=3, n_head=2, n_embd=48, d_ff=80,
                                                     block_size=8)),
                  r=1, alpha=1.0, with_ref=True, what="hidden (3 blocks, width 48): ")
# case: a target of two MLP projections of the second block
_m = share(small_gpt())
with forbid(_NO_REFERENCE_WRAP, globals()):
    _names = qlora_wrap(_m, target=r"blocks\.1\.mlp\.(up|down)_proj")
assert _names == ["blocks.1.mlp.up_proj", "blocks.1.mlp.down_proj"], \
    f"hidden: target r'blocks\\.1\\.mlp\\.(up|down)_proj' should wrap just those two, got {_names}"
assert isinstance(_m.blocks[0].mlp.up_proj, nn.Linear), \
    "hidden: a layer outside target was replaced"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_qlora_wrong_order", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_refuses(lora_target, what=""):
    model = small_gpt()
    wrap_lora(model, lora_target, r=4, alpha=8.0)
    before = _structure(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model = share(model)                # what your function holds, read back after it refuses
    try:
        with forbid(_NO_REFERENCE_WRAP, globals()):
            qlora_wrap(model)
    except ValueError as e:
        assert "quantiz" in str(e).lower(), \
            f"{what}the error should say that the base must be quantized first; got: {e}"
    else:
        raise AssertionError(f"{what}qlora_wrap on a model with LoRA on {lora_target!r} should "
                             f"raise ValueError (wrap after quantizing, never before)")
    assert _structure(model) == before, \
        f"{what}after refusing, the model must be as it was; changed modules: " \
        f"{[a for a, b in zip(_structure(model), before, strict=False) if a != b][:3]}"
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert sorted(now) == sorted(state) and all(torch.equal(v, now[k]) for k, v in state.items()), \
        f"{what}after refusing, every parameter and buffer must be as it was"


_check_refuses(BLOCK_PROJECTIONS)
try:                     # LoRA outside target (on lm_head): still wrapped first, still refused
    _check_refuses(["lm_head"], what="LoRA on lm_head only: ")
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: look for a LoRALinear anywhere in the model, not only "
                         "on target, and raise before quantizing anything") from _e
print("qlora_wrap refuses a model that was wrapped first, and leaves it untouched")

### BEGIN HIDDEN TESTS
# case: LoRA on one block projection only
_check_refuses(r"blocks\.0\.attn\.q_proj", what="hidden: ")
# case: LoRA on lm_head only
_check_refuses(["lm_head"], what="hidden (LoRA on lm_head only): ")
### END HIDDEN TESTS

# %% [markdown]
# ## Part B — Exercise 2: one adapter, two bases
#
# The `rev_replay` adapter was trained against the **float** weights. On the NF4 base it
# meets each weight moved by up to half a code gap times its block's absmax. How much does
# the model change? Three numbers over a fixed set of sequences answer it: the mean and the
# largest absolute logit difference, and how often the two models would pick the same next
# token.
#
# **Specification.** Write `logit_parity(model_a, model_b, tokens) -> dict` for `tokens`
# `[B, T]` (long), with float values:
#
# * `"mean_abs_diff"`: the mean over every position and vocabulary entry of
#   $|\text{logits}_a - \text{logits}_b|$; `"max_abs_diff"`: its maximum;
# * `"argmax_agreement"`: the fraction of positions (batch × sequence) where both models'
#   largest logit is the same token;
# * `"mean_abs_logit"`: the mean of $|\text{logits}_a|$, the scale the tolerance is stated
#   against.
#
# Put both models in `eval()` mode (dropout off) and compute without gradients. Return Python
# floats, not tensors.
#
# <details><summary>Hint 1: the idea</summary>
#
# Two forward passes under `torch.no_grad()` give `[B, T, V]` logits; cast them to float32
# (a bfloat16 model would otherwise round the differences). The means and the maximum run
# over every element; the argmax runs over the last (vocabulary) dimension and leaves a
# `[B, T]` tensor of token ids, whose equality you average as floats. `.item()` turns a 0-d
# tensor into a Python float.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# model_a.eval();  model_b.eval()
# with no_grad: la, lb = float32(model_a(tokens)), float32(model_b(tokens))    # [B, T, V]
# d = |la - lb|
# return {mean_abs_diff: mean(d), max_abs_diff: max(d),
#         argmax_agreement: mean(float(argmax(la, -1) == argmax(lb, -1))),
#         mean_abs_logit: mean(|la|)}                                         # all .item()
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "logit_parity", "locked": false, "schema_version": 3, "solution": true, "task": false}
def logit_parity(model_a: nn.Module, model_b: nn.Module, tokens: torch.Tensor) -> dict:
    """Compare the logits of two models on `tokens` [B, T]: mean / max |difference|, how often
    the argmax agrees, and the mean |logit| of model A."""
    ### BEGIN SOLUTION
    model_a.eval()
    model_b.eval()
    with torch.no_grad():
        la, lb = model_a(tokens).float(), model_b(tokens).float()
    diff = (la - lb).abs()
    return {"mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item(),
            "argmax_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
            "mean_abs_logit": la.abs().mean().item()}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_logit_parity", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _Fixed(logits, dropout=0.0):
    """A 'model' whose logits for the tokens _positions(logits) are `logits` [B, T, V]: an
    embedding holding them, one row per position, then dropout (torch modules only)."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    return nn.Sequential(nn.Embedding.from_pretrained(logits.flatten(0, 1)), nn.Dropout(dropout))


def _positions(logits):
    """The tokens [B, T] that make _Fixed(logits) return `logits`."""
    b, t = torch.as_tensor(logits).shape[:2]
    return torch.arange(b * t).view(b, t)


_KEYS = ("mean_abs_diff", "max_abs_diff", "argmax_agreement", "mean_abs_logit")
_MEANING = {"mean_abs_diff": "the mean of |logits A - logits B| over every position and "
                             "vocabulary entry",
            "max_abs_diff": "the largest |logits A - logits B|",
            "argmax_agreement": "the fraction of positions (batch x sequence) whose argmax over "
                                "the vocabulary, the last dimension, is the same token",
            "mean_abs_logit": "the mean of the absolute logits of model A, |logits A|"}


def _check_parity(la, lb, want, what="", tokens=None):
    tokens = _positions(la) if tokens is None else tokens
    got = logit_parity(_Fixed(la), _Fixed(lb), tokens)
    assert isinstance(got, dict) and sorted(got) == sorted(_KEYS), \
        f"{what}expected a dict with the keys {sorted(_KEYS)}, got " \
        f"{sorted(got) if isinstance(got, dict) else type(got).__name__}"
    for k in _KEYS:
        assert isinstance(got[k], float), \
            f"{what}{k} should be a Python float (.item()), got {type(got[k]).__name__}"
        assert math.isclose(got[k], want[k], rel_tol=1e-6, abs_tol=1e-6), \
            f"{what}{k}: expected {want[k]:.6f}, got {got[k]:.6f} ({k} is {_MEANING[k]})"


# Two positions, three tokens. |A - B| = [[0.5, 0.5, 1], [0, 1, 1]]: mean 4/6, max 1.
# argmax A = [2, 1], argmax B = [1, 1]: agree at one position of two. mean |A| = 11/6.
_A = [[[1.0, 2.0, 3.0], [0.0, 5.0, 0.0]]]
_B = [[[1.5, 2.5, 2.0], [0.0, 4.0, 1.0]]]
_check_parity(_A, _B, {"mean_abs_diff": 4 / 6, "max_abs_diff": 1.0, "argmax_agreement": 0.5,
                       "mean_abs_logit": 11 / 6}, what="hand example: ")
_check_parity(_A, _A, {"mean_abs_diff": 0.0, "max_abs_diff": 0.0, "argmax_agreement": 1.0,
                       "mean_abs_logit": 11 / 6}, what="a model against itself: ")
# negative logits, models of different scales: |A - B| = [[2, 5], [7, 6]], mean |A| = 2
_check_parity([[[2.0, -2.0], [-2.0, 2.0]]], [[[4.0, 3.0], [5.0, -4.0]]], {
    "mean_abs_diff": 5.0, "max_abs_diff": 7.0, "argmax_agreement": 0.5, "mean_abs_logit": 2.0},
    what="negative logits: ")
# a model with dropout, left in training mode, against itself: eval mode makes it exact
_drop = _Fixed(randn(2, 3, 8, seed=4), dropout=0.3).train()
_got = logit_parity(_drop, _drop, _positions(randn(2, 3, 8, seed=4)))
assert _got["max_abs_diff"] == 0.0, \
    f"a model with dropout 0.3 in training mode, compared with itself, differs by " \
    f"{_got['max_abs_diff']:.3g}; rule: put both models in eval() mode (dropout off) first"
print("logit_parity: the hand-computed example and a model against itself give the expected "
      "numbers")

### BEGIN HIDDEN TESTS
# case: [3, 4, 7] logits
_la, _lb = randn(3, 4, 7, seed=1), randn(3, 4, 7, seed=2)
_lb[0] = _la[0] + 0.01                     # the first sequence: same argmax everywhere
_check_parity(_la, _lb, {
    "mean_abs_diff": (_la - _lb).abs().mean().item(), "max_abs_diff": (_la - _lb).abs().max().item(),
    "argmax_agreement": (_la.argmax(-1) == _lb.argmax(-1)).float().mean().item(),
    "mean_abs_logit": _la.abs().mean().item()}, what="hidden [3, 4, 7] logits: ")
# case: two models of different scales
_check_parity([[[2.0, -2.0]]], [[[4.0, 4.0]]], {"mean_abs_diff": 4.0, "max_abs_diff": 6.0,
                                                "argmax_agreement": 1.0, "mean_abs_logit": 2.0},
              what="hidden: ")
# case: a model with dropout 0.5 in training mode, against itself
_d = _Fixed(randn(2, 5, 9, seed=3), dropout=0.5).train()
_got = logit_parity(_d, _d, _positions(randn(2, 5, 9, seed=3)))
assert _got["mean_abs_diff"] == 0.0 and _got["argmax_agreement"] == 1.0, \
    f"hidden: a model with dropout in training mode against itself should differ by 0 (put " \
    f"both models in eval mode), got {_got}"
# case: a linear layer with parameters that require gradients
_lin = nn.Linear(4, 6)
_x = randn(2, 3, 4, seed=4)
_got = logit_parity(_lin, _lin, _x)
assert _lin.weight.grad is None and _got["max_abs_diff"] == 0.0
### END HIDDEN TESTS

# %% [markdown]
# ### The float base against the NF4 base, with experiment 05's adapter
#
# Model A: the float32 base with `rev_replay`. Model B: the same base quantized by **your**
# `qlora_wrap` with the same adapter file. Experiment 06 states its tolerance: the mean
# absolute logit difference at most 10% of the mean absolute logit of A, and no task's exact
# match lower by more than 0.05 (`experiments/06-qlora-preview/config.json`). Below: the
# three numbers on 192 fixed sequences (32 per task), the relative error NF4 leaves in each
# weight matrix, and exact match per task on 50 evaluation examples each (the experiment uses
# 200).

# %%
model_a = float_lora(ADAPTERS["rev_replay"])
model_b = minigpt.load_base("dense")
qlora_wrap(model_b, r=8, alpha=16.0)
load_adapter(model_b, ADAPTERS["rev_replay"])
model_b.eval()

parity = logit_parity(model_a, model_b, PROMPTS)
limit = TOLERANCE["mean_abs_diff_rel"] * parity["mean_abs_logit"]
print(f"mean |logit A| {parity['mean_abs_logit']:.2f}; mean |A - B| {parity['mean_abs_diff']:.3f} "
      f"(tolerance {limit:.3f}); max |A - B| {parity['max_abs_diff']:.2f}; same argmax at "
      f"{parity['argmax_agreement']:.1%} of positions")

float_base = minigpt.load_base("dense")
errors = []
for name, layer in model_b.named_modules():
    if isinstance(layer, QuantizedLinear):
        w = float_base.get_submodule(name.removesuffix(".base")).weight
        errors.append(((layer.dequantized_weight() - w).norm() / w.norm()).item())
print(f"NF4 relative weight error ||W - deq(W)|| / ||W|| over {len(errors)} matrices: mean "
      f"{sum(errors) / len(errors):.3f}, max {max(errors):.3f}")

exact = {label: {t: evaluate(m, t, n=50) for t in tasks.TASKS}
         for label, m in (("A: float base", model_a), ("B: NF4 base", model_b))}
print(f"{'exact match (n=50)':<20}" + "".join(f"{t:>7}" for t in tasks.TASKS))
for label, row in exact.items():
    print(f"{label:<20}" + "".join(f"{row[t]:7.2f}" for t in tasks.TASKS))

# %% nbgrader={"grade": true, "grade_id": "test_parity_float_vs_nf4", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
_a, _b = float_lora(ADAPTERS["rev_replay"]), _fixture_qlora(ADAPTERS["rev_replay"])
with torch.no_grad():                     # expectations first
    _la, _lb = _a(PROMPTS), _b(PROMPTS)
_got = logit_parity(_a, _b, PROMPTS)
_want = {"mean_abs_diff": (_la - _lb).abs().mean().item(),
         "max_abs_diff": (_la - _lb).abs().max().item(),
         "argmax_agreement": (_la.argmax(-1) == _lb.argmax(-1)).float().mean().item(),
         "mean_abs_logit": _la.abs().mean().item()}
for _k, _v in _want.items():
    assert math.isclose(_got[_k], _v, rel_tol=1e-5, abs_tol=1e-6), \
        f"float base vs NF4 base with rev_replay: {_k} expected {_v:.6f}, got {_got[_k]:.6f}"
assert _got["mean_abs_diff"] <= TOLERANCE["mean_abs_diff_rel"] * _got["mean_abs_logit"], \
    f"mean |A - B| = {_got['mean_abs_diff']:.4f} is above experiment 06's tolerance " \
    f"{TOLERANCE['mean_abs_diff_rel']} x {_got['mean_abs_logit']:.3f}"
assert _got["argmax_agreement"] >= 0.9, \
    f"expected the same argmax at >= 90% of positions, got {_got['argmax_agreement']:.1%}"
print(f"float vs NF4 base with the same adapter: mean |diff| {_got['mean_abs_diff']:.3f} <= "
      f"{TOLERANCE['mean_abs_diff_rel']:.0%} of {_got['mean_abs_logit']:.2f}; argmax agrees at "
      f"{_got['argmax_agreement']:.1%}")

### BEGIN HIDDEN TESTS
# case: the rev_only adapter, float vs NF4
_a2, _b2 = float_lora(ADAPTERS["rev_only"]), reference_qlora(ADAPTERS["rev_only"])
_got2 = logit_parity(_a2, _b2, PROMPTS[::3])
assert _got2["mean_abs_diff"] <= TOLERANCE["mean_abs_diff_rel"] * _got2["mean_abs_logit"], \
    f"hidden: rev_only, float vs NF4: {_got2}"
# case: the float model against a fresh copy of itself
_self = logit_parity(_a, float_lora(ADAPTERS["rev_replay"]), PROMPTS[:8])
assert _self["max_abs_diff"] == 0.0 and _self["argmax_agreement"] == 1.0, \
    f"hidden: the float model against a fresh copy of itself should be exact, got {_self}"
### END HIDDEN TESTS

# %% [markdown]
# ## Part C — Training on the NF4 base
#
# Now a **fresh** adapter on the NF4 base: your `qlora_wrap` on the pretrained model, then
# 40 steps of the course's training loop (AdamW on the parameters that require gradients:
# only the LoRA factors) on the held-out task `rev` plus a little replay of the tasks the base
# already knows. Each forward dequantizes every projection, and the backward dequantizes it
# again (`minituner.lora_linear` keeps the NF4 storage, not the float weight, for the
# backward). Experiment 06 trains a whole epoch (93 steps of 64); this is the short version.

# %%
train_examples = (tasks.make_examples(tasks.HELD_OUT, 512, seed=0, split="train")
                  + tasks.make_mixture(tasks.PRETRAIN_TASKS, 32, seed=1, split="train"))
train_data = minituner.SequenceData.from_pairs(pairs_of(train_examples, tok), pad_id=tok.pad_id)

qmodel = minigpt.load_base("dense")
qlora_wrap(qmodel, r=8, alpha=16.0)
trainable, total = minituner.trainable_summary(qmodel)
nf4_before = {k: v.clone() for k, v in qmodel.named_buffers()}
frozen_before = {k: v.clone() for k, v in qmodel.named_parameters() if not v.requires_grad}
print(f"{len(train_data)} training sequences; trainable {trainable:,d} float32 parameters; "
      f"{len(nf4_before)} NF4 buffers")

cfg = minituner.TrainConfig(steps=40, batch_size=32, lr=3e-3, warmup_steps=4, log_every=4,
                            progress=False)
t0 = time.perf_counter()
result = minituner.train(qmodel, train_data, cfg)
print(f"40 QLoRA steps in {time.perf_counter() - t0:.1f} s; loss {result.losses[0]:.2f} -> "
      f"{result.losses[-1]:.2f}")
untouched = (all(torch.equal(v, dict(qmodel.named_buffers())[k]) for k, v in nf4_before.items())
             and all(torch.equal(v, dict(qmodel.named_parameters())[k])
                     for k, v in frozen_before.items()))
print("every loss finite:", all(math.isfinite(x) for x in result.losses),
      "| NF4 buffers and frozen float weights unchanged:", untouched,
      "| NaN guard fired:", result.stopped_early is not None)
assert all(math.isfinite(x) for x in result.losses) and result.stopped_early is None
assert result.losses[-1] < result.losses[0] and untouched
qmodel.eval()
print(f"exact match on '{tasks.HELD_OUT}' after 40 steps (n=50): "
      f"{evaluate(qmodel, tasks.HELD_OUT, n=50):.2f}")

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot([cfg.log_every * (i + 1) for i in range(len(result.losses))], result.losses, "o-")
ax.set_xlabel("step")
ax.set_ylabel(f"loss (mean of {cfg.log_every} steps)")
ax.set_title(f"QLoRA r=8: NF4 base, task '{tasks.HELD_OUT}' + replay")
plt.show()

# %% [markdown]
# ### Why the factors stay float32
#
# The base is 4-bit, so why not store the adapter in bfloat16 too? Because an AdamW step
# changes a factor by about the learning rate times a number of order one, and late in
# training by much less; bfloat16 has 8 bits of mantissa, so near 1.0 its spacing is
# $2^{-7} \approx 0.008$ and a smaller update rounds away. `model.to(torch.bfloat16)` casts
# the LoRA factors with everything else (the NF4 buffers are protected: `QuantizedLinear`
# keeps its codes and float32 scales).

# %%
one32, one16 = torch.tensor(1.0), torch.tensor(1.0, dtype=torch.bfloat16)
for step in (1e-2, 1e-3, 1e-4):
    print(f"1.0 + {step:g}: float32 {(one32 + step).item():.6f}   bfloat16 "
          f"{(one16 + step).item():.6f}")
cast = small_gpt()
qlora_wrap(cast, r=4)
cast.to(torch.bfloat16)
print("after .to(bfloat16): lora_A", cast.blocks[0].attn.q_proj.lora_A.dtype, "| NF4 scales",
      cast.blocks[0].attn.q_proj.base.absmax_scales.dtype, "| embedding",
      cast.tok_emb.weight.dtype)

# %% [markdown]
# ## Part D — Exercise 3: what training holds, counted tensor by tensor
#
# How much memory does QLoRA save here? Reading the process's resident memory (RSS) is a
# poor answer on a CPU: the allocator keeps freed blocks for reuse, Python and the libraries
# take hundreds of MB, and the number moves with whatever ran before. Instead, count the
# tensors a training step keeps alive:
#
# * **weights**: every parameter and buffer of the model (NF4 codes and scales are buffers);
# * **grads**: every `.grad` present;
# * **optimizer**: every tensor in `optimizer.state` (for AdamW, per parameter: `exp_avg`,
#   `exp_avg_sq`, and a 0-d `step` counter). AdamW creates that state **lazily**, at its first
#   `step()`: count before it and you get zero.
#
# **Specification.** Write `held(model, optimizer=None) -> dict` with the integer keys
# `"weights"` (the parameters and buffers), `"grads"` (the `.grad`s present) and
# `"optimizer"` (the tensors in `optimizer.state`; 0 without an optimizer), in bytes. Count
# **storage**, not tensors: a view, a slice, or a second `Parameter` over the same memory
# adds nothing, and a tensor that is a slice of a larger storage holds that whole storage. A
# storage counted once is never counted again, in any of the three groups. Off-limits:
# `minituner.memory.held_bytes`.
#
# <details><summary>Hint 1: the idea</summary>
#
# `t.untyped_storage()` gives the storage behind a tensor; its `.nbytes()` the bytes and its
# `.data_ptr()` an address that identifies it. Keep one set of the addresses already
# counted, shared by the three groups, and a small helper that sums the bytes of the storages
# it has not seen yet. `optimizer.state` maps each parameter to a dict of its state (for
# AdamW: `exp_avg`, `exp_avg_sq`, `step`); keep the values that are tensors.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# seen = {}
# count(tensors): total = 0
#                 for t in tensors: s = t.untyped_storage()
#                                   if s.data_ptr() not in seen: add it; total += s.nbytes()
#                 return total
# weights   = count(parameters + buffers)
# grads     = count(p.grad for p in parameters if p.grad is not None)
# optimizer = count(every tensor value of every dict in optimizer.state.values())   # 0 if None
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "held", "locked": false, "schema_version": 3, "solution": true, "task": false}
def held(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes of storage held by the model's weights, its gradients and the optimizer state."""
    ### BEGIN SOLUTION
    seen = set()

    def count(tensors):
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    weights = count([*model.parameters(), *model.buffers()])
    grads = count(p.grad for p in model.parameters() if p.grad is not None)
    states = [] if optimizer is None else [t for state in optimizer.state.values()
                                           for t in state.values() if isinstance(t, torch.Tensor)]
    return {"weights": weights, "grads": grads, "optimizer": count(states)}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_held", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
import operator

_NO_HELD_BYTES = [memory.held_bytes]


def _held(model, opt=None):
    with forbid(_NO_HELD_BYTES, globals()):
        got = held(model, opt)
    assert isinstance(got, dict) and sorted(got) == ["grads", "optimizer", "weights"], \
        f"expected a dict with keys grads, optimizer, weights; got {got!r}"
    for k, v in got.items():
        assert isinstance(v, int), f"{k} should be an int number of bytes, got {type(v).__name__}"
    return got


class _Over(nn.Parameter):
    """A Parameter over the storage of the tensor `over` (also once it travels to where your
    code runs, which copies a tensor's storage per tensor: it is rebuilt there from `over`)."""

    def __new__(cls, over):
        p = super().__new__(cls, over)
        p.over = over
        return p

    def __reduce_ex__(self, protocol):
        return nn.Parameter, (self.over, self.requires_grad)


class _View(torch.Tensor):
    """`over[0]`, a view (rebuilt as `over[0]` where it travels, see _Over)."""

    def __reduce_ex__(self, protocol):
        return operator.getitem, (self.over, 0)


def _shared_storage():
    """An embedding [10, 8], a head whose weight is a second Parameter over the same storage,
    a buffer that is a view of the embedding's row 0, and an independent buffer [8]."""
    base = randn(10, 8, seed=1)
    m = nn.Module()
    m.emb, m.head = _Over(base), _Over(base)
    row0 = base[0].as_subclass(_View)
    row0.over = base
    m.register_buffer("row0", row0)
    m.register_buffer("gain", torch.ones(8))
    return m


_s = _shared_storage()
_got = _held(_s)
assert _got == {"weights": 10 * 8 * 4 + 8 * 4, "grads": 0, "optimizer": 0}, \
    f"shared storage: expected weights = 320 (the [10, 8] storage, once) + 32 (gain, a " \
    f"buffer: buffers are weights too) = 352, no grads, no optimizer state; got {_got}"
# a Parameter over a slice holds the whole storage it lives in
_sl = nn.Module()
_sl.w = nn.Parameter(torch.zeros(50)[5:15])
assert _held(_sl)["weights"] == 200, \
    f"a Parameter over elements 5..14 of a 50-float storage: expected weights = 200 (the whole " \
    f"storage, untyped_storage().nbytes()), got {_held(_sl)['weights']}; rule: count storage, " \
    f"not numel() * element_size()"


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def _two_steps(model, opt, batch=4, steps=2):
    x = torch.randint(0, model.config.vocab_size, (batch, model.config.block_size),
                      generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
        opt.step()


def _adamw_bytes(model):
    """What a model of unshared tensors holds after AdamW steps on its trainable parameters,
    counted by hand: weights numel · element_size of every parameter and buffer; grads 4
    bytes per trained float32 element; AdamW's state exp_avg and exp_avg_sq (4 + 4 bytes per
    trained element) and one 0-d float32 step counter (4 bytes) per trained tensor."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return {"weights": sum(t.numel() * t.element_size()
                           for t in [*model.parameters(), *model.buffers()]),
            "grads": sum(4 * p.numel() for p in trained),
            "optimizer": sum(8 * p.numel() + 4 for p in trained)}


def _check_against_reference(make, label, make_opt=_adamw, with_ref=False):
    """Two training steps of a model from `make()` with its optimizer, held where your code
    runs; your count against the bytes counted by hand (_adamw_bytes; with_ref: held_bytes of
    a twin trained the same way here)."""
    model, twin = make(), make()
    pair = share((model, make_opt(model)))          # the model and its optimizer, together
    model, opt = pair[0], pair[1]
    before = _held(model, opt)
    assert before["optimizer"] == 0 and before["grads"] == 0, \
        f"{label}, before the first step: AdamW has no state yet and no grad exists; expected " \
        f"grads = optimizer = 0, got {before}"
    if with_ref:
        twin_opt = make_opt(twin)
        _two_steps(twin, twin_opt)
        want = memory.held_bytes(twin, twin_opt)
        want = {"weights": want.weights, "grads": want.grads, "optimizer": want.optimizer}
    else:
        want = _adamw_bytes(twin)
    _two_steps(model, opt)
    got = _held(model, opt)
    meaning = {"weights": "every parameter and buffer", "grads": "every .grad present",
               "optimizer": "every tensor in optimizer.state, AdamW's 0-d step counters "
                            "included"}
    assert got == want, f"{label}, after two steps: expected {want}, got {got}; " + \
        "; ".join(f"{k} counts {meaning[k]}" for k in want if got[k] != want[k])
    return got, model


def _lora_small():
    m = small_gpt()
    wrap_lora(m, BLOCK_PROJECTIONS, r=4, alpha=8.0)
    return m


def _qlora_small():
    return _qlora_fixture(small_gpt(), r=4, alpha=8.0)


_lo_held, _ = _check_against_reference(_lora_small, "LoRA on a float base")
_ql_held, _ = _check_against_reference(_qlora_small, "QLoRA")
assert _ql_held["grads"] == _lo_held["grads"] and _ql_held["weights"] < _lo_held["weights"]
print(f"held: shared storage counted once; after two AdamW steps equal to the bytes counted "
      f"by hand for LoRA {_lo_held} and QLoRA {_ql_held}")

### BEGIN HIDDEN TESTS
# case: a Parameter over a slice of a larger storage
_p = nn.Module()
_p.w = nn.Parameter(torch.zeros(100)[:10])
assert _held(_p)["weights"] == 400, \
    f"hidden: a Parameter over a slice of a 100-float storage holds 400 bytes, got {_held(_p)}"
# case: full fine-tuning with SGD and momentum
_, _full = _check_against_reference(
    lambda: small_gpt(2), "hidden: full fine-tuning with SGD + momentum",
    make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), with_ref=True)
# case: a trained model without an optimizer
assert _held(_full)["optimizer"] == 0, "hidden: with no optimizer, optimizer bytes are 0"


# case: the pretrained MiniGPT under QLoRA
def _big_qlora():
    m = minigpt.load_base("dense")
    wrap_minigpt_qlora(m)
    return m


_, _big = _check_against_reference(_big_qlora, "hidden: pretrained MiniGPT, QLoRA",
                                   with_ref=True)
# case: gradients reset to None
_big.zero_grad(set_to_none=True)
assert _held(_big)["grads"] == 0, "hidden: after setting every .grad to None, grads should be 0"
### END HIDDEN TESTS

# %% [markdown]
# ### The memory bill at MiniGPT scale, measured
#
# Both setups on the pretrained MiniGPT, a batch of 64 `rev` sequences (1088 tokens), two
# AdamW steps, then your `held` plus the activations one forward keeps for its backward
# (`minituner.activations.saved_activation_bytes`: it records every tensor the forward
# allocates and counts those still alive when it returns — counted, not sampled, so it is the
# same on every machine). Beside it, `minituner.memory.predict_training` from the model's shape
# alone: the course's claim is that prediction and measurement agree within 10%. One RSS
# reading is printed too, to show why it is not the number to report.

# %%
PARTS = ["weights", "grads", "optimizer", "activations", "total"]     # the bills' columns below

# %% tags=["jupyter-only"]
mem_batch = minituner.SequenceData.from_pairs(
    pairs_of(tasks.make_examples(tasks.HELD_OUT, 64, seed=0, split="train"), tok), pad_id=tok.pad_id)
mx, my, _ = mem_batch.batch(torch.arange(len(mem_batch)))


def memory_row(model, regime):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    lazy = held(model, opt)["optimizer"]
    with measure.measure() as rss:
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(mx).flatten(0, 1), my.flatten()).backward()
            opt.step()
    row = held(model, opt)
    row["activations"] = saved_activation_bytes(model, mx)
    row["total"] = sum(row.values())
    pred = memory.predict_training(memory.TransformerShape.of(model.config), regime, mx.numel(),
                                   r=8).as_dict()
    return row, pred, lazy, rss.rss_peak_delta


lora_base = minigpt.load_base("dense")
wrap_lora(lora_base, BLOCK_PROJECTIONS, r=8, alpha=16.0)
nf4_base = minigpt.load_base("dense")
qlora_wrap(nf4_base, r=8, alpha=16.0)
rows = {"LoRA, float32 base": memory_row(lora_base, "lora"),
        "QLoRA, NF4 base": memory_row(nf4_base, "qlora")}
print(f"{'MiB':<20}" + "".join(f"{p:>13}" for p in PARTS) + f"{'predicted':>11}{'RSS peak Δ':>12}")
for label, (row, pred, _, rss_delta) in rows.items():
    print(f"{label:<20}" + "".join(f"{row[p] / MiB:13.2f}" for p in PARTS)
          + f"{pred['total'] / MiB:11.2f}{rss_delta / MiB:12.1f}")
(lo_row, lo_pred, lazy, _), (q_row, q_pred, _, _) = rows.values()
print(f"optimizer state before the first step: {lazy} bytes (AdamW is lazy)")
print(f"weights {lo_row['weights'] / q_row['weights']:.2f}x smaller with NF4; total "
      f"{lo_row['total'] / q_row['total']:.2f}x; measured / predicted total: "
      f"{lo_row['total'] / lo_pred['total']:.3f} (LoRA), {q_row['total'] / q_pred['total']:.3f} "
      f"(QLoRA)")

fig, ax = plt.subplots(figsize=(7, 2.6))
for i, (row, _, _, _) in enumerate(rows.values()):
    left = 0.0
    for j, part in enumerate(PARTS[:-1]):
        ax.barh(i, row[part] / MiB, left=left, color=f"C{j}", label=part if i == 0 else None)
        left += row[part] / MiB
ax.set_yticks(range(len(rows)), list(rows))
ax.set_xlabel("MiB (held after two AdamW steps; activations of one step)")
ax.set_title("MiniGPT, batch 64: LoRA on a float base vs QLoRA on NF4")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()
plt.show()

# %% [markdown]
# At this scale the weights shrink more than 4× and it hardly matters: activations of a
# 64-sequence batch are most of the bill, and the gradients and Adam state are the adapter's,
# identical in both setups. QLoRA pays off when the weights are the bill — a 7B model.

# %% [markdown]
# ## Part E — Exercise 4: predicting the bill from a model's shape
#
# Nobody measures a 7B model to decide whether it fits on a GPU; one counts.
#
# **Specification.** Two functions.
#
# **`nf4_storage_bytes(numel, blocksize=64, double_quant=True) -> int`**, the bytes of an NF4
# tensor of `numel` elements (Lab 02): $\lceil n/2 \rceil$ bytes of packed codes, plus per
# block of `blocksize` elements (the last one may be partial) either a float32 absmax (4
# bytes), or with double quantization a 1-byte code, plus a float32 scale per 256 blocks
# (rounded up) and one float32 offset. Off-limits: `miniquant.nf4_bytes` and quantizing
# anything (a 7B model has no tensor to quantize here).
#
# **`predict_bytes(shape, regime, r=8, weight_bits=16, blocksize=64, double_quant=True) ->
# dict`** with the integer keys `"weights"`, `"grads"`, `"optimizer"` for a
# `minituner.memory.TransformerShape`, in one of three regimes:
#
# | regime | block projections | everything else | LoRA factors (r·(in + out) per projection) | trained |
# |---|---|---|---|---|
# | `"full"` | `weight_bits` | `weight_bits` | none | everything |
# | `"lora"` | `weight_bits`, frozen | `weight_bits`, frozen | float32 | the factors |
# | `"qlora"` | NF4, each matrix on its own (`nf4_storage_bytes`) | `weight_bits`, frozen | float32 | the factors |
#
# Gradients are float32 (4 bytes) per trained element, AdamW state two float32 tensors per
# trained element (leave out the 4-byte step counters). `shape.block_linears()` lists the
# `(out, in)` of one block's seven projections and `shape.n_layer` says how many blocks;
# `shape.other_params()` counts everything else (embeddings, norms, head). Raise `ValueError`
# for any other regime. Off-limits: `minituner.memory.predict`, `predict_training`,
# `regime_specs`, `param_specs`, `nf4_bytes` (the hidden tests compare you with them).
#
# <details><summary>Hint 1: the idea</summary>
#
# Everything is a ceiling division, `-(-n // d)` in integers: the packed codes are two per
# byte, the blocks include a partial last one, the nested scales one per 256 blocks. Then
# count, for the regime, three numbers: the bytes of the weights as stored, the number of
# trained elements, and from it 4 bytes of gradient and 8 of AdamW state each. The list of
# every projection of the model is `shape.block_linears() * shape.n_layer`; NF4 rounds each
# matrix on its own, so sum `nf4_storage_bytes` per matrix, not once over their total.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# nf4_storage_bytes(n, bs, dq):
#     blocks = ceil(n / bs)
#     scales = blocks + 4 * ceil(blocks / 256) + 4   if dq   else   4 * blocks
#     return ceil(n / 2) + scales
#
# predict_bytes(shape, regime, r, weight_bits, bs, dq):
#     regime not in full / lora / qlora -> ValueError
#     linears = shape.block_linears() * shape.n_layer;   proj = sum(out * in)
#     other = shape.other_params();   lora = sum(r * (out + in))
#     full:  weights = (other + proj) * weight_bits / 8;               trained = other + proj
#     lora:  weights = (other + proj) * weight_bits / 8 + 4 * lora;    trained = lora
#     qlora: weights = other * weight_bits / 8 + sum(nf4 per matrix) + 4 * lora;  trained = lora
#     return {weights, grads: 4 * trained, optimizer: 8 * trained}
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "predict_bytes", "locked": false, "schema_version": 3, "solution": true, "task": false}
def nf4_storage_bytes(numel: int, blocksize: int = 64, double_quant: bool = True) -> int:
    """Bytes an NF4 tensor of `numel` elements holds (codes + scales)."""
    ### BEGIN SOLUTION
    blocks = -(-numel // blocksize)
    if double_quant:
        scales = blocks + 4 * -(-blocks // 256) + 4
    else:
        scales = 4 * blocks
    return -(-numel // 2) + scales
    ### END SOLUTION


def predict_bytes(shape: memory.TransformerShape, regime: str, r: int = 8, weight_bits: int = 16,
                  blocksize: int = 64, double_quant: bool = True) -> dict:
    """Weights, gradients and AdamW state (bytes) of training `shape` in `regime`."""
    ### BEGIN SOLUTION
    if regime not in ("full", "lora", "qlora"):
        raise ValueError(f"regime must be 'full', 'lora' or 'qlora', got {regime!r}")
    linears = shape.block_linears() * shape.n_layer
    projections = sum(o * i for o, i in linears)
    other = shape.other_params()
    lora = sum(r * (o + i) for o, i in linears)
    if regime == "full":
        weights, trained = (other + projections) * weight_bits // 8, other + projections
    elif regime == "lora":
        weights, trained = (other + projections) * weight_bits // 8 + 4 * lora, lora
    else:
        nf4 = sum(nf4_storage_bytes(o * i, blocksize, double_quant) for o, i in linears)
        weights, trained = other * weight_bits // 8 + nf4 + 4 * lora, lora
    return {"weights": weights, "grads": 4 * trained, "optimizer": 8 * trained}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_nf4_storage_bytes", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
_NO_PREDICTOR = [miniquant.nf4_bytes, memory.predict, memory.predict_training,
                 memory.regime_specs, memory.param_specs, miniquant.quantize_nf4]


def _nf4_rule(numel, blocksize, double_quant, got):
    """The rule a wrong byte count breaks, when it is one of the usual slips (else '')."""
    def nbytes(codes, blocks, nested, offset):
        return codes + (blocks + 4 * nested + offset if double_quant else 4 * blocks)

    blocks = -(-numel // blocksize)
    right = (-(-numel // 2), blocks, -(-blocks // 256), 4)
    slips = [(nbytes(numel // 2, *right[1:]), "ceil(n / 2) bytes of codes: an odd count needs "
                                              "one more byte"),
             (nbytes(right[0], numel // blocksize, -(-(numel // blocksize) // 256), 4),
              "a partial last block has its scale too: ceil(n / blocksize) blocks")]
    if double_quant:
        slips += [(nbytes(*right[:2], blocks // 256, 4), "a float32 scale per 256 blocks, "
                                                         "rounded up"),
                  (nbytes(*right[:3], 0), "double quantization adds one float32 offset")]
    return next((f" ({rule})" for n, rule in slips if n == got), "")


def _check_nf4_bytes(numel, blocksize=64, double_quant=True, what=""):
    with forbid(_NO_PREDICTOR, globals()):
        got = nf4_storage_bytes(numel, blocksize, double_quant)
    want = miniquant.quantize_nf4(randn(numel, seed=numel), blocksize=blocksize,
                                  double_quant=double_quant).nbytes
    assert isinstance(got, int) and got == want, \
        f"{what}nf4_storage_bytes({numel}, blocksize={blocksize}, double_quant={double_quant}): " \
        f"quantize_nf4(...).nbytes is {want}, got {got!r}" + _nf4_rule(numel, blocksize,
                                                                       double_quant, got)


_check_nf4_bytes(128 * 128)
_check_nf4_bytes(448 * 128, double_quant=False)
_check_nf4_bytes(64 * 300)            # 300 blocks: two float32 scales for the nested quantization
_check_nf4_bytes(100)                 # partial last block
_check_nf4_bytes(101)                 # odd count, partial last block
_bits = 8 * nf4_storage_bytes(4096 * 4096) / (4096 * 4096)
assert abs(_bits - 4.127) < 1e-3, f"NF4 + double quant at blocksize 64: expected ≈ 4.127 " \
                                  f"bits per parameter, got {_bits:.4f}"
print(f"nf4_storage_bytes equals NF4Weight.nbytes; a 4096 x 4096 matrix costs {_bits:.4f} bits "
      f"per parameter")

### BEGIN HIDDEN TESTS
# case: odd sizes, other blocksizes, with and without double quantization
for _n, _bs, _dq in ((77, 64, False), (1000, 32, False), (384 * 128, 128, True), (1, 64, True),
                     (64 * 256, 64, True), (64 * 256 + 1, 64, True), (5000, 4096, True),
                     (33, 32, True)):
    _check_nf4_bytes(_n, _bs, _dq, what="hidden: ")
# case: a 7B MLP matrix at blocksize 128
with forbid(_NO_PREDICTOR, globals()):
    _got = nf4_storage_bytes(11008 * 4096, 128, False)
assert _got == miniquant.nf4_bytes(11008 * 4096, 128, False), "hidden: 7B MLP matrix, blocksize 128"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_predict_bytes", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
_COUNTS = {
    "weights": {"full": "every parameter at weight_bits / 8 bytes (other_params() and the "
                        "projections of all n_layer blocks)",
                "lora": "every base parameter at weight_bits / 8 bytes (all n_layer blocks), "
                        "plus the LoRA factors in float32, 4 bytes per element",
                "qlora": "NF4 for each projection matrix on its own (nf4_storage_bytes per "
                         "(out, in), all n_layer blocks), other_params() at weight_bits / 8, "
                         "plus the LoRA factors in float32, 4 bytes per element"},
    "grads": "4 bytes per trained element (full: every parameter; lora and qlora: the factors, "
             "r·(in + out) per projection of all n_layer blocks)",
    "optimizer": "AdamW's two float32 tensors, 8 bytes per trained element"}


# The bills worked out by hand (grads 4 and AdamW 8 bytes per trained element).
# LLaMA-7B, 16-bit weights, r = 8: a block's projections are 4 · 4096² (attention) +
# 3 · 11008 · 4096 (MLP) = 202,375,168, times 32 blocks 6,476,005,376; other_params() =
# 2 · 32000 · 4096 (embedding, head) + (2 · 32 + 1) · 4096 (norms) = 262,410,240; all
# 6,738,415,616. LoRA: 8 · (4 · (4096 + 4096) + 3 · (4096 + 11008)) = 624,640 a block,
# 19,988,480 in all. NF4 (blocksize 64, double quant): a 4096² matrix 8,388,608 bytes of
# codes + 262,144 blocks + 4 · 1024 nested + 4 = 8,654,852; an 11008 x 4096 one 22,544,384 +
# 704,512 + 4 · 2752 + 4 = 23,259,908; 32 · (4 · 8,654,852 + 3 · 23,259,908) = 3,340,772,224.
# MiniGPT (4 blocks, d 128, d_ff 448, vocabulary 45, block_size 32), 32-bit weights, r = 8:
# projections 4 · (4 · 128² + 3 · 448 · 128) = 950,272; other_params() = (2 · 45 + 32) · 128
# + (2 · 4 + 1) · 128 = 16,768; LoRA 4 · 8 · (4 · 256 + 3 · 576) = 88,064; NF4 4 · (4 ·
# (8192 + 256 + 4 + 4) + 3 · (28,672 + 896 + 4 · 4 + 4)) = 490,352.
_LLAMA_LORA = {"grads": 4 * 19_988_480, "optimizer": 8 * 19_988_480}
_MINI_LORA = {"grads": 4 * 88_064, "optimizer": 8 * 88_064}
_BILLS = {
    ("llama", "full"): {"weights": 2 * 6_738_415_616, "grads": 4 * 6_738_415_616,
                        "optimizer": 8 * 6_738_415_616},
    ("llama", "lora"): {"weights": 2 * 6_738_415_616 + 4 * 19_988_480, **_LLAMA_LORA},
    ("llama", "qlora"): {"weights": 2 * 262_410_240 + 3_340_772_224 + 4 * 19_988_480,
                         **_LLAMA_LORA},
    ("mini", "lora"): {"weights": 4 * (950_272 + 16_768) + 4 * 88_064, **_MINI_LORA},
    ("mini", "qlora"): {"weights": 4 * 16_768 + 490_352 + 4 * 88_064, **_MINI_LORA}}


def _check_predict(shape, regime, what="", want=None, **kw):
    """`want`: the bill worked out by hand; None: predict_training's (grading only)."""
    where = f"{what}predict_bytes({shape}, {regime!r}, {kw})"
    if want is None:
        want = memory.predict_training(shape, regime, tokens=1, **kw).as_dict()
    with forbid(_NO_PREDICTOR, globals()):
        got = predict_bytes(shape, regime, **kw)
    assert isinstance(got, dict) and sorted(got) == ["grads", "optimizer", "weights"], \
        f"{where}: expected a dict with keys grads, optimizer, weights; got {got!r}"
    for k in ("weights", "grads", "optimizer"):
        rule = _COUNTS[k][regime] if k == "weights" else _COUNTS[k]
        assert isinstance(got[k], int) and abs(got[k] - want[k]) <= 1, \
            f"{where}: {k} expected {want[k]:,d} bytes ({want[k] / GiB:.3f} GiB), got " + \
            (f"{got[k]:,d} ({got[k] / GiB:.3f} GiB)" if isinstance(got[k], int) else repr(got[k])) \
            + f"; {k} counts {rule}"
    return got


for _regime in ("full", "lora", "qlora"):
    _check_predict(memory.LLAMA_7B, _regime, r=8, weight_bits=16, want=_BILLS["llama", _regime])
_shape = memory.TransformerShape.of(minigpt.load_base("dense").config)
assert (_shape.n_layer, _shape.d_model, _shape.d_ff, _shape.vocab_size, _shape.block_size) \
    == (4, 128, 448, 45, 32), _shape                 # the MiniGPT the bills above are for
for _regime in ("lora", "qlora"):
    _check_predict(_shape, _regime, r=8, weight_bits=32, want=_BILLS["mini", _regime])
# and the prediction is what the real models hold
for _regime, _wrap in (("lora", lambda m: wrap_lora(m, BLOCK_PROJECTIONS, r=8, alpha=16.0)),
                       ("qlora", lambda m: _qlora_fixture(m, r=8, alpha=16.0))):
    _model = minigpt.load_base("dense")
    _wrap(_model)
    _opt = torch.optim.AdamW([q for q in _model.parameters() if q.requires_grad])
    _x = PROMPTS[:8]
    for _ in range(2):
        _opt.zero_grad()
        F.cross_entropy(_model(_x).flatten(0, 1), _x.roll(-1, 1).flatten()).backward()
        _opt.step()
    _row = _adamw_bytes(_model)          # (no tensor of these models shares a storage)
    assert _row["grads"] == sum(p.grad.numel() * 4 for p in _model.parameters()
                                if p.grad is not None)
    with forbid(_NO_PREDICTOR, globals()):
        _p = predict_bytes(_shape, _regime, r=8, weight_bits=32)
    assert _p["weights"] == _row["weights"] and _p["grads"] == _row["grads"], \
        f"MiniGPT, {_regime}: predicted weights / grads {_p['weights']:,d} / {_p['grads']:,d} " \
        f"differ from what the model holds after two steps, {_row['weights']:,d} / " \
        f"{_row['grads']:,d}"
try:
    with forbid(_NO_PREDICTOR, globals()):
        predict_bytes(_shape, "ia3")
except ValueError:
    pass
else:
    raise AssertionError("predict_bytes(shape, 'ia3') returned; rule: raise ValueError for a "
                         "regime other than 'full', 'lora' and 'qlora'")
print("predict_bytes equals the bills worked out by hand for LLaMA-7B and MiniGPT, and the "
      "weights and grads that MiniGPT's models hold")

### BEGIN HIDDEN TESTS
# case: LLaMA-7B QLoRA, rank 64, blocksize 128, no double quantization
_check_predict(memory.LLAMA_7B, "qlora", r=64, weight_bits=16, blocksize=128,
               double_quant=False, what="hidden: ")
# case: LLaMA-7B LoRA, rank 16, 32-bit weights
_check_predict(memory.LLAMA_7B, "lora", r=16, weight_bits=32, what="hidden: ")
# case: MiniGPT, full fine-tuning
_check_predict(_shape, "full", r=8, weight_bits=32, what="hidden: ")
# case: an odd shape in every regime
_odd = memory.TransformerShape(n_layer=3, d_model=40, d_ff=100, n_head=4, vocab_size=51,
                               block_size=24)
for _regime in ("full", "lora", "qlora"):
    _check_predict(_odd, _regime, r=3, weight_bits=16, blocksize=32, what="hidden: ")
# case: another unknown regime
try:
    predict_bytes(memory.LLAMA_7B, "dora")
except ValueError:
    pass
else:
    raise AssertionError("hidden: regime 'dora' should raise ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ### At 7B scale
#
# LLaMA-7B (32 layers, d_model 4096, d_ff 11008, vocabulary 32000), weights outside NF4 in
# bfloat16, LoRA r = 8 on all seven projections of every block, one step of 2048 tokens
# (activations in 16 bits, from `minituner.memory.activation_bytes`, the count checked against
# MiniGPT's saved tensors). The lines mark a 24 GiB consumer GPU and an 80 GB data-centre one.

# %%
big = {}
for regime in ("full", "lora", "qlora"):
    big[regime] = predict_bytes(memory.LLAMA_7B, regime, r=8, weight_bits=16)
    big[regime]["activations"] = memory.activation_bytes(memory.LLAMA_7B, regime, tokens=2048,
                                                         r=8, act_bits=16)
    big[regime]["total"] = sum(big[regime].values())
print(f"{'GiB':<8}" + "".join(f"{p:>13}" for p in PARTS))
for regime, row in big.items():
    print(f"{regime:<8}" + "".join(f"{row[p] / GiB:13.1f}" for p in PARTS))
print(f"QLoRA weights {big['lora']['weights'] / big['qlora']['weights']:.1f}x smaller than "
      f"LoRA's; total {big['full']['total'] / GiB:.1f} -> {big['lora']['total'] / GiB:.1f} -> "
      f"{big['qlora']['total'] / GiB:.1f} GiB")

fig, ax = plt.subplots(figsize=(7, 2.8))
for i, row in enumerate(big.values()):
    left = 0.0
    for j, part in enumerate(PARTS[:-1]):
        ax.barh(i, row[part] / GiB, left=left, color=f"C{j}", label=part if i == 0 else None)
        left += row[part] / GiB
for gib, label in ((24, "24 GiB"), (80e9 / GiB, "80 GB")):
    ax.axvline(gib, color="gray", ls="--", lw=1)
    ax.text(gib + 1, -0.45, label, fontsize=8, color="gray")
ax.set_yticks(range(len(big)), ["full fine-tuning", "LoRA (bf16 base)", "QLoRA (NF4 base)"])
ax.set_xlabel("GiB (predicted, one step of 2048 tokens)")
ax.set_title("LLaMA-7B, r = 8 on every projection")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Part F — Exercise 5: two adapters, one NF4 base
#
# An adapter is a few hundred KB here (80 MB at 7B, r = 8); the quantized base is the large
# part. So a server keeps **one** NF4 base in memory and swaps adapters in and out: no
# re-quantization, no second copy of the base, and the optimizer (if one trains on) keeps
# pointing at the same factor tensors.
#
# **Specification.** Write `swap_adapter(model, directory) -> list[str]` for a model that
# already holds LoRA layers (over NF4 or float bases) and a PEFT-format adapter directory (Lab 04):
#
# * read `adapter_config.json`; raise `ValueError` unless `peft_type` is `"LORA"`, unless the
#   model holds at least one `LoRALinear`, or if any `LoRALinear` has another `r` or
#   `scaling` than the config's (`lora_alpha / r`, or `lora_alpha / √r` with `use_rslora`);
# * read `adapter_model.safetensors` (`safetensors.torch.load_file`); the keys must be exactly
#   `base_model.model.<layer name>.lora_A.weight` / `.lora_B.weight` for every `LoRALinear`
#   of the model, with the factors' shapes: otherwise raise `ValueError` naming the missing,
#   unexpected or mis-shaped keys — before copying anything;
# * copy each tensor **into** the existing factor (`copy_` under `torch.no_grad()`): no new
#   layers, no new `Parameter`s, and nothing else of the model touched;
# * return the names of the layers loaded, in the model's order.
#
# Off-limits: `minituner.load_adapter` and anything that quantizes (`quantize_model`,
# `QuantizedLinear.from_linear`, `quantize_nf4`).
#
# <details><summary>Hint 1: the idea</summary>
#
# Validate everything, then change something. Build one dict from each expected file key
# (`PREFIX + name + ".lora_A.weight"`, …) to the model's factor `Parameter`; set operations
# on its keys and the file's keys give the missing and the unexpected ones, and a comparison
# of shapes the mis-shaped ones. Only when all three lists are empty, copy with `p.copy_(t)`
# under `torch.no_grad()`, which keeps every `Parameter` (and an optimizer's hold on it).
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# config = JSON;  peft_type != "LORA" -> ValueError
# layers = {name: m for name, m in model.named_modules() if m is a LoRALinear};  none -> ValueError
# scaling = lora_alpha / sqrt(r) if use_rslora else lora_alpha / r
# any layer with m.r != r or m.scaling != scaling -> ValueError
# params  = {PREFIX + name + ".lora_A.weight": m.lora_A, ... ".lora_B.weight": m.lora_B}
# tensors = load_file(directory / "adapter_model.safetensors")
# missing, unexpected, mis-shaped -> ValueError naming them
# with no_grad: for key, p in params: p.copy_(tensors[key])
# return list(layers)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "swap_adapter", "locked": false, "schema_version": 3, "solution": true, "task": false}
PREFIX = "base_model.model."


def swap_adapter(model: nn.Module, directory) -> list[str]:
    """Copy the factors of the PEFT adapter in `directory` into the model's LoRA layers."""
    ### BEGIN SOLUTION
    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"not a LoRA adapter: peft_type is {config.get('peft_type')!r}")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not layers:
        raise ValueError("the model holds no LoRA layer: wrap it (qlora_wrap) before swapping "
                         "adapters")
    r, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / (math.sqrt(r) if config.get("use_rslora", False) else r)
    bad = [n for n, m in layers.items() if m.r != r or not math.isclose(m.scaling, scaling)]
    if bad:
        raise ValueError(f"layers {bad[:3]} have another r or scaling than the adapter's "
                         f"r={r}, scaling={scaling}")
    params = {f"{PREFIX}{n}.lora_{ab}.weight": getattr(m, f"lora_{ab}")
              for n, m in layers.items() for ab in "AB"}
    tensors = safetensors.torch.load_file(str(directory / "adapter_model.safetensors"))
    missing = sorted(params.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - params.keys())
    shapes = sorted(k for k in params.keys() & tensors.keys()
                    if tensors[k].shape != params[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(f"adapter does not fit the model: missing {missing}, unexpected "
                         f"{unexpected}, other shapes {shapes}")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(tensors[key])
    return list(layers)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_swap_adapter", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
_NO_LOADER = [minituner.load_adapter, miniquant.quantize_model, miniquant.quantize_nf4,
              (QuantizedLinear, "from_linear"), minituner.qlora.wrap_minigpt_qlora]


def _served(model):
    """`model` held where your code runs (swap_adapter changes it in place), with an optimizer
    over its LoRA factors, as a server that trains on holds them: (model, optimizer)."""
    factors = [p for n, p in model.named_parameters() if "lora_" in n]
    pair = share((model, torch.optim.SGD(factors, lr=0.0) if factors else None))
    return pair[0], pair[1]


def _snapshot(model):
    """A clone of every buffer and frozen parameter."""
    return {n: t.detach().clone() for n, t in
            [*model.named_buffers(), *((n, p) for n, p in model.named_parameters()
                                       if "lora_" not in n)]}


def _check_untouched(model, opt, snap, what):
    now = dict([*model.named_buffers(), *model.named_parameters()])
    for n, value in snap.items():
        assert n in now and torch.equal(now[n], value), \
            f"{what}: {n} was replaced or changed; swapping an adapter must leave the base " \
            f"(NF4 buffers, embeddings, norms, head) exactly as it was"
    if opt is not None:
        factors = [p for n, p in now.items() if "lora_" in n]
        held_by_opt = opt.param_groups[0]["params"]
        assert len(held_by_opt) == len(factors) and all(
            torch.equal(a, b) for a, b in zip(held_by_opt, factors, strict=True)), \
            f"{what}: the model's LoRA factors are no longer the tensors its optimizer holds: " \
            f"copy the file's values into the existing Parameters (copy_ under " \
            f"torch.no_grad()), do not replace them"


def _swap(model, directory):
    directory = send_dir(directory)        # a folder your code can read, holding its files
    with forbid(_NO_LOADER, globals()):
        return swap_adapter(model, directory)


_local = _fixture_qlora()
_snap = _snapshot(_local)
_want_names = [n for n, m in _local.named_modules() if isinstance(m, LoRALinear)]
_server, _server_opt = _served(_local)
_logits = {}
for _name in ("rev_replay", "rev_only"):
    with torch.no_grad():                 # expectations first
        _fresh = _fixture_qlora(ADAPTERS[_name])(PROMPTS)
    _names = _swap(_server, ADAPTERS[_name])
    assert _names == _want_names, f"expected the loaded layer names {_want_names[:3]}..., " \
                                  f"got {_names}"
    _check_untouched(_server, _server_opt, _snap, f"after swapping in {_name}")
    with torch.no_grad():
        _logits[_name] = _server(PROMPTS)
    assert torch.equal(_logits[_name], _fresh), \
        f"after swapping in {_name}: the logits should equal a freshly quantized model with " \
        f"{_name} loaded, bit for bit; max difference " \
        f"{(_logits[_name] - _fresh).abs().max().item():.3g}"
_d = (_logits["rev_replay"] - _logits["rev_only"]).abs().mean().item()
assert _d > 0.1, f"the two adapters should give different logits; mean |diff| {_d:.3g}"
print(f"swap_adapter: rev_replay then rev_only in one NF4 model equal fresh loads bit for bit; "
      f"base untouched; mean |logit difference| between the adapters {_d:.2f}")

### BEGIN HIDDEN TESTS
# case: swapping the first adapter back in
_swap(_server, ADAPTERS["rev_replay"])
with torch.no_grad():
    assert torch.equal(_server(PROMPTS), _logits["rev_replay"]), "hidden: swapping back"
_check_untouched(_server, _server_opt, _snap, "hidden: after swapping back")
# case: a small model over a float base, an adapter written by save_adapter
_src = small_gpt()
wrap_lora(_src, BLOCK_PROJECTIONS, r=4, alpha=8.0)
randomize_lora(_src, seed=11)
_dst = small_gpt()
wrap_lora(_dst, BLOCK_PROJECTIONS, r=4, alpha=8.0)
_dst, _ = _served(_dst)
with tempfile.TemporaryDirectory() as _t:
    save_adapter(_src, _t)
    _swap(_dst, _t)
with torch.no_grad():
    assert torch.equal(_dst(torch.zeros(1, 4, dtype=torch.long)),
                       _src.eval()(torch.zeros(1, 4, dtype=torch.long))), \
        "hidden: a float-base model after swap_adapter should equal the model that saved it"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_swap_adapter_errors", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _expect_refusal(served, directory, words, what):
    model, opt = served
    snap = _snapshot(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    try:
        _swap(model, directory)
    except ValueError as e:
        for w in words:
            assert w in str(e), f"{what}: the error should name {w!r}; got: {e}"
    else:
        raise AssertionError(f"{what}: swap_adapter should raise ValueError")
    _check_untouched(model, opt, snap, what)
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, before[n]), f"{what}: {n} changed although the swap was refused"


_m = _qlora_fixture(small_gpt(), r=4, alpha=8.0)
randomize_lora(_m, seed=3)
_m_served = _served(_m)
_m = _m_served[0]
with tempfile.TemporaryDirectory() as _t:
    _other = _qlora_fixture(small_gpt(), r=2, alpha=8.0)         # another rank
    save_adapter(_other, _t)
    _expect_refusal(_m_served, _t, [], "an adapter with r=2 into layers with r=4")
with tempfile.TemporaryDirectory() as _t:
    _src = _qlora_fixture(small_gpt(), r=4, alpha=8.0)
    randomize_lora(_src, seed=6)
    save_adapter(_src, _t)
    # another lora_alpha with the same r: another scaling, refused
    _cfg = json.loads((Path(_t) / "adapter_config.json").read_text())
    (Path(_t) / "adapter_config.json").write_text(json.dumps({**_cfg, "lora_alpha": 4.0}))
    _expect_refusal(_m_served, _t, [], "lora_alpha 4 into layers with scaling 8/4 (rule: "
                    "compare the scaling, not only r)")
    (Path(_t) / "adapter_config.json").write_text(json.dumps({**_cfg, "use_rslora": True}))
    _expect_refusal(_m_served, _t, [], "a use_rslora adapter, scaling 8/sqrt(4), into layers "
                    "with scaling 8/4 (rule: with use_rslora the scaling is lora_alpha / sqrt(r))")
    (Path(_t) / "adapter_config.json").write_text(json.dumps({**_cfg, "peft_type": "LOHA"}))
    _expect_refusal(_m_served, _t, [], "an adapter_config.json with peft_type 'LOHA' (rule: "
                    "only peft_type 'LORA' is loaded)")
    (Path(_t) / "adapter_config.json").write_text(json.dumps(_cfg))
    # a file without one key: refused, naming it, before any factor is copied
    _file = Path(_t) / "adapter_model.safetensors"
    _key = f"{PREFIX}blocks.0.attn.k_proj.lora_A.weight"
    safetensors.torch.save_file({k: v for k, v in safetensors.torch.load_file(str(_file)).items()
                                 if k != _key}, str(_file))
    _expect_refusal(_m_served, _t, [_key], "a file without one key (rule: check every key "
                    "and shape first, then copy)")
print("swap_adapter refuses an adapter of another rank or scaling, and a file that lacks a "
      "key, and leaves the model as it was")

### BEGIN HIDDEN TESTS
# case: the hidden cases' own setup
_t = tempfile.mkdtemp()
_ok = small_gpt()
wrap_minigpt_qlora(_ok, r=4, alpha=8.0)
randomize_lora(_ok, seed=4)
save_adapter(_ok, _t)
_file = Path(_t) / "adapter_model.safetensors"
_tensors = safetensors.torch.load_file(str(_file))
_cfg = json.loads((Path(_t) / "adapter_config.json").read_text())
_key = f"{PREFIX}blocks.1.mlp.down_proj.lora_B.weight"
# case: a file without one key of the second block
safetensors.torch.save_file({k: v for k, v in _tensors.items() if k != _key}, str(_file))
_expect_refusal(_m_served, _t, [_key], "hidden: a file without one key")
# case: a file with an unexpected key
safetensors.torch.save_file({**_tensors, f"{PREFIX}lm_head.lora_A.weight": torch.zeros(4, 32)},
                            str(_file))
_expect_refusal(_m_served, _t, [f"{PREFIX}lm_head.lora_A.weight"], "hidden: an unexpected key")
# case: a file with a factor of another shape
safetensors.torch.save_file({**_tensors, _key: torch.zeros(4, 32)}, str(_file))
_expect_refusal(_m_served, _t, [_key], "hidden: a mis-shaped key")
safetensors.torch.save_file(_tensors, str(_file))
# case: another lora_alpha, the same r
(Path(_t) / "adapter_config.json").write_text(json.dumps({**_cfg, "lora_alpha": 16.0}))
_expect_refusal(_m_served, _t, [], "hidden: lora_alpha 16 into layers with scaling 8/4")
# case: a use_rslora adapter
(Path(_t) / "adapter_config.json").write_text(json.dumps({**_cfg, "use_rslora": True}))
_expect_refusal(_m_served, _t, [], "hidden: a use_rslora adapter into plain-LoRA layers")
# case: another peft_type
(Path(_t) / "adapter_config.json").write_text(json.dumps({**_cfg, "peft_type": "IA3"}))
_expect_refusal(_m_served, _t, [], "hidden: peft_type IA3")
(Path(_t) / "adapter_config.json").write_text(json.dumps(_cfg))
# case: a model without LoRA layers
_expect_refusal(_served(small_gpt()), _t, [], "hidden: a model with no LoRA layer")
# case: the good file after the refusals
_swap(_m, _t)
with torch.no_grad():
    assert torch.equal(_m(torch.zeros(1, 3, dtype=torch.long)),
                       _ok.eval()(torch.zeros(1, 3, dtype=torch.long))), \
        "hidden: after the refusals, the good adapter should load and equal its source"
### END HIDDEN TESTS

# %% [markdown]
# ### One base, two behaviours
#
# The same NF4 model, with each adapter swapped in by your function: exact match per task on
# 50 evaluation examples each. `rev_only` learned to reverse words and forgot nearly
# everything else (experiment 05's lesson on replay); `rev_replay` kept the other tasks. The
# base in memory is the same bytes throughout.

# %%
server = minigpt.load_base("dense")
qlora_wrap(server, r=8, alpha=16.0)
server.eval()
base_ptrs = {n: b.data_ptr() for n, b in server.named_buffers()}
scores = {}
for name, directory in ADAPTERS.items():
    swap_adapter(server, directory)
    scores[name] = {t: evaluate(server, t, n=50) for t in tasks.TASKS}
print("NF4 buffers never moved:", base_ptrs == {n: b.data_ptr() for n, b in server.named_buffers()})
adapter_kb = (ADAPTERS["rev_replay"] / "adapter_model.safetensors").stat().st_size / 1024
print(f"one adapter file: {adapter_kb:.0f} KB; the NF4 model it sits on holds "
      f"{held(server)['weights'] / 1024:.0f} KB")

fig, ax = plt.subplots(figsize=(7, 2.8))
width = 0.38
for i, (name, row) in enumerate(scores.items()):
    ax.bar([j + (i - 0.5) * width for j in range(len(tasks.TASKS))], [row[t] for t in tasks.TASKS],
           width, label=name)
ax.set_xticks(range(len(tasks.TASKS)), tasks.TASKS)
ax.set_ylabel("exact match (n=50)")
ax.set_title("One NF4 base, two adapters swapped in")
ax.set_ylim(0, 1.3)
ax.legend(fontsize=8, loc="upper center", ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Where this goes next
#
# You have composed QLoRA from Labs 02 and 04 and checked the three claims it rests on: an
# adapter sees nearly the same model on the 4-bit base (the experiment's tolerance, with 95%
# of next-token choices unchanged), training through the dequantized weights is stable, and
# the bill falls where the weights are the bill — 22.4 → 13.4 GiB predicted at 7B, against
# about 6% at MiniGPT scale, where activations dominate. `experiments/06-qlora-preview`
# runs the full version (a whole epoch, 200 examples per task, the same memory table) and
# writes a manifest to reproduce it. Labs 07–10 build the Mixture-of-Experts layers, whose
# experts are `[E, out, in]` tensors rather than `nn.Linear`s (so `quantize_model` leaves
# them alone); Lab 11 puts NF4 experts, expert LoRA and this memory table together.
#
# ### Reflection
#
# 1. The `rev_replay` adapter was never trained on the NF4 base, yet it works there. What does
#    that say about how much NF4 moves the function the model computes, and when would you
#    expect it to fail (think of a base with large outliers in a block)?
# 2. Why does QLoRA keep the embeddings, norms and `lm_head` in 16 bits? Estimate what they
#    cost for LLaMA-7B and compare with what quantizing them would save.
# 3. AdamW's state is created at the first `step()`. What would a memory check run right
#    after building the optimizer report, and which real failures (running out of memory at
#    step 1, not step 0) does that explain?
# 4. At MiniGPT scale the activations are 90% of the bill. Which knob of the course's
#    training loop cuts them (Lab 05), what does it cost, and does it matter at 7B with 2048
#    tokens?
# 5. You cannot merge an adapter into an NF4 base without re-quantizing (Lab 04's table). For
#    serving, when would you rather merge into a float copy and re-quantize, and when keep the
#    adapter separate and swap it as in Part F?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. NF4 moves each weight matrix by about 9 % of its norm (mean relative error 0.093), yet
#    the model's output barely moves: mean $|A - B|$ is 0.185 against a mean $|$logit$|$ of
#    2.67 (7 %), the argmax agrees at 95.8 % of positions and no task's exact match moves by
#    more than 0.04. The rounding errors are small, zero-mean and nearly independent, so they
#    largely cancel in each dot product, and the adapter's low-rank update does not depend on
#    the exact rounding. Expect it to fail where the errors are large or correlated: a block
#    with one large outlier sets a large absmax, the other 63 weights of the block land on a
#    coarse grid, and the errors no longer average out; or where activations carry a few huge
#    features that amplify the weight error. Training the adapter on the NF4 base (Part C)
#    lets it compensate.
# 2. They are a small share of the weights and the most sensitive to rounding: a norm gain
#    scales a whole layer, an embedding row is used alone (nothing averages its error), and
#    an error in `lm_head` shifts the logits directly. For LLaMA-7B, the embeddings, the head
#    and the norms are 262 M parameters: 0.49 GiB in bfloat16, 0.13 GiB in NF4. Quantizing
#    them would save 0.36 GiB, 10 % of QLoRA's 3.7 GiB of weights and under 3 % of the
#    13.4 GiB total, for the layers most likely to hurt.
# 3. It would report 0 bytes of optimizer state, as printed above ("AdamW is lazy"), and no
#    gradients either: only the weights. The gradients appear at the first backward and the
#    two AdamW moments at the first `step()`, 4 + 8 bytes per trained parameter (25.1 +
#    50.2 GiB for full fine-tuning at 7B). So a check that passes after building the
#    optimizer says nothing: the run fits at step 0 and runs out of memory in the first
#    backward or the first `step()`. Measure after one real step, or predict the bill as in
#    Part E.
# 4. Gradient checkpointing (`checkpoint_every` in `TrainConfig`, Lab 05): only each
#    segment's input is kept, and the segment's activations are recomputed in the backward,
#    about one more forward pass per step, for 18 times fewer activation bytes at
#    `every=1` on MiniGPT. At 7B with 2048 tokens the activations are 9.5 of the 13.4 GiB
#    QLoRA total (71 %), so it matters there too: checkpointing cuts most of them, leaving
#    the 3.7 GiB of NF4 weights as the largest item (the QLoRA paper trains with it on), and
#    it is what lets longer sequences or larger batches fit at all.
# 5. Merge into a float copy when one adapter serves all the traffic, it is final, and
#    latency or throughput matters (no extra LoRA matmuls); serve the merged model in 16 bits
#    if memory allows, and re-quantize only after measuring what is lost: Lab 04's table
#    shows that an update below about 3 % of the weight's scale barely moves a code. Keep the
#    adapter separate, as in Part F, when several adapters share one base (one NF4 copy plus
#    350 KB per adapter here), when adapters are still being trained or compared, or when
#    the update is small enough that re-quantization would erase it.
