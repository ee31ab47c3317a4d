"""Runtimes from one measured table: labs/runtimes.json.

`python -m course times` (`make times`) runs every lab's solution notebook the way a learner's
copy runs (from the lab's folder; the capstone with every lab's solution saved as the
learner's pieces, as `make check` would have saved them), one at a time, writes the table, and
fills every marker

    <!-- runtime:NN-name --><!-- /runtime -->

in the guides, the solutions' markdown, labs/INSTRUCTORS.md, README.md, RESULTS.md and
experiments/README.md from it (then `make course` carries the notebooks' text to labs/).
`--fill` refills the markers from the committed table without measuring.
`course.authoring.runtimes.problems` is what the test holds: markers that disagree with the
table, a lab missing from it or over the budget, runtime claims typed into the text instead of
taken from the table, and markers that start a line.

A marker never starts a line (nor a percent file's `# ` line, a list item or a quote): there
CommonMark opens an HTML block, which splits the sentence into two paragraphs. At least one
word goes before it on its line ("... the whole notebook\nruns in <!-- runtime:... -->").
The writer refuses to fill, and `make times` to measure, while one does.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit.atomic import atomic_write_text
from labkit.errors import InputError

TABLE = Path("labs") / "runtimes.json"
BUDGET_S = 30.0             # issue 19: every solution notebook within 30 s on the 2-core CPU
MARKER = re.compile(r"<!-- runtime:(?P<lab>[\w.-]+) -->(?P<text>.*?)<!-- /runtime -->")
# A typed runtime: a notebook, cell, lab or solution that runs or takes seconds or minutes.
CLAIM = re.compile(r"\b(notebook|cell|lab|solution)s?\b(\s+\d+)?[^.;]{0,60}?"
                   r"(?<![-\w])(runs|run in|run for|takes?|took|finishes)\b[^.;]{0,40}?"
                   r"(\b(\d+([.,]\d+)?|a|one|two|few|several)\s*([–-]\s*\d+\s*)?"
                   r"(s|secs?|seconds?|min|minutes?)\b|\ba (few )?(seconds?|minutes?)\b)",
                   re.I)
# What may stand before a marker at the start of a line and still leave it opening an HTML
# block: indentation, list markers and quote marks (after a percent file's `#`).
BLOCK_PREFIX = r"[ \t]*(?:(?:[-*+>]|\d+[.)])[ \t]+)*"


def text_files(root: Path) -> list[Path]:
    """Where runtimes may be stated: the guides, the solutions, the instructors' notes, the
    README, RESULTS.md and the experiments' guide (the release notebooks are generated from
    the solutions)."""
    return sorted([*root.glob("labs/[0-9][0-9]-*/README.md"), *root.glob("solutions/*.py"),
                   root / "labs" / "INSTRUCTORS.md", root / "README.md", root / "RESULTS.md",
                   root / "experiments" / "README.md"])


def render(entry: dict, cores: int) -> str:
    return f"about {entry['seconds']:.0f} s (the solution, measured on a {cores}-core CPU)"


def fill(text: str, table: dict) -> str:
    """`text` with every marker's content rendered from `table` (unknown labs left as they
    are, for `problems` to report)."""
    def sub(m: re.Match) -> str:
        entry = table["labs"].get(m["lab"])
        body = render(entry, table["cores"]) if entry else m["text"]
        return f"<!-- runtime:{m['lab']} -->{body}<!-- /runtime -->"
    return MARKER.sub(sub, text)


def line_start_markers(path: Path, text: str) -> list[int]:
    """The lines (from 1) of `text` where a runtime marker starts the line's Markdown."""
    comment = r"[ \t]*#[ \t]?" if path.suffix == ".py" else ""
    start = re.compile(rf"^{comment}{BLOCK_PREFIX}<!-- runtime:", re.M)
    return [text.count("\n", 0, m.start()) + 1 for m in start.finditer(text)]


def misplaced_markers(root: Path) -> list[str]:
    """`file:line: ...` for every marker that starts a line of the text files."""
    return [f"{path.relative_to(root)}:{line}: a runtime marker starts the line, which "
            "splits its sentence into two paragraphs (an HTML block in CommonMark); put at "
            "least one word before it on its line"
            for path in text_files(root) if path.is_file()
            for line in line_start_markers(path, path.read_text())]


def require_inline_markers(root: Path) -> None:
    """Raise InputError naming every marker that starts a line (see the module's doc)."""
    if found := misplaced_markers(root):
        raise InputError("\n".join(found))


