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
# # Lab 11 — Capstone: QLoRA on a Mixture-of-Experts model
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
# Then the course's last two ingredients: **reward-weighted SFT** (each example's loss weighted
# by a normalized reward) and the **memory bill** of the whole thing, measured at MiniGPT-MoE
# scale and predicted for Mixtral-8x7B and Qwen3-30B-A3B.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `qlora_moe(model, r, alpha, blocksize)`: NF4 + LoRA on attention and on every expert | `minituner.qlora.wrap_minigpt_qlora`: structure, buffers, trainable set, logits |
# | 2 | `expert_lora_norms(model)`: ‖s·B_e·A_e‖_F per expert | a naive loop; exactly 0 for an expert whose B is zero |
# | 3 | `reward_weighted_batch_loss(logits, targets, mask, rewards)` | `minituner.reward_weights` + `sequence_loss`, value and gradient |
# | 4 | `memory_bill(model, optimizer, x)`: weights, grads, optimizer state, activations | `minituner.memory.held_bytes` + `saved_activation_bytes` |
#
# Experiment 11 (`experiments/11-qlora-moe`) is the long version of this lab: 150 steps of
# QLoRA on the MoE against LoRA on the float MoE and dense QLoRA, a reward-weighted run on the
# model's own sampled answers, routing and LoRA norms per expert, the memory table and the
# extrapolation, with a manifest to reproduce it. Here every step is kept small.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification. You
# may use the course packages except the function each exercise rebuilds; the tests switch that
# one off while your code runs. The MoE layers run on their PyTorch backend (`backend="torch"`):
# on a CPU the Triton kernels would run in the interpreter, far too slowly. No GPU is needed;
# the notebook runs in about a minute.

# %%
import logging
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

# miniquant imports bitsandbytes, which logs a warning about an optional CPU kernel package.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import minigpt  # noqa: E402
import minituner  # noqa: E402
import minituner.data  # noqa: E402
import minituner.qlora  # noqa: E402
import minituner.trainer  # noqa: E402
from labkit.course.harness import forbid, pairs_of, randomize_lora  # noqa: E402
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks  # noqa: E402
from minigpt.generate import greedy_generate  # noqa: E402
from minimoe import MoEMLP, NF4Experts, attach_expert_lora  # noqa: E402
from minimoe.experts import ExpertLinear  # noqa: E402
from miniquant import quantize_model  # noqa: E402
from minituner import (  # noqa: E402
    LoRALinear,
    SequenceData,
    TrainConfig,
    memory,
    reward_weights,
    sequence_loss,
    train,
    wrap_lora,
)
from minituner.activations import saved_activation_bytes  # noqa: E402
from minituner.qlora import wrap_minigpt_qlora  # noqa: E402

torch.set_num_threads(1)   # small matrices: one thread is faster than several on a busy CPU
torch.manual_seed(0)
print("torch", torch.__version__, "| threads:", torch.get_num_threads())

MiB, GiB = 2**20, 2**30
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


def task_batch(task=HELD_OUT, n=8, seed=0, split="train"):
    """(x, y, mask) [n, L] of one task: inputs, next-token targets, answer mask."""
    data = SequenceData.from_pairs(pairs_of(tasks.make_examples(task, n, seed, split), tok),
                                   pad_id=tok.pad_id)
    return data.batch(torch.arange(n))


base = load_moe()
print(base.config)
print(base.blocks[0].mlp)
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
_NO_REFERENCE_WRAP = [minituner.qlora.wrap_minigpt_qlora]


def _structure(model):
    return [(n, type(m).__name__) for n, m in model.named_modules()]


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
    mine, ref = make(), make()
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
        f"{where}: expected the buffers {sorted(ref_buffers)[:3]} ..., got " \
        f"{sorted(mine_buffers)[:3]} ..."
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
    randomize_lora(mine, seed=r)
    randomize_lora(ref, seed=r)
    with torch.no_grad():
        got, want = mine(x), ref.eval()(x)
    assert torch.equal(got, want), \
        f"{where}: with the same LoRA factors your logits differ from the reference's " \
        f"(max difference {(got - want).abs().max().item():.3g})"
    return mine


