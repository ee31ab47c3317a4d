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
# # Lab 12 — GRPO: group advantages, the clipped loss, rewards, and a streaming log-softmax
#
# Until now every fine-tune in this course imitated a given answer. Reinforcement
# fine-tuning has no answer to imitate, only a **verifier** that scores what the model wrote.
# [GRPO](https://arxiv.org/abs/2402.03300) (Group Relative Policy Optimization, the method of
# DeepSeekMath and DeepSeek-R1) turns scores into a gradient with no value network:
#
# 1. **sample a group**: `G` completions of each of `P` prompts from the current policy;
# 2. **score** each completion with a reward (exact match, partial credit, a unit test …);
# 3. **advantages**: each completion's reward relative to its own group,
#    `A = (r − mean) / (std + eps)` — better than its siblings → pushed up, worse → down;
# 4. **update** with a clipped policy-gradient loss on the completion tokens' log-probabilities,
#    plus a KL term that keeps the policy near a frozen reference.
#
# Step 4 needs `log p(token)` of every completion token: the log-softmax of a `[rows, V]`
# block of logits read at one id per row. For a real vocabulary (151 936 for Qwen) the full
# log-softmax of a batch is gigabytes that nobody reads; a **streaming kernel** computes the one
# value per row without it, and recomputes what its backward needs.
#
# | # | you write | what it must match |
# |---|---|---|
# | 1 | `group_advantages(rewards)` `[P, G] → [P, G]` | a Python loop; exact zeros for a group of equal rewards |
# | 2 | `partial_credit(example, completion)` | hand-computed credits; 1.0 only for the exact answer |
# | 3 | `grpo_loss(logp, old_logp, advantages, mask, clip_eps, ref_logp, kl_coef)` | a token-by-token loop, value and gradient; the hand-derived one-token gradients |
# | 4 | `logsoftmax_fwd_kernel` + `my_logsoftmax_stats(logits, ids)`: log p(id), row max, log-sum | `torch.log_softmax` + `gather` |
# | 5 | `logsoftmax_bwd_kernel` + `my_logsoftmax_grad(...)` + `MySelectiveLogSoftmax` | `torch.autograd` of `log_softmax` + `gather` |
#
# Then your pieces run GRPO on a tiny MiniGPT (Part C): with exact match as the reward nothing
# is learned, with your partial credit the mean reward climbs to 1 — and the plot shows why.
#
# **No GPU needed.** As in Labs 03, 08 and 09, the setup cell sets `TRITON_INTERPRET=1`
# **before** `import triton` when there is no CUDA GPU, and the kernels run in Triton's
# interpreter (NumPy, one program after another, **float32 only**). The tests use small
# vocabularies (10 to 1 000 columns) and a few dozen rows.
#
# **How to work.** Run the cells from top to bottom; replace each `raise NotImplementedError()`
# with your code; run the test cell below it and read its message if it fails: it says what
# was expected and what came. Grading runs more (hidden) checks of the same specification —
# `G = 2`, a group of equal rewards, one row, a vocabulary smaller than the block, `−inf`
# logits, strided logits, bad inputs — and checks that your code does not call the `minirl`
# function it rebuilds (the tests switch those off while your code runs) and that your
# launchers launch your kernels. Each exercise states its specification first; below it, two
# collapsed hints (the idea, then pseudocode) are there when you want them. The whole notebook
# runs in <!-- runtime:12-grpo -->about 9 s (the solution, measured on a 2-core CPU)<!-- /runtime -->.

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
import math
import os
import time
import warnings

import torch

from course.notebook.harness import require_triton  # noqa: E402

require_triton("12-grpo")   # no triton (its wheels are Linux-only): say where to run

# The interpreter must be chosen before triton is imported (see Lab 03): @triton.jit decides
# at decoration time whether a function is compiled or interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import minirl  # noqa: E402
import minirl.logprob_triton  # noqa: E402
from course.notebook import harness  # noqa: E402
from minigpt import MiniGPT, MiniGPTConfig, tasks  # noqa: E402
from minirl import exact_match, sample_groups, score, token_logprobs  # noqa: E402

INTERPRET, DEVICE = harness.triton_setup()   # one CPU thread, seed 0, and where kernels run

# %% [markdown]
# ## Part A — one GRPO step, and why a group can teach nothing
#
# `minirl` has the plumbing: `sample_groups(model, prompts, G, max_new_tokens)` returns the
# `P·G` sampled rows in prompt-major order (row `p·G + g` is sample `g` of prompt `p`, so
# `rewards.view(P, G)` lines up with the groups) and `score(reward, examples, completions)` runs
# a reward over them. A reward is any function `(example, completion) -> float`.
#
# Below, a freshly initialised MiniGPT answers two prompts four times each. Its completions
# are random characters, so exact match scores every one of them 0: **each group's rewards are
# all equal**. An advantage compares an answer with its siblings; when they all scored the
# same there is nothing to prefer, every advantage is 0 and the step has no gradient. That is
# the first thing to check when GRPO "does not learn": if the policy never samples a right
# answer (pass@G = 0 on every prompt), there is nothing to reinforce. Exercise 2's partial
# credit is one way out; a warm start (supervised fine-tuning first) is the usual one.

# %%
_cfg = MiniGPTConfig(block_size=24, n_layer=1, n_head=2, n_embd=16, d_ff=32)
torch.manual_seed(0)
_fresh = MiniGPT(_cfg)
_prompts = [tasks.Example("answer", ex.prompt, "42") for ex in tasks.make_examples("copy", 2)]
_s = sample_groups(_fresh, _prompts, 4, 3, generator=torch.Generator().manual_seed(0))
_r = score(exact_match, [_prompts[i] for i in _s.group.tolist()], _s.completions).view(2, 4)
for _p in range(2):
    print(f"prompt {_prompts[_p].prompt!r} (answer {_prompts[_p].answer!r}): completions "
          f"{_s.completions[4 * _p: 4 * _p + 4]}, rewards {_r[_p].tolist()}")
print("tokens [P·G, L]:", tuple(_s.tokens.shape), "| target_mask marks the completion tokens:",
      _s.target_mask[0].int().tolist())

# %% [markdown]
# ## Exercise 1 — group-relative advantages
#
# **Specification.** `group_advantages(rewards, eps=1e-6)` takes rewards `r` `[P, G]` (row `p`
# is the group of prompt `p`; any float dtype) and returns
#
# $$A[p, g] = \frac{r[p, g] - \operatorname{mean}_g r[p]}{\operatorname{std}_g r[p] + \varepsilon}$$
#
# * `std` is the **sample** standard deviation (Bessel's correction, `G − 1` in the
#   denominator), as TRL's `GRPOTrainer` uses, so the numbers compare with it;
# * `eps` (default `1e-6`) only keeps the division finite;
# * return **float32** `[P, G]` whatever the input's float dtype; do not modify the input;
# * raise `ValueError` for a tensor that is not 2-D, and for `G < 2` (an answer is judged
#   against the other answers to the same prompt: with one there is no baseline).
#
# **A group of equal rewards must give exactly 0**, for `eps = 0` too (where `0 / (0 + 0)`
# would be NaN). The formula alone does not guarantee it: the float mean of equal values can
# differ from them in the last bit, the std is then `1e-17` instead of 0, and that rounding
# error divided by `std + eps` is a spurious advantage: already `0.06` in float32 with the
# default `eps`, and with `eps = 0` about `±0.8`, as large as a real one (rounding noise
# divided by rounding noise is of order 1). The cell below shows it happen.
#
# Off-limits: `minirl.group_advantages` (switched off while the tests run your function).
#
# <details><summary>Hint 1: the idea</summary>
#
# Compute in float64 and convert at the end. For the equal groups, either test for them
# explicitly and write 0, or centre on a value that is exact: `d = r − r[:, :1]` is exactly 0
# for equal values, and so are `d − d.mean()` and the std of `d`; the advantages of `d` equal
# those of `r`. Then keep the division away from a zero std (`torch.where`), which also
# covers `eps = 0`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# check: a 2-D tensor with G >= 2, else ValueError
# r = float64(rewards);  d = r - r[:, :1]                   # exact zeros for equal groups
# centred = d - mean(d, dim=1);  std = std(d, dim=1)        # Bessel: G - 1
# return float32(where(std > 0, centred / (std + eps), 0))
# ```
#
# </details>

# %%
for _dtype, _v, _G in ((torch.float64, 0.1, 3), (torch.float32, 0.9, 3), (torch.float32, 0.7, 8)):
    _eq = torch.full((1, _G), _v, dtype=_dtype)
    _d = _eq - _eq.mean(dim=1, keepdim=True)
    print(f"{_G} × {_v} in {_dtype}: r − mean = {_d[0, 0].item():.3g}, std = "
          f"{_eq.std(dim=1).item():.3g}, naive A with eps=1e-6: "
          f"{(_d / (_eq.std(dim=1, keepdim=True) + 1e-6))[0, 0].item():.3g}, with eps=0: "
          f"{(_d / _eq.std(dim=1, keepdim=True))[0, 0].item():.3g}")


# %% nbgrader={"grade": false, "grade_id": "group_advantages", "locked": false, "schema_version": 3, "solution": true, "task": false}
def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, G] -> float32 advantages [P, G]: (r − group mean) / (group std + eps),
    std with Bessel's correction; a group of equal rewards gives exactly 0."""
    ### BEGIN SOLUTION
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        raise ValueError(f"rewards must be a [P, G] tensor, got "
                         f"{list(getattr(rewards, 'shape', []))}")
    if rewards.shape[1] < 2:
        raise ValueError(f"GRPO needs at least 2 samples per group, got G = {rewards.shape[1]}")
    r = rewards.double()                                                 # [P, G]
    d = r - r[:, :1]                                 # exactly 0 where a group is all equal
    centred = d - d.mean(dim=1, keepdim=True)                            # [P, G]
    std = d.std(dim=1, keepdim=True)                   # [P, 1] Bessel; exactly 0 if equal
    return torch.where(std > 0, centred / (std + eps), 0.0).float()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_group_advantages", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
from course.notebook.forbid import bindings

# The minirl pieces this lab rebuilds: each raises if your code reaches it (under any name)
# while the tests run it.
_REFERENCE = list(harness.reference("12-grpo").values())
# each named by a module attribute that binds it, (module, name): forbid then switches off
# every binding of it, here and where your code runs
_REFERENCE = [next((o, n) for o, n in bindings(t) if not isinstance(o, dict))
              for t in _REFERENCE]


def _no_reference():
    return harness.forbid(_REFERENCE, globals())


def _loop_advantages(rows, eps=1e-6):
    """The definition, one Python float at a time (equal groups: 0 by definition)."""
    out = []
    for row in rows:
        G, mean = len(row), sum(row) / len(row)
        if all(x == row[0] for x in row):
            out.append([0.0] * G)
            continue
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / (G - 1))
        out.append([(x - mean) / (std + eps) for x in row])
    return torch.tensor(out, dtype=torch.float32)


