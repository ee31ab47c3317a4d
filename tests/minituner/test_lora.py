"""LoRALinear: decomposed backward (gradcheck, no [out, in] tensor), PEFT parity, merging."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from miniquant import QuantizedLinear
from minituner.lora import LoRALinear, lora_linear

OUT, IN, R = 24, 40, 4          # [out, in] = [24, 40] is a shape nothing else here has


def _layer(seed=0, bias=True, r=R, alpha=8.0, **kw) -> LoRALinear:
    """A LoRALinear over a random nn.Linear with a non-zero B (a fresh B is zero)."""
    torch.manual_seed(seed)
    layer = LoRALinear(nn.Linear(IN, OUT, bias=bias), r=r, alpha=alpha, **kw)
    with torch.no_grad():
        layer.lora_B.normal_(0.0, 0.5)
    return layer


def _naive(x, w, bias, A, B, s):
    """The textbook form y = x · (W + s·B·A)ᵀ + b, which builds B·A."""
    y = x @ (w + s * (B @ A)).t()
    return y if bias is None else y + bias


# --- the autograd Function ---------------------------------------------------------------

@pytest.mark.parametrize("with_mask", [False, True])
def test_function_gradcheck_float64(with_mask):
    torch.manual_seed(0)
    T, o, i, r = 5, 6, 7, 3
    x = torch.randn(T, i, dtype=torch.float64, requires_grad=True)
    A = torch.randn(r, i, dtype=torch.float64, requires_grad=True)
    B = torch.randn(o, r, dtype=torch.float64, requires_grad=True)
    w = torch.randn(o, i, dtype=torch.float64)
    mask = (torch.rand(T, i) > 0.3).double() / 0.7 if with_mask else None
    assert torch.autograd.gradcheck(lambda x, A, B: lora_linear(x, A, B, w, 0.7, mask),
                                    (x, A, B))
    # The callable form (a quantized base recomputes W in backward) is checked the same way.
    assert torch.autograd.gradcheck(lambda x, A, B: lora_linear(x, A, B, lambda: w, 2.5, mask),
                                    (x, A, B))


def test_gradients_match_naive_form_float32():
    layer = _layer(alpha=12.0)
    assert layer.scaling == 3.0
    x = torch.randn(2, 3, IN, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)

    A = layer.lora_A.detach().clone().requires_grad_()
    B = layer.lora_B.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y_ref = _naive(x2, layer.base.weight, layer.base.bias, A, B, layer.scaling)
    y_ref.backward(g)

    assert y.shape == (2, 3, OUT)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_A.grad, A.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_B.grad, B.grad, rtol=1e-5, atol=1e-5)
    assert layer.base.weight.grad is None and layer.base.bias.grad is None


# --- no [out, in] tensor on the LoRA path -------------------------------------------------

class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor each aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _record(fn) -> list[tuple[str, tuple[int, ...]]]:
    with _ShapeRecorder() as rec:
        fn()
    return rec.shapes


def test_decomposed_backward_never_builds_out_by_in():
    layer = _layer()
    x = torch.randn(2, 3, IN, requires_grad=True)       # T = 6: no clash with 24, 40 or 4

    def ours():
        layer(x).square().sum().backward()

    shapes = _record(ours)
    assert not [op for op, shape in shapes if shape == (OUT, IN)], shapes
    # The recorder does see the backward: dA [r, in] and dB [out, r] are produced there.
    assert (R, IN) in [s for _, s in shapes] and (OUT, R) in [s for _, s in shapes]
    assert layer.lora_A.grad is not None and x.grad is not None

    A = layer.lora_A.detach().clone().requires_grad_()
    B = layer.lora_B.detach().clone().requires_grad_()

    def naive():
        _naive(x, layer.base.weight, layer.base.bias, A, B, layer.scaling).square().sum().backward()

    # The check can fail: the naive form builds B·A (and its gradient) at [out, in].
    assert [op for op, shape in _record(naive) if shape == (OUT, IN)]


# --- parity with Hugging Face PEFT ---------------------------------------------------------

class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, OUT)
        self.other = nn.Linear(OUT, 3)

    def forward(self, x):
        return self.proj(x)


def _peft_pair(r, alpha, use_rslora, dropout=0.0):
    """Our LoRALinear and a PEFT lora.Linear over copies of one base, with identical A, B."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    tiny = _Tiny()
    ours = LoRALinear(nn.Linear(IN, OUT), r=r, alpha=alpha, dropout=dropout,
                      use_rslora=use_rslora)
    ours.base.load_state_dict(tiny.proj.state_dict())
    with torch.no_grad():
        ours.lora_B.normal_(0.0, 0.5)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], lora_dropout=dropout,
                          use_rslora=use_rslora)
    model = peft.get_peft_model(tiny, cfg)
    theirs = model.base_model.model.proj
    with torch.no_grad():
        theirs.lora_A["default"].weight.copy_(ours.lora_A)
        theirs.lora_B["default"].weight.copy_(ours.lora_B)
    return ours, theirs, model


