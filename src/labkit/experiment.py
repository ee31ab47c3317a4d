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
from .numerics import DEFAULT_THREADS
from .provenance import bit_differences, code_changes, code_digests, cpu_note, files_now, lacking
from .seed import seed_everything


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

    def artifact_files(self, folder: str) -> list[str]:
        """Record every file already written under `folder` (a saved adapter, say) as an
        artifact; returns their names."""
        root = self.out_dir / check_artifact_name(folder, "ctx.artifact_files")
        names = sorted(p.relative_to(self.out_dir).as_posix() for p in root.rglob("*")
                       if p.is_file())
        if not names:
            raise ValueError(f"ctx.artifact_files: {root} holds no file")
        for name in names:
            self.artifact(name)
        return names

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


def load_script(script: Path, module_name: str):
    """Execute a script of an experiment folder (not a package module) and return it."""
    spec = importlib.util.spec_from_file_location(module_name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_experiment(exp_dir: Path):
    script = exp_dir / "experiment.py"
    if not script.is_file():
        raise ManifestError(f"{exp_dir} has no experiment.py")
    module = load_script(script, f"experiment_{exp_dir.name}")
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


@dataclass
class Outcome:
    """One execution of an experiment: its metrics and context, and what it ran on."""

    metrics: dict
    ctx: RunContext
    measured: dict          # wall_time_s, peak_memory_mb
    code: dict[str, str]    # source file -> sha256, of what the run imported
    env: dict               # labkit.manifest.environment() after the run set its threads

    def artifact_digests(self) -> dict[str, str]:
        return {name: sha256_file(self.ctx.out_dir / name) for name in self.ctx.artifacts}


def execute(exp_dir: Path, cfg: dict, out_dir: Path) -> Outcome:
    """Seed, run and time one experiment, writing into `out_dir`."""
    module = load_experiment(exp_dir)
    seed_everything(cfg["seed"], threads=cfg.get("threads", DEFAULT_THREADS))
    ctx = RunContext(exp_dir=exp_dir, out_dir=out_dir)
    t0 = time.perf_counter()
    with measure() as mem:
        metrics = module.run(cfg, ctx)
    if not isinstance(metrics, dict):
        raise TypeError(f"{exp_dir}/experiment.py run() must return a dict, got {type(metrics)}")
    measured = {"wall_time_s": round(time.perf_counter() - t0, 3),
                "peak_memory_mb": round(mem.peak_bytes / 2**20, 1)}
    return Outcome(metrics, ctx, measured, code_digests(exp_dir), environment())


def run_experiment(exp_dir: str | Path, cfg: dict | None = None) -> dict:
    """Run `exp_dir` with its config.json (or `cfg`) and write its outputs and manifest."""
    exp_dir = Path(exp_dir).resolve()
    if not exp_dir.is_dir():
        raise ManifestError(f"{exp_dir} is not an experiment folder (expected a folder holding "
                            "experiment.py and config.json, e.g. experiments/00-pretrain-base)")
    cfg = read_config(exp_dir) if cfg is None else check_config(cfg, "cfg")
    git = git_state(exp_dir)    # the code that runs, before this run's outputs appear
    with tempfile.TemporaryDirectory(prefix=".run-", dir=exp_dir) as tmp:
        out = execute(exp_dir, cfg, Path(tmp))
        atomic_write_text(Path(tmp) / "metrics.json", json.dumps(out.metrics, indent=2) + "\n")
        artifacts = out.artifact_digests()
        for item in Path(tmp).iterdir():
            target = exp_dir / item.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
    return write_manifest(exp_dir / "manifest.json", {
        "experiment": exp_dir.name, "config": cfg, "seed": cfg["seed"],
        "git": git, "code": out.code, "env": out.env, "data": out.ctx.data,
        "inputs": out.ctx.inputs, "artifacts": artifacts, "metrics": out.metrics,
        "timings": out.ctx.timings, **out.measured,
    })


@dataclass
class ReproduceReport:
    exact: bool                 # True: nothing deciding the bits differs; numbers must be identical
    differences: list[str]      # fields deciding the bits that differ (empty when exact)
    lacks: list[str]            # what an old recording does not say about its arithmetic
    code_changed: list[str]     # source files that differ from the recording's
    commits: tuple[str, str]    # (recorded, now), each "abc1234" or "abc1234 (dirty)"
    moved: list[Moved]          # metrics that moved beyond the allowed tolerance
    data_moved: list[str]       # input datasets whose digest differs (always a failure)
    artifacts_moved: list[str]  # produced files whose bytes differ (a failure only when exact)
    note: str | None            # e.g. another CPU model under the pin
    wall_time_s: float

    @property
    def ok(self) -> bool:
        return not self.moved and not self.data_moved and not (self.exact and self.artifacts_moved)

    def summary(self) -> str:
        lines = [f"recorded at commit {self.commits[0]}; now {self.commits[1]}"]
        lines += code_lines(self.code_changed)
        if self.lacks:
            lines.append("the recording does not say " + " or ".join(self.lacks) +
                         ": compared under today's rules")
        if self.exact:
            lines.append(f"compared exactly (same library versions, numerical mode and threads); "
                         f"re-run took {self.wall_time_s:.1f} s")
        else:
            lines.append(f"compared within each metric's tolerance in the config, because "
                         f"these differ: {'; '.join(self.differences)}; re-run took "
                         f"{self.wall_time_s:.1f} s")
        lines += [f"note: {self.note}"] if self.note else []
        lines += [f"  moved: {m}" for m in self.moved]
        lines += [f"  input data differs: {d}" for d in self.data_moved]
        lines += [f"  artifact bytes differ: {a}" for a in self.artifacts_moved]
        lines.append("REPRODUCED" if self.ok else
                     f"NOT REPRODUCED: {len(self.moved)} number(s) and {len(self.data_moved)} "
                     "dataset(s) moved")
        return "\n".join(lines)


def code_lines(changed: list[str]) -> list[str]:
    if not changed:
        return ["code: every source file the run imports is as recorded"]
    return [f"code changed since the recording ({len(changed)} file(s)); a moved number may "
            "come from it:"] + [f"  {c}" for c in changed]


def _commit(git: dict) -> str:
    return f"{git.get('commit', 'unknown')[:10]}{' (dirty)' if git.get('dirty') else ''}"


def code_preview(manifest: dict, exp_dir: Path) -> list[str]:
    """Before a long re-run: the recorded commit and the recorded source files changed since."""
    recorded = manifest.get("code")
    if recorded is None:
        return [f"recorded at commit {_commit(manifest['git'])}; the recording lists no source "
                "digests (a manifest from before schema 2)"]
    now = files_now(recorded, exp_dir)
    return ([f"recorded at commit {_commit(manifest['git'])}; now {_commit(git_state(exp_dir))}"]
            + code_lines(code_changes(recorded, now)))


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
    git_now = git_state(exp_dir)
    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        out = execute(exp_dir, cfg, Path(tmp))
        artifacts_now = out.artifact_digests()
    then = manifest["env"]
    differs = bit_differences(then, out.env)
    exact = not differs
    moved = compare_metrics(manifest["metrics"], out.metrics,
                            None if exact else cfg.get("tolerances", {}))
    data_moved = [f"{k} (recorded {manifest['data'].get(k, '<absent>')[:12]}, now "
                  f"{out.ctx.data.get(k, '<absent>')[:12]})"
                  for k in sorted(manifest["data"].keys() | out.ctx.data.keys())
                  if manifest["data"].get(k) != out.ctx.data.get(k)]
    artifacts_moved = sorted(k for k in manifest["artifacts"].keys() | artifacts_now.keys()
                             if manifest["artifacts"].get(k) != artifacts_now.get(k))
    return ReproduceReport(
        exact=exact, differences=differs, lacks=lacking(then),
        code_changed=code_changes(manifest.get("code"), out.code),
        commits=(_commit(manifest["git"]), _commit(git_now)), moved=moved,
        data_moved=data_moved, artifacts_moved=artifacts_moved,
        note=cpu_note(then, out.env) if exact else None,
        wall_time_s=out.measured["wall_time_s"])
