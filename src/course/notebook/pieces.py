"""The pieces a learner builds that the packages can run on (`mine.use("mine")`).

Each piece names its lab, the visible tests that must have passed, and the package function
it stands in for. `ADAPTERS[target]` turns the learner's functions (their own signatures, as
the labs define them) into that function's signature; the package's own argument checks run
first, so a learner's piece sees only inputs the reference accepts, and every case a piece
does not cover (dropout masks, bitsandbytes' nested rounding, the torch backend) goes to the
reference. Two pieces share `parallel_linear`: Lab 09's without LoRA, Lab 10's with it.
An adapter calls `ran(piece name)` each time it hands a call to the learner's code, so that
`use` can say which pieces ran and how often.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    name: str                  # what the learner wrote, as `use` prints it
    lab: str
    tests: tuple[str, ...]     # visible tests of `lab` that must pass
    target: str                # "module:function" the piece stands in for
    uses: tuple[str, ...]      # the learner's definitions its adapter calls


PIECES = (
    Piece("NF4 quantize (nf4_indices, pack_nibbles, double_quantize_absmax)", "02-nf4",
          ("test_nf4_indices_match_bnb", "test_nf4_indices_rules", "test_nibbles",
           "test_double_quantize_absmax"), "miniquant.nf4:quantize_nf4",
          ("nf4_indices", "pack_nibbles", "double_quantize_absmax")),
    Piece("NF4 dequantize (unpack_nibbles, nf4_dequantize)", "02-nf4",
          ("test_nibbles", "test_nf4_dequantize"), "miniquant.nf4:dequantize_nf4",
          ("unpack_nibbles", "nf4_dequantize")),
    Piece("NF4 expert dequantize, CPU path (nf4_dequantize per active expert)", "02-nf4",
          ("test_nibbles", "test_nf4_dequantize"),
          "miniquant.triton_dequant:selective_dequantize_nf4_torch",
          ("unpack_nibbles", "nf4_dequantize")),
    Piece("NF4 dequant kernel (my_dequantize_nf4)", "03-triton-dequant",
          ("test_nf4_dequant_kernel", "test_my_dequantize_nf4"),
          "miniquant.triton_dequant:triton_dequantize_nf4", ("my_dequantize_nf4",)),
    Piece("selective dequant kernel (my_selective_dequantize)", "03-triton-dequant",
          ("test_selective_dequantize", "test_selective_bad_inputs"),
          "miniquant.triton_dequant:selective_dequantize_nf4", ("my_selective_dequantize",)),
    Piece("LoRA matmul, decomposed backward (LoRAMatmul)", "04-lora",
          ("test_lora_forward", "test_lora_backward", "test_lora_backward_memory"),
          "minituner.lora:lora_linear", ("LoRAMatmul",)),
    Piece("scatter2scatter kernel (my_scatter2scatter)", "08-moe-forward-kernel",
          ("test_scatter2scatter_kernel", "test_scatter2scatter_grouped",
           "test_launcher_checks"), "minimoe.ops:scatter2scatter", ("my_scatter2scatter",)),
    Piece("expert linear fwd+bwd kernels (my_parallel_linear)", "09-moe-backward-kernels",
          ("test_grouped_dy", "test_input_grad", "test_parallel_linear", "test_moe_step"),
          "minimoe.parallel_experts:parallel_linear", ("my_parallel_linear",)),
    Piece("expert LoRA fwd+bwd kernels (my_lora_parallel_linear)", "10-moe-lora",
          ("test_my_scatter2scatter_lora", "test_my_group_bwd_lora",
           "test_my_group_bwd_lora_launches", "test_lora_parallel_linear"),
          "minimoe.parallel_experts:parallel_linear", ("my_lora_parallel_linear",)),
)


def resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------- adapters
# Each takes (reference, {piece name: the learner's loaded module}, ran) and returns the
# stand-in, which calls ran(piece name) just before it runs the learner's code.


def _only(mods: dict) -> tuple[str, object]:
    """(piece name, module) of an adapter that stands for one piece."""
    ((name, module),) = mods.items()
    return name, module


def _quantize_nf4(ref, mods, ran):
    from miniquant.intquant import check_weight
    from miniquant.nf4 import NESTED_BLOCKSIZE, NF4Config, NF4Weight, check_blocksize

    piece, m = _only(mods)

    def quantize_nf4(w, blocksize=NF4Config.blocksize, double_quant=False,
                     nested_rounding=NF4Config.nested_rounding):
        if nested_rounding != "nearest":          # bitsandbytes' CPU rounding: not a lab's
            return ref(w, blocksize, double_quant, nested_rounding)
        check_weight(w, "w")
        check_blocksize(blocksize)
        ran(piece)
        idx, absmax = m.nf4_indices(w, blocksize)
        packed = m.pack_nibbles(idx.reshape(-1).to(torch.uint8))
        absmax = absmax.reshape(-1).float()
        if not double_quant:
            return NF4Weight(packed, w.shape, w.dtype, blocksize, block_absmax=absmax)
        codes, scales, offset = m.double_quantize_absmax(absmax, NESTED_BLOCKSIZE)
        return NF4Weight(packed, w.shape, w.dtype, blocksize, absmax_codes=codes,
                         absmax_scales=scales, absmax_offset=offset)
    return quantize_nf4


def _dequantize_nf4(ref, mods, ran):
    from miniquant.nf4 import check_float_dtype

    piece, m = _only(mods)

    def dequantize_nf4(q, dtype=None):
        check_float_dtype("dtype", dtype)
        ran(piece)
        idx = m.unpack_nibbles(q.packed, q.numel)
        return m.nf4_dequantize(idx, q.absmax, q.blocksize, q.shape, dtype or q.dtype)
    return dequantize_nf4


def _selective_torch(ref, mods, ran):
    from miniquant.triton_dequant import _check_selective

    piece, m = _only(mods)

    def selective_dequantize_nf4_torch(q_experts, active, dtype=None):
        dtype, numel = _check_selective(q_experts, active, dtype, kernel=False)
        ran(piece)
        E, d_out, d_in = q_experts.shape
        packed = q_experts.packed.view(E, numel // 2)
        absmax = q_experts.absmax.view(E, numel // q_experts.blocksize)
        rows = [m.nf4_dequantize(m.unpack_nibbles(packed[e], numel), absmax[e],
                                 q_experts.blocksize, (d_out, d_in), torch.float32)
                for e in active.tolist()]                            # host ids: a CPU path
        out = torch.stack(rows) if rows else torch.empty(0, d_out, d_in)
        return out.to(dtype)
    return selective_dequantize_nf4_torch


def _triton_dequantize(ref, mods, ran):
    piece, m = _only(mods)

    def triton_dequantize_nf4(q, dtype=None):
        ref_dtype = ref.__globals__["_check_weight"](q, "q", dtype)
        ran(piece)
        return m.my_dequantize_nf4(q).to(ref_dtype)
    return triton_dequantize_nf4


def _selective_kernel(ref, mods, ran):
    piece, m = _only(mods)

    def selective_dequantize_nf4(q_experts, active, dtype=None):
        dtype, _ = ref.__globals__["_check_selective"](q_experts, active, dtype, kernel=True)
        ran(piece)
        return m.my_selective_dequantize(q_experts, active).to(dtype)
    return selective_dequantize_nf4


def _lora_linear(ref, mods, ran):
    piece, m = _only(mods)

    def lora_linear(x, lora_A, lora_B, weight, scaling, mask=None):
        if mask is not None:                      # LoRA dropout: the lab's Function has none
            return ref(x, lora_A, lora_B, weight, scaling, mask)
        W = weight() if callable(weight) else weight
        ran(piece)
        return m.LoRAMatmul.apply(x, lora_A, lora_B, W, scaling)
    return lora_linear


def _scatter2scatter(ref, mods, ran):
    piece, m = _only(mods)

    def scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k, x_grouped=False,
                        y_grouped=False, *, trusted=False, routing=None):
        ran(piece)
        return m.my_scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k,
                                    x_grouped=x_grouped, y_grouped=y_grouped)
    return scatter2scatter


def _parallel_linear(ref, mods, ran):
    from minimoe import Routing

    plain = next(((name, m.my_parallel_linear) for name, m in mods.items()
                  if "LoRA" not in name), None)
    lora = next(((name, m.my_lora_parallel_linear) for name, m in mods.items()
                 if "LoRA" in name), None)

    def parallel_linear(x, W, routing, *args, **kw):
        # The packages call it with a Routing and keywords; anything else (the index form,
        # gates that do not fit, whose error the reference raises) goes to the reference.
        A, B, scaling = kw.get("lora") or (None, None, 1.0)
        chosen = plain if A is None else lora
        gates = kw.get("gates")
        if (args or not isinstance(routing, Routing) or chosen is None
                or kw.get("backend", "triton") != "triton"
                or kw.get("lora_path", "fused") != "fused"
                or (gates is not None and gates.shape[-1] != routing.k)):
            return ref(x, W, routing, *args, **kw)
        piece, fn = chosen
        ran(piece)
        extra = () if A is None else (A, B, scaling)
        return fn(x, W, routing.k, *routing, *extra, gates=gates,
                  grouped_in=kw.get("grouped_in", False), grouped_out=kw.get("grouped_out", False))
    return parallel_linear


ADAPTERS: dict[str, Callable] = {
    "miniquant.nf4:quantize_nf4": _quantize_nf4,
    "miniquant.nf4:dequantize_nf4": _dequantize_nf4,
    "miniquant.triton_dequant:selective_dequantize_nf4_torch": _selective_torch,
    "miniquant.triton_dequant:triton_dequantize_nf4": _triton_dequantize,
    "miniquant.triton_dequant:selective_dequantize_nf4": _selective_kernel,
    "minituner.lora:lora_linear": _lora_linear,
    "minimoe.ops:scatter2scatter": _scatter2scatter,
    "minimoe.parallel_experts:parallel_linear": _parallel_linear,
}