_q = _check_qlora_moe(load_moe)
print(f"qlora_moe: same tree, NF4 buffers, trainable set ({_expected_trainable(base.config, 8):,} "
      f"LoRA elements) and logits as wrap_minigpt_qlora; a fresh adapter computes the NF4 base")

### BEGIN HIDDEN TESTS
_check_qlora_moe(small_moe, r=4, alpha=8.0, blocksize=32, what="hidden: ")
_check_qlora_moe(lambda: small_moe(seed=3), r=2, alpha=4.0, blocksize=64, what="hidden: ")
for _bad in (_q, small_moe()):
    if _bad is not _q:
        attach_expert_lora(_bad.blocks[1].mlp, r=2, nf4=False)   # experts wrapped, attn not
    _before = _structure(_bad)
    try:
        with forbid(_NO_REFERENCE_WRAP, globals()):
            qlora_moe(_bad)
    except ValueError:
        pass
    else:
        raise AssertionError("hidden: qlora_moe should raise ValueError on a model that "
                             "already holds adapters")
    assert _structure(_bad) == _before, "hidden: after refusing, the model must be as it was"
### END HIDDEN TESTS

# %% [markdown]
# What did that buy? Count the bytes held by the weights of the plain MoE, of LoRA over the
# float MoE (`quantize=False`, the baseline of experiment 11) and of your QLoRA model.

# %%
qlora = load_moe()
qlora_moe(qlora, r=8, alpha=16.0)
float_lora = load_moe()
wrap_minigpt_qlora(float_lora, r=8, alpha=16.0, quantize=False)
for label, model in (("plain float MoE", base), ("LoRA, float base", float_lora),
                     ("QLoRA, NF4 base", qlora)):
    w = memory.held_bytes(model).weights
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{label:<17} weights held {w / MiB:5.2f} MiB | trainable {n_train:>9,}")
share = sum(p.numel() for n, p in qlora.named_parameters() if p.requires_grad and ".mlp." in n)
print(f"expert LoRA is {share / sum(p.numel() for p in qlora.parameters() if p.requires_grad):.0%}"
      f" of the trainable elements: every expert has its own r = 8 factors")

# %% [markdown]
# ## Part B — Exercise 2: how much has each expert's adapter moved?
#
# An expert that receives no tokens gets exactly-zero LoRA gradients; one that receives many
# learns the most. The size of expert `e`'s update is the Frobenius norm of
# $\Delta W_e = s\,B_eA_e$, with $A_e$ = `lora_A[e·r:(e+1)·r]` `[r, K]` and $B_e$ =
# `lora_B[:, e·r:(e+1)·r]` `[N, r]` — computed without a Python loop over experts if you can
# (reshape `A` to `[E, r, K]` and `B` to `[N, E, r]`, then one batched product).
#
# Write `expert_lora_norms(model) -> dict[str, list[float]]`: for every expert module with
# LoRA (`NF4Experts` or the float `ExpertLinear`, found by `lora_A` and `n_experts`), its full
# name -> `E` Python floats ‖s·B_e·A_e‖_F. Attention `LoRALinear`s are not included; a module
# whose `lora_A` is `None` (r = 0) is skipped. No gradients are needed.

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
        assert ok, f"{what}: {name}: expected {[round(v, 5) for v in values]}, got " \
                   f"{[round(v, 5) for v in got[name]]}"
    return got


_m = load_moe()
wrap_minigpt_qlora(_m)             # the reference's model: this test grades the norms alone
_fresh = _check_norms(_m, "a fresh adapter")
assert all(v == 0.0 for vs in _fresh.values() for v in vs), \
    f"a fresh adapter has B = 0, so every norm should be 0.0; got {_fresh}"
randomize_lora(_m, seed=3)
_check_norms(_m, "random factors")
_w = _m.blocks[2].mlp.w_up
with torch.no_grad():
    for _e in (1, 5):
        _w.lora_B[:, _e * _w.r:(_e + 1) * _w.r] = 0.0
