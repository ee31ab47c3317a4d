"""The design documents hold to the code: docs/ARCHITECTURE.md's sections exist where the code
cites them, and every public name a package's BLUEPRINT.md lists exists.

A citation is `docs/ARCHITECTURE.md` followed by a comma, a space and a heading of that file,
word for word, on one line, and then punctuation, the end of the line, or a space and a
non-letter (as in "NF4 (8 digits)"). A BLUEPRINT.md table has a column headed `name`; each
backticked span in it is a dotted name, read up to its first "(", resolved from the package:
attribute by attribute, importing a submodule where an attribute is missing
(`minimoe.reference`, `NF4Experts.from_weight`, `hf.moe_from_hf`).
"""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
BLUEPRINTS = sorted(SRC.glob("*/BLUEPRINT.md"))
PACKAGES = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
TEXT = (".py", ".md", ".ipynb", ".toml", ".txt", ".cfg", ".yml", ".yaml")
SKIP_DIRS = {".git", ".venv", "build", "work", "__pycache__", "node_modules"}
# The design document that is not in this repository, as cited before ARCHITECTURE.md was.
RETIRED = re.compile("DESIGN" + r"(\.md)? §")
CITATION = re.compile(r"ARCHITECTURE\.md, (?=[A-Za-z])")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
CELLS = re.compile(r"(?<!\\)\|")
MAX_ROW = 300


def text_files() -> list[Path]:
    """The tracked text files (git ls-files), or every text file outside SKIP_DIRS."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                             check=True).stdout.decode()
        files = [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.rglob("*")
                 if not SKIP_DIRS & set(p.relative_to(ROOT).parts[:-1])]
    return [p for p in files if p.suffix in TEXT and p.is_file()]


def headings(markdown: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{2,4} (.+)$", markdown, re.MULTILINE)}


def cited_section_problems(text: str, sections: set[str], where: str) -> list[str]:
    """`where:line: ...` for each citation whose section is not a heading (see the module doc)."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in CITATION.finditer(line):
            rest = line[m.end():]
            if not any(rest.startswith(s) and _ends(rest[len(s):]) for s in sections):
                problems.append(f"{where}:{number}: cites ARCHITECTURE.md section "
                                f"{rest[:40]!r}..., which is no heading of {ARCHITECTURE.name} "
                                "(the name must follow the comma word for word, on one line)")
    return problems


def _ends(after: str) -> bool:
    """What may follow a cited section name: the end, punctuation, or a space and a non-letter."""
    if not after or not (after[0].isalnum() or after[0] in " -_"):
        return True
    return after[0] == " " and (len(after) == 1 or not after[1].isalnum())


def test_no_file_cites_the_retired_design_document():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}"
             for p in text_files() for n, line in enumerate(_read(p).splitlines(), 1)
             if RETIRED.search(line)]
    assert found == [], ("these cite a design document that is not in the repository; cite "
                         "the section of docs/ARCHITECTURE.md instead:\n" + "\n".join(found))


def test_every_architecture_citation_names_a_heading():
    sections = headings(ARCHITECTURE.read_text(encoding="utf-8"))
    assert {"Layers", "Numerical design"} <= sections, f"headings of {ARCHITECTURE}: {sections}"
    problems = [problem for p in text_files()
                for problem in cited_section_problems(_read(p), sections, str(p.relative_to(ROOT)))]
    assert problems == [], "\n".join(problems)


def test_the_citation_check_catches_a_wrong_section():
    sections = {"NF4", "Sorted routing", "Expert LoRA"}
    at = "ARCHITECTURE" + ".md, "          # split, so that this file cites nothing itself
    good = (f"x  # docs/{at}NF4 (8 digits)\n(docs/{at}Sorted routing)\n{at}Expert LoRA:\n"
            f"as \"{at}<Section>\" (a placeholder)")
    assert cited_section_problems(good, sections, "f.py") == []
    bad = f"see docs/{at}Sorted routng.\nsee {at}Expert LoRAs here"
    assert [p.split(":")[1] for p in cited_section_problems(bad, sections, "f.py")] == ["1", "2"]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# ------------------------------------------------------------------------------ blueprints


