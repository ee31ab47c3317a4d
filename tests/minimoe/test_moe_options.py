"""MoEMLP's options: `renormalize` (Switch, Mixtral incl. k=1, OLMoE / Qwen-MoE), the Qwen2-MoE
shared expert, and the backend held in one place. Checked against the routing formulas token
by token, and against transformers' own MoE blocks (tiny configs, random weights copied in;
nothing is downloaded)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import minimoe.experts
import minimoe.moe
from minimoe import MoEMLP, Routing, attach_expert_lora, reference
from minimoe.hf import moe_from_hf

pytestmark = pytest.mark.usefixtures("single_thread")

C, FF, E = 24, 40, 5


def _mlp(k, seed=0, **kw) -> MoEMLP:
    torch.manual_seed(seed)
    return MoEMLP(C, FF, E, k, **kw)


def _naive_routing(logits, k, renormalize):
    """Per token: softmax over the E experts, the k largest (largest first), optionally
    divided by their sum."""
    weights, experts = [], []
    for row in logits.tolist():
        z = [math.exp(v - max(row)) for v in row]
        p = [v / sum(z) for v in z]
        top = sorted(range(len(p)), key=lambda e: -p[e])[:k]
        w = [p[e] for e in top]
        weights.append([v / sum(w) for v in w] if renormalize else w)
        experts.append(top)
    return torch.tensor(weights), torch.tensor(experts)


def _naive_mlp(m: MoEMLP, x, renormalize):
    weights, experts = _naive_routing(x @ m.router.weight.T, m.top_k, renormalize)
    out = reference.moe_loop(x, weights, experts, m.w_gate, m.w_up, m.w_down)
    if m.shared_d_ff:
        for t in range(x.shape[0]):           # sigmoid(x·g) · SwiGLU_shared(x), token by token
            h = F.silu(x[t] @ m.shared_w_gate) * (x[t] @ m.shared_w_up)
            out[t] = out[t] + torch.sigmoid(x[t] @ m.shared_gate[:, 0]) * (h @ m.shared_w_down)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("k, renormalize, effective", [
    (1, None, False), (2, None, True),        # the default: today's behaviour
    (1, True, True), (2, True, True),         # Mixtral (k = 1 too)
    (1, False, False), (3, False, False),     # OLMoE, Qwen-MoE: norm_topk_prob=False
])
def test_renormalize_matches_the_routing_formula(k, renormalize, effective, backend):
    m = _mlp(k, renormalize=renormalize, backend=backend)
    x = torch.randn(9, C, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m(x), _naive_mlp(m, x, effective), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shared_expert_matches_the_formula_and_trains(backend):
    m = _mlp(2, shared_d_ff=56, renormalize=False, backend=backend)
    x = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(2))
    out = m(x)
    with torch.no_grad():
        want = _naive_mlp(m, x.reshape(-1, C), False).reshape(x.shape)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    for name in ("shared_w_gate", "shared_w_up", "shared_w_down", "shared_gate"):
        assert getattr(m, name).grad.abs().sum() > 0, name


def test_defaults_are_the_old_module():
    """No option set: the same parameters (a state dict from before loads strictly), and no
    shared expert."""
    m = _mlp(2)
    assert m.renormalize is None and m.shared_d_ff == 0
    assert sorted(n for n, _ in m.named_parameters()) == ["router.weight", "w_down", "w_gate",
                                                          "w_up"]


@pytest.mark.parametrize("kw, match", [(dict(renormalize=1), "renormalize"),
                                       (dict(shared_d_ff=-1), "shared_d_ff"),
                                       (dict(shared_d_ff=2.5), "shared_d_ff"),
                                       (dict(backend="cuda"), "backend")])
def test_bad_options_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        _mlp(2, **kw)


# --- transformers' blocks, random weights copied in -----------------------------------------

def _hf_block(kind: str, k: int):
    tf = pytest.importorskip("transformers")
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = tf.MixtralConfig(hidden_size=C, intermediate_size=FF, num_local_experts=E,
                               num_experts_per_tok=k)
    elif kind == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block
        cfg = tf.OlmoeConfig(hidden_size=C, intermediate_size=FF, num_experts=E,
                             num_experts_per_tok=k, norm_topk_prob=False)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeSparseMoeBlock as Block,
        )
        cfg = tf.Qwen2MoeConfig(hidden_size=C, moe_intermediate_size=FF, num_experts=E,
                                num_experts_per_tok=k, norm_topk_prob=False,
                                shared_expert_intermediate_size=56)
    cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    return block


def _ours_from_hf(block, k: int, renormalize: bool, shared_d_ff: int, backend: str) -> MoEMLP:
    """minimoe.hf.moe_from_hf, with the options it reads from the block checked."""
    m = moe_from_hf(block, backend=backend)
    assert (m.top_k, m.renormalize, m.shared_d_ff) == (k, renormalize, shared_d_ff)
    return m


@pytest.mark.parametrize("kind, k, renormalize, shared, backend", [
    ("mixtral", 2, True, 0, "torch"), ("mixtral", 1, True, 0, "torch"),
    ("mixtral", 1, True, 0, "triton"), ("olmoe", 2, False, 0, "torch"),
    ("qwen2_moe", 2, False, 56, "torch"), ("qwen2_moe", 3, False, 56, "triton"),
])
def test_matches_transformers_blocks(kind, k, renormalize, shared, backend):
    block = _hf_block(kind, k)
    m = _ours_from_hf(block, k, renormalize, shared, backend)
    x = torch.randn(2, 6, C, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)


def test_switch_default_differs_from_mixtral_at_k1():
    """The reason for the switch: with k = 1 the default keeps the softmax mass, Mixtral 1."""
    block = _hf_block("mixtral", 1)
    ours = _ours_from_hf(block, 1, True, 0, "torch")
    ours.renormalize = None                     # the Switch default
    x = torch.randn(1, 4, C, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert not torch.allclose(ours(x), block(x), rtol=1e-3, atol=1e-4)


# --- the backend lives in the MoEMLP, and the dispatch's one call convention -----------------

@pytest.mark.parametrize("nf4", [False, True])
def test_expert_modules_run_on_the_mlps_backend(monkeypatch, nf4):
    m = _mlp(2, backend="triton")
    attach_expert_lora(m, r=2, nf4=nf4)
    m.backend = "torch"                    # changed after attaching: the MLP's value wins
    seen = []
    target = minimoe.nf4_experts if nf4 else minimoe.experts
    name = "nf4_parallel_linear" if nf4 else "parallel_linear"
    real = getattr(target, name)

    def spy(*args, **kwargs):
        seen.append(kwargs["backend"])
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, spy)
    m(torch.randn(5, C))
    assert seen == ["torch"] * 3


def test_dispatch_calls_parallel_linear_with_one_keyword_convention(monkeypatch):
    calls = []
    real = minimoe.moe.parallel_linear

    def spy(x, w, routing, **kwargs):
        calls.append((type(routing), sorted(kwargs), kwargs["backend"]))
        return real(x, w, routing, **kwargs)

    monkeypatch.setattr(minimoe.moe, "parallel_linear", spy)
    _mlp(2, backend="triton")(torch.randn(4, C))
    keys = ["backend", "gates", "grouped_in", "grouped_out"]
    assert calls == [(Routing, keys, "triton")] * 3
