"""The hosted paths: every lab opens in Colab from its guide and its notebook's first cell sets
the course up there (and does nothing anywhere else); the Codespaces container builds .venv
with the README's own command; every make target the README names has its make-less twin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course.authoring.hosted import CLONE, colab_badge, colab_cell, colab_url, repository

ROOT = Path(__file__).resolve().parents[2]
LABS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]-*.py"))
REPO = repository(ROOT)


def first_code_cell(source: str) -> str:
    """The first `# %%` code cell of a percent-format file, up to the next cell marker."""
    start = re.search(r"^# %%\n", source, re.M).start()
    end = source.find("\n# %%", start + 1)
    return source[start:end + 1]


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_source_opens_with_the_colab_cell(lab):
    text = (ROOT / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
    assert first_code_cell(text) == colab_cell(REPO) + "\n", (
        f"solutions/{lab}.py: its first code cell is not course.authoring.hosted.colab_cell()")


@pytest.mark.parametrize("lab", LABS)
def test_every_release_notebook_and_guide_points_to_colab(lab):
    nb = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    assert code.source == colab_cell(REPO).removeprefix("# %%\n").rstrip("\n"), (
        f"labs/{lab}/{lab}.ipynb does not open with the Colab cell: run make course")
    guide = (ROOT / "labs" / lab / "README.md").read_text(encoding="utf-8")
    assert colab_badge(REPO, lab) in guide, f"labs/{lab}/README.md lacks its Colab link"
    assert colab_url(REPO, lab).endswith(f"/blob/main/labs/{lab}/{lab}.ipynb")


def run_cell(on_colab: bool, clone_exists: bool) -> dict:
    """Run the cell in a child process with subprocess.run, os.chdir and os.path.isdir
    replaced by recorders: what it would run, where it would go, what it adds to sys.path."""
    probe = f"""
import json, os, subprocess, sys, types
calls = []
subprocess.run = lambda cmd, check=False: calls.append(cmd)
os.chdir = lambda path: calls.append(["chdir", path])
os.path.isdir = lambda path: {clone_exists!r}
if {on_colab!r}:
    sys.modules["google.colab"] = types.ModuleType("google.colab")
path_before = list(sys.path)
exec({colab_cell(REPO)!r})
print(json.dumps({{"calls": calls, "added": [p for p in sys.path if p not in path_before]}}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_the_colab_cell_does_nothing_elsewhere():
    assert run_cell(on_colab=False, clone_exists=False) == {"calls": [], "added": []}


def test_the_colab_cell_clones_once_installs_and_imports_from_the_clone():
    first = run_cell(on_colab=True, clone_exists=False)
    assert first["calls"] == [["git", "clone", "--depth", "1", REPO, CLONE],
                              [sys.executable, f"{CLONE}/scripts/hosted.py"],
                              ["chdir", CLONE]]
    assert first["added"] == [f"{CLONE}/src"]
    again = run_cell(on_colab=True, clone_exists=True)
    assert again["calls"] == first["calls"][1:], "a second run must not clone again"


def test_the_codespace_builds_venv_with_the_readmes_command():
    config = json.loads((ROOT / ".devcontainer" / "devcontainer.json").read_text())
    assert config["postCreateCommand"].endswith("make venv TORCH=cpu")
    assert "bubblewrap" in config["postCreateCommand"]
    assert re.search(r"python:3\.1[1-4]", config["image"]), config["image"]


def makefile_commands() -> dict[str, str]:
    """make target -> the `-m ...` or script its recipe runs with the venv's Python."""
    found = {}
    for target, recipe in re.findall(r"^([a-z-]+):[^\n]*\n((?:\t[^\n]*\n)+)",
                                     (ROOT / "Makefile").read_text(), re.M):
        m = re.search(r"\$\(PY(?:THON)?\) (-m \w+(?: [\w-]+)?|[\w/]+\.py)", recipe)
        if m:
            found[target] = m[1]
    return found


def test_every_make_target_in_the_readme_has_its_python_twin():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| make | the same without make |"):]
    table = table[:table.index("\n\n")]
    rows = dict(re.findall(r"^\| `make ([a-z-]+)[^`]*` \| (.+) \|$", table, re.M))
    named = set(re.findall(r"`make ([a-z-]+)", readme))
    assert named <= set(rows), f"make targets the README names without a twin: {named - set(rows)}"
    for target, command in makefile_commands().items():
        if target in rows:
            assert f"python {command}" in rows[target], (
                f"make {target} runs `{command}`, the README's twin says {rows[target]}")
