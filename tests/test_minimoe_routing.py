"""minimoe: the softmax top-k router, the Switch load-balancing loss, the PyTorch dispatch and
the MoE MLP, each against a naive per-token Python loop."""

from __future__ import annotations

import math

import pytest
import torch

from minimoe import MoEMLP, dispatch_torch, expert_swiglu, load_balancing_loss, route

pytestmark = pytest.mark.usefixtures("single_thread")

# (tokens, experts, k): length 1, k == E, E == 1, odd sizes.
SHAPES = [(1, 1, 1), (1, 5, 3), (7, 3, 1), (9, 5, 2), (6, 8, 3), (4, 4, 4), (13, 6, 2)]


def naive_softmax(row):
    m = max(row)
    ex = [math.exp(v - m) for v in row]
    s = sum(ex)
    return [v / s for v in ex]


def naive_topk(row, k):
    """Indices of the k largest values, largest first (no ties in random float logits)."""
    return sorted(range(len(row)), key=lambda i: -row[i])[:k]


# ---------------------------------------------------------------------------------------------
# route


@pytest.mark.parametrize("T, E, k", SHAPES)
def test_route_experts_are_argmax_k(T, E, k):
    g = torch.Generator().manual_seed(T * 100 + E)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    weights, experts = route(logits, k)
    assert weights.shape == experts.shape == (T, k)
    assert weights.dtype == torch.float32 and experts.dtype == torch.int64
    assert experts.tolist() == [naive_topk(row, k) for row in logits.tolist()]


@pytest.mark.parametrize("T, E, k", SHAPES)
def test_route_renormalized_sums_to_one(T, E, k):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E))
    weights, experts = route(logits, k, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(T), rtol=0, atol=1e-6)
    assert (weights > 0).all()
    for t, row in enumerate(logits.tolist()):
        p = naive_softmax(row)
        kept = [p[e] for e in experts[t].tolist()]
        expected = [v / sum(kept) for v in kept]
        assert weights[t].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)
        # Best expert first: weights are non-increasing along k.
        assert all(a >= b for a, b in zip(weights[t].tolist(), weights[t, 1:].tolist(),
                                          strict=False))


@pytest.mark.parametrize("T, E, k", SHAPES)
def test_route_without_renormalize_is_softmax_topk(T, E, k):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(k)) * 3
    weights, experts = route(logits, k, renormalize=False)
    for t, row in enumerate(logits.tolist()):
        p = naive_softmax(row)
        top = naive_topk(row, k)
        assert experts[t].tolist() == top
        assert weights[t].tolist() == pytest.approx([p[e] for e in top], rel=1e-5, abs=1e-7)
    if k < E:
        assert (weights.sum(-1) < 1).all()


def test_route_hand_computed():
    # softmax ≈ 1/6, 3/6, 2/6, 0
    logits = torch.tensor([[0.0, math.log(3.0), math.log(2.0), -50.0]])
    w, e = route(logits, 2, renormalize=False)
    assert e.tolist() == [[1, 2]]
    assert w.tolist()[0] == pytest.approx([0.5, 1 / 3], rel=1e-6)
    w, e = route(logits, 2)
    assert w.tolist()[0] == pytest.approx([0.6, 0.4], rel=1e-6)


def test_route_low_precision_logits_give_float32_weights():
    logits = torch.randn(5, 4).to(torch.bfloat16)
    w, e = route(logits, 2)
    assert w.dtype == torch.float32
    w32, e32 = route(logits.float(), 2)
    assert torch.equal(e, e32)
    torch.testing.assert_close(w, w32)


@pytest.mark.parametrize("k", [0, -1, 5, 6])
def test_route_bad_k_raises(k):
    with pytest.raises(ValueError, match="k must be"):
        route(torch.randn(3, 4), k)


def test_route_bad_shape_or_method_raises():
    with pytest.raises(ValueError, match="logits"):
        route(torch.randn(4), 1)
    with pytest.raises(ValueError, match="logits"):
        route(torch.randn(2, 3, 4), 1)
    with pytest.raises(ValueError, match="method"):
        route(torch.randn(3, 4), 1, method="expert_choice")


