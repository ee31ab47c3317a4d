"""`make bench-gpu`: the GPU tests and both kernel benchmarks in one run, into one result file.

    python benchmarks/bench_gpu.py [--tiny] [--out path.json]

On a CUDA machine, one run does, in order:

1. `pytest -m gpu`: the tests that need a GPU (counted: passed, failed, errors, skipped);
2. `bench_dequant.py` at its full shapes: Triton NF4 dequant, the PyTorch reference,
   bitsandbytes and a plain copy, in GB/s;
3. `bench_moe.py` at the real models' shapes: Triton `parallel_linear`, the sorted PyTorch
   path and the per-expert loop, with and without expert LoRA;
4. the ratios the course holds itself to (docs/ARCHITECTURE.md, Performance targets), per
   shape, from the two scripts' JSON:
   Triton dequant as a fraction of the copy's GB/s and against bitsandbytes; the MoE
   kernels' speed-up over the loop and what LoRA adds to their time;

and writes them as one manifest (labkit's writer: sealed, written atomically; commit and
dirty flag, versions, the device's name, the commands, timings, both scripts' full reports)
to `benchmarks/results/gpu/<device>.json`. `make readme` fills RESULTS.md's benchmark blocks
from the newest file there (`benchmarks/summary.py`).

`--tiny` checks the pipeline on any machine (CPU: the Triton interpreter) at the smoke shapes
and two MoE models; it writes `build/bench-gpu/tiny-<device>.json` (or `--out`), never under
`benchmarks/results/gpu/`, so that a smoke run cannot pass for a measurement. Without a CUDA
GPU and without `--tiny` the script refuses to start. Exit status: 0, 1 when a GPU test failed
(the result is still written, and says so) or a step did not finish (nothing written), 2
refused.

`peak_memory_mb` is the largest child process's peak resident (host) memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import torch

from labkit.hashing import sha256_file
from labkit.manifest import environment, git_state, write_manifest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks/results/gpu")                    # relative to ROOT
TINY_DIR = Path("build/bench-gpu")
# What the timings measure: these scripts and the two packages whose kernels they time.
CODE = ("benchmarks/bench_gpu.py", "benchmarks/bench_dequant.py", "benchmarks/bench_moe.py",
        "benchmarks/timing.py", "src/miniquant", "src/minimoe")
TINY_MOE_MODELS, TINY_MOE_RANK = ("mixtral-8x7b", "olmoe-1b-7b"), 4  # few and many experts
TINY_MOE = ["--models", ",".join(TINY_MOE_MODELS), "--rank", str(TINY_MOE_RANK)]
# docs/ARCHITECTURE.md, Performance targets, checked per shape; "many experts" is where the
# MoE target applies.
TARGETS = {"triton_of_copy": 0.8, "triton_vs_bitsandbytes": 1.0,
           "triton_vs_loop_fwd_bwd": 2.0, "triton_lora_overhead": 0.2}
MANY_EXPERTS = 64
MOE_METHODS = ("triton", "triton_split", "torch_sorted")
PASSES = ("fwd", "fwd+bwd")


class Refused(Exception):
    """A run this script will not make (exit status 2)."""


class StepFailed(Exception):
    """A step that did not finish; its own output above says why (exit status 1)."""


def add_output_args(p: argparse.ArgumentParser, tiny_dir: Path) -> None:
    """--tiny and --out, as bench_gpu.py and device_check.py both take them."""
    p.add_argument("--tiny", action="store_true",
                   help=f"pipeline check at smoke shapes (CPU allowed); writes under {tiny_dir}")
    p.add_argument("--out", default=None,
                   help=f"result path (default: {RESULTS}/<device>.json, or with --tiny "
                        f"{tiny_dir}/tiny-<device>.json)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(p, TINY_DIR)
    p.add_argument("--gpu-tests", nargs="+", default=["tests"], metavar="PATH",
                   help="where pytest -m gpu looks (default: tests, the whole suite)")
    return p.parse_args(argv)


def slug(device_name: str) -> str:
    """A file name for a device: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"


