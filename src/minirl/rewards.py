"""Rewards: a verifier scores one completion of one task example with a float.

A reward is any callable `(example, completion) -> float` (the `Reward` protocol), so a
learner plugs in their own by writing a function. Two come with the package:

- `exact_match`: 1.0 for exactly the answer, else 0.0. What the course's evaluation counts.
- `partial_credit`: a share of the answer right, character by character at its position,
  with a wrong length costing as much as wrong characters (formula in its docstring).

Partial credit gives a signal before the model ever gets a whole answer right, but a fresh
model's near-random strings get a little credit for the wrong reasons too; on its own it
does not replace a warm start (a model that already answers some prompts exactly).

`score` runs a reward over a batch and is where bad rewards are caught: a reward function
that raises, returns something that is not a real number, or returns NaN / ±Inf stops with
the example's index and prompt in the message, not later as a NaN loss.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Protocol

import torch

from minigpt.tasks import Example


class Reward(Protocol):
    """A verifier: how good `completion` (the decoded text after the prompt, without the
    <eos>) is as an answer to `example`. Any finite float; higher is better."""

    def __call__(self, example: Example, completion: str) -> float: ...


def exact_match(example: Example, completion: str) -> float:
    """1.0 if the completion is exactly the answer, else 0.0."""
    return 1.0 if completion == example.answer else 0.0


def partial_credit(example: Example, completion: str) -> float:
    """Share of positions right: hits / max(len(answer), len(completion)), in [0, 1].

    hits = number of positions i where completion[i] == answer[i]. Dividing by the longer
    length makes every missing or extra character cost as much as a wrong one: "ab" for
    "abc" earns 2/3, "abcd" for "abc" earns 3/4, "xbc" earns 2/3. The credit is 1.0 only
    for the exact answer (all positions hit and the lengths equal). Both empty: 1.0.
    """
    answer = example.answer
    n = max(len(answer), len(completion))
    if n == 0:
        return 1.0
    hits = sum(a == c for a, c in zip(answer, completion, strict=False))
    return hits / n


def score(reward: Reward, examples: Sequence[Example], completions: Sequence[str]
          ) -> torch.Tensor:
    """rewards [N] float32, reward(examples[i], completions[i]) for each i.

    Raises ValueError for no examples, lengths that differ, a result that is not a real number (bool
    counts as 0/1) or is not finite, and RuntimeError (from the original error) for a
    reward function that raises; each names the index and the prompt.
    """
    if not examples:
        raise ValueError("examples is empty; score needs at least one (example, completion)")
    if len(examples) != len(completions):
        raise ValueError(f"examples and completions must pair up one to one, got "
                         f"{len(examples)} examples and {len(completions)} completions")
    name = getattr(reward, "__name__", type(reward).__name__)
    out = []
    for i, (ex, completion) in enumerate(zip(examples, completions, strict=True)):
        where = f"example {i} (prompt {ex.prompt!r}, completion {completion!r})"
        try:
            r = reward(ex, completion)
        except Exception as err:
            raise RuntimeError(f"reward {name} raised on {where}: "
                               f"{type(err).__name__}: {err}") from err
        if not isinstance(r, numbers.Real):
            raise ValueError(f"reward {name} must return a real number, got "
                             f"{type(r).__name__} {r!r} on {where}")
        if not math.isfinite(r):
            raise ValueError(f"reward {name} returned {r} on {where}; rewards must be finite")
        out.append(float(r))
    return torch.tensor(out, dtype=torch.float32)
