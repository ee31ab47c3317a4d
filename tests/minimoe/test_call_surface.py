"""The MoE call surface: the `Routing` value, its checks, `parallel_linear` on a Routing and
its index-form adapter `parallel_linear_from_indices` (the course's index form and
ScatterMoE's output-projection convention, docs/ARCHITECTURE.md, Sorted routing),
`nf4_parallel_linear` / the expert modules on a Routing, and `ExpertLoRA` — each against a
naive per-token loop."""

from __future__ import annotations

import pytest
import torch

from minimoe import (
    ExpertLinear,
    ExpertLoRA,
    NF4Experts,
    Routing,
    flatten_sort_count,
    group_bwd_W,
    nf4_parallel_linear,
    parallel_linear,
    parallel_linear_from_indices,
    reference,
    scatter2scatter,
)
from minimoe.nf4_experts import quantize_experts
from miniquant.nf4 import dequantize_nf4

pytestmark = pytest.mark.usefixtures("single_thread")

RTOL = 1e-5
BACKENDS = ("triton", "torch")


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _problem(T=7, K=24, N=40, E=5, k=2, seed=0):
    """x [T, K], W [E, K, N], experts [T, k] (k distinct per token, expert E-1 unused), gates."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen)
    W = torch.randn(E, K, N, generator=gen) / K ** 0.5
    experts = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])
    gates = torch.rand(T, k, generator=gen)
    return x, W, experts, gates


# --- the Routing value --------------------------------------------------------------------

def test_flatten_sort_count_gives_a_routing_that_unpacks_as_three_tensors():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    routing = flatten_sort_count(experts, 4)
    assert isinstance(routing, Routing) and len(routing) == 3
    sei, ssi, offs = routing
    assert sei.tolist() == [0, 0, 1, 2, 2, 2] and ssi.tolist() == [1, 4, 3, 0, 2, 5]
    assert offs.tolist() == [2, 3, 6, 6] and routing[2] is offs and routing[-1] is offs
    assert (routing.k, routing.n_experts, routing.n_tokens, routing.n_rows) == (2, 4, 3, 6)
    assert routing.ends == (2, 3, 6, 6) and routing.counts() == [2, 1, 3, 0]
    assert routing.active_experts() == [0, 1, 2]
    assert all(t.dtype == torch.int64 for t in routing)


@pytest.mark.parametrize("T, E, k", [(1, 1, 1), (7, 5, 3), (33, 8, 2), (0, 4, 2)])
def test_flatten_sort_count_passes_its_own_check(T, E, k):
    """What flatten_sort_count builds unchecked, from_indices accepts, with the same ends."""
    gen = torch.Generator().manual_seed(T)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T \
        else torch.zeros(0, k, dtype=torch.int64)
    routing = flatten_sort_count(experts, E)
    again = Routing.from_indices(*routing, k, E)
    assert again.ends == routing.ends == tuple(torch.bincount(experts.reshape(-1),
                                                              minlength=E).cumsum(0).tolist())


def _indices():
    return tuple(flatten_sort_count(torch.tensor([[2, 0], [2, 1], [0, 2]]), 4))


@pytest.mark.parametrize("edit, match", [
    (lambda s, c, o: (s.flip(0), c.flip(0), o), "sorted_expert_idxs must be non-decreasing"),
    (lambda s, c, o: (s + 2, c, o), "sorted_expert_idxs must lie in 0..3"),
    (lambda s, c, o: (s - 1, c, o), "sorted_expert_idxs must lie"),
    (lambda s, c, o: (s, torch.tensor([1, 4, 3, 0, 2, 2]), o), "sorted_scattered_idxs must be a "
                                                                "permutation"),
    (lambda s, c, o: (s, c + 1, o), "sorted_scattered_idxs must be a permutation"),
    (lambda s, c, o: (s, c, torch.tensor([1, 3, 6, 6])), "expert_offsets must be the inclusive"),
    (lambda s, c, o: (s, c, torch.tensor([2, 3, 6, 7])), "expert_offsets must be the inclusive"),
    (lambda s, c, o: (s.float(), c, o), "sorted_expert_idxs must be an integer"),
    (lambda s, c, o: (s, c.bool(), o), "sorted_scattered_idxs must be an integer"),
    (lambda s, c, o: (s, c, o.double()), "expert_offsets must be an integer"),
    (lambda s, c, o: (s, c[:5], o), "sorted_scattered_idxs must have shape"),
    (lambda s, c, o: (s[None], c, o), "sorted_expert_idxs must be 1-D"),
    (lambda s, c, o: (s, c, o[:3]), "expert_offsets must have shape"),
])
def test_from_indices_names_the_inconsistent_argument(edit, match):
    with pytest.raises(ValueError, match=match):
        Routing.from_indices(*edit(*_indices()), 2, 4)


@pytest.mark.parametrize("k, E, match", [(4, 4, "not a multiple of k"), (0, 4, "k must be"),
                                         (5, 4, "k must be"), (2, 0, "n_experts"),
                                         (True, 4, "k must be")])
def test_from_indices_checks_k_and_experts(k, E, match):
    sei, ssi, _ = _indices()
    with pytest.raises(ValueError, match=match):
        Routing.from_indices(sei, ssi, torch.tensor([2, 3, 6, 6])[:max(E, 1)], k, E)


def _naive_sort(experts, E):
    """(ids, slots, ends) by a loop over experts: each expert's slots in increasing order."""
    flat = experts.reshape(-1).tolist()
    ids, slots, ends = [], [], []
    for e in range(E):
        for s, x in enumerate(flat):
            if x == e:
                ids.append(e)
                slots.append(s)
        ends.append(len(ids))
    return ids, slots, ends


