"""`make lab`: JupyterLab on the checkout, opened on work/, as root too, nbgrader's instructor
tools hidden unless MODE=instructor, lab guides opened rendered in both modes. The server
test starts a real server (headless, a free localhost port, a token) on a scratch checkout
and stops it; it is bounded in time."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course import labserver
from course.authoring.build import CELL_TIMEOUT_S, prepare_course
from course.labserver import (
    INSTRUCTOR_LAB_PLUGINS,
    INSTRUCTOR_SERVER_EXTENSIONS,
    LAB_SETTINGS,
    lab_command,
)
from course.learner import released_labs

ROOT = Path(__file__).resolve().parents[2]
LAB = "00-setup-minigpt"
TOKEN = "labserver-test-token"
LINK = re.compile(r"\]\(([^)#\s]+)")


def test_the_hidden_nbgrader_parts_are_named_as_installed():
    """The ids must be nbgrader's own, or learner mode would silently hide nothing."""
    enabled = json.loads((Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" /
                          "nbgrader.json").read_text())["ServerApp"]["jpserver_extensions"]
    assert set(INSTRUCTOR_SERVER_EXTENSIONS) < set(enabled)
    assert "nbgrader.server_extensions.validate_assignment" not in INSTRUCTOR_SERVER_EXTENSIONS
    static = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "@jupyter" / "nbgrader"
    plugins = set(re.findall(r'"(@jupyter/nbgrader:[a-z-]+)"', "".join(
        p.read_text(errors="replace") for p in static.glob("static/*.js"))))
    assert set(INSTRUCTOR_LAB_PLUGINS) < plugins
    assert "@jupyter/nbgrader:validate-assignment" in plugins - set(INSTRUCTOR_LAB_PLUGINS)


@pytest.mark.parametrize("uid0", [True, False])
def test_lab_command(tmp_path, monkeypatch, uid0):
    monkeypatch.setattr(labserver, "is_root", lambda: uid0)
    argv, env = lab_command(tmp_path, "learner", ["--port", "8890"])
    assert argv[1:4] == ["-m", "jupyter", "lab"] and argv[-2:] == ["--port", "8890"]
    assert f"--ServerApp.root_dir={tmp_path.resolve()}" in argv
    assert "--LabApp.default_url=/lab/tree/work/START.md" in argv
    assert ("--allow-root" in argv) == uid0
    config = tmp_path.resolve() / "build" / "jupyter" / "learner"
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0] == str(config)
    nbgrader = json.loads((config / "nbgrader_config.json").read_text())   # Validate button
    assert nbgrader["Execute"]["timeout"] == CELL_TIMEOUT_S
    argv, env = lab_command(tmp_path, "instructor", ["--allow-root"])
    assert argv.count("--allow-root") == 1
    instructor = config.parent / "instructor"
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0] == str(instructor)
    assert not (instructor / "labconfig").exists()       # nbgrader's tools stay in view
    (config.parent.parent / "course").mkdir()
    (config.parent.parent / "course" / "nbgrader_config.py").write_text("")   # make course
    _, env = lab_command(tmp_path, "instructor")
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep)[:2] == [
        str(config.parent.parent / "course"), str(instructor)]


