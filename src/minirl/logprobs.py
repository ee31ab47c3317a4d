"""Token log-probabilities of sampled completions, under the policy and a frozen reference.

GRPO needs log p(token) of every completion token three times: under the policy being
trained (with gradients), under the policy that sampled them (`old`, no gradients) and under
a frozen reference (for the KL term). All three come from one forward over the sampled
tokens and one `selective_log_softmax`: the log-softmax of each row of logits, read at one
id, logit[id] − logsumexp(logits).

The PyTorch backend is an autograd Function with the bits of autograd through
logit[id] − logsumexp(logits) (bf16 / fp16 logits in float32), value and gradient alike, so
the recorded experiments do not move. It keeps nothing of size [N, V] for its backward but
the logits themselves (bf16 / fp16 ones too, with no float32 copy): forward, logsumexp over
a block of rows at a time, kept as lse [N]; backward, g · (onehot(id) − exp(z − lse))
written block by block into the [N, V] gradient (for bf16 / fp16 logits through one float32
block). On a CPU a block is sized to stay in the L2 cache, so each pass over it after the
first reads the cache, not memory, and the buffers are small beside the gradient; on a GPU,
where the Triton backend is the fast path, the whole [N, V] is one block.

`IMPLEMENTATIONS` is the one place an implementation is chosen: a backend name mapped to a
function `(logits [N, V], ids [N]) -> [N]`. "torch" is the reference; "triton" is the
streaming kernel of logprob_triton.py (one pass per row forward and backward, three floats
per row kept), imported on its first call so that `import minirl` does not build it, and
`token_logprobs(..., backend=)` passes the name through. `entropy_from_logits` is the
PyTorch reference of the entropy the same kernel computes.

The reference of a LoRA / QLoRA policy is its own frozen base: `adapters_off(model)` sets the
scaling of every adapter (LoRALinear, and the expert LoRA of ExpertLinear / NF4Experts) to 0
for the duration of a `with` block, so the forward is the base's exactly (adding s·0 = 0),
with no copy of the model. A fully fine-tuned policy needs an explicit reference model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from minimoe import ExpertLinear, NF4Experts, NonFiniteLogitsError
from minituner import LoRALinear


def check_logits(logits: torch.Tensor, what: str) -> None:
    """Raise NonFiniteLogitsError if `logits` [..., V] hold NaN or +Inf (−Inf, probability 0,
    is fine).

    The max of a row is NaN or +Inf exactly when the row holds one, so the look is one
    reduction to [rows] (no [..., V] mask of the whole tensor) and one host sync; only the
    rows it flags are searched for the count and the first position.
    """
    if logits.numel() == 0:
        return
    rows = logits.detach().reshape(-1, logits.shape[-1])                  # [R, V]
    top = rows.amax(dim=1)                                                # [R], NaN propagates
    flagged = torch.isnan(top) | (top == float("inf"))
    if flagged.any():
        index = flagged.nonzero()[:, 0]
        bad = torch.isnan(rows[index]) | (rows[index] == float("inf"))   # [flagged, V]
        row, col = bad.nonzero()[0].tolist()
        lead = torch.unravel_index(index[row], logits.shape[:-1])
        first = (*(int(i) for i in lead), col)
        raise NonFiniteLogitsError(f"{what} hold NaN or +Inf ({int(bad.sum())} values, the "
                                   f"first at {first}); their log-probabilities would be NaN")


# Elements of logits per block of rows on a CPU: 2^18, 1 MiB of float32, which stays in the
# L2 cache between the passes over a block (max, exp, sum; forward and backward alike).
_CPU_BLOCK_ELEMENTS = 1 << 18


def _row_blocks(logits: torch.Tensor) -> list[slice]:
    """The row ranges of logits [N, V] that the PyTorch backend processes one at a time."""
    N, V = logits.shape
    rows = max(1, _CPU_BLOCK_ELEMENTS // max(V, 1)) if logits.device.type == "cpu" else N
    return [slice(r, r + rows) for r in range(0, N, rows)]


def _reduced_dtype(logits: torch.Tensor) -> torch.dtype:
    """float64 for float64 logits, float32 otherwise (a sum of exp over V needs float32)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _block_buffer(logits: torch.Tensor, blocks: list[slice], dtype: torch.dtype
                  ) -> torch.Tensor:
    """An empty [rows of the first block, V] tensor of `dtype`, reused by every block."""
    rows = blocks[0].stop if blocks else 0
    return logits.new_empty((min(rows, logits.shape[0]), logits.shape[1]), dtype=dtype)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """(logits [N, V], ids [N] int64) -> log_softmax(logits)[i, ids[i]], [N] in
    `_reduced_dtype`; saves the logits, ids and lse [N]. Twice differentiable: under
    create_graph the backward takes the recorded path, `graph_backward`."""

    @staticmethod
    def forward(ctx, logits, ids):
        dtype, blocks = _reduced_dtype(logits), _row_blocks(logits)
        lse = logits.new_empty(logits.shape[0], dtype=dtype)                      # [N]
        logp = torch.empty_like(lse)                                              # [N]
        for rows in blocks:
            x = logits[rows].to(dtype)                                            # [r, V]
            torch.logsumexp(x, 1, out=lse[rows])
            torch.sub(x.gather(1, ids[rows, None])[:, 0], lse[rows], out=logp[rows])
        ctx.save_for_backward(logits, ids, lse)
        return logp

    @staticmethod
    def backward(ctx, g):                                                         # g [N]
        logits, ids, lse = ctx.saved_tensors
        if torch.is_grad_enabled():         # create_graph=True: differentiable, for a 2nd order
            return _SelectiveLogSoftmax.graph_backward(logits, ids, g), None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [N, V]
        blocks = _row_blocks(logits)
        # bf16 / fp16 logits: each block is formed in float32, then rounded into grad.
        work = None if lse.dtype == logits.dtype else _block_buffer(logits, blocks, lse.dtype)
        for rows in blocks:
            x = logits[rows]                                                      # [r, V]
            out = grad[rows] if work is None else work[:len(x)]                   # [r, V]
            torch.sub(x, lse[rows, None], out=out)                                # z − lse
            # −g·p, + 0 as the sum of the two branches' gradients (−0 to +0 where g = 0,
            # the masked tokens), then + g at the id: the reference's bits exactly.
            out.exp_().mul_(-g[rows, None]).add_(0.0)
            out.scatter_add_(1, ids[rows, None], g[rows, None])
            if work is not None:
                grad[rows].copy_(out)
        return grad, None

    @staticmethod
    def graph_backward(logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """g · (onehot(ids) − softmax(logits)) [N, V] with out-of-place ops that autograd
        records (several [N, V] tensors, as a plain log_softmax's backward)."""
        p = torch.softmax(logits, 1, dtype=_reduced_dtype(logits))                # [N, V]
        grad = (-g[:, None] * p).scatter_add(1, ids[:, None], g[:, None])         # [N, V]
        return grad.to(logits.dtype)


def _selective_log_softmax_torch(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return _SelectiveLogSoftmax.apply(logits, ids)


def _selective_log_softmax_triton(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # Imported here, at the first call: importing it builds the kernels. The caller,
    # selective_log_softmax, has checked the ids' range and the logits' finiteness.
    from .logprob_triton import selective_log_softmax_triton

    return selective_log_softmax_triton(logits, ids, trusted=True)


# backend -> fn(logits [N, V], ids [N] int64) -> [N] (float32, float64 for float64 logits;
# the Triton kernel takes float32, bf16 and fp16 logits, float32 only in its interpreter).
IMPLEMENTATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch": _selective_log_softmax_torch,
    "triton": _selective_log_softmax_triton,
}


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor, backend: str = "torch"
                          ) -> torch.Tensor:
    """log_softmax(logits, -1)[i, ids[i]] for logits [N, V], ids [N] -> [N], in float32
    (float64 for float64 logits). NaN or +Inf logits -> NonFiniteLogitsError."""
    if backend not in IMPLEMENTATIONS:
        raise ValueError(f"backend must be one of {sorted(IMPLEMENTATIONS)}, got {backend!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 \
            or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point [N, V] tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} "
                         f"{list(getattr(logits, 'shape', []))}")
    N, V = logits.shape
    if not isinstance(ids, torch.Tensor) or ids.shape != (N,) or ids.dtype != torch.long:
        raise ValueError(f"ids must be an int64 tensor of shape [{N}] (one id per row of "
                         f"logits), got {getattr(ids, 'dtype', type(ids).__name__)} "
                         f"{list(getattr(ids, 'shape', []))}")
    if N and not ((ids >= 0) & (ids < V)).all():
        raise ValueError(f"ids must lie in 0..{V - 1} (the logits' vocabulary), got "
                         f"{int(ids.min())}..{int(ids.max())}")
    check_logits(logits, "logits")
    return IMPLEMENTATIONS[backend](logits, ids)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """−Σ_v p_v log p_v of softmax(logits[i]) for logits [N, V] -> [N], in float32 (float64
    for float64 logits; fp16/bf16 reduced in float32). The plain-PyTorch reference of
    `entropy_from_logits_triton`: it keeps [N, V] log-probabilities and probabilities for its
    backward. −Inf logits are probability 0 and add 0 (and get gradient 0); a row that is −Inf
    everywhere gives NaN, as log_softmax. NaN or +Inf logits -> NonFiniteLogitsError."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 \
            or not logits.is_floating_point() or logits.shape[1] == 0:
        raise ValueError(f"logits must be a floating-point [N, V] tensor with V >= 1, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} "
                         f"{list(getattr(logits, 'shape', []))}")
    check_logits(logits, "logits")
    if logits.element_size() < 4:
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=1)                                 # [N, V]
    # 0 · log 0 is 0: the where keeps −Inf · 0 = NaN out of the value and the gradient.
    return -(logp.exp() * torch.where(torch.isneginf(logits), 0.0, logp)).sum(dim=1)


def token_logprobs(model, samples, backend: str = "torch", temperature: float = 1.0
                   ) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) under `model` at `temperature`, [P·G, L-1]
    float32, 0 wherever `samples.target_mask` is False (prompt and padding).

    `temperature` must be the one the tokens were sampled at: the sampling distribution is
    softmax(logits / T), so the ratio of the GRPO loss compares log-probs of that distribution
    (TRL scores the same way); scoring at T = 1 what was sampled at T ≠ 1 gives every ratio
    and KL the wrong distribution. Gradients flow when called with grad enabled (the policy);
    wrap in `torch.no_grad()` for the old policy. The model's mode is left alone: LoRA dropout
    in training mode makes the policy's log-probs noisy, so GRPO runs use dropout 0.
    """
    if not (isinstance(temperature, int | float) and math.isfinite(temperature)
            and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (the sampling "
                         f"temperature), got {temperature!r}")
    device = next(model.parameters()).device
    tokens = samples.tokens.to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]                                  # [B, L-1]
    logits = model(x)                                                     # [B, L-1, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits.flatten(0, 1), y.flatten(), backend).view(y.shape)
    return torch.where(samples.target_mask.to(device), logp, 0.0)


def _adapter_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules()
            if isinstance(m, LoRALinear)
            or (isinstance(m, ExpertLinear | NF4Experts) and m.lora_A is not None)]


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model` computes its frozen base: every LoRA scaling is 0.

    Restores each scaling on exit, also on an exception. Refuses a model without adapters
    (pass a reference model instead) and one with merged LoRALinear layers, whose update is
    inside the base weight where a scaling of 0 cannot reach it (unmerge them first).
    """
    layers = _adapter_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no LoRA adapters, so it has no frozen "
                         f"base to switch to; pass the reference model explicitly")
    merged = [n for n, m in model.named_modules() if isinstance(m, LoRALinear) and m.merged]
    if merged:
        raise ValueError(f"LoRA layers {merged[:3]} are merged into their base weight; "
                         f"unmerge() them before switching the adapters off")
    saved = [m.scaling for m in layers]
    try:
        for m in layers:
            m.scaling = 0.0
        yield model
    finally:
        for m, s in zip(layers, saved, strict=True):
            m.scaling = s


@torch.no_grad()
def reference_logprobs(model: nn.Module, samples, reference: nn.Module | None = None,
                       backend: str = "torch", temperature: float = 1.0) -> torch.Tensor:
    """`token_logprobs` under the frozen reference at `temperature`, no gradients: `reference`
    when given, else `model` with its adapters off (the base of a LoRA / QLoRA policy)."""
    if reference is not None:
        return token_logprobs(reference, samples, backend, temperature)
    with adapters_off(model):
        return token_logprobs(model, samples, backend, temperature)
