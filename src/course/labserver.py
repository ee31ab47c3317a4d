"""`make lab`: JupyterLab on the course checkout, opened on the learner's copies in work/.

The server is rooted at the checkout, so the lab guides' relative links
(../../src/minimoe/BLUEPRINT.md, ../../experiments/...) open, and its default page is
work/START.md (the labs, their notebooks and guides), with the file browser on work/. As
root it adds `--allow-root`. Extra arguments go to `jupyter lab` unchanged (LAB_ARGS), after
ours, so they win.

Each mode has a Jupyter config directory of this checkout, build/jupyter/MODE/, on
JUPYTER_CONFIG_PATH (the user's ~/.jupyter is left alone). It points JupyterLab's app
settings directory at its lab-settings/, whose overrides.json opens Markdown files (the lab
guides) in the rendered preview rather than the text editor; the installed app settings are
copied in underneath, and the user's own settings still win.

Two modes. "learner" (the default) hides nbgrader's instructor tools: build/jupyter/learner/
goes first on JUPYTER_CONFIG_PATH and switches off the formgrader, course-list and
assignment-list server extensions and the matching JupyterLab plugins (Formgrader, Create
Assignment, Courses, Assignments and the Nbgrader menu, which only opens those). The
"Validate" notebook button stays, with the cell time limit of `make check` (interpreter
kernels are slow). "instructor" serves nbgrader as installed, with build/course/ (after
`make course`) first on JUPYTER_CONFIG_PATH so that its nbgrader_config.py points the
Formgrader at that course rather than at a gradebook in the checkout's root, and
build/jupyter/instructor/ after it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from labkit.atomic import atomic_write_text

from .authoring.build import CELL_TIMEOUT_S, course_dir
from .learner import START, WORK

MODES = ("learner", "instructor")
# Names as nbgrader 0.9 registers them: etc/jupyter/jupyter_server_config.d/nbgrader.json
# and the plugin ids of share/jupyter/labextensions/@jupyter/nbgrader (a test checks both).
INSTRUCTOR_SERVER_EXTENSIONS = ("nbgrader.server_extensions.formgrader",
                                "nbgrader.server_extensions.course_list",
                                "nbgrader.server_extensions.assignment_list")
INSTRUCTOR_LAB_PLUGINS = ("@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                          "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list",
                          "@jupyter/nbgrader:menu")
# JupyterLab settings defaults of both modes: a lab guide (README.md) opens rendered, and no
# pop-up asks to fetch Jupyter's news (a course machine may have no network).
LAB_SETTINGS = {"@jupyterlab/docmanager-extension:plugin":
                {"defaultViewers": {"markdown": "Markdown Preview"}},
                "@jupyterlab/apputils-extension:notification":
                {"fetchNews": "false", "checkForUpdates": False}}


def installed_app_settings() -> Path:
    """JupyterLab's own app settings directory (overrides.json, page_config.json there)."""
    from jupyterlab.commands import get_app_dir

    return Path(get_app_dir()) / "settings"


def merge(base: dict, top: dict) -> dict:
    """`base` updated with `top`, dictionaries merged key by key."""
    out = dict(base)
    for key, value in top.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if nested else value
    return out


def write_app_settings(directory: Path) -> Path:
    """An app settings directory: the installed one's overrides (overrides.d/*.json, then
    overrides.json) and page_config.json, with LAB_SETTINGS on top."""
    installed = installed_app_settings()
    overrides: dict = {}
    for path in [*sorted(installed.glob("overrides.d/*.json")), installed / "overrides.json"]:
        if path.is_file():
            overrides = merge(overrides, json.loads(path.read_text()))
    overrides = merge(overrides, LAB_SETTINGS)
    atomic_write_text(directory / "overrides.json", json.dumps(overrides, indent=2) + "\n")
    if (installed / "page_config.json").is_file():
        atomic_write_text(directory / "page_config.json",
                          (installed / "page_config.json").read_text())
    return directory


def config_dir(root: Path, mode: str) -> Path:
    """The Jupyter config directory of `mode`, (re)written: JupyterLab's app settings and,
    for a learner, the instructor tools switched off (the names above)."""
    directory = root / "build" / "jupyter" / mode
    server: dict = {"LabApp": {"app_settings_dir": str(
        write_app_settings(directory / "lab-settings"))}}
    if mode == "learner":
        server["ServerApp"] = {"jpserver_extensions": dict.fromkeys(
            INSTRUCTOR_SERVER_EXTENSIONS, False)}
        atomic_write_text(directory / "labconfig" / "page_config.json", json.dumps(
            {"disabledExtensions": dict.fromkeys(INSTRUCTOR_LAB_PLUGINS, True)},
            indent=2) + "\n")
        atomic_write_text(directory / "nbgrader_config.json", json.dumps(  # the Validate button
            {"Execute": {"timeout": CELL_TIMEOUT_S}}, indent=2) + "\n")
    atomic_write_text(directory / "jupyter_server_config.json",
                      json.dumps(server, indent=2) + "\n")
    return directory


def is_root() -> bool:
    """True for uid 0, where Jupyter refuses to start without --allow-root."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_environment(root: Path, mode: str) -> dict[str, str]:
    """os.environ with this Python's bin/ first on PATH (nbgrader runs `alembic` and kernels
    through it) and the mode's Jupyter config directory on JUPYTER_CONFIG_PATH: first, or
    after the instructor's nbgrader course."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                  os.environ.get("PATH", "")])}
    paths = [config_dir(root, mode), env.get("JUPYTER_CONFIG_PATH", "")]
    if mode == "instructor" and (course_dir(root) / "nbgrader_config.py").is_file():
        paths.insert(0, course_dir(root))
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(str(p) for p in paths if p)
    return env


def lab_command(root: Path, mode: str = "learner", extra: list[str] | None = None
                ) -> tuple[list[str], dict[str, str]]:
    """The `jupyter lab` command line and environment of `make lab` for checkout `root`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    root, extra = root.resolve(), list(extra or [])
    argv = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={root}",
            f"--LabApp.default_url=/lab/tree/{WORK}/{START}"]
    if is_root() and "--allow-root" not in extra:
        argv.append("--allow-root")
    return argv + extra, lab_environment(root, mode)


def serve(root: Path, mode: str = "learner", extra: list[str] | None = None) -> None:
    """Replace this process with JupyterLab (see `lab_command`); does not return."""
    argv, env = lab_command(root, mode, extra)
    print(f"JupyterLab in {mode} mode on {root.resolve()}, opened on {WORK}/{START}", flush=True)
    os.execve(argv[0], argv, env)
