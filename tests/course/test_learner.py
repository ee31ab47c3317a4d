"""A learner's work is never lost: copies in work/, `check` runs them, `course` overwrites no edits.

Everything that writes runs on the `checkout` fixture (a scratch copy of lab 00), never on the
real labs/ or work/.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import read_generated, source_notebook, stale_message, write_generated
from course.authoring.build import text_sha256 as sha
from course.authoring.exercises import notebook_for_check
from course.learner import copy_if_absent, make_work_copies, release_notebook_path, work_copy
from labkit.errors import InputError

LAB = "00-setup-minigpt"


def course(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m course ARGS --root ROOT`, as the Makefile runs it."""
    return subprocess.run([sys.executable, "-m", "course", *args, "--root", str(root)],
                          capture_output=True, text=True, cwd=root, timeout=600)


def with_marker(path: Path, marker: str) -> bytes:
    """Append a markdown cell holding `marker` to the notebook at `path`; return its bytes."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell(marker))
    nbformat.write(nb, path)
    return path.read_bytes()


def test_work_copies_are_made_once_and_never_overwritten(checkout, capsys):
    release = release_notebook_path(checkout, LAB)
    assert make_work_copies(checkout) == [work_copy(checkout, LAB)]
    assert work_copy(checkout, LAB).read_bytes() == release.read_bytes()
    mine = with_marker(work_copy(checkout, LAB), "my answer")
    assert make_work_copies(checkout) == []
    assert work_copy(checkout, LAB).read_bytes() == mine
    assert sorted(p.name for p in (checkout / "work").iterdir()) == [f"{LAB}.ipynb", "START.md"]


def test_the_start_page_lists_every_lab_with_links_that_open_and_stays_the_learners(checkout):
    """work/START.md, where JupyterLab opens: a row per released lab, its title from the
    guide, links to the learner's notebook and the guide that resolve from work/; written
    once, like the copies, so a learner's notes in it stay."""
    make_work_copies(checkout)
    page = (checkout / "work" / "START.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)]+)\)", page)
    labs = [p.parent.name for p in (checkout / "labs").glob("[0-9][0-9]-*/*.ipynb")]
    assert labs and len(links) == 2 * len(labs), page
    for link in links:
        assert (checkout / "work" / link).resolve().is_file(), f"START.md links to {link}"
    title = (checkout / "labs" / LAB / "README.md").read_text().splitlines()[0].lstrip("# ")
    assert title in page
    (checkout / "work" / "START.md").write_text("my notes\n")
    make_work_copies(checkout)
    assert (checkout / "work" / "START.md").read_text() == "my notes\n"


def test_copy_if_absent_never_writes_over_a_file(tmp_path):
    source, target = tmp_path / "a.ipynb", tmp_path / "w" / "a.ipynb"
    source.write_text("release")
    assert copy_if_absent(source, target) and target.read_text() == "release"
    target.write_text("mine")
    assert not copy_if_absent(source, target) and target.read_text() == "mine"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.ipynb"]   # no temporary left


def test_check_runs_the_work_copy_else_says_it_checks_the_release(checkout, capsys):
    path, _ = notebook_for_check(checkout, LAB, None)
    assert path == release_notebook_path(checkout, LAB).resolve()
    assert f"checking the blank release labs/{LAB}/{LAB}.ipynb" in capsys.readouterr().out
    make_work_copies(checkout)
    path, _ = notebook_for_check(checkout, LAB, None)
    assert path == work_copy(checkout, LAB).resolve()
    assert "blank release" not in capsys.readouterr().out
    with pytest.raises(InputError, match="unknown lab"):
        notebook_for_check(checkout, "99-nope", None)


def test_generated_record_round_trips_in_sha256sum_format(tmp_path):
    digests = {LAB: sha("a"), "01-quant-basics": sha("b")}
    write_generated(tmp_path, digests)
    assert read_generated(tmp_path) == digests
    assert f"{digests[LAB]}  {LAB}/{LAB}.ipynb\n" in (tmp_path / "labs" / ".generated.sha256"
                                                       ).read_text()


def test_stale_labs_message_sends_learners_to_work_and_developers_to_make_course(checkout):
    edited = stale_message(checkout, [LAB], edits=[LAB])
    assert f"labs/{LAB}/{LAB}.ipynb" in edited and "make course" not in edited
    assert f"cp -n labs/{LAB}/{LAB}.ipynb work/{LAB}.ipynb`" in edited
    make_work_copies(checkout)              # a copy exists: keep the edits beside it
    edited = stale_message(checkout, [LAB], edits=[LAB])
    assert f"cp -n labs/{LAB}/{LAB}.ipynb work/{LAB}.from-labs.ipynb`" in edited
    behind = stale_message(checkout, [LAB], edits=[])
    assert "course developers" in behind.lower() and "make course" in behind
    assert "work/" in behind


@pytest.mark.notebooks
def test_an_edit_survives_every_entry_point(checkout):
    """A learner edits their copy and (following old advice) the release too; course, the
    copy step of `make lab`, and check leave both edits as they were."""
    assert course(checkout, "work").returncode == 0
    mine = work_copy(checkout, LAB)
    nbformat.write(source_notebook(checkout / "solutions" / f"{LAB}.py"), mine)
    mine_bytes = mine.read_bytes()                      # the learner's finished notebook
    release = release_notebook_path(checkout, LAB)
    shipped = release.read_bytes()
    release_bytes = with_marker(release, "an edit in the release")

    proc = course(checkout, "build")
    assert proc.returncode == 2 and f"labs/{LAB}/{LAB}.ipynb" in proc.stderr, proc.stderr
    assert "work/" in proc.stderr
    proc = course(checkout, "build", "--check")        # what `make test` runs
    assert proc.returncode == 2 and "make course" not in proc.stderr, proc.stderr
    proc = course(checkout, "work")
    assert proc.returncode == 0 and "created" not in proc.stdout, proc.stdout
    proc = course(checkout, "check", LAB)
    assert proc.returncode == 0 and f"visible tests of {mine}" in proc.stdout, proc.stdout
    assert (mine.read_bytes(), release.read_bytes()) == (mine_bytes, release_bytes)

    release.write_bytes(shipped)                        # the edit moved; a solution changes
    with (checkout / "solutions" / f"{LAB}.py").open("a") as f:
        f.write("\n# %% [markdown]\n# A new closing note.\n")
    assert course(checkout, "build").returncode == 0
    assert "A new closing note." in release.read_text()
    assert course(checkout, "build", "--check").returncode == 0
    assert mine.read_bytes() == mine_bytes
