"""Create the course's virtual environment (.venv): what `make venv` runs, and Windows' way in.

    python scripts/venv.py [--installer auto|uv|pip] [--torch auto|cpu] [--venv .venv]

Standard library only, so it runs before anything is installed, on Linux, macOS and Windows.

- **uv** (the default when `uv` is on PATH): `uv sync --locked` installs exactly `uv.lock`,
  the versions every platform resolves to from PyPI (a CUDA build of torch on Linux).
- **pip** (the default otherwise): a venv, torch first, then the course with `-c
  constraints.txt` (the export of `uv.lock` for pip). pip's own configuration is honoured, so
  a machine whose pip already offers a CPU torch wheel (find-links, a local index) installs
  that one and downloads no CUDA libraries; that is an accelerator of such machines only.
- `--torch cpu` takes torch from PyTorch's CPU-only index (about 200 MB instead of several
  GB of CUDA libraries on Linux). Optional; the same versions otherwise.
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


def plan(installer: str, torch: str, venv: Path, python: str) -> list[list[str]]:
    """The commands that build `venv` (pure, so that the tests can read it)."""
    py = str(venv_python(venv))
    if installer == "uv" and torch == "auto":
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
    parser.add_argument("--torch", choices=("auto", "cpu"), default="auto",
                        help="cpu: torch from PyTorch's CPU-only index (smaller)")
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
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=str(venv.resolve()))
    print(f"== setting up {venv} with {installer}"
          f"{' (CPU-only torch)' if args.torch == 'cpu' else ''} ==", flush=True)
    for cmd in plan(installer, args.torch, venv, sys.executable):
        print("$ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
            sys.exit(f"scripts/venv.py: this step failed: {' '.join(cmd)}")
    (venv / ".installed").write_text(f"{installer} torch={args.torch}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
