"""Memory: measure what a block of code used, and predict what a training setup needs.

`measure` reads the process's resident set size (psutil) before, during (a sampling thread
keeps the peak) and after; on a GPU it also reads torch's peak allocated bytes. `predict`
counts bytes from parameter counts and dtypes: weights, gradients, optimizer state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import psutil
import torch

# Optimizer state tensors kept per trainable parameter.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


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
class ParamSpec:
    """One group of parameters as the predictor sees it."""

    numel: int
    bits: float          # storage bits per element (32 float32, 16 bf16, ~4.127 NF4+DQ)
    trainable: bool


@dataclass(frozen=True)
class MemoryPrediction:
    weights: int         # bytes
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


def param_specs(module: torch.nn.Module) -> list[ParamSpec]:
    """Parameters (trainable if `requires_grad`) and buffers (frozen) of a module."""
    specs = [ParamSpec(p.numel(), p.element_size() * 8, p.requires_grad)
             for p in module.parameters()]
    specs += [ParamSpec(b.numel(), b.element_size() * 8, False) for b in module.buffers()]
    return specs


def predict(params: Iterable[ParamSpec] | torch.nn.Module, *, grad_bits: int = 32,
            optimizer: str = "adamw", state_bits: int = 32, activations: int = 0
            ) -> MemoryPrediction:
    """Bytes for weights, gradients and optimizer state of a training setup.

    Gradients and optimizer state exist only for trainable parameters; AdamW keeps two
    state tensors (first and second moments) per trainable element.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if isinstance(params, torch.nn.Module):
        params = param_specs(params)
    params = list(params)
    weights = sum(p.numel * p.bits for p in params) / 8
    trainable = sum(p.numel for p in params if p.trainable)
    return MemoryPrediction(
        weights=round(weights),
        grads=trainable * grad_bits // 8,
        optimizer=trainable * OPTIMIZER_STATES[optimizer] * state_bits // 8,
        activations=int(activations),
    )
