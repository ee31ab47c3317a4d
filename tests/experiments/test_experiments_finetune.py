"""Experiments 05 and 06 end to end through the CLI on tiny configs (the committed manifests
stay the full runs): 05 writes PEFT-format adapters, 06 loads them onto an NF4 base, and
`reproduce` of 06 is identical."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import read_manifest

# Each test re-runs an experiment (05, 06, 11) end to end: 2 to 40 s apiece on a 2-core CPU.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def tiny_configs() -> dict[str, dict]:
    """Each experiment's tiny.json: the configuration its fingerprint check runs."""
    return {name: json.loads((ROOT / "experiments" / name / "tiny.json").read_text())
            for name in ("05-lora-finetune", "06-qlora-preview")}


def labkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exp")
    for name, cfg in tiny_configs().items():
        exp = root / name
        exp.mkdir()
        shutil.copy(ROOT / "experiments" / name / "experiment.py", exp)
        (exp / "config.json").write_text(json.dumps(cfg))
        proc = labkit("run", str(exp))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_05_writes_adapters_and_exact_match(runs):
    exp = runs / "05-lora-finetune"
    manifest = read_manifest(exp / "manifest.json")
    assert set(manifest["artifacts"]) == {f"adapter_{r}/{f}" for r in ("rev_only", "rev_replay")
                                          for f in ("adapter_model.safetensors",
                                                    "adapter_config.json")}
    m = manifest["metrics"]
    assert set(m["before"]) == set(m["rev_only"]["exact_match_after"])
    assert [e["step"] for e in m["rev_replay"]["evals"]] == [2, 4]
    assert all("val_loss" in e for e in m["rev_replay"]["evals"])
    assert (exp / "rev_replay.jsonl").is_file() and (exp / "REPORT.md").is_file()


def test_06_records_its_inputs_and_reproduces(runs):
    exp = runs / "06-qlora-preview"
    manifest = read_manifest(exp / "manifest.json")
    inputs = manifest["inputs"]
    assert any(k.endswith("adapter_rev_replay/adapter_model.safetensors") for k in inputs)
    assert any(k.endswith("base_dense.safetensors") for k in inputs)
    m = manifest["metrics"]
    assert m["qlora_epoch"]["all_finite"] and m["qlora_epoch"]["stopped_early"] is None
    assert labkit("report", str(exp), "--check").returncode == 0    # REPORT.md: its manifest
    lora, qlora = (m["memory"][k]["measured"] for k in m["memory"])
    assert qlora["weights"] < lora["weights"] / 3 and qlora["grads"] == lora["grads"]
    assert m["swap"]["mean_abs_diff"] > 0
    assert m["llama_7b"]["qlora"]["total"] < m["llama_7b"]["lora"]["total"]
    proc = labkit("reproduce", str(exp / "manifest.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REPRODUCED" in proc.stdout


def test_06_refuses_a_changed_adapter(runs):
    """A manifest whose input adapter changed is refused (exit 2), nothing re-run."""
    adapter = runs / "05-lora-finetune/adapter_rev_replay/adapter_config.json"
    original = adapter.read_text()
    adapter.write_text(original + " ")
    try:
        proc = labkit("reproduce", str(runs / "06-qlora-preview/manifest.json"))
    finally:
        adapter.write_text(original)
    assert proc.returncode == 2
    assert "has changed since the manifest was written" in proc.stderr


def _run_tiny_11(tmp_path, **train) -> dict:
    """Experiment 11 on a tiny config (train overrides on top); its manifest's metrics."""
    exp = tmp_path / "11-qlora-moe"
    exp.mkdir()
    for script in ("experiment.py", "report.py"):
        shutil.copy(ROOT / "experiments/11-qlora-moe" / script, exp)
    cfg = json.loads((ROOT / "experiments/11-qlora-moe/tiny.json").read_text())
    cfg["train"].update(train)
    (exp / "config.json").write_text(json.dumps(cfg))
    proc = labkit("run", str(exp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_manifest(exp / "manifest.json")["metrics"]


def test_11_qlora_moe_tiny(tmp_path):
    """Experiment 11 end to end on a tiny config: the Triton and PyTorch MoE paths agree on a
    training step, the predictor equals the held weights / grads exactly and the activations
    within 10 %, checkpointing cuts the saved activations and the step's peak, every run
    finishes finite, figures are written."""
    exp = tmp_path / "11-qlora-moe"
    m = _run_tiny_11(tmp_path)
    assert m["triton_check"]["max_rel_grad_diff"] < 1e-4
    assert set(m["runs"]) == {"qlora_moe", "lora_moe", "dense_qlora", "qlora_moe_rw"}
    assert all(r["stopped_early"] is None for r in m["runs"].values())
    for regime in ("full", "lora", "qlora"):
        row = m["memory"][regime]
        assert row["measured"]["weights"] == row["predicted"]["weights"]
        assert row["measured"]["grads"] == row["predicted"]["grads"]
        pred, meas = row["predicted"]["activations"], row["measured"]["activations"]
        assert abs(meas - pred) <= 0.1 * pred, (regime, meas, pred)
    ckpt = m["memory"]["checkpointing"]
    assert ckpt["activations_on"] * 5 < ckpt["activations_off"]
    assert ckpt["peak_on"] < ckpt["peak_off"]
    assert len(m["runs"]["qlora_moe"]["lora_norms"]["blocks.0.mlp.w_up"]) == 8
    assert m["extrapolate"]["llama-65b"]["qlora"]["total"] < 48e9
    for png in ("curves.png", "routing.png", "lora_norms.png", "memory.png"):
        assert (exp / png).is_file()
    proc = labkit("report", str(exp), "--check")     # the run's report is its manifest's
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_11_diverging_run_is_stopped_and_recorded(tmp_path):
    """A learning rate that blows the model up: the NaN guard stops each fine-tune, keeps the
    last finite weights, and the manifest says at which step, in which tensor, and why."""
    m = _run_tiny_11(tmp_path, lr=1e12, steps=4, warmup_steps=0, grad_clip=0.0, grad_clip_value=0.0)
    stops = {name: r["stopped_early"] for name, r in m["runs"].items()}
    assert all(s is not None for s in stops.values()), stops
    for s in stops.values():
        assert 1 <= s["step"] <= 4 and s["tensor"] and "non-finite" in s["reason"], s
    for r in m["runs"].values():    # scored, or the reason it could not be
        assert (r["exact_match_after"] is None) == ("not_evaluated" in r)
    assert (tmp_path / "11-qlora-moe" / "REPORT.md").read_text().count("stopped at step") == 4
