"""The cases `bench_cpu.py` times: each builds its inputs once and returns ours and its peer.

Every case is a function with no arguments returning a `Case`: two closures that do the same
work (the same inputs, the same outputs up to rounding), a shape to report and the peer's
name. Forward+backward cases start from the same upstream gradient and reset nothing: a
gradient accumulating into .grad costs both sides the same.

Shapes: a 4096 × 4096 weight at blocksize 64 with double quantization (a 7B model's
projection); MoE blocks of 8 experts, top-2, d_model 512, d_ff 1024 over 4,096 tokens, LoRA
rank 16 (a small Mixtral); log-probs of 256 tokens over a 50,000-word vocabulary.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn


class Case(NamedTuple):
    ours: Callable[[], object]
    peer: Callable[[], object]
    shape: str
    peer_name: str


NF4_SHAPE, BLOCKSIZE = (4096, 4096), 64
MOE = dict(C=512, F=1024, E=8, k=2, T=4096, r=16)
LOGPROBS = dict(N=256, V=50_000)


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of `module` on `x` (no grad of its own) from `grad`."""
    def step():
        out = module(x)
        (out[0] if isinstance(out, tuple) else out).backward(grad)
    return step


def nf4_dequant() -> Case:
    import bitsandbytes.functional as bnbf

    from miniquant import dequantize_nf4, quantize_nf4

    w = torch.randn(NF4_SHAPE)
    q = quantize_nf4(w, BLOCKSIZE, double_quant=True, nested_rounding="bnb_cpu")
    packed, state = bnbf.quantize_4bit(w, blocksize=BLOCKSIZE, compress_statistics=True,
                                       quant_type="nf4")
    return Case(lambda: dequantize_nf4(q), lambda: bnbf.dequantize_4bit(packed, state),
                f"{NF4_SHAPE[0]}x{NF4_SHAPE[1]} fp32, bs {BLOCKSIZE}, double quant",
                "bitsandbytes dequantize_4bit")


def nf4_quantize() -> Case:
    import bitsandbytes.functional as bnbf

    from miniquant import quantize_nf4

    w = torch.randn(NF4_SHAPE)
    return Case(lambda: quantize_nf4(w, BLOCKSIZE, double_quant=True, nested_rounding="bnb_cpu"),
                lambda: bnbf.quantize_4bit(w, blocksize=BLOCKSIZE, compress_statistics=True,
                                           quant_type="nf4"),
                f"{NF4_SHAPE[0]}x{NF4_SHAPE[1]} fp32, bs {BLOCKSIZE}, double quant",
                "bitsandbytes quantize_4bit")


def lora_linear() -> Case:
    from peft import LoraConfig, get_peft_model

    from minituner import LoRALinear

    n, r, tokens = 1024, MOE["r"], 2048

    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(n, n)

        def forward(self, x):
            return self.proj(x)

    base = Proj()
    peer = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r,
                                                          target_modules=["proj"]))
    ours = LoRALinear(base.proj, r=r, alpha=2 * r)
    x, grad = torch.randn(tokens, n), torch.randn(tokens, n)
    return Case(fwd_bwd(ours, x, grad), fwd_bwd(peer, x, grad),
                f"{tokens} tokens, {n}x{n}, r {r}", "PEFT LoRA")


def mixtral_block() -> nn.Module:
    """transformers' Mixtral sparse-MoE block at MOE's shape, eager, float32."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=MOE["C"], intermediate_size=MOE["F"],
                        num_local_experts=MOE["E"], num_experts_per_tok=MOE["k"])
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def moe_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, MOE["T"], MOE["C"]), torch.randn(1, MOE["T"], MOE["C"])


MOE_SHAPE = f"{MOE['T']} tokens, E {MOE['E']}, top-{MOE['k']}, {MOE['C']}->{MOE['F']}"


def moe_mlp() -> Case:
    from minimoe.hf import moe_from_hf

    block = mixtral_block()
    ours = moe_from_hf(block)
    x, grad = moe_inputs()
    return Case(fwd_bwd(ours, x.requires_grad_(), grad), fwd_bwd(block, x, grad),
                MOE_SHAPE, "transformers MixtralSparseMoeBlock")


def peft_experts(block: nn.Module) -> nn.Module:
    """PEFT's LoRA on both stacked expert parameters of an HF block (`target_parameters`)."""
    from peft import LoraConfig, get_peft_model

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = block

        def forward(self, x):
            out = self.mlp(x)
            return out[0] if isinstance(out, tuple) else out

    cfg = LoraConfig(r=MOE["r"], lora_alpha=2 * MOE["r"], target_modules=[],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return get_peft_model(Holder(), cfg)


def expert_lora(nf4: bool = False) -> Case:
    from minimoe import attach_expert_lora
    from minimoe.hf import moe_from_hf

    block = mixtral_block()
    ours = moe_from_hf(block)
    attach_expert_lora(ours, r=MOE["r"], alpha=2 * MOE["r"], nf4=nf4)
    peer = peft_experts(block)
    x, grad = moe_inputs()
    return Case(fwd_bwd(ours, x.requires_grad_(), grad), fwd_bwd(peer, x, grad),
                f"{MOE_SHAPE}, r {MOE['r']}" + (", NF4 experts" if nf4 else ""),
                "PEFT target_parameters" + (" (float experts)" if nf4 else ""))


def qlora_experts() -> Case:
    return expert_lora(nf4=True)


def logprobs() -> Case:
    from minirl import selective_log_softmax

    N, V = LOGPROBS["N"], LOGPROBS["V"]
    logits = torch.randn(N, V, requires_grad=True)
    ids, grad = torch.randint(V, (N,)), torch.randn(N)

    def ours():
        selective_log_softmax(logits, ids).backward(grad)

    def peer():
        torch.log_softmax(logits, dim=-1).gather(1, ids[:, None])[:, 0].backward(grad)

    return Case(ours, peer, f"[{N}, {V}] fp32", "log_softmax + gather")


CASES: dict[str, Callable[[], Case]] = {
    "nf4_dequant": nf4_dequant, "nf4_quantize": nf4_quantize, "lora_linear": lora_linear,
    "moe_mlp": moe_mlp, "expert_lora": expert_lora, "qlora_experts": qlora_experts,
    "logprobs": logprobs,
}
