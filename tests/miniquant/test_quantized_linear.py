"""QuantizedLinear and quantize_model: NF4 buffers, exact forward, guards, model surgery."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt import MiniGPT, MiniGPTConfig
from miniquant import NF4Config, QuantizedLinear, dequantize_nf4, quantize_model, quantize_nf4


def make_linear(n_in=96, n_out=40, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_equals_dequantized_matmul(double_quant, bias):
    lin = make_linear(bias=bias)
    q = QuantizedLinear.from_linear(lin, blocksize=64, double_quant=double_quant)
    x = torch.randn(5, 96)
    w = dequantize_nf4(quantize_nf4(lin.weight.detach(), 64, double_quant))
    torch.testing.assert_close(q(x), F.linear(x, w, lin.bias), rtol=0, atol=0)
    # ...and NF4 is close to the float layer: error of order absmax / 16 per weight
    rel = (q(x) - lin(x)).norm() / lin(x).norm()
    assert rel < 0.15, rel


def test_weights_are_buffers_not_parameters():
    q = QuantizedLinear.from_linear(make_linear())
    assert list(q.parameters()) == []
    names = dict(q.named_buffers())
    assert any(t.dtype == torch.uint8 for t in names.values())
    assert "bias" in names
    opt_params = [p for p in q.parameters() if p.requires_grad]
    assert opt_params == []


def test_state_dict_round_trip_is_exact():
    q = QuantizedLinear.from_linear(make_linear(), double_quant=True)
    q2 = QuantizedLinear.from_linear(make_linear(seed=1), double_quant=True)
    q2.load_state_dict(q.state_dict())
    x = torch.randn(3, 96)
    assert torch.equal(q(x), q2(x))


def test_dtype_cast_keeps_nf4_storage_exact_and_computes_in_input_dtype():
    q = QuantizedLinear.from_linear(make_linear(), double_quant=True)
    before = {k: v.clone() for k, v in q.state_dict().items() if k != "bias"}
    q = q.to(torch.bfloat16)
    for k, v in before.items():
        assert q.state_dict()[k].dtype == v.dtype and torch.equal(q.state_dict()[k], v), k
    y = q(torch.randn(2, 96, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_compute_dtype_is_honoured():
    q = QuantizedLinear.from_linear(make_linear(), compute_dtype=torch.bfloat16)
    assert q(torch.randn(2, 96)).dtype == torch.bfloat16


def test_bits_per_param_with_double_quant():
    lin = nn.Linear(1024, 1024, bias=False)
    q = QuantizedLinear.from_linear(lin, blocksize=64, double_quant=True)
    assert 4.12 < q.weight_nf4.bits_per_param < 4.14


def test_corrupt_scales_raise_a_clear_error():
    q = QuantizedLinear.from_linear(make_linear(), double_quant=False)
    for name, buf in q.named_buffers():
        if buf.is_floating_point() and name != "bias":
            buf.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        q(torch.randn(1, 96))


def test_from_linear_rejects_nan_weights_and_non_linear():
    lin = make_linear()
    with torch.no_grad():
        lin.weight[0, 0] = float("inf")
    with pytest.raises(ValueError):
        QuantizedLinear.from_linear(lin)
    with pytest.raises(ValueError, match="nn.Linear"):
        QuantizedLinear.from_linear(nn.Conv1d(3, 3, 1))


def test_quantize_model_replaces_matching_linears_only():
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(n_layer=2, n_head=2, n_embd=64, d_ff=64, block_size=16))
    ref = MiniGPT(model.config)
    ref.load_state_dict(model.state_dict())
    names = quantize_model(model, r"blocks\.\d+\.attn\.(q|k|v|o)_proj")
    assert names == [f"blocks.{i}.attn.{p}_proj" for i in range(2) for p in "qkvo"]
    for name, m in model.named_modules():
        assert isinstance(m, QuantizedLinear) == (name in names), name
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.blocks[0].mlp.up_proj,
                                                                nn.Linear)
    idx = torch.randint(0, model.config.vocab_size, (2, 10))
    a, b = model(idx), ref(idx)
    assert (a - b).norm() / b.norm() < 0.2
    trainable = {n for n, p in model.named_parameters()}
    assert not any(".attn." in n and "proj" in n for n in trainable)


def test_quantize_model_regex_is_a_full_match_and_must_match_something():
    model = MiniGPT(MiniGPTConfig(n_layer=1, n_head=2, n_embd=64, d_ff=64, block_size=16))
    with pytest.raises(ValueError, match="matches no nn.Linear"):
        quantize_model(model, r"q_proj")            # a suffix alone does not fully match
    with pytest.raises(ValueError, match="matches no nn.Linear"):
        quantize_model(model, r"blocks\.0\.attn\.nope")


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8, torch.bool])
def test_integer_input_is_refused(dtype):
    """Today an integer matmul: the weight truncated to ints, an output of (mostly) zeros."""
    q = QuantizedLinear.from_linear(make_linear())
    x = torch.ones(3, 96, dtype=dtype)
    with pytest.raises(TypeError, match=f"x must be a floating-point tensor .*got {dtype}"):
        q(x)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        QuantizedLinear.from_linear(make_linear(), compute_dtype=torch.float32)(x)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, "float16"])
def test_integer_compute_dtype_is_refused(dtype):
    match = "compute_dtype must be a floating-point torch.dtype"
    with pytest.raises(ValueError, match=match):
        QuantizedLinear.from_linear(make_linear(), compute_dtype=dtype)
    q = quantize_nf4(make_linear().weight.detach())
    with pytest.raises(ValueError, match=match):
        QuantizedLinear(q, compute_dtype=dtype)
    model = nn.Sequential(make_linear())
    with pytest.raises(ValueError, match=match):
        quantize_model(model, "0", compute_dtype=dtype)
    assert isinstance(model[0], nn.Linear)


@pytest.mark.parametrize("target", ["(", r"blocks\.(\d+", "*proj", "[a-"])
def test_quantize_model_invalid_regex_named(target):
    model = MiniGPT(MiniGPTConfig(n_layer=1, n_head=2, n_embd=64, d_ff=64, block_size=16))
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="target is not a valid regular expression"):
        quantize_model(model, target)
    assert {n: type(m) for n, m in model.named_modules()} == before


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_buffers())


def test_nf4_config_or_its_fields_as_keywords():
    """One NF4Config carries blocksize / double_quant / nested_rounding; the keywords build
    the same one; both at once are refused, a bad field is refused when the config is built."""
    assert NF4Config() == NF4Config(64, True, "nearest")
    with pytest.raises(AttributeError):
        NF4Config().blocksize = 32                                # frozen
    cfg = NF4Config(blocksize=128, double_quant=False, nested_rounding="bnb_cpu")
    by_keywords = QuantizedLinear.from_linear(make_linear(), blocksize=128, double_quant=False,
                                              nested_rounding="bnb_cpu")
    by_config = QuantizedLinear.from_linear(make_linear(), nf4_config=cfg)
    a, b = _buffers(by_keywords), _buffers(by_config)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = nn.Sequential(make_linear(), nn.ReLU())
    assert quantize_model(model, "0", nf4_config=cfg) == ["0"]
    assert model[0].weight_nf4.blocksize == 128 and not model[0].weight_nf4.double_quant
    with pytest.raises(ValueError, match="pass nf4_config or blocksize, not both"):
        QuantizedLinear.from_linear(make_linear(), blocksize=64, nf4_config=cfg)
    with pytest.raises(ValueError, match="nf4_config must be an NF4Config, got dict"):
        quantize_model(nn.Sequential(make_linear()), "0", nf4_config={"blocksize": 64})
    with pytest.raises(ValueError, match="blocksize must be one of"):
        NF4Config(blocksize=48)
