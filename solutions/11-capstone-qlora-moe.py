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
# # Lab 11 — Capstone: QLoRA on a Mixture-of-Experts model, on your own pieces
#
# Everything of the course meets here. MiniGPT-MoE (Lab 07) has, in every block, four attention
# projections and a `MoEMLP` whose eight experts are stacked `[E, in, out]` tensors routed
# top-2 by a small float router. QLoRA on it means three things at once:
#
# * the attention projections become `QuantizedLinear` (NF4, Lab 02) under a `LoRALinear`
#   (Lab 04), exactly as in Lab 06;
# * each stacked expert weight becomes one `NF4Experts` (Lab 10): NF4 codes as buffers,
#   dequantized only for the experts a batch routes tokens to, with **per-expert** LoRA
#   factors `lora_A` `[r·E, K]` and `lora_B` `[N, r·E]` — expert `e` owns rows (columns)
#   `e·r … (e+1)·r`, so it adds $s\cdot(xA_e^\top)B_e^\top$ to the tokens routed to it;
# * the router stays a float `nn.Linear` and stays **frozen**: its decisions are discrete, and
#   a router that moves during fine-tuning sends tokens to experts whose adapters never saw them.
#
# Then you train it on `rev`, the task the base never saw, **twice**: once on the course's
# reference code and once on *yours* — your NF4 quantize and dequantize (Lab 02) and your LoRA
# Function (Lab 04) — and check that the two runs agree, that `rev` was learned, which experts
# learned it, and what your model holds in memory. Your kernels (Labs 03, 08–10) then run the
# forward and backward of one MoE layer on the Triton path (Part F). Every piece of yours
# counts its calls, and the notebook prints what ran, not only what was loaded.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `qlora_moe(model, r, alpha, blocksize)`: NF4 + LoRA on attention and on every expert | `minituner.qlora.wrap_minigpt_qlora`: structure, buffers, trainable set, logits |
# | 2 | `expert_lora_norms(model)`: ‖s·B_e·A_e‖_F per expert | a naive loop; exactly 0 for an expert whose B is zero |
# | 3 | `compare_curves(mine, ref, window)`: smoothed loss curves and their largest gap | a naive loop; clear errors on curves that cannot be compared |
# | 4 | `experts_that_learned(norms, share, frac)`: per MoE layer, the experts whose adapters moved, and how that follows the routing | a naive loop over layers and experts |
#
# Experiment 11 (`experiments/11-qlora-moe`) is the long version: 150 steps against LoRA on
# the float MoE and dense QLoRA, a reward-weighted run on the model's own samples, the memory
# table and the extrapolation, with a manifest to reproduce it.
#
# **How to work.** Each exercise states its specification first; the hints below it are
# collapsed, from an idea to pseudocode: try without them. Replace each
# `raise NotImplementedError()` with your code and run the test cell below it; its message
# says what was expected and what came. Grading runs more (hidden) checks of the same
# specification, always on the course's reference pieces (a graded notebook never reads your
# other labs). The MoE layers run on their PyTorch backend (`backend="torch"`): on a CPU the
# Triton kernels would run in the interpreter, far too slowly for training. No GPU is needed;
# the notebook runs in <!-- runtime:11-capstone-qlora-moe -->about 20 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import dataclasses
import json
import logging
import math
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

# miniquant imports bitsandbytes, which logs a warning about an optional CPU kernel package.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import minigpt  # noqa: E402
import miniquant  # noqa: E402
import minituner.qlora  # noqa: E402
from course.notebook import bridged  # noqa: E402
from course.notebook.harness import forbid, pairs_of, randomize_lora  # noqa: E402
from course.notebook.mine import blame, ran, use  # noqa: E402
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks  # noqa: E402
from minigpt.generate import evaluate  # noqa: E402
from minimoe import MoEMLP, NF4Experts, attach_expert_lora  # noqa: E402
from minimoe.experts import ExpertLinear  # noqa: E402
from miniquant import dequantize_nf4, quantize_model  # noqa: E402
from miniquant.triton_env import TRITON_MISSING, import_triton, triton_installed  # noqa: E402
from minituner import (  # noqa: E402
    LoRALinear,
    SequenceData,
    TrainConfig,
    memory,
    train,
    wrap_lora,
)
from minituner.activations import saved_activation_bytes  # noqa: E402
from minituner.adapters import save_adapter  # noqa: E402
from minituner.lora_norms import adapter_norms, norms_table  # noqa: E402
from minituner.qlora import wrap_minigpt_qlora  # noqa: E402

torch.set_num_threads(1)   # small matrices: one thread is faster than several on a busy CPU
torch.manual_seed(0)
# Part F runs your kernels, on a CPU in Triton's interpreter, which must be chosen before
# anything imports triton: training's activation checkpointing (Part C) imports it through
# torch, and your kernels' `tl.zeros` and friends then fail to run. Choose it now.
if triton_installed():
    import_triton()
print("torch", torch.__version__, "| threads:", torch.get_num_threads())

MiB, GiB, GB = 2**20, 2**30, 10**9
# The four attention projections of every block (a full-match regex, as quantize_model takes).
ATTN_PROJECTIONS = r"blocks\.\d+\.attn\.(q|k|v|o)_proj"
EXPERT_PROJECTIONS = ("w_gate", "w_up", "w_down")
HELD_OUT = "rev"
tok = CharTokenizer()


def use_torch_backend(model: nn.Module) -> nn.Module:
    """Every MoEMLP on the sort-based PyTorch path (set before wrapping: the expert modules
    copy the backend when they are built)."""
    for m in model.modules():
        if isinstance(m, MoEMLP):
            m.backend = "torch"
    return model


def load_moe() -> MiniGPT:
    """The pretrained MiniGPT-MoE: 4 blocks, width 128, 8 experts of d_ff 128, top-2."""
    return use_torch_backend(minigpt.load_base("moe")).eval()


SMALL_MOE = MiniGPTConfig(n_layer=2, n_head=2, n_embd=32, d_ff=32, block_size=16,
                          n_experts=4, top_k=2)


def small_moe(seed=0, config=SMALL_MOE) -> MiniGPT:
    """A tiny random MiniGPT-MoE (2 blocks, width 32, 4 experts): what hidden tests also use."""
    torch.manual_seed(seed)
    return use_torch_backend(MiniGPT(config)).eval()


base = load_moe()
mlp = base.blocks[0].mlp
print(base.config)
print("blocks[0].mlp:", mlp, "- its only submodule is the router; the experts are parameters:")
print({p: tuple(getattr(mlp, p).shape) for p in EXPERT_PROJECTIONS}, "[E, in, out]")
print("tasks:", list(tasks.TASKS), "| held out from pretraining:", HELD_OUT)

