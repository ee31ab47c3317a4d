"""minimoe.hf: an HF experts module run through the sorted dispatch with expert LoRA equals
the HF module itself holding W + s·B_e·A_e per expert (naive reference), on both backends."""

from __future__ import annotations

import copy

import pytest
import torch

from minimoe.hf import HFExperts, is_hf_experts, moe_from_hf

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


def _block(E=5, k=2, C=12, F=20):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = tf.MixtralConfig(hidden_size=C, intermediate_size=F, num_local_experts=E,
                           num_experts_per_tok=k)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
    return block


def _with_delta(experts, wrapper: HFExperts):
    """The HF module holding W + s·B_e·A_e (B_e: columns e·r:(e+1)·r of ours)."""
    ref = copy.deepcopy(experts)
    with torch.no_grad():
        for name, held in wrapper.lora.items():
            E, r = held.n_experts, held.r
            A = held.lora_A.reshape(E, r, -1)
            B = held.lora_B.reshape(held.out_features, E, r).permute(1, 0, 2)
            getattr(ref, name).add_(held.scaling * B @ A)
    return ref


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("k, T, params", [(2, 7, ("gate_up_proj", "down_proj")),
                                          (1, 1, ("down_proj",)), (3, 5, ("gate_up_proj",))])
def test_equals_hf_module_with_the_update(backend, k, T, params):
    block = _block(k=k)
    wrapper = HFExperts(block.experts, r=2, alpha=3.0, params=params, backend=backend)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for held in wrapper.lora.values():
            held.lora_B.copy_(torch.randn(held.lora_B.shape, generator=g) * 0.3)
    x = torch.randn(T, 12, generator=g)
    _, weights, index = block.gate(x)          # with T = 1 most experts get no token
    want = _with_delta(block.experts, wrapper)(x, index, weights)
    got = wrapper(x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - block.experts(x, index, weights)).abs().max() > 1e-3


def test_only_the_lora_trains():
    block = _block()
    wrapper = HFExperts(block.experts, r=2, alpha=4.0)
    x = torch.randn(6, 12)
    _, weights, index = block.gate(x)
    wrapper(x, index, weights).sum().backward()
    assert block.experts.gate_up_proj.grad is None and block.experts.down_proj.grad is None
    assert wrapper.lora["gate_up_proj"].lora_B.grad.abs().sum() > 0


def test_refuses_what_it_cannot_run():
    block = _block()
    with pytest.raises(ValueError, match="params must be a non-empty subset"):
        HFExperts(block.experts, params=("up_proj",))
    with pytest.raises(ValueError, match="experts must be a transformers experts module"):
        HFExperts(block.gate)
    with pytest.raises(ValueError, match="block must be a transformers sparse-MoE block"):
        moe_from_hf(block.experts)
    assert is_hf_experts(block.experts) and not is_hf_experts(HFExperts(block.experts))
