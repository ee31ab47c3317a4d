"""wrap_lora and the PEFT-format adapter files: selection, freezing, and PEFT interop both ways."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch

from minigpt import MiniGPT, MiniGPTConfig
from miniquant import QuantizedLinear, quantize_model
from minituner.adapters import load_adapter, save_adapter, trainable_summary, wrap_lora
from minituner.lora import LoRALinear
from minituner.lora_norms import adapter_norms
from minituner.peft_format import AdapterError

peft = pytest.importorskip("peft")

ATTN_QV = [f"blocks.{i}.attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
PREFIX = "base_model.model."


@pytest.fixture
def base() -> MiniGPT:
    torch.manual_seed(0)
    cfg = MiniGPTConfig(n_layer=2, n_head=2, n_embd=32, d_ff=48, block_size=16)
    return MiniGPT(cfg).eval()


@pytest.fixture
def idx() -> torch.Tensor:
    return torch.randint(0, 45, (2, 16), generator=torch.Generator().manual_seed(1))


def randomize_lora(model: torch.nn.Module, seed: int = 2) -> None:
    """Non-zero B (and a fresh A) so that the adapter changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_wrap_suffix_list_wraps_exactly_and_freezes(base, idx):
    names = wrap_lora(base, ["q_proj", "v_proj"], r=8, alpha=16.0)
    assert names == ATTN_QV
    assert [n for n, m in base.named_modules() if isinstance(m, LoRALinear)] == ATTN_QV
    trainable = [n for n, p in base.named_parameters() if p.requires_grad]
    assert trainable == [f"{n}.lora_{ab}" for n in ATTN_QV for ab in "AB"]
    # Base: embeddings 45·32 + 16·32, per block 2·32 (norms) + 4·32·32 (attn) + 3·32·48
    # (mlp), final norm 32, lm_head 45·32. LoRA: 4 layers · (8·32 + 32·8).
    base_total = 45 * 32 + 16 * 32 + 2 * (2 * 32 + 4 * 32 * 32 + 3 * 32 * 48) + 32 + 45 * 32
    assert trainable_summary(base) == (4 * 512, base_total + 4 * 512) == (2048, 23008)
    assert base(idx).shape == (2, 16, 45)


def test_wrap_regex_is_full_match(base):
    names = wrap_lora(base, r"blocks\.\d+\.mlp\.(gate|up|down)_proj", r=4)
    assert names == [f"blocks.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up", "down")]
    with pytest.raises(ValueError, match="matches no linear layer"):
        wrap_lora(copy.deepcopy(base), r"mlp\.gate_proj")     # a search would match; full does not


def test_suffix_matches_whole_components_only(base):
    with pytest.raises(ValueError, match="matches no linear layer"):
        wrap_lora(base, ["proj"])                             # "q_proj" does not end with ".proj"


def test_nothing_matched_lists_the_linear_layers(base):
    with pytest.raises(ValueError) as err:
        wrap_lora(base, ["qkv"])
    msg = str(err.value)
    for name in ("blocks.0.attn.q_proj", "blocks.1.mlp.down_proj", "lm_head"):
        assert repr(name) in msg
    assert "tok_emb" not in msg
    assert not any(p.requires_grad is False for p in base.parameters())   # nothing touched


def test_double_wrap_raises(base):
    wrap_lora(base, ["q_proj"])
    with pytest.raises(ValueError, match=re.escape("already wrapped with LoRA: ['blocks.0.attn")):
        wrap_lora(base, ["q_proj", "k_proj"])
    with pytest.raises(ValueError, match="already wrapped"):
        wrap_lora(base, r".*attn\.q_proj")
    assert not isinstance(base.blocks[0].attn.k_proj, LoRALinear)   # refused as a whole
    assert isinstance(base.blocks[0].attn.q_proj.base, torch.nn.Linear)


def test_wrap_quantized_base(base, idx):
    quantize_model(base, r".*_proj")
    names = wrap_lora(base, ["q_proj", "v_proj"])
    assert names == ATTN_QV
    assert isinstance(base.blocks[0].attn.q_proj.base, QuantizedLinear)
    assert base(idx).isfinite().all()


