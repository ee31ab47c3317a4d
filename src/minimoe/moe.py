"""The MoE MLP: a router picks k of E SwiGLU experts per token and mixes their outputs.

Expert weights are stored stacked, in the [E, K, N] (in, out) layout the dispatch kernels
use: expert e computes  y = (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e].
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from miniquant.nf4 import FROM_CONFIG, NF4Config

from .experts import ExpertLinear
from .nf4_experts import NF4Experts
from .parallel_experts import parallel_linear
from .routers import BIASED, check_router, load_balancing_loss, route, update_selection_bias
from .routing import flatten_sort_count

BACKENDS = ("torch", "triton")
PROJECTIONS = ("w_gate", "w_up", "w_down")


def expert_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens: x [n, C], w_gate/w_up [C, F], w_down [F, C] -> [n, C]."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def dispatch_torch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
                   ) -> torch.Tensor:
    """Plain PyTorch dispatch: for each expert, gather its tokens, run it, scatter-add back.

    x [T, C]; weights, experts [T, k]; returns [T, C]. Experts with no tokens are skipped.
    """
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        y = expert_swiglu(x[token], w_gate[e], w_up[e], w_down[e])
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


def _expert_linear(w, x, routing, backend, gates=None, grouped_in=False, grouped_out=False
                   ) -> torch.Tensor:
    """A stacked weight [E, K, N] through `parallel_linear`, or an expert module (ExpertLinear,
    NF4Experts: frozen base + expert LoRA) through its own forward: one call convention."""
    if isinstance(w, torch.Tensor):
        return parallel_linear(x, w, routing, gates=gates, grouped_in=grouped_in,
                               grouped_out=grouped_out, backend=backend)
    return w(x, routing, gates=gates, grouped_in=grouped_in, grouped_out=grouped_out,
             backend=backend)


def dispatch_triton(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    w_gate, w_up, w_down, backend: str = "triton") -> torch.Tensor:
    """ScatterMoE dispatch: sort the slots once, three expert linears over sorted rows.

    x [T, C]; weights, experts [T, k]; returns [T, C]. Same math as `dispatch_torch`. Each
    w_* is a stacked weight (w_gate/w_up [E, C, F], w_down [E, F, C]) or an expert module
    (`ExpertLinear`, `NF4Experts`) of that shape; `backend="torch"` runs the same sorted
    order in PyTorch. The Routing is made and checked once (one host sync) for all three.
    """
    n_experts = w_gate.shape[0] if isinstance(w_gate, torch.Tensor) else w_gate.n_experts
    routing = flatten_sort_count(experts, n_experts)
    g = _expert_linear(w_gate, x, routing, backend, grouped_out=True)    # [T·k, F] sorted
    u = _expert_linear(w_up, x, routing, backend, grouped_out=True)      # [T·k, F] sorted
    h = F.silu(g) * u                                                    # [T·k, F] sorted
    # Down projection from sorted rows back to tokens, the k outputs mixed by the gates.
    return _expert_linear(w_down, h, routing, backend, gates=weights, grouped_in=True)  # [T, C]


EXPERT_KINDS = ("float", "lora", "nf4_lora")


def saved_per_token(d_model: int, d_ff: int, n_experts: int, top_k: int, experts: str,
                    r: int = 8) -> tuple[int, int]:
    """(floats, int64s) per token that one MoEMLP (no shared expert) keeps for backward: its own
    account of what its forward saves (tests hold it to a saved-tensor hook; minituner.memory
    builds its predictions on it).

    Routing (the default softmax router), for every kind of experts: two [E] softmaxes (router
    and balancing loss), the [E] top-k sort indices, the k picked weights and, renormalised
    (k > 1), their sum.
    - "float" (PyTorch dispatch, trained experts): per slot, the gathered input, gate, up,
      SiLU, product, down output and gated output (3·d_model + 4·d_ff), its gate, and its
      (token, slot) pair.
    - "lora" (sorted path, frozen float base + expert LoRA): the k gates (k > 1), the gathered
      inputs of the gate and up adapters (2·d_model), x·Aᵀ of the three (3r), gate, up, SiLU,
      product (4·d_ff), the down output kept by the k-way mix (d_model), and int64 row indices
      (4 token gathers, 2 inverse permutations).
    - "nf4_lora": each NF4 expert linear keeps only its inputs (nf4_experts.py: it dequantizes
      again in the backward, its LoRA term checkpointed): the k gates (k > 1), the MLP input
      (d_model, once), gate, up, SiLU, product (4·d_ff), the slot order and the three compact
      expert ids; nothing of size K·N.
    """
    if experts not in EXPERT_KINDS:
        raise ValueError(f"experts must be one of {EXPERT_KINDS}, got {experts!r}")
    d, f, E, k = d_model, d_ff, n_experts, top_k
    routing = 2 * E + k + (k > 1)
    if experts == "float":
        return routing + k * (3 * d + 4 * f + 1), E + 2 * k
    gates = k if k > 1 else 0
    if experts == "lora":
        return routing + gates + k * (3 * d + 4 * f + 3 * r), E + 6 * k
    return routing + gates + d + 4 * k * f, E + 4 * k


class MoEMLP(nn.Module):
    """Top-k routed SwiGLU experts. After each forward, `aux_loss` holds the balancing loss.

    renormalize: rescale each token's k weights to sum to 1. None (the default)
    does so for k > 1 and not for k = 1 (Switch); True is Mixtral (k = 1 too: the weight is
    then exactly 1), False is OLMoE and Qwen-MoE (`norm_topk_prob=False`).
    shared_d_ff > 0 adds a shared expert: a dense SwiGLU of that width on every token, added
    to the routed output, scaled by sigmoid(x @ shared_gate) (Qwen2-MoE) or, with
    shared_gated=False, not scaled (DeepSeek-V2/V3's shared experts).
    backend: "torch" or "triton"; the one place it lives — passed at call time to
    `dispatch_triton` and through it to any expert modules.

    The router (`routers.route`): method "softmax_topk" (the default), "sigmoid_topk" or
    "group_topk", with n_group, topk_group, group_score, scoring and routed_scaling_factor as
    `route` takes them. The sigmoid and group routers hold a selection bias `router_bias` [E]
    (a float32 buffer, in the state dict; softmax MLPs have none, so their state dicts are
    those of before). Training forwards (`self.training`, gradients enabled) add each
    expert's routed slots to `expert_counts` [E] (int64, not saved); `update_router_bias()`
    applies DeepSeek-V3's auxiliary-loss-free step at bias_update_rate to those counts and
    zeroes them. Gradient checkpointing runs a forward twice and doubles every count, which
    leaves the step (the sign of mean − count) unchanged.

    `aux_loss` is `load_balancing_loss` with P_i from the router's own scores: softmax for
    softmax_topk and softmax-scored group_topk, normalised sigmoid scores s_i / Σ_j s_j for
    the sigmoid routers (DeepSeek-V3's complementary balance loss).

    `attach_expert_lora` turns w_gate / w_up / w_down into expert modules (a frozen float or
    NF4 base plus per-expert LoRA); the routing and the forward stay the same."""

    # PEFT reads this when it puts LoRA on a 3-D parameter (`target_parameters`): the stacked
    # weights here are [E, in, out], not the [E, out, in] of nn.Linear it assumes otherwise.
    is_transposed = True

    def __init__(self, n_embd: int, d_ff: int, n_experts: int, top_k: int,
                 backend: str = "torch", renormalize: bool | None = None,
                 shared_d_ff: int = 0, *, method: str = "softmax_topk",
                 n_group: int | None = None, topk_group: int | None = None,
                 group_score: str = "top2_sum", scoring: str = "sigmoid",
                 routed_scaling_factor: float = 1.0, bias_update_rate: float = 0.0,
                 shared_gated: bool = True):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in 1..n_experts={n_experts}, got {top_k}")
        if renormalize is not None and not isinstance(renormalize, bool):
            raise ValueError(f"renormalize must be None, True or False, got {renormalize!r}")
        if isinstance(shared_d_ff, bool) or not isinstance(shared_d_ff, int) or shared_d_ff < 0:
            raise ValueError(f"shared_d_ff must be an int >= 0 (0 = no shared expert), "
                             f"got {shared_d_ff!r}")
        if not isinstance(shared_gated, bool):
            raise ValueError(f"shared_gated must be True or False, got {shared_gated!r}")
        check_router(method, n_experts, top_k, n_group=n_group, topk_group=topk_group,
                     routed_scaling_factor=routed_scaling_factor, group_score=group_score,
                     scoring=scoring)
        check_bias_update_rate(bias_update_rate, method)
        self.n_experts, self.top_k, self.backend = n_experts, top_k, backend
        self.renormalize = renormalize
        self.method, self.n_group, self.topk_group = method, n_group, topk_group
        self.group_score, self.scoring = group_score, scoring
        self.routed_scaling_factor = routed_scaling_factor
        self.bias_update_rate = bias_update_rate
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(n_experts, n_embd, d_ff))   # [E, C, F]
        self.w_up = nn.Parameter(torch.empty(n_experts, n_embd, d_ff))     # [E, C, F]
        self.w_down = nn.Parameter(torch.empty(n_experts, d_ff, n_embd))   # [E, F, C]
        self.shared_d_ff, self.shared_gated = shared_d_ff, shared_gated and bool(shared_d_ff)
        if shared_d_ff:
            self.shared_w_gate = nn.Parameter(torch.empty(n_embd, shared_d_ff))   # [C, Fs]
            self.shared_w_up = nn.Parameter(torch.empty(n_embd, shared_d_ff))     # [C, Fs]
            self.shared_w_down = nn.Parameter(torch.empty(shared_d_ff, n_embd))   # [Fs, C]
            if shared_gated:
                self.shared_gate = nn.Parameter(torch.empty(n_embd, 1))           # [C, 1]
        if method in BIASED:
            self.register_buffer("router_bias", torch.zeros(n_experts))            # [E] f32
            self.register_buffer("expert_counts", torch.zeros(n_experts, dtype=torch.long),
                                 persistent=False)                                 # [E]
        self.aux_loss = torch.zeros(())
        self.last_experts: torch.Tensor | None = None  # [T, k] choices of the last forward
        self.reset_parameters()

    @property
    def has_router_bias(self) -> bool:
        """Whether this router holds a selection bias (sigmoid_topk, group_topk)."""
        return "router_bias" in self._buffers

    def _shared(self) -> tuple[nn.Parameter, ...]:
        """The shared expert's w_gate, w_up, w_down and, when gated, its gate ((), if there is
        none)."""
        if not self.shared_d_ff:
            return ()
        gate = (self.shared_gate,) if self.shared_gated else ()
        return self.shared_w_gate, self.shared_w_up, self.shared_w_down, *gate

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.router.weight, self.w_gate, self.w_up, self.w_down, *self._shared()):
            nn.init.normal_(p, std=std)
        if self.has_router_bias:
            self.router_bias.zero_()
            self.expert_counts.zero_()

    def _apply(self, fn, recurse=True):
        # The selection bias stays float32 through `.to(dtype)` / `.half()` (transformers
        # keeps DeepSeek-V3's e_score_correction_bias float32 too): bias steps of ~1e-3 on
        # scores near 1 would round away in bf16. Only its device follows `fn`.
        bias = self._buffers.get("router_bias")
        super()._apply(fn, recurse)
        if bias is not None and self.router_bias.dtype != torch.float32:
            self.router_bias = bias.to(self.router_bias.device)
        return self

    def router_weight(self) -> torch.Tensor:
        """The router's weight [E, C]. A router wrapped with LoRA (`wrap_lora(model,
        ["router"])`, a `LoRALinear`) adds its update s·B·A here: E×C is small, and the logits
        stay one float32 matmul whatever the wrapper's dtype."""
        router = self.router
        if isinstance(router, nn.Linear):
            return router.weight
        if not isinstance(getattr(router, "base", None), nn.Linear):
            raise ValueError(f"the router must be an nn.Linear or a LoRA wrapper of one, got "
                             f"{type(router).__name__}")
        if router.merged:
            return router.base.weight
        return router.base.weight + router.delta_weight()

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] float32 -> (weights, experts) [T, k] by this MLP's router."""
        # By default k=1 keeps the router's probability (Switch): renormalised it would be
        # exactly 1 and the router would learn from the balancing loss alone.
        renormalize = self.top_k > 1 if self.renormalize is None else self.renormalize
        if self.method == "softmax_topk" and self.routed_scaling_factor == 1.0:
            return route(logits, self.top_k, renormalize=renormalize)
        return route(logits, self.top_k, self.method, renormalize,
                     bias=self.router_bias if self.has_router_bias else None,
                     n_group=self.n_group, topk_group=self.topk_group,
                     routed_scaling_factor=self.routed_scaling_factor,
                     group_score=self.group_score, scoring=self.scoring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                        # [T, C]
        # Router in float32 whatever the model dtype (see routers.py).
        logits = F.linear(x.float(), self.router_weight().float())         # [T, E]
        weights, experts = self.route(logits)                               # [T, k]
        if self.method == "sigmoid_topk" or (self.method == "group_topk"
                                             and self.scoring == "sigmoid"):
            self.aux_loss = load_balancing_loss(logits, experts, scoring="sigmoid")
        else:
            self.aux_loss = load_balancing_loss(logits, experts)
        self.last_experts = experts.detach()
        if self.has_router_bias and self.training and torch.is_grad_enabled():
            flat = experts.detach().flatten()                   # scatter_add: no host sync
            self.expert_counts.scatter_add_(0, flat, torch.ones_like(flat))
        ws = (self.w_gate, self.w_up, self.w_down)
        if self.backend == "torch" and all(isinstance(w, nn.Parameter) for w in ws):
            out = dispatch_torch(x, weights, experts, *ws)
        else:       # the Triton kernels, or expert modules (LoRA, NF4) on either backend
            out = dispatch_triton(x, weights, experts, *ws, backend=self.backend)
        if self.shared_d_ff:
            w_gate, w_up, w_down = self._shared()[:3]
            shared = expert_swiglu(x, w_gate, w_up, w_down)
            out = out + (torch.sigmoid(x @ self.shared_gate) * shared if self.shared_gated
                         else shared)
        return out.reshape(shape)

    @torch.no_grad()
    def update_router_bias(self) -> None:
        """DeepSeek-V3's auxiliary-loss-free step on the counts since the last call:
        router_bias += bias_update_rate · sign(mean count − count), then the counts are zeroed.
        Nothing to do for a softmax router. Call it after each optimizer step."""
        if not self.has_router_bias:
            return
        new = update_selection_bias(self.router_bias, self.expert_counts, self.bias_update_rate)
        self.router_bias.copy_(new)
        self.expert_counts.zero_()


def check_bias_update_rate(rate: float, method: str, name: str = "bias_update_rate") -> None:
    """ValueError naming `name` unless `rate` is a number >= 0, and 0 for a router without a
    selection bias."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0 \
            or not math.isfinite(rate):
        raise ValueError(f"{name} must be a finite number >= 0, got {rate!r}")
    if rate and method not in BIASED:
        raise ValueError(f"{name} is for routers with a selection bias {BIASED}, "
                         f"not {method!r}")


def update_router_biases(model: nn.Module) -> int:
    """`MoEMLP.update_router_bias()` on every MoE MLP of `model`, to be called after each
    optimizer step; returns how many hold a selection bias."""
    mlps = [m for m in model.modules() if isinstance(m, MoEMLP) and m.has_router_bias]
    for m in mlps:
        m.update_router_bias()
    return len(mlps)


def attach_expert_lora(mlp: nn.Module, r: int = 8, alpha: float = 16.0, nf4: bool = False,
                       blocksize: int = FROM_CONFIG, double_quant: bool = FROM_CONFIG,
                       nested_rounding: str = FROM_CONFIG,
                       projections: tuple[str, ...] = PROJECTIONS, *,
                       nf4_config: NF4Config | None = None) -> list[str]:
    """Replace a MoEMLP's w_gate / w_up / w_down by expert linears with LoRA, in place.

    nf4=False: `ExpertLinear` over the same float Parameter (frozen); nf4=True: `NF4Experts`
    quantized as `nf4_config` (miniquant.NF4Config), or its fields given as keywords, says
    (checked whatever `nf4`); each expert's K·N must be whole blocks. The router
    is left as it is, and so is a shared expert. Returns the names replaced. Everything is
    built before anything is swapped in, so a bad argument leaves `mlp` untouched. The
    modules keep no backend of the MLP's: it passes its own at each call.

    `projections` names those that get LoRA (rank r); with nf4 the others are NF4 without
    LoRA, without nf4 they stay the frozen float Parameters they were.
    """
    cfg = NF4Config.of(nf4_config, blocksize=blocksize, double_quant=double_quant,
                       nested_rounding=nested_rounding)
    current = {name: getattr(mlp, name, None) for name in PROJECTIONS}
    if not all(isinstance(w, nn.Parameter) for w in current.values()):
        raise ValueError(f"mlp must be a MoEMLP with float {PROJECTIONS} parameters (not yet "
                         f"wrapped), got {[type(w).__name__ for w in current.values()]}")
    if not projections or any(p not in PROJECTIONS for p in projections):
        raise ValueError(f"projections must be a non-empty subset of {PROJECTIONS}, "
                         f"got {projections!r}")
    new = {name: (NF4Experts.from_weight(w.detach(), r=r if name in projections else 0,
                                         alpha=alpha, nf4_config=cfg)
                  if nf4 else ExpertLinear(w, r=r, alpha=alpha))
           for name, w in current.items() if nf4 or name in projections}
    for name, module in new.items():
        delattr(mlp, name)
        setattr(mlp, name, module)
    return [p for p in PROJECTIONS if p in projections]
