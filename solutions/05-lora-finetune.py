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
# # Lab 05 — LoRA fine-tuning: teach MiniGPT a new task without forgetting the old ones
#
# The pretrained MiniGPT of Lab 00 knows five tasks (`add`, `copy`, `sort`, `kv`, `count`) and
# has never seen the sixth, **`rev`** (reverse a word): asked `rev:usr=`, it does not answer
# `rsu`. In this lab you fine-tune it with the LoRA adapters of Lab 04 — the base frozen,
# rank-8 factors on every projection, 8.3 % of the parameters trainable — and you write, one
# piece at a time, the training loop that does it, checked step for step against the course's
# loop `minituner.train`:
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `normalize_rewards(rewards)`, `answer_loss(logits, y, mask, weights)`: the prompt-masked, reward-weighted loss | `minituner.reward_weights`, `minituner.trainer.sequence_loss`, a per-example loop |
# | 2 | `lr_schedule(step, cfg)` (warm-up + cosine), `clip_grads(params, max_value, max_norm)` | `minituner.trainer.lr_at`, `minituner.trainer.clip_gradients` |
# | 3 | `train_loop(model, data, cfg)`: AdamW on the trainable parameters, no decay on 1-D tensors | `minituner.train`, loss for loss and weight for weight |
# | 4 | `greedy_answers(model, prompts)`, `exact_match(model, examples)` | `minigpt.answers`, `minigpt.evaluate`, also with LoRA dropout on |
#
# Then you run the fine-tune twice — on `rev` alone, and on `rev` plus a small **replay** of
# the old tasks — and measure what each run learns and what it **forgets**. The full-length
# run (300 steps of 64, with a report and saved adapters) is experiment
# `experiments/05-lora-finetune`; the runs here are shorter (120 steps of 16).
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Each exercise states its **specification** first (inputs,
# outputs, the rules that matter, what is off-limits), which is enough to solve it; below it,
# folded **hints** go from the idea to pseudocode, for when you want them. Grading runs more
# (hidden) checks of the same specification — other shapes, weights, schedules and models,
# and checks that your code does not call the reference to do the work. No GPU is needed: the
# whole notebook runs in <!-- runtime:05-lora-finetune -->about 25 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

# minituner.qlora imports bitsandbytes, which logs a warning about an optional CPU kernel package.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import minigpt  # noqa: E402
import minirl  # noqa: E402
import minituner  # noqa: E402
import minituner.trainer  # noqa: E402
from course.notebook.harness import (  # noqa: E402
    forbid,
    pairs_of,
    randn,
    randomize_lora,
    reference,
)
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks  # noqa: E402
from minituner import SequenceData, TrainConfig  # noqa: E402
from minituner.data import BatchOrder  # noqa: E402
from minituner.qlora import BLOCK_LINEARS  # noqa: E402
from minituner.trainer import clip_gradients, lr_at, sequence_loss  # noqa: E402

torch.set_num_threads(1)   # small matrices: one thread is faster than several on a busy CPU
torch.manual_seed(0)
print("torch", torch.__version__, "| threads:", torch.get_num_threads())

tok = CharTokenizer()


def make_data(examples, rewards=None) -> SequenceData:
    """Padded training tensors for a list of tasks.Example (optionally reward-weighted)."""
    return SequenceData.from_pairs(pairs_of(examples, tok), pad_id=tok.pad_id, rewards=rewards)


SMALL = MiniGPTConfig(n_layer=1, n_head=2, n_embd=16, d_ff=32, block_size=24)


def small_gpt(seed=0) -> MiniGPT:
    """A tiny random MiniGPT (1 block, width 16): what the training-loop tests train."""
    torch.manual_seed(seed)
    return MiniGPT(SMALL)


def lora_base(seed=0, dropout=0.0) -> MiniGPT:
    """The pretrained dense MiniGPT with rank-8 LoRA on all seven projections of each block."""
    model = minigpt.load_base("dense")
    torch.manual_seed(seed)                       # lora_A is drawn at random
    minituner.wrap_lora(model, BLOCK_LINEARS, r=8, alpha=16.0, dropout=dropout)
    return model


# %% [markdown]
# ## Part A — The base model and the held-out task
#
# The base was pretrained (experiment 00) on every task but `rev`. Exact match — the greedy
# answer equals the expected one, character for character — on 100 prompts of each task's
# **eval split** (prompts that no training set contains, by a hash of their text):

# %%
base = minigpt.load_base("dense").eval()
EVAL_N = 100

# %% tags=["jupyter-only"]
before = {t: minigpt.evaluate(base, t, n=EVAL_N, seed=0) for t in tasks.TASKS}
print("exact match of the base model:", {t: round(v, 2) for t, v in before.items()})
demo = tasks.make_examples(tasks.HELD_OUT, 6, seed=0, split="eval")
for ex, got in zip(demo, minigpt.answers(base, [ex.prompt for ex in demo]), strict=True):
    print(f"  {ex.prompt:<12} expected {ex.answer!r:<9} the base says {got!r}")

# %%
model = lora_base()
trainable, total = minituner.trainable_summary(model)
print(f"LoRA r=8 on {BLOCK_LINEARS!r}: {trainable:,d} trainable of {total:,d} parameters "
      f"({trainable / total:.1%})")

# %% [markdown]
# ### What a batch looks like
#
# `minituner.SequenceData` holds the examples as right-padded token rows
# (`prompt + answer + <eos>`, the pairs of Lab 00). `data.batch(idx)` returns, for the rows
# `idx`, the next-token pairs `x` (what the model reads), `y` (what it must predict at each
# position) and the loss `mask`: True where `y` is an answer token or the `<eos>`, False on the
# prompt and on the padding. With `train_on_prompt=True` the mask covers every real token of
# `y` (prompt included), never the padding. Batches are trimmed to their longest row.

# %%
data_demo = make_data(tasks.make_examples(tasks.HELD_OUT, 3, seed=0))
x, y, mask = data_demo.batch(torch.arange(3))
print("x, y, mask:", tuple(x.shape), x.dtype, y.dtype, mask.dtype)
for i in range(3):
    print(f"  y    {tok.decode([t for t in y[i].tolist() if t > 1])!r:<16}"
          f" mask {''.join('#' if m else '.' for m in mask[i].tolist())}")
_, _, mask_p = data_demo.batch(torch.arange(3), train_on_prompt=True)
print("  train_on_prompt mask of row 0:", "".join("#" if m else "." for m in mask_p[0].tolist()))

# %% [markdown]
# ## Part B — Exercise 1: the prompt-masked, reward-weighted loss
#
# Plain fine-tuning averages the cross-entropy over the answer tokens of a batch.
# **Reward-weighted SFT** gives each *example* a weight $w_i \ge 0$ as well, derived from a
# reward $r_i$ (a verifier's 0/1, a reward model's score, a human rating): a good answer
# counts more, a bad one less or not at all.
#
# **Specification.** Let $\ell_{it}$ be the cross-entropy of row $i$ at position $t$ and
# $m_{it}$ its mask (1 where the position is scored).
#
# * `normalize_rewards(rewards)`: `rewards` a list or a tensor of `N ≥ 1` numbers → a float32
#   tensor `[N]` of weights
#
#   $$ w_i = \frac{r_i - \min_j r_j}{\operatorname{mean}_k (r_k - \min_j r_j)}, $$
#
#   computed in **float64** (so that equal rewards give exactly 0 after the shift) and cast
#   at the end. All rewards equal → every weight `1.0`. Raise `ValueError` for an empty
#   input, and for a NaN or an infinity with a message naming the first bad one as
#   `rewards[i]` (e.g. `rewards[2] is nan`).
# * `answer_loss(logits, y, mask, weights=None)`: `logits [b, l, V]` of any float dtype,
#   `y [b, l]` (long), `mask [b, l]` (bool), `weights [b]` or `None` → a float32 scalar
#   tensor that stays differentiable (no `.item()`, no `torch.no_grad()`). Without weights,
#   the mean over **every scored token of the batch**; with weights, each example's own
#   masked mean, weighted, averaged over the batch size $b$:
#
#   $$ L = \frac{\sum_{i,t} m_{it}\,\ell_{it}}{\max(1, \sum_{i,t} m_{it})}, \qquad
#      L_w = \frac{1}{b} \sum_{i=1}^{b} w_i \,
#            \frac{\sum_t m_{it}\,\ell_{it}}{\max(1, \sum_t m_{it})}. $$
#
#   Take the cross-entropy **in float32** whatever the dtype of the logits (Lab 06 runs its
#   model in bfloat16). A row, or a batch, without any scored token contributes 0, never
#   NaN; an example of weight 0 gets exactly zero gradient.
#
# Off-limits: `minituner.reward_weights`, `SequenceData.with_rewards` and
# `minituner.trainer.sequence_loss` (the tests switch them off while your code runs).
#
# **Why these formulas.** A weight belongs to an example, not to its tokens, hence the
# per-example mean inside $L_w$. Dividing by the batch size $b$, not by $\sum_i w_i$, keeps a
# batch an unbiased sample of the whole data set's weighted loss (the weights average 1 over
# the data) and makes a batch of zero-weight examples contribute $0$, not $0/0$. The
# $\max(1, \cdot)$ keeps a row (or a batch) without any scored token at $0$ instead of NaN.
# With every $w_i = 1$ the two formulas differ: $L$ lets an example with a long answer weigh
# more than one with a short answer, $L_w$ gives each example the same say. The weight
# formula makes the reward's offset and scale irrelevant: the weights are $\ge 0$ with mean 1
# (the loss keeps plain SFT's scale), the worst example gets 0, and with 0/1 rewards this is
# *rejection-sampling SFT*: train on the accepted examples only. If every reward is equal
# there is nothing to prefer: every weight is 1.
#
# <details><summary>Hint 1: the idea</summary>
#
# Take the cross-entropy once, for every position, with `F.cross_entropy(...,
# reduction="none")` on the logits flattened to `[b·l, V]` and cast with `.float()`; shape it
# back to `[b, l]` when you need rows. The rest is masking and averaging: the mask as a float
# turns unscored positions into zeros, and `.clamp(min=1.0)` on a count is the
# $\max(1, \cdot)$. For the rewards, `torch.isfinite` finds the bad entries and `.nonzero()`
# the first index; `shifted.any()` tells whether anything is left after subtracting the
# minimum.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# normalize_rewards(rewards):
#     r = rewards as a flat float64 tensor
#     if r is empty: raise ValueError
#     if some r[i] is not finite: raise ValueError naming the first such i as rewards[i]
#     s = r - min(r)
#     if every s is 0: return ones(N) as float32
#     return float32(s / mean(s))
#
# answer_loss(logits, y, mask, weights):
#     ce = cross_entropy(float32(logits) as [b·l, V], y as [b·l], reduction none)   # [b·l]
#     m  = float(mask)
#     if weights is None: return sum(ce · m) / max(1, sum(m))
#     per_row = sum over t of (ce · m) as [b, l]  /  max(1, sum over t of m)       # [b]
#     return mean(weights · per_row)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "weighted_loss", "locked": false, "schema_version": 3, "solution": true, "task": false}
def normalize_rewards(rewards) -> torch.Tensor:
    """Rewards [N] -> float32 weights [N]: (r - min r) / mean(r - min r); all equal -> ones."""
    ### BEGIN SOLUTION
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("rewards must hold at least one value")
    bad = (~torch.isfinite(r)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"rewards[{i}] is {r[i].item()}; every reward must be finite")
    shifted = r - r.min()
    if not shifted.any():
        return torch.ones(r.numel(), dtype=torch.float32)
    return (shifted / shifted.mean()).float()
    ### END SOLUTION


def answer_loss(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """Masked mean cross-entropy; with weights [b], the weighted mean of per-example means."""
    ### BEGIN SOLUTION
    ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    if weights is None:
        m = mask.flatten().float()
        return (ce * m).sum() / m.sum().clamp(min=1.0)
    m = mask.float()                                                  # [b, l]
    per_example = (ce.view_as(m) * m).sum(1) / m.sum(1).clamp(min=1.0)  # [b]
    return (weights.to(per_example) * per_example).mean()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_normalize_rewards", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import share

_WHY = "this exercise must be done without the reference (minituner) or its torch shortcut"
_REFERENCE = [*reference("05-lora-finetune").values(),
              # torch's shortcuts, under the names torch gives them
              *[(torch.nn.utils, name)
                for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")],
              *[(torch.nn.utils.clip_grad, name)
                for name in ("clip_grad_norm_", "clip_grad_value_", "_clip_grads_with_norm_")]]


def _forbid_reference():
    """While the block runs, the reference implementations raise if called (also through
    names the notebook imported from them)."""
    return forbid(_REFERENCE, globals(), why=_WHY)


def _reward_rule(got, want):
    """The property of the weights that `got` breaks, when it is one of the usual slips."""
    if bool((want == 1).all()):
        return "\nLikely: all rewards are equal, so every weight is 1 (there is nothing to " \
               "prefer; the shifted rewards are all 0, and 0 / 0 is NaN)"
    if not got.min().item() == 0:
        return "\nLikely: the smallest reward must get weight 0: shift by the minimum first"
    if not abs(got.double().mean().item() - 1) < 1e-5:
        return "\nLikely: the weights must average 1: divide the shifted rewards by their mean"
    return ""


def _check_rewards(rewards, want=None, what="", diagnose=True):
    """`want`: the weights worked out by hand (float64, cast to float32 here); None: the
    reference's (grading only)."""
    where = f"{what}normalize_rewards({rewards!r})"
    want = minituner.reward_weights(rewards) if want is None else \
        torch.tensor(want, dtype=torch.float64).float()
    with _forbid_reference():
        got = normalize_rewards(rewards)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 \
        and got.shape == want.shape, \
        f"{where}: expected a float32 tensor of shape {tuple(want.shape)}, got " \
        f"{getattr(got, 'dtype', type(got).__name__)} {tuple(getattr(got, 'shape', ()))}"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: (
        f"{where}: expected {want.tolist()}, got {got.tolist()}\n{m}"
        + (_reward_rule(got, want) if diagnose else "")))


def _check_bad_rewards(rewards, index, what=""):
    try:
        with _forbid_reference():
            normalize_rewards(rewards)
    except ValueError as e:
        assert f"rewards[{index}]" in str(e), \
            f"{what}normalize_rewards({rewards!r}): the error should name rewards[{index}]; " \
            f"it says: {e}"
    else:
        raise AssertionError(f"{what}normalize_rewards({rewards!r}) should raise ValueError")


# the expected weights, worked out by hand: shift by the minimum, divide by the shifted mean
_check_rewards([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])         # shifted [0, 1, 2], mean 1
_check_rewards([0.0, 1.0, 1.0, 0.0, 1.0],                # 0/1 rewards: rejection sampling;
               [0.0, 1 / 0.6, 1 / 0.6, 0.0, 1 / 0.6])    # shifted the same, mean 3/5
_check_rewards([5.0, 5.0, 5.0], [1.0, 1.0, 1.0])         # nothing to prefer: plain SFT
try:                                           # a large offset: float32 cannot tell these apart
    _check_rewards([1e8, 1e8 + 1.0, 1e8 + 3.0],          # shifted [0, 1, 3], mean 4/3
                   [0.0, 0.75, 2.25], diagnose=False)
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: compute in float64 (torch.as_tensor(rewards, "
                         "dtype=torch.float64)) and cast to float32 only at the end") from _e
_check_bad_rewards([1.0, 0.5, float("nan"), 2.0], 2)
try:
    with _forbid_reference():
        normalize_rewards([])
except ValueError:
    pass
except Exception as _e:
    raise AssertionError(f"normalize_rewards([]) raised {type(_e).__name__}: {_e}\nRule: "
                         "raise ValueError for an empty input (it has no minimum)") from _e
else:
    raise AssertionError("normalize_rewards([]) returned instead of raising ValueError: an "
                         "empty input has no minimum to shift by (rule: raise ValueError)")
print("normalize_rewards: shift by the minimum, divide by the mean; equal -> ones; NaN named")

### BEGIN HIDDEN TESTS
# case: negative rewards given as a tensor
_check_rewards(torch.tensor([-3.0, -1.0, 4.0, 0.5]), what="hidden: ")       # negative, tensor
# case: a single reward
_check_rewards([7.0], what="hidden: ")                                       # one example
# case: equal rewards that are not integers
_check_rewards([0.1, 0.1, 0.1, 0.1], what="hidden: ")
# case: a float64 tensor of rewards
_check_rewards(torch.tensor([2.0, 1.0, 3.0], dtype=torch.float64), what="hidden: ")
# case: rewards shifted and scaled
_r = randn(50, seed=3)
with _forbid_reference():
    _a, _b = normalize_rewards(_r), normalize_rewards(_r * 7.5 - 12.0)
torch.testing.assert_close(_a, _b, rtol=1e-5, atol=1e-6, msg=lambda m: (
    f"hidden: the weights must not depend on the rewards' offset or positive scale:\n{m}"))
assert abs(_a.double().mean().item() - 1.0) < 1e-5 and _a.min().item() == 0.0, \
    f"hidden: weights should have mean 1 and minimum 0, got mean {_a.mean().item()} " \
    f"min {_a.min().item()}"
# case: an infinity first
_check_bad_rewards([float("inf"), 1.0], 0, what="hidden: ")
# case: a tensor with two non-finite rewards
_check_bad_rewards(torch.tensor([1.0, 2.0, 3.0, -float("inf"), float("nan")]), 3,
                   what="hidden: ")
# case: an empty list of rewards
try:
    normalize_rewards([])
except ValueError:
    pass
else:
    raise AssertionError("hidden: normalize_rewards([]) should raise ValueError")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_answer_loss", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _loop_loss(logits, y, mask, weights=None):
    """The definitions written out with a Python loop over the rows."""
    logits = logits.float()
    if weights is None:
        terms = [F.cross_entropy(logits[i][mask[i]], y[i][mask[i]], reduction="sum")
                 for i in range(len(y)) if mask[i].any()]
        return torch.stack(terms).sum() / max(1, int(mask.sum())) if terms else \
            logits.sum() * 0
    per = [F.cross_entropy(logits[i][mask[i]], y[i][mask[i]]) if mask[i].any()
           else logits.sum() * 0 for i in range(len(y))]
    return sum(w * p for w, p in zip(weights.tolist(), per, strict=True)) / len(y)


def _loss_rule(got, logits, y, mask, weights):
    """The rule a wrong loss breaks, when it is one of the usual slips (else '')."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
    ce, m = ce.view_as(mask), mask.float()
    slips = [(ce.mean(), "the mask: only positions where mask is True are scored (not the "
                         "prompt, not the padding)")]
    if weights is not None:
        per = (ce * m).sum(1) / m.sum(1).clamp(min=1.0)
        slips += [((weights * per).sum() / weights.sum().clamp(min=1e-12),
                   "divide the weighted sum by the batch size b, not by the sum of the weights"),
                  ((weights[:, None] * ce * m).sum() / m.sum().clamp(min=1.0),
                   "a weight multiplies its example's own mean (per-example means), not each "
                   "of its tokens")]
    for want, rule in slips:
        if math.isclose(got, want.item(), rel_tol=1e-5, abs_tol=1e-6):
            return f"\nLikely: {rule}."
    return ""


def _check_loss(logits, y, mask, weights=None, what="", with_ref=False):
    where = f"{what}logits {tuple(logits.shape)} {logits.dtype}, " \
            f"{int(mask.sum())} scored tokens, weights " \
            f"{None if weights is None else [round(w, 3) for w in weights.tolist()]}"
    # expectations first: the per-row loop, its value and its gradient w.r.t. the logits
    loop_lg = logits.detach().clone().requires_grad_()
    loop = _loop_loss(loop_lg, y, mask, weights)
    loop.backward()
    want = loop.detach()
    lg = logits.detach().clone().requires_grad_()
    with _forbid_reference():
        got = answer_loss(lg, y, mask, weights)
    assert isinstance(got, torch.Tensor) and got.dim() == 0, \
        f"{where}: expected a scalar tensor, got {type(got).__name__} " \
        f"{tuple(getattr(got, 'shape', ()))}"
    assert got.dtype == torch.float32, \
        f"{where}: expected a float32 loss, got {got.dtype} (rule: take the cross-entropy in " \
        f"float32, logits.float(), whatever the dtype of the logits)"
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6,
                               msg=lambda m: (f"{where}: expected {want.item():.6f} (the "
                                              f"definition, as a loop over the rows), got "
                                              f"{got.item():.6f}\n{m}"
                                              + _loss_rule(got.item(), logits, y, mask,
                                                           weights)))
    if with_ref:
        ref_lg = logits.detach().clone().requires_grad_()
        ref = sequence_loss(lambda _: ref_lg, None, y, mask, weights)
        torch.testing.assert_close(got.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ref.detach(), want, rtol=1e-5, atol=1e-6)
        ref.backward()
    assert got.requires_grad, f"{where}: the loss must stay differentiable (no .item(), no " \
                              f"torch.no_grad())"
    got.backward()
    torch.testing.assert_close(lg.grad, loop_lg.grad, rtol=1e-4, atol=1e-7, msg=lambda m: (
        f"{where}: the gradient of your loss w.r.t. the logits differs from the per-row "
        f"loop's:\n{m}"))
    if with_ref:
        torch.testing.assert_close(lg.grad, ref_lg.grad, rtol=1e-4, atol=1e-7)
    return lg.grad


_data = make_data(tasks.make_mixture(["add", "rev", "sort"], 4, seed=1))
_idx = torch.arange(8)
_x, _y, _mask = _data.batch(_idx)
_logits = randn(*_x.shape, tok.vocab_size, seed=1) * 3
_check_loss(_logits, _y, _mask)                             # plain: token mean
_w = torch.tensor([0.0, 2.0, 1.0, 0.5, 1.5, 0.0, 3.0, 1.0])
_g = _check_loss(_logits, _y, _mask, _w)                    # weighted: mean of example means
assert _g[0].abs().max() == 0 and _g[5].abs().max() == 0, \
    "examples of weight 0 must get no gradient at all"
# bfloat16 logits: the cross-entropy is still taken in float32
try:
    _check_loss(_logits.bfloat16(), _y, _mask, _w, what="bfloat16 logits: ")
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: cast the logits with .float() before the "
                         "cross-entropy (casting the loss afterwards is too late)") from _e
# rows without any scored token count 0, never NaN
_m_empty = _mask.clone()
_m_empty[3] = False
try:
    _check_loss(_logits, _y, _m_empty, _w, what="row 3 without scored tokens: ")
    for _weights in (None, _w):
        with torch.no_grad():
            _z = answer_loss(_logits, _y, torch.zeros_like(_mask), _weights)
        assert _z.item() == 0.0, f"a batch without any scored token (weights " \
                                 f"{'None' if _weights is None else 'given'}) gave {_z.item()}"
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: a row (or a batch) without any scored token "
                         "contributes 0, not NaN: divide by max(1, count)") from _e
print("answer_loss: the token mean without weights, the weighted mean of per-example means "
      "with them, as a per-row loop")

### BEGIN HIDDEN TESTS
# case: weights all equal to 1
_ones = torch.ones(8)
with torch.no_grad():
    _plain, _eq = answer_loss(_logits, _y, _mask), answer_loss(_logits, _y, _mask, _ones)
assert abs(_plain.item() - _eq.item()) > 1e-4, \
    "hidden: with weights all 1 the loss is the mean of per-example means, which differs " \
    "from the token mean over the batch"
_check_loss(_logits, _y, _mask, _ones, with_ref=True, what="hidden: ")
# case: rows of different lengths, one with a single scored token
_short = SequenceData.from_pairs([([5, 6, 7, 8], [1]), ([5, 6], [9, 10, 11, 1]), ([4], [12, 1])])
_xs, _ys, _ms = _short.batch(torch.arange(3))
_ls = randn(*_xs.shape, tok.vocab_size, seed=2)
_check_loss(_ls, _ys, _ms, with_ref=True, what="hidden: ")
# case: rows of different lengths, weighted
_check_loss(_ls, _ys, _ms, torch.tensor([3.0, 0.0, 1.0]), with_ref=True, what="hidden: ")
# case: a mask that covers the prompt too (train_on_prompt)
_xp, _yp, _mp = _data.batch(_idx, train_on_prompt=True)
_check_loss(_logits, _yp, _mp, with_ref=True, what="hidden (train_on_prompt): ")
_check_loss(_logits, _yp, _mp, _w, with_ref=True, what="hidden (train_on_prompt): ")
# case: bfloat16 logits
_check_loss(_logits.bfloat16(), _y, _mask, with_ref=True, what="hidden (bfloat16 logits): ")
_check_loss(_logits.bfloat16(), _y, _mask, _w, with_ref=True, what="hidden (bfloat16 logits): ")
# case: a row without any scored token
_m0 = _mask.clone()
_m0[2] = False
_check_loss(_logits, _y, _m0, _w, with_ref=True, what="hidden (a row with an empty mask): ")
# case: a batch without any scored token, no weights
with torch.no_grad():
    _z = answer_loss(_logits, _y, torch.zeros_like(_mask))
assert _z.item() == 0.0, f"hidden: a batch without any scored token should give 0, got {_z}"
### END HIDDEN TESTS

# %% [markdown]
# ### Reward-weighted SFT on noisy labels, measured
#
# Suppose 30 % of the `rev` training answers came out wrong — the annotator copied the word
# instead of reversing it — and a verifier (here: `answer == prompt word reversed`) gives each
# example a reward of 1 or 0. Plain SFT learns from everything; reward-weighted SFT gives the
# wrong examples weight 0 and the right ones weight 1/0.7 ≈ 1.43. 80 LoRA steps of 16 each, with
# the course's loop; the validation loss is on clean `rev` prompts of the eval split:

# %% tags=["jupyter-only"]
def noisy_rev(n, seed=0, wrong=0.3):
    """rev examples whose answer is, for a fraction `wrong` of them, the word itself."""
    exs = tasks.make_examples(tasks.HELD_OUT, n, seed=seed)
    g = torch.Generator().manual_seed(seed)
    flip = (torch.rand(n, generator=g) < wrong).tolist()
    out = [tasks.Example(ex.task, ex.prompt, ex.answer[::-1] if f else ex.answer)
           for ex, f in zip(exs, flip, strict=True)]
    rewards = [float(ex.answer == ex.prompt[4:-1][::-1]) for ex in out]
    return out, rewards


noisy, rewards = noisy_rev(2000)
print(f"{sum(r == 0 for r in rewards)} of {len(rewards)} answers are wrong; weights:",
      sorted(set(normalize_rewards(rewards).tolist())))
rev_eval = tasks.make_examples(tasks.HELD_OUT, EVAL_N, seed=0, split="eval")
rev_val = make_data(rev_eval)
NOISY_CFG = TrainConfig(steps=80, batch_size=16, lr=8e-3, warmup_steps=5, min_lr_ratio=0.5,
                        log_every=10, progress=False)
for label, data in (("plain SFT", make_data(noisy)),
                    ("reward-weighted SFT", make_data(noisy, rewards=rewards))):
    m = lora_base()
    minituner.train(m, data, NOISY_CFG)
    got = minigpt.answers(m, [ex.prompt for ex in rev_eval[:4]])
    print(f"{label:<20} rev exact match {minigpt.evaluate(m, 'rev', n=EVAL_N):.2f}, "
          f"clean validation loss {minituner.mean_loss(m, rev_val):.3f}; answers {got} for "
          f"{[ex.answer for ex in rev_eval[:4]]}")

# %% [markdown]
# ### The same kind of data, as a file you can edit
#
# The course ships such rewarded answers as a file too: `data/rev_rewarded.jsonl` in the
# course folder, one JSON object per line, eight `rev` prompts with four to six candidate
# answers each (the right one, near misses such as two letters swapped or the word copied as
# above, wrong ones), a `reward` (1 for exactly the right answer, else 0) and a
# `partial_credit` (the share of letters in place). `minirl.read_rewarded_jsonl` reads it and
# names the line of anything it cannot use. The right answers are (prompt, answer) pairs of
# the very 2000 `rev` training examples this lab trains on. Change a reward or add a line,
# then run the cell again: `data/README.md` says what the reader checks, and
# `python scripts/make_sample_data.py` puts the original back.

# %%
SAMPLE = Path("data", "rev_rewarded.jsonl")
sample_file = next((d / SAMPLE for d in (Path.cwd(), *Path.cwd().parents)
                    if (d / SAMPLE).is_file()), None)
try:
    sample = minirl.read_rewarded_jsonl(sample_file) if sample_file else None
except ValueError as err:               # an edit the reader refuses; the message names the line
    sample = None
    print(f"minirl.read_rewarded_jsonl refused the file: {err}")
if sample_file is None:
    print(f"{SAMPLE} is not in {Path.cwd()} or a folder above it: run the notebook inside the "
          "course folder, or write the file with `python scripts/make_sample_data.py`")
elif sample is not None:
    print(f"{sample_file}: {len(sample)} answers to {len(set(sample.prompts))} prompts; "
          "the first six:")
    sample_rows = list(zip(sample.prompts, sample.answers, sample.rewards.tolist(), strict=True))
    print("\n".join(f"  {p:<11} {a!r:<9} reward {r}" for p, a, r in sample_rows[:6]))
    sample_right = [tasks.Example(tasks.HELD_OUT, p, a) for p, a, r in sample_rows if r == 1]
    sample_train = set(tasks.make_examples(tasks.HELD_OUT, 2000, seed=0))
    print(f"{sum(ex in sample_train for ex in sample_right)} of the {len(sample_right)} "
          "reward-1 answers are training examples of this lab" + (
              f"; as training rows: make_data -> tokens "
              f"{tuple(make_data(sample_right).tokens.shape)}" if sample_right else ""))

# %% [markdown]
# ## Part C — Exercise 2: the learning-rate schedule and gradient clipping
#
# **Specification.**
#
# * `lr_schedule(step, cfg) -> float`: the learning rate of step `step` (steps count from 0):
#   a linear warm-up from `lr/warmup` to `lr` over `warmup_steps` steps, then half a cosine
#   down to `lr · min_lr_ratio` at the **last** step (`steps - 1`):
#
#   $$ \eta(s) = \begin{cases} \eta_{\max}\,\dfrac{s+1}{W} & s < W \\[6pt]
#      \eta_{\max}\left(\rho + (1-\rho)\,\tfrac12\left(1 + \cos \pi\, \min(1, p)\right)\right),
#      \quad p = \dfrac{s - W}{\max(1,\ S - 1 - W)} & s \ge W \end{cases} $$
#
#   with $S$ = `cfg.steps`, $W$ = `cfg.warmup_steps`, $\rho$ = `cfg.min_lr_ratio` and
#   $\eta_{\max}$ = `cfg.lr`. The $\max(1, \cdot)$ and $\min(1, p)$ are part of the rule:
#   they keep the edge cases finite (no warm-up, warm-up as long as the run, a step past the
#   end).
# * `clip_grads(params, max_value=0.0, max_norm=0.0) -> Tensor`: clip in place on each
#   parameter's `.grad`, in two stages; parameters whose `.grad` is `None` are skipped (and
#   stay `None`):
#   1. if `max_value > 0`, clamp every gradient element to $[-v, v]$, $v$ = `max_value`;
#   2. compute the global L2 norm $n$ of all the gradients together, **as they are after
#      stage 1**; if `max_norm > 0`, multiply every gradient by
#      $c = \text{max\_norm} / (n + 10^{-6})$ when $c < 1$ (PyTorch's `clip_grad_norm_`
#      arithmetic, $10^{-6}$ included).
#
#   Return $n$, the norm stage 2 saw, as a 0-dim tensor (the training loop logs it); with
#   both stages off the gradients are untouched and $n$ is still returned.
#
# Off-limits: `minituner.trainer.lr_at`, `minituner.trainer.clip_gradients` and
# `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` / `clip_grads_with_norm_`
# (`torch.linalg.vector_norm` is yours to use).
#
# **Why.** AdamW's first steps are its least reliable (its second-moment estimate has seen a
# single gradient), hence the warm-up; the cosine lets the last steps settle. Clamping comes
# first so that one huge element (a rare token, a bad example) is cut down *before* it enters
# the global norm, where it would otherwise shrink every other gradient.
#
# <details><summary>Hint 1: the idea</summary>
#
# The schedule is the formula with two branches, written with `math.cos` and `math.pi`; the
# only traps are counting steps from 0 (`s + 1` in the warm-up, so the first step is not
# 0) and the guards in $p$. For clipping, collect the gradients that exist first; clamp
# them in place with `clamp_`; the global norm is the norm of the per-tensor norms
# (`torch.linalg.vector_norm` of a stack of them); scale in place with `mul_`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# lr_schedule(s, cfg):
#     if s < W: return lr · (s + 1) / W
#     p = (s - W) / max(1, S - 1 - W)
#     return lr · (ρ + (1 - ρ) · 0.5 · (1 + cos(π · min(1, p))))
#
# clip_grads(params, max_value, max_norm):
#     grads = [p.grad for p in params if p.grad is not None]
#     if max_value > 0: clamp each g in grads to [-max_value, max_value], in place
#     n = norm of [norm(g) for g in grads]
#     if max_norm > 0 and max_norm / (n + 1e-6) < 1: multiply each g by that factor, in place
#     return n
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "schedule_and_clip", "locked": false, "schema_version": 3, "solution": true, "task": false}
def lr_schedule(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr · cfg.min_lr_ratio at the end."""
    ### BEGIN SOLUTION
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)
    ### END SOLUTION


def clip_grads(params, max_value: float = 0.0, max_norm: float = 0.0) -> torch.Tensor:
    """Clamp each grad element to ±max_value, then scale all grads to global norm <= max_norm;
    return the global norm the second stage saw. 0 turns a stage off."""
    ### BEGIN SOLUTION
    grads = [p.grad for p in params if p.grad is not None]
    if max_value > 0:
        for g in grads:
            g.clamp_(-max_value, max_value)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef)
    return norm
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_lr_schedule", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _schedule_rule(step, cfg, got):
    """The rule a wrong learning rate breaks, when it is one of the usual slips (else '')."""
    W, S, rho = cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio
    if step < W:
        slips = [(cfg.lr * step / W, "steps count from 0: the first warm-up step has "
                                      "lr/warmup_steps, the last one lr")]
    else:
        def cos(p):
            return 0.5 * (1 + math.cos(math.pi * min(1.0, p)))
        p = (step - W) / max(1, S - 1 - W)
        slips = [(cfg.lr * (rho + (1 - rho) * cos((step - W) / max(1, S - W))),
                  "the cosine reaches lr · min_lr_ratio at the last step, steps - 1: "
                  "p = (step - warmup_steps) / max(1, steps - 1 - warmup_steps)"),
                 (cfg.lr * cos(p), "the cosine decays to lr · min_lr_ratio, not to 0")]
    for want, rule in slips:
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
            return f" ({rule})"
    return ""


def _torch_lrs(cfg, n=None):
    """The learning rates of steps 0 .. n-1 (n = cfg.steps) from PyTorch's own schedulers:
    LinearLR from lr/W to lr over the W warm-up steps, then CosineAnnealingLR from lr to
    lr · min_lr_ratio over max(1, steps - 1 - W) steps; past the last step the rate stays at
    lr · min_lr_ratio (the min(1, p) of the rule; for a run with a cosine part, W < steps)."""
    W, S = cfg.warmup_steps, cfg.steps
    lrs = []
    for warm_up, count in ((True, min(W, S)), (False, S - W)):
        if count <= 0:
            continue
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched = torch.optim.lr_scheduler.LinearLR(
            opt, start_factor=1 / W, end_factor=1.0, total_iters=max(1, W - 1)) if warm_up \
            else torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=max(1, S - 1 - W), eta_min=cfg.lr * cfg.min_lr_ratio)
        for _ in range(count):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    n = S if n is None else n
    return (lrs + [cfg.lr * cfg.min_lr_ratio] * n)[:n]


