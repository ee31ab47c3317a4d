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
# # Lab 00 — Setup: MiniGPT, the task suite, and four building blocks
#
# Every later lab in this course quantizes, adapts or routes **one small model on one small
# set of problems**. This lab shows you both before you change anything, and has you rebuild
# four pieces that the rest of the course leans on:
#
# | # | you write | used again in |
# |---|---|---|
# | 1 | `causal_attention(q, k, v)`: masked attention | every forward pass; LoRA (Lab 04) |
# | 2 | `encode(text)` / `decode(ids)`: the tokenizer | every prompt and every answer |
# | 3 | `make_training_pair(...)`: prompt-masked pairs | fine-tuning (Labs 05, 06, 11) |
# | 4 | `state_dict_sha256(sd)`: a weights fingerprint | every experiment manifest |
#
# **How to work.** Run the cells from top to bottom. Where you see
# `raise NotImplementedError()`, replace it with your code. Each exercise is followed by a
# test cell: run it, and if it fails, read the message — it says what was expected and what
# your code returned. The test cells you see are not all of the tests: grading runs more
# (hidden) checks of the same specification, so make your function right, not just green.
# Nothing here trains a model, and nothing needs a GPU: the whole notebook
# runs in <!-- runtime:00-setup-minigpt -->about 5 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.
#
# Each exercise states its **specification** first: the inputs, the output, the rules that
# matter and what is off-limits. That is enough to solve it. Below it, folded **hints** go
# from the idea to pseudocode; open them when you want them, one at a time.

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
import hashlib
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import labkit
import minigpt
from course.notebook.bridged import in_learner, share
from course.notebook.harness import forbid
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks
from minigpt.tokenizer import ALPHABET
from minituner import SequenceData

# MiniGPT is tiny: its matrix products are too small to gain from several CPU threads, and on a
# busy machine the threads mostly wait for each other (we measured 10-20x slower). One is enough.
torch.set_num_threads(1)
torch.manual_seed(0)
print("torch", torch.__version__, "| threads:", torch.get_num_threads())

# %% [markdown]
# ## Part A — A tour
#
# ### A.1 The synthetic task suite
#
# Each task turns a random generator into a `(prompt, answer)` pair. The prompt names the task,
# gives the input, and ends with `=`; the model must then write the answer and stop by writing
# the end-of-sequence token `<eos>`. Answers are scored by **exact match**, so "did it work?" is
# never a matter of taste.
#
# `tasks.TASKS` maps each task name to its generator, and `tasks.make_examples(task, n, seed,
# split)` returns `n` examples. One task, `tasks.HELD_OUT`, was left out when the base model was
# pretrained: it is the skill the fine-tuning labs will teach.

# %%
print("held-out task:", tasks.HELD_OUT)
print("pretraining tasks:", tasks.PRETRAIN_TASKS)
print()
for name in tasks.TASKS:
    for ex in tasks.make_examples(name, 2, seed=0):
        print(f"{name:>6}   prompt {ex.prompt!r:<24} answer {ex.answer!r}")

# %% [markdown]
# ### A.2 The train / eval split is decided by a hash of the prompt
#
# The generators draw from small spaces (there are only 10 000 additions of two numbers below
# 100), so a prompt used in training could easily turn up again at evaluation time, and a
# model that memorised it would look cleverer than it is. To prevent that, `tasks.split_of`
# hashes the prompt text with sha256 and sends a fixed 20 % of all possible prompts to `"eval"`
# and the rest to `"train"`. `make_examples(..., split="eval")` keeps drawing until it has `n`
# prompts of that split.
#
# Because the split depends only on the text, it does not matter which seed or which lab
# generated a prompt: it always lands on the same side. The cell below checks that the two
# sides never share a prompt, and that lists are reproducible from `(task, seed, split)`.

# %%
for name in tasks.TASKS:
    train_prompts = {ex.prompt for ex in tasks.make_examples(name, 500, seed=0, split="train")}
    eval_prompts = {ex.prompt for ex in tasks.make_examples(name, 200, seed=0, split="eval")}
    shared = train_prompts & eval_prompts
    print(f"{name:>6}: {len(train_prompts):3d} distinct train prompts, "
          f"{len(eval_prompts):3d} distinct eval prompts, shared: {len(shared)}")
    assert not shared

assert tasks.make_examples("add", 5, seed=7) == tasks.make_examples("add", 5, seed=7)

# All 10 000 possible addition prompts: which share goes to eval?
every_add = [f"add:{a}+{b}=" for a in range(100) for b in range(100)]
eval_adds = [p for p in every_add if tasks.split_of(p) == "eval"]
print(f"\n{len(eval_adds)} of {len(every_add)} addition prompts are eval-only "
      f"({len(eval_adds) / len(every_add):.1%}), e.g. {eval_adds[:3]}")

# %% [markdown]
# ### A.3 The character tokenizer
#
# MiniGPT reads characters. `CharTokenizer` gives id 0 to padding (`<pad>`), id 1 to
# end-of-sequence (`<eos>`), and ids 2, 3, … to the characters of a fixed alphabet, in order.
# A fixed alphabet means every checkpoint in the course shares one vocabulary. You will
# rebuild this in Exercise 2.

# %%
tok = CharTokenizer()
print("alphabet:", repr(ALPHABET), "| vocab_size:", tok.vocab_size)

# %% tags=["jupyter-only"]
ids = tok.encode("add:12+7=")
print("encode('add:12+7=') ->", ids)
print("decode(...)         ->", repr(tok.decode(ids + [tok.eos_id] + tok.encode("ignored"))))

# %% [markdown]
# ### A.4 The model
#
# `MiniGPTConfig` is a dataclass; `MiniGPT(config)` builds a small Llama-style decoder:
# token and position embeddings, `n_layer` blocks of (RMSNorm → causal self-attention →
# residual, RMSNorm → SwiGLU MLP → residual), a final RMSNorm and a linear head over the
# vocabulary. The projection names (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
# `up_proj`, `down_proj`) are the same as in Hugging Face's Llama and Mixtral, so the
# patterns you will write to pick LoRA targets here would work on those models too. Setting
# `n_experts > 0` swaps every MLP for a Mixture-of-Experts layer (Labs 07–11).

# %%
cfg = MiniGPTConfig()
print(cfg)
model = MiniGPT(cfg)
print(model)

# %% [markdown]
# Where are the parameters? With width $C$ = `n_embd`, MLP width $F$ = `d_ff` and vocabulary
# $V$, each block holds $4C^2$ attention weights, $3CF$ MLP weights and two norm gains of size
# $C$. The cell below counts them both ways.

# %%
C, Fw, V, L = cfg.n_embd, cfg.d_ff, cfg.vocab_size, cfg.n_layer
groups = {"embeddings (tok + pos)": 0, "attention": 0, "mlp": 0, "norms": 0, "lm_head": 0}
for name, p in model.named_parameters():
    if name.startswith(("tok_emb", "pos_emb")):
        groups["embeddings (tok + pos)"] += p.numel()
    elif ".attn." in name:
        groups["attention"] += p.numel()
    elif ".mlp." in name:
        groups["mlp"] += p.numel()
    elif "norm" in name:
        groups["norms"] += p.numel()
    else:
        groups["lm_head"] += p.numel()
