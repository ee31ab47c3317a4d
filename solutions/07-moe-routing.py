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
# # Lab 07 — MoE routing: routers, balancing losses, sorting, the naive MoE
#
# A **Mixture-of-Experts** (MoE) layer replaces one MLP by $E$ smaller MLPs, the *experts*,
# and a **router**: a linear layer that scores every token against every expert,
# $\ell = x W_r^\top \in \mathbb{R}^{T \times E}$, keeps the $k$ best experts per token and
# mixes their outputs with weights $g$,
#
# $$ y_t = \sum_{j=1}^{k} g_{t,j}\; \mathrm{expert}_{e_{t,j}}(x_t), \qquad
#    \mathrm{expert}_e(x) = \big(\mathrm{silu}(x W^{\text{gate}}_e) \odot x W^{\text{up}}_e\big)
#    W^{\text{down}}_e . $$
#
# Each token pays for $k$ experts, the model holds $E$: Mixtral has 8 experts and uses 2,
# DeepSeek-V3 256 and uses 8. Two things decide whether it works. The **router** must spread
# the tokens: experts that receive nothing learn nothing, and an expert that receives
# everything is a slow dense MLP — hence balancing losses (Switch), the z-loss (ST-MoE) and
# the bias trick of DeepSeek-V3. And the **dispatch** must move each token to its experts
# without padding every expert to the same size — which starts with sorting the $T \cdot k$
# choices by expert once (the first step of ScatterMoE, whose kernels you write in Labs
# 08–09).
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `my_route(logits, k, method, renormalize, bias)`: softmax and sigmoid top-k | `minimoe.route` and a per-token loop; ties to the lower index |
# | 2 | `my_load_balancing_loss(logits, experts)`, `my_router_z_loss(logits)` | `minimoe` and hand values (1.0 for uniform routing) |
# | 3 | `my_flatten_sort_count(expert_idxs, E)` | `minimoe.flatten_sort_count`, an empty expert, k = 3, T = 1 |
# | 4 | `my_moe_forward(x, weights, experts, w_gate, w_up, w_down)` | `minimoe.reference.moe_loop`: outputs and every gradient |
# | 5 | `my_update_selection_bias(bias, tokens_per_expert, rate)` | `minimoe.update_selection_bias` |
# | 6 | (no new code) your router and MoE inside the pretrained MiniGPT-MoE | its logits and its routing |
#
# Then you look at the pretrained MiniGPT-MoE (experiment 00: 8 experts, top-2, 4 layers):
# which experts each task uses, layer by layer, how many tokens each expert gets, and what
# the balancing loss and the bias update do to a router that is left alone.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification —
# ties, one token, all experts, bfloat16 logits, an expert without tokens. You may use
# PyTorch freely, but not the `minimoe` function an exercise rebuilds: the tests switch the
# references off while your code runs. Each exercise states its **specification** first
# (inputs, outputs, the rules that matter, what is off-limits), which is enough to solve it;
# below it, folded **hints** go from the idea to pseudocode, for when you want them. No GPU is
# needed: the whole notebook runs in <!-- runtime:07-moe-routing -->about 11 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import json
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import minigpt
import minimoe
import minimoe.reference
from course.notebook.harness import forbid, reference, swap
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks
from minigpt.checkpoint import repo_root
from minimoe.reference import moe_loop
from minituner import SequenceData
from minituner.trainer import sequence_loss

torch.set_num_threads(1)   # small matrices: one thread is faster than several on a busy CPU
torch.manual_seed(0)
print("torch", torch.__version__, "| threads:", torch.get_num_threads())

ROOT = repo_root()          # the course checkout, wherever this notebook runs from
tok = CharTokenizer()


def randn(*shape, seed=0, dtype=torch.float32):
    """A reproducible standard-normal tensor (the tests use it too)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def randint(high, *shape, seed=0):
    """Reproducible int64 expert ids in 0..high-1."""
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def distinct_experts(T, k, E, seed=0):
    """[T, k] expert ids, k distinct experts per token (what a router produces)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


# %% [markdown]
# ### The MoE layer of MiniGPT-MoE, for a first look
#
# Experiment 00 pretrained two MiniGPTs on the task suite: a dense one and an MoE one whose
# four blocks each hold an `MoEMLP` with 8 SwiGLU experts (width 128 → 128 → 128) and a
# top-2 softmax router. The expert weights are stacked: `w_gate`, `w_up` `[E, C, F]`,
# `w_down` `[E, F, C]` — input dimension first, the layout the kernels of Labs 08–09 use.
# After every forward the layer keeps its choices in `last_experts` (`[T, k]`, one row per
# token of the batch).

# %%
moe_model = minigpt.load_base("moe").eval()
layer0 = moe_model.blocks[0].mlp
print(layer0)
print({n: tuple(p.shape) for n, p in layer0.named_parameters()})

# %% tags=["jupyter-only"]
prompt = tasks.make_examples("add", 1, seed=0, split="eval")[0].prompt
with torch.no_grad():
    moe_model(torch.tensor([tok.encode(prompt)]))
print(f"prompt {prompt!r}: the two experts of each character in block 0:")
for ch, row in zip(prompt, layer0.last_experts.tolist(), strict=True):
    print(f"  {ch!r}: {row}", end="")
print()

