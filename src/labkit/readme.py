"""The generated blocks of the course's documents: every number of RESULTS.md, and the
reproduce table of experiments/README.md, made from the manifests.

DOCS names the documents filled (README.md too, should a block ever stand there); each one
that exists is read. A block runs from an opening marker line to `END`, and only its body is
ever rewritten:
- `marker("NN-name")` opens a block whose body is `readme(manifest)` of
  `experiments/NN-name/summary.py`, given that experiment's verified manifest;
- `TABLE_MARKER` opens the reproduce table, which labkit makes itself: one row per experiment
  folder with a manifest (its recorded run time, threads, numerical mode, commit, peak memory);
- `gpu_marker(part)` opens a block of the GPU benchmarks: `readme(part, results)` of
  `benchmarks/summary.py`, given every result `make bench-gpu` wrote to
  `benchmarks/results/gpu/` (verified manifests, newest first; none: not yet run on a GPU);
- `COMPILE_MARKER` opens the compile report's block: `compile_readme(records, roofline)` of
  `benchmarks/summary.py`, given benchmarks/results/compile_report.json and roofline.json
  (which `make compile-report` writes and a test holds to what the compiler makes);
- `CPU_MARKER` opens the CPU benchmark's block: `cpu_readme(path, manifest)` of
  `benchmarks/summary.py`, given the verified manifest `make bench-cpu` wrote.

A relative link in a body is written from the root of the checkout; in a document below the
root (experiments/README.md) it is rewritten to open the same file from there.

`python -m labkit readme` rewrites every document of DOCS that is out of date; with `--check`
it only names those that no longer match the manifests, so a hand-typed number cannot survive
the next re-run unnoticed. Part of labkit: stdlib and labkit only.
"""

from __future__ import annotations

import json
import posixpath
import re
import textwrap
from pathlib import Path

from .atomic import atomic_write_text
from .errors import InputError
from .experiment import load_script
from .manifest import read_manifest
from .numerics import DEFAULT_THREADS

# The documents whose generated blocks are filled (from the root of the checkout), in order.
DOCS = ("README.md", "RESULTS.md", "experiments/README.md")
COMMAND = "`python -m labkit readme`"
END = "<!-- end generated -->"
TABLE_MARKER = ("<!-- generated from experiments/*/manifest.json by "
                f"{COMMAND}: the reproduce table -->")
GPU_RESULTS = "benchmarks/results/gpu"
GPU_SUMMARY = "benchmarks/summary.py"
COMPILE_REPORT = "benchmarks/results/compile_report.json"    # and roofline.json beside it
COMPILE_MARKER = (f"<!-- generated from {COMPILE_REPORT} by {COMMAND}; edit {GPU_SUMMARY}, "
                  "not this block -->")
CPU_RESULT = "benchmarks/results/cpu.json"                    # `make bench-cpu`
CPU_MARKER = (f"<!-- generated from {CPU_RESULT} by {COMMAND}; edit {GPU_SUMMARY}, "
              "not this block -->")
# The documents' prose is wrapped at this width; generated paragraphs follow it.
WIDTH = 92
_OPENING = "<!-- generated from "
_LINK = re.compile(r"\[[^\]]*\]\([^)]*\)")
# A link's target that is a path from the root: no scheme, not an anchor, not absolute.
_TARGET = re.compile(r"\]\((?![a-zA-Z][\w+.-]*:|[#/])([^)\s#]+)")
_EXPERIMENT_MARKER = re.compile(r"<!-- generated from experiments/(?P<name>[^/*]+)/manifest\.json "
                                + re.escape(f"by {COMMAND}; edit summary.py, not this block -->"))
_GPU_MARKER = re.compile(re.escape(f"<!-- generated from the newest {GPU_RESULTS}/*.json by "
                                   f"{COMMAND}; edit {GPU_SUMMARY}, not this block: ")
                         + r"(?P<part>[a-z-]+) -->")