for group, count in groups.items():
    print(f"{group:<24}{count:>10,d}")
print(f"{'total':<24}{model.num_params():>10,d}")

by_formula = (V * C + cfg.block_size * C) + L * (4 * C * C + 3 * C * Fw + 2 * C) + C + C * V
assert by_formula == model.num_params(), (by_formula, model.num_params())

logits = model(torch.randint(0, V, (1, 9)))
print("logits for one sequence of 9 token ids:", tuple(logits.shape), "= [batch, time, vocab]")

# %% [markdown]
# ### A.5 The pretrained base model
#
# Experiment `experiments/00-pretrain-base` pretrained this model on every task except the
# held-out one and saved it as safetensors. `minigpt.load_base("dense")` loads it. (If the
# file is missing, the cell below says where it looked; run
# `make run EXP=experiments/00-pretrain-base` from the course folder to create it.)
#
# `minigpt.evaluate(model, task, n)` generates greedy answers for `n` eval-split prompts and
# returns the fraction that match exactly. Expect high scores on the pretraining tasks and
# a score near zero on the held-out task.

# %%
base = minigpt.load_base("dense").eval()
print(f"base model: {base.num_params():,d} parameters, config {base.config}")

# %% tags=["jupyter-only"]
scores = {name: minigpt.evaluate(base, name, n=50) for name in tasks.TASKS}
for name, acc in scores.items():
    print(f"{name:>6}: {acc:.2f}" + ("   <- held out of pretraining" if name == tasks.HELD_OUT
                                     else ""))

fig, ax = plt.subplots(figsize=(7, 3.5))
colors = ["tab:red" if name == tasks.HELD_OUT else "tab:blue" for name in scores]
bars = ax.bar(list(scores), list(scores.values()), color=colors)
ax.bar_label(bars, fmt="%.2f")
ax.set_ylim(0, 1.1)
ax.set_ylabel("exact match (n = 50, eval split)")
ax.set_title(f"Base MiniGPT per task (red: held-out '{tasks.HELD_OUT}')")
plt.show()

# %% [markdown]
# A few greedy answers, to see what the failures look like:

# %% tags=["jupyter-only"]
for name in tasks.TASKS:
    exs = tasks.make_examples(name, 3, seed=1, split="eval")
    got = minigpt.answers(base, [ex.prompt for ex in exs])
    for ex, g in zip(exs, got, strict=True):
        mark = "ok " if g == ex.answer else "BAD"
        print(f"{mark} {ex.prompt:<22} expected {ex.answer!r:<10} got {g!r}")