# %% [markdown]
# ## Part A — Exercise 1: the router
#
# **Specification.** Write `my_route(logits, k, method="softmax_topk", renormalize=True,
# bias=None) -> (weights, experts)`. `logits` is `[T, E]` of any float dtype; `experts` is
# `[T, k]` int64, the k chosen expert ids of each token, **best first**; `weights` is `[T, k]`
# float32, the mixing weights in the same order.
#
# * **`softmax_topk`**: probabilities $p = \mathrm{softmax}(\ell)$ over all E experts; keep
#   the k largest. With `renormalize=True` the kept weights are divided by their sum (they
#   add to 1); with `renormalize=False` they keep their softmax mass.
# * **`sigmoid_topk`**: independent scores $s = \sigma(\ell)$. An optional **selection bias**
#   $b$ `[E]` is added *for choosing only*: the experts are the top k of $s + b$, but their
#   weights are the **unbiased** $s$ of the chosen experts (renormalised if asked). `bias`
#   with `softmax_topk` is an error.
# * Router math in **float32** whatever the logits' dtype (`logits.float()` first).
# * **Ties go to the lower expert index**, so routing is deterministic.
# * No gradient flows through the *choice* (it is discrete), only through the weights; the
#   bias carries none.
# * Raise `ValueError` unless `logits` is 2-D, `1 ≤ k ≤ E`, and `method` is one of the two
#   (and for a bias with `softmax_topk`).
#
# Off-limits: `minimoe.route` (and the rest of `minimoe.routers`).
#
# **Why.** Softmax top-k is the router of Switch, Mixtral and Qwen-MoE; Mixtral
# renormalises, Switch (k = 1) does not: with one expert, renormalising would make every
# weight exactly 1 and the router would get no gradient from the task loss. Sigmoid top-k is
# DeepSeek-V3's: no competition between experts, and a bias that steers load without
# changing what any expert's output is worth (Exercise 5 updates it). Float32, because a
# softmax over a few experts in bfloat16 has 8 bits of mantissa, and top-k choices then flip
# between runs that should be identical.
#
# <details><summary>Hint 1: the idea</summary>
#
# `torch.topk` does not promise an order for equal values (try
# `torch.topk(torch.tensor([1., 3, 3, 0, 3]), 2)`: on this CPU it answers `[2, 4]`); a
# **stable** descending sort does: `scores.sort(dim=-1, descending=True,
# stable=True).indices[:, :k]`. Choose on detached scores (plus the bias), then `gather` the
# chosen columns of the undetached, unbiased scores: the weights keep their gradient and the
# bias never enters them.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# check: logits 2-D;  k an int in 1..E;  method known;  bias only with sigmoid_topk
# l = float32(logits)
# scores = softmax(l, -1) if softmax_topk else sigmoid(l)                  # [T, E]
# select = detach(scores) (+ float32(bias) if given)
# experts = stable descending sort of select along E, indices, first k     # [T, k]
# weights = scores gathered at experts                                     # [T, k]
# if renormalize: weights = weights / sum of weights per row
# return weights, experts
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "route", "locked": false, "schema_version": 3, "solution": true, "task": false}
def my_route(logits: torch.Tensor, k: int, method: str = "softmax_topk",
             renormalize: bool = True, bias: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), best expert first."""
    ### BEGIN SOLUTION
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got {tuple(logits.shape)}")
    E = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"k must be in 1..{E}, got {k!r}")
    if method not in ("softmax_topk", "sigmoid_topk"):
        raise ValueError(f"unknown method {method!r}")
    if bias is not None and method != "sigmoid_topk":
        raise ValueError("a selection bias belongs to sigmoid_topk only")
    logits = logits.float()
    scores = logits.softmax(dim=-1) if method == "softmax_topk" else logits.sigmoid()
    select = scores.detach()
    if bias is not None:
        select = select + bias.float()
    experts = select.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_route_softmax", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.forbid import bindings

# What this lab rebuilds (minimoe.REFERENCE): while a test runs your code inside
# `_forbid_reference()`, each of them raises if reached (under any name).
_WHY = "this exercise rebuilds it, so the tests switch it off while your code runs"
_REFERENCE = list(reference("07-moe-routing").values())
# each reference named by a module attribute that binds it, (module, name): forbid then
# switches off every binding of it, here and where your code runs
_BOUND_AT = {t: next((o, n) for o, n in bindings(t) if not isinstance(o, dict))
             for t in _REFERENCE}


def _forbid_reference():
    """While the block runs, minimoe's routing, sorting and dispatch functions raise if
    called (also through names this notebook imported from them)."""
    return forbid([_BOUND_AT[t] for t in _REFERENCE], globals(), why=_WHY)


def _rule_of(got, candidates, rtol=1e-4, atol=1e-6):
    """The rule broken by `got`: the text of the first {rule: what breaking it computes}
    entry that `got` equals, '' if none does."""
    for rule, value in candidates.items():
        value = torch.as_tensor(value, dtype=torch.float32)
        got_ = torch.as_tensor(got.detach() if isinstance(got, torch.Tensor) else got,
                               dtype=torch.float32)
        if got_.shape == value.shape and torch.allclose(got_, value, rtol=rtol, atol=atol):
            return f"\nLikely rule broken: {rule}"
    return ""


def _route_rule(w, logits, e, method, renormalize, bias):
    """What a wrong weights tensor `w` of my_route most likely did, in words."""
    lg = logits.float()
    s = lg.softmax(-1) if method == "softmax_topk" else lg.sigmoid()
    kept = s.gather(1, e)
    sel = kept if bias is None else (s + bias.float()).gather(1, e)
    cands = {}
    if bias is not None:
        cands["the weights are the UNBIASED scores of the chosen experts (the bias only "
              "chooses)"] = sel / sel.sum(-1, keepdim=True) if renormalize else sel
    if renormalize:
        cands["renormalize=True: divide the kept weights by their sum"] = kept
    elif e.shape[1] < lg.shape[1]:
        cands["renormalize=False keeps the softmax mass: take the softmax over all E "
              "experts, keep the k best, do not divide by their sum (a softmax over the k "
              "kept logits sums to 1 too)"] = kept / kept.sum(-1, keepdim=True)
    return _rule_of(w, cands) or " (router math in float32?)"


def _naive_route(logits, k, method="softmax_topk", renormalize=True, bias=None):
    """Token by token, in Python: the float32 scores of one token (plus the bias, added in
    float32), its experts sorted by (-score, index) with sorted(), the first k kept; the
    weights are the unbiased scores of those, divided by their sum if renormalize."""
    W, X = [], []
    for row in logits.detach().float():                                  # [E] per token
        scores = row.softmax(-1) if method == "softmax_topk" else row.sigmoid()
        s = scores.tolist()
        sel = s if bias is None else (scores + bias.detach().float()).tolist()
        chosen = sorted(range(len(s)), key=lambda e: (-sel[e], e))[:k]
        w = [s[e] for e in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        W.append(w)
        X.append(chosen)
    return torch.tensor(W, dtype=torch.float32), torch.tensor(X, dtype=torch.int64)


def _check_route(logits, k, method="softmax_topk", renormalize=True, bias=None, naive=True,
                 what="", library=False):
    """my_route against the per-token loop above (library=True, for grading: against
    minimoe.route, and the loop as well unless naive=False)."""
    where = f"{what}my_route(logits {tuple(logits.shape)} {logits.dtype}, k={k}, " \
            f"method={method!r}, renormalize={renormalize}" \
            f"{', bias=...' if bias is not None else ''})"
    source = "minimoe.route's" if library else "a per-token loop's (sorted() on (-score, index))"
    want_w, want_e = minimoe.route(logits, k, method, renormalize, bias=bias) if library \
        else _naive_route(logits, k, method, renormalize, bias)
    with _forbid_reference():
        out = my_route(logits, k, method, renormalize, bias)
    assert isinstance(out, tuple) and len(out) == 2, \
        f"{where}: expected a tuple (weights, experts), got {type(out).__name__}"
    w, e = out
    T = logits.shape[0]
    assert e.shape == (T, k) and e.dtype == torch.int64, \
        f"{where}: experts should be int64 of shape {(T, k)}, got {e.dtype} {tuple(e.shape)}"
    assert w.shape == (T, k) and w.dtype == torch.float32, \
        f"{where}: weights should be float32 of shape {(T, k)}, got {w.dtype} {tuple(w.shape)}"
    bad = (e != want_e).any(dim=1).nonzero().flatten().tolist()
    assert not bad, \
        f"{where}: token {bad[0]} chose the wrong experts: expected {want_e[bad[0]].tolist()} " \
        f"(best first, ties to the lower index), got {e[bad[0]].tolist()}; logits of that " \
        f"token: {[round(v, 4) for v in logits[bad[0]].float().tolist()]}"
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7, msg=lambda m: (
        f"{where}: the weights differ from {source}:\n{m}"
        f"{_route_rule(w, logits, e, method, renormalize, bias)}"))
    if library and naive:
        nw, ne = _naive_route(logits, k, method, renormalize, bias)
        assert torch.equal(e, ne), f"{where}: experts differ from a per-token loop"
        torch.testing.assert_close(w, nw, rtol=1e-5, atol=1e-6)
    return w, e


_logits = randn(7, 8, seed=1) * 2
_w, _e = _check_route(_logits, 2)
assert torch.allclose(_w.sum(-1), torch.ones(7)), "renormalised weights should sum to 1"
_check_route(_logits, 2, renormalize=False)
_check_route(_logits, 1, renormalize=False)
_check_route(randn(33, 5, seed=2), 3)
# a tie: experts 1, 2 and 4 share the best logit
_check_route(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]), 2, renormalize=False)
# the weights carry the gradient to the logits
_lg = _logits.clone().requires_grad_()
with _forbid_reference():
    _w, _ = my_route(_lg, 2)
assert _w.requires_grad, \
    "the weights carry no gradient to the logits (did you detach the scores?)"
_w[:, 0].sum().backward()
assert _lg.grad is not None and _lg.grad.abs().sum() > 0, \
    "no gradient reached the logits through the weights (did you detach the scores?)"
# bfloat16 logits: the router math runs in float32
try:
    _check_route((randn(12, 8, seed=8) * 3).bfloat16(), 2, what="bfloat16 logits: ")
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: router math in float32 (logits.float() first), "
                         "whatever the logits' dtype") from _e
# k outside 1..E
for _k in (0, 9):
    try:
        with _forbid_reference():
            my_route(randn(3, 8), _k)
    except ValueError:
        pass
    else:
        raise AssertionError(f"my_route(logits [3, 8], k={_k}) should raise ValueError (rule: "
                             f"1 <= k <= E)")
print("softmax_topk: choices, order, ties and weights as a per-token loop, renormalised or "
      "not")

### BEGIN HIDDEN TESTS
# ties everywhere: integer logits, and all-equal logits (every token picks 0..k-1)
# case: integer logits with many ties
_check_route(randint(3, 40, 8, seed=3).float(), 2, naive=False, what="hidden: ", library=True)
# case: all-equal logits
_w, _e = _check_route(torch.zeros(4, 6), 3, naive=False, what="hidden: ", library=True)
assert _e.tolist() == [[0, 1, 2]] * 4, f"hidden: all-equal logits should pick [0, 1, 2], got {_e}"
# case: a single token
_check_route(randn(1, 8, seed=4), 2, what="hidden: ", library=True)                       # T = 1
# case: k equal to the number of experts, not renormalised
_w, _ = _check_route(randn(5, 4, seed=5), 4, renormalize=False, what="hidden: ", library=True)
assert torch.allclose(_w.sum(-1), torch.ones(5)), "hidden: k = E keeps all the softmax mass"
# case: bfloat16 logits
_check_route((randn(16, 8, seed=6) * 3).bfloat16(), 2, what="hidden: ", library=True)  # bf16 logits
# case: float64 logits, not renormalised
_check_route((randn(16, 8, seed=7) * 3).double(), 2, renormalize=False, what="hidden: ",
             library=True)
# case: invalid k or method
for _bad in (dict(k=0), dict(k=9), dict(k=2, method="top2")):
    try:
        with _forbid_reference():
            my_route(randn(3, 8), **_bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"hidden: my_route(logits [3, 8], {_bad}) should raise ValueError")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_route_sigmoid", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
_logits = randn(9, 8, seed=11) * 2
_w0, _e0 = _check_route(_logits, 2, "sigmoid_topk", renormalize=False)
torch.testing.assert_close(_w0, torch.sigmoid(_logits).gather(1, _e0))
_check_route(_logits, 2, "sigmoid_topk")
# a bias of +1 on expert 7 (more than any sigmoid gap) changes the choice, not the weights
_bias = torch.tensor([-0.3, 0, 0, 0, 0, 0, 0, 1.0])
_w, _e = _check_route(_logits, 2, "sigmoid_topk", renormalize=False, bias=_bias)
assert (_e == 7).any(dim=1).all(), \
    f"with bias +1 on expert 7 every token should choose it; experts chosen: {_e.tolist()}"
torch.testing.assert_close(_w, torch.sigmoid(_logits).gather(1, _e), msg=lambda m: (
    f"the weights must be the UNBIASED sigmoid scores of the chosen experts:\n{m}"))
try:
    with _forbid_reference():
        my_route(_logits, 2, "softmax_topk", bias=_bias)
except ValueError:
    pass
else:
    raise AssertionError("a bias with method='softmax_topk' should raise ValueError")
print("sigmoid_topk: unbiased weights, a selection-only bias, as a per-token loop")

### BEGIN HIDDEN TESTS
# case: k = 3 with a larger bias, renormalised
_check_route(_logits, 3, "sigmoid_topk", renormalize=True, bias=_bias * 2, what="hidden: ",
             library=True)
# case: a single token, k equal to the number of experts, with a bias
_check_route(randn(1, 6, seed=12), 6, "sigmoid_topk", renormalize=False,
             bias=randn(6, seed=13), what="hidden: ", library=True)  # T=1, k=E
# case: bfloat16 logits and a bfloat16 bias
_check_route((randn(20, 8, seed=14) * 4).bfloat16(), 2, "sigmoid_topk", renormalize=False,
             bias=torch.linspace(-0.2, 0.2, 8).bfloat16(), what="hidden: ", library=True)  # bf16
# case: two experts tied on the biased score
# a bias that makes two experts tie on the selection score: the lower index wins
_lg = torch.zeros(3, 4)
_w, _e = _check_route(_lg, 1, "sigmoid_topk", renormalize=False,
                      bias=torch.tensor([0.0, 0.25, 0.25, 0.0]), naive=False, what="hidden: ",
                      library=True)
assert _e.flatten().tolist() == [1, 1, 1], f"hidden: tie on the biased score -> expert 1: {_e}"
assert torch.allclose(_w, torch.full((3, 1), 0.5)), "hidden: weights are sigmoid(0) = 0.5"
# case: gradients with a bias that requires grad
# the bias never carries a gradient into the weights
_lg = randn(5, 8, seed=15).requires_grad_()
_b = torch.linspace(-1, 1, 8).requires_grad_()
with _forbid_reference():
    _w, _ = my_route(_lg, 2, "sigmoid_topk", bias=_b)
_w.sum().backward()
assert _b.grad is None or torch.count_nonzero(_b.grad) == 0, \
    "hidden: the selection bias must not carry a gradient (it only chooses)"
### END HIDDEN TESTS

# %% [markdown]
# ## Part B — Exercise 2: the balancing losses
#
# A router trained on the task loss alone tends to **collapse**: an expert that happens to
# be chosen a little more learns faster, becomes better, is chosen more. Two losses added to
# the task loss keep it healthy.
#
# **Specification.** Both return a 0-dimensional float32 tensor, computed in float32
# whatever the logits' dtype, differentiable with respect to the logits.
#
# * `my_load_balancing_loss(logits, experts)`, the **Switch load-balancing loss** (Fedus et
#   al., 2021), for `logits [T, E]` and the chosen `experts [T, k]`. With $N = E$, let $f_i$
#   be the fraction of the $T \cdot k$ routing slots that went to expert $i$ (counted from
#   `experts`, not differentiable) and $P_i = \frac1T\sum_t p_{t,i}$ the mean softmax
#   probability of expert $i$ (from `logits`, differentiable):
#
#   $$ \mathcal{L}_{\text{bal}} = N \sum_{i=1}^{N} f_i\, P_i . $$
#
# * `my_router_z_loss(logits)`, the **router z-loss** (ST-MoE, Zoph et al., 2022), for
#   `logits [..., E]`, averaged over every leading position:
#
#   $$ \mathcal{L}_z = \frac1T \sum_t \Big(\log \sum_i e^{\ell_{t,i}}\Big)^2 , $$
#
#   with the inner term computed so that it cannot overflow: logits around 90 must give a
#   finite loss.
#
# Off-limits: `minimoe.load_balancing_loss`, `minimoe.router_z_loss`.
#
# **Why.** With perfectly uniform routing, $f_i = P_i = 1/N$ and the balancing loss is
# exactly **1**; if every slot goes to one expert that also has all the probability, it is
# $N$. Its gradient flows through $P$ only, pushing probability away from the experts that
# get many slots. It is defined with the softmax probabilities whatever the router
# (MiniGPT-MoE adds $0.01\cdot\mathcal{L}_{\text{bal}}$ per layer to its loss). The z-loss
# penalises large logits, which round badly (in bf16, $e^{\ell}$ of a logit of 30 has an
# absolute error in the thousands) and make the softmax brittle.
#
# <details><summary>Hint 1: the idea</summary>
#
# $f$ is a histogram: `torch.bincount(experts.flatten(), minlength=E)` divided by the number
# of slots. $P$ is the softmax of the float32 logits averaged over the tokens. For the
# z-loss, `torch.logsumexp` computes $\log \sum_i e^{\ell_i}$ by subtracting the maximum
# first; `torch.log(torch.exp(l).sum())` overflows to `inf` for logits around 90 in
# float32.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# my_load_balancing_loss(logits, experts):
#     P = mean over tokens of softmax(float32(logits), -1)          # [E]
#     f = bincount(experts flattened, minlength=E) / experts.numel() # [E]
#     return E * sum(f * P)
#
# my_router_z_loss(logits):
#     return mean(logsumexp(float32(logits), -1) ** 2)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "losses", "locked": false, "schema_version": 3, "solution": true, "task": false}
def my_load_balancing_loss(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch loss N · Σ_i f_i · P_i for logits [T, E] and the chosen experts [T, k]."""
    ### BEGIN SOLUTION
    E = logits.shape[-1]
    P = logits.float().softmax(dim=-1).mean(dim=0)                               # [E]
    f = torch.bincount(experts.flatten(), minlength=E).float() / experts.numel()  # [E]
    return E * (f * P).sum()
    ### END SOLUTION