@pytest.mark.parametrize("use_rslora", [False, True])
def test_parity_with_peft(use_rslora):
    ours, theirs, model = _peft_pair(r=R, alpha=6.0, use_rslora=use_rslora)
    expected = 6.0 / math.sqrt(R) if use_rslora else 6.0 / R
    assert ours.scaling == pytest.approx(expected)
    assert theirs.scaling["default"] == pytest.approx(ours.scaling)

    x = torch.randn(2, 5, IN)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ya, yb, **tol)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    torch.testing.assert_close(ours.lora_A.grad, theirs.lora_A["default"].weight.grad, **tol)
    torch.testing.assert_close(ours.lora_B.grad, theirs.lora_B["default"].weight.grad, **tol)
    with torch.no_grad():
        torch.testing.assert_close(ours.delta_weight(), theirs.get_delta_weight("default"), **tol)

    ours.merge()
    model.merge_adapter()
    torch.testing.assert_close(ours.base.weight, theirs.base_layer.weight, **tol)
    torch.testing.assert_close(ours(x), theirs(x), **tol)


def test_dropout_matches_peft_and_touches_only_the_lora_path():
    ours, theirs, _ = _peft_pair(r=R, alpha=8.0, use_rslora=False, dropout=0.5)
    x = torch.randn(6, IN)

    ours.eval()
    theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    no_drop = ours(x)

    ours.train()
    theirs.train()
    torch.manual_seed(7)
    y_train = ours(x)
    torch.manual_seed(7)
    torch.testing.assert_close(y_train, theirs(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y_train, no_drop)
    # With B = 0 the LoRA path is silent: training-mode dropout must leave the output exact.
    with torch.no_grad():
        ours.lora_B.zero_()
    torch.testing.assert_close(ours(x), ours.base(x), rtol=0, atol=0)


def test_dropout_gradient_matches_masked_naive_form():
    layer = _layer(dropout=0.3)
    x = torch.randn(6, IN, requires_grad=True)
    torch.manual_seed(3)
    y = layer(x)
    y.sum().backward()
    torch.manual_seed(3)
    mask = nn.functional.dropout(torch.ones(6, IN), 0.3, training=True)
    x2 = x.detach().clone().requires_grad_()
    A = layer.lora_A.detach().clone().requires_grad_()
    B = layer.lora_B.detach().clone().requires_grad_()
    y2 = (x2 @ layer.base.weight.t() + layer.base.bias
          + layer.scaling * ((x2 * mask) @ A.t()) @ B.t())
    y2.sum().backward()
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_A.grad, A.grad, rtol=1e-5, atol=1e-5)


# --- merging -------------------------------------------------------------------------------

def test_merge_unmerge_round_trip_float_base():
    layer = _layer()
    w0 = layer.base.weight.detach().clone()
    x = torch.randn(3, IN)
    y0 = layer(x)
    layer.merge()
    assert layer.merged
    torch.testing.assert_close(layer.base.weight, w0 + layer.delta_weight(), rtol=0, atol=1e-6)
    torch.testing.assert_close(layer(x), y0, rtol=1e-5, atol=1e-5)
    layer.merge()                       # idempotent: merging twice must not add twice
    torch.testing.assert_close(layer.base.weight, w0 + layer.delta_weight(), rtol=0, atol=1e-6)
    layer.unmerge()
    assert not layer.merged
    torch.testing.assert_close(layer.base.weight, w0, rtol=0, atol=1e-6)
    torch.testing.assert_close(layer(x), y0, rtol=1e-5, atol=1e-5)


