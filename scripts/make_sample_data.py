"""Write the course's sample reward-labelled data, data/, deterministically from fixed seeds.

    .venv/bin/python scripts/make_sample_data.py [--out DIR] [--check]

`rev_rewarded.jsonl`: eight prompts of the held-out task (`minigpt.tasks.HELD_OUT`, `rev`,
train split), each with four to six candidate answers, one JSON object per line:
`prompt`, `answer` (the candidate), `reward` (`minirl.exact_match`), `partial_credit`
(`minirl.partial_credit`) and `kind` (how the candidate was made). The candidates come from
the task's own answer by plausible corruptions (the word copied instead of reversed, two
letters swapped, the last one dropped, ...), never from a model, so the file depends on no
weights. Six prompts mix right, near and wrong answers; one has only right answers and one
only wrong ones, so two groups have no `reward` variance. `minirl.read_rewarded_jsonl` reads
it. `SHA256SUMS`: the digest of each file written, as `sha256sum` prints it.

`--check` makes the files in memory and compares them with those in DIR byte for byte (and
DIR/SHA256SUMS with the files in DIR); it writes nothing and exits 1 naming each difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import minirl
from minigpt import tasks
from minigpt.atomic import atomic_path

ROOT = Path(__file__).resolve().parents[1]
REWARDED = "rev_rewarded.jsonl"
SUMS = "SHA256SUMS"
SEED = 0
N_MIXED = 6
# The kinds of candidate in each sort of group (made in this order, then shuffled).
MIXED = ("correct", "copied", "swapped", "dropped", "substituted", "unrelated")
SOLVED = ("correct",) * 4                                   # nothing to prefer: no variance
HOPELESS = ("copied", "unrelated", "empty", "unstopped")    # no exact match: no variance


def _swapped(answer: str, rng: random.Random) -> str:
    """Two adjacent letters that differ, swapped."""
    i = rng.choice([i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]])
    return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]


def _substituted(answer: str, rng: random.Random) -> str:
    """One letter replaced by another."""
    i = rng.randrange(len(answer))
    return answer[:i] + rng.choice(tasks.LETTERS.replace(answer[i], "")) + answer[i + 1:]


def _unrelated(answer: str, rng: random.Random) -> str:
    """A random word of the same length, neither the answer nor the copied word."""
    while True:
        word = "".join(rng.choice(tasks.LETTERS) for _ in answer)
        if word not in (answer, answer[::-1]):
            return word


# kind -> (answer, rng) -> candidate; every kind but "correct" is a wrong answer.
CORRUPTIONS: dict[str, Callable[[str, random.Random], str]] = {
    "correct": lambda a, rng: a,
    "copied": lambda a, rng: a[::-1],           # the prompt's word, not reversed
    "swapped": _swapped,
    "dropped": lambda a, rng: a[:-1],           # stopped one letter early
    "unstopped": lambda a, rng: a + rng.choice(tasks.LETTERS),   # one letter too many
    "substituted": _substituted,
    "unrelated": _unrelated,
    "empty": lambda a, rng: "",                 # <eos> at once
}


def sample_prompts(n: int, seed: int = SEED) -> list[tasks.Example]:
    """The first `n` distinct rev train prompts of 3+ letters whose word is no palindrome (so
    that every corruption is a wrong answer)."""
    out: dict[str, tasks.Example] = {}
    for ex in tasks.make_examples(tasks.HELD_OUT, 20 * n, seed=seed, split="train"):
        if len(ex.answer) >= 3 and ex.answer != ex.answer[::-1]:
            out.setdefault(ex.prompt, ex)
    if len(out) < n:
        raise ValueError(f"n={n}: only {len(out)} suitable prompts among {20 * n} examples")
    return list(out.values())[:n]


def group_records(example: tasks.Example, kinds: tuple[str, ...], rng: random.Random
                  ) -> list[dict]:
    """One record per kind of candidate, scored by both rewards, in shuffled order."""
    records = []
    for kind in kinds:
        answer = CORRUPTIONS[kind](example.answer, rng)
        records.append({"prompt": example.prompt, "answer": answer,
                         "reward": minirl.exact_match(example, answer),
                         "partial_credit": minirl.partial_credit(example, answer),
                         "kind": kind})
    rng.shuffle(records)
    return records


def rewarded_records(seed: int = SEED) -> list[dict]:
    """The records of rev_rewarded.jsonl: N_MIXED mixed groups, then a solved and a hopeless."""
    rng = random.Random(f"sample-data/{seed}")
    examples = sample_prompts(N_MIXED + 2, seed)
    kinds = [MIXED] * N_MIXED + [SOLVED, HOPELESS]
    return [r for ex, k in zip(examples, kinds, strict=True) for r in group_records(ex, k, rng)]


def sums(files: dict[str, bytes]) -> bytes:
    """`sha256sum` format: '<hex digest>  <name>' per file, names sorted."""
    return "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                   for name, data in sorted(files.items())).encode()


def sample_files(seed: int = SEED) -> dict[str, bytes]:
    """{file name in data/: its bytes}, SHA256SUMS included."""
    lines = [json.dumps(r) + "\n" for r in rewarded_records(seed)]
    files = {REWARDED: "".join(lines).encode()}
    return {**files, SUMS: sums(files)}


def write(files: dict[str, bytes], out: Path) -> None:
    """Each file atomically (all of it or none); SHA256SUMS last."""
    for name in sorted(files, key=lambda n: n == SUMS):
        with atomic_path(out / name) as tmp:
            tmp.write_bytes(files[name])


def _line_difference(path: Path, have: bytes, want: bytes) -> str:
    """Where `have` first departs from `want`: the line, and the fields that differ."""
    old, new = have.decode(errors="replace").splitlines(), want.decode().splitlines()
    for n, (a, b) in enumerate(zip(old, new, strict=False), start=1):
        if a == b:
            continue
        try:
            ra, rb = json.loads(a), json.loads(b)
            fields = [f"{k!r} is {ra.get(k, '(missing)')!r} in the file, the script "
                      f"gives {rb.get(k, '(missing)')!r}" for k in {**rb, **ra}
                      if ra.get(k, ...) != rb.get(k, ...)]
        except (ValueError, AttributeError):
            fields = []
        return f"{path}, line {n}: " + ("; ".join(fields) or
                                         f"the file has {a!r}, the script gives {b!r}")
    if len(old) != len(new):
        return f"{path}: the file has {len(old)} lines, the script gives {len(new)}"
    return f"{path}: the same lines, other line endings or bytes between them"


def differences(files: dict[str, bytes], out: Path) -> list[str]:
    """What in `out` differs from `files` (empty: all the same), then any file whose digest
    disagrees with out/SHA256SUMS."""
    found = []
    for name, want in files.items():
        path = out / name
        if not path.is_file():
            found.append(f"{path} is missing")
        elif (have := path.read_bytes()) != want:
            found.append(_line_difference(path, have, want))
    if (out / SUMS).is_file():
        recorded = (out / SUMS).read_text().splitlines()
        for name in (n for n in files if n != SUMS and (out / n).is_file()):
            actual = sums({name: (out / name).read_bytes()}).decode().rstrip("\n")
            if actual not in recorded:
                found.append(f"{out / name}: its sha256 is not the one {out / SUMS} records")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data",
                        help="the folder to write (or check); default: data/ of the checkout")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the files in --out differ from the "
                             "script's output")
    args = parser.parse_args(argv)
    files = sample_files()
    if args.check:
        if found := differences(files, args.out):
            print("the sample data differs from what scripts/make_sample_data.py makes:\n  "
                  + "\n  ".join(found) + "\nrerun `python scripts/make_sample_data.py` to "
                  "restore it (a learner's edits belong in a copy, see data/README.md)",
                  file=sys.stderr)
            return 1
        print(f"{args.out}: {', '.join(sorted(files))} are the script's output")
        return 0
    write(files, args.out)
    for name, data in sorted(files.items()):
        print(f"wrote {args.out / name} ({len(data):,d} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