def my_router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)², float32."""
    ### BEGIN SOLUTION
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_balancing_loss", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _naive_balance(logits, experts):
    """N · Σ_i f_i · P_i with a Python loop over the experts: f_i counted slot by slot,
    P_i = the mean over the tokens of column i of the float32 softmax (differentiable)."""
    E = logits.shape[-1]
    p = logits.float().softmax(dim=-1)                                     # [T, E]
    slots = experts.flatten().tolist()                                     # T·k expert ids
    total = torch.zeros((), dtype=torch.float32)
    for i in range(E):
        f_i = sum(1 for s in slots if s == i) / len(slots)
        total = total + f_i * p[:, i].mean()
    return E * total


def _check_balance(logits, experts, want=None, what="", library=False):
    """my_load_balancing_loss's value and gradient against the loop above (library=True,
    for grading: against minimoe.load_balancing_loss)."""
    E = logits.shape[-1]
    where = f"{what}my_load_balancing_loss(logits {tuple(logits.shape)} {logits.dtype}, " \
            f"experts {tuple(experts.shape)}) with E = {E}"
    source = "minimoe" if library else "a loop over the experts"
    ref_lg = logits.detach().clone().requires_grad_()
    ref = (minimoe.load_balancing_loss if library else _naive_balance)(ref_lg, experts)
    lg = logits.detach().clone().requires_grad_()
    with _forbid_reference():
        got = my_load_balancing_loss(lg, experts)
    assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == torch.float32, \
        f"{where}: expected a 0-d float32 tensor, got {getattr(got, 'dtype', type(got))} " \
        f"{tuple(getattr(got, 'shape', ()))}"
    P = logits.float().softmax(-1).mean(0)
    rule = _rule_of(got, {
        "the factor N = E (uniform routing gives exactly 1)": ref / E,
        "f_i counts the routing slots in `experts` (bincount), not probabilities":
            E * P.square().sum(),
        "f_i is the fraction of the T·k slots (divide the counts by experts.numel())":
            ref * experts.shape[1]})
    if want is not None:
        assert abs(got.item() - want) < 1e-5, \
            f"{where}: expected {want}, got {got.item():.6f}{rule}"
    assert abs(got.item() - ref.item()) < 1e-5 * max(1.0, abs(ref.item())), \
        f"{where}: expected {ref.item():.6f} ({source}), got {got.item():.6f}{rule}"
    assert got.requires_grad, f"{where}: no gradient reached the logits (P_i carries it)"
    got.backward()
    ref.backward()
    assert lg.grad is not None, f"{where}: no gradient reached the logits (P_i carries it)"
    torch.testing.assert_close(lg.grad, ref_lg.grad, rtol=1e-4, atol=1e-6, msg=lambda m: (
        f"{where}: the gradient with respect to the logits differs (only P_i is "
        f"differentiable; f_i is a count):\n{m}"))


# uniform: 8 tokens, 4 experts, top-2 in round robin, equal logits -> exactly 1
_uniform = torch.tensor([[0, 1], [2, 3]] * 4)
_check_balance(torch.zeros(8, 4), _uniform, want=1.0)
# collapsed: every slot to expert 0, which has (almost) all the probability -> about E
_check_balance(torch.tensor([[30.0, 0, 0, 0]] * 6), torch.zeros(6, 1, dtype=torch.int64),
               want=4.0)
# hand value: E=2, f = (3/4, 1/4), P = mean softmax
_lg = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
_p = _lg.softmax(-1).mean(0)
_check_balance(_lg, torch.tensor([[0], [0], [0], [1]]).view(2, 2),
               want=2 * (0.75 * _p[0].item() + 0.25 * _p[1].item()))
_lg = randn(64, 8, seed=21) * 2
_check_balance(_lg, _naive_route(_lg, 2)[1])                 # the experts a top-2 router picks
_check_balance((randn(24, 8, seed=25) * 3).bfloat16(), distinct_experts(24, 2, 8, seed=25),
               what="bfloat16 logits (P in float32): ")
print("load-balancing loss: 1.0 when uniform, E when collapsed, a loop's value and gradient")

### BEGIN HIDDEN TESTS
# case: k = 3
_lg = randn(50, 6, seed=22)
_check_balance(_lg, minimoe.route(_lg, 3)[1], what="hidden: ", library=True)                 # k = 3
# case: experts that receive no slot
_check_balance(_lg, torch.full((50, 2), 5), what="hidden: ", library=True)  # experts 0-4 unused
# case: bfloat16 logits
_check_balance((randn(30, 8, seed=23) * 3).bfloat16(), distinct_experts(30, 2, 8, seed=23),
               what="hidden: ", library=True)
# case: a single token
_check_balance(randn(1, 8, seed=24), torch.tensor([[3, 1]]), what="hidden: ", library=True)  # T = 1
# case: one token per expert, equal logits
_check_balance(torch.zeros(6, 6), torch.arange(6).view(6, 1), want=1.0, what="hidden: ",
               library=True)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_z_loss", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
import math


def _naive_z(logits):
    """mean over the tokens of (log Σ_i e^{l_i})², token by token in Python floats
    (float64), each log-sum-exp as m + log Σ_i e^{l_i - m} with m the token's largest logit."""
    rows = logits.detach().double().reshape(-1, logits.shape[-1]).tolist()    # [T, E]
    lse = [max(r) + math.log(sum(math.exp(v - max(r)) for v in r)) for r in rows]
    return sum(v * v for v in lse) / len(lse)