def result_path(tiny: bool, cuda: bool, device_name: str, out: str | None,
                tiny_dir: Path = TINY_DIR) -> Path:
    """Where this run writes (a --tiny run: under `tiny_dir`); refuse a run that could pass a
    smoke test off as a GPU result."""
    if not (tiny or cuda):
        raise Refused(
            "no CUDA GPU here (torch.cuda.is_available() is False): a full run measures the "
            f"kernels on a GPU and writes {RESULTS}/<device>.json. On a CPU, `--tiny` (`make "
            f"bench-gpu BENCH_ARGS=--tiny`) checks the pipeline instead and writes "
            f"{TINY_DIR}/tiny-cpu.json.")
    default = (tiny_dir / f"tiny-{slug(device_name)}.json" if tiny
               else RESULTS / f"{slug(device_name)}.json")
    path = (ROOT / default) if out is None else Path(out).resolve()
    if tiny and path.is_relative_to((ROOT / RESULTS).resolve()):
        raise Refused(f"a --tiny run is a smoke test, not a GPU result: it may not write under "
                      f"{RESULTS}/ (got --out {out})")
    return path


def run_child(argv: list[str], timeout: float | None = None) -> int:
    """`python ARGV` in a child process in the repository root, its output (stderr merged)
    passed on to our stdout line by line as it comes; its exit status. Past `timeout` seconds
    the child and any process it started are killed and StepFailed is raised."""
    command = shlex.join(["python", *argv])
    child = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace",
                             env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             start_new_session=hasattr(os, "killpg"))

    def relay():
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    relaying = threading.Thread(target=relay, daemon=True)
    relaying.start()
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        if hasattr(os, "killpg"):
            os.killpg(child.pid, signal.SIGKILL)
        else:
            child.kill()
        child.wait()
        relaying.join(5)
        raise StepFailed(f"`{command}` ran past its {timeout:.0f} s and was stopped") from None
    relaying.join()
    return code


def run_gpu_tests(tmp: Path, paths: list[str], options: list[str] = (),
                  timeout: float | None = None) -> dict:
    """`pytest -m gpu [OPTIONS] PATHS` in a child process; its counts from pytest's JUnit XML."""
    junit = tmp / "gpu-tests.xml"
    argv = ["-m", "pytest", "-m", "gpu", "-q", *options, *paths]
    code = run_child([*argv, f"--junitxml={junit}"], timeout)
    if code not in (0, 1, 5) or not junit.is_file():  # 5: no test is marked gpu
        raise StepFailed(f"`pytest -m gpu` did not finish (exit status {code})")
    suites = ET.parse(junit).getroot().iter("testsuite")
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    failed, errors, skipped = counts["failures"], counts["errors"], counts["skipped"]
    return dict(command=shlex.join(["python", *argv]), returncode=code, failed=failed,
                passed=counts["tests"] - failed - errors - skipped, errors=errors,
                skipped=skipped)


def run_bench(script: str, args: list[str], tmp: Path, timeout: float | None = None) -> dict:
    """One benchmark script in a child process (its table goes to our stdout); its report."""
    out = tmp / f"{Path(script).stem}.json"
    argv = [f"benchmarks/{script}", *args]
    code = run_child([*argv, "--out", str(out)], timeout)
    if code != 0:
        raise StepFailed(f"{script} failed (exit status {code})")
    return dict(command=shlex.join(["python", *argv]), report=json.loads(out.read_text()))


