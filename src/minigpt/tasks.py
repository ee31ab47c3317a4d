"""The synthetic task suite: small, exactly-checkable problems as (prompt, answer) pairs.

Every task is deterministic from a seed, and each prompt belongs to exactly one split
("train" or "eval") by a hash of its text, so evaluation never scores a prompt the model
was trained on. The base model is pretrained on every task but `HELD_OUT`; fine-tuning
labs teach that one, and exact match on it says whether they worked.
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

LETTERS = string.ascii_lowercase
HELD_OUT = "rev"
EVAL_FRACTION = 0.2


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str    # what the model is given, ends with "="
    answer: str    # what it must produce next (then <eos>); scored by exact match


def _word(rng: random.Random, lo: int = 2, hi: int = 6, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _add(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"add:{a}+{b}=", str(a + b)


def _copy(rng):
    w = _word(rng)
    return f"copy:{w}=", w


def _rev(rng):
    w = _word(rng)
    return f"rev:{w}=", w[::-1]


def _sort(rng):
    w = _word(rng)
    return f"sort:{w}=", "".join(sorted(w))


def _kv(rng):
    keys = rng.sample(LETTERS, rng.randint(2, 4))
    vals = [str(rng.randint(0, 9)) for _ in keys]
    q = rng.choice(keys)
    pairs = ",".join(k + v for k, v in zip(keys, vals, strict=True))
    return f"kv:{pairs}?{q}=", vals[keys.index(q)]


def _count(rng):
    w = _word(rng, 3, 7, "abc")
    q = rng.choice("abc")
    return f"count:{w}?{q}=", str(w.count(q))


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,        # two-digit addition
    "copy": _copy,      # repeat a word
    "sort": _sort,      # sort a word's letters
    "kv": _kv,          # look up the digit stored under a letter
    "count": _count,    # count one letter's occurrences
    "rev": _rev,        # reverse a word (held out of pretraining)
}
PRETRAIN_TASKS = [t for t in TASKS if t != HELD_OUT]


def split_of(prompt: str) -> str:
    """'eval' for a fixed EVAL_FRACTION of all prompts (by hash), else 'train'."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
    return "eval" if bucket / 2**32 < EVAL_FRACTION else "train"


def make_examples(task: str, n: int, seed: int = 0, split: str = "train") -> list[Example]:
    """`n` examples of `task` from `split`, the same list for the same (task, seed, split)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"{task}/{split}/{seed}")
    out = []
    while len(out) < n:
        prompt, answer = TASKS[task](rng)
        if split_of(prompt) == split:
            out.append(Example(task, prompt, answer))
    return out


def make_mixture(tasks: list[str], n_per_task: int, seed: int = 0, split: str = "train"
                 ) -> list[Example]:
    """Examples of several tasks, interleaved deterministically."""
    examples = [ex for t in tasks for ex in make_examples(t, n_per_task, seed, split)]
    random.Random(f"mix/{seed}/{split}").shuffle(examples)
    return examples
