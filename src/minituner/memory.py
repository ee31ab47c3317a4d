"""The memory bill of a training setup: predicted from shapes and dtypes, or counted off
the tensors a model and optimizer hold.

`predict` counts weights, gradients and optimizer state from parameter counts and storage
bits (`param_specs` reads them off a module). `predict_training` does it for a decoder-only
transformer given only its shape (`TransformerShape`, e.g. `LLAMA_7B`) in three regimes,
full fine-tuning, LoRA and QLoRA, activations included. Sizes come from the packages that
own them: an NF4 tensor's bytes from `miniquant.nf4_bytes` (what `NF4Weight.nbytes` reports),
a MoE MLP's saved tensors from `minimoe.saved_per_token`. `held_bytes` counts the same
bill off real tensors; the tests hold the prediction equal to it and to the saved-tensor
count on MiniGPT, and compare it with the RSS peak `labkit.measure.measure` sees.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from minimoe.moe import saved_per_token
from miniquant import NF4Config, nf4_bytes

# Optimizer state tensors kept per trainable parameter.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass(frozen=True)
class ParamSpec:
    """One group of parameters as the predictor sees it."""

    numel: int
    bits: float          # storage bits per element (32 float32, 16 bf16, ~4.127 NF4+DQ)
    trainable: bool


@dataclass(frozen=True)
class MemoryPrediction:
    """A memory bill by kind, predicted (`predict*`) or counted (`held_bytes`)."""

    weights: int         # bytes
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
               ) -> MemoryPrediction:
    """What a training setup holds right now, counted tensor by tensor (no activations).

    weights: parameters and buffers; grads: every `.grad` present; optimizer: every tensor in
    the optimizer's state (AdamW's moments, and its 0-d step counters). Shared storage counts
    once. Read it after a few steps, when gradients and optimizer state exist.
    """
    seen: set[int] = set()

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    weights = nbytes(list(model.parameters()) + list(model.buffers()))
    grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
    states = [] if optimizer is None else [
        t for state in optimizer.state.values() for t in state.values()
        if isinstance(t, torch.Tensor)]
    return MemoryPrediction(weights=weights, grads=grads, optimizer=nbytes(states),
                            activations=0)


def param_specs(module: torch.nn.Module) -> list[ParamSpec]:
    """Parameters (trainable if `requires_grad`) and buffers (frozen) of a module."""
    specs = [ParamSpec(p.numel(), p.element_size() * 8, p.requires_grad)
             for p in module.parameters()]
    specs += [ParamSpec(b.numel(), b.element_size() * 8, False) for b in module.buffers()]
    return specs


def predict(params: Iterable[ParamSpec] | torch.nn.Module, *, grad_bits: int = 32,
            optimizer: str = "adamw", state_bits: int = 32, activations: int = 0
            ) -> MemoryPrediction:
    """Bytes for weights, gradients and optimizer state of a training setup.

    Gradients and optimizer state exist only for trainable parameters; AdamW keeps two
    state tensors (first and second moments) per trainable element.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if isinstance(params, torch.nn.Module):
        params = param_specs(params)
    params = list(params)
    weights = sum(p.numel * p.bits for p in params) / 8
    trainable = sum(p.numel for p in params if p.trainable)
    return MemoryPrediction(
        weights=round(weights),
        grads=trainable * grad_bits // 8,
        optimizer=trainable * OPTIMIZER_STATES[optimizer] * state_bits // 8,
        activations=int(activations),
    )


# ---------------------------------------------------------------------------------------------
# Training regimes of a decoder-only transformer, from its shape alone

REGIMES = ("full", "lora", "qlora")