_got = expert_lora_norms(_m)["blocks.2.mlp.w_up"]
assert _got[1] == 0.0 and _got[5] == 0.0 and min(_got[0], _got[2]) > 0, \
    f"after zeroing experts 1 and 5's B in blocks.2.mlp.w_up, expected exactly 0.0 for them " \
    f"and > 0 for the others; got {[round(v, 4) for v in _got]}"
print("expert_lora_norms: matches the per-expert loop; zero B reads exactly 0.0")

### BEGIN HIDDEN TESTS
_f = small_moe(seed=1)
wrap_minigpt_qlora(_f, r=4, alpha=8.0, quantize=False)     # float ExpertLinear, another rank
randomize_lora(_f, seed=7)
_check_norms(_f, "hidden: float experts, r=4")
_f2 = small_moe(seed=2)
for _mm in _f2.modules():
    if isinstance(_mm, MoEMLP):
        attach_expert_lora(_mm, r=0, nf4=True, blocksize=32)
assert expert_lora_norms(_f2) == {}, "hidden: experts without LoRA (r=0) should be skipped"
_f3 = small_moe(seed=2)
attach_expert_lora(_f3.blocks[0].mlp, r=3, alpha=5.0, nf4=True, blocksize=32)
randomize_lora(_f3, seed=9, std=0.5)
_ = _check_norms(_f3, "hidden: one MoE layer wrapped, r=3, alpha=5")
### END HIDDEN TESTS

# %% [markdown]
# ## Part C — Exercise 3: reward-weighted SFT
#
# Plain SFT copies every example equally. With a reward per example (here: how right the
# model's own sampled answer was), **reward-weighted SFT** weights each example's loss:
#
# * weights from rewards $\rho_i$: shift so the smallest is 0, divide by the mean,
#   $w_i = (\rho_i - \min\rho) / \overline{(\rho - \min\rho)}$ — non-negative with mean 1, so
#   the learning rate keeps its meaning; if all rewards are equal (nothing to prefer), every
#   weight is 1;
# * each example's loss is its **masked token mean** of cross-entropy (answer tokens only; a
#   long answer does not count more than a short one);
# * the batch loss is $\frac1b\sum_i w_i\,\ell_i$ (divided by $b$, not by $\sum w_i$: a batch
#   of zero-weight examples contributes 0, not 0/0).
#
# Write `reward_weighted_batch_loss(logits [b, l, V], targets [b, l] int64, mask [b, l] bool,
# rewards [b]) -> 0-d tensor`, differentiable in `logits`, computed in float32 whatever the
# logits' dtype. Rules for awkward inputs: a row with no masked token has loss 0 (it still
# counts in $b$); `rewards` of another length than $b$, or holding a NaN or an infinity, raise
# `ValueError` naming the problem. Off-limits: `minituner.reward_weights`,
# `minituner.sequence_loss` and `SequenceData.with_rewards`.

# %% nbgrader={"grade": false, "grade_id": "reward_weighted_batch_loss", "locked": false, "schema_version": 3, "solution": true, "task": false}
def reward_weighted_batch_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                               rewards) -> torch.Tensor:
    """Σ_i w_i · (masked mean CE of row i) / b, with w the normalized rewards."""
    ### BEGIN SOLUTION
    b, l, V = logits.shape
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() != b:
        raise ValueError(f"rewards has {r.numel()} values for a batch of {b} examples")
    if not torch.isfinite(r).all():
        raise ValueError(f"every reward must be finite, got {r.tolist()}")
    shifted = r - r.min()                                     # float64: equal rewards -> 0
    w = torch.ones(b) if not shifted.any() else (shifted / shifted.mean()).float()   # [b]
    ce = F.cross_entropy(logits.reshape(b * l, V).float(), targets.reshape(-1),
                         reduction="none").view(b, l)         # [b, l]
    m = mask.float()
    per_example = (ce * m).sum(1) / m.sum(1).clamp(min=1.0)   # [b]; 0 for an empty row
    return (w.to(per_example.device) * per_example).mean()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_reward_weighted_batch_loss", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
