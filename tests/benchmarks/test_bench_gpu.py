"""benchmarks/bench_gpu.py (`make bench-gpu`): the --tiny pipeline end to end on a CPU, the
refusal without CUDA, the manifest it writes, its ratios against a hand computation, and
the GPU blocks of RESULTS.md (benchmarks/summary.py; here in a test checkout's README.md) with
and without a result."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import read_manifest, write_manifest
from labkit.errors import InputError
from labkit.readme import END, gpu_marker, render, write_readme

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"


def load_bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_gpu = load_bench_gpu()


# ---------------------------------------------------------------------------------------------
# two benchmark reports, shaped like the scripts' JSON, with numbers chosen for hand arithmetic

def dequant_report() -> dict:
    """4096x4096: Triton 2400 GB/s, copy 3000, bitsandbytes 2000; 4096x14336: no bitsandbytes."""
    measured = {(4096, 4096): dict(triton=2400.0, torch_reference=300.0, copy=3000.0,
                                   bitsandbytes=2000.0),
                (4096, 14336): dict(triton=2700.0, torch_reference=600.0, copy=3000.0)}
    rows = [dict(shape=list(shape), method=m, median_s=1e-3, bytes=1, gbps=g)
            for shape, methods in measured.items() for m, g in methods.items()]
    rows.append(dict(shape=[4096, 14336], method="bitsandbytes",
                     skipped="RuntimeError: no kernels for this device"))
    return dict(device="cuda", dtype="bf16", blocksize=64, repeats=50, results=rows)


# seconds of (fwd, fwd+bwd) without LoRA, and each method's factor with LoRA
MOE_TIMES = {
    "olmoe-1b-7b": (64, 8, {"loop": (4.0, 12.0), "triton": (1.0, 4.0), "triton_split": (2.0, 6.0),
                            "torch_sorted": (2.0, 8.0)}),
    "mixtral-8x7b": (8, 2, {"loop": (3.0, 6.0), "triton": (1.5, 4.0), "triton_split": (1.5, 4.0),
                            "torch_sorted": (3.0, 6.0)}),
}
LORA_FACTOR = {"olmoe-1b-7b": dict(loop=1.25, triton=1.1, triton_split=1.5, torch_sorted=1.2),
               "mixtral-8x7b": dict(loop=1.25, triton=1.3, triton_split=1.5, torch_sorted=1.2)}


def moe_report() -> dict:
    rows = []
    for model, (E, k, times) in MOE_TIMES.items():
        for method, (fwd, both) in times.items():
            for lora in (False, True):
                factor = LORA_FACTOR[model][method] if lora else 1.0
                for pass_, seconds in (("fwd", fwd), ("fwd+bwd", both)):
                    rows.append(dict(model=model, E=E, k=k, K=2048, N=1024, T=4096, method=method,
                                     lora_rank=16 if lora else 0, pass_=pass_,
                                     median_s=seconds * factor))
    for row in rows:
        row["pass"] = row.pop("pass_")
    return dict(device="cuda", dtype="bf16", scale=1, tokens=4096, lora_rank=16, repeats=20,
                results=rows)


def runs(failed: int = 0) -> dict:
    tests = dict(command="python -m pytest -m gpu -q", returncode=int(failed > 0), passed=20,
                 failed=failed, errors=0, skipped=2)
    return {"gpu_tests": tests,
            "bench_dequant": dict(command="python benchmarks/bench_dequant.py --device cuda",
                                  report=dequant_report()),
            "bench_moe": dict(command="python benchmarks/bench_moe.py --device cuda",
                              report=moe_report())}


def gpu_manifest(recorded_at: str = "2026-01-02T03:04:05+00:00", device: str = H100,
                 tiny: bool = False, failed: int = 0) -> dict:
    """A result as bench_gpu writes it on a GPU, from the two reports above."""
    manifest = bench_gpu.build_manifest(
        runs(failed), {"gpu_tests_s": 30.0, "bench_dequant_s": 60.0, "bench_moe_s": 200.0},
        tiny=tiny, cuda=device != "cpu", git={"commit": "abc1234def", "dirty": False},
        env={"device": device, "python": "3.11.7"}, command="python benchmarks/bench_gpu.py",
        wall_time_s=290.0, peak_memory_mb=2048.0)
    return {**manifest, "recorded_at": recorded_at}


# ---------------------------------------------------------------------------------------------
# the ratios, by hand

def test_dequant_ratios_by_hand():
    d = bench_gpu.summarize_dequant(dequant_report())
    square, wide = d["shapes"]
    assert square["shape"] == [4096, 4096] and wide["shape"] == [4096, 14336]
    assert square["triton_of_copy"] == pytest.approx(2400 / 3000)          # 0.80: on the target
    assert square["triton_vs_bitsandbytes"] == pytest.approx(2400 / 2000)  # 1.20
    assert square["reference_of_copy"] == pytest.approx(0.1)
    assert wide["triton_of_copy"] == pytest.approx(0.9)
    assert wide["triton_vs_bitsandbytes"] is None
    assert wide["bitsandbytes_skipped"] == "RuntimeError: no kernels for this device"
    assert d["met"] == {"triton_of_copy": [2, 2], "triton_vs_bitsandbytes": [1, 1]}
    assert d["targets"] == {"triton_of_copy": 0.8, "triton_vs_bitsandbytes": 1.0}
    assert (d["dtype"], d["blocksize"], d["repeats"]) == ("bf16", 64, 50)


def test_moe_ratios_by_hand():
    m = bench_gpu.summarize_moe(moe_report())
    olmoe, mixtral = m["models"]
    assert (olmoe["model"], olmoe["E"], olmoe["many_experts"]) == ("olmoe-1b-7b", 64, True)
    assert (mixtral["E"], mixtral["many_experts"]) == (8, False)
    # the loop's time over the method's, same pass, both without LoRA
    assert olmoe["vs_loop"]["triton"] == pytest.approx({"fwd": 4 / 1, "fwd+bwd": 12 / 4})
    assert olmoe["vs_loop"]["torch_sorted"] == pytest.approx({"fwd": 2.0, "fwd+bwd": 1.5})
    # ... both with LoRA: (12 x 1.25) / (4 x 1.1)
    assert olmoe["vs_loop_lora"]["triton"]["fwd+bwd"] == pytest.approx(15 / 4.4)
    # LoRA's overhead: the method with LoRA over itself without, minus one
    assert olmoe["lora_overhead"]["triton"] == pytest.approx({"fwd": 0.1, "fwd+bwd": 0.1})
    assert olmoe["lora_overhead"]["triton_split"]["fwd+bwd"] == pytest.approx(0.5)
    assert mixtral["vs_loop"]["triton"]["fwd+bwd"] == pytest.approx(1.5)
    assert mixtral["lora_overhead"]["triton"]["fwd+bwd"] == pytest.approx(0.3)
    # 2x the loop counts at many-expert shapes only (olmoe: 3.0); LoRA <= 20% at both (0.1, 0.3)
    assert m["met"] == {"triton_vs_loop_fwd_bwd": [1, 1], "triton_lora_overhead": [1, 2]}
    assert (m["many_experts"], m["lora_rank"], m["scale"], m["tokens"]) == (64, 16, 1, 4096)


def test_the_scripts_own_ratios_agree():
    """bench_moe.py's speedup_vs_loop and lora_overhead, where the report has them, are the
    same numbers as the summary's (the loop's row against the method's)."""
    report = moe_report()
    summary = bench_gpu.summarize_moe(report)
    row = next(r for r in report["results"] if r["model"] == "olmoe-1b-7b"
               and r["method"] == "triton" and r["pass"] == "fwd+bwd" and r["lora_rank"])
    loop = next(r for r in report["results"] if r["model"] == "olmoe-1b-7b"
                and r["method"] == "loop" and r["pass"] == "fwd+bwd" and r["lora_rank"])
    assert (summary["models"][0]["vs_loop_lora"]["triton"]["fwd+bwd"]
            == loop["median_s"] / row["median_s"])