# the oracle, against values worked out by hand for steps=40, warmup 5, lr 3e-3, ratio 0.1:
# step 0: 3e-3 · 1/5; steps 4 and 5 (p = 0): 3e-3; step 22: p = 17/34 = 1/2, cos(π/2) = 0,
# 3e-3 · (0.1 + 0.9 · 0.5); step 39: p = 1, 3e-3 · 0.1
_hand = _torch_lrs(TrainConfig(steps=40, warmup_steps=5, lr=3e-3, progress=False))
assert all(math.isclose(_hand[s], v, rel_tol=1e-12) for s, v in
           ((0, 6e-4), (4, 3e-3), (5, 3e-3), (22, 1.65e-3), (39, 3e-4))), _hand


def _check_schedule(what="", with_ref=False, **kw):
    cfg = TrainConfig(progress=False, **kw)
    where = f"{what}TrainConfig(steps={cfg.steps}, warmup_steps={cfg.warmup_steps}, " \
            f"lr={cfg.lr}, min_lr_ratio={cfg.min_lr_ratio})"
    awkward = {0, cfg.warmup_steps - 1, cfg.warmup_steps, cfg.warmup_steps + 1,
               cfg.steps // 2, cfg.steps - 2, cfg.steps - 1}
    steps = sorted(s for s in awkward | set(range(cfg.steps)) if s >= 0)
    table = _torch_lrs(cfg, max(steps) + 1)
    wants = [table[s] if s < cfg.steps or cfg.warmup_steps < cfg.steps else lr_at(s, cfg)
             for s in steps]               # (lr_at: past the end of an all-warm-up run, hidden)
    if with_ref:
        assert all(math.isclose(w, lr_at(s, cfg), rel_tol=1e-9, abs_tol=1e-15)
                   for s, w in zip(steps, wants, strict=True))
    with _forbid_reference():
        try:
            gots = [lr_schedule(step, cfg) for step in steps]
        except ZeroDivisionError as e:
            raise AssertionError(f"{where}: lr_schedule raised {e!r}; rule: the cosine's "
                                 f"denominator is max(1, steps - 1 - warmup_steps)") from e
    for step, want, got in zip(steps, wants, gots, strict=True):
        assert isinstance(got, (float, int)) and math.isclose(got, want, rel_tol=1e-9,
                                                              abs_tol=1e-15), \
            f"{where}: at step {step} expected lr {want!r}, got {got!r}" + (
                _schedule_rule(step, cfg, got) if isinstance(got, (float, int)) else "")


_check_schedule(steps=40, warmup_steps=5, lr=3e-3)
_check_schedule(steps=120, warmup_steps=10, lr=5e-3, min_lr_ratio=0.1)
_check_schedule(steps=6, warmup_steps=5, lr=2e-3)       # steps - 1 - warmup_steps = 0
_past = TrainConfig(steps=12, warmup_steps=2, lr=1e-3, progress=False)
_want = 1e-3 * _past.min_lr_ratio                  # lr · min_lr_ratio, 1e-4: the last value
with _forbid_reference():
    _got = lr_schedule(15, _past)
assert math.isclose(_got, _want, rel_tol=1e-9), \
    f"step 15 of a 12-step run: expected lr {_want!r} (the final value), got " \
    f"{_got!r}; rule: the cosine's progress is min(1, p), so the rate stays at " \
    f"lr · min_lr_ratio after the last step"
print("lr_schedule: warm-up and cosine as PyTorch's LinearLR and CosineAnnealingLR, step by "
      "step")

### BEGIN HIDDEN TESTS
# case: no warm-up
_check_schedule(steps=10, warmup_steps=0, lr=1e-2, with_ref=True, what="hidden: ")  # no warm-up
# case: warm-up one step shorter than the run
_check_schedule(steps=8, warmup_steps=7, lr=1e-3, with_ref=True, what="hidden: ")  # denominator 0
# case: a single step
_check_schedule(steps=1, warmup_steps=0, lr=2e-3, with_ref=True, what="hidden: ")  # one step
# case: warm-up as long as the run
_check_schedule(steps=6, warmup_steps=6, lr=2e-3, with_ref=True, what="hidden: ")  # all warm-up
# case: min_lr_ratio 0
_check_schedule(steps=30, warmup_steps=3, lr=1e-3, min_lr_ratio=0.0, with_ref=True, what="hidden: ")
# case: min_lr_ratio 1
_check_schedule(steps=30, warmup_steps=3, lr=1e-3, min_lr_ratio=1.0, with_ref=True, what="hidden: ")
# case: steps past the end of the run
_cfg = TrainConfig(steps=20, warmup_steps=4, lr=1e-3, progress=False)
for _s in (20, 25, 100):                                                   # past the end
    assert math.isclose(lr_schedule(_s, _cfg), lr_at(_s, _cfg), rel_tol=1e-9), \
        f"hidden: step {_s} past the end of a 20-step run: expected {lr_at(_s, _cfg)}, got " \
        f"{lr_schedule(_s, _cfg)} (min(1, progress))"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_clip_grads", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import outputs


def _params_with_grads(shapes, seed=0, scale=1.0, none_at=()):
    ps = []
    for i, shape in enumerate(shapes):
        p = nn.Parameter(torch.zeros(shape))
        p.grad = None if i in none_at else randn(*shape, seed=seed + i) * scale
        ps.append(p)
    return ps


def _torch_clip(params, max_value, max_norm):
    """PyTorch's clipping, the two stages of the rule: clip_grad_value_, then clip_grad_norm_
    (which scales by max_norm / (norm + 1e-6) when that is < 1; an infinite max_norm only
    measures). Returns the norm it saw."""
    with_grads = [p for p in params if p.grad is not None]
    if max_value > 0:
        torch.nn.utils.clip_grad_value_(with_grads, max_value)
    return torch.nn.utils.clip_grad_norm_(with_grads, max_norm if max_norm > 0 else math.inf)


def _check_clip(shapes, max_value, max_norm, seed=0, scale=1.0, none_at=(), what="",
                with_ref=False):
    where = f"{what}grads of shapes {shapes} (x{scale}), max_value={max_value}, " \
            f"max_norm={max_norm}"
    mine = _params_with_grads(shapes, seed, scale, none_at)
    ref = _params_with_grads(shapes, seed, scale, none_at)
    want = _torch_clip(ref, max_value, max_norm)
    if with_ref:
        ref2 = _params_with_grads(shapes, seed, scale, none_at)
        want2 = clip_gradients(ref2, TrainConfig(grad_clip_value=max_value, grad_clip=max_norm,
                                                 progress=False))
        torch.testing.assert_close(want2, want, rtol=1e-6, atol=1e-7)
        for q, q2 in zip(ref, ref2, strict=True):
            assert (q.grad is None) == (q2.grad is None)
            if q.grad is not None:
                torch.testing.assert_close(q2.grad, q.grad, rtol=1e-5, atol=1e-7 * scale)
    with _forbid_reference(), outputs(*mine):          # the grads it clips in place
        got = clip_grads(mine, max_value, max_norm)
    assert isinstance(got, torch.Tensor) and got.dim() == 0, \
        f"{where}: expected the norm as a 0-dim tensor, got {got!r}"
    if max_value > 0:
        top = max(p.grad.abs().max().item() for p in mine if p.grad is not None)
        assert top <= max_value * (1 + 1e-6), \
            f"{where}: after clip_grads a gradient element is {top:.4g}, above max_value: " \
            f"clamp each p.grad in place (g.clamp_(...)); a clamped copy changes nothing"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: (
        f"{where}: expected the returned norm {want.item():.6g}, got {got.item():.6g}" + (
            " (the norm of the clamped gradients, before the rescaling)" if max_value else "")
        + f"\n{m}"))
    for i, (p, q) in enumerate(zip(mine, ref, strict=True)):
        if q.grad is None:
            assert p.grad is None, f"{where}: parameter {i} had no grad; leave it None"
            continue
        # atol scales with the gradients: at 1e-4 the 1e-6 of the rule moves them by 1e-8
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-5, atol=1e-7 * scale, msg=lambda m, i=i: (
                f"{where}: the clipped gradient of parameter {i} differs from PyTorch's "
                f"clip_grad_value_ + clip_grad_norm_ (clamp first, then scale by "
                f"max_norm / (norm + 1e-6) when that is < 1)\n{m}"))


