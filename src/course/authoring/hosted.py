"""The hosted path into each lab: its guide's "Open in Colab" link and its notebook's first cell.

Colab opens a lab's release notebook straight from the course's public repository
(`[project.urls] Repository` in pyproject.toml, the one place the address is written). That
notebook then needs the course's packages, so every lab source (solutions/NN-name.py) opens
with the same code cell, `colab_cell()`: on Colab only, it clones the course, runs
scripts/hosted.py (install what is missing, keep Colab's torch, raise triton to the floor)
and imports from the clone; anywhere else it does nothing. Tests hold every source, release
notebook and guide to the text written here.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

CLONE = "/content/miniqlora-moe-labs"


def repository(root: Path) -> str:
    """The course's public repository (pyproject.toml's [project.urls] Repository)."""
    meta = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    return meta["project"]["urls"]["Repository"].rstrip("/")


def colab_url(repo: str, lab: str, branch: str = "main") -> str:
    """Colab's address of a lab's release notebook in a GitHub repository."""
    path = repo.removeprefix("https://github.com/")
    return (f"https://colab.research.google.com/github/{path}/blob/{branch}/labs/{lab}/"
            f"{lab}.ipynb")


def colab_badge(repo: str, lab: str) -> str:
    """The Markdown line each guide carries under its summary."""
    return (f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"({colab_url(repo, lab)}) (Colab: run the notebook's first cell first; see the "
            "course README's \"Where it runs\")")


def colab_cell(repo: str) -> str:
    """The first code cell of every lab source, in jupytext's percent format."""
    return f'''# %%
# Colab only (anywhere else this cell does nothing): fetch the course, install what Colab
# lacks while keeping its torch (scripts/hosted.py says what and why), import from the clone.
import sys

if "google.colab" in sys.modules:
    import os
    import subprocess

    if not os.path.isdir("{CLONE}"):
        subprocess.run(["git", "clone", "--depth", "1", "{repo}", "{CLONE}"], check=True)
    subprocess.run([sys.executable, "{CLONE}/scripts/hosted.py"], check=True)
    sys.path.insert(0, "{CLONE}/src")
    os.chdir("{CLONE}")
'''