def _check_z(logits, want=None, what="", library=False):
    """my_router_z_loss against `want`, else the loop above (library=True, for grading:
    against minimoe.router_z_loss)."""
    where = f"{what}my_router_z_loss(logits {tuple(logits.shape)} {logits.dtype})"
    ref = want if want is not None else minimoe.router_z_loss(logits).item() if library \
        else _naive_z(logits)
    with _forbid_reference():
        got = my_router_z_loss(logits)
    assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == torch.float32, \
        f"{where}: expected a 0-d float32 tensor, got {getattr(got, 'dtype', type(got))} " \
        f"{tuple(getattr(got, 'shape', ()))}"
    lse = torch.logsumexp(logits.float(), dim=-1)
    rule = _rule_of(got, {"sign: the z-loss is a positive penalty, +mean(lse²)": -ref,
                          "square the log-sum-exp of each token": lse.mean(),
                          "average over the tokens (mean, not sum)": lse.square().sum()})
    assert torch.isfinite(got) and abs(got.item() - ref) <= 1e-5 * max(1.0, abs(ref)), \
        f"{where}: expected {ref:.6f}, got {got.item():.6f}{rule}"


_check_z(torch.zeros(5, 8), want=torch.tensor(8.0).log().item() ** 2)     # (log E)²
_check_z(torch.tensor([[2.0, 2.0]]), want=(2 + torch.tensor(2.0).log().item()) ** 2)
_check_z(randn(3, 7, 8, seed=31) * 2)                                       # [B, T, E]
try:                                            # exp(95) overflows float32: logsumexp does not
    _check_z(torch.full((3, 5), 95.0), want=(95 + torch.tensor(5.0).log().item()) ** 2,
             what="logits of 95: ")
except AssertionError as _e:
    raise AssertionError(f"{_e}\nRule: compute log Σ exp with torch.logsumexp, which does not "
                         "overflow; log(exp(l).sum()) is inf for logits around 90") from _e
_check_z((randn(6, 8, seed=36) * 4).bfloat16(), what="bfloat16 logits (float32 math): ")
print("z-loss: (log E)² for zero logits, means over every leading position")

### BEGIN HIDDEN TESTS
# case: very large logits
_check_z(torch.full((2, 4), 100.0), want=(100 + torch.tensor(4.0).log().item()) ** 2,
         what="hidden: ", library=True)                               # exp(100) overflows float32
# case: bfloat16 logits
_check_z((randn(16, 8, seed=32) * 5).bfloat16(), what="hidden: ", library=True)
# case: a single token and a single expert
_check_z(randn(1, 1, seed=33), what="hidden: ", library=True)
# case: the gradient
_lg = randn(4, 8, seed=34).requires_grad_()
with _forbid_reference():
    my_router_z_loss(_lg).backward()
_ref = randn(4, 8, seed=34).requires_grad_()
minimoe.router_z_loss(_ref).backward()
torch.testing.assert_close(_lg.grad, _ref.grad, msg=lambda m: f"hidden: z-loss gradient:\n{m}")
### END HIDDEN TESTS

