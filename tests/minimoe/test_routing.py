"""minimoe: the routers (softmax, sigmoid with a selection bias, group-limited), the Switch
load-balancing loss, the z-loss, the PyTorch dispatch and the MoE MLP, each against a naive
per-token Python loop."""

from __future__ import annotations

import math

import pytest
import torch

from minimoe import MoEMLP, dispatch_torch, expert_swiglu, load_balancing_loss, route
from minimoe.routers import _route, router_z_loss, update_selection_bias

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


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_is_bit_identical_to_the_topk_formula(renormalize):
    # Experiment 00's MoE checkpoint was trained with softmax -> torch.topk -> renormalise.
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(5)) * 2
    ref_w, ref_e = torch.softmax(logits, -1).topk(2, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    w, e = route(logits, 2, renormalize=renormalize)
    assert torch.equal(e, ref_e) and torch.equal(w, ref_w)


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
# sigmoid_topk and group_topk: naive per-token loops


def naive_sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def naive_sigmoid_route(row, k, bias=None, renormalize=True, n_group=None, topk_group=None,
                        scale=1.0, group_score="top2_sum"):
    """One token: sigmoid scores, bias for selection only, optional group limit (group score
    = sum of the two best selection scores in the group, or the best with "max"), ties to
    the lower index."""
    E = len(row)
    s = [naive_sigmoid(v) for v in row]
    sel = [s[i] + (bias[i] if bias else 0.0) for i in range(E)]
    candidates = list(range(E))
    if n_group is not None:
        size = E // n_group
        best = [sorted(sel[g * size:(g + 1) * size], reverse=True) for g in range(n_group)]
        rank = [b[0] if group_score == "max" else sum(b[:2]) for b in best]
        groups = sorted(range(n_group), key=lambda g: (-rank[g], g))[:topk_group]
        candidates = [i for g in groups for i in range(g * size, (g + 1) * size)]
    chosen = sorted(candidates, key=lambda i: (-sel[i], i))[:k]
    w = [s[i] for i in chosen]
    if renormalize:
        total = sum(w)
        w = [v / total for v in w]
    return chosen, [v * scale for v in w]


def check_against_naive(logits, k, bias=None, renormalize=True, n_group=None, topk_group=None,
                        scale=1.0, group_score="top2_sum"):
    method = "sigmoid_topk" if n_group is None else "group_topk"
    extra = {} if n_group is None else {"group_score": group_score}
    weights, experts = route(logits, k, method, renormalize, bias=bias, n_group=n_group,
                             topk_group=topk_group, routed_scaling_factor=scale, **extra)
    assert weights.shape == experts.shape == (logits.shape[0], k)
    assert weights.dtype == torch.float32 and experts.dtype == torch.int64
    b = None if bias is None else bias.tolist()
    for t, row in enumerate(logits.tolist()):
        chosen, w = naive_sigmoid_route(row, k, b, renormalize, n_group, topk_group, scale,
                                        group_score)
        assert experts[t].tolist() == chosen, t
        assert weights[t].tolist() == pytest.approx(w, rel=1e-5, abs=1e-7), t
    return weights, experts


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T, E, k", SHAPES)
def test_sigmoid_topk_matches_naive_loop(T, E, k, renormalize):
    for seed in range(3):
        g = torch.Generator().manual_seed(seed * 1000 + T * 10 + E)
        logits = torch.randn(T, E, generator=g) * 2
        check_against_naive(logits, k, renormalize=renormalize)
        bias = torch.randn(E, generator=g) * 0.3
        w, _ = check_against_naive(logits, k, bias=bias, renormalize=renormalize, scale=2.5)
        if renormalize:
            torch.testing.assert_close(w.sum(-1), torch.full((T,), 2.5), rtol=0, atol=1e-5)


# (tokens, experts, n_group, topk_group, k): one expert per group, k == group size, k == E,
# a single group, E == 1.
GROUP_SHAPES = [(1, 1, 1, 1, 1), (5, 6, 3, 2, 3), (9, 8, 4, 2, 4), (7, 8, 8, 3, 2),
                (4, 6, 2, 1, 3), (6, 4, 2, 2, 4), (11, 12, 4, 3, 5), (3, 5, 1, 1, 2)]


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
@pytest.mark.parametrize("T, E, n_group, topk_group, k", GROUP_SHAPES)
def test_group_topk_matches_naive_loop(T, E, n_group, topk_group, k, group_score):
    for seed in range(3):
        g = torch.Generator().manual_seed(seed * 1000 + T * 10 + E)
        logits = torch.randn(T, E, generator=g) * 2
        w, e = check_against_naive(logits, k, n_group=n_group, topk_group=topk_group,
                                   group_score=group_score)
        torch.testing.assert_close(w.sum(-1), torch.ones(T), rtol=0, atol=1e-6)
        # Every chosen expert lies in one of at most topk_group groups.
        size = E // n_group
        assert all(len({x // size for x in row}) <= topk_group for row in e.tolist())
        bias = torch.randn(E, generator=g) * 0.3
        check_against_naive(logits, k, bias=bias, renormalize=False, n_group=n_group,
                            topk_group=topk_group, scale=0.5, group_score=group_score)


@pytest.mark.parametrize("T, E, n_group, topk_group, k", GROUP_SHAPES)
def test_group_topk_reduces_to_sigmoid_topk(T, E, n_group, topk_group, k):
    g = torch.Generator().manual_seed(T + E)
    logits, bias = torch.randn(T, E, generator=g), torch.randn(E, generator=g) * 0.2
    ref = route(logits, k, "sigmoid_topk", bias=bias)
    # All groups allowed ...
    got = route(logits, k, "group_topk", bias=bias, n_group=n_group, topk_group=n_group)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    # ... or groups of one expert, k of them allowed.
    got = route(logits, k, "group_topk", bias=bias, n_group=E, topk_group=k)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_sigmoid_topk_hand_computed():
    # sigmoid(log a) = a / (1 + a): scores 1/2, 3/4, 1/4, 4/5.
    logits = torch.tensor([[0.0, math.log(3.0), -math.log(3.0), math.log(4.0)]])
    w, e = route(logits, 2, "sigmoid_topk", renormalize=False)
    assert e.tolist() == [[3, 1]]
    assert w.tolist()[0] == pytest.approx([0.8, 0.75], rel=1e-6)
    w, e = route(logits, 2, "sigmoid_topk")
    assert w.tolist()[0] == pytest.approx([0.8 / 1.55, 0.75 / 1.55], rel=1e-6)
    # The bias lifts expert 2 to the top (0.25 + 0.6 = 0.85) but its weight stays its own
    # unbiased score: order follows the selection score, not the weight.
    bias = torch.tensor([0.0, 0.0, 0.6, 0.0])
    w, e = route(logits, 2, "sigmoid_topk", bias=bias)
    assert e.tolist() == [[2, 3]]
    assert w.tolist()[0] == pytest.approx([0.25 / 1.05, 0.8 / 1.05], rel=1e-6)
    w, e = route(logits, 2, "sigmoid_topk", bias=bias, routed_scaling_factor=2.5)
    assert w.tolist()[0] == pytest.approx([2.5 * 0.25 / 1.05, 2.5 * 0.8 / 1.05], rel=1e-6)


def test_group_topk_hand_computed_uses_group_max():
    # Groups {0,1} {2,3} {4,5}: maxes 3, 2.5, 2.6 (in logits; sigmoid is monotone). Group
    # {2,3} has the largest top-2 sum (V3's rule, the default) but not the largest max (V2's).
    logits = torch.tensor([[3.0, -3.0, 2.5, 2.4, 2.6, -5.0]])
    w, e = route(logits, 2, "group_topk", n_group=3, topk_group=2, group_score="max")
    assert e.tolist() == [[0, 4]]
    s0, s4 = torch.sigmoid(torch.tensor([3.0, 2.6])).tolist()
    assert w.tolist()[0] == pytest.approx([s0 / (s0 + s4), s4 / (s0 + s4)], rel=1e-6)
    # One group allowed: its poor second expert beats the better ones elsewhere.
    w, e = route(logits, 2, "group_topk", n_group=3, topk_group=1, group_score="max")
    assert e.tolist() == [[0, 1]]
    assert w.tolist()[0] == pytest.approx([naive_sigmoid(3.0), naive_sigmoid(-3.0)], rel=1e-6)
    # The bias also steers the group choice: +0.5 on expert 3 makes {2,3} the best group.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    w, e = route(logits, 2, "group_topk", n_group=3, topk_group=1, bias=bias, group_score="max")
    assert e.tolist() == [[3, 2]]


def test_selection_bias_changes_choices_not_weights():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(40, 6, generator=g)
    w0, e0 = route(logits, 2, "sigmoid_topk", renormalize=False)
    # A bias that forces expert 5 first on every token: the weights are still the scores.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0])
    w, e = route(logits, 2, "sigmoid_topk", renormalize=False, bias=bias)
    assert (e[:, 0] == 5).all()
    torch.testing.assert_close(w[:, 0], torch.sigmoid(logits[:, 5]))
    # A bias equal on every expert changes nothing.
    w, e = route(logits, 2, "sigmoid_topk", renormalize=False, bias=torch.full((6,), 0.25))
    assert torch.equal(e, e0) and torch.equal(w, w0)


@pytest.mark.parametrize("method, extra", [
    ("softmax_topk", {}), ("sigmoid_topk", {}),
    ("group_topk", {"n_group": 3, "topk_group": 2}),
])
def test_ties_go_to_the_lower_index(method, extra):
    # All experts equal: experts 0..k-1 (and groups 0, 1), on every row.
    w, e = route(torch.zeros(4, 6), 3, method, **extra)
    assert e.tolist() == [[0, 1, 2]] * 4
    torch.testing.assert_close(w, torch.full((4, 3), 1 / 3))
    # A tie for second place between experts 2 and 4.
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.0, 3.0, 5.0]])
    _, e = route(logits, 3, method, **extra)
    assert e.tolist() == [[5, 2, 4]]
    _, e = route(logits, 2, method, **extra)
    assert e.tolist() == [[5, 2]]


@pytest.mark.parametrize("method, extra", [
    ("sigmoid_topk", {}), ("group_topk", {"n_group": 2, "topk_group": 1}),
])
def test_new_routers_low_precision_logits_give_float32_weights(method, extra):
    logits = torch.randn(5, 4).to(torch.bfloat16)
    bias = torch.randn(4).to(torch.bfloat16)
    w, e = route(logits, 2, method, bias=bias, **extra)
    assert w.dtype == torch.float32
    w32, e32 = route(logits.float(), 2, method, bias=bias.float(), **extra)
    assert torch.equal(e, e32) and torch.equal(w, w32)


def test_single_expert_renormalized_weight_is_one():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    for method in ("softmax_topk", "sigmoid_topk"):
        w, _ = route(logits, 1, method)
        assert torch.equal(w, torch.ones(5, 1))


# ---------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("method, renormalize, use_bias, extra", [
    ("softmax_topk", True, False, {}), ("softmax_topk", False, False, {}),
    ("sigmoid_topk", True, True, {}), ("sigmoid_topk", False, True, {}),
    ("group_topk", True, True, {"n_group": 3, "topk_group": 2}),
])
def test_router_weights_gradcheck_float64(method, renormalize, use_bias, extra):
    # `_route` is the router math without the float32 cast, so it can run in float64.
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=g, dtype=torch.float64) * 0.3 if use_bias else None

    def weights(x):
        return _route(x, 2, method, renormalize, bias, extra.get("n_group"),
                      extra.get("topk_group"), 1.5)[0]

    assert torch.autograd.gradcheck(weights, (logits,))


