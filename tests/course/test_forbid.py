"""course.notebook.forbid: functions switched out by object, through every alias, and back
after; a name or object that is not there raises instead of being skipped."""

from __future__ import annotations

import sys
import types

import pytest

from course.notebook.forbid import bindings, forbid, refuse, swap


@pytest.fixture
def two_modules(monkeypatch):
    """A course-package module defining `solve` and a class method, and a second one that
    imported `solve` under another name (as `from .a import solve as helper` would)."""
    def solve():
        return 42

    class Holder:
        def method(self):
            return 1

    a = types.ModuleType("minigpt._forbid_test_a")
    a.solve, a.Holder, a._private = solve, Holder, solve
    Holder.__module__ = a.__name__
    b = types.ModuleType("minigpt._forbid_test_b")
    b.helper = solve
    monkeypatch.setitem(sys.modules, a.__name__, a)
    monkeypatch.setitem(sys.modules, b.__name__, b)
    return a, b


def test_bindings_finds_module_aliases_class_attributes_and_public_notebook_names(two_modules):
    a, b = two_modules
    ns = {"solve": a.solve, "_mine": a.solve, "other": len}
    found = {(getattr(o, "__name__", "ns"), n) for o, n in bindings(a.solve, ns)}
    assert found == {(a.__name__, "solve"), (a.__name__, "_private"), (b.__name__, "helper"),
                     ("ns", "solve")}
    method = a.Holder.__dict__["method"]
    assert bindings(method) == [(a.Holder, "method")]


def test_forbid_one_entry_blocks_every_alias_and_restores(two_modules):
    a, b = two_modules
    original = a.solve
    ns = {"solve": original, "_mine": original}
    with forbid([original], ns, why="rebuild it"):
        for call, label in ((a.solve, "minigpt._forbid_test_a.solve"),
                            (b.helper, "minigpt._forbid_test_b.helper"), (ns["solve"], "solve")):
            with pytest.raises(AssertionError, match=f"{label} was called while your code "
                                                     f"ran: rebuild it"):
                call()
        assert ns["_mine"] is original                    # the tests' own names stay
    assert a.solve is b.helper is ns["solve"] is a._private is original


def test_forbid_blocks_a_kernel_launch_and_a_method(two_modules):
    a, _ = two_modules
    method = a.Holder.__dict__["method"]
    with forbid([method]):
        with pytest.raises(AssertionError, match="Holder.method was called"):
            a.Holder().method()
    assert a.Holder().method() == 1
    kernel = types.SimpleNamespace(__getitem__=None)
    a.kernel = kernel
    with forbid([kernel]), pytest.raises(AssertionError, match="kernel was called"):
        a.kernel[(4,)]()


def test_forbid_raises_on_a_missing_name_or_an_unbound_object(two_modules):
    a, _ = two_modules
    with pytest.raises(AttributeError, match=r"_forbid_test_a._with_lora does not exist"):
        with forbid([(a, "_with_lora")], {}):
            pass
    with pytest.raises(LookupError, match="bound nowhere"):
        with forbid([lambda: 0], {}):
            pass
    # nothing was changed by the failed attempt, even for the targets listed before it
    with pytest.raises(AttributeError):
        with forbid([a.solve, (a, "absent")], {}):
            pass
    assert a.solve() == 42


def test_forbid_takes_a_pair_outside_the_course_packages(two_modules):
    outside = types.ModuleType("elsewhere")
    outside.f = abs
    with forbid([(outside, "f")], {"g": abs}):
        with pytest.raises(AssertionError, match="elsewhere.f was called"):
            outside.f(-1)
    assert outside.f is abs


def test_swap_replaces_every_alias_and_restores_after_an_exception(two_modules):
    a, b = two_modules
    original = a.solve
    ns = {"solve": original}
    with pytest.raises(KeyError), swap(original, lambda: 7, ns):
        assert a.solve() == b.helper() == ns["solve"]() == 7
        raise KeyError("boom")
    assert a.solve is b.helper is ns["solve"] is original
    with pytest.raises(LookupError, match="bound nowhere"):
        with swap(lambda: 0, abs, {}):
            pass


def test_refuse_names_the_function():
    with pytest.raises(AssertionError, match="torch.autograd.grad was called"):
        refuse("torch.autograd.grad")(1, x=2)
