"""miniquant.nf4 and miniquant.dynamic on their own (no bitsandbytes): the codebook facts,
nibble packing, quantization against a per-block loop, double quantization, storage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from miniquant import (
    DYNAMIC_CODE,
    NF4_CODE,
    NF4Weight,
    dequantize_nf4,
    nf4,
    nf4_bytes,
    nf4_codebook,
    quantize_nf4,
)
from miniquant.dynamic import code_cells, nearest_code, nearest_code_in_cells, scale_blocks
from miniquant.nf4 import BLOCKSIZES, NF4_DTYPES, pack_nibbles, unpack_nibbles

pytestmark = pytest.mark.usefixtures("single_thread")

# docs/ARCHITECTURE.md, NF4, to 8 decimals.
NF4_VALUES = [-1.0, -0.69619280, -0.52507305, -0.39491749, -0.28444138, -0.18477343,
              -0.09105004, 0.0, 0.07958030, 0.16093020, 0.24611230, 0.33791524, 0.44070983,
              0.56261700, 0.72295684, 1.0]


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def same_bits(a, b):
    """Equal dtype, shape and bit patterns (torch.equal takes -0.0 for 0.0)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


def naive_nf4(w, blocksize):
    """Per block, per element: (indices list, absmax list), nearest code, ties to the lower."""
    flat = w.reshape(-1).float()
    code = NF4_CODE.tolist()
    indices, absmaxes = [], []
    for start in range(0, flat.numel(), blocksize):
        block = flat[start:start + blocksize]
        absmax = block.abs().max()
        absmaxes.append(absmax.item())
        full = block.numel() == blocksize
        scaled = block * (1.0 / absmax) if full else block / absmax
        for x in (scaled if absmax > 0 else torch.zeros_like(block)).tolist():
            dist = [abs(x - c) for c in code]
            indices.append(dist.index(min(dist)))     # index() finds the lower one on a tie
    return indices, absmaxes


# ---------------------------------------------------------------------------------------------
# the codebook and the dynamic map


def test_codebook_facts():
    code = nf4_codebook()
    assert code.dtype == torch.float32 and code.shape == (16,)
    assert torch.equal(code, NF4_CODE)
    assert code[7] == 0 and code[0] == -1 and code[15] == 1
    assert (code[1:] > code[:-1]).all()
    torch.testing.assert_close(code, torch.tensor(NF4_VALUES), rtol=0, atol=1e-8)


def test_codebook_rounding_order_matters():
    """All in float64, one rounding: 10 of 16 values a few ulps off (docs/ARCHITECTURE.md, NF4)."""
    pos = torch.linspace(0.9677083, 0.5, 9, dtype=torch.float64)[:-1]
    neg = torch.linspace(0.9677083, 0.5, 8, dtype=torch.float64)[:-1]
    q = torch.cat([torch.special.ndtri(pos), torch.zeros(1, dtype=torch.float64),
                   -torch.special.ndtri(neg)]).sort().values
    all_double = (q / q.max()).float()
    assert (all_double != NF4_CODE).sum() == 10
    assert (all_double - NF4_CODE).abs().max() < 2e-7


def test_dynamic_map_facts():
    assert DYNAMIC_CODE.dtype == torch.float32 and DYNAMIC_CODE.shape == (256,)
    assert (DYNAMIC_CODE[1:] > DYNAMIC_CODE[:-1]).all()
    assert DYNAMIC_CODE[-1] == 1.0 and (DYNAMIC_CODE == 0).sum() == 1
    # The linear grid of the top decade has 64 midpoints in [0.1, 1]: the smallest value
    # is -(the last midpoint), not -1.
    assert DYNAMIC_CODE[0] == -DYNAMIC_CODE[-2]
    assert DYNAMIC_CODE[-2] == (torch.tensor(1 - 0.9 / 64) + 1) / 2
    positive = DYNAMIC_CODE[DYNAMIC_CODE > 0]
    assert positive.min() < 1e-6 and len(positive) == 128


# ---------------------------------------------------------------------------------------------
# packing


def test_pack_puts_first_element_in_high_nibble_and_pads_with_seven():
    idx = torch.tensor([1, 2, 15, 0, 9], dtype=torch.uint8)
    packed = pack_nibbles(idx)
    assert packed.tolist() == [0x12, 0xF0, 0x97]
    assert torch.equal(unpack_nibbles(packed, 5), idx)


