"""ScatterMoE dispatch: sort, Triton kernels, parallel_linear and MoEMLP(backend="triton").

Every output and gradient is checked against the naive loops in `minimoe.reference`, in
float32, on awkward sizes (K, N not multiples of the block; T = 1; an expert with no tokens;
every token to one expert). On CPU the kernels run in the Triton interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minimoe import (
    ExpertLinear,
    ExpertLoRA,
    MoEMLP,
    dispatch_triton,
    flatten_sort_count,
    group,
    group_bwd_lora,
    group_bwd_W,
    ops,
    parallel_linear,
    parallel_linear_from_indices,
    reference,
    scatter2scatter,
    scatter2scatter_lora,
)
from minimoe.kernels import interpreting

pytestmark = pytest.mark.usefixtures("single_thread")

RTOL = 1e-5  # max |error| / max |reference|, float32
BACKENDS = ("triton", "torch")

# (T, K, N, E, k, routing): routing "rand" = k distinct random experts per token, "zero" =
# never the last expert, "one" = every token to the same k experts.
CASES = [
    (1, 24, 40, 1, 1, "rand"), (1, 40, 24, 4, 3, "rand"), (1, 24, 40, 8, 2, "zero"),
    (7, 24, 40, 4, 2, "rand"), (7, 40, 24, 8, 3, "zero"), (7, 24, 40, 8, 1, "zero"),
    (7, 40, 24, 1, 1, "one"), (7, 24, 40, 4, 3, "one"), (7, 40, 24, 4, 1, "rand"),
    (64, 24, 40, 8, 2, "rand"), (64, 40, 24, 4, 1, "one"), (64, 40, 24, 8, 3, "rand"),
    (64, 24, 40, 8, 1, "zero"), (64, 24, 40, 4, 2, "one"), (64, 40, 24, 4, 3, "zero"),
    (64, 40, 40, 1, 1, "rand"), (7, 136, 72, 4, 2, "rand"),   # several K steps and N tiles
]


def _case_id(c):
    return "T{}-K{}-N{}-E{}-k{}-{}".format(*c)


def _routing(T: int, E: int, k: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct experts per token, as a top-k router gives."""
    if mode == "one":
        return torch.arange(k).repeat(T, 1)
    pool = E - 1 if mode == "zero" else E
    assert k <= pool
    return torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(T)])


def _inputs(case, seed=0):
    T, K, N, E, k, mode = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen)
    W = torch.randn(E, K, N, generator=gen) / K ** 0.5
    experts = _routing(T, E, k, mode, gen)
    gates = torch.rand(T, k, generator=gen)
    return x, W, experts, gates


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _linear_errors(case, backend: str, gated: bool, lora_path: str | None = None,
                   r: int = 3) -> dict[str, float]:
    """Max relative errors of parallel_linear vs reference.linear_loop: out and each grad.

    With `lora_path` ("fused" | "split"), expert LoRA A [r·E, K], B [N, r·E] too (dA, dB).
    """
    x, W, experts, gates = _inputs(case)
    E, K, N = W.shape
    gen = torch.Generator().manual_seed(5)
    ab = (torch.randn(r * E, K, generator=gen), torch.randn(N, r * E, generator=gen)) \
        if lora_path else ()
    leaves = [t.clone().requires_grad_() for t in (x, W, gates, *ab)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, W, gates, *ab)]
    routing = flatten_sort_count(experts, E)
    lora = dict(lora=ExpertLoRA(leaves[3], leaves[4], 0.5),
                lora_path=lora_path) if lora_path else {}
    out = parallel_linear(leaves[0], leaves[1], routing, gates=leaves[2] if gated else None,
                          backend=backend, **lora)
    ref_lora = dict(lora_A=ref_leaves[3], lora_B=ref_leaves[4], scaling=0.5) \
        if lora_path else {}
    ref = reference.linear_loop(ref_leaves[0], ref_leaves[1], experts,
                                ref_leaves[2] if gated else None, **ref_lora)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    ref.backward(dout)
    names = ("dx", "dW", "dgates", "dA", "dB")
    errs = {"out": _rel(out, ref)}
    errs.update({n: _rel(a.grad, b.grad) for n, a, b in zip(names, leaves, ref_leaves,
                                                             strict=False)
                 if n != "dgates" or gated})
    unused = torch.bincount(experts.reshape(-1), minlength=E) == 0
    zero = bool((leaves[1].grad[unused] == 0).all())
    if lora_path:
        unused_r = unused.repeat_interleave(r)
        zero &= bool((leaves[3].grad[unused_r] == 0).all())
        zero &= bool((leaves[4].grad[:, unused_r] == 0).all())
    errs["unused_zero"] = zero
    return errs