def test_saved_files_are_peft_format(base, tmp_path):
    wrap_lora(base, ["q_proj", "v_proj"], r=4, alpha=8.0, dropout=0.05, use_rslora=True)
    randomize_lora(base)
    save_adapter(base, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    assert cfg["lora_dropout"] == 0.05 and cfg["use_rslora"] is True and cfg["bias"] == "none"
    for key in ("task_type", "base_model_name_or_path", "modules_to_save"):
        assert cfg[key] is None
    assert cfg["fan_in_fan_out"] is False and cfg["inference_mode"] is True
    assert cfg["init_lora_weights"] is True
    tensors = safetensors.torch.load_file(tmp_path / "adapter_model.safetensors")
    assert sorted(tensors) == sorted(f"{PREFIX}{n}.lora_{ab}.weight"
                                     for n in ATTN_QV for ab in "AB")
    q = base.blocks[1].attn.q_proj
    assert torch.equal(tensors[f"{PREFIX}blocks.1.attn.q_proj.lora_B.weight"], q.lora_B)
    lc = peft.LoraConfig.from_pretrained(str(tmp_path))
    assert (lc.r, lc.lora_alpha, lc.use_rslora, set(lc.target_modules)) == (
        4, 8.0, True, {"q_proj", "v_proj"})


def test_saved_targets_select_only_what_was_wrapped(base, tmp_path):
    wrap_lora(base, r"blocks\.0\.attn\.q_proj")
    save_adapter(base, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["blocks.0.attn.q_proj"]   # "q_proj" would take block 1
    with pytest.raises(ValueError, match="selects"):
        save_adapter(base, tmp_path / "x", target_modules=["q_proj"])


@pytest.mark.parametrize("use_rslora", [False, True])
def test_ours_loads_in_peft_with_same_outputs(base, idx, tmp_path, use_rslora):
    fresh = copy.deepcopy(base)
    wrap_lora(base, ["q_proj", "v_proj", "down_proj"], r=4, alpha=8.0, use_rslora=use_rslora)
    randomize_lora(base)
    save_adapter(base, tmp_path)
    with torch.no_grad():
        ours = base(idx)
        plain = fresh(idx)
        theirs = peft.PeftModel.from_pretrained(fresh, str(tmp_path)).eval()(idx)
    assert (ours - plain).abs().max() > 1e-3                  # the adapter does something
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)


def test_peft_saved_loads_in_ours_with_same_outputs(base, idx, tmp_path):
    ours = copy.deepcopy(base)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"])
    theirs = peft.get_peft_model(base, cfg)
    randomize_lora(theirs)
    theirs.save_pretrained(str(tmp_path))
    report = load_adapter(ours, tmp_path)
    assert report.wrapped == [f"blocks.{i}.{p}" for i in (0, 1)
                              for p in ("attn.k_proj", "mlp.up_proj")]
    assert report.ok
    assert ours.blocks[0].mlp.up_proj.scaling == 2.0
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs.eval()(idx), rtol=0, atol=1e-6)


def test_round_trip_into_already_wrapped_model(base, idx, tmp_path):
    other = copy.deepcopy(base)
    wrap_lora(base, ["o_proj"], r=2, alpha=4.0)
    randomize_lora(base)
    save_adapter(base, tmp_path)
    wrap_lora(other, ["o_proj"], r=2, alpha=4.0)
    assert load_adapter(other, tmp_path).wrapped == []
    with torch.no_grad():
        assert torch.equal(other(idx), base(idx))
    mismatch = copy.deepcopy(base)
    mismatch.blocks[0].attn.o_proj = LoRALinear(mismatch.blocks[0].attn.o_proj.base, r=2, alpha=8)
    with pytest.raises(ValueError, match="scaling"):
        load_adapter(mismatch, tmp_path)


@pytest.fixture
def saved(base, tmp_path):
    """An adapter on q/v of `base`, saved to tmp_path; returns (dir, its tensors)."""
    model = copy.deepcopy(base)
    wrap_lora(model, ["q_proj", "v_proj"], r=4, alpha=8.0)
    randomize_lora(model)
    save_adapter(model, tmp_path)
    return tmp_path, safetensors.torch.load_file(tmp_path / "adapter_model.safetensors")


