"""Prove the tests catch the mistakes learners make, and say why: `make check-mistakes`.

`solutions/mistakes/NN-name.toml` lists, for every exercise of a lab, plausible wrong
versions of its solution, each a small patch of the solution region:

    [[mistake]]
    exercise = "group_advantages"          # grade_id of the exercise's solution cell
    name = "population std (divide by G)"  # what the learner did, in a few words
    rule = "Bessel"                        # words the failing visible test's message holds
    find = "/ (G - 1)"                     # text inside the cell's solution regions, once
    replace = "/ G"

A mistake the visible tests cannot catch by design carries `left = "why"`; the guide shows it.
Each mistake is applied alone to the solution notebook, which then runs in a fresh kernel
from the top through the exercise's own test cells (the graded cells after its solution cell,
before the next solution cell). The verdict:

    visible   a visible test fails and its message names the rule (contains `rule`,
              ignoring case): what every mistake should get
    unnamed   a visible test fails, but no failing message names the rule
    hidden    the visible tests pass and a hidden test fails
    missed    every test passes

A mistake not caught by a visible test is run again with the hidden tests to tell `hidden`
from `missed`. `--write` records a lab's verdicts in labs/NN-name/mistakes.json and refills
each guide's block `<!-- mistakes:NN-name -->...<!-- /mistakes -->` and the summary in
labs/INSTRUCTORS.md (`<!-- mistakes:summary -->`) from the recorded files; `--fill` only
refills.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat

from labkit.atomic import atomic_write_text
from labkit.errors import InputError

from .build import jupyter_only, lab_names, source_notebook
from .exercises import REGION, error_of

CATALOGUE = Path("solutions") / "mistakes"
TABLE = "mistakes.json"         # labs/NN-name/mistakes.json: the lab's recorded verdicts
MIN_PER_EXERCISE = 3
VERDICTS = ("visible", "unnamed", "hidden", "missed")
HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS\n.*?^[ \t]*### END HIDDEN TESTS[ \t]*$\n?",
                    re.MULTILINE | re.DOTALL)
FIELDS = ("exercise", "name", "rule", "find", "replace")
OPTIONAL = ("left",)     # why a mistake is left to the hidden tests (or missed); shown in guides
BLOCK = re.compile(r"<!-- mistakes:(?P<lab>[\w.-]+) -->\n.*?<!-- /mistakes -->", re.DOTALL)


@dataclass(frozen=True)
class Mistake:
    lab: str
    exercise: str
    name: str
    rule: str
    find: str
    replace: str
    left: str = ""


def load(root: Path, lab: str) -> list[Mistake]:
    """The lab's catalogue; InputError naming the file and entry when an entry is malformed."""
    path = root / CATALOGUE / f"{lab}.toml"
    if not path.is_file():
        raise InputError(f"{path.relative_to(root)}: no mistakes catalogue for {lab}")
    try:
        entries = tomllib.loads(path.read_text(encoding="utf-8")).get("mistake", [])
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path.relative_to(root)}: not valid TOML ({e})") from e
    out = []
    for k, entry in enumerate(entries, start=1):
        missing = [f for f in FIELDS if not isinstance(entry.get(f), str) or
                   (f != "replace" and not entry[f].strip())]
        extra = sorted(set(entry) - set(FIELDS) - set(OPTIONAL))
        if missing or extra:
            raise InputError(f"{path.relative_to(root)}: mistake {k} "
                             f"({entry.get('name', '?')!r}) needs the strings {list(FIELDS)}"
                             + (f"; missing or empty: {missing}" if missing else "")
                             + (f"; unknown keys: {extra}" if extra else ""))
        out.append(Mistake(lab=lab, left=str(entry.get("left", "")),
                           **{f: entry[f] for f in FIELDS}))
    return out


