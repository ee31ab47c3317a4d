"""minirl.logprobs: selective_log_softmax against log_softmax + gather, token log-probs
against one-sequence-at-a-time forwards, the reference with adapters off, and refusals."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from rl_support import PROMPTS, raise_eos, tiny

import minimoe
from minirl import (
    IMPLEMENTATIONS,
    NonFiniteLogitsError,
    adapters_off,
    reference_logprobs,
    sample_groups,
    selective_log_softmax,
    token_logprobs,
)
from minirl.logprobs import check_logits
from minituner import LoRALinear, wrap_lora
from minituner.qlora import wrap_minigpt_qlora


def logits_ids(N=11, V=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(N, V, generator=g)).to(dtype).requires_grad_()
    return logits, torch.randint(0, V, (N,), generator=g)


def reference(logits, ids):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, None])[:, 0]


@pytest.mark.parametrize("N, V", [(11, 37), (1, 2), (64, 45)])
def test_selective_log_softmax_matches_log_softmax_gather(N, V):
    logits, ids = logits_ids(N, V)
    got, want = selective_log_softmax(logits, ids), reference(logits, ids)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), logits)[0]
    g_want = torch.autograd.grad(want.sum(), logits)[0]
    torch.testing.assert_close(g_got, g_want)


def test_selective_log_softmax_dtypes():
    logits, ids = logits_ids(dtype=torch.float64)
    got = selective_log_softmax(logits, ids)
    assert got.dtype == torch.float64
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, ids), (logits,))
    half, ids = logits_ids(dtype=torch.bfloat16)
    got = selective_log_softmax(half, ids)
    assert got.dtype == torch.float32           # reduced in float32, not in bf16
    torch.testing.assert_close(got, reference(half, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_row_blocks_with_minus_inf_logits_and_ids_anywhere(dtype):
    """A vocabulary wide enough that a CPU processes the rows in blocks (the last one short):
    value and gradient as log_softmax + gather, with −Inf logits, ids on them (logp −Inf,
    gradient g there) and ids at the first and last column."""
    logits, ids = logits_ids(N=37, V=30_000, seed=3)
    logits = logits.detach()
    logits[::3, ::7] = -math.inf
    ids[:4] = torch.tensor([0, 29_999, 7, 0])          # rows 0 and 3: ids on a −Inf logit
    logits = logits.to(dtype).requires_grad_()
    got, want = selective_log_softmax(logits, ids), reference(logits, ids)
    assert torch.isneginf(got[[0, 3]]).all()
    torch.testing.assert_close(got, want)
    g = torch.randn(37, generator=torch.Generator().manual_seed(4))
    g_got = torch.autograd.grad(got, logits, g)[0]
    g_want = torch.autograd.grad(want, logits, g)[0]
    assert g_got.dtype == dtype
    torch.testing.assert_close(g_got, g_want)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of t: equal only where the values are, and their zeros' signs too."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bits_of_gather_minus_logsumexp(dtype):
    """Value and gradient are those of autograd through logit[id] − logsumexp(logits) bit for
    bit, zeros' signs included (the committed experiments were recorded with that form): over
    many row blocks, with −Inf logits and g = 0 on masked rows."""
    logits, ids = logits_ids(N=37, V=30_000, seed=5)
    logits = logits.detach()
    logits[1, ::5] = -math.inf
    logits = logits.to(dtype).requires_grad_()
    x = logits.float()
    want = x.gather(1, ids[:, None])[:, 0] - torch.logsumexp(x, dim=1)
    got = selective_log_softmax(logits, ids)
    g = torch.randn(37, generator=torch.Generator().manual_seed(6))
    g[::3] = 0.0                                          # rows a target mask leaves out
    g_got = torch.autograd.grad(got, logits, g)[0]
    g_want = torch.autograd.grad(want, logits, g)[0]
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(g_got), bits(g_want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nothing_of_the_logits_size_is_saved_but_the_logits(dtype):
    """For its backward the PyTorch path keeps the logits themselves (bf16 ones too, with no
    float32 copy) and [N]-sized tensors: no [N, V] log-softmax, softmax or copy."""
    logits, ids = logits_ids(N=40, V=20_000)
    logits = logits.detach().to(dtype).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        selective_log_softmax(logits, ids)
    big = [(t.dtype, tuple(t.shape)) for t in saved
           if t.numel() >= logits.numel() and t.data_ptr() != logits.data_ptr()]
    assert saved and big == [], f"saved for the backward besides the logits: {big}"


def peak_extra_bytes(fn, tmp_path) -> int:
    """The most CPU memory that tensors made while fn() runs hold at once, from the
    profiler's allocation and free events in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    now = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        now += e["args"]["Bytes"]
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_build_no_other_tensor_of_the_logits_size(dtype, tmp_path):
    """Peak memory of forward + backward: the [N, V] gradient (which any implementation
    returns) and less than half an [N, V] float32 more, where autograd through log_softmax +
    gather, or gather − logsumexp, builds two [N, V] float32 tensors more, or three."""
    logits, ids = logits_ids(N=128, V=16_384)
    logits = logits.detach().to(dtype).requires_grad_()
    peak = peak_extra_bytes(
        lambda: torch.autograd.grad(selective_log_softmax(logits, ids).sum(), logits), tmp_path)
    gradient = logits.numel() * logits.element_size()
    assert gradient <= peak < gradient + logits.numel() * 4 // 2, \
        f"peak {peak / 2**20:.1f} MiB for a {gradient / 2**20:.1f} MiB gradient"


