"""`make device-check`: everything a lent GPU machine should measure, in one bounded command.

    PYTHONPATH=src python3 benchmarks/device_check.py [--tiny] [--out path.json]
                                                      [--budget SECONDS] [--steps a,b]
                                                      [--commit HASH]

Made for a machine that is lent for minutes, with no network and no install step: it needs
the system Python with torch, triton, numpy, pytest and psutil, and nothing of the course's
virtual environment (no nbgrader, jupyter or ruff). bitsandbytes comes as a carried wheel when
`make device-wheels` fetched it here first (carried_wheels.py; installed with pip --no-index
into build/device-site). It runs, each step in a child process with its own time limit, in
this order:

1. `gpu_tests`: `pytest -m gpu -p no:cacheprovider --continue-on-collection-errors` over the
   test modules that mark a test `gpu` (found by their text), so that modules needing the
   notebook tool chain are never collected;
2. `bench_dequant`: `bench_dequant.py` at its full shapes. Without bitsandbytes its rows say
   skipped, Triton is compared with the copy and the PyTorch reference only, and the result
   says so (`metrics.bitsandbytes`);
3. `bench_moe:<model>`: `bench_moe.py` at one real model's shapes (Mixtral-8x7B, Qwen3-30B-A3B,
   OLMoE-1B-7B), forward and forward + backward, with and without expert LoRA, one child per
   model;
4. `bench_logprobs:<rows>x<vocab>`: `bench_logprobs.py`, one child per logits shape: the
   Triton log-prob (and entropy) kernels' time and peak GPU memory against PyTorch's full
   log-softmax.

Each step's wall time is printed as it ends. A step that fails, crashes or runs past its limit
(`LIMITS_S`, cut to what is left of `--budget`, default 420 s) is recorded as failed, with the
reason, and the next one runs; a step that would start with less than `MIN_START_S` left is
recorded as not run. Then one sealed labkit manifest goes to
`benchmarks/results/gpu/<device>.json` (as `make bench-gpu` writes it, where `make readme`
reads it: `metrics.dequant` and `metrics.moe` have bench_gpu.py's shape; a part whose step
failed is null), plus `metrics.logprobs`, `metrics.steps` and `metrics.failed_steps`. When the
environment variable OUT names a folder, the result and the whole log (`device-check.log`)
are copied there too.

`--tiny` checks the pipeline on any machine (CPU: the Triton interpreter) at the smoke shapes;
it writes `build/device-check/tiny-<device>.json` (or `--out`), never under
`benchmarks/results/gpu/`. Without a CUDA GPU and without `--tiny` it refuses to start. The
manifest records the `--commit` given (`make device-check COMMIT=...`, a clean checkout's),
else what git says of the tree (a copied tree may hold no `.git`, or a stale one); `code`
holds the sha256 of every measured file either way. Exit status: 0 when every step finished
and no GPU test failed, 1 otherwise (the result is still written), 2 refused.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This tree's packages, before any installed copy (main() gives the children the same path).
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import bench_gpu  # noqa: E402
import carried_wheels  # noqa: E402
import torch  # noqa: E402
from bench_gpu import StepFailed  # noqa: E402
from bench_logprobs import SHAPES as LOGPROB_SHAPES  # noqa: E402
from bench_logprobs import TASKS as LOGPROB_TASKS  # noqa: E402
from bench_moe import MODELS  # noqa: E402

from labkit.manifest import environment, git_state, write_manifest  # noqa: E402

TINY_DIR = Path("build/device-check")
LOG_NAME = "device-check.log"
CODE = (*bench_gpu.CODE, "benchmarks/device_check.py", "benchmarks/bench_logprobs.py",
        "src/minirl")
DEFAULT_BUDGET_S = 420               # --tiny: TINY_BUDGET_S (the interpreter is slow)
TINY_BUDGET_S = 900
MIN_START_S = 20
# The most each step may take on a GPU (its first launches compile the Triton kernels); a
# --tiny run on a CPU takes the interpreter's time instead.
LIMITS_S = {"gpu_tests": 150, "bench_dequant": 90, "bench_moe": 90, "bench_logprobs": 75}
TINY_LIMITS_S = {"gpu_tests": 150, "bench_dequant": 120, "bench_moe": 240, "bench_logprobs": 120}
# The pytest options of a machine without the course's environment: no .pytest_cache in the
# tree, and a module whose imports fail costs its own tests only.
PYTEST_OPTIONS = ["-p", "no:cacheprovider", "--continue-on-collection-errors"]
GPU_MARK = re.compile(r"mark\.gpu\b")


class Tee:
    """Writes to a stream and a log file, flushing both at once (the lent machine buffers)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.stream.flush()
        if self.log is not None:
            self.log.write(text)
            self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        if self.log is not None:
            self.log.flush()

    def isatty(self) -> bool:
        return False


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_gpu.add_output_args(p, TINY_DIR)
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all the steps together (default {DEFAULT_BUDGET_S}, "
                        f"with --tiny {TINY_BUDGET_S})")
    p.add_argument("--steps", default="",
                   help="comma-separated step kinds to run: gpu_tests, bench_dequant, "
                        "bench_moe, bench_logprobs (default: all)")
    p.add_argument("--commit", default="",
                   help="the (clean) commit this tree is; recorded in place of what git "
                        "says, since a copied tree's .git may be missing or stale")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.steps.split(",") if k.strip()] or list(LIMITS_S)
    unknown = sorted(set(kinds) - set(LIMITS_S))
    if unknown:
        p.error(f"unknown steps {unknown}; choose from {list(LIMITS_S)}")
    args.steps = kinds
    args.budget = args.budget or (TINY_BUDGET_S if args.tiny else DEFAULT_BUDGET_S)
    return args