# %% [markdown]
# ## Part B — Exercise 1: causal self-attention
#
# For one head, with queries $Q$, keys $K$ and values $V$ of shape $[T, D]$, attention is
#
# $$\mathrm{Attn}(Q, K, V) = \mathrm{softmax}\!\left(\frac{Q K^\top}{\sqrt{D}} + M\right) V,
# \qquad M_{ij} = \begin{cases} 0 & j \le i \\ -\infty & j > i \end{cases}$$
#
# The mask $M$ makes the model **causal**: position $i$ may look at itself and at earlier
# positions, never at later ones. That is what lets one forward pass train on every next-token
# prediction of a sequence at once, and what lets generation append one token at a time.
#
# **Specification.** `causal_attention(q, k, v)` takes `q` and `k` of shape `[B, H, T, D]`
# (batch, heads, time, head size) and `v` of shape `[B, H, T, Dv]`, all of one floating
# dtype, and returns the attention above for every batch element and head: a tensor of shape
# `[B, H, T, Dv]` and of the dtype of `q`. The rules:
#
# * the scores are scaled by $1/\sqrt{D}$ with $D$ = `q.shape[-1]` (not $T$, not `Dv`);
# * the mask is applied **before** the softmax, so that masked weights come out exactly zero
#   and position $i$ sees positions $0 \dots i$, itself included (even when $T = 1$);
# * the softmax is numerically stable: scores in the hundreds must not give `inf` or `NaN`.
#
# Off-limits: `F.scaled_dot_product_attention` (the tests compare you against it, and
# switch it off while your function runs).
#
# <details><summary>Hint 1: the idea</summary>
#
# Everything is batched by `@`: `q @ k.transpose(-2, -1)` gives the `[B, H, T, T]` scores of
# every head at once. The mask is a `[T, T]` boolean matrix, `True` strictly above the
# diagonal (`torch.triu(..., diagonal=1)`; `diagonal=0` would also hide each token from
# itself), which broadcasts over `B` and `H`. Fill the masked scores with `-inf` and the
# softmax turns them into exact zeros. `torch.softmax` subtracts the row maximum for you; a
# hand-written `exp` has to do it itself.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# scores  = q @ transpose(k, -2, -1) / sqrt(D)       # [B, H, T, T]
# future  = ones(T, T) strictly above the diagonal    # bool
# scores  = scores with -inf where future
# weights = softmax(scores, last dim)
# return weights @ v                                  # [B, H, T, Dv]
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "causal_attention", "locked": false, "schema_version": 3, "solution": true, "task": false}
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(D) + causal mask) v for q, k [B, H, T, D] and v [B, H, T, Dv]."""
    ### BEGIN SOLUTION
    T, D = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / D**0.5                       # [B, H, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_causal_attention_matches_sdpa", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_attention(B, H, T, D, Dv=None, dtype=torch.float32, scale=1.0, seed=0, tol=None):
    g = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = scale * torch.randn(B, H, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, T, Dv or D, generator=g, dtype=dtype)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = causal_attention(q, k, v)
    where = f"[B={B}, H={H}, T={T}, D={D}, Dv={Dv or D}, {dtype}]"
    assert isinstance(got, torch.Tensor), f"{where} expected a tensor, got {type(got).__name__}"
    assert got.shape == want.shape, \
        f"{where} expected output shape {tuple(want.shape)}, got {tuple(got.shape)}"
    assert got.dtype == want.dtype, f"{where} expected dtype {want.dtype}, got {got.dtype}"
    stable = " (scores this large overflow exp: a numerically stable softmax subtracts each " \
             "row's maximum first)" if scale > 1 else ""
    assert not got.isnan().any(), f"{where} output has NaN at (b, h, t) = " \
        f"{got.isnan().any(-1).nonzero()[:3].tolist()}...{stable}"
    atol, rtol = tol or (1e-5, 1e-4)
    # A wrong output that is attention with another scale: name the scale.
    for s, why in ((1.0, "not scaled at all"), (1 / D, "scaled by 1/D instead of 1/sqrt(D)"),
                   (T**-0.5, "scaled by 1/sqrt(T), the sequence length"),
                   ((Dv or D)**-0.5, "scaled by 1/sqrt(Dv), the head size of v")):
        other = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s)
        assert torch.allclose(got, want, atol=atol, rtol=rtol) or s == D**-0.5 or \
            not torch.allclose(got, other, atol=atol, rtol=rtol), \
            f"{where} your output is attention with the scores {why}: the scale is " \
            "1/sqrt(D), D = q.shape[-1]"
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                               msg=lambda m: f"{where} differs from F.scaled_dot_product_attention"
                                             f"(..., is_causal=True):\n{m}")


# The weights themselves first: with v = identity, the output is the weight matrix P [T, T].
_g = torch.Generator().manual_seed(7)
_q, _k = torch.randn(1, 1, 5, 4, generator=_g), torch.randn(1, 1, 5, 4, generator=_g)
_P = causal_attention(_q, _k, torch.eye(5).expand(1, 1, 5, 5))[0, 0]
assert not _P[0].isnan().any(), \
    f"the weights of query 0 are {_P[0].tolist()}: every key of its row is masked. Position i " \
    "must see itself: mask only the keys j > i, strictly above the diagonal"
_leak = _P.triu(diagonal=1).abs().max().item()
assert _leak == 0, f"a query puts weight {_leak:.3g} on a later key: the mask must hide every " \
    f"future position, j > i, and nothing else (weights:\n{_P})"
if not torch.allclose(_P.sum(-1), torch.ones(5)):
    raise AssertionError(
        f"the columns of the weights sum to 1, not the rows: take the softmax over the keys, "
        f"the last dim (weights:\n{_P})" if torch.allclose(_P.sum(-2), torch.ones(5)) else
        f"each query's weights should sum to 1, got {_P.sum(-1).tolist()}: apply the mask "
        f"before the softmax (scores of future keys set to -inf), not after it")
_check_attention(2, 3, 5, 7)          # several heads, odd head size
_check_attention(1, 1, 1, 4)          # a single token: it may only attend to itself
_check_attention(1, 4, 16, 8)
_check_attention(2, 2, 6, 5, Dv=3)    # values narrower than queries and keys
_check_attention(1, 2, 5, 3, dtype=torch.float64, seed=1, tol=(1e-12, 1e-10))  # keeps q's dtype
# Scores in the hundreds: exp overflows float32 unless the row maximum is subtracted first.
_check_attention(1, 1, 10, 16, scale=12.0, seed=4, tol=(1e-4, 1e-4))
# Off-limits: the function you are compared with is switched off while yours runs.
_g = torch.Generator().manual_seed(6)
_q, _k, _v = (torch.randn(1, 2, 4, 3, generator=_g) for _ in range(3))
with forbid([(F, "scaled_dot_product_attention")], globals(),
            why="causal_attention must compute attention from its definition"):
    causal_attention(_q, _k, _v)
print("causal_attention matches scaled_dot_product_attention on the visible shapes")

### BEGIN HIDDEN TESTS
# case: head size 1
_check_attention(3, 2, 32, 1)
# case: float64, tight tolerance
_check_attention(2, 3, 9, 6, dtype=torch.float64, tol=(1e-12, 1e-10))
# case: very large scores
_check_attention(1, 2, 12, 16, scale=10.0, tol=(1e-4, 1e-4))
# case: values wider than queries and keys
_check_attention(2, 1, 7, 4, Dv=11, seed=3)

# case: gradients, against scaled_dot_product_attention's
g = torch.Generator().manual_seed(5)
qkv = [torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3)]
mine = [t.clone().requires_grad_() for t in qkv]
ref = [t.clone().requires_grad_() for t in qkv]
w = torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64)
(causal_attention(*mine) * w).sum().backward()
(F.scaled_dot_product_attention(*ref, is_causal=True) * w).sum().backward()
for name, a, b in zip("qkv", mine, ref, strict=True):
    torch.testing.assert_close(a.grad, b.grad, msg=lambda m, n=name: f"grad of {n}: {m}")

# case: the model's own attention module, rebuilt from its projections
torch.manual_seed(2)
_m = MiniGPT(MiniGPTConfig(n_layer=1, n_head=4, n_embd=32, d_ff=64, block_size=16))
_attn = _m.blocks[0].attn
_x = torch.randn(2, 11, 32)
_q, _k, _v = (p(_x).view(2, 11, 4, 8).transpose(1, 2)
              for p in (_attn.q_proj, _attn.k_proj, _attn.v_proj))
with torch.no_grad():
    _y = _attn.o_proj(causal_attention(_q, _k, _v).transpose(1, 2).reshape(2, 11, 32))
    torch.testing.assert_close(_y, _attn(_x), msg=lambda m: f"vs CausalSelfAttention: {m}")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_causal_attention_no_future", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
g = torch.Generator().manual_seed(1)     # the test's own draws: no call can move them
B, H, T, D = 2, 2, 8, 4
q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
out = causal_attention(q, k, v)
for t in range(T - 1):
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, t + 1:] += torch.randn(B, H, T - t - 1, D, generator=g)   # every future position
    k2[:, :, t + 1:] += 5 * torch.randn(B, H, T - t - 1, D, generator=g)
    v2[:, :, t + 1:] += torch.randn(B, H, T - t - 1, D, generator=g)
    out2 = causal_attention(q2, k2, v2)
    torch.testing.assert_close(
        out2[:, :, :t + 1], out[:, :, :t + 1], atol=1e-6, rtol=1e-6,
        msg=lambda m, t=t: f"outputs at positions 0..{t} changed when only positions "
                           f"{t + 1}..{T - 1} changed (the future leaks in):\n{m}")
print("positions never see the future")

### BEGIN HIDDEN TESTS
# case: the first position, and a sequence of one token
torch.testing.assert_close(out[:, :, 0], v[:, :, 0], atol=1e-6, rtol=1e-6,
                           msg=lambda m: f"output at position 0 should equal v[..., 0, :]:\n{m}")
one = causal_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1])
torch.testing.assert_close(one, v[:, :, :1], atol=1e-6, rtol=1e-6,
                           msg=lambda m: f"T=1: output should equal v:\n{m}")
# case: the last position, after a change at position 0
k3 = k.clone()
k3[:, :, 0] += 3.0
assert not torch.allclose(causal_attention(q, k3, v)[:, :, -1], out[:, :, -1]), \
    "the last position ignored a change at position 0: is the mask hiding the past too?"
### END HIDDEN TESTS

# %% [markdown]
# ### What a head of the base model looks at
#
# Your function returns $PV$, where $P$ is the matrix of attention weights. To see $P$ itself,
# pass the identity matrix as the values: $P I = P$. (This is why `v` may have a different
# last dimension from `q` and `k`.)
#
# Below we recompute the queries and keys of the base model's **first** block exactly as
# `MiniGPT.forward` does — token embedding plus position embedding, then the block's
# `attn_norm`, then `q_proj` / `k_proj` split into heads — and plot the weights of each head
# on one `kv` prompt with its answer. Row $i$ is the query at position $i$; every row sums
# to 1 and everything above the diagonal is zero. We also check that your function, fed the
# block's projections, reproduces the block's own attention output.

# %% tags=["jupyter-only"]
ex = tasks.make_examples("kv", 1, seed=3, split="eval")[0]
text = ex.prompt + ex.answer
idx = torch.tensor([tok.encode(text)])
T = idx.shape[1]
H, C = base.config.n_head, base.config.n_embd
block = base.blocks[0]
with torch.no_grad():
    h = block.attn_norm(base.tok_emb(idx) + base.pos_emb(torch.arange(T)))
    q, k, v = (proj(h).view(1, T, H, C // H).transpose(1, 2)
               for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj))
    P = causal_attention(q, k, torch.eye(T).expand(1, H, T, T))[0]          # [H, T, T]
    mine = block.attn.o_proj(causal_attention(q, k, v).transpose(1, 2).reshape(1, T, C))
    print("largest difference from block.attn(h):", (mine - block.attn(h)).abs().max().item())

print("rows sum to 1:", torch.allclose(P.sum(-1), torch.ones(H, T)),
      "| above-diagonal weight:", P.triu(diagonal=1).abs().max().item())

labels = list(text)
fig, axes = plt.subplots(1, H, figsize=(4 * H, 4.6), layout="constrained")
for head, ax in enumerate(axes):
    ax.imshow(P[head], cmap="viridis", vmin=0, vmax=1)
    ax.set_title(f"block 0, head {head}")
    ax.set_xticks(range(T), labels, fontsize=7)
    ax.set_yticks(range(T), labels, fontsize=7)
    ax.set_xlabel("key position")
axes[0].set_ylabel("query position")
fig.suptitle(f"Attention weights on {text!r} (prompt {ex.prompt!r}, answer {ex.answer!r})")
plt.show()

# %% [markdown]
# ## Part C — Exercise 2: the character tokenizer
#
# **Specification.** Rebuild the tokenizer as two functions over `ALPHABET` (imported above
# from `minigpt.tokenizer`): id `PAD_ID = 0`, id `EOS_ID = 1`, and the character `ALPHABET[i]`
# has id `i + 2`. Your ids must agree with `CharTokenizer` exactly.
#
# * `encode(text)` takes a `str` and returns a `list` of Python `int`s, one per character. A
#   character outside the alphabet (an upper-case letter, `!`, …) raises `ValueError`.
#   `encode("")` is `[]`.
# * `decode(ids)` takes a list of ints or a 1-D integer tensor and returns a `str`. It **stops
#   at the first `EOS_ID`** (what follows an answer is not part of it), **skips `PAD_ID`**,
#   and raises `ValueError` for an id outside `0 … VOCAB_SIZE - 1`, negative ids included.
#
# Off-limits: `CharTokenizer` (its `encode` and `decode` are switched off while yours run,
# including on the `tok` made in Part A).
#
# <details><summary>Hint 1: the idea</summary>
#
# `ALPHABET.find(ch)` gives a character's position, or `-1` when it is not there; a dict from
# character to id built once does the same faster. Going back, check the range of each id
# *before* indexing: `ALPHABET[i - 2]` with `i = 0` or a negative `i` does not fail, it
# quietly returns a character from the end of the alphabet (Python's negative indexing).
# `int(i)` turns a 0-d tensor element into a Python int.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# encode(text): for each ch: i = position of ch in ALPHABET
#                            if not found: raise ValueError;  append i + 2
# decode(ids):  for each i (as int):
#                   if i outside 0..VOCAB_SIZE-1: raise ValueError
#                   if i == EOS_ID: stop;  if i == PAD_ID: skip
#                   append ALPHABET[i - 2]
#               return the characters joined
# ```
#
# </details>

# %%
PAD_ID, EOS_ID = 0, 1
VOCAB_SIZE = 2 + len(ALPHABET)
print(f"{VOCAB_SIZE} ids: 0 = <pad>, 1 = <eos>, 2..{VOCAB_SIZE - 1} = {ALPHABET!r}")


# %% nbgrader={"grade": false, "grade_id": "tokenizer", "locked": false, "schema_version": 3, "solution": true, "task": false}
def encode(text: str) -> list[int]:
    """Character ids of `text`: ALPHABET[i] -> i + 2; ValueError on an unknown character."""
    ### BEGIN SOLUTION
    ids = []
    for ch in text:
        i = ALPHABET.find(ch)
        if i < 0:
            raise ValueError(f"character {ch!r} is not in the alphabet {ALPHABET!r}")
        ids.append(i + 2)
    return ids
    ### END SOLUTION


def decode(ids) -> str:
    """Text of `ids`: stop at EOS_ID, skip PAD_ID, ValueError on an id out of range."""
    ### BEGIN SOLUTION
    chars = []
    for i in ids:
        i = int(i)
        if not 0 <= i < VOCAB_SIZE:
            raise ValueError(f"token id {i} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
        if i == EOS_ID:
            break
        if i == PAD_ID:
            continue
        chars.append(ALPHABET[i - 2])
    return "".join(chars)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_encode", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
_ref = CharTokenizer()           # the hidden tests compare with it; these, with ids by hand
_got = encode("add:12+7=")
assert isinstance(_got, list), \
    f"encode should return a list of Python ints, got a {type(_got).__name__}: {_got!r}"
# worked by hand: ALPHABET[i] has id i + 2 ("a" is ALPHABET[11], so 13)
_BY_HAND = {"add:12+7=": [13, 16, 16, 43, 4, 5, 39, 10, 41],
            "kv:a1,b2?b=": [23, 34, 43, 13, 4, 44, 14, 5, 42, 14, 41],
            "count:abca?c=": [15, 27, 33, 26, 32, 43, 13, 14, 15, 13, 42, 15, 41],
            " ": [2], "": []}
for text, want in _BY_HAND.items():
    got = encode(text)
    _off = {g - w for g, w in zip(got, want, strict=False)}
    assert got == want, f"encode({text!r}): expected {want}, got {got}" + (
        f" (every id is off by {_off.pop()}: ALPHABET[i] has id i + 2, after <pad> = 0 and "
        "<eos> = 1)" if len(got) == len(want) and len(_off) == 1 else "")
assert all(type(i) is int for i in encode("sort:zyx=")), \
    f"encode should return Python ints, got {[type(i).__name__ for i in encode('sort:zyx=')]}"
try:
    encode("Hello!")
except ValueError:
    pass
else:
    raise AssertionError("encode('Hello!') should raise ValueError ('H' and '!' are unknown)")
# Off-limits: CharTokenizer's own methods are switched off while yours runs.
with forbid([(CharTokenizer, "encode"), (CharTokenizer, "decode")], globals(),
            why="encode must map characters to ids itself"):
    _got = encode("kv:a1?a=")
assert _got == [23, 34, 43, 13, 4, 42, 13, 41], \
    f"with CharTokenizer switched off, encode('kv:a1?a=') returned {_got}"
print("encode gives the ids worked by hand")

### BEGIN HIDDEN TESTS
# case: the whole alphabet
got = encode(ALPHABET)
assert got == list(range(2, VOCAB_SIZE)), \
    f"encode(ALPHABET): expected 2..{VOCAB_SIZE - 1}, got {got}"
# case: prompts and answers of every task
for name in tasks.TASKS:
    for ex in tasks.make_examples(name, 30, seed=4):
        for text in (ex.prompt, ex.answer):
            got = encode(text)
            assert got == _ref.encode(text), \
                f"encode({text!r}): expected {_ref.encode(text)}, got {got}"
# case: all of a task's prompts and answers in one long text
for name in tasks.TASKS:
    text = "".join(t for ex in tasks.make_examples(name, 30, seed=4) for t in (ex.prompt, ex.answer))
    got = encode(text)
    assert got == _ref.encode(text), f"encode of a long text ({len(text)} characters) differs"
# case: texts with characters outside the alphabet
for bad in ["abc!", "\n", "é", "ADD:1+1="]:
    try:
        encode(bad)
    except ValueError:
        continue
    raise AssertionError(f"encode({bad!r}) should raise ValueError")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_decode", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
_ref = CharTokenizer()           # the hidden tests compare with it; these, with ids by hand
for ids, text in (([13, 16, 16, 43, 4, 5, 39, 10, 41], "add:12+7="),
                  ([30, 17, 34, 43, 20, 17, 24, 24, 27, 41], "rev:hello="), ([], "")):
    got = decode(ids)
    assert got == text, f"decode({ids}): expected {text!r}, got {got!r}"
ids = [13, 14, EOS_ID, 15, 16]                            # "ab", <eos>, "cd"
assert decode(ids) == "ab", \
    f"decode({ids}) should stop at <eos>: expected 'ab', got {decode(ids)!r}"
ids = [PAD_ID, 13, 14, PAD_ID, PAD_ID]
assert decode(ids) == "ab", \
    f"decode({ids}) should skip <pad>: expected 'ab', got {decode(ids)!r}"
assert decode([]) == "", f"decode([]): expected '', got {decode([])!r}"
assert decode(encode("kv:a1,b2?a=")) == "kv:a1,b2?a=", "decode(encode(text)) is not text"
# Ids outside the vocabulary raise, negative ones included (ALPHABET[-3] would not fail).
for _bad, _why in (([-1], "a negative id: ALPHABET[-3] does not fail, it counts from the end"),
                   ([2, VOCAB_SIZE], "VOCAB_SIZE is one past the last id")):
    try:
        _came = f"returned {decode(_bad)!r}"
    except ValueError:
        continue
    except Exception as _e:  # noqa: BLE001 - any other error is reported as the wrong one
        _came = f"raised {type(_e).__name__}: {_e}"
    raise AssertionError(f"decode({_bad}) should raise ValueError ({_why}; the ids are "
                         f"0..{VOCAB_SIZE - 1}), but it {_came}")
# Off-limits: CharTokenizer's own methods are switched off while yours runs.
_ids = [31, 27, 30, 32, 43, 15, 13, 14, 41, EOS_ID, 7]     # "sort:cab=", <eos>, "5"
with forbid([(CharTokenizer, "encode"), (CharTokenizer, "decode")], globals(),
            why="decode must map ids to characters itself"):
    _got = decode(_ids)
assert _got == "sort:cab=", f"with CharTokenizer switched off, decode({_ids}) returned {_got!r}"
print("decode inverts encode, stops at <eos>, skips <pad>, rejects ids out of range")

### BEGIN HIDDEN TESTS
# case: ids of every task's examples, with <eos> and <pad> inside
for name in tasks.TASKS:
    for ex in tasks.make_examples(name, 30, seed=5):
        ids = _ref.encode(ex.answer) + [EOS_ID, PAD_ID] + _ref.encode(ex.prompt)
        got = decode(ids)
        assert got == _ref.decode(ids), f"decode({ids}): expected {_ref.decode(ids)!r}, got {got!r}"
# case: all of a task's examples in one long run of ids, <pad> between them
for name in tasks.TASKS:
    ids = [i for ex in tasks.make_examples(name, 30, seed=5)
           for i in [PAD_ID, *_ref.encode(ex.prompt + ex.answer)]] + [EOS_ID]
    got = decode(ids)
    assert got == _ref.decode(ids), f"decode of a long run of {len(ids)} ids differs"
# case: a tensor of ids
t = torch.tensor(_ref.encode("copy:abc=") + [EOS_ID, 5])
assert decode(t) == "copy:abc=", \
    f"decode(tensor {t.tolist()}): expected 'copy:abc=', got {decode(t)!r}"
# case: <eos> first, and padding only
assert decode([EOS_ID] + _ref.encode("x")) == "", "decode should return '' when <eos> comes first"
assert decode([PAD_ID, PAD_ID]) == "", "decode of padding only should be ''"
# case: ids out of range
for bad in ([VOCAB_SIZE], [2, 3, 99], [-1], [5, -3]):
    try:
        decode(bad)
    except ValueError:
        continue
    raise AssertionError(f"decode({bad}) should raise ValueError (id outside 0..{VOCAB_SIZE - 1})")
### END HIDDEN TESTS

# %% [markdown]
# ## Part D — Exercise 3: next-token training pairs with prompt masking
#
# A language model learns by predicting, at every position, the next token. For a fine-tuning
# example the sequence is `prompt + answer + [eos]`, and the model is fed the sequence without
# its last token and asked for the sequence without its first:
#
# ```
# seq        p0  p1  p2  a0  a1  eos
# x          p0  p1  p2  a0  a1          (seq[:-1], what the model reads)
# y          p1  p2  a0  a1  eos         (seq[1:],  what it must predict at each position)
# loss_mask  F   F   T   T   T           (True where y is an answer token or the eos)
# ```
#
# We do not want the loss to reward predicting the *prompt* — the prompt is given, the answer
# is the skill — so the loss is averaged only where `loss_mask` is True. The `eos` must be in
# the mask: it is how the model learns to **stop**.
#
# **Specification.** `make_training_pair(prompt_ids, answer_ids, eos_id)` takes two lists of
# ints (the prompt has at least one token; the answer may be empty, and then only the `eos`
# is learned) and an int, and returns `(x, y, loss_mask)` as 1-D tensors of length
# `len(prompt_ids) + len(answer_ids)`, laid out as in the table above: `x` and `y` of dtype
# `torch.long`, `loss_mask` of dtype `torch.bool`, `True` exactly where **`y`** is an answer
# token or the `eos`. The caller's lists must come back unchanged.
#
# The course's data pipeline, `minituner.SequenceData`, does the same for a whole batch
# (see `src/minituner/data.py`); the tests compare you with it.
#
# <details><summary>Hint 1: the idea</summary>
#
# Build the whole sequence once, as a new list or tensor (`prompt_ids + answer_ids` makes a
# new list; `.append` or `.extend` would change the caller's), then take two slices of it.
# For the mask, first mark which tokens of the *sequence* belong to the answer (everything
# from index `len(prompt_ids)` on, the `eos` included), then slice that marking the same way
# as `y`, because the mask belongs to the targets.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# seq       = long tensor of prompt_ids + answer_ids + [eos_id]
# is_answer = bool tensor, False for the first len(prompt_ids) positions, True after
# return seq[:-1], seq[1:], is_answer[1:]
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "make_training_pair", "locked": false, "schema_version": 3, "solution": true, "task": false}
def make_training_pair(prompt_ids: list[int], answer_ids: list[int], eos_id: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, loss_mask) for next-token training on prompt + answer + [eos], answer-only loss."""
    ### BEGIN SOLUTION
    seq = torch.tensor([*prompt_ids, *answer_ids, eos_id], dtype=torch.long)
    is_answer = torch.zeros(len(seq), dtype=torch.bool)
    is_answer[len(prompt_ids):] = True            # the answer tokens and the eos
    return seq[:-1], seq[1:], is_answer[1:]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_make_training_pair", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_pair(prompt, answer, eos, want_x, want_y, want_mask):
    got = make_training_pair(prompt, answer, eos)
    assert isinstance(got, tuple) and len(got) == 3, \
        f"expected a tuple (x, y, loss_mask), got {type(got).__name__} of length {len(got)}"
    x, y, mask = got
    call = f"make_training_pair({prompt}, {answer}, eos_id={eos})"
    for name, t, dtype in (("x", x, torch.long), ("y", y, torch.long),
                           ("loss_mask", mask, torch.bool)):
        came = getattr(t, "dtype", type(t).__name__)
        assert isinstance(t, torch.Tensor) and t.dtype == dtype, \
            f"{call}: {name} should be a {dtype} tensor, got {came}"
    on_seq = [False] * len(prompt) + [True] * (len(answer) + 1)    # answer + eos, per token
    why = {"x": " (x and y are swapped: x = seq[:-1] is what the model reads)"
                if x.tolist() == want_y else "",
           "loss_mask": " (this mask is marked on x, the inputs: it belongs to the targets y)"
                        if mask.tolist() == on_seq[:-1] else
                        " (the eos is missing: it is how the model learns to stop)"
                        if mask.tolist() == [*want_mask[:-1], False] else ""}
    for name, t, want in (("x", x, want_x), ("y", y, want_y), ("loss_mask", mask, want_mask)):
        assert t.tolist() == want, \
            f"{call}: {name} expected {want}, got {t.tolist()}{why.get(name, '')}"