def rewrite(dir, tensors):
    safetensors.torch.save_file(tensors, dir / "adapter_model.safetensors")


def test_missing_key_named(base, saved):
    dir, tensors = saved
    key = f"{PREFIX}blocks.1.attn.v_proj.lora_B.weight"
    del tensors[key]
    rewrite(dir, tensors)
    with pytest.raises(ValueError, match=re.escape(f"missing ['{key}']")):
        load_adapter(copy.deepcopy(base), dir)
    report = load_adapter(base, dir, strict=False)
    assert report.missing == [key] and not report.unexpected and not report.mismatched
    loaded = base.blocks[0].attn.q_proj.lora_B
    assert torch.equal(loaded, tensors[f"{PREFIX}blocks.0.attn.q_proj.lora_B.weight"])


def test_unexpected_key_named(base, saved):
    dir, tensors = saved
    key = f"{PREFIX}blocks.0.attn.k_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 32)
    rewrite(dir, tensors)
    with pytest.raises(ValueError, match=re.escape(f"unexpected ['{key}']")):
        load_adapter(base, dir)


def test_wrong_shape_named(base, saved):
    dir, tensors = saved
    key = f"{PREFIX}blocks.0.attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(5, 32)
    rewrite(dir, tensors)
    with pytest.raises(ValueError, match=re.escape(f"{key}: file [5, 32] vs model [4, 32]")):
        load_adapter(base, dir)


def snapshot(model: torch.nn.Module) -> tuple[dict, dict, dict]:
    """Everything a failed load must leave alone: module types by name, the state_dict
    (copied), and which parameters train."""
    return ({n: type(m) for n, m in model.named_modules()},
            {k: v.clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()})


def assert_same(model: torch.nn.Module, before: tuple[dict, dict, dict]) -> None:
    types, state, grads = snapshot(model)
    assert types == before[0]
    assert state.keys() == before[1].keys()
    assert all(torch.equal(state[k], before[1][k]) for k in state)
    assert grads == before[2]


def _shape(tensors):
    tensors[f"{PREFIX}blocks.1.attn.q_proj.lora_B.weight"] = torch.zeros(32, 5)


def _extra(tensors):
    tensors[f"{PREFIX}blocks.0.attn.k_proj.lora_A.weight"] = torch.zeros(4, 32)


def _missing(tensors):
    del tensors[f"{PREFIX}blocks.1.attn.v_proj.lora_A.weight"]


def _nan(tensors):
    tensors[f"{PREFIX}blocks.1.attn.v_proj.lora_B.weight"][3, 1] = float("nan")


@pytest.mark.parametrize("spoil", [_shape, _extra, _missing, _nan])
@pytest.mark.parametrize("prewrapped", [False, True], ids=["unwrapped", "wrapped"])
def test_failed_load_leaves_the_model_as_it_was(base, saved, spoil, prewrapped):
    """Checked before the model is touched: a load that raises neither wraps a layer nor
    freezes a parameter nor writes a factor (today's code wrapped first, then raised)."""
    dir, tensors = saved
    spoil(tensors)
    rewrite(dir, tensors)
    if prewrapped:
        wrap_lora(base, ["q_proj", "v_proj"], r=4, alpha=8.0)
        randomize_lora(base, seed=7)
    before = snapshot(base)
    with pytest.raises(ValueError):
        load_adapter(base, dir)
    assert_same(base, before)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_adapter_weights_named(base, saved, value):
    dir, tensors = saved
    key = f"{PREFIX}blocks.0.attn.v_proj.lora_A.weight"
    tensors[key][0, 0] = value
    rewrite(dir, tensors)
    with pytest.raises(ValueError, match=re.escape(f"NaN or Inf in ['{key}']")):
        load_adapter(base, dir)
    assert not any(isinstance(m, LoRALinear) for m in base.modules())