@pytest.mark.parametrize("mode", ["learner", "instructor"])
def test_markdown_opens_rendered_over_the_installed_app_settings(tmp_path, monkeypatch, mode):
    """Rule: in both modes JupyterLab's app settings open a .md file (a lab guide) in the
    Markdown preview; what the installed app settings directory says stays underneath."""
    installed = tmp_path / "installed"
    (installed / "overrides.d").mkdir(parents=True)
    (installed / "overrides.d" / "theme.json").write_text(json.dumps(
        {"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}))
    (installed / "overrides.json").write_text(json.dumps(
        {"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"csv": "CSVTable"},
                                                     "autosave": False}}))
    (installed / "page_config.json").write_text('{"exposeAppInBrowser": true}')
    monkeypatch.setattr(labserver, "installed_app_settings", lambda: installed)
    _, env = lab_command(tmp_path / "checkout", mode)
    config = Path(env["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0])
    settings = Path(json.loads((config / "jupyter_server_config.json").read_text())
                    ["LabApp"]["app_settings_dir"])
    assert settings.is_relative_to(config)
    overrides = json.loads((settings / "overrides.json").read_text())
    docmanager = overrides["@jupyterlab/docmanager-extension:plugin"]
    assert docmanager == {"defaultViewers": {"csv": "CSVTable", "markdown": "Markdown Preview"},
                          "autosave": False}
    assert overrides["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert json.loads((settings / "page_config.json").read_text()) == {"exposeAppInBrowser": True}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lab_passes_mode_and_lab_args():
    proc = subprocess.run(["make", "-n", "lab", "MODE=instructor", "LAB_ARGS=--port 8890"],
                          capture_output=True, text=True, cwd=ROOT)
    assert "-m course lab --mode instructor --port 8890" in proc.stdout, proc.stdout


def test_guide_links_resolve_from_the_checkout():
    """Served from the checkout, every relative link of every lab guide opens something."""
    for guide in ROOT.glob("labs/*/README.md"):
        for link in LINK.findall(guide.read_text()):
            if "://" in link:
                continue
            target = (guide.parent / link).resolve()
            assert target.is_relative_to(ROOT), f"{guide}: {link} leaves the checkout"
            work = target.relative_to(ROOT).parts[0] == "work"
            assert (target.stem in released_labs(ROOT)) if work else target.exists(), \
                f"{guide.relative_to(ROOT)}: {link} does not resolve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, dict, bytes]:
    """GET with the token, redirects not followed: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        sep = "&" if "?" in path else "?"
        conn.request("GET", f"{path}{sep}token={TOKEN}")
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def wait_until_up(proc: subprocess.Popen, port: int, log: Path, deadline_s: float = 90) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"jupyter lab exited ({proc.returncode}):\n{log.read_text()}"
        try:
            if get(port, "/api/status")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"jupyter lab did not answer in {deadline_s} s:\n{log.read_text()[-3000:]}")


def page_config(port: int) -> dict:
    html = get(port, "/lab")[2].decode()
    m = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                  html, re.DOTALL)
    return json.loads(m.group(1))


def default_settings(port: int) -> dict:
    """The served defaults of the settings LAB_SETTINGS names (the schemas' defaults, which
    the app settings' overrides.json rewrites)."""
    out = {}
    for plugin, values in LAB_SETTINGS.items():
        schema = json.loads(get(port, f"/lab/api/settings/{plugin}")[2])["schema"]
        out[plugin] = {key: schema["properties"][key]["default"] for key in values}
    return out


@pytest.mark.notebooks
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["learner", "instructor"])
def test_make_lab_serves_the_checkout(checkout, tmp_path, mode):
    mine = checkout / "work" / f"{LAB}.ipynb"
    mine.parent.mkdir()
    mine.write_text((checkout / "labs" / LAB / f"{LAB}.ipynb").read_text()
                    .replace("YOUR CODE HERE", "MY OWN CODE", 1))
    before, port, log = mine.read_bytes(), free_port(), tmp_path / "lab.log"
    if mode == "instructor":
        prepare_course(checkout)         # the nbgrader course the Formgrader should open
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "course", "lab", "--root", str(checkout), "--mode", mode,
             "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={TOKEN}"], cwd=checkout, env=env, stdout=out, stderr=out)
    try:
        wait_until_up(proc, port, log)
        status, headers, _ = get(port, "/")
        assert status == 302 and "/lab/tree/work" in headers["Location"]
        status, _, body = get(port, f"/api/contents/work/{LAB}.ipynb")
        assert status == 200 and json.loads(body)["type"] == "notebook"
        assert "MY OWN CODE" in body.decode()
        for path in ("src/minigpt/BLUEPRINT.md", "experiments/06-qlora-preview/REPORT.md",
                     f"labs/{LAB}/README.md"):
            assert get(port, f"/api/contents/{path}?content=0")[0] == 200, path
        assert default_settings(port) == LAB_SETTINGS, "guides open in the Markdown preview"
        disabled = set(page_config(port)["disabledExtensions"])
        formgrader = get(port, "/formgrader")[0]
        if mode == "learner":
            assert formgrader == 404 and set(INSTRUCTOR_LAB_PLUGINS) <= disabled
        else:
            assert formgrader != 404 and not set(INSTRUCTOR_LAB_PLUGINS) & disabled
            status, _, body = get(port, "/formgrader/api/assignments")
            assert status == 200 and LAB in [a["name"] for a in json.loads(body)], body[:500]
            assert not (checkout / "gradebook.db").exists()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert mine.read_bytes() == before