@pytest.mark.parametrize("n", [1, 2, 3, 64, 1001])
def test_pack_unpack_round_trip(n):
    idx = torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(n)).to(torch.uint8)
    packed = pack_nibbles(idx)
    assert packed.shape == ((n + 1) // 2,) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed, n), idx)


# ---------------------------------------------------------------------------------------------
# quantize / dequantize


@pytest.mark.parametrize("shape, blocksize", [((1,), 64), ((3,), 32), ((65,), 64),
                                              ((5, 37), 32), ((3, 4, 50), 64),
                                              ((2, 700), 256)])
def test_quantize_matches_naive_block_loop(shape, blocksize):
    w = randn(*shape, seed=sum(shape))
    q = quantize_nf4(w, blocksize=blocksize)
    indices, absmaxes = naive_nf4(w, blocksize)
    assert q.codes().tolist() == indices
    assert q.absmax.tolist() == absmaxes
    assert q.shape == w.shape and q.dtype == w.dtype and q.blocksize == blocksize
    assert not q.double_quant and q.n_blocks == len(absmaxes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_is_code_times_absmax_then_cast(dtype):
    w = randn(7, 45, seed=2, dtype=dtype)
    q = quantize_nf4(w, blocksize=32)
    ref = NF4_CODE[q.codes().long()] * q.absmax.repeat_interleave(32)[: w.numel()]
    out = dequantize_nf4(q)
    assert out.dtype == dtype and out.shape == w.shape
    assert torch.equal(out, ref.reshape(w.shape).to(dtype))
    assert torch.equal(q.dequantize(torch.float32), ref.reshape(w.shape))
    # Each value is within half the largest code gap (-1 to -0.6961928) of its block's absmax.
    half_gap = (NF4_CODE[1:] - NF4_CODE[:-1]).max() / 2
    bound = q.absmax.repeat_interleave(32)[: w.numel()] * half_gap
    assert ((w.float().reshape(-1) - ref).abs() <= bound * (1 + 1e-6)).all()


def test_values_on_midpoints_go_to_the_lower_code():
    mids = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
    w = torch.cat([torch.ones(1), mids, torch.zeros(64 - 16)])     # absmax 1: scaling exact
    q = quantize_nf4(w, blocksize=64)
    assert q.codes()[1:16].tolist() == list(range(15))


def test_all_zero_blocks_dequantize_to_zero():
    w = randn(200, seed=5)
    w[64:128] = 0       # a full zero block
    w[192:] = 0         # a zero trailing partial block
    q = quantize_nf4(w, blocksize=64)
    assert q.absmax[1] == 0 and q.absmax[3] == 1e-38   # bitsandbytes' floor, partial block only
    assert (q.codes()[64:128] == 7).all() and (q.codes()[192:] == 7).all()
    out = q.dequantize()
    assert not out[64:128].any() and not out[192:].any()
    assert torch.equal(quantize_nf4(torch.zeros(3, 5)).dequantize(), torch.zeros(3, 5))


def test_to_moves_every_tensor():
    q = quantize_nf4(randn(300, seed=6), double_quant=True).to("cpu")
    assert torch.equal(q.dequantize(), quantize_nf4(randn(300, seed=6), double_quant=True)
                       .dequantize())


# ---------------------------------------------------------------------------------------------
# the nearest code by cell lookup, and the spans a CPU works in


def test_cell_lookup_is_nearest_code():
    """Ties (the midpoints), their float32 neighbours, the codes, signed zeros, denormals, the
    first and last value of every finite cell, and random bit patterns: the same index as the
    binary search, as uint8."""
    mids = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
    starts = torch.arange(4096, dtype=torch.int64) << 20
    noise = torch.randint(0, 2**32, (100_000,), generator=torch.Generator().manual_seed(0))
    bits = torch.cat([starts, starts + 2**20 - 1, noise])
    edges = torch.where(bits >= 2**31, bits - 2**32, bits).int().view(torch.float32)
    x = torch.cat([mids, -mids, mids.nextafter(torch.tensor(2.0)),
                   mids.nextafter(torch.tensor(-2.0)), NF4_CODE,
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38]), edges[edges.isfinite()]])
    got = nearest_code_in_cells(x, code_cells(NF4_CODE))
    assert got.dtype == torch.uint8
    assert torch.equal(got.long(), nearest_code(x, NF4_CODE))
    assert got[:15].tolist() == list(range(15))        # on a midpoint: the lower code


