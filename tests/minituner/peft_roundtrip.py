"""Adapter round trips between minituner and PEFT on tiny models built from a config (no
download): each case builds a base model, puts LoRA on it one side with random nonzero B
factors, saves, loads the other side on a fresh copy of the base, and returns the largest
logit difference. `python tests/minituner/peft_roundtrip.py` prints the table the tests assert.
"""

from __future__ import annotations

import copy
import tempfile
import warnings

import torch

CASES = []      # (model, adapter kind, direction, function)


def case(model: str, kind: str, direction: str):
    def register(fn):
        CASES.append((model, kind, direction, fn))
        return fn
    return register


def randomize_B(model: torch.nn.Module, seed: int = 1) -> None:
    """LoRA B starts at zero (the adapter changes nothing); give every B random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def hf_model(kind: str):
    import transformers as tf
    common = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=24, **common))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(intermediate_size=24, **common))
    else:
        model = tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                                       num_experts_per_tok=2, **common))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model.eval()


def minigpt(n_experts: int = 4):
    from minigpt import MiniGPT, MiniGPTConfig
    torch.manual_seed(0)
    return MiniGPT(MiniGPTConfig(n_layer=2, n_embd=32, n_head=2, d_ff=64,
                                 n_experts=n_experts, top_k=2)).eval()


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def _ours_to_peft(base, wrap, ids, names="ours", peft_base=None) -> tuple[float, float]:
    import peft

    from minituner import save_adapter
    ours = copy.deepcopy(base)
    wrap(ours)
    randomize_B(ours)
    with tempfile.TemporaryDirectory() as d:
        save_adapter(ours, d, names=names)
        with warnings.catch_warnings():        # PEFT warns that rank_pattern keys of
            warnings.simplefilter("ignore")    # parameters matched no module; they are used
            theirs = peft.PeftModel.from_pretrained(copy.deepcopy(peft_base or base), d).eval()
    return _diffs(ours, theirs, peft_base or base, ids)


def _diffs(ours, theirs, base, ids) -> tuple[float, float]:
    """(max |ours − theirs|, max |adapted − base|): the second shows the adapter did act."""
    got = logits(ours, ids)
    return ((got - logits(theirs, ids)).abs().max().item(),
            (got - logits(base, ids)).abs().max().item())


def _peft_to_ours(base, config, ids) -> tuple[float, float]:
    import peft

    from minituner import load_adapter
    theirs = peft.get_peft_model(copy.deepcopy(base), config)
    randomize_B(theirs)
    theirs.eval()
    with tempfile.TemporaryDirectory() as d:
        theirs.save_pretrained(d)
        ours = copy.deepcopy(base)
        load_adapter(ours, d)
    return _diffs(ours, theirs, base, ids)


IDS = torch.randint(0, 45, (2, 9), generator=torch.Generator().manual_seed(5))
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _peft_config(**kw):
    import peft
    return peft.LoraConfig(r=2, lora_alpha=4, **kw)


for _kind in ("llama", "mistral"):
    @case(f"HF {_kind.capitalize()}", "attention LoRA", "ours → PEFT")
    def _(kind=_kind):
        from minituner import wrap_lora
        return _ours_to_peft(hf_model(kind), lambda m: wrap_lora(m, ATTN, r=2, alpha=4), IDS)

    @case(f"HF {_kind.capitalize()}", "attention LoRA", "PEFT → ours")
    def _(kind=_kind):
        return _peft_to_ours(hf_model(kind), _peft_config(target_modules=ATTN), IDS)

    @case(f"HF {_kind.capitalize()}", "QLoRA (NF4 base, attention + MLP)", "ours → PEFT")
    def _(kind=_kind):
        from miniquant import quantize_model
        from minituner import wrap_lora
        base = hf_model(kind)
        nf4 = copy.deepcopy(base)
        target = r".*\.(q|k|v|o|gate|up|down)_proj"
        quantize_model(nf4, target)
        dequantized = copy.deepcopy(base)      # PEFT's float base holds the same NF4 values
        with torch.no_grad():
            for name, m in nf4.named_modules():
                if hasattr(m, "dequantized_weight"):
                    dequantized.get_submodule(name).weight.copy_(m.dequantized_weight())
        return _ours_to_peft(nf4, lambda m: wrap_lora(m, target, r=2, alpha=4), IDS,
                             peft_base=dequantized)


@case("HF Mixtral", "attention + expert LoRA (HFExperts)", "PEFT → ours")
def _():
    return _peft_to_ours(hf_model("mixtral"), _peft_config(
        target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]), IDS)


@case("HF Mixtral", "expert LoRA, rank_pattern (HFExperts)", "PEFT → ours")
def _():
    return _peft_to_ours(hf_model("mixtral"), _peft_config(
        target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        rank_pattern={"down_proj": 3}), IDS)


@case("HF Mixtral", "attention + expert LoRA (HFExperts)", "ours → PEFT")
def _():
    from minituner import wrap_lora
    return _ours_to_peft(hf_model("mixtral"), lambda m: wrap_lora(
        m, ["q_proj"], r=2, alpha=4,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]), IDS)


@case("HF Mixtral, blocks as MoEMLP", "attention + router + expert LoRA", "ours → PEFT")
def _():
    from minimoe.hf import moe_from_hf
    from minituner import wrap_lora
    hf = hf_model("mixtral")
    swapped = copy.deepcopy(hf)
    for layer in swapped.model.layers:
        layer.mlp = moe_from_hf(layer.mlp)
    return _ours_to_peft(swapped, lambda m: wrap_lora(
        m, ["q_proj", "router"], r=2, alpha=4, target_parameters=["w_gate", "w_up", "w_down"]),
        IDS, names="hf", peft_base=hf)


@case("MiniGPT-MoE", "attention + expert LoRA", "ours → PEFT")
def _():
    from minituner import wrap_lora
    return _ours_to_peft(minigpt(), lambda m: wrap_lora(
        m, ATTN, r=2, alpha=4, target_parameters=["w_gate", "w_up", "w_down"]), IDS)


@case("MiniGPT-MoE", "attention + expert LoRA", "PEFT → ours")
def _():
    return _peft_to_ours(minigpt(), _peft_config(
        target_modules=ATTN, target_parameters=["w_gate", "w_up", "w_down"]), IDS)


@case("MiniGPT-MoE", "QLoRA (NF4 experts and attention)", "ours → PEFT")
def _():
    from minituner.qlora import wrap_minigpt_qlora
    base = minigpt()
    float_base = copy.deepcopy(base)
    qlora = copy.deepcopy(base)
    wrap_minigpt_qlora(qlora, r=2, alpha=4)
    with torch.no_grad():                   # PEFT's float base: the NF4 values, dequantized
        for name, m in qlora.named_modules():
            if hasattr(m, "dequantized_weight"):
                float_base.get_submodule(name.removesuffix(".base")).weight.copy_(
                    m.dequantized_weight())
            elif hasattr(m, "weight_nf4"):
                getattr(float_base.get_submodule(name.rpartition(".")[0]),
                        name.rpartition(".")[2]).copy_(m.weight_nf4.dequantize(torch.float32))
    return _ours_to_peft(qlora, lambda m: None, IDS, peft_base=float_base)


if __name__ == "__main__":
    print("| model | adapter | direction | max logit difference | adapter's effect on the logits |")
    print("|---|---|---|---|---|")
    for model, kind, direction, fn in CASES:
        diff, effect = fn()
        print(f"| {model} | {kind} | {direction} | {diff:.1e} | {effect:.2f} |")
