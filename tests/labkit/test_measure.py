"""labkit.measure: measure() sees real allocations; held_bytes() counts tensors as by hand."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

from labkit import measure
from labkit.measure import HeldBytes

MB = 1_000_000

# ---------------------------------------------------------------------------------------------
# measure


def test_measure_sees_a_held_allocation():
    with measure.measure(cuda=False) as m:
        t = torch.ones(25_000_000)               # 100 MB, written so the pages are resident
        time.sleep(0.02)
    assert t.sum().item() == 25_000_000
    assert m.rss_peak_delta >= 80 * MB
    assert m.rss_delta >= 80 * MB
    assert m.rss_peak >= m.rss_end >= m.rss_start > 0
    assert m.cuda_peak is None and m.peak_bytes == m.rss_peak
    del t


def test_measure_catches_a_transient_peak():
    """Memory freed before the block ends still shows in the peak (the sampler saw it)."""
    with measure.measure(interval_s=0.002, cuda=False) as m:
        t = torch.ones(25_000_000)
        time.sleep(0.1)
        del t
    assert m.rss_peak_delta >= 80 * MB
    assert m.rss_peak_delta > m.rss_delta


def test_measure_small_block_small_delta():
    with measure.measure(cuda=False) as m:
        x = sum(range(1000))
    assert x == 499500
    assert abs(m.rss_peak_delta) < 20 * MB


def test_measure_stops_its_sampler_on_exception():
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="inside"), measure.measure(cuda=False) as m:
        raise RuntimeError("inside")
    assert m.rss_end > 0 and m.rss_peak >= m.rss_end
    assert threading.active_count() == before


@pytest.mark.gpu
def test_measure_cuda_peak():
    with measure.measure(cuda=True) as m:
        t = torch.ones(25_000_000, device="cuda")
        del t
    assert m.cuda_peak >= 100 * MB
    assert m.peak_bytes == m.cuda_peak


# ---------------------------------------------------------------------------------------------
# held_bytes


def test_held_bytes_by_hand():
    """A tied module counts once; grads and AdamW state appear after a step, with AdamW's 0-d
    float32 step counter per parameter tensor; buffers are weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2, bias=False))
    model[2].requires_grad_(False)
    model = nn.ModuleDict({"net": model, "tied": model[0]})
    # weights: 20 + 10 (linear, norm) + 10 frozen, float32; buffers 5 + 5 float32 + 1 int64
    weights = (20 + 10 + 10) * 4 + 10 * 4 + 8
    assert measure.held_bytes(model) == HeldBytes(weights=weights, grads=0, optimizer=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model["net"](torch.randn(4, 3)).sum().backward()
    opt.step()
    held = measure.held_bytes(model, opt)
    trainable_tensors = 4                       # two of the linear, two of the norm
    assert held == HeldBytes(weights=weights, grads=30 * 4,
                             optimizer=2 * 30 * 4 + 4 * trainable_tensors)
    assert held.total == weights + 120 + 256
    assert held.as_dict() == {"weights": weights, "grads": 120, "optimizer": 256,
                              "activations": 0, "total": held.total}


def test_held_bytes_counts_shared_storage_once():
    a = nn.Linear(4, 4, bias=False)
    b = nn.Linear(4, 4, bias=False)
    b.weight = a.weight                                  # one storage, two modules
    view = nn.Module()
    view.register_buffer("rows", a.weight.detach()[:2])  # a view of the same storage
    model = nn.ModuleList([a, b, view])
    assert measure.held_bytes(model).weights == 16 * 4
