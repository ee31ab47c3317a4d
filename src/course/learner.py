"""A learner's own copies of the lab notebooks: work/NN-name.ipynb.

labs/NN-name/NN-name.ipynb is the blank release that the course build (`make course`)
regenerates; a learner never works in it. `make lab` copies each release to work/ (ignored
by git) the first time, and never touches a copy that exists: from then on it is the
learner's. `make check LAB=NN-name` runs the copy in work/. Beside the copies, work/START.md
(written when absent, like them) lists each lab with its notebook and its guide: JupyterLab
opens on it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

WORK = "work"
START = "START.md"


def released_labs(root: Path) -> list[str]:
    """Labs a learner has: labs/NN-name/NN-name.ipynb (solutions/ may be private)."""
    return sorted(p.stem for p in (root / "labs").glob("[0-9][0-9]-*/*.ipynb")
                  if p.stem == p.parent.name)


def release_notebook_path(root: Path, lab: str) -> Path:
    """The blank release of `lab`, as the course build writes it."""
    return root / "labs" / lab / f"{lab}.ipynb"


def work_copy(root: Path, lab: str) -> Path:
    """Where the learner's own copy of `lab` lives."""
    return root / WORK / f"{lab}.ipynb"


def copy_if_absent(source: Path, target: Path) -> bool:
    """Copy `source` to a new file `target`; False (and no write) if `target` exists.

    The bytes go to a temporary file first, which is then hard-linked to `target`: the link
    fails if `target` exists (even one created a moment ago by another process), and a
    learner never finds a half-written copy.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.copyfile(source, tmp)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def start_page(root: Path) -> str:
    """work/START.md: each released lab, its title (its guide's first heading), a link to
    the learner's notebook and one to the guide, and how to check a lab."""
    lines = ["# Start here", "",
             "Each lab is a notebook to fill in (yours, in this folder) and a guide to read "
             "beside it. Work through them in order; `make check LAB=NN-name` runs a lab's "
             "visible tests, and saves your pieces for the capstone.", "",
             "| lab | your notebook | guide |", "|---|---|---|"]
    for lab in released_labs(root):
        guide = root / "labs" / lab / "README.md"
        title = next((line.lstrip("# ").strip() for line in guide.read_text(
            encoding="utf-8").splitlines() if line.startswith("# ")), lab) \
            if guide.is_file() else lab
        lines.append(f"| {title.replace('|', '/')} | [{lab}.ipynb]({lab}.ipynb) | "
                     f"[README](../labs/{lab}/README.md) |")
    return "\n".join(lines) + "\n"


def make_work_copies(root: Path) -> list[Path]:
    """Give every released lab a copy in work/ if it has none, and work/START.md if it is
    missing; return the copies made."""
    root = root.resolve()
    made = [work_copy(root, lab) for lab in released_labs(root)
            if copy_if_absent(release_notebook_path(root, lab), work_copy(root, lab))]
    start = root / WORK / START
    if not start.exists():
        tmp = start.parent / f".{START}.{os.getpid()}.page"
        tmp.write_text(start_page(root), encoding="utf-8")
        copy_if_absent(tmp, start)
        tmp.unlink()
    return made


def report_work_copies(root: Path, created: list[Path]) -> None:
    """Say which copies were made and where the learner's notebooks are."""
    root = root.resolve()
    for path in created:
        print(f"created {path.relative_to(root)} from the blank release "
              f"labs/{path.stem}/{path.name}")
    print(f"your notebooks are in {root / WORK}/ "
          f"({'new copies above; ' if created else ''}existing copies are never overwritten)")


def notebook_to_check(root: Path, lab: str) -> Path:
    """The learner's copy of `lab` in work/, or the blank release if there is none yet."""
    mine = work_copy(root, lab)
    return mine if mine.is_file() else release_notebook_path(root, lab)
