"""MiniGPT: a small decoder-only transformer, dense or Mixture-of-Experts, from one config.

Llama-style blocks (RMSNorm, bias-free projections, SwiGLU MLP) with learned absolute
positions. The projection names (q_proj … down_proj) match Hugging Face Llama/Mixtral, so
the LoRA and quantization target patterns a learner writes here work on real models too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from minimoe import MoEMLP
from minimoe.moe import BACKENDS as MOE_BACKENDS
from minimoe.moe import check_bias_update_rate
from minimoe.routers import METHODS as MOE_ROUTERS
from minimoe.routers import check_router


@dataclass
class MiniGPTConfig:
    vocab_size: int = 45       # tokens in the vocabulary (CharTokenizer().vocab_size)
    block_size: int = 32       # longest sequence the model attends over (positions 0..block-1)
    n_layer: int = 4           # transformer blocks
    n_head: int = 4            # attention heads; n_embd must be divisible by n_head
    n_embd: int = 128          # residual stream width
    d_ff: int = 384            # SwiGLU hidden width (of each expert when n_experts > 0)
    n_experts: int = 0         # 0 = dense MLP in every block; > 0 = MoE MLP with this many experts
    top_k: int = 2             # experts per token (MoE only)
    norm_eps: float = 1e-5     # RMSNorm epsilon
    # MoE options (defaults = the behaviour before they existed, so old configs load as is):
    moe_backend: str = "torch"           # "torch" (PyTorch dispatch) or "triton" (ScatterMoE)
    moe_renormalize: bool | None = None  # top-k weights sum to 1? None: for top_k > 1 only
    moe_shared_d_ff: int = 0             # Qwen2-MoE shared expert width; 0 = none
    moe_router: str = "softmax_topk"     # "softmax_topk" | "sigmoid_topk" | "group_topk"
    moe_n_group: int | None = None       # group_topk: experts in this many equal groups
    moe_topk_group: int | None = None    # group_topk: top-k within this many best groups
    moe_group_score: str = "top2_sum"    # group_topk's group rank: "top2_sum" (V3) | "max" (V2)
    moe_scoring: str = "sigmoid"         # group_topk's expert scores: "sigmoid" | "softmax"
    moe_routed_scaling_factor: float = 1.0  # multiplies the routed weights (DeepSeek)
    moe_bias_update_rate: float = 0.0    # sigmoid/group routers: aux-loss-free bias step

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_experts < 0:
            raise ValueError(f"n_experts must be >= 0 (0 = dense), got {self.n_experts}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, "
                             f"got {self.moe_backend!r}")
        if self.moe_renormalize is not None and not isinstance(self.moe_renormalize, bool):
            raise ValueError(f"moe_renormalize must be None, True or False, "
                             f"got {self.moe_renormalize!r}")
        if isinstance(self.moe_shared_d_ff, bool) or not isinstance(self.moe_shared_d_ff, int) \
                or self.moe_shared_d_ff < 0:
            raise ValueError(f"moe_shared_d_ff must be an int >= 0 (0 = none), "
                             f"got {self.moe_shared_d_ff!r}")
        if self.moe_router not in MOE_ROUTERS:
            raise ValueError(f"moe_router must be one of {MOE_ROUTERS}, got {self.moe_router!r}")
        # The router options against the experts (only what does not need them when dense).
        E = self.n_experts or None
        check_router(self.moe_router, E, self.top_k if E else None, n_group=self.moe_n_group,
                     topk_group=self.moe_topk_group, group_score=self.moe_group_score,
                     scoring=self.moe_scoring,
                     routed_scaling_factor=self.moe_routed_scaling_factor, prefix="moe_")
        check_bias_update_rate(self.moe_bias_update_rate, self.moe_router,
                               name="moe_bias_update_rate")

    def to_dict(self) -> dict:
        """The fields as a dict, the MoE options only where they differ from their defaults:
        a config that leaves them alone serialises (and its checkpoint hashes) as before they
        existed, so experiment 00's bases still reproduce byte for byte."""
        return {name: value for name, value in asdict(self).items()
                if not (name in MOE_OPTIONS and value == MOE_OPTIONS[name])}


