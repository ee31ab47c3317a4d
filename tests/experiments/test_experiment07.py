"""Experiment 07's measures against independent references: MaxVio on known answers, the
expert load of a padded batch against each sequence run alone, and a config whose routers
are the ones its docstring names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from labkit.experiment import load_script
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, tasks
from minimoe import MoEMLP
from minimoe.routers import route

EXP = Path(__file__).resolve().parents[2] / "experiments" / "07-moe-routing"
exp07 = load_script(EXP / "experiment.py", "experiment_07_test")


@pytest.mark.parametrize("shares, expected", [([0.25] * 4, 0.0), ([1.0, 0.0, 0.0, 0.0], 3.0),
                                              ([0.5, 0.25, 0.125, 0.125], 1.0)])
def test_max_vio_known_answers(shares, expected):
    assert exp07.max_vio(shares) == pytest.approx(expected)


def naive_load(model: MiniGPT, examples) -> torch.Tensor:
    """Each sequence alone at its own length (no padding at all), counted: [L, E] shares."""
    tok = CharTokenizer()
    model.eval()
    mlps = [b.mlp for b in model.blocks]
    counts = torch.zeros(len(mlps), model.config.n_experts)
    with torch.no_grad():
        for e in examples:
            model(torch.tensor([tok.encode(e.prompt) + tok.encode(e.answer) + [tok.eos_id]]))
            for layer, mlp in enumerate(mlps):
                for expert in mlp.last_experts.flatten().tolist():
                    counts[layer, expert] += 1
    return counts / counts.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("router", [{}, {"moe_router": "sigmoid_topk"},
                                    {"moe_router": "group_topk", "moe_n_group": 3,
                                     "moe_topk_group": 2}])
def test_expert_load_of_a_padded_batch_equals_each_sequence_alone(router):
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(n_layer=2, n_head=2, n_embd=24, d_ff=8, n_experts=6, top_k=2,
                                  block_size=32, **router))
    for mlp in (b.mlp for b in model.blocks):
        assert isinstance(mlp, MoEMLP)
        torch.nn.init.normal_(mlp.router.weight, std=1.0)     # a router with preferences
    examples = tasks.make_mixture(["copy", "kv", "sort"], 7, seed=4, split="eval")
    data = exp07.task_data(examples, CharTokenizer())
    assert len(set(data.lengths.tolist())) > 1                 # padding in the batch
    got = torch.tensor(exp07.expert_load(model, data, batch_size=5))     # awkward batches
    want = naive_load(model, examples)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert exp07.max_vio(got[0].tolist()) > 0.1                # not trivially even


def test_the_config_trains_the_routers_it_names():
    cfg = json.loads((EXP / "config.json").read_text())
    built = {name: exp07.model_config(spec, cfg) for name, spec in cfg["routers"].items()}
    assert {n: c.moe_router for n, c in built.items()} == {
        "softmax_aux": "softmax_topk", "softmax_none": "softmax_topk",
        "sigmoid_bias": "sigmoid_topk", "group_v3": "group_topk", "group_v2": "group_topk"}
    assert built["group_v3"].moe_group_score == "top2_sum"
    assert (built["group_v2"].moe_group_score, built["group_v2"].moe_scoring) == ("max",
                                                                                  "softmax")
    for name in ("group_v3", "group_v2"):      # a group limit that limits something
        c = built[name]
        assert c.moe_topk_group * c.n_experts // c.moe_n_group > c.top_k, name
    assert built["group_v2"].moe_topk_group < built["group_v2"].top_k, (
        "V2's max rule with topk_group >= top_k is plain top-k (see the test below): the run "
        "would repeat softmax_aux")
    biased = {n for n, c in built.items() if c.moe_bias_update_rate > 0}
    balanced = {n for n, s in cfg["routers"].items() if s["aux_loss_coef"] > 0}
    assert biased == {"sigmoid_bias", "group_v3"}
    assert balanced == {"softmax_aux", "group_v2"}
    assert not biased & balanced
    # every router but its own options is experiment 00's MoE
    base = json.loads((EXP.parent / "00-pretrain-base" / "config.json").read_text())
    assert cfg["model"] == base["models"]["moe"]["model"]


def test_the_max_group_rule_with_as_many_groups_as_k_is_plain_top_k():
    """Why group_v2 keeps one group for k = 2: the best expert's group has the largest max,
    the second best expert's group the largest max among the rest, so the k best experts
    always lie in the topk_group >= k best groups. V3's top-2 sum has no such shortcut."""
    logits = torch.randn(500, 8, generator=torch.Generator().manual_seed(1))
    plain = route(logits, 2, "softmax_topk")
    v2 = route(logits, 2, "group_topk", n_group=4, topk_group=2, group_score="max",
               scoring="softmax")
    assert torch.equal(v2[1], plain[1]) and torch.equal(v2[0], plain[0])
    v2_one = route(logits, 2, "group_topk", n_group=2, topk_group=1, group_score="max",
                   scoring="softmax")
    v3 = route(logits, 2, "group_topk", n_group=4, topk_group=2, group_score="top2_sum",
               scoring="softmax")
    assert not torch.equal(v2_one[1], plain[1]) and not torch.equal(v3[1], plain[1])
