"""GRPO's online loop: sample a group per prompt, score it, weight each answer by its advantage
within the group, update; with minituner's NaN guard and an asynchronous option.

One step (iteration) of `grpo_train`:

    prompts  <- the next P of `prompts` (reshuffled every epoch, from the seed)
    samples  <- G completions of each, from the behaviour policy, at T   [P·G rows]
    old_logp <- their log-probs under the policy that sampled them, at T  (no grad)
    A        <- group_advantages(reward(prompt, completion))               [P, G]
    ref_logp <- log-probs under the reference (the base: adapters off)    (no grad)
    A all 0, no KL, no replay:  no update (`skip_zero_advantage`)
    repeat inner_steps:  loss = grpo_loss(logp, old_logp, A, mask, ε, ref_logp, β, ...)
                              + replay_coef · CE(replay batch)             AdamW step

Every log-prob is scored at the sampling temperature T (`token_logprobs(..., temperature)`):
the ratio compares the distribution the tokens were drawn from. `accumulate` splits the
P·G rows into micro-batches, each forward and backward in turn before the one AdamW step; each
part carries the whole batch's normalisation (grpo_loss's `totals`), so the update is the
whole batch's, and the activations held at once are one micro-batch's.

Synchronous: the behaviour policy is the policy itself, so old_logp = logp at the first inner
step (ratio 1). Asynchronous (`async_generation`): a background thread samples step i+1's batch
from a snapshot of the policy taken before step i's update, while step i updates; each batch
is one update stale (policy lag 1) and the clipped ratio logp − old_logp corrects for it. The
snapshot is a separate model and the sampler has its own generator, so the run is as
deterministic as the synchronous one; on a CPU the two halves share the cores, so the point
there is the effect of staleness on learning, not speed.

The NaN guard is minituner's: a non-finite loss or gradient stops the run with the update
skipped (parameters and optimizer state those of the last good step); non-finite logits while
sampling or scoring (`NonFiniteLogitsError`) stop it the same way; an update that overflows a
parameter stops it with the parameters not restored. `GRPOResult.stopped_early` says which.
Rewards are the caller's: a reward that raises or returns NaN is a bug, and `score` raises.

The configuration shares minituner's field names (lr, warmup_steps, min_lr_ratio,
weight_decay, betas, grad_clip, grad_clip_value), so its optimizer, schedule and clipping
serve here unchanged; `steps` counts iterations.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minigpt import CharTokenizer
from minigpt.tasks import Example
from minimoe import update_router_biases
from minituner import SequenceData
from minituner.data import BatchOrder
from minituner.metrics_log import MetricsLog
from minituner.trainer import (
    clip_gradients,
    first_nonfinite,
    lr_at,
    make_optimizer,
    sequence_loss,
)

from .advantages import SCALES, group_advantages, variance_fraction
from .grpo import check_family, grpo_loss
from .logprobs import IMPLEMENTATIONS, reference_logprobs, token_logprobs
from .replay import replay_examples
from .rewards import Reward, score
from .sampling import Samples, sample_groups
from .weighting import sft_pairs


@dataclass
class GRPOConfig:
    steps: int = 150              # iterations: sample one batch, then inner_steps updates on it
    prompts_per_step: int = 8     # P prompts per batch
    group_size: int = 8           # G completions per prompt (>= 2: advantages compare them)
    max_new_tokens: int = 8       # completion length cap (the <eos> counts)
    temperature: float = 1.0      # sampling temperature
    inner_steps: int = 1          # AdamW steps per batch; > 1 moves the ratio off 1 (clipping)
    clip_eps: float = 0.2         # ratio clipped to [1 − ε, 1 + ε_high]
    epsilon_high: float | None = None  # upper clip ε_high (DAPO's clip-higher); None: clip_eps
    loss_type: str = "grpo"       # token-loss aggregation: grpo | bnpo | dr_grpo | dapo (grpo.py)
    importance_sampling_level: str = "token"  # "sequence": one ratio per completion (GSPO)
    scale_rewards: str = "group"  # advantages over the group's std | the batch's | "none"
    adv_eps: float = 1e-6         # eps of the advantages' std (TRL uses 1e-4; advantages.py)
    kl_coef: float = 0.0          # β of the k3 KL to the reference; 0 off (the KL is still logged)
    kl_bias_correction: bool = False  # weight k3 by the importance ratio (DeepSeek-V3.2)
    skip_zero_advantage: bool = True  # no update from a batch whose advantages are all 0
    accumulate: int = 1           # micro-batches per update (same update, less activation memory)
    replay_batch: int = 0         # pretraining examples per update, plain CE on their answers
    replay_coef: float = 1.0      # weight of that CE term
    async_generation: bool = False  # sample the next batch while this one updates (lag 1)
    backend: str = "torch"        # log-prob implementation: a key of minirl.IMPLEMENTATIONS
    lr: float = 1e-3              # peak learning rate
    warmup_steps: int = 0         # linear warm-up, in iterations
    min_lr_ratio: float = 1.0     # cosine decay to lr · this; 1.0 keeps the lr constant
    weight_decay: float = 0.0     # AdamW decay on matrices (LoRA's A and B)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0        # global gradient-norm clip; 0 off
    grad_clip_value: float = 0.0  # element-wise clip first; 0 off
    seed: int = 0                 # prompt order, sampling, replay order
    log_path: str | None = None   # JSONL, one record per iteration
    progress: bool = True         # tqdm progress bar

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "max_new_tokens", "inner_steps", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.prompts_per_step * self.group_size) % self.accumulate:
            raise ValueError(f"accumulate={self.accumulate} must divide the batch's "
                             f"prompts_per_step · group_size = "
                             f"{self.prompts_per_step * self.group_size} sequences")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got "
                             f"{self.temperature!r}")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"scale_rewards must be one of {SCALES}, got "
                             f"{self.scale_rewards!r}")
        grpo_loss_options(self)            # loss_type and the rest, checked as grpo_loss does
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO compares the answers to one "
                             f"prompt with each other), got {self.group_size}")
        for name in ("kl_coef", "replay_batch", "replay_coef", "warmup_steps", "grad_clip",
                     "grad_clip_value"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.backend not in IMPLEMENTATIONS:
            raise ValueError(f"backend must be one of {sorted(IMPLEMENTATIONS)}, got "
                             f"{self.backend!r}")


@dataclass
class GRPOResult:
    records: list[dict] = field(default_factory=list)  # one per iteration (see `_record`)
    steps: int = 0                                      # iterations done
    wall_time_s: float = 0.0
    stopped_early: dict | None = None   # NaN guard: {step, tensor, reason, last_good_state}

    def curve(self, key: str) -> list[float]:
        return [r[key] for r in self.records]


@dataclass
class _Batch:
    prompts: list[Example]
    samples: Samples
    old_logp: torch.Tensor | None   # [P·G, L-1] under the sampling policy; None: the policy's


class _Sampler:
    """Draws batches: from the policy itself, or (async) from a snapshot in a worker thread."""

    def __init__(self, model, prompts, cfg: GRPOConfig):
        self.model, self.prompts, self.cfg = model, list(prompts), cfg
        self.order = BatchOrder(len(self.prompts), cfg.prompts_per_step, cfg.seed)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.actor = copy.deepcopy(model).requires_grad_(False) if cfg.async_generation else None
        self.pool = ThreadPoolExecutor(1) if cfg.async_generation else None
        self.pending: Future | None = None

    def _draw(self, model) -> _Batch:
        cfg = self.cfg
        prompts = [self.prompts[i] for i in next(self.order).tolist()]
        samples = sample_groups(model, prompts, cfg.group_size, cfg.max_new_tokens,
                                temperature=cfg.temperature, generator=self.generator)
        old = None
        if model is self.actor:
            with torch.no_grad():
                old = token_logprobs(model, samples, cfg.backend, cfg.temperature)
        return _Batch(prompts, samples, old)

    def _snapshot_and_submit(self) -> None:
        with torch.no_grad():
            for a, p in zip(self.actor.parameters(), self.model.parameters(), strict=True):
                a.copy_(p)
        self.pending = self.pool.submit(self._draw, self.actor)

    def next(self) -> _Batch:
        """This step's batch; in async mode the next one starts sampling before returning."""
        if self.pool is None:
            return self._draw(self.model)
        if self.pending is None:
            self._snapshot_and_submit()
        batch = self.pending.result()
        self._snapshot_and_submit()        # from the policy before this step's update
        return batch

    def close(self) -> None:
        if self.pool is not None:
            if self.pending is not None:
                self.pending.cancel()
                try:
                    self.pending.result()
                except Exception:   # noqa: BLE001 - a stopped run drops its unused batch
                    pass
            self.pool.shutdown(wait=True)


