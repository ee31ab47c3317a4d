"""The trusted side's proxy for an object of the learner's (see trusted_side's docstring):
every use of a `Remote` is a request its bridge sends to the learner's kernel."""

from __future__ import annotations

import pickle
import sys

from . import wire

KNOWN_ROOTS = ("torch", "builtins", "collections", "minigpt", "miniquant", "minimoe",
               "minituner", "minirl", "gpucompile", "triton", "numpy")

HEAP_TYPE = 1 << 9             # Py_TPFLAGS_HEAPTYPE: a class made by a class statement


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("h", object.__getattribute__(obj, "_number")) if type(obj) is Remote else None


def _known_class(names: str):
    """The first class of `names` ("module.Qualname ...", the learner's object's class
    hierarchy as its side reports it) that lives in a known package and is `_claimable`;
    Remote if none does."""
    for name in names.split()[:32]:
        module, _, qual = name.rpartition(".")
        if module.split(".")[0] not in KNOWN_ROOTS or module not in sys.modules:
            continue
        obj = sys.modules[module]
        for part in qual.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and _claimable(obj):
            return obj
    return Remote


def _claimable(cls: type) -> bool:
    """Whether a proxy may report `cls` as its class: only when no class of its hierarchy
    keeps C data in its instances, but builtins' (CPython checks those by the object's real
    type). torch's C++ takes an object whose class is a tensor, storage or generator on its
    word (isinstance) and reads its memory as one: a proxy never claims those."""
    return all(c.__flags__ & HEAP_TYPE or c.__module__ == "builtins" for c in cls.__mro__)


class Remote:
    """A proxy for an object in the learner's kernel (see the module docstring)."""

    __slots__ = ("_bridge", "_number", "_cls", "_callable", "__weakref__")

    def __init__(self, bridge, handle: wire.Handle):
        for name, value in (("_bridge", bridge), ("_number", handle.number),
                            ("_cls", handle.cls), ("_callable", handle.callable)):
            object.__setattr__(self, name, value)

    def _ask(self, op: str, **fields):
        return object.__getattribute__(self, "_bridge").ask(
            op, target=object.__getattribute__(self, "_number"), **fields)

    @property
    def __class__(self):
        return _known_class(object.__getattribute__(self, "_cls"))

    def __getattr__(self, name):
        return self._ask("getattr", name=name)

    def __setattr__(self, name, value):
        self._ask("setattr", name=name, value=value)

    def __delattr__(self, name):
        self._ask("delattr", name=name)

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_bridge").call(self, args, kwargs)

    def __getitem__(self, key):
        return self._ask("getitem", key=key)

    def __setitem__(self, key, value):
        self._ask("setitem", key=key, value=value)

    def __len__(self):
        return self._ask("len")

    def __iter__(self):
        return iter(self._ask("iter"))

    def __contains__(self, value):
        return self._ask("contains", value=value)

    def __bool__(self):
        return self._ask("bool")

    def __repr__(self):
        return self._ask("repr")

    def __str__(self):
        return self._ask("str")

    def __deepcopy__(self, memo):
        return self._ask("deepcopy")

    def __copy__(self):
        return self._ask("deepcopy")

    def __reduce_ex__(self, protocol):
        raise TypeError("a proxy for the learner's object travels only as its handle")
