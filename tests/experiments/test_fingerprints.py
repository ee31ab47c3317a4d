"""The staleness check: every committed experiment's tiny configuration, re-run under the pin,
gives bit for bit what its fingerprint.json recorded beside the full run's manifest. A change
of code that fails here moves the full run's numbers too: re-record the experiment (and the
experiments that load its outputs), or refresh the fingerprint with a reviewed note."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.numerics import pinned_env

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.parent.name for p in (ROOT / "experiments").glob("*/tiny.json"))


def labkit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in pinned_env()}
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, cwd=ROOT, env={**clean, **(env or {})})


def test_every_experiment_has_a_tiny_configuration_and_a_fingerprint():
    folders = sorted(p.name for p in (ROOT / "experiments").iterdir()
                     if (p / "experiment.py").is_file())
    assert folders == EXPERIMENTS
    assert all((ROOT / "experiments" / e / "fingerprint.json").is_file() for e in EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_fingerprint_holds(name):
    proc = labkit("fingerprint", f"experiments/{name}")
    if proc.returncode == 1 and "--add-cpu" in proc.stdout and "moved" not in proc.stdout:
        # Recorded on another CPU vendor only: the pin does not hold across vendors, so there
        # is nothing to compare with here (the message says how to add this vendor's run).
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, f"experiments/{name} is stale:\n{proc.stdout}{proc.stderr}"
    assert f"{name}: fingerprint holds" in proc.stdout


def test_an_edited_dependency_fails_the_check(tmp_path):
    """The course's own code, edited: AdamW's learning rate one part in a million higher."""
    src = Path(shutil.copytree(ROOT / "src", tmp_path / "src",
                               ignore=shutil.ignore_patterns("__pycache__")))
    optim = src / "minituner" / "optim.py"
    text = optim.read_text()
    assert "def lr_at(step: int, cfg) -> float:" in text
    optim.write_text(text.replace("def lr_at(step: int, cfg) -> float:",
                                  "def lr_at(step: int, cfg) -> float:\n"
                                  "    return _lr_at(step, cfg) * (1 + 1e-6)\n\n\n"
                                  "def _lr_at(step: int, cfg) -> float:"))
    proc = labkit("fingerprint", "experiments/00-pretrain-base", env={"PYTHONPATH": str(src)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("00-pretrain-base: STALE")
    assert "minituner/optim.py" in proc.stdout   # new since the recording, then edited
    assert "make run EXP=experiments/00-pretrain-base" in proc.stdout