# %% [markdown]
# ## Part C — Exercise 3: sort the choices once
#
# A dispatch kernel wants every expert's tokens next to each other. ScatterMoE (Tan et al.,
# 2024) gets there without padding or copying the tokens: it flattens the `[T, k]` choices
# into $T\cdot k$ **slots** (slot $s = t\cdot k + j$ is the $j$-th choice of token
# $t = s /\!/ k$), sorts the slots by expert **stably**, and counts.
#
# **Specification.** Write `my_flatten_sort_count(expert_idxs, num_experts)` for
# `expert_idxs [T, k]` of any integer dtype; it returns three int64 tensors:
#
# * `sorted_expert_idxs [T·k]`: the experts of the slots, in sorted order;
# * `sorted_scattered_idxs [T·k]`: the slot each sorted row came from (its token is
#   `slot // k`); the sort is **stable**: slots of one expert stay in increasing order;
# * `expert_offsets [E]`: the **inclusive cumulative counts** — the *end* row of each expert:
#   expert $e$ owns sorted rows `offsets[e-1] : offsets[e]` (with `offsets[-1]` read as 0),
#   and `offsets[E-1] = T·k`. An expert with no token has an empty range: its offset equals
#   the previous one.
#
# Raise `ValueError` for a non-2-D input or an id outside `0..E-1`. Off-limits:
# `minimoe.flatten_sort_count`.
#
# Example, E = 4, `expert_idxs = [[2, 0], [1, 2], [2, 1]]` (T = 3, k = 2): the slots hold
# experts `[2, 0, 1, 2, 2, 1]`, so `sorted_expert_idxs = [0, 1, 1, 2, 2, 2]`,
# `sorted_scattered_idxs = [1, 2, 5, 0, 3, 4]`, `expert_offsets = [1, 3, 6, 6]`.
#
# <details><summary>Hint 1: the idea</summary>
#
# Flatten row-major (`reshape(-1)`) and cast to int64 first: then the position of an element
# in the flat vector *is* its slot. One `sort(stable=True)` gives both the sorted values and
# the indices they came from; the offsets are a histogram (`torch.bincount` with
# `minlength=E`, so that experts without tokens still get a count of 0) followed by
# `cumsum`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# expert_idxs not 2-D -> ValueError
# flat = int64(expert_idxs flattened row-major)                    # [T·k]
# any id < 0 or >= E -> ValueError
# sorted_expert_idxs, sorted_scattered_idxs = stable sort of flat (values, indices)
# expert_offsets = cumsum(bincount(flat, minlength=E))             # [E]
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "flatten_sort_count", "locked": false, "schema_version": 3, "solution": true, "task": false}
def my_flatten_sort_count(expert_idxs: torch.Tensor, num_experts: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, k] expert ids -> (sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)."""
    ### BEGIN SOLUTION
    if expert_idxs.dim() != 2:
        raise ValueError(f"expert_idxs must be [T, k], got {tuple(expert_idxs.shape)}")
    flat = expert_idxs.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    sorted_expert_idxs, sorted_scattered_idxs = flat.sort(stable=True)
    offsets = torch.bincount(flat, minlength=num_experts).cumsum(0)
    return sorted_expert_idxs, sorted_scattered_idxs, offsets
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_flatten_sort_count", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _naive_fsc(expert_idxs, E):
    """In Python: the slots 0..T·k-1 sorted by (expert, slot) with sorted(), each expert's
    slots counted one by one, the counts summed up to each expert (its end row)."""
    flat = [int(v) for v in expert_idxs.reshape(-1).tolist()]            # slot -> expert
    order = sorted(range(len(flat)), key=lambda s: (flat[s], s))
    ends, seen = [], 0
    for e in range(E):
        seen += sum(1 for v in flat if v == e)
        ends.append(seen)
    return [flat[s] for s in order], order, ends


def _check_fsc(expert_idxs, E, want=None, what="", library=False):
    """my_flatten_sort_count against `want`, else the loop above (library=True, for
    grading: against minimoe.flatten_sort_count)."""
    T, k = expert_idxs.shape
    where = f"{what}my_flatten_sort_count(expert_idxs {tuple(expert_idxs.shape)} " \
            f"{expert_idxs.dtype}, {E})"
    if want is None and library:
        ref = minimoe.flatten_sort_count(expert_idxs, E)
    else:
        ref = tuple(torch.tensor(v, dtype=torch.int64)
                    for v in (want if want is not None else _naive_fsc(expert_idxs, E)))
    with _forbid_reference():
        got = my_flatten_sort_count(expert_idxs, E)
    assert isinstance(got, tuple) and len(got) == 3, f"{where}: expected a tuple of three tensors"
    for name, g, r in zip(("sorted_expert_idxs", "sorted_scattered_idxs", "expert_offsets"),
                          got, ref, strict=True):
        assert isinstance(g, torch.Tensor) and g.dtype == torch.int64 and g.shape == r.shape, \
            f"{where}: {name} should be int64 of shape {tuple(r.shape)}, got " \
            f"{getattr(g, 'dtype', type(g))} {tuple(getattr(g, 'shape', ()))}" + (
                " (cast the ids to int64 first: any integer dtype in, int64 out)"
                if getattr(g, "dtype", None) != torch.int64 else
                " (one offset per expert, the empty ones included: bincount's minlength)"
                if name == "expert_offsets" else "")
        assert torch.equal(g, r), \
            f"{where}: {name}: expected {r.tolist()}, got {g.tolist()}" + (
                " (offsets are the inclusive cumulative counts, the END row of each expert)"
                if name == "expert_offsets" else
                " (a stable sort keeps each expert's slots in increasing order)"
                if name == "sorted_scattered_idxs" else "")
    # what the three outputs mean, said directly
    sei, ssi, off = got
    flat = expert_idxs.reshape(-1).long()
    assert torch.equal(flat[ssi], sei), f"{where}: flat[sorted_scattered_idxs] != sorted_expert_idxs"
    starts = torch.cat([off.new_zeros(1), off[:-1]])
    for e in range(E):
        assert (sei[starts[e]:off[e]] == e).all()


_check_fsc(torch.tensor([[2, 0], [1, 2], [2, 1]]), 4,
           want=([0, 1, 1, 2, 2, 2], [1, 2, 5, 0, 3, 4], [1, 3, 6, 6]))
_check_fsc(distinct_experts(64, 2, 8, seed=41), 8)
_check_fsc(torch.tensor([[3], [3], [0]]), 5, want=([0, 3, 3], [2, 0, 1], [1, 1, 1, 3, 3]))
_check_fsc(torch.tensor([[1, 0], [0, 2]], dtype=torch.int32), 3,         # int32 in, int64 out
           want=([0, 0, 1, 2], [1, 2, 0, 3], [2, 3, 4]))
try:
    with _forbid_reference():
        my_flatten_sort_count(torch.tensor([[0, 1], [4, 2]]), 4)
except ValueError:
    pass
else:
    raise AssertionError("my_flatten_sort_count([[0, 1], [4, 2]], 4) should raise ValueError: "
                         "expert id 4 is outside 0..3 (rule: check the ids)")
print("flatten_sort_count: stable order, slots, inclusive end offsets — as sorted() in Python")

### BEGIN HIDDEN TESTS
# case: k = 3
_check_fsc(distinct_experts(7, 3, 6, seed=42), 6, what="hidden: ", library=True)  # k = 3
# case: a single token
_check_fsc(torch.tensor([[4, 1, 0]]), 6, what="hidden: ", library=True)  # T = 1
# case: every token to one expert
_check_fsc(torch.full((5, 2), 2), 4, what="hidden: ", library=True)  # every token to one expert
# case: a single expert
_check_fsc(torch.zeros(4, 1, dtype=torch.int64), 1, what="hidden: ", library=True)  # E = 1
# case: int32 expert ids
_check_fsc(distinct_experts(33, 2, 8, seed=43).int(), 8, what="hidden: ", library=True)  # int32
# case: only the last experts used
_check_fsc(torch.tensor([[7, 6], [6, 7]]), 8, what="hidden: ", library=True)  # experts 0..5 empty
# case: invalid inputs
for _bad in ((torch.tensor([[0, 8]]), 8), (torch.tensor([[0, -1]]), 8), (torch.arange(4), 8)):
    try:
        with _forbid_reference():
            my_flatten_sort_count(*_bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"hidden: my_flatten_sort_count{_bad} should raise ValueError")
### END HIDDEN TESTS

# %% [markdown]
# ## Part D — Exercise 4: the naive MoE forward
#
# Now the layer itself, in plain PyTorch and **per expert**, not per token.
#
# **Specification.** Write `my_moe_forward(x, weights, experts, w_gate, w_up, w_down)` with
# `x [T, C]`, the router's `weights [T, k]` and `experts [T, k]`, and the expert weights
# `w_gate`, `w_up` `[E, C, F]` and `w_down` `[E, F, C]`; return `[T, C]` in the dtype of `x`:
#
# $$ y_t = \sum_{j=1}^{k} g_{t,j}\; \big(\mathrm{silu}(x_t W^{\text{gate}}_{e_{t,j}}) \odot
#    x_t W^{\text{up}}_{e_{t,j}}\big) W^{\text{down}}_{e_{t,j}} . $$
#
# * At most **three matrix products per expert that has tokens**, whatever $T$: run each
#   expert once, on all of its tokens together (the test counts your products).
# * Gradients come from autograd, to `x`, to each weight, and to the gates (hence to the
#   router); an expert that receives no token gets an exactly-zero gradient (no NaN).
# * Cast the gates to the dtype of the expert outputs.
#
# Off-limits: `minimoe.dispatch_torch`, `dispatch_triton`, `expert_swiglu`, `parallel_linear`
# and the loops in `minimoe.reference` (`moe_loop` is what you are checked against: three
# products per (token, choice)).
#
# <details><summary>Hint 1: the idea</summary>
#
# Loop over the experts, not the tokens. For expert $e$, `(experts == e).nonzero(as_tuple=True)`
# gives the `(token, slot)` pairs that chose it (skip the expert when there are none);
# `x[token]` **gathers** its tokens into one `[n_e, C]` matrix; the gate of each row is
# `weights[token, slot]`. After the SwiGLU, **scatter-add** the gated rows back into the
# output rows of their tokens with `index_add` (a token appears once per expert at most, but
# several experts add to the same row). The out-of-place `out = out.index_add(...)` keeps
# autograd simple.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# out = zeros like x                                            # [T, C]
# for e in 0 .. E-1:
#     token, slot = positions where experts == e                # [n_e] each
#     if none: continue
#     xe = x[token]                                             # [n_e, C]
#     y  = (silu(xe @ w_gate[e]) * (xe @ w_up[e])) @ w_down[e]  # [n_e, C]
#     out = out.index_add(0, token, y * weights[token, slot][:, None] in y's dtype)
# return out
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "moe_forward", "locked": false, "schema_version": 3, "solution": true, "task": false}
def my_moe_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
                   ) -> torch.Tensor:
    """x [T, C], weights/experts [T, k], w_gate/w_up [E, C, F], w_down [E, F, C] -> [T, C]."""
    ### BEGIN SOLUTION
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        xe = x[token]                                                   # [n_e, C]
        y = (F.silu(xe @ w_gate[e]) * (xe @ w_up[e])) @ w_down[e]       # [n_e, C]
        out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_moe_forward", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.bridged import in_learner


def moe_case(T, C, F_, E, k, seed=0, dtype=torch.float32, experts=None):
    """Random inputs of one MoE layer: x, router weights (rows sum to 1), experts, weights."""
    x = randn(T, C, seed=seed, dtype=dtype)
    e = distinct_experts(T, k, E, seed=seed) if experts is None else experts
    w = torch.rand(T, k, generator=torch.Generator().manual_seed(seed + 1)) + 0.1
    w = w / w.sum(-1, keepdim=True)
    ws = [randn(*s, seed=seed + 2 + i, dtype=dtype) * s[1] ** -0.5
          for i, s in enumerate(((E, C, F_), (E, C, F_), (E, F_, C)))]
    return x, w, e, *ws


# in-process check: how many matrix products my_moe_forward runs (counted where it runs)
def _count_moe_forward_matmuls(x, w, e, wg, wu, wd):
    """Runs my_moe_forward(x, w, e, wg, wu, wd) once, in the process that runs your code,
    under a dispatch mode that counts the matrix products (mm, bmm, mv, dot, ...); their
    number."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        KINDS = ("mm", "bmm", "addmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_mm")
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in self.KINDS:
                self.n += 1
            return func(*args, **(kwargs or {}))

    with Counter() as counter:
        my_moe_forward(x, w, e, wg, wu, wd)
    return counter.n


def _naive_moe(x, w, e, wg, wu, wd):
    """The MoE layer token by token and choice by choice, dense (three matrix-vector
    products per (token, choice)): y_t = Σ_j w[t, j] · (silu(x_t Wg_e) ⊙ x_t Wu_e) Wd_e with
    e = e[t, j]. x [T, C], w/e [T, k], wg/wu [E, C, F], wd [E, F, C] -> [T, C]."""
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])                                                  # [C]
        for j in range(e.shape[1]):
            i = int(e[t, j])
            h = F.silu(x[t] @ wg[i]) * (x[t] @ wu[i])                               # [F]
            y = y + w[t, j].to(x.dtype) * (h @ wd[i])
        rows.append(y)
    return torch.stack(rows)


def _moe_forward_rule(got, x, w, e, wg, wu, wd):
    """What a wrong output of my_moe_forward most likely did, in words."""
    terms = torch.stack([_naive_moe(x, w * (torch.arange(w.shape[1]) == j), e, wg, wu, wd)
                         for j in range(w.shape[1])], dim=1)               # [T, k, C]
    last = terms.gather(1, e.argmax(1)[:, None, None].expand(-1, 1, x.shape[1]))[:, 0]
    return _rule_of(got, {
        "gate weight: multiply each expert's output by its weight": _naive_moe(
            x, torch.ones_like(w), e, wg, wu, wd),
        "silu of the gate projection x·W_gate, times x·W_up (not the other way)": _naive_moe(
            x, w, e, wu, wg, wd),
        "sum the k gated experts of each token (index_add; assigning rows keeps only the "
        "last expert)": last}, rtol=1e-4, atol=1e-5)


