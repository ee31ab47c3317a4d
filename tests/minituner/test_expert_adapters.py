"""Expert LoRA in adapters: PEFT's B order, wrap_lora's targets and refusals, router LoRA,
loading into a QLoRA model, part of the projections, and the metadata lora_norms reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from peft_roundtrip import IDS, hf_model, logits, minigpt, randomize_B

from minimoe import MoEMLP
from minituner import load_adapter, save_adapter, wrap_lora
from minituner.adapter_targets import from_peft_B, to_peft_B
from minituner.qlora import wrap_minigpt_qlora

EXPERTS = ["w_gate", "w_up", "w_down"]


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, str(model)


@pytest.mark.parametrize("E, r, out", [(1, 1, 3), (3, 2, 5), (4, 3, 1)])
def test_peft_B_order(E, r, out):
    """Ours: expert e in columns e·r:(e+1)·r. PEFT: column j·E + e (B.reshape(out, r, E))."""
    B = torch.randn(out, r * E)
    peft_B = to_peft_B(B, E)
    for e in range(E):
        torch.testing.assert_close(peft_B.reshape(out, r, E)[:, :, e], B[:, e * r:(e + 1) * r])
    torch.testing.assert_close(from_peft_B(peft_B, E), B)


def test_hf_router_is_refused_by_name():
    """PEFT would adapt Mixtral's router weight; ours refuses, naming it, and changes nothing."""
    model = hf_model("mixtral")
    before = snapshot(model)
    with pytest.raises(ValueError,
                       match=re.escape("model.layers.0.mlp.gate is a MixtralTopKRouter")):
        wrap_lora(model, ["q_proj", "gate"])
    assert snapshot(model)[1] == before[1]


def test_hf_experts_module_named_as_a_module_says_what_to_name():
    with pytest.raises(ValueError, match=r"target_parameters=\['gate_up_proj', 'down_proj'\]"):
        wrap_lora(hf_model("mixtral"), ["experts"])


def test_moe_mlp_named_as_a_module_says_what_to_name():
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp is a MoEMLP.*target_parameters"):
        wrap_lora(minigpt(), ["mlp"])


def test_parameter_no_expert_holds_is_refused():
    model = hf_model("mixtral")
    with pytest.raises(ValueError, match=r"'gate\.weight' names .*MixtralTopKRouter.*cannot adapt"):
        wrap_lora(model, None, target_parameters=["gate.weight"])
    with pytest.raises(ValueError, match="'w_nothing' matches no parameter.*expert parameters are"):
        wrap_lora(minigpt(), None, target_parameters=["w_nothing"])


@pytest.mark.parametrize("kw, match", [
    (dict(dropout=0.1), "takes no dropout"), (dict(use_rslora=True), "alpha / r"),
])
def test_expert_lora_options_refused(kw, match):
    model = minigpt()
    before = snapshot(model)
    with pytest.raises(ValueError, match=match):
        wrap_lora(model, ["q_proj"], target_parameters=EXPERTS, **kw)
    assert str(model) == before[1]


def test_router_lora_trains_and_changes_routing():
    model = minigpt()
    names = wrap_lora(model, ["router"], r=2, alpha=4)
    assert names == ["blocks.0.mlp.router", "blocks.1.mlp.router"]
    before = logits(model, IDS)
    randomize_B(model)
    assert (logits(model, IDS) - before).abs().max() > 1e-3
    model(IDS).sum().backward()
    assert model.blocks[0].mlp.router.lora_A.grad.abs().sum() > 0


def test_part_of_the_projections(tmp_path):
    model = minigpt()
    assert wrap_lora(model, None, r=2, alpha=4, target_parameters=["w_down"]) == [
        "blocks.0.mlp.w_down", "blocks.1.mlp.w_down"]
    assert isinstance(model.blocks[0].mlp.w_gate, torch.nn.Parameter)
    randomize_B(model)
    save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["w_down"] and cfg["target_modules"] == []
    fresh = minigpt()
    load_adapter(fresh, tmp_path)
    torch.testing.assert_close(logits(fresh, IDS), logits(model, IDS), rtol=0, atol=0)


