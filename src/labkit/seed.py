"""Seeding: one call makes a run repeatable with the same library versions and arithmetic (the
numerical mode of labkit.numerics fixes the arithmetic across x86-64 CPUs)."""

from __future__ import annotations

import numbers
import os
import random

import numpy as np
import torch


def seed_everything(seed: int, *, deterministic: bool = True, threads: int | None = None) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) from one integer.

    `deterministic=True` also asks torch for deterministic kernels, so that two runs with the
    same seed give bit-identical weights on the same machine. `threads` fixes torch's intra-op
    thread count: a CPU reduction split over a different number of threads can round
    differently, so the count is part of what a manifest records.
    """
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if threads is not None:
        torch.set_num_threads(threads)
    if deterministic:
        # Needed by cuBLAS for deterministic GEMMs; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
