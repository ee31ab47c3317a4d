"""Where the kernel labs run: course.notebook.harness chooses the interpreter or compiled
kernels, and the device the tests put their tensors on, once and by the packages' own rule;
the setup cells take INTERPRET and DEVICE from it, and Lab 13 its GPU's architecture."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import torch

from course.authoring.build import lab_names
from course.notebook import harness

ROOT = Path(__file__).resolve().parents[2]
KERNEL_LABS = [lab for lab in lab_names(ROOT)
               if "require_triton(" in (ROOT / "solutions" / f"{lab}.py").read_text()]


@pytest.fixture
def machine(monkeypatch):
    """machine(capability, interpret=...): torch sees a CUDA GPU of that capability (None: no
    GPU), and TRITON_INTERPRET is unset or the given string."""
    def make(capability, interpret=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
        if interpret is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
    return make


def test_without_a_gpu_the_kernels_are_interpreted_on_the_cpu(machine):
    machine(None)
    assert harness.triton_mode() == (True, "cpu")
    assert harness.gpu_arch() is None


@pytest.mark.parametrize("capability, arch", [((7, 5), "sm_75"), ((8, 0), "sm_80"),
                                              ((8, 6), "sm_86"), ((8, 9), "sm_89"),
                                              ((9, 0), "sm_90")])
def test_on_a_gpu_the_kernels_compile_and_the_tensors_go_to_cuda(machine, capability, arch):
    machine(capability)
    assert harness.triton_mode() == (False, "cuda")
    assert harness.gpu_arch() == arch


@pytest.mark.parametrize("capability, value, want", [
    ((7, 5), "1", (True, "cpu")),        # the interpreter on a GPU machine, asked for
    ((7, 5), "true", (True, "cpu")),     # as triton reads the variable
    ((8, 9), "0", (False, "cuda")),
    (None, "0", (False, "cuda")),        # asked for compiled kernels: respected, not overruled
])
def test_an_explicit_triton_interpret_is_respected(machine, capability, value, want):
    machine(capability, value)
    assert harness.triton_mode() == want


@pytest.mark.parametrize("capability", [None, (7, 5)])
def test_the_harness_and_the_packages_choose_alike(machine, capability):
    """The packages' first kernel sets TRITON_INTERPRET by the same rule: after it, the
    harness still says what it said before (triton is imported first, unpatched, so the
    process keeps the mode it has)."""
    pytest.importorskip("triton")
    from miniquant.triton_env import import_triton

    machine(capability)
    before = harness.triton_mode()
    import_triton()
    assert harness.triton_mode() == before
    assert ("TRITON_INTERPRET" in os.environ) == before[0]


@pytest.mark.parametrize("capability, said", [
    (None, "INTERPRET = True, DEVICE = 'cpu': no CUDA GPU"),
    ((7, 5), "INTERPRET = False, DEVICE = 'cuda': the kernels compile for this GPU, Tesla T4 "
             "(sm_75)")])
def test_triton_setup_returns_the_mode_and_says_what_it_means(machine, capability, said,
                                                               monkeypatch, capsys):
    pytest.importorskip("triton")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)   # not this test process's
    monkeypatch.setattr(torch, "manual_seed", lambda seed: None)
    machine(capability)
    assert harness.triton_setup() == harness.triton_mode()
    out = capsys.readouterr().out
    assert said in out and "The tests put their tensors on DEVICE." in out, out


def assigned(source: str, name: str) -> list[str]:
    """The source of every value assigned to `name` at any nesting of `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
        for target in targets:
            names = [t.id for t in ast.walk(target) if isinstance(t, ast.Name)]
            if name in names:
                found.append(ast.unparse(node.value) if node.value else "")
    return found


@pytest.mark.parametrize("lab", KERNEL_LABS)
def test_a_kernel_lab_takes_its_device_once_from_the_harness(lab):
    """DEVICE and INTERPRET are bound once, by `harness.triton_setup()`; no test cell picks
    a device of its own (a compiled kernel cannot read a CPU tensor)."""
    source = (ROOT / "solutions" / f"{lab}.py").read_text()
    for name in ("DEVICE", "INTERPRET"):
        assert assigned(source, name) == ["harness.triton_setup()"], \
            f"{lab}: {name} must be bound once, by harness.triton_setup(): {assigned(source, name)}"
    picked = re.findall(r"device\s*=\s*[\"'](?:cpu|cuda)[\"']|\.cuda\(\)", source)
    assert not picked, f"{lab} picks a device itself ({picked}): use DEVICE"


def test_lab_13_compiles_for_the_learners_gpu_else_a_stated_default():
    source = (ROOT / "solutions" / "13-gpu-compiler.py").read_text()
    values = assigned(source, "ARCH")
    assert values and values[0].startswith("harness.gpu_arch()"), values