def marker(name: str) -> str:
    """The line that opens the block of experiment `name` (a folder under experiments/)."""
    return (f"<!-- generated from experiments/{name}/manifest.json by {COMMAND}; "
            "edit summary.py, not this block -->")


def gpu_marker(part: str) -> str:
    """The line that opens block `part` of the GPU benchmark results (one of summary's PARTS)."""
    return (f"<!-- generated from the newest {GPU_RESULTS}/*.json by {COMMAND}; "
            f"edit {GPU_SUMMARY}, not this block: {part} -->")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, for the summary.py files and the reproduce table."""
    lines = ["| " + " | ".join(cells) + " |" for cells in (header, *rows)]
    return "\n".join([lines[0], "|" + "---|" * len(header), *lines[1:]])


def paragraph(text: str, indent: str = "") -> str:
    """`text` wrapped like the documents' prose; `indent` starts every line after the first (two
    spaces under a list item). Words and links are never split."""
    # A link's text is kept on one line (NUL stands for its spaces while wrapping).
    kept = _LINK.sub(lambda link: link[0].replace(" ", "\0"), text)
    return textwrap.fill(kept, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False).replace("\0", " ")


def prose(markdown: str) -> str:
    """`markdown` with each paragraph and list item wrapped by `paragraph` (the text of a
    report written as tables plus fixed text); headings, tables and images are kept as they
    are. Paragraphs are separated by a blank line; a list item starts a line with "- "."""
    blocks = []
    for block in markdown.strip("\n").split("\n\n"):
        if block.startswith(("#", "|", "!")):
            blocks.append(block)
            continue
        items = re.split(r"\n(?=- )", block)
        blocks.append("\n".join(paragraph(" ".join(item.split()),
                                          "  " if item.startswith("- ") else "")
                                for item in items))
    return "\n\n".join(blocks) + "\n"


def _where(doc: str, number: int) -> str:
    return f"{doc} line {number}"


def _opened(line: str, number: int, doc: str) -> str | None:
    """What a line opens: an experiment's name, "*" for the reproduce table, GPU_RESULTS/part
    for a block of the GPU benchmarks (no experiment's name holds a "/"), or None."""
    text = line.strip()
    if text == TABLE_MARKER:
        return "*"
    if text == COMPILE_MARKER:
        return COMPILE_REPORT
    if text == CPU_MARKER:
        return CPU_RESULT
    found = _EXPERIMENT_MARKER.fullmatch(text)
    if found:
        return found["name"]
    found = _GPU_MARKER.fullmatch(text)
    if found:
        return f"{GPU_RESULTS}/{found['part']}"
    if text.startswith(_OPENING):
        raise InputError(f"{_where(doc, number)}: unrecognised marker {text!r}; expected "
                         f"{marker('NN-name')!r}, {gpu_marker('part')!r}, {COMPILE_MARKER!r}, "
                         f"{CPU_MARKER!r} or {TABLE_MARKER!r}")
    return None


def _blocks(lines: list[str], doc: str) -> list[tuple[int, int, str]]:
    """(index of the opening line, index of its END line, what it opened), in order."""
    blocks, start, opened = [], None, None
    for i, line in enumerate(lines):
        what = _opened(line, i + 1, doc)
        if what is not None and start is not None:
            raise InputError(f"{_where(doc, start + 1)}: block has no {END!r} before the next "
                             f"marker on line {i + 1}")
        if what is not None:
            start, opened = i, what
        elif line.strip() == END:
            if start is None:
                raise InputError(f"{_where(doc, i + 1)}: {END!r} closes no block (no marker line "
                                 "opens one above it)")
            blocks.append((start, i, opened))
            start = None
    if start is not None:
        raise InputError(f"{_where(doc, start + 1)}: block has no {END!r} after it")
    return blocks


def load_summary(exp_dir: Path, where: str):
    """An experiment's summary.py, loaded from its path (it is not a package module)."""
    script = exp_dir / "summary.py"
    if not exp_dir.is_dir():
        raise InputError(f"{where}: no experiment folder {exp_dir}")
    if not script.is_file():
        raise InputError(f"{where}: {exp_dir} has no summary.py (expected one defining "
                         "readme(manifest) -> str)")
    module = load_script(script, f"summary_{exp_dir.name}")
    if not callable(getattr(module, "readme", None)):
        raise InputError(f"{where}: {script} must define readme(manifest) -> str")
    return module


def _manifest(exp_dir: Path, where: str) -> dict:
    try:
        return read_manifest(exp_dir / "manifest.json")
    except InputError as e:
        raise InputError(f"{where}: {e}") from None


def experiment_body(root: Path, name: str, where: str = "RESULTS.md") -> str:
    """The body of experiment `name`'s block: its summary.py's readme(manifest)."""
    exp_dir = Path(root) / "experiments" / name
    summary = load_summary(exp_dir, where)
    return _markdown(summary.readme(_manifest(exp_dir, where)), exp_dir / "summary.py", where)


def _markdown(body, script: Path, where: str) -> str:
    if not isinstance(body, str):
        raise InputError(f"{where}: {script} readme() returned {type(body).__name__}, expected "
                         "the markdown as a str")
    return body


def gpu_results(root: Path, where: str = "RESULTS.md") -> list[tuple[str, dict]]:
    """(path from the root, verified manifest) of every result under GPU_RESULTS, newest
    first; a --tiny or CPU run there is refused, never shown as a GPU's numbers."""
    found = []
    for path in sorted((Path(root) / GPU_RESULTS).glob("*.json")):
        name = f"{GPU_RESULTS}/{path.name}"
        try:
            m = read_manifest(path)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        if m["config"].get("tiny") or m["env"].get("device", "cpu") == "cpu":
            raise InputError(f"{where}: {name} is a --tiny or CPU run, not a GPU's result; "
                             f"it does not belong in {GPU_RESULTS}/")
        found.append((name, m))
    return sorted(found, key=lambda item: item[1].get("recorded_at", ""), reverse=True)


def gpu_body(root: Path, part: str, where: str = "RESULTS.md") -> str:
    """The body of GPU block `part`: GPU_SUMMARY's readme(part, gpu_results(root))."""
    script = Path(root) / GPU_SUMMARY
    if not script.is_file():
        raise InputError(f"{where}: no {GPU_SUMMARY} (expected one defining PARTS and "
                         "readme(part, results) -> str)")
    summary = load_script(script, "benchmarks_summary")
    if part not in getattr(summary, "PARTS", ()):
        raise InputError(f"{where}: {GPU_SUMMARY} makes no block {part!r} (its PARTS: "
                         f"{getattr(summary, 'PARTS', ())})")
    return _markdown(summary.readme(part, gpu_results(root, where)), script, where)


def compile_body(root: Path, where: str = "RESULTS.md") -> str:
    """The compile report's block: GPU_SUMMARY's compile_readme(records, roofline)."""
    paths = [Path(root) / COMPILE_REPORT, (Path(root) / COMPILE_REPORT).with_name("roofline.json")]
    try:
        records, roofline = (json.loads(p.read_text(encoding="utf-8")) for p in paths)
    except (OSError, ValueError) as e:
        raise InputError(f"{where}: cannot read the compile report ({e}); run "
                         "`make compile-report`") from None
    script = Path(root) / GPU_SUMMARY
    summary = load_script(script, "benchmarks_summary")
    return _markdown(summary.compile_readme(records, roofline), script, where)


def cpu_body(root: Path, where: str = "RESULTS.md") -> str:
    """The CPU benchmark's block: GPU_SUMMARY's cpu_readme(name, manifest) of CPU_RESULT."""
    try:
        manifest = read_manifest(Path(root) / CPU_RESULT)
    except InputError as e:
        raise InputError(f"{where}: {e}; run `make bench-cpu`") from None
    script = Path(root) / GPU_SUMMARY
    summary = load_script(script, "benchmarks_summary")
    return _markdown(summary.cpu_readme(CPU_RESULT, manifest), script, where)


def duration(seconds: float) -> str:
    """A run time as a reader takes it in: "95 s" under two minutes, else "13.2 min"."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def reproduce_table(root: Path) -> str:
    """One row per experiment folder with a manifest: the run a reproduce is compared with."""
    rows = []
    for manifest_path in sorted(Path(root).glob("experiments/*/manifest.json")):
        name = manifest_path.parent.name
        m = _manifest(manifest_path.parent, f"the reproduce table, experiments/{name}")
        rows.append([f"[{name}](experiments/{name}/REPORT.md)",
                     duration(m["wall_time_s"]),
                     str(m["config"].get("threads", DEFAULT_THREADS)),
                     m["env"].get("numerics", {}).get("mode", "not recorded"),
                     f"`{m['git']['commit'][:7]}`",
                     f"{m['peak_memory_mb']:.0f} MB"])
    return table(["experiment", "recorded run", "threads", "numerics", "commit", "peak memory"],
                 rows)


def _body(root: Path, opened: str, where: str) -> str:
    if opened == "*":
        return reproduce_table(root)
    if opened.startswith(f"{GPU_RESULTS}/"):
        return gpu_body(root, opened.removeprefix(f"{GPU_RESULTS}/"), where)
    if opened == COMPILE_REPORT:
        return compile_body(root, where)
    if opened == CPU_RESULT:
        return cpu_body(root, where)
    return experiment_body(root, opened, where)


def relink(body: str, doc: str) -> str:
    """`body`, whose relative links are paths from the root, with each rewritten to open the
    same file from `doc`'s folder (unchanged for a document at the root)."""
    folder = posixpath.dirname(doc)
    if not folder:
        return body
    return _TARGET.sub(lambda m: "](" + posixpath.relpath(m[1], folder), body)


def render_text(text: str, root: Path, doc: str = "README.md") -> str:
    """`text` (the document `doc`, a path from the root) with the body of every generated
    block made afresh."""
    lines = text.splitlines(keepends=True)
    out, done = [], 0
    for start, end, opened in _blocks(lines, doc):
        body = relink(_body(root, opened, _where(doc, start + 1)), doc)
        # Blank lines around the body: a marker is an HTML block, and a table or paragraph
        # right after it would be swallowed into that block by some renderers.
        out += lines[done:start + 1] + ["\n", body.strip("\n") + "\n", "\n"]
        done = end
    return "".join(out + lines[done:])


def render(root: Path, doc: str = "README.md") -> str:
    """Document `doc` under `root` with every generated block filled from the manifests."""
    path = Path(root) / doc
    if not path.is_file():
        raise InputError(f"no {doc} in {root}")
    return render_text(path.read_text(encoding="utf-8"), Path(root), doc)


def docs(root: Path) -> list[str]:
    """The documents of DOCS that exist under `root` (at least one must)."""
    found = [doc for doc in DOCS if (Path(root) / doc).is_file()]
    if not found:
        raise InputError(f"none of {', '.join(DOCS)} in {root}")
    return found


def write_docs(root: Path, check: bool = False) -> list[str]:
    """The documents (of DOCS, under `root`) that did not match the manifests. Without
    `check` each of them is rewritten (atomically), and only once every document has been
    made afresh, so a refused block leaves all of them as they were; with it, nothing is
    written."""
    fresh = {doc: render(root, doc) for doc in docs(root)}
    stale = [doc for doc, text in fresh.items()
             if (Path(root) / doc).read_text(encoding="utf-8") != text]
    if not check:
        for doc in stale:
            atomic_write_text(Path(root) / doc, fresh[doc])
    return stale


def write_readme(root: Path, check: bool = False) -> bool:
    """Whether every document of DOCS under `root` already matched the manifests (see
    `write_docs`: without `check`, those that did not are rewritten)."""
    return not write_docs(root, check)
