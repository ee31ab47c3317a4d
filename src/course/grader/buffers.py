"""What a learner's call may write back into the trusted side's tensors, and what it changed
without being asked (course.grader.trusted_side's calls; course.notebook.bridged for tests).

A call's tensor arguments travel by value. What the learner's code writes in one comes back
only into a buffer the test declares (`Buffers.outputs`, a block; a view of a declared
buffer's storage counts, since the whole storage comes back): a kernel's output, gradients
clipped in place. Any other tensor the call changes in place stays as it was here, so an
expectation the test computes from its inputs cannot be moved by the learner's code; the
change is recorded (`touched`), for a test whose spec says the inputs stay unchanged
(`bridged.unchanged`). Which tensors changed is the learner side's word: it can hide a change
of its own copy, never make one here.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is `b` or a tensor over the same (non-empty) storage."""
    ptr = a.untyped_storage().data_ptr()
    return a is b or ptr != 0 and ptr == b.untyped_storage().data_ptr()


class Buffers:
    """The buffers the open `outputs` blocks declare, and the tensors calls changed without."""

    def __init__(self):
        self.declared: list[torch.Tensor] = []
        self.touched: list[weakref.ref] = []

    def declares(self, t: torch.Tensor) -> bool:
        return any(same_storage(t, d) for d in self.declared)

    @contextlib.contextmanager
    def outputs(self, buffers: tuple):
        """While the block runs, what calls write in `buffers` (tensors) is written back."""
        n = len(self.declared)
        self.declared.extend(buffers)
        try:
            yield
        finally:
            del self.declared[n:]

    def take_back(self, tensors: list, declared: list[bool], changed: dict,
                  grads: dict) -> None:
        """Into the declared buffers among a call's tensor arguments (`declared[i]`), what the
        call wrote there (`changed`: index -> the whole storage as uint8, which the learner's
        side sends for those only) and the .grad it set or changed (`grads`: index -> tensor
        or None); record the other tensors it changed, left as they were."""
        for i, new in changed.items():
            if type(i) is not int or not 0 <= i < len(tensors):
                continue
            t = tensors[i]
            if not declared[i]:
                self.touched.append(weakref.ref(t))
            elif type(new) is torch.Tensor and new.dtype == torch.uint8 \
                    and new.numel() == t.untyped_storage().nbytes():
                t.untyped_storage().copy_(new.untyped_storage())
        for i, grad in grads.items():
            if type(i) is int and 0 <= i < len(tensors) and declared[i] and tensors[i].is_leaf:
                t = tensors[i]
                if grad is None or (type(grad) is torch.Tensor and grad.shape == t.shape
                                    and grad.dtype == t.dtype):
                    t.grad = grad

    def changed(self, since: int, t: torch.Tensor) -> bool:
        """Whether a call recorded after the first `since` entries of `touched` changed `t`
        (or a tensor over its storage) in place."""
        return any((u := r()) is not None and same_storage(t, u) for r in self.touched[since:])