def test_code_cells_refuses_a_code_with_two_midpoints_in_a_cell():
    with pytest.raises(ValueError, match="two midpoints in one cell"):
        code_cells(DYNAMIC_CODE)


@pytest.mark.parametrize("span", ["4096", "all"])
@pytest.mark.parametrize("dtype", NF4_DTYPES)
@pytest.mark.parametrize("blocksize", BLOCKSIZES)
def test_spans_give_the_whole_tensor_formulas(monkeypatch, blocksize, dtype, span):
    """On a CPU quantize_nf4 and dequantize_nf4 work CPU_SPAN elements at a time, elsewhere
    all at once. An odd count with a partial last block, over four spans of 4096 (the largest
    blocksize, the last span partial) or in one odd span (as on a GPU), gives the bytes,
    scales and values (bit for bit, every output dtype) of the one-pass formulas."""
    w = randn(3 * 4096 + 1001, seed=blocksize, dtype=dtype)
    monkeypatch.setattr(nf4, "CPU_SPAN", 4096 if span == "4096" else w.numel())
    q = quantize_nf4(w, blocksize=blocksize)
    scaled, absmax = scale_blocks(w.float(), blocksize)
    assert torch.equal(q.packed, pack_nibbles(nearest_code(scaled, NF4_CODE).to(torch.uint8)))
    assert same_bits(q.absmax, absmax)
    ref = NF4_CODE[q.codes().long()] * absmax.repeat_interleave(blocksize)[: w.numel()]
    for out in NF4_DTYPES:
        assert same_bits(dequantize_nf4(q, out), ref.to(out)), out
    assert same_bits(q.dequantize(), ref.to(dtype))


# ---------------------------------------------------------------------------------------------
# double quantization and storage


@pytest.mark.parametrize("shape", [(7,), (64 * 300 + 5,), (3, 64, 257)])
def test_double_quant_absmax_close_to_plain(shape):
    w = randn(*shape, seed=7)
    plain, dq = quantize_nf4(w), quantize_nf4(w, double_quant=True)
    assert dq.double_quant and dq.block_absmax is None
    assert torch.equal(plain.packed, dq.packed)
    assert dq.absmax_codes.shape == (plain.n_blocks,)
    assert dq.absmax_scales.shape == (-(-plain.n_blocks // 256),)
    assert dq.absmax_offset == plain.absmax.mean()
    # Nearest code in the dynamic map: error at most half its largest gap (0.0140625 / 2)
    # times the nested block's scale.
    scales = dq.absmax_scales.repeat_interleave(256)[: plain.n_blocks]
    assert ((dq.absmax - plain.absmax).abs() <= scales * 0.0140625 / 2 + 1e-6).all()


def test_bits_per_param():
    w = randn(256, 1024, seed=8)
    plain = quantize_nf4(w)
    assert plain.nbytes == w.numel() // 2 + 4 * w.numel() // 64
    assert plain.bits_per_param == 4.5
    dq = quantize_nf4(w, double_quant=True)
    assert dq.nbytes == w.numel() // 2 + w.numel() // 64 + 4 * w.numel() // (64 * 256) + 4
    for n in (1, 2, 63, 1000):
        assert quantize_nf4(randn(n), double_quant=True).bits_per_param > 4.0


def test_bits_per_param_4096_square():
    """docs/ARCHITECTURE.md, Double quantization: NF4 + DQ at blocksize 64 ≈ 4.127 bits/param."""
    dq = quantize_nf4(randn(4096, 4096, seed=9), double_quant=True)
    assert 4.12 < dq.bits_per_param < 4.135, dq.bits_per_param
    assert dq.bits_per_param == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / 4096**2)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("w, message", [
    (torch.tensor([1.0, float("nan")]), "finite"),
    (torch.tensor([float("-inf"), 1.0]), "finite"),
    (torch.arange(64), "float16, bfloat16 or float32"),
    (torch.ones(64, dtype=torch.float64), "float16, bfloat16 or float32"),
    (torch.ones(0), "empty"),
])
def test_bad_weights_raise(w, message):
    with pytest.raises(ValueError, match=f"w must .*{message}"):
        quantize_nf4(w)


@pytest.mark.parametrize("blocksize", [16, 100, 8192, 0, 64.0, True])
def test_bad_blocksize_raises(blocksize):
    with pytest.raises(ValueError, match=r"blocksize must be one of \(32, 64"):
        quantize_nf4(torch.ones(64), blocksize=blocksize)


def test_bad_double_quant_raises():
    with pytest.raises(ValueError, match="double_quant must be a bool"):
        quantize_nf4(torch.ones(64), double_quant="yes")


def test_inconsistent_nf4weight_is_refused():
    q = quantize_nf4(randn(130, seed=10))
    with pytest.raises(ValueError, match="packed must be a torch.uint8 tensor with 65"):
        NF4Weight(q.packed[:-1], q.shape, q.dtype, 64, block_absmax=q.absmax)
    with pytest.raises(ValueError, match="block_absmax must be a torch.float32 tensor with 3"):
        NF4Weight(q.packed, q.shape, q.dtype, 64, block_absmax=q.absmax[:2])
    with pytest.raises(ValueError, match="give block_absmax, or absmax_codes"):
        NF4Weight(q.packed, q.shape, q.dtype, 64)
    with pytest.raises(ValueError, match="dtype must be one of"):
        NF4Weight(q.packed, q.shape, torch.float64, 64, block_absmax=q.absmax)
    assert set(BLOCKSIZES) == {32, 64, 128, 256, 512, 1024, 2048, 4096}


def storage_bytes(q: NF4Weight) -> int:
    """What the tensors of an NF4Weight really occupy, read off their storages."""
    held = (q.packed, q.block_absmax, q.absmax_codes, q.absmax_scales, q.absmax_offset)
    return sum(t.untyped_storage().nbytes() for t in held if t is not None)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("numel, blocksize", [(1, 64), (2, 32), (63, 64), (101, 64),
                                              (64 * 300 + 5, 64), (64 * 256, 64),
                                              (64 * 256 + 1, 64), (4097, 4096), (7 * 33, 128)])
def test_nf4_bytes_equals_the_storage_of_a_real_tensor(numel, blocksize, double_quant):
    """The static size (what the memory predictor uses) against a quantized tensor's storage
    and a by-hand count: odd counts, partial blocks, 256 and 257 nested blocks."""
    q = quantize_nf4(randn(numel, seed=numel), blocksize=blocksize, double_quant=double_quant)
    blocks = (numel + blocksize - 1) // blocksize
    by_hand = (numel + 1) // 2 + (blocks + 4 * ((blocks + 255) // 256) + 4 if double_quant
                                  else 4 * blocks)
    assert nf4_bytes(numel, blocksize, double_quant) == storage_bytes(q) == by_hand == q.nbytes


