"""Where the course installs: the README's install resolves from PyPI alone on every platform it
promises, uv.lock and constraints.txt agree, and the two setup scripts plan what they say.

The resolution tests ask PyPI (the only network CI has) and download no wheels: uv reads the
wheels' metadata. Offline outside CI they skip, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# (uv's --python-platform, what the README calls it, whether triton is installed there)
PLATFORMS = [("x86_64-unknown-linux-gnu", "Linux x86_64", True),
             ("aarch64-unknown-linux-gnu", "Linux aarch64", True),
             ("aarch64-apple-darwin", "macOS arm64", False),
             ("x86_64-pc-windows-msvc", "Windows amd64", False)]
PYTHONS = ["3.11", "3.12", "3.13", "3.14"]
MACOS = "14.0"   # torch's macOS wheels are built for macOS 14 (Sonoma) and later


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def uv(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "uv", *args, "--no-config"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.fixture(scope="module")
def pypi():
    try:
        urllib.request.urlopen("https://pypi.org/simple/uv/", timeout=10).close()
    except OSError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PyPI is not reachable ({e}): the resolution tests need it")


def test_requires_python_is_what_the_scripts_and_lock_say():
    assert PYPROJECT["project"]["requires-python"] == ">=3.11,<3.15"
    assert load_script("venv").PYTHONS == ((3, 11), (3, 14))
    lock = (ROOT / "uv.lock").read_text(encoding="utf-8")
    assert 'requires-python = ">=3.11, <3.15"' in lock, "uv.lock is for another Python range"
    assert PYTHONS == [f"3.{m}" for m in range(11, 15)], "test every Python the range admits"


def test_constraints_is_the_export_of_the_lock():
    proc = uv("export", "--frozen", "--extra", "dev", "--no-hashes", "--no-emit-project",
              "--no-header", "--no-annotate")
    assert proc.returncode == 0, proc.stderr
    body = "".join(line + "\n" for line in
                   (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()
                   if not line.startswith("#"))
    assert body == proc.stdout, "constraints.txt is not uv.lock's export: run make lock"


def test_torch_chooses_triton_on_linux():
    """Only torch is pinned by hand; triton is a range, so torch's Linux wheel picks it."""
    deps = PYPROJECT["project"]["dependencies"]
    assert "triton>=3.7; sys_platform == 'linux'" in deps
    assert PYPROJECT["tool"]["uv"]["constraint-dependencies"] == ["torch==2.13.0"]
    assert not [d for d in deps if "==" in d.split(";")[0]], "exact versions: uv.lock only"


def test_lock_is_current(pypi):
    proc = uv("lock", "--locked")
    assert proc.returncode == 0, f"uv.lock does not match pyproject.toml:\n{proc.stderr}"


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("target,label,has_triton", PLATFORMS, ids=[p[1] for p in PLATFORMS])
def test_pip_install_resolves_from_pypi(pypi, target, label, has_triton, python):
    """The README's pip path (`pip install -c constraints.txt -e .[dev]`), wheels only."""
    proc = uv("pip", "compile", "pyproject.toml", "--extra", "dev", "-c", "constraints.txt",
              "--python-platform", target, "--python-version", python, "--only-binary", ":all:",
              "--no-header", "--no-annotate", "--quiet", MACOSX_DEPLOYMENT_TARGET=MACOS)
    assert proc.returncode == 0, f"{label}, Python {python}: no install resolves:\n{proc.stderr}"
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", proc.stdout, re.M))
    assert pins.get("torch") == "2.13.0", f"{label}, Python {python}: torch {pins.get('torch')}"
    assert ("triton" in pins) == has_triton, f"{label}: triton {pins.get('triton')}"
    if has_triton:
        assert tuple(map(int, pins["triton"].split(".")[:2])) >= (3, 7)


def test_every_tested_python_and_no_other_is_admitted():
    admitted = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert [v for v in ("3.10", *PYTHONS, "3.15") if v in admitted] == PYTHONS


# -- scripts/venv.py: what `make venv` runs ---------------------------------------------------

def test_venv_plans():
    venv = load_script("venv")
    py = str(venv.venv_python(Path(".venv")))
    assert venv.plan("uv", "cuda", Path(".venv"), "python3") == [
        ["uv", "sync", "--locked", "--extra", "dev", "--python", "python3"]]
    pip = venv.plan("pip", "cuda", Path(".venv"), "python3")
    assert pip[1] == [py, "-m", "pip", "install", "--quiet", "torch==2.13.0",
                      "-c", "constraints.txt"]
    assert pip[2][-4:] == ["-c", "constraints.txt", "-e", ".[dev]"]
    cpu = venv.plan("pip", "cpu", Path(".venv"), "python3")
    assert cpu[1][-2:] == ["--index-url", "https://download.pytorch.org/whl/cpu"]
    assert "--torch-backend" in venv.plan("uv", "cpu", Path(".venv"), "python3")[1]


@pytest.mark.parametrize("system, gpu, choice, build", [
    ("linux", False, "auto", "cpu"), ("linux", True, "auto", "cuda"),
    ("darwin", False, "auto", "cuda"), ("win32", False, "auto", "cuda"),
    ("linux", False, "cuda", "cuda"), ("darwin", False, "cpu", "cpu")])
