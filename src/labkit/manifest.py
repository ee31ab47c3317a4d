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
from pathlib import Path, PurePosixPath

import torch

from .atomic import atomic_write_text
from .errors import InputError
from .hashing import sha256_json
from .numerics import cpu_identity, in_force

# Schema 2 adds `code` (sha256 of each source file the run imported) and, in `env`, the
# numerical mode and the CPU's identity. Schema 1 manifests are still read: reproduce re-runs
# them under today's rules and says what they lack.
SCHEMA = 2
READABLE_SCHEMAS = (1, 2)
REQUIRED = ("schema", "experiment", "config", "seed", "git", "env", "data", "inputs",
            "artifacts", "metrics", "wall_time_s", "peak_memory_mb", "manifest_sha256")
REQUIRED_SINCE_2 = ("code",)
# Fields that hold JSON objects; the three digest maps go from a name to a sha256 string.
OBJECTS = ("config", "git", "env", "data", "inputs", "artifacts", "metrics")
DIGEST_MAPS = ("data", "inputs", "artifacts")
# Library versions a manifest records; any difference switches reproduce to tolerances.
TRACKED_PACKAGES = ("torch", "triton", "bitsandbytes", "numpy", "safetensors")


class ManifestError(InputError):
    """A manifest that is missing, malformed, edited, or whose files no longer match it."""


def _kind(value) -> str:
    """How a message names a JSON value of the wrong kind: "a list", "str 'abc'"."""
    return "a list" if isinstance(value, list) else f"{type(value).__name__} {value!r:.40}"


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tolerance(tol) -> bool:
    """{"rtol": r, "atol": a}, each optional, each a number >= 0."""
    return isinstance(tol, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
        for v in (tol.get("rtol", 0), tol.get("atol", 0)))


def check_config(cfg, where: str) -> dict:
    """Refuse a config that is not an object with an integer `seed` (and sane `threads`,
    `tolerances`); `where` names it in the message (a config.json, or a manifest's config)."""
    if not isinstance(cfg, dict):
        raise ManifestError(f"{where} must be a JSON object, got {_kind(cfg)}")
    if "seed" not in cfg:
        raise ManifestError(f"{where} has no 'seed' (an integer)")
    if not _whole(cfg["seed"]):
        raise ManifestError(f"{where} must give an integer 'seed', got {_kind(cfg['seed'])}")
    threads = cfg.get("threads")
    if threads is not None and not (_whole(threads) and threads >= 1):
        raise ManifestError(f"{where}: 'threads' must be a positive integer, got {_kind(threads)}")
    tolerances = cfg.get("tolerances", {})
    if not (isinstance(tolerances, dict) and all(map(_tolerance, tolerances.values()))):
        raise ManifestError(f"{where}: 'tolerances' must map metric prefixes (or \"default\") "
                            'to {"rtol": r, "atol": a} with r, a >= 0')
    return cfg


def check_artifact_name(name, where: str = "") -> str:
    """Refuse an artifact path that is not relative or that climbs out of the experiment."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
        raise ManifestError(f"{where}{': ' if where else ''}artifact path {name!r} must be a "
                            "relative path inside the experiment folder (no leading '/', no '..')")
    return name


def check_fields(manifest: dict, where: str) -> None:
    """Refuse a manifest whose fields have the wrong shape (a list for `artifacts`, a config
    without `seed`, an artifact outside the experiment folder, an absolute input path)."""
    code = ("code",) if "code" in manifest else ()     # schema 1 has none
    for key in OBJECTS + code:
        if not isinstance(manifest[key], dict):
            raise ManifestError(f"{where}: '{key}' must be a JSON object, got "
                                f"{_kind(manifest[key])}")
    check_config(manifest["config"], f"{where}: 'config'")
    for key in DIGEST_MAPS + code:
        bad = [k for k, v in manifest[key].items() if not isinstance(v, str)]
        if bad:
            raise ManifestError(f"{where}: '{key}' must map names to sha256 strings; "
                                f"{bad[0]!r} does not")
    for name in manifest["artifacts"]:
        check_artifact_name(name, where)
    absolute = [k for k in manifest["inputs"] if PurePosixPath(k).is_absolute()]
    if absolute:
        raise ManifestError(f"{where}: input path {absolute[0]!r} must be relative to the "
                            "experiment folder")


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
    """Python and library versions, platform, CPU (name, identity and flags), thread count,
    numerical mode and device of this process."""
    env = {"python": platform.python_version()}
    env.update({name: _version(name) for name in TRACKED_PACKAGES})
    env.update(
        platform=platform.platform(),
        cpu=_cpu_model(),
        cpu_id=cpu_identity(),
        threads=torch.get_num_threads(),
        numerics=in_force(),
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
    missing = [k for k in REQUIRED + REQUIRED_SINCE_2 if k not in sealed]
    if missing:
        raise ManifestError(f"manifest is missing fields {missing}")
    check_fields(sealed, f"manifest {path}")
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
    if manifest["schema"] not in READABLE_SCHEMAS or isinstance(manifest["schema"], bool):
        raise ManifestError(f"manifest {path} has schema {manifest['schema']!r}, expected one "
                            f"of {list(READABLE_SCHEMAS)}")
    missing = [k for k in REQUIRED_SINCE_2 if manifest["schema"] >= 2 and k not in manifest]
    if missing:
        raise ManifestError(f"manifest {path} is missing fields {missing}")
    if seal(manifest)["manifest_sha256"] != manifest["manifest_sha256"]:
        raise ManifestError(
            f"manifest {path} was edited after it was written (its manifest_sha256 no longer "
            "matches its contents); re-run the experiment instead of editing the manifest")
    check_fields(manifest, f"manifest {path}")
    return manifest

