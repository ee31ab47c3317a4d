"""Frozen NF4 experts: only the experts with tokens are dequantized, into a compact buffer.

`nf4_parallel_linear` must equal `parallel_linear` on the fully dequantized weight (output
and the x / gates / LoRA gradients), never read an expert without tokens, keep the NF4
storage out of autograd, and allocate a dequant buffer proportional to the active experts.
On CPU the Triton kernels run in the interpreter: tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from support import poison
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minimoe import ExpertLoRA, NF4Experts, flatten_sort_count, nf4_parallel_linear, parallel_linear
from minimoe.nf4_experts import active_experts, quantize_experts

pytestmark = pytest.mark.usefixtures("single_thread")

RTOL = 1e-5


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _case(T=7, K=16, N=24, E=5, k=2, pool=None, seed=0):
    """x [T, K], W [E, K, N], gates [T, k], experts [T, k] drawn from the first `pool`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen)
    W = torch.randn(E, K, N, generator=gen) / K ** 0.5
    gates = torch.rand(T, k, generator=gen)
    pool = pool or E
    experts = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(T)])
    return x, W, gates, experts


def test_quantize_experts_checks_blocks():
    q = quantize_experts(torch.randn(3, 16, 24))                    # 384 = 6 blocks / expert
    assert tuple(q.shape) == (3, 16, 24) and q.double_quant and q.blocksize == 64
    with pytest.raises(ValueError, match="multiple of the blocksize"):
        quantize_experts(torch.randn(3, 10, 10))


def test_active_experts():
    assert active_experts(torch.tensor([2, 2, 5, 5, 6])).tolist() == [0, 2, 4]
    assert active_experts(torch.tensor([0, 0, 3])).tolist() == [2]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("gated", [False, True], ids=["slots", "gates"])
def test_matches_parallel_linear_on_dequantized(backend, lora, gated):
    # Experts 3 and 4 of 5 get no tokens: the compact weight holds 3 experts.
    x, W, gates, experts = _case(pool=3)
    E, K, N = W.shape
    r = 2
    q = quantize_experts(W)
    Wd = q.dequantize()                                             # the full [E, K, N]
    gen = torch.Generator().manual_seed(2)
    A, B = torch.randn(r * E, K, generator=gen), torch.randn(N, r * E, generator=gen)
    routing = flatten_sort_count(experts, E)

    def leaves():
        return [t.clone().requires_grad_() for t in (x, gates, A, B)]

    ours, ref = leaves(), leaves()
    stats = {}
    out = nf4_parallel_linear(ours[0], q, routing, gates=ours[1] if gated else None,
                              lora=ExpertLoRA(ours[2], ours[3], 0.5) if lora else None,
                              backend=backend, stats=stats)
    want = parallel_linear(ref[0], Wd, routing, gates=ref[1] if gated else None,
                           lora=ExpertLoRA(ref[2], ref[3], 0.5) if lora else None,
                           backend=backend)
    assert stats["active"] == [0, 1, 2] and stats["dequant_bytes"] == 3 * K * N * 4
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    want.backward(dout)
    errs = {"out": _rel(out, want), "dx": _rel(ours[0].grad, ref[0].grad)}
    if gated:
        errs["dgates"] = _rel(ours[1].grad, ref[1].grad)
    if lora:
        errs["dA"] = _rel(ours[2].grad, ref[2].grad)
        errs["dB"] = _rel(ours[3].grad, ref[3].grad)
        # Experts without tokens: their LoRA rows / columns get exactly-zero gradients.
        assert (ours[2].grad.view(E, r, K)[3:] == 0).all()
        assert (ours[3].grad.view(N, E, r)[:, 3:] == 0).all()
    assert max(errs.values()) <= RTOL, errs


