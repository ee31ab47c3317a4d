"""What decides a run's bits, and what differs between a recording and now.

Two runs of one config give bit-identical numbers when the same code runs on the same
arithmetic: the same library versions, the same numerical mode (`labkit.numerics`), the same
thread count. Under the pinned mode the CPU's model does not matter but its vendor does: an
AMD EPYC and an Intel Xeon give different last bits under the same pin (measured on every
experiment's tiny run; MKL documents its reproducible `MKL_CBWR` branches for Intel CPUs
only). Within one vendor the pin is promised, and a difference there is a bug to report
(`cpu_note`). Under the native mode the model matters too, down to its instruction-set flags.
`bit_differences` names every such field that differs; `code_changes` names every source
file that changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .hashing import sha256_file

# Library and device fields of a manifest's `env` that must agree for identical bits.
VERSION_KEYS = ("python", "torch", "triton", "bitsandbytes", "numpy", "safetensors", "device")
SRC_ROOT = Path(__file__).resolve().parents[1]      # src/, holding every course package


def code_digests(exp_dir: Path) -> dict[str, str]:
    """sha256 of the experiment's script and of every module under src/ loaded so far (call
    it after the run: what was imported is the code that ran). Keys are relative paths."""
    digests = {f"{exp_dir.name}/experiment.py": sha256_file(exp_dir / "experiment.py")}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().is_relative_to(SRC_ROOT):
            digests[Path(path).resolve().relative_to(SRC_ROOT).as_posix()] = sha256_file(path)
    return dict(sorted(digests.items()))


def code_changes(recorded: dict | None, now: dict[str, str]) -> list[str]:
    """Each source file whose bytes differ between the recording and now, with how."""
    if recorded is None:
        return []
    changes = []
    for name in sorted(recorded.keys() | now.keys()):
        if name not in now:
            changes.append(f"{name} (not run now)")
        elif name not in recorded:
            changes.append(f"{name} (new: not run when recorded)")
        elif recorded[name] != now[name]:
            changes.append(f"{name} (changed)")
    return changes


def files_now(recorded: dict[str, str], exp_dir: Path) -> dict[str, str]:
    """Today's digests of the files a recording ran (before re-running, to warn early)."""
    now = {}
    for name in recorded:
        path = (exp_dir.parent / name) if name.startswith(f"{exp_dir.name}/") else SRC_ROOT / name
        if path.is_file():
            now[name] = sha256_file(path)
    return now


def _cpu_line(cpu) -> str:
    if not isinstance(cpu, dict):
        return str(cpu)
    flags = "unknown flags" if cpu.get("flags") is None else "+".join(cpu["flags"]) or "no flags"
    return (f"{cpu.get('vendor')} family {cpu.get('family')} model {cpu.get('model')} "
            f"({cpu.get('name')}; {flags})")


def lacking(env: dict) -> list[str]:
    """What a recording made before the pinned mode does not say about its arithmetic."""
    return [what for key, what in (("numerics", "its numerical mode and thread counts"),
                                   ("cpu_id", "its CPU's family, model and flags"))
            if key not in env]


def bit_differences(then: dict, now: dict) -> list[str]:
    """Every field deciding the bits that differs between two `env`s, named with both values
    (empty: the numbers must be identical)."""
    out = [f"{k}: {then.get(k)} -> {now.get(k)}" for k in VERSION_KEYS
           if then.get(k) != now.get(k)]
    if "numerics" not in then:
        return out + ["numerics: not recorded (a manifest from before labkit pinned numerics)"]
    a, b = then["numerics"], now["numerics"]
    for key in ("mode", "torch_cpu_capability", "numpy_simd", "intra_op_threads"):
        if a.get(key) != b.get(key):
            out.append(f"numerics.{key}: {a.get(key)} -> {b.get(key)}")
    env_a, env_b = a.get("env", {}), b.get("env", {})
    out += [f"{k}: {env_a.get(k, '<unset>')} -> {env_b.get(k, '<unset>')}"
            for k in sorted(env_a.keys() | env_b.keys()) if env_a.get(k) != env_b.get(k)]
    native = "native" in (a.get("mode"), b.get("mode"))
    if native and then.get("cpu_id") != now.get("cpu_id"):
        out.append(f"cpu (native mode): {_cpu_line(then.get('cpu_id'))} -> "
                   f"{_cpu_line(now.get('cpu_id'))}")
    elif cpu_vendor(then) != cpu_vendor(now):
        out.append(f"cpu vendor (the pin holds within one vendor): {cpu_vendor(then)} -> "
                   f"{cpu_vendor(now)}")
    return out


def cpu_vendor(env: dict) -> str | None:
    """The CPU vendor an `env` records (`GenuineIntel`, `AuthenticAMD`; None if unrecorded)."""
    cpu = env.get("cpu_id")
    return cpu.get("vendor") if isinstance(cpu, dict) else None


def cpu_note(then: dict, now: dict) -> str | None:
    """Under the pin another CPU model of the same vendor is allowed; say so when it
    happens."""
    if then.get("cpu_id") in (None, now.get("cpu_id")) or cpu_vendor(then) != cpu_vendor(now):
        return None
    return (f"other CPU ({_cpu_line(then['cpu_id'])} -> {_cpu_line(now.get('cpu_id'))}); the "
            "pinned mode promises the same bits on any AVX2 CPU of the same vendor")
