"""The training loop's save / resume (bit-exact), its metrics log and its NaN guard."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import torch.nn as nn
from support import TOK, small_model, task_data

from minituner import TrainConfig, train, wrap_lora
from minituner import checkpoint as ckpt
from minituner.trainer import lr_at

pytestmark = pytest.mark.usefixtures("single_thread")


class Crash(Exception):
    pass


def lora_model() -> nn.Module:
    """A 2-layer MiniGPT with dropout-0.1 LoRA: resuming must replay the dropout RNG too."""
    model = small_model(n_layer=2)
    wrap_lora(model, ["q_proj", "v_proj", "up_proj"], r=2, dropout=0.1)
    return model


def probe(model) -> dict:
    """An eval_fn whose value depends on the parameters at the moment it runs."""
    return {"b_norm": sum(float(p.detach().norm()) for n, p in model.named_parameters()
                          if "lora_B" in n)}


def crash_at_call(k):
    calls = []

    def eval_fn(model):
        calls.append(1)
        if len(calls) == k:
            raise Crash
        return probe(model)
    return eval_fn


def run_cfg(out_dir, **kw) -> TrainConfig:
    # 10 rows, 2 validation, batches of 3 over 8: epochs end mid-run (batch order resumes
    # mid-epoch); log_every 4 leaves a half-full loss window at the step-5 checkpoint.
    base = dict(steps=12, batch_size=3, lr=1e-2, warmup_steps=2, log_every=4, eval_every=3,
                val_fraction=0.2, save_every=5, out_dir=str(out_dir), seed=3, progress=False)
    return TrainConfig(**{**base, **kw})


def log_lines(path) -> list[dict]:
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    for line in lines:
        assert line.pop("elapsed") >= 0
    return lines


def assert_same_run(a, ra, b, rb):
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    assert (ra.losses, ra.grad_norms, ra.evals, ra.steps) == \
        (rb.losses, rb.grad_norms, rb.evals, rb.steps)
    assert ra.final_loss == rb.final_loss


def test_resume_after_crash_is_bit_exact(tmp_path):
    data, base = task_data("copy", n=10), lora_model()
    straight, crashed = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(123)
    r_straight = train(straight, data, run_cfg(tmp_path / "a"), eval_fn=probe)
    torch.manual_seed(123)
    with pytest.raises(Crash):          # evaluations at 3, 6, 9: dies at 9, checkpoint at 5
        train(crashed, data, run_cfg(tmp_path / "b"), eval_fn=crash_at_call(3))
    torch.manual_seed(999)              # the resumed run must not depend on the RNG it finds
    r_resumed = train(crashed, data, run_cfg(tmp_path / "b"), eval_fn=probe,
                      resume=tmp_path / "b" / "checkpoint")
    assert_same_run(straight, r_straight, crashed, r_resumed)
    assert len(r_straight.losses) == 3 and len(r_straight.evals) == 4
    assert r_resumed.wall_time_s > 0
    # The log of the crashed run lost its lines after step 5 and got the redone ones once.
    assert log_lines(tmp_path / "a" / "metrics.jsonl") == log_lines(tmp_path / "b" /
                                                                      "metrics.jsonl")
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint", "metrics.jsonl"]
    assert sorted(os.listdir(tmp_path / "b" / "checkpoint")) == [
        "optimizer.safetensors", "rng.safetensors", "state.json", "trainable.safetensors"]


def test_resume_keeps_an_moe_routers_selection_bias(tmp_path):
    """The bias moves at every step (update_router_biases) without being a parameter: the
    checkpoint keeps it, so the resumed run does not continue from the crashed run's bias."""
    data = task_data("copy", n=10)
    base = small_model(n_layer=2, n_experts=4, top_k=2, moe_router="sigmoid_topk",
                       moe_bias_update_rate=0.01)
    straight, crashed = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(123)
    r_straight = train(straight, data, run_cfg(tmp_path / "a"), eval_fn=probe)
    torch.manual_seed(123)
    with pytest.raises(Crash):
        train(crashed, data, run_cfg(tmp_path / "b"), eval_fn=crash_at_call(3))
    r_resumed = train(crashed, data, run_cfg(tmp_path / "b"), eval_fn=probe,
                      resume=tmp_path / "b" / "checkpoint")
    assert_same_run(straight, r_straight, crashed, r_resumed)
    for (n, a), b in zip(straight.named_buffers(), crashed.buffers(), strict=True):
        assert torch.equal(a, b), f"{n} after the resumed run differs from the straight run's"
    assert any(b.abs().sum() > 0 for n, b in straight.named_buffers() if "router_bias" in n)