def _check_moe_forward(T, C, F_, E, k, seed=0, dtype=torch.float32, experts=None, what="",
                       count=False, library=False):
    """my_moe_forward against the token-by-token loop above (library=True, for grading:
    against minimoe.reference.moe_loop)."""
    x, w, e, wg, wu, wd = moe_case(T, C, F_, E, k, seed, dtype, experts)
    where = f"{what}my_moe_forward on T={T}, C={C}, F={F_}, E={E}, k={k}, {dtype}"
    source = "minimoe.reference.moe_loop" if library else "a token-by-token loop"
    want = (moe_loop if library else _naive_moe)(x, w, e, wg, wu, wd)
    with _forbid_reference():
        got = my_moe_forward(x, w, e, wg, wu, wd)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == x.dtype, \
        f"{where}: expected a {x.dtype} tensor of shape {tuple(want.shape)}, got " \
        f"{getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: (
        f"{where}: the output differs from {source}:\n{m}"
        f"{_moe_forward_rule(got, x, w, e, wg, wu, wd)}"))
    if count:
        with _forbid_reference():
            n = in_learner(_count_moe_forward_matmuls, x, w, e, wg, wu, wd)
        used = len(e.unique())
        assert isinstance(n, int) and n <= 3 * used, \
            f"{where}: {n} matrix products for {used} experts with tokens; expected at " \
            f"most 3 per expert (gather each expert's tokens and run them together, not one " \
            f"token at a time)"


_check_moe_forward(T=7, C=24, F_=40, E=4, k=2, count=True)
_check_moe_forward(T=64, C=16, F_=24, E=8, k=2, seed=1, count=True)
_check_moe_forward(T=5, C=8, F_=12, E=4, k=1, seed=2, count=True)
_check_moe_forward(T=9, C=16, F_=24, E=6, k=3, seed=11, count=True)
print("my_moe_forward: equals the per-token loop, with at most 3 matrix products per expert")

### BEGIN HIDDEN TESTS
# case: a single token
_check_moe_forward(T=1, C=24, F_=40, E=8, k=2, seed=3, what="hidden: ", library=True)  # T = 1
# case: k = 3
_check_moe_forward(T=9, C=16, F_=24, E=6, k=3, seed=4, what="hidden: ", library=True)  # k = 3
# case: experts without tokens
# experts 0, 3 idle
_check_moe_forward(T=6, C=8, F_=12, E=4, k=2, seed=5, what="hidden: ", library=True,
                   experts=torch.tensor([[1, 2], [2, 1]] * 3))
# case: a single expert
_check_moe_forward(T=8, C=8, F_=12, E=1, k=1, seed=6, what="hidden: ", library=True)  # E = 1
# case: float64 inputs
_check_moe_forward(T=10, C=12, F_=20, E=5, k=2, seed=7, dtype=torch.float64, what="hidden: ",
                   library=True)
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_moe_backward", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
NAMES = ("x", "weights", "w_gate", "w_up", "w_down")


def _moe_grads(fn, inputs, experts, dout, forbid_ref=False):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    x, w, wg, wu, wd = leaves
    if forbid_ref:
        with _forbid_reference():
            out = fn(x, w, experts, wg, wu, wd)
    else:
        out = fn(x, w, experts, wg, wu, wd)
    (out * dout).sum().backward()
    return [t.grad for t in leaves]


def _check_moe_backward(T, C, F_, E, k, seed=0, dtype=torch.float32, experts=None, what="",
                        library=False):
    """Autograd through my_moe_forward against autograd through the token-by-token loop
    (library=True, for grading: through minimoe.reference.moe_loop)."""
    x, w, e, wg, wu, wd = moe_case(T, C, F_, E, k, seed, dtype, experts)
    dout = randn(T, C, seed=seed + 9, dtype=dtype)
    where = f"{what}gradients of my_moe_forward on T={T}, C={C}, F={F_}, E={E}, k={k}, {dtype}"
    want = _moe_grads(moe_loop if library else _naive_moe, (x, w, wg, wu, wd), e, dout)
    got = _moe_grads(my_moe_forward, (x, w, wg, wu, wd), e, dout, forbid_ref=True)
    for name, g, r in zip(NAMES, got, want, strict=True):
        assert g is not None, \
            f"{where}: no gradient reached {name} (is something detached, or computed " \
            f"under torch.no_grad()?)"
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: (
            f"{where}: d{name} differs from the per-token loop's:\n{m}"))
    idle = sorted(set(range(E)) - set(e.unique().tolist()))
    for name, g in zip(NAMES[2:], got[2:], strict=True):
        for i in idle:
            assert torch.count_nonzero(g[i]) == 0 and torch.isfinite(g[i]).all(), \
                f"{where}: expert {i} received no token, so d{name}[{i}] must be exactly zero"


_check_moe_backward(T=7, C=24, F_=40, E=4, k=2)
_check_moe_backward(T=16, C=16, F_=24, E=8, k=2, seed=1)
# experts 1 and 3 receive no token: exact zeros in their weight gradients
_check_moe_backward(T=4, C=8, F_=12, E=4, k=2, seed=9, what="two idle experts: ",
                    experts=torch.tensor([[0, 2], [2, 0]] * 2))
print("my_moe_forward backward: dx, dgates, dw_gate, dw_up, dw_down equal the loop's")

### BEGIN HIDDEN TESTS
# case: experts without tokens
# experts 0 and 3 receive nothing: their gradients are exact zeros, not NaN, not missing
_check_moe_backward(T=6, C=8, F_=12, E=4, k=2, seed=5, what="hidden: ", library=True,
                    experts=torch.tensor([[1, 2], [2, 1]] * 3))
# case: k = 3
_check_moe_backward(T=9, C=16, F_=24, E=6, k=3, seed=4, what="hidden: ", library=True)
# case: a single token
_check_moe_backward(T=1, C=8, F_=12, E=8, k=2, seed=3, what="hidden: ", library=True)
# case: float64, every token to one expert
_check_moe_backward(T=5, C=8, F_=12, E=3, k=1, seed=8, dtype=torch.float64, what="hidden: ",
                    library=True,
                    experts=torch.full((5, 1), 2))                     # every token to one expert
### END HIDDEN TESTS

# %% [markdown]
# ## Part E — Exercise 5: balancing without a loss (DeepSeek-V3)
#
# A balancing loss trades task quality for balance: its gradient reaches the router weights
# and fights the task's gradient there. DeepSeek-V3 (2024) balances instead with the
# selection bias of the sigmoid router (Exercise 1), which no gradient touches. After each
# training step, with `tokens_per_expert` the counts of that step,
#
# $$ b_i \leftarrow b_i + \gamma\cdot \operatorname{sign}(\bar c - c_i), \qquad
#    \bar c = \tfrac1E \textstyle\sum_i c_i : $$
#
# underloaded experts move up by the rate $\gamma$, overloaded ones down, exactly-average
# ones stay. Since the bias only chooses, the weights — and so the model's function for a
# given choice — are untouched.
#
# **Specification.** Write `my_update_selection_bias(bias, tokens_per_expert, rate)` for
# `bias [E]` (any float dtype), `tokens_per_expert [E]` (integer or float counts) and a float
# `rate` $\gamma$: return the updated bias above as a **new** float32 tensor `[E]`; `bias`
# itself must not change (no in-place update). Off-limits: `minimoe.update_selection_bias`.
#
# <details><summary>Hint 1: the idea</summary>
#
# Cast the counts to float before taking their mean (`mean` refuses integer tensors), and
# the bias to float32; `torch.sign` gives $-1$, $0$ or $+1$ per expert. An expression such
# as `bias.float() + ...` builds a new tensor; `+=` on `bias` would change the caller's.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# load = float32(tokens_per_expert)
# return float32(bias) + rate * sign(mean(load) - load)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "selection_bias", "locked": false, "schema_version": 3, "solution": true, "task": false}
def my_update_selection_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                             rate: float) -> torch.Tensor:
    """bias + rate · sign(mean load − load), a new float32 tensor."""
    ### BEGIN SOLUTION
    load = tokens_per_expert.float()
    return bias.float() + rate * torch.sign(load.mean() - load)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_selection_bias", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
from course.notebook.harness import unchanged


def _naive_bias(bias, counts, rate):
    """Expert by expert in Python: b_i + rate if c_i is below the mean count, b_i - rate if
    above, b_i if on it; float32."""
    load = [float(c) for c in counts.tolist()]
    mean = sum(load) / len(load)
    return torch.tensor([b + rate * ((c < mean) - (c > mean))
                         for b, c in zip(bias.float().tolist(), load, strict=True)],
                        dtype=torch.float32)


def _check_bias(bias, counts, rate, want=None, what="", library=False):
    """my_update_selection_bias against `want`, else the loop above (library=True, for
    grading: against minimoe.update_selection_bias)."""
    where = f"{what}my_update_selection_bias({bias.tolist()}, {counts.tolist()}, {rate})"
    if want is not None:
        want = torch.tensor(want, dtype=torch.float32)
    else:
        want = (minimoe.update_selection_bias if library else _naive_bias)(bias, counts, rate)
    with _forbid_reference(), unchanged(f"{where}: no update in place, return a new tensor",
                                        bias=bias):
        got = my_update_selection_bias(bias, counts, rate)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 \
        and got.shape == bias.shape, \
        f"{where}: expected a float32 tensor of shape {tuple(bias.shape)}, got " \
        f"{getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}"
    b, load = bias.float(), counts.float()
    rule = _rule_of(got, {
        "sign: underloaded experts (below the mean load) move UP": 2 * b - want,
        "an expert exactly at the mean load stays (sign(0) = 0)":
            b + rate * torch.where(load > load.mean(), -1.0, 1.0),
        "the step is ±rate, the sign of the gap, not the gap itself":
            b + rate * (load.mean() - load)})
    torch.testing.assert_close(got, want, msg=lambda m: f"{where}: expected {want.tolist()}, "
                               f"got {got.tolist()}\n{m}{rule}")


