"""Build the nbgrader course from solutions/ and keep labs/ in step with it.

solutions/NN-name.py (jupytext percent, nbgrader metadata) is the single source of truth:
    solutions/NN-name.py --jupytext--> build/course/source/NN-name/NN-name.ipynb
        --nbgrader generate_assignment--> build/course/release/NN-name/NN-name.ipynb
        --copy--> labs/NN-name/NN-name.ipynb   (committed; a test checks it is current)

The build never writes over a notebook it did not write: labs/.generated.sha256 (committed,
`sha256sum` format) records the sha256 of each release as the build last wrote it, and a
labs/ notebook that matches neither that record nor the fresh build holds someone's edits,
so the build refuses and names it. Learners work in their own copies in work/ (learner.py).
It refuses as well a lab with a graded test that has no hidden part (`require_hidden`).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat

from labkit.atomic import atomic_write_text
from labkit.errors import InputError

from ..learner import WORK, release_notebook_path, work_copy
from . import reflection

COURSE_ID = "miniqlora-moe-labs"
# In labs/: the sha256 of each release notebook as the course build last wrote it.
GENERATED = ".generated.sha256"
# Interpreter-mode Triton kernels are slow on a laptop CPU: give each cell minutes, not the
# 30 s nbgrader default. A submission that loops forever costs this much, once per cell.
CELL_TIMEOUT_S = 300
# A cell tagged so (`# %% [markdown] tags=["instructor"]` in solutions/) is for instructors
# only: sample answers to the reflection questions. It never reaches nbgrader or labs/.
INSTRUCTOR_TAG = "instructor"
# A cell tagged so runs in Jupyter only, never while graded (`make check`, `make grade`): it
# calls the library's version of what the lab asks for, which is a stub there (a comparison,
# a benchmark), or reads what such a cell made.
JUPYTER_ONLY_TAG = "jupyter-only"
# A test cell's hidden part: stripped from the release, run only when graded. Every graded
# test needs one, with inputs of its own: a visible part alone gives its points to an answer
# memorised for the inputs the learner can read.
HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS[ \t]*\n(.*?)"
                    r"^[ \t]*### END HIDDEN TESTS[ \t]*$\n?", re.MULTILINE | re.DOTALL)
# What nbgrader puts in place of a solution region in the release (and check-exercises too).
CODE_STUB = "raise NotImplementedError()"
NBGRADER_CONFIG = '''\
# Written by `python -m course build`; edit src/course/authoring/build.py instead.
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
    """The notebook nbgrader is given for a jupytext solution file, with stable cell ids.

    Cells tagged `instructor` (sample answers) are left out. Cell ids are derived from the
    position (and the grade_id where there is one) so that regenerating the course gives
    byte-identical notebooks.
    """
    nb = jupytext.read(solution, fmt="py:percent")
    nb.cells = [c for c in nb.cells if INSTRUCTOR_TAG not in c.metadata.get("tags", [])]
    for i, cell in enumerate(nb.cells):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        cell.id = f"c{i:02d}-{grade_id}" if grade_id else f"c{i:02d}"
    return nb


def jupyter_only(cell) -> bool:
    return JUPYTER_ONLY_TAG in cell.get("metadata", {}).get("tags", [])


def graded_test_cells(nb) -> list:
    """The autograded test cells of `nb`: code cells nbgrader grades that are not answers."""
    return [c for c in nb.cells if c.cell_type == "code"
            and (m := c.metadata.get("nbgrader", {})).get("grade")
            and not m.get("solution") and m.get("grade_id")]


def without_hidden(nb) -> list[str]:
    """The grade_ids of the graded tests of `nb` that have no hidden part (or an empty one)."""
    return [c.metadata["nbgrader"]["grade_id"] for c in graded_test_cells(nb)
            if not any(m.group(1).strip() for m in HIDDEN.finditer(c.source))]


def require_hidden(root: Path, names: list[str]) -> None:
    """Raise InputError naming each lab and graded test without a hidden part."""
    bare = {n: ids for n in names
            if (ids := without_hidden(source_notebook(root / "solutions" / f"{n}.py")))}
    if bare:
        raise InputError("every graded test needs a hidden part with inputs of its own (between "
                         "`### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS`, in `# case:` "
                         "blocks), or an answer memorised for the visible inputs earns its "
                         "points; none in " + "; ".join(
                             f"solutions/{n}.py: {', '.join(ids)}" for n, ids in bare.items()))


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


def text_sha256(text: str) -> str:
    """sha256 of a notebook's text as read (newlines normalised), as the record keeps it."""
    return hashlib.sha256(text.encode()).hexdigest()


