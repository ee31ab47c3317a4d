"""The manifest: everything needed to re-run an experiment and to notice that anything moved.

A manifest is one JSON file written atomically at the end of a run. It carries its own
sha256 (`manifest_sha256`, over every other field), so a hand-edited manifest is refused
rather than trusted.
"""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from .atomic import atomic_write_text
from .errors import InputError
from .hashing import sha256_json

SCHEMA = 1
REQUIRED = ("schema", "experiment", "config", "seed", "git", "env", "data", "inputs",
            "artifacts", "metrics", "wall_time_s", "peak_memory_mb", "manifest_sha256")
# Library versions a manifest records; any difference switches reproduce to tolerances.
TRACKED_PACKAGES = ("torch", "triton", "bitsandbytes", "numpy", "safetensors")


class ManifestError(InputError):
    """A manifest that is missing, malformed, edited, or whose files no longer match it."""


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Python and library versions, platform, CPU, thread count and device of this process."""
    env = {"python": platform.python_version()}
    env.update({name: _version(name) for name in TRACKED_PACKAGES})
    env.update(
        platform=platform.platform(),
        cpu=_cpu_model(),
        threads=torch.get_num_threads(),
        device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    )
    return env


def git_state(repo: str | Path) -> dict:
    """Commit hash and whether the working tree has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": "unknown", "dirty": True}


def seal(manifest: dict) -> dict:
    """Return `manifest` with its self-hash set."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return {**body, "manifest_sha256": sha256_json(body)}


def write_manifest(path: str | Path, manifest: dict) -> dict:
    """Seal and write `manifest` atomically; return what was written."""
    sealed = seal({"schema": SCHEMA, **manifest})
    missing = [k for k in REQUIRED if k not in sealed]
    if missing:
        raise ManifestError(f"manifest is missing fields {missing}")
    atomic_write_text(path, json.dumps(sealed, indent=2, sort_keys=True) + "\n")
    return sealed


def read_manifest(path: str | Path) -> dict:
    """Read and verify a manifest; raise ManifestError saying exactly what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"manifest not found: {path}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest {path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"manifest {path} must hold a JSON object")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise ManifestError(f"manifest {path} is missing fields {missing}")
    if manifest["schema"] != SCHEMA:
        raise ManifestError(f"manifest {path} has schema {manifest['schema']}, expected {SCHEMA}")
    if seal(manifest)["manifest_sha256"] != manifest["manifest_sha256"]:
        raise ManifestError(
            f"manifest {path} was edited after it was written (its manifest_sha256 no longer "
            "matches its contents); re-run the experiment instead of editing the manifest")
    return manifest