# ---------------------------------------------------------------------------------------------
# where it writes, and what it refuses

def test_result_paths():
    assert bench_gpu.slug(H100) == "nvidia-h100-80gb-hbm3"
    assert (bench_gpu.result_path(False, True, H100, None)
            == ROOT / "benchmarks" / "results" / "gpu" / "nvidia-h100-80gb-hbm3.json")
    assert (bench_gpu.result_path(True, False, "cpu", None)
            == ROOT / "build" / "bench-gpu" / "tiny-cpu.json")
    assert (bench_gpu.result_path(True, True, H100, None)
            == ROOT / "build" / "bench-gpu" / "tiny-nvidia-h100-80gb-hbm3.json")


@pytest.mark.parametrize("argv, message", [
    ([], "no CUDA GPU here"),
    (["--out", "elsewhere.json"], "no CUDA GPU here"),
    (["--tiny", "--out", "benchmarks/results/gpu/cpu.json"], "a --tiny run is a smoke test"),
])
def test_refused_before_anything_runs(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_gpu, "measure_all", lambda *a: pytest.fail("it ran"))
    monkeypatch.chdir(ROOT if "--tiny" in argv else tmp_path)
    before = sorted((ROOT / "benchmarks" / "results" / "gpu").iterdir())
    assert bench_gpu.main(argv) == 2
    err = capsys.readouterr().err
    assert f"bench_gpu: refused: {message}" in err
    assert "--tiny" in err and "benchmarks/results/gpu" in err
    assert sorted((ROOT / "benchmarks" / "results" / "gpu").iterdir()) == before
    assert not (tmp_path / "elsewhere.json").exists()