@pytest.mark.parametrize("T, E, k", [(61, 3, 2), (250, 7, 3), (1000, 4, 1)])
def test_flatten_sort_count_keeps_slot_order_within_an_expert(T, E, k):
    """A stable sort: with 100 and more rows of few experts (where torch's default CPU sort
    reorders equal ids; scripts/mutate.py: `stable=False` went unnoticed), each expert's rows
    keep increasing slot order, as the loop gives."""
    gen = torch.Generator().manual_seed(T)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    routing = flatten_sort_count(experts, E)
    ids, slots, ends = _naive_sort(experts, E)
    assert routing.sorted_expert_idxs.tolist() == ids
    assert routing.sorted_scattered_idxs.tolist() == slots
    assert routing.expert_offsets.tolist() == ends and list(routing.ends) == ends


def test_from_indices_refuses_a_drop_after_the_first_row_and_names_it():
    """Rows 2 and 3 swapped: every id is still >= the first one, but row 3 (1) follows 2."""
    sei, ssi, offs = _indices()
    swap = [0, 1, 3, 2, 4, 5]
    with pytest.raises(ValueError, match=r"non-decreasing \(sorted by expert\), but row 3 "
                                         r"\(1\) follows 2$"):
        Routing.from_indices(sei[swap], ssi[swap], offs, 2, 4)


def test_from_indices_one_row_with_an_out_of_range_slot():
    """M = 1: slot 1 (or -1) is no permutation of 0..0, a ValueError (not an indexing error)."""
    for slot in (1, -1):
        with pytest.raises(ValueError, match=r"permutation of 0..0"):
            Routing.from_indices(torch.tensor([0]), torch.tensor([slot]), torch.tensor([1]), 1, 1)


