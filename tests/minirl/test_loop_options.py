"""grpo_train's options beyond the plain loop (test_loop.py): micro-batch accumulation equal to
the whole batch, the loss family passed through, batches with nothing to learn skipped, and
the advantages' scale; plus group_advantages' scales and eps worked by hand."""

from __future__ import annotations

import pytest
import torch
from test_loop import COPY, cfg_of, length_reward, model_and_reference, params_of, run

from minigpt.tasks import Example
from minirl import exact_match, group_advantages, grpo_train, sample_groups

BATCH = dict(steps=2, prompts_per_step=4, group_size=3, max_new_tokens=4, temperature=0.9,
             kl_coef=0.2, lr=3e-2, seed=4)


def run64(cfg):
    """`run` in float64: AdamW divides by √v, so in float32 a weight whose gradient is near 0
    can move by a visible amount on a last-bit difference of the summation order."""
    model, ref = model_and_reference(ref_seed=1)
    model, ref = model.double(), ref.double()
    return grpo_train(model, COPY, length_reward, cfg, reference=ref), params_of(model)


def close_params(a: dict, b: dict, what: str) -> None:
    for name in a:
        why = (f"{what}: parameter {name} after 2 steps differs from the whole batch's; each "
               f"micro-batch must carry the whole batch's normalisation (grpo_loss totals)")
        torch.testing.assert_close(a[name], b[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, why=why: f"{why}\n{m}")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulated_micro_batches_equal_the_whole_batch(loss_type, accumulate):
    """12 rows of completions of different lengths cut into 2 or 3 parts: every part has its
    own token count, so a part normalised by its own count would give another update."""
    whole, p_whole = run64(cfg_of(**BATCH, loss_type=loss_type))
    parts, p_parts = run64(cfg_of(**BATCH, loss_type=loss_type, accumulate=accumulate))
    close_params(p_whole, p_parts, f"{loss_type}, accumulate={accumulate}")
    for a, b in zip(whole.records, parts.records, strict=True):
        for key in ("loss", "grad_norm", "mean_kl", "mean_ratio", "clip_fraction", "reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key


def test_with_accumulation_bnpo_averages_each_micro_batch_over_its_own_tokens():
    """bnpo is dapo on a whole batch; split, it is TRL's per-micro-batch token mean."""
    _, dapo = run64(cfg_of(**BATCH, loss_type="dapo"))
    _, bnpo = run64(cfg_of(**BATCH, loss_type="bnpo"))
    _, split = run64(cfg_of(**BATCH, loss_type="bnpo", accumulate=3))
    close_params(dapo, bnpo, "bnpo on the whole batch")
    assert any(not torch.allclose(dapo[n], split[n], atol=1e-6) for n in dapo)


def test_the_loss_family_reaches_the_loss():
    _, plain = run(cfg_of(**BATCH), ref_seed=1)
    for option in (dict(loss_type="dr_grpo"), dict(importance_sampling_level="sequence",
                                                   inner_steps=2),
                   dict(epsilon_high=0.01, clip_eps=0.01, inner_steps=2),
                   dict(kl_bias_correction=True, inner_steps=2),
                   dict(scale_rewards="none"), dict(scale_rewards="batch")):
        _, other = run(cfg_of(**{**BATCH, **option}), ref_seed=1)
        assert any(not torch.equal(plain[n], other[n]) for n in plain), option


NEVER = [Example("never", ex.prompt, "\u00a7") for ex in COPY]      # an answer no model gives


def test_a_batch_with_nothing_to_learn_makes_no_update():
    """Every answer wrong, so every advantage is 0: no AdamW step (its momentum and weight
    decay would still move the weights), the stats recorded all the same."""
    model, ref = model_and_reference()
    before = params_of(model)
    cfg = cfg_of(steps=2, prompts_per_step=4, group_size=2, max_new_tokens=2, lr=0.1,
                 weight_decay=0.5)
    result = grpo_train(model, NEVER, exact_match, cfg, reference=ref)
    assert all(torch.equal(before[n], p) for n, p in params_of(model).items()), (
        "a batch whose advantages are all 0 must not take an optimizer step")
    assert [r["skipped"] for r in result.records] == [True, True]
    assert all(r["mean_ratio"] == 1.0 and r["loss"] == 0.0 and "mean_kl" in r
               for r in result.records)
    moved = grpo_train(model, NEVER, exact_match, cfg_of(**{**cfg.__dict__,
                                                            "skip_zero_advantage": False}),
                       reference=ref)
    assert not moved.records[0]["skipped"]
    assert any(not torch.equal(before[n], p) for n, p in params_of(model).items())


def test_a_kl_term_still_teaches_when_the_advantages_are_all_0():
    model, ref = model_and_reference(ref_seed=1)
    before = params_of(model)
    cfg = cfg_of(steps=1, prompts_per_step=4, group_size=2, max_new_tokens=2, kl_coef=0.5)
    result = grpo_train(model, NEVER, exact_match, cfg, reference=ref)
    assert not result.records[0]["skipped"]
    assert any(not torch.equal(before[n], p) for n, p in params_of(model).items())


def test_samples_rows_is_a_micro_batch():
    model, _ = model_and_reference()
    s = sample_groups(model, COPY[:3], 2, 3, generator=torch.Generator().manual_seed(0))
    part = s.rows(slice(2, 5))
    assert torch.equal(part.tokens, s.tokens[2:5])
    assert torch.equal(part.target_mask, s.target_mask[2:5])
    assert part.completions == s.completions[2:5] and part.group.tolist() == [1, 1, 2]
    assert part.group_size == 2


# --- the advantages' scale and eps, by hand ------------------------------------------------

def test_near_equal_group_with_our_eps_and_trls():
    """[0.2, 0.25, 0.2, 0.2]: mean 0.2125, std 0.025 (Bessel); the 0.25 is 0.0375 above."""
    rewards = [[0.2, 0.25, 0.2, 0.2]]
    assert group_advantages(rewards)[0, 1].item() == pytest.approx(0.0375 / (0.025 + 1e-6))
    assert group_advantages(rewards, eps=1e-4)[0, 1].item() == pytest.approx(
        0.0375 / (0.025 + 1e-4))
    assert group_advantages(rewards)[0, 1].item() == pytest.approx(1.49994, abs=1e-5)
    assert group_advantages(rewards, eps=1e-4)[0, 1].item() == pytest.approx(1.49402,
                                                                              abs=1e-5)


def test_batch_scale_divides_every_group_by_one_std():
    rewards = [[0.0, 1.0, 1.0, 0.0], [0.2, 0.25, 0.2, 0.2]]
    flat = torch.tensor(rewards, dtype=torch.float64).flatten()
    std = flat.std().item()                                     # Bessel over all 8 rewards
    got = group_advantages(rewards, scale="batch")
    assert got[0].tolist() == pytest.approx([-0.5 / std, 0.5 / std, 0.5 / std, -0.5 / std],
                                            rel=1e-5)
    assert got[1, 1].item() == pytest.approx(0.0375 / std, rel=1e-5), (
        "scale='batch': the batch's std, not the group's")


def test_no_scale_keeps_the_difference_from_the_mean_and_flat_groups_are_0():
    got = group_advantages([[0.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]], scale="none")
    assert got.tolist() == [[-0.5, 0.5, 0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]
    for scale in ("group", "batch", "none"):
        assert not group_advantages([[0.1, 0.1, 0.1]], scale=scale).any(), scale


def test_a_bad_scale_is_named():
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages([[0.0, 1.0]], scale="prompt")


def test_length_reward_groups_disagree():
    """The helper reward of these tests gives every group some variance (so no batch here is
    skipped unless a test means it)."""
    model, _ = model_and_reference()
    s = sample_groups(model, COPY[:4], 3, 4, generator=torch.Generator().manual_seed(4))
    r = torch.tensor([length_reward(COPY[g], c) for g, c in zip(s.group.tolist(),
                                                                 s.completions, strict=True)])
    assert (r.view(4, 3).std(dim=1) > 0).all()
