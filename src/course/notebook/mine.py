"""Your own code, all the way: a learner's saved lab code, swapped into the packages.

`make check LAB=NN-name` runs the learner's notebook; afterwards `save` writes the notebook's
definitions to work/mine/NN-name.py (in the spirit of d2l's `#@save`, but automatic): from
every code cell that is not a test, the top-level imports, public functions and classes,
UPPER_CASE constants, and every helper they need whatever its name (closure.py). Beside it,
work/mine/NN-name.json records which visible tests passed, the module's sha256, and the
definitions that need a value the notebook only computes at run time (`Saved.incomplete`):
a piece calling one of those stays on the reference, saying why.

`use("mine")` then swaps each piece of `pieces.PIECES` whose tests passed into the packages,
wherever they call the reference (by object, as the lab tests' `swap` does), and prints for
every piece whether it is yours or, and why, the reference's. Each call the packages hand to
a piece of yours is counted (`Choice.calls`); leaving the block prints what ran, so a piece
that was loaded but never called says so:

    with use("mine") as choices:
        train(model, ...)          # quantize_nf4, lora_linear, parallel_linear: yours
    ran(choices)                   # {piece: calls} for every piece of yours

When a run on your pieces leaves the reference's, `blame` repeats a short version of it with
your pieces swapped back to the reference one at a time and names the one whose swap restores
agreement.

Grading never reads work/: a graded notebook runs on the reference alone (`use` says so).
In a student edition (course.authoring.edition) a reference whose lab is not released is a
stub: `use` names such a piece as the stub of that lab, which raises when the run reaches it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from labkit.atomic import atomic_write_text
from labkit.errors import InputError

from ..learner import WORK
from .closure import definitions

if TYPE_CHECKING:   # annotations only: the capstone imports `use` without nbformat's import cost
    import nbformat

MINE = "mine"                      # work/mine/: the learner's saved modules
MODULE_PREFIX = "labkit_mine_"     # sys.modules names of the loaded modules


def mine_dir(root: Path) -> Path:
    return root / WORK / MINE


def default_root() -> Path:
    """The course checkout: $MINIQLORA_ROOT, else the first folder up from the working
    directory holding work/ or labs/ (a notebook runs in work/), else this package's checkout."""
    if os.environ.get("MINIQLORA_ROOT"):
        return Path(os.environ["MINIQLORA_ROOT"]).resolve()
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / WORK / MINE).is_dir() or (folder / "labs").is_dir():
            return folder
    return Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------------- saving


@dataclass
class Saved:
    """What work/mine/NN-name.json says about a lab's saved module."""
    lab: str
    passed: list[str]
    failed: list[str]
    sha256: str
    notebook: str = ""
    saved_at: str = ""
    path: Path = field(default=Path(), compare=False)
    edited: bool = False         # the module no longer has the sha256 `make check` recorded
    names: list[str] = field(default_factory=list)              # what the module defines
    incomplete: dict[str, list[str]] = field(default_factory=dict)  # {name: what it lacks}


def save(root: Path, lab: str, nb: nbformat.NotebookNode, passed: dict[str, bool],
         notebook: Path) -> Saved:
    """Write work/mine/<lab>.py and its record (each atomically; the record last, so a
    record always describes the module beside it). Returns the record."""
    found = definitions(nb)
    source = (f"# Saved by `make check LAB={lab}` from {notebook.name}: your definitions, "
              f"for `use(\"mine\")`.\n# Rewritten at every check: edit the notebook, not "
              f"this file.\n\n" + found.source)
    folder = mine_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    module = folder / f"{lab}.py"
    atomic_write_text(module, source)
    record = {"lab": lab, "notebook": str(notebook), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "passed": sorted(k for k, v in passed.items() if v),
              "failed": sorted(k for k, v in passed.items() if not v),
              "sha256": hashlib.sha256(source.encode()).hexdigest(),
              "names": found.names, "incomplete": found.incomplete}
    atomic_write_text(folder / f"{lab}.json", json.dumps(record, indent=1) + "\n")
    return saved(root, lab)


def saved(root: Path, lab: str) -> Saved | None:
    """The record of `lab`'s saved module, or None when there is none (or it is unreadable).
    `edited` says the module no longer has the hash recorded when it was saved: it was edited
    by hand since the check, and is not used."""
    folder = mine_dir(root)
    try:
        record = json.loads((folder / f"{lab}.json").read_text())
        source = (folder / f"{lab}.py").read_bytes()
        s = Saved(**{k: record[k] for k in ("lab", "passed", "failed", "sha256")},
                  notebook=record.get("notebook", ""), saved_at=record.get("saved_at", ""),
                  path=folder / f"{lab}.py", names=list(record.get("names", [])),
                  incomplete=dict(record.get("incomplete", {})))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    s.edited = hashlib.sha256(source).hexdigest() != s.sha256
    return s


