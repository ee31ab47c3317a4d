"""What a lab asks the learner to write does not exist in the learner's kernel.

`install(lab)` runs in the learner's kernel before any of their code: every object the
packages' REFERENCE tables name for `lab` (course.notebook.harness.reference), less what
their GIVEN tables hand the learner to build on, is replaced,
wherever a loaded module of the course holds it (its own module, the package's re-export,
any other module's import of it), by a stub that raises `NotInThisLab`. An alias, closure
or container the learner's code makes afterwards can only capture the stub; the trusted test
kernel, where the tests compare against the reference, has the real packages.
"""

from __future__ import annotations

import contextlib
import importlib

from ..notebook.forbid import bindings
from ..notebook.harness import REFERENCE_PACKAGES, reference, resolve


class NotInThisLab(RuntimeError):
    """Called a reference that this lab asks the learner to write."""


class Stub:
    """Stands where a reference was: calling it (or launching it, for a kernel) raises."""

    def __init__(self, name: str, lab: str):
        self.name, self.lab = name, lab
        self.__name__ = self.__qualname__ = name.rsplit(".", 1)[-1]

    def __call__(self, *args, **kwargs):
        raise NotInThisLab(f"{self.name} is what lab {self.lab} asks you to write: it does not "
                           "exist while your notebook is graded (write your own, or use the "
                           "pieces the lab gives you)")

    def __getitem__(self, grid):
        return self

    def __repr__(self) -> str:
        return f"<stub of {self.name}: lab {self.lab} asks you to write it>"


def _references(lab: str) -> dict[str, object]:
    """harness.reference(lab), less what cannot load here: a kernel module without triton
    (a learner's `make check` on a Mac) cannot be called here either."""
    try:
        return reference(lab) if lab else {}
    except ValueError:               # no package names anything this lab rebuilds
        return {}
    except ImportError:
        found = {}
        for package in REFERENCE_PACKAGES:
            table = getattr(importlib.import_module(package), "REFERENCE", {})
            for name, path in table.get(lab, {}).items():
                with contextlib.suppress(ImportError):
                    found[name] = resolve(path)
        return found


def install(lab: str) -> list[str]:
    """Stub `lab`'s references wherever a loaded course module binds them; the places."""
    table = _references(lab)
    given = {name for package in REFERENCE_PACKAGES
             for name in getattr(importlib.import_module(package), "GIVEN", {}).get(lab, ())}
    replaced = []
    for name, obj in table.items():
        if name in given:
            continue
        for owner, attr in bindings(obj):
            where = f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attr}"
            setattr(owner, attr, Stub(where, lab))
            replaced.append(where)
    return replaced