@pytest.mark.parametrize("key, value, match", [
    ("lora_alpha", float("inf"), "lora_alpha must be > 0 and finite, got inf"),
    ("lora_alpha", float("nan"), "lora_alpha must be > 0 and finite, got nan"),
    ("lora_alpha", "16", "lora_alpha must be > 0 and finite, got '16'"),
    ("r", 4.9, "r must be a positive int, got 4.9"),
    ("r", 0, "r must be a positive int, got 0"),
    ("lora_dropout", 1.5, r"lora_dropout must be in \[0, 1\), got 1.5"),
])
def test_bad_config_values_named(base, saved, key, value, match):
    """JSON holds what Python's json writes: Infinity, NaN, 4.9; int(4.9) loaded r = 4."""
    dir, _ = saved
    cfg = json.loads((dir / "adapter_config.json").read_text())
    cfg[key] = value
    (dir / "adapter_config.json").write_text(json.dumps(cfg))
    before = snapshot(base)
    with pytest.raises(ValueError, match=match):
        load_adapter(base, dir)
    assert_same(base, before)


def test_config_not_an_object(base, saved):
    dir, _ = saved
    (dir / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        load_adapter(base, dir)


@pytest.mark.parametrize("target", ["(", r"blocks\.[0-9", "*proj"])
def test_wrap_invalid_regex_named(base, target):
    before = snapshot(base)
    with pytest.raises(ValueError, match="target_modules is not a valid regular expression"):
        wrap_lora(base, target)
    assert_same(base, before)


@pytest.mark.parametrize("alpha", [float("inf"), float("nan"), -float("inf")])
def test_wrap_non_finite_alpha(base, alpha):
    before = snapshot(base)
    with pytest.raises(ValueError, match="alpha must be > 0 and finite"):
        wrap_lora(base, ["q_proj"], alpha=alpha)
    assert_same(base, before)


def test_missing_files_are_clear(base, saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        load_adapter(base, tmp_path / "nowhere")
    dir, _ = saved
    (dir / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors"):
        load_adapter(base, dir)


@pytest.mark.parametrize("key, value, match", [
    ("lora_alpha", 0, "lora_alpha must be > 0 and finite, got 0"),
    ("rank_pattern", {"q_(proj": 2}, "rank_pattern key 'q_(proj' is not a regex"),
    ("target_parameters", "w_up", "target_parameters is 'w_up', expected a list of names"),
    ("use_rslora", "yes", "use_rslora is 'yes', expected true or false"),
])
def test_one_config_reader_for_loading_and_norms(base, saved, key, value, match):
    """load_adapter and lora_norms read adapter_config.json through one validator: the same
    AdapterError (a ValueError) naming the file and the field."""
    dir, _ = saved
    cfg = json.loads((dir / "adapter_config.json").read_text())
    cfg[key] = value
    (dir / "adapter_config.json").write_text(json.dumps(cfg))
    errors = []
    for read in (lambda: load_adapter(base, dir), lambda: adapter_norms(dir)):
        with pytest.raises(AdapterError, match=re.escape(match)) as err:
            read()
        errors.append(str(err.value))
    assert errors[0] == errors[1] and errors[0].startswith(str(dir / "adapter_config.json"))
    with pytest.raises(FileNotFoundError, match="no adapter_config.json") as err:
        adapter_norms(dir / "nowhere")
    assert isinstance(err.value, AdapterError)


def test_unsupported_config_refused(base, saved):
    dir, _ = saved
    cfg = json.loads((dir / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported LoRA options.*use_dora"):
        load_adapter(base, dir)


def test_failed_save_leaves_nothing_half_written(base, saved, monkeypatch):
    dir, tensors = saved
    before = {p.name: p.read_bytes() for p in dir.iterdir()}
    wrap_lora(base, ["q_proj", "v_proj"], r=4, alpha=8.0)

    def broken(path, data):
        with open(path, "wb") as f:                           # a torn write, then the error
            f.write(data[:7])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", broken)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(base, dir)                               # over an existing adapter
    assert {p.name: p.read_bytes() for p in dir.iterdir()} == before
    with pytest.raises(OSError, match="disk full"):
        save_adapter(base, dir / "new")
    assert list((dir / "new").iterdir()) == []
