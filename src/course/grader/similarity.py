"""The nearest source of each submission's code: the lab's reference, or another student's.

A hint for a person to read (grades.csv's `nearest`, the console's short list), never a
score: nothing here changes a grade. Per lab of a grading run, in the grader's own process,
after grading (the learner's files are read as JSON: never run, never validated):

    given      the release's code cells (labs/NN-name/NN-name.ipynb): what everyone got
    reference  the instructor's solution cells (solutions/NN-name.py) and the source of every
               library object the lab rebuilds (`harness.reference`; a lab without a REFERENCE
               table: the solution cells alone, and the run says so)
    a student  their code cells that are not verbatim a given one, solution cells first,
               MAX_CELLS read, MAX_CELL_CHARS a cell and MAX_CODE_CHARS in all, control
               characters removed

Every cell is fingerprinted apart with copydetect (the winnowing of MOSS): pygments tokens,
every name made V/F/O and every string S, comments and whitespace dropped; the hashes of that
text's K-grams, winnowed over WINDOW. Before, each line of the release's solution cells
(signature, docstring, `# YOUR CODE HERE`, the stub) is dropped from every cell, and after,
every K-gram of the given cells (copydetect's boilerplate): what everyone was given matches
nothing, and a skeleton alone has no fingerprint.

    score(a, b) = characters of a's cells inside a K-gram that b holds too
                  / characters a's K-grams cover          (copydetect's similarity, per cell)
    nearest     = the source of the highest score: "reference 0.93", "student alice 0.71";
                  "" for code too short to compare (under MIN_COVERAGE) or an unreadable file

Python salts its str hash per process: fingerprints are compared within one run, never kept
(and every hash is kept, WINDOW = 1, so that the scores do not change from run to run).
"""

from __future__ import annotations

import inspect
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from ..learner import release_notebook_path
from ..notebook.harness import reference
from .printable import printable

# K-grams of the normalised text (`def F(V:V.V)->V.V:` for a signature): a notebook cell's
# body is 100 to 600 such characters, a line 10 to 30. K = 25 (copydetect's own noise
# threshold) is about two statements: shorter, honest solutions of one specification share
# more (`V=V.V(V,V=V.V)` is half of every line); longer, a copied short exercise goes unseen.
# WINDOW = 1 keeps every hash: Python salts its str hash per process, so a wider window would
# keep other hashes on every run and move a score by up to 0.03 between two runs of the same
# files (a quarter of the hashes, for that). Measured on 02-nf4 (labs/INSTRUCTORS.md): the
# solutions with names changed 0.94, two honest ones 0.00 to each other and 0.03-0.09 to the
# reference, two of eight functions copied 0.50; K = 30 or 40 take that to 0.44, K = 20
# moves no score by more than 0.02.
K = 25
WINDOW = 1
MAX_NOTEBOOK_BYTES = 50 << 20     # as grading's: a larger file is not read at all
MAX_CELL_CHARS = 10_000           # pygments lexes 40-80 k characters a second (hostile text
MAX_CODE_CHARS = 30_000           # 40 k): a submission costs 0.8 s at most, 20-50 ms usually
MAX_CELLS = 2_000                 # read of a notebook (a release has 29 to 47 cells)
MAX_NAME_CHARS = 60               # of a student's name in the column
MIN_COVERAGE = 4 * K              # fewer fingerprinted characters: nothing to compare
# Scored in full against a submission: the reference and the others of the run sharing the
# most hashes with it (a set intersection, 0.15 ms a pair, where a score costs 2 ms).
CANDIDATES = 5
# The console lists the rows at or above this score: where to start reading, not a verdict.
# On 02-nf4 a copy scores about 0.95, two of eight functions copied 0.5, honest work under
# 0.1; a short, tightly specified exercise can be written only a few ways, and two friends
# may have studied together.
FLAG_AT = 0.5


@dataclass
class Code:
    """One source's code, fingerprinted cell by cell (copydetect.CodeFingerprint each)."""
    cells: list
    hashes: frozenset      # every cell's hashes: what a k-gram of another source is found in
    coverage: int          # characters of normalised text the cells' k-grams cover


