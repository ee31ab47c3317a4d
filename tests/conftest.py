"""Shared fixtures for the package tests: tiny model configs, seeding, the `gpu` marker, and a
scratch course checkout for tests that write labs/ or work/."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from labkit.threads import wait_passively

wait_passively()   # before torch loads: the OpenMP threads of every test and child sleep, not spin

import pytest  # noqa: E402
import torch  # noqa: E402

from minigpt import MiniGPT, MiniGPTConfig  # noqa: E402

# Small enough that a forward pass costs well under a millisecond on a 2-core CPU; odd-ish
# sizes (n_embd 24 over 3 heads, d_ff 40) so that nothing only works for powers of two.
TINY = dict(block_size=16, n_layer=2, n_head=3, n_embd=24, d_ff=40)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_cfg() -> MiniGPTConfig:
    """A dense MiniGPT config with the tokenizer's vocabulary."""
    return MiniGPTConfig(**TINY)


@pytest.fixture
def tiny_moe_cfg() -> MiniGPTConfig:
    """The MoE twin of `tiny_cfg`: 5 experts, top-2."""
    return MiniGPTConfig(**TINY, n_experts=5, top_k=2)


@pytest.fixture(params=["dense", "moe"])
def tiny_model(request, tiny_cfg, tiny_moe_cfg) -> MiniGPT:
    """A freshly initialised tiny MiniGPT, dense or MoE, in eval mode, from a fixed seed."""
    torch.manual_seed(0)
    model = MiniGPT(tiny_cfg if request.param == "dense" else tiny_moe_cfg)
    return model.eval()


@pytest.fixture
def restore_torch_determinism(monkeypatch):
    """Undo the process-wide switches seed_everything flips."""
    # Registered with monkeypatch so the variable is restored (or removed) afterwards.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if not os.environ["CUBLAS_WORKSPACE_CONFIG"]:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_num_threads(threads)


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread, then restore the count.

    The models here are tiny: a second thread buys nothing and, on a busy 2-core machine,
    OpenMP oversubscription makes a training test several times slower. The package test
    modules opt in with `pytestmark = pytest.mark.usefixtures("single_thread")`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A small copy of the course checkout: lab 00 (guide, release, solution and its line of
    labs/.generated.sha256) and the BLUEPRINT.md and REPORT.md files the guides point to.

    For tests that run what writes labs/ or work/, so that the real checkout is never touched.
    """
    real, root, lab = Path(__file__).resolve().parents[1], tmp_path / "course", "00-setup-minigpt"
    shutil.copytree(real / "labs" / lab, root / "labs" / lab)
    record = (real / "labs" / ".generated.sha256").read_text().splitlines()
    (root / "labs" / ".generated.sha256").write_text(
        "".join(f"{line}\n" for line in record if f" {lab}/" in line))
    for path in [real / "solutions" / f"{lab}.py", *real.glob("src/*/BLUEPRINT.md"),
                 *real.glob("experiments/*/REPORT.md")]:
        (root / path.relative_to(real)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / path.relative_to(real))
    return root
