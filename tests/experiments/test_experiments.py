"""labkit run / reproduce end to end on experiment 00 with a tiny config, plus bad manifests.

The committed manifest stays the full run; these tests copy the experiment into a temporary
folder with a config small enough for CI and drive the CLI as a user would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from labkit import read_manifest
from labkit.experiment import verify_files
from labkit.manifest import seal

ROOT = Path(__file__).resolve().parents[2]
EXP00 = ROOT / "experiments" / "00-pretrain-base"

# The tiny configuration the fingerprint check also runs (experiments/00-pretrain-base/tiny.json).
TINY = json.loads((EXP00 / "tiny.json").read_text())


def labkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """Experiment 00 copied with the tiny config and run once through the CLI."""
    exp = tmp_path_factory.mktemp("exp") / "00-pretrain-base"
    exp.mkdir()
    shutil.copy(EXP00 / "experiment.py", exp)
    (exp / "config.json").write_text(json.dumps(TINY))
    proc = labkit("run", str(exp))
    assert proc.returncode == 0, proc.stderr
    return exp


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A private copy of the tiny run, free to tamper with."""
    return Path(shutil.copytree(tiny_run, tmp_path / tiny_run.name))


@pytest.mark.slow
def test_run_writes_manifest_and_artifacts(tiny_run):
    manifest = read_manifest(tiny_run / "manifest.json")
    assert set(manifest["artifacts"]) == {"base_dense.safetensors", "base_moe.safetensors"}
    assert manifest["config"] == TINY and manifest["seed"] == 3
    assert manifest["env"]["torch"] == metadata.version("torch")
    assert set(manifest["data"]) == {"train"}
    assert json.loads((tiny_run / "metrics.json").read_text()) == manifest["metrics"]
    for name in ("REPORT.md", "loss_curve.png"):
        assert (tiny_run / name).is_file()
    assert not list(tiny_run.glob(".run-*")), "temporary run folder left behind"
    moe = manifest["metrics"]["moe"]
    assert len(moe["expert_load"]["copy"]) == 1 and len(moe["expert_load"]["copy"][0]) == 3
    assert manifest["wall_time_s"] > 0 and manifest["peak_memory_mb"] > 0


@pytest.mark.slow
def test_reproduce_is_identical(run_copy):
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    proc = labkit("reproduce", str(run_copy / "manifest.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REPRODUCED" in proc.stdout and "exact" in proc.stdout
    after = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    assert before == after, "reproduce must not overwrite anything"


@pytest.mark.slow
def test_reproduce_names_every_moved_number(run_copy):
    path = run_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metrics"]["dense"]["final_loss"] += 0.5
    manifest["metrics"]["moe"]["exact_match"]["kv"] = 0.123
    path.write_text(json.dumps(seal(manifest)))     # a validly sealed, different result
    proc = labkit("reproduce", str(path))
    assert proc.returncode == 1
    assert "dense.final_loss" in proc.stdout and "moe.exact_match.kv" in proc.stdout
    assert "NOT REPRODUCED: 2 number(s) and 0 dataset(s) moved" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("damage, message", [
    ("delete", "manifest not found"),
    ("garble", "not valid JSON"),
    ("edit", "was edited"),
    ("drop_field", "missing fields"),
    ("checkpoint", "has changed since the manifest was written"),
    ("delete_checkpoint", "is missing"),
])
def test_reproduce_refuses_bad_manifest(run_copy, damage, message):
    path = run_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    if damage == "delete":
        path.unlink()
    elif damage == "garble":
        path.write_text(path.read_text()[:-20])
    elif damage == "edit":
        manifest["metrics"]["dense"]["final_loss"] = 0.0
        path.write_text(json.dumps(manifest))
    elif damage == "drop_field":
        del manifest["artifacts"]
        path.write_text(json.dumps(manifest))
    elif damage == "checkpoint":
        with open(run_copy / "base_dense.safetensors", "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
    elif damage == "delete_checkpoint":
        (run_copy / "base_moe.safetensors").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in run_copy.iterdir()}
    proc = labkit("reproduce", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in run_copy.iterdir()} == before


def test_run_failure_writes_nothing(tmp_path):
    exp = tmp_path / "00-broken"
    exp.mkdir()
    (exp / "experiment.py").write_text(
        "def run(cfg, ctx):\n"
        "    ctx.artifact('half.bin').write_bytes(b'x')\n"
        "    raise RuntimeError('diverged at step 3')\n")
    (exp / "config.json").write_text(json.dumps({"seed": 0}))
    proc = labkit("run", str(exp))
    assert proc.returncode != 0 and "diverged at step 3" in proc.stderr
    assert sorted(p.name for p in exp.iterdir()) == ["config.json", "experiment.py"]


def test_run_rejects_config_without_seed(tmp_path):
    exp = tmp_path / "00-noseed"
    exp.mkdir()
    (exp / "experiment.py").write_text("def run(cfg, ctx):\n    return {}\n")
    (exp / "config.json").write_text("{}")
    proc = labkit("run", str(exp))
    assert proc.returncode == 2 and "config.json has no 'seed'" in proc.stderr


@pytest.mark.skipif(not (EXP00 / "manifest.json").is_file(), reason="full run not committed")
def test_committed_manifest_matches_its_files():
    manifest = read_manifest(EXP00 / "manifest.json")
    verify_files(manifest, EXP00)
    dense, moe = manifest["metrics"]["dense"], manifest["metrics"]["moe"]
    assert 0.8e6 <= dense["params"] <= 1.3e6
    assert 4 <= manifest["config"]["models"]["moe"]["model"]["n_experts"] <= 8
    assert manifest["config"]["models"]["moe"]["model"]["top_k"] == 2
    for m in (dense, moe):
        assert m["held_out_exact_match"] <= 0.05
        assert m["pretrain_mean_exact_match"] >= 0.5
    assert manifest["timings"]["dense_train_s"] <= 600
    assert manifest["timings"]["moe_train_s"] <= 600
