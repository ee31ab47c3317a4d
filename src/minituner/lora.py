"""LoRALinear: a frozen linear layer plus a trainable low-rank update, with a decomposed backward.

y = base(x) + s · dropout(x) · Aᵀ · Bᵀ with A [r, in], B [out, r] and s = alpha / r
(alpha / √r with rsLoRA). The base is an `nn.Linear` (its parameters are frozen) or a
miniquant `QuantizedLinear` (NF4 buffers, frozen by construction), so QLoRA is this same class
over a quantized base.

The product B·A is an [out, in] matrix, as large as the weight it adapts. Written naively,
y = x · (W + s·B·A)ᵀ builds it in the forward and again (as its gradient) in the backward. The
autograd Function here keeps the LoRA path at rank size: x·Aᵀ is [T, r], dY·B is [T, r], and
dA, dB come from those, so no [out, in] tensor is ever produced for the adapter. Only
`delta_weight()` (for merging and inspection) materialises s·B·A.

Initialisation and scaling follow Hugging Face PEFT (A kaiming-uniform with a=√5, B zeros, so
a fresh adapter leaves the model unchanged), and the weights load into PEFT one-to-one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
import torch.nn as nn

from minimoe import lora_scaling
from miniquant import QuantizedLinear


class _LoRALinearFunction(torch.autograd.Function):
    """y = x · Wᵀ + s · ((x ⊙ m) · Aᵀ) · Bᵀ for x [T, in], with a rank-sized backward.

    `weight` is the frozen base weight W [out, in], either as a tensor or as a zero-argument
    callable that produces it (a quantized base dequantizes on demand). `mask` is the dropout
    mask [T, in] already scaled by 1/(1-p), or None for no dropout. W gets no gradient.
    All tensors share one dtype; the caller casts.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                weight: torch.Tensor | Callable[[], torch.Tensor], scaling: float,
                mask: torch.Tensor | None) -> torch.Tensor:
        w = weight() if callable(weight) else weight
        x_d = x if mask is None else x * mask
        xa = x_d @ lora_A.t()                                   # [T, r]
        y = x @ w.t() + scaling * (xa @ lora_B.t())             # [T, out]
        # A quantized base is not saved: its dequantized [out, in] weight would be held in
        # float for the whole backward pass, which is the memory QLoRA exists to avoid. The
        # callable dequantizes it again in backward instead.
        ctx.weight_fn = weight if callable(weight) else None
        ctx.scaling = scaling
        ctx.has_mask = mask is not None
        saved_w = None if callable(weight) else weight
        ctx.save_for_backward(x_d, xa, lora_A, lora_B, saved_w, mask)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_d, xa, lora_A, lora_B, saved_w, mask = ctx.saved_tensors
        s = ctx.scaling
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        dx = dA = dB = None
        if need_x or need_A:
            dy_b = dy @ lora_B                                  # [T, r]
        if need_x:
            w = ctx.weight_fn() if ctx.weight_fn is not None else saved_w
            d_lora = s * (dy_b @ lora_A)                        # [T, in]
            if ctx.has_mask:
                d_lora = d_lora * mask
            dx = dy @ w + d_lora                                # [T, in]
        if need_A:
            dA = s * (dy_b.t() @ x_d)                           # [r, in]
        if need_B:
            dB = s * (dy.t() @ xa)                              # [out, r]
        return dx, dA, dB, None, None, None