# worked by hand: seq = [5, 6, 7, 8, 9, 1]
_check_pair([5, 6, 7], [8, 9], 1,
            [5, 6, 7, 8, 9], [6, 7, 8, 9, 1], [False, False, True, True, True])
# a one-token prompt: every target is an answer token or the eos
_check_pair([5], [8], 1, [5, 8], [8, 1], [True, True])

# the same as minituner.SequenceData for the ids of a real example, "add:12+7=" -> "19"
_tok = CharTokenizer()
_p, _a = [13, 16, 16, 43, 4, 5, 39, 10, 41], [4, 12]
_want = SequenceData.from_pairs([(_p, _a + [_tok.eos_id])]).batch(torch.tensor([0]))
_got = make_training_pair(_p, _a, _tok.eos_id)
for _name, _g, _w in zip(("x", "y", "loss_mask"), _got, _want, strict=True):
    assert _g.tolist() == _w[0].tolist(), \
        f"{_p} -> {_a}: {_name} expected {_w[0].tolist()}, got {_g.tolist()}"
print("make_training_pair matches the hand-worked cases and SequenceData")

### BEGIN HIDDEN TESTS
# case: an empty answer
_check_pair([4, 5, 6], [], 1, [4, 5, 6], [5, 6, 1], [False, False, True])
# case: another eos id, and a longer answer
_check_pair([9, 9], [3, 4, 5, 6], 0, [9, 9, 3, 4, 5, 6], [9, 3, 4, 5, 6, 0],
            [False, True, True, True, True, True])
