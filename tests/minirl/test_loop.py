"""minirl.grpo_train (loop.py) and minirl.pass_at_k.

The loop is pinned against GRPO written out by hand from the pieces (sample_groups, score,
group_advantages, token_logprobs, grpo_loss, global-norm clipping, AdamW): one synchronous
step, several steps with a learning-rate schedule, and the asynchronous run, whose batches
come from the policy one update old (the hand-written run keeps every past policy and samples
from the right one). Around that: it learns, deterministically; replay, KL and their records;
the NaN guard's three stops (non-finite logits while sampling or updating, a non-finite
gradient, an update that overflows) with the parameters of the last good step, the warning
and the JSONL log; the refusals; a raising reward leaves no worker thread behind; the MoE
path with LoRA and QLoRA. pass_at_k against a loop over the samples and against models whose
answers are known.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import types

import pytest
import torch
from rl_support import raise_eos, tiny
from support import TOK

from minigpt import tasks
from minigpt.tasks import Example
from minirl import (
    GRPOConfig,
    exact_match,
    group_advantages,
    grpo_loss,
    grpo_train,
    pass_at_k,
    sample_groups,
    score,
    token_logprobs,
)
from minituner import wrap_lora
from minituner.data import BatchOrder
from minituner.qlora import wrap_minigpt_qlora
from minituner.trainer import make_optimizer

# "copy:<letters>=" prompts of 5 different lengths (9..12 tokens): several decoding buckets.
COPY = tasks.make_examples("copy", 12)
# Answer "7" to every prompt (test_grpo_learns.py's target).
SEVEN = [Example("seven", ex.prompt, "7") for ex in tasks.make_examples("copy", 32)]
# Prompts of one length: with max_new_tokens=1 every sampling call is exactly one forward.
SAME_LENGTH = [Example("seven", f"{c}=", "7") for c in "abcdefgh"]


def length_reward(example: Example, completion: str) -> float:
    """Longer completions score more (with raise_eos's <eos> the groups always disagree), and
    characters of the example's own prompt more still (the reward reads the right example)."""
    return len(completion) + 0.5 * sum(ch in example.prompt for ch in completion)


def cfg_of(**kw) -> GRPOConfig:
    return GRPOConfig(**{"progress": False, **kw})


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def timeless(records: list[dict]) -> list[dict]:
    """The records without their wall-clock field."""
    return [{k: v for k, v in r.items() if k != "elapsed"} for r in records]


def open_paths() -> set[str]:
    """Files this process holds open (Linux /proc)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def model_and_reference(seed: int = 0, ref_seed: int | None = None):
    """A tiny MiniGPT with raised <eos> (completions of several lengths), all trainable, and
    a frozen reference: its copy, or another model (`ref_seed`) so that the KL term acts."""
    model = raise_eos(tiny(seed=seed))
    ref = copy.deepcopy(model) if ref_seed is None else raise_eos(tiny(seed=ref_seed))
    return model, ref.requires_grad_(False)


def run(cfg: GRPOConfig, prompts=COPY, reward=length_reward, ref_seed: int | None = None):
    model, ref = model_and_reference(ref_seed=ref_seed)
    result = grpo_train(model, prompts, reward, cfg, reference=ref)
    return result, params_of(model)


# --- GRPO written out by hand ------------------------------------------------------------

def hand_lr(step: int, cfg: GRPOConfig) -> float:
    """Linear warm-up over warmup_steps iterations, then cosine to lr · min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio)
                     * (0.5 * (1 + math.cos(math.pi * progress))))