def test_gradients_reach_logits_not_bias():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(5, 6, generator=g, requires_grad=True)
    bias = torch.zeros(6, requires_grad=True)
    w, _ = route(logits, 2, "sigmoid_topk", bias=bias)
    (w * torch.randn(5, 2, generator=g)).sum().backward()
    assert logits.grad.abs().sum() > 0
    assert bias.grad is None


# ---------------------------------------------------------------------------------------------
# update_selection_bias


def test_update_selection_bias_hand_computed():
    bias = torch.tensor([0.0, 0.1, -0.2, 0.3])
    counts = torch.tensor([6, 2, 4, 4])                   # mean 4
    new = update_selection_bias(bias, counts, 0.01)
    assert new.dtype == torch.float32
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.11, -0.2, 0.3]))
    assert torch.equal(bias, torch.tensor([0.0, 0.1, -0.2, 0.3]))     # not in place
    # Naive loop.
    mean = sum(counts.tolist()) / 4
    ref = [b + 0.01 * ((mean > c) - (mean < c)) for b, c in zip(bias.tolist(),
                                                                counts.tolist(), strict=True)]
    assert new.tolist() == pytest.approx(ref, abs=1e-7)


def test_selection_bias_balances_a_skewed_router():
    g = torch.Generator().manual_seed(0)
    T, E, k = 512, 8, 2
    skew = torch.tensor([1.5, 1.0, 0.5, 0.0, 0.0, -0.5, -1.0, -1.5])
    logits = torch.randn(T, E, generator=g) + skew

    def imbalance(bias):
        _, experts = route(logits, k, "sigmoid_topk", bias=bias)
        load = torch.bincount(experts.flatten(), minlength=E).float()
        return (load.max() / load.mean()).item(), load

    bias = torch.zeros(E)
    start, _ = imbalance(bias)
    history = [start]
    for _ in range(60):
        _, load = imbalance(bias)
        bias = update_selection_bias(bias, load, 0.01)
        history.append(imbalance(bias)[0])
    assert start > 2.0                      # expert 0 takes more than twice its share
    assert max(history[-10:]) < 1.2         # and ends within 20% of the mean
    # The weights stayed the unbiased scores throughout: only the choice moved.
    w, e = route(logits, k, "sigmoid_topk", renormalize=False, bias=bias)
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, e))