# ---------------------------------------------------------------------------------------------
# load_balancing_loss


def naive_lb_loss(logits, experts):
    T, E = len(logits), len(logits[0])
    slots = [e for row in experts for e in row]
    probs = [naive_softmax(row) for row in logits]
    total = 0.0
    for i in range(E):
        f = sum(e == i for e in slots) / len(slots)
        P = sum(p[i] for p in probs) / T
        total += f * P
    return E * total


@pytest.mark.parametrize("experts", [
    [[0], [1], [2], [0], [1], [2]],          # k=1, two tokens per expert
    [[0, 1], [2, 0], [1, 2]],                # k=2
    [[2, 1, 0]],                             # T=1, k=E
])
def test_lb_loss_is_one_when_uniform(experts):
    T, E = len(experts), 3
    loss = load_balancing_loss(torch.zeros(T, E), torch.tensor(experts))
    assert loss.item() == pytest.approx(1.0, abs=1e-6)


def test_lb_loss_collapsed_routing_is_n():
    # Every token confidently routed to expert 0: f_0 = 1, P_0 ≈ 1, loss ≈ N.
    E = 4
    logits = torch.full((5, E), -30.0)
    logits[:, 0] = 30.0
    loss = load_balancing_loss(logits, torch.zeros(5, 1, dtype=torch.long))
    assert loss.item() == pytest.approx(E, rel=1e-6)


@pytest.mark.parametrize("T, E, k", SHAPES)
def test_lb_loss_matches_naive_loop(T, E, k):
    g = torch.Generator().manual_seed(T + E + k)
    logits = torch.randn(T, E, generator=g) * 2
    _, experts = route(logits, k)
    expected = naive_lb_loss(logits.tolist(), experts.tolist())
    assert load_balancing_loss(logits, experts).item() == pytest.approx(expected, rel=1e-5)
    # Also for choices that are not the router's own (deliberately unbalanced).
    skewed = torch.zeros(T, k, dtype=torch.long)
    skewed[:, -1] = E - 1
    expected = naive_lb_loss(logits.tolist(), skewed.tolist())
    assert load_balancing_loss(logits, skewed).item() == pytest.approx(expected, rel=1e-5)