def test_stop_after_then_resume(tmp_path):
    data, base = task_data("sort", n=10), small_model()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    cfg = run_cfg(tmp_path, val_fraction=0.0, eval_every=0)
    ra = train(a, data, cfg)
    rb = train(b, data, cfg, stop_after=7)        # checkpoint at 5; steps 6 and 7 are lost
    assert rb.steps == 7 and rb.stopped_early is None
    rb = train(b, data, cfg, resume=tmp_path / "checkpoint")
    assert_same_run(a, ra, b, rb)
    # The checkpoint saved at the last step resumes to the same, finished run.
    rc = train(b, data, cfg, resume=tmp_path / "checkpoint")
    assert_same_run(a, ra, b, rc)


def test_resume_from_the_old_checkpoint_after_a_crash_mid_swap(tmp_path):
    data, base = task_data("copy", n=10), small_model()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    cfg = run_cfg(tmp_path, val_fraction=0.0, eval_every=0)
    ra = train(a, data, cfg)
    train(b, data, cfg, stop_after=6)
    os.replace(tmp_path / "checkpoint", tmp_path / "checkpoint.old")  # between the renames
    rb = train(b, data, cfg, resume=tmp_path / "checkpoint")
    assert_same_run(a, ra, b, rb)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    data, model = task_data("copy", n=10), small_model()
    cfg = run_cfg(tmp_path, val_fraction=0.0, eval_every=0)
    train(model, data, cfg, stop_after=5)
    real_write = ckpt._write

    def half_write(state, dir):
        real_write(state, dir)
        (dir / "state.json").write_text("{", encoding="utf-8")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write", half_write)
    with pytest.raises(OSError, match="disk full"):
        train(model, data, cfg, resume=tmp_path / "checkpoint")   # tries to save at 10
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "metrics.jsonl"]
    assert ckpt.load_state(tmp_path / "checkpoint").progress["step"] == 5


@pytest.fixture
def saved(tmp_path):
    """A checkpoint at step 5 of run_cfg (no validation) on 10 copy rows."""
    data = task_data("copy", n=10)
    cfg = run_cfg(tmp_path, val_fraction=0.0, eval_every=0)
    train(lora_model(), data, cfg, stop_after=5)
    return data, cfg, tmp_path / "checkpoint"


def test_resume_rejects_another_config(saved):
    data, cfg, path = saved
    bad = TrainConfig(**{**cfg.__dict__, "lr": 0.5, "seed": 4, "steps": 20})
    with pytest.raises(ValueError, match=r"lr \(checkpoint 0.01, now 0.5\).*seed.*steps"):
        train(lora_model(), data, bad, resume=path)
    # Where and how to report may change.
    ok = TrainConfig(**{**cfg.__dict__, "progress": False, "save_every": 0, "out_dir": None})
    assert train(lora_model(), data, ok, resume=path).steps == 12


def test_resume_rejects_other_trainable_params(saved):
    data, cfg, path = saved
    model = small_model(n_layer=2)
    wrap_lora(model, ["q_proj", "k_proj", "up_proj"], r=2, dropout=0.1)
    with pytest.raises(ValueError, match=r"not in the checkpoint: \['blocks.0.attn.k_proj"
                                         r".lora_A'.*not trainable here: \['blocks.0.attn"
                                         r".v_proj.lora_A'"):
        train(model, data, cfg, resume=path)
    wider = small_model(n_layer=2)
    wrap_lora(wider, ["q_proj", "v_proj", "up_proj"], r=3, dropout=0.1)
    with pytest.raises(ValueError, match=r"blocks.0.attn.q_proj.lora_A is \[3, 16\] here, "
                                         r"\[2, 16\] in the checkpoint"):
        train(wider, data, cfg, resume=path)


def test_resume_rejects_other_data(saved):
    _, cfg, path = saved
    with pytest.raises(ValueError, match="training data differs"):
        train(lora_model(), task_data("sort", n=10), cfg, resume=path)


def test_resume_rejects_missing_or_garbled(saved, tmp_path):
    data, cfg, path = saved
    with pytest.raises(FileNotFoundError, match="no training checkpoint"):
        train(lora_model(), data, cfg, resume=tmp_path / "nowhere")
    (path / "rng.safetensors").unlink()
    with pytest.raises(ValueError, match="missing rng.safetensors"):
        train(lora_model(), data, cfg, resume=path)
    (path / "rng.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="cannot read the training checkpoint"):
        train(lora_model(), data, cfg, resume=path)
    (path / "state.json").write_text('{"format": "something/9"}', encoding="utf-8")
    with pytest.raises(ValueError, match="something/9"):
        ckpt.load_state(path)


# ---------------------------------------------------------------------------------------------
# metrics log


def test_metrics_log_lines(tmp_path):
    data = task_data("copy", n=10)
    log = tmp_path / "m" / "log.jsonl"
    cfg = TrainConfig(steps=5, batch_size=4, log_every=2, eval_every=4, val_fraction=0.2,
                      log_path=str(log), progress=False)
    res = train(small_model(), data, cfg)
    lines = log_lines(log)
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["step"] for x in lines] == [2, 4, 4, 5, 5]
    assert [x["loss"] for x in train_lines] == res.losses
    assert [x["grad_norm"] for x in train_lines] == res.grad_norms
    assert [x["lr"] for x in train_lines] == [lr_at(s - 1, cfg) for s in (2, 4, 5)]
    assert [{k: v for k, v in x.items() if k != "kind"} for x in lines
            if x["kind"] == "eval"] == res.evals
    assert all(math.isfinite(x["val_loss"]) for x in lines if x["kind"] == "eval")


