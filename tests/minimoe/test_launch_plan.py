"""What a dot kernel launches on each architecture (`plans.dot_plan`), and the warning a launch
gives when 16-bit inputs fall back: checked on the CPU, with the device's name and compute
capability stood in for.

Below sm_80 Triton compiles no tensor-core dot (benchmarks/compile_report.py shows no HMMA in
any sm_75 cubin, and thousands of spilled bytes in the 16-bit tiles there), so every dtype
gets the float32 tiles and exact products; from sm_80 each dtype gets its own list.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from minimoe import launch_plan as plans


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0)])
def test_from_sm_80_every_dtype_launches_as_asked(capability):
    assert plans.dot_plan(capability, torch.bfloat16) == (16, "ieee", None)
    assert plans.dot_plan(capability, torch.float16) == (16, "ieee", None)
    assert plans.dot_plan(capability, torch.float32) == (32, "ieee", None)
    assert plans.dot_plan(capability, torch.float32, tf32=True) == (32, "tf32", None)
    assert plans.dot_plan(capability, torch.bfloat16, tf32=True) == (16, "ieee", None)


def test_on_sm_75_everything_multiplies_in_float32_and_says_why():
    bf16 = plans.dot_plan((7, 5), torch.bfloat16)
    assert bf16[:2] == (32, "ieee")
    assert bf16.fallback == ("bfloat16 products in float32 on the FMA units, with the float32 "
                             "tiles: sm_75 has no bfloat16 tensor cores, and Triton compiles "
                             "no tensor-core dot below sm_80")
    fp16 = plans.dot_plan((7, 5), torch.float16)
    assert fp16[:2] == (32, "ieee")
    assert fp16.fallback.startswith("float16 products in float32 on the FMA units")
    assert "no bfloat16" not in fp16.fallback                # sm_75 has float16 tensor cores
    assert plans.dot_plan((7, 5), torch.float32) == (32, "ieee", None)
    assert plans.dot_plan((7, 5), torch.float32, tf32=True) == (
        32, "ieee", "exact float32 products: sm_75 has no TF32 tensor cores")
    assert plans.dot_plan((7, 0), torch.bfloat16).fallback.startswith("bfloat16 products")


@pytest.fixture
def a_t4(monkeypatch):
    """A CUDA device 0 that is a Tesla T4 (compute capability 7.5), warnings not yet given."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    plans.capability.cache_clear()
    plans.warn_once.cache_clear()
    yield torch.device("cuda", 0)
    plans.capability.cache_clear()
    plans.warn_once.cache_clear()


def test_a_launch_warns_once_per_device_and_dtype_naming_the_device_and_why(a_t4):
    with pytest.warns(UserWarning) as caught:
        plan = plans.device_plan(a_t4, torch.bfloat16)
        plans.device_plan(a_t4, torch.bfloat16)                 # the same launch again: silent
    assert plan == plans.dot_plan((7, 5), torch.bfloat16)
    assert [str(w.message) for w in caught] == [
        f"minimoe: Tesla T4: {plan.fallback}. Expect the MoE kernels several times slower than "
        f"on an sm_80 or later GPU."]
    with pytest.warns(UserWarning, match=r"Tesla T4: float16 products in float32"):
        plans.device_plan(a_t4, torch.float16)


def test_float32_falls_back_silently(a_t4, monkeypatch):
    """TF32 is a permission (torch.set_float32_matmul_precision), which PyTorch's own matmuls
    drop without a word on a T4: so does the launch."""
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plans.device_plan(a_t4, torch.float32) == plans.dot_plan((7, 5), torch.float32,
                                                                     tf32=True)


def test_from_sm_80_a_launch_is_silent(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA L4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 9))
    plans.capability.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert plans.device_plan(torch.device("cuda", 0), torch.bfloat16) == (16, "ieee", None)
    finally:
        plans.capability.cache_clear()
