"""QLoRA on MiniGPT: quantize the frozen base to NF4, then put float LoRA adapters on top.

The order matters. Quantizing replaces each `nn.Linear` with a `QuantizedLinear` that holds
only NF4 buffers; wrapping then puts a `LoRALinear` around each of those, with float32
factors A and B that are the only trainable tensors. The other order cannot work: once a
layer is a `LoRALinear`, it is no longer an `nn.Linear`, so the quantizer would either skip it
(leaving the base in float, no memory saved) or, reaching inside, fold a trained adapter into
4-bit codes. `wrap_minigpt_qlora` therefore refuses a model that already holds LoRA layers.

What gets quantized: every projection inside the transformer blocks (attention q/k/v/o and
the SwiGLU gate/up/down). The embeddings, norms and `lm_head` stay in float, as in QLoRA: they
are a small share of a large model and the most sensitive to rounding.

MoE blocks (MiniGPT-MoE): the experts are stacked `[E, in, out]` parameters, not
`nn.Linear`s. `minimoe.attach_expert_lora` swaps each `MoEMLP`'s w_gate / w_up / w_down for
`NF4Experts` (NF4 + double quant, dequantized only for the experts a batch routes tokens to)
carrying per-expert LoRA. The router stays a float `nn.Linear`, frozen unless
`train_router=True`: routing decisions are discrete and a few mis-rounded router weights
would move tokens to other experts. `quantize=False` builds the same adapters over the float
base (the "LoRA on a float MoE" baseline).
"""

from __future__ import annotations

import re

import torch.nn as nn

from minimoe import MoEMLP, attach_expert_lora
from miniquant import NF4Config, quantize_model
from miniquant.nf4 import FROM_CONFIG

from .lora import LoRALinear, check_lora_args
from .wrap import wrap_lora

# The block projections of MiniGPT (full-match regex, as quantize_model takes it).
BLOCK_LINEARS = r"blocks\.\d+\.(attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
SCHEME = re.compile(r"nf4_per_group_(\d+)")


def parse_quant_scheme(quant_scheme: str) -> int:
    """"nf4_per_group_<blocksize>" -> blocksize (the blocksize itself is checked by miniquant)."""
    match = SCHEME.fullmatch(quant_scheme) if isinstance(quant_scheme, str) else None
    if match is None:
        raise ValueError(f"quant_scheme must look like 'nf4_per_group_<blocksize>' "
                         f"(e.g. 'nf4_per_group_64'), got {quant_scheme!r}")
    return int(match.group(1))


def wrap_minigpt_qlora(model: nn.Module, r: int = 8, alpha: float = 16.0,
                       quant_scheme: str = FROM_CONFIG, double_quant: bool = FROM_CONFIG,
                       dropout: float = 0.0, use_rslora: bool = False,
                       target: str = BLOCK_LINEARS, quantize: bool = True,
                       train_router: bool = False, nested_rounding: str = FROM_CONFIG, *,
                       nf4_config: NF4Config | None = None) -> list[str]:
    """Quantize the linears matching `target` to NF4, then wrap the same layers with LoRA;
    in a MoE model also give every expert NF4 weights and its own LoRA (see the module doc).

    In place; returns the names wrapped (expert projections as `<mlp>.w_gate` ...).
    Afterwards the only trainable parameters are the float32 `lora_A` / `lora_B` factors (and
    the routers' weights with `train_router`); everything else is frozen (NF4 buffers, and
    the float embeddings, norms and head). `quantize=False` keeps the base in float.
    Every NF4 quantization, linears and experts, follows `nf4_config` (miniquant.NF4Config),
    or its fields given as `quant_scheme` ("nf4_per_group_<blocksize>"), `double_quant` and
    `nested_rounding` ("bnb_cpu": bitsandbytes' CPU double-quant codes bit for bit). Raises
    ValueError, with the model untouched, for a model that already holds LoRA layers (wrong
    order), an unknown `quant_scheme` or `nested_rounding`, expert shapes that don't fit the
    NF4 blocks, or a `target` matching nothing.
    """
    wrapped = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    if wrapped:
        raise ValueError(
            f"model already holds LoRA layers ({wrapped[:3]}{' ...' if len(wrapped) > 3 else ''})"
            f"; QLoRA quantizes the base first and wraps it second. Quantizing after wrapping "
            f"would skip the wrapped layers (a LoRALinear is not an nn.Linear) and keep their "
            f"base in float. Start from the plain model: wrap_minigpt_qlora(load_base(...)).")
    nf4 = NF4Config.of(nf4_config, double_quant=double_quant, nested_rounding=nested_rounding,
                       blocksize=FROM_CONFIG if quant_scheme is FROM_CONFIG
                       else parse_quant_scheme(quant_scheme))
    blocksize = nf4.blocksize
    check_lora_args(r, alpha, dropout)   # before quantizing: fail with the model untouched
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoEMLP)}
    if quantize:
        for name, mlp in moes.items():
            for proj in ("w_gate", "w_up", "w_down"):
                w = getattr(mlp, proj)
                if not isinstance(w, nn.Parameter):
                    raise ValueError(f"{name}.{proj} is already wrapped ({type(w).__name__})")
                if w[0].numel() % blocksize:
                    raise ValueError(
                        f"{name}.{proj}: each expert's {w.shape[1]}×{w.shape[2]} = "
                        f"{w[0].numel()} weights must be a multiple of the NF4 blocksize "
                        f"{blocksize} (quant_scheme 'nf4_per_group_{blocksize}'), so that no "
                        f"block spans two experts")
        quantize_model(model, target, nf4_config=nf4)
    names = wrap_lora(model, target, r=r, alpha=alpha, dropout=dropout, use_rslora=use_rslora)
    for name, mlp in moes.items():
        attach_expert_lora(mlp, r=r, alpha=alpha, nf4=quantize, nf4_config=nf4)
        mlp.router.weight.requires_grad_(train_router)
        names += [f"{name}.{proj}" for proj in ("w_gate", "w_up", "w_down")]
    return names