@pytest.mark.parametrize("args, match", [((0,), "numel must be a positive int, got 0"),
                                         ((10.0,), "numel must be a positive int, got 10.0"),
                                         ((10, 48), "blocksize must be one of")])
def test_nf4_bytes_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        nf4_bytes(*args)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool, int, "float32"])
def test_dequantize_to_a_non_float_dtype_is_refused(dtype):
    """Today an integer dtype truncates every weight to 0 or ±1 without a word."""
    q = quantize_nf4(randn(4, 64, seed=3))
    match = "dtype must be a floating-point torch.dtype"
    with pytest.raises(ValueError, match=match):
        q.dequantize(dtype=dtype)
    with pytest.raises(ValueError, match=match):
        dequantize_nf4(q, dtype=dtype)
    assert q.dequantize(torch.float64).dtype == torch.float64     # any float dtype is fine


def test_import_leaves_the_environment_alone():
    """`import miniquant` sets no TRITON_INTERPRET and imports no triton, nor does naming a
    Triton function; its first launch makes the interpreter choice (here: no CUDA, so "1")."""
    code = textwrap.dedent("""
        import os, sys
        import miniquant, miniquant.linear, miniquant.nf4
        assert "TRITON_INTERPRET" not in os.environ, "set at import"
        assert "triton" not in sys.modules, "triton imported at import"
        dequantize = miniquant.triton_dequantize_nf4
        assert "triton" not in sys.modules, "triton imported by naming a launcher"
        import torch
        q = miniquant.quantize_nf4(torch.randn(4, 64, device="cuda" if torch.cuda.is_available()
                                               else "cpu"))
        assert torch.equal(dequantize(q), miniquant.dequantize_nf4(q))
        want = None if torch.cuda.is_available() else "1"
        assert os.environ.get("TRITON_INTERPRET") == want, os.environ.get("TRITON_INTERPRET")
        assert "triton" in sys.modules
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_unknown_attribute_is_an_attribute_error():
    import miniquant
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        miniquant.nope  # noqa: B018