_NO_REWARD_REFS = [minituner.reward_weights, minituner.trainer.sequence_loss,
                   SequenceData.with_rewards]


def _reference_loss(logits, targets, mask, rewards):
    """minituner's arithmetic: its weights and its sequence_loss on a model that returns logits."""
    return sequence_loss(lambda _x: logits, targets, targets, mask,
                         weights=reward_weights(rewards))


def _check_loss(logits, targets, mask, rewards, what):
    mine_logits = logits.detach().clone().requires_grad_(True)
    ref_logits = logits.detach().clone().requires_grad_(True)
    with forbid(_NO_REWARD_REFS, globals()):
        got = reward_weighted_batch_loss(mine_logits, targets, mask, rewards)
    want = _reference_loss(ref_logits, targets, mask, rewards)
    assert isinstance(got, torch.Tensor) and got.dim() == 0, \
        f"{what}: expected a 0-d tensor, got {type(got).__name__} " \
        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else ''}"
    assert got.dtype == torch.float32, f"{what}: expected a float32 loss, got {got.dtype}"
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), \
        f"{what}: expected loss {want.item():.6f}, got {got.item():.6f} " \
        f"(weights should be {reward_weights(rewards).tolist()})"
    got.backward()
    want.backward()
    assert mine_logits.grad is not None, f"{what}: the loss should be differentiable in logits"
    assert torch.allclose(mine_logits.grad, ref_logits.grad, rtol=1e-4, atol=1e-7), \
        f"{what}: the gradient in logits differs; max difference " \
        f"{(mine_logits.grad - ref_logits.grad).abs().max().item():.3g}"


def _random_batch(b, l, V=11, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, l, V, generator=g) * 2).to(dtype)
    targets = torch.randint(0, V, (b, l), generator=g)
    mask = torch.rand(b, l, generator=g) < 0.6
    mask[:, 0] = True
    return logits, targets, mask


_check_loss(*_random_batch(4, 7), [1.0, 0.25, -0.5, 0.25], "rewards [1, 0.25, -0.5, 0.25]")
_check_loss(*_random_batch(3, 5, seed=1), [2.0, 2.0, 2.0], "all-equal rewards")
_x, _y, _mask = task_batch(HELD_OUT, n=4)
with torch.no_grad():
    _logits = base(_x)
_check_loss(_logits, _y, _mask, [0.0, 1.0, 0.5, 0.1], "the MoE's logits on rev")
print("reward_weighted_batch_loss: equals reward_weights + sequence_loss, value and gradient")

### BEGIN HIDDEN TESTS
_check_loss(*_random_batch(1, 6, seed=2), [0.3], "hidden: one example")
_l, _t, _mk = _random_batch(4, 6, seed=3)
_mk[2] = False
_check_loss(_l, _t, _mk, [0.5, 1.0, 3.0, -2.0], "hidden: a fully masked row")
_check_loss(*_random_batch(5, 4, seed=4), torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]),
            "hidden: one non-zero reward (a tensor)")
_check_loss(*_random_batch(3, 4, seed=5, dtype=torch.bfloat16), [1.0, 2.0, 4.0],
            "hidden: bfloat16 logits")
