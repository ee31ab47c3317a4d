"""QLoRA composition on MiniGPT: quantize first, then wrap; only float LoRA factors train."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from minigpt import MiniGPT, MiniGPTConfig
from miniquant import QuantizedLinear, quantize_model
from minituner import trainable_summary, wrap_lora
from minituner.lora import LoRALinear
from minituner.qlora import BLOCK_LINEARS, parse_quant_scheme, wrap_minigpt_qlora

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(n_experts=0, seed=0) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(MiniGPTConfig(n_layer=2, n_head=2, n_embd=64, d_ff=96, block_size=16,
                                 n_experts=n_experts, top_k=2 if n_experts else 1))


def tokens(b=3, t=11, seed=1) -> torch.Tensor:
    return torch.randint(0, 45, (b, t), generator=torch.Generator().manual_seed(seed))


def test_quantizes_block_projections_and_wraps_them():
    model = tiny()
    names = wrap_minigpt_qlora(model)
    assert len(names) == 2 * len(PROJECTIONS)
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, LoRALinear) and isinstance(layer.base, QuantizedLinear)
        assert layer.base.weight_nf4.blocksize == 64 and layer.base.weight_nf4.double_quant
        assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32
        assert (layer.r, layer.scaling) == (8, 2.0)
    # embeddings, norms and the head stay float and frozen
    assert type(model.lm_head) is nn.Linear and not model.lm_head.weight.requires_grad
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}" for n in names for ab in "AB"}
    lora_numel = sum(model.get_submodule(n).lora_A.numel() + model.get_submodule(n).lora_B.numel()
                     for n in names)
    assert trainable_summary(model)[0] == lora_numel


def test_fresh_adapter_equals_the_quantized_base_and_is_close_to_float():
    model = tiny()
    x = tokens()
    with torch.no_grad():
        float_logits = model(x)
    quant_only = tiny()
    quantize_model(quant_only, BLOCK_LINEARS)
    wrap_minigpt_qlora(model)
    with torch.no_grad():
        logits = model(x)
        assert torch.equal(logits, quant_only(x))     # B = 0: the adapter adds exactly nothing
    diff = (logits - float_logits).abs().mean().item()
    assert 0 < diff < 0.05, diff


def test_gradients_equal_lora_on_the_dequantized_float_base():
    """NF4 base + adapter trains exactly like a float base holding the dequantized weights."""
    q_model, f_model = tiny(), tiny()
    names = wrap_minigpt_qlora(q_model, r=4, alpha=8.0)
    g = torch.Generator().manual_seed(3)
    for name in names:
        q_layer = q_model.get_submodule(name)
        torch.nn.init.normal_(q_layer.lora_B, std=0.1, generator=g)
        f_model.get_submodule(name).weight.data.copy_(q_layer.base.dequantized_weight())
    wrap_lora(f_model, BLOCK_LINEARS, r=4, alpha=8.0)
    for name in names:
        for factor in ("lora_A", "lora_B"):
            getattr(f_model.get_submodule(name), factor).data.copy_(
                getattr(q_model.get_submodule(name), factor).data)
    x = tokens()
    losses = [m(x).square().mean() for m in (q_model, f_model)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for name in names:
        for factor in ("lora_A", "lora_B"):
            gq = getattr(q_model.get_submodule(name), factor).grad
            gf = getattr(f_model.get_submodule(name), factor).grad
            assert gq.abs().sum() > 0
            torch.testing.assert_close(gq, gf, rtol=1e-5, atol=1e-6)


def test_wrong_order_raises_and_explains():
    model = tiny()
    wrap_lora(model, ["q_proj"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="quantizes the base first and wraps it second"):
        wrap_minigpt_qlora(model)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kw, match", [
    ({"quant_scheme": "int4"}, "quant_scheme must look like 'nf4_per_group_<blocksize>'"),
    ({"quant_scheme": "nf4_per_group_48"}, "blocksize must be one of"),
    ({"r": 0}, "r must be a positive int"),
    ({"alpha": -1.0}, "alpha must be > 0"),
    ({"alpha": float("inf")}, "alpha must be > 0 and finite, got inf"),
    ({"target": r"blocks\.(\d+"}, "target is not a valid regular expression"),
    ({"target": r"blocks\.\d+\.nothing"}, "matches no nn.Linear"),
])
def test_bad_arguments_leave_the_model_untouched(kw, match):
    model = tiny()
    with pytest.raises(ValueError, match=match):
        wrap_minigpt_qlora(model, **kw)
    assert not any(isinstance(m, QuantizedLinear | LoRALinear) for m in model.modules())


def test_scheme_sets_the_blocksize_and_double_quant_is_optional():
    assert parse_quant_scheme("nf4_per_group_128") == 128
    model = tiny()
    wrap_minigpt_qlora(model, quant_scheme="nf4_per_group_32", double_quant=False)
    base = model.blocks[1].mlp.down_proj.base.weight_nf4
    assert base.blocksize == 32 and not base.double_quant


def test_nf4_config_is_the_quant_scheme_keywords():
    from miniquant import NF4Config
    by_keywords = tiny(n_experts=2)          # seeds, so both adapters start alike
    wrap_minigpt_qlora(by_keywords, quant_scheme="nf4_per_group_32", double_quant=False)
    by_config = tiny(n_experts=2)
    wrap_minigpt_qlora(by_config, nf4_config=NF4Config(blocksize=32, double_quant=False))
    a, b = by_keywords.state_dict(), by_config.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="pass nf4_config or blocksize, not both"):
        wrap_minigpt_qlora(tiny(), quant_scheme="nf4_per_group_64", nf4_config=NF4Config())


def test_moe_model_gets_nf4_experts_with_expert_lora():
    """Attention: NF4 + LoRA; every MoEMLP: NF4Experts with per-expert LoRA; router float and
    frozen (trainable on request); a fresh adapter equals the NF4 base exactly."""
    from minimoe import ExpertLinear, NF4Experts
    model = tiny(n_experts=4)
    names = wrap_minigpt_qlora(model, r=4)
    assert len(names) == 2 * (4 + 3)
    assert [n for n in names if "mlp" in n] == [f"blocks.{i}.mlp.{p}" for i in range(2)
                                                for p in ("w_gate", "w_up", "w_down")]
    mlp = model.blocks[0].mlp
    assert isinstance(mlp.w_up, NF4Experts) and mlp.w_up.lora_A.shape == (4 * 4, 64)
    assert not mlp.router.weight.requires_grad
    trainable = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A", "lora_B"}
    x = tokens()
    model(x).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n
               and "attn" in n)

    flt = tiny(n_experts=4)
    wrap_minigpt_qlora(flt, r=4, quantize=False, train_router=True)
    assert isinstance(flt.blocks[1].mlp.w_down, ExpertLinear)
    assert flt.blocks[1].mlp.router.weight.requires_grad


def test_moe_bad_expert_shapes_leave_the_model_untouched():
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(n_layer=1, n_head=2, n_embd=24, d_ff=36, block_size=8,
                                  n_experts=4, top_k=2))       # 24·36 = 864: not whole blocks
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.w_gate.*multiple of the NF4 "
                                         r"blocksize 64"):
        wrap_minigpt_qlora(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                 for k in before)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


def test_qlora_step_lowers_loss_without_nan():
    model = tiny()
    wrap_minigpt_qlora(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = tokens(b=8, t=12)
    losses = []
    for _ in range(5):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