@pytest.mark.parametrize("double_quant", [False, True])
def test_experts_without_tokens_are_never_read(double_quant):
    # E=6, experts 1 and 4 only; every other expert's codes and scales are poisoned (NaN
    # scales / code 0xFF), which would show in the output or the gradients if read.
    x, W, gates, experts = _case(T=5, E=6, k=2)
    experts = torch.tensor([[1, 4], [4, 1], [1, 4], [4, 1], [1, 4]])
    q = quantize_experts(W, double_quant=double_quant)
    routing = flatten_sort_count(experts, 6)
    lora = ExpertLoRA(torch.randn(2 * 6, 16), torch.randn(24, 2 * 6))
    clean = nf4_parallel_linear(x, q, routing, gates=gates, lora=lora)
    poison(q, keep=[1, 4])
    xp = x.clone().requires_grad_()
    got = nf4_parallel_linear(xp, q, routing, gates=gates, lora=lora)
    assert torch.equal(got, clean)
    got.sum().backward()
    assert torch.isfinite(xp.grad).all()


def test_module_only_lora_is_trainable():
    x, W, gates, experts = _case()
    E, K, N = W.shape
    mod = NF4Experts.from_weight(W, r=2, alpha=4.0, backend="torch")
    with torch.no_grad():
        mod.lora_B.normal_()
    assert [n for n, _ in mod.named_parameters()] == ["lora_A", "lora_B"]
    assert all(not b.requires_grad for b in mod.buffers())
    xl, gl = x.clone().requires_grad_(), gates.clone().requires_grad_()
    out = mod(xl, flatten_sort_count(experts, E), gates=gl)

    # Walk the autograd graph: the only leaves it accumulates into are x, gates and LoRA.
    leaves, seen, stack = set(), set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            leaves.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions)
    assert leaves == {id(xl), id(gl), id(mod.lora_A), id(mod.lora_B)}
    out.sum().backward()
    assert mod.lora_A.grad is not None and mod.lora_B.grad is not None
    assert all(b.grad is None for b in mod.buffers())
    assert mod.last_stats["n_active"] == 5 and mod.last_stats["n_experts"] == 5
    # state_dict holds the NF4 storage (uint8 codes etc.), a dtype cast keeps float32 scales.
    assert mod.state_dict()["packed"].dtype == torch.uint8
    assert mod.to(torch.float64).weight_nf4.absmax_scales.dtype == torch.float32


class _AllocLedger(TorchDispatchMode):
    """Bytes of every distinct storage allocated for a tensor shaped [*, K, N]."""

    def __init__(self, K: int, N: int):
        super().__init__()
        self.K, self.N, self.storages = K, N, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() == 3 and tuple(t.shape[1:]) == (
                    self.K, self.N):
                s = t.untyped_storage()
                self.storages.setdefault(StorageWeakRef(s).cdata, s.nbytes())
        return out


