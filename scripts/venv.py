"""Create the course's virtual environment (.venv): what `make venv` runs, and Windows' way in.

    python scripts/venv.py [--installer auto|uv|pip] [--torch auto|cpu|cuda] [--venv .venv]

Standard library only, so it runs before anything is installed, on Linux, macOS and Windows.

- **uv** (the default when `uv` is on PATH): `uv sync --locked` installs exactly `uv.lock`,
  the versions every platform resolves to from PyPI (a CUDA build of torch on Linux).
- **pip** (the default otherwise): a venv, torch first, then the course with `-c
  constraints.txt` (the export of `uv.lock` for pip). pip's own configuration is honoured, so
  a machine whose pip already offers a CPU torch wheel (find-links, a local index) installs
  that one and downloads no CUDA libraries; that is an accelerator of such machines only.
- `--torch cpu` takes torch from PyTorch's CPU-only index (about 200 MB instead of several
  GB of CUDA libraries on Linux); `--torch cuda`, PyPI's build (CUDA on Linux), as the lock
  pins it. The same torch version either way.
- `--torch auto` (the default) is `cpu` on a Linux machine with no NVIDIA GPU (no driver in
  /proc/driver/nvidia, no `nvidia-smi`), and says so in one line; `cuda` everywhere else
  (PyPI's wheels for macOS and Windows hold no CUDA).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = ((3, 11), (3, 14))          # requires-python in pyproject.toml: >=3.11,<3.15
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def check_python(version: tuple[int, int] = sys.version_info[:2]) -> None:
    low, high = PYTHONS
    if not low <= version <= high:
        found = ".".join(map(str, version))
        sys.exit(f"scripts/venv.py: the course needs Python {low[0]}.{low[1]} to "
                 f"{high[0]}.{high[1]} (found {found}): run it with one of those, e.g. "
                 "PYTHON=python3.12 make venv, or py -3.12 scripts/venv.py on Windows")


def venv_python(venv: Path) -> Path:
    """The venv's interpreter: Scripts/python.exe on Windows, bin/python elsewhere."""
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def torch_pin() -> str:
    """torch's exact requirement from constraints.txt (`torch==X ; markers` -> `torch==X`)."""
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("torch=="):
            return line.split(";")[0].strip()
    sys.exit("scripts/venv.py: constraints.txt has no torch==VERSION line (run make lock)")


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver is loaded (its /proc entry) or its tool is installed."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def torch_build(choice: str, system: str | None = None, gpu=None) -> str:
    """"cpu" or "cuda" for `--torch choice`: auto takes the CPU build on Linux without an
    NVIDIA GPU (PyPI's Linux torch carries several GB of CUDA libraries it would not use).
    `system` (sys.platform) and `gpu` (has_nvidia_gpu) are there for the tests."""
    if choice != "auto":
        return choice
    linux = (system or sys.platform).startswith("linux")
    return "cpu" if linux and not (gpu or has_nvidia_gpu)() else "cuda"


def plan(installer: str, torch: str, venv: Path, python: str) -> list[list[str]]:
    """The commands that build `venv` with torch's `cpu` or `cuda` build (pure, so that the
    tests can read it)."""
    py = str(venv_python(venv))
    if installer == "uv" and torch == "cuda":
        return [["uv", "sync", "--locked", "--extra", "dev", "--python", python]]
    if installer == "uv":
        return [["uv", "venv", "--python", python, str(venv)],
                ["uv", "pip", "install", "--python", py, "--torch-backend", "cpu",
                 "-c", "constraints.txt", "-e", ".[dev]"]]
    torch_args = ["--index-url", CPU_INDEX] if torch == "cpu" else ["-c", "constraints.txt"]
    return [[python, "-m", "venv", str(venv)],
            [py, "-m", "pip", "install", "--quiet", torch_pin(), *torch_args],
            [py, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e", ".[dev]"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--installer", choices=("auto", "uv", "pip"), default="auto")
    parser.add_argument("--torch", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cpu: torch from PyTorch's CPU-only index (smaller); cuda: "
                             "PyPI's build; auto: cpu on Linux without an NVIDIA GPU")
    parser.add_argument("--venv", default=".venv")
    args = parser.parse_args(argv)
    check_python()
    installer = args.installer
    if installer == "auto":
        installer = "uv" if shutil.which("uv") else "pip"
    elif installer == "uv" and not shutil.which("uv"):
        sys.exit("scripts/venv.py: --installer uv, but uv is not on PATH "
                 "(https://docs.astral.sh/uv/ installs it; or use --installer pip)")
    venv = Path(args.venv)
    build = torch_build(args.torch)
    if args.torch == "auto" and build == "cpu":
        print("no NVIDIA GPU here (no /proc/driver/nvidia, no nvidia-smi): CPU-only torch "
              "(make venv TORCH=cuda takes PyPI's CUDA build)", flush=True)
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=str(venv.resolve()))
    print(f"== setting up {venv} with {installer}"
          f"{' (CPU-only torch)' if build == 'cpu' else ''} ==", flush=True)
    for cmd in plan(installer, build, venv, sys.executable):
        print("$ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
            sys.exit(f"scripts/venv.py: this step failed: {' '.join(cmd)}")
    (venv / ".installed").write_text(f"{installer} torch={build}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
