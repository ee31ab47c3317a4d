"""minituner: SequenceData, the learning-rate schedule and the training loop."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks
from minituner import SequenceData, TrainConfig, train
from minituner.train import batches, lr_at, sequence_loss

pytestmark = pytest.mark.usefixtures("single_thread")

TOK = CharTokenizer()
SMALL = dict(block_size=24, n_layer=1, n_head=2, n_embd=16, d_ff=32)


def quiet(**kw) -> TrainConfig:
    return TrainConfig(**{"progress": False, **kw})


def task_data(task="copy", n=8, seed=0) -> SequenceData:
    exs = tasks.make_examples(task, n, seed=seed)
    return SequenceData.from_pairs([(TOK.encode(ex.prompt), TOK.encode(ex.answer) + [TOK.eos_id])
                                    for ex in exs])


def small_model(seed=0, **kw) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(MiniGPTConfig(**{**SMALL, **kw}))


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


@pytest.mark.parametrize("kw", [dict(steps=0), dict(batch_size=0), dict(log_every=0)])
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


class ZeroGradExtras(nn.Module):
    """A bigram model plus a 1-D and a 2-D parameter that get exactly-zero gradients, so that
    AdamW changes them only through weight decay."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TOK.vocab_size, 8)
        self.head = nn.Linear(8, TOK.vocab_size)
        self.vec = nn.Parameter(torch.ones(5))
        self.mat = nn.Parameter(torch.ones(3, 4))

    def forward(self, x):
        return self.head(self.emb(x)) + 0.0 * (self.vec.sum() + self.mat.sum())


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