@pytest.mark.parametrize("failed, status", [(0, 0), (2, 1)])
def test_the_manifest_it_writes(failed, status, monkeypatch, tmp_path):
    """main() with the three steps stubbed: a sealed manifest holding the device, the commands,
    the commit, the tests' counts and the ratios; exit status 1 when a GPU test failed."""
    monkeypatch.setattr(bench_gpu, "measure_all",
                        lambda tiny, cuda, gpu_tests: (runs(failed), {"gpu_tests_s": 1.0}))
    out = tmp_path / "result.json"
    assert bench_gpu.main(["--tiny", "--out", str(out)]) == status
    m = read_manifest(out)                      # sealed: an edited result would be refused
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    assert m["git"]["commit"] == head and isinstance(m["git"]["dirty"], bool)
    assert m["command"] == f"python benchmarks/bench_gpu.py --tiny --out {out}"
    assert m["env"]["device"] == m["metrics"]["device_name"] == device
    assert {"python", "torch", "triton", "bitsandbytes", "cuda"} <= set(m["env"])
    assert m["config"]["tiny"] is True and m["experiment"] == "bench-gpu"
    assert m["metrics"]["gpu_tests"]["failed"] == failed
    assert m["metrics"]["gpu_tests"]["command"] == "python -m pytest -m gpu -q"
    assert m["metrics"]["dequant"] == bench_gpu.summarize_dequant(dequant_report())
    assert m["runs"]["bench_moe"]["report"] == moe_report()
    assert m["timings"] == {"gpu_tests_s": 1.0} and m["recorded_at"]
    assert {"benchmarks/bench_gpu.py", "benchmarks/bench_moe.py",
            "src/minimoe/kernels.py", "src/miniquant/triton_dequant.py"} <= set(m["code"])


def test_a_step_that_fails_writes_nothing(monkeypatch, capsys, tmp_path):
    run_bench = bench_gpu.run_bench
    monkeypatch.setattr(bench_gpu, "run_gpu_tests", lambda tmp, paths: runs()["gpu_tests"])
    monkeypatch.setattr(bench_gpu, "run_bench",
                        lambda script, args, tmp: run_bench("no_such_script.py", args, tmp))
    out = tmp_path / "result.json"
    assert bench_gpu.main(["--tiny", "--out", str(out)]) == 1
    assert ("bench_gpu: no_such_script.py failed (exit status 2); no result written"
            in capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tmp_path):
    """`bench_gpu.py --tiny`: pytest -m gpu, both benchmarks at their smoke shapes, one result,
    written where it was told (and nothing under benchmarks/results/gpu/)."""
    out, results = tmp_path / "tiny.json", ROOT / "benchmarks" / "results" / "gpu"
    before = sorted(results.iterdir())
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--tiny", "--out", str(out),
         "--gpu-tests", "tests/miniquant/test_triton_dequant.py"],   # one file: quick to collect
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(results.iterdir()) == before
    m = read_manifest(out)
    assert f"wrote {out}" in done.stdout and "GPU tests on " in done.stdout
    cuda = torch.cuda.is_available()
    assert m["metrics"]["device_name"] == (torch.cuda.get_device_name(0) if cuda else "cpu")
    tests = m["metrics"]["gpu_tests"]
    assert tests["failed"] == tests["errors"] == 0
    assert tests["skipped"] > 0 if not cuda else tests["passed"] > 0
    assert m["runs"]["bench_moe"]["command"].endswith("--tiny --models mixtral-8x7b,olmoe-1b-7b "
                                                      "--rank 4")
    assert m["metrics"]["dequant"] == bench_gpu.summarize_dequant(m["runs"]["bench_dequant"]
                                                                  ["report"])
    assert m["metrics"]["moe"] == bench_gpu.summarize_moe(m["runs"]["bench_moe"]["report"])
    assert [s["model"] for s in m["metrics"]["moe"]["models"]] == ["mixtral-8x7b", "olmoe-1b-7b"]
    assert set(m["timings"]) == {"gpu_tests_s", "bench_dequant_s", "bench_moe_s"}


