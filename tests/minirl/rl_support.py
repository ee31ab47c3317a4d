"""Helpers the minirl test modules share (this folder is on sys.path while they run): tiny
MiniGPTs (support.SMALL, dense or MoE), prompts of several lengths, and a hook that raises
the <eos> logit so that sampled completions end at different lengths. No tests here."""

from __future__ import annotations

import torch
from support import SMALL, TOK

from minigpt import MiniGPT, MiniGPTConfig
from minigpt.tasks import Example

# Prompts of three lengths (2, 3, 4 tokens), one length twice: decoding buckets by length.
PROMPTS = [Example("t", "ab=", "a"), Example("t", "abc=", "c"), Example("t", "xy=", "y"),
           Example("t", "k=", "k")]


def tiny(kind: str = "dense", seed: int = 0, **kw) -> MiniGPT:
    """A fresh tiny MiniGPT: SMALL sizes (every NF4-quantized shape is whole 64-blocks),
    dense, or MoE with 4 experts, top-2."""
    torch.manual_seed(seed)
    experts = dict(n_experts=4, top_k=2) if kind == "moe" else {}
    return MiniGPT(MiniGPTConfig(**{**SMALL, **experts, **kw}))


def raise_eos(model: torch.nn.Module, bias: float = 3.0) -> torch.nn.Module:
    """Add `bias` to the <eos> logit of every forward (then about 1 token in 3 is <eos>)."""
    def hook(module, inputs, logits):
        return logits + bias * torch.nn.functional.one_hot(
            torch.tensor(TOK.eos_id), logits.shape[-1]).to(logits)
    model.lm_head.register_forward_hook(hook)
    return model