def test_dequant_buffer_scales_with_active_experts():
    """The measurement for the issue: transient dequant bytes for 1, 2, 4, 8 of 8 experts."""
    E, K, N, T = 8, 32, 64, 16                     # 2048 elements = 32 blocks per expert
    x, W, _, _ = _case(T=T, K=K, N=N, E=E, k=1)
    q = quantize_experts(W)
    full = E * K * N * 4
    rows = []
    for n in (1, 2, 4, 8):
        experts = (torch.arange(T) % n).reshape(T, 1)          # tokens spread over n experts
        stats = {}
        ledger = _AllocLedger(K, N)
        with ledger:
            nf4_parallel_linear(x, q, flatten_sort_count(experts, E), backend="torch",
                                stats=stats)
        seen = sum(ledger.storages.values())       # every [*, K, N] buffer allocated
        assert stats["n_active"] == n
        assert stats["dequant_bytes"] == seen == n * K * N * 4
        rows.append((n, stats["dequant_bytes"], seen, stats["dequant_bytes"] / full))
    print(f"\nNF4 experts E={E}, K={K}, N={N}, float32: dequant buffer per call "
          f"(full dequant = {full} B)")
    print(f"{'active':>7} {'recorded B':>11} {'ledger B':>9} {'of full':>8}")
    for n, rec, seen, frac in rows:
        print(f"{n:>4}/{E} {rec:>11} {seen:>9} {frac:>8.3f}")
    print(f"NF4+DQ storage: {q.nbytes} B ({q.bits_per_param:.3f} bits/param)")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_moemlp_nf4_experts_with_lora(backend):
    """attach_expert_lora(nf4=True) == attach_expert_lora(nf4=False) on the dequantized
    weights with the same LoRA: output, x / router / LoRA gradients; the NF4 base gets none."""
    import copy

    from minimoe import MoEMLP, attach_expert_lora
    from miniquant.nf4 import dequantize_nf4

    torch.manual_seed(0)
    base = MoEMLP(32, 64, 4, 2, backend=backend)               # 32·64 = 32 blocks / expert
    quant, flt = copy.deepcopy(base), copy.deepcopy(base)
    assert attach_expert_lora(quant, r=2, alpha=4.0, nf4=True) == ["w_gate", "w_up", "w_down"]
    with torch.no_grad():
        for name in ("w_gate", "w_up", "w_down"):
            getattr(flt, name).copy_(dequantize_nf4(getattr(quant, name).weight_nf4))
    attach_expert_lora(flt, r=2, alpha=4.0, nf4=False)
    with torch.no_grad():
        for name in ("w_gate", "w_up", "w_down"):
            q, f = getattr(quant, name), getattr(flt, name)
            q.lora_B.normal_()
            f.lora_A.copy_(q.lora_A)
            f.lora_B.copy_(q.lora_B)
    x = torch.randn(3, 5, 32)
    outs, grads = [], []
    for m in (quant, flt):
        xl = x.clone().requires_grad_()
        out = m(xl)
        out.square().sum().backward()
        outs.append(out)
        grads.append([xl.grad] + [p.grad for n, p in m.named_parameters()
                                  if "lora" in n or "router" in n])
    assert _rel(outs[0], outs[1]) <= RTOL
    for g0, g1 in zip(*grads, strict=True):
        assert _rel(g0, g1) <= RTOL
    trainable = sorted(n for n, p in quant.named_parameters() if p.requires_grad)
    assert trainable == sorted(["router.weight"] + [f"{p}.lora_{ab}" for p in
                                                    ("w_gate", "w_up", "w_down")
                                                    for ab in "AB"])
    assert quant.w_down.last_stats["n_active"] <= 4


def test_attach_expert_lora_refuses_bad_input():
    from minimoe import MoEMLP, attach_expert_lora

    mlp = MoEMLP(24, 36, 4, 2)                                 # 24·36 = 864: 13.5 blocks of 64
    with pytest.raises(ValueError, match="multiple of the blocksize 64"):
        attach_expert_lora(mlp, nf4=True)
    assert isinstance(mlp.w_gate, torch.nn.Parameter)           # untouched
    with pytest.raises(ValueError, match="r must be"):
        attach_expert_lora(mlp, r=-1)
    attach_expert_lora(mlp, r=2)
    with pytest.raises(ValueError, match="not yet wrapped"):
        attach_expert_lora(mlp, r=2)


def test_nf4_config_reaches_the_expert_quantizers():
    """quantize_experts, NF4Experts.from_weight and attach_expert_lora take one NF4Config or
    its fields as keywords, to the same codes."""
    from minimoe import MoEMLP, attach_expert_lora
    from miniquant import NF4Config
    W = _case(K=32, N=64)[1]
    cfg = NF4Config(blocksize=32, double_quant=False)
    want = quantize_experts(W, blocksize=32, double_quant=False)
    for q in (quantize_experts(W, nf4_config=cfg),
              NF4Experts.from_weight(W, nf4_config=cfg).weight_nf4):
        assert torch.equal(q.packed, want.packed) and torch.equal(q.absmax, want.absmax)
    mlp = MoEMLP(n_embd=32, d_ff=64, n_experts=2, top_k=1)
    w_up = mlp.w_up.detach().clone()
    attach_expert_lora(mlp, r=2, nf4=True, nf4_config=cfg)
    assert torch.equal(mlp.w_up.weight_nf4.packed,
                       quantize_experts(w_up, nf4_config=cfg).packed)
    with pytest.raises(ValueError, match="pass nf4_config or double_quant, not both"):
        quantize_experts(W, double_quant=True, nf4_config=cfg)


