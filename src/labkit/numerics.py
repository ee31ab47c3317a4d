"""The pinned numerical mode: the same bits on any x86-64 CPU with AVX2 of one vendor, whatever
its core count.

Four libraries choose their arithmetic by the machine they find, and each choice can move the
last bit of a float sum:
- PyTorch runs its vectorised CPU kernels (matmul epilogues, GELU, layer norm, softmax, exp)
  in the widest instruction set the CPU has: AVX-512 on a Zen 4 or a Xeon, AVX2 on a laptop;
- MKL, torch's BLAS, picks a code path per CPU, and oneDNN likewise;
- NumPy (the Triton interpreter's arithmetic) dispatches its loops by CPU, and its OpenBLAS
  picks a kernel per CPU;
- every one of them splits reductions by the number of threads, which defaults to the cores.
The pin fixes each to a setting every x86-64 CPU with AVX2 and FMA (Intel since 2013, AMD
since 2015) can honour. It does not make an Intel and an AMD CPU agree: MKL promises its
`MKL_CBWR` branches on Intel CPUs, and the two vendors differ in the last bits under it
(`labkit.provenance`, which names the vendor among what decides the bits). The libraries
read these variables once, when they load, so the pin must be in the environment before
Python starts: `python -m labkit run|reproduce` re-runs itself in a child process with
`pinned_env(threads)` whenever the caller's environment differs.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from .errors import InputError

DEFAULT_THREADS = 2
# NumPy's dispatch targets above AVX2+FMA (X86_V3): switched off so NumPy runs its AVX2 loops.
_NUMPY_ABOVE_AVX2 = ("X86_V4", "AVX512_ICL", "AVX512_SPR")
# CPU flags that decide which kernels can run; recorded in a manifest beside the CPU's identity.
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16")
NEEDED_FLAGS = ("avx2", "fma")


def pinned_env(threads: int = DEFAULT_THREADS) -> dict[str, str]:
    """The environment variables of the pinned mode for `threads` intra-op threads."""
    return {
        "ATEN_CPU_CAPABILITY": "avx2",          # PyTorch's vectorised CPU kernels
        "MKL_CBWR": "AVX2",                     # MKL's conditional numerical reproducibility
        "ONEDNN_MAX_CPU_ISA": "AVX2",           # oneDNN (mkldnn) kernels
        "NPY_DISABLE_CPU_FEATURES": " ".join(_NUMPY_ABOVE_AVX2),
        "OPENBLAS_CORETYPE": "Haswell",         # NumPy's OpenBLAS: its AVX2 kernels
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": str(threads),        # torch's and MKL's thread pools
        "MKL_NUM_THREADS": str(threads),
    }


def overridden(threads: int = DEFAULT_THREADS, environ=None) -> dict[str, tuple[str, str]]:
    """Pinned variables the environment sets otherwise: name -> (the caller's value, the pin)."""
    environ = os.environ if environ is None else environ
    return {k: (environ.get(k, "<unset>"), v) for k, v in pinned_env(threads).items()
            if environ.get(k) != v}


def cpu_identity() -> dict:
    """Vendor, family, model, name and the kernel-deciding flags of this CPU (Linux reads
    /proc/cpuinfo; elsewhere only the name and the architecture are known)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name", "flags") \
                    and key not in fields:
                fields[key] = value.strip()
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {
        "arch": platform.machine(),
        "vendor": fields.get("vendor_id", "unknown"),
        "family": fields.get("cpu family", "unknown"),
        "model": fields.get("model", "unknown"),
        "name": fields.get("model name") or platform.processor() or platform.machine(),
        "flags": [f for f in CPU_FLAGS if f in flags] if flags else None,
    }


def check_can_pin(cpu: dict | None = None) -> None:
    """Refuse, in one line, a machine the pinned mode cannot run on."""
    cpu = cpu_identity() if cpu is None else cpu
    if cpu["arch"].lower() not in ("x86_64", "amd64"):
        raise InputError(f"the pinned numerical mode needs an x86-64 CPU with AVX2; this is "
                         f"{cpu['arch']} ({cpu['name']}). Run with --numerics native: numbers "
                         "are then compared within each metric's tolerance")
    missing = [f for f in NEEDED_FLAGS if cpu["flags"] is not None and f not in cpu["flags"]]
    if missing:
        raise InputError(f"the pinned numerical mode needs AVX2 and FMA; this CPU "
                         f"({cpu['name']}) lacks {', '.join(missing)}. Run with --numerics "
                         "native: numbers are then compared within each metric's tolerance")


def _numpy_simd() -> list[str]:
    """NumPy's dispatch targets in force in this process (the pin leaves X86_V3 alone)."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:
        return ["unknown"]
    return [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]


def in_force(threads: int | None = None) -> dict:
    """What decides the bits in this process: the mode, torch's CPU capability, the pinned
    variables as set, NumPy's SIMD targets and the thread counts. `mode` is "pinned" only
    when every pinned variable holds and torch really runs its AVX2 kernels."""
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    capability = torch.backends.cpu.get_cpu_capability()
    pinned = not overridden(threads) and capability == "AVX2"
    return {
        "mode": "pinned" if pinned else "native",
        "torch_cpu_capability": capability,
        "env": {k: os.environ.get(k, "<unset>") for k in pinned_env(threads)},
        "numpy_simd": _numpy_simd(),
        "intra_op_threads": torch.get_num_threads(),
    }


def check_pinned(threads: int) -> dict:
    """In the pinned child: confirm the pin took (torch can fall back from AVX2 silently)."""
    state = in_force(threads)
    if state["mode"] != "pinned":
        raise InputError(f"the pinned numerical mode did not take: torch runs "
                         f"{state['torch_cpu_capability']} kernels and "
                         f"{sorted(overridden(threads)) or 'no'} variables differ from the pin")
    return state


def describe_overrides(threads: int) -> str:
    """One line naming what the pin changes in the caller's environment, for the log."""
    changes = overridden(threads)
    return ", ".join(f"{k} {old}->{new}" for k, (old, new) in sorted(changes.items()))


def relaunch_pinned(argv: list[str], threads: int) -> int:
    """Run `python -m labkit ARGV` in a child process under the pin; return its exit code."""
    import subprocess

    print(f"labkit: pinned numerics, {threads} thread(s) (set for this run: "
          f"{describe_overrides(threads)})", file=sys.stderr, flush=True)
    # The marker stops a child re-launching itself; a grandchild wanting other threads may.
    env = {**os.environ, **pinned_env(threads), "LABKIT_PINNED_CHILD": f"threads={threads}"}
    return subprocess.call([sys.executable, "-m", "labkit", *argv], env=env)
