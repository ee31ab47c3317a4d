"""minituner.train with gradient accumulation (TrainConfig.accumulate).

A step over k micro-batches equals the one-batch step to rounding (float64 models): ragged
sequences whose micro-batches score different numbers of tokens, example weights, LoRA, a
batch shorter than batch_size, frozen layers, gradient checkpointing and evaluation. A MoE's
balancing loss is the micro-batches' mean, against a loop written out plainly. The NaN guard
skips the whole step; resuming stays bit-exact; accumulate=1 is the code before the option,
bit for bit, and its checkpoints record the config as before. The saved activations shrink
to one micro-batch's, as minituner.memory predicts.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import TOK, small_model
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from minigpt import MiniGPT, MiniGPTConfig
from minituner import SequenceData, TrainConfig, memory, train, wrap_lora
from minituner.checkpoint import config_fingerprint
from minituner.qlora import wrap_minigpt_qlora
from minituner.trainer import (
    _Run,
    batches,
    clip_gradients,
    first_nonfinite,
    loss_normaliser,
    lr_at,
    sequence_loss,
)

pytestmark = pytest.mark.usefixtures("single_thread")

RULE = ("each micro-batch's summed loss must be divided by the WHOLE batch's normaliser "
        "(loss_normaliser: its masked tokens, or its rows with weights), not by its own")


def ragged_data(n: int = 18, seed: int = 0) -> SequenceData:
    """n rows with prompts of 1..6 and answers of 2..10 tokens: the micro-batches of a step
    score different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randint(3, 45, (1 + i % 6,), generator=g).tolist(),
              torch.randint(3, 45, (1 + 5 * i % 9,), generator=g).tolist() + [TOK.eos_id])
             for i in range(n)]
    return SequenceData.from_pairs(pairs)


def quiet(**kw) -> TrainConfig:
    base = dict(steps=3, batch_size=12, lr=1e-2, warmup_steps=1, log_every=1, progress=False)
    return TrainConfig(**{**base, **kw})


def double_model(seed: int = 0, **kw) -> nn.Module:
    return small_model(seed, **{"n_layer": 2, **kw}).double()


def lora_model() -> nn.Module:
    model = small_model(n_layer=2)
    wrap_lora(model, ["q_proj", "v_proj", "up_proj", "down_proj"], r=4)
    return model.double()


def train_pair(make_model, data, accumulate: int, **kw):
    """(model, result) trained with accumulate=1 and with `accumulate`, from one init."""
    a, b = make_model(), make_model()
    ra = train(a, data, quiet(**kw))
    rb = train(b, data, quiet(accumulate=accumulate, **kw))
    return a, ra, b, rb


def assert_same_run(a, ra, b, rb, what: str, rtol: float = 1e-6, atol: float = 1e-9):
    """Parameters, logged losses and gradient norms agree to rounding. The losses and norms
    catch a wrong normaliser that is the same factor in every micro-batch (AdamW and the
    norm clip would hide it from the parameters)."""
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=rtol, atol=atol,
                                   msg=lambda m, n=n: f"{what}: {n} differs; {RULE}\n{m}")
    assert rb.losses == pytest.approx(ra.losses, rel=rtol), \
        f"{what}: logged losses {rb.losses} vs one batch {ra.losses}; {RULE}"
    assert rb.grad_norms == pytest.approx(ra.grad_norms, rel=rtol), \
        f"{what}: gradient norms {rb.grad_norms} vs one batch {ra.grad_norms}; {RULE}"


def micro_counts(data: SequenceData, cfg: TrainConfig) -> list[int]:
    """Scored tokens of each micro-batch of the first step."""
    idx = next(batches(len(data), cfg))
    return [int(data.batch(p)[2].sum()) for p in idx.tensor_split(cfg.accumulate)]


# ---------------------------------------------------------------------------------------------
# a step over micro-batches equals the one-batch step


@pytest.mark.parametrize("accumulate", [2, 3, 4, 6])
def test_accumulate_equals_one_batch(accumulate):
    data = ragged_data()
    counts = micro_counts(data, quiet(accumulate=accumulate))
    assert len(set(counts)) > 1, counts          # the case a per-part divisor gets wrong
    a, ra, b, rb = train_pair(double_model, data, accumulate)
    assert_same_run(a, ra, b, rb, f"batch 12, accumulate={accumulate}, tokens {counts}")


