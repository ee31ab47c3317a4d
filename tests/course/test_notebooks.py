"""The notebook pipeline: solutions/ -> nbgrader course -> labs/, validation.

These execute every lab notebook (the solution, and the release with its stubs), so they
take a minute or two per lab on a 2-core CPU. Autograding: tests/course/test_grading_robustness.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import build_course, course_dir, lab_names

ROOT = Path(__file__).resolve().parents[2]
LABS = lab_names(ROOT)
pytestmark = pytest.mark.notebooks


def validate(notebook: Path, *flags: str) -> str:
    """nbgrader validate always exits 0; its verdict is in what it prints."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "nbgrader", "validate", *flags,
                           "--Execute.timeout=300", str(notebook)],
                          capture_output=True, text=True, env=env, cwd=notebook.parent)
    return proc.stdout


@pytest.fixture(scope="module")
def course() -> Path:
    """Build the course once, refusing to run if labs/ is out of date with solutions/."""
    assert build_course(ROOT, check=True) == []
    return course_dir(ROOT)


def test_every_lab_has_guide_and_notebook():
    assert "00-setup-minigpt" in LABS
    for lab in LABS:
        assert (ROOT / "labs" / lab / "README.md").is_file(), f"{lab} has no guide"
        assert (ROOT / "labs" / lab / f"{lab}.ipynb").is_file(), f"{lab} has no notebook"


@pytest.mark.parametrize("lab", LABS)
def test_release_is_clean(course, lab):
    text = (ROOT / "labs" / lab / f"{lab}.ipynb").read_text()
    for leak in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert leak not in text, f"labs/{lab} leaks {leak!r}"
    nb = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    graded = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(graded) >= 3, f"{lab} has {len(graded)} graded cells"
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("lab", LABS)
def test_solution_passes_every_test(course, lab):
    out = validate(course / "source" / lab / f"{lab}.ipynb")
    assert "Success! Your notebook passes all the tests." in out, out[-3000:]


@pytest.mark.parametrize("lab", LABS)
def test_release_fails_every_test(course, lab):
    out = validate(ROOT / "labs" / lab / f"{lab}.ipynb", "--invert")
    assert "Success! The notebook does not pass any tests." in out, out[-3000:]
