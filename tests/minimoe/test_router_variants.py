"""The router variants in a trainable MoEMLP and MiniGPT: softmax, sigmoid with a selection bias,
group-limited top-k (DeepSeek-V3's top-2-sum groups, V2's max groups, sigmoid or softmax
scores). Checked against transformers' own blocks (tiny configs, random weights copied in;
nothing is downloaded), against per-token loops and hand-computed numbers, and trained end
to end with the auxiliary-loss-free bias update."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from support import quiet, task_data

from minigpt import MiniGPT, MiniGPTConfig, base_path, load_base, load_checkpoint, save_checkpoint
from minimoe import MoEMLP, load_balancing_loss, route, update_router_biases
from minimoe.hf import moe_from_hf
from minituner import train

pytestmark = pytest.mark.usefixtures("single_thread")

C, FF, E, K = 24, 20, 8, 3


def _moes(model) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


# --- transformers' blocks ---------------------------------------------------------------------

def _hf_block(kind: str, **kw):
    tf = pytest.importorskip("transformers")
    if kind == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
        cfg = tf.DeepseekV3Config(hidden_size=C, intermediate_size=32, moe_intermediate_size=FF,
                                  n_routed_experts=E, num_experts_per_tok=K,
                                  n_shared_experts=1, num_attention_heads=2,
                                  num_key_value_heads=2, hidden_act="silu", **kw)
    elif kind == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Block
        cfg = tf.DeepseekV2Config(hidden_size=C, intermediate_size=32, moe_intermediate_size=FF,
                                  n_routed_experts=E, num_experts_per_tok=K,
                                  n_shared_experts=2, num_attention_heads=2,
                                  num_key_value_heads=2, hidden_act="silu", **kw)
    elif kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as Block,
        )
        cfg = tf.Qwen3MoeConfig(hidden_size=C, moe_intermediate_size=FF, num_experts=E,
                                num_experts_per_tok=K, **kw)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = tf.MixtralConfig(hidden_size=C, intermediate_size=FF, num_local_experts=E,
                               num_experts_per_tok=K)
    cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.3)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:            # a selection bias that changes choices
            bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(9)) * 0.2)
    return block


def _dense(weights, experts) -> torch.Tensor:
    """[T, k] choices and weights as [T, E] (0 where not chosen): order-free comparison."""
    return torch.zeros(weights.shape[0], E).scatter(1, experts, weights.float())


# (kind, HF config options, what moe_from_hf must read from the block)
HF_CASES = {
    "v3": ("deepseek_v3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               norm_topk_prob=True),
           dict(method="group_topk", n_group=4, topk_group=2, group_score="top2_sum",
                scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5)),
    "v3-raw": ("deepseek_v3", dict(n_group=4, topk_group=2, routed_scaling_factor=0.5,
                                   norm_topk_prob=False),
               dict(method="group_topk", renormalize=False, routed_scaling_factor=0.5)),
    "v3-sigmoid": ("deepseek_v3", dict(n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                       norm_topk_prob=True),
                   dict(method="group_topk", n_group=1, topk_group=1)),
    "v2-group": ("deepseek_v2", dict(n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                     routed_scaling_factor=1.5),
                 dict(method="group_topk", n_group=4, topk_group=2, group_score="max",
                      scoring="softmax", renormalize=False, routed_scaling_factor=1.5)),
    "v2-greedy": ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=2.0),
                  dict(method="softmax_topk", renormalize=False, routed_scaling_factor=2.0)),
    "qwen3": ("qwen3_moe", dict(norm_topk_prob=False), dict(method="softmax_topk",
                                                            renormalize=False)),
    "qwen3-norm": ("qwen3_moe", dict(norm_topk_prob=True), dict(method="softmax_topk",
                                                                renormalize=True)),
    "mixtral": ("mixtral", {}, dict(method="softmax_topk", renormalize=True)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_moe_mlp_matches_transformers_block_and_its_choices(case):
    kind, options, expected = HF_CASES[case]
    block = _hf_block(kind, **options)
    m = moe_from_hf(block)
    for name, value in expected.items():
        assert getattr(m, name) == value, (name, getattr(m, name), value)
    assert m.has_router_bias == (m.method != "softmax_topk")    # V2's group router: all 0
    if kind == "deepseek_v3":
        assert torch.equal(m.router_bias, block.gate.e_score_correction_bias)
        assert m.shared_d_ff == FF and not m.shared_gated
    x = torch.randn(3, 7, C, generator=torch.Generator().manual_seed(4))      # T = 21
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
        # The routing itself: the same experts with the same weights, token by token.
        _, hf_weights, hf_experts = block.gate(x.reshape(-1, C))
        weights, experts = m.route(F.linear(x.reshape(-1, C), m.router.weight))
    assert torch.equal(experts.sort(dim=1).values, hf_experts.sort(dim=1).values)
    torch.testing.assert_close(_dense(weights, experts), _dense(hf_weights, hf_experts),
                               rtol=1e-5, atol=1e-6)


def test_the_v3_case_depends_on_its_group_rule_and_bias():
    """The V3 comparison above can fail: V2's max rule, or no bias, choose other experts."""
    block = _hf_block("deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                      norm_topk_prob=True)
    m = moe_from_hf(block)
    x = torch.randn(21, C, generator=torch.Generator().manual_seed(4))
    logits = F.linear(x, m.router.weight)
    _, want = m.route(logits)
    common = dict(bias=m.router_bias, n_group=4, topk_group=2)
    _, by_max = route(logits, K, "group_topk", group_score="max", **common)
    _, no_bias = route(logits, K, "group_topk", n_group=4, topk_group=2)
    assert not torch.equal(want.sort(1).values, by_max.sort(1).values)
    assert not torch.equal(want.sort(1).values, no_bias.sort(1).values)


def test_sigmoid_topk_mlp_matches_deepseek_v3_with_one_group():
    """MoEMLP(method="sigmoid_topk") is V3's router with a single group."""
    block = _hf_block("deepseek_v3", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                      norm_topk_prob=True)
    ours = MoEMLP(C, FF, E, K, renormalize=True, shared_d_ff=FF, shared_gated=False,
                  method="sigmoid_topk")
    ours.load_state_dict(moe_from_hf(block).state_dict())
    x = torch.randn(1, 9, C, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), block(x), rtol=1e-5, atol=1e-5)