def by_hand(model, reference, prompts, reward, cfg: GRPOConfig, lag: int) -> list[dict]:
    """cfg.steps GRPO iterations (inner_steps=1) on `model`, step i's batch sampled from
    θ_max(i−lag, 0) (θ_j: the parameters after j updates): lag 0 samples from the policy
    itself, lag 1 from the one before the previous update (θ_0 for steps 0 and 1). Every past
    policy is kept; a separate copy ("actor") is loaded with the right one, samples the batch
    and gives the old log-probs. Returns what each step computed."""
    assert cfg.inner_steps == 1 and cfg.grad_clip_value == 0
    order = BatchOrder(len(prompts), cfg.prompts_per_step, cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg)
    params = [p for g in opt.param_groups for p in g["params"]]   # the norm's summation order
    actor = copy.deepcopy(model).requires_grad_(False)
    history = [params_of(model)]                                   # θ_0, θ_1, ...
    out = []
    for step in range(cfg.steps):
        actor.load_state_dict(history[max(step - lag, 0)])
        batch = [prompts[i] for i in next(order).tolist()]
        s = sample_groups(actor, batch, cfg.group_size, cfg.max_new_tokens,
                          temperature=cfg.temperature, generator=gen)
        rewards = score(reward, [batch[g] for g in s.group.tolist()], s.completions)
        adv = group_advantages(rewards.view(-1, cfg.group_size)).flatten()
        with torch.no_grad():     # every log-prob at the sampling temperature, as TRL scores
            old = token_logprobs(actor, s, temperature=cfg.temperature)
            ref = token_logprobs(reference, s, temperature=cfg.temperature)
        lr = hand_lr(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        loss, stats = grpo_loss(token_logprobs(model, s, temperature=cfg.temperature), old,
                                adv, s.target_mask,
                                cfg.clip_eps, ref, cfg.kl_coef)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip \
            else torch.nn.utils.get_total_norm([p.grad for p in params])
        opt.step()
        history.append(params_of(model))
        out.append(dict(loss=loss.item(), grad_norm=norm.item(), lr=lr,
                        reward=rewards.mean().item(), completions=s.completions, **stats))
    return out


def check_against_hand(cfg: GRPOConfig, lag: int, ref_seed: int | None = None):
    """grpo_train's records and parameters equal by_hand's; returns (result, params, hand)."""
    result, after = run(cfg, ref_seed=ref_seed)
    model, ref = model_and_reference(ref_seed=ref_seed)
    hand = by_hand(model, ref, COPY, length_reward, cfg, lag)
    assert result.steps == cfg.steps and result.stopped_early is None
    assert len(result.records) == cfg.steps
    for step, (got, want) in enumerate(zip(result.records, hand, strict=True)):
        assert got["step"] == step + 1
        for key in ("loss", "grad_norm", "lr", "reward", "mean_ratio", "clip_fraction",
                    "mean_kl"):
            assert got[key] == want[key], (step, key, got[key], want[key])
        assert got["replay_loss"] is None
    assert same_params(after, params_of(model))
    return result, after, hand


def test_one_step_equals_a_hand_written_step():
    """12 prompts, 4 per step (the BatchOrder picks which), a reference other than the policy
    with β > 0 (the KL gradient is not 0), a global-norm clip that bites, weight decay and
    non-default betas, a warm-up of 2 (the first step at lr / 2)."""
    cfg = cfg_of(steps=1, inner_steps=1, prompts_per_step=4, group_size=3, max_new_tokens=4,
                 temperature=1.3, kl_coef=0.3, clip_eps=0.1, lr=3e-2, warmup_steps=2,
                 weight_decay=0.1, betas=(0.8, 0.9), grad_clip=0.05, seed=5)
    _, _, hand = check_against_hand(cfg, lag=0, ref_seed=1)
    assert hand[0]["grad_norm"] > cfg.grad_clip         # the clip acted
    assert hand[0]["mean_kl"] > 0 and hand[0]["mean_ratio"] == 1.0
    assert len(set(hand[0]["completions"])) > 3


def test_several_synchronous_steps_equal_the_hand_written_loop():
    """Four iterations through a warm-up and a cosine decay; the prompt order wraps an epoch."""
    cfg = cfg_of(steps=4, inner_steps=1, prompts_per_step=5, group_size=2, max_new_tokens=3,
                 kl_coef=0.1, lr=2e-2, warmup_steps=1, min_lr_ratio=0.1, seed=2)
    _, _, hand = check_against_hand(cfg, lag=0, ref_seed=1)
    assert [h["lr"] for h in hand] == pytest.approx([2e-2, 2e-2, 1.1e-2, 2e-3])


def test_log_probs_are_scored_at_the_sampling_temperature():
    """The tokens were drawn from softmax(logits / T): the policy's, the old policy's and the
    reference's log-probs are all of that distribution (TRL scores the same way)."""
    cfg = cfg_of(steps=1, prompts_per_step=4, group_size=3, max_new_tokens=4,
                 temperature=0.5, kl_coef=0.3, seed=3)
    result, _ = run(cfg, ref_seed=1)
    model, ref = model_and_reference(ref_seed=1)
    (hand,) = by_hand(model, ref, COPY, length_reward, cfg, lag=0)
    for key in ("loss", "mean_kl"):
        assert result.records[0][key] == hand[key], (
            f"{key}: {result.records[0][key]} against {hand[key]} scored at T = "
            f"{cfg.temperature}: score every log-prob at the sampling temperature "
            f"(token_logprobs(..., temperature=cfg.temperature))")


# --- async generation ----------------------------------------------------------------------

ASYNC = dict(steps=3, inner_steps=1, prompts_per_step=4, group_size=3, max_new_tokens=3,
             kl_coef=0.05, lr=5e-2, seed=1, temperature=0.8)


def test_async_generation_lags_the_policy_by_one_update():
    """Batch 0 from θ0, batch i ≥ 1 from θ_{i−1}: equal to the hand-written loop with lag 1
    (parameters and every record), twice the same; ratio 1 only where the batch came from the
    policy itself. The synchronous run (lag 0) keeps the ratio at exactly 1 and ends
    elsewhere."""
    cfg = cfg_of(async_generation=True, **ASYNC)
    first, params, hand = check_against_hand(cfg, lag=1)
    again, params_again = run(cfg)
    assert timeless(first.records) == timeless(again.records)
    assert same_params(params, params_again)
    ratios = first.curve("mean_ratio")
    assert ratios[0] == 1.0 and all(r != 1.0 for r in ratios[1:]), ratios
    sync, sync_params = run(cfg_of(async_generation=False, **ASYNC))
    assert sync.curve("mean_ratio") == [1.0] * cfg.steps
    assert not same_params(params, sync_params)
    # Batch 1: same prompts and generator draws, but from θ0 (async) instead of θ1 (sync).
    lag0 = by_hand(*model_and_reference(), COPY, length_reward, cfg, lag=0)
    assert [h["completions"] for h in lag0] != [h["completions"] for h in hand]
    assert timeless(sync.records) != timeless(first.records)


# --- it learns -----------------------------------------------------------------------------

def mean_reward(model, seed=123) -> float:
    s = sample_groups(model, SEVEN, 4, 1, generator=torch.Generator().manual_seed(seed))
    return score(exact_match, [SEVEN[i] for i in s.group.tolist()], s.completions).mean().item()


def learn(tmp_path, name):
    model = tiny(seed=0)                      # every weight trains (test_grpo_learns.py says why)
    reference = copy.deepcopy(model).requires_grad_(False)
    before = mean_reward(model)
    cfg = cfg_of(steps=30, prompts_per_step=8, group_size=8, max_new_tokens=1, inner_steps=2,
                 kl_coef=0.01, lr=1e-2, seed=0, log_path=str(tmp_path / name))
    result = grpo_train(model, SEVEN, exact_match, cfg, reference=reference)
    return before, mean_reward(model), result, params_of(model)


def test_grpo_train_raises_the_mean_reward_deterministically(tmp_path):
    before, after, result, params = learn(tmp_path, "a.jsonl")
    assert before < 0.1 and after > 0.9, (before, after)
    assert result.steps == 30 and result.stopped_early is None and result.wall_time_s > 0
    rewards = result.curve("reward")
    assert rewards[0] < 0.2 and min(rewards[-3:]) > 0.8, rewards
    assert max(result.curve("variance_fraction")) > 0
    assert all(r["completion_tokens"] == 1.0 for r in result.records)
    assert all(r["mean_kl"] >= 0 for r in result.records) and result.records[-1]["mean_kl"] > 0
    assert not any(str(tmp_path) in p for p in open_paths())          # the log is closed
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"kind": "grpo", **r}
                                                    for r in result.records]
    again = learn(tmp_path, "b.jsonl")
    assert (again[0], again[1]) == (before, after)
    assert timeless(again[2].records) == timeless(result.records)
    assert same_params(again[3], params)


