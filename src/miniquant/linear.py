"""QuantizedLinear: a frozen linear layer whose weight is stored in NF4.

The 4-bit codes and their scales are buffers, never parameters: they move with `.to()`,
are saved in `state_dict()`, and no optimizer can see them. Each forward dequantizes the
whole weight to the compute dtype, checks it is finite, and runs an ordinary matmul; LoRA
adapters (minituner) add the trainable part on top.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from .nf4 import FROM_CONFIG, NF4Config, NF4Weight, check_float_dtype, quantize_nf4


class NF4Buffers(nn.Module):
    """Base of modules that hold one frozen NF4Weight as buffers (QuantizedLinear, minimoe's
    NF4Experts): its tensors become buffers under their field names (saved in `state_dict`,
    moved by `.to(device)`, invisible to optimizers); the rest (shape, dtype, blocksize, ...)
    are plain attributes needed to rebuild it as `weight_nf4`.
    """

    def hold_nf4(self, weight: NF4Weight) -> None:
        self._tensor_fields, self._static_fields = [], {}
        for f in dataclasses.fields(weight):
            value = getattr(weight, f.name)
            if isinstance(value, torch.Tensor):
                self.register_buffer(f.name, value)
                self._tensor_fields.append(f.name)
            else:
                self._static_fields[f.name] = value

    def _apply(self, fn, recurse=True):
        # `.to(device)` moves the NF4 storage, but a dtype cast (`.half()`, `.to(bf16)`)
        # must not round its float32 scales: re-move the originals instead.
        originals = {name: self._buffers[name] for name in self._tensor_fields}
        super()._apply(fn, recurse)
        for name, t in originals.items():
            if self._buffers[name].dtype != t.dtype:
                self._buffers[name] = t.to(self._buffers[name].device)
        return self

    @property
    def weight_nf4(self) -> NF4Weight:
        return NF4Weight(**{name: getattr(self, name) for name in self._tensor_fields},
                         **self._static_fields)


class QuantizedLinear(NF4Buffers):
    """y = x · dequant(W)ᵀ + b with W held as NF4 (optionally double-quantized) buffers.

    `compute_dtype=None` computes in the dtype of the input, which must then be floating
    point (float16, bfloat16 or float32).
    """

    def __init__(self, weight: NF4Weight, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        check_float_dtype("compute_dtype", compute_dtype)
        if len(weight.shape) != 2:
            raise ValueError(f"weight must be a 2-D [out, in] NF4Weight, got shape "
                             f"{tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype
        self.hold_nf4(weight)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocksize: int = FROM_CONFIG,
                    double_quant: bool = FROM_CONFIG, compute_dtype: torch.dtype | None = None,
                    nested_rounding: str = FROM_CONFIG, *,
                    nf4_config: NF4Config | None = None) -> QuantizedLinear:
        """Quantize `linear.weight` to NF4 as `nf4_config` (or its fields given as keywords,
        the others at NF4Config's defaults) says; the bias (if any) is kept, frozen, as is."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        check_float_dtype("compute_dtype", compute_dtype)
        cfg = NF4Config.of(nf4_config, blocksize=blocksize, double_quant=double_quant,
                           nested_rounding=nested_rounding)
        q = quantize_nf4(linear.weight.detach(), **dataclasses.asdict(cfg))
        return cls(q, linear.bias, compute_dtype=compute_dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out, in] this layer computes with; raises if it is not finite."""
        w = self.weight_nf4.dequantize(dtype or self.compute_dtype)
        if not torch.isfinite(w).all():
            raise FloatingPointError(
                f"dequantized weight of QuantizedLinear({self.in_features}, "
                f"{self.out_features}) holds NaN or Inf: its NF4 scales are corrupt")
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"x must be a floating-point tensor [..., {self.in_features}], got "
                            f"{got} (token ids go through an embedding first)")
        w = self.dequantized_weight(self.compute_dtype or x.dtype)
        bias = None if self.bias is None else self.bias.to(w.dtype)
        return F.linear(x.to(w.dtype), w, bias)

    def extra_repr(self) -> str:
        q = self._static_fields
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nf4 blocksize={q.get('blocksize')}, compute_dtype={self.compute_dtype}")


def quantize_model(model: nn.Module, target: str, blocksize: int = FROM_CONFIG,
                   double_quant: bool = FROM_CONFIG, compute_dtype: torch.dtype | None = None,
                   nested_rounding: str = FROM_CONFIG, *,
                   nf4_config: NF4Config | None = None) -> list[str]:
    """Replace, in place, every nn.Linear whose full name matches the regex `target` by a
    QuantizedLinear (`from_linear`'s NF4 settings).

    Returns the names replaced; raises ValueError, with the model untouched, when `target` is
    not a valid regex or matches no nn.Linear, or the NF4 settings are not valid.
    """
    cfg = NF4Config.of(nf4_config, blocksize=blocksize, double_quant=double_quant,
                       nested_rounding=nested_rounding)
    pattern = compile_target("target", target)
    names = [name for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and pattern.fullmatch(name)]
    if not names:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"target {target!r} matches no nn.Linear (full match); the model's "
                         f"linear layers are e.g. {linears[:6]}")
    # Quantize every layer before replacing any, so that a bad weight leaves the model as it was.
    quantized = {name: QuantizedLinear.from_linear(model.get_submodule(name),
                                                   compute_dtype=compute_dtype, nf4_config=cfg)
                 for name in names}
    for name, layer in quantized.items():
        model.set_submodule(name, layer)
    return names


def compile_target(name: str, pattern) -> re.Pattern:
    """`pattern` compiled, or ValueError naming the argument (not a bare re.error)."""
    if not isinstance(pattern, str):
        raise ValueError(f"{name} must be a regex string, got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{name} is not a valid regular expression: {pattern!r} ({e})") from None