# %% [markdown]
# ## Part A — Exercise 1: QLoRA on the MoE, by hand
#
# `quantize_model` only sees `nn.Linear`s, so on MiniGPT-MoE it reaches the attention
# projections and the routers — and the routers must stay float. The experts are
# `nn.Parameter`s `[E, in, out]`; `minimoe.attach_expert_lora(mlp, r, alpha, nf4=True,
# blocksize)` replaces a `MoEMLP`'s three of them by `NF4Experts` with per-expert LoRA.
#
# Write `qlora_moe(model, r=8, alpha=16.0, blocksize=64) -> list[str]`, in place:
#
# * refuse, with a `ValueError` and before changing anything, a model that already holds a
#   `LoRALinear` or an expert projection that is no longer a plain `nn.Parameter`;
# * quantize the attention projections (`ATTN_PROJECTIONS`) to NF4 with double quantization
#   at `blocksize`, and wrap the same layers with LoRA (`wrap_lora`);
# * give every `MoEMLP` NF4 experts with LoRA (`attach_expert_lora(..., nf4=True)`);
# * leave the routers float and **frozen**; the only trainable tensors are the LoRA factors;
# * return the attention names wrapped, then `<mlp name>.w_gate`, `.w_up`, `.w_down` for every
#   MoE layer in the model's order (the reference's order).
#
# Off-limits: `minituner.qlora.wrap_minigpt_qlora`, which the tests compare you with.
#
# <details><summary>Hint 1: the idea</summary>
#
# Check first, change second: collect the `LoRALinear`s and the expert projections that are
# not plain parameters, and raise before any call that modifies the model. Then it is three
# course calls — quantize, wrap, attach — and one line to freeze each router again, because
# `wrap_lora` froze everything but the factors and `attach_expert_lora` adds new ones.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# if any LoRALinear or any MoEMLP.w_* not an nn.Parameter: raise ValueError
# quantize_model(model, ATTN_PROJECTIONS, blocksize, double_quant=True)
# names = wrap_lora(model, ATTN_PROJECTIONS, r, alpha)
# for name, mlp in MoE layers (model order):
#     attach_expert_lora(mlp, r, alpha, nf4=True, blocksize, double_quant=True)
#     freeze mlp.router; names += [name.w_gate, name.w_up, name.w_down]
# return names
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "qlora_moe", "locked": false, "schema_version": 3, "solution": true, "task": false}
def qlora_moe(model: nn.Module, r: int = 8, alpha: float = 16.0, blocksize: int = 64
              ) -> list[str]:
    """NF4 + LoRA on the attention projections, NF4 experts with per-expert LoRA (in place)."""
    ### BEGIN SOLUTION
    lora = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    moes = {n: m for n, m in model.named_modules() if isinstance(m, MoEMLP)}
    wrapped = [f"{n}.{p}" for n, m in moes.items() for p in EXPERT_PROJECTIONS
               if not isinstance(getattr(m, p), nn.Parameter)]
    if lora or wrapped:
        raise ValueError(f"the model already holds adapters ({(lora + wrapped)[:3]}): QLoRA "
                         f"quantizes the plain base first, then wraps it; start from the "
                         f"plain model")
    quantize_model(model, ATTN_PROJECTIONS, blocksize=blocksize, double_quant=True)
    names = wrap_lora(model, ATTN_PROJECTIONS, r=r, alpha=alpha)   # freezes all but factors
    for name, mlp in moes.items():
        attach_expert_lora(mlp, r=r, alpha=alpha, nf4=True, blocksize=blocksize,
                           double_quant=True)
        mlp.router.weight.requires_grad_(False)
        names += [f"{name}.{p}" for p in EXPERT_PROJECTIONS]
    return names
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_qlora_moe", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
from course.notebook import bridged  # noqa: E402

_NO_REFERENCE_WRAP = [minituner.qlora.wrap_minigpt_qlora]


def _structure(model):
    """(name, class name) of every submodule, below the model itself."""
    return [(n, m.__class__.__name__) for n, m in model.named_modules() if n]


def _nf4_base(make, blocksize=64):
    """The same model quantized, without any adapter: what a fresh adapter must compute."""
    model = make()
    quantize_model(model, ATTN_PROJECTIONS, blocksize=blocksize, double_quant=True)
    for m in model.modules():
        if isinstance(m, MoEMLP):
            attach_expert_lora(m, r=0, nf4=True, blocksize=blocksize)
    return model.eval()


def _expected_trainable(config, r):
    """r·(in+out) per attention projection + r·E·(in+out) per expert projection."""
    c, f, e = config.n_embd, config.d_ff, config.n_experts
    return config.n_layer * (4 * r * (c + c) + 3 * r * e * (c + f))


