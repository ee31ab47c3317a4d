"""benchmarks/bench_moe.py --tiny runs on CPU and writes a complete JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_tiny_cpu_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--tiny", "--device", "cpu",
         "--models", "mixtral-8x7b,olmoe-1b-7b", "--rank", "4", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "TFLOP/s" in done.stdout and "vs loop" in done.stdout

    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["triton_interpreter"] is True
    for key in ("dtype", "scale", "tokens", "lora_rank", "repeats", "warmup", "versions",
                "flops_counted"):
        assert key in report
    rows = report["results"]
    assert {r["model"] for r in rows} == {"mixtral-8x7b", "olmoe-1b-7b"}
    assert {(r["method"], r["pass"], r["lora_rank"]) for r in rows} == {
        (m, p, lr) for m in ("triton", "triton_split", "torch_sorted", "loop")
        for p in ("fwd", "fwd+bwd")
        for lr in (0, 4)}
    for r in rows:
        assert r["median_s"] > 0 and r["tflops"] > 0 and r["speedup_vs_loop"] > 0
        base = 2 * r["T"] * r["k"] * r["K"] * r["N"]
        lora = 2 * r["T"] * r["k"] * r["lora_rank"] * (r["K"] + r["N"])
        assert r["flops"] == (1 if r["pass"] == "fwd" else 3) * (base + lora)
        assert ("lora_overhead" in r) == (r["lora_rank"] > 0)
        if r["method"] == "loop":
            assert r["speedup_vs_loop"] == 1.0
    mixtral = next(r for r in rows if r["model"] == "mixtral-8x7b")
    assert (mixtral["E"], mixtral["k"], mixtral["K"], mixtral["N"]) == (8, 2, 32, 112)


def test_per_expert_loop_matches_reference():
    import importlib.util

    import torch

    from minimoe import reference

    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "benchmarks" / "bench_moe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    per_expert_loop = bench.per_expert_loop

    gen = torch.Generator().manual_seed(0)
    x, W = torch.randn(6, 8, generator=gen), torch.randn(4, 8, 5, generator=gen)
    A, B = torch.randn(2 * 4, 8, generator=gen), torch.randn(5, 2 * 4, generator=gen)
    experts = torch.tensor([[0, 2], [2, 1], [1, 0], [0, 2], [2, 0], [1, 2]])  # 3 never chosen
    gates = torch.rand(6, 2, generator=gen)
    got = per_expert_loop(x, W, gates, experts, A, B, 0.5)
    want = reference.linear_loop(x, W, experts, gates, A, B, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