# --- group_topk's rules against a per-token loop ----------------------------------------------

def naive_group_route(row, k, n_group, topk_group, group_score, scoring, bias=None,
                      renormalize=True, scale=1.0):
    """One token in plain Python: scores (sigmoid, or softmax over the row), the bias added for
    selection only, groups ranked by their best selection score ("max") or the sum of their
    two best ("top2_sum"), the k best experts of the topk_group best groups; ties to the lower
    index."""
    n = len(row)
    if scoring == "softmax":
        z = [math.exp(v - max(row)) for v in row]
        s = [v / sum(z) for v in z]
    else:
        s = [1 / (1 + math.exp(-v)) for v in row]
    sel = [s[i] + (bias[i] if bias else 0.0) for i in range(n)]
    size = n // n_group
    best = [sorted(sel[g * size:(g + 1) * size], reverse=True) for g in range(n_group)]
    rank = [b[0] if group_score == "max" else sum(b[:2]) for b in best]
    groups = sorted(range(n_group), key=lambda g: (-rank[g], g))[:topk_group]
    candidates = [i for g in groups for i in range(g * size, (g + 1) * size)]
    chosen = sorted(candidates, key=lambda i: (-sel[i], i))[:k]
    w = [s[i] for i in chosen]
    if renormalize:
        w = [v / sum(w) for v in w]
    return chosen, [v * scale for v in w]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("group_score", ["max", "top2_sum"])
