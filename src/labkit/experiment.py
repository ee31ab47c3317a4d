"""Run an experiment into a manifest, and reproduce one from its manifest.

An experiment is a folder `experiments/NN-name/` holding `experiment.py`, which defines
`run(cfg: dict, ctx: RunContext) -> dict` (the metrics), and `config.json`. Everything a run
produces is written into `ctx.out_dir`, a private temporary folder; only a run that finishes
has its files moved beside `experiment.py`, manifest last. Reproduce re-runs into another
temporary folder and overwrites nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import atomic_write_text
from .compare import Moved, compare_metrics
from .hashing import sha256_file
from .manifest import (
    ManifestError,
    check_artifact_name,
    check_config,
    environment,
    git_state,
    read_manifest,
    write_manifest,
)
from .measure import measure
from .seed import seed_everything

# Environment fields that must agree for reproduce to demand bit-identical numbers.
SAME_MACHINE_KEYS = ("python", "torch", "triton", "bitsandbytes", "numpy", "cpu", "threads",
                     "device")


@dataclass
class RunContext:
    """What an experiment's `run` gets beside its config: where to write, what to record."""

    exp_dir: Path                       # the experiment's folder (read inputs relative to it)
    out_dir: Path                       # write every output here; moved into exp_dir at the end
    artifacts: list[str] = field(default_factory=list)   # output files whose sha256 is recorded
    inputs: dict[str, str] = field(default_factory=dict)  # consumed file -> sha256
    data: dict[str, str] = field(default_factory=dict)    # dataset name -> sha256
    timings: dict[str, float] = field(default_factory=dict)  # seconds; recorded, not compared

    def artifact(self, name: str) -> Path:
        """Path for an output file whose bytes are part of the result (checkpoints, adapters)."""
        self.artifacts.append(check_artifact_name(name, "ctx.artifact"))
        return self.out_dir / name

    def output(self, name: str) -> Path:
        """Path for an output file that is kept but not hashed (figures, reports)."""
        return self.out_dir / check_artifact_name(name, "ctx.output")

    def record_input(self, path: str | Path) -> Path:
        """Hash a file the run reads (e.g. a base checkpoint); reproduce checks it is unchanged."""
        path = Path(path).resolve()
        self.inputs[os.path.relpath(path, self.exp_dir.resolve())] = sha256_file(path)
        return path

    def record_data(self, name: str, digest: str) -> None:
        self.data[name] = digest