def gpu_test_files() -> list[str]:
    """The test modules that mark a test `gpu`, relative to the root."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                  if GPU_MARK.search(p.read_text(encoding="utf-8", errors="replace")))


def plan(kinds: list[str], tiny: bool, cuda: bool) -> list[tuple[str, str, object]]:
    """(step name, kind, what it runs: tmp folder, limit -> its result), in running order."""
    device = ["--device", "cuda" if cuda else "cpu"]
    tiny_args = ["--tiny"] if tiny else []
    steps = []
    if "gpu_tests" in kinds:
        steps.append(("gpu_tests", "gpu_tests", lambda tmp, limit: bench_gpu.run_gpu_tests(
            tmp, gpu_test_files(), PYTEST_OPTIONS, limit)))
    if "bench_dequant" in kinds:
        steps.append(("bench_dequant", "bench_dequant", lambda tmp, limit: bench_gpu.run_bench(
            "bench_dequant.py", device + tiny_args, tmp, limit)))
    if "bench_moe" in kinds:
        moe = ["--tiny", "--rank", str(bench_gpu.TINY_MOE_RANK)] if tiny else []
        for model in (bench_gpu.TINY_MOE_MODELS if tiny else MODELS):
            steps.append((f"bench_moe:{model}", "bench_moe",
                          lambda tmp, limit, model=model: bench_gpu.run_bench(
                              "bench_moe.py", device + moe + ["--models", model], tmp, limit)))
    if "bench_logprobs" in kinds:
        for rows, vocab in LOGPROB_SHAPES["tiny" if tiny or not cuda else "full"]:
            shape = f"{rows}x{vocab}"
            steps.append((f"bench_logprobs:{shape}", "bench_logprobs",
                          lambda tmp, limit, shape=shape: bench_gpu.run_bench(
                              "bench_logprobs.py", device + ["--shapes", shape], tmp, limit)))
    return steps


def run_steps(steps, tiny: bool, budget: float) -> dict[str, dict]:
    """Run every step within its limit and the budget; {name: {ok, seconds, result | error}}."""
    limits = TINY_LIMITS_S if tiny else LIMITS_S
    deadline = time.monotonic() + budget
    done = {}
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        for i, (name, kind, step) in enumerate(steps, 1):
            left = deadline - time.monotonic()
            if left < MIN_START_S:
                done[name] = dict(ok=False, seconds=0.0,
                                  error=f"not run: {left:.0f} s of the {budget:.0f} s budget left")
                print(f"== device-check {i}/{len(steps)}: {name}: NOT RUN ({done[name]['error']})",
                      flush=True)
                continue
            limit = min(limits[kind], left)
            print(f"== device-check {i}/{len(steps)}: {name} (limit {limit:.0f} s) ==", flush=True)
            t0 = time.perf_counter()
            try:
                done[name] = dict(ok=True, result=step(Path(tmp), limit))
            except StepFailed as e:
                done[name] = dict(ok=False, error=str(e))
            except Exception as e:  # a report that cannot be read: the step failed, go on
                traceback.print_exc()
                done[name] = dict(ok=False, error=f"{type(e).__name__}: {e}")
            done[name]["seconds"] = round(time.perf_counter() - t0, 1)
            status = "ok" if done[name]["ok"] else f"FAILED: {done[name]['error']}"
            print(f"== device-check {i}/{len(steps)}: {name}: {status} "
                  f"({done[name]['seconds']:.1f} s) ==", flush=True)
    return done


def merged_report(done: dict[str, dict], kind: str) -> dict | None:
    """The reports of every finished step of `kind` as one (their rows in running order)."""
    reports = [s["result"]["report"] for name, s in done.items()
               if name.split(":")[0] == kind and s["ok"]]
    if not reports:
        return None
    return {**reports[0], "results": [row for r in reports for row in r["results"]]}


def summarize_logprobs(report: dict) -> dict:
    """Per shape and task: both backends' time, Triton's speed-up and the peak memory each
    allocates beyond the logits (on a GPU), or why PyTorch was not timed."""
    rows = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in report["results"]):
        for task in LOGPROB_TASKS:
            by = {r["backend"]: r for r in report["results"]
                  if tuple(r["shape"]) == shape and r["task"] == task}
            torch_row, triton_row = by.get("torch", {}), by.get("triton", {})
            rows.append(dict(
                shape=list(shape), task=task, torch_ms=torch_row.get("median_ms"),
                triton_ms=triton_row.get("median_ms"), speedup=triton_row.get("ratio"),
                torch_peak_mib=torch_row.get("peak_extra_mib"),
                triton_peak_mib=triton_row.get("peak_extra_mib"),
                saved_mib=triton_row.get("saved_mib"), torch_skipped=torch_row.get("skipped")))
    return dict(dtype=report["dtype"], repeats=report["repeats"], rows=rows)


def bitsandbytes_note(dequant: dict | None) -> str:
    if dequant is None:
        return "unknown: the dequant benchmark did not finish"
    version = dequant["report"]["versions"].get("bitsandbytes")
    why = next((r["skipped"] for r in dequant["report"]["results"]
                if r["method"] == "bitsandbytes" and "skipped" in r), None)
    if why is None:
        return f"compared: bitsandbytes {version}"
    return (f"not compared ({why}): Triton is measured against the copy and the PyTorch "
            "reference only")


def build_manifest(done: dict[str, dict], *, tiny: bool, cuda: bool, git: dict, env: dict,
                   command: str, budget: float, wall_time_s: float,
                   peak_memory_mb: float) -> dict:
    """The result: a labkit manifest shaped like bench_gpu.py's, with a null part where its
    step failed, the log-prob benchmark, and every step's outcome."""
    def result(name):
        return done[name]["result"] if done.get(name, {}).get("ok") else None

    dequant, moe, logprobs = (result("bench_dequant"), merged_report(done, "bench_moe"),
                              merged_report(done, "bench_logprobs"))
    steps = {name: {k: v for k, v in s.items() if k != "result"} for name, s in done.items()}
    return {
        "experiment": "device-check", "command": command,
        "config": {"seed": 0, "tiny": tiny, "device": "cuda" if cuda else "cpu",
                   "budget_s": budget, "steps": list(done)},
        "seed": 0,                  # each script seeds its own inputs with 0
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git, "code": bench_gpu.code_digests(CODE), "env": env,
        "data": {}, "inputs": {}, "artifacts": {},
        "metrics": {
            "device_name": env["device"],
            "failed_steps": [name for name, s in done.items() if not s["ok"]],
            "steps": steps,
            "gpu_tests": result("gpu_tests"),
            "dequant": None if dequant is None else bench_gpu.summarize_dequant(dequant["report"]),
            "bitsandbytes": bitsandbytes_note(dequant),
            "moe": None if moe is None else bench_gpu.summarize_moe(moe),
            "logprobs": None if logprobs is None else summarize_logprobs(logprobs)},
        "runs": {name: s["result"] for name, s in done.items()
                 if s["ok"] and name != "gpu_tests"},
        "timings": {f"{name}_s": s["seconds"] for name, s in done.items()},
        "wall_time_s": wall_time_s, "peak_memory_mb": peak_memory_mb,
    }