def _check_qlora_moe(make, r=8, alpha=16.0, blocksize=64, what=""):
    where = f"{what}qlora_moe(r={r}, alpha={alpha}, blocksize={blocksize})"
    # qlora_moe changes the model in place: `share` keeps yours where your code runs, so that
    # what it changed is what the checks below read
    mine, ref = bridged.share(make()), make()
    torch.manual_seed(5)
    with forbid(_NO_REFERENCE_WRAP, globals()):
        names = qlora_moe(mine, r=r, alpha=alpha, blocksize=blocksize)
    torch.manual_seed(5)
    want_names = wrap_minigpt_qlora(ref, r=r, alpha=alpha,
                                    quant_scheme=f"nf4_per_group_{blocksize}")
    assert names == want_names, f"{where}: expected the names {want_names[:2]} ... " \
                                f"{want_names[-2:]} ({len(want_names)}), got {names}"
    diff = [(a, b) for a, b in zip(_structure(mine), _structure(ref), strict=False) if a != b]
    assert _structure(mine) == _structure(ref), \
        f"{where}: the module tree differs from the reference's; first differences " \
        f"(yours, reference): {diff[:3]}"
    trainable = {n: p for n, p in mine.named_parameters() if p.requires_grad}
    want_trainable = sorted(n for n, p in ref.named_parameters() if p.requires_grad)
    assert sorted(trainable) == want_trainable, \
        f"{where}: trainable parameters should be exactly the LoRA factors; extra: " \
        f"{sorted(set(trainable) - set(want_trainable))[:4]}, missing: " \
        f"{sorted(set(want_trainable) - set(trainable))[:4]}"
    for n, p in trainable.items():
        assert p.dtype == torch.float32, f"{where}: {n} should be float32, got {p.dtype}"
    count, want_count = sum(p.numel() for p in trainable.values()), _expected_trainable(
        mine.config, r)
    assert count == want_count, f"{where}: expected {want_count:,} trainable elements " \
                                f"(r·(in+out) per attention projection + r·E·(in+out) per " \
                                f"expert projection), got {count:,}"
    for name, m in mine.named_modules():
        if isinstance(m, MoEMLP):
            assert isinstance(m.router, nn.Linear) and m.router.weight.dtype == torch.float32 \
                and not m.router.weight.requires_grad, \
                f"{where}: {name}.router should stay a frozen float32 nn.Linear, got " \
                f"{type(m.router).__name__}, requires_grad={m.router.weight.requires_grad}"
            for p in EXPERT_PROJECTIONS:
                assert isinstance(getattr(m, p), NF4Experts), \
                    f"{where}: {name}.{p} should be NF4Experts, got {type(getattr(m, p)).__name__}"
    ref_buffers = dict(ref.named_buffers())
    mine_buffers = dict(mine.named_buffers())
    assert sorted(mine_buffers) == sorted(ref_buffers), \
        f"{where}: the NF4 buffers differ from the reference's; missing: " \
        f"{sorted(set(ref_buffers) - set(mine_buffers))[:3]}, extra: " \
        f"{sorted(set(mine_buffers) - set(ref_buffers))[:3]} (with double quantization an NF4 " \
        f"weight holds absmax_codes, absmax_scales and absmax_offset, not block_absmax)"
    for n, b in mine_buffers.items():
        assert torch.equal(b, ref_buffers[n]), \
            f"{where}: NF4 buffer {n} differs from the reference's (blocksize? double quant?)"
    x = torch.randint(0, mine.config.vocab_size, (3, min(12, mine.config.block_size)),
                      generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = mine.eval()(x), _nf4_base(make, blocksize)(x)
    assert torch.equal(got, want), \
        f"{where}: a fresh adapter (B = 0) should compute the NF4 base exactly; max " \
        f"difference {(got - want).abs().max().item():.3g}"
    randomize_lora(ref, seed=r)
    # the same factors in yours, by name (the trainable sets are equal, checked above)
    mine.load_state_dict({n: p.detach() for n, p in ref.named_parameters() if p.requires_grad},
                         strict=False)
    with torch.no_grad():
        got, want = mine(x), ref.eval()(x)
    assert torch.equal(got, want), \
        f"{where}: with the same LoRA factors your logits differ from the reference's " \
        f"(max difference {(got - want).abs().max().item():.3g})"
    return mine


def _check_refuses(bad, what):
    before = _structure(bad)
    try:
        with forbid(_NO_REFERENCE_WRAP, globals()):
            qlora_moe(bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{what}: qlora_moe should raise ValueError on a model that "
                             f"already holds adapters (LoRALinear, or expert projections that "
                             f"are no longer plain nn.Parameters)")
    assert _structure(bad) == before, \
        f"{what}: qlora_moe raised ValueError only after changing the model: a model that " \
        f"already holds adapters must be refused before anything changes"


_q = _check_qlora_moe(load_moe)
_check_qlora_moe(small_moe, r=4, alpha=8.0, blocksize=32, what="a small MoE, blocksize 32: ")
_check_refuses(_q, "a model your qlora_moe already wrapped")
_bad = small_moe()
attach_expert_lora(_bad.blocks[1].mlp, r=2, nf4=False)
_check_refuses(bridged.share(_bad), "a model whose experts (not its attention) already hold LoRA")
print(f"qlora_moe: same tree, NF4 buffers, trainable set ({_expected_trainable(base.config, 8):,} "
      f"LoRA elements) and logits as wrap_minigpt_qlora; a fresh adapter computes the NF4 base; "
      f"refuses a model that already holds adapters")

### BEGIN HIDDEN TESTS
# case: another small MoE, r = 2, alpha = 4
_check_qlora_moe(lambda: small_moe(seed=3), r=2, alpha=4.0, blocksize=64, what="hidden: ")
# case: LoRA on one attention projection only
_bad = small_moe(seed=4)
wrap_lora(_bad, r"blocks\.0\.attn\.q_proj", r=2)
_check_refuses(bridged.share(_bad), "hidden: LoRA on one attention projection only")
# case: NF4 experts without LoRA (r = 0) on one MoE layer
_bad = small_moe(seed=5)
attach_expert_lora(_bad.blocks[1].mlp, r=0, nf4=True, blocksize=32)
_check_refuses(bridged.share(_bad), "hidden: NF4 experts without LoRA on one MoE layer")
### END HIDDEN TESTS

# %% [markdown]
# What did that buy? First, what trains in your QLoRA model; then (in Jupyter: it builds the
# baseline with the reference) the bytes held by the weights of the plain MoE, of LoRA over
# the float MoE (`quantize=False`, the baseline of experiment 11) and of your QLoRA model.

# %%
qlora = load_moe()
qlora_moe(qlora, r=8, alpha=16.0)
share = sum(p.numel() for n, p in qlora.named_parameters() if p.requires_grad and ".mlp." in n)
print(f"expert LoRA is {share / sum(p.numel() for p in qlora.parameters() if p.requires_grad):.0%}"
      f" of the trainable elements: every expert has its own r = 8 factors")

# %% tags=["jupyter-only"]
float_lora = load_moe()
wrap_minigpt_qlora(float_lora, r=8, alpha=16.0, quantize=False)
for label, model in (("plain float MoE", base), ("LoRA, float base", float_lora),
                     ("QLoRA, NF4 base", qlora)):
    w = memory.held_bytes(model).weights
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{label:<17} weights held {w / MiB:5.2f} MiB | trainable {n_train:>9,}")

# %% [markdown]
# ## Part B — Exercise 2: how much has each expert's adapter moved?
#
# An expert that receives no tokens gets exactly-zero LoRA gradients; one that receives many
# learns the most. The size of expert `e`'s update is the Frobenius norm of
# $\Delta W_e = s\,B_eA_e$, with $A_e$ = `lora_A[e·r:(e+1)·r]` `[r, K]` and $B_e$ =
# `lora_B[:, e·r:(e+1)·r]` `[N, r]`.
#
# Write `expert_lora_norms(model) -> dict[str, list[float]]`: for every expert module with
# LoRA (`NF4Experts` or the float `ExpertLinear`, found by `lora_A` and `n_experts`), its full
# name -> `E` Python floats ‖s·B_e·A_e‖_F. Attention `LoRALinear`s are not included; a module
# whose `lora_A` is `None` (r = 0) is skipped. No gradients are needed.
#
# <details><summary>Hint 1: the idea</summary>
#
# A loop over experts is correct; one batched product is what a real MoE with 128 experts
# needs. Expert `e`'s rows of `A` are contiguous, so `A` reshapes to `[E, r, K]`; its columns of
# `B` are contiguous within each row, so `B` reshapes to `[N, E, r]` (not `[E, r, N]`, which
# mixes experts).
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# for each module with lora_A and n_experts (NF4Experts, ExpertLinear), lora_A not None:
#     A_e = A.reshape(E, r, K); B_e = B.reshape(N, E, r).permute(1, 0, 2)   # [E, N, r]
#     delta = scaling * bmm(B_e, A_e)                                        # [E, N, K]
#     out[name] = delta.flatten(1).norm(dim=1).tolist()
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "expert_lora_norms", "locked": false, "schema_version": 3, "solution": true, "task": false}
def expert_lora_norms(model: nn.Module) -> dict[str, list[float]]:
    """{expert projection name: [‖s·B_e·A_e‖_F for e in range(E)]}."""
    ### BEGIN SOLUTION
    out = {}
    for name, m in model.named_modules():
        A = getattr(m, "lora_A", None)
        if not isinstance(m, (NF4Experts, ExpertLinear)) or A is None:
            continue
        E, K, N = m.n_experts, m.in_features, m.out_features
        with torch.no_grad():
            A_e = A.reshape(E, m.r, K)                                   # [E, r, K]
            B_e = m.lora_B.reshape(N, E, m.r).permute(1, 0, 2)           # [E, N, r]
            delta = m.scaling * torch.bmm(B_e, A_e)                      # [E, N, K]
            out[name] = delta.flatten(1).norm(dim=1).tolist()
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_expert_lora_norms", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _naive_norms(model):
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (NF4Experts, ExpertLinear)) and m.lora_A is not None:
            A, B, r = m.lora_A.detach(), m.lora_B.detach(), m.r
            out[name] = [float((m.scaling * B[:, e * r:(e + 1) * r] @ A[e * r:(e + 1) * r])
                               .norm()) for e in range(m.n_experts)]
    return out


def _check_norms(model, what):
    got, want = expert_lora_norms(model), _naive_norms(model)
    assert isinstance(got, dict) and sorted(got) == sorted(want), \
        f"{what}: expected the keys {sorted(want)[:3]} ... ({len(want)}), got " \
        f"{sorted(got)[:3] if isinstance(got, dict) else type(got).__name__}"
    for name, values in want.items():
        assert isinstance(got[name], list) and all(type(v) is float for v in got[name]), \
            f"{what}: {name} should map to a list of Python floats, got {got[name]!r}"
        ok = len(got[name]) == len(values) and all(
            math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) for a, b in zip(got[name], values, strict=True))
        ratios = {round(a / b, 4) for a, b in zip(got[name], values, strict=False) if b > 0}
        hint = "" if ok or len(ratios) != 1 else \
            f" (every value is {ratios.pop()}× the loop's: the scaling s = α/r multiplies " \
            f"B_e·A_e once)"
        assert ok, f"{what}: {name}: expected {[round(v, 5) for v in values]}, got " \
                   f"{[round(v, 5) for v in got[name]]}{hint}"
    return got


_m = load_moe()
wrap_minigpt_qlora(_m)             # the reference's model: this test grades the norms alone
_fresh = _check_norms(_m, "a fresh adapter")
assert all(v == 0.0 for vs in _fresh.values() for v in vs), \
    f"a fresh adapter has B = 0, so every norm should be 0.0; got {_fresh}"
randomize_lora(_m, seed=3)
_w, _v = _m.blocks[2].mlp.w_up, _m.blocks[1].mlp.w_down
with torch.no_grad():
    for _e in (1, 5):
        _w.lora_B[:, _e * _w.r:(_e + 1) * _w.r] = 0.0
    _v.lora_A[3 * _v.r:4 * _v.r] = 0.0
_got = expert_lora_norms(_m)
assert _got["blocks.2.mlp.w_up"][1] == 0.0 and _got["blocks.2.mlp.w_up"][5] == 0.0 and \
    min(_got["blocks.2.mlp.w_up"][0], _got["blocks.2.mlp.w_up"][2]) > 0, \
    f"after zeroing experts 1 and 5's B in blocks.2.mlp.w_up (expert e owns the columns " \
    f"e·r:(e+1)·r of lora_B), expected exactly 0.0 for them and > 0 for the others; got " \
    f"{[round(v, 4) for v in _got['blocks.2.mlp.w_up']]}"