def test_with_k_rereads_the_same_rows_and_checks_k():
    routing = flatten_sort_count(torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]]), 4)   # 8 rows
    for k in (1, 2, 4):                        # 1 and E included
        again = routing.with_k(k)
        assert (again.k, again.n_tokens, again.n_experts) == (k, 8 // k, 4)
        assert again.ends == routing.ends
        assert all(a is b for a, b in zip(again, routing, strict=True))
    for k in (0, 3, 5, 8, True, 2.0):          # 3 divides no 8 rows; 5 and 8 exceed E
        with pytest.raises(ValueError, match="k must be in 1..4 and divide the 8 rows"):
            routing.with_k(k)


def test_flatten_sort_count_bad_input():
    with pytest.raises(ValueError, match="expert_idxs must lie in 0..3"):
        flatten_sort_count(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="integer"):
        flatten_sort_count(torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="tokens, k"):
        flatten_sort_count(torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_experts"):
        flatten_sort_count(torch.zeros(2, 1, dtype=torch.int64), 0)


# --- the three silent cases of the issue: now a ValueError at the public entry ------------

def _shuffled_rows(sei, ssi):
    """The same (expert, slot) pairs in another order: each row still consistent, unsorted."""
    perm = torch.randperm(sei.numel(), generator=torch.Generator().manual_seed(1))
    return sei[perm], ssi[perm]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsorted_expert_ids_are_refused(backend):
    """Today's code gave triton and torch answers 6.9 apart; now neither answers."""
    x, W, experts, gates = _problem()
    sei, ssi, offs = flatten_sort_count(experts, 5)
    sei, ssi = _shuffled_rows(sei, ssi)
    with pytest.raises(ValueError, match="sorted_expert_idxs must be non-decreasing"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, offs, gates=gates, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scattered_ids_that_are_not_a_permutation_are_refused(backend):
    """Today's code left the slot nobody wrote as uninitialised memory in the output."""
    x, W, experts, _ = _problem()
    sei, ssi, offs = flatten_sort_count(experts, 5)
    ssi = ssi.clone()
    ssi[3] = ssi[4]                                  # slot ssi[4] twice, the old ssi[3] never
    with pytest.raises(ValueError, match="sorted_scattered_idxs must be a permutation"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, offs, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_inconsistent_with_the_ids_are_refused(backend):
    """Non-decreasing and ending at M, but not the ids' counts: today dW was off by 3.2."""
    x, W, experts, gates = _problem()
    sei, ssi, offs = flatten_sort_count(experts, 5)
    offs = offs.clone()
    offs[0] += 1
    W = W.clone().requires_grad_()
    with pytest.raises(ValueError, match="expert_offsets must be the inclusive cumulative"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, offs, gates=gates,
                                     backend=backend).sum().backward()


def test_nf4_and_expert_modules_take_a_routing_only():
    """Hand-built indices reach them as a Routing, checked where it is made."""
    x, W, experts, gates = _problem(K=16, N=24)
    sei, ssi, offs = flatten_sort_count(experts, 5)
    q = quantize_experts(W)
    with pytest.raises(TypeError, match="Routing"):
        nf4_parallel_linear(x, q, 2, gates=gates)
    for module in (ExpertLinear(W.clone(), r=2), NF4Experts(q, r=2)):
        with pytest.raises(TypeError):
            module(x, 2, sei, ssi, offs, gates=gates)
    sei, ssi = _shuffled_rows(sei, ssi)
    with pytest.raises(ValueError, match="sorted_expert_idxs must be non-decreasing"):
        Routing.from_indices(sei, ssi, offs, 2, 5)


def test_launchers_alone_check_index_values_and_trust_when_told():
    x, W, experts, _ = _problem()
    sei, ssi, offs = flatten_sort_count(experts, 5)
    bad_sei, bad_ssi = _shuffled_rows(sei, ssi)
    with pytest.raises(ValueError, match="sorted_expert_idxs must be non-decreasing"):
        scatter2scatter(x, W, bad_sei, bad_ssi, 2)
    dup = ssi.clone()
    dup[0] = dup[1]
    with pytest.raises(ValueError, match="sorted_scattered_idxs must be a permutation"):
        scatter2scatter(x, W, sei, dup, 2)
    with pytest.raises(ValueError, match="expert_offsets must be non-decreasing"):
        group_bwd_W(torch.zeros(14, 40), x[ssi // 2], offs.flip(0), 5)
    want = reference.linear_loop(x, W, experts)
    assert _rel(scatter2scatter(x, W, sei, ssi, 2, trusted=True), want) <= RTOL


def test_one_form_takes_a_routing_and_keywords():
    x, W, experts, gates = _problem()
    routing = flatten_sort_count(experts, 5)
    sei, ssi, _ = routing
    with pytest.raises(TypeError, match="Routing"):
        parallel_linear(x, W, tuple(routing))
    with pytest.raises(TypeError):
        parallel_linear(x, W, routing, gates)                       # options are keywords
    with pytest.raises(TypeError):
        parallel_linear_from_indices(x, W, 2, sei, ssi)


# --- the Routing form, ExpertLoRA, and the forms agree --------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lora_path", ["fused", "split"])
def test_routing_form_equals_index_form_and_the_loop(backend, lora_path):
    x, W, experts, gates = _problem()
    E, K, N = W.shape
    gen = torch.Generator().manual_seed(3)
    A, B = torch.randn(3 * E, K, generator=gen), torch.randn(N, 3 * E, generator=gen)
    routing = flatten_sort_count(experts, E)
    new = parallel_linear(x, W, routing, gates=gates, lora=ExpertLoRA(A, B, 0.5),
                          backend=backend, lora_path=lora_path)
    old = parallel_linear_from_indices(x, W, 2, *routing, gates=gates, lora_A=A, lora_B=B,
                                       scaling=0.5, backend=backend, lora_path=lora_path)
    positional_gates = parallel_linear_from_indices(x, W, 2, *routing, gates, backend=backend)
    want = reference.linear_loop(x, W, experts, gates, A, B, 0.5)
    assert torch.equal(new, old) and _rel(new, want) <= RTOL
    assert _rel(positional_gates, reference.linear_loop(x, W, experts, gates)) <= RTOL


def test_the_one_form_refuses_index_tensors_and_names_the_adapter():
    """parallel_linear takes a Routing only; the index form goes through the adapter, whose
    checks name the bad argument."""
    x, W, experts, gates = _problem()
    routing = flatten_sort_count(experts, W.shape[0])
    with pytest.raises(TypeError, match="parallel_linear_from_indices"):
        parallel_linear(x, W, 2, gates=gates, backend="torch")
    with pytest.raises(TypeError, match="3 positional arguments"):
        parallel_linear(x, W, 2, *routing, gates=gates, backend="torch")
    sei, ssi = _shuffled_rows(*routing[:2])
    with pytest.raises(ValueError, match="sorted_expert_idxs must be non-decreasing"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, routing[2])


def test_routing_must_fit_the_weight_and_the_input():
    x, W, experts, gates = _problem()
    routing = flatten_sort_count(experts, 5)
    with pytest.raises(ValueError, match="E = 5"):
        parallel_linear(x, W[:4], routing)
    with pytest.raises(ValueError, match=r"x must be \[7, 24\]"):
        parallel_linear(x[:6], W, routing)
    with pytest.raises(ValueError, match=r"gates must have shape \[7, 2\]"):
        parallel_linear(x, W, routing, gates=gates[:, :1])
    with pytest.raises(ValueError, match="grouped_out=False"):
        parallel_linear(x, W, routing, gates=gates, grouped_out=True)
    with pytest.raises(ValueError, match="together"):
        parallel_linear(x, W, routing, lora=ExpertLoRA(torch.zeros(10, 24), None))


# --- ScatterMoE's output projection: k=1, grouped input, gates [T, top_k] --------------------

def _scattermoe_problem(T=9, F=24, C=40, E=6, top_k=3, seed=2):
    """h [T·top_k, F] in sorted order (what the up projections give), W2 [E, F, C], gates."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E - 1, generator=gen)[:top_k] for _ in range(T)])
    h = torch.randn(T * top_k, F, generator=gen)
    W2 = torch.randn(E, F, C, generator=gen) / F ** 0.5
    gates = torch.rand(T, top_k, generator=gen)
    return h, W2, experts, gates


def _naive_output_projection(h, W2, experts, gates, ssi):
    """out[t] = Σ_j gates[t, j] · h[row of slot t·k + j] @ W2[experts[t, j]], token by token."""
    T, k = experts.shape
    row_of_slot = torch.empty_like(ssi).scatter_(0, ssi, torch.arange(ssi.numel()))
    return torch.stack([sum(gates[t, j] * (h[row_of_slot[t * k + j]] @ W2[experts[t, j]])
                            for j in range(k)) for t in range(T)])


def _grads(fn, *leaves):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
    return [out] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
def test_scattermoe_output_projection_convention(backend):
    h, W2, experts, gates = _scattermoe_problem()
    sei, ssi, offsets = flatten_sort_count(experts, W2.shape[0])
    got = _grads(lambda h, W2, g: parallel_linear_from_indices(
        h, W2, 1, sei, ssi, offsets, grouped_in=True, gates=g, backend=backend), h, W2, gates)
    want = _grads(lambda h, W2, g: _naive_output_projection(h, W2, experts, g, ssi),
                  h, W2, gates)
    for name, a, b in zip(("out", "dh", "dW2", "dgates"), got, want, strict=True):
        assert _rel(a, b) <= RTOL, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_scattermoe_convention_through_expert_modules(backend):
    """ScatterMoE's k=1 indices, checked into a Routing read with top_k slots per token (what
    parallel_linear_from_indices does), through the expert modules."""
    h, W2, experts, gates = _scattermoe_problem(F=16, C=24)
    E, top_k = W2.shape[0], gates.shape[1]
    routing = flatten_sort_count(experts, E)
    sei, ssi, offsets = routing
    scattermoe = Routing.from_indices(sei, ssi, offsets, 1, E).with_k(top_k)
    want = _naive_output_projection(h, W2, experts, gates, ssi)
    float_module = ExpertLinear(W2.clone(), r=0)
    got = float_module(h, scattermoe, grouped_in=True, gates=gates, backend=backend)
    assert _rel(got, want) <= RTOL
    q = quantize_experts(W2)
    nf4 = NF4Experts(q)(h, scattermoe, grouped_in=True, gates=gates, backend=backend)
    W2q = dequantize_nf4(q, torch.float32)
    assert _rel(nf4, _naive_output_projection(h, W2q, experts, gates, ssi)) <= RTOL
    via_routing = nf4_parallel_linear(h, q, routing, grouped_in=True, gates=gates,
                                      backend=backend)
    assert torch.equal(via_routing, nf4)


def test_scattermoe_k1_is_only_for_a_grouped_input():
    x, W, experts, gates = _problem()
    sei, ssi, offs = flatten_sort_count(experts, 5)
    with pytest.raises(ValueError, match="gates must have shape"):
        parallel_linear_from_indices(torch.randn(14, 24), W, 1, sei, ssi, offs, gates=gates)


def test_scattermoe_k1_is_the_adapters_reading_not_the_one_forms():
    """A Routing says its own k: the one form takes gates [T, k] for it, nothing else."""
    h, W2, experts, gates = _scattermoe_problem()
    sei, ssi, offsets = flatten_sort_count(experts, W2.shape[0])
    k1 = Routing.from_indices(sei, ssi, offsets, 1, W2.shape[0])
    with pytest.raises(ValueError, match=r"gates must have shape \[27, 1\]"):
        parallel_linear(h, W2, k1, grouped_in=True, gates=gates)
