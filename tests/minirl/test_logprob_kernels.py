"""minirl's Triton selective log-softmax and entropy (logprob_triton.py, logprob_kernels.py)
against PyTorch: log_softmax + gather and the entropy of softmax, values and gradients.

On a CPU the kernels run in Triton's interpreter (float32), so the shapes stay small and
awkward: a vocabulary that is not a multiple of the block or is smaller than it, one row, a
row count that does not fill the last program, −Inf logits, strided logits, logits of
magnitude 1e4. The `gpu` test runs the compiled kernels in bf16 on real sizes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from rl_support import PROMPTS, tiny

from minirl import (
    NonFiniteLogitsError,
    entropy_from_logits,
    grpo_loss,
    sample_groups,
    selective_log_softmax,
    token_logprobs,
)
from minirl.logprob_kernels import blocks, interpreting
from minirl.logprob_triton import (
    entropy_from_logits_triton,
    logprobs_and_entropy_triton,
    selective_log_softmax_triton,
)

INF = math.inf


def make(N, V, scale=4.0, seed=0, device="cpu", dtype=torch.float32):
    """logits [N, V] and ids [N] int64 with ids[0] = 0 and ids[-1] = V - 1."""
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(N, V, generator=g)
    ids = torch.randint(0, V, (N,), generator=g)
    ids[0], ids[-1] = 0, V - 1
    return logits.to(device=device, dtype=dtype), ids.to(device)


def torch_stats(logits, ids):
    logp = torch.log_softmax(logits.float(), dim=1).gather(1, ids[:, None])[:, 0]
    return logp, entropy_from_logits(logits)


def grads(outputs, weights, keep, logits):
    """d Σ_k (weights[k] · outputs[k]) / d logits over the outputs `keep` marks (the graph is
    kept for the next call)."""
    loss = sum((w * o).sum() for o, w, k in zip(outputs, weights, keep, strict=True) if k)
    return torch.autograd.grad(loss, logits, retain_graph=True)[0]


def assert_matches_torch(logits, ids, atol=1e-5, rtol=1e-5, **block):
    """Values, and the gradient of logp alone, of H alone and of both (one backward pass),
    equal PyTorch's on `logits` (a leaf or a view of one: the gradient is taken there)."""
    leaf = logits.detach().requires_grad_()
    logp, entropy = logprobs_and_entropy_triton(leaf, ids, **block)
    want_logp, want_entropy = torch_stats(leaf, ids)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == ids.shape
    close = dict(atol=atol, rtol=rtol, equal_nan=True)
    torch.testing.assert_close(logp, want_logp, **close)
    torch.testing.assert_close(entropy, want_entropy, **close)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(len(ids), generator=g), torch.randn(len(ids), generator=g))
    for keep in ((True, True), (True, False), (False, True)):
        got = grads((logp, entropy), w, keep, leaf)
        want = grads((want_logp, want_entropy), w, keep, leaf)
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        torch.testing.assert_close(got, want, **close)


@pytest.mark.parametrize("N, V, block_v, block_rows", [
    (11, 67, 32, 4),        # V not a multiple of the block; the last program half empty
    (5, 20, 32, None),      # V smaller than the block
    (1, 67, 32, None),      # one row
    (16, 300, None, None),  # the default blocks
    (16, 300, 64, 1),       # one row per program, five steps over V
    (3, 1, None, None),     # one column: logp = 0, H = 0
], ids=str)
def test_values_and_gradients_match_torch(N, V, block_v, block_rows):
    logits, ids = make(N, V)
    assert_matches_torch(logits, ids, block_v=block_v, block_rows=block_rows)


def test_large_magnitude_logits_do_not_overflow():
    """±1e4 in one row (exp would overflow without the max) and rows shifted by ±1e4 (a float32
    lse is off by 5e-4 there; the kernels keep max and log-sum apart)."""
    logits, ids = make(6, 67, scale=3.0)
    logits[0, ::2] += 1e4
    logits[0, 1::2] -= 1e4
    logits[1] += 1e4
    logits[2] -= 1e4
    logits[3, 5] = 1e4
    ids[3] = 5
    assert_matches_torch(logits, ids, block_v=32)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:invalid value:RuntimeWarning")  # the all −Inf row, in NumPy
def test_minus_inf_logits():
    """Scattered −Inf are probability 0; an id at −Inf has logp = −Inf; a row −Inf everywhere
    gives NaN (value and gradient row), as PyTorch; a row finite in one block only."""
    logits, ids = make(6, 67)
    logits[0, 3::4] = -INF
    logits[1, ids[1]] = -INF
    logits[2] = -INF
    logits[3, :64] = -INF                     # only the last (partial) block is finite
    logits[4, 32:] = -INF                     # only the first block is finite
    ids[3], ids[4] = 65, 7
    logits[5, 1:] = -INF                      # one finite logit: logp 0 or −Inf, H 0
    ids[5] = 0
    assert_matches_torch(logits, ids, block_v=32, block_rows=4)
    logp, entropy = logprobs_and_entropy_triton(logits, ids, block_v=32)
    assert logp[1] == -INF and logp[2].isnan() and entropy[2].isnan()
    assert logp[5] == 0 and entropy[5] == 0