_check_clip([(3, 4), (5,)], 0.0, 1.0)              # global norm only (norm about 4)
_check_clip([(3, 4), (5,)], 0.5, 0.0)              # clamp only
_check_clip([(3, 4), (5,)], 0.5, 1.0)              # both: clamp, then the norm of the clamped
_check_clip([(3, 4), (5,)], 0.0, 100.0)            # the norm is below max_norm: untouched
_check_clip([(8, 8)], 0.0, 1e-4, seed=3, scale=1e-4)  # norm about 8e-4: the 1e-6 matters
try:                                               # a parameter without a gradient
    _check_clip([(3, 4), (2,), (5,)], 0.5, 1.0, none_at=(1,))
except (AttributeError, TypeError) as _e:
    raise AssertionError(f"clip_grads failed on a parameter whose .grad is None ({_e}); "
                         "rule: skip parameters without a gradient and leave them None") from _e
print("clip_grads: clamp, then the global norm, as PyTorch's clip_grad_value_ and "
      "clip_grad_norm_")

### BEGIN HIDDEN TESTS
# case: four parameters of several ranks, both stages
_check_clip([(7, 3), (2, 2, 2), (1,), (4,)], 0.3, 0.8, seed=5, with_ref=True, what="hidden: ")
# case: a parameter without a gradient, both stages
_check_clip([(7, 3), (4,), (6,)], 0.2, 0.5, seed=6, none_at=(1,), with_ref=True, what="hidden: ")
# case: both stages off
_check_clip([(10, 10)], 0.0, 0.0, seed=7, scale=5.0, with_ref=True, what="hidden (both off): ")
# case: a clamp too wide to bite
_check_clip([(10, 10), (3,)], 1e3, 1.0, seed=8, with_ref=True,
            what="hidden (clamp too wide to bite): ")