def test_weighted_accumulate_equals_one_batch():
    data = ragged_data().with_rewards([i % 5 for i in range(18)])    # weights 0 .. 2
    a, ra, b, rb = train_pair(double_model, data, 3)
    assert_same_run(a, ra, b, rb, "weighted, accumulate=3")


def test_lora_accumulate_equals_one_batch():
    a, ra, b, rb = train_pair(lora_model, ragged_data(), 4)
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in b.named_parameters())
    assert_same_run(a, ra, b, rb, "LoRA, accumulate=4")


def test_batch_shorter_than_batch_size_splits_unevenly():
    """5 rows for batches of 12: one batch of 5, in micro-batches of 2, 1, 1, 1."""
    a, ra, b, rb = train_pair(double_model, ragged_data(n=5), 4)
    assert_same_run(a, ra, b, rb, "5 rows, batch 12, accumulate=4")


@pytest.mark.parametrize("weighted", [False, True], ids=["tokens", "weighted"])
def test_own_normaliser_is_caught(monkeypatch, weighted):
    """The data above can tell: dividing each micro-batch by its own count (tokens), or
    averaging it over its own rows (weights), fails assert_same_run, naming the rule."""
    data = ragged_data()
    if weighted:
        data = data.with_rewards([i % 5 for i in range(18)])
    right = _Run.micro_batches
    monkeypatch.setattr(_Run, "micro_batches", lambda self, idx: (right(self, idx)[0], None))
    a, ra, b, rb = train_pair(double_model, data, 3)
    with pytest.raises(AssertionError, match="WHOLE batch's normaliser"):
        assert_same_run(a, ra, b, rb, "own normaliser")


def test_loss_normaliser_hand_computed():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    assert loss_normaliser(mask) == 5.0
    assert loss_normaliser(mask, weighted=True) == 3.0
    assert loss_normaliser(torch.zeros(2, 4, dtype=torch.bool)) == 1.0     # never 0/0
    # Two micro-batches with the whole batch's divisor add up to the whole batch's loss.
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(3, 3, 7, generator=g), torch.randint(0, 7, (3, 3), generator=g)
    w = torch.tensor([0.5, 2.0, 1.5])
    for weights in (None, w):
        whole = sequence_loss(lambda x: logits, None, y, mask, weights)
        norm = loss_normaliser(mask, weighted=weights is not None)
        parts = [sequence_loss(lambda x, s=s: logits[s], None, y[s], mask[s],
                               None if weights is None else weights[s], norm)
                 for s in (slice(0, 1), slice(1, 3))]
        assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_freeze_checkpointing_and_eval_with_accumulation(monkeypatch):
    """freeze_layers, gradient checkpointing and val_loss as with one batch; evaluation runs
    in batches of batch_size / accumulate rows."""
    import minituner.trainer as tr
    rows = []
    real = tr.mean_loss
    monkeypatch.setattr(tr, "mean_loss", lambda m, d, b, p: rows.append(b) or real(m, d, b, p))
    kw = dict(freeze_layers=1, checkpoint_every=1, val_fraction=0.2, eval_every=2)
    a, ra, b, rb = train_pair(lambda: double_model(n_layer=3), ragged_data(n=20), 3, **kw)
    assert_same_run(a, ra, b, rb, "freeze_layers=1, checkpoint_every=1, accumulate=3")
    assert rows == [12, 12, 4, 4]
    assert [e["step"] for e in rb.evals] == [2, 3]
    for ea, eb in zip(ra.evals, rb.evals, strict=True):
        assert eb["val_loss"] == pytest.approx(ea["val_loss"], rel=1e-6)
    frozen = [n for n, _ in b.named_parameters()
              if n.startswith(("blocks.0.", "tok_emb", "pos_emb"))]
    start = dict(double_model(n_layer=3).named_parameters())
    assert frozen and all(torch.equal(dict(b.named_parameters())[n], start[n]) for n in frozen)


# ---------------------------------------------------------------------------------------------
# MoE: the balancing loss is the micro-batches' mean


