"""Measure memory: what a block of code used, as the process and the GPU saw it.

`measure` reads the process's resident set size (psutil) before, during (a sampling thread
keeps the peak) and after; on a GPU it also reads torch's peak allocated bytes. The bill of
a training setup, counted tensor by tensor (`held_bytes`) or predicted from shapes, lives
beside what it counts, in `minituner.memory`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch


@dataclass
class MemoryReading:
    rss_start: int = 0          # bytes resident when the block began
    rss_end: int = 0
    rss_peak: int = 0           # highest resident bytes seen while the block ran
    cuda_peak: int | None = None  # torch.cuda.max_memory_allocated above the start, if on GPU

    @property
    def rss_delta(self) -> int:
        return self.rss_end - self.rss_start

    @property
    def rss_peak_delta(self) -> int:
        return self.rss_peak - self.rss_start

    @property
    def peak_bytes(self) -> int:
        """The number to report: GPU peak when there is a GPU, else the RSS peak."""
        return self.cuda_peak if self.cuda_peak is not None else self.rss_peak


@contextlib.contextmanager
def measure(interval_s: float = 0.005, cuda: bool | None = None) -> Iterator[MemoryReading]:
    """`with measure() as m: ...` then read `m.rss_peak_delta`, `m.cuda_peak` (bytes)."""
    proc = psutil.Process()
    cuda = torch.cuda.is_available() if cuda is None else cuda
    reading = MemoryReading(rss_start=proc.memory_info().rss)
    reading.rss_peak = reading.rss_start
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            reading.rss_peak = max(reading.rss_peak, proc.memory_info().rss)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_start = torch.cuda.memory_allocated()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield reading
    finally:
        stop.set()
        sampler.join()
        reading.rss_end = proc.memory_info().rss
        reading.rss_peak = max(reading.rss_peak, reading.rss_end)
        if cuda:
            torch.cuda.synchronize()
            reading.cuda_peak = torch.cuda.max_memory_allocated() - cuda_start


__all__ = ["MemoryReading", "measure"]
