"""Measure memory: what a block of code used, and what a model and optimizer hold.

`measure` reads the process's resident set size (psutil) before, during (a sampling thread
keeps the peak) and after; on a GPU it also reads torch's peak allocated bytes. `held_bytes`
counts what a model and optimizer hold, tensor by tensor. Both look at real tensors only.
The prediction of the same bill from shapes lives beside what it predicts, in
`minituner.memory`; `HeldBytes` has the fields and `as_dict` of its `MemoryPrediction`, so
the two compare key by key (labkit imports none of the model packages, so it cannot share
the class).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
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


@dataclass(frozen=True)
class HeldBytes:
    """Bytes a training setup holds, by kind (activations: what the caller adds, else 0)."""

    weights: int
    grads: int
    optimizer: int
    activations: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
               ) -> HeldBytes:
    """What a training setup holds right now, counted tensor by tensor (no activations).

    weights: parameters and buffers; grads: every `.grad` present; optimizer: every tensor in
    the optimizer's state (AdamW's moments, and its 0-d step counters). Shared storage counts
    once. Read it after a few steps, when gradients and optimizer state exist.
    """
    seen: set[int] = set()

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    weights = nbytes(list(model.parameters()) + list(model.buffers()))
    grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
    states = [] if optimizer is None else [
        t for state in optimizer.state.values() for t in state.values()
        if isinstance(t, torch.Tensor)]
    return HeldBytes(weights=weights, grads=grads, optimizer=nbytes(states))


__all__ = ["HeldBytes", "MemoryReading", "held_bytes", "measure"]