@dataclass(frozen=True)
class TransformerShape:
    """The sizes that set a pre-norm SwiGLU transformer's memory (MiniGPT, LLaMA-style, and
    top-k MoE models such as Mixtral and Qwen3-MoE).

    Per block: attention q [H·hd, d_model], k and v [KV·hd, d_model], o [d_model, H·hd]
    (H = n_head, KV = n_kv_head, hd = head_dim); a SwiGLU MLP gate/up [d_ff, d_model], down
    [d_model, d_ff] — or, with n_experts > 0, that many experts of width d_ff and a router
    [n_experts, d_model]; two RMSNorm gains. Around them a token embedding, an optional
    learned position embedding (block_size rows; 0 for rotary), a final norm and an untied
    head.
    """

    n_layer: int
    d_model: int
    d_ff: int                 # MLP width; with experts, the width of one expert
    n_head: int
    vocab_size: int
    block_size: int = 0
    n_experts: int = 0        # 0 = dense MLP
    top_k: int = 0            # experts per token (MoE only)
    n_kv_head: int = 0        # 0 = n_head (no grouped-query attention)
    head_dim: int = 0         # 0 = d_model // n_head

    @classmethod
    def of(cls, config) -> TransformerShape:
        """From a MiniGPTConfig (or anything with the same field names)."""
        return cls(config.n_layer, config.n_embd, config.d_ff, config.n_head, config.vocab_size,
                   config.block_size, getattr(config, "n_experts", 0),
                   getattr(config, "top_k", 0) if getattr(config, "n_experts", 0) else 0)

    def attn_linears(self) -> list[tuple[int, int]]:
        """[out, in] of q, k, v, o."""
        d = self.d_model
        hd = self.head_dim or d // self.n_head
        q, kv = self.n_head * hd, (self.n_kv_head or self.n_head) * hd
        return [(q, d), (kv, d), (kv, d), (d, q)]

    def mlp_linears(self) -> list[tuple[int, int]]:
        """[out, in] of gate, up, down (of one expert in a MoE)."""
        d, f = self.d_model, self.d_ff
        return [(f, d), (f, d), (d, f)]

    def block_linears(self) -> list[tuple[int, int]]:
        """[out, in] of every projection of one block (each expert's three in a MoE)."""
        return self.attn_linears() + self.mlp_linears() * max(self.n_experts, 1)

    def other_params(self) -> int:
        """Embeddings, norm gains, routers and head: everything outside the projections."""
        d = self.d_model
        return ((2 * self.vocab_size + self.block_size) * d + (2 * self.n_layer + 1) * d
                + self.n_layer * self.n_experts * d)

    def n_params(self) -> int:
        return self.other_params() + self.n_layer * sum(o * i for o, i in self.block_linears())


LLAMA_7B = TransformerShape(n_layer=32, d_model=4096, d_ff=11008, n_head=32, vocab_size=32000)
# Published configurations (config.json on the Hugging Face Hub): 46.7 B and 30.5 B parameters.
MIXTRAL_8X7B = TransformerShape(n_layer=32, d_model=4096, d_ff=14336, n_head=32,
                                vocab_size=32000, n_experts=8, top_k=2, n_kv_head=8)
QWEN3_30B_A3B = TransformerShape(n_layer=48, d_model=2048, d_ff=768, n_head=32,
                                 vocab_size=151936, n_experts=128, top_k=8, n_kv_head=4,
                                 head_dim=128)
# The QLoRA paper's largest model (LLaMA-65B), fine-tuned there on one 48 GB GPU.
LLAMA_65B = TransformerShape(n_layer=80, d_model=8192, d_ff=22016, n_head=64, vocab_size=32000)


def regime_specs(shape: TransformerShape, regime: str, r: int = 8, weight_bits: int = 32,
                 lora_bits: int = 32, blocksize: int = NF4Config.blocksize,
                 double_quant: bool = NF4Config.double_quant) -> list[ParamSpec]:
    """The parameters a regime holds: "full" trains everything; "lora" freezes the base and
    adds rank-r factors (A [r, in], B [out, r]) to every block projection (to every expert's,
    in a MoE); "qlora" does the same over NF4 block projections (embeddings, norms, routers
    and head stay at weight_bits, trained only in "full")."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    linears = shape.block_linears() * shape.n_layer
    specs = [ParamSpec(shape.other_params(), weight_bits, regime == "full")]
    if regime == "qlora":
        # One NF4 tensor per projection; a MoE's experts are stacked [E, in, out] into one.
        tensors = [o * i for o, i in shape.attn_linears()] + [
            o * i * max(shape.n_experts, 1) for o, i in shape.mlp_linears()]
        specs += [ParamSpec(n, 8 * nf4_bytes(n, blocksize, double_quant) / n, False)
                  for n in tensors * shape.n_layer]
    else:
        specs += [ParamSpec(o * i, weight_bits, regime == "full") for o, i in linears]
    if regime != "full":
        specs += [ParamSpec(r * (o + i), lora_bits, True) for o, i in linears]
    return specs


def _moe_mlp_saved(shape: TransformerShape, regime: str, r: int) -> tuple[int, int]:
    """(floats, int64s) per token one MiniGPT-MoE MLP keeps: minimoe's own account."""
    kind = {"full": "float", "lora": "lora", "qlora": "nf4_lora"}[regime]
    return saved_per_token(shape.d_model, shape.d_ff, shape.n_experts, shape.top_k, kind, r)


