"""Fingerprints (labkit.fingerprint): `run` records the tiny configuration's result beside the
manifest; the check passes a change that moves no number and fails, naming the experiment and
the changed file, on a change that does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.numerics import pinned_env

pytestmark = pytest.mark.slow       # each case runs `python -m labkit` in subprocesses

ROOT = Path(__file__).resolve().parents[2]

# The experiment reads a constant from a module beside it: its "dependency".
EXPERIMENT = '''
import torch
import dep

def run(cfg, ctx):
    g = torch.Generator().manual_seed(cfg["seed"])
    w = torch.randn(cfg["n"], generator=g) * dep.SCALE
    torch.save({"w": w}, ctx.artifact("w.pt"))
    return {"mean": w.mean().item(), "n": cfg["n"]}
'''


def labkit(*args: str, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in pinned_env()}
    env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env)


@pytest.fixture
def exp(tmp_path) -> Path:
    """A recorded experiment (full run, manifest and fingerprint) with a dependency module."""
    (tmp_path / "dep.py").write_text("SCALE = 1.0\n")
    exp = tmp_path / "97-dep"
    exp.mkdir()
    (exp / "experiment.py").write_text(EXPERIMENT)
    (exp / "config.json").write_text(json.dumps({"seed": 0, "n": 1000}))
    (exp / "tiny.json").write_text(json.dumps({"seed": 0, "n": 7, "threads": 1}))
    proc = labkit("run", str(exp), pythonpath=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and (exp / "fingerprint.json").is_file()
    return exp


def test_run_records_the_tiny_result_beside_the_manifest(exp):
    fp = json.loads((exp / "fingerprint.json").read_text())
    manifest = json.loads((exp / "manifest.json").read_text())
    assert fp["manifest_sha256"] == manifest["manifest_sha256"] and fp["note"] is None
    assert fp["result"]["metrics"]["n"] == 7 and set(fp["result"]["artifacts"]) == {"w.pt"}
    assert fp["env"]["numerics"]["mode"] == "pinned"
    assert fp["env"]["numerics"]["intra_op_threads"] == 1       # tiny.json's threads


def test_an_unchanged_dependency_holds(exp):
    proc = labkit("fingerprint", str(exp), pythonpath=exp.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "97-dep: fingerprint holds" in proc.stdout


def test_a_refactor_that_moves_no_number_holds(exp):
    (exp.parent / "dep.py").write_text("# the scale every weight is multiplied by\nSCALE = 1.0\n")
    proc = labkit("fingerprint", str(exp), pythonpath=exp.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_edited_dependency_is_caught_naming_the_experiment(exp):
    (exp.parent / "dep.py").write_text("SCALE = 1.001\n")
    proc = labkit("fingerprint", str(exp), pythonpath=exp.parent)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("97-dep: STALE") and "moved: metrics.mean" in out
    assert "moved: artifacts.w.pt" in out and "make run EXP=experiments/97-dep" in out


def test_a_reviewed_note_refreshes_the_fingerprint_alone(exp):
    (exp.parent / "dep.py").write_text("SCALE = 1.001\n")
    proc = labkit("fingerprint", str(exp), "--write", "--note", "tiny only", pythonpath=exp.parent)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((exp / "fingerprint.json").read_text())["note"] == "tiny only"
    assert labkit("fingerprint", str(exp), pythonpath=exp.parent).returncode == 0


def test_a_fingerprint_of_another_recording_is_refused(exp):
    config = json.loads((exp / "config.json").read_text())
    (exp / "config.json").write_text(json.dumps({**config, "n": 1001}))
    proc = subprocess.run([sys.executable, "-c", "from labkit import run_experiment; "
                           f"run_experiment({str(exp)!r})"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(exp.parent)})
    assert proc.returncode == 0, proc.stderr
    out = labkit("fingerprint", str(exp), pythonpath=exp.parent)
    assert out.returncode == 1 and "belongs to another recording" in out.stdout


@pytest.mark.parametrize("setup, message", [
    (lambda e: (e / "fingerprint.json").unlink(), "fingerprint.json is missing"),
    (lambda e: (e / "fingerprint.json").write_text("{"), "fingerprint.json is not valid JSON"),
    (lambda e: (e / "tiny.json").unlink(), "has no tiny.json"),
])
def test_bad_fingerprint_files_are_one_line_errors(exp, setup, message):
    setup(exp)
    proc = labkit("fingerprint", str(exp), pythonpath=exp.parent)
    assert proc.returncode == 2 and message in proc.stderr
    last = proc.stderr.splitlines()[-1]       # after the line saying what the pin overrode
    assert last.startswith("error: ") and "Traceback" not in proc.stderr


def test_note_without_write_is_refused(exp):
    proc = labkit("fingerprint", str(exp), "--note", "x", pythonpath=exp.parent)
    assert proc.returncode == 2 and "--note goes with --write" in proc.stderr


# The pin holds within one CPU vendor: a fingerprint keeps one tiny run per vendor.

def recorded_elsewhere(exp: Path) -> str:
    """Make the fingerprint look recorded on another CPU vendor; returns this machine's."""
    fp = json.loads((exp / "fingerprint.json").read_text())
    here = fp["env"]["cpu_id"]["vendor"]
    fp["env"]["cpu_id"]["vendor"] = "OtherVendor"
    (exp / "fingerprint.json").write_text(json.dumps(fp))
    return here


