"""labkit's experiment half runs with only the runtime dependencies: `import labkit`, `python -m
labkit run` and `reproduce` succeed with the notebook stack made unimportable, and `import
labkit` does not import labkit.course."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Development-only packages (the nbgrader course): none may be needed to run an experiment.
DEV_ONLY = ("jupytext", "nbgrader", "nbformat", "nbclient", "jupyter_client", "ipykernel")

# Installed before anything else runs: a finder that refuses the names above, then the CLI.
BLOCK = f"""
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {DEV_ONLY!r}:
            raise ImportError(f"blocked by the test: {{name}} is a development dependency")
        return None
sys.meta_path.insert(0, Block())
"""

EXPERIMENT = '''
import torch

def run(cfg, ctx):
    w = torch.randn(cfg["n"], generator=torch.Generator().manual_seed(cfg["seed"]))
    torch.save(w, ctx.artifact("w.pt"))
    ctx.output("REPORT.md").write_text("a throwaway experiment\\n")
    return {"sum": float(w.sum()), "n": cfg["n"]}
'''


def blocked_python(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code, *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


@pytest.fixture
def experiment(tmp_path) -> Path:
    exp = tmp_path / "99-throwaway"
    exp.mkdir()
    (exp / "experiment.py").write_text(EXPERIMENT)
    (exp / "config.json").write_text(json.dumps({"seed": 7, "threads": 1, "n": 5}))
    return exp


def test_the_blocker_blocks(tmp_path):
    for name in DEV_ONLY:
        proc = blocked_python(f"import {name}", cwd=tmp_path)
        assert proc.returncode != 0 and "blocked by the test" in proc.stderr, name


def test_import_labkit_needs_no_course(tmp_path):
    proc = blocked_python(
        "import labkit, labkit.experiment, labkit.manifest\n"
        "assert 'labkit.course' not in sys.modules, sorted(sys.modules)\n"
        "print('ok')", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_run_and_reproduce_need_no_course(experiment):
    # Both commands in one process (one torch import), each as `python -m labkit` runs it.
    cli = f"""
for argv in (["run", {str(experiment)!r}], ["reproduce", {str(experiment / "manifest.json")!r}]):
    sys.argv = ["labkit", *argv]
    try:
        runpy.run_module("labkit", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert e.code == 0, f"{{argv[0]}} exited {{e.code}}"
assert "labkit.course" not in sys.modules
"""
    proc = blocked_python(cli, cwd=experiment.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wrote " in proc.stdout and "REPRODUCED" in proc.stdout and "exact" in proc.stdout
    manifest = json.loads((experiment / "manifest.json").read_text())
    assert list(manifest["artifacts"]) == ["w.pt"] and manifest["config"]["seed"] == 7
    assert (experiment / "REPORT.md").is_file()