def test_lora_scaling_is_alpha_over_r_or_sqrt_r():
    from minimoe import lora_scaling
    assert lora_scaling(16.0, 8) == 2.0 and lora_scaling(12, 9, use_rslora=True) == 4.0
    assert NF4Experts.from_weight(_case(K=32, N=64)[1], r=4, alpha=6.0).scaling == 1.5


# The torch backend without gates: the base through a Function that dequantizes again in its
# backward instead of rerunning the forward (nf4_experts._FrozenNF4Linear), the LoRA term
# checkpointed. (grouped_in, grouped_out) layouts, as in dispatch: gate / up read tokens and
# write sorted rows, down reads sorted rows.
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


def _ungated(grouped_in, r, dtype, seed=0):
    """x, q, routing, LoRA leaves, dout: E=6 with expert 1 never chosen and expert 0 on every
    token (uneven counts), K·N = 2 blocks per expert."""
    T, K, N, E, k = 9, 16, 8, 6, 2
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.tensor([0, 2 + int(torch.randint(E - 2, (1,), generator=gen))])
                           for _ in range(T)])                                  # [T, k]
    routing = flatten_sort_count(experts, E)
    q = quantize_experts(torch.randn(E, K, N, generator=gen))
    x = torch.randn(T * k if grouped_in else T, K, generator=gen, dtype=dtype)
    A = torch.randn(r * E, K, generator=gen, dtype=dtype)
    B = torch.randn(N, r * E, generator=gen, dtype=dtype)
    dout = torch.randn(T * k, N, generator=gen, dtype=dtype)
    return x, q, routing, (A, B), dout


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("r", [0, 1, 3])
@pytest.mark.parametrize("grouped_in, grouped_out", LAYOUTS, ids=["ss", "sg", "gs", "gg"])
def test_torch_without_gates_has_the_bits_of_autograd(grouped_in, grouped_out, r, dtype):
    """Output and the x, A, B gradients, bit for bit those of autograd through the same
    operations (what the checkpointed call computes): dequantize the active experts, slice
    their LoRA, parallel_linear on the compact routing."""
    from miniquant.triton_dequant import selective_dequantize_nf4_torch
    x, q, routing, (A, B), dout = _ungated(grouped_in, r, dtype)
    E, K, N = q.shape
    ours, ref = _leaves(x, A, B), _leaves(x, A, B)
    out = nf4_parallel_linear(ours[0], q, routing, grouped_in=grouped_in, backend="torch",
                              grouped_out=grouped_out,
                              lora=ExpertLoRA(ours[1], ours[2], 0.5) if r else None)
    active, compact = routing.compacted()
    ids = torch.tensor(active)
    lora_c = ExpertLoRA(ref[1].view(E, r, K)[ids].reshape(-1, K),
                        ref[2].view(N, E, r)[:, ids].reshape(N, -1), 0.5) if r else None
    want = parallel_linear(ref[0], selective_dequantize_nf4_torch(q, ids, dtype), compact,
                           grouped_in=grouped_in, grouped_out=grouped_out, lora=lora_c,
                           backend="torch")
    out.backward(dout)
    want.backward(dout)
    assert out.dtype == dtype and torch.equal(out, want)
    assert torch.equal(ours[0].grad, ref[0].grad)
    if r:
        assert torch.equal(ours[1].grad, ref[1].grad) and torch.equal(ours[2].grad, ref[2].grad)
        assert (ours[1].grad.view(E, r, K)[1] == 0).all()           # expert 1: no tokens
    with torch.no_grad():
        assert torch.equal(nf4_parallel_linear(x, q, routing, grouped_in=grouped_in,
                                               grouped_out=grouped_out, backend="torch",
                                               lora=ExpertLoRA(A, B, 0.5) if r else None),
                           out)


