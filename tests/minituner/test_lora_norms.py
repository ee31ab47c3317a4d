"""lora_norms: ‖s·B·A‖_F per module and per expert of a PEFT-format adapter directory, against
the materialised product, our LoRALinear.delta_weight(), and PEFT's own get_delta_weight."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch

from minigpt import MiniGPT, MiniGPTConfig
from minituner.adapters import save_adapter, wrap_lora
from minituner.lora import LoRALinear
from minituner.lora_norms import (
    TargetNorms,
    adapter_norms,
    grid,
    main,
    norms_table,
    total_norm,
    update_norms,
)

PREFIX = "base_model.model."
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def naive_norms(A: torch.Tensor, B: torch.Tensor, E: int, s: float) -> list[float]:
    """Materialise s·B_e·A_e per expert in float64; B_e takes columns j·E + e (PEFT's order)."""
    r = A.shape[0] // E
    out = []
    for e in range(E):
        A_e = A[e * r:(e + 1) * r].double()                           # [r, in]
        B_e = B[:, [j * E + e for j in range(r)]].double()            # [out, r]
        out.append(float(torch.linalg.norm(s * B_e @ A_e)))
    return out


def write_adapter(dir, tensors: dict, config: dict | None = None, targets: list | None = None):
    """An adapter directory by hand: config JSON and safetensors (with our metadata if given)."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "adapter_config.json").write_text(json.dumps(CONFIG if config is None else config))
    metadata = {"format": "pt"}
    if targets is not None:
        metadata["minituner.targets"] = json.dumps(targets)
    safetensors.torch.save_file(tensors, str(dir / "adapter_model.safetensors"),
                                metadata=metadata)
    return dir


def by_name(norms: list[TargetNorms]) -> dict[str, list[float]]:
    return {t.name: t.experts for t in norms}


# --- the norm itself ------------------------------------------------------------------------

@pytest.mark.parametrize("r, E, n_in, n_out", [(1, 1, 5, 3), (2, 3, 7, 4), (3, 1, 4, 9),
                                                (1, 3, 1, 1), (4, 2, 6, 6), (1, 5, 11, 2)])
def test_update_norms_equal_the_materialised_product(r, E, n_in, n_out):
    g = torch.Generator().manual_seed(r * 100 + E * 10 + n_in)
    A, B = torch.randn(r * E, n_in, generator=g), torch.randn(n_out, r * E, generator=g)
    got = update_norms(A, B, E, -1.7).tolist()
    assert got == pytest.approx(naive_norms(A, B, E, -1.7), rel=1e-12, abs=1e-12)


def test_a_zero_B_gives_exactly_zero():
    A = torch.randn(6, 5)
    assert update_norms(A, torch.zeros(4, 6), 3, 2.0).tolist() == [0.0, 0.0, 0.0]


def test_total_is_the_root_sum_of_squares():
    assert TargetNorms("x", [3.0, 4.0]).total == 5.0


# --- our adapters ---------------------------------------------------------------------------

def test_our_dense_adapter_matches_delta_weight(tmp_path):
    torch.manual_seed(0)
    model = MiniGPT(MiniGPTConfig(n_layer=2, n_embd=32, n_head=2, d_ff=48, block_size=16))
    wrapped = wrap_lora(model, ["q_proj", "v_proj"], r=4, alpha=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g))
    save_adapter(model, tmp_path)
    got = by_name(adapter_norms(tmp_path))
    want = {n: [float(model.get_submodule(n).delta_weight().detach().double().norm())]
            for n in wrapped}
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5), name
    whole = math.sqrt(sum(v[0] ** 2 for v in want.values()))
    assert total_norm(tmp_path) == pytest.approx(whole, rel=1e-5)


def test_metadata_reads_expert_columns_in_peft_order(tmp_path):
    """Only expert 1's B columns (j·E + 1) are nonzero: only expert 1 may move. Reading the
    columns as e·r + j would put them on experts 0 and 2."""
    E, r, s = 3, 2, 0.5
    A = torch.randn(r * E, 5)
    B = torch.zeros(4, r * E)
    B[:, [j * E + 1 for j in range(r)]] = torch.randn(4, r)
    prefix = f"{PREFIX}blocks.0.mlp.base_layer."
    write_adapter(tmp_path, {prefix + "lora_A.weight": A, prefix + "lora_B.weight": B},
                  targets=[{"prefix": prefix, "name": "blocks.0.mlp.w_up", "experts": E,
                            "r": r, "scaling": s}])
    (t,) = adapter_norms(tmp_path)
    assert t.name == "blocks.0.mlp.w_up"
    assert t.experts[0] == 0.0 and t.experts[2] == 0.0
    # the metadata's scaling (0.5), not the config's alpha / r (2.0)
    assert t.experts[1] == pytest.approx(naive_norms(A, B, E, s)[1], rel=1e-12)
    assert t.experts[1] > 0


def test_config_rank_alpha_patterns_and_rslora(tmp_path):
    """Without metadata: r and alpha from rank_pattern / alpha_pattern (PEFT's first-match
    rule), s = alpha / sqrt(r) with use_rslora."""
    config = {**CONFIG, "target_modules": ["q_proj", "v_proj"], "use_rslora": True,
              "rank_pattern": {"v_proj": 3}, "alpha_pattern": {"attn.v_proj": 9, "v_proj": 1}}
    q, v = f"{PREFIX}blocks.0.attn.q_proj.", f"{PREFIX}blocks.0.attn.v_proj."
    t = {q + "lora_A.weight": torch.randn(2, 8), q + "lora_B.weight": torch.randn(8, 2),
         v + "lora_A.weight": torch.randn(3, 8), v + "lora_B.weight": torch.randn(8, 3)}
    got = by_name(adapter_norms(write_adapter(tmp_path, t, config)))
    assert got["blocks.0.attn.q_proj"] == pytest.approx(
        naive_norms(t[q + "lora_A.weight"], t[q + "lora_B.weight"], 1, 4 / math.sqrt(2)))
    assert got["blocks.0.attn.v_proj"] == pytest.approx(
        naive_norms(t[v + "lora_A.weight"], t[v + "lora_B.weight"], 1, 9 / math.sqrt(3)))


# --- PEFT's expert adapters -------------------------------------------------------------------

def _peft_mixtral(tmp_path, target_parameters, **lora_kwargs):
    """A tiny HF Mixtral with PEFT LoRA on q_proj and expert parameters, random lora_B, saved."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    pm = peft.get_peft_model(transformers.MixtralForCausalLM(cfg), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=target_parameters,
        **lora_kwargs))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_()
    pm.save_pretrained(tmp_path)
    return peft, pm


