"""Triton NF4 dequantization: bit-exact against the PyTorch reference and bitsandbytes' codes.

On CPU the kernel runs in the Triton interpreter (miniquant.triton_dequant sets
TRITON_INTERPRET=1 before importing triton when no GPU is present), so the shapes stay small:
awkward element counts (1, odd, one short of and one past a block, several tiles) are what
find indexing bugs. The `gpu` tests run the compiled kernel on real sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support import poison

from miniquant.nf4 import NF4_CODE, NF4Weight, dequantize_nf4, quantize_nf4
from miniquant.triton_dequant import (
    BYTES_PER_PROGRAM,
    selective_dequantize_nf4,
    selective_dequantize_nf4_torch,
    triton_dequantize_nf4,
)

pytestmark = pytest.mark.usefixtures("single_thread")

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TILE = 2 * BYTES_PER_PROGRAM  # elements one program writes
# 1, odd, one short of / equal to / one past a 64-block, several tiles with a ragged tail,
# and 2-D / 3-D shapes whose rows do not align with the blocks.
SHAPES = [(1,), (3,), (63,), (64,), (65,), (1000,), (7, 9), (2, 3, 37), (3, TILE // 2 + 7)]


def by_hand(q: NF4Weight) -> torch.Tensor:
    """code[idx] * absmax[block], float32, from the packed bytes (independent of nf4.py)."""
    hi, lo = q.packed >> 4, q.packed & 0xF
    idx = torch.stack([hi, lo], dim=1).reshape(-1)[: q.numel].long()
    block = torch.arange(q.numel) // q.blocksize
    return (NF4_CODE[idx] * q.absmax[block]).reshape(q.shape)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 4096])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_exactly(shape, blocksize, double_quant):
    torch.manual_seed(0)
    q = quantize_nf4(torch.randn(shape) * 3, blocksize=blocksize, double_quant=double_quant)
    reference = dequantize_nf4(q, torch.float32)
    assert torch.equal(reference, by_hand(q))
    for dtype in OUT_DTYPES:
        got = triton_dequantize_nf4(q, dtype)
        assert got.shape == q.shape and got.dtype == dtype
        assert torch.equal(got, reference.to(dtype)), f"{dtype}: {got} vs {reference}"


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_default_dtype_is_the_quantized_one(dtype):
    q = quantize_nf4(torch.randn(5, 40).to(dtype))
    got = triton_dequantize_nf4(q)
    assert got.dtype == dtype and torch.equal(got, dequantize_nf4(q))


@pytest.mark.parametrize("shape", [(2, 96), (6, 80), (255,)], ids=str)
def test_matches_bitsandbytes_codes(shape):
    # bitsandbytes quantizes; we dequantize its bytes and absmax. The oracle is its code table
    # applied by hand, not its CPU dequantize_4bit, which is wrong for these row lengths.
    bnbf = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(1)
    w = torch.randn(shape)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    q = NF4Weight(packed.reshape(-1), w.shape, torch.float32, 64, block_absmax=state.absmax)
    code = bnbf.get_4bit_type("nf4", device="cpu")
    idx = torch.stack([q.packed >> 4, q.packed & 0xF], dim=1).reshape(-1)[: w.numel()].long()
    expected = code[idx] * state.absmax[torch.arange(w.numel()) // 64]
    assert torch.equal(triton_dequantize_nf4(q), expected.reshape(shape))


def experts(n_experts=5, d_out=16, d_in=160, blocksize=64, double_quant=False, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n_experts, d_out, d_in)
    return quantize_nf4(w, blocksize=blocksize, double_quant=double_quant)


SELECTIVE = [selective_dequantize_nf4, selective_dequantize_nf4_torch]


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("fn", SELECTIVE, ids=["triton", "torch"])
def test_selective_reads_only_listed_experts(dtype, fn):
    # Experts of 2560 elements (more than one tile, 40 blocks each); codes 0xFF (level 1.0)
    # and NaN scales in the others would show up in any output that read them.
    q = experts()
    active = torch.tensor([3, 1])
    expected = dequantize_nf4(q, dtype)[active]
    poison(q, keep=[1, 3])
    got = fn(q, active, dtype)
    assert got.shape == (2, 16, 160) and got.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("fn", SELECTIVE, ids=["triton", "torch"])
def test_selective_double_quant_reads_only_listed_codes(fn):
    # Blocksize 32 and 256*32 elements per expert: each expert owns whole groups of 256 nested
    # codes, so the other experts' group scales can be poisoned too.
    q = experts(n_experts=3, d_out=64, d_in=128, blocksize=32, double_quant=True)
    active = torch.tensor([2, 0, 2])
    expected = dequantize_nf4(q)[active]
    poison(q, keep=[0, 2])
    q.absmax_scales[1] = float("nan")
    assert torch.equal(fn(q, active), expected)


@pytest.mark.parametrize("fn", SELECTIVE, ids=["triton", "torch"])
def test_selective_double_quant_with_shared_nested_groups(fn):
    # 40 blocks per expert: nested groups of 256 codes straddle experts (the group scale is
    # shared and read); the other experts' codes are poisoned.
    q = experts(double_quant=True)
    active = torch.tensor([4, 0])
    expected = dequantize_nf4(q)[active]
    poison(q, keep=[0, 4])
    assert torch.equal(fn(q, active), expected)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("fn", SELECTIVE, ids=["triton", "torch"])
def test_selective_shuffled_with_repeats(double_quant, fn):
    q = experts(n_experts=6, d_out=8, d_in=24, blocksize=32, double_quant=double_quant)
    active = torch.tensor([5, 0, 5, 2, 0, 3], dtype=torch.int32)  # rows follow `active`
    got = fn(q, active, torch.bfloat16)
    assert torch.equal(got, dequantize_nf4(q, torch.bfloat16)[active.long()])


@pytest.mark.parametrize("fn", SELECTIVE, ids=["triton", "torch"])
def test_selective_all_experts_equals_full(fn):
    q = experts(n_experts=4, d_out=4, d_in=32, blocksize=128)
    assert torch.equal(fn(q, torch.arange(4)), triton_dequantize_nf4(q))


@pytest.mark.parametrize("fn", SELECTIVE, ids=["triton", "torch"])
def test_selective_empty_active(fn):
    q = experts(n_experts=3, d_out=4, d_in=16)
    got = fn(q, torch.empty(0, dtype=torch.long))
    assert got.shape == (0, 4, 16) and got.dtype == torch.float32


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("fn", SELECTIVE, ids=["triton", "torch"])
def test_selective_one_expert(fn, double_quant):
    """A single listed expert (one output row, the smallest launch), each of three in turn
    (scripts/mutate.py: `active.numel() == 1` returning the unwritten buffer went unnoticed)."""
    q = experts(n_experts=5, d_out=3, d_in=96, blocksize=32, double_quant=double_quant, seed=3)
    full = dequantize_nf4(q)
    for e in (4, 0, 2):
        got = fn(q, torch.tensor([e]))
        assert got.shape == (1, 3, 96) and torch.equal(got, full[[e]]), e


def test_cpu_weight_is_refused_when_the_kernel_is_compiled(monkeypatch):
    """A compiled kernel reads CUDA memory only: with the interpreter faked off, a CPU weight is
    a ValueError naming the argument from both kernel entry points (nothing launches), while
    the PyTorch selective path still takes it."""
    import miniquant.triton_dequant as triton_dequant

    q = experts(n_experts=2, d_out=4, d_in=64)
    monkeypatch.setattr(triton_dequant, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="q is on cpu, but Triton compiles for CUDA"):
        triton_dequantize_nf4(q)
    with pytest.raises(ValueError, match="q_experts is on cpu, but Triton compiles for CUDA"):
        selective_dequantize_nf4(q, torch.tensor([1]))
    got = selective_dequantize_nf4_torch(q, torch.tensor([1]))
    assert torch.equal(got, dequantize_nf4(q)[[1]])


@pytest.mark.parametrize(
    "active, match",
    [
        (torch.tensor([[0, 1]]), "1-D"),
        (torch.tensor([0.0, 1.0]), "integer"),
        (torch.tensor([True, False]), "integer"),
        (torch.tensor([0, 3]), r"\[0, 3\)"),
        (torch.tensor([-1]), r"\[0, 3\)"),
        ([0, 1], "1-D"),
    ],
    ids=["2d", "float", "bool", "too-big", "negative", "list"],
)
def test_selective_bad_active(active, match):
    q = experts(n_experts=3, d_out=4, d_in=16)
    with pytest.raises(ValueError, match=match):
        selective_dequantize_nf4(q, active)


def test_selective_bad_weights():
    with pytest.raises(ValueError, match="q_experts.*multiple of the blocksize"):
        selective_dequantize_nf4(quantize_nf4(torch.randn(3, 5, 7), blocksize=32),
                                 torch.tensor([0]))
    with pytest.raises(ValueError, match=r"q_experts.*\[E, out, in\]"):
        selective_dequantize_nf4(quantize_nf4(torch.randn(4, 64)), torch.tensor([0]))
    with pytest.raises(ValueError, match="q_experts must be an NF4Weight"):
        selective_dequantize_nf4(torch.randn(2, 4, 16), torch.tensor([0]))


def test_bad_inputs():
    q = quantize_nf4(torch.randn(10))
    with pytest.raises(ValueError, match="q must be an NF4Weight"):
        triton_dequantize_nf4(torch.randn(10))
    for dtype in (torch.float64, torch.int8):
        with pytest.raises(ValueError, match="dtype"):
            triton_dequantize_nf4(q, dtype)
        with pytest.raises(ValueError, match="dtype"):
            selective_dequantize_nf4(experts(n_experts=2, d_out=4, d_in=16), torch.tensor([0]),
                                     dtype)


def run_fresh(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_interpreter_chosen_even_after_triton_was_imported():
    # triton first, with TRITON_INTERPRET unset: the kernel, loaded at the first launch, is
    # still interpreted.
    done = run_fresh("""
        import os, triton, torch
        from miniquant.nf4 import dequantize_nf4, quantize_nf4
        from miniquant.triton_dequant import triton_dequantize_nf4
        q = quantize_nf4(torch.randn(3, 77))
        assert torch.equal(triton_dequantize_nf4(q, torch.bfloat16),
                           dequantize_nf4(q, torch.bfloat16))
        assert os.environ["TRITON_INTERPRET"] == "1"
        print("ok")
    """)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_explicit_triton_interpret_0_is_respected():
    done = run_fresh("""
        import torch
        from miniquant.nf4 import quantize_nf4
        from miniquant.triton_dequant import triton_dequantize_nf4
        try:
            triton_dequantize_nf4(quantize_nf4(torch.randn(8)))
        except ValueError as e:
            print(e)
    """, TRITON_INTERPRET="0")
    assert done.returncode == 0 and "TRITON_INTERPRET=1" in done.stdout, done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("double_quant", [False, True])
def test_gpu_large_matches_reference(double_quant):
    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    q = quantize_nf4(w, blocksize=64, double_quant=double_quant)
    reference = dequantize_nf4(q, torch.float32)
    for dtype in OUT_DTYPES:
        assert torch.equal(triton_dequantize_nf4(q, dtype), reference.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1,), (4097,), (3, 14337)], ids=str)
def test_gpu_ragged_matches_reference(shape):
    q = quantize_nf4(torch.randn(shape, device="cuda"), blocksize=128)
    for dtype in OUT_DTYPES:
        assert torch.equal(triton_dequantize_nf4(q, dtype), dequantize_nf4(q, dtype))


@pytest.mark.gpu
def test_gpu_matches_bitsandbytes():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(4096, 4096, device="cuda")
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    q = NF4Weight(packed.reshape(-1), w.shape, torch.float32, 64, block_absmax=state.absmax)
    assert torch.equal(triton_dequantize_nf4(q), bnbf.dequantize_4bit(packed, state))


@pytest.mark.gpu
@pytest.mark.parametrize("double_quant", [False, True])
def test_gpu_selective_matches_reference(double_quant):
    torch.manual_seed(0)
    q = quantize_nf4(torch.randn(8, 1024, 4096, device="cuda"), double_quant=double_quant)
    active = torch.tensor([7, 2, 2, 5], device="cuda")
    for dtype in OUT_DTYPES:
        expected = dequantize_nf4(q, dtype)[active]
        assert torch.equal(selective_dequantize_nf4(q, active, dtype), expected)
