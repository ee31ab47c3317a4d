"""`make lab`: JupyterLab on the course checkout, opened on the learner's copies in work/.

The server is rooted at the checkout, so the lab guides' relative links
(../../src/minimoe/BLUEPRINT.md, ../../experiments/...) open, and its default page is the
file browser on work/. As root it adds `--allow-root`. Extra arguments go to `jupyter lab`
unchanged (LAB_ARGS), after ours, so they win.

Two modes. "learner" (the default) hides nbgrader's instructor tools: a Jupyter config
directory of this checkout, build/jupyter/learner/, goes first on JUPYTER_CONFIG_PATH (the
user's ~/.jupyter is left alone) and switches off the formgrader, course-list and
assignment-list server extensions and the matching JupyterLab plugins (Formgrader, Create
Assignment, Courses, Assignments and the Nbgrader menu, which only opens those). The
"Validate" notebook button stays, with the cell time limit of `make check` (interpreter
kernels are slow). "instructor" serves nbgrader as installed, with build/course/ (after
`make course`) first on JUPYTER_CONFIG_PATH so that its nbgrader_config.py points the
Formgrader at that course rather than at a gradebook in the checkout's root.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..atomic import atomic_write_text
from .build import CELL_TIMEOUT_S, course_dir
from .learner import WORK

MODES = ("learner", "instructor")
# Names as nbgrader 0.9 registers them: etc/jupyter/jupyter_server_config.d/nbgrader.json
# and the plugin ids of share/jupyter/labextensions/@jupyter/nbgrader (a test checks both).
INSTRUCTOR_SERVER_EXTENSIONS = ("nbgrader.server_extensions.formgrader",
                                "nbgrader.server_extensions.course_list",
                                "nbgrader.server_extensions.assignment_list")
INSTRUCTOR_LAB_PLUGINS = ("@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                          "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list",
                          "@jupyter/nbgrader:menu")


def learner_config_dir(root: Path) -> Path:
    """The Jupyter config directory of learner mode, (re)written from the names above."""
    directory = root / "build" / "jupyter" / "learner"
    atomic_write_text(directory / "jupyter_server_config.json", json.dumps(
        {"ServerApp": {"jpserver_extensions": dict.fromkeys(INSTRUCTOR_SERVER_EXTENSIONS,
                                                            False)}}, indent=2) + "\n")
    atomic_write_text(directory / "labconfig" / "page_config.json", json.dumps(
        {"disabledExtensions": dict.fromkeys(INSTRUCTOR_LAB_PLUGINS, True)}, indent=2) + "\n")
    atomic_write_text(directory / "nbgrader_config.json", json.dumps(   # the Validate button
        {"Execute": {"timeout": CELL_TIMEOUT_S}}, indent=2) + "\n")
    return directory


def is_root() -> bool:
    """True for uid 0, where Jupyter refuses to start without --allow-root."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_environment(root: Path, mode: str) -> dict[str, str]:
    """os.environ with this Python's bin/ first on PATH (nbgrader runs `alembic` and kernels
    through it) and the mode's Jupyter config directory first on JUPYTER_CONFIG_PATH."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                  os.environ.get("PATH", "")])}
    first = learner_config_dir(root) if mode == "learner" else course_dir(root)
    if mode == "learner" or (first / "nbgrader_config.py").is_file():
        paths = [str(first), env.get("JUPYTER_CONFIG_PATH", "")]
        env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(p for p in paths if p)
    return env


def lab_command(root: Path, mode: str = "learner", extra: list[str] | None = None
                ) -> tuple[list[str], dict[str, str]]:
    """The `jupyter lab` command line and environment of `make lab` for checkout `root`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    root, extra = root.resolve(), list(extra or [])
    argv = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={root}",
            f"--LabApp.default_url=/lab/tree/{WORK}"]
    if is_root() and "--allow-root" not in extra:
        argv.append("--allow-root")
    return argv + extra, lab_environment(root, mode)


def serve(root: Path, mode: str = "learner", extra: list[str] | None = None) -> None:
    """Replace this process with JupyterLab (see `lab_command`); does not return."""
    argv, env = lab_command(root, mode, extra)
    print(f"JupyterLab in {mode} mode on {root.resolve()}, opened on {WORK}/", flush=True)
    os.execve(argv[0], argv, env)
