"""Activation memory: the bytes a forward pass leaves allocated for its backward.

Counted, not sampled: a dispatch mode sees every tensor an operator allocates during the
forward; after the forward returns, the storages still alive are the ones autograd (or a
gradient checkpoint, which keeps each segment's input outside autograd's saved tensors) holds
for the backward. Parameters, buffers, the input and the output are not counted, and views
of one storage count once, so the number is deterministic and device-independent — unlike
RSS on a CPU, where the allocator keeps freed memory.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageLedger(TorchDispatchMode):
    """Weak references to every storage an operator outputs, except the excluded ones."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                ref = StorageWeakRef(s)
                if ref.cdata not in self.exclude:
                    self.refs.setdefault(ref.cdata, (ref, s.nbytes()))
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        return sum(n for key, (ref, n) in self.refs.items()
                   if key not in exclude and not ref.expired())


def _storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of activations held between `model(x)` and its backward, in the current mode.

    Runs one forward with gradients enabled (dropout and other training-mode behaviour follow
    `model.training`) and drops the graph afterwards; no backward runs.
    """
    pre = {_storage_key(t) for t in (*model.parameters(), *model.buffers(), x)}
    ledger = _StorageLedger(pre)
    with torch.enable_grad(), ledger:
        out = model(x)
    held = ledger.live_bytes({_storage_key(t) for t in tree_leaves(out)
                              if isinstance(t, torch.Tensor)})
    del out
    return held


__all__ = ["saved_activation_bytes"]
