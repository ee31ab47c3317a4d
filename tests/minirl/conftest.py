"""Fixtures of the minirl tests: one intra-op thread for every test, and a tiny MiniGPT
(dense and MoE) that ends its sampled completions at different lengths."""

from __future__ import annotations

import pytest
from rl_support import raise_eos, tiny

from minigpt import MiniGPT


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every minirl test on one thread (tests/conftest.py `single_thread` says why)."""
    yield


@pytest.fixture(params=["dense", "moe"])
def eos_model(request) -> MiniGPT:
    """A tiny MiniGPT, dense or MoE, whose <eos> logit is raised (rl_support.raise_eos)."""
    return raise_eos(tiny(request.param))
