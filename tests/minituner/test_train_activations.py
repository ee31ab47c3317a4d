"""Gradient checkpointing: MiniGPT's segments, the loop's protocol, and the bytes it saves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from support import ZeroGradExtras, small_model, task_data

from minigpt import MiniGPT, MiniGPTConfig
from minituner import TrainConfig, peak_step_bytes, saved_activation_bytes, train, wrap_lora
from minituner.qlora import wrap_minigpt_qlora

pytestmark = pytest.mark.usefixtures("single_thread")

FOUR = dict(block_size=24, n_layer=4, n_head=2, n_embd=32, d_ff=64)


def grads_of(model: nn.Module, x: torch.Tensor, every: int, seed: int = 0) -> dict:
    """Parameter gradients of sum(logits²) + aux loss, with checkpointing every `every`."""
    model = copy.deepcopy(model)
    model.set_gradient_checkpointing(every)
    torch.manual_seed(seed)                          # the same dropout masks in every run
    out = model(x)
    (out.pow(2).sum() + model.aux_loss()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["dense", "moe", "lora_dropout", "qlora_moe"])
def test_checkpointed_gradients_are_identical(kind):
    torch.manual_seed(0)
    if kind in ("moe", "qlora_moe"):
        model = MiniGPT(MiniGPTConfig(**{**FOUR, "n_layer": 3}, n_experts=4, top_k=2))
    else:
        model = MiniGPT(MiniGPTConfig(**FOUR))
    if kind == "qlora_moe":
        # NF4 experts checkpoint each expert linear themselves: nested inside the blocks'
        wrap_minigpt_qlora(model, r=4)
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                nn.init.normal_(p, std=0.02)
    if kind == "lora_dropout":
        wrap_lora(model, ["q_proj", "v_proj", "down_proj"], r=4, dropout=0.1)
        for m in model.modules():
            if hasattr(m, "lora_B"):
                nn.init.normal_(m.lora_B, std=0.02)   # B = 0 would hide A's gradient
    model.train()
    x = torch.randint(0, 45, (3, 24), generator=torch.Generator().manual_seed(1))
    plain = grads_of(model, x, 0)
    assert plain
    for every in (1, 2, 3, 4):
        got = grads_of(model, x, every)
        assert got.keys() == plain.keys()
        for n in plain:     # exact on CPU float32: recomputation replays the same kernels
            assert torch.equal(got[n], plain[n]), f"every={every}: {n}"


def test_set_gradient_checkpointing_rejects_and_skips_no_grad():
    model = small_model(n_layer=2)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="every"):
            model.set_gradient_checkpointing(bad)
    x = torch.randint(0, 45, (2, 10))
    with torch.no_grad():
        want = model(x)
        model.set_gradient_checkpointing(1)
        assert torch.equal(model(x), want)


def test_train_with_checkpointing_is_bit_identical():
    data = task_data("copy", n=8)
    a, b = small_model(n_layer=3), small_model(n_layer=3)
    cfg = dict(steps=3, batch_size=4, progress=False)
    ra = train(a, data, TrainConfig(**cfg))
    rb = train(b, data, TrainConfig(**cfg, checkpoint_every=2))
    assert ra.losses == rb.losses
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    assert b.checkpoint_every == 0, "train() turns checkpointing off again"


def test_checkpoint_every_needs_the_protocol():
    with pytest.raises(ValueError, match="checkpoint_every=2.*ZeroGradExtras"):
        train(ZeroGradExtras(), task_data(n=2), TrainConfig(steps=1, checkpoint_every=2,
                                                            progress=False))


def hook_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Independent count: bytes autograd packs for backward, each storage once, parameters and
    the input excluded."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), x)}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(seen.values())


def test_checkpointing_cuts_saved_activation_bytes(capsys):
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(**FOUR)).train()
    B, T, C = 8, 24, FOUR["n_embd"]
    x = torch.randint(0, 45, (B, T), generator=torch.Generator().manual_seed(0))
    held = {}
    for every in (0, 1, 2, 4):
        model.set_gradient_checkpointing(every)
        held[every] = saved_activation_bytes(model, x)
        assert held[every] == hook_saved_bytes(model, x), every
    with capsys.disabled():
        print("\nsaved activation bytes, 4-layer MiniGPT (n_embd 32, batch 8x24): "
              + ", ".join(f"every={k}: {v}" for k, v in held.items())
              + f"; no checkpointing / every=1 = {held[0] / held[1]:.1f}x")
    assert held[1] * 5 < held[0]                  # measured: about 10.7x fewer bytes
    # Longer segments keep fewer boundaries: each one is a [B, T, C] float32 tensor.
    assert held[1] - held[2] == 2 * B * T * C * 4
    assert held[2] - held[4] == 1 * B * T * C * 4


def test_peak_step_bytes_bounds_and_checkpointing():
    """The peak of a step holds at least what the forward saved plus every gradient; with
    activations much larger than the trained parameters, checkpointing lowers it."""
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(**FOUR)).train()
    wrap_lora(model, ["q_proj", "v_proj"], r=2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 45, (16, 24), generator=g), torch.randint(0, 45, (16, 24), generator=g)
    grads = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    peak = {}
    for every in (0, 1):
        model.set_gradient_checkpointing(every)
        peak[every] = peak_step_bytes(model, x, y)
        assert peak[every] >= saved_activation_bytes(model, x, y) + grads
        assert all(p.grad is None for p in model.parameters())
    assert peak[1] * 2 < peak[0], peak