@pytest.mark.parametrize("T, n_experts, n_group, topk_group, k", [
    (7, 8, 4, 2, 3), (5, 6, 3, 1, 2), (9, 12, 4, 3, 5), (3, 6, 6, 2, 2)])
def test_group_topk_variants_match_the_loop(T, n_experts, n_group, topk_group, k, group_score,
                                            scoring):
    g = torch.Generator().manual_seed(T * 10 + n_experts)
    logits = torch.randn(T, n_experts, generator=g) * 2
    bias = torch.randn(n_experts, generator=g) * 0.05
    for b, renormalize, scale in ((None, True, 1.0), (bias, False, 2.5)):
        w, e = route(logits, k, "group_topk", renormalize, bias=b, n_group=n_group,
                     topk_group=topk_group, routed_scaling_factor=scale,
                     group_score=group_score, scoring=scoring)
        for t, row in enumerate(logits.tolist()):
            chosen, want = naive_group_route(row, k, n_group, topk_group, group_score, scoring,
                                             None if b is None else b.tolist(), renormalize,
                                             scale)
            assert e[t].tolist() == chosen, (t, group_score, scoring)
            assert w[t].tolist() == pytest.approx(want, rel=1e-5, abs=1e-7), t


def test_group_rules_hand_computed_with_ties():
    # Groups {0,1} {2,3} {4,5}, softmax scores p_i = e^{x_i} / Z, Z = e² + e⁻¹ + 2e^1.5 + 2.
    logits = torch.tensor([[2.0, -1.0, 1.5, 1.5, 0.0, 0.0]])
    Z = math.exp(2) + math.exp(-1) + 2 * math.exp(1.5) + 2
    common = dict(n_group=3, topk_group=1, scoring="softmax")
    # V2's max: group {0,1} (e² beats e^1.5), so experts 0 then 1, raw softmax mass.
    w, e = route(logits, 2, "group_topk", False, group_score="max", **common)
    assert e.tolist() == [[0, 1]]
    assert w.tolist()[0] == pytest.approx([math.exp(2) / Z, math.exp(-1) / Z], rel=1e-6)
    # V3's top-2 sum: {2,3} (2e^1.5 = 8.96 beats e² + e⁻¹ = 7.76); its experts tie: 2 first.
    w, e = route(logits, 2, "group_topk", False, group_score="top2_sum", **common)
    assert e.tolist() == [[2, 3]]
    assert w.tolist()[0] == pytest.approx([math.exp(1.5) / Z] * 2, rel=1e-6)
    # Two groups tie under either rule: the lower group wins, then its lower expert.
    tied = torch.tensor([[1.0, 0.0, 0.0, 1.0, -1.0, -1.0]])
    for rule in ("max", "top2_sum"):
        for scoring in ("softmax", "sigmoid"):
            _, e = route(tied, 2, "group_topk", n_group=3, topk_group=1, group_score=rule,
                         scoring=scoring)
            assert e.tolist() == [[0, 1]], (rule, scoring)


def test_group_options_are_checked():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="group_score must be one of"):
        route(logits, 2, "group_topk", n_group=4, topk_group=2, group_score="sum")
    with pytest.raises(ValueError, match="scoring must be one of"):
        route(logits, 2, "group_topk", n_group=4, topk_group=2, scoring="tanh")
    with pytest.raises(ValueError, match="group_score / scoring are for the 'group_topk'"):
        route(logits, 2, "sigmoid_topk", scoring="softmax")
    with pytest.raises(ValueError, match="bias_update_rate is for routers with a selection"):
        MoEMLP(C, FF, E, 2, bias_update_rate=0.1)
    with pytest.raises(ValueError, match="bias_update_rate must be a finite number"):
        MoEMLP(C, FF, E, 2, method="sigmoid_topk", bias_update_rate=-0.1)
    with pytest.raises(ValueError, match="topk_group"):
        MoEMLP(C, FF, E, 2, method="group_topk", n_group=4)


# --- the balancing loss of a sigmoid router ---------------------------------------------------