def print_summary(metrics: dict) -> None:
    print(f"== device-check summary: {metrics['device_name']} ==")
    for name, s in metrics["steps"].items():
        print(f"  {name:<32} {'ok' if s['ok'] else 'FAILED':>6} {s['seconds']:7.1f} s"
              f"{'' if s['ok'] else '  ' + s['error']}")
    tests = metrics["gpu_tests"]
    if tests is not None:
        print(f"GPU tests: {tests['passed']} passed, {tests['failed']} failed, "
              f"{tests['errors']} errors, {tests['skipped']} skipped")
    if metrics["dequant"] is not None:
        for s in metrics["dequant"]["shapes"]:
            bnb = s["triton_vs_bitsandbytes"]
            vs_bnb = "" if bnb is None else f", {bnb:.2f}x bitsandbytes"
            print(f"  dequant {'x'.join(map(str, s['shape'])):>11}: Triton "
                  f"{s['gbps']['triton']:,.4g} GB/s, {s['triton_of_copy']:.3f} of copy{vs_bnb}")
    print(f"  bitsandbytes: {metrics['bitsandbytes']}")
    if metrics["moe"] is not None:
        for m in metrics["moe"]["models"]:
            print(f"  moe {m['model']:>15}: Triton fwd+bwd {m['vs_loop']['triton']['fwd+bwd']:.2f}x"
                  f" the loop, with LoRA {m['vs_loop_lora']['triton']['fwd+bwd']:.2f}x, LoRA "
                  f"overhead {m['lora_overhead']['triton']['fwd+bwd']:+.1%}")
    if metrics["logprobs"] is not None:
        for r in metrics["logprobs"]["rows"]:
            shape = "x".join(map(str, r["shape"]))
            if r["torch_skipped"]:
                vs = f"PyTorch skipped ({r['torch_skipped']})"
            else:
                vs = f"{r['speedup']:.2f}x PyTorch"
            peak = ("" if r["triton_peak_mib"] is None else
                    f", peak {r['triton_peak_mib']:,.0f} MiB"
                    + ("" if r["torch_peak_mib"] is None
                       else f" vs {r['torch_peak_mib']:,.0f} MiB"))
            print(f"  logprobs {shape:>12} {r['task']:>12}: Triton {r['triton_ms']:.3f} ms, "
                  f"{vs}{peak}")
    if metrics["failed_steps"]:
        print(f"FAILED steps: {', '.join(metrics['failed_steps'])}")


