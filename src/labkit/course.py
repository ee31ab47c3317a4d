"""Build the nbgrader course from solutions/ and keep labs/ in step with it.

solutions/NN-name.py (jupytext percent, nbgrader metadata) is the single source of truth:
    solutions/NN-name.py --jupytext--> build/course/source/NN-name/NN-name.ipynb
        --nbgrader generate_assignment--> build/course/release/NN-name/NN-name.ipynb
        --copy--> labs/NN-name/NN-name.ipynb   (committed; a test checks it is current)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat

from .atomic import atomic_write_text
from .errors import InputError

COURSE_ID = "miniqlora-moe-labs"
# Interpreter-mode Triton kernels are slow on a laptop CPU: give each cell minutes, not the
# 30 s nbgrader default. A submission that loops forever costs this much, once per cell.
CELL_TIMEOUT_S = 300
# What nbgrader puts in place of a solution region in the release (and check-exercises too).
CODE_STUB = "raise NotImplementedError()"
NBGRADER_CONFIG = '''\
# Written by `python -m labkit course`; edit labkit/course.py instead.
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = "{course_id}"
c.CourseDirectory.root = {root!r}
c.Execute.timeout = {timeout}
c.Execute.iopub_timeout = 30
c.Execute.raise_on_iopub_timeout = False
c.ClearSolutions.code_stub = {{"python": "# YOUR CODE HERE\\n{stub}"}}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
# A test cell the student deleted (or un-marked) is put back from the gradebook and run.
c.OverwriteCells.add_missing_cells = True
'''


def course_dir(root: Path) -> Path:
    return root / "build" / "course"


def lab_names(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "solutions").glob("[0-9][0-9]-*.py"))


def nbgrader(course: Path, *args: str, timeout: float | None = None, check: bool = True
             ) -> subprocess.CompletedProcess:
    """Run the nbgrader CLI of this Python in `course`; output is captured for reports."""
    # nbgrader runs `alembic` (and kernels) through PATH: put this Python's bin/ first.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                  os.environ.get("PATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"nbgrader {' '.join(args)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def source_notebook(solution: Path) -> nbformat.NotebookNode:
    """The instructor notebook of a jupytext solution file, with stable cell ids.

    Cell ids are derived from the position (and the grade_id where there is one) so that
    regenerating the course gives byte-identical notebooks.
    """
    nb = jupytext.read(solution, fmt="py:percent")
    for i, cell in enumerate(nb.cells):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        cell.id = f"c{i:02d}-{grade_id}" if grade_id else f"c{i:02d}"
    return nb


def write_notebook(nb: nbformat.NotebookNode, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, nbformat.writes(nb) + "\n")


def release_notebook(path: Path) -> str:
    """A release notebook as committed: outputs and execution counts cleared."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nbformat.writes(nb) + "\n"


def prepare_course(root: Path, timeout: int = CELL_TIMEOUT_S, course: Path | None = None
                   ) -> Path:
    """Write nbgrader_config.py and the source notebooks; return the course directory.

    `course` defaults to build/course; grading may use another (e.g. a JupyterHub course).
    """
    course = course or course_dir(root)
    course.mkdir(parents=True, exist_ok=True)
    atomic_write_text(course / "nbgrader_config.py", NBGRADER_CONFIG.format(
        course_id=COURSE_ID, root=str(course.resolve()), timeout=timeout, stub=CODE_STUB))
    for name in lab_names(root):
        write_notebook(source_notebook(root / "solutions" / f"{name}.py"),
                       course / "source" / name / f"{name}.ipynb")
    return course


def generate_assignments(root: Path, names: list[str], course: Path | None = None) -> Path:
    """Source notebooks -> nbgrader releases (and gradebook entries); return the course dir."""
    course = prepare_course(root, course=course)
    for name in names:
        nbgrader(course, "generate_assignment", name, "--force")
    return course


def build_course(root: Path, check: bool = False) -> list[str]:
    """Generate every lab's release; refresh labs/ (or, with `check`, verify it is current).

    Returns the labs whose committed notebook differs from a fresh build (empty when in sync);
    with `check`, a difference raises InputError naming them.
    """
    root = root.resolve()
    names = lab_names(root)
    if not names:
        raise InputError(f"no lab sources found in {root / 'solutions'} (expected NN-name.py)")
    course = generate_assignments(root, names)
    stale = []
    for name in names:
        fresh = release_notebook(course / "release" / name / f"{name}.ipynb")
        committed = root / "labs" / name / f"{name}.ipynb"
        if not committed.is_file() or committed.read_text() != fresh:
            stale.append(name)
            if not check:
                committed.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(committed, fresh)
    if check and stale:
        raise InputError(f"labs/ is out of date for {stale}: run `make course` and commit")
    print(f"course built in {course} for {len(names)} lab(s)"
          + (f"; refreshed labs/ for {stale}" if stale and not check else ""))
    return stale