def test_sigmoid_balancing_loss_uses_normalised_scores():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 4, generator=g)
    experts = torch.tensor([[0, 1], [0, 2], [3, 0], [1, 2], [0, 1]])
    counts = [sum(row.count(i) for row in experts.tolist()) for i in range(4)]
    s = [[1 / (1 + math.exp(-v)) for v in row] for row in logits.tolist()]
    p = [sum(r[i] / sum(r) for r in s) / 5 for i in range(4)]
    want = 4 * sum(c / 10 * pi for c, pi in zip(counts, p, strict=True))
    got = load_balancing_loss(logits, experts, scoring="sigmoid")
    assert got.item() == pytest.approx(want, rel=1e-6)
    assert got.item() != pytest.approx(load_balancing_loss(logits, experts).item(), rel=1e-3)
    # Balanced: equal scores and equal counts give 1.
    even = load_balancing_loss(torch.zeros(4, 4), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]]),
                               scoring="sigmoid")
    assert even.item() == pytest.approx(1.0)


def test_moe_mlp_aux_loss_follows_its_router():
    x = torch.randn(11, C, generator=torch.Generator().manual_seed(3))
    for method, kw, scoring in (("softmax_topk", {}, "softmax"),
                                ("sigmoid_topk", {}, "sigmoid"),
                                ("group_topk", dict(n_group=4, topk_group=2), "sigmoid"),
                                ("group_topk", dict(n_group=4, topk_group=2,
                                                    scoring="softmax"), "softmax")):
        torch.manual_seed(0)
        m = MoEMLP(C, FF, E, K, method=method, **kw)
        m(x)
        logits = F.linear(x, m.router.weight)
        want = load_balancing_loss(logits, m.last_experts, scoring=scoring)
        assert torch.equal(m.aux_loss, want), method


# --- the selection bias and its update --------------------------------------------------------

def _one_hot_router(method="sigmoid_topk", k=1, rate=0.1, **kw) -> MoEMLP:
    """4 experts on 4-dim tokens: token e_j (a unit vector) has logit 5 + j/2 for expert j,
    -5 + i/2 for the others (so its runner-up is expert 3, or 2 for j = 3)."""
    torch.manual_seed(0)
    m = MoEMLP(4, 6, 4, k, method=method, bias_update_rate=rate, **kw)
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(4) * 10 - 5 + torch.arange(4.0)[:, None] / 2)
    return m


def _tokens(*experts) -> torch.Tensor:
    return torch.eye(4)[list(experts)]


def test_bias_update_hand_computed():
    m = _one_hot_router()
    m.train()
    m(_tokens(0, 0, 1, 3))                      # counts 2 1 0 1 ...
    m(_tokens(0, 3))                            # ... then 3 1 0 2
    with torch.no_grad():
        m(_tokens(2, 2, 2))                     # no gradients: not counted
    m.eval()
    m(_tokens(2, 2, 2))                         # eval mode: not counted
    assert m.expert_counts.tolist() == [3, 1, 0, 2]
    m.update_router_bias()                      # mean 1.5: over, under, under, over
    assert m.router_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, -0.1])
    assert m.expert_counts.tolist() == [0, 0, 0, 0]
    m.update_router_bias()                      # no tokens since: nothing moves
    assert m.router_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, -0.1])
    m.train()
    m(_tokens(0, 1, 2, 2))                      # counts 1 1 2 0, mean 1: equal ones stay
    m.update_router_bias()
    assert m.router_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    assert m.router_bias.dtype == torch.float32