def exercises(nb: nbformat.NotebookNode) -> dict[str, int]:
    """{grade_id: cell index} of the solution cells (the exercises), in notebook order."""
    return {c.metadata["nbgrader"]["grade_id"]: i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")}


def apply(nb: nbformat.NotebookNode, mistake: Mistake) -> tuple[nbformat.NotebookNode, int]:
    """A copy of `nb` with the mistake made, and the index of the last cell to run (the
    exercise's last test cell). ValueError when the patch does not apply exactly once inside
    the cell's solution regions."""
    cells = exercises(nb)
    if mistake.exercise not in cells:
        raise ValueError(f"{mistake.lab}: mistake {mistake.name!r} names exercise "
                         f"{mistake.exercise!r}; the lab's exercises are {list(cells)}")
    i = cells[mistake.exercise]
    src = nb.cells[i].source
    hits = [(m, k) for m in REGION.finditer(src)
            for k in _occurrences(m.group(0), mistake.find)]
    if len(hits) != 1:
        raise ValueError(f"{mistake.lab}: mistake {mistake.name!r}: `find` occurs {len(hits)} "
                         f"times inside the solution regions of {mistake.exercise!r} "
                         "(it must occur exactly once)")
    m, k = hits[0]
    at = m.start() + k
    nb = nbformat.from_dict(nb)
    nb.cells[i].source = src[:at] + mistake.replace + src[at + len(mistake.find):]
    later = [j for j in cells.values() if j > i]
    tests = [j for j in range(i + 1, later[0] if later else len(nb.cells))
             if nb.cells[j].metadata.get("nbgrader", {}).get("grade")]
    if not tests:
        raise ValueError(f"{mistake.lab}: exercise {mistake.exercise!r} has no test cell "
                         "before the next exercise")
    return nb, tests[-1]


def _occurrences(text: str, find: str) -> list[int]:
    out, at = [], text.find(find)
    while at >= 0:
        out.append(at)
        at = text.find(find, at + 1)
    return out


def run_through(nb: nbformat.NotebookNode, last: int, cwd: Path, hidden: bool,
                timeout: int) -> dict[str, str | None]:
    """Run cells 0..last in a fresh kernel; {grade_id: 'ename: evalue' or None} of the test
    cells run. Without `hidden`, the hidden-test blocks are cut from the test cells first."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    from ..quiet import client_options

    nb = nbformat.from_dict(nb)
    nb.cells = [c for c in nb.cells[:last + 1] if not jupyter_only(c)]   # as when graded
    tests = [i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade")]
    if not hidden:
        for i in tests:
            nb.cells[i].source = HIDDEN.sub("", nb.cells[i].source)
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name="python3", resources={"metadata": {"path": str(cwd)}},
                            **client_options())
    died = None
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            try:
                client.execute_cell(cell, i)
            except DeadKernelError:         # a mistake that crashes the process: a failure
                died = i
                break
    return {nb.cells[i].metadata["nbgrader"]["grade_id"]:
            error_of(nb.cells[i]) if died is None or i < died
            else "DeadKernelError: the Python process crashed"
            + (" in this test" if i == died else " before this test ran") for i in tests}


@dataclass(frozen=True)
class Result:
    lab: str
    exercise: str
    name: str
    verdict: str
    test: str           # the test that caught it ("" when missed)
    message: str        # its first failing message, whole ("" when missed)
    left: str = ""      # the catalogue's reason, when it is left to the hidden tests


def judge(root: Path, mistake: Mistake, timeout: int = 300) -> Result:
    """Run one mistake; its verdict."""
    nb, last = apply(source_notebook(root / "solutions" / f"{mistake.lab}.py"), mistake)
    cwd = root / "labs" / mistake.lab
    failed = {k: v for k, v in run_through(nb, last, cwd, False, timeout).items() if v}
    named = {k: v for k, v in failed.items() if mistake.rule.lower() in v.lower()}
    if failed:
        test, message = next(iter((named or failed).items()))
        return Result(mistake.lab, mistake.exercise, mistake.name,
                      "visible" if named else "unnamed", test, message, mistake.left)
    failed = {k: v for k, v in run_through(nb, last, cwd, True, timeout).items() if v}
    test, message = next(iter(failed.items()), ("", ""))
    return Result(mistake.lab, mistake.exercise, mistake.name,
                  "hidden" if failed else "missed", test, message, mistake.left)


def problems(root: Path, lab: str) -> list[str]:
    """Catalogue entries that do not apply (checked without running anything)."""
    try:
        catalogue = load(root, lab)
    except InputError as e:
        return [str(e)]
    nb = source_notebook(root / "solutions" / f"{lab}.py")
    out = []
    for mistake in catalogue:
        try:
            apply(nb, mistake)
        except ValueError as e:
            out.append(str(e))
    return out


def shortfall(root: Path, lab: str) -> list[str]:
    """Exercises with fewer than MIN_PER_EXERCISE catalogued mistakes."""
    nb = source_notebook(root / "solutions" / f"{lab}.py")
    catalogue = load(root, lab) if (root / CATALOGUE / f"{lab}.toml").is_file() else []
    counts = {e: sum(m.exercise == e for m in catalogue) for e in exercises(nb)}
    return [f"{lab}: exercise {e!r} has {n} catalogued mistake(s); at least "
            f"{MIN_PER_EXERCISE} are needed" for e, n in counts.items() if n < MIN_PER_EXERCISE]


def _judge(args: tuple[Path, Mistake, int]) -> Result:
    return judge(*args)


def check_mistakes(root: Path, labs: list[str] | None = None, jobs: int = 1,
                   write: bool = False, timeout: int = 300, first: bool = False) -> bool:
    """Print a row per mistake; True when every one is caught by a visible test that names
    its rule. With `write`, record the verdicts and refill the guides' blocks; with `first`,
    run only the first mistake of each exercise (CI's sample; nothing is recorded)."""
    if write and first:
        raise InputError("--first runs a sample: it cannot --write a lab's record")
    from tqdm import tqdm

    root = root.resolve()
    known = lab_names(root)
    if unknown := sorted(set(labs or []) - set(known)):
        raise InputError(f"unknown lab(s) {unknown}; available: {known}")
    labs = labs or known
    if bad := [p for lab in labs for p in problems(root, lab)]:
        raise InputError("the mistakes catalogue does not apply:\n  " + "\n  ".join(bad))
    todo = [(root, m, timeout) for lab in labs for m in load(root, lab)]
    if first:                       # the first mistake of each exercise, in order
        exercises_seen: set[tuple[str, str]] = set()
        sample = []
        for job in todo:
            if (key := (job[1].lab, job[1].exercise)) not in exercises_seen:
                exercises_seen.add(key)
                sample.append(job)
        todo = sample
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(tqdm(pool.map(_judge, todo), total=len(todo), desc="mistakes",
                            unit="mistake", leave=False))
    for r in results:
        where = f" by {r.test}" if r.test else ""
        print(f"{r.lab:<24} {r.exercise:<22} {r.verdict.upper():<8} {r.name}{where}")
        if r.verdict != "visible" and r.message:
            print("".join(f"        {line}\n" for line in r.message.splitlines()), end="")
    for lab in labs:
        counts = {v: sum(r.lab == lab and r.verdict == v for r in results) for v in VERDICTS}
        print(f"{lab}: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    short = [] if first else [s for lab in labs for s in shortfall(root, lab)]
    print("".join(f"{s}\n" for s in short), end="")
    if write:
        record(root, results)
    return not short and all(r.verdict == "visible" or r.left for r in results)


def table_path(root: Path, lab: str) -> Path:
    return root / "labs" / lab / TABLE


def read_tables(root: Path) -> dict[str, list[dict]]:
    """{lab: rows} of every lab's recorded verdicts."""
    return {p.parent.name: json.loads(p.read_text())["mistakes"]
            for p in sorted(root.glob(f"labs/[0-9][0-9]-*/{TABLE}"))}


def record(root: Path, results: list[Result]) -> None:
    """Write each lab's verdicts to labs/NN-name/mistakes.json, then refill the blocks."""
    for lab in sorted({r.lab for r in results}):
        table = {"what": "each mistake of solutions/mistakes/" f"{lab}.toml applied alone to "
                 "the solution, and the test that caught it",
                 "command": f"python -m course check-mistakes --write {lab}",
                 "sources": sources_sha256(root, lab),
                 "mistakes": [asdict(r) for r in results if r.lab == lab]}
        atomic_write_text(table_path(root, lab), json.dumps(table, indent=1) + "\n")
    refill(root)


def sources_sha256(root: Path, lab: str) -> str:
    """What the verdicts depend on: the code cells a run goes through (with their metadata;
    not the text, which `make times` refills, nor the jupyter-only cells) and the catalogue."""
    nb = source_notebook(root / "solutions" / f"{lab}.py")
    code = [(c.metadata, c.source) for c in nb.cells
            if c.cell_type == "code" and not jupyter_only(c)]
    h = hashlib.sha256(repr(code).encode())
    h.update((root / CATALOGUE / f"{lab}.toml").read_bytes())
    return h.hexdigest()


def refill(root: Path) -> list[Path]:
    """Refill every guide's block and the summary from the recorded verdicts; the files
    changed."""
    tables, changed = read_tables(root), []
    for file in guide_files(root):
        text = file.read_text(encoding="utf-8")
        if (new := fill(text, tables)) != text:
            atomic_write_text(file, new)
            changed.append(file)
    return changed


def guide_files(root: Path) -> list[Path]:
    return [*sorted(root.glob("labs/[0-9][0-9]-*/README.md")), root / "labs" / "INSTRUCTORS.md"]


def render(lab: str, rows: list[dict]) -> str:
    """A guide's block: one line per verdict count, then the table of mistakes."""
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    lines = [f"{len(rows)} catalogued mistakes: {counts['visible']} caught by a visible test "
             f"that names the rule, {counts['unnamed']} caught without naming it, "
             f"{counts['hidden']} by a hidden test only, {counts['missed']} missed.", "",
             "| exercise | mistake | caught by |", "|---|---|---|"]
    for r in rows:
        by = {"visible": f"`{r['test']}`", "unnamed": f"`{r['test']}` (rule not named)",
              "hidden": f"`{r['test']}`, hidden cases only", "missed": "**nothing**"}
        why = f" ({r['left']})" if r.get("left") else ""
        lines.append(f"| `{r['exercise']}` | {r['name']} | {by[r['verdict']]}{why} |")
    return "\n".join(lines)


def render_summary(table: dict[str, list[dict]]) -> str:
    lines = ["| lab | mistakes | visible, rule named | visible, not named | hidden only | "
             "missed |", "|---|---|---|---|---|---|"]
    for lab, rows in sorted(table.items()):
        counts = [sum(r["verdict"] == v for r in rows) for v in VERDICTS]
        lines.append(f"| {lab} | {len(rows)} | " + " | ".join(map(str, counts)) + " |")
    return "\n".join(lines)


def fill(text: str, table: dict[str, list[dict]]) -> str:
    def sub(m: re.Match) -> str:
        lab = m["lab"]
        if lab == "summary":
            body = render_summary(table)
        elif lab in table:
            body = render(lab, table[lab])
        else:
            return m.group(0)
        return f"<!-- mistakes:{lab} -->\n{body}\n<!-- /mistakes -->"
    return BLOCK.sub(sub, text)


def stale_blocks(root: Path) -> list[str]:
    """Guide blocks that differ from the recorded verdicts (what the docs test holds)."""
    tables = read_tables(root)
    return [str(f.relative_to(root)) for f in guide_files(root)
            if (text := f.read_text(encoding="utf-8")) != fill(text, tables)]
