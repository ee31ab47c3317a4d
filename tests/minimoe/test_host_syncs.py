"""Device→host conversions per MoE forward + backward: one to check the router logits, one
to build (and check) the Routing, none per kernel launch.

Counted on any device by wrapping the Python-level conversions (`item`, `tolist`, `cpu`,
`numpy`, `bool(t)`, `int(t)`, `index`, `float(t)`, `nonzero`): on a GPU each is a sync. Calls
from inside the Triton interpreter are left out — it stands in for the GPU itself.

Measured on this CPU for MoEMLP(32, 48, E=6, k=2) on 18 tokens, before the Routing value (the
indices re-checked at every launch) and after:

    dispatch                    before  after
    triton, float experts           45      2
    triton, float + LoRA            45      2
    triton, NF4 + LoRA              75     14   (12: miniquant's id check, on host ids)
    torch,  float + LoRA            12      2
    torch,  NF4 + LoRA              39     14   (12: likewise)
    torch,  float experts            7      7   (dispatch_torch: one nonzero per expert)
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

import minimoe.nf4_experts
from minimoe import MoEMLP, attach_expert_lora

pytestmark = pytest.mark.usefixtures("single_thread")

CONVERSIONS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__",
               "__float__", "nonzero")


class HostSyncs:
    """Count the conversions made inside the `with` block: `.calls[(name, file:line)]`."""

    def __enter__(self) -> HostSyncs:
        self.calls: collections.Counter = collections.Counter()
        self._saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in CONVERSIONS]
        self._saved.append((torch, "nonzero", torch.nonzero))
        for owner, name, real in self._saved:
            setattr(owner, name, self._counting(real, name))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, real in self._saved:
            setattr(owner, name, real)

    def _counting(self, real, name):
        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            if "triton" not in frame.f_code.co_filename.split(os.sep):
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
                self.calls[(name, where)] += 1
            return real(*args, **kwargs)
        return counted

    def total(self, skip_file: str | None = None) -> int:
        return sum(n for (_, where), n in self.calls.items()
                   if skip_file is None or not where.startswith(skip_file))


def _forward_backward(backend: str, experts: str) -> HostSyncs:
    torch.manual_seed(0)
    m = MoEMLP(32, 48, 6, 2, backend=backend)
    if experts != "float":
        attach_expert_lora(m, r=4, nf4=experts == "nf4")
    x = torch.randn(2, 9, 32, requires_grad=True)
    with HostSyncs() as syncs:
        out = m(x)
        (out.square().sum() + m.aux_loss).backward()
    return syncs


def test_the_counter_counts():
    with HostSyncs() as syncs:
        t = torch.arange(3)
        assert bool(t.any()) and int(t[1]) == 1 and t.tolist() == [0, 1, 2]
        t.nonzero()
    assert syncs.total() == 4, syncs.calls


@pytest.mark.parametrize("backend, experts", [("triton", "float"), ("triton", "lora"),
                                              ("torch", "lora")])
def test_two_syncs_per_moe_forward_backward(backend, experts):
    syncs = _forward_backward(backend, experts)
    assert syncs.total() <= 2, syncs.calls
    assert sorted(where.split(":")[0] for _, where in syncs.calls) == ["routers.py", "routing.py"]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_nf4_experts_sync_only_for_the_routing(backend, monkeypatch):
    """Beyond the two, only miniquant's range check of the active ids (2 per dequantization:
    3 projections, forward and backward) — on ids held on the host, so on a GPU they are no
    sync at all."""
    seen = []
    for name in ("selective_dequantize_nf4", "selective_dequantize_nf4_torch"):
        real = getattr(minimoe.nf4_experts, name)

        def spy(q, active, *args, _real=real, **kwargs):
            seen.append(active.device.type)
            return _real(q, active, *args, **kwargs)

        monkeypatch.setattr(minimoe.nf4_experts, name, spy)
    syncs = _forward_backward(backend, "nf4")
    assert seen == ["cpu"] * 6
    assert syncs.total(skip_file="triton_dequant.py") <= 2, syncs.calls
    assert syncs.total() <= 2 + 2 * len(seen), syncs.calls


def test_dispatch_torch_is_the_plain_loop():
    """The PyTorch dispatch (Lab 07's) asks each expert for its tokens: E + 1 syncs."""
    assert _forward_backward("torch", "float").total() <= 6 + 1
