"""benchmarks/bench_cpu.py: the CPU hot paths held to their peers (issue 33's targets)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_cpu  # noqa: E402
import cpu_cases  # noqa: E402


def test_time_pair_reports_the_ratio_of_medians_and_its_noise():
    row = bench_cpu.time_pair(lambda: time.sleep(0.004), lambda: time.sleep(0.002), repeats=6)
    assert 1.4 < row["ratio"] < 2.6, row
    assert row["noise"] >= 0 and row["repeats"] == 6


@pytest.mark.parametrize("ratio, noise, verdict", [
    (1.0, 0.0, "held"), (1.5, 0.0, "held"), (1.55, 0.0, "held"), (1.6, 0.0, "over"),
    (1.6, 0.1, "held"), (2.0, 0.1, "over"),
])
def test_a_ratio_past_its_target_by_more_than_its_noise_is_over(ratio, noise, verdict):
    assert bench_cpu.verdict({"ratio": ratio, "noise": noise, "target": 1.5}) == verdict


def test_a_case_without_a_target_is_reported():
    assert bench_cpu.verdict({"ratio": 9.0, "noise": 0.0, "target": None}) == "reported"


def test_every_target_names_a_case():
    assert set(bench_cpu.TARGETS) <= set(cpu_cases.CASES)


def test_an_unknown_case_is_refused():
    with pytest.raises(ValueError, match=r"cases must be among .*'nf4_dequant'.*got \['nope'\]"):
        bench_cpu.measure(["nope"], repeats=4)


def test_the_committed_result_holds_every_target():
    manifest = json.loads((ROOT / bench_cpu.RESULT).read_text())
    rows = manifest["metrics"]
    assert set(rows) == set(cpu_cases.CASES)
    over = {name: r["ratio"] for name, r in rows.items() if r["verdict"] == "over"}
    assert not over, f"the committed CPU result misses its targets: {over}"
    assert {name: r["target"] for name, r in rows.items()
            if r["target"] is not None} == bench_cpu.TARGETS


# Beside the suite's other worker on two cores a case bound by memory traffic slows more than
# its peer: qlora_experts measured 1.28x and 1.30x its float peer there on an Intel Xeon, where
# alone it is 1.12x (1.06-1.14x on an AMD EPYC). The committed result, measured alone, is held
# to the targets themselves (test above); here a ratio may pass its target by this factor.
SHARED_MACHINE = 1.25


@pytest.mark.slow
def test_the_hot_paths_stay_within_their_targets():
    """Fails when a held ratio passes its target (times SHARED_MACHINE) by more than the noise
    it measured: each case timed against its peer in this process, one thread, alternating."""
    rows = bench_cpu.measure(list(bench_cpu.TARGETS), repeats=7)
    over = {name: f"{r['ratio']:.2f}x {r['peer']} (target {r['target']}x, noise "
                  f"{r['noise']:.0%})" for name, r in rows.items()
            if bench_cpu.verdict({**r, "target": r["target"] * SHARED_MACHINE}) == "over"}
    assert not over, f"slower than its peer past the target: {over}"