# case: real examples of every task, against SequenceData
_pairs = [(_tok.encode(ex.prompt), _tok.encode(ex.answer))
          for ex in tasks.make_mixture(list(tasks.TASKS), 8, seed=2)]
_data = SequenceData.from_pairs([(p, a + [_tok.eos_id]) for p, a in _pairs])
for _i, (_p, _a) in enumerate(_pairs):
    _want = [t[0].tolist() for t in _data.batch(torch.tensor([_i]))]
    _got = [t.tolist() for t in make_training_pair(_p, _a, _tok.eos_id)]
    assert _got == _want, f"pair {_i} ({_tok.decode(_p)!r}): expected {_want}, got {_got}"
# case: the caller's lists afterwards
_p, _a = share([7, 8]), share([9])         # lists held where make_training_pair runs
make_training_pair(_p, _a, 1)
assert list(_p) == [7, 8] and list(_a) == [9], \
    f"inputs were modified: prompt {list(_p)}, answer {list(_a)}"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_make_training_pair_keeps_inputs", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# The caller's lists come back unchanged, from a function that also gives the right pair (a
# function that ignores its inputs keeps them too).
_check_pair([4, 6], [8], 1, [4, 6, 8], [6, 8, 1], [False, True, True])


# in-process check: make_training_pair leaves the lists it is given unchanged
def _lists_after_call():
    prompt, answer = [4, 6], [8]
    make_training_pair(prompt, answer, 1)
    return prompt, answer