def test_lb_loss_gradient_goes_through_probabilities_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g, requires_grad=True)
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [1, 0], [0, 2]])
    load_balancing_loss(logits, experts).backward()
    # Reference: f is a constant, P = softmax(logits).mean(0).
    f = torch.bincount(experts.flatten(), minlength=4).double() / experts.numel()
    ref_logits = logits.detach().double().requires_grad_()
    (4 * (f * torch.softmax(ref_logits, -1).mean(0)).sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad.float(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# dispatch_torch


def naive_swiglu(x, wg, wu, wd):
    """One token through one expert, with silu spelled out."""
    g, u = x @ wg, x @ wu
    return (g * torch.sigmoid(g) * u) @ wd


def naive_dispatch(x, weights, experts, wg, wu, wd):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            out[t] += weights[t, j] * naive_swiglu(x[t], wg[e], wu[e], wd[e])
    return out


def random_choices(T, E, k, g, avoid=()):
    allowed = torch.tensor([e for e in range(E) if e not in avoid])
    rows = [allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)]
    return torch.stack(rows)


@pytest.mark.parametrize("T, k", [(1, 1), (1, 2), (1, 3), (5, 1), (8, 2), (11, 3)])
def test_dispatch_matches_naive_loop(T, k):
    E, C, F = 5, 6, 7
    g = torch.Generator().manual_seed(T * 10 + k)
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    wg, wu = (torch.randn(E, C, F, generator=g, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(E, F, C, generator=g, dtype=torch.float64)
    experts = random_choices(T, E, k, g, avoid=(3,))        # expert 3 gets zero tokens
    weights = torch.rand(T, k, generator=g, dtype=torch.float64)
    assert not (experts == 3).any()
    got = dispatch_torch(x, weights, experts, wg, wu, wd)
    torch.testing.assert_close(got, naive_dispatch(x, weights, experts, wg, wu, wd))
    # The zero-token expert's weights do not matter.
    wg2 = wg.clone()
    wg2[3] = float("nan")
    torch.testing.assert_close(dispatch_torch(x, weights, experts, wg2, wu, wd), got)


def test_expert_swiglu_matches_naive():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    wg, wu, wd = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g), \
        torch.randn(5, 4, generator=g)
    ref = torch.stack([naive_swiglu(x[i], wg, wu, wd) for i in range(3)])
    torch.testing.assert_close(expert_swiglu(x, wg, wu, wd), ref)


# ---------------------------------------------------------------------------------------------
# MoEMLP


def make_moe(C=6, F=10, E=6, k=2, seed=0, std=0.3) -> MoEMLP:
    torch.manual_seed(seed)
    m = MoEMLP(C, F, E, k)
    with torch.no_grad():
        for p in (m.w_gate, m.w_up, m.w_down):
            p.normal_(0, std)                 # see test_moemlp_initialises_its_experts
        m.router.weight.normal_(0, 1.0)
    return m


@pytest.mark.parametrize("k", [1, 2, 3])
def test_moemlp_matches_naive(k):
    m = make_moe(k=k)
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1))
    y = m(x)
    assert y.shape == x.shape
    flat = x.reshape(-1, 6)
    weights, experts = route(flat @ m.router.weight.T, k, renormalize=k > 1)  # Switch at k=1
    ref = naive_dispatch(flat, weights, experts, m.w_gate, m.w_up, m.w_down).reshape(x.shape)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(m.last_experts, experts)
    torch.testing.assert_close(m.aux_loss, load_balancing_loss(flat @ m.router.weight.T,
                                                               experts))


def test_moemlp_gradients_reach_router_and_only_used_experts():
    m = make_moe(E=7, k=2)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(2))   # 2 tokens x top-2
    m(x).pow(2).sum().backward()
    used = set(m.last_experts.flatten().tolist())
    assert 2 <= len(used) <= 4 < m.n_experts      # so some experts got zero tokens
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0
    for name in ("w_gate", "w_up", "w_down"):
        grad = getattr(m, name).grad
        for e in range(m.n_experts):
            if e in used:
                assert grad[e].abs().sum() > 0, (name, e)
            else:
                assert torch.equal(grad[e], torch.zeros_like(grad[e])), (name, e)


def test_moemlp_gradients_match_naive_autograd():
    m = make_moe(E=5, k=3, C=4, F=6)
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(3))
    m(x).sin().sum().backward()
    params = [m.router.weight, m.w_gate, m.w_up, m.w_down]
    ref = [p.detach().clone().requires_grad_() for p in params]
    w, e = route(x @ ref[0].T, 3)
    naive_dispatch(x, w, e, *ref[1:]).sin().sum().backward()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6)


def test_moemlp_top1_router_learns_from_output():
    m = make_moe(E=4, k=1)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    m(x).pow(2).sum().backward()
    assert m.router.weight.grad.abs().max() > 1e-4


def test_moemlp_initialises_its_experts(monkeypatch):
    real_empty = torch.empty

    def garbage_empty(*size, **kwargs):      # what uninitialised memory may hold
        return real_empty(*size, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", garbage_empty)
    m = MoEMLP(8, 16, 4, 2)
    monkeypatch.undo()
    for name, p in m.named_parameters():
        assert torch.isfinite(p).all(), f"{name} was never initialised"


def test_moemlp_bfloat16():
    m = make_moe(k=2)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(5))
    ref = m(x)
    m = m.to(torch.bfloat16)
    y = m(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.05)


def test_moemlp_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        MoEMLP(4, 8, 3, 4)
    with pytest.raises(ValueError, match="top_k"):
        MoEMLP(4, 8, 3, 0)
    with pytest.raises(ValueError, match="backend"):
        MoEMLP(4, 8, 3, 2, backend="cuda")