def _check_advantages(rewards, eps=None, what=""):
    kw = {} if eps is None else {"eps": eps}
    where = f"group_advantages of {what or 'rewards'} {list(rewards.shape)} {rewards.dtype}" \
            + ("" if eps is None else f", eps={eps}")
    want = _loop_advantages(rewards.tolist(), **kw)
    with _no_reference(), harness.unchanged(f"{where}: do not modify the input",
                                            rewards=rewards):
        got = group_advantages(rewards, **kw)
    for p, row in enumerate(rewards.tolist()):
        if all(x == row[0] for x in row):
            assert torch.equal(got[p], torch.zeros_like(got[p])), \
                f"{where}: group {p} has equal rewards {row}, so its advantages must be exactly " \
                f"0; got {got[p].tolist()} (the float mean of equal values is not always " \
                "equal to them: see the cell above the exercise" \
                + ("; with eps = 0, keep 0 / 0 out)" if eps == 0 else ")")
    harness.assert_close(got, want, where)
    return got


def _check_by_hand(rewards, want, rule, eps=None):
    """A case worked by hand; the message says which rule gives `want`."""
    kw = {} if eps is None else {"eps": eps}
    with _no_reference():
        got = group_advantages(torch.tensor(rewards), **kw)
    call = f"group_advantages({rewards}" + ("" if eps is None else f", eps={eps}") + ")"
    assert isinstance(got, torch.Tensor) and got.shape == (len(rewards), len(rewards[0])), \
        f"{call}: expected a tensor of shape [{len(rewards)}, {len(rewards[0])}], got " \
        f"{type(got).__name__} {list(getattr(got, 'shape', []))}"
    assert (got.double() - torch.tensor(want, dtype=torch.float64)).abs().max() < 1e-4, \
        f"{call}: expected about {want} ({rule}), got {got.tolist()}"


def _raises(what, call):
    try:
        with _no_reference():
            call()
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as err:
        raise AssertionError(f"{what}: expected ValueError, got {type(err).__name__}: "
                             f"{err}") from err
    raise AssertionError(f"{what}: expected ValueError, nothing was raised")


# worked by hand, first: one right answer of four. mean 0.25, std = sqrt(0.75 / 3) = 0.5
_check_by_hand([[1.0, 0.0, 0.0, 0.0]], [[1.5, -0.5, -0.5, -0.5]],
               "mean 0.25, sample std sqrt(0.75 / 3) = 0.5: Bessel's correction, divide by G - 1")
_check_by_hand([[1.0, 0.0, 0.0, 0.0]], [[0.75, -0.25, -0.25, -0.25]],
               "std 0.5 + eps 0.5 = 1: the division uses the eps argument", eps=0.5)
_check_by_hand([[1.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]],
               [[1.5, -0.5, -0.5, -0.5], [1.5, -0.5, -0.5, -0.5]],
               "mean and std per group, along dim 1, not over the whole batch: a group and the "
               "same group scaled by 0.5 get the same advantages")
_check_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), what="one right answer of four")
_check_advantages(torch.tensor([[1.0, 0.0], [0.25, 0.75]]), what="G = 2")
_check_advantages(torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float64), what="an equal group")
_check_advantages(torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.0, 0.9]]), what="an equal group")
_check_advantages((torch.rand(5, 8, generator=torch.Generator().manual_seed(0)) < 0.3).float(),
                  what="binary rewards")
_check_advantages(torch.full((2, 4), 0.9), eps=0.0, what="equal groups")   # 0 / 0 kept out
_raises("group_advantages of rewards [3, 1] (G = 1)", lambda: group_advantages(torch.ones(3, 1)))
_raises("group_advantages of a 1-D tensor [4]", lambda: group_advantages(torch.ones(4)))
print("group_advantages matches the loop, gives exact zeros for equal groups, refuses G = 1")

### BEGIN HIDDEN TESTS
# case: one equal group, G = 2
_check_advantages(torch.full((1, 2), 0.3), what="one equal group, G = 2")
# case: equal groups, G = 8
_check_advantages(torch.full((2, 8), 0.7), what="equal groups, G = 8")
# case: an equal float64 group
_check_advantages(torch.full((1, 7), 1 / 3, dtype=torch.float64) * 2, what="an equal group")
# case: partial credits
_check_advantages(torch.randint(0, 4, (6, 16), generator=torch.Generator().manual_seed(1)) / 3,
                  what="partial credits")
# case: a large offset, float64
_check_advantages(torch.tensor([[1e6, 1e6 + 1.0, 1e6, 1e6 + 2.0]], dtype=torch.float64),
                  what="a large offset")
# case: eps other than the default
_check_advantages(torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.5, 0.5]]), eps=0.5, what="rewards")
# case: an equal group with eps = 0
_check_advantages(torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float64), eps=0.0,
                  what="an equal group")
# case: invalid shapes or G
_raises("group_advantages of rewards [1, 1]", lambda: group_advantages(torch.ones(1, 1)))
_raises("group_advantages of a 1-D tensor", lambda: group_advantages(torch.ones(4)))
_raises("group_advantages of a 3-D tensor", lambda: group_advantages(torch.ones(2, 2, 2)))
# case: float64 rewards
assert group_advantages(torch.ones(2, 3, dtype=torch.float64)).dtype == torch.float32, \
    "group_advantages must return float32 for float64 rewards"
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 2 — a partial-credit reward
#
# Exact match gives a fresh model nothing (Part A). A reward that gives **partial credit**
# lets the group's answers differ before any of them is right:
#
# $$\text{credit} = \frac{\#\{i : \text{completion}[i] = \text{answer}[i]\}}{\max(\lvert\text{answer}\rvert, \lvert\text{completion}\rvert)}$$
#
# Positions are compared where both strings have a character; dividing by the **longer**
# length makes a missing or extra character cost as much as a wrong one: for the answer
# `"abc"`, `"ab"` earns 2/3, `"abcd"` earns 3/4, `"xbc"` earns 2/3 and only `"abc"` earns 1.
# Both empty: 1.0. Return a Python `float` (`score` refuses anything that is not a real number).
# `example` is a `minigpt.tasks.Example`; its `.answer` is the string to compare with.
#
# <details><summary>Hint 1: the idea</summary>
#
# `zip` stops at the shorter string, which is exactly "where both have a character"; the
# denominator is the longer length, and the empty case needs its own line. A `bool` sums as
# an `int`, and `int / int` is already a Python `float`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# n = max(len(answer), len(completion))
# return 1.0 if n == 0 else (number of i < min length with answer[i] == completion[i]) / n
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "partial_credit", "locked": false, "schema_version": 3, "solution": true, "task": false}
def partial_credit(example: tasks.Example, completion: str) -> float:
    """Positions that agree / max(len(answer), len(completion)); 1.0 only for the answer."""
    ### BEGIN SOLUTION
    answer = example.answer
    n = max(len(answer), len(completion))
    if n == 0:
        return 1.0
    return sum(a == c for a, c in zip(answer, completion, strict=False)) / n
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_partial_credit", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _check_credit(answer, completion, want, rule=""):
    call = f"partial_credit(answer {answer!r}, completion {completion!r})"
    why = f" ({rule})" if rule else ""
    try:
        with _no_reference():
            got = partial_credit(tasks.Example("t", "p=", answer), completion)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as err:
        raise AssertionError(f"{call}: expected {want:.6g}{why}, got {type(err).__name__}: "
                             f"{err}") from err
    assert isinstance(got, float), \
        f"partial_credit must return a Python float, got {type(got).__name__} {got!r}"
    assert abs(got - want) < 1e-12, f"{call}: expected {want:.6g}{why}, got {got:.6g}"


def _loop_credit(answer, completion):
    n = max(len(answer), len(completion))
    hits = 0
    for i in range(min(len(answer), len(completion))):
        hits += answer[i] == completion[i]
    return 1.0 if n == 0 else hits / n


_LONGER = "divide by the longer of the two lengths"
for _ans, _comp, _want, _rule in (
        ("abc", "abc", 1.0, "the exact answer"),
        ("abc", "ab", 2 / 3, f"a missing character costs as much as a wrong one: {_LONGER}"),
        ("abc", "abcd", 3 / 4, f"an extra character costs as much as a wrong one: {_LONGER}"),
        ("abc", "xbc", 2 / 3, "every position where both agree counts, not only a common prefix"),
        ("42", "24", 0.0, "characters are compared position by position: none of '24' is at "
                          "its place in '42'"),
        ("42", "", 0.0, "an empty completion agrees nowhere"),
        ("", "", 1.0, "both empty: 1.0, with no division by the length 0")):
    _check_credit(_ans, _comp, _want, _rule)


def _random_string(g, alphabet, shortest, longest):
    n = int(torch.randint(shortest, longest + 1, (1,), generator=g))
    return "".join(alphabet[int(i)] for i in torch.randint(0, len(alphabet), (n,), generator=g))


_gc = torch.Generator().manual_seed(0)
for _ in range(40):
    _ans, _comp = _random_string(_gc, "0123", 1, 4), _random_string(_gc, "0123", 0, 5)
    _check_credit(_ans, _comp, _loop_credit(_ans, _comp))
print("partial_credit matches the hand-computed credits and the loop")

### BEGIN HIDDEN TESTS
# case: both empty
_check_credit("", "", 1.0)
# case: an empty answer
_check_credit("", "x", 0.0)
# case: one character, exact
_check_credit("7", "7", 1.0)
# case: a completion longer than the answer
_check_credit("7", "77", 0.5)
# case: a completion shorter than the answer
_check_credit("abcdef", "abc", 0.5)
# case: a repeated answer
_check_credit("abc", "abcabc", 0.5)
# case: random short strings
for _ in range(60):
    _ans, _comp = _random_string(_gc, "01", 0, 5), _random_string(_gc, "01", 0, 5)
    _check_credit(_ans, _comp, _loop_credit(_ans, _comp))
    with _no_reference():
        _full = partial_credit(tasks.Example("t", "p=", _ans), _comp) == 1.0
    assert _full == (_ans == _comp), \
        f"partial_credit(answer {_ans!r}, completion {_comp!r}) is 1.0 only for the exact answer"
# it plugs into minirl.score as a Reward
# case: as a Reward in minirl.score
_exs = [tasks.Example("t", "p=", a) for a in ("abc", "42", "7")]
with _no_reference():
    _sc = score(partial_credit, _exs, ["abd", "4", "7"])
