"""benchmarks/device_check.py (`make device-check`): the steps it plans, a failing or slow step
that costs only itself, the budget, the manifest with a failed part (and RESULTS.md's blocks
made from it), the copies to $OUT, and the refusal without CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit import read_manifest, write_manifest
from labkit.readme import END, gpu_marker, render

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench_gpu import H100, course, dequant_report, flat, moe_report  # noqa: E402


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


device_check = load("device_check")
bench_gpu = device_check.bench_gpu


def test_the_gpu_test_modules_are_found_by_their_marks():
    files = device_check.gpu_test_files()
    assert {"tests/miniquant/test_triton_dequant.py", "tests/minimoe/test_kernels.py",
            "tests/minirl/test_logprob_kernels.py"} <= set(files)
    assert not [f for f in files if f.startswith("tests/course/")]   # nbgrader never collected


def test_the_plan_on_a_gpu_and_tiny():
    full = [name for name, _, _ in device_check.plan(list(device_check.LIMITS_S), False, True)]
    assert full == ["gpu_tests", "bench_dequant", "bench_moe:mixtral-8x7b",
                    "bench_moe:qwen3-30b-a3b", "bench_moe:olmoe-1b-7b",
                    "bench_logprobs:4096x32000", "bench_logprobs:4096x151936",
                    "bench_logprobs:16384x32000", "bench_logprobs:16384x151936"]
    tiny = [name for name, _, _ in device_check.plan(["bench_moe", "bench_logprobs"], True, False)]
    assert tiny == ["bench_moe:mixtral-8x7b", "bench_moe:olmoe-1b-7b",
                    "bench_logprobs:16x300", "bench_logprobs:64x1000"]


def test_a_child_past_its_limit_is_stopped():
    t0 = time.perf_counter()
    with pytest.raises(bench_gpu.StepFailed, match="ran past its 1 s and was stopped"):
        bench_gpu.run_child(["-c", "import time; print('started', flush=True); time.sleep(60)"],
                            timeout=1)
    assert time.perf_counter() - t0 < 30


def step_ok(report):
    return lambda tmp, limit: dict(command="python x.py", report=report)


def step_fails(tmp, limit):
    raise bench_gpu.StepFailed("bench_moe.py failed (exit status 1)")


def step_crashes(tmp, limit):
    raise KeyError("results")


def test_a_failed_step_costs_only_itself(capsys):
    steps = [("bench_dequant", "bench_dequant", step_ok(dequant_report())),
             ("bench_moe:mixtral-8x7b", "bench_moe", step_fails),
             ("bench_moe:olmoe-1b-7b", "bench_moe", step_crashes),
             ("bench_logprobs:16x300", "bench_logprobs", step_ok({"results": []}))]
    done = device_check.run_steps(steps, tiny=False, budget=600)
    assert [s["ok"] for s in done.values()] == [True, False, False, True]
    assert done["bench_moe:mixtral-8x7b"]["error"] == "bench_moe.py failed (exit status 1)"
    assert done["bench_moe:olmoe-1b-7b"]["error"] == "KeyError: 'results'"
    out = capsys.readouterr().out
    assert "== device-check 2/4: bench_moe:mixtral-8x7b: FAILED: bench_moe.py failed" in out
    assert all(isinstance(s["seconds"], float) for s in done.values())


def test_the_budget_limits_each_step_and_skips_what_it_cannot_start():
    limits = []

    def slow(tmp, limit):
        limits.append(limit)
        time.sleep(1.2)
        return {}

    steps = [("a", "bench_dequant", slow), ("b", "bench_dequant", slow)]
    done = device_check.run_steps(steps, tiny=False, budget=device_check.MIN_START_S + 1)
    assert limits[0] == pytest.approx(device_check.MIN_START_S + 1, abs=0.5)
    assert done["a"]["ok"] and not done["b"]["ok"]
    assert done["b"]["error"].startswith("not run: ")


def device_manifest(failed_moe: bool = False, recorded_at: str = "2026-04-01T00:00:00+00:00"):
    moe = moe_report()
    done = {"gpu_tests": dict(ok=True, seconds=30.0, result=dict(
                command="python -m pytest -m gpu", returncode=0, passed=26, failed=0, errors=0,
                skipped=0)),
            "bench_dequant": dict(ok=True, seconds=20.0, result=dict(
                command="python benchmarks/bench_dequant.py --device cuda",
                report={**dequant_report(), "versions": {"bitsandbytes": None}})),
            "bench_moe:olmoe-1b-7b": (dict(ok=False, seconds=90.0, error="ran past its 90 s")
                                      if failed_moe else dict(ok=True, seconds=60.0, result=dict(
                                          command="python benchmarks/bench_moe.py",
                                          report=moe)))}
    manifest = device_check.build_manifest(
        done, tiny=False, cuda=True, git={"commit": "abc1234def", "dirty": False},
        env={"device": H100, "python": "3.12.3"}, command="python benchmarks/device_check.py",
        budget=420, wall_time_s=170.0, peak_memory_mb=3000.0)
    return {**manifest, "recorded_at": recorded_at}


def test_the_manifest_records_failed_steps_and_readme_skips_their_parts(tmp_path):
    m = device_manifest(failed_moe=True)
    assert m["metrics"]["failed_steps"] == ["bench_moe:olmoe-1b-7b"]
    assert m["metrics"]["moe"] is None and m["metrics"]["logprobs"] is None
    assert m["metrics"]["dequant"] == bench_gpu.summarize_dequant(dequant_report())
    assert m["metrics"]["bitsandbytes"].startswith("not compared (RuntimeError: no kernels")
    assert m["metrics"]["steps"]["bench_moe:olmoe-1b-7b"] == dict(
        ok=False, seconds=90.0, error="ran past its 90 s")
    assert m["timings"]["bench_moe:olmoe-1b-7b_s"] == 90.0
    assert "src/minirl/logprob_kernels.py" in m["code"]
    root = course(tmp_path, ("h100.json", m))
    words = flat(render(root))
    assert "Measured by `make device-check` on NVIDIA H100 80GB HBM3" in words
    assert "Not yet run on a GPU: `make bench-gpu` measures it in the same run" in words
    # a later result whose MoE step failed leaves the block on the one that measured it
    root = course(tmp_path / "b", ("old.json", device_manifest()),
                  ("new.json", device_manifest(True, "2026-05-01T00:00:00+00:00")))
    words = flat(render(root))
    assert "Measured by `make device-check` on NVIDIA H100 80GB HBM3 ([new.json]" in words
    assert "Measured in the same run ([old.json]" in words


def test_logprob_summary():
    report = {"dtype": "bf16", "repeats": 20, "results": [
        dict(shape=[8, 10], task="logp", backend="torch", median_ms=4.0, peak_extra_mib=300.0),
        dict(shape=[8, 10], task="logp", backend="triton", median_ms=1.0, ratio=4.0,
             peak_extra_mib=100.0, saved_mib=200.0),
        dict(shape=[8, 10], task="logp+entropy", backend="torch", skipped="out of memory"),
        dict(shape=[8, 10], task="logp+entropy", backend="triton", median_ms=2.0,
             peak_extra_mib=100.0)]}
    rows = device_check.summarize_logprobs(report)["rows"]
    assert rows[0] == dict(shape=[8, 10], task="logp", torch_ms=4.0, triton_ms=1.0, speedup=4.0,
                           torch_peak_mib=300.0, triton_peak_mib=100.0, saved_mib=200.0,
                           torch_skipped=None)
    assert rows[1]["torch_skipped"] == "out of memory" and rows[1]["speedup"] is None


def logprob_report() -> dict:
    """One shape, PyTorch 4 ms / 300 MiB against Triton 1 ms / 100 MiB for `logp`, and out of
    memory for `logp+entropy`."""
    return {"dtype": "bf16", "repeats": 20, "results": [
        dict(shape=[4096, 32000], task="logp", backend="torch", median_ms=4.0,
             peak_extra_mib=3000.0),
        dict(shape=[4096, 32000], task="logp", backend="triton", median_ms=1.0, ratio=4.0,
             peak_extra_mib=250.0, saved_mib=2750.0),
        dict(shape=[4096, 32000], task="logp+entropy", backend="torch", skipped="out of memory"),
        dict(shape=[4096, 32000], task="logp+entropy", backend="triton", median_ms=1.25,
             peak_extra_mib=250.0)]}


def test_the_logprob_block(tmp_path):
    """RESULTS.md's log-prob block: per shape and task both times, the speed-up, both peaks
    and the memory saved, from the newest result that measured it; "not yet run" before."""
    root = course(tmp_path)
    (root / "README.md").write_text(f"Log-probs:\n\n{gpu_marker('logprobs')}\nstale\n{END}\n")
    words = flat(render(root))
    assert "Not yet run on a GPU: `make device-check` measures it (`make bench-gpu` does not)" \
        in words and "stale" not in words
    m = device_manifest()
    m["metrics"]["logprobs"] = device_check.summarize_logprobs(logprob_report())
    write_manifest(root / "benchmarks" / "results" / "gpu" / "h100.json", m)
    text = render(root)
    assert "| 4096×32000 | `logp` | 4.00 | 1.00 | 4.00× | 3,000 | 250 | 2,750 |" in text
    assert "| 4096×32000 | `logp+entropy` | skipped: out of memory | 1.25 | — | — | 250 | — |" \
        in text
    assert ("Measured by `make device-check` on NVIDIA H100 80GB HBM3 ([h100.json]"
            "(benchmarks/results/gpu/h100.json), commit `abc1234`, 2026-04-01; bf16 logits, "
            "median of 20)") in flat(text)


def test_main_writes_the_result_and_the_log_to_out(monkeypatch, tmp_path):
    out_dir, result = tmp_path / "OUT", tmp_path / "result.json"
    monkeypatch.setenv("OUT", str(out_dir))
    monkeypatch.setattr(device_check, "plan", lambda kinds, tiny, cuda: [
        ("bench_dequant", "bench_dequant", step_ok({**dequant_report(),
                                                    "versions": {"bitsandbytes": None}})),
        ("bench_moe:mixtral-8x7b", "bench_moe", step_fails)])
    assert device_check.main(["--tiny", "--out", str(result), "--commit", "f00"]) == 1
    m = read_manifest(result)
    assert read_manifest(out_dir / result.name) == m
    log = (out_dir / device_check.LOG_NAME).read_text()
    assert "bench_moe:mixtral-8x7b: FAILED" in log and f"wrote {result}" in log
    assert m["experiment"] == "device-check" and m["config"]["tiny"] is True
    assert m["git"]["commit"] == "f00"          # --commit wins: a copied .git may be stale
    assert m["metrics"]["failed_steps"] == ["bench_moe:mixtral-8x7b"]


def test_refused_without_cuda(monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_check, "run_steps", lambda *a: pytest.fail("it ran"))
    assert device_check.main([]) == 2
    assert "device_check: refused: no CUDA GPU here" in capsys.readouterr().err
    assert device_check.main(["--tiny", "--out", "benchmarks/results/gpu/x.json"]) == 2
    assert "a --tiny run is a smoke test" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_tiny_dequant_step_end_to_end(tmp_path):
    """The script as `make device-check` runs it, one real step: a sealed result in $OUT."""
    out_dir = tmp_path / "OUT"
    out_dir.mkdir()
    env = {**os.environ, "OUT": str(out_dir), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "benchmarks/device_check.py", "--tiny", "--steps", "bench_dequant",
         "--out", str(tmp_path / "tiny.json")], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    m = read_manifest(out_dir / "tiny.json")
    assert list(m["metrics"]["steps"]) == ["bench_dequant"]
    assert [s["shape"] for s in m["metrics"]["dequant"]["shapes"]] == [[256, 256], [128, 512]]
    assert "== device-check 1/1: bench_dequant: ok" in (out_dir / "device-check.log").read_text()
    assert json.loads((out_dir / "tiny.json").read_text())["config"]["budget_s"] == 900