# mean load 10: experts 0 and 3 are under it, 1 over it, 2 exactly on it
_check_bias(torch.zeros(4), torch.tensor([4, 22, 10, 4]), 0.01, want=[0.01, -0.01, 0.0, 0.01])
_check_bias(torch.tensor([0.5, -0.2, 0.0]), torch.tensor([1.0, 7.0, 1.0]), 0.1)
_check_bias(torch.tensor([0.25, 0.0], dtype=torch.bfloat16), torch.tensor([2, 6]), 0.125,
            what="a bfloat16 bias (the result is float32): ")
print("update_selection_bias: up for the underloaded, down for the overloaded, as a loop")

### BEGIN HIDDEN TESTS
# case: a balanced load
# balanced
_check_bias(torch.linspace(-1, 1, 8), torch.full((8,), 5), 0.3, what="hidden: ", library=True)
# case: a rate of 0
# rate 0
_check_bias(torch.ones(6), torch.tensor([0, 0, 0, 0, 0, 12]), 0.0, what="hidden: ", library=True)
# case: a bfloat16 bias
_check_bias(torch.zeros(5, dtype=torch.bfloat16), torch.tensor([3, 1, 4, 1, 5]), 0.05,
            what="hidden: ", library=True)
### END HIDDEN TESTS

# %% [markdown]
# ### The bias update at work
#
# A sigmoid router with a built-in skew: expert $i$'s logits are shifted by a constant that
# falls from $+1.5$ (expert 0) to $-1.5$ (expert 7), so without help experts 0–1 take most
# of the load. Every step routes a fresh batch of 512 tokens, counts the load, and updates
# the bias with your function at rate 0.01 (DeepSeek-V3 uses 0.001 over many more steps).

# %%
E_DEMO, K_DEMO, T_DEMO = 8, 2, 512
skew = torch.linspace(1.5, -1.5, E_DEMO)
g = torch.Generator().manual_seed(0)
bias = torch.zeros(E_DEMO)
history = {"no bias": [], "bias update": []}
for _step in range(300):
    logits = torch.randn(T_DEMO, E_DEMO, generator=g) + skew
    for name in history:
        b = bias if name == "bias update" else None
        w, e = my_route(logits, K_DEMO, "sigmoid_topk", renormalize=True, bias=b)
        counts = torch.bincount(e.flatten(), minlength=E_DEMO)
        history[name].append(counts.float() / counts.sum())
        if b is not None:
            bias = my_update_selection_bias(bias, counts, rate=0.01)
print("final bias:", [round(v, 2) for v in bias.tolist()])

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
for name, loads in history.items():
    loads = torch.stack(loads)
    axes[0].plot((loads.max(1).values * E_DEMO).tolist(), label=name)
    print(f"{name:12s} load in the last 50 steps:",
          [f"{v:.3f}" for v in loads[-50:].mean(0).tolist()])
axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
axes[0].set(xlabel="step", ylabel="busiest expert's load × E (1 = balanced)",
            title="sigmoid router with a skew")
axes[0].legend()
xs = torch.arange(E_DEMO)
for off, (name, loads) in zip((-0.2, 0.2), history.items(), strict=True):
    axes[1].bar(xs + off, torch.stack(loads)[-50:].mean(0).tolist(), width=0.4, label=name)
axes[1].axhline(1 / E_DEMO, color="gray", lw=0.8, ls="--")
axes[1].set(xlabel="expert", ylabel="share of the slots (last 50 steps)",
            title="tokens per expert")
axes[1].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Part F — Your router and MoE inside the pretrained MiniGPT-MoE
#
# `MoEMLP.forward` calls `route`, `load_balancing_loss` and a dispatch function that it looks
# up in `minimoe.moe` when it runs. The test below puts yours there (with
# `course.notebook.harness.swap`, which replaces a function wherever it is bound) and runs the
# pretrained MiniGPT-MoE on evaluation prompts of every task: the logits, every layer's choices and the balancing loss must be the model's own.

# %% nbgrader={"grade": true, "grade_id": "test_minigpt_moe", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def eval_batch(per_task=8, seed=0):
    """[6 · per_task, L] prompts of every task's eval split, padded on the right."""
    ex = [e for t in tasks.TASKS for e in tasks.make_examples(t, per_task, seed, "eval")]
    return SequenceData.from_pairs([(tok.encode(e.prompt), tok.encode(e.answer)) for e in ex],
                                   pad_id=tok.pad_id).tokens


@contextlib.contextmanager
def _yours_in_the_model():
    """Your route, balancing loss and MoE forward stand in for minimoe's wherever the model
    reaches them; the rest of what you rebuilt stays switched off."""
    yours = {minimoe.route: my_route, minimoe.load_balancing_loss: my_load_balancing_loss,
             minimoe.dispatch_torch: my_moe_forward}
    with contextlib.ExitStack() as stack:
        for reference, mine in yours.items():
            stack.enter_context(swap(reference, mine, globals()))
        stack.enter_context(forbid([_BOUND_AT[t] for t in _REFERENCE if t not in yours],
                                   globals(), why=_WHY))
        yield


@contextlib.contextmanager
def _loops_in_the_model():
    """The per-token loops of the tests above (router, balancing loss, MoE layer) stand in
    for minimoe's wherever the model reaches them: what the model computes, found without
    the library functions this lab rebuilds."""
    loops = {minimoe.route: _naive_route, minimoe.load_balancing_loss: _naive_balance,
             minimoe.dispatch_torch: _naive_moe}
    with contextlib.ExitStack() as stack:
        for reference, loop in loops.items():
            stack.enter_context(swap(reference, loop, globals()))
        yield


def run_moe(model, idx):
    with torch.no_grad():
        logits = model(idx)
    return logits, [b.mlp.last_experts.clone() for b in model.blocks], model.aux_loss().item()


_idx = eval_batch()
with _loops_in_the_model():
    _want = run_moe(moe_model, _idx)
with _yours_in_the_model():
    _got = run_moe(moe_model, _idx)
for _i, (_g, _w) in enumerate(zip(_got[1], _want[1], strict=True)):
    _diff = (_g != _w).any(1).sum().item()
    assert _diff == 0, f"block {_i}: your router chose other experts for {_diff} of " \
                       f"{len(_w)} tokens"
torch.testing.assert_close(_got[0], _want[0], rtol=1e-4, atol=1e-4, msg=lambda m: (
    f"MiniGPT-MoE with your router and MoE computes other logits:\n{m}"))
assert abs(_got[2] - _want[2]) < 1e-4, \
    f"the summed balancing loss: expected {_want[2]:.5f}, got {_got[2]:.5f}"
print(f"MiniGPT-MoE on {len(_idx)} prompts with your code: same routing in all 4 blocks, "
      f"max |logit difference| {(_got[0] - _want[0]).abs().max().item():.1e}, "
      f"balancing loss {_got[2]:.4f} (4 blocks)")

### BEGIN HIDDEN TESTS
# case: other prompts, truncated
_idx = eval_batch(per_task=4, seed=1)[:, :9]
_want = run_moe(moe_model, _idx)
with _yours_in_the_model():
    _got = run_moe(moe_model, _idx)
assert all(torch.equal(a, b) for a, b in zip(_got[1], _want[1], strict=True)), "hidden: routing"
torch.testing.assert_close(_got[0], _want[0], rtol=1e-4, atol=1e-4)
### END HIDDEN TESTS

# %% [markdown]
# ### Which experts does each task use?
#
# One prompt at a time (no padding tokens in the counts), 50 evaluation prompts per task —
# the recipe of experiment 00, whose `metrics.json` stores the result as
# `moe.expert_load[task][layer][expert]`. The heatmaps show the share of each task's routing
# slots that each expert receives, per block. `rev` was held out of pretraining: the router
# has never seen it.

# %% tags=["jupyter-only"]
metrics = json.loads((ROOT / "experiments" / "00-pretrain-base" / "metrics.json").read_text())
stored = metrics["moe"]["expert_load"]
n_layer, n_exp = moe_model.config.n_layer, moe_model.config.n_experts
t0 = time.perf_counter()
counts = {}
with torch.no_grad():
    for task in tasks.TASKS:
        c = torch.zeros(n_layer, n_exp)
        for ex in tasks.make_examples(task, 50, seed=0, split="eval"):
            moe_model(torch.tensor([tok.encode(ex.prompt)]))
            for i, block in enumerate(moe_model.blocks):
                c[i] += torch.bincount(block.mlp.last_experts.flatten(), minlength=n_exp)
        counts[task] = c
load = {t: c / c.sum(1, keepdim=True) for t, c in counts.items()}
diff = max((load[t] - torch.tensor(stored[t])).abs().max().item() for t in tasks.TASKS)
print(f"routing of {6 * 50} prompts in {time.perf_counter() - t0:.1f} s; "
      f"max difference from metrics.json: {diff:.1e}")