def test_a_fingerprint_of_another_cpu_vendor_is_unchecked_naming_the_fix(exp):
    here = recorded_elsewhere(exp)
    (exp.parent / "dep.py").write_text("SCALE = 1.001\n")     # would be STALE, were it compared
    proc = labkit("fingerprint", str(exp), pythonpath=exp.parent)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("97-dep: UNCHECKED") and "moved" not in proc.stdout
    assert "recorded on OtherVendor CPUs" in proc.stdout and f"this {here} CPU" in proc.stdout
    assert "fingerprint experiments/97-dep --add-cpu" in proc.stdout


def test_add_cpu_keeps_the_recording_and_checks_this_vendor_against_its_own_run(exp):
    here = recorded_elsewhere(exp)
    proc = labkit("fingerprint", str(exp), "--add-cpu", "--note", "held on OtherVendor",
                  pythonpath=exp.parent)
    assert proc.returncode == 0, proc.stderr
    fp = json.loads((exp / "fingerprint.json").read_text())
    assert fp["env"]["cpu_id"]["vendor"] == "OtherVendor"            # the recording's, kept
    assert set(fp["other_cpus"]) == {here}
    assert fp["other_cpus"][here]["note"] == "held on OtherVendor"
    assert fp["other_cpus"][here]["result"]["metrics"]["n"] == 7
    assert labkit("fingerprint", str(exp), pythonpath=exp.parent).returncode == 0
    (exp.parent / "dep.py").write_text("SCALE = 1.001\n")
    stale = labkit("fingerprint", str(exp), pythonpath=exp.parent)
    assert stale.returncode == 1 and stale.stdout.startswith("97-dep: STALE")
    # a fresh --write is this vendor's recording, and drops the other vendors' entries
    assert labkit("fingerprint", str(exp), "--write", "--note", "x",
                  pythonpath=exp.parent).returncode == 0
    fp = json.loads((exp / "fingerprint.json").read_text())
    assert fp["env"]["cpu_id"]["vendor"] == here and "other_cpus" not in fp


@pytest.mark.parametrize("args, message", [
    (["--add-cpu"], "was recorded on this CPU vendor"),
    (["--add-cpu", "--write"], "give one of them"),
])
def test_add_cpu_misuse_is_a_one_line_error(exp, args, message):
    proc = labkit("fingerprint", str(exp), *args, pythonpath=exp.parent)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