assert _got["blocks.1.mlp.w_down"][3] == 0.0 and min(_got["blocks.1.mlp.w_down"][:3]) > 0, \
    f"after zeroing expert 3's A in blocks.1.mlp.w_down (expert e owns the rows e·r:(e+1)·r " \
    f"of lora_A), expected exactly 0.0 for it and > 0 for the others; got " \
    f"{[round(v, 4) for v in _got['blocks.1.mlp.w_down']]}"
_check_norms(_m, "random factors")
print("expert_lora_norms: matches the per-expert loop; zero B reads exactly 0.0")

### BEGIN HIDDEN TESTS
# case: float experts, r = 4
_f = small_moe(seed=1)
wrap_minigpt_qlora(_f, r=4, alpha=8.0, quantize=False)     # float ExpertLinear, another rank
randomize_lora(_f, seed=7)
_check_norms(_f, "hidden: float experts, r=4")
# case: experts without LoRA (r = 0)
_f2 = small_moe(seed=2)
for _mm in _f2.modules():
    if isinstance(_mm, MoEMLP):
        attach_expert_lora(_mm, r=0, nf4=True, blocksize=32)
assert expert_lora_norms(_f2) == {}, "hidden: experts without LoRA (r=0) should be skipped"
# case: one MoE layer wrapped, r = 3, alpha = 5
_f3 = small_moe(seed=2)
attach_expert_lora(_f3.blocks[0].mlp, r=3, alpha=5.0, nf4=True, blocksize=32)
randomize_lora(_f3, seed=9, std=0.5)
_ = _check_norms(_f3, "hidden: one MoE layer wrapped, r=3, alpha=5")
### END HIDDEN TESTS

# %% [markdown]
# ## Part C — Train it on your own pieces
#
# `use("mine")` (from `course.notebook.mine`) swaps in what *you* built wherever the course
# packages call it, for as long as the `with` block runs. Each time `make check LAB=NN-name`
# runs one of your lab notebooks, it saves that notebook's definitions to `work/mine/`; a piece
# counts as yours once the visible tests of its lab's exercises pass (and the saved file is
# as `make check` wrote it), otherwise the reference stands in, and the cell below says which,
# piece by piece, and why (`python -m course mine` prints the same list from a terminal).
# Every call the packages hand to a piece of yours is counted: when the block ends, `use`
# prints how many calls each piece received, and "loaded, never called" for one that got none.
#
# | piece | your lab | what it replaces | where it runs in this notebook |
# |---|---|---|---|
# | `nf4_indices`, `pack_nibbles`, `double_quantize_absmax` | 02 | `miniquant.quantize_nf4` | Part C: every projection and expert is quantized by it |
# | `unpack_nibbles`, `nf4_dequantize` | 02 | `miniquant.dequantize_nf4` and the experts' CPU dequantization | Part C: every forward and backward |
# | `LoRAMatmul` | 04 | `minituner.lora.lora_linear` | Part C: every attention LoRA |
# | `my_selective_dequantize` | 03 | the experts' Triton dequantization | Part F: the QLoRA MoE layer |
# | `my_lora_parallel_linear` | 10 | `minimoe.parallel_linear` with expert LoRA | Part F: the QLoRA MoE layer, forward and backward |
# | `my_scatter2scatter`, `my_parallel_linear` | 08, 09 | `minimoe.ops.scatter2scatter`, `minimoe.parallel_linear` without LoRA | Part F: the same layer with float experts, forward and backward |
# | `my_dequantize_nf4` | 03 | `miniquant.triton_dequantize_nf4` | Part F: one attention projection's NF4 weight |
#
# On a CPU the training below runs the MoE layers on the PyTorch backend, so the kernels are
# loaded there but not called: the list printed after the run says so, and Part F runs them.
#
# The run: your `qlora_moe` on the pretrained MoE, then `STEPS` steps of supervised
# fine-tuning on gold `rev` answers, exact match on 50 held-out `rev` prompts before and after.
# Both runs start from the same seed and see the same batches, so any difference comes from
# the arithmetic of the pieces. Forty steps teach the start of `rev`; for the longer run, set
# `STEPS = 200`: with the reference pieces, `rev` exact match then reached 1.00 on the same 50
# prompts (the loss falls near 0 there, so compare the exact matches rather than relative
# loss gaps).

# %%
STEPS, BATCH, LR, EVAL_N = 40, 16, 1e-2, 50
TRAIN = SequenceData.from_pairs(pairs_of(tasks.make_examples(HELD_OUT, 400, 0, "train"), tok),
                                pad_id=tok.pad_id)
CONFIG = TrainConfig(steps=STEPS, batch_size=BATCH, lr=LR, warmup_steps=3, log_every=1,
                     grad_clip_value=1.0, aux_loss_coef=0.0, progress=False, seed=0)


def qlora_run():
    """(model, per-step losses, rev exact match before, after) of one fine-tune."""
    # `share` keeps the model, and the evaluation and training that run on it, where your
    # code runs: where your qlora_moe changed it (graded, the tests run in a process of their
    # own). In this notebook `bridged.share(x)` is `x` itself.
    torch.manual_seed(0)
    model = bridged.share(load_moe())
    qlora_moe(model, r=8, alpha=16.0)
    before = bridged.share(evaluate)(model, HELD_OUT, n=EVAL_N)
    result = bridged.share(train)(model, TRAIN, CONFIG)
    assert result.stopped_early is None, f"the NaN guard fired: {result.stopped_early}"
    model.eval()
    return model, result.losses, before, evaluate(model, HELD_OUT, n=EVAL_N)


with use("mine") as choices:
    mine_model, mine_losses, mine_before, mine_after = qlora_run()
ref_model, ref_losses, ref_before, ref_after = qlora_run()
yours = [c.piece for c in choices if c.yours]
trained_on = [piece for piece, calls in ran(choices).items() if calls]
print(f"\n{len(yours)} of {len(choices)} pieces were yours, {len(trained_on)} of them ran in "
      f"training | rev exact match: yours {mine_before:.2f} -> {mine_after:.2f}, reference "
      f"{ref_before:.2f} -> {ref_after:.2f}")

# %% [markdown]
# ## Exercise 3: do the two runs agree?
#
# Per-step losses are noisy (each step sees another batch), so compare **smoothed** curves: the
# trailing mean over the last `window` steps, where the first steps average what exists
# (step 0 is itself, step 1 the mean of steps 0–1, …).
#
# Write `compare_curves(mine, ref, window=5) -> dict` with
#
# * `"mine"`, `"ref"`: the smoothed curves, lists of Python floats, as long as the inputs;
# * `"max_gap"`: the largest relative gap $\max_t |m_t - r_t| / |r_t|$ between the smoothed
#   curves, a Python float (0.0 when they are equal);
# * `"step"`: the step (index) where that gap is largest, the first one on a tie.
#
# Rules: `mine` and `ref` are sequences of numbers of the same non-zero length, else
# `ValueError` naming the lengths; a NaN or infinite loss anywhere raises `ValueError` naming
# the curve and the step (a run that diverged cannot "agree"); `window` must be an int ≥ 1.
#
# <details><summary>Hint 1: the idea</summary>
#
# A trailing mean at step t averages `values[max(0, t - window + 1) : t + 1]`. Check the
# inputs first, so that a bad curve never reaches the arithmetic. Float64 sums keep the
# smoothing exact enough; convert to Python floats at the end.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# check window, lengths, finiteness (name the curve and the step)
# smooth(v)[t] = mean(v[max(0, t-window+1) .. t])
# gaps[t] = |m[t] - r[t]| / |r[t]|
# step = argmax(gaps) (first on a tie); max_gap = gaps[step]
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "compare_curves", "locked": false, "schema_version": 3, "solution": true, "task": false}
def compare_curves(mine, ref, window: int = 5) -> dict:
    """Trailing-mean smoothed curves and their largest relative gap (and where it is)."""
    ### BEGIN SOLUTION
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    curves = {"mine": [float(v) for v in mine], "ref": [float(v) for v in ref]}
    if len(curves["mine"]) != len(curves["ref"]) or not curves["ref"]:
        raise ValueError(f"mine and ref must have the same non-zero length, got "
                         f"{len(curves['mine'])} and {len(curves['ref'])}")
    for name, values in curves.items():
        bad = [t for t, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"{name} has a non-finite loss at step {bad[0]}: "
                             f"{values[bad[0]]}")
    out = {}
    for name, values in curves.items():
        v = torch.tensor(values, dtype=torch.float64)
        csum = torch.cat([v.new_zeros(1), v.cumsum(0)])
        t = torch.arange(len(values))
        lo = (t - window + 1).clamp(min=0)
        out[name] = ((csum[t + 1] - csum[lo]) / (t + 1 - lo)).tolist()
    m, r = torch.tensor(out["mine"], dtype=torch.float64), torch.tensor(out["ref"], dtype=torch.float64)
    gaps = (m - r).abs() / r.abs()
    step = int(torch.argmax(gaps))          # the first maximum
    return {**out, "max_gap": float(gaps[step]), "step": step}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_compare_curves", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _naive_compare(mine, ref, window):
    sm = {}
    for name, v in (("mine", mine), ("ref", ref)):
        sm[name] = [sum(v[max(0, t - window + 1):t + 1]) / len(v[max(0, t - window + 1):t + 1])
                    for t in range(len(v))]
    gaps = [abs(a - b) / abs(b) for a, b in zip(sm["mine"], sm["ref"], strict=True)]
    step = gaps.index(max(gaps))
    return {**sm, "max_gap": gaps[step], "step": step}