def _paragraphs(path: Path, text: str) -> list[str]:
    """The prose of a file, markers' content cut out, one string per paragraph, list item,
    table row or heading: a solution's comment lines (its markdown and code comments), a
    Markdown file whole."""
    text = re.sub(r"```.*?```", "", MARKER.sub("", text), flags=re.S)   # code blocks
    if path.suffix == ".py":
        text = "\n".join(line.lstrip()[1:] for line in text.splitlines()
                         if line.lstrip().startswith("#"))
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:[|#>*-]|\d+\.)\s)", text)
    return [" ".join(b.split()) for b in blocks]


def typed_claims(path: Path, text: str) -> list[str]:
    """Sentences of `text` that state how long a notebook, cell or lab runs."""
    sentences = [s for b in _paragraphs(path, text) for s in re.split(r"(?<=[.;!?])\s+", b)]
    return [s[:160] for s in sentences if CLAIM.search(s)]


def problems(root: Path, labs: list[str]) -> list[str]:
    """What makes the stated runtimes disagree with the table (empty when none)."""
    try:
        table = json.loads((root / TABLE).read_text())
    except (OSError, ValueError) as e:
        return [f"{TABLE}: unreadable ({e}); run `make times`"]
    out = [f"{TABLE}: {lab} is not measured (run `make times`)" for lab in labs
           if lab not in table["labs"]]
    out += [f"{TABLE}: {lab} took {e['seconds']:.1f} s, over the {BUDGET_S:.0f} s budget"
            for lab, e in table["labs"].items() if e["seconds"] > BUDGET_S]
    for path in text_files(root):
        text = path.read_text()
        rel = path.relative_to(root)
        if fill(text, table) != text:
            out.append(f"{rel}: a runtime marker differs from {TABLE} (run `python -m course "
                       f"times --fill`, then `make course`)")
        out += [f"{rel}: marker for unknown lab {m['lab']!r}" for m in MARKER.finditer(text)
                if m["lab"] not in table["labs"]]
        out += [f"{rel}: a runtime typed instead of a marker: {claim!r}"
                for claim in typed_claims(path, text)]
    return out + misplaced_markers(root)


def _measure_one(root: Path, lab: str) -> float:
    """Seconds to execute `lab`'s solution notebook from its folder, in a fresh kernel."""
    from nbclient import NotebookClient

    from .build import source_notebook

    nb = source_notebook(root / "solutions" / f"{lab}.py")
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(root / "labs" / lab)}})
    t0 = time.perf_counter()
    client.execute()
    return time.perf_counter() - t0


def measure(root: Path, labs: list[str], repeat: int = 1) -> dict:
    """Run every lab's solution `repeat` times; the median per lab, with the machine."""
    from tqdm import tqdm

    from ..notebook.mine import save
    from ..notebook.pieces import PIECES
    from .build import graded_test_cells, source_notebook

    saved_env = {k: os.environ.get(k) for k in ("MINIQLORA_ROOT", "NBGRADER_EXECUTION")}
    with tempfile.TemporaryDirectory() as learner:
        for lab in sorted({p.lab for p in PIECES}):          # a learner who did every lab
            nb = source_notebook(root / "solutions" / f"{lab}.py")
            save(Path(learner), lab, nb, {c.metadata.nbgrader.grade_id: True
                                          for c in graded_test_cells(nb)},
                 root / "solutions" / f"{lab}.py")
        os.environ["MINIQLORA_ROOT"] = learner
        os.environ.pop("NBGRADER_EXECUTION", None)
        try:
            seconds = {lab: [] for lab in labs}
            for _ in range(repeat):
                for lab in tqdm(labs, desc="solution notebooks"):
                    seconds[lab].append(_measure_one(root, lab))
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                            capture_output=True, text=True).stdout.strip()
    return {"what": "wall seconds to run each lab's solution notebook (hidden tests included) "
                    "from top to bottom in a fresh kernel, median of the runs",
            "command": f"python -m course times --repeat {repeat}",
            "cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "commit": commit, "repeat": repeat,
            "labs": {lab: {"seconds": round(statistics.median(s), 1),
                           "runs": [round(x, 1) for x in s]} for lab, s in seconds.items()}}


def write(root: Path, table: dict | None = None) -> list[Path]:
    """Write the table (if given) and refill every marker from the committed one; return the
    files changed. Refuses (InputError, nothing written) while a marker starts a line."""
    require_inline_markers(root)
    if table is not None:
        atomic_write_text(root / TABLE, json.dumps(table, indent=1) + "\n")
    table = json.loads((root / TABLE).read_text())
    changed = []
    for path in text_files(root):
        text = path.read_text()
        if (new := fill(text, table)) != text:
            atomic_write_text(path, new)
            changed.append(path)
    return changed
