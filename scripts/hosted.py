"""Install the course into a hosted notebook's running Python (Colab), keeping its torch.

    python scripts/hosted.py [--dry-run]

Each lab notebook's first cell runs this on Colab only (after cloning the course). A hosted
runtime already holds torch, numpy and matplotlib, some of them imported by the notebook's
kernel, so nothing it holds is replaced:
- the course itself is installed without dependencies (`pip install --no-deps -e`);
- what is missing (safetensors, bitsandbytes, peft, ...) is installed at uv.lock's versions;
- torch is kept when it is at least the course's floor (pyproject.toml), installed otherwise;
- triton (Linux only) is kept at or above 3.7, the oldest whose interpreter runs the labs'
  kernels; below it (Colab's torch may pin 3.6) uv.lock's triton is installed *without*
  dependencies, beside the torch that pinned the older one. pip then warns that torch wanted
  its own triton: the course's kernels run on the new one; torch.compile may not.
Where a GPU is present the kernels run compiled; without one, in Triton's interpreter.

Standard library only: it runs before anything of the course is importable.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRITON_FLOOR = (3, 7)
NOTEBOOK_ORACLES = ("bitsandbytes", "peft")   # outside libraries the labs' notebooks import


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.10.0+cu126' -> (2, 10, 0): the release numbers, enough to compare with a floor."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def locked_versions(constraints: str) -> dict[str, str]:
    """name -> version from constraints.txt (uv.lock's export; markers dropped, first wins)."""
    found: dict[str, str] = {}
    for line in constraints.splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        if m:
            found.setdefault(canonical(m[1]), m[2])
    return found


def course_requirements(pyproject: str) -> tuple[list[str], tuple[int, ...]]:
    """The course's runtime dependency names (torch and triton apart) and torch's floor."""
    names, torch_floor = [], (0,)
    for req in tomllib.loads(pyproject)["project"]["dependencies"]:
        name = canonical(re.match(r"[A-Za-z0-9_.-]+", req)[0])
        if name == "torch":
            m = re.search(r">=\s*([\d.]+)", req)
            torch_floor = version_tuple(m[1]) if m else (0,)
        elif name != "triton":
            names.append(name)
    return names, torch_floor


def plan(installed: dict[str, str], system: str, locked: dict[str, str],
         needs: list[str], torch_floor: tuple[int, ...]) -> list[list[str]]:
    """pip argument lists that complete `installed` (canonical name -> version) for the
    course on `system` (platform.system()), replacing nothing that is recent enough."""
    steps = [["install", "--no-deps", "-e", str(ROOT)]]
    torch = installed.get("torch")
    if torch is None or version_tuple(torch) < torch_floor:
        steps.append(["install", f"torch=={locked['torch']}"])
    missing = [f"{n}=={locked[n]}" for n in (*needs, *NOTEBOOK_ORACLES) if n not in installed]
    if missing:
        steps.append(["install", *missing])
    triton = installed.get("triton")
    if system == "Linux" and (triton is None or version_tuple(triton) < TRITON_FLOOR):
        steps.append(["install", "--no-deps", f"triton=={locked['triton']}"])
    return steps


def installed_versions() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()
            if d.metadata["Name"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the pip steps only")
    args = parser.parse_args(argv)
    locked = locked_versions((ROOT / "constraints.txt").read_text(encoding="utf-8"))
    needs, floor = course_requirements((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    installed = installed_versions()
    print(f"hosted setup: torch {installed.get('torch', 'missing')}, triton "
          f"{installed.get('triton', 'missing')}, Python {platform.python_version()}", flush=True)
    for step in plan(installed, platform.system(), locked, needs, floor):
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", *step[1:]]
        print("$ pip " + " ".join(step), flush=True)
        if not args.dry_run and subprocess.run(cmd).returncode != 0:
            sys.exit(f"hosted setup: this step failed: pip {' '.join(step)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