def test_counts_are_slots_and_the_bias_steers_the_choice():
    m = _one_hot_router(k=2, rate=1.0)
    m.train()
    m(_tokens(0, 1, 1))
    # k = 2: each token also picks its runner-up, expert 3.
    assert m.expert_counts.tolist() == [1, 2, 0, 3] and m.expert_counts.sum() == 3 * 2
    m.update_router_bias()                      # mean 1.5: +1 -1 +1 -1
    assert m.router_bias.tolist() == [1.0, -1.0, 1.0, -1.0]
    with torch.no_grad():
        w, e = m.route(F.linear(_tokens(1), m.router.weight))
    # Token e_1 now chooses experts 2 and 0: selection scores σ(-4) + 1 and σ(-5) + 1 beat
    # σ(5.5) - 1 of its own expert ...
    assert e.tolist() == [[2, 0]]
    # ... and mixes them with the unbiased scores.
    s = torch.sigmoid(m.router.weight[:, 1])
    torch.testing.assert_close(w[0], s[[2, 0]] / s[[2, 0]].sum())


def test_update_router_biases_walks_the_model():
    model = torch.nn.Sequential(_one_hot_router(), MoEMLP(4, 6, 4, 1),
                                _one_hot_router("group_topk", n_group=2, topk_group=1))
    model.train()
    model[0](_tokens(0, 0))
    model[2](_tokens(3))
    assert update_router_biases(model) == 2
    assert model[0].router_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert model[2].router_bias.tolist() == pytest.approx([0.1, 0.1, 0.1, -0.1])
    assert not model[1].has_router_bias and "router_bias" not in model[1].state_dict()


def test_router_bias_stays_float32_through_a_dtype_cast():
    m = _one_hot_router()
    with torch.no_grad():
        m.router_bias.copy_(torch.tensor([1e-3, -0.1234567, 0.5, 2.0001]))
    want = m.router_bias.clone()
    m = m.to(torch.bfloat16)
    assert m.router.weight.dtype == torch.bfloat16 and m.router_bias.dtype == torch.float32
    assert torch.equal(m.router_bias, want)                 # not rounded through bf16
    m.half()
    assert torch.equal(m.router_bias, want)


# --- MiniGPT: the config, checkpoints, training ----------------------------------------------

TINY = dict(block_size=24, n_layer=2, n_head=2, n_embd=16, d_ff=16, n_experts=4, top_k=1)
NEW = ("moe_router", "moe_n_group", "moe_topk_group", "moe_group_score", "moe_scoring",
       "moe_routed_scaling_factor", "moe_bias_update_rate")


def test_softmax_model_keys_and_dict_are_those_of_the_base_checkpoint():
    """The base MoE checkpoint was written before the router options: a softmax model of its
    config has exactly its tensors, and its config dict exactly its keys."""
    path = base_path("moe")
    with safe_open(path, framework="pt") as f:
        saved = json.loads(f.metadata()["config"])
    cfg = MiniGPTConfig(**saved)
    assert cfg.moe_router == "softmax_topk" and cfg.to_dict() == saved
    assert not set(NEW) & set(cfg.to_dict())
    assert set(MiniGPT(cfg).state_dict()) == set(load_file(path))
    model = load_base("moe")
    assert all(m.method == "softmax_topk" and not m.has_router_bias for m in _moes(model))


def test_router_options_reach_every_mlp_and_round_trip(tmp_path):
    cfg = MiniGPTConfig(**{**TINY, "top_k": 2}, moe_router="group_topk", moe_n_group=2,
                        moe_topk_group=1, moe_group_score="max", moe_scoring="softmax",
                        moe_routed_scaling_factor=2.0, moe_bias_update_rate=0.01)
    assert {k: v for k, v in cfg.to_dict().items() if k in NEW} == dict(
        moe_router="group_topk", moe_n_group=2, moe_topk_group=1, moe_group_score="max",
        moe_scoring="softmax", moe_routed_scaling_factor=2.0, moe_bias_update_rate=0.01)
    torch.manual_seed(0)
    model = MiniGPT(cfg)
    for m in _moes(model):
        assert (m.method, m.n_group, m.topk_group, m.group_score, m.scoring,
                m.routed_scaling_factor, m.bias_update_rate) == (
            "group_topk", 2, 1, "max", "softmax", 2.0, 0.01)
    with torch.no_grad():
        for i, m in enumerate(_moes(model)):
            m.router_bias.copy_(torch.tensor([0.1, -0.2, 0.3, -0.4]) * (i + 1))
    assert "blocks.0.mlp.router_bias" in model.state_dict()
    save_checkpoint(model, tmp_path / "m.safetensors")
    again = load_checkpoint(tmp_path / "m.safetensors")
    assert again.config == cfg
    assert torch.equal(_moes(again)[1].router_bias, _moes(model)[1].router_bias)
    x = torch.randint(0, 45, (2, 7))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


