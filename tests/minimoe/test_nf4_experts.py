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
