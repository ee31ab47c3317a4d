"""Switch reference implementations off while a learner's code runs (for lab test cells).

A test that calls the learner's function inside `with forbid(targets, globals()):` fails
with a clear message if that function reaches one of the references it is meant to rebuild,
whether through the module attribute or through a name the notebook imported from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

WHY = "this exercise rebuilds it, so it is switched off here"


def refuse(name: str, why: str = WHY) -> Callable:
    """A stand-in that raises AssertionError naming `name` whenever it is called."""
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} was called while your code ran: {why}")
    return fail


@contextlib.contextmanager
def forbid(targets: Iterable[tuple[object, str]], namespace: dict, why: str = WHY
           ) -> Iterator[None]:
    """Replace each `(owner, attribute)` in `targets` by `refuse(...)`, and every public name
    in `namespace` bound to one of those objects; restore all of them on exit."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name in targets
             if name in owner.__dict__]
    originals = {id(value) for _, _, value in saved}
    aliases = {k: v for k, v in namespace.items() if not k.startswith("_") and id(v) in originals}
    try:
        for owner, name, _ in saved:
            setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}", why))
        for k in aliases:
            namespace[k] = refuse(k, why)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        namespace.update(aliases)