@dataclass
class Given:
    """What a lab gives every learner, as fingerprinting drops it."""
    cells: frozenset       # the release's code cells, stripped: a student's copy is skipped
    lines: frozenset       # the lines of its solution cells, stripped: dropped from every cell
    boilerplate: object    # int64 [n]: the hashes of every k-gram of its code cells


def _drop_lines(text: str, lines: frozenset) -> str:
    return "\n".join(line for line in text.splitlines() if line.strip() not in lines)


def _fingerprints(cells: list[str], lines: frozenset, boilerplate) -> list:
    """copydetect.CodeFingerprint of each cell, read from memory, less the `lines`."""
    # copydetect imports matplotlib.pyplot (most of a second): only when a run compares code
    from copydetect import CodeFingerprint

    return [CodeFingerprint("cell.py", K, WINDOW, boilerplate, language="python",
                            fp=io.StringIO(_drop_lines(text, lines))) for text in cells]


def fingerprint(cells: list[str], given: Given) -> Code:
    fps = _fingerprints(cells, given.lines, given.boilerplate)
    return Code(fps, frozenset(int(h) for f in fps for h in f.hashes),
                int(sum(f.token_coverage for f in fps)))


def given_code(release_nb) -> Given:
    """The release notebook's code, as every submission of the lab got it."""
    import numpy as np

    code = [c.source for c in release_nb.cells if c.cell_type == "code"]
    skeleton = [c.source for c in release_nb.cells if c.cell_type == "code"
                and c.metadata.get("nbgrader", {}).get("solution")]
    lines = frozenset(s for text in skeleton for line in text.splitlines() if (s := line.strip()))
    fps = _fingerprints(code, lines, None)
    boilerplate = np.array(sorted({int(h) for f in fps for h in f.hashes}), dtype=np.int64)
    return Given(frozenset(c.strip() for c in code), lines, boilerplate)


def _source(obj) -> str | None:
    """The source of a library object: a function, a class, a property's getter or a Triton
    kernel's Python function (`.fn`); None where there is none to read."""
    for candidate in (obj, getattr(obj, "fn", None), getattr(obj, "fget", None)):
        try:
            return inspect.getsource(candidate)
        except (TypeError, OSError):
            continue
    return None


def reference_cells(lab: str, source_nb) -> tuple[list[str], str]:
    """The instructor's solution cells and the source of each library object `lab` rebuilds;
    a note for the console when the lab has no REFERENCE table or an object has no source."""
    cells = [c.source for c in source_nb.cells if c.cell_type == "code"
             and c.metadata.get("nbgrader", {}).get("solution")]
    try:
        objects = reference(lab)
    except Exception as e:   # no table (ValueError); triton absent on macOS, Windows; ...
        return cells, f"{lab}: the library's part is not compared ({type(e).__name__}: {e})"
    sources = {name: _source(obj) for name, obj in objects.items()}
    missing = sorted(name for name, text in sources.items() if text is None)
    note = f"{lab}: no source for {', '.join(missing)}" if missing else ""
    return cells + [text for text in sources.values() if text], note


def _text(source) -> str:
    """A notebook cell's source (a string or a list of them), MAX_CELL_CHARS at most."""
    if isinstance(source, str):
        return source[:MAX_CELL_CHARS]
    parts, left = [], MAX_CELL_CHARS
    for part in source if isinstance(source, list) else ():
        if left <= 0:
            break
        if isinstance(part, str):
            parts.append(part[:left])
            left -= len(parts[-1])
    return "".join(parts)


def student_cells(notebook: Path, given: Given) -> list[str]:
    """The code cells of a submission not given verbatim, solution cells first, bounded and
    without control characters; [] for a file that is not a notebook."""
    try:
        if notebook.stat().st_size > MAX_NOTEBOOK_BYTES:
            return []
        cells = json.loads(notebook.read_bytes()).get("cells")
    except (OSError, ValueError, RecursionError, AttributeError):
        return []
    if not isinstance(cells, list):
        return []
    ranked = []
    for cell in cells[:MAX_CELLS]:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        text = printable(_text(cell.get("source")), lines=True)
        if text.strip() and text.strip() not in given.cells:
            meta = cell.get("metadata")
            nbgrader = meta.get("nbgrader") if isinstance(meta, dict) else None
            ranked.append((not (isinstance(nbgrader, dict) and nbgrader.get("solution")), text))
    kept, left = [], MAX_CODE_CHARS
    for _, text in sorted(ranked, key=lambda r: r[0]):      # stable: notebook order kept
        if left <= 0:
            break
        kept.append(text[:left])
        left -= len(kept[-1])
    return kept


