"""Selective log-softmax and entropy from logits [N, V] on Triton, with autograd.

`LogSoftmaxStats` runs one streaming pass over each row of logits for the forward
(logprob_kernels.py has the pseudocode and the derivation of the gradients) and keeps three
floats per row — max, log Σ exp(z − max) and the entropy — besides the logits themselves,
which autograd holds anyway. Its backward is one more pass that writes d logits; when both
logp and the entropy were used, both upstream gradients go into that one pass. PyTorch's
`entropy_from_logits` keeps [N, V] float32 tensors for its backward instead (log_softmax's
output and its exp) and builds several more while it runs; the PyTorch selective
log-softmax keeps none (it runs a block of rows at a time, logprobs.py).

Results are float32 for float32, bf16 and fp16 logits (reduced in float32); gradients come
back in the logits' dtype. −Inf logits are probability 0; an id whose logit is −Inf has
logp = −Inf; a row that is −Inf everywhere has NaN logp, entropy and gradient, as PyTorch's
log_softmax. NaN or +Inf logits → `NonFiniteLogitsError` naming the rows (checked on the
[N] row sums the kernel returns, not on an [N, V] mask). In the interpreter (no GPU) float32
only.

`selective_log_softmax(..., backend="triton")` and `token_logprobs(..., backend="triton")`
(hence the GRPO loss) reach this module through `minirl.logprobs.IMPLEMENTATIONS`, which
imports it on first use. This module imports without triton; the kernels
(logprob_kernels.py, which imports triton) load at the first launch, and without triton that
launch raises `TritonUnavailableError`.
"""

from __future__ import annotations

import functools
import importlib

import torch

from .logprobs import NonFiniteLogitsError

__all__ = ["LogSoftmaxStats", "entropy_from_logits_triton", "logprobs_and_entropy_triton",
           "selective_log_softmax_triton"]


@functools.cache
def _kernels():
    """minirl.logprob_kernels, imported at the first launch (a failure is not cached)."""
    return importlib.import_module(".logprob_kernels", __package__)


def _check_finite(log_sum: torch.Tensor) -> None:
    """log Σ exp(z − max) is NaN exactly for the rows holding NaN or +Inf (one host sync)."""
    bad = torch.isnan(log_sum)
    if bad.any():
        rows = bad.nonzero()[:, 0].tolist()
        raise NonFiniteLogitsError(f"logits hold NaN or +Inf in {len(rows)} rows (the first "
                                   f"{rows[:5]}); their log-probabilities would be NaN")


class LogSoftmaxStats(torch.autograd.Function):
    """(logits [N, V], ids [N] int64 or None) -> (logp [N] or None, entropy [N]), float32.

    `trusted=True`: the caller has checked that the ids lie in [0, V) and the logits hold no
    NaN or +Inf (`selective_log_softmax` does), which saves two host syncs.
    """

    @staticmethod
    def forward(ctx, logits, ids, block_v=None, block_rows=None, trusted=False):
        stats = _kernels().logsoftmax_stats_forward(logits, ids, block_v=block_v,
                                                    block_rows=block_rows, trusted=trusted)
        if not trusted:
            _check_finite(stats.log_sum)
        ctx.set_materialize_grads(False)        # an unused output's gradient stays None
        ctx.save_for_backward(logits, ids, stats.entropy, stats.row_max, stats.log_sum)
        ctx.blocks = dict(block_v=block_v, block_rows=block_rows)
        return stats.logp, stats.entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, ids, entropy, row_max, log_sum = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        kernels = _kernels()
        stats = kernels.Stats(None, entropy, row_max, log_sum)
        dlogits = kernels.logsoftmax_stats_backward(logits, ids, stats, g_logp, g_entropy,
                                                    trusted=True, **ctx.blocks)
        return dlogits, None, None, None, None


def logprobs_and_entropy_triton(logits: torch.Tensor, ids: torch.Tensor, *,
                                block_v: int | None = None, block_rows: int | None = None,
                                trusted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits)[i, ids[i]], entropy of softmax(logits[i])), [N] float32 each, for
    logits [N, V] (any strides) and ids [N] int64: one pass forward, one backward.

    `block_v` (vocabulary columns per step) and `block_rows` (rows per program), powers of
    two, override the defaults (logprob_kernels.blocks); `trusted` as `LogSoftmaxStats`.
    """
    if ids is None:
        raise ValueError("ids must be an int64 tensor of token ids, got None "
                         "(entropy_from_logits_triton takes logits alone)")
    return LogSoftmaxStats.apply(logits, ids, block_v, block_rows, trusted)


def selective_log_softmax_triton(logits: torch.Tensor, ids: torch.Tensor, *,
                                 block_v: int | None = None, block_rows: int | None = None,
                                 trusted: bool = False) -> torch.Tensor:
    """log_softmax(logits, -1)[i, ids[i]] -> [N] float32; as `logprobs_and_entropy_triton`."""
    return logprobs_and_entropy_triton(logits, ids, block_v=block_v, block_rows=block_rows,
                                       trusted=trusted)[0]


def entropy_from_logits_triton(logits: torch.Tensor, *, block_v: int | None = None,
                               block_rows: int | None = None) -> torch.Tensor:
    """−Σ_v p_v log p_v of softmax(logits[i]) -> [N] float32, for logits [N, V]."""
    return LogSoftmaxStats.apply(logits, None, block_v, block_rows, False)[1]
