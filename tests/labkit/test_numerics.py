"""The pinned numerical mode (labkit.numerics) and what decides the bits (labkit.provenance):
the pin wins over the caller's environment, a manifest records it, and reproduce compares
exactly only when everything that decides the bits agrees, naming what does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import read_manifest
from labkit.errors import InputError
from labkit.manifest import seal
from labkit.numerics import (
    CPU_FLAGS,
    DEFAULT_THREADS,
    check_can_pin,
    cpu_identity,
    overridden,
    pinned_env,
)
from labkit.provenance import bit_differences, code_changes, cpu_note, cpu_vendor, lacking

ROOT = Path(__file__).resolve().parents[2]

# An experiment whose numbers depend on the kernels: GELU and a matmul (bits differ between
# torch's AVX2 and AVX-512 kernels), and what the process ran with.
EXPERIMENT = '''
import hashlib
import torch

def run(cfg, ctx):
    g = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(64, 200, generator=g)
    y = torch.nn.functional.gelu(x) @ torch.randn(200, 33, generator=g)
    return {"digest": hashlib.sha256(y.numpy().tobytes()).hexdigest(),
            "sum": y.sum().item(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}
'''


def labkit(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m labkit ARGS` with the caller's environment plus `env` (never pinned here)."""
    base = {k: v for k, v in os.environ.items() if k not in pinned_env()}
    base.pop("LABKIT_PINNED_CHILD", None)
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, cwd=ROOT, env={**base, **env})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """The experiment run once under the pin, from a caller asking for AVX-512 and 1 thread."""
    exp = tmp_path_factory.mktemp("numerics") / "98-kernels"
    exp.mkdir()
    (exp / "experiment.py").write_text(EXPERIMENT)
    (exp / "config.json").write_text(json.dumps({"seed": 1, "threads": 2}))
    proc = labkit("run", str(exp), ATEN_CPU_CAPABILITY="avx512", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr
    assert "ATEN_CPU_CAPABILITY avx512->avx2" in proc.stderr
    assert "OMP_NUM_THREADS 1->2" in proc.stderr
    return exp


# ---------------------------------------------------------------------------------------------
# the pin itself


def test_pinned_env_fixes_every_library():
    env = pinned_env(3)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "AVX2"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["OPENBLAS_NUM_THREADS"] == "1" and "X86_V4" in env["NPY_DISABLE_CPU_FEATURES"]
    assert pinned_env()["OMP_NUM_THREADS"] == str(DEFAULT_THREADS)


def test_overridden_names_each_difference():
    environ = {**pinned_env(2), "ATEN_CPU_CAPABILITY": "avx512"}
    del environ["MKL_CBWR"]
    assert overridden(2, environ) == {"ATEN_CPU_CAPABILITY": ("avx512", "avx2"),
                                      "MKL_CBWR": ("<unset>", "AVX2")}
    assert overridden(2, pinned_env(2)) == {}
    assert set(overridden(1, pinned_env(2))) == {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads /proc/cpuinfo")
def test_cpu_identity_reads_this_machine():
    cpu = cpu_identity()
    assert cpu["vendor"] != "unknown" and cpu["family"] != "unknown"
    assert set(cpu["flags"]) <= set(CPU_FLAGS)
    json.dumps(cpu)


@pytest.mark.parametrize("cpu, message", [
    ({"arch": "arm64", "name": "Apple M2", "flags": None}, "needs an x86-64 CPU with AVX2"),
    ({"arch": "x86_64", "name": "Old Xeon", "flags": ["avx"]}, "lacks avx2, fma"),
    ({"arch": "x86_64", "name": "Piledriver", "flags": ["avx", "fma"]}, "lacks avx2"),
])
def test_a_cpu_the_pin_cannot_run_on_is_refused_in_one_line(cpu, message):
    with pytest.raises(InputError, match=message) as e:
        check_can_pin(cpu)
    assert "--numerics native" in str(e.value) and "\n" not in str(e.value)


def test_an_avx2_cpu_is_accepted():
    check_can_pin({"arch": "x86_64", "name": "Haswell", "flags": ["avx", "avx2", "fma"]})


# ---------------------------------------------------------------------------------------------
# what decides the bits


def _env(**changes) -> dict:
    numerics = {"mode": "pinned", "torch_cpu_capability": "AVX2", "numpy_simd": ["X86_V3"],
                "intra_op_threads": 2, "env": pinned_env(2)}
    cpu = {"arch": "x86_64", "vendor": "AuthenticAMD", "family": "25", "model": "17",
           "name": "AMD EPYC", "flags": ["avx2", "avx512f", "fma"]}
    env = {"python": "3.11.7", "torch": "2.13.0", "triton": "3.9.0", "bitsandbytes": "0.50.0",
           "numpy": "2.4.6", "safetensors": "0.7.0", "device": "cpu", "numerics": numerics,
           "cpu_id": cpu}
    for key, value in changes.items():
        if key in numerics:
            numerics[key] = value
        else:
            env[key] = value
    return env


def test_identical_environments_differ_in_nothing():
    assert bit_differences(_env(), _env()) == []


def test_each_difference_is_named_with_both_values():
    assert bit_differences(_env(), _env(torch="2.14.0")) == ["torch: 2.13.0 -> 2.14.0"]
    assert bit_differences(_env(), _env(intra_op_threads=4)) == [
        "numerics.intra_op_threads: 2 -> 4"]
    diffs = bit_differences(_env(), _env(mode="native", torch_cpu_capability="AVX512"))
    assert "numerics.mode: pinned -> native" in diffs
    assert "numerics.torch_cpu_capability: AVX2 -> AVX512" in diffs


def test_under_the_pin_another_cpu_model_is_noted_not_a_difference():
    zen3 = {"arch": "x86_64", "vendor": "AuthenticAMD", "family": "25", "model": "1",
            "name": "AMD EPYC", "flags": ["avx2", "fma"]}
    assert bit_differences(_env(), _env(cpu_id=zen3)) == []
    assert "same bits on any AVX2 CPU of the same vendor" in cpu_note(_env(), _env(cpu_id=zen3))
    native = bit_differences(_env(mode="native"), _env(mode="native", cpu_id=zen3))
    assert len(native) == 1 and native[0].startswith("cpu (native mode): AuthenticAMD family "
                                                     "25 model 17")


def test_a_recording_from_before_the_pin_says_what_it_lacks():
    old = {k: v for k, v in _env().items() if k not in ("numerics", "cpu_id")}
    assert bit_differences(old, _env())[-1].startswith("numerics: not recorded")
    assert lacking(old) == ["its numerical mode and thread counts",
                            "its CPU's family, model and flags"]
    assert lacking(_env()) == []


def test_code_changes():
    before = {"a.py": "1", "b.py": "2", "c.py": "3"}
    after = {"a.py": "1", "b.py": "9", "d.py": "4"}
    assert code_changes(before, after) == ["b.py (changed)", "c.py (not run now)",
                                           "d.py (new: not run when recorded)"]
    assert code_changes(before, before) == [] and code_changes(None, after) == []


# ---------------------------------------------------------------------------------------------
# end to end through the CLI (each a subprocess importing torch: marked slow)


@pytest.mark.slow
def test_the_pin_wins_over_the_callers_environment(recorded):
    manifest = read_manifest(recorded / "manifest.json")
    m, numerics = manifest["metrics"], manifest["env"]["numerics"]
    assert m["capability"] == "AVX2" and m["threads"] == 2
    assert numerics["mode"] == "pinned" and numerics["torch_cpu_capability"] == "AVX2"
    assert numerics["numpy_simd"] == ["X86_V3"] and numerics["intra_op_threads"] == 2
    assert {"98-kernels/experiment.py", "labkit/experiment.py"} <= set(manifest["code"])


@pytest.mark.slow
@pytest.mark.parametrize("caller", [{}, {"OMP_NUM_THREADS": "1"},
                                    {"ATEN_CPU_CAPABILITY": "avx512"},
                                    {"MKL_CBWR": "AUTO", "OPENBLAS_NUM_THREADS": "8"}])
def test_reproduce_is_exact_whatever_the_caller_sets(recorded, caller):
    proc = labkit("reproduce", str(recorded / "manifest.json"), **caller)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compared exactly" in proc.stdout and "REPRODUCED" in proc.stdout


@pytest.mark.slow
def test_native_reproduce_names_what_differs_and_uses_tolerances(recorded):
    proc = labkit("reproduce", str(recorded / "manifest.json"), "--numerics", "native")
    assert "compared within each metric's tolerance" in proc.stdout
    assert "numerics.mode: pinned -> native" in proc.stdout
    # the native kernels of an AVX-512 machine give other bits; the config allows no tolerance
    if "AVX512" in proc.stdout:
        assert proc.returncode == 1 and "moved: digest" in proc.stdout


def copy_of(recorded: Path, tmp_path: Path, *names: str) -> Path:
    """A new experiment folder holding `names` copied from the recorded one."""
    exp = tmp_path / recorded.name
    exp.mkdir()
    for name in names:
        (exp / name).write_bytes((recorded / name).read_bytes())
    return exp


@pytest.mark.slow
def test_an_old_manifest_is_reproduced_under_todays_rules(recorded, tmp_path):
    exp = copy_of(recorded, tmp_path, "experiment.py", "config.json")
    m = json.loads((recorded / "manifest.json").read_text())
    del m["code"], m["env"]["numerics"], m["env"]["cpu_id"]
    m["schema"] = 1
    (exp / "manifest.json").write_text(json.dumps(seal(m)))
    proc = labkit("reproduce", str(exp / "manifest.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the recording does not say its numerical mode" in proc.stdout
    assert "numerics: not recorded" in proc.stdout and "REPRODUCED" in proc.stdout


@pytest.mark.slow
def test_a_child_where_the_pin_did_not_take_refuses(recorded):
    proc = labkit("run", str(recorded), LABKIT_PINNED_CHILD="threads=2")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: the pinned numerical mode did not take")
    assert proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_reproduce_names_a_code_change_before_it_runs(recorded, tmp_path):
    exp = copy_of(recorded, tmp_path, "config.json", "manifest.json")
    (exp / "experiment.py").write_text(EXPERIMENT + "\n# a comment moves no number\n")
    proc = labkit("reproduce", str(exp / "manifest.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[:3]
    assert first[1].startswith("code changed since the recording (1 file(s))"), first
    assert first[2].strip() == "98-kernels/experiment.py (changed)"


def test_under_the_pin_another_cpu_vendor_is_a_difference():
    """An AMD EPYC and an Intel Xeon differ in the last bits under the pin (measured): the
    vendor is named among what decides the bits, and no "same bits" note is given."""
    xeon = {"arch": "x86_64", "vendor": "GenuineIntel", "family": "6", "model": "207",
            "name": "Intel(R) Xeon(R) Processor", "flags": ["avx2", "avx512f", "fma"]}
    assert bit_differences(_env(), _env(cpu_id=xeon)) == [
        "cpu vendor (the pin holds within one vendor): AuthenticAMD -> GenuineIntel"]
    assert cpu_note(_env(), _env(cpu_id=xeon)) is None
    assert cpu_vendor(_env(cpu_id=xeon)) == "GenuineIntel"
    assert cpu_vendor({"torch": "2.13.0"}) is None