def header(cuda: bool) -> None:
    """What this machine is, first in the log."""
    import triton

    print(f"device-check: python {sys.version.split()[0]}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}), triton {triton.__version__}, "
          f"{os.cpu_count()} CPUs, root {ROOT}", flush=True)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        print(f"device-check: {props.name}, capability {props.major}.{props.minor}, "
              f"{props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s)",
              flush=True)
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20).stdout.strip()
            print(f"device-check: nvidia-smi: {smi}", flush=True)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"device-check: nvidia-smi: {e}", flush=True)


def copy_out(paths: list[Path]) -> None:
    """Copy the result (and the log) to $OUT, when set: the lent machine hands that back."""
    out = os.environ.get("OUT")
    if not out:
        return
    for path in paths:
        try:
            shutil.copy(path, Path(out) / path.name)
            print(f"copied {path.name} to {out}/", flush=True)
        except OSError as e:
            print(f"device-check: could not copy {path} to {out}: {e}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out, log = os.environ.get("OUT"), None
    if out:
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            log = open(Path(out) / LOG_NAME, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            print(f"device-check: no log in {out}: {e}", file=sys.stderr)
    real = sys.stdout, sys.stderr, os.environ.get("PYTHONPATH")
    sys.stdout, sys.stderr = Tee(real[0], log), Tee(real[1], log)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, real[2:])])
    try:
        return check(args, argv)
    finally:
        sys.stdout, sys.stderr = real[:2]
        if real[2] is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = real[2]
        if log is not None:
            log.close()


def check(args: argparse.Namespace, argv: list[str]) -> int:
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    if not (args.tiny or cuda):
        print("device_check: refused: no CUDA GPU here (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}, CUDA build {torch.version.cuda}). `--tiny` "
              "(`make device-check DEVICE_ARGS=--tiny`) checks the pipeline on a CPU instead.",
              file=sys.stderr)
        return 2
    try:
        path = bench_gpu.result_path(args.tiny, cuda, device_name, args.out, TINY_DIR)
    except bench_gpu.Refused as e:
        print(f"device_check: refused: {e}", file=sys.stderr)
        return 2
    header(cuda)
    for line in carried_wheels.install(ROOT):
        print(f"device-check: {line}", flush=True)
    git, t0 = git_state(ROOT), time.perf_counter()          # the code, before the run writes
    if args.commit:         # the copied tree's .git, if any, may be a stale one
        git = {"commit": args.commit, "dirty": False}
    steps = plan(args.steps, args.tiny, cuda)
    print(f"device-check: {len(steps)} steps within {args.budget:.0f} s, result to {path}",
          flush=True)
    done = run_steps(steps, args.tiny, args.budget)
    env = environment() | bench_gpu.cuda_env(cuda)
    manifest = write_manifest(path, build_manifest(
        done, tiny=args.tiny, cuda=cuda, git=git, env=env, budget=args.budget,
        command=shlex.join(["python", "benchmarks/device_check.py", *argv]),
        wall_time_s=round(time.perf_counter() - t0, 3),
        peak_memory_mb=round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)))
    metrics = manifest["metrics"]
    print_summary(metrics)
    print(f"wrote {path} (wall {manifest['wall_time_s']:.0f} s)", flush=True)
    copy_out([path])
    tests = metrics["gpu_tests"]
    failed = metrics["failed_steps"] or (tests and (tests["failed"] or tests["errors"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
