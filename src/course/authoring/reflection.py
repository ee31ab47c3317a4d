"""One list of reflection questions per lab: the notebook's, copied into the guide.

The questions live in the solution's `### Reflection` markdown cell, where the
instructor-tagged sample answers below it are numbered to match. `python -m course build`
copies them into the guide's block

    ## Reflection questions

    <!-- reflection:NN-name -->
    1. ...
    <!-- /reflection -->

and `build --check` (and tests/course/test_course_text.py) fails while a guide differs.
"""

from __future__ import annotations

import re
from pathlib import Path

import jupytext

from labkit.atomic import atomic_write_text

HEADING = re.compile(r"^#+ Reflection[^\n]*\n", re.MULTILINE)
BLOCK = re.compile(r"<!-- reflection:(?P<lab>[\w.-]+) -->\n.*?<!-- /reflection -->",
                   re.DOTALL)


def questions(solution: Path) -> str:
    """The markdown after the `Reflection` heading of the solution's reflection cell."""
    nb = jupytext.read(solution, fmt="py:percent")
    for cell in nb.cells:
        if cell.cell_type == "markdown" and (m := HEADING.search(cell.source)):
            return cell.source[m.end():].strip()
    raise ValueError(f"{solution.name}: no markdown cell with a Reflection heading")


def fill(text: str, lab: str, body: str) -> str:
    return BLOCK.sub(lambda m: (f"<!-- reflection:{lab} -->\n{body}\n<!-- /reflection -->"
                                if m["lab"] == lab else m.group(0)), text)


def guide(root: Path, lab: str) -> Path:
    return root / "labs" / lab / "README.md"


def stale(root: Path, labs: list[str]) -> list[str]:
    """Guides whose reflection block is missing or differs from the notebook's questions."""
    out = []
    for lab in labs:
        text = guide(root, lab).read_text(encoding="utf-8")
        body = questions(root / "solutions" / f"{lab}.py")
        if not BLOCK.search(text) or fill(text, lab, body) != text:
            out.append(str(guide(root, lab).relative_to(root)))
    return out


def write(root: Path, labs: list[str]) -> list[str]:
    """Refill each guide's block from its notebook; the guides changed."""
    changed = []
    for lab in labs:
        path = guide(root, lab)
        text = path.read_text(encoding="utf-8")
        if (new := fill(text, lab, questions(root / "solutions" / f"{lab}.py"))) != text:
            atomic_write_text(path, new)
            changed.append(str(path.relative_to(root)))
    return changed