def _replay_data(cfg: GRPOConfig) -> tuple[SequenceData, BatchOrder] | None:
    if not cfg.replay_batch:
        return None
    tok = CharTokenizer()
    n = max(cfg.replay_batch * cfg.steps, cfg.replay_batch)
    ex = replay_examples(n, cfg.seed)
    data = SequenceData.from_pairs(sft_pairs([e.prompt for e in ex], [e.answer for e in ex]),
                                   pad_id=tok.pad_id)
    return data, BatchOrder(len(data), cfg.replay_batch, cfg.seed + 1)


def grpo_train(model: torch.nn.Module, prompts: Sequence[Example], reward: Reward,
               cfg: GRPOConfig, *, reference: torch.nn.Module | None = None) -> GRPOResult:
    """GRPO on `prompts` (Examples; `reward(example, completion)` scores each completion),
    training `model`'s trainable parameters (LoRA adapters on a frozen or NF4 base).

    `reference` is the frozen model of the KL term (and of the logged KL); None uses `model`
    with its adapters off, i.e. the base. A run the NaN guard stops returns with
    `stopped_early` set and a RuntimeWarning.
    """
    if not prompts:
        raise ValueError("prompts is empty; grpo_train needs at least one prompt")
    if not all(isinstance(p, Example) for p in prompts):
        raise ValueError("prompts must be minigpt.tasks.Example objects (the reward reads "
                         "their answers)")
    opt = make_optimizer(model, cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for g in opt.param_groups for p in g["params"]]
    device = next(model.parameters()).device
    replay = _replay_data(cfg)
    sampler = _Sampler(model, prompts, cfg)
    result, log = GRPOResult(), MetricsLog(cfg.log_path) if cfg.log_path else None
    t0 = time.perf_counter()

    def stop(step: int, tensor: str, reason: str, last_good: bool) -> None:
        result.stopped_early = {"step": step + 1, "tensor": tensor, "reason": reason,
                                "last_good_state": last_good}
        warnings.warn(f"GRPO stopped at step {step + 1}: {reason} ({tensor})", RuntimeWarning,
                      stacklevel=3)

    try:
        with tqdm(range(cfg.steps), desc="grpo", disable=not cfg.progress,
                  mininterval=1.0) as bar:
            for step in bar:
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, cfg)
                try:
                    batch = sampler.next()
                    s = batch.samples
                    rewards = score(reward, [batch.prompts[g] for g in s.group.tolist()],
                                    s.completions).view(-1, cfg.group_size)       # [P, G]
                    adv = group_advantages(rewards, cfg.adv_eps, cfg.scale_rewards
                                           ).flatten().to(device)                 # [P·G]
                    ref = reference_logprobs(model, s, reference, cfg.backend,
                                             cfg.temperature)                     # [P·G, L-1]
                    if cfg.skip_zero_advantage and not adv.any() and not cfg.kl_coef \
                            and replay is None:
                        record = _skipped(model, batch, adv, ref, cfg)
                    else:
                        record = _update(model, opt, params, named, batch, adv, ref, replay,
                                         cfg)
                except FloatingPointError as err:      # NonFiniteLogitsError included
                    stop(step, "forward", f"non-finite values ({err}); the update was skipped",
                         True)
                    break
                if "stopped" in record:
                    stop(step, *record["stopped"])
                    break
                record.update(step=step + 1, lr=lr_at(step, cfg),
                              reward=rewards.mean().item(),
                              variance_fraction=variance_fraction(rewards),
                              completion_tokens=s.target_mask.sum(1).float().mean().item(),
                              elapsed=round(time.perf_counter() - t0, 3))
                result.records.append(record)
                result.steps = step + 1
                if log:
                    log.write({"kind": "grpo", **record})
                bar.set_postfix(reward=f"{record['reward']:.3f}")
    finally:
        sampler.close()
        if log:
            log.close()
    result.wall_time_s = time.perf_counter() - t0
    return result


