"""The training loop every lab and experiment uses: pretraining, LoRA, QLoRA.

It needs only `model(x) -> logits` and, optionally, `model.aux_loss()` (MoE balancing),
and trains whatever parameters have `requires_grad`, so the same loop pretrains a full
model and fine-tunes adapters on a frozen (or quantized) base.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .data import SequenceData


@dataclass
class TrainConfig:
    steps: int = 1000            # optimizer steps
    batch_size: int = 64         # sequences per step
    lr: float = 3e-3             # peak learning rate
    warmup_steps: int = 50       # linear warm-up from 0 to lr
    min_lr_ratio: float = 0.1    # cosine decay ends at lr · min_lr_ratio
    weight_decay: float = 0.1    # AdamW decay, on matrices only (not norms or 1-D tensors)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0       # clip the global gradient norm to this; 0 turns it off
    aux_loss_coef: float = 0.01  # weight of model.aux_loss() (MoE load balancing)
    train_on_prompt: bool = False  # False: loss on answer tokens only (prompt masking)
    eval_every: int = 0          # call eval_fn every this many steps (and at the end); 0 never
    log_every: int = 10          # keep the mean loss of every this many steps
    seed: int = 0                # seeds the batch order
    progress: bool = True        # tqdm progress bar

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)   # mean loss per log_every steps
    evals: list[dict] = field(default_factory=list)     # {"step": s, **eval_fn(model)}
    steps: int = 0
    wall_time_s: float = 0.0

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr · min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (all requires_grad=False)")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def batches(n: int, cfg: TrainConfig):
    """Yield index batches forever, reshuffling at every epoch, deterministically from seed."""
    g = torch.Generator().manual_seed(cfg.seed)
    while True:
        perm = torch.randperm(n, generator=g)
        # Drop the last partial batch, but keep one (smaller) batch when n < batch_size.
        for i in range(0, max(n - cfg.batch_size, 0) + 1, cfg.batch_size):
            yield perm[i:i + cfg.batch_size]


def sequence_loss(model, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens where mask is True."""
    logits = model(x)                                                  # [b, l, V]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    m = mask.flatten().float()
    return (ce * m).sum() / m.sum().clamp(min=1.0)


def train(model: torch.nn.Module, data: SequenceData, cfg: TrainConfig,
          eval_fn: Callable[[torch.nn.Module], dict] | None = None) -> TrainResult:
    """Train `model`'s trainable parameters on `data` for `cfg.steps` AdamW steps."""
    opt = make_optimizer(model, cfg)
    device = next(model.parameters()).device
    result, window = TrainResult(), []
    t0 = time.perf_counter()
    model.train()
    bar = tqdm(range(cfg.steps), desc="train", disable=not cfg.progress, mininterval=1.0)
    for step, idx in zip(bar, batches(len(data), cfg), strict=False):  # batches() is endless
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y, mask = (t.to(device) for t in data.batch(idx, cfg.train_on_prompt))
        loss = sequence_loss(model, x, y, mask)
        total = loss + cfg.aux_loss_coef * model.aux_loss() if hasattr(model, "aux_loss") \
            else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
        opt.step()
        window.append(loss.item())
        if len(window) == cfg.log_every or step == cfg.steps - 1:
            result.losses.append(sum(window) / len(window))
            bar.set_postfix(loss=f"{result.losses[-1]:.4f}")
            window = []
        if eval_fn and cfg.eval_every and ((step + 1) % cfg.eval_every == 0
                                           or step == cfg.steps - 1):
            result.evals.append({"step": step + 1, **eval_fn(model)})
            model.train()
    result.steps = cfg.steps
    result.wall_time_s = time.perf_counter() - t0
    return result