def _check_compare(mine, ref, window, what):
    got = compare_curves(mine, ref, window)
    want = _naive_compare([float(v) for v in mine], [float(v) for v in ref], window)
    assert isinstance(got, dict) and set(want) <= set(got), \
        f"{what}: expected a dict with the keys {sorted(want)}, got " \
        f"{sorted(got) if isinstance(got, dict) else type(got).__name__}"
    for key in ("mine", "ref"):
        assert isinstance(got[key], list) and all(type(v) is float for v in got[key]), \
            f"{what}: {key!r} should be a list of Python floats, got {got[key]!r:.80}"
        assert len(got[key]) == len(want[key]) and all(
            math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
            for a, b in zip(got[key], want[key], strict=True)), \
            f"{what}: smoothed {key!r} with window={window}: expected " \
            f"{[round(v, 4) for v in want[key]]}, got {[round(v, 4) for v in got[key]]} (a " \
            f"trailing mean: step t averages steps max(0, t-window+1) … t)"
    assert type(got["max_gap"]) is float and math.isclose(got["max_gap"], want["max_gap"],
                                                          rel_tol=1e-9, abs_tol=1e-12), \
        f"{what}: expected max_gap {want['max_gap']:.6g}, got {got['max_gap']!r} (the gap " \
        f"relative to the reference's smoothed loss: |m_t - r_t| / |r_t|)"
    assert got["step"] == want["step"], \
        f"{what}: the largest gap is at step {want['step']} (the first on a tie), got " \
        f"{got['step']!r}"


def _rejects(call, what):
    try:
        call()
    except ValueError:
        return
    except Exception as e:
        raise AssertionError(f"{what}: expected ValueError, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: expected ValueError")


_check_compare([3.0, 2.0, 1.0], [3.0, 2.0, 1.0], 2, "identical curves (max_gap 0.0, step 0)")
_check_compare([4.0, 2.0, 3.0, 1.0, 1.5], [4.0, 2.5, 2.0, 1.0, 1.0], 3,
               "window 3 over five steps")
_check_compare([2.0], [1.0], 5, "a single step, window longer than the curve")
if "mine_losses" in globals():        # Part C ran (it needs your qlora_moe)
    _check_compare(mine_losses, ref_losses, 5, "your two runs above")
_rejects(lambda: compare_curves([1.0, 2.0], [1.0], 2), "curves of different lengths")
_rejects(lambda: compare_curves([1.0, float("nan")], [1.0, 1.0], 2),
         "a NaN loss (a run that diverged)")
_rejects(lambda: compare_curves([1.0], [1.0], 0), "window = 0")
print("compare_curves: matches the trailing-mean loop; refuses curves that cannot be compared")

### BEGIN HIDDEN TESTS
# case: window 1
_check_compare([5.0, 1.0, 5.0, 1.0], [1.0, 5.0, 1.0, 5.0], 1, "hidden: window 1 (no smoothing)")
# case: a tie of gaps
_check_compare([1.0, 2.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0], 4, "hidden: a tie of gaps")
# case: a tensor and a tuple as curves
_check_compare(torch.tensor([2.0, 1.5, 1.25]), (2.5, 1.0, 1.0), 2,
               "hidden: a tensor and a tuple")
# case: empty curves
_rejects(lambda: compare_curves([], [], 3), "hidden: empty curves")
# case: an infinite loss
_rejects(lambda: compare_curves([1.0, 2.0], [1.0, float("inf")], 1), "hidden: an infinite loss")
# case: a float window, and window=True
_rejects(lambda: compare_curves([1.0], [1.0], 2.0), "hidden: a float window")
_rejects(lambda: compare_curves([1.0], [1.0], True), "hidden: window=True")
### END HIDDEN TESTS

# %% [markdown]
# The two curves, and the tolerance this lab holds them to: smoothed over 5 steps, they must
# stay within `CURVE_TOL` of each other at every step. Your pieces compute the same functions
# as the reference, but not always in the same order of float32 operations, and forty steps of
# AdamW amplify a last-bit difference a little; a real bug (a wrong scale, a missing term in
# the backward, a gradient changed in place) moves the curve by far more than that.
#
# When the curves part, the cell finds the piece: `blame` repeats a `SHORT_STEPS`-step version
# of the run (same seed and data) with the pieces of yours that ran swapped back to the
# reference one at a time, and names the first whose swap brings every step's loss within
# `SHORT_TOL` of the reference's short run. With the course's solutions as your pieces the two
# runs are equal bit for bit.

# %%
CURVE_TOL = 0.05
SHORT_STEPS, SHORT_TOL = 5, 1e-3      # the search for the piece: per-step losses, no smoothing
curves = compare_curves(mine_losses, ref_losses, window=5)
print(f"largest smoothed gap {curves['max_gap']:.2e} at step {curves['step']} "
      f"(tolerance {CURVE_TOL:.0%}); loss {curves['ref'][0]:.2f} -> {curves['ref'][-1]:.2f}")


def short_losses():
    """The per-step losses of a SHORT_STEPS-step version of Part C's run, same seed and data."""
    torch.manual_seed(0)
    model = load_moe()
    qlora_moe(model, r=8, alpha=16.0)
    return train(model, TRAIN, dataclasses.replace(CONFIG, steps=SHORT_STEPS)).losses


if curves["max_gap"] > CURVE_TOL:
    ref_short = short_losses()
    culprit = blame(short_losses, lambda losses: max(
        abs(a - b) / abs(b) for a, b in zip(losses, ref_short, strict=True)) <= SHORT_TOL)
    raise AssertionError(f"your pieces' run left the reference's by {curves['max_gap']:.1%} "
                         f"at step {curves['step']}; {culprit}")
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.plot(mine_losses, color="C0", alpha=0.3)
ax.plot(ref_losses, color="C1", alpha=0.3)
ax.plot(curves["mine"], color="C0", label=f"your pieces ({len(yours)} of {len(choices)})")
ax.plot(curves["ref"], color="C1", ls="--", label="reference")
ax.set(xlabel="step", ylabel="loss on rev answers", title="QLoRA-MoE, SFT on rev")
ax.legend()
plt.show()

