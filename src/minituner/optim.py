"""The update of a training step: AdamW with decay on matrices only, the learning-rate
schedule, the gradient clip, and the NaN guard's search for the tensor that went bad.
`cfg` is any config with TrainConfig's field names (minirl's GRPOConfig shares them).

    make_optimizer(model, cfg)          AdamW over what requires_grad
    lr_at(step, cfg)                    linear warm-up, then cosine to lr · min_lr_ratio
    clip_gradients(params, cfg, norm)   element-wise clip, then the global-norm clip
    first_nonfinite(named)              the first tensor holding NaN or Inf, by name

The training loop (trainer.py) imports them from here; `minituner.trainer.lr_at` and the rest
are the same objects.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, cfg) -> float:
    """Linear warm-up, then cosine decay to lr · min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (all requires_grad=False)")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def clip_gradients(params: list[torch.Tensor], cfg,
                   norm: torch.Tensor | None = None) -> torch.Tensor:
    """Clamp each gradient element to ±grad_clip_value, then scale all gradients together so
    their global L2 norm is at most grad_clip; returns the norm the second clip saw.

    Element-wise first, so that one huge element is cut down before it enters the global
    norm, where it would otherwise shrink every other gradient. `norm` is the global norm of
    the gradients as they are, if already computed.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if cfg.grad_clip_value > 0:
        torch.nn.utils.clip_grad_value_(params, cfg.grad_clip_value)
        norm = None
    if norm is None:
        norm = torch.nn.utils.get_total_norm(grads)
    if cfg.grad_clip > 0:
        # get_total_norm + clip_grads_with_norm_ is exactly clip_grad_norm_, split so that
        # the guard can look at the norm first.
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm)
    return norm


def first_nonfinite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """Name of the first tensor holding a NaN or an infinity (None tensors are skipped)."""
    return next((n for n, t in named if t is not None and not torch.isfinite(t).all()), None)