def test_update_selection_bias_bad_arguments():
    with pytest.raises(ValueError, match="bias"):
        update_selection_bias(torch.zeros(2, 3), torch.zeros(2, 3), 0.1)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        update_selection_bias(torch.zeros(4), torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="rate"):
        update_selection_bias(torch.zeros(4), torch.zeros(4), -0.1)


# ---------------------------------------------------------------------------------------------
# router_z_loss


def test_router_z_loss_hand_computed():
    # logsumexp: log 2 and log(3 + 1) = 2 log 2  ->  mean of squares = 2.5 (log 2)².
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert router_z_loss(logits).item() == pytest.approx(2.5 * math.log(2.0) ** 2, rel=1e-6)


def test_router_z_loss_matches_naive_and_is_float32():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 5, generator=g) * 3
    rows = logits.tolist()
    ref = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in rows) / len(rows)
    assert router_z_loss(logits).item() == pytest.approx(ref, rel=1e-5)
    z = router_z_loss(logits.to(torch.bfloat16))
    assert z.dtype == torch.float32
    # Leading dims are all positions: [B, T, E] is the mean over B·T rows.
    assert router_z_loss(logits.reshape(1, 7, 5)).item() == pytest.approx(ref, rel=1e-5)


def test_router_z_loss_gradient_is_analytic():
    logits = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x = logits.detach().clone().requires_grad_()
    router_z_loss(x).backward()
    lse = torch.logsumexp(logits.detach(), -1, keepdim=True)
    expected = 2 * lse * torch.softmax(logits.detach(), -1) / 3
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "sigmoid_topk", "k": 5}, "k must be"),
    ({"method": "group_topk", "k": 0, "n_group": 2, "topk_group": 1}, "k must be"),
    ({"method": "softmax_topk", "bias": torch.zeros(4)}, "bias"),
    ({"method": "sigmoid_topk", "bias": torch.zeros(3)}, "bias"),
    ({"method": "sigmoid_topk", "bias": torch.zeros(1, 4)}, "bias"),
    ({"method": "sigmoid_topk", "bias": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, "bias"),
    ({"method": "sigmoid_topk", "n_group": 2}, "n_group"),
    ({"method": "softmax_topk", "topk_group": 1}, "topk_group"),
    ({"method": "group_topk"}, "n_group"),
    ({"method": "group_topk", "n_group": 3, "topk_group": 1}, "n_group"),
    ({"method": "group_topk", "n_group": 0, "topk_group": 1}, "n_group"),
    ({"method": "group_topk", "n_group": 2}, "topk_group"),
    ({"method": "group_topk", "n_group": 2, "topk_group": 3}, "topk_group"),
    ({"method": "group_topk", "n_group": 2, "topk_group": 0}, "topk_group"),
    ({"method": "group_topk", "k": 3, "n_group": 2, "topk_group": 1}, "topk_group"),
    ({"method": "sigmoid_topk", "routed_scaling_factor": 0.0}, "routed_scaling_factor"),
])
def test_route_bad_arguments_raise(kwargs, match):
    kwargs = {"k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        route(torch.randn(3, 4), **kwargs)


@pytest.mark.parametrize("method", ["softmax_topk", "sigmoid_topk"])
def test_route_nan_logits_raise(method):
    logits = torch.randn(3, 4)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match="logits"):
        route(logits, 2, method)


@pytest.mark.parametrize("value, shown", [(float("inf"), "±Inf"), (float("-inf"), "±Inf"),
                                          (float("nan"), "NaN")])
@pytest.mark.parametrize("method", ["softmax_topk", "sigmoid_topk"])
def test_route_non_finite_logits_raise_one_error(method, value, shown):
    """+Inf gave NaN weights (inf / inf) before; NaN and ±Inf are now the same error, a
    ValueError for a caller and a FloatingPointError for minituner's NaN guard."""
    from minimoe import NonFiniteLogitsError
    logits = torch.randn(3, 4)
    logits[0, 1] = value
    with pytest.raises(NonFiniteLogitsError, match=f"logits contain {shown}") as err:
        route(logits, 2, method)
    assert isinstance(err.value, ValueError) and isinstance(err.value, FloatingPointError)


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