# --- replay and KL -------------------------------------------------------------------------

SMALL_RUN = dict(steps=2, inner_steps=2, prompts_per_step=3, group_size=2, max_new_tokens=3,
                 lr=2e-2, seed=3)


def test_replay_adds_a_cross_entropy_term_and_its_record():
    plain, plain_params = run(cfg_of(**SMALL_RUN))
    assert [r["replay_loss"] for r in plain.records] == [None, None]
    replay, replay_params = run(cfg_of(replay_batch=2, **SMALL_RUN))
    losses = replay.curve("replay_loss")
    # A fresh model's cross-entropy over 45 tokens is near ln 45 = 3.8.
    assert all(isinstance(x, float) and 3.0 < x < 4.6 for x in losses), losses
    assert not same_params(plain_params, replay_params)
    # Same prompts and samples at step 1: replay draws from its own order, not the sampler's.
    assert replay.records[0]["reward"] == plain.records[0]["reward"]
    # replay_coef 0: the replay batch is drawn and logged, but adds nothing to the update.
    zero, zero_params = run(cfg_of(replay_batch=2, replay_coef=0.0, **SMALL_RUN))
    assert same_params(zero_params, plain_params)
    assert all(math.isfinite(x) for x in zero.curve("replay_loss"))


def test_kl_coef_changes_the_update_and_the_kl_is_logged_either_way():
    cfg = dict(SMALL_RUN, steps=1, inner_steps=1)
    off, off_params = run(cfg_of(kl_coef=0.0, **cfg), ref_seed=1)
    on, on_params = run(cfg_of(kl_coef=0.5, **cfg), ref_seed=1)
    kl = off.records[0]["mean_kl"]
    assert kl > 0 and on.records[0]["mean_kl"] == kl
    assert off.records[0]["reward"] == on.records[0]["reward"]
    # float32 losses near 0 (the policy term nearly cancels): an absolute floor of 1e-7
    assert on.records[0]["loss"] == pytest.approx(off.records[0]["loss"] + 0.5 * kl, rel=1e-5,
                                                  abs=1e-7)
    assert not same_params(off_params, on_params)