def load(s: Saved):
    """Import a saved module (the learner's own code, in the learner's own process) with the
    process as it was: loading runs setup lines such as `harness.triton_setup()`, which seed
    torch and set its thread count, and print. Triton is imported first the packages' way
    (`import_triton`: the interpreter where there is no CUDA), in case the module's own
    `import triton` would be the first: the lab's setup cell that chose the interpreter is not
    saved. (If something imported triton earlier without it, as torch's checkpoint does, a
    kernel that calls triton.language helpers cannot run on a CPU: the capstone chooses the
    interpreter in its setup cell.)"""
    import torch

    from miniquant.triton_env import import_triton, triton_installed

    if triton_installed():
        import_triton()
    name = MODULE_PREFIX + s.lab.replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, s.path)
    module = importlib.util.module_from_spec(spec)
    rng, threads = torch.random.get_rng_state(), torch.get_num_threads()
    # the notebook's folder first, as Jupyter has it: a module of the learner's own beside
    # the notebook (`import my_utils`) imports as it did there
    beside = [str(Path(s.notebook).parent)] if s.notebook else []
    sys.path[:0] = beside
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            spec.loader.exec_module(module)
    finally:
        del sys.path[:len(beside)]
        torch.random.set_rng_state(rng)
        torch.set_num_threads(threads)
    sys.modules[name] = module
    return module


# ----------------------------------------------------------------------------------- using


@dataclass
class Choice:
    piece: str
    lab: str
    yours: bool
    why: str
    calls: int = 0      # calls the packages handed to your code inside the `use` block
    stub: str = ""      # not yours, and the reference is a stub until this lab is released


