"""The training loss: prompt-masked, optionally reward-weighted cross-entropy over a batch of
sequences, what it is divided by (one place, so that micro-batches add up to their whole
batch), and the loss of a whole dataset for evaluation.

    sequence_loss(model, x, y, mask, weights=None, normaliser=None)   one batch's loss
    loss_normaliser(mask, weighted=False)                             what it divides by
    mean_loss(model, data, batch_size=64)                             a dataset's, eval mode

The training loop (trainer.py) imports them from here; `minituner.trainer.sequence_loss` and
the rest are the same objects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import SequenceData


def _token_ce(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every next-token target, [b·l] float32."""
    logits = model(x)                                                  # [b, l, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")


def sequence_loss(model, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                  weights: torch.Tensor | None = None, normaliser: float | None = None
                  ) -> torch.Tensor:
    """Mean cross-entropy over the tokens where mask is True (the loop's default arithmetic,
    which experiment 00's manifest pins bit for bit).

    With example `weights` [b]: each example's masked mean cross-entropy, times its weight,
    averaged over the batch, Σ w_i·loss_i / b. Dividing by b rather than Σ w_i keeps the
    batch an unbiased sample of the dataset's weighted loss (weights average 1 over the data)
    and makes a batch of zero-weight examples contribute 0, not 0/0.

    `normaliser` replaces the divisor (the masked-token count, or b with weights) by another
    batch's: given a whole batch's `loss_normaliser`, the losses of its micro-batches add up
    to the whole batch's loss. None (the default) divides by this batch's own, as always.
    """
    ce = _token_ce(model, x, y)
    if weights is None:
        m = mask.flatten().float()
        total = (ce * m).sum()
        return total / (m.sum().clamp(min=1.0) if normaliser is None else normaliser)
    m = mask.float()                                                   # [b, l]
    per_example = (ce.view_as(m) * m).sum(1) / m.sum(1).clamp(min=1.0)   # [b]
    weighted = weights.to(per_example) * per_example
    return weighted.mean() if normaliser is None else weighted.sum() / normaliser


def loss_normaliser(mask: torch.Tensor, weighted: bool = False) -> float:
    """What `sequence_loss` divides a batch's summed loss by: its masked tokens [b, l] (at
    least 1), or with example weights its b rows. Pass a whole batch's to `sequence_loss` for
    each of its micro-batches and the parts add up to the whole batch's loss (and gradient);
    dividing each part by its own count would weight a token of a sparse micro-batch more."""
    return float(mask.shape[0]) if weighted else float(mask.sum().clamp(min=1))


@torch.no_grad()
def mean_loss(model: torch.nn.Module, data: SequenceData, batch_size: int = 64,
              train_on_prompt: bool = False) -> float:
    """Unweighted mean cross-entropy over every scored token of `data`, in eval mode."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0.0
    for start in range(0, len(data), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(data)))
        x, y, mask = (t.to(device) for t in data.batch(idx, train_on_prompt))
        m = mask.flatten().float()
        total += float((_token_ce(model, x, y) * m).sum(dtype=torch.float64))
        count += float(m.sum())
    model.train(was_training)
    return total / max(count, 1.0)