def grpo_loss_options(cfg: GRPOConfig) -> dict:
    """`grpo_loss`'s loss-family keywords from a config, checked as grpo_loss checks them."""
    options = dict(loss_type=cfg.loss_type, epsilon_high=cfg.epsilon_high,
                   importance_sampling_level=cfg.importance_sampling_level,
                   kl_bias_correction=cfg.kl_bias_correction,
                   max_completion_length=cfg.max_new_tokens)
    check_family(**options, totals=None)
    return options


def _micro_batches(n: int, accumulate: int) -> list[slice]:
    size = n // accumulate
    return [slice(i, i + size) for i in range(0, n, size)]


def _policy_loss(model, s: Samples, olds: list, adv, ref, cfg: GRPOConfig, backward: bool
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of the whole batch, one micro-batch at a time (`cfg.accumulate`), each
    part's backward run before the next part's forward when `backward`: the parts carry the
    whole batch's normalisation (`totals`), so their gradients add up to the whole's. Fills
    `olds` (the old log-probs per part) where it holds None: the policy sampled them."""
    mask = s.target_mask.to(adv.device)
    totals = (len(s), int(mask.sum()))
    options = grpo_loss_options(cfg)
    loss, stats = torch.zeros((), device=adv.device), {}
    for j, rows in enumerate(_micro_batches(len(s), cfg.accumulate)):
        logp = token_logprobs(model, s.rows(rows), cfg.backend, cfg.temperature)
        if olds[j] is None:         # sampled by this very policy: the ratio starts at 1
            olds[j] = logp.detach()
        part, part_stats = grpo_loss(logp, olds[j], adv[rows], mask[rows], cfg.clip_eps,
                                     None if ref is None else ref[rows], cfg.kl_coef,
                                     **options, totals=totals)
        if backward:
            part.backward()
        loss = loss + part.detach()
        share = (rows.stop - rows.start) / len(s)         # the stats are per-sequence means
        for k, v in part_stats.items():
            stats[k] = stats.get(k, 0.0) + share * v
    return loss, stats


def _skipped(model, batch: _Batch, adv, ref, cfg: GRPOConfig) -> dict:
    """The record of a batch whose advantages are all 0 (every group's answers scored the
    same) and whose loss has no other term: its gradient is exactly 0, but an AdamW step would
    still move the weights along their momentum and decay, so there is no step. Its stats
    are measured all the same (one forward, no backward)."""
    olds = [None if batch.old_logp is None else batch.old_logp[rows]
            for rows in _micro_batches(len(batch.samples), cfg.accumulate)]
    with torch.no_grad():
        loss, stats = _policy_loss(model, batch.samples, olds, adv, ref, cfg, backward=False)
    return {"loss": loss.item(), "grad_norm": 0.0, "replay_loss": None, **stats,
            "skipped": True}


def _update(model, opt, params, named, batch: _Batch, adv, ref, replay, cfg: GRPOConfig
            ) -> dict:
    """`inner_steps` AdamW steps on one batch; the record of the last, or {"stopped": ...}.

    A stop at a later inner step puts back the parameters and optimizer state from before
    the batch's first one, so a stopped run ends at the last whole iteration."""
    s = batch.samples
    saved = None
    if cfg.inner_steps > 1:
        saved = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))

    def undone(tensor: str, reason: str, inner: int) -> dict:
        if inner == 0:
            return {"stopped": (tensor, f"{reason}; the update was skipped", True)}
        if saved is not None:
            with torch.no_grad():
                for p, v in zip(params, saved[0], strict=True):
                    p.copy_(v)
            opt.load_state_dict(saved[1])
        return {"stopped": (tensor, f"{reason} at inner step {inner + 1}; the iteration's "
                                    "earlier updates were undone", True)}

    parts = _micro_batches(len(s), cfg.accumulate)
    olds = [None] * len(parts) if batch.old_logp is None else \
        [batch.old_logp[rows] for rows in parts]
    model.train()
    for inner in range(cfg.inner_steps):
        opt.zero_grad(set_to_none=True)
        try:
            loss, stats = _policy_loss(model, s, olds, adv, ref, cfg, backward=True)
            total, replay_loss = loss, None
            if replay is not None:
                data, order = replay
                x, y, m = (t.to(adv.device) for t in data.batch(next(order)))
                replay_loss = sequence_loss(model, x, y, m)
                (cfg.replay_coef * replay_loss).backward()
                total = loss + cfg.replay_coef * replay_loss.detach()
        except FloatingPointError as err:      # NonFiniteLogitsError included
            return undone("forward", f"non-finite values ({err})", inner)
        if not math.isfinite(total.item()):
            return undone("loss", "non-finite loss", inner)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if not torch.isfinite(norm):
            name = first_nonfinite([(n, p.grad) for n, p in named]) or "grad_norm"
            return undone(name, "non-finite gradient", inner)
        norm = clip_gradients(params, cfg, norm)
        opt.step()
        update_router_biases(model)        # an MoE's selection bias, if its router has one
        if not torch.isfinite(torch.nn.utils.get_total_norm(params)) and (
                name := first_nonfinite(named)):
            return {"stopped": (name, "the update overflowed to a non-finite parameter; "
                                      "parameters were not restored", False)}
    return {"loss": loss.item(), "grad_norm": norm.item(),
            "replay_loss": None if replay_loss is None else replay_loss.item(), **stats,
            "skipped": False}
