"""course.notebook.harness: spies that find their target by object, the learner's index-form
parallel_linear accepted where minimoe passes routing, and the MoE problems and reference."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from course.notebook.harness import (
    accept_routing,
    assert_close,
    assert_no_atomics,
    assert_rejects,
    expert_problem,
    expert_routing,
    loop_grads,
    spy_on,
)


def test_spy_on_counts_calls_and_launches_through_every_alias_and_restores(monkeypatch):
    mod = types.ModuleType("minimoe._harness_test")
    kernel = {(2,): lambda v: v + 1}          # kernel[grid](...) stands for a launch

    def f(v):
        return -v

    mod.f = f
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ns = {"f": f, "kernel": kernel}
    with spy_on(ns, f, kernel) as (spy_f, spy_k):
        assert mod.f(3) == ns["f"](3) == -3
        assert ns["kernel"][(2,)](1) == 2
    assert spy_f.calls == 2 and spy_f.results[0] == ((3,), {}, -3) and spy_k.grids == [(2,)]
    assert mod.f is f and ns["f"] is f and ns["kernel"] is kernel
    with pytest.raises(LookupError), spy_on({}, lambda: 0):
        pass


def test_accept_routing_takes_the_index_form_and_a_routing_value():
    seen = []

    def mine(x, W, k, sei, ssi, offsets, gates=None):
        seen.append((k, sei, ssi, offsets, gates))
        return x

    class Routing(tuple):
        k = 2

    adapted = accept_routing(mine)
    adapted("x", "W", Routing(("sei", "ssi", "off")), gates="g", backend="triton")
    adapted("x", "W", 3, "sei", "ssi", "off")
    assert seen == [(2, "sei", "ssi", "off", "g"), (3, "sei", "ssi", "off", None)]


def test_expert_routing_distinct_experts_only_and_skip():
    idx = expert_routing(40, 3, 6, seed=1, skip=2)
    assert idx.shape == (40, 3) and (idx != 2).all()
    assert all(len(set(row.tolist())) == 3 for row in idx)
    assert set(expert_routing(30, 2, 8, only=[1, 6]).unique().tolist()) == {1, 6}
    with pytest.raises(ValueError, match="k=3 distinct experts"):
        expert_routing(4, 3, 4, only=[0, 1])


def test_loop_grads_against_autograd_of_a_hand_loop():
    x, W, idx, gates, dout, A, B = expert_problem(5, 7, 3, 4, 2, seed=3, r=2)
    out, dx, dW, dg, dA, dB = loop_grads(x, W, idx, gates, dout, A, B, scaling=0.5)
    xr, Wr, gr, Ar, Br = (t.clone().requires_grad_() for t in (x, W, gates, A, B))
    rows = []
    for t in range(5):
        acc = 0
        for j in range(2):
            e = int(idx[t, j])
            a, b = Ar[e * 2:(e + 1) * 2], Br[:, e * 2:(e + 1) * 2]
            acc = acc + gr[t, j] * (xr[t] @ Wr[e] + 0.5 * (xr[t] @ a.T) @ b.T)
        rows.append(acc)
    want = torch.stack(rows)
    want.backward(dout)
    assert_close(out, want.detach(), "out")
    for name, got, ref in (("dx", dx, xr), ("dW", dW, Wr), ("dg", dg, gr), ("dA", dA, Ar),
                           ("dB", dB, Br)):
        assert_close(got, ref.grad, name)


def test_assert_close_says_where_and_fails_on_nan():
    want = torch.ones(2, 3)
    assert_close(want + 1e-7, want, "ok")
    bad = want.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(AssertionError, match=r"1 of 6 entries differ.*index \[1, 2\]"):
        assert_close(bad, want, "t")
    with pytest.raises(AssertionError, match="expected shape"):
        assert_close(want[0], want, "t")


def test_accept_routing_with_minimoe_routing_matches_the_library():
    import minimoe

    x, W, idx, gates, *_ = expert_problem(6, 8, 5, 4, 2, seed=2)
    routing = minimoe.flatten_sort_count(idx, 4)

    def index_form(x, W, k, sei, ssi, offsets, gates=None):
        return minimoe.parallel_linear_from_indices(x, W, k, sei, ssi, offsets, gates=gates,
                                                    backend="torch")

    got = accept_routing(index_form)(x, W, routing, gates=gates, backend="triton")
    want = loop_grads(x, W, idx, gates, torch.ones(6, 5))[0]
    assert_close(got, want, "through accept_routing")


def test_assert_rejects_and_assert_no_atomics():
    def strict(v):
        if v < 0:
            raise ValueError("negative")

    assert_rejects("strict", [("-1", lambda: strict(-1))])
    with pytest.raises(AssertionError, match=r"strict accepted 1; expected ValueError"):
        assert_rejects("strict", [("1", lambda: strict(1))])

    def kernel(ptr):
        return tl_stub.atomic_add(ptr, 1)

    tl_stub = types.SimpleNamespace(atomic_add=lambda p, v: p)
    with pytest.raises(AssertionError, match=r"kernel uses \['atomic_add'\]: one owner"):
        assert_no_atomics(kernel, "one owner")
    assert_no_atomics(strict, "one owner")