def read_generated(root: Path) -> dict[str, str]:
    """{lab: sha256} of the releases the course build last wrote (empty if no record)."""
    path = root / "labs" / GENERATED
    pairs = [line.split() for line in (path.read_text().splitlines() if path.is_file() else [])]
    return {Path(pair[1]).stem: pair[0] for pair in pairs if len(pair) == 2}


def write_generated(root: Path, digests: dict[str, str]) -> None:
    """Record what the build wrote, as `sha256sum -c` reads it from labs/."""
    atomic_write_text(root / "labs" / GENERATED, "".join(
        f"{digest}  {name}/{name}.ipynb\n" for name, digest in sorted(digests.items())))


def edited(root: Path, name: str, fresh: str, generated: dict[str, str]) -> bool:
    """True when labs/NAME/NAME.ipynb exists and is neither the fresh build nor what the
    build last wrote: someone edited it, and writing over it would lose their work."""
    path = release_notebook_path(root, name)
    if not path.is_file():
        return False
    text = path.read_text()
    return text != fresh and text_sha256(text) != generated.get(name)


def keep_command(root: Path, names: list[str]) -> str:
    """Shell command copying edited labs/ notebooks into work/ without overwriting a copy."""
    targets = {n: work_copy(root, n) if not work_copy(root, n).exists()
               else work_copy(root, n).with_suffix(".from-labs.ipynb") for n in names}
    return " && ".join([f"mkdir -p {WORK}"] + [
        f"cp -n labs/{n}/{n}.ipynb {t.relative_to(root)}" for n, t in targets.items()])


def edited_message(root: Path, names: list[str]) -> str:
    """Why the build will not write over `names`, and what a learner or developer does."""
    files = " ".join(f"labs/{n}/{n}.ipynb" for n in names)
    verb, holds = ("differs", "it holds") if len(names) == 1 else ("differ", "they hold")
    return (f"{files} {verb} from what the course build last wrote (labs/{GENERATED}): {holds}"
            " edits, and the course build never writes over edits. A learner's work belongs in"
            f" {WORK}/: keep it there with `{keep_command(root, names)}`, then restore the"
            f" release with `git checkout -- {files}`. Course developers: labs/ is generated"
            " from solutions/; move the edits there or discard them.")


def stale_message(root: Path, names: list[str], edits: list[str]) -> str:
    """Why `build_course(check=True)` failed, addressed to whoever can act on it."""
    behind = [n for n in names if n not in edits]
    parts = [edited_message(root, edits)] if edits else []
    if behind or not names:
        parts.append(f"labs/ (or labs/{GENERATED}) is behind solutions/"
                     + (f" for {behind}" if behind else "") + ". For course developers: run"
                     " `make course` and commit labs/. Learners have nothing to do here: their"
                     f" work lives in {WORK}/, which the course build never touches.")
    return " ".join(parts)


def build_course(root: Path, check: bool = False) -> list[str]:
    """Generate every lab's release; refresh labs/ (or, with `check`, verify it is current).

    Returns the labs whose committed notebook differs from a fresh build (empty when in sync).
    With `check`, a difference (or an out-of-date labs/.generated.sha256) raises InputError;
    without it, so does a labs/ notebook holding edits, before anything in labs/ is written.
    """
    root = root.resolve()
    names = lab_names(root)
    if not names:
        raise InputError(f"no lab sources found in {root / 'solutions'} (expected NN-name.py)")
    require_hidden(root, names)
    course = generate_assignments(root, names)
    fresh = {n: release_notebook(course / "release" / n / f"{n}.ipynb") for n in names}
    digests = {n: text_sha256(text) for n, text in fresh.items()}
    generated = read_generated(root)
    stale = [n for n in names if not release_notebook_path(root, n).is_file()
             or release_notebook_path(root, n).read_text() != fresh[n]]
    edits = [n for n in stale if edited(root, n, fresh[n], generated)]
    if check and (stale or generated != digests):
        raise InputError(stale_message(root, stale, edits))
    if check and (guides := reflection.stale(root, names)):
        raise InputError(f"reflection questions differ from the notebooks' in {guides}: "
                         "`make course` copies them")
    if edits:
        raise InputError(edited_message(root, edits))
    for name in stale:                  # none left under `check`
        atomic_write_text(release_notebook_path(root, name), fresh[name])
    if generated != digests:
        write_generated(root, digests)
    if not check:
        reflection.write(root, names)
    print(f"course built in {course} for {len(names)} lab(s)"
          + (f"; refreshed labs/ for {stale}" if stale and not check else ""))
    return stale