# ---------------------------------------------------------------------------------------------
# The GPU blocks (RESULTS.md's; the generator fills any document of labkit.readme.DOCS)

README = (f"# Demo\n\nDequant:\n\n{gpu_marker('dequant')}\nstale\n{END}\n\nMoE:\n\n"
          f"{gpu_marker('moe')}\n{END}\n")


def course(tmp_path: Path, *manifests: tuple[str, dict]) -> Path:
    """A checkout holding README.md, benchmarks/summary.py and the given GPU results."""
    (tmp_path / "benchmarks" / "results" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "summary.py", tmp_path / "benchmarks" / "summary.py")
    (tmp_path / "README.md").write_text(README)
    for name, manifest in manifests:
        write_manifest(tmp_path / "benchmarks" / "results" / "gpu" / name, manifest)
    return tmp_path


def flat(text: str) -> str:
    return " ".join(text.split())


def test_readme_without_a_gpu_result(tmp_path):
    root = course(tmp_path)
    (root / "benchmarks" / "results" / "gpu" / "README.md").write_text("not a result\n")
    text = flat(render(root))
    assert "Not yet run on a GPU: `benchmarks/results/gpu/` holds no result." in text
    assert ("`make bench-gpu` on a CUDA machine writes `benchmarks/results/gpu/<device>.json`"
            in text)
    assert "Not yet run on a GPU: `make bench-gpu` measures it in the same run" in text
    assert "stale" not in text


def test_readme_with_a_gpu_result(tmp_path):
    root = course(tmp_path)
    assert write_readme(root) is False                          # the blocks: not yet run
    write_manifest(root / "benchmarks/results/gpu/nvidia-h100-80gb-hbm3.json", gpu_manifest())
    assert write_readme(root, check=True) is False              # a result arrived: stale
    assert write_readme(root) is False and write_readme(root, check=True)
    text = (root / "README.md").read_text()
    assert "Not yet run" not in text
    assert "| 4096×4096 | 2,400 | 3,000 | 0.80 | 2,000 | 1.20× |" in text
    assert "| 4096×14336 | 2,700 | 3,000 | 0.90 | — | — |" in text
    assert ("| olmoe-1b-7b | 64, 8 | 2048 × 1024 | 4.00× | 3.00× | 3.41× | 1.50× | +10% | +50% |"
            in text)
    assert "| mixtral-8x7b | 8, 2 | 2048 × 1024 | 2.00× | 1.50× |" in text
    words = flat(text)
    assert f"on {H100} ([nvidia-h100-80gb-hbm3.json]" in words
    assert "commit `abc1234`, 2026-01-02" in words
    assert "the GPU tests in the same run: 20 passed, 0 failed, 2 skipped" in words
    assert "Triton ≥ 0.80 of the copy (met at 2 of 2 shapes)" in words
    assert "≥ 1.00× bitsandbytes (met at 1 of 1 shapes); bitsandbytes did not run:" in words
    assert "≥ 2× the loop at many-expert shapes (E ≥ 64; met at 1 of 1 models)" in words
    assert "fused LoRA overhead ≤ 20% (met at 1 of 2 models)" in words


def test_readme_shows_the_newest_result_and_failures(tmp_path):
    root = course(tmp_path, ("a100.json", gpu_manifest("2026-03-01T00:00:00+00:00", "A100")),
                  ("h100.json", gpu_manifest("2026-02-01T00:00:00+00:00", H100, failed=3)))
    words = flat(render(root))
    assert "on A100 ([a100.json](benchmarks/results/gpu/a100.json)" in words
    assert "other GPUs: [h100.json](benchmarks/results/gpu/h100.json)" in words
    root = course(tmp_path / "b", ("h100.json", gpu_manifest(device=H100, failed=3)))
    assert "20 passed, **3 failed**, 2 skipped" in flat(render(root))


@pytest.mark.parametrize("tiny, device", [(True, H100), (False, "cpu")])
def test_readme_refuses_a_smoke_run_among_the_results(tmp_path, tiny, device):
    root = course(tmp_path, ("x.json", gpu_manifest(device=device, tiny=tiny)))
    with pytest.raises(InputError, match="README.md line 5: benchmarks/results/gpu/x.json is a "
                                         "--tiny or CPU run, not a GPU's result"):
        render(root)


def test_readme_refuses_an_edited_result(tmp_path):
    root = course(tmp_path, ("h100.json", gpu_manifest()))
    path = root / "benchmarks" / "results" / "gpu" / "h100.json"
    path.write_text(path.read_text().replace("2400.0", "2900.0"))
    with pytest.raises(InputError, match="README.md line 5: manifest .* was edited"):
        render(root)