@pytest.mark.parametrize("view", ["transposed", "sliced"])
def test_strided_logits_are_read_in_place(view):
    base, ids = make(70, 40)
    logits = base.t() if view == "transposed" else base[3:50:3, 1:68]    # [40, 70] / [16, 67]
    ids = ids[:len(logits)] % logits.shape[1]
    assert not logits.is_contiguous()
    assert_matches_torch(logits, ids, block_v=32, block_rows=4)


def test_the_three_public_functions_agree():
    logits, ids = make(7, 50)
    logp, entropy = logprobs_and_entropy_triton(logits, ids)
    assert torch.equal(selective_log_softmax_triton(logits, ids), logp)
    assert torch.equal(entropy_from_logits_triton(logits), entropy)
    assert torch.equal(selective_log_softmax(logits, ids, backend="triton"), logp)
    strided_ids = torch.stack([ids, ids.flip(0)], dim=1)[:, 0]
    assert not strided_ids.is_contiguous()
    assert torch.equal(selective_log_softmax_triton(logits, strided_ids), logp)
    empty = logprobs_and_entropy_triton(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert [t.shape for t in empty] == [(0,), (0,)]


def test_changing_logp_in_place_leaves_the_entropy_backward_alone():
    """The per-row statistics saved for the backward are not views of the returned logp."""
    logits, ids = make(7, 50)
    leaf = logits.requires_grad_()
    logp, entropy = logprobs_and_entropy_triton(leaf, ids)
    want = torch.autograd.grad(entropy.sum(), leaf, retain_graph=True)[0]
    logp.mul_(2.0)
    assert torch.equal(torch.autograd.grad(entropy.sum(), leaf)[0], want)


def test_entropy_reference():
    """entropy_from_logits: uniform over k finite logits is log k; one-hot-like is 0."""
    logits = torch.tensor([[0.0, 0.0, 0.0, -INF], [5.0, -INF, -INF, -INF]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(3), 0.0]))
    half = torch.randn(3, 9, dtype=torch.bfloat16)
    assert entropy_from_logits(half).dtype == torch.float32
    assert entropy_from_logits(half.double()).dtype == torch.float64


def test_block_choice():
    assert blocks(16384, 151936) == (1, 4096)
    assert blocks(11, 45) == (16, 64)
    assert blocks(3, 300) == (4, 512)
    assert blocks(11, 67, 32, 4) == (4, 32)
    for bad in (dict(block_v=48), dict(block_rows=0)):
        with pytest.raises(ValueError, match="must be a power of two"):
            blocks(4, 4, **bad)


