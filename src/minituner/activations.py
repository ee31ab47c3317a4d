"""Activation memory: the bytes a forward pass leaves allocated for its backward.

Counted, not sampled: a dispatch mode sees every tensor an operator allocates during the
forward; after the forward returns, the storages still alive are the ones autograd (or a
gradient checkpoint, which keeps each segment's input outside autograd's saved tensors) holds
for the backward. Parameters, buffers, the input and the output are not counted, and views
of one storage count once, so the number is deterministic and device-independent — unlike
RSS on a CPU, where the allocator keeps freed memory.

`peak_step_bytes` runs the same ledger through a whole forward and backward and reports the
largest total alive at any operator: the peak a training step adds on top of the weights.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageLedger(TorchDispatchMode):
    """Weak references to every storage an operator outputs, except the excluded ones."""

    def __init__(self, exclude: set[int], track_peak: bool = False):
        super().__init__()
        self.exclude, self.track_peak, self.peak = exclude, track_peak, 0
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                ref = StorageWeakRef(s)
                if ref.cdata not in self.exclude:
                    self.refs.setdefault(ref.cdata, (ref, s.nbytes()))
        if self.track_peak:      # O(live storages) per operator: fine for the course's models
            self.peak = max(self.peak, self.live_bytes(set()))
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        return sum(n for key, (ref, n) in self.refs.items()
                   if key not in exclude and not ref.expired())


def _storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _forward(model: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor | None):
    """model(x), or with targets the mean cross-entropy of its logits [.., V] against them."""
    out = model(x)
    if targets is None:
        return out
    return F.cross_entropy(out.flatten(0, -2), targets.flatten())


def _excluded(model: torch.nn.Module, *tensors) -> set[int]:
    return {_storage_key(t) for t in (*model.parameters(), *model.buffers(), *tensors)
            if t is not None}


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor,
                           targets: torch.Tensor | None = None) -> int:
    """Bytes of activations held between `model(x)` and its backward, in the current mode.

    Runs one forward with gradients enabled (dropout and other training-mode behaviour follow
    `model.training`) and drops the graph afterwards; no backward runs. With `targets`, the
    forward includes the cross-entropy loss, so what the loss keeps (the logits' softmax, the
    target ids) is counted too.
    """
    ledger = _StorageLedger(_excluded(model, x, targets))
    with torch.enable_grad(), ledger:
        out = _forward(model, x, targets)
    # What only a reference cycle keeps (Triton's interpreter makes some) is garbage, not an
    # activation: collect it first.
    gc.collect()
    held = ledger.live_bytes({_storage_key(t) for t in tree_leaves(out)
                              if isinstance(t, torch.Tensor)})
    del out
    return held


def peak_step_bytes(model: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor) -> int:
    """Peak bytes alive during one forward + backward of the cross-entropy loss: saved
    activations, the gradients as they accumulate, and the backward's temporaries (with
    gradient checkpointing, the recomputed segment). Parameters, buffers, x and targets are
    not counted; the parameters' .grad are cleared before and after.
    """
    model.zero_grad(set_to_none=True)
    ledger = _StorageLedger(_excluded(model, x, targets), track_peak=True)
    with torch.enable_grad(), ledger:
        _forward(model, x, targets).backward()
    model.zero_grad(set_to_none=True)
    return ledger.peak


__all__ = ["peak_step_bytes", "saved_activation_bytes"]