def summarize_dequant(report: dict) -> dict:
    """Per shape: each method's GB/s, Triton over the copy and over bitsandbytes."""
    shapes = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in report["results"]):
        rows = {r["method"]: r for r in report["results"] if tuple(r["shape"]) == shape}
        gbps = {m: r["gbps"] for m, r in rows.items() if "gbps" in r}
        bnb = gbps.get("bitsandbytes")
        shapes.append(dict(
            shape=list(shape), gbps=gbps,
            triton_of_copy=gbps["triton"] / gbps["copy"],
            reference_of_copy=gbps["torch_reference"] / gbps["copy"],
            triton_vs_bitsandbytes=None if bnb is None else gbps["triton"] / bnb,
            bitsandbytes_skipped=rows.get("bitsandbytes", {}).get("skipped")))
    met = {key: [sum(s[key] >= TARGETS[key] for s in shapes if s[key] is not None),
                 sum(s[key] is not None for s in shapes)]
           for key in ("triton_of_copy", "triton_vs_bitsandbytes")}
    return dict(dtype=report["dtype"], blocksize=report["blocksize"], repeats=report["repeats"],
                shapes=shapes, targets={k: TARGETS[k] for k in met}, met=met)


def summarize_moe(report: dict) -> dict:
    """Per model: each method's speed-up over the per-expert loop (the loop's time over its
    own, same pass, same LoRA or none) and LoRA's overhead (time with LoRA / without - 1)."""
    models = []
    for model in dict.fromkeys(r["model"] for r in report["results"]):
        rows = [r for r in report["results"] if r["model"] == model]
        t = {(r["method"], r["pass"], r["lora_rank"] > 0): r["median_s"] for r in rows}

        def vs_loop(lora: bool, t=t) -> dict:
            return {m: {p: t["loop", p, lora] / t[m, p, lora] for p in PASSES}
                    for m in MOE_METHODS}

        first = rows[0]
        models.append(dict(
            model=model, E=first["E"], k=first["k"], K=first["K"], N=first["N"], T=first["T"],
            many_experts=first["E"] >= MANY_EXPERTS, vs_loop=vs_loop(False),
            vs_loop_lora=vs_loop(True),
            lora_overhead={m: {p: t[m, p, True] / t[m, p, False] - 1 for p in PASSES}
                           for m in (*MOE_METHODS, "loop")}))
    many = [m for m in models if m["many_experts"]]
    met = {"triton_vs_loop_fwd_bwd": [
               sum(m["vs_loop"]["triton"]["fwd+bwd"] >= TARGETS["triton_vs_loop_fwd_bwd"]
                   for m in many), len(many)],
           "triton_lora_overhead": [
               sum(m["lora_overhead"]["triton"]["fwd+bwd"] <= TARGETS["triton_lora_overhead"]
                   for m in models), len(models)]}
    return dict(dtype=report["dtype"], scale=report["scale"], tokens=report["tokens"],
                lora_rank=report["lora_rank"], repeats=report["repeats"],
                many_experts=MANY_EXPERTS, models=models, targets={k: TARGETS[k] for k in met},
                met=met)


def code_digests(code: tuple[str, ...] = CODE) -> dict[str, str]:
    """sha256 of every file in `code` (folders: their .py files), keyed by path from the root."""
    files = [p for entry in code for p in
             (sorted((ROOT / entry).rglob("*.py")) if (ROOT / entry).is_dir() else [ROOT / entry])]
    return {p.relative_to(ROOT).as_posix(): sha256_file(p) for p in files}


def bench_args(tiny: bool, cuda: bool) -> tuple[list[str], list[str]]:
    """The arguments of bench_dequant.py and bench_moe.py."""
    device = ["--device", "cuda" if cuda else "cpu"]
    return (device + ["--tiny"] * tiny), (device + (["--tiny", *TINY_MOE] if tiny else []))