# %% [markdown]
# ## Part D — Exercise 4: which experts learned `rev`?
#
# The routers are frozen, so each MoE layer sends `rev` tokens to the experts it always chose
# for such inputs, and only those experts' adapters receive gradient. Exercise 2's norms say
# how far each adapter moved; the routing share says how much `rev` traffic each expert got.
# `rev_share(model)` below gives the share per layer: row `i` is MoE layer `i`'s fraction of
# `rev` top-k slots per expert.
#
# Write `experts_that_learned(norms, share, frac=0.5) -> dict[int, dict]`: for MoE layer `i`
# (the `i`-th distinct `<layer>` among the `"<layer>.w_gate"`, `".w_up"`, `".w_down"` keys of
# `norms`, in the order the keys first appear), with `share[i]` its `[E]` routing shares:
#
# * the expert's update size is $u_e = \sqrt{g_e^2 + u p_e^2 + d_e^2}$ from its three
#   projections' norms (the Frobenius norm of the three updates together);
# * `"learned"`: the experts with $u_e \ge$ `frac` · $\max_e u_e$, largest first (ties: lower
#   id first); empty when every $u_e$ is 0;
# * `"corr"`: the Pearson correlation between $u$ and `share[i]`, a Python float; 0.0 when
#   either is constant.
#
# `share` must have one row per layer and one column per expert, else `ValueError`.
#
# <details><summary>Hint 1: the idea</summary>
#
# Group the keys by what comes before the last dot, keeping first-appearance order. Stack each
# layer's three norm lists into `[3, E]`, take the norm over the first axis. Pearson is the
# mean of the product of the centred vectors over the product of their standard deviations.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# layers = unique(key.rsplit(".", 1)[0] for key in norms)   # in order
# check share is [len(layers), E]
# for i, layer: u = sqrt(sum over p of norms[layer.p]^2)
#     learned = sorted(e with u[e] >= frac*max(u) and max(u) > 0, by (-u[e], e))
#     a, b = u - mean(u), share[i] - mean(share[i])
#     corr = 0 if |a| == 0 or |b| == 0 else sum(a*b) / (|a| |b|)
# ```
#
# </details>

# %%
def rev_share(model: nn.Module, n: int = 32) -> torch.Tensor:
    """[n MoE layers, E]: each layer's share of the top-k slots of `rev` eval prompts."""
    x = SequenceData.from_pairs(pairs_of(tasks.make_examples(HELD_OUT, n, 0, "eval"), tok),
                                pad_id=tok.pad_id).tokens
    with torch.no_grad():
        model.eval()(x)
    rows = [torch.bincount(m.last_experts.reshape(-1), minlength=m.n_experts).float()
            for m in model.modules() if isinstance(m, MoEMLP)]
    return torch.stack([r / r.sum() for r in rows])


# %% nbgrader={"grade": false, "grade_id": "experts_that_learned", "locked": false, "schema_version": 3, "solution": true, "task": false}
def experts_that_learned(norms: dict[str, list[float]], share: torch.Tensor,
                         frac: float = 0.5) -> dict[int, dict]:
    """{MoE layer i: {"learned": [expert ids], "corr": Pearson(update size, rev share)}}."""
    ### BEGIN SOLUTION
    layers = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in norms))
    share = torch.as_tensor(share, dtype=torch.float64)
    E = len(next(iter(norms.values()))) if norms else 0
    if share.dim() != 2 or tuple(share.shape) != (len(layers), E):
        raise ValueError(f"share must be [{len(layers)} layers, {E} experts], got "
                         f"{tuple(share.shape)}")
    out = {}
    for i, layer in enumerate(layers):
        u = torch.tensor([norms[f"{layer}.{p}"] for p in EXPERT_PROJECTIONS],
                         dtype=torch.float64).norm(dim=0)                       # [E]
        top = float(u.max())
        learned = sorted((e for e in range(E) if top > 0 and u[e] >= frac * top),
                         key=lambda e: (-float(u[e]), e))
        a, b = u - u.mean(), share[i] - share[i].mean()
        den = float(a.norm() * b.norm())
        out[i] = {"learned": learned, "corr": 0.0 if den == 0 else float((a * b).sum()) / den}
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_experts_that_learned", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _naive_learned(norms, share, frac):
    layers = []
    for name in norms:
        if name.rsplit(".", 1)[0] not in layers:
            layers.append(name.rsplit(".", 1)[0])
    out = {}
    for i, layer in enumerate(layers):
        E = len(norms[f"{layer}.w_gate"])
        u = [math.sqrt(sum(norms[f"{layer}.{p}"][e] ** 2 for p in EXPERT_PROJECTIONS))
             for e in range(E)]
        s = [float(v) for v in share[i]]
        top = max(u)
        learned = sorted([e for e in range(E) if top > 0 and u[e] >= frac * top],
                         key=lambda e: (-u[e], e))
        mu, ms = sum(u) / E, sum(s) / E
        cov = sum((a - mu) * (b - ms) for a, b in zip(u, s, strict=True))
        den = math.sqrt(sum((a - mu) ** 2 for a in u) * sum((b - ms) ** 2 for b in s))
        out[i] = {"learned": learned, "corr": 0.0 if den == 0 else cov / den}
    return out


def _check_learned(norms, share, frac, what):
    got = experts_that_learned(norms, share, frac)
    want = _naive_learned(norms, share, frac)
    assert isinstance(got, dict) and sorted(got) == sorted(want), \
        f"{what}: expected one entry per MoE layer, keys {sorted(want)}, got " \
        f"{sorted(got) if isinstance(got, dict) else type(got).__name__}"
    for i, w in want.items():
        g = got[i]
        assert g.get("learned") == w["learned"], \
            f"{what}: layer {i}: expected learned experts {w['learned']} (largest first, " \
            f"u_e >= {frac} * max), got {g.get('learned')}"
        assert type(g.get("corr")) is float and math.isclose(g["corr"], w["corr"],
                                                             rel_tol=1e-6, abs_tol=1e-9), \
            f"{what}: layer {i}: expected corr {w['corr']:.6f}, got {g.get('corr')!r}"


def _norms(values_by_layer):
    return {f"blocks.{i}.mlp.{p}": list(v[j]) for i, v in enumerate(values_by_layer)
            for j, p in enumerate(EXPERT_PROJECTIONS)}


_check_learned(_norms([[[1.0, 2.0, 3.0]] * 3]), torch.tensor([[0.3, 0.3, 0.4]]), 0.5,
               "corr is Pearson's: u and the share each centred on their mean")
_flat = torch.tensor([[0.5, 0.5]])
_check_learned(_norms([[[3.0, 2.0], [0.0, 2.0], [0.0, 2.0]]]), _flat, 0.6,
               "the three projections combine as u_e = √(g_e² + up_e² + d_e²) (not a sum)")
_check_learned(_norms([[[1.0, 2.0]] * 3]), _flat, 0.5,
               "an expert exactly at frac · max is learned (u_e >= frac · max)")
_check_learned(_norms([[[2.0, 1.0, 2.0]] * 3]), torch.tensor([[0.4, 0.2, 0.4]]), 0.9,
               "a tie of update sizes: the lower expert id first")
_check_learned(_norms([[[0.0] * 3] * 3]), torch.tensor([[0.5, 0.25, 0.25]]), 0.5,
               "an untouched layer: nothing learned (every u_e is 0), corr 0.0")
_toy = _norms([[[3.0, 0.0, 1.0, 0.0], [4.0, 0.0, 1.0, 2.0], [0.0, 0.0, 1.0, 0.0]]])
_check_learned(_toy, torch.tensor([[0.4, 0.0, 0.3, 0.3]]), 0.5, "one layer, four experts")
_check_learned(_norms([[[0.0] * 3] * 3, [[1.0, 2.0, 2.0]] * 3]),
               torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.4, 0.4]]), 0.5,
               "an untouched layer, and a tie")
_ref = load_moe()
wrap_minigpt_qlora(_ref)           # the reference's model: this test grades the reading alone
randomize_lora(_ref, seed=4)
_real_norms = _naive_norms(_ref)   # Exercise 2's naive loop, from its test cell
_real_share = rev_share(_ref)
_check_learned(_real_norms, _real_share, 0.5, "a QLoRA MoE with random adapters")
_rejects(lambda: experts_that_learned(_real_norms, _real_share[:2], 0.5),
         "share with two rows for four layers")
print("experts_that_learned: matches the loop over layers and experts")

### BEGIN HIDDEN TESTS
# case: frac 0.9
_check_learned(_real_norms, _real_share, 0.9, "hidden: frac 0.9")
# case: frac 0
_check_learned(_real_norms, _real_share, 0.0, "hidden: frac 0 (every expert, sorted)")
# case: constant update sizes
_check_learned(_norms([[[1.0, 1.0]] * 3]), torch.tensor([[0.7, 0.3]]), 0.5,
               "hidden: constant update sizes (corr 0.0)")
