"""minirl.sample_groups: layout of the rows, seeding, batching, block_size, every model kind
(dense, MoE, LoRA, QLoRA, the Triton MoE backend) and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from rl_support import PROMPTS, raise_eos, tiny
from support import TOK

from minigpt import greedy_generate
from minirl import NonFiniteLogitsError, Samples, sample_groups
from minituner import wrap_lora
from minituner.qlora import wrap_minigpt_qlora


def draw(model, prompts=PROMPTS, G=3, max_new=5, seed=0, **kw) -> Samples:
    return sample_groups(model, prompts, G, max_new,
                         generator=torch.Generator().manual_seed(seed), **kw)


def check_layout(s: Samples, prompts, G: int, max_new: int) -> None:
    """Every row: its prompt, then its completion (ending at <eos> or after max_new tokens),
    then padding; the masks, lengths, groups and decoded text agree with the tokens."""
    P = len(prompts)
    assert len(s) == P * G and s.n_prompts == P and s.group_size == G
    assert s.group.tolist() == [p for p in range(P) for _ in range(G)]
    for row in range(P * G):
        prompt = TOK.encode(prompts[row // G].prompt)
        n = len(prompt)
        assert s.tokens[row, :n].tolist() == prompt and s.prompt_lengths[row] == n
        positions = s.completion_mask[row].nonzero().flatten().tolist()
        assert positions == list(range(n, n + len(positions))) and 1 <= len(positions) <= max_new
        completion = s.tokens[row, positions].tolist()
        assert (TOK.eos_id in completion) == bool(s.finished[row])
        if s.finished[row]:
            assert completion.index(TOK.eos_id) == len(completion) - 1   # stops at the first
        else:
            assert len(completion) == max_new
        assert (s.tokens[row, n + len(completion):] == TOK.pad_id).all()
        assert s.completions[row] == TOK.decode(completion)
    assert s.target_mask.shape == (P * G, s.tokens.shape[1] - 1)
    assert torch.equal(s.target_mask, s.completion_mask[:, 1:])


def test_rows_hold_prompt_completion_and_padding(eos_model):
    s = draw(eos_model)
    check_layout(s, PROMPTS, 3, 5)
    lengths = s.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 2                # completions of different lengths
    assert s.finished.any() and not s.finished.all()     # some hit max_new_tokens


def test_one_prompt_group_of_two():
    s = draw(raise_eos(tiny()), PROMPTS[:1], G=2, max_new=1)
    check_layout(s, PROMPTS[:1], 2, 1)
    assert s.tokens.shape == (2, 4)


def test_same_seed_same_samples_other_seed_other_samples(eos_model):
    a, b, c = draw(eos_model, seed=3), draw(eos_model, seed=3), draw(eos_model, seed=4)
    assert torch.equal(a.tokens, b.tokens) and a.completions == b.completions
    assert not torch.equal(a.tokens, c.tokens)


def test_prompts_as_text_ids_or_examples_give_the_same_samples(eos_model):
    by_example = draw(eos_model)
    by_text = draw(eos_model, [ex.prompt for ex in PROMPTS])
    by_ids = draw(eos_model, [TOK.encode(ex.prompt) for ex in PROMPTS])
    assert torch.equal(by_example.tokens, by_text.tokens)
    assert torch.equal(by_example.tokens, by_ids.tokens)


def test_a_cold_temperature_is_greedy_decoding(eos_model):
    ids = [TOK.encode(ex.prompt) for ex in PROMPTS]
    greedy = greedy_generate(eos_model, ids, 5, TOK.eos_id)
    s = draw(eos_model, G=2, temperature=1e-4)
    for row in range(len(s)):
        mask = s.completion_mask[row]
        got = [t for t in s.tokens[row, mask].tolist() if t != TOK.eos_id]
        assert got == greedy[row // 2]


def test_prompts_of_one_length_are_decoded_as_one_batch(eos_model):
    batches = []
    eos_model.register_forward_pre_hook(lambda m, args: batches.append(tuple(args[0].shape)))
    draw(eos_model, G=3, max_new=5)
    # "ab=" and "xy=" (3 tokens) together: 2 prompts × G = 6 rows; "abc=" and "k=": 3 rows each
    assert sorted({b for b, _ in batches}) == [3, 6]
    six = [t for b, t in batches if b == 6]
    assert six == list(range(3, 3 + len(six)))       # one forward per new token of the batch
    assert len(batches) <= 3 * 5                     # 3 buckets, at most 5 steps each


def test_runs_in_eval_mode_and_restores_the_mode(eos_model):
    modes = []
    eos_model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    eos_model.train()
    draw(eos_model)
    assert modes and not any(modes) and eos_model.training
    eos_model.eval()
    draw(eos_model)
    assert not eos_model.training


def test_never_exceeds_block_size():
    model = tiny(block_size=8)
    s = sample_groups(model, ["abc="], 2, 4, generator=torch.Generator().manual_seed(0))
    assert s.tokens.shape[1] <= 8
    with pytest.raises(ValueError, match=r"prompts\[1\] has 5 tokens; with max_new_tokens=4 "
                                         r"the sequence could reach 9 tokens, more than the "
                                         r"model's block_size=8; use max_new_tokens <= 3"):
        sample_groups(model, ["abc=", "abcd="], 2, 4)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("wrap", ["lora", "qlora"])
def test_lora_and_qlora_models(kind, wrap):
    model = raise_eos(tiny(kind))
    if wrap == "lora":
        wrap_lora(model, ["q_proj", "v_proj"], r=4, dropout=0.1)
    else:
        wrap_minigpt_qlora(model, r=4)
    model.train()
    check_layout(draw(model), PROMPTS, 3, 5)
    assert model.training


def test_triton_moe_backend_samples_what_the_torch_backend_samples():
    """The Triton path (interpreted on a CPU) computes the same logits up to rounding, so
    the same generator draws the same tokens; on QLoRA-MoE, NF4 experts and expert LoRA."""
    model = raise_eos(tiny("moe"))
    wrap_minigpt_qlora(model, r=4)
    for mlp_lora in (m for n, m in model.named_modules() if n.endswith(".w_up")):
        torch.nn.init.normal_(mlp_lora.lora_B, std=0.5)     # a trained-looking adapter
    torch_samples = draw(model, PROMPTS[:2], G=2, max_new=2)
    model.set_moe_backend("triton")
    triton_samples = draw(model, PROMPTS[:2], G=2, max_new=2)
    assert torch.equal(torch_samples.tokens, triton_samples.tokens)


@pytest.mark.parametrize("kw, message", [
    (dict(group_size=0), "group_size must be an int >= 1, got 0"),
    (dict(group_size=2.0), "group_size must be an int >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    (dict(temperature=0.0), r"temperature must be finite and > 0 .*greedy_generate"),
    (dict(temperature=-1.0), "temperature must be finite and > 0"),
    (dict(temperature=math.nan), "temperature must be finite and > 0"),
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=["ab=", ""]), r"prompts\[1\] is empty"),
    (dict(prompts=["ab=", 3]), r"prompts\[1\] must be an Example, a string or a list of token"),
    (dict(prompts=[[3, True]]), r"prompts\[0\] must be"),
])
def test_bad_arguments_are_named(kw, message):
    args = dict(prompts=PROMPTS, group_size=2, max_new_tokens=3) | kw
    temperature = args.pop("temperature", 1.0)
    with pytest.raises(ValueError, match=message):
        sample_groups(tiny(), **args, temperature=temperature)


def test_nan_logits_are_refused_and_the_mode_restored():
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = math.nan
    model.train()
    with pytest.raises(NonFiniteLogitsError, match="logits while sampling hold NaN or"):
        draw(model)
    assert model.training