def test_venv_takes_the_cpu_torch_on_linux_without_an_nvidia_gpu(system, gpu, choice, build):
    venv = load_script("venv")
    assert venv.torch_build(choice, system, lambda: gpu) == build


@pytest.mark.parametrize("gpu", [False, True])
def test_make_venv_says_which_torch_it_chose(monkeypatch, capsys, tmp_path, gpu):
    """The detection faked both ways: the default names its choice in one line (no GPU) and
    installs that build; the commands are recorded, not run."""
    venv = load_script("venv")
    ran = []
    monkeypatch.setattr(venv, "has_nvidia_gpu", lambda: gpu)
    monkeypatch.setattr(venv.sys, "platform", "linux")
    monkeypatch.setattr(venv.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or
                        venv.subprocess.CompletedProcess(cmd, 0))
    (tmp_path / "v").mkdir()
    assert venv.main(["--installer", "pip", "--venv", str(tmp_path / "v")]) == 0
    said = capsys.readouterr().out
    assert ("CPU-only torch (make venv TORCH=cuda" in said) is not gpu, said
    assert ("https://download.pytorch.org/whl/cpu" in ran[1]) is not gpu, ran[1]
    assert (tmp_path / "v" / ".installed").read_text() == \
        f"pip torch={'cuda' if gpu else 'cpu'}\n"


def test_venv_refuses_an_old_python(capsys):
    venv = load_script("venv")
    with pytest.raises(SystemExit) as e:
        venv.check_python((3, 10))
    assert "Python 3.11 to 3.14 (found 3.10)" in str(e.value)
    venv.check_python((3, 12))


# -- scripts/hosted.py: the Colab cell --------------------------------------------------------

@pytest.fixture
def hosted():
    module = load_script("hosted")
    locked = module.locked_versions((ROOT / "constraints.txt").read_text(encoding="utf-8"))
    needs, floor = module.course_requirements((ROOT / "pyproject.toml").read_text("utf-8"))
    return module, locked, needs, floor


COLAB = {"torch": "2.10.0+cu126", "triton": "3.6.0", "numpy": "2.0.2", "matplotlib": "3.10.0",
         "tqdm": "4.67.1", "psutil": "5.9.5", "safetensors": "0.5.3", "peft": "0.17.1"}


def test_hosted_keeps_colabs_torch_and_raises_triton(hosted):
    module, locked, needs, floor = hosted
    assert floor == (2, 10) and set(needs) == {"numpy", "safetensors", "psutil", "tqdm",
                                               "matplotlib"}
    steps = module.plan(COLAB, "Linux", locked, needs, floor)
    assert steps == [["install", "--no-deps", "-e", str(ROOT)],
                     ["install", f"bitsandbytes=={locked['bitsandbytes']}"],
                     ["install", "--no-deps", "triton==3.7.1"]]


def test_hosted_changes_nothing_recent_enough(hosted):
    module, locked, needs, floor = hosted
    ready = {**COLAB, "triton": "3.8.0", "bitsandbytes": "0.48.0"}
    assert module.plan(ready, "Linux", locked, needs, floor) == [
        ["install", "--no-deps", "-e", str(ROOT)]]
    # macOS and Windows have no triton wheel: none is asked for there.
    no_triton = {k: v for k, v in ready.items() if k != "triton"}
    assert module.plan(no_triton, "Darwin", locked, needs, floor) == [
        ["install", "--no-deps", "-e", str(ROOT)]]


def test_hosted_installs_torch_only_below_the_floor(hosted):
    module, locked, needs, floor = hosted
    old = {**COLAB, "torch": "2.9.1", "triton": "3.7.1", "bitsandbytes": "0.48.0"}
    assert ["install", "torch==2.13.0"] in module.plan(old, "Linux", locked, needs, floor)
    assert module.version_tuple("2.10.0+cu126") == (2, 10, 0)


@pytest.mark.slow
def test_hosted_setup_in_a_venv_with_another_triton(tmp_path):
    """The Colab cell's script, for real: a venv whose torch pinned an older triton (3.6, as
    Colab's may) ends with its torch untouched, triton raised to the floor, and the course's
    kernels running."""
    venv = tmp_path / "hosted"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(load_script("venv").venv_python(venv))
    pip = [py, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0", "triton==3.6.0"], check=True, timeout=900)
    torch_before = subprocess.run([py, "-c", "import torch; print(torch.__version__)"],
                                  capture_output=True, text=True, check=True).stdout
    proc = subprocess.run([py, str(ROOT / "scripts" / "hosted.py")], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton==3.7.1" in proc.stdout
    check = ("import torch, triton, minimoe, minigpt\n"
             "from minimoe import flatten_sort_count, scatter2scatter\n"
             "x, W = torch.randn(5, 8), torch.randn(3, 8, 4)\n"
             "idx = torch.tensor([[0, 2], [1, 0], [2, 2], [0, 1], [1, 2]])\n"
             "sei, ssi, _ = flatten_sort_count(idx, 3)\n"
             "y = scatter2scatter(x, W, sei, ssi, k=2)\n"
             "ref = torch.stack([x[t] @ W[idx[t, j]] for t in range(5) for j in range(2)])\n"
             "assert torch.allclose(y, ref, atol=1e-5), 'kernel disagrees with the loop'\n"
             "print(torch.__version__, triton.__version__)\n")
    out = subprocess.run([py, "-c", check], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [torch_before.strip(), "3.7.1"]