# --- the NaN guard -------------------------------------------------------------------------

def poison(model, *, train: bool, after: int):
    """From the (after+1)-th forward in training mode (`train`) or in eval mode (sampling),
    the model's logits are NaN. Counts are shared by deep copies (the async actor)."""
    state = {"calls": 0}

    def hook(module, inputs, logits):
        if module.training == train:
            state["calls"] += 1
            if state["calls"] > after:
                return logits * float("nan")
        return None

    model.lm_head.register_forward_hook(hook)
    return model


def guarded(tmp_path, cfg_kw, *, prepare=lambda m: m, prompts=SAME_LENGTH):
    """A run (length reward, so every update moves the parameters) on a model `prepare`d
    after its reference was copied (the reference is clean)."""
    model = raise_eos(tiny(seed=0))
    ref = copy.deepcopy(model).requires_grad_(False)
    prepare(model)
    log = tmp_path / "log.jsonl"
    cfg = cfg_of(log_path=str(log), **cfg_kw)
    result = grpo_train(model, prompts, length_reward, cfg, reference=ref)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert not any(str(log) in p for p in open_paths())                 # closed
    return result, params_of(model), lines


GUARD = dict(steps=5, inner_steps=1, prompts_per_step=4, group_size=4, max_new_tokens=1,
             lr=1e-2)