def test_fresh_adapter_is_identity_and_init_is_peft_like():
    torch.manual_seed(0)
    base = nn.Linear(IN, OUT)
    layer = LoRALinear(base, r=R, alpha=16.0)
    assert layer.lora_A.shape == (R, IN) and layer.lora_B.shape == (OUT, R)
    assert torch.all(layer.lora_B == 0) and layer.scaling == 4.0
    bound = 1 / math.sqrt(IN)           # kaiming_uniform(a=√5) on [r, in]: U(-1/√in, 1/√in)
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.std() > bound / 3
    x = torch.randn(4, IN)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)
    assert not base.weight.requires_grad and not base.bias.requires_grad
    trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A", "lora_B"}


def test_quantized_base():
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(nn.Linear(IN, OUT), blocksize=64, double_quant=True)
    layer = LoRALinear(q, r=R, alpha=8.0)
    with torch.no_grad():
        layer.lora_B.normal_(0.0, 0.5)
    assert layer.lora_A.dtype == torch.float32 and layer.lora_B.dtype == torch.float32
    assert {n for n, _ in layer.named_parameters()} == {"lora_A", "lora_B"}

    x = torch.randn(2, 3, IN, requires_grad=True)
    y = layer(x)
    y.square().sum().backward()
    assert layer.lora_A.grad is not None and layer.lora_B.grad is not None

    w = q.dequantized_weight(torch.float32)
    A = layer.lora_A.detach().clone().requires_grad_()
    B = layer.lora_B.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    _naive(x2, w, q.bias, A, B, layer.scaling).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.lora_A.grad, A.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.lora_B.grad, B.grad, rtol=1e-5, atol=1e-4)

    with pytest.raises(ValueError, match="re-quantized"):
        layer.merge()
    assert not layer.merged
    merged = layer.merge_and_dequantize()
    assert isinstance(merged, nn.Linear) and merged.weight.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(merged(x), layer(x), rtol=1e-5, atol=1e-5)


def test_quantized_base_bf16_compute_keeps_float32_lora_grads():
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(nn.Linear(IN, OUT), compute_dtype=torch.bfloat16)
    layer = LoRALinear(q, r=R, alpha=8.0)
    y = layer(torch.randn(5, IN))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.lora_A.grad.dtype == torch.float32 and layer.lora_B.grad.dtype == torch.float32


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(r=0), "r must"), (dict(r=-2), "r must"), (dict(r=2.5), "r must"),
    (dict(alpha=0.0), "alpha must"), (dict(alpha=-1.0), "alpha must"),
    (dict(alpha=float("inf")), "alpha must be > 0 and finite, got inf"),
    (dict(alpha=float("nan")), "alpha must be > 0 and finite, got nan"),
    (dict(alpha="16"), "alpha must be > 0 and finite, got '16'"),
    (dict(dropout=1.0), "dropout must"), (dict(dropout=-0.1), "dropout must"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRALinear(nn.Linear(IN, OUT), **kwargs)


def test_bad_base():
    with pytest.raises(ValueError, match="nn.Linear or a miniquant QuantizedLinear"):
        LoRALinear(nn.Conv1d(3, 3, 1))
    with pytest.raises(ValueError, match="already wrapped"):
        LoRALinear(LoRALinear(nn.Linear(IN, OUT)))


def test_wrapping_keeps_the_training_flag_of_the_base():
    base = nn.Linear(6, 4).eval()
    layer = LoRALinear(base, r=2, dropout=0.5)
    assert not layer.training and not layer.dropout.training
    nn.init.ones_(layer.lora_B)                          # so that dropout would show
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), layer(x))       # no dropout drawn in eval mode
    assert LoRALinear(nn.Linear(6, 4), r=2).training