def test_bad_inputs_are_named():
    logits, ids = make(11, 67)
    with pytest.raises(ValueError, match=r"ids must be an int64 tensor of shape \[11\]"):
        selective_log_softmax_triton(logits, ids.int())
    with pytest.raises(ValueError, match=r"ids must be an int64 tensor of shape \[11\]"):
        selective_log_softmax_triton(logits, ids[:4])
    with pytest.raises(ValueError, match=r"ids must lie in 0..66 .* got 0..67"):
        selective_log_softmax_triton(logits, torch.where(ids == 66, 67, ids))
    with pytest.raises(ValueError, match=r"ids must lie in 0..66 .* got -1..66"):
        selective_log_softmax_triton(logits, torch.where(ids == 0, -1, ids))
    with pytest.raises(ValueError, match=r"logits must be a \[N, V\] tensor .* \[2, 11, 67\]"):
        selective_log_softmax_triton(logits.expand(2, 11, 67), ids)
    with pytest.raises(ValueError, match=r"logits must be a \[N, V\] tensor .*torch.int64"):
        entropy_from_logits_triton(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits must be a \[N, V\] tensor .*torch.float64"):
        entropy_from_logits_triton(logits.double())
    with pytest.raises(ValueError, match="at least one vocabulary column"):
        entropy_from_logits_triton(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="ids must be an int64 tensor of token ids, got None"):
        logprobs_and_entropy_triton(logits, None)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        selective_log_softmax_triton(logits, ids, block_v=24)


@pytest.mark.skipif(not interpreting(), reason="the interpreter only")
def test_the_interpreter_refuses_half_precision():
    with pytest.raises(ValueError, match="interpreter is float32-only"):
        entropy_from_logits_triton(torch.zeros(3, 4, dtype=torch.bfloat16))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")    # inf - inf, in NumPy
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_logits_are_refused_by_row(bad):
    logits, ids = make(11, 67)
    logits[4, 7] = logits[9, 66] = bad
    with pytest.raises(NonFiniteLogitsError, match=r"NaN or \+Inf in 2 rows \(the first "
                                                   r"\[4, 9\]\)"):
        selective_log_softmax_triton(logits, ids, block_v=32)
    with pytest.raises(NonFiniteLogitsError, match=r"in 2 rows"):
        entropy_from_logits_triton(logits)


def draw(model, G=3, max_new=5, seed=0):
    return sample_groups(model, PROMPTS, G, max_new, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_token_logprobs_and_the_grpo_loss_on_the_triton_backend(kind):
    """backend="triton" gives the torch backend's log-probs and GRPO loss to 1e-6, and the
    same gradients of the model's parameters."""
    model = tiny(kind).eval()
    s = draw(model)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        old = token_logprobs(model, s) - 0.05 * torch.rand(s.target_mask.shape)
    advantages = torch.linspace(-1.0, 1.0, len(s))
    results = {}
    for backend in ("torch", "triton"):
        logp = token_logprobs(model, s, backend=backend)
        loss, _ = grpo_loss(logp, old, advantages, s.target_mask)
        results[backend] = (logp, loss, torch.autograd.grad(loss, params))
    (lp_t, loss_t, g_t), (lp_k, loss_k, g_k) = results["torch"], results["triton"]
    torch.testing.assert_close(lp_k, lp_t, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss_k, loss_t, atol=1e-6, rtol=1e-6)
    for a, b in zip(g_k, g_t, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_built_on_first_use_and_interpreted_after_an_early_triton_import():
    """`import minirl` does not build the kernels; triton imported first with TRITON_INTERPRET
    unset, the kernels (their reductions included) still run interpreted."""
    code = textwrap.dedent("""
        import os, sys, triton, torch
        import minirl
        assert "minirl.logprob_kernels" not in sys.modules
        logits, ids = torch.randn(5, 70), torch.tensor([0, 3, 69, 8, 1])
        got = minirl.selective_log_softmax(logits, ids, backend="triton")
        want = torch.log_softmax(logits, 1).gather(1, ids[:, None])[:, 0]
        assert "minirl.logprob_kernels" in sys.modules
        assert os.environ["TRITON_INTERPRET"] == "1"
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(minirl.entropy_from_logits_triton(logits),
                                   minirl.entropy_from_logits(logits))
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_the_kernels_compile_for_a_gpu(tmp_path):
    """Without a GPU: built with TRITON_INTERPRET=0 and compiled for sm_90 (to a cubin), bf16
    logits, every constexpr variant, the launchers' block shapes; what the interpreter
    would never see (types, the int64 offsets, the combine functions) goes through the real
    compiler."""
    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from minirl import logprob_kernels as K
        assert not K.interpreting()
        types = dict(logits="*bf16", dlogits="*bf16", ids="*i64", N="i32", V="i32",
                     s_n="i64", s_v="i64")
        variants = [(K._logsoftmax_stats_fwd_kernel, dict(HAS_IDS=h)) for h in (True, False)]
        variants += [(K._logsoftmax_stats_bwd_kernel, dict(HAS_G_LOGP=a, HAS_G_H=b))
                     for a, b in ((True, True), (True, False), (False, True))]
        for i, (kernel, flags) in enumerate(variants):
            consts = dict(flags, BLOCK_R=1 if i % 2 else 16, BLOCK_V=4096 if i % 2 else 64)
            sig = {a: "constexpr" if a in consts else types.get(a, "*fp32")
                   for a in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                      target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=8))
            assert "cubin" in compiled.asm, kernel
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_matches_torch_and_keeps_no_rows_by_vocab(dtype):
    """Compiled kernels on a vocabulary of real size (not a multiple of 4096), strided too;
    fwd + bwd allocate about one [N, V] tensor, the gradient, and nothing in float32."""
    N, V = 1024, 50257
    base, ids = make(N, V + 3, device="cuda", dtype=dtype)
    ids = ids % V
    for logits in (base[:, :V].contiguous(), base[:, 3:]):
        leaf = logits.detach().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        logp, entropy = logprobs_and_entropy_triton(leaf, ids)
        got = torch.autograd.grad(logp.sum() + entropy.sum(), leaf)[0]
        extra = torch.cuda.max_memory_allocated() - before
        assert extra < 1.25 * leaf.numel() * leaf.element_size(), extra
        # The reference in float32 from the same values; the kernel rounds its float32
        # gradient once, to half a unit in the last place of the dtype (2**-9 of bf16).
        ref = leaf.detach().float().requires_grad_()
        want_logp, want_entropy = torch_stats(ref, ids)
        want = torch.autograd.grad(want_logp.sum() + want_entropy.sum(), ref)[0]
        torch.testing.assert_close(logp, want_logp, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(entropy, want_entropy, atol=1e-4, rtol=1e-5)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2**-8)