# ---------------------------------------------------------------------------------------------
# NaN guard


def test_nan_gradient_stops_with_the_last_good_state():
    data, base = task_data("copy", n=8), small_model()
    cfg = TrainConfig(steps=6, batch_size=4, warmup_steps=0, log_every=1, progress=False)
    want = copy.deepcopy(base)
    ref = train(want, data, cfg, stop_after=2)
    model = copy.deepcopy(base)
    name = "blocks.0.attn.q_proj.weight"
    backward_calls = []

    def poison(grad):
        backward_calls.append(1)
        return grad * math.nan if len(backward_calls) == 3 else grad

    dict(model.named_parameters())[name].register_hook(poison)
    with pytest.warns(RuntimeWarning, match=rf"step 3: non-finite gradient.*\({name}\).*"
                                            r"those after step 2"):
        res = train(model, data, cfg)
    assert res.stopped_early == {"step": 3, "tensor": name, "last_good_state": True,
                                 "reason": "non-finite gradient; the update was skipped"}
    assert res.steps == 2 and res.losses == ref.losses
    for (n, p), q in zip(model.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(p, q), n


class NaNAfter(nn.Module):
    """Wraps a model; its logits turn NaN from the k-th forward on."""

    def __init__(self, inner, k):
        super().__init__()
        self.inner, self.k, self.calls = inner, k, 0

    def forward(self, x):
        self.calls += 1
        out = self.inner(x)
        return out * math.nan if self.calls >= self.k else out


def test_nan_loss_stops():
    model = NaNAfter(small_model(), k=2)
    with pytest.warns(RuntimeWarning, match=r"step 2: non-finite loss.*\(loss\)"):
        res = train(model, task_data(n=8), TrainConfig(steps=4, batch_size=4,
                                                       progress=False))
    assert res.stopped_early["tensor"] == "loss" and res.steps == 1
    assert len(res.losses) == 1 and math.isfinite(res.losses[0])


class BigWeight(nn.Module):
    """A bigram model plus a weight just under float32's max whose gradient a hook pins to -1:
    the first AdamW step moves it up by lr, past the max, while loss and gradients are finite."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TOK.vocab_size, TOK.vocab_size)
        self.big = nn.Parameter(torch.tensor([3.39e38]))
        self.big.register_hook(lambda g: torch.full_like(g, -1.0))

    def forward(self, x):
        return self.emb(x) + 0.0 * self.big


def test_overflowing_update_stops_and_says_not_restored():
    torch.manual_seed(0)
    model = BigWeight()
    with pytest.warns(RuntimeWarning, match=r"step 1: the update overflowed.*\(big\).*"
                                            r"parameters hold non-finite values"):
        res = train(model, task_data(n=8), TrainConfig(steps=3, batch_size=4, lr=1e37,
                                                       warmup_steps=0, progress=False))
    assert res.stopped_early == {"step": 1, "tensor": "big", "last_good_state": False,
                                 "reason": "the update overflowed to a non-finite parameter; "
                                           "parameters were not restored"}
    assert model.big.item() == math.inf and res.steps == 0


class RouterNaNAfter(nn.Module):
    """From call k on, a layer that refuses NaN (minimoe's router) sees NaN and raises."""

    def __init__(self, inner: nn.Module, k: int):
        super().__init__()
        self.inner, self.k, self.calls = inner, k, 0

    def forward(self, x):
        from minimoe import route
        self.calls += 1
        out = self.inner(x)
        if self.calls >= self.k:
            route(torch.full((x.numel(), 4), math.nan), 2)
        return out


def test_forward_that_refuses_nan_stops_with_the_last_good_state():
    model = RouterNaNAfter(small_model(), k=3)
    with pytest.warns(RuntimeWarning, match=r"step 3: non-finite values in the forward"):
        res = train(model, task_data(n=8), TrainConfig(steps=5, batch_size=4,
                                                       progress=False))
    assert res.stopped_early["tensor"] == "forward" and res.steps == 2
    assert res.stopped_early["last_good_state"] is True
    assert "logits contain NaN" in res.stopped_early["reason"]


def test_other_forward_errors_still_raise():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = small_model()

        def forward(self, x):
            raise ValueError("a shape bug, not divergence")
    with pytest.raises(ValueError, match="shape bug"):
        train(Broken(), task_data(n=8), TrainConfig(steps=2, batch_size=4, progress=False))
