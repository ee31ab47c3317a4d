"""minigpt: config validation, the model, tokenizer, tasks, greedy decoding, evaluation and
checkpoints. Every answer is checked against an independent reference (a regex parse of the
prompt, a naive decoding loop, hand-built files)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from minigpt import (
    CharTokenizer,
    MiniGPT,
    MiniGPTConfig,
    evaluate,
    greedy_generate,
    load_base,
    load_checkpoint,
    save_checkpoint,
    tasks,
)
from minimoe import MoEMLP

pytestmark = pytest.mark.usefixtures("single_thread")

TOK = CharTokenizer()

# ---------------------------------------------------------------------------------------------
# MiniGPTConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_embd=30, n_head=4), "n_head"),
        (dict(n_embd=7, n_head=2), "n_embd"),
        (dict(n_experts=4, top_k=5), "top_k"),
        (dict(n_experts=4, top_k=0), "top_k"),
        (dict(n_experts=1, top_k=2), "top_k"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(block_size=0), "block_size"),
        (dict(n_layer=0), "n_layer"),
        (dict(n_embd=0), "n_embd"),
        (dict(d_ff=0), "d_ff"),
        (dict(d_ff=-3), "d_ff"),
        (dict(n_layer=-1), "n_layer"),
    ],
)
def test_config_rejects_bad_sizes_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MiniGPTConfig(**kwargs)


def test_config_zero_heads_is_a_value_error():
    with pytest.raises(ValueError, match="n_head"):
        MiniGPTConfig(n_head=0)


def test_config_accepts_good_sizes():
    MiniGPTConfig(n_embd=6, n_head=3, n_experts=3, top_k=3)   # top_k == n_experts is fine
    MiniGPTConfig(n_experts=0, top_k=99)                      # dense: top_k is not used
    cfg = MiniGPTConfig(n_embd=5, n_head=1, d_ff=1, n_layer=1, block_size=1, vocab_size=1)
    assert cfg.to_dict() == dict(vocab_size=1, block_size=1, n_layer=1, n_head=1, n_embd=5,
                                 d_ff=1, n_experts=0, top_k=2, norm_eps=1e-5)


def test_default_vocab_matches_tokenizer():
    assert MiniGPTConfig().vocab_size == CharTokenizer().vocab_size == 45


# ---------------------------------------------------------------------------------------------
# MiniGPT


@pytest.mark.parametrize("B, T", [(1, 1), (3, 7), (2, 16)])
def test_forward_shape(tiny_model, B, T):
    idx = torch.randint(0, tiny_model.config.vocab_size, (B, T))
    logits = tiny_model(idx)
    assert logits.shape == (B, T, tiny_model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_moe_model_uses_moe_mlp(tiny_cfg, tiny_moe_cfg):
    assert not any(isinstance(m, MoEMLP) for m in MiniGPT(tiny_cfg).modules())
    moe = MiniGPT(tiny_moe_cfg)
    assert sum(isinstance(m, MoEMLP) for m in moe.modules()) == tiny_moe_cfg.n_layer


def test_init_is_finite_and_small(tiny_model):
    for name, p in tiny_model.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.dim() > 1:
            assert 0 < p.std() < 0.05, name


@pytest.mark.parametrize("t", [0, 5, 10])
def test_causal(tiny_model, t):
    """Changing tokens after position t changes no logit at positions <= t."""
    g = torch.Generator().manual_seed(t)
    V = tiny_model.config.vocab_size
    idx = torch.randint(0, V, (2, 12), generator=g)
    other = idx.clone()
    other[:, t + 1:] = (idx[:, t + 1:] + 1 + torch.randint(0, V - 1, idx[:, t + 1:].shape,
                                                           generator=g)) % V
    assert (other[:, t + 1:] != idx[:, t + 1:]).all()
    with torch.no_grad():
        a, b = tiny_model(idx), tiny_model(other)
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], rtol=0, atol=1e-6)
    # ... while the positions that see the change do move (the check is not vacuous).
    assert (a[:, t + 1:] - b[:, t + 1:]).abs().amax() > 1e-4


@pytest.mark.parametrize("n_experts", [0, 5])
def test_forward_bfloat16(tiny_cfg, n_experts):
    cfg = MiniGPTConfig(**{**tiny_cfg.to_dict(), "n_experts": n_experts})
    torch.manual_seed(0)
    model = MiniGPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 6))
    with torch.no_grad():
        ref = model(idx)
        got = model.to(torch.bfloat16)(idx)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=0.1, atol=0.05)


def test_sequence_longer_than_block_size_raises(tiny_model):
    bs = tiny_model.config.block_size
    tiny_model(torch.zeros(1, bs, dtype=torch.long))          # exactly block_size is fine
    with pytest.raises(ValueError, match="block_size"):
        tiny_model(torch.zeros(1, bs + 1, dtype=torch.long))


def test_parameter_names_follow_llama(tiny_cfg, tiny_moe_cfg):
    dense = {n for n, _ in MiniGPT(tiny_cfg).named_parameters()}
    for i in range(tiny_cfg.n_layer):
        for proj in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert f"blocks.{i}.{proj}.weight" in dense
    moe = {n for n, _ in MiniGPT(tiny_moe_cfg).named_parameters()}
    for proj in ("attn.q_proj.weight", "attn.o_proj.weight", "mlp.router.weight",
                 "mlp.w_gate", "mlp.w_up", "mlp.w_down"):
        assert f"blocks.0.{proj}" in moe
    # No biases anywhere (Llama-style bias-free projections).
    assert not any(n.endswith(".bias") for n in dense | moe)


def test_aux_loss_dense_is_zero(tiny_cfg):
    model = MiniGPT(tiny_cfg)
    model(torch.randint(0, tiny_cfg.vocab_size, (2, 9)))
    aux = model.aux_loss()
    assert aux.shape == () and float(aux) == 0.0


def test_aux_loss_moe_is_about_one_per_layer(tiny_moe_cfg):
    torch.manual_seed(0)
    model = MiniGPT(tiny_moe_cfg)
    model(torch.randint(0, tiny_moe_cfg.vocab_size, (3, 16)))
    aux = model.aux_loss()
    assert aux.shape == ()
    assert torch.isfinite(aux)
    # Near-uniform routing at init: N·Σ f·P ≈ Σ f = 1 per MoE layer.
    assert 0.9 * tiny_moe_cfg.n_layer < aux.detach().item() < 1.5 * tiny_moe_cfg.n_layer
    # It must carry a gradient to the routers (that is what it is for).
    aux.backward()
    for block in model.blocks:
        assert block.mlp.router.weight.grad is not None
        assert block.mlp.router.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# CharTokenizer


def test_tokenizer_round_trip_every_task():
    for task in tasks.TASKS:
        for split in ("train", "eval"):
            for ex in tasks.make_examples(task, 100, seed=3, split=split):
                for text in (ex.prompt, ex.answer, ex.prompt + ex.answer):
                    ids = TOK.encode(text)
                    assert len(ids) == len(text)
                    assert all(2 <= i < TOK.vocab_size for i in ids)
                    assert TOK.decode(ids) == text


def test_tokenizer_whole_alphabet_round_trip():
    ids = TOK.encode(TOK.alphabet)
    assert ids == list(range(2, TOK.vocab_size))
    assert TOK.decode(torch.tensor(ids)) == TOK.alphabet


@pytest.mark.parametrize("text", ["A", "ab!", "é", "a\nb", "add:1*2="])
def test_tokenizer_unknown_char_raises(text):
    with pytest.raises(ValueError, match="alphabet"):
        TOK.encode(text)


def test_tokenizer_decode_stops_at_eos_and_skips_pad():
    pad, eos = TOK.pad_id, TOK.eos_id
    assert (pad, eos) == (0, 1)
    assert TOK.decode(TOK.encode("ab") + [eos] + TOK.encode("cd")) == "ab"
    assert TOK.decode([pad] + TOK.encode("a") + [pad, pad] + TOK.encode("b") + [pad]) == "ab"
    assert TOK.decode([eos]) == ""
    assert TOK.decode([]) == ""
    # Anything after <eos> is ignored, even ids that would be invalid.
    assert TOK.decode(TOK.encode("z") + [eos, 999]) == "z"


@pytest.mark.parametrize("bad", [45, 1000, -1])
def test_tokenizer_decode_out_of_vocab_raises(bad):
    with pytest.raises(ValueError, match="vocabulary"):
        TOK.decode([TOK.encode("a")[0], bad])


def test_tokenizer_rejects_repeated_alphabet():
    with pytest.raises(ValueError, match="repeat"):
        CharTokenizer("abca")


# ---------------------------------------------------------------------------------------------
# tasks


def _check_add(prompt):
    m = re.fullmatch(r"add:(\d+)\+(\d+)=", prompt)
    a, b = int(m[1]), int(m[2])
    assert 0 <= a <= 99 and 0 <= b <= 99
    return str(a + b)


def _word_of(task, prompt):
    m = re.fullmatch(task + r":([a-z]+)=", prompt)
    assert 2 <= len(m[1]) <= 6
    return m[1]


def _check_kv(prompt):
    m = re.fullmatch(r"kv:((?:[a-z][0-9],)*[a-z][0-9])\?([a-z])=", prompt)
    pairs = m[1].split(",")
    keys = [p[0] for p in pairs]
    assert len(set(keys)) == len(keys), "keys must be distinct"
    assert 2 <= len(keys) <= 4
    table = {p[0]: p[1] for p in pairs}
    return table[m[2]]


def _check_count(prompt):
    m = re.fullmatch(r"count:([abc]+)\?([abc])=", prompt)
    word, q = m[1], m[2]
    assert 3 <= len(word) <= 7
    return str(sum(ch == q for ch in word))


REFERENCE = {
    "add": _check_add,
    "copy": lambda p: _word_of("copy", p),
    "rev": lambda p: _word_of("rev", p)[::-1],
    "sort": lambda p: "".join(sorted(_word_of("sort", p))),
    "kv": _check_kv,
    "count": _check_count,
}


def test_every_task_has_a_reference_check():
    assert set(tasks.TASKS) == set(REFERENCE)
    assert tasks.HELD_OUT in tasks.TASKS
    assert tasks.HELD_OUT not in tasks.PRETRAIN_TASKS
    assert set(tasks.PRETRAIN_TASKS) | {tasks.HELD_OUT} == set(tasks.TASKS)


@pytest.mark.parametrize("task", sorted(REFERENCE))
@pytest.mark.parametrize("split", ["train", "eval"])
def test_task_answers_are_correct(task, split):
    for ex in tasks.make_examples(task, 150, seed=11, split=split):
        assert ex.task == task
        assert ex.prompt.endswith("=")
        assert ex.answer, "answers are never empty"
        assert REFERENCE[task](ex.prompt) == ex.answer, ex


@pytest.mark.parametrize("task", sorted(REFERENCE))
def test_tasks_deterministic_from_seed(task):
    a = tasks.make_examples(task, 40, seed=1)
    assert a == tasks.make_examples(task, 40, seed=1)
    assert len(a) == 40
    assert a != tasks.make_examples(task, 40, seed=2)
    assert a != tasks.make_examples(task, 40, seed=1, split="eval")
    # A shorter request is a prefix of a longer one (one stream per (task, seed, split)).
    assert tasks.make_examples(task, 10, seed=1) == a[:10]


@pytest.mark.parametrize("task", sorted(REFERENCE))
def test_splits_disjoint(task):
    train = tasks.make_examples(task, 400, seed=0, split="train")
    evals = tasks.make_examples(task, 300, seed=5, split="eval")
    assert {ex.prompt for ex in train}.isdisjoint(ex.prompt for ex in evals)
    assert all(tasks.split_of(ex.prompt) == "train" for ex in train)
    assert all(tasks.split_of(ex.prompt) == "eval" for ex in evals)


def test_split_fraction_is_about_eval_fraction():
    prompts = {f"add:{a}+{b}=" for a in range(100) for b in range(100)}
    frac = sum(tasks.split_of(p) == "eval" for p in prompts) / len(prompts)
    assert abs(frac - tasks.EVAL_FRACTION) < 0.02


def test_make_mixture():
    mix = tasks.make_mixture(["add", "kv", "rev"], 7, seed=4)
    assert mix == tasks.make_mixture(["add", "kv", "rev"], 7, seed=4)
    assert sorted(ex.task for ex in mix) == ["add"] * 7 + ["kv"] * 7 + ["rev"] * 7
    assert set(mix) == set(tasks.make_examples("add", 7, 4) + tasks.make_examples("kv", 7, 4)
                           + tasks.make_examples("rev", 7, 4))


def test_unknown_task_or_split_raises():
    with pytest.raises(ValueError, match="task"):
        tasks.make_examples("mul", 3)
    with pytest.raises(ValueError, match="split"):
        tasks.make_examples("add", 3, split="test")


# ---------------------------------------------------------------------------------------------
# greedy_generate


class SuccessorStub(nn.Module):
    """Predicts last_token + 1 while the last token is in [2, stop), else <eos>.

    Refuses inputs longer than its block_size, as MiniGPT does."""

    VOCAB, EOS, STOP = 20, 1, 10

    def __init__(self, block_size: int = 4):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size)
        self.dummy = nn.Parameter(torch.zeros(()))
        self.batch_sizes: list[int] = []

    @classmethod
    def successor(cls, t: int) -> int:
        return t + 1 if 2 <= t < cls.STOP else cls.EOS

    def forward(self, idx):
        assert idx.shape[1] <= self.config.block_size
        self.batch_sizes.append(idx.shape[0])
        nxt = idx.clone().apply_(self.successor)
        return F.one_hot(nxt, self.VOCAB).float() * 5.0 - 1.0


def successor_reference(prompt, max_new):
    out, t = [], prompt[-1]
    for _ in range(max_new):
        t = SuccessorStub.successor(t)
        if t == SuccessorStub.EOS:
            break
        out.append(t)
    return out


@pytest.mark.parametrize("max_new", [0, 1, 3, 5, 12])
def test_greedy_generate_stub(max_new):
    prompts = [[2], [5, 3], [9, 9, 9, 9, 9, 7], [10], [4, 4], [6], [12, 2, 8]]
    model = SuccessorStub(block_size=4).train()
    got = greedy_generate(model, prompts, max_new_tokens=max_new, eos_id=SuccessorStub.EOS)
    assert got == [successor_reference(p, max_new) for p in prompts]
    assert model.training, "greedy_generate must restore training mode"
    # Equal-length prompts were decoded together: never more rows than the largest group.
    assert max(model.batch_sizes, default=0) <= 3


def test_greedy_generate_hand_checked():
    got = greedy_generate(SuccessorStub(), [[2], [5, 3], [10]], max_new_tokens=5, eos_id=1)
    assert got == [[3, 4, 5, 6, 7], [4, 5, 6, 7, 8], []]
    got = greedy_generate(SuccessorStub(), [[7]], max_new_tokens=10, eos_id=1)
    assert got == [[8, 9, 10]]


def test_greedy_generate_empty_prompt_raises():
    with pytest.raises(ValueError, match="empty"):
        greedy_generate(SuccessorStub(), [[3], []], max_new_tokens=2, eos_id=1)


def naive_greedy(model, prompt, max_new, eos_id):
    """One token at a time, one prompt at a time, the whole (cropped) sequence each step."""
    seq, out = list(prompt), []
    for _ in range(max_new):
        ctx = torch.tensor([seq[-model.config.block_size:]])
        with torch.no_grad():
            nxt = int(model(ctx)[0, -1].argmax())
        if nxt == eos_id:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


def test_greedy_generate_batched_matches_one_at_a_time(tiny_model):
    # Scale the weights up so that greedy choices are far from ties.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in tiny_model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    V = tiny_model.config.vocab_size
    lengths = [1, 3, 3, 7, 1, 12, 7, 15, 3]
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in lengths]
    eos = 1
    batched = greedy_generate(tiny_model, prompts, max_new_tokens=6, eos_id=eos)
    single = [greedy_generate(tiny_model, [p], max_new_tokens=6, eos_id=eos)[0] for p in prompts]
    naive = [naive_greedy(tiny_model, p, 6, eos) for p in prompts]
    assert batched == single == naive
    assert len({tuple(x) for x in batched}) > 1, "degenerate model: all continuations equal"


# ---------------------------------------------------------------------------------------------
# evaluate


class OracleStub(nn.Module):
    """Answers each prompt from a table: one character per step, then <eos>."""

    def __init__(self, table: dict[str, str]):
        super().__init__()
        self.table = table
        self.config = SimpleNamespace(block_size=64)
        self.dummy = nn.Parameter(torch.zeros(()))
        self.eq = TOK.encode("=")[0]

    def forward(self, idx):
        B, T = idx.shape
        logits = torch.zeros(B, T, TOK.vocab_size)
        for b, row in enumerate(idx.tolist()):
            end = row.index(self.eq) + 1
            prompt, gen = TOK.decode(row[:end]), row[end:]
            answer = self.table[prompt]
            if TOK.eos_id in gen or len(gen) >= len(answer):
                nxt = TOK.eos_id
            else:
                nxt = TOK.encode(answer[len(gen)])[0]
            logits[b, -1, nxt] = 1.0
        return logits


class EosStub(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(block_size=64)
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, TOK.vocab_size)
        logits[..., TOK.eos_id] = 1.0
        return logits


@pytest.mark.parametrize("task", sorted(REFERENCE))
def test_evaluate_oracle_and_eos(task):
    n, seed = 25, 3
    examples = tasks.make_examples(task, n, seed=seed, split="eval")
    oracle = OracleStub({ex.prompt: ex.answer for ex in examples})
    assert evaluate(oracle, task, n=n, seed=seed) == 1.0
    assert evaluate(EosStub(), task, n=n, seed=seed) == 0.0


def test_evaluate_counts_exact_matches():
    n, seed = 30, 0
    examples = tasks.make_examples("add", n, seed=seed, split="eval")
    table, wrong = {}, 0
    for i, ex in enumerate(examples):
        if i % 3 == 0:                        # one extra digit: not an exact match
            table[ex.prompt], wrong = ex.answer + "0", wrong + 1
        elif i % 3 == 1:                      # a prefix only: not an exact match either
            table[ex.prompt] = ex.answer[:-1] if len(ex.answer) > 1 else "x"
            wrong += 1
        else:
            table[ex.prompt] = ex.answer
    assert evaluate(OracleStub(table), "add", n=n, seed=seed) == pytest.approx(1 - wrong / n)


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoint_round_trip(tiny_model, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(tiny_model, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(tiny_model.state_dict())
        assert json.loads(f.metadata()["config"]) == tiny_model.config.to_dict()
    loaded = load_checkpoint(path).eval()
    assert isinstance(loaded, MiniGPT)
    assert loaded.config == tiny_model.config
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    idx = torch.randint(0, tiny_model.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(loaded(idx), tiny_model(idx))


def test_checkpoint_overwrite(tmp_path, tiny_cfg):
    path = tmp_path / "ckpt.safetensors"
    torch.manual_seed(0)
    save_checkpoint(MiniGPT(tiny_cfg), path)
    torch.manual_seed(1)
    second = MiniGPT(tiny_cfg)
    save_checkpoint(second, path)
    assert torch.equal(load_checkpoint(path).lm_head.weight, second.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]


def test_load_checkpoint_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_load_checkpoint_without_config(tmp_path, tiny_cfg):
    path = tmp_path / "raw.safetensors"
    save_file(MiniGPT(tiny_cfg).state_dict(), path)
    with pytest.raises(ValueError, match="config"):
        load_checkpoint(path)


def _save_with_config(state, cfg, path):
    save_file({k: v.contiguous() for k, v in state.items()}, path,
              metadata={"config": json.dumps(cfg.to_dict())})


def test_load_checkpoint_missing_key(tmp_path, tiny_cfg):
    state = MiniGPT(tiny_cfg).state_dict()
    del state["blocks.1.attn.k_proj.weight"]
    _save_with_config(state, tiny_cfg, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.1\.attn\.k_proj\.weight'\]"):
        load_checkpoint(tmp_path / "c.safetensors")


def test_load_checkpoint_unexpected_key(tmp_path, tiny_cfg):
    state = dict(MiniGPT(tiny_cfg).state_dict())
    state["extra.weight"] = torch.zeros(2)
    _save_with_config(state, tiny_cfg, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"unexpected keys \['extra\.weight'\]"):
        load_checkpoint(tmp_path / "c.safetensors")


def test_load_checkpoint_shape_mismatch(tmp_path, tiny_cfg):
    state = MiniGPT(tiny_cfg).state_dict()
    other = MiniGPTConfig(**{**tiny_cfg.to_dict(), "d_ff": tiny_cfg.d_ff + 8})
    _save_with_config(state, other, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="shape mismatches.*up_proj"):
        load_checkpoint(tmp_path / "c.safetensors")


def test_load_checkpoint_dense_weights_under_moe_config(tmp_path, tiny_cfg, tiny_moe_cfg):
    _save_with_config(MiniGPT(tiny_cfg).state_dict(), tiny_moe_cfg, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="router"):
        load_checkpoint(tmp_path / "c.safetensors")


@pytest.mark.parametrize("name", ["Dense", "large", "", "base_dense"])
def test_load_base_bad_name(name):
    with pytest.raises(ValueError, match="dense"):
        load_base(name)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_forward_and_generate_match_cpu(tiny_model):
    idx = torch.randint(0, tiny_model.config.vocab_size, (2, 9))
    with torch.no_grad():
        cpu = tiny_model(idx)
        gpu = tiny_model.to("cuda")(idx.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-4)
    out = greedy_generate(tiny_model, [[3, 4], [5]], max_new_tokens=3, eos_id=1)
    assert len(out) == 2 and all(len(o) <= 3 for o in out)