_p, _a = in_learner(_lists_after_call)
assert _p == [4, 6] and _a == [8], \
    f"make_training_pair([4, 6], [8], 1) changed the caller's lists: prompt is now {_p}, " \
    f"answer {_a}; build a new sequence instead of appending to them"
print("make_training_pair leaves the caller's lists unchanged")

### BEGIN HIDDEN TESTS
# case: another pair, worked by hand
_check_pair([3, 9, 2], [5, 5], 0, [3, 9, 2, 5, 5], [9, 2, 5, 5, 0],
            [False, False, True, True, True])
# case: the caller's lists afterwards, other lists
_p, _a = share([11, 12, 13]), share([14, 15, 16])    # lists held where make_training_pair runs
make_training_pair(_p, _a, 2)
assert list(_p) == [11, 12, 13] and list(_a) == [14, 15, 16], \
    f"make_training_pair([11, 12, 13], [14, 15, 16], 2) changed the caller's lists: prompt " \
    f"is now {list(_p)}, answer {list(_a)}"
### END HIDDEN TESTS

# %% [markdown]
# With your function, the loss a fine-tuning run minimises is one line: the cross-entropy of
# the logits at the masked positions. Here it is for the base model, averaged over a few
# eval prompts of each task. The held-out task should stand out; Labs 05, 06 and 11 will
# bring that number down.