def activation_bytes(shape: TransformerShape, regime: str, tokens: int, r: int = 8,
                     act_bits: int = 32, checkpointing: bool = False) -> int:
    """Bytes autograd saves for backward over `tokens` = batch × sequence positions (of one
    micro-batch, with gradient accumulation: see `predict_training`).

    Counted from what MiniGPT's graph saves per token (tests/minituner/test_memory.py checks
    the count against a saved-tensor hook). Per block, with q = n_head·head_dim and kv =
    n_kv_head·head_dim: full fine-tuning keeps 5 vectors of d_model (norm inputs, normalised
    values and outputs, the residual), q, k and v, the attention output and its transposed
    copy, 4 of d_ff (gate, up, their SiLU product and the down projection's input), the
    attention's log-sum-exp per head and 2 norm scalars. LoRA drops the inputs of frozen norm
    gains and projections, except what the adapters need, and adds x·Aᵀ (r values) per
    adapted projection; its first block saves nothing for its input norm, since nothing below
    it is trained. A MoE block replaces the dense MLP by the terms of `_moe_mlp_saved`, and
    under QLoRA each layer also keeps 6 int64 per active expert (min(E, tokens·k) of them).
    The head adds the logits' softmax (vocab_size); the target ids (and, when the embedding
    trains, the input ids) are int64. Attention here is flash-style (no [T, T] matrix kept).

    With `checkpointing` (one block per segment) the forward keeps only each block's input
    (d_model per token per layer) and the backward recomputes one block at a time: the peak
    is those inputs plus one block's activations plus the head's.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    d, f, h, v = shape.d_model, shape.d_ff, shape.n_head, shape.vocab_size
    (q, _), (kv, _) = shape.attn_linears()[:2]        # q and k widths (grouped-query aware)
    ints = 2 if regime == "full" else 1     # int64 inputs (for the embedding's grad), targets
    if regime == "full":
        block, mlp, head = 5 * d + 3 * q + 2 * kv + h + 2, (4 * f, 0), 3 * d + 1 + v
    else:
        block, mlp, head = 3 * d + 2 * q + 2 * kv + h + 2 + 4 * r, (d + 4 * f + 3 * r, 0), v
    if shape.n_experts:
        mlp = _moe_mlp_saved(shape, regime, r)
    block += mlp[0]
    layers = shape.n_layer * d + block if checkpointing else shape.n_layer * block
    per_layer_ints = mlp[1] * (1 if checkpointing else shape.n_layer)
    fixed = 0
    if shape.n_experts and regime == "qlora" and tokens:
        fixed = 6 * 8 * min(shape.n_experts, tokens * shape.top_k)
        fixed *= 1 if checkpointing else shape.n_layer
    return tokens * ((layers + head) * act_bits // 8 + 8 * (ints + per_layer_ints)) + fixed


def predict_training(shape: TransformerShape, regime: str, tokens: int, r: int = 8,
                     weight_bits: int = 32, act_bits: int = 32, optimizer: str = "adamw",
                     blocksize: int = NF4Config.blocksize,
                     double_quant: bool = NF4Config.double_quant, lora_bits: int = 32,
                     checkpointing: bool = False) -> MemoryPrediction:
    """Weights, gradients, optimizer state and activations of one training step.

    Gradients and AdamW state are float32 (by default the LoRA factors train in float32
    even over a 16-bit base, as minituner does; `lora_bits` sets their storage). `tokens`
    are those of one forward: with gradient accumulation (`TrainConfig.accumulate` = k)
    autograd holds one micro-batch's activations at a time, so pass the micro-batch's,
    batch_size / k rows × positions; nothing else in the bill depends on k.
    """
    specs = regime_specs(shape, regime, r, weight_bits, lora_bits, blocksize=blocksize,
                         double_quant=double_quant)
    return predict(specs, optimizer=optimizer,
                   activations=activation_bytes(shape, regime, tokens, r, act_bits,
                                                checkpointing))


__all__ = ["LLAMA_65B", "LLAMA_7B", "MIXTRAL_8X7B", "OPTIMIZER_STATES", "QWEN3_30B_A3B",
           "REGIMES", "MemoryPrediction", "ParamSpec", "TransformerShape", "activation_bytes",
           "nf4_bytes", "param_specs", "predict", "predict_training", "regime_specs"]
