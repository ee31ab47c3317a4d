"""MiniGPTConfig's MoE options (backend, renormalize, shared expert), configs written before
they existed, `set_moe_backend`, and token ids outside the vocabulary."""

from __future__ import annotations

import pytest
import torch

from minigpt import MiniGPT, MiniGPTConfig, load_base, load_checkpoint, save_checkpoint
from minimoe import MoEMLP

pytestmark = pytest.mark.usefixtures("single_thread")

TINY_MOE = dict(block_size=16, n_layer=2, n_head=3, n_embd=24, d_ff=40, n_experts=5, top_k=2)


def _moes(model) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def test_defaults_are_todays_behaviour_and_stay_out_of_the_dict():
    cfg = MiniGPTConfig(**TINY_MOE)
    assert (cfg.moe_backend, cfg.moe_renormalize, cfg.moe_shared_d_ff) == ("torch", None, 0)
    assert not any(key.startswith("moe_") for key in cfg.to_dict())
    changed = MiniGPTConfig(**TINY_MOE, moe_backend="triton", moe_renormalize=False,
                            moe_shared_d_ff=8)
    assert {k: v for k, v in changed.to_dict().items() if k.startswith("moe_")} == dict(
        moe_backend="triton", moe_renormalize=False, moe_shared_d_ff=8)
    assert MiniGPTConfig(**changed.to_dict()) == changed


@pytest.mark.parametrize("kw, field", [(dict(moe_backend="cuda"), "moe_backend"),
                                       (dict(moe_renormalize=1), "moe_renormalize"),
                                       (dict(moe_renormalize="yes"), "moe_renormalize"),
                                       (dict(moe_shared_d_ff=-1), "moe_shared_d_ff"),
                                       (dict(moe_shared_d_ff=True), "moe_shared_d_ff")])
def test_bad_moe_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        MiniGPTConfig(**TINY_MOE, **kw)


def test_the_options_reach_every_moe_mlp():
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(**TINY_MOE, moe_backend="triton", moe_renormalize=True,
                                  moe_shared_d_ff=8))
    for m in _moes(model):
        assert (m.backend, m.renormalize, m.shared_d_ff) == ("triton", True, 8)
        assert m.shared_w_down.shape == (8, 24)
    logits = model(torch.randint(0, 45, (2, 5)))
    assert logits.shape == (2, 5, 45) and torch.isfinite(logits).all()


def test_old_checkpoint_config_loads_with_the_defaults():
    """Experiment 00's MoE base was saved without the MoE options."""
    model = load_base("moe")
    assert model.config.moe_backend == "torch" and model.config.moe_renormalize is None
    assert all(m.backend == "torch" and m.shared_d_ff == 0 for m in _moes(model))


def test_options_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(1)
    model = MiniGPT(MiniGPTConfig(**TINY_MOE, moe_renormalize=False, moe_shared_d_ff=8))
    save_checkpoint(model, tmp_path / "m.safetensors")
    again = load_checkpoint(tmp_path / "m.safetensors")
    assert again.config == model.config
    x = torch.randint(0, 45, (1, 7))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_set_moe_backend_records_it_and_keeps_the_logits():
    torch.manual_seed(2)
    model = MiniGPT(MiniGPTConfig(**TINY_MOE)).eval()
    x = torch.randint(0, 45, (1, 9))
    with torch.no_grad():
        want = model(x)
        model.set_moe_backend("triton")
        got = model(x)
    assert model.config.moe_backend == "triton"
    assert all(m.backend == "triton" for m in _moes(model))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="backend"):
        model.set_moe_backend("cuda")


@pytest.mark.parametrize("bad", [45, 100, -1])
def test_token_ids_outside_the_vocabulary_are_a_value_error(bad):
    model = MiniGPT(MiniGPTConfig(**TINY_MOE))
    idx = torch.randint(0, 45, (2, 6))
    idx[1, 3] = bad
    with pytest.raises(ValueError, match=r"idx must hold token ids in 0\.\.44 \(vocab_size=45\)"):
        model(idx)


def test_float_token_ids_are_a_value_error():
    model = MiniGPT(MiniGPTConfig(**TINY_MOE))
    with pytest.raises(ValueError, match="idx must be an integer tensor"):
        model(torch.zeros(1, 4))