def lora_linear(x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                weight: torch.Tensor | Callable[[], torch.Tensor], scaling: float,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """The decomposed LoRA matmul (no bias) for x [T, in]; see `_LoRALinearFunction`."""
    return _LoRALinearFunction.apply(x, lora_A, lora_B, weight, scaling, mask)


def check_lora_args(r, alpha, dropout, names: tuple[str, str, str] = ("r", "alpha", "dropout")
                    ) -> None:
    """Raise ValueError unless r is a positive int, alpha a finite real > 0 and dropout in
    [0, 1); `names` are the arguments' names in the message (an adapter config's keys)."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"{names[0]} must be a positive int, got {r!r}")
    if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
            or not (math.isfinite(alpha) and alpha > 0)):
        raise ValueError(f"{names[1]} must be > 0 and finite, got {alpha!r}")
    if (isinstance(dropout, bool) or not isinstance(dropout, numbers.Real)
            or not 0.0 <= dropout < 1.0):
        raise ValueError(f"{names[2]} must be in [0, 1), got {dropout!r}")


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` or `QuantizedLinear` plus a trainable rank-`r` update s·B·A.

    Inputs are [..., in]; outputs [..., out] in the base's compute dtype (the weight dtype of
    an `nn.Linear`; `compute_dtype`, else the input dtype, of a `QuantizedLinear`). The LoRA
    parameters keep their own dtype (float32; a model-wide `.to(dtype)` casts them too, as in
    PEFT) and are cast for the matmul, so their gradients
    and optimizer state stay float32 over a low-precision base.

    `dropout` drops x on the LoRA path only, in training mode only (as PEFT). After `merge()`
    (float base only) the forward is the base layer alone and the adapter gets no gradient.
    """

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 use_rslora: bool = False):
        super().__init__()
        if isinstance(base, LoRALinear):
            raise ValueError("base is already wrapped in a LoRALinear; wrap its .base instead")
        if not isinstance(base, nn.Linear | QuantizedLinear):
            raise ValueError(f"base must be an nn.Linear or a miniquant QuantizedLinear, got "
                             f"{type(base).__name__}")
        check_lora_args(r, alpha, dropout)
        if isinstance(base, nn.Linear):
            base.requires_grad_(False)
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.use_rslora = r, float(alpha), use_rslora
        self.scaling = lora_scaling(self.alpha, r, use_rslora)
        # Identity when dropout is 0, so the forward can skip drawing a mask (as PEFT).
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base.weight.device if isinstance(base, nn.Linear) else next(base.buffers()).device
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=device))
        # Same init as nn.Linear(in, r).weight, which is what PEFT's lora_A is.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.merged = False
        self.train(base.training)     # a layer wrapped in a model in eval() stays in eval()

    @property
    def is_quantized(self) -> bool:
        return isinstance(self.base, QuantizedLinear)

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.is_quantized:
            return self.base.compute_dtype or x.dtype
        return self.base.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base(x)
        dtype = self._compute_dtype(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(dtype)          # [T, in]
        mask = None
        if self.training and isinstance(self.dropout, nn.Dropout):
            # dropout(ones) is the scaled keep-mask; x ⊙ mask equals dropout(x) for the same
            # RNG state. The Function needs the mask itself to route dX through it.
            mask = self.dropout(torch.ones_like(x2))
        if self.is_quantized:
            base = self.base

            def weight() -> torch.Tensor:
                return base.dequantized_weight(dtype)

            bias = base.bias
        else:
            weight, bias = self.base.weight, self.base.bias
        y = lora_linear(x2, self.lora_A.to(dtype), self.lora_B.to(dtype), weight,
                        self.scaling, mask)
        if bias is not None:
            y = y + bias.to(dtype)
        return y.reshape(*lead, self.out_features)

    def delta_weight(self) -> torch.Tensor:
        """s · B · A, [out, in] float32: the update `merge()` adds to the base weight."""
        return self.scaling * (self.lora_B @ self.lora_A)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold s·B·A into a float base weight in place; a no-op if already merged."""
        if self.is_quantized:
            raise ValueError(
                "cannot merge into a QuantizedLinear: the merged weight would have to be "
                "re-quantized to NF4, rounding it again and losing most of the small LoRA "
                "update; use merge_and_dequantize() to get a float nn.Linear instead")
        if self.merged:
            return
        w = self.base.weight
        w.add_(self.delta_weight().to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract s·B·A from the base weight again; a no-op if not merged."""
        if not self.merged:
            return
        w = self.base.weight
        w.sub_(self.delta_weight().to(w.dtype))
        self.merged = False

    @torch.no_grad()
    def merge_and_dequantize(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """A new float `nn.Linear` with weight dequant(W) + s·B·A (and the base bias).

        Works for either base; for an `nn.Linear` base the unmerged weight is used.
        """
        if self.is_quantized:
            w = self.base.dequantized_weight(torch.float32)
            bias = self.base.bias
        else:
            w = self.base.weight.float()
            if self.merged:
                w = w - self.delta_weight()
            bias = self.base.bias
        out = nn.Linear(self.in_features, self.out_features, bias=bias is not None,
                        device=w.device, dtype=dtype)
        out.weight.copy_(w + self.delta_weight())
        if bias is not None:
            out.bias.copy_(bias)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"alpha={self.alpha}, scaling={self.scaling:.4g}, rslora={self.use_rslora}, "
                f"merged={self.merged}")


__all__ = ["LoRALinear", "lora_linear"]
