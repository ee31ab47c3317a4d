"""Swap functions out by object while a learner's code runs (for lab test cells).

A function can be reached under many names: `minimoe.parallel_linear`,
`minimoe.parallel_experts.parallel_linear`, a `from minimoe import parallel_linear` in another
module or in the notebook. `bindings` finds every one of them for a given object, in the
course packages and in a notebook namespace; `swap` rebinds them all to a replacement and puts
the originals back on exit, even after an exception; `forbid` swaps in `refuse(...)`, a
stand-in that fails with a message the learner can act on, whether called (`f(...)`) or
launched as a Triton kernel (`kernel[grid](...)`).

Naming something that is bound nowhere raises instead of being skipped: a renamed reference
must break the lab's test cell, not silently stop being forbidden.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator

from . import bridged

WHY = "this exercise rebuilds it, so it is switched off here"
COURSE_PACKAGES = ("miniquant", "minimoe", "minigpt", "minituner", "minirl", "gpucompile",
                   "labkit")

Binding = tuple[object, str]     # (a module, class or namespace dict, the name bound there)


class Refuse:
    """A stand-in that raises AssertionError naming `name` when called or launched."""

    def __init__(self, name: str, why: str = WHY):
        self.name, self.why = name, why

    def _fail(self, *args, **kwargs):
        raise AssertionError(f"{self.name} was called while your code ran: {self.why}")

    __call__ = _fail
    __getitem__ = _fail       # kernel[grid](...)


def refuse(name: str, why: str = WHY) -> Refuse:
    """A stand-in that raises AssertionError naming `name` whenever it is called."""
    return Refuse(name, why)


def _course_owners() -> Iterator[object]:
    """The loaded course modules and the classes they define (whose methods can be bound)."""
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in COURSE_PACKAGES:
            continue
        yield module
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                yield value


def bindings(obj: object, namespace: dict | None = None) -> list[Binding]:
    """Every (owner, name) under which `obj` is bound: module globals and class attributes
    in the loaded course packages, and the public names of `namespace` (a notebook's
    `globals()`; names starting with `_` are the tests' own and stay)."""
    found = [(owner, name) for owner in _course_owners()
             for name, value in list(vars(owner).items()) if value is obj]
    if namespace is not None:
        found += [(namespace, name) for name, value in list(namespace.items())
                  if value is obj and not name.startswith("_")]
    return found


def _label(owner: object, name: str) -> str:
    return name if isinstance(owner, dict) else f"{getattr(owner, '__name__', owner)}.{name}"


def _get(owner: object, name: str) -> object:
    return owner[name] if isinstance(owner, dict) else vars(owner)[name]


def _set(owner: object, name: str, value: object) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:
        setattr(owner, name, value)


def _resolve(target: object) -> tuple[object, list[Binding]]:
    """A target is an object, or an (owner, name) pair naming where it is bound (for owners
    outside the course packages, such as torch or bitsandbytes)."""
    if isinstance(target, tuple) and len(target) == 2 and isinstance(target[1], str):
        owner, name = target
        if name not in vars(owner):
            raise AttributeError(f"{_label(owner, name)} does not exist (renamed or removed?): "
                                 f"the lab names something that is not there")
        return vars(owner)[name], [(owner, name)]
    return target, []


@contextlib.contextmanager
def _rebound(plan: Iterable[tuple[object, Callable[[str], object]]], namespace: dict | None
             ) -> Iterator[None]:
    """Rebind every binding of each target to `make(label)`; restore all on exit. Every
    target is looked up before anything changes, so a missing one leaves nothing swapped."""
    saved: dict[tuple[int, str], tuple[object, str, object]] = {}
    new: list[tuple[object, str, object]] = []
    for target, make in plan:
        obj, explicit = _resolve(target)
        where = explicit + bindings(obj, namespace)
        if not where:
            raise LookupError(f"{getattr(obj, '__qualname__', obj)!r} is bound nowhere in "
                              f"{', '.join(COURSE_PACKAGES)} or the notebook: nothing to swap")
        for owner, name in where:
            if (id(owner), name) not in saved:
                saved[(id(owner), name)] = (owner, name, _get(owner, name))
                new.append((owner, name, make(_label(owner, name))))
    try:
        for owner, name, value in new:
            _set(owner, name, value)
        yield
    finally:
        for owner, name, value in saved.values():
            _set(owner, name, value)


def swap(target: object, replacement: object, namespace: dict | None = None
         ) -> contextlib.AbstractContextManager[None]:
    """Inside the block, every binding of `target` (a function or class object, or an
    `(owner, name)` pair) in the course packages and in `namespace` is `replacement`; the
    originals come back on exit, even after an exception. Raises LookupError when `target`
    is bound nowhere, AttributeError when a pair names a missing attribute."""
    return _rebound([(target, lambda label: replacement)], namespace)


@contextlib.contextmanager
def forbid(targets: Iterable[object], namespace: dict | None = None, why: str = WHY
           ) -> Iterator[None]:
    """Replace every binding of each target (a function, class, kernel, or an `(owner, name)`
    pair) by a `Refuse` naming where it was reached, in the course packages and in
    `namespace`; restore all of them on exit. A target bound nowhere, or a pair naming a
    missing attribute, raises before anything changes. With the tests apart from the
    learner's code (bridged.BRIDGE), the same happens in the learner's kernel too."""
    targets = list(targets)
    bridge = bridged.BRIDGE
    here = [t for t in targets if not (bridge and bridge.owns(t))]
    # the learner's kernel first: its specs are read off the bindings before they change here
    with (bridge.forbid(targets, why) if bridge else contextlib.nullcontext()), \
            _rebound([(t, lambda label: Refuse(label, why)) for t in here], namespace):
        yield