# case: tiny gradients
_check_clip([(64, 64)], 0.0, 1.0, seed=9, scale=1e-4, with_ref=True, what="hidden (tiny grads): ")
# case: a small hand-computed example
_a, _b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(1, 1))
_a.grad, _b.grad = torch.tensor([3.0, -4.0, 0.5]), torch.tensor([[10.0]])
with outputs(_a, _b):
    _n = clip_grads([_a, _b], 2.0, 1.0)
assert math.isclose(_n.item(), 3.5, rel_tol=1e-6), f"hidden: expected norm 3.5, got {_n}"
torch.testing.assert_close(_a.grad, torch.tensor([2.0, -2.0, 0.5]) / (3.5 + 1e-6))
### END HIDDEN TESTS

# %% [markdown]
# The schedule of the fine-tune in Part F (120 steps, 10 of warm-up, peak `5e-3`), and what
# the two clipping stages do to one gradient with a single outlier element:

# %%
RUN_CFG = TrainConfig(steps=120, batch_size=16, lr=5e-3, warmup_steps=10, log_every=10,
                      eval_every=30, progress=False)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
ax1.plot(range(RUN_CFG.steps), [lr_schedule(s, RUN_CFG) for s in range(RUN_CFG.steps)])
ax1.axvline(RUN_CFG.warmup_steps, color="k", lw=0.8, ls=":")
ax1.set(xlabel="step", ylabel="learning rate", title="warm-up + cosine to lr · min_lr_ratio")

