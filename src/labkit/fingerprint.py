"""Behavioural fingerprints: each experiment's tiny configuration, re-run bit for bit in CI.

A full run takes minutes to half an hour, too long to repeat for every change; its tiny
configuration (`tiny.json`) runs the same code in seconds. `fingerprint.json`, written beside
the manifest whenever the full run is recorded, holds what the tiny run produced: every
metric, and the digests of its data, inputs and artifacts. A change of code that moves the
tiny run's bits will move the full run's: the check fails, naming the experiment, until the
full run is re-recorded (`make run EXP=...`), or until a reviewed note says why the full run
cannot have moved (`python -m labkit fingerprint EXP --write --note "..."`). A refactor that
moves no number passes, whatever files it touched.

The pin holds within one CPU vendor, not across them (`labkit.provenance`), so the check
compares with the tiny run recorded on this machine's vendor: the recording's own, or one
kept under `other_cpus` (`python -m labkit fingerprint EXP --add-cpu`, on a machine of that
vendor, at a commit whose fingerprint holds on the recording's). With neither, the check says
so (UNCHECKED, `missing_cpu`) and runs nothing.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .atomic import atomic_write_text
from .compare import Moved, compare_metrics
from .experiment import code_lines, execute
from .manifest import ManifestError, check_config, read_manifest
from .numerics import cpu_identity
from .provenance import VERSION_KEYS, bit_differences, code_changes, cpu_note, cpu_vendor

TINY = "tiny.json"
FINGERPRINT = "fingerprint.json"


def read_tiny(exp_dir: Path) -> dict:
    path = exp_dir / TINY
    try:
        return check_config(json.loads(path.read_text(encoding="utf-8")), str(path))
    except FileNotFoundError:
        raise ManifestError(f"{exp_dir} has no {TINY} (the tiny configuration its "
                            "fingerprint runs)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None


def tiny_run(exp_dir: Path) -> tuple[dict, dict, dict, dict]:
    """Run the tiny configuration; (config, result, env, code) where result holds the metrics
    and the data, input and artifact digests."""
    cfg = read_tiny(exp_dir)
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as tmp:
        out = execute(exp_dir, cfg, Path(tmp))
        result = {"metrics": out.metrics, "data": out.ctx.data, "inputs": out.ctx.inputs,
                  "artifacts": out.artifact_digests()}
    env = {k: out.env.get(k) for k in (*VERSION_KEYS, "numerics", "cpu_id")}
    return cfg, result, env, out.code


def _manifest_sha(exp_dir: Path) -> str | None:
    path = exp_dir / "manifest.json"
    return read_manifest(path)["manifest_sha256"] if path.is_file() else None


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None


def write_fingerprint(exp_dir: str | Path, note: str | None = None,
                      add_cpu: bool = False) -> dict:
    """Run the tiny configuration and record it beside the manifest it belongs to. `note`
    (for a refresh without re-recording the full run) says why the full run cannot move.

    The record is this CPU vendor's and replaces the whole file: a tiny run that moved here
    has moved on other vendors too, so their entries go. `add_cpu` instead adds this vendor's
    tiny run to `other_cpus` of a fingerprint recorded on another vendor, leaving the rest as
    it is."""
    exp_dir = Path(exp_dir).resolve()
    path = exp_dir / FINGERPRINT
    old = _read(path) if path.is_file() else {}
    vendor = cpu_identity()["vendor"]
    if add_cpu and not old:
        raise ManifestError(f"{path} is missing: --add-cpu adds this CPU vendor's tiny run to "
                            f"an existing fingerprint (record one with --write)")
    if add_cpu and cpu_vendor(old.get("env", {})) == vendor:
        raise ManifestError(f"{path} was recorded on this CPU vendor ({vendor}): refresh it "
                            f"with --write, not --add-cpu")
    cfg, result, env, code = tiny_run(exp_dir)
    entry = {"note": note, "config": cfg, "env": env, "code": code, "result": result}
    if add_cpu:
        record = {**old, "other_cpus": {**old.get("other_cpus", {}), vendor: entry}}
    else:
        record = {"experiment": exp_dir.name, "manifest_sha256": _manifest_sha(exp_dir),
                  **entry}
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


@dataclass
class FingerprintReport:
    experiment: str
    problems: list[str]         # why the recording cannot be compared or belongs elsewhere
    moved: list[Moved]          # tiny-run numbers and digests that moved
    code_changed: list[str]
    cpu: str | None = None      # another CPU model than the recording's (allowed under the pin)
    missing_cpu: str | None = None  # no tiny run recorded on this CPU vendor: nothing compared

    @property
    def ok(self) -> bool:
        return not self.problems and not self.moved and not self.missing_cpu

    def summary(self) -> str:
        if self.ok:
            return f"{self.experiment}: fingerprint holds (tiny run identical)"
        lines = [f"{self.experiment}: STALE" if self.moved else f"{self.experiment}: UNCHECKED"]
        lines += [f"  {p}" for p in self.problems]
        if self.missing_cpu:
            lines.append(f"  {self.missing_cpu}")
        lines += [f"  moved: {m}" for m in self.moved[:20]]
        if len(self.moved) > 20:
            lines.append(f"  ... and {len(self.moved) - 20} more")
        lines += ["  " + line for line in code_lines(self.code_changed)]
        if self.cpu:
            lines.append(f"  {self.cpu}: if no source file changed, the pin did not hold on "
                         "this CPU — please report it")
        if self.moved:
            lines.append(f"  the code no longer produces what experiments/{self.experiment} "
                         "recorded: re-record it (make run EXP=experiments/"
                         f"{self.experiment}), and what loads its outputs; or, if the full run "
                         "cannot have moved, say why: python -m labkit fingerprint "
                         f"experiments/{self.experiment} --write --note \"...\"")
        return "\n".join(lines)


def check_fingerprint(exp_dir: str | Path) -> FingerprintReport:
    """Re-run the tiny configuration and compare it bit for bit with `fingerprint.json`'s
    entry for this CPU vendor."""
    exp_dir = Path(exp_dir).resolve()
    path = exp_dir / FINGERPRINT
    if not path.is_file():
        raise ManifestError(f"{path} is missing: record it with python -m labkit fingerprint "
                            f"{exp_dir} --write")
    recorded = _read(path)
    vendor, own = cpu_identity()["vendor"], cpu_vendor(recorded.get("env", {}))
    entry = recorded if own in (None, vendor) else recorded.get("other_cpus", {}).get(vendor)
    if entry is None:
        kept = ", ".join([own, *recorded.get("other_cpus", {})])
        return FingerprintReport(exp_dir.name, [], [], [], missing_cpu=(
            f"recorded on {kept} CPUs, and the pin holds within one vendor only: nothing to "
            f"compare this {vendor} CPU with; add its tiny run with python -m labkit "
            f"fingerprint experiments/{exp_dir.name} --add-cpu, on a commit whose fingerprint "
            f"holds on {own}"))
    problems = []
    if entry.get("config") != read_tiny(exp_dir):
        problems.append(f"{TINY} changed since the fingerprint was recorded")
    if recorded.get("manifest_sha256") != _manifest_sha(exp_dir):
        problems.append("the fingerprint belongs to another recording of the full run "
                        "(manifest_sha256 differs): record both with make run")
    _, result, env, code = tiny_run(exp_dir)
    problems += [f"cannot compare bit for bit, {d}" for d in
                 bit_differences(entry.get("env", {}), env)]
    return FingerprintReport(exp_dir.name, problems,
                             compare_metrics(entry.get("result", {}), result),
                             code_changes(entry.get("code"), code),
                             cpu_note(entry.get("env", {}), env))