def measure_all(tiny: bool, cuda: bool, gpu_tests: list[str]) -> tuple[dict, dict]:
    """Run the three steps, each in a child process; (what each returned, seconds each)."""
    dequant_args, moe_args = bench_args(tiny, cuda)
    steps = {"gpu_tests": lambda tmp: run_gpu_tests(tmp, gpu_tests),
             "bench_dequant": lambda tmp: run_bench("bench_dequant.py", dequant_args, tmp),
             "bench_moe": lambda tmp: run_bench("bench_moe.py", moe_args, tmp)}
    runs, timings = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for name, step in steps.items():
            print(f"== bench-gpu: {name} ==", flush=True)
            t0 = time.perf_counter()
            runs[name] = step(Path(tmp))
            timings[f"{name}_s"] = round(time.perf_counter() - t0, 3)
    return runs, timings


def build_manifest(runs: dict, timings: dict, *, tiny: bool, cuda: bool, git: dict,
                   env: dict, command: str, wall_time_s: float, peak_memory_mb: float) -> dict:
    """The result: a labkit manifest whose metrics are the tests' counts and the ratios."""
    return {
        "experiment": "bench-gpu", "command": command,
        "config": {"seed": 0, "tiny": tiny, "device": "cuda" if cuda else "cpu"},
        "seed": 0,                  # each script seeds its own inputs with 0
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git, "code": code_digests(), "env": env,
        "data": {}, "inputs": {}, "artifacts": {},
        "metrics": {"device_name": env["device"], "gpu_tests": runs["gpu_tests"],
                    "dequant": summarize_dequant(runs["bench_dequant"]["report"]),
                    "moe": summarize_moe(runs["bench_moe"]["report"])},
        "runs": {name: runs[name] for name in ("bench_dequant", "bench_moe")},
        "timings": timings, "wall_time_s": wall_time_s, "peak_memory_mb": peak_memory_mb,
    }


def cuda_env(cuda: bool) -> dict:
    """CUDA's version and the GPU's compute capability, beside labkit's environment()."""
    if not cuda:
        return {"cuda": None, "capability": None}
    major, minor = torch.cuda.get_device_capability()
    return {"cuda": torch.version.cuda, "capability": f"{major}.{minor}"}


def print_summary(metrics: dict) -> None:
    tests = metrics["gpu_tests"]
    print(f"GPU tests on {metrics['device_name']}: {tests['passed']} passed, {tests['failed']} "
          f"failed, {tests['errors']} errors, {tests['skipped']} skipped")
    for s in metrics["dequant"]["shapes"]:
        bnb = s["triton_vs_bitsandbytes"]
        vs_bnb = "bitsandbytes skipped" if bnb is None else f"{bnb:.2f}x bitsandbytes"
        print(f"  dequant {'x'.join(map(str, s['shape'])):>11}: Triton {s['triton_of_copy']:.3f} "
              f"of copy, {vs_bnb}")
    for m in metrics["moe"]["models"]:
        print(f"  moe {m['model']:>15}: Triton fwd+bwd {m['vs_loop']['triton']['fwd+bwd']:.2f}x "
              f"the loop, LoRA overhead {m['lora_overhead']['triton']['fwd+bwd']:+.1%}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    try:
        path = result_path(args.tiny, cuda, device_name, args.out)
    except Refused as e:
        print(f"bench_gpu: refused: {e}", file=sys.stderr)
        return 2
    git, t0 = git_state(ROOT), time.perf_counter()          # the code, before the run writes
    try:
        runs, timings = measure_all(args.tiny, cuda, args.gpu_tests)
    except StepFailed as e:
        print(f"bench_gpu: {e}; no result written", file=sys.stderr)
        return 1
    env = environment() | cuda_env(cuda)
    manifest = write_manifest(path, build_manifest(
        runs, timings, tiny=args.tiny, cuda=cuda, git=git, env=env,
        command=shlex.join(["python", "benchmarks/bench_gpu.py", *argv]),
        wall_time_s=round(time.perf_counter() - t0, 3),
        peak_memory_mb=round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)))
    print_summary(manifest["metrics"])
    print(f"wrote {path}" + ("" if args.tiny else "; `make readme` puts it in RESULTS.md"))
    tests = manifest["metrics"]["gpu_tests"]
    return 1 if tests["failed"] or tests["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
