"""labkit.forbid: references switched off inside the block, through aliases too, and back after."""

from __future__ import annotations

import types

import pytest

from labkit.course.forbid import forbid, refuse


def test_forbid_blocks_attribute_and_alias_and_restores():
    mod = types.ModuleType("ref")
    mod.solve = lambda: 42
    namespace = {"solve": mod.solve, "other": len, "_private": mod.solve}
    original = mod.solve
    with forbid([(mod, "solve"), (mod, "absent")], namespace, why="rebuild it"):
        with pytest.raises(AssertionError, match=r"ref.solve was called while your code ran: "
                                                 r"rebuild it"):
            mod.solve()
        with pytest.raises(AssertionError, match="solve was called"):
            namespace["solve"]()
        assert namespace["other"] is len and namespace["_private"] is original
    assert mod.solve is original and namespace["solve"] is original


def test_forbid_restores_after_an_exception():
    mod = types.ModuleType("ref")
    mod.f = abs
    with pytest.raises(KeyError), forbid([(mod, "f")], {}):
        raise KeyError("boom")
    assert mod.f is abs


def test_refuse_names_the_function():
    with pytest.raises(AssertionError, match="torch.autograd.grad was called"):
        refuse("torch.autograd.grad")(1, x=2)