# %%
@torch.no_grad()
def answer_loss(model, task, n=20):
    losses = []
    for ex in tasks.make_examples(task, n, seed=0, split="eval"):
        x, y, mask = make_training_pair(encode(ex.prompt), encode(ex.answer), tok.eos_id)
        logits = model(x[None])[0]                          # [T, vocab]
        losses.append(F.cross_entropy(logits[mask], y[mask]))
    return torch.stack(losses).mean().item()


for name in tasks.TASKS:
    print(f"{name:>6}: answer loss {answer_loss(base, name):.3f}"
          + ("   <- held out" if name == tasks.HELD_OUT else ""))


# %% [markdown]
# ## Part E — Exercise 4: a fingerprint of a model's weights
#
# Every experiment in this course writes a **manifest** (`experiments/*/manifest.json`): the
# config, the seed, the library versions, the metrics — and sha256 digests of the weights it
# read and wrote. The digests are what make a manifest trustworthy: if someone retrains the
# base model, edits a checkpoint, or loads the wrong adapter, the digest changes and
# `python -m labkit reproduce` refuses to compare numbers produced from different weights.
#
# A digest of a *file* (`labkit.sha256_file`) is easy, but it changes when nothing that matters
# changed (the same weights saved with another key order or other metadata). A digest of the
# *state dict* itself should depend only on what the weights are.
#
# **Specification.** `state_dict_sha256(sd)` takes a mapping from `str` names to tensors and
# returns a 64-character lower-case hex sha256 digest (`hashlib.sha256`) such that:
#
# * it does **not** depend on the order of the keys;
# * it **does** change if any value changes (even by one unit in the last place), if a tensor's
#   dtype changes (float32 vs float64 of the same values), if its shape changes (`[6]` vs
#   `[2, 3]` holding the same bytes), if a key is renamed, or if the same bytes are split
#   differently between two keys;
# * it works for any dtype (including `torch.bfloat16`, which NumPy cannot represent), any
#   shape (including 0-d and empty tensors), non-contiguous tensors (which hash like their
#   contiguous copy) and tensors that require grad (which hash like their detached copy).
#
# Off-limits: the reference, `labkit.sha256_state_dict` (in `src/labkit/hashing.py`; the
# tests switch it off while yours runs). Yours does not have to produce the same hex string,
# only to have the properties above.
#
# <details><summary>Hint 1: the idea</summary>
#
# Feed one `hashlib.sha256()` object, for each key in a fixed order (sorted), the key, the
# dtype, the shape and the raw bytes of the tensor. Two traps: `str(tensor)` abbreviates
# large tensors with `...` and rounds the printed values, so it is not the data; and a stream
# of fields glued together without separators or lengths can read the same for two different
# state dicts, so prefix each field with its length. For the raw bytes, make the tensor
# detached, contiguous and 1-D, then view it as `uint8`: that works for every dtype and shape,
# and NumPy then only sees bytes.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# h = sha256()
# for name in sorted(sd):
#     t      = sd[name] detached, on the CPU, contiguous
#     header = f"{name}|{t.dtype}|{tuple(t.shape)}" as bytes
#     data   = t flattened, viewed as uint8, as bytes
#     for field in (header, data): h.update(len(field) as 8 bytes); h.update(field)
# return h.hexdigest()
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "state_dict_sha256", "locked": false, "schema_version": 3, "solution": true, "task": false}
def state_dict_sha256(sd) -> str:
    """sha256 hex digest of a {name: tensor} mapping: order-free, sensitive to everything else."""
    ### BEGIN SOLUTION
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().to("cpu").contiguous()
        header = f"{name}|{t.dtype}|{tuple(t.shape)}".encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_state_dict_sha256", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _differ(sd1, sd2, what):
    d1, d2 = state_dict_sha256(sd1), state_dict_sha256(sd2)
    assert d1 != d2, f"{what}: expected two different digests, got the same one twice ({d1})"


torch.manual_seed(0)
a, b = torch.randn(2, 3), torch.arange(4)
digest = state_dict_sha256({"a": a, "b": b})
assert isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef"), \
    f"expected a 64-character lower-case hex string, got {digest!r}"
again = state_dict_sha256({"b": b, "a": a})
assert again == digest, f"reordering the keys changed the digest: expected {digest}, got {again}"

a_ulp = a.clone()
a_ulp[1, 2] = torch.nextafter(a[1, 2], torch.tensor(float("inf")))
_differ({"a": a, "b": b}, {"a": a_ulp, "b": b}, "one element moved by one ulp")
_differ({"a": a}, {"a": a.double()}, "float32 vs float64 of the same values")
_differ({"w": torch.arange(6, dtype=torch.float32)}, {"w": torch.arange(6.0).view(torch.int32)},
        "float32 vs int32 holding the same bytes (the dtype is part of what a tensor is)")
_differ({"a": a, "b": b}, {"a": a, "c": b}, "key 'b' renamed to 'c'")
six = torch.arange(6, dtype=torch.float32)
_differ({"w": six}, {"w": six.reshape(2, 3)}, "shape [6] vs [2, 3] with the same bytes")
_differ({"w": six[:4], "x": six[4:]}, {"w": six[:3], "x": six[3:]},
        "the same six values split 4 + 2 or 3 + 3 between two keys")
# Any dtype and shape: bfloat16, a 0-d tensor, a non-contiguous view, a tensor requiring grad.
_awkward = {"bf16": torch.randn(5).to(torch.bfloat16), "scalar": torch.tensor(2.5),
            "t": torch.randn(3, 4).T, "p": torch.nn.Parameter(torch.randn(2, 2))}
_plain = {k: t.detach().contiguous() for k, t in _awkward.items()}
for _key, _what in (("bf16", "a bfloat16 tensor (NumPy has no bfloat16: hash bytes)"),
                    ("scalar", "a 0-d tensor"),
                    ("t", "a non-contiguous tensor (it should hash like its contiguous copy)"),
                    ("p", "a tensor that requires grad (it should hash like its detached copy)")):
    try:
        _d1, _d2 = state_dict_sha256({_key: _awkward[_key]}), state_dict_sha256({_key: _plain[_key]})
    except (TypeError, RuntimeError, ValueError) as _e:
        raise AssertionError(f"state_dict_sha256 failed on {_what}: "
                             f"{type(_e).__name__}: {_e}") from _e
    assert _d1 == _d2, f"{_what}: got the digest {_d1}, and {_d2} for the plain copy"
# Off-limits: the reference is switched off while yours runs.
with forbid([(labkit, "sha256_state_dict"), (labkit.hashing, "sha256_state_dict")], globals(),
            why="state_dict_sha256 must build its own digest"):
    state_dict_sha256({"a": a, "b": b})
print("state_dict_sha256 has the visible properties")