def test_second_order_gradients():
    """Under create_graph the backward is recorded, so a gradient of the gradient is right."""
    logits, ids = logits_ids(N=5, V=9, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda x: selective_log_softmax(x, ids) ** 2, (logits,))


def test_minus_inf_logits_are_probability_zero():
    logits = torch.tensor([[0.0, -math.inf, 0.0], [-math.inf, 1.0, -math.inf]])
    got = selective_log_softmax(logits, torch.tensor([0, 1]))
    torch.testing.assert_close(got, torch.tensor([math.log(0.5), 0.0]))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_logits_are_refused(bad):
    logits, ids = logits_ids()
    logits = logits.detach().clone()
    logits[4, 7] = bad
    with pytest.raises(NonFiniteLogitsError, match=r"logits hold NaN or \+Inf \(1 values, the "
                                                   r"first at \(4, 7\)\)"):
        selective_log_softmax(logits, ids)
    assert issubclass(NonFiniteLogitsError, ValueError)
    assert issubclass(NonFiniteLogitsError, FloatingPointError)   # the trainer's NaN guard
    assert NonFiniteLogitsError is minimoe.NonFiniteLogitsError    # one class, the router's too


def test_non_finite_logits_are_counted_and_located_in_any_shape():
    """check_logits looks at rows through their max: the count and the first position are
    those of the whole tensor, also for [B, T, V] logits with several bad rows."""
    logits = torch.zeros(3, 4, 5)
    logits[1, 2, 0] = -math.inf                     # probability 0: fine
    check_logits(logits, "logits")
    logits[2, 0, 4] = math.nan
    logits[1, 3, 1] = logits[1, 3, 2] = math.inf
    with pytest.raises(NonFiniteLogitsError, match=r"\(3 values, the first at \(1, 3, 1\)\)"):
        check_logits(logits, "logits")


def test_bad_arguments_are_named():
    logits, ids = logits_ids()
    with pytest.raises(ValueError, match=r"logits must be a floating-point \[N, V\] tensor"):
        selective_log_softmax(logits[0], ids)
    with pytest.raises(ValueError, match=r"logits must be a floating-point"):
        selective_log_softmax(torch.zeros(11, 37, dtype=torch.long), ids)
    with pytest.raises(ValueError, match=r"ids must be an int64 tensor of shape \[11\]"):
        selective_log_softmax(logits, ids[:5])
    with pytest.raises(ValueError, match=r"ids must be an int64"):
        selective_log_softmax(logits, ids.int())
    with pytest.raises(ValueError, match=r"ids must lie in 0..36"):
        selective_log_softmax(logits, torch.full((11,), 37))
    with pytest.raises(ValueError, match=r"backend must be one of \['torch', 'triton'\]"):
        selective_log_softmax(logits, ids, backend="cuda")


def test_an_implementation_is_swapped_in_one_place(monkeypatch, eos_model):
    calls = []

    def spy(logits, ids):
        calls.append(tuple(logits.shape))
        return IMPLEMENTATIONS["torch"](logits, ids)

    monkeypatch.setitem(IMPLEMENTATIONS, "spy", spy)
    s = draw(eos_model)
    torch.testing.assert_close(token_logprobs(eos_model, s, backend="spy"),
                               token_logprobs(eos_model, s))
    assert calls == [(s.tokens.numel() - len(s), 45)]


def draw(model, G=3, max_new=5, seed=0):
    return sample_groups(model, PROMPTS, G, max_new, generator=torch.Generator().manual_seed(seed))


def loop_logprobs(model, s, temperature: float = 1.0) -> torch.Tensor:
    """Each completion token scored by a forward of its own row's prefix alone (no batch, no
    padding), the way sampling saw it: log softmax(logits / T)[token]."""
    out = torch.zeros(s.tokens.shape[0], s.tokens.shape[1] - 1)
    with torch.no_grad():
        for row in range(len(s)):
            for t in s.completion_mask[row].nonzero().flatten().tolist():
                logits = model(s.tokens[row:row + 1, :t])[0, -1]
                out[row, t - 1] = torch.log_softmax(logits / temperature, -1)[s.tokens[row, t]]
    return out