def test_loads_into_a_qlora_model_already_wrapped(tmp_path):
    """Experiment 11's path: the QLoRA model exists (NF4 experts), the adapter fills it."""
    trained = minigpt()
    wrap_minigpt_qlora(trained, r=2, alpha=4)
    randomize_B(trained)
    save_adapter(trained, tmp_path)
    fresh = minigpt()
    wrap_minigpt_qlora(fresh, r=2, alpha=4)
    report = load_adapter(fresh, tmp_path)
    assert report.ok and report.wrapped == []
    torch.testing.assert_close(logits(fresh, IDS), logits(trained, IDS), rtol=0, atol=0)
    other = minigpt()
    wrap_minigpt_qlora(other, r=4, alpha=4)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q_proj is wrapped with r=4"):
        load_adapter(other, tmp_path)


def test_metadata_names_every_target(tmp_path):
    model = minigpt()
    wrap_lora(model, ["q_proj"], r=2, alpha=4, target_parameters=EXPERTS)
    save_adapter(model, tmp_path)
    with safetensors.safe_open(tmp_path / "adapter_model.safetensors", "pt") as f:
        targets = json.loads(f.metadata()["minituner.targets"])
        keys = set(f.keys())
    names = {t["name"]: t for t in targets}
    assert names["blocks.0.mlp.w_gate"]["prefix"] == (
        "base_model.model.blocks.0.mlp.base_layer.base_layer.")
    assert names["blocks.0.mlp.w_down"]["prefix"] == "base_model.model.blocks.0.mlp."
    assert names["blocks.0.mlp.w_up"]["experts"] == 4
    assert names["blocks.0.mlp.w_up"]["scaling"] == 2.0
    assert {t["prefix"] + "lora_A.weight" for t in targets} | {
        t["prefix"] + "lora_B.weight" for t in targets} == keys


def test_expert_shape_mismatch_named_and_model_untouched(tmp_path):
    model = minigpt()
    wrap_lora(model, None, r=2, alpha=4, target_parameters=EXPERTS)
    save_adapter(model, tmp_path)
    other = minigpt(n_experts=2)
    before = snapshot(other)
    with pytest.raises(ValueError, match=re.escape(
            "base_model.model.blocks.0.mlp.lora_A.weight: file [8, 64] vs model [4, 64]")):
        load_adapter(other, tmp_path)
    assert str(other) == before[1]
    assert isinstance(other.blocks[0].mlp, MoEMLP) and isinstance(
        other.blocks[0].mlp.w_gate, torch.nn.Parameter)


def test_expert_adapter_on_a_dense_model_is_refused(tmp_path):
    model = minigpt()
    wrap_lora(model, None, r=2, alpha=4, target_parameters=EXPERTS)
    save_adapter(model, tmp_path)
    with pytest.raises(ValueError, match="'w_down' matches no parameter"):
        load_adapter(minigpt(n_experts=0), tmp_path)


def test_names_must_be_known(tmp_path):
    model = minigpt()
    wrap_lora(model, ["q_proj"])
    with pytest.raises(ValueError, match="names must be one of"):
        save_adapter(model, tmp_path, names="peft")


def test_bad_rank_pattern_named(tmp_path):
    model = minigpt()
    wrap_lora(model, ["q_proj"])
    save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {"q_proj": 0}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"rank_pattern\['q_proj'\] must be a positive int"):
        load_adapter(minigpt(), tmp_path)


def test_saved_bytes_do_not_depend_on_the_process(tmp_path):
    """safetensors orders `__metadata__` by a per-process hash: the adapter file must not."""
    script = ("import sys, torch\n"
              "from peft_roundtrip import minigpt, randomize_B\n"
              "from minituner import save_adapter, wrap_lora\n"
              "m = minigpt()\n"
              "wrap_lora(m, ['q_proj'], r=2, alpha=4, target_parameters=['w_down'])\n"
              "randomize_B(m)\n"
              "save_adapter(m, sys.argv[1])\n")
    tests = str(Path(__file__).resolve().parent)
    digests = set()
    for i in range(6):            # an unsorted header matches 6 times in a row 1 time in 32
        out = tmp_path / f"a{i}"
        subprocess.run([sys.executable, "-c", script, str(out)], check=True,
                       env={**os.environ, "PYTHONPATH": tests, "PYTHONHASHSEED": "random"})
        digests.add((out / "adapter_model.safetensors").read_bytes())
    assert len(digests) == 1
    with safetensors.safe_open(tmp_path / "a0" / "adapter_model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