def load_experiment(exp_dir: Path):
    script = exp_dir / "experiment.py"
    if not script.is_file():
        raise ManifestError(f"{exp_dir} has no experiment.py")
    spec = importlib.util.spec_from_file_location(f"experiment_{exp_dir.name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise ManifestError(f"{script} must define run(cfg, ctx) -> metrics")
    return module


def read_config(exp_dir: Path) -> dict:
    path = exp_dir / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{exp_dir} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    return check_config(cfg, str(path))


def _execute(exp_dir: Path, cfg: dict, out_dir: Path) -> tuple[dict, RunContext, dict]:
    """Seed, run, and time one experiment; return (metrics, context, measurements)."""
    module = load_experiment(exp_dir)
    seed_everything(cfg["seed"], threads=cfg.get("threads"))
    ctx = RunContext(exp_dir=exp_dir, out_dir=out_dir)
    t0 = time.perf_counter()
    with measure() as mem:
        metrics = module.run(cfg, ctx)
    if not isinstance(metrics, dict):
        raise TypeError(f"{exp_dir}/experiment.py run() must return a dict, got {type(metrics)}")
    measured = {"wall_time_s": round(time.perf_counter() - t0, 3),
                "peak_memory_mb": round(mem.peak_bytes / 2**20, 1)}
    return metrics, ctx, measured


def run_experiment(exp_dir: str | Path, cfg: dict | None = None) -> dict:
    """Run `exp_dir` with its config.json (or `cfg`) and write its outputs and manifest."""
    exp_dir = Path(exp_dir).resolve()
    if not exp_dir.is_dir():
        raise ManifestError(f"{exp_dir} is not an experiment folder (expected a folder holding "
                            "experiment.py and config.json, e.g. experiments/00-pretrain-base)")
    cfg = read_config(exp_dir) if cfg is None else check_config(cfg, "cfg")
    git = git_state(exp_dir)    # the code that runs, before this run's outputs appear
    with tempfile.TemporaryDirectory(prefix=".run-", dir=exp_dir) as tmp:
        metrics, ctx, measured = _execute(exp_dir, cfg, Path(tmp))
        atomic_write_text(Path(tmp) / "metrics.json", json.dumps(metrics, indent=2) + "\n")
        artifacts = {name: sha256_file(Path(tmp) / name) for name in ctx.artifacts}
        for item in Path(tmp).iterdir():
            target = exp_dir / item.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
    return write_manifest(exp_dir / "manifest.json", {
        "experiment": exp_dir.name, "config": cfg, "seed": cfg["seed"],
        "git": git, "env": environment(), "data": ctx.data,
        "inputs": ctx.inputs, "artifacts": artifacts, "metrics": metrics,
        "timings": ctx.timings, **measured,
    })


@dataclass
class ReproduceReport:
    exact: bool                 # True: same machine and versions, so numbers must be identical
    why_tolerant: list[str]     # environment fields that differ (empty when exact)
    moved: list[Moved]          # metrics that moved beyond the allowed tolerance
    artifacts_moved: list[str]  # produced files whose bytes differ (a failure only when exact)
    wall_time_s: float

    @property
    def ok(self) -> bool:
        return not self.moved and not (self.exact and self.artifacts_moved)

    def summary(self) -> str:
        mode = "exact (same CPU and versions)" if self.exact else (
            "within the config's tolerances (differs in: " + ", ".join(self.why_tolerant) + ")")
        lines = [f"compared {mode}; re-run took {self.wall_time_s:.1f} s"]
        lines += [f"  moved: {m}" for m in self.moved]
        lines += [f"  artifact bytes differ: {a}" for a in self.artifacts_moved]
        lines.append("REPRODUCED" if self.ok else
                     f"NOT REPRODUCED: {len(self.moved)} number(s) moved")
        return "\n".join(lines)


def verify_files(manifest: dict, exp_dir: Path) -> None:
    """Refuse a manifest whose recorded inputs or artifacts no longer match the files."""
    inside = exp_dir.resolve()
    for name in manifest["artifacts"]:     # through a symbolic link counts as outside
        if not (exp_dir / check_artifact_name(name)).resolve().is_relative_to(inside):
            raise ManifestError(f"artifact {name!r} resolves outside {exp_dir} (a symbolic "
                                "link?); refusing to read it")
    recorded = {**manifest["inputs"], **manifest["artifacts"]}
    for rel, digest in recorded.items():
        path = exp_dir / rel
        if not path.is_file():
            raise ManifestError(f"file recorded in the manifest is missing: {path}")
        if sha256_file(path) != digest:
            raise ManifestError(
                f"{path} has changed since the manifest was written (sha256 recorded "
                f"{digest[:12]}…, now {sha256_file(path)[:12]}…); restore it or re-run")


def reproduce(manifest_path: str | Path) -> ReproduceReport:
    """Re-run the experiment a manifest describes and compare every recorded number."""
    manifest_path = Path(manifest_path).resolve()
    manifest = read_manifest(manifest_path)
    exp_dir = manifest_path.parent
    verify_files(manifest, exp_dir)
    cfg = manifest["config"]
    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        metrics, ctx, measured = _execute(exp_dir, cfg, Path(tmp))
        artifacts_now = {name: sha256_file(Path(tmp) / name) for name in ctx.artifacts}
    env_now, env_then = environment(), manifest["env"]  # after _execute has set the threads
    differs = [k for k in SAME_MACHINE_KEYS if env_then.get(k) != env_now.get(k)]
    exact = not differs
    moved = compare_metrics(manifest["metrics"], metrics,
                            None if exact else cfg.get("tolerances", {}))
    artifacts_moved = sorted(k for k in manifest["artifacts"].keys() | artifacts_now.keys()
                             if manifest["artifacts"].get(k) != artifacts_now.get(k))
    return ReproduceReport(exact, differs, moved, artifacts_moved, measured["wall_time_s"])