# case: a constant share
_check_learned(_norms([[[2.0, 1.0, 3.0]] * 3, [[1.0, 0.5, 0.0]] * 3]),
               torch.tensor([[1 / 3] * 3, [0.6, 0.4, 0.0]]), 0.4,
               "hidden: a constant share (corr 0.0)")
# case: a share with too few experts
_rejects(lambda: experts_that_learned(_real_norms, _real_share[:, :3], 0.5),
         "hidden: share with too few experts")
### END HIDDEN TESTS

# %% [markdown]
# Read your run: the update size of every expert beside the share of `rev` traffic it got,
# layer by layer.

# %%
mine_norms, mine_share = expert_lora_norms(mine_model), rev_share(mine_model)
report = experts_that_learned(mine_norms, mine_share)
sizes = torch.stack([torch.tensor([mine_norms[f"blocks.{i}.mlp.{p}"] for p in
                                   EXPERT_PROJECTIONS]).norm(dim=0) for i in report])
for i, r in report.items():
    print(f"MoE layer {i}: learned {r['learned']} | corr(update, rev share) {r['corr']:+.2f} | "
          f"rev share {[round(v, 2) for v in mine_share[i].tolist()]}")
fig, axes = plt.subplots(1, 2, figsize=(10, 2.6))
for ax, data, title in ((axes[0], sizes, "‖ΔW_e‖ (three projections)"),
                        (axes[1], mine_share, "share of rev top-k slots")):
    im = ax.imshow(data, cmap="viridis")
    ax.set(title=title, xlabel="expert", ylabel="MoE layer")
    fig.colorbar(im, ax=ax, shrink=0.8)
plt.show()

# %% [markdown]
# ## Part E — The memory bill of your model
#
# What does *your* model hold for one training step, next to the reference's? Weights (NF4
# codes, scales, float embeddings, norms, routers, head, LoRA factors), gradients (the factors
# only), AdamW state, and what autograd saves for the backward, measured with the tools of
# Lab 06 on both models, each under its own pieces. A piece that computes the same numbers
# can still hold more: a LoRA Function that saves the dequantized weight for its backward keeps
# a float copy of every attention projection that the reference rebuilds in the backward.

# %%
PARTS = ("weights", "grads", "optimizer", "activations")
xb, yb, _ = TRAIN.batch(torch.arange(8))


