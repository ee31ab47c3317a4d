"""Test helpers that work the same whether a test cell runs beside the learner's code (in their
notebook) or apart from it (graded, and `make check`: the trusted kernel reaches the learner's
kernel through course.grader's bridge, which sets `BRIDGE` there).

Apart, arguments travel by value and objects of the learner's are proxies, so a test that
hands the learner's code a folder, or asks whether a class of theirs subclasses another, says
so through these:

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

import inspect
import tempfile
import textwrap
from pathlib import Path

BRIDGE = None      # the trusted kernel's bridge to the learner's kernel, when apart


def learner_dir() -> str:
    return BRIDGE.learner_dir() if BRIDGE else tempfile.mkdtemp(prefix="lab-")


def fetch_dir(path) -> Path:
    return BRIDGE.fetch_dir(str(path)) if BRIDGE else Path(path)


def send_dir(local) -> str:
    return BRIDGE.send_dir(Path(local)) if BRIDGE else str(local)


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
