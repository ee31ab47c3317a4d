"""Wheels carried to a lent GPU machine that has no network: fetched here, installed there.

The lent machine holds torch, triton, numpy, pytest and psutil but not bitsandbytes, the
dequant benchmark's CPU-and-GPU peer. Its wheel is 43 MB: a library for every CUDA and ROCm
release it supports, too much beside the working tree in the 64 MiB a device call carries. The
lent machines' torch is a CUDA 13 build (the device folder's KINDS.md), so `main` keeps the
CPU and CUDA 13 libraries only (`KEEP`, about 8 MB) and rewrites the wheel's RECORD to match:

    make device-wheels           # here, with the registries: download, slim, into WHEELS
    run(carry=["build/device-wheels"], command="make device-check ...")   # there

`install()`, which device_check.py calls first, installs whatever WHEELS holds with
`pip install --no-index --no-deps --target SITE` (no network, nothing outside the tree) and
puts SITE on the PYTHONPATH its steps inherit. A wheel whose package is already importable is
left alone; no wheels, or a failed install, only means the steps run without that package
(bench_dequant then says bitsandbytes was skipped).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEELS = Path("build/device-wheels")     # relative to the root; ignored by git
SITE = Path("build/device-site")
# What `make device-wheels` fetches: the lent machine's platform (Linux x86-64, glibc 2.24+).
PACKAGES = ("bitsandbytes",)
PLATFORM = "manylinux_2_24_x86_64"
# A wheel's native libraries that are kept (the others are another CUDA's or ROCm's).
NATIVE = re.compile(r"\.so(\.\d+)*$")
KEEP = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")


def package_of(wheel: Path) -> str:
    """The importable name a wheel file is for ("bitsandbytes-0.50.2-py3-...whl")."""
    return wheel.name.split("-", 1)[0].replace("-", "_").lower()


def install(root: Path, timeout: float = 120) -> list[str]:
    """Install the carried wheels not importable yet; a line for each, what was done."""
    wheels = sorted((root / WHEELS).glob("*.whl"))
    wanted = [w for w in wheels if importlib.util.find_spec(package_of(w)) is None]
    notes = [f"{package_of(w)}: already importable, carried wheel not needed"
             for w in wheels if w not in wanted]
    if not wanted:
        return notes or [f"no wheels carried in {WHEELS}/"]
    site = root / SITE
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
           "--disable-pip-version-check", "--upgrade", "--target", str(site),
           *map(str, wanted)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return notes + [f"could not install {[w.name for w in wanted]}: {e}"]
    if done.returncode != 0:
        return notes + [f"pip could not install {[w.name for w in wanted]}: "
                        f"{(done.stderr or done.stdout).strip()[-500:]}"]
    sys.path.append(str(site))              # this process reports their versions
    os.environ["PYTHONPATH"] = os.pathsep.join(    # the steps' children import them
        [*filter(None, [os.environ.get("PYTHONPATH")]), str(site)])
    return notes + [f"{package_of(w)}: installed from {w.name} into {SITE}/" for w in wanted]


def slim(wheel: Path, out: Path) -> Path:
    """A copy of `wheel` in folder `out` without the native libraries KEEP does not match,
    its RECORD listing what is left (same file name: pip reads the tags from it)."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / wheel.name
    with zipfile.ZipFile(wheel) as src, tempfile.NamedTemporaryFile(
            dir=out, suffix=".part", delete=False) as tmp:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            kept = [i for i in src.infolist()
                    if not NATIVE.search(i.filename) or KEEP.search(i.filename)]
            record = next(i.filename for i in kept if i.filename.endswith(".dist-info/RECORD"))
            lines = []
            for info in kept:
                if info.filename == record:
                    continue
                data = src.read(info)
                dst.writestr(info, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                lines.append(f"{info.filename},sha256={digest.decode()},{len(data)}")
            dst.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    os.replace(tmp.name, target)
    return target


def main() -> int:
    """`make device-wheels`: download PACKAGES (constraints.txt's versions) for the lent
    machine's platform and write their slimmed wheels to WHEELS."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", "--platform", PLATFORM, "-c", str(root / "constraints.txt"),
                        "-d", tmp, *PACKAGES], check=True)
        for wheel in sorted(Path(tmp).glob("*.whl")):
            done = slim(wheel, root / WHEELS)
            print(f"{done.relative_to(root)}: {wheel.stat().st_size / 2**20:.1f} MiB -> "
                  f"{done.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