@pytest.mark.parametrize("kw, field", [
    (dict(moe_router="topk"), "moe_router"),
    (dict(moe_router="sigmoid_topk", moe_n_group=2), "moe_n_group"),
    (dict(moe_router="group_topk"), "moe_n_group"),
    (dict(moe_router="group_topk", moe_n_group=3, moe_topk_group=1), "moe_n_group"),
    (dict(moe_router="group_topk", moe_n_group=2, moe_topk_group=3), "moe_topk_group"),
    (dict(moe_group_score="max"), "moe_group_score"),
    (dict(moe_router="group_topk", moe_n_group=2, moe_topk_group=1, moe_scoring="x"),
     "moe_scoring"),
    (dict(moe_routed_scaling_factor=0.0), "moe_routed_scaling_factor"),
    (dict(moe_bias_update_rate=0.1), "moe_bias_update_rate"),
    (dict(moe_router="sigmoid_topk", moe_bias_update_rate=float("nan")),
     "moe_bias_update_rate"),
])
def test_bad_router_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        MiniGPTConfig(**TINY, **kw)


def _train(rate: float) -> tuple[MiniGPT, list[torch.Tensor]]:
    """30 steps of a sigmoid-routed MiniGPT through minituner.train, which updates the biases
    after each optimizer step; each layer's update records that step's expert counts first.
    The balancing loss is off: only the bias balances."""
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(**TINY, moe_router="sigmoid_topk",
                                  moe_bias_update_rate=rate))
    mlps, loads, step = _moes(model), [], []

    def recording(mlp):
        update = mlp.update_router_bias

        def record_then_update():
            step.append(mlp.expert_counts.clone())
            if len(step) == len(mlps):
                loads.append(torch.stack(step))
                step.clear()
            update()
        return record_then_update

    for mlp in mlps:
        mlp.update_router_bias = recording(mlp)
    result = train(model, task_data("copy", n=48), quiet(
        steps=30, batch_size=8, lr=3e-3, warmup_steps=5, aux_loss_coef=0.0))
    assert result.steps == 30 and math.isfinite(result.final_loss)
    assert len(loads) == 30, (f"minituner.train updated the router biases after {len(loads)} "
                              f"of 30 steps: call update_router_biases after each step")
    return model, loads


def _imbalance(loads: list[torch.Tensor]) -> float:
    """Mean over the last 15 steps and the layers of max load / mean load."""
    last = torch.stack(loads[-15:]).float()                     # [15, layers, E]
    return (last.amax(-1) / last.mean(-1)).mean().item()


def test_training_with_the_bias_update_evens_the_load():
    """Without the update two of the four experts end up with (almost) no tokens; with it the
    load stays near even. The rate must stay below the spread of the router's scores (~0.02
    here): larger steps flip every token to one expert and back each step."""
    fixed, fixed_loads = _train(0.0)
    moving, moving_loads = _train(0.003)
    assert len(moving_loads) == 30
    # Every step counted each layer's routed slots once: the layers agree, tokens · k each.
    assert all((c.sum(-1) == c[0].sum()).all() and c[0].sum() > 0 for c in moving_loads)
    assert all((m.router_bias == 0).all() for m in _moes(fixed))
    for m in _moes(moving):
        assert m.router_bias.abs().max() > 0.01            # moved, in steps of 0.003
    assert _imbalance(fixed_loads) > 2.0
    assert _imbalance(moving_loads) < _imbalance(fixed_loads) - 0.5, (
        _imbalance(moving_loads), _imbalance(fixed_loads))
