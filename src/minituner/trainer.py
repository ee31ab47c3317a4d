"""The training loop every lab and experiment uses: pretraining, LoRA, QLoRA.

It needs only `model(x) -> logits` and, optionally, `model.aux_loss()` (MoE balancing),
and trains whatever parameters have `requires_grad`, so the same loop pretrains a full
model and fine-tunes adapters on a frozen (or quantized) base. Two features ask more of the
model, and say so when it lacks it: `checkpoint_every` calls
`model.set_gradient_checkpointing(every)`, and `freeze_layers` reads `model.blocks`.

One step: forward and backward over each of its `accumulate` micro-batches (one by default),
the gradients adding up in `.grad`, then the NaN guard, the element-wise clip, the global-norm
clip, the AdamW update. The guard checks every micro-batch's loss and every gradient before
the update; a non-finite one stops training with the whole update skipped, so parameters and
optimizer state are exactly those of the last good step at no cost. It checks the parameters
again after the update: with finite gradients and a finite learning rate, AdamW moves a
weight by a few times lr at most, so this fires only on overflow (fp16 weights, an absurd
lr); undoing that would need a copy of every trainable tensor and its optimizer state before
each step, which the loop does not keep, so it stops and reports the parameters as not
restored.

Gradient accumulation (`accumulate` = k > 1) splits a step's batch_size rows into k
micro-batches of batch_size / k and runs forward and backward on one at a time, so the
activations of only one micro-batch are alive at once (`minituner.memory.predict_training`
with the micro-batch's tokens); gradients, optimizer state and the update are unchanged. Each
micro-batch's summed loss is divided by the whole batch's `loss_normaliser` (its masked-token
count; with example weights its number of rows), not by its own, so the parts' gradients add
up to the whole batch's and the step equals the one-batch step to float rounding, however
the masked tokens fall across the micro-batches. The logged loss is the sum of the parts: the
whole batch's loss. The exception is a MoE's balancing loss `model.aux_loss()`: a statistic
of one forward's routing, not a sum over rows, so each micro-batch adds aux_loss_coef · aux /
k, the mean over the micro-batches (as transformers does); it equals the whole batch's only
for a dense model or aux_loss_coef = 0. LoRA dropout draws its masks micro-batch by
micro-batch, so with dropout the run differs from the one-batch run by the draw. Evaluation
(`val_loss`) runs in batches of batch_size / k rows too. With k = 1 a step is computed
exactly as without the option.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minimoe import update_router_biases

from . import checkpoint as ckpt
from .data import BatchOrder, SequenceData
from .losses import loss_normaliser, mean_loss, sequence_loss
from .metrics_log import MetricsLog
from .optim import clip_gradients, first_nonfinite, lr_at, make_optimizer


@dataclass
class TrainConfig:
    steps: int = 1000            # optimizer steps
    batch_size: int = 64         # sequences per step
    accumulate: int = 1          # split them into this many micro-batches (gradient accumulation)
    lr: float = 3e-3             # peak learning rate
    warmup_steps: int = 50       # linear warm-up from 0 to lr
    min_lr_ratio: float = 0.1    # cosine decay ends at lr · min_lr_ratio
    weight_decay: float = 0.1    # AdamW decay, on matrices only (not norms or 1-D tensors)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0       # clip the global gradient norm to this; 0 turns it off
    grad_clip_value: float = 0.0  # first clamp each gradient element to [-v, v]; 0 turns it off
    aux_loss_coef: float = 0.01  # weight of model.aux_loss() (MoE load balancing)
    train_on_prompt: bool = False  # False: loss on answer tokens only (prompt masking)
    freeze_layers: int = 0       # also freeze the embeddings and the first N of model.blocks
    checkpoint_every: int = 0    # gradient checkpointing in segments of N blocks; 0 off
    val_fraction: float = 0.0    # hold out this fraction of data (drawn from seed) as val
    eval_every: int = 0          # val_loss, eval_fn every this many steps (and at the end)
    log_every: int = 10          # keep the mean loss of every this many steps
    seed: int = 0                # seeds the batch order and the validation split
    save_every: int = 0          # save a resumable state to out_dir/checkpoint; 0 never
    out_dir: str | None = None   # where the checkpoint and metrics.jsonl go
    log_path: str | None = None  # JSONL metrics log (default out_dir/metrics.jsonl if out_dir)
    progress: bool = True        # tqdm progress bar

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("grad_clip", "grad_clip_value", "freeze_layers", "checkpoint_every",
                     "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns it off), got "
                                 f"{getattr(self, name)}")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) \
                or self.accumulate < 1:
            raise ValueError(f"accumulate must be an int >= 1 (micro-batches per step), got "
                             f"{self.accumulate!r}")
        if self.batch_size % self.accumulate:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by accumulate="
                             f"{self.accumulate}: a step's rows split into equal micro-batches")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1] (the cosine decay ends at "
                             f"lr · min_lr_ratio), got {self.min_lr_ratio}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.val_fraction and not self.eval_every:
            raise ValueError("val_fraction > 0 needs eval_every >= 1 (when to compute val_loss)")
        if self.save_every and not self.out_dir:
            raise ValueError("save_every > 0 needs out_dir (where to save the checkpoint)")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)      # mean loss per log_every steps
    grad_norms: list[float] = field(default_factory=list)  # mean global grad norm, same windows
    evals: list[dict] = field(default_factory=list)  # {"step": s, "val_loss"?, **eval_fn(model)}
    steps: int = 0                                   # steps done
    wall_time_s: float = 0.0                         # summed over resumed calls
    stopped_early: dict | None = None  # NaN guard: {step, tensor, reason, last_good_state}

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan


def batches(n: int, cfg: TrainConfig) -> BatchOrder:
    """Index batches forever, reshuffling at every epoch, deterministically from seed."""
    return BatchOrder(n, cfg.batch_size, cfg.seed)


@contextlib.contextmanager
def _prepared(model: torch.nn.Module, cfg: TrainConfig) -> Iterator[None]:
    """Apply freeze_layers and checkpoint_every for one train() call; undo both after."""
    kind = type(model).__name__
    if cfg.checkpoint_every and not callable(getattr(model, "set_gradient_checkpointing", None)):
        raise ValueError(f"checkpoint_every={cfg.checkpoint_every} needs a model with a "
                         f"set_gradient_checkpointing(every) method; {kind} has none")
    frozen = []
    if cfg.freeze_layers:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, torch.nn.ModuleList):
            raise ValueError(f"freeze_layers={cfg.freeze_layers} needs the model's blocks as an "
                             f"nn.ModuleList `model.blocks`; {kind} has none")
        if cfg.freeze_layers > len(blocks):
            raise ValueError(f"freeze_layers={cfg.freeze_layers} exceeds the {len(blocks)} "
                             f"blocks of {kind}")
        embeddings = [m for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Embedding) and not n.startswith("blocks.")]
        for m in [*embeddings, *blocks[:cfg.freeze_layers]]:
            frozen += [p for p in m.parameters() if p.requires_grad]
            m.requires_grad_(False)
    try:
        if cfg.checkpoint_every:
            model.set_gradient_checkpointing(cfg.checkpoint_every)
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
        if cfg.checkpoint_every:
            model.set_gradient_checkpointing(0)


def _split(data: SequenceData, val_data: SequenceData | None, cfg: TrainConfig
           ) -> tuple[SequenceData, SequenceData | None]:
    if val_data is not None and cfg.val_fraction:
        raise ValueError("pass either val_data or cfg.val_fraction, not both")
    if val_data is not None and not cfg.eval_every:
        raise ValueError("val_data needs cfg.eval_every >= 1 (when to compute val_loss)")
    return data.split(cfg.val_fraction, cfg.seed) if cfg.val_fraction else (data, val_data)


class _Run:
    """The state of one training run: model, optimizer, batch order, results so far."""

    def __init__(self, model, data, val_data, cfg, eval_fn):
        self.model, self.data, self.val_data, self.cfg, self.eval_fn = (
            model, data, val_data, cfg, eval_fn)
        self.opt = make_optimizer(model, cfg)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.device = next(model.parameters()).device
        self.order = batches(len(data), cfg)
        self.result = TrainResult()
        self.window: list[float] = []        # losses of the steps since the last log line
        self.window_norms: list[float] = []  # their global gradient norms
        self.step = 0                        # steps done
        self.elapsed_before = 0.0            # wall time of the calls this one resumes
        self.t0 = time.perf_counter()
        self.digest = ckpt.data_digest(data) if cfg.save_every else ""
        self.log: MetricsLog | None = None

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t0

    def open_log(self, resumed: bool) -> None:
        path = self.cfg.log_path or (self.cfg.out_dir and Path(self.cfg.out_dir) / "metrics.jsonl")
        if path:
            self.log = MetricsLog(path, self.step if resumed else None)

    def write(self, record: dict) -> None:
        if self.log:
            self.log.write({**record, "elapsed": round(self.elapsed(), 3)})

    def micro_batches(self, idx: torch.Tensor) -> tuple[list[torch.Tensor], float | None]:
        """A step's rows `idx` in cfg.accumulate parts, and the whole batch's divisor they
        share (None for a single part: sequence_loss divides by its own, as without the
        option). A batch shorter than batch_size (data with fewer rows) splits as evenly as
        it goes; empty parts are dropped."""
        if self.cfg.accumulate == 1:
            return [idx], None
        parts = [p for p in idx.tensor_split(self.cfg.accumulate) if len(p)]
        _, _, mask = self.data.batch(idx, self.cfg.train_on_prompt)
        return parts, loss_normaliser(mask, weighted=self.data.weights is not None)

    def one_step(self, step: int) -> bool:
        """Step `step` (0-based); False when the NaN guard stopped training."""
        cfg, model = self.cfg, self.model
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        parts, normaliser = self.micro_batches(next(self.order))
        aux_coef = cfg.aux_loss_coef / len(parts)     # the balancing loss: micro-batches' mean
        losses, totals = [], []                       # per micro-batch, detached
        self.opt.zero_grad(set_to_none=True)
        try:
            for idx in parts:
                x, y, mask = (t.to(self.device) for t in self.data.batch(idx, cfg.train_on_prompt))
                w = None if self.data.weights is None else self.data.weights[idx].to(self.device)
                loss = sequence_loss(model, x, y, mask, w, normaliser)
                total = loss + aux_coef * model.aux_loss() if hasattr(model, "aux_loss") \
                    else loss
                total.backward()
                losses.append(loss.detach())
                totals.append(total.detach())
        except FloatingPointError as err:    # a layer that refuses NaN (e.g. a MoE router)
            return self.stop(step, "forward", f"non-finite values in the forward ({err}); "
                             "the update was skipped", True)
        finite = torch.isfinite(torch.stack(totals))
        if not finite.all():
            where = "" if len(parts) == 1 else \
                f" in micro-batch {int((~finite).nonzero()[0]) + 1} of {len(parts)}"
            return self.stop(step, "loss", f"non-finite loss{where}; the update was skipped",
                             True)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if not torch.isfinite(norm):
            name = first_nonfinite([(n, p.grad) for n, p in self.named]) or "grad_norm"
            return self.stop(step, name, "non-finite gradient; the update was skipped", True)
        norm = clip_gradients(self.params, cfg, norm)
        self.opt.step()
        update_router_biases(model)     # an MoE router's selection bias (DeepSeek-V3), if any
        # One fused norm per step; the per-tensor scan runs only when it is not finite (and
        # finds nothing when merely the norm of huge but finite weights overflowed).
        params_ok = torch.isfinite(torch.nn.utils.get_total_norm(self.params))
        if not params_ok and (name := first_nonfinite(self.named)):
            return self.stop(step, name, "the update overflowed to a non-finite parameter; "
                             "parameters were not restored", False)
        self.window.append(torch.stack(losses).sum().item())    # the whole batch's loss
        self.window_norms.append(norm.item())
        return True

    def stop(self, step: int, tensor: str, reason: str, last_good_state: bool) -> bool:
        self.result.stopped_early = {"step": step + 1, "tensor": tensor, "reason": reason,
                                     "last_good_state": last_good_state}
        kept = (f"parameters and optimizer state are those after step {step}"
                if last_good_state else "parameters hold non-finite values")
        warnings.warn(f"training stopped at step {step + 1}: {reason} ({tensor}); {kept}",
                      RuntimeWarning, stacklevel=4)
        self.flush_window(step - 1)
        return False

    def flush_window(self, last_step: int) -> None:
        if not self.window:
            return
        loss = sum(self.window) / len(self.window)
        norm = sum(self.window_norms) / len(self.window_norms)
        self.result.losses.append(loss)
        self.result.grad_norms.append(norm)
        self.write({"kind": "train", "step": last_step + 1, "loss": loss,
                    "lr": lr_at(last_step, self.cfg), "grad_norm": norm})
        self.window, self.window_norms = [], []

    def evaluate(self, step: int) -> None:
        entry = {"step": step + 1}
        if self.val_data is not None:
            rows = self.cfg.batch_size // self.cfg.accumulate
            entry["val_loss"] = mean_loss(self.model, self.val_data, rows,
                                          self.cfg.train_on_prompt)
        if self.eval_fn is not None:
            entry.update(self.eval_fn(self.model))
        self.model.train()
        self.result.evals.append(entry)
        self.write({"kind": "eval", **entry})

    def after_step(self, step: int) -> None:
        cfg, last = self.cfg, step == self.cfg.steps - 1
        self.step = step + 1
        if len(self.window) == cfg.log_every or last:
            self.flush_window(step)
        if cfg.eval_every and (self.eval_fn or self.val_data is not None) and (
                self.step % cfg.eval_every == 0 or last):
            self.evaluate(step)
        if cfg.save_every and (self.step % cfg.save_every == 0 or last):
            self.save()

    def save(self) -> None:
        progress = {"step": self.step, "window": self.window,
                    "window_norms": self.window_norms, "elapsed_s": self.elapsed(),
                    "result": {"losses": self.result.losses,
                               "grad_norms": self.result.grad_norms,
                               "evals": self.result.evals}}
        state = ckpt.snapshot(self.named, self.opt, self.order, progress,
                              ckpt.config_fingerprint(self.cfg), self.digest,
                              ckpt.trained_buffers(self.model))
        ckpt.save_state(state, Path(self.cfg.out_dir) / "checkpoint")

    def restore(self, path: str | Path) -> None:
        state = ckpt.load_state(path)
        ckpt.check_compatible(state, ckpt.config_fingerprint(self.cfg),
                              self.digest or ckpt.data_digest(self.data),
                              {n: p.shape for n, p in self.named})
        ckpt.restore(state, self.named, self.opt, self.order, ckpt.trained_buffers(self.model))
        pr = state.progress
        self.step, self.elapsed_before = pr["step"], pr["elapsed_s"]
        self.window, self.window_norms = pr["window"], pr["window_norms"]
        self.result = TrainResult(**pr["result"], steps=self.step)


def train(model: torch.nn.Module, data: SequenceData, cfg: TrainConfig,
          eval_fn: Callable[[torch.nn.Module], dict] | None = None, *,
          val_data: SequenceData | None = None, resume: str | Path | None = None,
          stop_after: int | None = None) -> TrainResult:
    """Train `model`'s trainable parameters on `data` for `cfg.steps` AdamW steps.

    `val_data` (or `cfg.val_fraction` of `data`) gives `val_loss` at every evaluation.
    `resume` is a checkpoint directory (`out_dir/checkpoint`) to continue from; the run then
    ends exactly as an uninterrupted one would. `stop_after` returns once that many steps are
    done, as an interruption would (no final log window, evaluation or save).
    """
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"stop_after must be >= 1, got {stop_after}")
    data, val_data = _split(data, val_data, cfg)
    with _prepared(model, cfg):
        run = _Run(model, data, val_data, cfg, eval_fn)
        if resume is not None:
            run.restore(resume)
        run.open_log(resumed=resume is not None)
        model.train()
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        try:
            with tqdm(range(run.step, end), desc="train", disable=not cfg.progress,
                      mininterval=1.0, initial=run.step, total=cfg.steps) as bar:
                for step in bar:
                    if not run.one_step(step):
                        break
                    run.after_step(step)
                    if run.result.losses:
                        bar.set_postfix(loss=f"{run.result.losses[-1]:.4f}")
        finally:
            if run.log:
                run.log.close()
    run.result.steps = run.step
    run.result.wall_time_s = run.elapsed()
    return run.result