_check_loss(*_random_batch(2, 3, seed=6), [-1e3, -1e3], "hidden: equal negative rewards")
for _bad, _why in (([1.0, 2.0], "two rewards for three examples"),
                   ([1.0, float("nan"), 0.0], "a NaN reward"),
                   ([1.0, float("inf"), 0.0], "an infinite reward")):
    try:
        with forbid(_NO_REWARD_REFS, globals()):
            reward_weighted_batch_loss(*_random_batch(3, 4, seed=7), _bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"hidden: {_why} should raise ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ## Part D — Exercise 4: the memory bill, counted
#
# What does training the QLoRA MoE hold? Four parts: **weights** (parameters and buffers: NF4
# codes and scales, float embeddings, norms, routers, head, LoRA factors), **gradients** (only
# the factors have them), **optimizer state** (AdamW: two moments and a step counter per
# factor tensor, created at the first `step()`), and **activations** (what autograd saves
# between forward and backward).
#
# Write `memory_bill(model, optimizer, x) -> dict` with int values for `weights`, `grads`,
# `optimizer`, `activations` and `total` (their sum):
#
# * count **storage**, not tensors: `t.untyped_storage().nbytes()`, each storage once (by its
#   `data_ptr()`), across all three of weights, grads and optimizer state (a tied weight
#   counts once; a parameter that views part of a larger storage holds that whole storage);
# * `optimizer` is every tensor in `optimizer.state` (0 before the first step);
# * `activations` is `minituner.saved_activation_bytes(model, x)` (allowed: it is the
#   measurement tool, not the exercise).
#
# Off-limits: `minituner.memory.held_bytes`.

# %% nbgrader={"grade": false, "grade_id": "memory_bill", "locked": false, "schema_version": 3, "solution": true, "task": false}
def memory_bill(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor
                ) -> dict[str, int]:
    """Bytes held for weights, grads and optimizer state (storage once), and activations."""
    ### BEGIN SOLUTION
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    bill = {
        "weights": nbytes([*model.parameters(), *model.buffers()]),
        "grads": nbytes([p.grad for p in model.parameters() if p.grad is not None]),
        "optimizer": nbytes([t for state in optimizer.state.values() for t in state.values()
                             if isinstance(t, torch.Tensor)]),
        "activations": int(saved_activation_bytes(model, x)),
    }
    bill["total"] = sum(bill.values())
    return bill
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_memory_bill", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
_NO_HELD = [memory.held_bytes]
KEYS = ("weights", "grads", "optimizer", "activations", "total")


def _bill(model, optimizer, x):
    with forbid(_NO_HELD, globals()):
        got = memory_bill(model, optimizer, x)
    assert isinstance(got, dict) and all(k in got for k in KEYS), \
        f"memory_bill should return a dict with the keys {KEYS}, got " \
        f"{sorted(got) if isinstance(got, dict) else type(got).__name__}"
    assert all(type(got[k]) is int for k in KEYS), \
        f"every value should be a Python int, got {({k: type(got[k]).__name__ for k in KEYS})}"
    return got


def _check_bill(model, optimizer, x, what):
    got = _bill(model, optimizer, x)
    held = memory.held_bytes(model, optimizer)
    want = {"weights": held.weights, "grads": held.grads, "optimizer": held.optimizer,
            "activations": saved_activation_bytes(model, x)}
    want["total"] = sum(want.values())
    wrong = {k: (want[k], got[k]) for k in KEYS if got[k] != want[k]}
    assert not wrong, f"{what}: (expected, got) bytes: {wrong}"
    return got


def _one_step(model, x, y, optimizer):
    model.train()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


_mm = load_moe()
wrap_minigpt_qlora(_mm)            # the reference's QLoRA MoE: this test grades the bill alone
_opt = torch.optim.AdamW([p for p in _mm.parameters() if p.requires_grad], lr=1e-3)
_x, _y, _ = task_batch(HELD_OUT, n=4)
_b0 = _bill(_mm, _opt, _x)
assert _b0["optimizer"] == 0 and _b0["grads"] == 0, \
    f"before the first step AdamW holds no state and nothing has a .grad: expected optimizer = " \
    f"0 and grads = 0, got optimizer = {_b0['optimizer']}, grads = {_b0['grads']}"
_one_step(_mm, _x, _y, _opt)
_b1 = _check_bill(_mm, _opt, _x, "the QLoRA MoE after one AdamW step")
_n = sum(p.numel() for p in _mm.parameters() if p.requires_grad)
print(f"memory_bill after one step: { {k: f'{v / MiB:.2f} MiB' for k, v in _b1.items()} } "
      f"| grads = 4 bytes x {_n:,} factors: {_b1['grads'] == 4 * _n}")

### BEGIN HIDDEN TESTS
# a tied weight (counted once) and a parameter viewing part of a larger storage
_tied = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
_tied[1].weight = _tied[0].weight
_big = torch.zeros(40, 8)
_tied.register_parameter("part", nn.Parameter(_big[:5]))
_sgd = torch.optim.SGD(_tied.parameters(), lr=0.1, momentum=0.9)
_ids = torch.tensor([[1, 2, 3]])
_sgd.zero_grad()
(_tied(_ids).sum() + _tied.part.sum()).backward()
_sgd.step()
_got = _check_bill(_tied, _sgd, _ids, "hidden: tied weights, a sliced storage, SGD momentum")
assert _got["weights"] == 10 * 8 * 4 + 40 * 8 * 4, \
    f"hidden: expected weights 320 (the tied [10, 8] once) + 1280 (the [40, 8] storage of " \
    f"the slice), got {_got['weights']}"
# the float LoRA MoE after two steps
_fl = small_moe(seed=4)
wrap_minigpt_qlora(_fl, r=4, alpha=8.0, quantize=False)
_o = torch.optim.AdamW([p for p in _fl.parameters() if p.requires_grad])
_xs = torch.randint(0, _fl.config.vocab_size, (2, 8))
for _ in range(2):
    _one_step(_fl, _xs, _xs, _o)
_ = _check_bill(_fl, _o, _xs, "hidden: float LoRA on a small MoE after two steps")
### END HIDDEN TESTS

# %% [markdown]
# ### The bill, measured and predicted
#
# Three regimes on the same batch of 8 `rev` examples, one AdamW step each: full fine-tuning
# of the float MoE, LoRA on the float MoE, and your QLoRA. Beside each, what
# `minituner.memory.predict_training` says from the shape and the token count alone. Its
# activations include the loss (the logits' softmax and the target ids), which
# `memory_bill`'s plain forward does not run, so they read a little above the measurement.

# %%
def build(regime):
    model = load_moe()
    if regime == "lora":
        wrap_minigpt_qlora(model, r=8, alpha=16.0, quantize=False)
    elif regime == "qlora":
        qlora_moe(model, r=8, alpha=16.0)
    return model


xb, yb, _ = task_batch(HELD_OUT, n=8)
shape = memory.TransformerShape.of(base.config)
PARTS = ("weights", "grads", "optimizer", "activations")
bills = {}
print(f"{'regime':<7}" + "".join(f"{p:>13}" for p in PARTS) + f"{'w+g+o':>8}"
      + f"{'predicted':>11}{'pred. act.':>12}   (MiB)")
for regime in memory.REGIMES:
    model = build(regime)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    _one_step(model, xb, yb, opt)
    bills[regime] = memory_bill(model, opt, xb)
    pred = memory.predict_training(shape, regime, tokens=xb.numel(), r=8)
    held_wgo = sum(bills[regime][p] for p in PARTS[:3])
    print(f"{regime:<7}" + "".join(f"{bills[regime][p] / MiB:13.2f}" for p in PARTS)
          + f"{held_wgo / MiB:8.2f}{(pred.weights + pred.grads + pred.optimizer) / MiB:11.2f}"
          + f"{pred.activations / MiB:12.2f}")
    del model, opt
model = build("qlora").train()
off = saved_activation_bytes(model, xb)
model.set_gradient_checkpointing(1)
print(f"QLoRA activations with gradient checkpointing (1 block per segment): "
      f"{off / MiB:.2f} -> {saved_activation_bytes(model, xb) / MiB:.2f} MiB")

fig, ax = plt.subplots(figsize=(7, 2.4))
for i, bill in enumerate(bills.values()):
    left = 0.0
    for j, part in enumerate(PARTS):
        ax.barh(i, bill[part] / MiB, left=left, color=f"C{j}", label=part if i == 0 else None)
        left += bill[part] / MiB
ax.set_yticks(range(len(bills)), ["full", "LoRA (float MoE)", "QLoRA (NF4 MoE)"])
ax.set_xlabel("MiB held (measured, 8 sequences)")
ax.set_title("MiniGPT-MoE: one training step")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()
plt.show()

# %% [markdown]
# Three things to read in that table. Weights, gradients and Adam state agree with the
# predictor to the byte or nearly (the AdamW step counters are the difference). The
# activations agree too, once you allow for the loss the prediction includes. And QLoRA's
# activations are *below* LoRA's, although its experts must be dequantized to run: the
# package's NF4 experts checkpoint each expert linear, so the compact `[n_active, K, N]` float
# copy (here 3 × 4 layers × 8 experts × 128 × 128 × 4 bytes ≈ 6.3 MiB) is not kept for the
# backward but dequantized again there — what bitsandbytes does for a dense 4-bit layer. The
# same checkpoint also drops the gathered inputs and x·Aᵀ that LoRA on float experts keeps.
# Gradient checkpointing of whole blocks cuts what is left, at the price of recomputing every
# block once in the backward.
#
# At this size the activations and the float embeddings, norms and head are much of the
# bill. The predictor is what tells us about real MoEs: the expert weights dominate, every
# expert (not just the two a token uses) must be held, and that is where NF4 pays. Weights,
# gradients and AdamW state from the shape alone, base in bfloat16:

# %%
print(f"{'model':<15}{'regime':<7}{'weights':>11}{'grads':>9}{'Adam':>9}{'total':>10}  (GiB)")
for label, s in (("Mixtral-8x7B", memory.MIXTRAL_8X7B), ("Qwen3-30B-A3B", memory.QWEN3_30B_A3B)):
    for regime in memory.REGIMES:
        p = memory.predict_training(s, regime, tokens=0, r=8, weight_bits=16)
        print(f"{label:<15}{regime:<7}{p.weights / GiB:11.1f}{p.grads / GiB:9.2f}"
              f"{p.optimizer / GiB:9.2f}{p.total / GiB:10.1f}")
paper = memory.predict_training(memory.LLAMA_65B, "qlora", tokens=512, r=64, weight_bits=16,
                                lora_bits=16, checkpointing=True)
print(f"LLaMA-65B, the QLoRA paper's setting (r=64, 512 tokens, checkpointing): "
      f"{paper.total / GiB:.1f} GiB — it fit on one 48 GB GPU")

# %% [markdown]
# ## Part E — A short reward-weighted QLoRA run (not graded)
#
# The model samples its own answers to `rev` prompts (temperature 1); each gets a reward —
# 1.0 for an exact match, otherwise half the fraction of right positions — and the gold
# answers join with reward 1.0. `SequenceData.from_pairs(..., rewards=)` turns the rewards into
# the weights your Exercise 3 computes, and `minituner.train` uses your loss's arithmetic.
# Twenty steps of batch 8, with element-wise gradient clipping (`grad_clip_value`) and
# gradient checkpointing (`checkpoint_every=1`), as experiment 11 trains for 150 steps.

# %%
def routing_share(model, n=16):
    """Per task: share of top-k slots sent to each expert, summed over layers [E]."""
    moes = [m for m in model.modules() if isinstance(m, MoEMLP)]
    out = {}
    with torch.no_grad():
        for t in tasks.TASKS:
            x = SequenceData.from_pairs(pairs_of(tasks.make_examples(t, n, 0, "eval"), tok),
                                        pad_id=tok.pad_id).tokens
            model.eval()(x)
            counts = sum(torch.bincount(m.last_experts.reshape(-1), minlength=m.n_experts)
                         for m in moes).float()
            out[t] = counts / counts.sum()
    return torch.stack([out[t] for t in tasks.TASKS])        # [tasks, E]


student = build("qlora")
before = routing_share(student)
train_pairs = pairs_of(tasks.make_examples(HELD_OUT, 24, 0, "train"), tok)
gen = torch.Generator().manual_seed(7)
sampled = greedy_generate(student, [p for p, _ in train_pairs], 10, tok.eos_id,
                          temperature=1.0, generator=gen)
rewards, pairs = [], []
for (prompt, gold), out in zip(train_pairs, sampled, strict=True):
    gold = gold[:-1]
    hits = sum(a == b for a, b in zip(out, gold, strict=False))
    rewards += [1.0 if out == gold else 0.5 * hits / max(len(gold), len(out), 1), 1.0]
    pairs += [(prompt, out + [tok.eos_id]), (prompt, gold + [tok.eos_id])]
data = SequenceData.from_pairs(pairs, pad_id=tok.pad_id, rewards=rewards)
xw, yw, mw = data.batch(torch.arange(8))
with torch.no_grad():
    mine = reward_weighted_batch_loss(student(xw), yw, mw, rewards[:8])
    theirs = sequence_loss(student, xw, yw, mw, weights=reward_weights(rewards[:8]))
print(f"mean sampled reward {sum(rewards[::2]) / len(rewards[::2]):.2f} | "
      f"your loss {mine.item():.4f} vs the trainer's {theirs.item():.4f} on one batch")

t0 = time.perf_counter()
result = train(student, data, TrainConfig(steps=20, batch_size=8, lr=3e-3, warmup_steps=2,
                                           log_every=1, grad_clip_value=1.0, checkpoint_every=1,
                                           aux_loss_coef=0.0, progress=False))
print(f"20 steps in {time.perf_counter() - t0:.1f} s | loss {result.losses[0]:.2f} -> "
      f"{result.final_loss:.2f} | NaN guard fired: {result.stopped_early is not None}")
after = routing_share(student)
norms = expert_lora_norms(student)
print("‖ΔW_e‖ of blocks.0.mlp.w_down:", [round(v, 3) for v in norms["blocks.0.mlp.w_down"]])

fig, axes = plt.subplots(1, 3, figsize=(12, 2.8))
axes[0].plot(range(1, len(result.losses) + 1), result.losses)
axes[0].set(xlabel="step", ylabel="reward-weighted loss", title="QLoRA-MoE on rev")
for ax, share, title in ((axes[1], before, "before"), (axes[2], after, "after")):
    im = ax.imshow(share, vmin=0, vmax=float(max(before.max(), after.max())), cmap="viridis")
    ax.set(title=f"routing share {title}", xlabel="expert")
    ax.set_yticks(range(len(tasks.TASKS)), list(tasks.TASKS))
fig.colorbar(im, ax=axes[1:], shrink=0.8)
plt.show()
print("largest routing change:", f"{(after - before).abs().max().item():.4f}",
      "(the routers are frozen: the adapters below each router change its input)")

# %% [markdown]
# ## Where this ends
#
# You have composed QLoRA on a Mixture-of-Experts from the course's parts: NF4 codes (Lab 02)
# dequantized per active expert (Labs 03 and 10), LoRA on attention (Lab 04) and on each
# expert (Lab 10), the routed forward (Labs 07–09), a reward-weighted loss, and the memory bill
# measured and predicted. `experiments/11-qlora-moe` runs the long version and writes
# `REPORT.md`: compare its curves, routing and norms with your twenty steps.
#
# ### Reflection
#
# 1. The router is frozen, yet the routing heatmap moved a little. Where does that change
#    come from, and what would `train_router=True` add — and risk?
# 2. Some experts' ‖ΔW_e‖ grow faster than others'. Relate that to the routing share on `rev`:
#    what does an expert that never receives a `rev` token learn?
# 3. Mixtral-8x7B holds all eight experts although a token uses two. What does QLoRA save on
#    its weights, and why does top-2 routing not reduce the weights you must hold?
# 4. Reward-weighted SFT with all rewards equal is plain SFT. What happens to the weights when
#    one sample has a very negative reward, and why is shifting by the minimum a choice worth
#    questioning?
# 5. QLoRA's experts dequantize twice per step (forward and backward) to keep no float copy,
#    and block checkpointing recomputes every block. What does each cost in time, and which
#    part of the bill dominates at Qwen3-30B-A3B's size?
