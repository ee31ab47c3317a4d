"""miniquant.intquant: absmax int8 and symmetric per-group quantization, against naive loops."""

from __future__ import annotations

import pytest
import torch

from miniquant import (
    dequantize_absmax_int8,
    dequantize_symmetric_per_group,
    quantize_absmax_int8,
    quantize_symmetric_per_group,
)

pytestmark = pytest.mark.usefixtures("single_thread")



def half_step_excess(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|w - ŵ| beyond half a quantization step, less float32's rounding of code × scale (a
    weight exactly on a rounding tie lands half a step plus one ulp away); <= 0 everywhere."""
    return (w.float() - deq).abs() - deq.abs() * torch.finfo(torch.float32).eps - scale / 2

def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def naive_per_group(w, bits, group_size):
    """One group at a time over the row-major flattening: (q list, scale list)."""
    qmax = 2 ** (bits - 1) - 1
    flat = w.reshape(-1).float()
    qs, scales = [], []
    for start in range(0, flat.numel(), group_size):
        group = flat[start:start + group_size]
        scale = group.abs().max() / qmax
        scales.append(scale)
        for x in group:
            qs.append(int(torch.round(x / scale).clamp(-qmax, qmax)) if scale > 0 else 0)
    return qs, torch.stack(scales)


# ---------------------------------------------------------------------------------------------
# absmax int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7,), (5, 13), (3, 4, 9)])
def test_absmax_int8_round_trip_within_half_a_step(shape, dtype):
    w = randn(*shape, seed=len(shape), dtype=dtype)
    q, scale = quantize_absmax_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert scale == w.float().abs().max() / 127
    assert q.abs().max() == 127 and q.min() >= -127
    err = half_step_excess(w, dequantize_absmax_int8(q, scale), scale)
    assert (err <= 0).all(), f"max error {err.max()} above scale/2 {scale / 2}"


def test_absmax_int8_per_row_matches_a_row_loop():
    w = randn(6, 11, seed=1)
    w[2] *= 50                      # one row with a much larger range
    q, scale = quantize_absmax_int8(w, dim=-1)
    assert scale.shape == (6, 1)
    for r in range(6):
        q_row, s_row = quantize_absmax_int8(w[r])
        assert torch.equal(q[r], q_row) and scale[r, 0] == s_row
    assert (half_step_excess(w, dequantize_absmax_int8(q, scale), scale) <= 0).all()


def test_absmax_int8_rounds_half_to_even():
    # absmax 127 makes the scale exactly 1, so w / scale is w itself.
    w = torch.tensor([2.5, 3.5, -2.5, 0.5, 127.0])
    q, scale = quantize_absmax_int8(w)
    assert scale == 1.0
    assert q.tolist() == [2, 4, -2, 0, 127]


def test_absmax_int8_all_zero_gives_zero():
    q, scale = quantize_absmax_int8(torch.zeros(4, 5))
    assert scale == 0 and not q.any()
    assert not dequantize_absmax_int8(q, scale).any()


# ---------------------------------------------------------------------------------------------
# symmetric per group


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("shape, group_size", [((1,), 64), ((65,), 64), ((5, 13), 8),
                                               ((3, 4, 9), 7), ((100,), 1), ((10, 10), 100)])
def test_per_group_matches_naive_loop_and_error_bound(bits, shape, group_size):
    w = randn(*shape, seed=bits)
    q, scales = quantize_symmetric_per_group(w, bits=bits, group_size=group_size)
    qmax = 2 ** (bits - 1) - 1
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scales.dtype == torch.float32 and scales.shape == (-(-w.numel() // group_size),)
    assert q.min() >= -qmax and q.max() <= qmax
    naive_q, naive_scales = naive_per_group(w, bits, group_size)
    assert q.reshape(-1).tolist() == naive_q
    assert torch.equal(scales, naive_scales)
    deq = dequantize_symmetric_per_group(q, scales, group_size=group_size)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    per_element = scales.repeat_interleave(group_size)[: w.numel()].reshape(w.shape)
    err = half_step_excess(w, deq, per_element)
    assert (err <= 0).all(), f"max error above scale/2 by {err.max()}"


def test_per_group_last_partial_group_uses_only_its_own_elements():
    w = torch.cat([torch.full((8,), 100.0), torch.tensor([0.5, -0.25])])
    q, scales = quantize_symmetric_per_group(w, bits=8, group_size=8)
    assert torch.equal(scales, torch.tensor([100.0, 0.5]) / 127)
    assert q[-2:].tolist() == [127, -64]   # -0.25 / (0.5/127) = -63.5 -> -64 (half to even)


def test_per_group_beats_per_tensor_on_an_outlier():
    w = randn(64, 64, seed=3)
    w[10, 20] = 1000.0
    q_t, s_t = quantize_absmax_int8(w)
    q_g, s_g = quantize_symmetric_per_group(w, bits=8, group_size=64)
    err_tensor = (w - dequantize_absmax_int8(q_t, s_t)).abs().mean()
    err_group = (w - dequantize_symmetric_per_group(q_g, s_g, 64)).abs().mean()
    # Per tensor, the outlier's scale (1000/127 ≈ 7.9) zeroes almost every N(0,1) weight
    # (mean error ≈ 0.8); per group only its own 64 elements suffer (mean ≈ 0.02).
    assert err_group * 20 < err_tensor, (err_group, err_tensor)


def test_fewer_bits_more_error():
    w = randn(4096, seed=4)
    errors = []
    for bits in range(2, 9):
        q, s = quantize_symmetric_per_group(w, bits=bits, group_size=64)
        errors.append((w - dequantize_symmetric_per_group(q, s, 64)).abs().mean().item())
    assert errors == sorted(errors, reverse=True), errors


# ---------------------------------------------------------------------------------------------
# bad input


BAD_WEIGHTS = [
    (torch.tensor([1.0, float("nan")]), "finite"),
    (torch.tensor([1.0, float("inf")]), "finite"),
    (torch.arange(4), "float16, bfloat16 or float32"),
    (torch.ones(4, dtype=torch.float64), "float16, bfloat16 or float32"),
    (torch.ones(0, 3), "empty"),
    ([1.0, 2.0], "torch.Tensor"),
]


@pytest.mark.parametrize("w, message", BAD_WEIGHTS)
@pytest.mark.parametrize("quantize", [quantize_absmax_int8, quantize_symmetric_per_group])
def test_bad_weights_raise(quantize, w, message):
    with pytest.raises(ValueError, match=f"w must .*{message}"):
        quantize(w)


@pytest.mark.parametrize("bits", [1, 9, 0, 2.5, True, "8"])
def test_bad_bits_raise(bits):
    with pytest.raises(ValueError, match="bits must be an integer in 2..8"):
        quantize_symmetric_per_group(torch.ones(4), bits=bits)


@pytest.mark.parametrize("group_size", [0, -1, 1.5, False])
def test_bad_group_size_raises(group_size):
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        quantize_symmetric_per_group(torch.ones(4), group_size=group_size)
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        dequantize_symmetric_per_group(torch.ones(4, dtype=torch.int8), torch.ones(1),
                                       group_size=group_size)


def test_dequantize_checks_its_inputs():
    q, scales = quantize_symmetric_per_group(randn(10), group_size=4)
    with pytest.raises(ValueError, match=r"scales must hold ceil\(10/4\) = 3 values, got 2"):
        dequantize_symmetric_per_group(q, scales[:2], group_size=4)
    with pytest.raises(ValueError, match="q must be an int8 tensor"):
        dequantize_symmetric_per_group(q.float(), scales, group_size=4)
    with pytest.raises(ValueError, match="q must be an int8 tensor"):
        dequantize_absmax_int8(q.int(), torch.tensor(1.0))