def step_bill(model):
    """Bytes held after one AdamW step on xb, and the activations its forward saves."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    held = memory.held_bytes(model, opt)
    return {"weights": held.weights, "grads": held.grads, "optimizer": held.optimizer,
            "activations": saved_activation_bytes(model, xb)}


with use("mine", quiet=True):
    bill_mine = step_bill(mine_model)
bill_ref = step_bill(ref_model)
print(f"{'':<11}" + "".join(f"{p:>13}" for p in PARTS) + f"{'total':>10}   (MiB)")
for label, bill in (("yours", bill_mine), ("reference", bill_ref)):
    print(f"{label:<11}" + "".join(f"{bill[p] / MiB:13.2f}" for p in PARTS)
          + f"{sum(bill.values()) / MiB:10.2f}")
fig, ax = plt.subplots(figsize=(7, 1.8))
for i, bill in enumerate((bill_mine, bill_ref)):
    left = 0.0
    for j, part in enumerate(PARTS):
        ax.barh(i, bill[part] / MiB, left=left, color=f"C{j}", label=part if i == 0 else None)
        left += bill[part] / MiB
ax.set_yticks([0, 1], ["your pieces", "reference"])
ax.set_xlabel("MiB held (one step, 8 sequences)")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()
plt.show()

# %% [markdown]
# At this size the float embeddings, head and activations are much of the bill. In a real MoE
# the expert weights dominate, every expert (not just the two a token uses) must be held, and
# that is where NF4 pays. `minituner.memory.predict_training` gives weights, gradients and
# AdamW state from the shape alone (base in bfloat16, r = 8). The last line uses the QLoRA
# paper's setting for LLaMA-65B (r = 64 on every projection, 16-bit adapters and activations,
# 512 tokens, gradient checkpointing) — the same setting as experiment 11, whose report and
# the README give it in GB (10⁹ bytes); both units are printed.

# %%
print(f"{'model':<15}{'regime':<7}{'weights':>11}{'grads':>9}{'Adam':>9}{'total':>10}  (GiB)")
for label, s in (("Mixtral-8x7B", memory.MIXTRAL_8X7B), ("Qwen3-30B-A3B", memory.QWEN3_30B_A3B)):
    for regime in memory.REGIMES:
        p = memory.predict_training(s, regime, tokens=0, r=8, weight_bits=16)
        print(f"{label:<15}{regime:<7}{p.weights / GiB:11.1f}{p.grads / GiB:9.2f}"
              f"{p.optimizer / GiB:9.2f}{p.total / GiB:10.1f}")
paper = memory.predict_training(memory.LLAMA_65B, "qlora", tokens=512, r=64, weight_bits=16,
                                act_bits=16, lora_bits=16, checkpointing=True)
print(f"LLaMA-65B, the QLoRA paper's setting: {paper.total / GB:.1f} GB = "
      f"{paper.total / GiB:.1f} GiB — under the paper's one 48 GB GPU")

# %% [markdown]
# ## Part F — Your kernels, on one MoE layer
#
# The training above ran the MoE layers on the PyTorch backend, where no kernel launches. On
# the Triton backend the packages launch them, and `use("mine")` puts yours there: a QLoRA
# expert layer dequantizes its active experts with your selective kernel (Lab 03) and runs
# base + LoRA forward and backward through your fused kernels (Lab 10); an expert layer
# without LoRA runs through your `my_parallel_linear` (Lab 09), whose forward and input
# gradient are your scatter2scatter (Lab 08); and `miniquant.triton_dequantize_nf4`, which no
# layer calls, is your whole-tensor dequantization kernel (Lab 03). On a CPU they run in
# Triton's interpreter, seconds per MoE layer, so here they run on one layer of the small MoE
# (width 32, 4 experts, top-2), against the PyTorch path: its QLoRA form from your
# `qlora_moe` with random adapters, the same layer with its float experts, and one attention
# projection's NF4 weight. The list printed comes from the calls counted while the block ran.
# On a GPU, set every `MoEMLP.backend = "triton"` before `qlora_moe` and Part C trains on your
# Lab 03 and Lab 10 kernels end to end (QLoRA has no expert layer without LoRA).

# %%
KERNEL_LABS = ("03", "08", "09", "10")


def layer_grads(mlp, h, backend):
    """(output, dL/dh, dL/d every trainable parameter) of one MoEMLP on hidden states h."""
    for m in (mlp, *(getattr(mlp, p) for p in EXPERT_PROJECTIONS)):
        if isinstance(m, nn.Module):      # float experts are parameters, with no backend
            m.backend = backend
    h = h.detach().clone().requires_grad_(True)
    out = mlp.eval()(h)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in mlp.parameters() if p.requires_grad]
    mlp.zero_grad()
    return [out.detach(), h.grad, *grads]


def largest_gap(got, want):
    """The largest relative difference over two lists of tensors."""
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True))


if not triton_installed():        # macOS, Windows: no triton wheel; the PyTorch path above ran
    print(f"Part F skipped: {TRITON_MISSING}")
else:
    tiny, tiny_float = small_moe(seed=1), small_moe(seed=1)        # the same base weights
    qlora_moe(tiny, r=4, alpha=8.0, blocksize=32)
    randomize_lora(tiny, seed=2, std=0.2)
    h_tiny = torch.randn(2, 5, tiny.config.n_embd, generator=torch.Generator().manual_seed(3))
    q_attn = tiny.blocks[0].attn.q_proj.base.weight_nf4               # [32, 32] NF4
    checks = ("QLoRA layer (NF4 experts + LoRA): output, dX, LoRA gradients",
              "float layer (no LoRA): output, dX, expert and router gradients",
              "NF4 dequantization of blocks.0.attn.q_proj")
    want = [layer_grads(tiny.blocks[0].mlp, h_tiny, "torch"),
            layer_grads(tiny_float.blocks[0].mlp, h_tiny, "torch"), [dequantize_nf4(q_attn)]]
    with use("mine", quiet=True) as kernel_choices:
        got = [layer_grads(tiny.blocks[0].mlp, h_tiny, "triton"),
               layer_grads(tiny_float.blocks[0].mlp, h_tiny, "triton"),
               [miniquant.triton_dequantize_nf4(q_attn)]]
    gaps = [largest_gap(g, w) for g, w in zip(got, want, strict=True)]
    print("largest relative difference of the Triton path to the PyTorch path:")
    for what, gap in zip(checks, gaps, strict=True):
        print(f"  {what}: {gap:.1e}")
    calls, trained = ran(kernel_choices), ran(choices)          # {piece: calls}: here, Part C
    kernels = [c.piece for c in kernel_choices if c.yours and c.lab.startswith(KERNEL_LABS)]
    print("kernels of yours on the Triton path (calls): " + (", ".join(
        f"{p} {calls[p]}" if calls[p] else f"{p} loaded, never called" for p in kernels)
        or "none yet (the reference kernels ran)"))
    never = [p for p, n in calls.items() if n == 0 and not trained.get(p)]
    print(f"pieces of yours never called in this notebook: {', '.join(never) or 'none'}")
    assert max(gaps) < 1e-4, "the Triton path disagrees with the PyTorch path"

# %% [markdown]
# ## Part G — Your adapter, out of the course
#
# `save_adapter` writes your model's adapters as Hugging Face PEFT does: attention LoRA under
# `target_modules`; each expert projection under `target_parameters`, PEFT's form for a
# stacked `[E, ·, ·]` weight. PEFT keeps expert e's rows of A where you do (`e·r:(e+1)·r`) but
# orders B's columns expert-fastest (`j·E + e`), and nests the three projections of one
# `MoEMLP` as `…mlp.base_layer.base_layer.lora_A.weight` (w_gate), `…mlp.base_layer.…` (w_up),
# `…mlp.lora_A.weight` (w_down); the saver converts. `python -m minituner.lora_norms DIR`
# reads any such folder (yours, or one PEFT wrote) and prints ‖s·B·A‖_F per module and per
# expert from two r×r products, never building B·A. The cell saves your trained adapter,
# reads it back, and compares with your `expert_lora_norms` (Part B) of the same model.

# %% tags=["jupyter-only"]
adapter_dir = Path(tempfile.mkdtemp(prefix="capstone-adapter-"))
save_adapter(mine_model, adapter_dir)
saved_config = json.loads((adapter_dir / "adapter_config.json").read_text())
print("saved to", adapter_dir)
print("target_modules:", saved_config["target_modules"],
      "| target_parameters:", saved_config["target_parameters"])
saved_norms = {t.name: t.experts for t in adapter_norms(adapter_dir)}
yours = expert_lora_norms(mine_model)      # now: Part E's bill took one AdamW step on it
gap = max(abs(a - b) for name, v in yours.items()
          for a, b in zip(v, saved_norms[name], strict=True))
print(f"largest difference between your expert_lora_norms and the saved file's: {gap:.1e}")
assert gap < 1e-4, "the saved adapter's norms disagree with expert_lora_norms"
print(norms_table(adapter_norms(adapter_dir), top=6))

# %% [markdown]
# ## Where this ends
#
# You have composed QLoRA on a Mixture-of-Experts from your own parts: NF4 codes (Lab 02)
# dequantized per active expert (Labs 03 and 10), LoRA on attention (Lab 04) and on each
# expert (Lab 10), the routed forward and backward (Labs 07–09), trained it against the
# reference and read which experts learned. `experiments/11-qlora-moe` runs the long version
# (and a reward-weighted run on the model's own samples) and writes `REPORT.md`: compare its
# curves, routing and norms with your forty steps; it saves every run's adapter as Part G
# did (`adapter_qlora_moe/`), and `python -m minituner.lora_norms
# experiments/11-qlora-moe/adapter_qlora_moe --grid` prints its report's tables from that file.
#
# ### Reflection
#
# 1. The router is frozen, yet the routing share can move during fine-tuning. Where does
#    that change come from, and what would `train_router=True` add — and risk?
# 2. Compare `learned` with the `rev` share in Part D. What does an expert that never
#    receives a `rev` token learn, and what does the correlation tell you about where the
#    adapter's capacity went?
# 3. Your run and the reference's agree to within `CURVE_TOL` but not bit for bit (or do
#    they?). Name two places in your pieces where the order of float operations can differ
#    from the reference's, and why forty steps of AdamW amplify such differences.
# 4. Mixtral-8x7B holds all eight experts although a token uses two. What does QLoRA save on
#    its weights, and why does top-2 routing not reduce the weights you must hold?
# 5. Part E measured your model's bill beside the reference's. If they differ, which part
#    differs and which line of your code holds the extra bytes? If they agree, what would a
#    LoRA Function that saves `W` for its backward cost at Qwen3-30B-A3B's size?
# 6. Part G's file stores B's columns expert-fastest (`j·E + e`) where your model blocks them
#    by expert (`e·r + j`). Which layout lets a kernel read one expert's B as one contiguous
#    slice, and why can the file use the other without costing a kernel anything?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. The router's weights do not move, but its *input* does: the router reads the residual
#    stream after the attention sublayer, and the attention LoRA (and, from block 1 on, every
#    earlier block's expert LoRA) changes that stream, so the same frozen router makes other
#    top-k choices. `train_router=True` would let routing follow the task (send `rev` tokens
#    to the experts that learn it best), but a moving router hands tokens to experts whose
#    adapters never saw them, can collapse onto a few experts without a balancing loss, and
#    undoes the pretrained load balance other tasks rely on.
# 2. An expert with no `rev` tokens gets exactly zero LoRA gradient, so its B stays at zero
#    (weight decay on a zero B keeps it there): its ‖ΔW_e‖ is 0 and it forgets nothing. A
#    strongly positive correlation says the capacity went where the frozen router sends the
#    traffic: the adapters of the heavily used experts carry the new task. A weak correlation
#    in a layer points to the attention LoRA upstream having changed that layer's routing
#    during training (Part D measures the share after training).
# 3. Candidates: the LoRA backward (`dy @ W + s·(dy·B)·A` summed in another order, or `s`
#    applied before or after the product), the dequantization (multiplying code by absmax in
#    float32 then casting, or scaling in another dtype), the sum over a token's k experts, and
#    accumulation order inside a kernel. AdamW normalizes each update by the running second
#    moment, so a last-bit difference in a tiny gradient becomes a full-size difference in the
#    step, and each step's weights feed the next step's gradients: differences grow roughly
#    with the learning rate times the number of steps until the losses differ at the 1e-3 level.
# 4. QLoRA stores each base weight in about 4.1–4.5 bits instead of 16, so the frozen experts,
#    which are most of Mixtral's 46.7 B parameters, shrink about 3.6–3.9×; the adapters and
#    their Adam state are small either way. Top-2 routing reduces the *compute* per token, not
#    what must be resident: any token may be routed to any expert, so all eight must be in
#    memory for every step.
# 5. With the solution's pieces the bills agree to the byte: the same buffers, the same
#    factors, and the LoRA Function saves x, x·Aᵀ, A, B and W — where W is a view of a tensor the
#    reference also builds. A Function that saves its own dequantized float copy of W holds
#    K·N·4 bytes per attention projection until the backward; at Qwen3-30B-A3B's size (48
#    layers, four attention projections each) that is several GB of float32 weights for one
#    step, on top of a 4-bit base whose whole point was not to hold them.
# 6. Blocked by expert (`e·r + j`, the model's layout): expert e's B is the contiguous column
#    slice `e·r:(e+1)·r`, so the fused kernel reads the columns of the expert a tile belongs to
#    as one block, and the compact path (`index_select` of the active experts) gathers whole
#    slices. The file is read once at load time: `from_peft_B` is one reshape–transpose of a
#    `[out, r·E]` tensor, a permutation that costs one copy of the (small) factor and nothing
#    per step. PEFT's expert-fastest order suits its own einsum, which folds all experts into
#    one delta weight; either order holds the same numbers.