names = list(tasks.TASKS)
fig, axes = plt.subplots(1, n_layer, figsize=(14, 3.2), sharey=True)
for i, ax in enumerate(axes):
    grid = torch.stack([load[t][i] for t in names])                 # [tasks, experts]
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=0.5)
    ax.set(title=f"block {i}", xlabel="expert", xticks=range(n_exp))
    ax.set_yticks(range(len(names)), [t + (" (held out)" if t == tasks.HELD_OUT else "")
                                      for t in names])
fig.colorbar(im, ax=axes, shrink=0.8, label="share of the task's slots")
fig.suptitle("MiniGPT-MoE routing per task (uniform = 0.125)")
plt.show()

# %% [markdown]
# ### Tokens per expert
#
# The same counts summed over the five pretraining tasks: how many of the routing slots each
# expert receives in each block. The balancing loss (coefficient 0.01 in pretraining) keeps
# no expert empty, but it does not make them equal — and it does not need to.

# %% tags=["jupyter-only"]
fig, ax = plt.subplots(figsize=(9, 3.4))
total = sum(counts[t] for t in tasks.PRETRAIN_TASKS)                 # [layers, experts]
width = 0.8 / n_layer
for i in range(n_layer):
    ax.bar(torch.arange(n_exp) + (i - (n_layer - 1) / 2) * width, total[i].tolist(),
           width=width, label=f"block {i}")
ax.axhline(total[0].sum().item() / n_exp, color="gray", lw=0.8, ls="--", label="uniform")
ax.set(xlabel="expert", ylabel="routing slots", xticks=range(n_exp),
       title="tokens per expert, pretraining tasks, 250 prompts")
ax.legend(ncol=5, fontsize=8)
plt.show()
for i in range(n_layer):
    share = total[i] / total[i].sum()
    print(f"block {i}: busiest expert {share.max():.3f}, idlest {share.min():.3f} "
          f"(uniform 0.125)")

# %% [markdown]
# ### What the balancing loss does in training
#
# A tiny MiniGPT-MoE (2 blocks, width 64, 8 experts, top-2) trained from scratch for 100
# steps on the pretraining tasks, three times with the same seed and data: without the
# balancing loss, with the pretraining coefficient 0.01, and with 0.1. Plotted: the Switch
# loss itself (mean over blocks, 1 = balanced) and the busiest expert's share, step by step.

# %% tags=["jupyter-only"]
examples = tasks.make_mixture(tasks.PRETRAIN_TASKS, 200, seed=0)
data = SequenceData.from_pairs([(tok.encode(e.prompt), tok.encode(e.answer) + [tok.eos_id])
                                for e in examples], pad_id=tok.pad_id)
TINY = MiniGPTConfig(n_layer=2, n_head=2, n_embd=64, d_ff=64, n_experts=8, top_k=2,
                     block_size=32)


def train_tiny(aux_coef, steps=100, batch=32, seed=0):
    torch.manual_seed(seed)
    model = MiniGPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    log = {"task loss": [], "balancing loss": [], "busiest share": []}
    for _ in range(steps):
        x, y, mask = data.batch(torch.randint(0, len(data), (batch,), generator=g))
        loss = sequence_loss(model, x, y, mask)
        aux = model.aux_loss()
        (loss + aux_coef * aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        shares = [torch.bincount(b.mlp.last_experts.flatten(), minlength=8).float()
                  for b in model.blocks]
        log["task loss"].append(loss.item())
        log["balancing loss"].append(aux.item() / len(model.blocks))
        log["busiest share"].append(max((s / s.sum()).max().item() for s in shares))
    return log


t0 = time.perf_counter()
runs = {c: train_tiny(c) for c in (0.0, 0.01, 0.1)}
print(f"3 × 100 steps in {time.perf_counter() - t0:.1f} s")


def smooth(v, n=10):
    v = torch.tensor(v)
    return [v[max(0, i - n + 1):i + 1].mean().item() for i in range(len(v))]


fig, axes = plt.subplots(1, 3, figsize=(14, 3.4))
for c, log in runs.items():
    for ax, key in zip(axes, log, strict=True):
        ax.plot(smooth(log[key]), label=f"aux_loss_coef {c}")
        ax.set(xlabel="step", title=key + " (10-step mean)")
    print(f"coef {c:<4}: last 20 steps — task loss {sum(log['task loss'][-20:]) / 20:.3f}, "
          f"balancing loss {sum(log['balancing loss'][-20:]) / 20:.3f}, "
          f"busiest expert {sum(log['busiest share'][-20:]) / 20:.3f}")
axes[1].axhline(1.0, color="gray", lw=0.8, ls="--")
axes[2].axhline(1 / 8, color="gray", lw=0.8, ls="--")
axes[0].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Where this goes next
#
# You have the whole MoE layer in plain PyTorch: routers that choose deterministically, the
# losses that keep them spread, the sort that lines the choices up by expert, and a forward
# whose gradients autograd gets right. Its cost is the loop over experts: $E$ small GEMMs,
# each after a gather that copies the expert's tokens. Lab 08 writes **scatter2scatter**, one
# Triton kernel that walks the sorted rows of `flatten_sort_count` and does the gather, the
# per-expert GEMM and the scatter in one pass with no padding; Lab 09 writes its backward (dX
# with the same kernel, dW as the scattered outer product, the gate gradients) and checks it
# against the loop you wrote here.
#
# ### Reflection
#
# 1. With k = 1, why does Switch *not* renormalise the kept weight? What gradient would the
#    router receive from the task loss if it did?
# 2. $\mathcal{L}_{\text{bal}} = N\sum_i f_i P_i$ uses the counts $f$ and the probabilities
#    $P$. Why not $N\sum_i f_i^2$, or $N\sum_i P_i^2$? Which of the two is differentiable, and
#    which measures what the hardware actually sees?
# 3. The selection bias changes which experts a token uses but not their weights. What does
#    a token lose when the bias pushes it from its best expert to its third? Why is that
#    still better, for DeepSeek-V3, than a larger balancing loss?
# 4. In the heatmaps, are the early or the late blocks more task-specific? What would you
#    expect the held-out task `rev` to look like after Lab 05's fine-tune, and how would you
#    check?
# 5. `expert_offsets` holds end rows. With a row tile of 16 sorted rows, how does a kernel
#    find which experts a tile touches, and why can a tile span several experts (Lab 08)?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. With one expert, the renormalised weight is $p_e / p_e = 1$ for every token, whatever the
#    logits: the output is $\mathrm{expert}_e(x)$ alone and the task loss does not depend on
#    the router's logits at all, so its gradient with respect to them is exactly zero (the
#    choice itself is discrete). The router would learn only from the balancing loss. Without
#    renormalisation the output is $p_e \cdot \mathrm{expert}_e(x)$, and the task gradient
#    reaches the logits through $p_e$: it says whether more or less of the chosen expert
#    would have helped.
# 2. $N\sum_i f_i^2$ is built from counts of an argmax: piecewise constant, its gradient is
#    zero almost everywhere, so it cannot train the router. $N\sum_i P_i^2$ is differentiable
#    but measures the soft probabilities, not the load: a router can make every token's
#    distribution nearly flat while its top-k picks still pile onto one expert, and the
#    hardware sees the picks. The product uses each for what it is good at: $f$ measures the
#    real load (and weights the penalty towards the overloaded experts), $P$ carries the
#    gradient. The pretrained MiniGPT-MoE sits at 4.0259 over 4 blocks, about 1.006 per
#    block, close to the uniform value 1.
# 3. It loses affinity: its third expert scores lower for it (a smaller unbiased weight $s$,
#    an expert less suited to that token), so that layer's contribution is somewhat worse
#    for that token. But the weight stays the true score, so the function computed for a
#    given choice is not distorted, and only the tokens at the margin of an overloaded expert
#    move. A larger balancing loss instead sends a gradient into the router on every token,
#    fighting the task gradient everywhere. In the demo above the bias alone brings the load
#    from 0.357 / 0.004 on the busiest / idlest expert to 0.124–0.126 on all eight.
# 4. The early block: a task's routing in block 0 is, on average, 0.32 away (total variation)
#    from the all-task average, against 0.20–0.22 in blocks 1–3 (`add` reaches 0.46 in block
#    0). Block 0's router sees little more than the character and its position, and the tasks
#    differ in their characters (digits for `add`, `a`/`b`/`c` for `count`), so it separates
#    them lexically. After a LoRA fine-tune on `rev`, the router weights are frozen but their
#    inputs change from block 1 on, so `rev`'s routing there may drift towards a few experts.
#    To check, run the heatmap cell on the fine-tuned model and compare `rev`'s row per block
#    with the one stored in experiment 00's `metrics.json` (total variation, and the load per
#    expert).
# 5. The tile starting at sorted row $r_0$ holds rows $r_0 .. r_0 + 15$; their experts are
#    `sorted_expert_idxs[r0]` (the first) to `sorted_expert_idxs[min(r0 + 15, M - 1)]` (the
#    last), since the ids are sorted; from the offsets alone, a binary search
#    (`searchsorted(expert_offsets, r0, right=True)`) gives the first one. A tile spans
#    several experts because the sorted rows are packed without padding: an expert whose
#    count is not a multiple of 16 ends inside a tile and the next expert's rows follow at
#    once. Lab 08's kernel therefore makes one masked pass per expert in the tile's range.