def _peft_deltas(peft, pm) -> dict[str, torch.Tensor]:
    """Our expected name -> PEFT's delta weight [E, ·, ·] (a module's as [1, out, in])."""
    layer = peft.tuners.lora.layer
    params, out = {}, {}
    for name, m in pm.named_modules():
        if isinstance(m, layer.ParamWrapper):
            module, depth = name.removeprefix(PREFIX), 0
            while module.endswith(".base_layer"):
                module, depth = module.removesuffix(".base_layer"), depth + 1
            params.setdefault(module, []).append((depth, m))
        elif isinstance(m, layer.Linear):
            out[name.removeprefix(PREFIX)] = m.get_delta_weight("default")[None]
    for module, wrappers in params.items():
        for depth, m in wrappers:
            key = (f"{module}.{m.parameter_name}" if len(wrappers) == 1
                   else f"{module}[base_layer×{depth}]")
            dw = m.get_delta_weight("default")
            out[key] = dw if dw.ndim == 3 else dw[None]       # a 2-D parameter is E = 1
    return out


# PEFT 0.21 warns that a pattern naming a target parameter "did not match any targeted
# module", and applies it all the same.
peft_noise = pytest.mark.filterwarnings(
    "ignore:The following (rank|alpha)_pattern keys", "ignore:`is_gradient_checkpointing`")


@pytest.mark.parametrize("target_parameters, patterns", [
    (["experts.gate_up_proj", "experts.down_proj"], {}),
    (["experts.gate_up_proj", "experts.down_proj"],
     {"rank_pattern": {"down_proj": 3}, "alpha_pattern": {"gate_up_proj": 8}}),
    # rows 8 and 16 fit r = 2 or 4 at either depth: only "one E per experts module" decides
    (["experts.gate_up_proj", "experts.down_proj"], {"rank_pattern": {"down_proj": 4}}),
    (["experts.down_proj", "gate.weight"], {"rank_pattern": {"down_proj": 3}}),
], ids=["two-params", "two-params-patterns", "two-params-r4", "one-param-and-router"])
@peft_noise
def test_peft_expert_adapter_matches_get_delta_weight(tmp_path, target_parameters, patterns):
    peft, pm = _peft_mixtral(tmp_path, target_parameters, **patterns)
    got = by_name(adapter_norms(tmp_path))
    deltas = _peft_deltas(peft, pm)
    assert got.keys() == deltas.keys()
    for name, dw in deltas.items():
        want = dw.double().flatten(1).norm(dim=1).tolist()        # per expert, [E]
        assert got[name] == pytest.approx(want, rel=1e-5), name
        assert len(got[name]) == (1 if name.endswith(("q_proj", "gate.weight")) else 4), name