harness.assert_close(_sc, torch.tensor([2 / 3, 0.5, 1.0]), "score(partial_credit, ...)")
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 3 — the GRPO loss
#
# **Specification.** `grpo_loss(logp, old_logp, advantages, mask, clip_eps=0.2, ref_logp=None,
# kl_coef=0.0)` returns a scalar tensor. Inputs, as `minirl.token_logprobs` and your advantages give them, for `B = P·G` sequences
# of `T` positions:
#
# * `logp` `[B, T]`: log-probabilities of the sampled tokens under the policy being trained
#   (with gradients);
# * `old_logp` `[B, T]`: the same under the policy that **sampled** them (no gradients);
# * `advantages` `[B]`: one per sequence (your `group_advantages(...).flatten()`), the same
#   for every token of the sequence;
# * `mask` `[B, T]` bool: True on completion tokens (`Samples.target_mask`). Positions off
#   the mask may hold **anything** (even `±inf`): they must not reach the loss or its gradient;
# * `ref_logp` `[B, T]` or `None`: the frozen reference's log-probabilities, `kl_coef` = β.
#
# Per completion token, with ratio $\rho = e^{\,\mathrm{logp} - \mathrm{old}}$ and $\varepsilon$ = `clip_eps`:
#
# $$\ell = -\min\big(\rho A,\ \operatorname{clip}(\rho, 1-\varepsilon, 1+\varepsilon)\,A\big)
#   + \beta\,\big(e^{\,\mathrm{ref} - \mathrm{logp}} - (\mathrm{ref} - \mathrm{logp}) - 1\big)$$
#
# The KL term is the **k3** estimator: its *value*, averaged over tokens sampled from the
# policy, estimates KL(policy ‖ reference); it is never negative and 0 when the two agree.
# Used as a loss and differentiated through `logp` (as here, and in TRL), its expected
# *gradient* is that of the reverse KL(reference ‖ policy), not of KL(policy ‖ reference);
# both vanish when the two agree and pull `logp` towards `ref`, which is the term's job.
# **Averaging**: each sequence's token losses are averaged over *its own* completion tokens,
# then the `B` sequence losses are averaged (the GRPO paper's
# $\frac1G\sum_i \frac1{|o_i|}\sum_t$). TRL's `GRPOTrainer` defaults to another one
# (`loss_type="dapo"` in TRL 1.16): the sum of all token losses divided by the number of
# completion tokens in the whole batch (across devices and accumulation steps), so a long
# completion weighs more; its `loss_type="grpo"` is the one here. Return the scalar loss.
# Treat `old_logp`, `ref_logp` and `advantages` as constants (`.detach()`); only `logp` gets
# a gradient. Add the KL term only when `kl_coef > 0`; raise `ValueError` when `kl_coef > 0`
# and `ref_logp` is `None`, and when a sequence has no completion token (its mean would be
# 0/0).
#
# What the min does, one token at a time (the tests check these gradients):
#
# | | ρ < 1 − ε | 1 − ε ≤ ρ ≤ 1 + ε | ρ > 1 + ε |
# |---|---|---|---|
# | A > 0 | −A·ρ (still pushed up) | −A·ρ | **0** (clipped: far enough up) |
# | A < 0 | **0** (clipped: far enough down) | −A·ρ | −A·ρ (still pushed down) |
#
# d loss / d logp of one token (B = 1, one completion token). On fresh samples (`old = logp`,
# ρ = 1) the loss is `−mean(A)` and its gradient is the plain policy gradient. The KL adds
# `β (1 − e^(ref − logp))`.
#
# <details><summary>Hint 1: the idea</summary>
#
# Build everything `[B, T]` and select, never multiply, by the mask: `(ρ · mask)` with
# `ρ = exp(logp − old)` computed everywhere turns an off-mask `exp(100) = inf` into
# `inf · 0 = NaN`, in the loss and in its gradient. Select with `torch.where(mask, logp − old,
# 0)` before the `exp` (and likewise `ref − logp` for the KL), and zero the off-mask token
# losses with `torch.where` too. For the averaging, sum each row's token losses and divide by
# that row's number of completion tokens, then take the mean of the `B` results.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# check kl_coef > 0 needs ref_logp; every row of mask has a True   (else ValueError)
# A     = advantages.detach()[:, None]                              # [B, 1]
# ratio = exp(where(mask, logp - old_logp.detach(), 0))             # [B, T]
# tok   = -min(ratio * A, clamp(ratio, 1 - eps, 1 + eps) * A)
# if kl_coef > 0:
#     d = where(mask, ref_logp.detach() - logp, 0);  tok += kl_coef * (exp(d) - d - 1)
# tok = where(mask, tok, 0)
# return mean over rows of (sum(tok, dim=1) / sum(mask, dim=1))
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "grpo_loss", "locked": false, "schema_version": 3, "solution": true, "task": false}
def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None,
              kl_coef: float = 0.0) -> torch.Tensor:
    """The clipped GRPO loss (+ β·k3 KL), per-sequence mean over completion tokens, then the
    mean over sequences; a scalar with gradients to `logp` only."""
    ### BEGIN SOLUTION
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp")
    if not mask.any(dim=1).all():
        raise ValueError("every sequence needs at least one completion token in mask")
    m = mask.to(logp.dtype)                                               # [B, T]
    A = advantages.detach().to(logp.dtype)[:, None]                       # [B, 1]
    ratio = torch.where(mask, logp - old_logp.detach(), 0.0).exp()        # [B, T]
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    per_token = -torch.min(ratio * A, clipped * A)                        # [B, T]
    if kl_coef > 0:
        d = torch.where(mask, ref_logp.detach() - logp, 0.0)              # [B, T]
        per_token = per_token + kl_coef * (d.exp() - d - 1)
    per_token = torch.where(mask, per_token, 0.0)
    return (per_token.sum(dim=1) / m.sum(dim=1)).mean()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_grpo_loss", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _loop_loss(logp, old, adv, mask, eps, ref, beta):
    """Token by token, sequence by sequence, from the definition (autograd through it)."""
    seq_losses = []
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            rho = torch.exp(logp[i, t] - old[i, t])
            a = adv[i]
            term = -torch.minimum(rho * a, torch.clamp(rho, 1 - eps, 1 + eps) * a)
            if beta > 0:
                d = ref[i, t] - logp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            terms.append(term)
        seq_losses.append(torch.stack(terms).mean())
    return torch.stack(seq_losses).mean()