def test_torch_without_gates_and_x_without_grad():
    """Only the LoRA factors train (x is a frozen input): no gradient for x is computed."""
    x, q, routing, (A, B), dout = _ungated(False, 2, torch.float32)
    Al, Bl = _leaves(A, B)
    out = nf4_parallel_linear(x, q, routing, lora=ExpertLoRA(Al, Bl), backend="torch")
    out.backward(dout)
    assert x.grad is None and Al.grad.abs().sum() > 0 and Bl.grad.abs().sum() > 0


@pytest.mark.parametrize("gated", [False, True], ids=["slots", "gates"])
def test_torch_backward_multiplies_by_the_weight_once(gated):
    """Without gates the backward needs only dX = dY·Wcᵀ: one product by the weight (plus the
    rank-r LoRA), not the forward's again as a checkpoint would. With gates dgates needs the
    outputs, so the call stays checkpointed: two."""
    from torch.utils.flop_counter import FlopCounterMode
    T, K, N, E, k = 32, 64, 64, 4, 2
    x, W, gates, experts = _case(T=T, K=K, N=N, E=E, k=k)
    q = quantize_experts(W)
    xl, A, B = _leaves(x, torch.randn(E, K), torch.randn(N, E))              # r = 1
    out = nf4_parallel_linear(xl, q, flatten_sort_count(experts, E), backend="torch",
                              gates=gates if gated else None, lora=ExpertLoRA(A, B))
    counter = FlopCounterMode(display=False)
    with counter:
        out.backward(torch.ones_like(out))
    products = counter.get_total_flops() / (2 * T * k * K * N)       # in units of one x @ W
    assert (1.9 < products < 2.5) if gated else (0.9 < products < 1.5), products


@pytest.mark.parametrize("outer", [False, True], ids=["plain", "in-checkpoint"])
def test_torch_without_gates_keeps_only_its_input(outer):
    """Between forward and backward the call keeps its input x and no other float tensor: no
    dequantized weight (the Function keeps the means to dequantize again), no gathered copy of
    x or x·Aᵀ (the LoRA term is checkpointed). Inside a checkpointed block it keeps nothing
    at all: whatever it holds outside autograd's saved tensors would outlive the block."""
    import gc

    from torch.utils.checkpoint import checkpoint
    T, K, N, E, k = 8, 32, 24, 4, 2
    x, W, _, experts = _case(T=T, K=K, N=N, E=E, k=k)
    q, routing = quantize_experts(W), flatten_sort_count(experts, E)
    xl, A, B = _leaves(x, torch.randn(2 * E, K), torch.randn(N, 2 * E))

    def block(x):                   # x * 1: an input made inside the block, as a norm's output
        return nf4_parallel_linear(x * 1, q, routing, backend="torch", lora=ExpertLoRA(A, B))

    ledger = _FloatStorages()
    with ledger:
        out = checkpoint(block, xl, use_reentrant=False) if outer else block(xl)
    gc.collect()
    kept = sum(ledger.alive(besides=out))
    assert kept == (0 if outer else x.nbytes), kept
    out.sum().backward()
    assert xl.grad is not None and A.grad is not None


class _FloatStorages(TorchDispatchMode):
    """Weak references to every float storage an operator allocates (not views of its inputs,
    such as the LoRA factors reshaped)."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in inputs:
                    self.refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        return out

    def alive(self, besides: torch.Tensor) -> list[int]:
        """Bytes of each storage still alive, `besides`'s left out."""
        skip = StorageWeakRef(besides.untyped_storage()).cdata
        return [n for key, (ref, n) in self.refs.items() if key != skip and not ref.expired()]