def reference_moe_run(model, data: SequenceData, cfg: TrainConfig) -> list[float]:
    """The documented arithmetic spelled out: per micro-batch Σ masked CE / (the whole batch's
    masked tokens) + aux_loss_coef · aux / k, backward each; then clip and AdamW. Returns each
    step's loss (the CE parts summed, aux left out)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas)
    order, k, losses = batches(len(data), cfg), cfg.accumulate, []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        idx = next(order)
        n_tokens = data.batch(idx)[2].sum().item()
        opt.zero_grad()
        step_loss = 0.0
        for part in idx.tensor_split(k):
            x, y, m = data.batch(part)
            ce = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="none")
            loss = (ce * m.flatten()).sum() / n_tokens
            (loss + cfg.aux_loss_coef * model.aux_loss() / k).backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(step_loss)
    return losses


def test_moe_aux_loss_is_the_micro_batch_mean():
    data = ragged_data()
    cfg = quiet(accumulate=3, aux_loss_coef=0.5)
    a, b = small_model(n_experts=4, top_k=2), small_model(n_experts=4, top_k=2)
    res = train(a, data, cfg)
    want = reference_moe_run(b, data, cfg)
    assert res.losses == pytest.approx(want, rel=1e-5)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: aux_loss_coef · aux / k per "
                                   f"micro-batch (their mean)\n{m}")


def test_moe_without_aux_equals_one_batch():
    """With aux_loss_coef = 0 nothing in a MoE step depends on how the rows are grouped. The
    router runs in float32 whatever the model's dtype (measured: 4e-9 apart), hence the
    looser tolerance."""
    a, ra, b, rb = train_pair(lambda: double_model(n_experts=4, top_k=2), ragged_data(), 3,
                              aux_loss_coef=0.0)
    assert_same_run(a, ra, b, rb, "MoE, aux_loss_coef=0, accumulate=3", rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# the NaN guard skips the whole step


class NaNAfter(nn.Module):
    """Wraps a model; its logits turn NaN from the k-th forward on."""

    def __init__(self, inner, k):
        super().__init__()
        self.inner, self.k, self.calls = inner, k, 0

    def forward(self, x):
        self.calls += 1
        out = self.inner(x)
        return out * math.nan if self.calls >= self.k else out


@pytest.fixture
def optimizer_steps():
    """Counts every optimizer.step() while the test runs."""
    calls = []
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append(1))
    yield calls
    handle.remove()


def good_state_after_one_step(data, cfg):
    model = small_model()
    train(model, data, cfg, stop_after=1)
    return model


def test_nan_loss_in_a_micro_batch_skips_the_step(optimizer_steps):
    data, cfg = ragged_data(), quiet(steps=4, accumulate=3)
    want = good_state_after_one_step(data, cfg)
    optimizer_steps.clear()
    model = NaNAfter(small_model(), k=5)           # step 2, its second micro-batch
    with pytest.warns(RuntimeWarning, match=r"step 2: non-finite loss in micro-batch 2 of 3; "
                                            r"the update was skipped \(loss\)"):
        res = train(model, data, cfg)
    assert res.steps == 1 and res.stopped_early["last_good_state"] is True
    assert len(optimizer_steps) == 1               # no update, no optimizer state change
    for (n, p), q in zip(model.inner.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_nan_gradient_in_a_micro_batch_skips_the_step(optimizer_steps):
    data, cfg = ragged_data(), quiet(steps=4, accumulate=3)
    want = good_state_after_one_step(data, cfg)
    optimizer_steps.clear()
    model = small_model()
    name, calls = "blocks.0.attn.q_proj.weight", []

    def poison(grad):
        calls.append(1)
        return grad * math.nan if len(calls) == 6 else grad     # step 2, third micro-batch

    dict(model.named_parameters())[name].register_hook(poison)
    with pytest.warns(RuntimeWarning, match=rf"step 2: non-finite gradient.*\({name}\)"):
        res = train(model, data, cfg)
    assert res.stopped_early == {"step": 2, "tensor": name, "last_good_state": True,
                                 "reason": "non-finite gradient; the update was skipped"}
    assert res.steps == 1 and len(optimizer_steps) == 1
    for (n, p), q in zip(model.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q), n


# ---------------------------------------------------------------------------------------------
# configuration, checkpoints and resume


@pytest.mark.parametrize("kw, match", [
    (dict(accumulate=0), r"accumulate must be an int >= 1 \(micro-batches per step\), got 0"),
    (dict(accumulate=-2), "accumulate must be an int >= 1"),
    (dict(accumulate=2.0), r"accumulate must be an int >= 1 .*got 2\.0"),
    (dict(accumulate=True), "accumulate must be an int >= 1"),
    (dict(batch_size=12, accumulate=5), "batch_size=12 must be divisible by accumulate=5"),
    (dict(batch_size=2, accumulate=4), "batch_size=2 must be divisible by accumulate=4"),
])
def test_bad_accumulate_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


# TrainConfig()'s checkpoint record before `accumulate` existed: it must not change.
DEFAULT_RECORD = {"steps": 1000, "batch_size": 64, "lr": 3e-3, "warmup_steps": 50,
                  "min_lr_ratio": 0.1, "weight_decay": 0.1, "betas": [0.9, 0.95],
                  "grad_clip": 1.0, "grad_clip_value": 0.0, "aux_loss_coef": 0.01,
                  "train_on_prompt": False, "freeze_layers": 0, "checkpoint_every": 0,
                  "val_fraction": 0.0, "eval_every": 0, "log_every": 10, "seed": 0}


def test_checkpoint_records_the_config_as_before(tmp_path):
    assert config_fingerprint(TrainConfig()) == DEFAULT_RECORD
    assert config_fingerprint(TrainConfig(batch_size=64, accumulate=4)) == \
        {**DEFAULT_RECORD, "accumulate": 4}
    cfg = quiet(steps=2, save_every=2, out_dir=str(tmp_path))
    train(small_model(), ragged_data(), cfg)
    saved = json.loads((tmp_path / "checkpoint" / "state.json").read_text())["config"]
    assert saved == {**DEFAULT_RECORD, "steps": 2, "batch_size": 12, "lr": 1e-2,
                     "warmup_steps": 1, "log_every": 1}


def test_resume_with_accumulation_is_bit_exact(tmp_path):
    data = ragged_data(n=20)
    cfg = quiet(steps=5, accumulate=3, save_every=2, out_dir=str(tmp_path / "a"),
                val_fraction=0.2, eval_every=2)
    straight, resumed = small_model(), small_model()
    rs = train(straight, data, cfg)
    cfg_b = quiet(**{**cfg.__dict__, "out_dir": str(tmp_path / "b")})
    train(resumed, data, cfg_b, stop_after=3)
    rr = train(resumed, data, cfg_b, resume=tmp_path / "b" / "checkpoint")
    for (n, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert (rs.losses, rs.grad_norms, rs.evals) == (rr.losses, rr.grad_norms, rr.evals)
    other = quiet(**{**cfg_b.__dict__, "accumulate": 2})
    with pytest.raises(ValueError, match=r"accumulate \(checkpoint 3, now 2\)"):
        train(small_model(), data, other, resume=tmp_path / "b" / "checkpoint")
    one = quiet(**{**cfg_b.__dict__, "accumulate": 1})
    with pytest.raises(ValueError, match=r"accumulate \(checkpoint 3, now '<absent>'\)"):
        train(small_model(), data, one, resume=tmp_path / "b" / "checkpoint")


# ---------------------------------------------------------------------------------------------
# accumulate=1 is the code before the option, bit for bit


def old_sequence_loss(model, x, y, mask, weights=None):
    """minituner.trainer.sequence_loss as it was before `normaliser`."""
    logits = model(x)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")
    if weights is None:
        m = mask.flatten().float()
        return (ce * m).sum() / m.sum().clamp(min=1.0)
    m = mask.float()
    per_example = (ce.view_as(m) * m).sum(1) / m.sum(1).clamp(min=1.0)
    return (weights.to(per_example) * per_example).mean()


def old_one_step(self, step: int) -> bool:
    """_Run.one_step as it was before `accumulate`."""
    cfg, model = self.cfg, self.model
    for group in self.opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    idx = next(self.order)
    x, y, mask = (t.to(self.device) for t in self.data.batch(idx, cfg.train_on_prompt))
    w = None if self.data.weights is None else self.data.weights[idx].to(self.device)
    self.opt.zero_grad(set_to_none=True)
    try:
        loss = old_sequence_loss(model, x, y, mask, w)
        total = loss + cfg.aux_loss_coef * model.aux_loss() if hasattr(model, "aux_loss") \
            else loss
        total.backward()
    except FloatingPointError as err:
        return self.stop(step, "forward", f"non-finite values in the forward ({err}); "
                         "the update was skipped", True)
    if not math.isfinite(total.item()):
        return self.stop(step, "loss", "non-finite loss; the update was skipped", True)
    norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
    if not torch.isfinite(norm):
        name = first_nonfinite([(n, p.grad) for n, p in self.named]) or "grad_norm"
        return self.stop(step, name, "non-finite gradient; the update was skipped", True)
    norm = clip_gradients(self.params, cfg, norm)
    self.opt.step()
    params_ok = torch.isfinite(torch.nn.utils.get_total_norm(self.params))
    if not params_ok and (name := first_nonfinite(self.named)):
        return self.stop(step, name, "the update overflowed to a non-finite parameter; "
                         "parameters were not restored", False)
    self.window.append(loss.item())
    self.window_norms.append(norm.item())
    return True


def dropout_lora_model() -> nn.Module:
    model = small_model(n_layer=2)
    wrap_lora(model, ["q_proj", "v_proj", "up_proj"], r=2, dropout=0.1)
    return model


CASES = {
    "moe-aux": (lambda: small_model(n_experts=4, top_k=2), lambda: ragged_data(),
                dict(aux_loss_coef=0.3)),
    "weighted": (small_model, lambda: ragged_data().with_rewards([i % 4 for i in range(18)]),
                 dict(train_on_prompt=True)),
    "lora-dropout-clip": (dropout_lora_model, lambda: ragged_data(),
                          dict(grad_clip_value=1e-3, grad_clip=0.5)),
}


@pytest.mark.parametrize("case", CASES)
def test_accumulate_1_is_the_code_before_bit_for_bit(monkeypatch, case):
    make_model, make_data, kw = CASES[case]
    data, cfg = make_data(), quiet(steps=4, **kw)
    a = make_model()                   # small_model seeds torch: the same dropout masks
    ra = train(a, data, cfg)
    monkeypatch.setattr(_Run, "one_step", old_one_step)
    b = make_model()
    rb = train(b, data, cfg)
    assert (ra.losses, ra.grad_norms) == (rb.losses, rb.grad_norms)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n


# ---------------------------------------------------------------------------------------------
# activation memory: one micro-batch's


class SavedPeak:
    """The largest total of the tensors autograd holds for backward at any moment
    (saved_tensors_hooks): storages counted once, dropped once freed; parameters and buffers
    left out. A micro-batch's saved tensors are freed by its backward, before the next
    forward."""

    def __init__(self, model: nn.Module):
        self.exclude = {StorageWeakRef(t.untyped_storage()).cdata
                        for t in (*model.parameters(), *model.buffers())}
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ref = StorageWeakRef(s)
        if ref.cdata not in self.exclude:
            old = self.refs.get(ref.cdata)
            if old is None or old[0].expired():        # a freed storage's address reused
                self.refs[ref.cdata] = (ref, s.nbytes())
            live = sum(n for r, n in self.refs.values() if not r.expired())
            self.peak = max(self.peak, live)
        return t


def equal_length_data(rows: int, length: int) -> SequenceData:
    """Rows of `length` tokens, the second half scored: every micro-batch has the same shape."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 45, (rows, length), generator=g)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:, length // 2:] = True
    return SequenceData(tokens, mask, torch.full((rows,), length))