@pytest.mark.parametrize("where", ["sampling", "sampling-async", "update"])
def test_nan_logits_stop_the_run_with_the_last_good_parameters(tmp_path, where):
    """NaN logits at step 3 (while sampling its batch, also in the async worker, or in its
    update's forward): the run stops there with step 3's update skipped: parameters, records
    and log lines those of a clean 2-step run."""
    kw = dict(GUARD, async_generation=where == "sampling-async")
    # max_new_tokens=1 and prompts of one length: one eval forward per batch, one training
    # forward per update; the 3rd batch (async: sampled during step 2) or update is NaN.
    prepare = (lambda m: poison(m, train=False, after=2)) if where.startswith("sampling") \
        else (lambda m: poison(m, train=True, after=2))
    with pytest.warns(RuntimeWarning, match="GRPO stopped at step 3"):
        result, params, lines = guarded(tmp_path, kw, prepare=prepare)
    stop = result.stopped_early
    assert stop is not None and stop["step"] == 3 and stop["tensor"] == "forward"
    assert "NaN" in stop["reason"] and "skipped" in stop["reason"]
    assert stop["last_good_state"] is True
    assert result.steps == 2 and [r["step"] for r in result.records] == [1, 2]
    assert [r["step"] for r in lines] == [1, 2]
    clean, clean_params, _ = guarded(tmp_path, dict(kw, steps=2))
    assert clean.stopped_early is None
    assert same_params(params, clean_params)
    assert not same_params(params, params_of(raise_eos(tiny(seed=0))))   # 2 updates happened
    assert timeless(result.records) == timeless(clean.records)


def test_a_nan_at_a_later_inner_step_leaves_the_last_good_iteration(tmp_path):
    """Iteration 2's second inner update sees NaN logits (the 4th training forward): the run
    reports 1 finished iteration and a skipped update, so the parameters should be those of a
    clean 1-iteration run."""
    kw = dict(GUARD, inner_steps=2)
    with pytest.warns(RuntimeWarning, match="GRPO stopped at step 2"):
        result, params, lines = guarded(tmp_path, kw,
                                        prepare=lambda m: poison(m, train=True, after=3))
    assert result.stopped_early["last_good_state"] is True and result.steps == 1
    assert len(lines) == 1
    _, clean_params, _ = guarded(tmp_path, dict(kw, steps=1))
    assert same_params(params, clean_params)


def test_a_nan_gradient_stops_the_run_naming_the_parameter(tmp_path):
    def nan_grad_from_step_2(model):
        state = {"calls": 0}

        def grad_hook(grad):
            state["calls"] += 1
            return grad * float("nan") if state["calls"] >= 2 else grad
        model.blocks[0].attn.v_proj.weight.register_hook(grad_hook)
        return model

    with pytest.warns(RuntimeWarning, match="GRPO stopped at step 2"):
        result, params, lines = guarded(tmp_path, GUARD, prepare=nan_grad_from_step_2)
    stop = result.stopped_early
    assert stop["step"] == 2 and stop["tensor"] == "blocks.0.attn.v_proj.weight"
    assert "gradient" in stop["reason"] and stop["last_good_state"] is True
    assert result.steps == 1 and len(lines) == 1
    _, clean_params, _ = guarded(tmp_path, dict(GUARD, steps=1))
    assert same_params(params, clean_params)


def test_an_update_that_overflows_stops_without_restoring(tmp_path):
    """lr 1e37 with weight decay 1e4: AdamW's decay factor 1 − lr·wd = −1e41 overflows every
    matrix (the first in the model's order is the token embedding)."""
    with pytest.warns(RuntimeWarning, match="GRPO stopped at step 1"):
        result, params, lines = guarded(tmp_path, dict(GUARD, lr=1e37, weight_decay=1e4))
    stop = result.stopped_early
    assert stop["step"] == 1 and stop["last_good_state"] is False
    assert stop["tensor"] == "tok_emb.weight" and not torch.isfinite(params["tok_emb.weight"]).all()
    assert "not restored" in stop["reason"]
    assert result.steps == 0 and result.records == [] and lines == []


# --- refusals and errors -------------------------------------------------------------------