# The MoE options and their defaults (left out of `to_dict` when unchanged).
MOE_OPTIONS = {f.name: f.default for f in fields(MiniGPTConfig) if f.name.startswith("moe_")}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: MiniGPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # [B, T, C] -> [B, n_head, T, head_dim]
        q, k, v = (proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the gated MLP of Llama and of each Mixtral expert."""

    def __init__(self, n_embd: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, d_ff, bias=False)
        self.up_proj = nn.Linear(n_embd, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: MiniGPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = (MoEMLP(cfg.n_embd, cfg.d_ff, cfg.n_experts, cfg.top_k,
                           backend=cfg.moe_backend, renormalize=cfg.moe_renormalize,
                           shared_d_ff=cfg.moe_shared_d_ff, method=cfg.moe_router,
                           n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
                           group_score=cfg.moe_group_score, scoring=cfg.moe_scoring,
                           routed_scaling_factor=cfg.moe_routed_scaling_factor,
                           bias_update_rate=cfg.moe_bias_update_rate) if cfg.n_experts
                    else SwiGLU(cfg.n_embd, cfg.d_ff))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


class MiniGPT(nn.Module):
    def __init__(self, cfg: MiniGPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.checkpoint_every = 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual-writing projections scaled by 1/sqrt(2·n_layer)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)        # RMSNorm gains
            elif name.endswith(("o_proj.weight", "down_proj.weight", "w_down")):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, T] token ids -> logits [B, T, vocab_size]."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.is_floating_point() \
                or idx.is_complex() or idx.dtype == torch.bool:
            raise ValueError(f"idx must be an integer tensor [batch, seq], got "
                             f"{getattr(idx, 'dtype', type(idx).__name__)} "
                             f"{tuple(getattr(idx, 'shape', ()))}")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        V = self.config.vocab_size
        if idx.numel() and not ((idx >= 0) & (idx < V)).all():     # one host sync
            raise ValueError(f"idx must hold token ids in 0..{V - 1} (vocab_size={V}), got "
                             f"{int(idx.min())}..{int(idx.max())}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)                          # [B, T, C]
        n = self.checkpoint_every if torch.is_grad_enabled() else 0
        if n:
            for i in range(0, len(self.blocks), n):
                # Autograd keeps only this segment's input x [B, T, C]; the activations of
                # its n blocks are recomputed in backward (dropout masks replayed from the
                # stashed RNG state), so gradients are unchanged.
                x = checkpoint(_run_blocks, self.blocks[i:i + n], x, use_reentrant=False)
        else:
            x = _run_blocks(self.blocks, x)
        return self.lm_head(self.norm(x))

    def set_gradient_checkpointing(self, every: int) -> None:
        """Recompute blocks in backward, in segments of `every` blocks; 0 turns it off.

        The training loop's `checkpoint_every` calls this. It applies only when gradients
        are enabled, so no_grad evaluation runs the plain forward.
        """
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every must be an int >= 0 (0 = off), got {every!r}")
        self.checkpoint_every = every

    def set_moe_backend(self, backend: str) -> None:
        """Run every MoE MLP on `backend` ("torch" | "triton") from now on, and record it in
        the config (a checkpoint saved after this keeps it). A dense model only records it."""
        if backend not in MOE_BACKENDS:
            raise ValueError(f"backend must be one of {MOE_BACKENDS}, got {backend!r}")
        self.config.moe_backend = backend
        for m in self.modules():
            if isinstance(m, MoEMLP):
                m.backend = backend

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE load-balancing losses of the last forward (0 for a dense model)."""
        losses = [b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoEMLP)]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