def _matched(cell, hashes: frozenset) -> int:
    """Characters of a cell's normalised text inside one of its k-grams that `hashes` holds
    (copydetect.compare_files' token overlap, against a set of hashes)."""
    import numpy as np
    from copydetect.utils import get_copied_slices

    shared = [h for h in cell.hashes if h in hashes]
    if not shared:
        return 0
    starts, ends = get_copied_slices(np.concatenate([cell.hash_idx[h] for h in shared]), K)
    return int((ends - starts).sum())


def score(a: Code, b: Code) -> float:
    """The share of a's fingerprinted text found in b (0 to 1; not symmetric)."""
    if not a.coverage or not b.hashes:
        return 0.0
    return sum(_matched(cell, b.hashes) for cell in a.cells) / a.coverage


def nearest(student: str, codes: dict[str, Code], ref: Code) -> str:
    """The column for `student`: their nearest source and its score, "" if too short."""
    mine = codes[student]
    if mine.coverage < MIN_COVERAGE:
        return ""
    shared = {other: len(mine.hashes & code.hashes) for other, code in codes.items()
              if other != student}
    name, best = "reference", score(mine, ref)
    for other in sorted(shared, key=lambda o: (-shared[o], o))[:CANDIDATES]:
        if (s := score(mine, codes[other])) > best:
            name, best = f"student {printable(other)[:MAX_NAME_CHARS]}", s
    return f"{name} {best:.2f}"


def lab_columns(root: Path, lab: str, source_nb, notebooks: dict[str, Path]
                ) -> tuple[dict[str, str], str]:
    """{student: nearest column} for the submissions of one lab; a note on its reference."""
    given = given_code(nbformat.read(release_notebook_path(root, lab), as_version=4))
    cells, note = reference_cells(lab, source_nb)
    ref = fingerprint(cells, given)
    codes = {s: fingerprint(student_cells(path, given), given) for s, path in notebooks.items()}
    return {s: nearest(s, codes, ref) for s in codes}, note


def nearest_sources(root: Path, found: dict[tuple[str, str], Path], sources: dict
                    ) -> tuple[dict[tuple[str, str], str], list[str]]:
    """{(student, lab): nearest column} for every submission in `found`; notes on the
    references (labs without a REFERENCE table), on a lab not compared, and the time taken.
    A failure here is ours, never the student's: that lab's column stays empty."""
    start, columns, notes = time.perf_counter(), {}, []
    for lab in sorted({lab for _, lab in found}):
        notebooks = {s: path for (s, lab_), path in found.items() if lab_ == lab}
        try:
            by_student, note = lab_columns(root, lab, sources[lab], notebooks)
        except Exception as e:  # a hint lost, not a grade: say so, go on
            by_student, note = {}, f"{lab}: not compared ({type(e).__name__}: {e})"
        notes += [note] if note else []
        columns.update({(s, lab): column for s, column in by_student.items()})
    notes.append(f"compared {len(found)} submission(s) with their lab's reference and "
                 f"each other in {time.perf_counter() - start:.1f} s")
    return columns, notes


def column_score(column: str) -> float:
    """The score in a `nearest` column ("student alice 0.71" -> 0.71); 0 for "" or another."""
    try:
        return float(column.rsplit(" ", 1)[-1])
    except ValueError:
        return 0.0


def summary(rows: list, notes: list[str]) -> str:
    """For the console: the notes, then each row whose nearest source scores FLAG_AT or more."""
    high = [r for r in rows if column_score(r.nearest) >= FLAG_AT]
    lines = [f"similarity: {n}" for n in notes]
    lines.append(f"nearest source at {FLAG_AT:g} or more (a hint to read the code, never a "
                 f"verdict; grades.csv's `nearest` has every row):" + ("" if high else " none"))
    lines += [f"  {printable(r.student)} {r.lab}: {r.nearest}" for r in high]
    return "\n".join(lines)
