"""labkit.memory: measure() sees real allocations; predict() counts bytes as by hand."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

from labkit import memory
from labkit.memory import MemoryPrediction, ParamSpec

MB = 1_000_000

# ---------------------------------------------------------------------------------------------
# measure


def test_measure_sees_a_held_allocation():
    with memory.measure(cuda=False) as m:
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
    with memory.measure(interval_s=0.002, cuda=False) as m:
        t = torch.ones(25_000_000)
        time.sleep(0.1)
        del t
    assert m.rss_peak_delta >= 80 * MB
    assert m.rss_peak_delta > m.rss_delta


def test_measure_small_block_small_delta():
    with memory.measure(cuda=False) as m:
        x = sum(range(1000))
    assert x == 499500
    assert abs(m.rss_peak_delta) < 20 * MB


def test_measure_stops_its_sampler_on_exception():
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="inside"), memory.measure(cuda=False) as m:
        raise RuntimeError("inside")
    assert m.rss_end > 0 and m.rss_peak >= m.rss_end
    assert threading.active_count() == before


@pytest.mark.gpu
def test_measure_cuda_peak():
    with memory.measure(cuda=True) as m:
        t = torch.ones(25_000_000, device="cuda")
        del t
    assert m.cuda_peak >= 100 * MB
    assert m.peak_bytes == m.cuda_peak


# ---------------------------------------------------------------------------------------------
# predict


class Small(nn.Module):
    """20 trainable float32 elements, 8 frozen float32, 10 frozen bf16, a tied module, and
    buffers: 6 float32 + 3 int64."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 5)                           # 15 + 5, trainable
        self.tied = self.a                                 # the same parameters, counted once
        self.b = nn.Linear(4, 2, bias=False).requires_grad_(False)   # 8 frozen
        self.low = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("running", torch.zeros(6))
        self.register_buffer("count", torch.zeros(3, dtype=torch.long))


WEIGHTS = 20 * 4 + 8 * 4 + 10 * 2 + 6 * 4 + 3 * 8    # = 180
TRAINABLE = 20


def test_predict_adamw_float32_by_hand():
    p = memory.predict(Small())
    assert WEIGHTS == 180
    assert p == MemoryPrediction(weights=180, grads=TRAINABLE * 4, optimizer=TRAINABLE * 8,
                                 activations=0)
    assert p.total == 180 + 80 + 160
    assert p.as_dict() == {"weights": 180, "grads": 80, "optimizer": 160, "activations": 0,
                           "total": 420}


@pytest.mark.parametrize("optimizer, states", [("adam", 2), ("adamw", 2), ("sgd", 0),
                                               ("sgd_momentum", 1)])
def test_predict_optimizer_states(optimizer, states):
    p = memory.predict(Small(), optimizer=optimizer, activations=1234)
    assert p.optimizer == TRAINABLE * states * 4
    assert p.grads == TRAINABLE * 4
    assert p.activations == 1234
    assert p.total == WEIGHTS + TRAINABLE * 4 + TRAINABLE * states * 4 + 1234


def test_predict_low_precision_grads_and_states():
    p = memory.predict(Small(), grad_bits=16, state_bits=8)
    assert (p.grads, p.optimizer) == (TRAINABLE * 2, TRAINABLE * 2 * 1)


def test_predict_frozen_model_has_no_grads_or_state():
    m = Small().requires_grad_(False)
    p = memory.predict(m)
    assert (p.weights, p.grads, p.optimizer) == (WEIGHTS, 0, 0)


def test_predict_counts_a_real_model_like_a_loop():
    model = nn.Sequential(nn.Embedding(7, 3), nn.LayerNorm(3), nn.Linear(3, 11))
    model[1].requires_grad_(False)
    weights = trainable = 0
    for prm in model.parameters():
        weights += prm.numel() * 4
        trainable += prm.numel() if prm.requires_grad else 0
    assert trainable == 7 * 3 + 3 * 11 + 11
    p = memory.predict(model)
    assert (p.weights, p.grads, p.optimizer) == (weights, trainable * 4, trainable * 8)


def test_predict_from_specs_with_fractional_bits():
    specs = [ParamSpec(numel=1000, bits=4.127, trainable=False),
             ParamSpec(numel=10, bits=32, trainable=True),
             ParamSpec(numel=3, bits=16, trainable=True)]
    p = memory.predict(specs)
    assert p.weights == round(1000 * 4.127 / 8 + 40 + 6)     # 561.875 -> 562
    assert p.grads == 13 * 4 and p.optimizer == 13 * 8
    assert memory.predict(iter(specs)) == p                  # any iterable, read once


def test_predict_empty():
    assert memory.predict([]).total == 0
    assert memory.predict(nn.Module()).total == 0


@pytest.mark.parametrize("bad", ["AdamW", "lion", "", "adamw8bit"])
def test_predict_bad_optimizer(bad):
    with pytest.raises(ValueError, match="optimizer"):
        memory.predict(Small(), optimizer=bad)