def _batch(B, T, seed=0, spread=0.4, garbage=100.0):
    """logp, old, ref [B, T] (off the mask: `garbage`), advantages [B], mask [B, T]: each
    row a prompt (False), then 1..T-1 completion tokens, then padding (False)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + spread * torch.randn(B, T, generator=g)
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    start = torch.randint(0, T // 2, (B,), generator=g)
    length = torch.randint(1, T // 2 + 1, (B,), generator=g)
    pos = torch.arange(T)
    mask = (pos >= start[:, None]) & (pos < (start + length)[:, None])
    for t, v in ((logp, garbage), (old, -garbage), (ref, -garbage)):
        t[~mask] = v
    return logp, old, adv, mask, ref


def _check_loss(B, T, seed=0, eps=0.2, beta=0.0, with_ref=True, spread=0.4, garbage=100.0):
    logp, old, adv, mask, ref = _batch(B, T, seed, spread, garbage)
    ref = ref if with_ref else None
    lw = harness.leaf(logp)
    want = _loop_loss(lw, old, adv, mask, eps, ref, beta)
    want.backward()
    lg = harness.leaf(logp)
    with _no_reference():
        got = grpo_loss(lg, old, adv, mask, clip_eps=eps, ref_logp=ref, kl_coef=beta)
    where = (f"grpo_loss, B={B}, T={T}, clip_eps={eps}, kl_coef={beta}, ref_logp "
             f"{'given' if with_ref else 'None'}, completion lengths {mask.sum(1).tolist()}")
    assert isinstance(got, torch.Tensor) and got.dim() == 0, \
        f"{where}: expected a scalar tensor, got {type(got).__name__} " \
        f"{list(getattr(got, 'shape', []))}"
    assert torch.isfinite(got), \
        f"{where}: the loss is {got.item()}: a value off the mask reached it (inf · 0 = NaN: " \
        "select with torch.where, do not multiply by the mask)"
    harness.assert_close(got.detach(), want.detach(), f"{where}: loss")
    got.backward()
    assert lg.grad is not None, f"{where}: no gradient reached logp"
    assert torch.equal(lg.grad[~mask], torch.zeros_like(lg.grad[~mask])), \
        f"{where}: the gradient off the mask must be exactly 0, got " \
        f"{lg.grad[~mask][lg.grad[~mask] != 0][:3].tolist()} (NaN: inf · 0 — select with " \
        "torch.where before the exp)"
    harness.assert_close(lg.grad, lw.grad, f"{where}: d loss / d logp")
    return got


def _one_token(logp, old, a, eps=0.2, ref=None, beta=0.0):
    """(loss, d loss / d logp) for one sequence of one completion token."""
    lp = torch.tensor([[logp]], requires_grad=True)
    with _no_reference():
        loss = grpo_loss(lp, torch.tensor([[old]]), torch.tensor([a]),
                         torch.tensor([[True]]), clip_eps=eps,
                         ref_logp=None if ref is None else torch.tensor([[ref]]), kl_coef=beta)
    loss.backward()
    return loss.item(), lp.grad.item()


def _fresh_hint(got, adv, mask):
    """What a wrong loss on fresh samples most likely did (every token's loss is -A there)."""
    n = mask.sum(dim=1).to(adv.dtype)                                     # [B] lengths
    for wrong, why in (((adv * n).sum() / n.sum(), "the mean over all completion tokens of "
                        "the batch (DAPO's aggregation): average each sequence over its own "
                        "completion tokens, then over the sequences"),
                       ((adv * n / mask.shape[1]).mean(), "each sequence divided by T, padding "
                        "included: divide by its own number of completion tokens"),
                       (adv.sum(), "the sum over the sequences: take their mean")):
        if abs(got + wrong.item()) < 1e-6:
            return f"that is {why}"
    return ("every ratio rho = exp(logp - old_logp) is exactly 1 here, inside the clip range "
            "[1 - eps, 1 + eps], so each token's loss is -A: check the ratio and the clamp")


# fresh samples: old = logp, ratio 1, the loss is -mean(A)
_lp, _old, _adv, _mask, _ = _batch(6, 7, seed=1, garbage=0.0)
with _no_reference():
    _fresh_loss = grpo_loss(_lp, _lp.clone(), _adv, _mask).item()
assert abs(_fresh_loss + _adv.mean().item()) < 1e-6, \
    f"on fresh samples (old_logp = logp) the loss is -mean(advantages) = " \
    f"{-_adv.mean().item():.6f}, got {_fresh_loss:.6f} ({_fresh_hint(_fresh_loss, _adv, _mask)})"
# one token, rho = 1.5 > 1 + eps: A > 0 is clipped (gradient 0), A < 0 is not (-A·rho)
_, _g = _one_token(math.log(1.5), 0.0, 1.0)
assert abs(_g) < 1e-7, \
    f"rho = 1.5, A = +1, eps = 0.2: clipped, gradient 0 expected, got {_g} (-min(rho·A, " \
    "clip(rho, 0.8, 1.2)·A) takes the clipped 1.2·A, a constant: the min, not the max)"
_, _g = _one_token(math.log(1.5), 0.0, -1.0)
assert abs(_g - 1.5) < 1e-5, \
    f"rho = 1.5, A = -1: gradient -A·rho = 1.5 expected, got {_g} (-min(rho·A, " \
    "clip(rho, 0.8, 1.2)·A) takes rho·A = -1.5 here: the min, not the max)"
# one token with the KL term only (A = 0, fresh): k3 of d = ref - logp = -log 1.5
_l, _g = _one_token(math.log(1.5), math.log(1.5), 0.0, ref=0.0, beta=0.1)
_kl, _dkl = 0.1 * (1 / 1.5 + math.log(1.5) - 1), 0.1 * (1 - 1 / 1.5)
if _l < 0:
    _why = "the KL term is added with a + sign: beta·k3 is never negative"
elif abs(_l - 0.1 * (1.5 - math.log(1.5) - 1)) < 1e-6:
    _why = "that is k3 of logp - ref; the estimator takes d = ref - logp"
elif abs(_g - _dkl) < 1e-6:
    _why = "the gradient is right, the value is not: mind the constant - 1 of k3, which " \
           "makes it 0 where the policy equals the reference"
else:
    _why = "see the formula in the specification"
assert abs(_l - _kl) < 1e-6 and abs(_g - _dkl) < 1e-6, \
    f"the KL term, one token: logp = log 1.5, ref_logp = 0, kl_coef = beta = 0.1, A = 0: " \
    f"expected the loss beta·k3 = {_kl:.6f} with k3 = e^d - d - 1 and d = ref - logp, and " \
    f"the gradient beta·(1 - e^(ref - logp)) = {_dkl:.6f}; got {_l:.6f} and {_g:.6f} ({_why})"
_check_loss(6, 7)                                   # off-mask garbage 100: exp(100) = inf
_check_loss(3, 5, seed=9, beta=0.1, garbage=float("inf"))    # off-mask inf: inf · 0 = NaN
_check_loss(8, 9, seed=2, beta=0.1)                 # with the k3 KL
# constants: old_logp, advantages and ref_logp get no gradient
_lp, _old, _adv, _mask, _ref = _batch(4, 6, seed=12, garbage=0.0)
_oldr, _advr, _refr, _lpr = (harness.leaf(t) for t in (_old, _adv, _ref, _lp))
with _no_reference():
    grpo_loss(_lpr, _oldr, _advr, _mask, ref_logp=_refr, kl_coef=0.1).backward()
for _name, _t in (("old_logp", _oldr), ("advantages", _advr), ("ref_logp", _refr)):
    assert _t.grad is None or not _t.grad.any(), \
        f"grpo_loss: {_name} must get no gradient (detach it), got {_t.grad.abs().max():.3g}"
_m0 = _mask.clone()
_m0[2] = False
_raises("grpo_loss with a sequence without completion tokens",
        lambda: grpo_loss(_lp, _old, _adv, _m0))
_raises("grpo_loss with kl_coef=0.1 and no ref_logp",
        lambda: grpo_loss(_lp, _old, _adv, _mask, kl_coef=0.1))
print("grpo_loss matches the token-by-token loop (value and gradient); clipping as the table")

### BEGIN HIDDEN TESTS
# case: ref given, kl_coef 0
_check_loss(8, 9, seed=3, eps=0.1, beta=0.0)        # ref given, kl_coef 0: no KL term
# case: no reference
_check_loss(8, 9, seed=4, eps=0.3, with_ref=False)
# case: most tokens clipped
_check_loss(5, 12, seed=5, eps=0.2, beta=0.05, spread=1.5)   # most tokens clipped
# case: one sequence
_check_loss(1, 4, seed=6, beta=0.2)                 # one sequence
# case: non-finite values outside the mask
_check_loss(2, 3, seed=7, eps=0.2, beta=0.1, garbage=float("inf"))
# the other two clip cases, and the KL gradient beta·(1 - e^(ref - logp))
# case: the clip cases and the KL gradient, one token
_, _g = _one_token(math.log(0.5), 0.0, 1.0)
assert abs(_g + 0.5) < 1e-5, f"rho = 0.5, A = +1: gradient -A·rho = -0.5 expected, got {_g}"
_, _g = _one_token(math.log(0.5), 0.0, -1.0)
assert abs(_g) < 1e-7, f"rho = 0.5, A = -1: clipped, gradient 0 expected, got {_g}"
_, _g = _one_token(math.log(1.1), 0.0, 2.0)
assert abs(_g + 2.2) < 1e-5, f"rho = 1.1, A = 2, inside the clip range: -A·rho = -2.2, got {_g}"
_l, _g = _one_token(math.log(1.5), math.log(1.5), 0.0, ref=0.0, beta=0.1)
assert abs(_g - 0.1 * (1 - 1 / 1.5)) < 1e-6, \
    f"KL gradient: beta·(1 - e^(ref - logp)) = {0.1 * (1 - 1 / 1.5):.6f} expected, got {_g}"
assert abs(_l - 0.1 * (1 / 1.5 + math.log(1.5) - 1)) < 1e-6, f"k3 value: got {_l}"
_l, _g = _one_token(-0.7, -0.7, 0.0, ref=-0.7, beta=0.5)
assert abs(_l) < 1e-7 and abs(_g) < 1e-7, f"policy = reference: KL 0 and gradient 0, got {_l}, {_g}"
# constants get no gradient
# case: gradients of the constants
_lp, _old, _adv, _mask, _ref = _batch(4, 6, seed=8, garbage=0.0)
_oldr, _advr, _refr, _lpr = (harness.leaf(t) for t in (_old, _adv, _ref, _lp))
with _no_reference():
    grpo_loss(_lpr, _oldr, _advr, _mask, ref_logp=_refr, kl_coef=0.1).backward()
for _name, _t in (("old_logp", _oldr), ("advantages", _advr), ("ref_logp", _refr)):
    assert _t.grad is None or not _t.grad.any(), f"grpo_loss: {_name} must get no gradient"
# bad inputs
# case: invalid inputs
_m0 = _mask.clone()
_m0[1] = False
_raises("grpo_loss with a sequence without completion tokens",
        lambda: grpo_loss(_lp, _old, _adv, _m0))
_raises("grpo_loss with kl_coef=0.1 and no ref_logp",
        lambda: grpo_loss(_lp, _old, _adv, _mask, kl_coef=0.1))
### END HIDDEN TESTS

# %% [markdown]
# ### How the token losses become one number: short against long completions
#
# Your `grpo_loss` averages each completion over its own tokens, then the completions: the
# GRPO paper's $\frac1B\sum_i \frac1{|o_i|}\sum_t \ell_{it}$ (`loss_type="grpo"` in TRL and in
# `minirl.grpo_loss`). Every completion then weighs the same, so **a token of a long completion
# weighs less than a token of a short one**: a long wrong answer is pushed down less, per
# token, than a short wrong one, and the model learns that rambling is the cheaper way to be
# wrong. The alternatives divide by a number that does not depend on the completion:
# `"dapo"` (and `"bnpo"`) by all the batch's completion tokens, `"dr_grpo"` (Dr. GRPO) by
# `B · max_completion_length`. The cell below takes fresh samples (ratio 1, so each token's
# loss is $-A_i$) of lengths 1 to 9 and shows each token's gradient, $-A_i$ times its weight,
# from **your** `grpo_loss` and from the two other rules written out.

# %%
_lengths, _adv_demo = [1, 9, 3, 7, 2, 5], torch.tensor([1.0, -1.0, 0.5, 0.5, -2.0, 1.0])
_mask_demo = torch.arange(9)[None, :] < torch.tensor(_lengths)[:, None]      # [6, 9]
_lp_demo = torch.full((6, 9), -1.0, requires_grad=True)
grpo_loss(_lp_demo, _lp_demo.detach(), _adv_demo, _mask_demo).backward()
_per_token = {"grpo (yours)": _lp_demo.grad[:, 0].abs(),
              "dapo / bnpo": _adv_demo.abs() / sum(_lengths),
              "dr_grpo": _adv_demo.abs() / (6 * 9)}
for _name, _w in _per_token.items():
    print(f"{_name:>13}: |gradient| of one token per completion "
          + "  ".join(f"{_n}:{_v:.4f}" for _n, _v in zip(_lengths, _w.tolist(), strict=True)))
fig, ax = plt.subplots(figsize=(7, 3))
for _k, (_name, _w) in enumerate(_per_token.items()):
    ax.bar([i + 0.27 * (_k - 1) for i in range(6)], (_w / _adv_demo.abs()).tolist(), 0.27,
           label=_name)
ax.set_xticks(range(6), [f"|o| = {n}" for n in _lengths])
ax.set_ylabel("weight of one token")
ax.set_title("per-token weight by completion length (|A| divided out)")
ax.legend()
plt.show()

# %% [markdown]
# ## Part B — the selective log-softmax, streamed over the vocabulary
#
# `token_logprobs` runs the model over the sampled tokens and needs, for each of the
# `N = B·(L−1)` positions, one number: $\log \mathrm{softmax}(z)[\mathrm{id}] = z_{\mathrm{id}} -
# \mathrm{lse}(z)$ with $\mathrm{lse}(z) = \log\sum_v e^{z_v}$. `torch.log_softmax(z).gather(...)`
# builds the whole `[N, V]` log-softmax to read one entry per row, and keeps it for the
# backward: at `N = 4096` positions and Qwen's `V = 151 936` that is 2.5 GB in float32, on top
# of the logits. A kernel can stream each row instead, in chunks of `BLOCK_V` columns, with
# the **online log-sum-exp** (the trick at the heart of FlashAttention): keep a running max
# `m` and a running sum `s = Σ e^(z − m)`, and rescale `s` whenever the max grows:
#
# ```
# m = −inf;  s = 0
# for each chunk z_c of the row:
#     m_new = max(m, max(z_c))
#     s     = s · e^(m − m_new) + Σ e^(z_c − m_new)
#     m     = m_new
# lse = m + log s;   log p(id) = (z[id] − m) − log s
# ```
#
# Only `m` and `log s` (two floats per row) are kept for the backward, which recomputes
# `p_v = e^((z_v − m) − log s)` chunk by chunk. Keeping them apart (rather than `lse`) keeps
# `z − m` exact: for logits near `1e4`, a float32 `lse` is off by `5e-4`.
#
# **`−inf` logits** (a masked token) are probability 0 and must stay harmless: while a row has
# seen only `−inf`, `m = −inf` and `z − m = −inf − (−inf) = NaN`. Shift by
# `c = m_new if m_new > −inf else 0` instead of `m_new` (then `e^(−inf − 0) = 0`). A row that
# is `−inf` everywhere has no distribution; PyTorch gives NaN there, and so does the formula.
#
# The same loop in PyTorch on one row, chunk by chunk, to read before you write the kernel:

# %%
def _online_lse(z: torch.Tensor, block: int) -> tuple[float, float]:
    """(m, log s) of one row z [V], streamed in chunks of `block` (the kernel's loop)."""
    m, s = float("-inf"), 0.0
    for v0 in range(0, z.numel(), block):
        zc = z[v0:v0 + block]
        m_new = max(m, zc.max().item())
        c = m_new if m_new > float("-inf") else 0.0
        s = s * math.exp(m - c) + torch.exp(zc - c).sum().item()
        m = m_new
    return m, math.log(s) if s > 0 else float("-inf")


_z = torch.randn(45) * 3
_z[:20] = float("-inf")                        # the first chunk holds only -inf
_m, _ls = _online_lse(_z, 16)
print(f"online: m + log s = {_m + _ls:.6f} | torch.logsumexp = {torch.logsumexp(_z, 0).item():.6f}")

# %% [markdown]
# ## Exercise 4 — the forward kernel
#
# **Specification.** `logsoftmax_fwd_kernel` (signature below) is launched on the grid
# `(cdiv(N, BLOCK_R),)`: program `pid` owns rows `r = pid·BLOCK_R + arange(BLOCK_R)` and, for
# each of them that is `< N`, stores `logp[r] = log_softmax(logits[r])[ids[r]]`,
# `row_max[r] = max_v logits[r, v]` and `log_sum[r] = log Σ_v exp(logits[r, v] − row_max[r])`,
# in one streaming pass over the vocabulary in chunks of `BLOCK_V` columns. The rules that
# matter:
#
# * **no `[N, V]` temporary**: each program holds one `[BLOCK_R, BLOCK_V]` tile at a time;
#   `BLOCK_V` may be larger than `V` (one masked chunk) or much smaller (many chunks);
# * **never touch a column `≥ V` or store a row `≥ N`**: the tests surround the tensors with
#   NaN and sentinels;
# * **`−inf` logits are harmless**, including a chunk that is all `−inf`;
# * **`logp = (z_id − m) − log s`**, subtracting `m` first (for logits near `1e4`,
#   `z_id − (m + log s)` is off by up to `5e-4`);
# * the logits are read **through their strides** (`s_n`, `s_v`: the tests pass transposed
#   views), with int64 offsets (`r.to(tl.int64)`) so that `N·V > 2³¹` would not overflow on a
#   GPU.
#
# `tl.max(z, axis=1)`, `tl.sum(..., axis=1)`, `tl.exp`, `tl.log`, `tl.maximum`, `tl.where`,
# `tl.minimum` and `tl.full` are all you need.
#
# Then `my_logsoftmax_stats(logits, ids, block_r=16, block_v=64)` → `(logp, row_max,
# log_sum)`, `[N]` float32 each: raise `ValueError` unless `logits` is a 2-D float tensor
# with `V ≥ 1` (float32 under the interpreter) and `ids` an int64 `[N]` tensor with values
# in `[0, V)`; allocate the outputs and launch **your** kernel (the tests check the launch;
# strided logits are fine: pass the strides).
#
# <details><summary>Hint 1: the idea</summary>
#
# The online loop above, vectorised over the program's rows: `m` and `s` are `[BLOCK_R]`
# vectors, each chunk is a `[BLOCK_R, BLOCK_V]` tile loaded with `mask=v < V, other=−inf`, and
# the shift is `c = where(m_new > −inf, m_new, 0)`. The padding rows of the last program can
# simply re-read row `N − 1` (`rr = min(r, N − 1)`): every load stays in bounds, and only the
# stores need the `r < N` mask. After the loop, load each row's id and its logit `z_id`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# r  = pid·BLOCK_R + arange(BLOCK_R);  rr = min(r, N − 1)     # padding rows re-read row N−1
# m = full([BLOCK_R], −inf);  s = zeros([BLOCK_R])
# for v0 in range(0, V, BLOCK_V):
#     v = v0 + arange(BLOCK_V)
#     z = logits[rr, v]   (masked v < V, other −inf)           # [BLOCK_R, BLOCK_V]
#     m_new = maximum(m, max(z, axis=1));  c = where(m_new > −inf, m_new, 0)
#     s = s · exp(m − c) + sum(exp(z − c[:, None]), axis=1);   m = m_new
# logp[r]    = (logits[r, ids[r]] − m) − log(s)               # stores masked r < N
# row_max[r] = m;   log_sum[r] = log(s)
# ```
#
# </details>

# %% nbgrader={"grade": false, "grade_id": "logsoftmax_fwd", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def logsoftmax_fwd_kernel(
    logits,         # *float32 [N, V], read through its strides
    ids,            # *int64 [N]: the token id of each row
    logp,           # *float32 [N] out: log_softmax(logits)[r, ids[r]]
    row_max,        # *float32 [N] out: m = max_v logits[r, v]
    log_sum,        # *float32 [N] out: log Σ_v exp(logits[r, v] - m)
    N, V,           # rows, vocabulary size
    s_n, s_v,       # strides of logits, in elements
    BLOCK_R: tl.constexpr,    # rows per program
    BLOCK_V: tl.constexpr,    # vocabulary columns per step
):
    """One program per BLOCK_R rows, one streaming pass over the vocabulary."""
    ### BEGIN SOLUTION
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)     # [BR]
    in_rows = r < N
    rr = tl.minimum(r, N - 1)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_R,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        z = tl.load(logits + rr[:, None] * s_n + v.to(tl.int64)[None, :] * s_v,
                    mask=(v < V)[None, :], other=float("-inf")).to(tl.float32)  # [BR, BV]
        m_new = tl.maximum(m, tl.max(z, axis=1))
        c = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.exp(m - c) + tl.sum(tl.exp(z - c[:, None]), axis=1)
        m = m_new
    log_s = tl.log(s)
    target = tl.load(ids + rr)
    z_id = tl.load(logits + rr * s_n + target * s_v).to(tl.float32)
    tl.store(logp + r, (z_id - m) - log_s, mask=in_rows)
    tl.store(row_max + r, m, mask=in_rows)
    tl.store(log_sum + r, log_s, mask=in_rows)
    ### END SOLUTION