### BEGIN HIDDEN TESTS
# case: equal content held in other tensors
assert state_dict_sha256({"a": a.clone(), "b": b.clone()}) == digest, "equal content, other digest"
# case: bfloat16 vs float16 with the same bits
half_bits = torch.randn(8).to(torch.bfloat16)
_differ({"h": half_bits}, {"h": half_bits.view(torch.float16)}, "bfloat16 vs float16, same bits")
# case: shape () vs (1,)
_differ({"s": torch.tensor(1.5)}, {"s": torch.tensor([1.5])}, "shape () vs (1,)")
# case: empty tensors of two shapes
_differ({"e": torch.zeros(0)}, {"e": torch.zeros(0, 3)}, "empty tensors of shapes (0,) and (0, 3)")
# case: the same bytes split differently between two keys
_differ({"w": torch.tensor([1.0, 2.0, 3.0]), "x": torch.tensor([4.0])},
        {"w": torch.tensor([1.0, 2.0]), "x": torch.tensor([3.0, 4.0])},
        "the same concatenated bytes split differently between two keys")
# case: float32 vs int32 with the same bytes
_differ({"w": six}, {"w": six.view(torch.int32)}, "float32 vs int32 holding the same bytes")
# case: a transposed tensor vs its contiguous copy
m = torch.randn(4, 5)
assert state_dict_sha256({"m": m.T}) == state_dict_sha256({"m": m.T.contiguous()}), \
    "a transposed (non-contiguous) tensor should hash like its contiguous copy"
# case: a parameter vs its detached copy
p = torch.nn.Parameter(torch.randn(3, 3))
assert state_dict_sha256({"p": p}) == state_dict_sha256({"p": p.detach().clone()}), \
    "a tensor that requires grad should hash like its detached copy"
# case: a whole model, a safetensors round trip and one changed weight
torch.manual_seed(3)
_small = MiniGPT(MiniGPTConfig(n_layer=2, n_embd=32, n_head=2, d_ff=64, block_size=16))
_sd = _small.state_dict()
with tempfile.TemporaryDirectory() as _tmp:
    save_file({k: t.contiguous() for k, t in _sd.items()}, Path(_tmp) / "w.safetensors")
    _loaded = load_file(Path(_tmp) / "w.safetensors")
assert state_dict_sha256(_loaded) == state_dict_sha256(_sd), "safetensors round trip changed it"
_edited = dict(_sd)
_edited["blocks.1.mlp.up_proj.weight"] = _sd["blocks.1.mlp.up_proj.weight"].clone()
_edited["blocks.1.mlp.up_proj.weight"][3, 4] += 1e-3
_differ(_sd, _edited, "one weight of a model changed")
### END HIDDEN TESTS

# %% [markdown]
# Now the reference. `labkit.sha256_state_dict` follows the same recipe (sorted keys; a
# length-prefixed header of name, dtype and shape; the raw bytes). The digest of a tensor dict
# is not the digest of the file that stores it: the file also holds its own header and
# metadata (here, the model's config). Manifests record file digests of the inputs and
# artifacts of a run (`labkit.sha256_file`); a state-dict digest says "same weights" whatever
# file they came from.

# %% tags=["jupyter-only"]
base_sd = base.state_dict()
print("yours  :", state_dict_sha256(base_sd))
print("labkit :", labkit.sha256_state_dict(base_sd))
file_digest = labkit.sha256_file(minigpt.base_path("dense"))
print("file   :", file_digest, "(the .safetensors file)")

reordered = dict(reversed(list(base_sd.items())))
assert labkit.sha256_state_dict(reordered) == labkit.sha256_state_dict(base_sd)
assert state_dict_sha256(reordered) == state_dict_sha256(base_sd)
print("both digests ignore key order; both change if any weight moves")

# The manifest of experiment 00 recorded the file digest of the checkpoint it wrote.
manifest_path = minigpt.base_path("dense").parent / "manifest.json"
if manifest_path.is_file():
    recorded = labkit.read_manifest(manifest_path)["artifacts"].get("base_dense.safetensors")
    print(f"manifest.json records {recorded}; the file on disk matches: {recorded == file_digest}")
else:
    print(f"(no {manifest_path} yet: `make run EXP=experiments/00-pretrain-base` writes it)")

# %% [markdown]
# ## Where this goes next
#
# You have seen the model and the goal every later lab measures against: exact match near 1
# on four tasks, about half on `kv`, close to none on `rev` (the bar chart above). Lab 01 starts shrinking the model: you will quantize its
# weight matrices to 8 bits (absmax, then symmetric per-group), measure the error as a function
# of the group size, and see what a single outlier weight does to a whole group. Lab 02 moves
# to NF4, the 4-bit format QLoRA uses. Your `make_training_pair` is the data side of the
# fine-tuning in Lab 05, and `state_dict_sha256` is what every experiment's manifest records.
#
# ### Reflection
#
# 1. The split between train and eval is decided by hashing the prompt, not by drawing from
#    different seeds. What would go wrong, for the `add` task in particular, if eval examples
#    were simply generated with another seed?
# 2. In the heatmap, what do the heads of the first block attend to when the query is the
#    final `=`? Why might a key-value lookup need more than one layer?
# 3. If the `eos` were left out of `loss_mask`, the loss on answers would still fall during
#    training. What would you see at generation time, and with which metric would you catch it?
# 4. Why does a manifest hash the weights instead of trusting a file name such as
#    `base_dense.safetensors`? Give a way two runs could read "the same" file name and still
#    disagree.

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. `add` has only 10 000 distinct prompts, so two sets drawn with different seeds overlap
#    heavily: a fine-tuning set of a few thousand examples already covers a large share of
#    the space, and most eval prompts would have been seen in training. Exact match would
#    then measure memorisation, not addition. Hashing the text sends a fixed 2 044 of the
#    10 000 prompts (20.4 %, as the notebook prints) to eval whatever seed or lab produced
#    them, and the check in A.2 finds 0 shared prompts for every task.
# 2. On the `kv` prompt of the heatmap (`kv:c9,v9?v=`), the final `=` of block 0 looks
#    mostly at the value digits (heads 1–3 split their weight between the two `9`s) and at a
#    separator (head 0 puts about 0.9 on the `,`), not at the queried letter. A lookup needs
#    two steps: first each value position has to learn which key comes right before it (an
#    attention to the previous token), and only then can a later layer match the query
#    letter against that key and copy the value. One layer cannot do both, because when it
#    runs the value positions do not yet hold their key. The base model's 0.42 on `kv` shows
#    the skill is only half learned.
# 3. The model would never be trained to emit `<eos>` after an answer, so greedy generation
#    runs on to `max_new_tokens`, appending characters, even when the answer's first
#    characters are right (the held-out `rev` already shows such run-ons, e.g. `'hhvhhhhhv'`).
#    The answer loss stays low, so the loss curve hides it; exact match
#    (`minigpt.evaluate`) drops to near 0 and catches it at once.
# 4. A file name says nothing about the content: rerunning experiment 00 with another seed
#    or another torch version writes different weights under the same name
#    `base_dense.safetensors`, and two machines can hold different files under that name.
#    The digest recorded in the manifest (here `4e7774f3…`, which matches the file on disk)
#    tells the two apart, so `labkit reproduce` refuses to compare metrics computed from
#    different weights. Re-saving the same weights with another key order changes the file
#    digest but not the state-dict digest, which is why both exist.
