"""The committed experiments' adapters: every run's final adapter is a PEFT folder hashed in
its manifest; `lora_norms` reads each back to the `adapter_norm` its metrics recorded; the
capstone report's norm tables are what `python -m minituner.lora_norms --grid` prints from the
saved file; and the capstone's adapter loads into a fresh QLoRA MiniGPT-MoE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minituner.lora_norms import adapter_norms, grid, main, total_norm

ROOT = Path(__file__).resolve().parents[2]
EXP = ROOT / "experiments"


def _runs() -> list[tuple[str, str, dict]]:
    """(experiment, adapter folder, the metrics entry recording its adapter_norm)."""
    out = []
    for name, runs in (("05-lora-finetune", ("rev_only", "rev_replay")),
                       ("06-qlora-preview", ("qlora_epoch",))):
        metrics = json.loads((EXP / name / "metrics.json").read_text())
        out += [(name, "adapter_qlora" if run == "qlora_epoch" else f"adapter_{run}",
                 metrics[run]) for run in runs]
    metrics = json.loads((EXP / "11-qlora-moe" / "metrics.json").read_text())
    out += [("11-qlora-moe", f"adapter_{run}", m) for run, m in metrics["runs"].items()]
    metrics = json.loads((EXP / "12-grpo" / "metrics.json").read_text())
    out += [("12-grpo", f"adapter_{run}_{kind}", m) for kind in ("dense", "moe")
            for run, m in metrics[kind]["runs"].items()]
    return out


RUNS = _runs()


@pytest.mark.parametrize("name, folder, entry", RUNS, ids=[f"{n}/{f}" for n, f, _ in RUNS])
def test_adapter_is_hashed_and_reads_back_to_its_recorded_norm(name, folder, entry):
    manifest = json.loads((EXP / name / "manifest.json").read_text())
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        assert f"{folder}/{file}" in manifest["artifacts"], f"{name}: {folder}/{file} not hashed"
    # The bytes are held by the manifest's sha256; the norm is recomputed here without the
    # pin, whose float64 sums round by the CPU's vector width and vendor (an Intel Xeon reads
    # an AMD recording's norms one ulp off), so it is held to 1e-12, far below what any
    # changed weight moves.
    assert total_norm(EXP / name / folder) == pytest.approx(entry["adapter_norm"], rel=1e-12)


def test_capstone_report_tables_are_the_cli_grid(capsys):
    folder = EXP / "11-qlora-moe" / "adapter_qlora_moe"
    tables = grid(adapter_norms(folder))
    assert tables in (EXP / "11-qlora-moe" / "REPORT.md").read_text()
    assert main([str(folder), "--grid"]) == 0
    assert tables in capsys.readouterr().out


def test_capstone_adapter_loads_into_a_fresh_qlora_model():
    from minigpt import load_base
    from minituner import load_adapter
    from minituner.qlora import wrap_minigpt_qlora
    config = json.loads((EXP / "11-qlora-moe" / "config.json").read_text())
    model = load_base("moe")
    wrap_minigpt_qlora(model, quant_scheme=config["quant_scheme"], **config["lora"])
    report = load_adapter(model, EXP / "11-qlora-moe" / "adapter_qlora_moe")
    assert report.ok and report.wrapped == []
    expert = model.blocks[0].mlp.w_gate
    saved = {t.name: t.experts for t in adapter_norms(EXP / "11-qlora-moe" / "adapter_qlora_moe")}
    E, r = expert.n_experts, expert.r
    got = [float((expert.scaling * expert.lora_B[:, e * r:(e + 1) * r]
                  @ expert.lora_A[e * r:(e + 1) * r]).norm()) for e in range(E)]
    assert got == pytest.approx(saved["blocks.0.mlp.w_gate"], rel=1e-5)