@peft_noise
def test_peft_rank_pattern_gives_E_not_rows_over_r(tmp_path):
    """down_proj at r=3 has 12 rows of A: 4 experts, not the 6 that the config's r=2 gives."""
    _peft_mixtral(tmp_path, ["experts.gate_up_proj", "experts.down_proj"],
                  rank_pattern={"down_proj": 3})
    with safetensors.safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        rows = f.get_slice(f"{PREFIX}model.layers.0.mlp.experts.lora_A.weight").get_shape()[0]
    assert rows == 12
    got = by_name(adapter_norms(tmp_path))
    assert len(got["model.layers.0.mlp.experts[base_layer×0]"]) == 4
    assert len(got["model.layers.0.mlp.experts[base_layer×1]"]) == 4


# --- text -------------------------------------------------------------------------------------

NORMS = [TargetNorms("blocks.0.mlp.w_gate", [1.0, 2.5]),
         TargetNorms("blocks.0.attn.q_proj", [0.5]),
         TargetNorms("blocks.1.attn.q_proj", [3.0]),
         TargetNorms("blocks.1.attn.v_proj", [0.25])]


def test_norms_table_is_sorted_largest_first():
    assert norms_table(NORMS, top=3).splitlines() == [
        "  ‖s·B·A‖_F  update",
        "     3.0000  blocks.1.attn.q_proj",
        "     2.5000  blocks.0.mlp.w_gate[e1]",
        "     1.0000  blocks.0.mlp.w_gate[e0]",
        "             … and 2 smaller",
    ]


def test_grid_is_experts_then_projections_by_block():
    assert grid(NORMS) == "\n".join([
        "| expert projection | e0 | e1 |",
        "|---|---|---|",
        "| blocks.0.mlp.w_gate | 1.00 | 2.50 |",
        "| **sum** | **1.00** | **2.50** |",
        "",
        "| attention projection | b0 | b1 |",
        "|---|---|---|",
        "| q_proj | 0.500 | 3.00 |",
        "| v_proj |  | 0.250 |",
    ])


# --- the command line -------------------------------------------------------------------------

def _mixed_adapter(dir):
    """An expert target (E=3, r=2) and two attention modules, with our metadata."""
    g = torch.Generator().manual_seed(3)
    e, q0, q1 = (f"{PREFIX}blocks.0.mlp.base_layer.", f"{PREFIX}blocks.0.attn.q_proj.",
                 f"{PREFIX}blocks.1.attn.q_proj.")
    tensors = {e + "lora_A.weight": torch.randn(6, 8, generator=g),
               e + "lora_B.weight": torch.randn(5, 6, generator=g)}
    for p in (q0, q1):
        tensors[p + "lora_A.weight"] = torch.randn(2, 8, generator=g)
        tensors[p + "lora_B.weight"] = torch.randn(8, 2, generator=g)
    targets = [{"prefix": e, "name": "blocks.0.mlp.w_up", "experts": 3, "r": 2, "scaling": 2.0},
               {"prefix": q0, "name": "blocks.0.attn.q_proj", "experts": 1, "r": 2,
                "scaling": 2.0},
               {"prefix": q1, "name": "blocks.1.attn.q_proj", "experts": 1, "r": 2,
                "scaling": 2.0}]
    return write_adapter(dir, tensors, targets=targets)


