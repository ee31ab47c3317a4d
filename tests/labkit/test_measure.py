"""labkit.measure: measure() sees real allocations (RSS, and the CUDA peak on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from labkit import measure

MB = 1_000_000

# ---------------------------------------------------------------------------------------------
# measure


def fresh(block: str, interval_s: float = 0.005) -> dict:
    """Run `block` inside measure() in a fresh interpreter and return its reading. In a long-lived
    test process the allocator may hand out pages an earlier test freed but kept resident,
    and then an allocation does not grow the RSS at all."""
    code = (f"import json, time, torch\nfrom labkit import measure\n"
            f"with measure.measure(interval_s={interval_s}, cuda=False) as m:\n"
            + textwrap.indent(block, "    ")
            + "\nprint(json.dumps({k: getattr(m, k) for k in ('rss_start', 'rss_end', "
              "'rss_peak', 'rss_delta', 'rss_peak_delta', 'cuda_peak', 'peak_bytes')}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_measure_sees_a_held_allocation():
    m = fresh("t = torch.ones(25_000_000)   # 100 MB, written so the pages are resident\n"
              "time.sleep(0.02)\n"
              "assert t.sum().item() == 25_000_000")
    assert m["rss_peak_delta"] >= 80 * MB
    assert m["rss_delta"] >= 80 * MB
    assert m["rss_peak"] >= m["rss_end"] >= m["rss_start"] > 0
    assert m["cuda_peak"] is None and m["peak_bytes"] == m["rss_peak"]


def test_measure_catches_a_transient_peak():
    """Memory freed before the block ends still shows in the peak (the sampler saw it)."""
    m = fresh("t = torch.ones(25_000_000)\ntime.sleep(0.1)\ndel t", interval_s=0.002)
    assert m["rss_peak_delta"] >= 80 * MB
    assert m["rss_peak_delta"] > m["rss_delta"]


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
