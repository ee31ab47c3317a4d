"""minituner: SequenceData, the learning-rate schedule and the training loop.

Gradient checkpointing is in test_train_activations.py; save / resume, the NaN guard and
the metrics log are in test_train_resume.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import TOK, ZeroGradExtras, quiet, small_model, task_data

from minituner import SequenceData, TrainConfig, mean_loss, reward_weights, train, wrap_lora
from minituner.trainer import batches, clip_gradients, lr_at, sequence_loss

pytestmark = pytest.mark.usefixtures("single_thread")

def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# SequenceData

PAIRS = [([5, 6, 7], [8, 1]), ([4], [9, 1]), ([2, 3], [1])]


def test_from_pairs_hand_computed():
    d = SequenceData.from_pairs(PAIRS)
    assert len(d) == 3
    assert d.tokens.dtype == torch.int64 and d.answer_mask.dtype == torch.bool
    assert d.tokens.tolist() == [[5, 6, 7, 8, 1], [4, 9, 1, 0, 0], [2, 3, 1, 0, 0]]
    assert d.answer_mask.int().tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 0, 0], [0, 0, 1, 0, 0]]
    assert d.lengths.tolist() == [5, 3, 3]


def test_from_pairs_custom_pad():
    d = SequenceData.from_pairs([([3], [4, 1]), ([3, 3, 3], [1])], pad_id=44)
    assert d.tokens.tolist() == [[3, 4, 1, 44], [3, 3, 3, 1]]
    assert d.answer_mask.int().tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]


def test_batch_answer_only():
    d = SequenceData.from_pairs(PAIRS)
    x, y, m = d.batch(torch.tensor([1, 2]))
    # Longest row in the batch is 3 tokens, so 2 next-token pairs per row.
    assert x.tolist() == [[4, 9], [2, 3]]
    assert y.tolist() == [[9, 1], [3, 1]]
    assert m.int().tolist() == [[1, 1], [0, 1]]
    x, y, m = d.batch(torch.tensor([0, 1]))
    assert x.tolist() == [[5, 6, 7, 8], [4, 9, 1, 0]]
    assert y.tolist() == [[6, 7, 8, 1], [9, 1, 0, 0]]
    assert m.int().tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]


def test_batch_train_on_prompt():
    d = SequenceData.from_pairs(PAIRS)
    _, _, m = d.batch(torch.tensor([1, 2]), train_on_prompt=True)
    assert m.int().tolist() == [[1, 1], [1, 1]]
    _, y, m = d.batch(torch.tensor([0, 1]), train_on_prompt=True)
    assert m.int().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # Padding is never a target under either mask.
    _, y, m2 = d.batch(torch.tensor([0, 1, 2]), train_on_prompt=True)
    assert not m2[y == 0].any()


def test_batch_single_row_and_order():
    d = SequenceData.from_pairs(PAIRS)
    x, y, m = d.batch(torch.tensor([2]))
    assert (x.tolist(), y.tolist(), m.int().tolist()) == ([[2, 3]], [[3, 1]], [[0, 1]])
    x, _, _ = d.batch(torch.tensor([2, 0]))
    assert x.tolist() == [[2, 3, 1, 0], [5, 6, 7, 8]]


def test_from_pairs_rejects_empty():
    with pytest.raises(ValueError, match="empty answer"):
        SequenceData.from_pairs([([3], [4, 1]), ([3], [])])
    with pytest.raises(ValueError, match="at least one"):
        SequenceData.from_pairs([])


def test_empty_dataset_is_refused_before_training():
    """Built directly with no rows (today: a bare max() error from the first batch)."""
    empty = torch.zeros(0, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"tokens holds no examples \(N = 0\)"):
        SequenceData(empty, empty.bool(), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens holds no examples"):
        SequenceData.from_pairs(PAIRS).subset(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens must be a 2-D \[N, L\] tensor"):
        SequenceData(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.bool),
                     torch.ones(5, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# learning-rate schedule


def test_lr_warmup_is_linear():
    cfg = quiet(steps=100, lr=2e-3, warmup_steps=8)
    for s in range(8):
        assert lr_at(s, cfg) == pytest.approx(2e-3 * (s + 1) / 8, rel=1e-12)
    assert lr_at(8, cfg) == pytest.approx(2e-3, rel=1e-12)     # peak at the end of warm-up


def test_lr_cosine_shape():
    # 61 steps: the decay runs over steps 10..60, the last step (60) at the floor.
    cfg = quiet(steps=61, lr=1.0, warmup_steps=10, min_lr_ratio=0.2)
    values = [lr_at(s, cfg) for s in range(10, 61)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert min(values) >= 0.2
    # Halfway through the decay, the cosine is at its midpoint.
    assert lr_at(35, cfg) == pytest.approx(0.2 + 0.8 * 0.5, rel=1e-12)
    # The cosine reaches lr * min_lr_ratio at the end of the schedule, and stays there.
    assert lr_at(60, cfg) == pytest.approx(0.2, rel=1e-12)
    assert lr_at(500, cfg) == pytest.approx(0.2, rel=1e-12)


def test_lr_no_warmup():
    cfg = quiet(steps=11, lr=0.5, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(0, cfg) == pytest.approx(0.5)
    assert lr_at(5, cfg) == pytest.approx(0.25)


def test_lr_last_step_is_min():
    cfg = quiet(steps=20, lr=1.0, warmup_steps=5, min_lr_ratio=0.1)
    assert lr_at(cfg.steps - 1, cfg) == pytest.approx(0.1, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# TrainConfig and batches


@pytest.mark.parametrize("kw", [
    dict(steps=0), dict(batch_size=0), dict(log_every=0), dict(grad_clip=-1.0),
    dict(grad_clip_value=-0.5), dict(freeze_layers=-1), dict(checkpoint_every=-2),
    dict(eval_every=-1), dict(save_every=-1), dict(val_fraction=1.0), dict(val_fraction=-0.1),
    dict(val_fraction=0.2),                    # without eval_every: never evaluated
    dict(save_every=5),                        # without out_dir: nowhere to save
    dict(min_lr_ratio=-0.5),                   # today: a negative learning rate at the end
    dict(min_lr_ratio=1.5), dict(min_lr_ratio=math.nan),
])
def test_train_config_rejects(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        TrainConfig(**kw)


def test_batches_cover_each_epoch_once():
    cfg = quiet(batch_size=4, seed=3)
    it = batches(10, cfg)
    epoch = [next(it) for _ in range(2)]            # 10 // 4 = 2 full batches, rest dropped
    flat = torch.cat(epoch).tolist()
    assert all(len(b) == 4 for b in epoch) and len(set(flat)) == 8
    assert all(0 <= i < 10 for i in flat)
    again = batches(10, cfg)
    assert all(torch.equal(a, next(again)) for a in epoch)


def test_batches_fewer_rows_than_batch_size():
    it = batches(3, quiet(batch_size=8))
    for _ in range(3):
        assert sorted(next(it).tolist()) == [0, 1, 2]


def test_sequence_loss_matches_naive():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=g)
    y = torch.randint(0, 7, (2, 4), generator=g)
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    terms = [-torch.log_softmax(logits[b, t], -1)[y[b, t]] for b in range(2) for t in range(4)
             if mask[b, t]]
    got = sequence_loss(lambda x: logits, None, y, mask)
    assert got.item() == pytest.approx((sum(terms) / 3).item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# train


def test_train_memorizes():
    data = task_data("copy", n=8)
    model = small_model()
    x, y, m = data.batch(torch.arange(len(data)))
    with torch.no_grad():
        before = sequence_loss(model, x, y, m).item()
    res = train(model, data, quiet(steps=40, batch_size=8, lr=2e-2, warmup_steps=5,
                                   log_every=10))
    with torch.no_grad():
        after = sequence_loss(model, x, y, m).item()
    assert before > 2.5                              # about log(45) at init
    assert after < 0.1 * before
    assert res.final_loss < 0.2 * res.losses[0]
    assert len(res.losses) == 4 and res.steps == 40 and res.wall_time_s > 0


def test_train_moe_uses_aux_loss():
    data = task_data("add", n=6)
    model = small_model(n_experts=4, top_k=2)
    router = model.blocks[0].mlp.router.weight.detach().clone()
    res = train(model, data, quiet(steps=5, batch_size=6, aux_loss_coef=0.5))
    assert all(math.isfinite(v) for v in res.losses)
    assert not torch.equal(router, model.blocks[0].mlp.router.weight)


def test_train_deterministic():
    data = task_data("sort", n=12)
    base = small_model()
    a, b, c = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    cfg = dict(steps=6, batch_size=4, warmup_steps=2, log_every=2)
    ra = train(a, data, quiet(seed=7, **cfg))
    rb = train(b, data, quiet(seed=7, **cfg))
    train(c, data, quiet(seed=8, **cfg))
    assert ra.losses == rb.losses
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    # Another seed draws other batches (12 rows, batches of 4), so the weights differ.
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(),
                                                         strict=True))


def test_train_changes_only_trainable_params():
    data = task_data("kv", n=8)
    model = small_model()
    trainable = {"lm_head.weight", "blocks.0.attn.q_proj.weight", "blocks.0.mlp_norm.weight"}
    for n, p in model.named_parameters():
        p.requires_grad_(n in trainable)
    before = params_of(model)
    train(model, data, quiet(steps=3, batch_size=4, warmup_steps=0))
    for n, p in model.named_parameters():
        if n in trainable:
            assert not torch.equal(p, before[n]), f"{n} should have been trained"
        else:
            assert torch.equal(p, before[n]), f"{n} is frozen but changed"


def test_weight_decay_only_on_matrices():
    torch.manual_seed(0)
    model = ZeroGradExtras()
    lr, wd, steps = 0.1, 0.5, 3
    train(model, task_data(n=4), quiet(steps=steps, batch_size=4, lr=lr, warmup_steps=0,
                                       min_lr_ratio=1.0, weight_decay=wd))
    assert torch.equal(model.vec.detach(), torch.ones(5)), "1-D parameter was decayed"
    expected = torch.full((3, 4), (1 - lr * wd) ** steps)
    torch.testing.assert_close(model.mat.detach(), expected, rtol=1e-6, atol=0)


def test_train_without_trainable_params_raises():
    model = small_model()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        train(model, task_data(n=2), quiet(steps=1))


def test_eval_fn_schedule():
    data = task_data(n=4)
    model = small_model()
    calls = []

    def eval_fn(m):
        calls.append(m.training)
        return {"n": len(calls)}

    res = train(model, data, quiet(steps=7, batch_size=2, eval_every=3, log_every=3),
                eval_fn=eval_fn)
    assert res.evals == [{"step": 3, "n": 1}, {"step": 6, "n": 2}, {"step": 7, "n": 3}]
    assert len(res.losses) == 3                     # windows of 3, 3 and the last 1
    assert model.training

    res = train(small_model(), data, quiet(steps=6, batch_size=2, eval_every=3), eval_fn=eval_fn)
    assert [e["step"] for e in res.evals] == [3, 6]   # the end coincides: no double call
    res = train(small_model(), data, quiet(steps=2, batch_size=2, eval_every=0), eval_fn=eval_fn)
    assert res.evals == []


def test_logged_losses_are_window_means():
    """log_every=1 logs every step's loss; log_every=steps logs their mean."""
    data = task_data(n=8)
    a, b = small_model(), small_model()
    ra = train(a, data, quiet(steps=4, batch_size=4, log_every=1))
    rb = train(b, data, quiet(steps=4, batch_size=4, log_every=4))
    assert len(ra.losses) == 4 and len(rb.losses) == 1
    assert rb.losses[0] == pytest.approx(sum(ra.losses) / 4, rel=1e-12)