def unreleased(target: str) -> str:
    """The lab whose stub stands at `target` ("module:function") in a student edition (its
    module's `__unreleased__`), or "" where the reference is there."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), "__unreleased__", {}).get(name, "")


def _mark_stubs(choices: list[Choice]) -> list[Choice]:
    """Name, in each choice that falls to an unreleased reference, the lab of its stub."""
    from .pieces import PIECES

    for piece, c in zip(PIECES, choices, strict=True):
        if not c.yours and (lab := unreleased(piece.target)):
            c.stub, c.why = lab, (f"{c.why}; the reference is not released: a stub in this "
                                  f"student edition (Lab {lab[:2]} asks you to write it), "
                                  "which raises if the run reaches it")
    return choices


def choose(root: Path) -> list[Choice]:
    """For each piece: yours (its lab saved, its tests passed) or the reference, and why."""
    from .pieces import PIECES

    out = []
    for p in PIECES:
        s = saved(root, p.lab)
        missing = sorted(set(p.tests) - set(s.passed)) if s else None
        if os.environ.get("NBGRADER_EXECUTION"):
            why = "grading runs every notebook on the reference alone"
        elif s is None:
            why = f"nothing saved from {p.lab} yet (`make check LAB={p.lab}` saves it)"
        elif s.edited:
            why = (f"{WORK}/{MINE}/{p.lab}.py was edited by hand since `make check` saved it: "
                   f"edit the notebook and run `make check LAB={p.lab}` again")
        elif missing:
            why = f"{p.lab}: visible tests not passed yet: {', '.join(missing)}"
        elif absent := [n for n in p.uses if s.names and n not in s.names]:
            why = f"{p.lab}: your notebook defines no {', '.join(absent)}"
        elif lacking := {n: s.incomplete[n] for n in p.uses if n in s.incomplete}:
            why = (f"{p.lab}: " + "; ".join(f"your {n} needs {', '.join(v)}" for n, v in
                                             lacking.items())
                   + ", which your notebook computes at run time and `make check` cannot save "
                   "(make it an argument, or a constant or function of its own)")
        else:
            why = f"from {WORK}/{MINE}/{p.lab}.py"
        out.append(Choice(p.name, p.lab, why.startswith("from "), why))
    return out


@contextlib.contextmanager
def use(which: str = "mine", root: Path | None = None, quiet: bool = False,
        reference: Iterable[str] = ()) -> Iterator[list[Choice]]:
    """Inside the block, the packages run the learner's pieces where they are done
    (`which="mine"`), except the pieces named in `reference`, or the reference everywhere
    (`which="reference"`). Each call handed to a piece of yours adds one to its
    `Choice.calls` (a case the piece does not cover, which the reference runs, does not).
    Unless `quiet`, prints the choice for each piece on entry and what ran on a normal exit.
    A piece whose module fails to load falls back, saying why."""
    if which not in ("mine", "reference"):
        raise ValueError(f"which must be 'mine' or 'reference', got {which!r}")
    from .forbid import swap
    from .pieces import ADAPTERS, PIECES, resolve

    reference = set(reference)
    if unknown := reference - {p.name for p in PIECES}:
        raise ValueError(f"reference names no piece: {sorted(unknown)}")
    root = (root or default_root()).resolve()
    choices = choose(root) if which == "mine" else [
        Choice(p.name, p.lab, False, "use('reference')") for p in PIECES]
    for c in choices:
        if c.yours and c.piece in reference:
            c.yours, c.why = False, "kept on the reference (use(..., reference=...))"
    by_name = {c.piece: c for c in choices}

    def count(piece: str) -> None:
        by_name[piece].calls += 1

    modules: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        # Target by target in PIECES order, each lab's module loaded just before its first
        # swap: a later lab's `from minimoe import scatter2scatter` then binds the learner's.
        for target in dict.fromkeys(p.target for p in PIECES):
            mine = [(p, c) for p, c in zip(PIECES, choices, strict=True)
                    if p.target == target and c.yours]
            try:
                for piece, _ in mine:
                    if piece.lab not in modules:
                        modules[piece.lab] = load(saved(root, piece.lab))
                if mine:
                    ref = resolve(target)
                    stack.enter_context(swap(ref, ADAPTERS[target](
                        ref, {p.name: modules[p.lab] for p, _ in mine}, count)))
            except Exception as e:  # the learner's module: any error means "not usable"
                for piece, choice in mine:
                    choice.yours, choice.why = False, (
                        f"{piece.lab}'s saved code failed to load: {type(e).__name__}: {e}")[:200]
        _mark_stubs(choices)
        if not quiet:
            print(describe(choices))
        yield choices
        if not quiet:
            print(f"your pieces that ran in this block (calls):\n{describe_calls(choices)}")


def ran(choices: list[Choice]) -> dict[str, int]:
    """{piece: calls} for every piece of yours in a `use` block; 0: loaded, never called."""
    return {c.piece: c.calls for c in choices if c.yours}


def describe(choices: list[Choice]) -> str:
    width = max(len(c.piece) for c in choices)
    return "\n".join(f"  {c.piece:<{width}}  {_kind(c):<9}  {c.why}" for c in choices)


def _kind(c: Choice) -> str:
    return "yours" if c.yours else f"stub {c.stub[:2]}" if c.stub else "reference"


def describe_calls(choices: list[Choice]) -> str:
    calls = ran(choices)
    if not calls:
        return "  none: every piece was the reference's"
    width = max(len(p) for p in calls)
    return "\n".join(f"  {p:<{width}}  {n:>6,}" if n else
                     f"  {p:<{width}}  loaded, never called" for p, n in calls.items())


def blame(run: Callable[[], object], agrees: Callable[[object], bool],
          root: Path | None = None) -> str:
    """Which piece of yours makes a run leave the reference's, as a sentence.

    `run` is a short, seeded version of the run that disagreed and `agrees(result)` says
    whether its result matches the reference's. It is repeated under `use("mine")`: with all
    your pieces (the short run must disagree too), then with each piece that ran swapped back
    to the reference alone, in PIECES order; the first whose swap restores agreement is named.
    If no single swap does, the pieces that ran are swapped back one more at a time."""
    def agrees_with(back: list[str]) -> tuple[bool, list[Choice]]:
        with use("mine", root=root, quiet=True, reference=back) as choices:
            result = run()
        return agrees(result), choices

    ok, choices = agrees_with([])
    if ok:
        return ("the short check agrees with the reference even with all your pieces, so it "
                "cannot tell which piece moved the long run")
    labs = {c.piece: c.lab for c in choices}
    suspects = [c.piece for c in choices if c.calls]

    def named(piece: str) -> str:
        return f"{piece} (work/mine/{labs[piece]}.py)"

    for piece in suspects:
        if agrees_with([piece])[0]:
            return (f"swapped back to the reference alone, {named(piece)} restores agreement "
                    f"on a short run: that piece computes something else than the reference "
                    f"here; rerun `make check LAB={labs[piece]}`")
    for n in range(2, len(suspects) + 1):
        if agrees_with(suspects[:n])[0]:
            return (f"no single piece restores agreement on a short run; swapping back "
                    f"{', '.join(named(p) for p in suspects[:n])} together does, the last "
                    f"one named completing it")
    return ("a short run disagrees even with every piece of yours swapped back to the "
            "reference: the difference is in this notebook's code, not in your pieces")


def status(root: Path) -> int:
    """`python -m course mine`: which pieces are yours now."""
    print(f"pieces `use(\"mine\")` swaps in ({mine_dir(root)}):")
    print(describe(_mark_stubs(choose(root))))
    return 0


def require_lab(lab: str, labs: list[str]) -> None:
    if lab not in labs:
        raise InputError(f"unknown lab {lab!r}; available: {labs}")