def table_rows(markdown: str):
    """(line number, row text, name cell) of every body row of every table with a `name`
    column."""
    lines, column = markdown.splitlines(), None
    for number, line in enumerate(lines, 1):
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in CELLS.split(line)[1:-1]]
        following = lines[number] if number < len(lines) else ""
        if column is None and following.startswith("|") and set(following) <= set("|-: "):
            column = cells.index("name") if "name" in cells else None
        elif column is not None and not set(line) <= set("|-: "):
            yield number, line, cells[column] if column < len(cells) else ""


def resolve(package: str, dotted: str) -> str | None:
    """None when `package`'s `dotted` name exists, else why not."""
    obj: object = importlib.import_module(package)
    parts = dotted.split(".")
    if not hasattr(obj, parts[0]) and parts[0] in PACKAGES and len(parts) > 1:
        obj, parts = importlib.import_module(parts[0]), parts[1:]     # another package's name
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if isinstance(obj, ModuleType):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
                continue
            except ModuleNotFoundError as e:
                if e.name != f"{obj.__name__}.{part}":
                    raise
        owner = getattr(obj, "__name__", type(obj).__name__)
        return f"{owner} has no {part!r}" + (f" (after {'.'.join(parts[:i])})" if i else "")
    return None


def blueprint_problems(markdown: str, package: str, where: str) -> list[str]:
    """`where:line: ...` for each name-column entry that is not a name of `package`, and each
    row without one."""
    problems = []
    for number, row, cell in table_rows(markdown):
        spans = re.findall(r"`([^`]+)`", cell)
        if not spans:
            problems.append(f"{where}:{number}: no `name` in the name column: {row[:80]}")
        for span in spans:
            name = span.split("(")[0].strip()
            if not NAME.fullmatch(name):
                problems.append(f"{where}:{number}: `{span[:40]}` is not a dotted name")
            elif why := resolve(package, name):
                problems.append(f"{where}:{number}: `{name}` is listed but does not exist "
                                f"({why}); row: {row[:100]}")
    return problems


@pytest.mark.parametrize("blueprint", BLUEPRINTS, ids=lambda p: p.parent.name)
def test_every_listed_name_exists(blueprint):
    rows = list(table_rows(blueprint.read_text(encoding="utf-8")))
    assert rows, f"{blueprint.relative_to(ROOT)} has no table with a `name` column"
    problems = blueprint_problems(blueprint.read_text(encoding="utf-8"), blueprint.parent.name,
                                  str(blueprint.relative_to(ROOT)))
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("blueprint", BLUEPRINTS, ids=lambda p: p.parent.name)
def test_rows_stay_short(blueprint):
    """A BLUEPRINT.md is a map: one line of what per name; the detail is in the docstrings."""
    long = [f"{blueprint.relative_to(ROOT)}:{n}: {len(line)} characters"
            for n, line in enumerate(blueprint.read_text(encoding="utf-8").splitlines(), 1)
            if line.startswith("|") and len(line) > MAX_ROW]
    assert long == [], f"table rows over {MAX_ROW} characters:\n" + "\n".join(long)


def test_every_package_has_a_blueprint():
    assert sorted(p.parent.name for p in BLUEPRINTS) == sorted(set(PACKAGES) - {"gpucompile"})


def test_the_blueprint_check_catches_a_missing_name():
    table = ("| file | name | what |\n|---|---|---|\n"
             "| `a.py` | `parallel_linear(x, W, routing)`, `reference.linear_loop` | fine |\n"
             "| | `NF4Experts.from_weight(W)` | fine |\n"
             "| | `NF4Experts.from_weights(W)` | a typo |\n"
             "| | `reference.no_such_loop` | gone |\n"
             "| | `hf.moe_from_hf(block)`, `miniquant.nf4_bytes` | a submodule; another package |\n"
             "| | no backticks | no name |\n\n"
             "| not | a | name table |\n|---|---|---|\n| `x` | `nothing` | checked |\n")
    problems = blueprint_problems(table, "minimoe", "BLUEPRINT.md")
    assert [p.split(":")[1] for p in problems] == ["5", "6", "8"], problems
    assert "`NF4Experts.from_weights` is listed but does not exist" in problems[0]
    assert "minimoe.reference has no 'no_such_loop'" in problems[1]
