"""benchmarks/bench_dequant.py --tiny runs on CPU and writes a complete JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"triton", "torch_reference", "bitsandbytes", "copy"}


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_tiny_cpu_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dequant.py"), "--tiny",
         "--device", "cpu", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "GB/s" in done.stdout and "of copy" in done.stdout

    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["triton_interpreter"] is True
    for key in ("dtype", "blocksize", "repeats", "warmup", "versions", "bytes_counted"):
        assert key in report
    rows = report["results"]
    shapes = {tuple(r["shape"]) for r in rows}
    assert (256, 256) in shapes
    for shape in shapes:
        measured = {r["method"]: r for r in rows if tuple(r["shape"]) == shape and "gbps" in r}
        assert {"triton", "torch_reference", "copy"} <= set(measured) <= METHODS
        for r in measured.values():
            for field in ("median_s", "bytes", "gbps", "frac_of_copy"):
                assert r[field] > 0, (shape, r)
        assert measured["copy"]["frac_of_copy"] == 1.0
        n = shape[0] * shape[1]
        expected = n // 2 + 4 * n // report["blocksize"] + 2 * n  # bf16 out
        assert measured["triton"]["bytes"] == expected