def test_prompt_masking_changes_training():
    data = task_data(n=8)
    a, b = small_model(), small_model()
    train(a, data, quiet(steps=2, batch_size=8, train_on_prompt=False))
    train(b, data, quiet(steps=2, batch_size=8, train_on_prompt=True))
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_sequence_loss_ignores_unmasked_targets():
    model = small_model().eval()
    d = task_data(n=3)
    x, y, m = d.batch(torch.arange(3))
    y2 = torch.where(m, y, (y + 7) % TOK.vocab_size)     # scramble every unscored target
    with torch.no_grad():
        assert sequence_loss(model, x, y, m).item() == sequence_loss(model, x, y2, m).item()
        logits = model(x)
    ref = F.cross_entropy(logits[m], y[m])
    assert sequence_loss(model, x, y, m).item() == pytest.approx(ref.item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# the default arithmetic and element-wise clipping, against a loop written out plainly


def reference_losses(model, data: SequenceData, cfg: TrainConfig) -> list[float]:
    """The training loop with every step spelled out: same batches, schedule and AdamW groups,
    the clamp and the global-norm clip by hand. Returns each step's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas)
    g = torch.Generator().manual_seed(cfg.seed)
    losses = []
    while len(losses) < cfg.steps:
        perm = torch.randperm(len(data), generator=g)
        for start in range(0, max(len(data) - cfg.batch_size, 0) + 1, cfg.batch_size):
            if len(losses) == cfg.steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(len(losses), cfg)
            x, y, m = data.batch(perm[start:start + cfg.batch_size])
            ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
            mf = m.flatten().float()
            loss = (ce * mf).sum() / mf.sum().clamp(min=1.0)
            opt.zero_grad()
            (loss + cfg.aux_loss_coef * model.aux_loss()).backward()
            if cfg.grad_clip_value:
                for p in params:
                    p.grad.clamp_(-cfg.grad_clip_value, cfg.grad_clip_value)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("clip", [dict(), dict(grad_clip_value=2e-3, grad_clip=0.5)])
def test_train_matches_reference_loop(clip):
    """Bit for bit: the default path must keep experiment 00's numbers, and the clamp must
    act before the norm clip."""
    data = task_data("sort", n=10)
    cfg = quiet(steps=6, batch_size=4, warmup_steps=2, log_every=1, **clip)
    a, b = small_model(), small_model()
    res = train(a, data, cfg)
    assert res.losses == reference_losses(b, data, cfg)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    if clip:      # the clamp bites: without it the run differs
        c = small_model()
        train(c, data, quiet(**{**cfg.__dict__, "grad_clip_value": 0.0}))
        assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_clip_gradients_hand_computed():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(1, 1))
    a.grad, b.grad = torch.tensor([3.0, -4.0, 0.5]), torch.tensor([[10.0]])
    norm = clip_gradients([a, b], quiet(grad_clip_value=2.0, grad_clip=1.0))
    # Clamped to [2, -2, 0.5] and [2]: norm sqrt(4 + 4 + 0.25 + 4) = 3.5, then scaled to ~1.
    assert norm.item() == pytest.approx(3.5, rel=1e-6)
    scale = 1.0 / (3.5 + 1e-6)
    torch.testing.assert_close(a.grad, torch.tensor([2.0, -2.0, 0.5]) * scale)
    torch.testing.assert_close(b.grad, torch.tensor([[2.0]]) * scale)
    a.grad = torch.tensor([3.0, -4.0, 0.0])
    b.grad = None
    assert clip_gradients([a, b], quiet(grad_clip=0.0)).item() == pytest.approx(5.0)
    assert a.grad.tolist() == [3.0, -4.0, 0.0]          # both clips off: untouched


# ---------------------------------------------------------------------------------------------
# reward-weighted SFT


def test_reward_weights_hand_computed():
    assert reward_weights([1.0, 2.0, 3.0]).tolist() == [0.0, 1.0, 2.0]
    assert reward_weights([-3.0, -1.0]).tolist() == [0.0, 2.0]      # negatives: shifted
    assert reward_weights([0, 1, 1, 0]).tolist() == [0.0, 2.0, 2.0, 0.0]   # rejection sampling
    w = reward_weights(torch.tensor([0.3, -1.2, 4.0, 0.0]))
    assert w.dtype == torch.float32 and w.min() == 0.0
    assert w.mean().item() == pytest.approx(1.0, rel=1e-6)
    # Offset and positive scale of the rewards do not matter.
    torch.testing.assert_close(reward_weights(2.5 * torch.tensor([0.3, -1.2, 4.0, 0.0]) - 7), w)


def test_reward_weights_all_equal_is_plain_sft():
    assert reward_weights([0.7] * 5).tolist() == [1.0] * 5
    assert reward_weights([-2.0]).tolist() == [1.0]


@pytest.mark.parametrize("bad, index", [([1.0, 2.0, math.nan], 2), ([math.inf, 0.0], 0),
                                        ([0.0, -math.inf, math.nan], 1)])
def test_reward_weights_reject_non_finite(bad, index):
    with pytest.raises(ValueError, match=rf"rewards\[{index}\]"):
        reward_weights(bad)
    with pytest.raises(ValueError, match="at least one"):
        reward_weights([])


def test_sequence_data_weights():
    d = SequenceData.from_pairs(PAIRS, rewards=[1.0, 0.0, 2.0])
    assert d.weights.tolist() == [1.0, 0.0, 2.0]
    assert SequenceData.from_pairs(PAIRS).weights is None
    assert d.subset(torch.tensor([2, 0])).weights.tolist() == [2.0, 1.0]
    assert SequenceData.from_pairs(PAIRS).with_rewards([5, 5, 5]).weights.tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="3 examples"):
        d.with_rewards([1.0, 2.0])
    with pytest.raises(ValueError, match="weights"):
        SequenceData(d.tokens, d.answer_mask, d.lengths, torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="weights"):
        SequenceData(d.tokens, d.answer_mask, d.lengths, torch.ones(2))


def test_weighted_loss_matches_per_example_loop():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 7, generator=g)
    y = torch.randint(0, 7, (3, 5), generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    w = torch.tensor([0.5, 0.0, 2.5])
    per_example = []
    for b in range(3):
        terms = [-torch.log_softmax(logits[b, t], -1)[y[b, t]] for t in range(5) if mask[b, t]]
        per_example.append(sum(terms) / len(terms))
    want = sum(wi * li for wi, li in zip(w, per_example, strict=True)) / 3
    got = sequence_loss(lambda x: logits, None, y, mask, w)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_zero_weight_examples_give_no_gradient():
    data = task_data("copy", n=3).with_rewards([1.0, 0.0, 0.0])      # weights [3, 0, 0]
    grads = []
    for idx in (torch.arange(3), torch.tensor([0])):
        model = small_model()
        x, y, m = data.batch(idx)
        sequence_loss(model, x, y, m, data.weights[idx]).backward()
        grads.append(model.lm_head.weight.grad)
    # Σ w·loss / b: alone, example 0 gives 3·loss_0 / 1; with the zero-weight two, 3·loss_0 / 3.
    torch.testing.assert_close(3 * grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_train_uses_weights():
    data = task_data("copy", n=8)
    a, b = small_model(), small_model()
    cfg = quiet(steps=3, batch_size=4)
    train(a, data, cfg)
    train(b, data.with_rewards([1, 0, 2, 0, 1, 0, 3, 0]), cfg)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


# ---------------------------------------------------------------------------------------------
# validation split


def test_split_is_deterministic_and_disjoint():
    d = task_data(n=10).with_rewards(list(range(10)))
    tr, va = d.split(0.3, seed=4)
    assert (len(tr), len(va)) == (7, 3)
    rows = {tuple(r) for r in d.tokens.tolist()}
    assert {tuple(r) for r in tr.tokens.tolist()} | {tuple(r) for r in va.tokens.tolist()} \
        == rows
    tr2, va2 = d.split(0.3, seed=4)
    assert torch.equal(va.tokens, va2.tokens) and torch.equal(tr.weights, tr2.weights)
    _, va3 = d.split(0.3, seed=5)
    assert not torch.equal(va.tokens, va3.tokens)
    with pytest.raises(ValueError, match="at least one"):
        d.split(0.01, seed=0)                  # round(0.1) = 0 validation rows


def test_train_val_fraction_reports_val_loss():
    data = task_data("copy", n=10)
    model = small_model()
    cfg = quiet(steps=4, batch_size=4, eval_every=2, val_fraction=0.3, seed=2)
    res = train(model, data, cfg, eval_fn=lambda m: {"probe": 1})
    assert [sorted(e) for e in res.evals] == [["probe", "step", "val_loss"]] * 2
    assert model.training
    # The last val_loss, by hand: mean cross-entropy over every answer token of the val rows.
    _, val = data.split(0.3, seed=2)
    model.eval()
    with torch.no_grad():
        x, y, m = val.batch(torch.arange(len(val)))
        want = F.cross_entropy(model(x)[m], y[m]).item()
    assert res.evals[-1]["val_loss"] == pytest.approx(want, rel=1e-5)
    assert mean_loss(model, val, batch_size=2) == pytest.approx(want, rel=1e-5)
    # The split is what train() trains on: the same as passing the parts explicitly.
    other = small_model()
    tr, va = data.split(0.3, seed=2)
    res2 = train(other, tr, quiet(**{**cfg.__dict__, "val_fraction": 0.0}), val_data=va,
                 eval_fn=lambda m: {"probe": 1})
    assert res2.evals == res.evals
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)


def test_val_data_conflicts():
    data = task_data(n=6)
    with pytest.raises(ValueError, match="either val_data or"):
        train(small_model(), data, quiet(steps=1, eval_every=1, val_fraction=0.5),
              val_data=data)
    with pytest.raises(ValueError, match="eval_every"):
        train(small_model(), data, quiet(steps=1), val_data=data)


# ---------------------------------------------------------------------------------------------
# freeze_layers


def test_freeze_layers_keeps_embeddings_and_first_blocks():
    data = task_data("copy", n=8)
    model = small_model(n_layer=3)
    before = params_of(model)
    train(model, data, quiet(steps=2, batch_size=4, warmup_steps=0, freeze_layers=2))
    for n, p in model.named_parameters():
        frozen = n.startswith(("tok_emb", "pos_emb", "blocks.0.", "blocks.1."))
        assert torch.equal(p, before[n]) == frozen, n
        assert p.requires_grad, f"{n}: train() must hand the model back as it found it"


def test_freeze_layers_only_touches_trainable_params():
    data = task_data("copy", n=8)
    model = small_model(n_layer=2)
    wrap_lora(model, ["q_proj", "v_proj"], r=2)
    before = params_of(model)
    train(model, data, quiet(steps=2, batch_size=4, warmup_steps=0, freeze_layers=1))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"blocks.1.attn.{m}.lora_{f}" for m in ("q_proj", "v_proj")
                       for f in "AB"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n in before if "lora_" in n}


def test_freeze_layers_rejects():
    with pytest.raises(ValueError, match="freeze_layers=1.*ZeroGradExtras"):
        train(ZeroGradExtras(), task_data(n=2), quiet(steps=1, freeze_layers=1))
    with pytest.raises(ValueError, match="freeze_layers=3 exceeds the 1 blocks of MiniGPT"):
        train(small_model(), task_data(n=2), quiet(steps=1, freeze_layers=3))