def my_logsoftmax_stats(logits: torch.Tensor, ids: torch.Tensor, block_r: int = 16,
                        block_v: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, row_max, log_sum) [N] float32 each, for logits [N, V] and ids [N], by your kernel."""
    ### BEGIN SOLUTION
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 \
            or not logits.is_floating_point() or logits.shape[1] < 1:
        raise ValueError(f"logits must be a floating-point [N, V] tensor with V >= 1, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} "
                         f"{list(getattr(logits, 'shape', []))}")
    if INTERPRET and logits.dtype != torch.float32:
        raise ValueError(f"logits are {logits.dtype}; the Triton interpreter is float32-only")
    N, V = logits.shape
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.shape != (N,):
        raise ValueError(f"ids must be an int64 tensor of shape [{N}], got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} "
                         f"{list(getattr(ids, 'shape', []))}")
    if N and not ((ids >= 0) & (ids < V)).all():
        raise ValueError(f"ids must lie in 0..{V - 1}, got {int(ids.min())}..{int(ids.max())}")
    logp, row_max, log_sum = (torch.empty(N, dtype=torch.float32, device=logits.device)
                              for _ in range(3))
    if N:
        logsoftmax_fwd_kernel[(triton.cdiv(N, block_r),)](
            logits, ids.contiguous(), logp, row_max, log_sum, N, V,
            logits.stride(0), logits.stride(1), BLOCK_R=block_r, BLOCK_V=block_v)
    return logp, row_max, log_sum
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test_logsoftmax_fwd_kernel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
SENTINEL = 12345.0      # what the tests put around the outputs: it must still be there after


def _assert_same(got, want, what, rtol=1e-5):
    """NaN and ±inf where (and only where) `want` has them; the finite entries close."""
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, \
        f"{what}: expected a tensor of shape {tuple(want.shape)}, got " \
        f"{list(getattr(got, 'shape', [])) if isinstance(got, torch.Tensor) else type(got).__name__}"
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = (test(got) != test(want)).nonzero()
        if len(diff):
            at = tuple(diff[0].tolist())
            raise AssertionError(f"{what}: at index {list(at)} expected {want[at].item()}, got "
                                 f"{got[at].item()} ({name} where it should (not) be)")
    fin = torch.isfinite(want)
    if fin.any():
        harness.assert_close(got[fin], want[fin], f"{what} (finite entries)", rtol=rtol)


def _logits(N, V, seed=0, scale=3.0, neg_inf=False, offset=0.0):
    """logits [N, V] float32 and ids [N] (ids 0 and V-1 included). With `neg_inf`: row 0 has
    -inf in its first half, row 1 at its id, row 2 finite only in its last column."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * scale + offset
    ids = torch.randint(0, V, (N,), generator=g)
    ids[0] = 0
    ids[-1] = V - 1
    if neg_inf and N >= 3 and V >= 4:
        x[0, : V // 2] = float("-inf")
        ids[0] = V - 1
        x[1, ids[1]] = float("-inf")
        x[2, :-1] = float("-inf")
    return x, ids


def _torch_stats(x, ids):
    """(logp, row_max, log_sum) from PyTorch: log_softmax + gather, max, log Σ exp(z - max)."""
    logp = torch.log_softmax(x, dim=1).gather(1, ids[:, None])[:, 0]
    m = x.max(dim=1).values
    return logp, m, torch.log(torch.exp(x - m[:, None]).sum(dim=1))


def _strided(x, layout):
    """x as a strided view with NaN around it (any read outside [N, V] shows), or transposed."""
    N, V = x.shape
    if layout == "transposed":
        return x.T.contiguous().T
    buf = torch.full((N + 8, V + 5), float("nan"), device=x.device)
    buf[:N, :V] = x
    return buf[:N, :V]


def _launch_fwd(N, V, BLOCK_R, BLOCK_V, seed=0, layout="padded", why="", **kind):
    x, ids = _logits(N, V, seed, **kind)
    want = _torch_stats(x, ids)
    x, ids = _strided(x.to(DEVICE), layout), ids.to(DEVICE)
    # each output is the first N entries of a buffer of sentinels; the kernel gets the whole
    # buffer (the same pointer), so that anything written past row N-1 shows
    bufs = [torch.full((N + BLOCK_R + 3,), SENTINEL, device=DEVICE) for _ in range(3)]
    grid = (triton.cdiv(N, BLOCK_R),)
    with _no_reference(), harness.outputs(*bufs):
        logsoftmax_fwd_kernel[grid](x, ids, *bufs, N, V, x.stride(0), x.stride(1),
                                    BLOCK_R=BLOCK_R, BLOCK_V=BLOCK_V)
    outs = [b[:N] for b in bufs]
    where = (f"logsoftmax_fwd_kernel[{grid}], N={N}, V={V}, BLOCK_R={BLOCK_R}, "
             f"BLOCK_V={BLOCK_V}, {layout} logits" + (f", {kind}" if kind else "")
             + (f" ({why})" if why else ""))
    for name, b in zip(("logp", "row_max", "log_sum"), bufs, strict=True):
        assert (b[N:] == SENTINEL).all(), \
            f"{where}: wrote {name} past row N-1 (mask the stores with r < N)"
    _assert_same(outs[0], want[0], f"{where}: logp — expected log_softmax(logits).gather(ids)")
    _assert_same(outs[1], want[1], f"{where}: row_max — expected the max of each row")
    _assert_same(outs[2], want[2], f"{where}: log_sum — expected log Σ exp(logits - row_max)")


_COLUMNS = "load only the columns v < V: mask=v < V, other=-inf"
_launch_fwd(13, 45, 4, 16, why="3 chunks, the last part-filled, in a buffer of NaN: "
            f"{_COLUMNS}, and address them through the strides s_n, s_v")
_launch_fwd(5, 37, 8, 64, why=f"V smaller than the block, one part-filled chunk: {_COLUMNS}")
_launch_fwd(6, 100, 2, 32, seed=1, layout="transposed",
            why="transposed logits: address them through the strides s_n, s_v")
_launch_fwd(4, 45, 4, 16, seed=2, neg_inf=True,       # -inf: a whole first chunk, at an id
            why="-inf logits, a first chunk all -inf: shift by c = where(m_new > -inf, m_new, "
                "0), never by -inf, since -inf - (-inf) is NaN")
_launch_fwd(5, 45, 4, 16, seed=12, offset=1e4,
            why="logits near 1e4: subtract the running max m before the exp, since exp(z) "
                "overflows float32 without it, and logp = (z_id - m) - log s, not "
                "z_id - (m + log s), which rounds by up to 5e-4")
print("logsoftmax_fwd_kernel matches log_softmax + gather, the row max and the log-sum")

### BEGIN HIDDEN TESTS
# case: one row
_launch_fwd(1, 45, 1, 16, seed=3)                     # one row
# case: one row in a 16-row program
_launch_fwd(1, 45, 16, 64, seed=4)                    # one row in a 16-row program
# case: a longer vocabulary
_launch_fwd(33, 1000, 8, 128, seed=5)                 # a longer vocabulary, 8 chunks
# case: transposed logits, V smaller than the block
_launch_fwd(7, 10, 4, 64, seed=6, layout="transposed")
# case: V = 2
_launch_fwd(9, 2, 4, 16, seed=7)                      # V = 2
# case: logits near 1e4
_launch_fwd(6, 45, 4, 16, seed=8, offset=1e4)         # logits near 1e4: z - m stays exact
# case: very peaked rows
_launch_fwd(6, 45, 4, 16, seed=9, scale=30.0)         # very peaked rows
# case: -inf logits, transposed
_launch_fwd(7, 64, 4, 16, seed=10, neg_inf=True, layout="transposed")
# a row that is -inf everywhere: logp NaN, as torch.log_softmax
# case: a row that is -inf everywhere
_xa, _ia = _logits(3, 45, seed=11)
_xa[1] = float("-inf")
_outs = [torch.empty(3, device=DEVICE) for _ in range(3)]
with _no_reference(), warnings.catch_warnings(), harness.outputs(*_outs):
    warnings.simplefilter("ignore", RuntimeWarning)       # NumPy's log(0) in the interpreter
    logsoftmax_fwd_kernel[(1,)](_xa.to(DEVICE), _ia.to(DEVICE), *_outs, 3, 45, 45, 1,
                                BLOCK_R=4, BLOCK_V=16)
_assert_same(_outs[0], _torch_stats(_xa, _ia)[0], "logsoftmax_fwd_kernel with an all -inf row")
assert _outs[1][1].item() == float("-inf"), "row_max of an all -inf row must be -inf"
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_my_logsoftmax_stats", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def _launches(run, kernel):
    """Whether `run()` launches (or calls) `kernel`: with the kernel switched off wherever it
    is bound, it must fail by reaching it."""
    try:
        with _no_reference(), harness.forbid([kernel], globals(), why=_LAUNCH_PROBE):
            run()
    except AssertionError as e:
        return _LAUNCH_PROBE in str(e)
    return False


_LAUNCH_PROBE = "the test switched it off to see that your code launches it"


def _check_stats(N, V, seed=0, layout=None, why="", **kw):
    x, ids = _logits(N, V, seed)
    want = _torch_stats(x, ids)
    x, ids = x.to(DEVICE), ids.to(DEVICE)
    if layout:
        x = _strided(x, layout)
    with _no_reference():
        got = my_logsoftmax_stats(x, ids, **kw)
    where = f"my_logsoftmax_stats, N={N}, V={V}" + (f", {layout} logits" if layout else "") \
            + (f", {kw}" if kw else "") + (f" ({why})" if why else "")
    assert _launches(lambda: my_logsoftmax_stats(x, ids, **kw), logsoftmax_fwd_kernel), \
        f"{where}: logsoftmax_fwd_kernel was not launched"
    assert isinstance(got, tuple) and len(got) == 3, \
        f"{where}: expected (logp, row_max, log_sum), got {type(got).__name__}"
    for name, gt, wt in zip(("logp", "row_max", "log_sum"), got, want, strict=True):
        assert gt.dtype == torch.float32, f"{where}: {name} must be float32, got {gt.dtype}"
        _assert_same(gt, wt, f"{where}: {name}")


_check_stats(13, 45, why="13 rows, block_r=16: the grid is cdiv(N, block_r), not N // block_r")
_check_stats(20, 45, seed=1, block_r=4, block_v=16)
_check_stats(6, 100, seed=6, layout="transposed",
             why="pass the strides of the logits, logits.stride(0) and logits.stride(1)")
_xv, _iv = _logits(4, 45, seed=13)
harness.assert_rejects("my_logsoftmax_stats", [
    ("ids past the vocabulary (45 … 89 for V = 45)",
     lambda: my_logsoftmax_stats(_xv.to(DEVICE), _iv.to(DEVICE) + 45))],
    lambda: harness.forbid([logsoftmax_fwd_kernel], globals(),
                           why="ids outside [0, V) must raise ValueError before the launch"))
print("my_logsoftmax_stats launches your kernel and matches PyTorch")

### BEGIN HIDDEN TESTS
# case: one row
_check_stats(1, 45, seed=2)
# case: transposed logits
_check_stats(7, 100, seed=3, layout="transposed")
# case: V = 1
_check_stats(5, 1, seed=4)                                    # V = 1: log p = 0
# case: invalid inputs
_xb, _ib = _logits(4, 45, seed=5)
_xb, _ib = _xb.to(DEVICE), _ib.to(DEVICE)
_bad = [("ids of another length", lambda: my_logsoftmax_stats(_xb, _ib[:-1])),
        ("ids past the vocabulary", lambda: my_logsoftmax_stats(_xb, _ib + 45)),
        ("negative ids", lambda: my_logsoftmax_stats(_xb, _ib - 46)),
        ("int32 ids", lambda: my_logsoftmax_stats(_xb, _ib.int())),
        ("1-D logits", lambda: my_logsoftmax_stats(_xb[0], _ib[:1]))]
if INTERPRET:
    _bad.append(("float64 logits under the interpreter",
                 lambda: my_logsoftmax_stats(_xb.double(), _ib)))
harness.assert_rejects("my_logsoftmax_stats", _bad, _no_reference)
### END HIDDEN TESTS

# %% [markdown]
# ## Exercise 5 — the backward kernel, and the autograd Function
#
# With $p_v = e^{(z_v - m) - \log s}$, the derivative of $\log p_{\mathrm{id}} = z_{\mathrm{id}} -
# \mathrm{lse}(z)$ is $\partial/\partial z_v = \delta_{v,\mathrm{id}} - p_v$ (the lse's
# derivative is the softmax). With the upstream gradient `g` `[N]` of `logp`:
#
# $$\frac{\partial\,\mathrm{loss}}{\partial z_{r,v}} = g_r\,\big(\mathbb 1[v = \mathrm{id}_r] - p_{r,v}\big)$$
#
# **Specification.** `logsoftmax_bwd_kernel` (signature below), on the same grid, writes
# `dlogits[r, v] = g[r] · (1[v = ids[r]] − p[r, v])` for every `r < N`, `v < V`, through
# `dlogits`' strides `sd_n`, `sd_v`, and nothing else, with
# `p[r, v] = exp((logits[r, v] − row_max[r]) − log_sum[r])` recomputed from the logits.
# Nothing `[N, V]` is kept between the two passes: the logits themselves (which the model's
# autograd holds anyway) and three floats per row are all the backward needs. As in the
# forward: strides, masks, `(z − m) − log s` in that order.
#
# Then:
#
# * `my_logsoftmax_grad(logits, ids, row_max, log_sum, g, block_r=16, block_v=64)` → `dlogits`
#   `[N, V]` float32, contiguous, by **your** kernel; `g` may arrive as float64 or as an
#   expanded tensor with stride 0 (the gradient of `logp.sum()`);
# * `MySelectiveLogSoftmax.forward(ctx, logits, ids)` returns `logp` by
#   `my_logsoftmax_stats`; `.backward(ctx, g)` returns `(d logits, None)`, one gradient per
#   forward input, `None` for the ids, through `my_logsoftmax_grad`.
#
# <details><summary>Hint 1: the idea</summary>
#
# Per program, load each row's `row_max`, `log_sum`, `g` and id once (as `[BLOCK_R, 1]`
# columns), then stream over the vocabulary again: load a chunk (masked, `other=−inf`),
# recompute `p`, store `g · (1[v = id] − p)` with the 2-D mask `r < N`, `v < V`. A `−inf` logit
# has `p = 0`, so its gradient is `g·1[v = id]`: no special case needed. In the launcher,
# make `g` float32 and **contiguous** first: the kernel reads `g + r`, which is wrong for a
# stride-0 tensor. The Function saves the logits, the ids and the two statistics with
# `ctx.save_for_backward`.
#
# </details>
#
# <details><summary>Hint 2: pseudocode</summary>
#
# ```text
# kernel:   r = pid·BLOCK_R + arange(BLOCK_R);  rr = min(r, N − 1)
#           m, ls, gr, id = row_max[rr], log_sum[rr], g[rr], ids[rr]       # [BLOCK_R, 1]
#           for v0 in range(0, V, BLOCK_V):
#               v = v0 + arange(BLOCK_V);  z = logits[rr, v] (masked v < V, other −inf)
#               p = exp((z − m) − ls)
#               dlogits[r, v] = gr · (where(v == id, 1, 0) − p)   (masked r < N, v < V)
# launcher: g = g.float().contiguous();  dlogits = empty(N, V);  launch;  return dlogits
# Function: forward: logp, m, ls = my_logsoftmax_stats(logits, ids); save; return logp
#           backward: return my_logsoftmax_grad(logits, ids, m, ls, g), None
# ```
#
# </details>
#
# `my_selective_log_softmax(logits, ids)` (given) is the differentiable function, with the
# signature of the backends in `minirl.IMPLEMENTATIONS`.

# %% nbgrader={"grade": false, "grade_id": "logsoftmax_bwd", "locked": false, "schema_version": 3, "solution": true, "task": false}
@triton.jit
def logsoftmax_bwd_kernel(
    logits,         # *float32 [N, V], read through its strides
    ids,            # *int64 [N]
    row_max,        # *float32 [N]: the forward's m
    log_sum,        # *float32 [N]: the forward's log Σ exp(z - m)
    g,              # *float32 [N]: d loss / d logp, contiguous
    dlogits,        # *float32 [N, V] out: d loss / d logits
    N, V,           # rows, vocabulary size
    s_n, s_v,       # strides of logits
    sd_n, sd_v,     # strides of dlogits
    BLOCK_R: tl.constexpr,    # rows per program
    BLOCK_V: tl.constexpr,    # vocabulary columns per step
):
    """dlogits[r, v] = g[r] · (1[v == ids[r]] − p[r, v]), p recomputed from row_max, log_sum."""
    ### BEGIN SOLUTION
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)     # [BR]
    in_rows = r < N
    rr = tl.minimum(r, N - 1)
    cols = tl.arange(0, BLOCK_V)
    m = tl.load(row_max + rr)[:, None]                                      # [BR, 1]
    log_s = tl.load(log_sum + rr)[:, None]
    g_r = tl.load(g + rr)[:, None]
    target = tl.load(ids + rr)[:, None]
    for v0 in range(0, V, BLOCK_V):
        v = (v0 + cols).to(tl.int64)[None, :]                               # [1, BV]
        in_v = v < V
        z = tl.load(logits + rr[:, None] * s_n + v * s_v, mask=in_v,
                    other=float("-inf")).to(tl.float32)                     # [BR, BV]
        p = tl.exp((z - m) - log_s)
        dz = g_r * (tl.where(v == target, 1.0, 0.0) - p)
        tl.store(dlogits + r[:, None] * sd_n + v * sd_v, dz, mask=in_rows[:, None] & in_v)
    ### END SOLUTION