def test_cli_prints_sorted_lines(tmp_path, capsys):
    assert main([str(_mixed_adapter(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("5 updates in 3 LoRA targets (2 modules, 1 expert parameters × "
                             "3 experts)")
    rows = [line.split() for line in lines[2:]]
    values = [float(v) for v, _ in rows]
    assert values == sorted(values, reverse=True)
    assert sorted(label for _, label in rows) == sorted(
        ["blocks.0.attn.q_proj", "blocks.1.attn.q_proj"]
        + [f"blocks.0.mlp.w_up[e{e}]" for e in range(3)])


def test_cli_top_and_grid(tmp_path, capsys):
    dir = _mixed_adapter(tmp_path)
    assert main([str(dir), "--top", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("… and 3 smaller")
    assert main([str(dir), "--grid"]) == 0
    out = capsys.readouterr().out
    assert "| expert projection | e0 | e1 | e2 |" in out
    assert "| attention projection | b0 | b1 |" in out


def test_cli_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "plots" / "norms.png"
    assert main([str(_mixed_adapter(tmp_path / "a")), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in png.parent.iterdir()] == ["norms.png"]   # no temporary left
    assert capsys.readouterr().out.splitlines()[-1] == f"plot: {png}"


def _expert_pair(rows: int, cols: int, nan: bool = False) -> dict:
    p = f"{PREFIX}model.layers.0.mlp.experts."
    A = torch.randn(rows, 8)
    if nan:
        A[1, 2] = math.nan
    return {p + "lora_A.weight": A, p + "lora_B.weight": torch.randn(5, cols)}


EXPERT_CONFIG = {**CONFIG, "target_parameters": ["experts.down_proj"]}
BROKEN = {
    "missing-dir": (lambda d: d / "nowhere", "no such directory"),
    "no-config": (lambda d: d, "no adapter_config.json"),
    "bad-json": (lambda d: (d / "adapter_config.json").write_text("{r: 2") and d,
                 "adapter_config.json: not valid JSON"),
    "not-lora": (lambda d: write_adapter(d, _expert_pair(4, 4), {**CONFIG, "peft_type": "IA3"}),
                 "peft_type is 'IA3', expected 'LORA'"),
    "pickle-only": (lambda d: (d / "adapter_config.json").write_text(json.dumps(CONFIG))
                    and (d / "adapter_model.bin").write_bytes(b"x") and d,
                    "only safetensors are read"),
    "nan": (lambda d: write_adapter(d, _expert_pair(4, 4, nan=True), EXPERT_CONFIG),
            "NaN or Inf in ['base_model.model.model.layers.0.mlp.experts.lora_A.weight']"),
    "A-without-B": (lambda d: write_adapter(d, {k: v for k, v in _expert_pair(4, 4).items()
                                               if "lora_A" in k}, EXPERT_CONFIG),
                    "experts.lora_A.weight has no base_model.model.model.layers.0.mlp.experts."
                    "lora_B.weight"),
    "rows-not-a-multiple-of-r": (lambda d: write_adapter(d, _expert_pair(7, 7), EXPERT_CONFIG),
                                 "experts.lora_A.weight has 7 rows, expected a multiple of r = 2"),
    "B-columns-ne-A-rows": (lambda d: write_adapter(d, _expert_pair(6, 4), EXPERT_CONFIG),
                            "experts.lora_B.weight is [5, 4], expected 6 columns"),
    "module-rows-ne-r": (lambda d: write_adapter(d, _expert_pair(4, 4)),
                         "experts.lora_A.weight is [4, 8], expected 2 rows"),
    "metadata-E-wrong": (lambda d: write_adapter(d, _expert_pair(6, 6), targets=[{
        "prefix": f"{PREFIX}model.layers.0.mlp.experts.", "name": "w", "experts": 4, "r": 2,
        "scaling": 1.0}]), "experts.lora_A.weight is [6, 8], expected 8 rows (r·E = 2·4 for w)"),
    "bad-rank_pattern": (lambda d: write_adapter(d, _expert_pair(4, 4), {
        **CONFIG, "rank_pattern": {"q_(proj": 3}}), "rank_pattern key 'q_(proj' is not a regex"),
    "metadata-misses-a-pair": (lambda d: write_adapter(d, _expert_pair(6, 6), targets=[]),
                               "is not described in metadata minituner.targets"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_cli_refuses_a_broken_adapter_in_one_line(tmp_path, capsys, case):
    make, message = BROKEN[case]
    assert main([str(make(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err


def test_cli_refuses_a_bad_top(tmp_path, capsys):
    assert main([str(_mixed_adapter(tmp_path)), "--top", "0"]) == 2
    assert capsys.readouterr().err == "error: --top must be at least 1\n"
