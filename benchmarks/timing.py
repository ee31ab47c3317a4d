"""Timing for the benchmarks: the median of repeated runs, on CUDA with events."""

from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, device: str, repeats: int, warmup: int, flush_l2_bytes: int = 0) -> float:
    """Median wall time of fn() over `repeats` runs, after `warmup` runs. On CUDA each run is
    timed with events, after zeroing a `flush_l2_bytes` buffer (when > 0) so that data that
    fits in L2 is not served from it."""
    for _ in range(warmup):
        fn()
    flush = (torch.empty(flush_l2_bytes, dtype=torch.uint8, device="cuda")
             if device == "cuda" and flush_l2_bytes else None)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
