"""Test helpers that work the same whether a test cell runs beside the learner's code (in their
notebook) or apart from it (graded, and `make check`: the trusted kernel reaches the learner's
kernel through course.grader's bridge, which sets `BRIDGE` there).

Apart, arguments travel by value and objects of the learner's are proxies, so a test that
hands the learner's code a folder or a buffer to write, or asks whether a class of theirs
subclasses another, says so through these:

    outputs(*buffers)   a block whose calls may write in `buffers` (a kernel's output, grads
                        clipped in place): apart, only those are written back from the
                        learner's kernel; any other tensor argument stays as it was here
    unchanged(rule, **tensors)
                        a block that must leave each named tensor as it was (a spec's "the
                        inputs stay unchanged"): AssertionError naming `rule` and the tensor
                        otherwise; apart, the bridge's record of what each call changed there

    learner_dir()       a fresh empty folder the learner's code can write to (its path there)
    fetch_dir(path)     the regular files the learner's code wrote under `path`, as a local
                        folder the test may read (apart: copied over as bytes)
    send_dir(local)     a folder the learner's code can read holding `local`'s files
    share(obj)          the tests' object kept where the learner's code runs, so that what it
                        changes in place (a model it wraps, a dict it fills) is seen: apart,
                        a proxy for a copy sent there once; beside, `obj` itself
    is_subclass(c, b)   issubclass for a class of the learner's
    is_instance(o, c)   isinstance for an object and a class of the learner's
    in_learner(f, ...)  call the test's function `f` where the learner's code runs: a check
                        that must look inside their process (a spy, a ledger of saved
                        tensors, a memory measurement). Apart, `f`'s source is sent and run
                        there with the learner's globals, and only data comes back. Such a
                        check is the one kind a determined learner could forge: the lab
                        declares each (labs/INSTRUCTORS.md lists them), in visible tests only.
"""

from __future__ import annotations

import contextlib
import inspect
import tempfile
import textwrap
from pathlib import Path

import torch

BRIDGE = None      # the trusted kernel's bridge to the learner's kernel, when apart


def learner_dir() -> str:
    return BRIDGE.learner_dir() if BRIDGE else tempfile.mkdtemp(prefix="lab-")


def fetch_dir(path) -> Path:
    return BRIDGE.fetch_dir(str(path)) if BRIDGE else Path(path)


def send_dir(local) -> str:
    return BRIDGE.send_dir(Path(local)) if BRIDGE else str(local)


@contextlib.contextmanager
def outputs(*buffers: torch.Tensor):
    for b in buffers:
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"outputs(...) takes tensors, got {type(b).__name__}")
    if BRIDGE is None:                # beside: the learner's code writes into them itself
        yield
        return
    with BRIDGE.buffers.outputs(buffers):
        yield


@contextlib.contextmanager
def unchanged(rule: str, **tensors: torch.Tensor):
    before = {name: t.detach().clone() for name, t in tensors.items()}
    since = len(BRIDGE.buffers.touched) if BRIDGE else 0
    yield
    for name, t in tensors.items():
        moved = BRIDGE is not None and BRIDGE.buffers.changed(since, t)   # apart: not here
        if moved or not _same(t.detach(), before[name]):
            raise AssertionError(f"{rule}: {name} was changed in place")


def _same(t: torch.Tensor, was: torch.Tensor) -> bool:
    """Equal shapes and values, NaN where NaN was."""
    if t.shape != was.shape or not (t.is_floating_point() or t.is_complex()):
        return torch.equal(t, was)
    return bool(((t == was) | (t.isnan() & was.isnan())).all())


def share(obj):
    return BRIDGE.share(obj) if BRIDGE else obj


def is_instance(obj, cls) -> bool:
    if BRIDGE and BRIDGE.owns(obj) and BRIDGE.owns(cls):
        return BRIDGE.is_instance(obj, cls)
    return isinstance(cls, type) and isinstance(obj, cls)


def is_subclass(cls, base: type) -> bool:
    if BRIDGE and BRIDGE.owns(cls):
        return BRIDGE.is_subclass(cls, base)
    return isinstance(cls, type) and issubclass(cls, base)


def in_learner(fn, *args, **kwargs):
    if BRIDGE is None:
        return fn(*args, **kwargs)
    return BRIDGE.in_learner(textwrap.dedent(inspect.getsource(fn)), fn.__name__, args, kwargs)