def test_flatten_sort_count():
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sei, ssi, offs = flatten_sort_count(experts, 4)
    assert sei.tolist() == [0, 0, 1, 2, 2, 2]
    assert ssi.tolist() == [1, 4, 3, 0, 2, 5]          # stable: slot order within an expert
    assert offs.tolist() == [2, 3, 6, 6]               # end offsets; expert 3 has none
    assert (experts.reshape(-1)[ssi] == sei).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_parallel_linear_matches_loop(case, backend):
    for gated in (False, True):
        errs = _linear_errors(case, backend, gated)
        assert errs.pop("unused_zero"), "an expert with no tokens must get dW exactly 0"
        assert max(errs.values()) <= RTOL, (gated, errs)


@pytest.mark.parametrize("case", [CASES[4], CASES[11]], ids=_case_id)
def test_parallel_linear_grouped_in_out(case):
    """grouped_in / grouped_out read and write sorted rows; both backends agree with the loop."""
    x, W, experts, _ = _inputs(case)
    E, k = W.shape[0], experts.shape[1]
    routing = flatten_sort_count(experts, E)
    sei, ssi, _ = routing
    xg = x[ssi // k]                                                  # [M, K] sorted
    ref = reference.linear_loop(x, W, experts)[ssi]                   # [M, N] sorted
    for backend in BACKENDS:
        for gi, go in ((True, True), (True, False), (False, True)):
            xin = xg.clone().requires_grad_() if gi else x.clone().requires_grad_()
            out = parallel_linear(xin, W, routing, grouped_in=gi, grouped_out=go,
                                  backend=backend)
            want = ref if go else torch.empty_like(ref).index_copy(0, ssi, ref)
            assert _rel(out, want) <= RTOL
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
            out.backward(dout)
            dy_sorted = dout if go else dout[ssi]                      # [M, N] sorted
            dxg = torch.einsum("mn,mkn->mk", dy_sorted, W[sei])       # [M, K] sorted
            want_dx = dxg if gi else torch.zeros_like(x).index_add(0, ssi // k, dxg)
            assert _rel(xin.grad, want_dx) <= RTOL


LORA_CASES = [CASES[1], CASES[4], CASES[12], CASES[14], CASES[9], CASES[16]]
# (backend, lora_path): the fused kernels, the split path on the kernels, and PyTorch.
LORA_PATHS = [("triton", "fused"), ("triton", "split"), ("torch", "split")]


@pytest.mark.parametrize("path", LORA_PATHS, ids="-".join)
@pytest.mark.parametrize("case", LORA_CASES, ids=_case_id)
def test_parallel_linear_expert_lora_matches_loop(case, path):
    """A [r·E, K], B [N, r·E]: output and grads of x, W, A, B, gates vs the loop; experts
    without tokens get exactly-zero dW, dA rows and dB columns."""
    for gated in (True, False):
        errs = _linear_errors(case, *path[:1], gated, lora_path=path[1])
        assert errs.pop("unused_zero"), "unused experts must get exact-zero dW / dA / dB"
        assert max(errs.values()) <= RTOL, (gated, errs)


@pytest.mark.parametrize("r", [1, 16, 17, 20])
def test_lora_ranks_not_a_power_of_two(r):
    """The rank block pads r to a power of two >= 16: r = 1, exactly 16, 17 and 20 (-> 32)."""
    errs = _linear_errors((7, 40, 24, 4, 2, "zero"), "triton", True, lora_path="fused", r=r)
    assert errs.pop("unused_zero") and max(errs.values()) <= RTOL, errs


def test_fused_lora_kernels_directly():
    """scatter2scatter_lora (slot and sorted order) and group_bwd_lora vs naive loops."""
    T, K, N, E, k, r, s = 9, 40, 24, 5, 2, 3, 0.7
    x, W, experts, _ = _inputs((T, K, N, E, k, "zero"))
    gen = torch.Generator().manual_seed(7)
    A, B = torch.randn(r * E, K, generator=gen), torch.randn(N, r * E, generator=gen)
    sei, ssi, offs = flatten_sort_count(experts, E)
    want = reference.linear_loop(x, W, experts, lora_A=A, lora_B=B, scaling=s)    # [M, N]
    assert _rel(scatter2scatter_lora(x, W, A, B, s, sei, ssi, k), want) <= RTOL
    assert _rel(scatter2scatter_lora(x, W, A, B, s, sei, ssi, k, y_grouped=True),
                want[ssi]) <= RTOL
    dy, xg = torch.randn(T * k, N, generator=gen), x[ssi // k]                    # sorted
    dA, dB = group_bwd_lora(dy, xg, A, B, offs, s)
    want_dA, want_dB = torch.zeros_like(A), torch.zeros_like(B)
    for i in range(T * k):                                     # one row's outer products
        e = int(sei[i])
        rows = slice(e * r, (e + 1) * r)
        want_dA[rows] += s * torch.outer(dy[i] @ B[:, rows], xg[i])
        want_dB[:, rows] += s * torch.outer(dy[i], xg[i] @ A[rows].T)
    assert _rel(dA, want_dA) <= RTOL and _rel(dB, want_dB) <= RTOL
    last = slice((E - 1) * r, E * r)                           # expert E-1 has no tokens
    assert torch.equal(dA[last], torch.zeros(r, K)) and torch.equal(dB[:, last],
                                                                    torch.zeros(N, r))


def test_group_and_group_bwd_W():
    T, K, N, E, k = 7, 40, 24, 5, 2
    x, W, experts, gates = _inputs((T, K, N, E, k, "zero"))
    sei, ssi, offs = flatten_sort_count(experts, E)
    assert torch.equal(group(x, ssi, fan_out=k), x[ssi // k])
    coeff = gates.reshape(-1)
    assert _rel(group(x, ssi, fan_out=k, coeff=coeff), x[ssi // k] * coeff[ssi, None]) < RTOL
    dy = torch.randn(T * k, N)
    xg = x[ssi // k]
    dW = group_bwd_W(dy, xg, offs, E)
    want = torch.zeros(E, K, N)
    for i in range(T * k):                                             # naive outer products
        want[sei[i]] += torch.outer(xg[i], dy[i])
    assert _rel(dW, want) <= RTOL
    assert torch.equal(dW[E - 1], torch.zeros(K, N))                   # no tokens: exact 0


MLP_CASES = [(1, 24, 40, 4, 2, "rand"), (7, 40, 24, 8, 3, "zero"), (64, 24, 40, 4, 1, "one"),
             (64, 40, 24, 8, 2, "zero"), (7, 24, 40, 1, 1, "rand")]


def _mlp_errors(case, backend: str) -> dict[str, float]:
    """SwiGLU dispatch (with router-like gates from leaf logits) vs reference.moe_loop."""
    T, C, F, E, k, mode = case
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, C, generator=gen)
    ws = [torch.randn(E, C, F, generator=gen) / C ** 0.5, torch.randn(E, C, F, generator=gen)
          / C ** 0.5, torch.randn(E, F, C, generator=gen) / F ** 0.5]
    logits = torch.randn(T, k, generator=gen)
    experts = _routing(T, E, k, mode, gen)
    runs = []
    for fn in (dispatch_triton if backend == "triton" else _torch_sorted_dispatch,
               reference.moe_loop):
        leaves = [t.clone().requires_grad_() for t in (x, logits, *ws)]
        out = fn(leaves[0], leaves[1].softmax(-1), experts, *leaves[2:])
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
        runs.append((out, [t.grad for t in leaves]))
    (out, grads), (ref, ref_grads) = runs
    names = ("dx", "dlogits", "dW_gate", "dW_up", "dW_down")
    errs = {"out": _rel(out, ref)}
    errs.update({n: _rel(g, r) for n, g, r in zip(names, grads, ref_grads, strict=True)})
    unused = torch.bincount(experts.reshape(-1), minlength=E) == 0
    assert all(bool((g[unused] == 0).all()) for g in grads[2:])
    return errs


def _torch_sorted_dispatch(x, weights, experts, w_gate, w_up, w_down):
    """dispatch_triton's three parallel_linears, on the sort-based PyTorch backend."""
    routing = flatten_sort_count(experts, w_gate.shape[0])
    g = parallel_linear(x, w_gate, routing, grouped_out=True, backend="torch")
    u = parallel_linear(x, w_up, routing, grouped_out=True, backend="torch")
    h = torch.nn.functional.silu(g) * u
    return parallel_linear(h, w_down, routing, gates=weights, grouped_in=True, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MLP_CASES, ids=_case_id)
def test_moe_dispatch_matches_loop(case, backend):
    errs = _mlp_errors(case, backend)
    assert max(errs.values()) <= RTOL, errs


@pytest.mark.parametrize("path", LORA_PATHS, ids="-".join)
@pytest.mark.parametrize("case", MLP_CASES[:4], ids=_case_id)
def test_moe_expert_lora_matches_loop(case, path):
    """SwiGLU MoE with LoRA on every expert of gate / up / down (ExpertLinear modules with
    their base weights made trainable for the check): output and the gradients of x, the
    router logits, W_gate, W_up, W_down and each A, B vs reference.moe_loop."""
    T, C, F, E, k, mode = case
    backend, lora_path = path
    r, s = 2, 0.75
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(T, C, generator=gen)
    shapes = [(C, F), (C, F), (F, C)]
    ws = [torch.randn(E, i, o, generator=gen) / i ** 0.5 for i, o in shapes]
    abs_ = [t for i, o in shapes for t in (torch.randn(r * E, i, generator=gen),
                                           torch.randn(o, r * E, generator=gen))]
    logits = torch.randn(T, k, generator=gen)
    experts = _routing(T, E, k, mode, gen)
    dout = torch.randn(T, C, generator=gen)
    runs = []
    for kernel in (True, False):
        leaves = [torch.nn.Parameter(t.clone()) for t in (x, logits, *ws, *abs_)]
        if kernel:
            mods = [ExpertLinear(w, r=r, alpha=s * r, backend=backend) for w in leaves[2:5]]
            for m, a, b in zip(mods, leaves[5::2], leaves[6::2], strict=True):
                m.weight.requires_grad_(True)
                m.lora_A, m.lora_B, m.lora_path = a, b, lora_path
            out = dispatch_triton(leaves[0], leaves[1].softmax(-1), experts, *mods,
                                  backend=backend)
        else:
            lora = tuple(zip(leaves[5::2], leaves[6::2], strict=True))
            out = reference.moe_loop(leaves[0], leaves[1].softmax(-1), experts, *leaves[2:5],
                                     lora=lora, scaling=s)
        out.backward(dout)
        runs.append([out] + [t.grad for t in leaves])
    names = ("out", "dx", "dlogits", "dW_gate", "dW_up", "dW_down", "dA_gate", "dB_gate",
             "dA_up", "dB_up", "dA_down", "dB_down")
    errs = {n: _rel(g, w) for n, g, w in zip(names, *runs, strict=True)}
    assert max(errs.values()) <= RTOL, errs


def test_moemlp_triton_backend_same_as_torch():
    """Same parameters (a torch-backend state dict loads as is), same outputs and grads."""
    torch.manual_seed(0)
    mods = [MoEMLP(24, 40, 5, 2, backend=b) for b in ("torch", "triton")]
    mods[1].load_state_dict(mods[0].state_dict(), strict=True)
    x = torch.randn(2, 9, 24)
    outs = []
    for m in mods:
        out = m(x)
        (out.square().sum() + m.aux_loss).backward()
        outs.append(out)
    assert _rel(outs[1], outs[0]) <= RTOL
    assert torch.equal(mods[0].last_experts, mods[1].last_experts)
    for (name, p0), p1 in zip(mods[0].named_parameters(), mods[1].parameters(), strict=True):
        assert _rel(p1.grad, p0.grad) <= RTOL, name


def test_experiment00_checkpoint_runs_on_triton_backend():
    """The pretrained MoE base loads unchanged; switching its MoEMLPs to Triton keeps logits."""
    from minigpt import load_base
    model = load_base("moe").eval()
    x = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator())
    with torch.no_grad():
        want = model(x)
        for m in model.modules():
            if isinstance(m, MoEMLP):
                m.backend = "triton"
        got = model(x)
    want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
    assert _rel(got, want) <= RTOL


def test_error_table():
    """The gradient-check matrix: max relative error per case × backend (run with -s)."""
    cols = ("out", "dx", "dW", "dgates", "dA", "dB")
    runs = [(c, b, None) for c in CASES for b in BACKENDS] + \
           [(c, b, lp) for c in LORA_CASES for b, lp in LORA_PATHS]
    print(f"\n{'case':28} {'path':13} " + " ".join(f"{n:>8}" for n in cols))
    for case, backend, lora_path in runs:
        e = _linear_errors(case, backend, gated=True, lora_path=lora_path)
        assert e.pop("unused_zero")
        label = backend + (f"+{lora_path}" if lora_path else "")
        print(f"{_case_id(case):28} {label:13} "
              + " ".join(f"{e[n]:8.1e}" if n in e else f"{'-':>8}" for n in cols))
        assert max(e.values()) <= RTOL


# --- bad inputs -----------------------------------------------------------------------------

def _good():
    x, W, experts, _ = _inputs((7, 24, 40, 4, 2, "rand"))
    return x, W, experts, flatten_sort_count(experts, 4)


def test_bad_inputs_raise_clear_errors():
    x, W, experts, (sei, ssi, offs) = _good()
    with pytest.raises(ValueError, match="k must be"):
        scatter2scatter(x, W, sei, ssi, 5)
    with pytest.raises(ValueError, match="k must be"):
        scatter2scatter(x, W, sei, ssi, 0)
    with pytest.raises(ValueError, match="expert_idxs must lie"):
        flatten_sort_count(experts + 4, 4)
    with pytest.raises(ValueError, match="sorted_expert_idxs must lie"):
        scatter2scatter(x, W, sei + 1, ssi, 2)
    with pytest.raises(ValueError, match="same dtype"):
        scatter2scatter(x, W.double(), sei, ssi, 2)
    with pytest.raises(ValueError, match="X has"):
        scatter2scatter(x[:5], W, sei, ssi, 2)
    with pytest.raises(ValueError, match="together"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, offs, lora_A=torch.zeros(8, 24))
    with pytest.raises(ValueError, match="lora_A must be"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, offs, lora_A=torch.zeros(6, 24),
                                     lora_B=torch.zeros(40, 6))
    with pytest.raises(ValueError, match="backend"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, offs, backend="cuda")
    A, B = torch.zeros(8, 24), torch.zeros(40, 8)
    with pytest.raises(ValueError, match="lora_path"):
        parallel_linear_from_indices(x, W, 2, sei, ssi, offs, lora_A=A, lora_B=B,
                                     lora_path="fast")
    with pytest.raises(ValueError, match="lora_A"):
        scatter2scatter_lora(x, W, A.double(), B, 1.0, sei, ssi, 2)
    with pytest.raises(ValueError, match="lora_A must be"):
        scatter2scatter_lora(x, W, A[:, :20], B, 1.0, sei, ssi, 2)
    with pytest.raises(ValueError, match="expert_offsets"):
        group_bwd_lora(torch.zeros(14, 40), x[ssi // 2], A, B, offs - 1, 1.0)
    with pytest.raises(ValueError, match="same rows"):
        group_bwd_lora(torch.zeros(13, 40), x[ssi // 2], A, B, offs, 1.0)


def test_rank_block_is_the_next_power_of_two_from_16():
    assert {r: ops._rank_block(r) for r in (1, 15, 16, 17, 31, 32, 33, 64, 65)} == {
        1: 16, 15: 16, 16: 16, 17: 32, 31: 32, 32: 32, 33: 64, 64: 64, 65: 128}


def test_shape_edges_of_the_launchers():
    """What scripts/mutate.py found unguarded in ops.py: a K that differs between X and W
    (`or` -> `and`), an empty routing (M = 0 is valid), a LoRA of rank 0 (refused) and of
    rank 1 on one expert (valid), ids that go down after the first row, and in `group` and
    `group_bwd_W` a slot past M, a short coeff and DY and X of other rows."""
    x, W, experts, (sei, ssi, offs) = _good()
    with pytest.raises(ValueError, match="the same K"):
        scatter2scatter(x, W[:, :20], sei, ssi, 2)
    empty = torch.zeros(0, dtype=torch.long)
    assert scatter2scatter(x[:0], W, empty, empty, 2).shape == (0, 40)
    with pytest.raises(ValueError, match="lora_A must be"):
        ops.check_expert_lora(torch.zeros(0, 24), torch.zeros(40, 0), 4, 24, 40)
    assert ops.check_expert_lora(torch.zeros(1, 24), torch.zeros(40, 1), 1, 24, 40) == 1
    down, perm = sei.clone(), torch.arange(len(sei))
    i, j = 2, int((sei > sei[2]).nonzero()[0])          # a later, larger id moved up
    perm[[i, j]] = perm[[j, i]]
    assert down[perm][1:].ge(down[0]).all()              # every id >= the first: not enough
    with pytest.raises(ValueError, match="sorted_expert_idxs must be non-decreasing"):
        scatter2scatter(x, W, sei[perm], ssi[perm], 2)
    with pytest.raises(ValueError, match="sorted_scattered_idxs must lie in 0..13"):
        group(x, ssi + 1, 2)                             # a slot past M: read past X
    with pytest.raises(ValueError, match="coeff must be a floating tensor of 14 elements"):
        group(x, ssi, 2, coeff=torch.ones(13))
    with pytest.raises(ValueError, match="must have the same rows"):
        group_bwd_W(torch.zeros(14, 40), torch.zeros(13, 24), offs, 4)


def test_group_bwd_lora_on_one_expert():
    """E = 1 is valid (`E < 1` -> `E <= 1` went unnoticed): the formulas, by hand."""
    gen = torch.Generator().manual_seed(3)
    X, DY = torch.randn(5, 24, generator=gen), torch.randn(5, 40, generator=gen)
    A, B = torch.randn(2, 24, generator=gen), torch.randn(40, 2, generator=gen)
    dA, dB = group_bwd_lora(DY, X, A, B, torch.tensor([5]), 0.5)
    torch.testing.assert_close(dA, 0.5 * (DY @ B).T @ X, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dB, 0.5 * DY.T @ (X @ A.T), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.float(), "must be an integer tensor"),
    (lambda t: t.bool(), "must be an integer tensor"),
    (lambda t: t[:-1], r"must have shape \[6\], got \(5,\)"),
    (lambda t: t[:, None], r"must have shape \[6\], got \(6, 1\)"),
])
def test_launchers_check_each_index_tensor(edit, match):
    """Index tensors reach the kernels as [M] int64: a float or bool one, a short one and an
    [M, 1] one are ValueErrors naming the argument, never truncated or read past M
    (scripts/mutate.py: `or` -> `and` in either check went unnoticed)."""
    sei, ssi, offs = flatten_sort_count(torch.tensor([[0, 1], [1, 2], [2, 0]]), 3)   # M = 6
    X, W = torch.randn(3, 8), torch.randn(3, 8, 4)
    with pytest.raises(ValueError, match="sorted_scattered_idxs " + match):
        group(X, edit(ssi), 2)
    with pytest.raises(ValueError, match="sorted_scattered_idxs " + match):
        scatter2scatter(X, W, sei, edit(ssi), 2)
    offs_match = match.split(", got")[0].replace("6", "3")
    with pytest.raises(ValueError, match="expert_offsets " + offs_match):
        group_bwd_W(torch.randn(6, 4), torch.randn(6, 8), edit(offs), 3)


def test_backward_launchers_take_offsets_with_the_first_expert_empty():
    """End offsets starting at 0 (expert 0 has no rows) are valid: its blocks are exact zeros,
    the others match the per-expert products (the launchers' own offset check)."""
    gen = torch.Generator().manual_seed(5)
    M, K, N, E, r = 6, 7, 5, 3, 2
    DY, X = torch.randn(M, N, generator=gen), torch.randn(M, K, generator=gen)
    A, B = torch.randn(r * E, K, generator=gen), torch.randn(N, r * E, generator=gen)
    offs = torch.tensor([0, 4, 6])
    dW = group_bwd_W(DY, X, offs, E)
    dA, dB = group_bwd_lora(DY, X, A, B, offs, 0.5)
    assert not dW[0].any() and not dA[:r].any() and not dB[:, :r].any()
    for e, (lo, hi) in ((1, (0, 4)), (2, (4, 6))):
        x, dy, a, b = X[lo:hi], DY[lo:hi], A[e * r:(e + 1) * r], B[:, e * r:(e + 1) * r]
        torch.testing.assert_close(dW[e], x.T @ dy)
        torch.testing.assert_close(dA[e * r:(e + 1) * r], 0.5 * (dy @ b).T @ x)
        torch.testing.assert_close(dB[:, e * r:(e + 1) * r], 0.5 * dy.T @ (x @ a.T))


@pytest.mark.parametrize("offs", [[2, 5, 3, 6], [0, 4, 2, 6], [3, 3, 7, 6]])
def test_backward_launchers_refuse_offsets_that_go_down(offs):
    """In range and ending at M = 6 (but for the last), yet not non-decreasing: a drop after
    the first expert, which a check against the first offset alone would pass."""
    DY, X = torch.randn(6, 5), torch.randn(6, 7)
    A, B = torch.randn(8, 7), torch.randn(5, 8)
    with pytest.raises(ValueError, match="expert_offsets must be non-decreasing end offsets"):
        group_bwd_W(DY, X, torch.tensor(offs), 4)
    with pytest.raises(ValueError, match="expert_offsets must be non-decreasing end offsets"):
        group_bwd_lora(DY, X, A, B, torch.tensor(offs), 1.0)


def test_cpu_tensors_are_refused_when_the_kernels_are_compiled(monkeypatch):
    """A compiled kernel reads CUDA memory only: with the interpreter faked off, CPU inputs are a
    ValueError naming the argument before anything launches."""
    sei, ssi, offs = flatten_sort_count(torch.tensor([[0, 1], [1, 2]]), 3)
    X, W = torch.randn(2, 8), torch.randn(3, 8, 4)
    monkeypatch.setattr("minimoe.kernels.interpreting", lambda: False)
    with pytest.raises(ValueError, match="X is on cpu, but Triton compiles for CUDA"):
        scatter2scatter(X, W, sei, ssi, 2)
    with pytest.raises(ValueError, match="X is on cpu, but Triton compiles for CUDA"):
        group(X, ssi, 2)
    with pytest.raises(ValueError, match="DY is on cpu, but Triton compiles for CUDA"):
        group_bwd_W(torch.randn(4, 4), torch.randn(4, 8), offs, 3)


@pytest.mark.skipif(not interpreting(), reason="interpreter-only check")
def test_interpreter_rejects_bf16():
    x, W, _, (sei, ssi, _) = _good()
    with pytest.raises(ValueError, match="interpreter is float32-only"):
        scatter2scatter(x.bfloat16(), W.bfloat16(), sei, ssi, 2)


def test_non_contiguous_inputs_are_handled():
    x, W, experts, (sei, ssi, offs) = _good()
    Wt = W.transpose(1, 2).contiguous().transpose(1, 2)                # same values, strided
    xt = x.t().contiguous().t()
    assert _rel(scatter2scatter(xt, Wt, sei, ssi, 2), reference.linear_loop(x, W, experts)) \
        <= RTOL


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_interpreted_even_after_triton_was_imported():
    """triton first with TRITON_INTERPRET unset: the kernels still run (builtins only)."""
    code = textwrap.dedent("""
        import os, triton, torch
        from minimoe import flatten_sort_count, group_bwd_W, reference, scatter2scatter
        x, W = torch.randn(5, 24), torch.randn(3, 24, 40)
        e = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [1, 2]])
        sei, ssi, offs = flatten_sort_count(e, 3)
        y = scatter2scatter(x, W, sei, ssi, 2)
        assert os.environ["TRITON_INTERPRET"] == "1"              # chosen at the first launch
        assert (y - reference.linear_loop(x, W, e)).abs().max() < 1e-4
        assert group_bwd_W(y[ssi], x[ssi // 2], offs, 3).shape == (3, 24, 40)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


# --- compiled, on a GPU -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[4], CASES[9], CASES[14]], ids=_case_id)
def test_gpu_float32_ieee(case):
    torch.backends.cuda.matmul.allow_tf32 = False
    x, W, experts, gates = [t.cuda() for t in _inputs(case)]
    out = parallel_linear(x, W, flatten_sort_count(experts, W.shape[0]), gates=gates)
    assert _rel(out, reference.linear_loop(x, W, experts, gates)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[4], CASES[9], CASES[14]], ids=_case_id)
def test_gpu_bf16_norm_relative(case):
    torch.backends.cuda.matmul.allow_tf32 = False
    x, W, experts, gates = [t.cuda() for t in _inputs(case)]
    routing = flatten_sort_count(experts, W.shape[0])
    leaves = [t.bfloat16().requires_grad_() for t in (x, W, gates)]
    out = parallel_linear(leaves[0], leaves[1], routing, gates=leaves[2])
    ref_leaves = [t.clone().requires_grad_() for t in (x, W, gates)]          # float32
    ref = reference.linear_loop(*ref_leaves[:2], experts, ref_leaves[2])
    dout = torch.randn_like(ref)
    out.backward(dout.bfloat16())
    ref.backward(dout)
    pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(leaves, ref_leaves, strict=True)]
    for got, want in pairs:
        assert float((got.float() - want).norm() / want.norm()) < 2e-2


ALIGNED = (300, 128, 256, 64, 4, "rand")     # sizes multiples of 16: the autotuned tiles


def _fused_lora_runs(case, dtype, r=16):
    """(parallel_linear with fused rank-r expert LoRA, the float32 loop) on the GPU: pairs of
    the output and every gradient (x, W, gates, A, B)."""
    x, W, experts, gates = [t.cuda() for t in _inputs(case)]
    E, K, N = W.shape
    A, B = torch.randn(r * E, K, device="cuda") / K, torch.randn(N, r * E, device="cuda") / r
    runs = []
    for fused in (True, False):
        lv = [(t.to(dtype) if fused else t).clone().requires_grad_() for t in (x, W, gates, A, B)]
        if fused:
            out = parallel_linear(lv[0], lv[1], flatten_sort_count(experts, E), gates=lv[2],
                                  lora=ExpertLoRA(lv[3], lv[4], 0.5))
        else:
            out = reference.linear_loop(lv[0], lv[1], experts, lv[2], lv[3], lv[4], 0.5)
        out.backward(torch.ones_like(out))
        runs.append([out] + [t.grad for t in lv])
    return zip(*runs, strict=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[4], CASES[9], CASES[14]], ids=_case_id)
def test_gpu_fused_lora_float32_ieee(case):
    """The fused LoRA kernels compiled: output and dx, dW, dA, dB vs the loop on the GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for got, want in _fused_lora_runs(case, torch.float32, r=3):
        assert _rel(got, want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision, tol", [
    (torch.float32, "highest", 1e-5),           # exact products: the checking mode
    (torch.float32, "high", 5e-3),              # TF32 allowed, as torch.matmul would use it
    (torch.bfloat16, "highest", 2e-2),
])
def test_gpu_aligned_sizes_autotuned(dtype, precision, tol):
    """Sizes that are multiples of 16 take the autotuned tiles (CONFIGS[...][16 | 32]), 64
    experts with few tokens each; fp32 exact unless TF32 is allowed."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        for got, want in _fused_lora_runs(ALIGNED, dtype):
            err = float((got.float() - want).norm() / want.norm())
            assert err <= tol, err
    finally:
        torch.set_float32_matmul_precision(before)
    from minimoe import ops
    tuned = ops._autotuned("scatter2scatter", 32 if dtype == torch.float32 else 16, True)
    assert tuned.best_config is not None


@pytest.mark.gpu
def test_gpu_unaligned_sizes_bf16():
    """K = 40, N = 24: the "unaligned" configurations, bf16 with fused LoRA, fwd and bwd."""
    for got, want in _fused_lora_runs(CASES[11], torch.bfloat16):
        assert float((got.float() - want).norm() / want.norm()) < 2e-2
