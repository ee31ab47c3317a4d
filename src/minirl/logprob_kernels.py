"""Triton kernels of the log-softmax statistics GRPO needs: log p(id) and the entropy of each
row of logits [N, V], forward and backward, streaming over the vocabulary (private: call them
through `logprob_triton.py`).

For one row z [V] (float32 arithmetic whatever the logits' dtype), with m = max z,
s = Σ_v exp(z_v − m), lse = m + log s and p_v = exp(z_v − lse):

    logp = z[id] − lse = (z[id] − m) − log s
    H    = −Σ p_v log p_v = lse − Σ p_v z_v = log s − t / s,   t = Σ_v exp(z_v − m)(z_v − m)

Forward — one pass over the row in BLOCK_V chunks, BLOCK_R rows per program; the running
sums are rescaled whenever the running max grows (the online softmax):

    # grid = (cdiv(N, BLOCK_R),)
    r = pid * BLOCK_R + arange(BLOCK_R);  rr = min(r, N - 1)   # padding rows re-read row N-1
    m = -inf;  s = 0;  t = 0                                   # [BLOCK_R] each, float32
    for v0 in 0 .. V step BLOCK_V:
        z     = logits[rr, v0 + arange(BLOCK_V)]               # -inf past V
        m_new = maximum(m, max_v z)
        c_old = m     if m     > -inf else 0                   # shifts: 0 while a row has
        c     = m_new if m_new > -inf else 0                   #   seen nothing but -inf
        a     = exp(m - c)                                     # old sums' rescale, 0 at -inf
        e     = exp(z - c)                                     # 0 where z = -inf
        d     = z - c where z > -inf else 0                    # keeps 0 * -inf out of t
        t     = a * (t + s * (c_old - c)) + Σ_v e * d          # Σ e(z - c_old) -> Σ e(z - c)
        s     = a * s + Σ_v e
        m     = m_new
    log_s = log(s)
    logp[r] = (logits[r, id[r]] - m) - log_s                   # if HAS_IDS
    H[r], row_max[r], log_sum[r] = log_s - t / s, m, log_s     # masked: r < N

Only row_max, log_sum and H ([N] float32 each) are kept for the backward, never an [N, V]
tensor: it recomputes log p_v = (z_v − row_max) − log_sum from the logits. Keeping m and
log s apart (rather than their sum, lse) keeps z_v − m exact, so that logits of magnitude 1e4
(where a float32 lse is off by 5e-4) still give p_v to float32 rounding; t is likewise summed
relative to the running max, so H does not cancel two numbers of that magnitude.

Backward — derivatives, with ∂p_u/∂z_v = p_u(δ_uv − p_v):

    ∂logp/∂z_v = δ_{v,id} − p_v
    ∂H/∂z_v    = ∂lse/∂z_v − p_v − Σ_u z_u ∂p_u/∂z_v = p_v − p_v − p_v z_v + p_v Σ_u p_u z_u
               = −p_v (z_v − (lse − H)) = −p_v (log p_v + H)

so with upstream gradients g_logp [N] and g_H [N] (either absent), one pass writes

    # grid = (cdiv(N, BLOCK_R),)
    for v0 in 0 .. V step BLOCK_V:
        z  = logits[rr, v];  lp = (z - row_max) - log_sum;  p = exp(lp)
        dz = g_logp * ((v == id) - p)                          # if HAS_G_LOGP
           - g_H * p * (0 if p == 0 else lp + H)               # if HAS_G_H
        dlogits[r, v] = dz                                     # masked: r < N, v < V

−Inf logits are probability 0: they add nothing to s or t and get the gradient
−g_logp·p_v = 0 (the p == 0 guard keeps 0 · −inf out of the entropy term). A row whose id
has logit −Inf gets logp = −Inf (and the gradient g_logp at the id, as log_softmax). A row
that is −Inf everywhere has no distribution: m = −Inf, s = 0, so logp, H and its whole
gradient row are NaN, as PyTorch's log_softmax gives. NaN or +Inf logits make s NaN, so
log_sum is NaN exactly for those rows (the public functions check that [N] vector).

The kernels call no @triton.jit helper. `tl.max` and `tl.sum` are such helpers, which fail
inside an interpreted kernel when triton was first imported without TRITON_INTERPRET (see
miniquant/triton_dequant.py); the row max and sums are therefore the builtin `tl.reduce`
with the combine functions those helpers pass (`_MAX`, `_SUM`), which a compiled kernel
inlines and the interpreter recognises by identity and runs as one NumPy call (any other
combine function it calls element by element: 100 times slower on a 4096-element tile).
Offsets are int64: N · V passes 2**31 at 16k rows of a 152k vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from miniquant.triton_env import interpreted, not_on_cuda, tl, triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements per program and chunk: BLOCK_R * BLOCK_V <= TILE. On a GPU one row of a large
# vocabulary per program, 4096 columns a step (16 per thread over 8 warps); a small
# vocabulary packs several rows into a program. The interpreter pays per program and per
# NumPy call, so the same large tiles are its fast choice too.
TILE = 4096
MAX_BLOCK_R = 16


# Triton's own combine functions of tl.max / tl.sum (the module docstring says why these).
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


@triton.jit
def _logsoftmax_stats_fwd_kernel(
    logits,     # *float32 | *bfloat16 | *float16 [N, V], read through its strides
    ids,        # *int64 [N]: the token id of each row, in [0, V) (read if HAS_IDS)
    logp,       # *float32 [N] out: log_softmax(logits)[r, ids[r]] (written if HAS_IDS)
    entropy,    # *float32 [N] out: H = -Σ p log p of each row
    row_max,    # *float32 [N] out: m = max_v logits[r, v] (-inf for an all -inf row)
    log_sum,    # *float32 [N] out: log Σ_v exp(logits[r, v] - m); lse = m + log_sum
    N, V,       # rows, vocabulary size (runtime ints, both >= 1)
    s_n, s_v,   # strides of logits, in elements
    HAS_IDS: tl.constexpr,   # compute logp (False: entropy only, ids and logp unused)
    BLOCK_R: tl.constexpr,   # rows per program (a power of two)
    BLOCK_V: tl.constexpr,   # vocabulary columns per step (a power of two)
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)     # [BR] int64
    in_rows = r < N
    rr = tl.minimum(r, N - 1)          # padding rows read a real row, so no NaN is computed
    cols = tl.arange(0, BLOCK_V)                                            # [BV]
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    s = tl.full((BLOCK_R,), 0.0, tl.float32)
    t = tl.full((BLOCK_R,), 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        col = v.to(tl.int64)[None, :] * s_v       # int64: a transposed [16k, 152k] passes 2**31
        z = tl.load(logits + rr[:, None] * s_n + col, mask=(v < V)[None, :],
                    other=float("-inf")).to(tl.float32)                    # [BR, BV]
        m_new = tl.maximum(m, tl.reduce(z, 1, _MAX))
        c_old = tl.where(m > float("-inf"), m, 0.0)
        c = tl.where(m_new > float("-inf"), m_new, 0.0)
        a = tl.exp(m - c)
        e = tl.exp(z - c[:, None])
        d = tl.where(z > float("-inf"), z - c[:, None], 0.0)
        t = a * (t + s * (c_old - c)) + tl.reduce(e * d, 1, _SUM)
        s = a * s + tl.reduce(e, 1, _SUM)
        m = m_new
    log_s = tl.log(s)
    if HAS_IDS:
        target = tl.load(ids + rr)
        z_id = tl.load(logits + rr * s_n + target * s_v).to(tl.float32)
        tl.store(logp + r, (z_id - m) - log_s, mask=in_rows)
    tl.store(entropy + r, log_s - t / s, mask=in_rows)
    tl.store(row_max + r, m, mask=in_rows)
    tl.store(log_sum + r, log_s, mask=in_rows)


@triton.jit
def _logsoftmax_stats_bwd_kernel(
    logits,     # *float32 | *bfloat16 | *float16 [N, V], read through its strides
    ids,        # *int64 [N]: the token id of each row (read if HAS_G_LOGP)
    row_max,    # *float32 [N]: the forward's m
    log_sum,    # *float32 [N]: the forward's log Σ exp(z - m)
    entropy,    # *float32 [N]: the forward's H (read if HAS_G_H)
    g_logp,     # *float32 [N]: upstream gradient of logp (read if HAS_G_LOGP)
    g_entropy,  # *float32 [N]: upstream gradient of H (read if HAS_G_H)
    dlogits,    # *dtype of logits [N, V] out, contiguous: the gradient of the logits
    N, V,       # rows, vocabulary size (runtime ints, both >= 1)
    s_n, s_v,   # strides of logits, in elements
    HAS_G_LOGP: tl.constexpr,  # add g_logp * (onehot(id) - p)
    HAS_G_H: tl.constexpr,     # add -g_H * p * (log p + H)
    BLOCK_R: tl.constexpr,     # rows per program (a power of two)
    BLOCK_V: tl.constexpr,     # vocabulary columns per step (a power of two)
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)     # [BR] int64
    in_rows = r < N
    rr = tl.minimum(r, N - 1)
    cols = tl.arange(0, BLOCK_V)
    m = tl.load(row_max + rr)[:, None]                                      # [BR, 1]
    log_s = tl.load(log_sum + rr)[:, None]
    if HAS_G_LOGP:
        target = tl.load(ids + rr)[:, None]
        g_lp = tl.load(g_logp + rr)[:, None]
    if HAS_G_H:
        h = tl.load(entropy + rr)[:, None]
        g_h = tl.load(g_entropy + rr)[:, None]
    for v0 in range(0, V, BLOCK_V):
        v = v0 + cols
        in_v = (v < V)[None, :]
        col = v.to(tl.int64)[None, :] * s_v
        z = tl.load(logits + rr[:, None] * s_n + col, mask=in_v,
                    other=float("-inf")).to(tl.float32)                    # [BR, BV]
        lp = (z - m) - log_s                                                # log p_v
        p = tl.exp(lp)
        dz = tl.full((BLOCK_R, BLOCK_V), 0.0, tl.float32)
        if HAS_G_LOGP:
            dz += g_lp * (tl.where(v[None, :] == target, 1.0, 0.0) - p)
        if HAS_G_H:
            dz -= g_h * (p * tl.where(p == 0.0, 0.0, lp + h))     # never 0 * -inf
        tl.store(dlogits + r[:, None] * V + v[None, :], dz.to(dlogits.dtype.element_ty),
                 mask=in_rows[:, None] & in_v)


def interpreting() -> bool:
    """Whether these kernels were built for the Triton interpreter (decided at import)."""
    return interpreted(_logsoftmax_stats_fwd_kernel)


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def blocks(N: int, V: int, block_v: int | None = None, block_rows: int | None = None
           ) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_V): the given values, checked, or TILE-sized defaults for [N, V]."""
    for name, b in (("block_v", block_v), ("block_rows", block_rows)):
        if b is not None and (not isinstance(b, int) or b < 1 or b & (b - 1)):
            raise ValueError(f"{name} must be a power of two, got {b!r}")
    block_v = block_v or min(_pow2(V), TILE)
    block_rows = block_rows or max(1, min(_pow2(N), MAX_BLOCK_R, TILE // block_v))
    return block_rows, block_v


def check_logits_arg(logits) -> None:
    """2-D [N, V >= 1] logits in a kernel dtype, on a device the kernels can read (no sync)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in DTYPES:
        raise ValueError(f"logits must be a [N, V] tensor of one of {DTYPES}, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} "
                         f"{list(getattr(logits, 'shape', []))}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one vocabulary column, got V = 0")
    if interpreting():
        if logits.dtype != torch.float32:
            raise ValueError(f"logits are {logits.dtype}, but the Triton interpreter is "
                             f"float32-only: pass float32 logits or run on a GPU")
    elif logits.device.type != "cuda":
        raise not_on_cuda("logits", logits.device)


def check_ids_arg(ids, logits: torch.Tensor, trusted: bool) -> torch.Tensor:
    """ids int64 [N] on the logits' device; unless `trusted`, in [0, V) (one host sync).
    Returns them contiguous, as the kernels read them."""
    N, V = logits.shape
    if not isinstance(ids, torch.Tensor) or ids.shape != (N,) or ids.dtype != torch.long:
        raise ValueError(f"ids must be an int64 tensor of shape [{N}] (one id per row of "
                         f"logits), got {getattr(ids, 'dtype', type(ids).__name__)} "
                         f"{list(getattr(ids, 'shape', []))}")
    if ids.device != logits.device:
        raise ValueError(f"ids ({ids.device}) must be on the logits' device ({logits.device})")
    if not trusted and N and not ((ids >= 0) & (ids < V)).all():
        raise ValueError(f"ids must lie in 0..{V - 1} (the logits' vocabulary), got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return ids.contiguous()


class Stats(NamedTuple):
    """What the forward returns: logp (None without ids) and entropy are the results,
    row_max and log_sum (with entropy) all the backward keeps; [N] float32 each."""
    logp: torch.Tensor | None
    entropy: torch.Tensor
    row_max: torch.Tensor
    log_sum: torch.Tensor


def logsoftmax_stats_forward(logits: torch.Tensor, ids: torch.Tensor | None, *,
                             block_v: int | None = None, block_rows: int | None = None,
                             trusted: bool = False) -> Stats:
    """Launch the forward kernel over logits [N, V] (any strides): `Stats`.

    `ids` None computes the entropy only. `trusted=True` skips the ids range check (one host
    sync), for a caller that has already made it; shapes, dtypes and devices are always
    checked.
    """
    check_logits_arg(logits)
    if ids is not None:
        ids = check_ids_arg(ids, logits, trusted)
    N, V = logits.shape
    # Four tensors, not rows of one: an in-place change of a returned logp must not touch
    # (and invalidate) the row_max and log_sum saved for the backward.
    logp, entropy, row_max, log_sum = (torch.empty(N, dtype=torch.float32,
                                                   device=logits.device) for _ in range(4))
    if N:
        block_r, block_v = blocks(N, V, block_v, block_rows)
        _logsoftmax_stats_fwd_kernel[(triton.cdiv(N, block_r),)](
            logits, ids if ids is not None else logp,     # ids: never read without HAS_IDS
            logp, entropy, row_max, log_sum,
            N, V, logits.stride(0), logits.stride(1),
            HAS_IDS=ids is not None, BLOCK_R=block_r, BLOCK_V=block_v,
            num_warps=8 if block_r * block_v >= TILE else 4)
    return Stats(logp if ids is not None else None, entropy, row_max, log_sum)


def _check_grad(g, name: str, N: int, device: torch.device) -> torch.Tensor:
    if not isinstance(g, torch.Tensor) or g.shape != (N,) or not g.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of shape [{N}], got "
                         f"{getattr(g, 'dtype', type(g).__name__)} "
                         f"{list(getattr(g, 'shape', []))}")
    if g.device != device:
        raise ValueError(f"{name} ({g.device}) must be on the logits' device ({device})")
    return g.to(torch.float32).contiguous()


def logsoftmax_stats_backward(logits: torch.Tensor, ids: torch.Tensor | None, stats: Stats,
                              g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None, *,
                              block_v: int | None = None, block_rows: int | None = None,
                              trusted: bool = False) -> torch.Tensor:
    """d loss / d logits, [N, V] contiguous in the logits' dtype, from the upstream gradients
    of logp and of the entropy ([N] each; None where that output got none) and the forward's
    `stats` of the same logits and ids."""
    check_logits_arg(logits)
    N, V = logits.shape
    if g_logp is not None:
        if ids is None:
            raise ValueError("g_logp needs the ids the forward read logp at, got ids=None")
        ids = check_ids_arg(ids, logits, trusted)
        g_logp = _check_grad(g_logp, "g_logp", N, logits.device)
    if g_entropy is not None:
        g_entropy = _check_grad(g_entropy, "g_entropy", N, logits.device)
    dlogits = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    if g_logp is None and g_entropy is None:
        return dlogits.zero_()
    if N:
        block_r, block_v = blocks(N, V, block_v, block_rows)
        unused = stats.row_max      # for the pointers the flags leave unread
        _logsoftmax_stats_bwd_kernel[(triton.cdiv(N, block_r),)](
            logits, ids if g_logp is not None else unused, stats.row_max, stats.log_sum,
            stats.entropy, g_logp if g_logp is not None else unused,
            g_entropy if g_entropy is not None else unused, dlogits,
            N, V, logits.stride(0), logits.stride(1),
            HAS_G_LOGP=g_logp is not None, HAS_G_H=g_entropy is not None,
            BLOCK_R=block_r, BLOCK_V=block_v,
            num_warps=8 if block_r * block_v >= TILE else 4)
    return dlogits
