"""The run-time cost of the pinned numerical mode: the same experiment work, pinned and native,
side by side in one run.

    python benchmarks/pin_cost.py [--rounds 3] [--steps 300] [--out PATH.json]

Workloads, each an experiment's own `run` on its real inputs (nothing is written beside them):
- `00-pretrain`: experiment 00's config with `--steps` AdamW steps per model (dense and MoE),
  20 eval prompts per task: matmuls, GELU/SwiGLU, layer norm, softmax, the MoE dispatch;
- `11-tiny`: experiment 11's tiny.json: NF4 dequantization, QLoRA on the MoE, memory counts,
  and one training step through the Triton kernels in the interpreter (NumPy's arithmetic).
Each round runs every workload once pinned (`labkit.numerics.pinned_env`) and once native
(this machine's own kernels), alternating which goes first, each in a fresh process; both at
the config's thread count, so the difference is the instruction set alone. Timing is noisy on
a shared machine: the ratio of medians is what to read, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from labkit.atomic import atomic_write_text  # noqa: E402
from labkit.manifest import environment  # noqa: E402
from labkit.numerics import DEFAULT_THREADS, pinned_env  # noqa: E402

CHILD = """
import json, sys, tempfile
from pathlib import Path
from labkit.experiment import execute
exp, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    out = execute(exp, cfg, Path(tmp))
print(json.dumps({"wall_time_s": out.measured["wall_time_s"],
                  "mode": out.env["numerics"]["mode"],
                  "capability": out.env["numerics"]["torch_cpu_capability"]}))
"""


def workloads(steps: int) -> dict[str, tuple[Path, dict]]:
    exp00 = ROOT / "experiments" / "00-pretrain-base"
    cfg00 = json.loads((exp00 / "config.json").read_text())
    cfg00.update(eval_n=20, routing_n=5, n_per_task=2000)
    for spec in cfg00["models"].values():
        spec["train"].update(steps=steps, progress=False)
    exp11 = ROOT / "experiments" / "11-qlora-moe"
    return {"00-pretrain": (exp00, cfg00),
            "11-tiny": (exp11, json.loads((exp11 / "tiny.json").read_text()))}


def run_once(exp: Path, cfg: dict, pinned: bool) -> dict:
    threads = cfg.get("threads", DEFAULT_THREADS)
    env = {k: v for k, v in os.environ.items() if k not in pinned_env(threads)}
    if pinned:
        env.update(pinned_env(threads))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(exp), json.dumps(cfg)],
                          capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pin_cost.json"))
    args = p.parse_args(argv)
    times = {name: {"pinned": [], "native": []} for name in workloads(args.steps)}
    for r in range(args.rounds):
        for name, (exp, cfg) in workloads(args.steps).items():
            for pinned in ((True, False) if r % 2 == 0 else (False, True)):
                got = run_once(exp, cfg, pinned)
                mode = "pinned" if pinned else "native"
                assert got["mode"] == mode, got
                times[name][mode].append(got["wall_time_s"])
                print(f"round {r + 1}/{args.rounds} {name:12s} {mode:6s} ({got['capability']}): "
                      f"{got['wall_time_s']:.2f} s", flush=True)
    summary = {name: {"pinned_median_s": statistics.median(t["pinned"]),
                      "native_median_s": statistics.median(t["native"]),
                      "ratio_pinned_over_native": round(statistics.median(t["pinned"])
                                                        / statistics.median(t["native"]), 3),
                      "runs": t}
               for name, t in times.items()}
    for name, s in summary.items():
        print(f"{name:12s} pinned {s['pinned_median_s']:.2f} s, native {s['native_median_s']:.2f} "
              f"s: pinned/native = {s['ratio_pinned_over_native']:.3f}")
    env = environment()
    record = {"command": "python benchmarks/pin_cost.py " + " ".join(argv or sys.argv[1:]),
              "rounds": args.rounds, "steps": args.steps, "cpu": env["cpu_id"],
              "versions": {k: env[k] for k in ("python", "torch", "numpy", "triton")},
              "results": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