def my_logsoftmax_grad(logits: torch.Tensor, ids: torch.Tensor, row_max: torch.Tensor,
                       log_sum: torch.Tensor, g: torch.Tensor, block_r: int = 16,
                       block_v: int = 64) -> torch.Tensor:
    """d loss / d logits [N, V] float32 for the upstream gradient g [N] of logp."""
    ### BEGIN SOLUTION
    N, V = logits.shape
    g = g.to(torch.float32).contiguous()
    dlogits = torch.empty((N, V), dtype=torch.float32, device=logits.device)
    if N:
        logsoftmax_bwd_kernel[(triton.cdiv(N, block_r),)](
            logits, ids.contiguous(), row_max, log_sum, g, dlogits, N, V,
            logits.stride(0), logits.stride(1), dlogits.stride(0), dlogits.stride(1),
            BLOCK_R=block_r, BLOCK_V=block_v)
    return dlogits
    ### END SOLUTION


class MySelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids):
        ### BEGIN SOLUTION
        logp, row_max, log_sum = my_logsoftmax_stats(logits, ids)
        ctx.save_for_backward(logits, ids, row_max, log_sum)
        return logp
        ### END SOLUTION

    @staticmethod
    def backward(ctx, g):
        ### BEGIN SOLUTION
        logits, ids, row_max, log_sum = ctx.saved_tensors
        return my_logsoftmax_grad(logits, ids, row_max, log_sum, g), None
        ### END SOLUTION