def saved_peak(regime: str, data: SequenceData, accumulate: int) -> int:
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig())
    if regime == "lora":
        wrap_minigpt_qlora(model, r=8, quantize=False)
    peak = SavedPeak(model)
    with torch.autograd.graph.saved_tensors_hooks(peak.pack, lambda t: t):
        train(model, data, quiet(steps=1, batch_size=len(data), accumulate=accumulate))
    return peak.peak


@pytest.mark.parametrize("regime", ["full", "lora"])
def test_saved_activations_are_one_micro_batch(regime):
    """MiniGPTConfig() (4 x 128, dense), batch 32 of 31 positions: the peak of the saved
    tensors over a step with accumulate = k is what `memory.activation_bytes` predicts for
    32 / k rows, plus what the trainer's loss keeps beyond the plain mean cross-entropy the
    formula counts (the float32 loss mask, 4 bytes per token) and the terms test_memory
    allows (the position ids, 8 per position, when the embedding trains, and a few 0-d
    tensors); when the embedding trains, the input ids are a view of the [b, 32] tokens the
    targets come from, one int64 per row more than the formula's [b, 31]."""
    data, t = equal_length_data(32, 32), 31
    shape = memory.TransformerShape.of(MiniGPTConfig())
    measured = {k: saved_peak(regime, data, k) for k in (1, 2, 4)}
    for k, got in measured.items():
        rows = 32 // k
        predicted = memory.activation_bytes(shape, regime, rows * t)
        extra = 4 * rows * t + (8 * rows + 8 * t if regime == "full" else 0) + 64
        assert 0 <= got - predicted <= extra, (k, got, predicted, extra)
    assert 3.8 < measured[1] / measured[4] < 4.2, measured