g0 = randn(200, seed=11) * 0.01
g0[17] = 5.0                                         # one outlier element
for label, v in (("global norm only", 0.0), ("clamp to ±0.05, then norm", 0.05)):
    p = nn.Parameter(torch.zeros(200))
    p.grad = g0.clone()
    n = clip_grads([p], v, 1.0)
    others = torch.cat([p.grad[:17], p.grad[18:]])
    ax2.plot(p.grad.abs().numpy(), ".", ms=3,
             label=f"{label}: norm {n.item():.2f}, other elements |g| ≈ "
                   f"{others.abs().mean().item():.4f}")
ax2.set(yscale="log", xlabel="element", ylabel="|gradient| after clipping",
        title="one outlier element")
ax2.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Part D — Exercise 3: the training loop
#
# Now put the pieces together.
#
# **Specification.** `train_loop(model, data, cfg) -> list[float]` trains the parameters of
# `model` that have `requires_grad` (with LoRA, only the adapter's factors) for `cfg.steps`
# AdamW steps on `data` (a `SequenceData`), and returns the loss of each step as Python
# floats (`loss.item()`, so that no step's graph is kept alive).
#
# * `params`: the parameters with `requires_grad`, in `model.parameters()` order; raise
#   `ValueError` if there are none.
# * `torch.optim.AdamW` with **two parameter groups**: the tensors with 2 or more dimensions
#   (matrices) get weight decay `cfg.weight_decay`, the 1-D ones (norm gains, biases) get
#   `0.0`; `lr=cfg.lr`, `betas=cfg.betas`, the other settings PyTorch's defaults.
# * The batches come from `BatchOrder(len(data), cfg.batch_size, cfg.seed)` (imported above
#   from `minituner.data`): `next(order)` gives the row indices `idx` of the next batch,
#   reshuffled at every epoch from the seed. `data.batch(idx, cfg.train_on_prompt)` gives
#   `x, y, mask`; the weights are `data.weights[idx]`, or `None` when `data.weights` is
#   `None`.
# * `model.train()` first; then each step, **in this order**: every group's `"lr"` set to
#   `lr_schedule(step, cfg)`; the next batch; `answer_loss(model(x), y, mask, w)`;
#   `opt.zero_grad(set_to_none=True)`; `backward()`;
#   `clip_grads(params, cfg.grad_clip_value, cfg.grad_clip)`; `opt.step()`.
#
# The order is part of the specification: the tests train a copy of the model with the same
# config (a loop of PyTorch's AdamW and clipping; `minituner.train` in the hidden tests) and
# compare every step's loss and every parameter at the end.
# (`minituner.train` does more — a NaN guard, validation, logging, checkpoints, the MoE
# auxiliary loss, which is 0 for these dense models — none of which changes the numbers.)
#
# Off-limits: `minituner.train` and everything in the module `minituner.trainer` (the tests
# switch them off while your loop runs): use your `answer_loss`, `lr_schedule` and
# `clip_grads`.
#
# **Why two groups.** Decaying a norm gain pulls it towards 0, i.e. shrinks a whole layer's
# output; weight decay is meant for matrices. **Why `BatchOrder`.** It is what makes your
# run comparable to the reference, batch for batch.
#
# <details><summary>Hint 1: the idea</summary>
#
# Everything the loop needs already exists: your three functions, `BatchOrder`,
# `SequenceData.batch` and `torch.optim.AdamW`, which accepts a list of dicts (one per
# group, each with its own `"params"` and `"weight_decay"`). The learning rate of a group is
# the entry `group["lr"]` of `opt.param_groups`, and you may change it before each
# `opt.step()`. When the losses differ from the first step, look at the data side (batch
# order, mask, weights); when they agree at first and drift later, at the update side.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# params = [p for p in model.parameters() if p.requires_grad];  none -> ValueError
# opt    = AdamW([{params: the ≥2-D ones, weight_decay: cfg.weight_decay},
#                 {params: the 1-D ones,  weight_decay: 0.0}], lr=cfg.lr, betas=cfg.betas)
# order  = BatchOrder(len(data), cfg.batch_size, cfg.seed)
# model.train();  losses = []
# for step in 0 .. cfg.steps-1:
#     for group in opt.param_groups: group["lr"] = lr_schedule(step, cfg)
#     idx = next(order)
#     x, y, mask = data.batch(idx, cfg.train_on_prompt)
#     w = None if data.weights is None else data.weights[idx]
#     loss = answer_loss(model(x), y, mask, w)
#     opt.zero_grad(set_to_none=True);  loss.backward()
#     clip_grads(params, cfg.grad_clip_value, cfg.grad_clip);  opt.step()
#     losses.append(loss.item())
# return losses
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "train_loop", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_loop(model: nn.Module, data: SequenceData, cfg: TrainConfig) -> list[float]:
    """AdamW on model's trainable parameters, as minituner.train does; the loss of each step."""
    ### BEGIN SOLUTION
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (all requires_grad=False)")
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas)
    order = BatchOrder(len(data), cfg.batch_size, cfg.seed)
    model.train()
    losses = []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_schedule(step, cfg)
        idx = next(order)
        x, y, mask = data.batch(idx, cfg.train_on_prompt)
        w = None if data.weights is None else data.weights[idx]
        loss = answer_loss(model(x), y, mask, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_grads(params, cfg.grad_clip_value, cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_train_loop", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
import dataclasses


def _torch_train(model, data, cfg, lrs=None, zero_grad=True, one_group=False):
    """The specification's loop built from PyTorch's own pieces: torch.optim.AdamW, the
    learning rates of _torch_lrs (PyTorch's schedulers), the per-row loss loop _loop_loss,
    clip_grad_value_ + clip_grad_norm_. The other arguments make the usual slips (a list of
    learning rates per step, no zero_grad, one AdamW group). Returns the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": params, "weight_decay": cfg.weight_decay}] if one_group else [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)
    lrs = _torch_lrs(cfg) if lrs is None else lrs
    order = BatchOrder(len(data), cfg.batch_size, cfg.seed)
    model.train()
    losses = []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        idx = next(order)
        x, y, mask = data.batch(idx, cfg.train_on_prompt)
        loss = _loop_loss(model(x), y, mask, None if data.weights is None else data.weights[idx])
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        _torch_clip(params, cfg.grad_clip_value, cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses


def _loop_slips(cfg, data):
    """(rule, config changes, data, _torch_train options) of the usual slips."""
    lrs = _torch_lrs(cfg, cfg.steps + 1)
    slips = [
        ("the learning rate never changes: set every group's lr to lr_schedule(step, cfg) "
         "before each step", {}, data, {"lrs": [cfg.lr] * cfg.steps}),
        ("the learning rate is one step ahead: step s (counting from 0) uses "
         "lr_schedule(s, cfg)", {}, data, {"lrs": lrs[1:]}),
        ("the learning rate is set after opt.step(): set it before", {}, data,
         {"lrs": [cfg.lr] + lrs[:-2]}),
        ("gradients accumulate over the steps: opt.zero_grad(set_to_none=True) before each "
         "backward()", {}, data, {"zero_grad": False}),
        ("no clipping: clip_grads(params, cfg.grad_clip_value, cfg.grad_clip) between "
         "backward() and opt.step()", {"grad_clip": 0.0, "grad_clip_value": 0.0}, data, {}),
        ("weight decay on every tensor: the 1-D ones (norm gains, biases) go in a group with "
         "weight_decay 0.0", {}, data, {"one_group": True}),
        ("no weight decay: the group of 2-D tensors gets cfg.weight_decay",
         {"weight_decay": 0.0}, data, {})]
    if data.weights is not None:
        slips.append(("the example weights are ignored: w = data.weights[idx]", {},
                      dataclasses.replace(data, weights=None), {}))
    if cfg.train_on_prompt:
        slips.append(("cfg.train_on_prompt is ignored: data.batch(idx, cfg.train_on_prompt)",
                      {"train_on_prompt": False}, data, {}))
    return slips


def _loop_rule(make_model, data, cfg, got, rng_seed):
    """The rule your losses break, when they are those of a usual slip (else '')."""
    for rule, changes, variant_data, options in _loop_slips(cfg, data):
        if rng_seed is not None:
            torch.manual_seed(rng_seed)
        want = _torch_train(make_model(), variant_data, dataclasses.replace(cfg, **changes),
                            **options)
        if all(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6) for g, w in zip(got, want,
                                                                               strict=True)):
            return f"\nLikely: {rule}."
    return ""


def _check_loop(make_model, data, what="", rng_seed=None, with_ref=False, **kw):
    cfg = TrainConfig(**{"steps": 8, "batch_size": 6, "lr": 1e-2, "warmup_steps": 2,
                         "log_every": 1, "progress": False, **kw})
    where = f"{what}{len(data)} examples{', weighted' if data.weights is not None else ''}, " \
            f"steps={cfg.steps}, batch={cfg.batch_size}, lr={cfg.lr}, " \
            f"weight_decay={cfg.weight_decay}, grad_clip={cfg.grad_clip}, " \
            f"grad_clip_value={cfg.grad_clip_value}, train_on_prompt={cfg.train_on_prompt}"
    local, ref = make_model(), make_model()
    start = {n: p.detach().clone() for n, p in local.named_parameters()}
    trainable = {n for n, p in local.named_parameters() if p.requires_grad}
    mine = share(local)                 # your loop trains it in place: read it back after
    if rng_seed is not None:            # LoRA dropout: the same masks in every run
        torch.manual_seed(rng_seed)
    want = _torch_train(ref, data, cfg)
    if with_ref:
        ref2 = make_model()
        if rng_seed is not None:
            torch.manual_seed(rng_seed)
        want2 = minituner.train(ref2, data, cfg).losses
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
                   for a, b in zip(want, want2, strict=True)), (want, want2)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    with _forbid_reference():
        got = train_loop(mine, data, cfg)
    assert isinstance(got, list) and len(got) == cfg.steps and all(
        isinstance(v, float) for v in got), \
        f"{where}: expected a list of {cfg.steps} floats (loss.item() of each step), got " \
        f"{type(got).__name__} of length {len(got) if hasattr(got, '__len__') else '?'}"
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        if not math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6):
            hint = ("the loss before any update differs: the batch order (BatchOrder with "
                    "cfg.seed), the batch's mask/weights or the loss itself"
                    if step == 0 else
                    "the first steps agree, then the updates differ: the schedule (set each "
                    "group's lr before the step), clipping, weight decay or the AdamW groups")
            raise AssertionError(f"{where}: the loss of step {step} is {g:.6f}, the "
                                 f"specification's loop (built from torch.optim.AdamW, "
                                 f"PyTorch's schedulers and clipping) gives {w:.6f}; {hint}.\n"
                                 f"yours: {[round(v, 5) for v in got]}\n"
                                 f"ref:   {[round(v, 5) for v in want]}"
                                 f"{_loop_rule(make_model, data, cfg, got, rng_seed)}")
    for (n, p), q in zip(list(mine.named_parameters()), ref.parameters(), strict=True):
        if n not in trainable:
            assert torch.equal(p, start[n]), f"{where}: the frozen parameter {n} changed"
            continue
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=n, p=p: (
            f"{where}: after training, {n} ({p.dim()}-D) differs from the specification's "
            f"loop's" + (" (no weight decay on 1-D tensors)" if p.dim() < 2 else "")
            + f"\n{m}"))
        if with_ref:
            torch.testing.assert_close(p.detach(), dict(ref2.named_parameters())[n].detach(),
                                       rtol=1e-4, atol=1e-5)


def _weighted(data, weights):
    """`data` with the example weights worked out by hand (what make_data(..., rewards)
    computes with the reference's reward_weights)."""
    return dataclasses.replace(data, weights=torch.tensor(weights, dtype=torch.float64).float())


_loop_data = make_data(tasks.make_mixture(["sort", "copy"], 8, seed=2))   # 16 rows: 2 epochs
_check_loop(small_gpt, _loop_data)
# reward-weighted data (some weights 0), the prompt scored too
# rewards i % 4: [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], minimum 0, mean 13/10: weights r / 1.3
_check_loop(small_gpt, _weighted(make_data(tasks.make_mixture(["add", "kv"], 5, seed=6)),
                                 [(i % 4) / 1.3 for i in range(10)]),
            what="weighted, train_on_prompt: ", steps=5, batch_size=4, train_on_prompt=True)
try:
    with _forbid_reference():
        train_loop(small_gpt().requires_grad_(False), _loop_data,
                   TrainConfig(steps=1, progress=False))
except ValueError:
    pass
except Exception as _e:
    raise AssertionError(f"train_loop on a model without trainable parameters raised "
                         f"{type(_e).__name__}: {_e}\nRule: raise ValueError when no parameter "
                         "has requires_grad") from _e
else:
    raise AssertionError("train_loop on a model without trainable parameters returned; rule: "
                         "raise ValueError when no parameter has requires_grad")
print("train_loop: every step's loss and every final weight as the specification's loop, "
      "built from torch.optim.AdamW and PyTorch's schedulers and clipping")

### BEGIN HIDDEN TESTS
# case: the hidden cases' own setup
def _small_lora(seed=0, dropout=0.0):
    m = small_gpt(seed)
    torch.manual_seed(seed + 100)
    minituner.wrap_lora(m, ["q_proj", "v_proj", "down_proj"], r=4, alpha=8.0, dropout=dropout)
    return m


# case: LoRA on a frozen base
_check_loop(_small_lora, _loop_data, with_ref=True, what="hidden (LoRA): ", lr=3e-2)
# case: reward-weighted data, some weights 0
_wd = make_data(tasks.make_mixture(["add", "kv"], 7, seed=3),
                rewards=[float(i % 3) for i in range(14)])
_check_loop(small_gpt, _wd, with_ref=True, what="hidden: ", steps=7, batch_size=4)
# case: both clipping stages, a strong weight decay, other betas
_check_loop(small_gpt, _loop_data, with_ref=True, what="hidden: ", grad_clip_value=2e-3,
            grad_clip=0.5, weight_decay=0.5, betas=(0.8, 0.9))
# case: train_on_prompt, no warm-up
_check_loop(lambda: small_gpt(1), _loop_data, with_ref=True, what="hidden: ",
            train_on_prompt=True, warmup_steps=0, steps=5)
# case: a batch larger than the data set
_check_loop(small_gpt, make_data(tasks.make_examples("count", 5, seed=4)), with_ref=True,
            what="hidden: ", batch_size=8, steps=4)
# case: LoRA dropout, the RNG seeded before each run
_check_loop(lambda: _small_lora(2, dropout=0.2), _loop_data, with_ref=True,
            what="hidden (LoRA dropout): ", rng_seed=0, steps=4)
# case: nothing to train
_frozen = small_gpt().requires_grad_(False)
try:
    train_loop(_frozen, _loop_data, TrainConfig(steps=2, progress=False))
except ValueError:
    pass
else:
    raise AssertionError("hidden: a model without trainable parameters should raise ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ## Part E — Exercise 4: exact match with greedy decoding
#
# The loss says how probable the right answer is; **exact match** says whether the model,
# left to itself, produces it. Greedy decoding: feed the prompt, append the most likely next
# token, repeat until the model emits `<eos>` or `max_new_tokens` tokens have come; the answer
# is the generated text before the `<eos>`. The answer is right if it equals the expected one
# exactly.
#
# **Specification.**
#
# * `greedy_answers(model, prompts, max_new_tokens=10) -> list[str]`: `prompts` a list of
#   strings → their greedy answers, decoded, in the order of `prompts`.
#   * The model is in **eval mode** while generating (LoRA dropout, if any, must be off: in
#     training mode every forward draws a new random mask and the "greedy" answer becomes
#     random), and goes back **in the mode it came in** (`model.training`); no gradients
#     (`torch.no_grad()`).
#   * Encode each prompt with `tok` (the `CharTokenizer` above). At each step feed the model
#     at most its **last `model.config.block_size` tokens** (its positions stop there), take
#     the `argmax` of the last position's logits, and stop at `tok.eos_id` or after
#     `max_new_tokens` tokens.
# * `exact_match(model, examples, max_new_tokens=10) -> float`: the fraction of the
#   `tasks.Example`s whose greedy answer equals `ex.answer`; `ValueError` for an empty list.
#
# Off-limits: `minigpt.evaluate`, `minigpt.answers`, `minigpt.greedy_generate`.
#
# <details><summary>Hint 1: the idea</summary>
#
# You may decode the prompts one at a time, or several of equal length together as one
# batch: prompts of the same length need no padding, the answers are the same, and it is
# several times faster. Group the prompt indices by length (a dict of lists), decode each
# group as a `[b, L]` tensor that grows by one column per step, and remember where each row
# came from. `tok.decode` stops at the first `<eos>`, so you can decode everything after the
# prompt. Save `model.training` before `model.eval()` and hand it to `model.train(...)` at
# the end.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# greedy_answers(model, prompts, max_new_tokens):
#     was_training = model.training;  model.eval()
#     group the indices i of prompts by len(prompts[i])
#     with no_grad, for each group:
#         seq  = tensor of tok.encode(prompts[i]) for i in the group         # [b, L]
#         done = all False                                                  # [b]
#         repeat max_new_tokens times:
#             nxt  = argmax of model(seq[:, -block_size:])[:, -1]           # [b]
#             done = done or (nxt == eos);  seq = seq with nxt appended as a column
#             if all done: stop
#         answer of row r = tok.decode(seq[r, after the prompt])
#     model.train(was_training);  return the answers in prompt order
#
# exact_match(model, examples, max_new_tokens):
#     empty -> ValueError
#     got = greedy_answers(model, [ex.prompt ...], max_new_tokens)
#     return (number of got[i] == examples[i].answer) / len(examples)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "exact_match", "locked": false, "schema_version": 3, "solution": true, "task": false}
def greedy_answers(model: nn.Module, prompts: list[str], max_new_tokens: int = 10) -> list[str]:
    """Greedy continuation of each prompt until <eos> (or max_new_tokens), decoded."""
    ### BEGIN SOLUTION
    was_training = model.training
    model.eval()
    block = model.config.block_size
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out = [""] * len(prompts)
    with torch.no_grad():
        for idxs in by_len.values():
            seq = torch.tensor([tok.encode(prompts[i]) for i in idxs])
            done = torch.zeros(len(idxs), dtype=torch.bool)
            for _ in range(max_new_tokens):
                nxt = model(seq[:, -block:])[:, -1].argmax(-1)
                done |= nxt == tok.eos_id
                seq = torch.cat([seq, nxt[:, None]], dim=1)
                if done.all():
                    break
            for row, i in enumerate(idxs):
                out[i] = tok.decode(seq[row, len(prompts[i]):].tolist())   # stops at <eos>
    model.train(was_training)
    return out
    ### END SOLUTION


def exact_match(model: nn.Module, examples, max_new_tokens: int = 10) -> float:
    """Fraction of examples whose greedy answer is exactly ex.answer."""
    ### BEGIN SOLUTION
    if not examples:
        raise ValueError("exact_match needs at least one example")
    got = greedy_answers(model, [ex.prompt for ex in examples], max_new_tokens)
    return sum(g == ex.answer for g, ex in zip(got, examples, strict=True)) / len(examples)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_greedy_answers", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _one_by_one(model, prompts, max_new_tokens=10):
    """Greedy answers the plain way: one prompt at a time, one token per forward (in eval
    mode, without gradients, the last block_size tokens fed), the caller's mode restored."""
    mode = model.training
    model.eval()
    block = model.config.block_size
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, gen = tok.encode(prompt), []
            for _ in range(max_new_tokens):
                nxt = int(model(torch.tensor([(ids + gen)[-block:]]))[0, -1].argmax())
                if nxt == tok.eos_id:
                    break
                gen.append(nxt)
            out.append(tok.decode(gen))
    model.train(mode)
    return out


def _check_answers(model, prompts, max_new_tokens=10, what="", with_ref=False):
    where = f"{what}{len(prompts)} prompts such as {prompts[0]!r}, " \
            f"max_new_tokens={max_new_tokens}, model in {'training' if model.training else 'eval'}" \
            f" mode"
    mode = model.training
    want = _one_by_one(model, prompts, max_new_tokens)
    if with_ref:
        assert want == minigpt.answers(model, prompts, tok, max_new_tokens)
    assert model.training == mode
    model = share(model)                # the model your function sets the mode of
    with _forbid_reference():
        got = greedy_answers(model, prompts, max_new_tokens)
    assert isinstance(got, list) and len(got) == len(prompts), \
        f"{where}: expected a list of {len(prompts)} strings, got {type(got).__name__}"
    bad = [(p, g, w) for p, g, w in zip(prompts, got, want, strict=True) if g != w]
    assert not bad, f"{where}: {len(bad)} answers differ from greedy decoding one prompt at " \
                    f"a time; first ones " \
                    f"(prompt, yours, expected): {bad[:3]}" + (
                        "\nLikely: the answer is the text generated after the prompt, "
                        "without the prompt" if all(isinstance(g, str) and g.startswith(p)
                                                     for p, g, _ in bad) else "")
    assert model.training == mode, \
        f"{where}: the model came in {'training' if mode else 'eval'} mode and left in " \
        f"{'training' if model.training else 'eval'} mode; restore model.training"


_mix = tasks.make_mixture(list(tasks.TASKS), 8, seed=5, split="eval")
_check_answers(base, [ex.prompt for ex in _mix])
# a LoRA model in training mode, with dropout: generate in eval mode, give the mode back
_train_mode = lora_base(seed=1, dropout=0.5)
randomize_lora(_train_mode, seed=4, std=0.1)
_train_mode.train()
try:
    _check_answers(_train_mode, [ex.prompt for ex in _mix[::4]],
                   what="LoRA dropout 0.5, training mode: ")
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: model.eval() while generating (dropout off), then "
                         "model.train(was_training)") from _e
# prompt + answer longer than block_size (32): feed the last block_size tokens
try:
    _check_answers(base, [f"copy:{'abcdefghijklmnopqrstuvwxyz'[:n]}=" for n in (22, 26)],
                   max_new_tokens=12, what="longer than block_size: ")
except ValueError as _e:
    raise AssertionError(f"greedy_answers fed the model more than block_size tokens ({_e}); "
                         "rule: feed seq[:, -model.config.block_size:]") from _e
print("greedy_answers: the same answers as one-prompt-at-a-time greedy decoding on",
      len(_mix) + 14, "prompts, "
      "in eval mode, the caller's mode restored, the last block_size tokens fed")

### BEGIN HIDDEN TESTS
# case: a LoRA model with dropout, in training mode
_drop = lora_base(seed=3, dropout=0.5)
with torch.no_grad():
    for _n, _p in _drop.named_parameters():
        if "lora_B" in _n:
            _p.copy_(randn(*_p.shape, seed=len(_n)) * 0.3)
_drop.train()
_check_answers(_drop, [ex.prompt for ex in _mix[:8]], with_ref=True,
               what="hidden (LoRA dropout 0.5): ")
assert _drop.training
# case: answers cut by max_new_tokens
_check_answers(base, [ex.prompt for ex in _mix[:12]], max_new_tokens=2, with_ref=True,
               what="hidden: ")
# case: prompt and answer longer than block_size
_long = [f"copy:{'abcdefghijklmnopqrstuvwxy'[:n]}=" for n in (20, 24, 25)]
_check_answers(base, _long, max_new_tokens=12, with_ref=True,
               what="hidden (longer than block_size): ")
# case: a single prompt
_one = greedy_answers(base, ["add:12+30="])
assert _one == minigpt.answers(base, ["add:12+30="]), f"hidden: one prompt, got {_one}"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_exact_match", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_em(model, task, n, seed, what="", with_ref=False):
    examples = tasks.make_examples(task, n, seed=seed, split="eval")
    right = sum(a == ex.answer for a, ex in zip(_one_by_one(model, [ex.prompt for ex in examples]),
                                                examples, strict=True))
    want = right / n
    if with_ref:
        assert want == minigpt.evaluate(model, task, n=n, seed=seed)
    with _forbid_reference():
        got = exact_match(model, examples)
    assert isinstance(got, float) and math.isclose(got, want, abs_tol=1e-12), \
        f"{what}exact_match on {n} '{task}' eval prompts (seed {seed}): expected {want} " \
        f"({right} right of {n}, greedy answers one prompt at a time), got {got!r}" + (
            "\nLikely: return the fraction of right answers, the count divided by the number "
            "of examples" if isinstance(got, (int, float)) and got == round(want * n) else "")


_check_em(base, "kv", 20, seed=1)
_check_em(base, "rev", 20, seed=1)
try:
    with _forbid_reference():
        exact_match(base, [])
except ValueError:
    pass
except Exception as _e:
    raise AssertionError(f"exact_match(model, []) raised {type(_e).__name__}: {_e}\nRule: "
                         "raise ValueError for an empty list") from _e
else:
    raise AssertionError("exact_match(model, []) returned; rule: raise ValueError for an empty "
                         "list (a fraction of nothing is undefined)")
print("exact_match: the fraction of greedy answers that are right")

### BEGIN HIDDEN TESTS
# case: another task and seed
_check_em(base, "sort", 10, seed=7, with_ref=True, what="hidden: ")
# case: a single example
_check_em(base, "add", 1, seed=2, with_ref=True, what="hidden: ")
# case: an empty list
try:
    exact_match(base, [])
except ValueError:
    pass
else:
    raise AssertionError("hidden: exact_match(model, []) should raise ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ## Part F — The fine-tune: learning `rev`, and what it costs the other tasks
#
# Your loop is the course's loop; from here on we use `minituner.train` itself, for what it
# adds: a **validation** loss every `eval_every` steps (`val_data`, in eval mode, without
# gradients) and an `eval_fn` whose results are logged beside it. First, one check that the
# two agree on the real model (10 steps):

# %% tags=["jupyter-only"]
rev_train = tasks.make_examples(tasks.HELD_OUT, 2000, seed=0)
check_cfg = TrainConfig(steps=10, batch_size=8, lr=5e-3, warmup_steps=5, log_every=1,
                        progress=False)
t0 = time.perf_counter()
yours = train_loop(lora_base(), make_data(rev_train), check_cfg)
theirs = minituner.train(lora_base(), make_data(rev_train), check_cfg).losses
print(f"your loop, 10 steps in {time.perf_counter() - t0:.1f} s (both runs); "
      f"max |loss difference| vs minituner.train: "
      f"{max(abs(a - b) for a, b in zip(yours, theirs, strict=True)):.1e}")

# %% [markdown]
# Two runs, same seed, same 120 steps of 16 (`RUN_CFG` above), LoRA r=8 on every projection:
#
# * **rev only**: 2000 `rev` examples;
# * **rev + replay**: the same, plus 200 examples of each of the five pretraining tasks,
#   shuffled in (a third of the data).
#
# Validation: the loss on 100 `rev` prompts of the eval split (is the new task being
# learned?) and on 20 eval prompts of each old task (is the old knowledge kept?), and exact
# match on `rev` with your `exact_match`. Greedy decoding stops one token after the longest
# expected answer of the prompts it scores (`answer_budget`: 7 tokens for `rev`, 2 for
# `kv`): a longer answer is wrong anyway, so the scores are those of `max_new_tokens=10`, and
# a model that has forgotten a task and never emits `<eos>` costs fewer forward passes.

# %% tags=["jupyter-only"]
old_val = make_data(tasks.make_mixture(tasks.PRETRAIN_TASKS, 20, seed=0, split="eval"))
rev_em_examples = rev_eval[:50]


def answer_budget(examples) -> int:
    """Tokens enough to produce any right answer: the longest expected one, then <eos>."""
    return max(len(ex.answer) for ex in examples) + 1


def eval_fn(m):
    return {"old_tasks_loss": minituner.mean_loss(m, old_val),
            "rev_exact_match": exact_match(m, rev_em_examples, answer_budget(rev_em_examples))}


eval_sets = {t: tasks.make_examples(t, EVAL_N, seed=0, split="eval") for t in tasks.TASKS}


RUNS = {"rev only": rev_train,
        "rev + replay": rev_train + tasks.make_mixture(tasks.PRETRAIN_TASKS, 200, seed=1)}
results, after = {}, {}
for name, examples in RUNS.items():
    m = lora_base()
    t0 = time.perf_counter()
    results[name] = minituner.train(m, make_data(examples), RUN_CFG, eval_fn=eval_fn,
                                    val_data=rev_val)
    after[name] = {t: exact_match(m, exs, answer_budget(exs)) for t, exs in eval_sets.items()}
    if name == "rev + replay":
        with tempfile.TemporaryDirectory() as d:
            minituner.save_adapter(m, d)
            kb = (Path(d) / "adapter_model.safetensors").stat().st_size / 1024
    print(f"{name:<13} {len(examples)} examples, {time.perf_counter() - t0:.1f} s; "
          f"train loss {results[name].losses[0]:.2f} -> {results[name].final_loss:.3f}")
print(f"the adapter on disk (PEFT format): {kb:.0f} KB")

# %% tags=["jupyter-only"]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
for (name, res), color in zip(results.items(), ("C0", "C1"), strict=True):
    steps = [RUN_CFG.log_every * (i + 1) for i in range(len(res.losses))]
    ev_steps = [e["step"] for e in res.evals]
    axes[0].plot(steps, res.losses, color=color, label=f"{name}: train")
    axes[0].plot(ev_steps, [e["val_loss"] for e in res.evals], "o--", color=color,
                 label=f"{name}: validation (rev)")
    axes[1].plot([0] + ev_steps, [minituner.mean_loss(base, old_val)]
                 + [e["old_tasks_loss"] for e in res.evals], "o-", color=color, label=name)
    axes[2].plot([0] + ev_steps, [before["rev"]] + [e["rev_exact_match"] for e in res.evals],
                 "o-", color=color, label=name)
axes[0].set(yscale="log", xlabel="step", ylabel="loss (answer tokens)",
            title="train and validation loss")
axes[1].set(yscale="log", xlabel="step", ylabel="loss", title="validation loss, old tasks")
axes[2].set(xlabel="step", ylabel="exact match", ylim=(-0.02, 1.02),
            title="greedy exact match on rev")
for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% tags=["jupyter-only"]
print(f"{'task':<16} {'base':>6} " + " ".join(f"{n:>13}" for n in after))
for t in tasks.TASKS:
    label = f"{t} (held out)" if t == tasks.HELD_OUT else t
    print(f"{label:<16} {before[t]:>6.2f} " + " ".join(f"{after[n][t]:>13.2f}" for n in after))

fig, ax = plt.subplots(figsize=(9, 3.4))
task_names = list(tasks.TASKS)
pos = torch.arange(len(task_names)).float()
for k, (label, em) in enumerate((("base", before), *after.items())):
    bars = ax.bar(pos + (k - 1) * 0.27, [em[t] for t in task_names], width=0.27, label=label)
    ax.bar_label(bars, labels=[f"{em[t]:.2f}" for t in task_names], fontsize=6)
ax.set_xticks(pos, task_names)
ax.set(ylabel=f"exact match ({EVAL_N} eval prompts)", ylim=(0, 1.3),
       title="Before and after LoRA fine-tuning on rev: forgetting, and replay against it")
ax.legend(fontsize=8, loc="upper center", ncol=3)
plt.show()

# %% [markdown]
# Training on `rev` alone teaches it — and wrecks the other tasks. Nothing in the loss asks the
# adapter to keep the old behaviour, and a rank-8 update on every projection is plenty to
# overwrite it: the validation loss on the old tasks climbs while the one on `rev` falls. A
# third of the data spent on the old tasks keeps most of them for the same number of steps
# (`add`, `copy` and `count` stay at 0.84–0.96, `kv` near its base; `sort` slips to 0.71,
# against 0.05 without replay); `rev` is learned more slowly, since it gets two thirds of the
# examples. (A
# frozen base does **not** protect you from forgetting: the base's weights are untouched, but
# the model you run is base + adapter. Removing the adapter restores the old tasks — and
# forgets `rev`.) The full run, `experiments/05-lora-finetune` (300 steps of 64, 400 replay
# examples a task, 200 eval prompts a task), tells the same story with the adapters trained to
# the end: its `REPORT.md` has the table.
#
# ## Part G — Interrupted and resumed; activations traded for compute
#
# **Resuming.** A long run must survive an interruption. With `save_every` and `out_dir`,
# `minituner.train` saves a resumable state (the trainable parameters, AdamW's moments, the
# RNG states and the batch order's position, the results so far) as safetensors + JSON;
# `resume=` continues from it. Below, a run is "killed" after 12 steps (`stop_after`; its last
# checkpoint is at step 10, so steps 11–12 are lost and redone), and resumed on a **fresh
# model with other random LoRA factors**. LoRA dropout is on, so the RNG state matters too.

# %% tags=["jupyter-only"]
small_rev = make_data(rev_train[:256])
with tempfile.TemporaryDirectory() as d:
    cfg_a = TrainConfig(steps=20, batch_size=4, lr=5e-3, warmup_steps=4, log_every=5,
                        progress=False, save_every=5, out_dir=f"{d}/a")
    cfg_b = TrainConfig(**{**cfg_a.__dict__, "out_dir": f"{d}/b"})
    whole = lora_base(seed=0, dropout=0.1)
    res_whole = minituner.train(whole, small_rev, cfg_a)
    interrupted = lora_base(seed=0, dropout=0.1)
    minituner.train(interrupted, small_rev, cfg_b, stop_after=12)
    resumed = lora_base(seed=99, dropout=0.1)                 # other random lora_A
    res_resumed = minituner.train(resumed, small_rev, cfg_b, resume=f"{d}/b/checkpoint")
same = all(torch.equal(p, q) for (n, p), q in zip(whole.named_parameters(),
                                                  resumed.parameters(), strict=True))
print("every parameter bit-identical to the uninterrupted run:", same)
print("losses identical:", res_whole.losses == res_resumed.losses, [round(v, 4)
                                                                      for v in res_whole.losses])

# %% [markdown]
# **Gradient checkpointing.** The backward pass needs activations that the forward computed;
# keeping them all costs memory proportional to layers × batch × sequence length. With
# `checkpoint_every=k`, the model keeps only the input of each segment of `k` blocks and
# recomputes the segment's activations during the backward: about one more forward pass of
# compute, for a fraction of the memory. `minituner.saved_activation_bytes` counts what a
# forward leaves allocated for the backward (a ledger of storages, not a noisy RSS sample):

# %%
x_act = make_data(tasks.make_examples(tasks.HELD_OUT, 2000, seed=0)[:16]).batch(torch.arange(16))[0]
act_model = lora_base().train()
saved = {}
for every in (0, 1, 2, 4):
    act_model.set_gradient_checkpointing(every)
    saved[every] = minituner.saved_activation_bytes(act_model, x_act)
act_model.set_gradient_checkpointing(0)
grads = {}
for every in (0, 1):
    act_model.zero_grad(set_to_none=True)
    act_model.set_gradient_checkpointing(every)
    F.cross_entropy(act_model(x_act).flatten(0, 1), x_act.flatten()).backward()
    grads[every] = [p.grad.clone() for p in act_model.parameters() if p.requires_grad]
act_model.set_gradient_checkpointing(0)
print("gradients with and without checkpointing torch.equal:",
      all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True)))
for every, b in saved.items():
    print(f"checkpoint_every={every}: {b / 1024:8.1f} KB saved for backward"
          + (f"  ({saved[0] / b:.1f}x less)" if every else "  (off)"))
B, T = x_act.shape
boundary = B * T * act_model.config.n_embd * 4
print(f"one [B, T, C] = {list(x_act.shape) + [act_model.config.n_embd]} float32 tensor: "
      f"{boundary / 1024:.0f} KB; every=1 minus every=2: {(saved[1] - saved[2]) / boundary:.2f} "
      f"of them, every=2 minus every=4: {(saved[2] - saved[4]) / boundary:.2f}")

fig, ax = plt.subplots(figsize=(6, 3.2))
labels = ["off" if e == 0 else f"every {e}" for e in saved]
bars = ax.bar(labels, [b / 1024 for b in saved.values()])
ax.bar_label(bars, labels=[f"{b / 1024:.0f} KB" for b in saved.values()], fontsize=8)
ax.set(ylabel="activation KB held for backward",
       title=f"Gradient checkpointing, batch {tuple(x_act.shape)}, 4 blocks + LoRA")
plt.show()

# %% [markdown]
# Each segment's input that is kept costs one `[B, T, C]` tensor: `every=1` keeps four of
# them, `every=2` two, `every=4` (one segment) one — the differences between the bars are
# exactly two such tensors and one; what stays on top of them belongs to the final norm and the
# `lm_head`, outside the checkpointed blocks. Everything inside a segment is recomputed
# during the backward, which gives the very same gradients. For MiniGPT this is kilobytes;
# for a 7B model at a 4096-token context the activations, not the weights, are what overflow
# a GPU, and Lab 06 and the capstone turn it on.
#
# ## Where this goes next
#
# You have written the loop that fine-tunes: the masked, reward-weighted loss, the schedule,
# clipping, AdamW with the right groups, and the evaluation that says whether it worked. Lab 06
# runs the same loop over an **NF4** base (QLoRA) and measures the memory; the capstone (Lab
# 11) uses reward-weighted SFT on an MoE model.
#
# ### Reflection
#
# 1. With every weight equal to 1, $L_w$ (mean of per-example means) and $L$ (token mean)
#    differ. In a batch with one 2-token answer and one 8-token answer, how much does each
#    token of the short answer count under each? Which would you use for plain SFT, and why
#    does the course keep `weights=None` for it?
# 2. $w_i = (r_i - \min r)/\operatorname{mean}(r - \min r)$ depends on the *whole* data set.
#    What happens to the weights if one example with a very low reward is added? Propose a
#    normalisation that is robust to that, and say what it costs.
# 3. The run on `rev` alone drives `add` from 1.0 to near 0 although the base weights never
#    change. Where, exactly, did the old skill go? What would removing the adapter do?
# 4. Replay spent a third of each batch on old tasks. Name two other ways to limit forgetting
#    with LoRA (think of the rank, the targets, the learning rate, or the loss), and how you
#    would measure each in this notebook.
# 5. Clipping by global norm after an element-wise clamp: construct a gradient for which the
#    order (clamp then norm, or norm then clamp) changes the result, and say which order keeps
#    more of the useful signal.
# 6. The resumed run is bit-identical. List everything the checkpoint must hold for that
#    (with LoRA dropout on), and say which item, if forgotten, would still give a run that
#    *looks* fine.

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. Ten scored tokens in all. Under $L$ every token weighs $1/10$, so the short answer's two
#    tokens carry 20 % of the loss. Under $L_w$ each example's mean counts $1/2$: a token of
#    the short answer weighs $1/2 \cdot 1/2 = 1/4$, one of the long answer $1/16$, and the
#    short example carries 50 %. Plain SFT is maximum likelihood of the data's tokens, which
#    is the token mean, the arithmetic of pretraining and of experiment 00's manifest; with
#    `weights=None` the loop keeps exactly that, while passing all-ones weights would
#    silently change the objective (the two differ, as the hidden test of `answer_loss`
#    checks).
# 2. The minimum drops, so every shifted reward grows by the same amount and the weights
#    crowd towards 1: with the noisy-labels cell's 0/1 rewards plus one example at −10, the
#    accepted examples get about 1.03 and the rejected ones about 0.94 instead of 1.43 and 0,
#    so the run would behave almost like plain SFT (0.18 exact match on `rev` there, against
#    0.60 with the proper weights). Robust alternatives: weights from ranks or quantiles, clipping
#    rewards at a low percentile before the shift, or normalising within groups of answers to
#    the same prompt (GRPO's advantages, Lab 12). Ranks throw away how much better an answer
#    is; clipping needs a threshold; groups need several samples per prompt.
# 3. In the adapter. The model that runs is $W + s\,BA$ on every projection, and 120 steps of
#    gradients from `rev` alone moved $s\,BA$ wherever that helped `rev`, with nothing asking
#    it to keep `add` working: `add` 1.00 → 0.01, `count` 1.00 → 0.00. $W$ never changed, so
#    removing (or disabling) the adapter gives back the base exactly: `add`, `copy`, `count`
#    1.00, `sort` 0.99, `kv` 0.47, and `rev` back to 0.03.
# 4. (a) Less capacity to overwrite: a smaller rank or fewer targets (only `q_proj`/`v_proj`,
#    or `freeze_layers` on the early blocks); re-run the rev-only run with, say, `r=2` or two
#    targets and compare the after table and the old-tasks validation curve. (b) A lower
#    learning rate or early stopping: read off the three curves the step where `rev` exact
#    match is high before the old-tasks loss has climbed. (c) A term in the loss that pulls
#    towards the base, e.g. a KL to the base's next-token distribution on old-task prompts,
#    measured with the same `eval_fn`. Each costs something on `rev`; the table shows how
#    much.
# 5. Take $g = [10, 0.1, 0.1, 0.1]$, `max_value = 1`, `max_norm = 1`. Clamp first: $[1, 0.1,
#    0.1, 0.1]$, norm 1.015, scaled by 0.985 to $[0.985, 0.099, 0.099, 0.099]$. Norm first:
#    the norm is 10.0, everything is scaled by 0.1 to $[1.0, 0.01, 0.01, 0.01]$ and the clamp
#    no longer bites. Clamping first keeps ten times more of the three ordinary elements
#    (the clipping plot shows the same: the other elements keep their size when the outlier
#    is clamped first); the outlier is bounded either way.
# 6. The trainable parameters, AdamW's state (both moments and the step count, which drives
#    the bias correction), the torch RNG state (the dropout masks), the batch order (the
#    epoch's permutation, its seed and the position in it), the step (for the learning-rate
#    schedule), the results and the partial log window so far, and fingerprints of the config
#    and the data so that resuming a different run is refused. Forgetting the RNG state gives
#    a run that looks fine: other dropout masks, losses within noise of the uninterrupted
#    run and the same final quality, but not bit-identical, which only a comparison like
#    Part G's reveals.
