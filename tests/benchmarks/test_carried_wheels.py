"""benchmarks/carried_wheels.py: wheels slimmed here, installed offline on the lent machine."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import carried_wheels  # noqa: E402

NAME = "carried_demo"


def make_wheel(folder: Path) -> Path:
    """A small wheel of package NAME with three native libraries: CPU, CUDA 13.0, CUDA 12.1."""
    wheel = folder / f"{NAME}-0.1-py3-none-any.whl"
    info = f"{NAME}-0.1.dist-info"
    files = {f"{NAME}/__init__.py": "VALUE = 42\n",
             f"{NAME}/libbitsandbytes_cpu.so": "cpu", f"{NAME}/libbitsandbytes_cuda130.so": "13",
             f"{NAME}/libbitsandbytes_cuda121.so": "12" * 1000,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n",
             f"{info}/RECORD": "stale\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def test_slim_keeps_the_cpu_and_cuda13_libraries_and_a_true_record(tmp_path):
    slim = carried_wheels.slim(make_wheel(tmp_path), tmp_path / "out")
    with zipfile.ZipFile(slim) as z:
        names = set(z.namelist())
        record = z.read(f"{NAME}-0.1.dist-info/RECORD").decode()
    assert f"{NAME}/libbitsandbytes_cuda121.so" not in names
    assert {f"{NAME}/libbitsandbytes_cpu.so", f"{NAME}/libbitsandbytes_cuda130.so"} <= names
    assert sorted(line.split(",")[0] for line in record.splitlines()) == sorted(names)
    assert "stale" not in record and not list((tmp_path / "out").glob("*.part"))


def test_install_puts_the_carried_wheels_on_the_childrens_path(tmp_path, monkeypatch):
    carried_wheels.slim(make_wheel(tmp_path), tmp_path / carried_wheels.WHEELS)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(sys, "path", list(sys.path))
    notes = carried_wheels.install(tmp_path)
    assert notes == [f"{NAME}: installed from {NAME}-0.1-py3-none-any.whl into "
                     f"{carried_wheels.SITE}/"]
    assert os.environ["PYTHONPATH"] == f"/elsewhere{os.pathsep}{tmp_path / carried_wheels.SITE}"
    child = subprocess.run([sys.executable, "-c", f"import {NAME}; print({NAME}.VALUE)"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "42"


def test_without_wheels_nothing_is_installed(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert carried_wheels.install(tmp_path) == [f"no wheels carried in {carried_wheels.WHEELS}/"]
    assert "PYTHONPATH" not in os.environ


def test_a_package_already_importable_is_left_alone(tmp_path):
    wheel = make_wheel(tmp_path)
    (tmp_path / carried_wheels.WHEELS).mkdir(parents=True)
    wheel.rename(tmp_path / carried_wheels.WHEELS / "pytest-0.1-py3-none-any.whl")
    assert carried_wheels.install(tmp_path) == [
        "pytest: already importable, carried wheel not needed"]
