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
    MoEMLP,
    dispatch_triton,
    flatten_sort_count,
    group,
    group_bwd_W,
    parallel_linear,
    reference,
    scatter2scatter,
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


def _linear_errors(case, backend: str, gated: bool) -> dict[str, float]:
    """Max relative errors of parallel_linear vs reference.linear_loop: out and each grad."""
    x, W, experts, gates = _inputs(case)
    E = W.shape[0]
    leaves = [t.clone().requires_grad_() for t in (x, W, gates)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, W, gates)]
    idx = flatten_sort_count(experts, E)
    k = experts.shape[1]
    out = parallel_linear(leaves[0], leaves[1], k, *idx, gates=leaves[2] if gated else None,
                          backend=backend)
    ref = reference.linear_loop(ref_leaves[0], ref_leaves[1], experts,
                                ref_leaves[2] if gated else None)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    ref.backward(dout)
    errs = {"out": _rel(out, ref), "dx": _rel(leaves[0].grad, ref_leaves[0].grad),
            "dW": _rel(leaves[1].grad, ref_leaves[1].grad)}
    if gated:
        errs["dgates"] = _rel(leaves[2].grad, ref_leaves[2].grad)
    unused = torch.bincount(experts.reshape(-1), minlength=E) == 0
    errs["dW_unused_zero"] = bool((leaves[1].grad[unused] == 0).all())
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
        assert errs.pop("dW_unused_zero"), "an expert with no tokens must get dW exactly 0"
        assert max(errs.values()) <= RTOL, (gated, errs)


@pytest.mark.parametrize("case", [CASES[4], CASES[11]], ids=_case_id)
def test_parallel_linear_grouped_in_out(case):
    """grouped_in / grouped_out read and write sorted rows; both backends agree with the loop."""
    x, W, experts, _ = _inputs(case)
    E, k = W.shape[0], experts.shape[1]
    sei, ssi, offs = flatten_sort_count(experts, E)
    xg = x[ssi // k]                                                  # [M, K] sorted
    ref = reference.linear_loop(x, W, experts)[ssi]                   # [M, N] sorted
    for backend in BACKENDS:
        for gi, go in ((True, True), (True, False), (False, True)):
            xin = xg.clone().requires_grad_() if gi else x.clone().requires_grad_()
            out = parallel_linear(xin, W, k, sei, ssi, offs, grouped_in=gi, grouped_out=go,
                                  backend=backend)
            want = ref if go else torch.empty_like(ref).index_copy(0, ssi, ref)
            assert _rel(out, want) <= RTOL
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
            out.backward(dout)
            dy_sorted = dout if go else dout[ssi]                      # [M, N] sorted
            dxg = torch.einsum("mn,mkn->mk", dy_sorted, W[sei])       # [M, K] sorted
            want_dx = dxg if gi else torch.zeros_like(x).index_add(0, ssi // k, dxg)
            assert _rel(xin.grad, want_dx) <= RTOL


LORA_CASES = [CASES[1], CASES[4], CASES[12], CASES[14]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LORA_CASES, ids=_case_id)
def test_parallel_linear_expert_lora_matches_loop(case, backend):
    """A [r·E, K], B [N, r·E]: output and grads of x, W, A, B, gates vs the loop."""
    x, W, experts, gates = _inputs(case)
    E, K, N = W.shape
    r, scaling = 3, 0.5
    gen = torch.Generator().manual_seed(5)
    A, B = torch.randn(r * E, K, generator=gen), torch.randn(N, r * E, generator=gen)
    runs = []
    for fn in ("kernel", "loop"):
        lv = [t.clone().requires_grad_() for t in (x, W, gates, A, B)]
        if fn == "kernel":
            idx = flatten_sort_count(experts, E)
            out = parallel_linear(lv[0], lv[1], experts.shape[1], *idx, gates=lv[2],
                                  lora_A=lv[3], lora_B=lv[4], scaling=scaling, backend=backend)
        else:
            out = reference.linear_loop(lv[0], lv[1], experts, lv[2], lv[3], lv[4], scaling)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
        runs.append([out] + [t.grad for t in lv])
    for got, want in zip(*runs, strict=True):
        assert _rel(got, want) <= RTOL
    unused = (torch.bincount(experts.reshape(-1), minlength=E) == 0).repeat_interleave(r)
    assert bool((runs[0][4][unused] == 0).all()) and bool((runs[0][5][:, unused] == 0).all())


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
    k = experts.shape[1]
    idx = flatten_sort_count(experts, w_gate.shape[0])
    g = parallel_linear(x, w_gate, k, *idx, grouped_out=True, backend="torch")
    u = parallel_linear(x, w_up, k, *idx, grouped_out=True, backend="torch")
    h = torch.nn.functional.silu(g) * u
    return parallel_linear(h, w_down, k, *idx, gates=weights, grouped_in=True, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MLP_CASES, ids=_case_id)
def test_moe_dispatch_matches_loop(case, backend):
    errs = _mlp_errors(case, backend)
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
    rows = []
    for case in CASES:
        for backend in BACKENDS:
            e = _linear_errors(case, backend, gated=True)
            worst = max(v for n, v in e.items() if n != "dW_unused_zero")
            rows.append((_case_id(case), backend, worst, e))
    print(f"\n{'case':28} {'backend':7} {'out':>8} {'dx':>8} {'dW':>8} {'dgates':>8}")
    for cid, backend, worst, e in rows:
        print(f"{cid:28} {backend:7} " + " ".join(f"{e[n]:8.1e}" for n in
                                                  ("out", "dx", "dW", "dgates")))
        assert worst <= RTOL


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
        parallel_linear(x, W, 2, sei, ssi, offs, lora_A=torch.zeros(8, 24))
    with pytest.raises(ValueError, match="lora_A must be"):
        parallel_linear(x, W, 2, sei, ssi, offs, lora_A=torch.zeros(6, 24),
                        lora_B=torch.zeros(40, 6))
    with pytest.raises(ValueError, match="backend"):
        parallel_linear(x, W, 2, sei, ssi, offs, backend="cuda")


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
        assert os.environ["TRITON_INTERPRET"] == "1"
        x, W = torch.randn(5, 24), torch.randn(3, 24, 40)
        e = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [1, 2]])
        sei, ssi, offs = flatten_sort_count(e, 3)
        y = scatter2scatter(x, W, sei, ssi, 2)
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
    idx = flatten_sort_count(experts, W.shape[0])
    out = parallel_linear(x, W, experts.shape[1], *idx, gates=gates)
    assert _rel(out, reference.linear_loop(x, W, experts, gates)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[4], CASES[9], CASES[14]], ids=_case_id)
def test_gpu_bf16_norm_relative(case):
    torch.backends.cuda.matmul.allow_tf32 = False
    x, W, experts, gates = [t.cuda() for t in _inputs(case)]
    idx = flatten_sort_count(experts, W.shape[0])
    k = experts.shape[1]
    leaves = [t.bfloat16().requires_grad_() for t in (x, W, gates)]
    out = parallel_linear(leaves[0], leaves[1], k, *idx, gates=leaves[2])
    ref_leaves = [t.clone().requires_grad_() for t in (x, W, gates)]          # float32
    ref = reference.linear_loop(*ref_leaves[:2], experts, ref_leaves[2])
    dout = torch.randn_like(ref)
    out.backward(dout.bfloat16())
    ref.backward(dout)
    pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(leaves, ref_leaves, strict=True)]
    for got, want in pairs:
        assert float((got.float() - want).norm() / want.norm()) < 2e-2