def my_selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits, -1)[i, ids[i]] -> [N] float32, differentiable by your kernels."""
    return MySelectiveLogSoftmax.apply(logits, ids)


# %% nbgrader={"grade": true, "grade_id": "test_logsoftmax_bwd_kernel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
def _torch_grad(x, ids, g):
    """d (g · logp).sum() / d logits by torch.autograd of log_softmax + gather."""
    xr = harness.leaf(x)
    logp = torch.log_softmax(xr, dim=1).gather(1, ids[:, None])[:, 0]
    logp.backward(g)
    return xr.grad


def _bwd_hint(got, x, ids, g):
    """What a wrong dlogits most likely is, from the usual slips (or "")."""
    p = torch.softmax(x, dim=1)
    onehot = torch.nn.functional.one_hot(ids, x.shape[1]).float()
    for wrong, why in ((g[:, None] * onehot, "the softmax term - p is missing: "
                        "d log p_id / d z_v = 1[v = id] - p_v"),
                       (-g[:, None] * p, "the one-hot term 1[v = id] is missing"),
                       (onehot - p, "it is not multiplied by the upstream gradient g"),
                       (g[:, None] * (p - onehot), "the sign is flipped: g · (1[v = id] - p)")):
        if torch.allclose(got.detach().float().cpu(), wrong, rtol=1e-4, atol=1e-6):
            return f" ({why})"
    return ""


def _launch_bwd(N, V, BLOCK_R, BLOCK_V, seed=0, layout="padded", why="", **kind):
    x, ids = _logits(N, V, seed, **kind)
    g = torch.randn(N, generator=torch.Generator().manual_seed(seed + 50))
    want = _torch_grad(x, ids, g)
    _, m, ls = _torch_stats(x, ids)
    xs = _strided(x.to(DEVICE), layout)
    # dlogits is dbuf[:N, :V], all NaN at first (every element must be written); the kernel
    # gets the whole buffer (the same pointer and strides), so that a write outside shows
    dbuf = torch.full((N + BLOCK_R, V + 3), float("nan"), device=DEVICE)
    grid = (triton.cdiv(N, BLOCK_R),)
    with _no_reference(), harness.outputs(dbuf):
        logsoftmax_bwd_kernel[grid](xs, ids.to(DEVICE), m.to(DEVICE), ls.to(DEVICE),
                                    g.to(DEVICE), dbuf, N, V, xs.stride(0), xs.stride(1),
                                    dbuf.stride(0), dbuf.stride(1), BLOCK_R=BLOCK_R,
                                    BLOCK_V=BLOCK_V)
    d = dbuf[:N, :V]
    where = (f"logsoftmax_bwd_kernel[{grid}], N={N}, V={V}, BLOCK_R={BLOCK_R}, "
             f"BLOCK_V={BLOCK_V}, {layout} logits" + (f", {kind}" if kind else "")
             + (f" ({why})" if why else ""))
    outside = dbuf.clone()
    outside[:N, :V] = float("nan")
    assert outside.isnan().all(), \
        f"{where}: wrote outside dlogits[:N, :V] (mask the stores with r < N and v < V)"
    _assert_same(d, want, f"{where}: dlogits — expected autograd of log_softmax + gather"
                 + _bwd_hint(d, x, ids, g))


_launch_bwd(13, 45, 4, 16)
_launch_bwd(5, 37, 8, 64, seed=1)
_launch_bwd(6, 100, 2, 32, seed=2, layout="transposed",
            why="transposed logits: address them through the strides s_n, s_v")
_launch_bwd(4, 45, 4, 16, seed=3, neg_inf=True)
_launch_bwd(5, 45, 4, 16, seed=12, offset=1e4,
            why="logits near 1e4: p = exp((z - m) - log s), subtracting m first; "
                "exp(z - (m + log s)) is off by up to 5e-4")
print("logsoftmax_bwd_kernel matches autograd of log_softmax + gather, writes all of dlogits "
      "and nothing else")

### BEGIN HIDDEN TESTS
# case: one row
_launch_bwd(1, 45, 1, 16, seed=4)
# case: one row in a 16-row program
_launch_bwd(1, 45, 16, 64, seed=5)
# case: a longer vocabulary
_launch_bwd(33, 1000, 8, 128, seed=6)
# case: transposed logits, V smaller than the block
_launch_bwd(7, 10, 4, 64, seed=7, layout="transposed")
# case: V = 2
_launch_bwd(9, 2, 4, 16, seed=8)
# case: logits near 1e4
_launch_bwd(6, 45, 4, 16, seed=9, offset=1e4)
# case: very peaked rows
_launch_bwd(6, 45, 4, 16, seed=10, scale=30.0)
# case: -inf logits, transposed
_launch_bwd(7, 64, 4, 16, seed=11, neg_inf=True, layout="transposed")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "test_my_selective_log_softmax", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
def _check_function(N, V, seed=0, layout=None, upstream="random", **kind):
    x, ids = _logits(N, V, seed, **kind)
    x, ids = x.to(DEVICE), ids.to(DEVICE)
    if layout:
        x = _strided(x, layout)
    xr = harness.leaf(x)
    want_logp = torch.log_softmax(xr, dim=1).gather(1, ids[:, None])[:, 0]
    g = torch.randn(N, generator=torch.Generator().manual_seed(seed + 9)).to(DEVICE)
    (want_logp.sum() if upstream == "sum" else (want_logp * g).sum()).backward()
    xm = harness.leaf(x)

    def forward_backward(xm=xm):
        logp = my_selective_log_softmax(xm, ids)
        (logp.sum() if upstream == "sum" else (logp * g).sum()).backward()
        return logp

    with _no_reference():
        logp = forward_backward()
    where = f"my_selective_log_softmax, N={N}, V={V}" + (f", {layout} logits" if layout else "") \
            + (", upstream gradient of logp.sum() (g arrives expanded, with stride 0: make it "
               "contiguous before the launch)" if upstream == "sum" else "") \
            + (f", {kind}" if kind else "")
    fwd = _launches(lambda: forward_backward(harness.leaf(x)), logsoftmax_fwd_kernel)
    bwd = _launches(lambda: forward_backward(harness.leaf(x)), logsoftmax_bwd_kernel)
    assert fwd and bwd, \
        f"{where}: your kernels were not both launched (forward: {'yes' if fwd else 'no'}, " \
        f"backward: {'yes' if bwd else 'no'})"
    _assert_same(logp, want_logp, f"{where}: logp")
    assert xm.grad is not None, f"{where}: no gradient reached the logits"
    _assert_same(xm.grad, xr.grad, f"{where}: d logits")


_check_function(13, 45)
_check_function(9, 100, seed=1, layout="transposed")
_check_function(8, 45, seed=6, upstream="sum")         # g arrives expanded, with stride 0
print("my_selective_log_softmax: value and gradient match PyTorch, through your two kernels")

### BEGIN HIDDEN TESTS
# case: one row
_check_function(1, 45, seed=2)
# case: many rows, gradient of logp.sum()
_check_function(24, 45, seed=3, upstream="sum")        # g arrives expanded, stride 0
# case: -inf logits
_check_function(5, 45, seed=4, neg_inf=True)
# case: padded logits, a longer vocabulary, gradient of logp.sum()
_check_function(6, 300, seed=5, layout="padded", upstream="sum")
### END HIDDEN TESTS

# %% [markdown]
# ## Part C — GRPO on a tiny MiniGPT, with your pieces
#
# The loop below is the whole algorithm (`tests/minirl/test_grpo_learns.py` has the same
# shape): a fresh one-layer MiniGPT must learn to answer
# `"42"` to every prompt. Each step samples `G = 8` completions of `P = 8` prompts (at most 3
# new tokens), scores them, and takes two AdamW steps on **your** `grpo_loss` with **your**
# advantages (the second step has ratio ≠ 1, so clipping can act), with a small KL to the
# frozen initial model. It runs twice: rewarded by exact match, then by **your**
# `partial_credit`.
#
# Exact match needs `"4"`, `"2"`, `<eos>` in a row from a model that draws each of 45 tokens
# about equally: roughly 1 chance in 10⁵ per completion. The groups score all zeros, every
# advantage is 0, and the model does not move (the KL term pulls it nowhere: it *is* the
# reference, and with zero gradients AdamW takes no step). Partial credit rewards a first
# `"4"`, so the answers of a group differ from the first steps, and the mean reward climbs.

# %% tags=["jupyter-only"]
def run_grpo(reward, steps=40, P=8, G=8, seed=0):
    """Mean reward, exact-match rate and share of groups with reward variance, per step."""
    prompts = [tasks.Example("answer", ex.prompt, "42") for ex in tasks.make_examples("copy", 32)]
    torch.manual_seed(seed)
    model, reference = MiniGPT(_cfg), MiniGPT(_cfg)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        batch = [prompts[(step * P + i) % len(prompts)] for i in range(P)]
        s = sample_groups(model, batch, G, 3, generator=gen)
        examples = [batch[i] for i in s.group.tolist()]
        rewards = score(reward, examples, s.completions).view(P, G)             # [P, G]
        exact = score(exact_match, examples, s.completions)
        varied = (rewards != rewards[:, :1]).any(dim=1).float().mean().item()
        history.append((rewards.mean().item(), exact.mean().item(), varied))
        adv = group_advantages(rewards).flatten()                               # [P·G]
        with torch.no_grad():
            old = token_logprobs(model, s)
            ref = token_logprobs(reference, s)
        for _ in range(2):
            loss = grpo_loss(token_logprobs(model, s), old, adv, s.target_mask,
                             clip_eps=0.2, ref_logp=ref, kl_coef=0.01)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return history


try:
    _t0 = time.perf_counter()
    _runs = {"exact match": run_grpo(exact_match), "your partial credit": run_grpo(partial_credit)}
    print(f"two GRPO runs of 40 steps in {time.perf_counter() - _t0:.1f} s")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for (name, hist), color in zip(_runs.items(), ("tab:gray", "tab:green"), strict=True):
        for ax, col in zip(axes, range(3), strict=True):
            ax.plot([h[col] for h in hist], color=color, label=name)
    for ax, title in zip(axes, ("mean reward (the run's own reward)", "exact match rate",
                                "share of groups with reward variance"), strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(-0.05, 1.05)
    axes[0].legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    for name, hist in _runs.items():
        print(f"{name:>20}: mean reward {hist[0][0]:.2f} -> {hist[-1][0]:.2f}, exact match "
              f"{hist[0][1]:.2f} -> {hist[-1][1]:.2f}, steps with any group with reward "
              f"variance: {sum(h[2] > 0 for h in hist)} of {len(hist)}")
except NotImplementedError:
    print("(finish Exercises 1-3 to run GRPO)")

# %% [markdown]
# The third panel explains the second. With exact match the share of groups with variance is
# 0 at (almost) every step: a group that never holds a right and a wrong answer has nothing to
# reinforce. A lucky draw may give one group one right answer once (this seeded run has such
# a step); one update from one sample is forgotten long before the next lucky draw. With
# partial credit the share starts above 0, reaches 1 while the model is half right (groups
# mix `"4"`, `"42"` and misses), and falls back towards 0 at the end, when every answer in a
# group is right — a solved prompt teaches nothing either, and only costs samples.
#
# ### Your kernel inside `minirl`
#
# `minirl.IMPLEMENTATIONS` is the one place where `selective_log_softmax` (hence
# `token_logprobs` and the GRPO loss) picks its implementation: a backend name mapped to a
# function `(logits [N, V], ids [N]) -> [N]`. Your `my_selective_log_softmax` has that shape.
# Registered under a new name, it computes a GRPO batch's token log-probabilities and the
# gradient of the loss, and gives what the PyTorch backend gives:

# %% tags=["jupyter-only"]
try:
    minirl.IMPLEMENTATIONS["yours"] = my_selective_log_softmax
    torch.manual_seed(1)
    _model = MiniGPT(_cfg).to(DEVICE)         # where your kernels run
    _batch_prompts = [tasks.Example("answer", ex.prompt, "42") for ex in tasks.make_examples("copy", 4)]
    _s = sample_groups(_model, _batch_prompts, 4, 3, generator=torch.Generator().manual_seed(1))
    _adv = torch.randn(len(_s), generator=torch.Generator().manual_seed(2))
    _grads = {}
    for _backend in ("torch", "yours"):
        _model.zero_grad()
        _lp = token_logprobs(_model, _s, backend=_backend)
        _loss = grpo_loss(_lp, _lp.detach(), _adv.to(DEVICE), _s.target_mask.to(DEVICE))
        _loss.backward()
        _grads[_backend] = (_lp.detach(), torch.cat([p.grad.flatten() for p in _model.parameters()]))
    _dl = (_grads["torch"][0] - _grads["yours"][0]).abs().max().item()
    _dg = (_grads["torch"][1] - _grads["yours"][1]).abs().max().item()
    print(f"{len(_s)} sequences, logits [{_s.target_mask.numel()}, {_cfg.vocab_size}]: max |Δ logp| "
          f"{_dl:.2e}, max |Δ grad| over the model's parameters {_dg:.2e} "
          f"(of max |grad| {_grads['torch'][1].abs().max().item():.2e})")
except NotImplementedError:
    print("(finish Exercises 3-5 to plug your kernel in)")
finally:
    minirl.IMPLEMENTATIONS.pop("yours", None)

# %% [markdown]
# ## Where this goes next
#
# `experiments/12-grpo/REPORT.md` runs the same loop at the course's scale: GRPO on the
# pretrained MiniGPT bases (LoRA and QLoRA, dense and MoE) on the held-out task, reward-weighted
# SFT as the offline alternative, replay of the pretraining tasks against forgetting, and the
# share of groups with reward variance over training. On a GPU, `benchmarks/bench_logprobs.py`
# times `minirl`'s version of your kernels (which also computes the entropy in the same pass)
# against the PyTorch path and measures the memory the streaming saves.
#
# ### Reflection
#
# 1. A prompt whose `G` answers all scored 1 gives advantages 0, like one whose answers all
#    scored 0. What does each cost per step, and what would you do with such prompts in a
#    long run (think of pass@G measured before training)?
# 2. Why divide by the group's std at all? Compare a prompt where 1 of 8 answers is right
#    with one where 7 of 8 are: what are the advantages of the right answers in each, with
#    and without the division?
# 3. Averaging per sequence, then over sequences, makes a token of a 20-token completion
#    count 20 times less than the single token of a 1-token completion. What behaviour
#    could that reward, and what does summing over all tokens (as DAPO does) change?
# 4. Your kernel keeps `row_max` and `log_sum` apart rather than `lse = m + log s`. Take
#    logits near `1e4` in float32: how large is the rounding error of `lse`, and what does it
#    do to `p = exp(z − lse)` in the backward?
# 5. The backward reads the logits once more instead of keeping the softmax. For `N = 4096`
#    positions and `V = 151 936` in bf16, how many bytes does each choice read and keep, and
#    which one is faster on a GPU whose bandwidth is the limit?

# %% [markdown] tags=["instructor"]
# **Sample answers (instructors only; this cell is not in the learners' notebook).**
#
# 1. Both cost the same: `G` sampled completions, the forward passes of the policy, the old
#    policy and the reference over them, and a backward whose policy term is exactly zero
#    (only the KL term acts). Neither teaches anything: the exact-match run had a group with
#    reward variance at 1 step of 40 and learned nothing. An all-0 prompt is beyond the
#    policy's reach (pass@G = 0): drop it, make the reward separate wrong answers, or warm
#    the model up with SFT. An all-1 prompt is solved: drop it or resample (DAPO's dynamic
#    sampling), as the partial-credit run shows when its variance share falls back towards 0
#    at the end. Measuring pass@G of the starting policy on every prompt says in advance how
#    much of the budget each kind would waste.
# 2. With 1 right of 8: mean 0.125, Bessel std √(0.875 / 7) = 0.354, so the right answer gets
#    +2.47 and each wrong one −0.35; without the division +0.875 and −0.125. With 7 right of
#    8: the same std, so each right answer gets +0.35 and the wrong one −2.47; without it
#    +0.125 and −0.875. Dividing by the std gives every group the same spread of advantages:
#    it raises lopsided groups (1 or 7 of 8, std 0.354) above a balanced one (4 of 8, std
#    0.535, advantages ±0.94). It favours prompts that are almost always failed or almost
#    always solved, and the rare outcome in each gets the large push; Dr. GRPO drops the
#    division for that reason.
# 3. Each sequence contributes its mean token loss, so with a positive advantage a short
#    right answer pushes each of its tokens harder than a long one does, and with a negative
#    advantage a long wrong answer spreads its penalty thinly over many tokens. Together that
#    favours short right answers and lets wrong answers grow longer at little cost, which is
#    the length drift reported for GRPO. DAPO's token-level average gives every completion
#    token the same weight in the batch (long answers count in proportion to their length);
#    Dr. GRPO divides by a fixed maximum length instead, so no answer's tokens weigh more for
#    being in a short or a long sequence.
# 4. Near `1e4` float32 values are `2⁻¹⁰ ≈ 9.8e-4` apart, so `lse = m + log s` is rounded by up
#    to `4.9e-4`. Then `logp = z − lse` is off by that much, and `p = exp(z − lse)` by a factor
#    `e^{±4.9e-4}`, a relative error of `5e-4` in every probability and in every entry of the
#    gradient: fifty times the tests' `1e-5` (the visible `offset=1e4` launches fail by that).
#    Keeping the two apart, `z − m` is exact (two close float32 numbers subtract without
#    rounding) and `log s` is a number of order 1, so `(z − m) − log s` rounds like any O(1)
#    value, about `1e-7`.
# 5. The logits are `4096 · 151 936 · 2 B = 1.24 GB` in bf16, held by the model's autograd
#    anyway. Keeping the softmax keeps another 1.24 GB (2.5 GB in float32) and costs the
#    forward a 1.24 GB write; its backward reads the softmax (1.24 GB) and writes `dlogits`
#    (1.24 GB). The streaming kernel keeps `2 · 4 · 4096 = 32 KiB` (two floats per row); its
#    forward reads the logits and writes three floats per row, its backward reads the logits
#    again (1.24 GB) and writes `dlogits` (1.24 GB). So the backward reads the same bytes
#    either way, and recomputing saves the forward's 1.24 GB write and 1.24 GB of memory.
#    On a bandwidth-bound GPU (0.37 ms per 1.24 GB at 3.35 TB/s) that makes the streaming
#    version faster, because the `exp` it recomputes costs arithmetic, not bytes.