@pytest.mark.parametrize("kw, name", [
    (dict(group_size=1), "group_size"), (dict(steps=0), "steps"),
    (dict(backend="cuda-magic"), "backend"), (dict(kl_coef=-0.1), "kl_coef"),
    (dict(kl_coef=float("nan")), "kl_coef"), (dict(prompts_per_step=0), "prompts_per_step"),
    (dict(inner_steps=0), "inner_steps"), (dict(replay_batch=-1), "replay_batch"),
    (dict(temperature=0.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(accumulate=0), "accumulate"), (dict(accumulate=3), "accumulate=3 must divide"),
    (dict(loss_type="token"), "loss_type"), (dict(scale_rewards="prompt"), "scale_rewards"),
    (dict(epsilon_high=0.0), "epsilon_high"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level"),
])
def test_bad_config_is_refused_naming_the_field(kw, name):
    with pytest.raises(ValueError, match=name):
        GRPOConfig(**kw)


@pytest.mark.parametrize("prompts", [[], ["copy:ab="], [SEVEN[0], ("copy:ab=", "ab")]])
def test_bad_prompts_are_refused_before_anything_trains(prompts):
    model, ref = model_and_reference()
    before, threads = params_of(model), set(threading.enumerate())
    with pytest.raises(ValueError, match="prompts"):
        grpo_train(model, prompts, exact_match, cfg_of(steps=1, async_generation=True),
                   reference=ref)
    assert same_params(before, params_of(model))
    assert set(threading.enumerate()) == threads


def in_thread(fn, timeout=60.0):
    """fn() in a daemon thread; its exception (or a hang) comes back here."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as err:   # noqa: BLE001 - handed to the test
            box["error"] = err
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "grpo_train hung"
    return box


@pytest.mark.parametrize("async_generation", [False, True])
@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_raising_reward_propagates_and_leaves_no_worker(tmp_path, async_generation, fail_at):
    calls = {"n": 0}

    def flaky(example, completion):
        calls["n"] += 1
        if calls["n"] == (fail_at - 1) * 8 + 5:      # 8 rows per step: the 5th of step fail_at
            raise KeyError("boom")
        return exact_match(example, completion)

    model, ref = model_and_reference()
    log = tmp_path / "log.jsonl"
    cfg = cfg_of(steps=4, prompts_per_step=4, group_size=2, max_new_tokens=2,
                 async_generation=async_generation, log_path=str(log))
    threads = set(threading.enumerate())
    box = in_thread(lambda: grpo_train(model, COPY, flaky, cfg, reference=ref))
    err = box.get("error")
    order = BatchOrder(len(COPY), 4, cfg.seed)
    batch = [next(order) for _ in range(fail_at)][-1]
    prompt = COPY[batch[4 // 2]].prompt                  # row 4 answers the batch's prompt 2
    assert isinstance(err, RuntimeError), box
    assert f"flaky raised on example 4 (prompt {prompt!r}" in str(err), (str(err), prompt)
    assert isinstance(err.__cause__, KeyError)
    assert set(threading.enumerate()) == threads       # the sampler's worker is gone
    assert len(log.read_text().splitlines()) == fail_at - 1
    assert not any(str(log) in p for p in open_paths())


@pytest.mark.parametrize("kw, ref, name", [
    ({}, False, "reference"),             # a model without adapters has no base to switch to
    (dict(max_new_tokens=10_000), True, "max_new_tokens"),  # refused by the (async) sampler
    (dict(clip_eps=-0.5), True, "clip_eps"),               # refused by grpo_loss
])
def test_errors_of_the_first_step_propagate_and_leave_no_worker(kw, ref, name):
    model, reference = model_and_reference()
    before, threads = params_of(model), set(threading.enumerate())
    cfg = cfg_of(steps=2, prompts_per_step=2, group_size=2, async_generation=True, **kw)
    box = in_thread(lambda: grpo_train(model, COPY, exact_match, cfg,
                                       reference=reference if ref else None))
    assert isinstance(box.get("error"), ValueError) and name in str(box["error"]), box
    assert set(threading.enumerate()) == threads
    assert same_params(before, params_of(model))


# --- MoE with LoRA / QLoRA -----------------------------------------------------------------

@pytest.mark.parametrize("wrap", ["lora", "qlora"])
def test_moe_with_adapters_trains_against_its_own_base(wrap):
    """reference=None: the KL is to the base (adapters off), 0 on the first batch while the
    fresh adapters are 0, then > 0; only the adapters move; everything finite."""
    model = raise_eos(tiny("moe"))
    if wrap == "lora":
        wrap_lora(model, ["q_proj", "v_proj", "o_proj"], r=4)
    else:
        wrap_minigpt_qlora(model, r=4)              # NF4 experts with expert LoRA too
    before = params_of(model)
    cfg = cfg_of(steps=3, inner_steps=1, prompts_per_step=3, group_size=3, max_new_tokens=3,
                 kl_coef=0.05, replay_batch=2, lr=5e-2, async_generation=True, seed=4)
    result = grpo_train(model, COPY, length_reward, cfg)
    assert result.steps == 3 and result.stopped_early is None
    for r in result.records:
        for key in ("loss", "grad_norm", "mean_kl", "mean_ratio", "replay_loss", "reward"):
            assert math.isfinite(r[key]), (key, r)
    assert result.records[0]["mean_kl"] == 0.0 and result.records[-1]["mean_kl"] > 0
    after = params_of(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(("lora_A" in n or "lora_B" in n) for n in trainable)
    if wrap == "qlora":
        assert any(n.startswith("blocks.0.mlp.") for n in trainable)   # expert LoRA
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert any(not torch.equal(before[n], after[n]) for n in trainable if "lora_B" in n)


# --- pass_at_k -----------------------------------------------------------------------------

def test_pass_at_k_equals_a_loop_over_the_samples():
    """Half the answers are "a", whose logit is raised (often drawn), half "b" (rarely)."""
    model = tiny(seed=0)
    bias = 3.0 * torch.nn.functional.one_hot(torch.tensor(TOK.encode("a")[0]), TOK.vocab_size)
    model.lm_head.register_forward_hook(lambda m, i, logits: logits + bias)
    examples = [Example("t", ex.prompt, "ab"[i % 2]) for i, ex in enumerate(COPY)]
    k = 3
    got = pass_at_k(model, examples, k, 1, generator=torch.Generator().manual_seed(7))
    s = sample_groups(model, examples, k, 1, generator=torch.Generator().manual_seed(7))
    hits = 0
    for p, ex in enumerate(examples):
        hits += any(s.completions[p * k + j] == ex.answer for j in range(k))
    assert got == pytest.approx(hits / len(examples), rel=1e-7)
    assert 0 < got < 1
    cold = pass_at_k(model, examples, k, 1, temperature=0.5,
                     generator=torch.Generator().manual_seed(7))
    s = sample_groups(model, examples, k, 1, temperature=0.5,
                      generator=torch.Generator().manual_seed(7))
    assert cold == pytest.approx(sum(any(s.completions[p * k + j] == ex.answer for j in range(k))
                       for p, ex in enumerate(examples)) / len(examples), rel=1e-7)


def test_pass_at_k_is_exactly_the_share_of_examples_solved():
    examples = [Example("t", ex.prompt, "7" if i < 4 else "8") for i, ex in enumerate(COPY)]
    got = pass_at_k(Scripted("7"), examples, 2, 3, generator=torch.Generator().manual_seed(0))
    assert got == 4 / 12


class Scripted(torch.nn.Module):
    """Answers `answer` then <eos> to every prompt, with certainty (logits 0 / 1e4)."""

    def __init__(self, answer: str):
        super().__init__()
        self.config = types.SimpleNamespace(block_size=24)
        self.dummy = torch.nn.Parameter(torch.zeros(()))
        self.script = TOK.encode(answer) + [TOK.eos_id]

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, TOK.vocab_size)
        for row in range(idx.shape[0]):
            ids = idx[row].tolist()
            done = next((n for n in range(len(self.script), 0, -1)
                         if ids[-n:] == self.script[:n] and ids[-n - 1] == TOK.encode("=")[0]),
                        0)
            logits[row, -1, self.script[min(done, len(self.script) - 1)]] = 1e4
        return logits


def test_pass_at_k_of_models_whose_answers_are_known():
    examples = [Example("t", ex.prompt, "7") for ex in COPY[:6]]
    gen = torch.Generator().manual_seed(0)
    assert pass_at_k(Scripted("7"), examples, 4, 3, generator=gen) == 1.0
    assert pass_at_k(Scripted("7"), examples, 1, 3, generator=gen) == 1.0
    assert pass_at_k(Scripted("77"), examples, 4, 3, generator=gen) == 0.0
    assert pass_at_k(Scripted(""), examples, 4, 3, generator=gen) == 0.0
    mixed = [Example("t", ex.prompt, "7" if i < 2 else "8") for i, ex in enumerate(COPY[:6])]
    assert pass_at_k(Scripted("7"), mixed, 2, 3, generator=gen) == pytest.approx(2 / 6)