def test_token_logprobs_equal_plain_forwards_of_each_prefix(eos_model):
    s = draw(eos_model)
    got = token_logprobs(eos_model, s)
    assert got.shape == (len(s), s.tokens.shape[1] - 1) and got.dtype == torch.float32
    torch.testing.assert_close(got, loop_logprobs(eos_model, s), rtol=1e-5, atol=1e-5)
    assert (got[~s.target_mask] == 0).all() and (got[s.target_mask] < 0).all()


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_token_logprobs_score_the_distribution_sampled_at_a_temperature(eos_model, temperature):
    s = draw(eos_model)
    got = token_logprobs(eos_model, s, temperature=temperature)
    torch.testing.assert_close(got, loop_logprobs(eos_model, s, temperature), rtol=1e-5,
                               atol=1e-5, msg=lambda m: f"log softmax(logits / T), T = "
                                                        f"{temperature}:\n{m}")
    assert not torch.allclose(got, token_logprobs(eos_model, s))
    with torch.no_grad():
        torch.testing.assert_close(reference_logprobs(eos_model, s, eos_model,
                                                      temperature=temperature), got)
    for bad in (0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            token_logprobs(eos_model, s, temperature=bad)


def test_token_logprobs_carry_gradients_to_the_trainable_parameters(eos_model):
    s = draw(eos_model)
    token_logprobs(eos_model, s).sum().backward()
    assert eos_model.lm_head.weight.grad.abs().sum() > 0


def test_nan_in_the_model_is_refused_by_token_logprobs(eos_model):
    s = draw(eos_model)
    with torch.no_grad():
        eos_model.lm_head.weight[3, 2] = math.nan
    with pytest.raises(NonFiniteLogitsError):
        token_logprobs(eos_model, s)


def trained_looking(model) -> torch.nn.Module:
    """Give every adapter (attention LoRA and expert LoRA) a non-zero B, as after training."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def zero_adapters(model) -> torch.nn.Module:
    """A copy whose adapters add exactly nothing (B = 0): the frozen base."""
    base = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("lora_B"):
                p.zero_()
    return base


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("wrap", ["lora", "qlora"])
def test_adapters_off_is_the_frozen_base(kind, wrap):
    model = raise_eos(tiny(kind))
    if wrap == "lora":
        wrap_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], r=4)
    else:
        wrap_minigpt_qlora(model, r=4)      # MoE: NF4 experts with expert LoRA too
    base_model = zero_adapters(trained_looking(model))
    s = draw(model)
    policy = token_logprobs(model, s).detach()
    base = token_logprobs(base_model, s)
    ref = reference_logprobs(model, s)
    assert torch.equal(ref, base) and not ref.requires_grad
    assert not torch.allclose(policy, ref)                  # the adapters do change the policy
    assert torch.equal(token_logprobs(model, s), policy)    # and are back on afterwards


def test_adapters_off_on_the_triton_moe_backend():
    """The fused expert-LoRA kernels (interpreted on a CPU) read the scaling at each call."""
    model = raise_eos(tiny("moe"))
    wrap_minigpt_qlora(model, r=4)
    base_model = zero_adapters(trained_looking(model))
    for m in (model, base_model):
        m.set_moe_backend("triton")
    s = sample_groups(model, PROMPTS[:2], 2, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(reference_logprobs(model, s), token_logprobs(base_model, s).detach())


def test_adapters_off_restores_the_scaling_after_an_error():
    model = wrap_lora_model()
    scalings = [m.scaling for m in model.modules() if isinstance(m, LoRALinear)]
    with pytest.raises(KeyError), adapters_off(model):
        assert all(m.scaling == 0 for m in model.modules() if isinstance(m, LoRALinear))
        raise KeyError("inside")
    assert [m.scaling for m in model.modules() if isinstance(m, LoRALinear)] == scalings


def wrap_lora_model():
    model = raise_eos(tiny())
    wrap_lora(model, ["q_proj", "v_proj"], r=2, alpha=8.0)
    return trained_looking(model)


def test_an_explicit_reference_model():
    model, other = raise_eos(tiny(seed=0)), raise_eos(tiny(seed=1))
    s = draw(model)
    torch.testing.assert_close(reference_logprobs(model, s, reference=other),
                               token_logprobs(other, s).detach())


def test_adapters_off_refuses_a_model_without_adapters_or_with_merged_ones():
    with pytest.raises(ValueError, match="holds no LoRA adapters.*pass the reference model"):
        reference_logprobs(tiny(), draw(raise_eos(tiny())))
    model = wrap_lora_model()
    model.blocks[0].attn.q_proj.merge()
    with pytest.raises(ValueError, match=r"\['blocks.0.attn.q_proj'\] are merged"):
        with adapters_off(model):
            pass


def test_a_completions_first_token_is_scored_at_prompt_length_minus_one():
    model = raise_eos(tiny())
    s = draw(model, G=2, max_new=3)
    got = token_logprobs(model, s)
    for row in range(len(s)):
        first = int(s.prompt_lengths[row]) - 1        # column t scores token t + 1
        assert got[row, first] != 0 and (got[row, :first] == 0).all()
