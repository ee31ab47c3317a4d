"""miniquant: 4-bit NF4 quantization, bit-for-bit with bitsandbytes (Labs 01–03).

Absmax int8 and symmetric per-group quantization (intquant), NF4 with double quantization
(nf4, on the 8-bit dynamic map of dynamic), and conversion to and from bitsandbytes (bnb;
bitsandbytes itself is imported only when those two functions are called), QuantizedLinear
and quantize_model (linear), and the Triton dequantization kernels, whole or per expert
(triton_dequant). See BLUEPRINT.md.

`import miniquant` leaves the environment alone and needs no triton (which has wheels for
Linux only): the Triton names are loaded on first use (module `__getattr__`), and their
kernel at its first launch, when `miniquant.triton_env` imports triton, choosing Triton's
interpreter on a machine without CUDA (the one place that sets `TRITON_INTERPRET`). Without
triton the names still resolve (a lab may switch them off by name); a launch raises
`TritonUnavailableError`.
"""

from .bnb import from_bnb, to_bnb
from .dynamic import DYNAMIC_CODE, dequantize_blockwise_8bit, dynamic_map, quantize_blockwise_8bit
from .intquant import (
    dequantize_absmax_int8,
    dequantize_symmetric_per_group,
    quantize_absmax_int8,
    quantize_symmetric_per_group,
)
from .linear import QuantizedLinear, quantize_model
from .nf4 import (
    NF4_CODE,
    NF4Config,
    NF4Weight,
    dequantize_nf4,
    nf4_bytes,
    nf4_codebook,
    quantize_nf4,
)
from .triton_env import lazy_names

# Loaded on first access: the Triton launchers (their kernel loads at the first launch).
_TRITON_NAMES = {"selective_dequantize_nf4": "triton_dequant",
                 "triton_dequantize_nf4": "triton_dequant"}
__getattr__ = lazy_names(__name__, _TRITON_NAMES)


# Lab -> {public name: dotted path} of what the lab rebuilds (docs/ARCHITECTURE.md, Lab sources).
REFERENCE = {
    "01-quant-basics": {
        "quantize_absmax_int8": "miniquant.intquant.quantize_absmax_int8",
        "dequantize_absmax_int8": "miniquant.intquant.dequantize_absmax_int8",
        "quantize_symmetric_per_group": "miniquant.intquant.quantize_symmetric_per_group",
        "dequantize_symmetric_per_group": "miniquant.intquant.dequantize_symmetric_per_group",
        "round_to_grid": "miniquant.intquant.round_to_grid",
    },
    "02-nf4": {
        "nf4_codebook": "miniquant.nf4.nf4_codebook",
        "quantize_nf4": "miniquant.nf4.quantize_nf4",
        "quantize_codes": "miniquant.nf4._quantize_codes",
        "scale_blocks": "miniquant.dynamic.scale_blocks",
        "nearest_code": "miniquant.dynamic.nearest_code",
        "nearest_code_in_cells": "miniquant.dynamic.nearest_code_in_cells",
        "quantize_blockwise_8bit": "miniquant.dynamic.quantize_blockwise_8bit",
        "pack_nibbles": "miniquant.nf4.pack_nibbles",
        "unpack_nibbles": "miniquant.nf4.unpack_nibbles",
        "NF4Weight.codes": "miniquant.nf4.NF4Weight.codes",
        "dequantize_nf4": "miniquant.nf4.dequantize_nf4",
        "dequantize_span": "miniquant.nf4._dequantize_span",
        "NF4Weight.dequantize": "miniquant.nf4.NF4Weight.dequantize",
        "nf4_bytes": "miniquant.nf4.nf4_bytes",
    },
    "03-triton-dequant": {
        "dequantize_nf4": "miniquant.nf4.dequantize_nf4",
        "triton_dequantize_nf4": "miniquant.triton_dequant.triton_dequantize_nf4",
        "selective_dequantize_nf4": "miniquant.triton_dequant.selective_dequantize_nf4",
        "active_scales": "miniquant.triton_dequant._active_scales",
        "unpack_nibbles": "miniquant.nf4.unpack_nibbles",
        "NF4Weight.dequantize": "miniquant.nf4.NF4Weight.dequantize",
        "NF4Weight.codes": "miniquant.nf4.NF4Weight.codes",
        "dequant_launch": "miniquant.triton_dequant._launch",
        "nf4_dequant_kernel": "miniquant.dequant_kernel._nf4_dequant_kernel",
    },
    "06-qlora-preview": {"nf4_bytes": "miniquant.nf4.nf4_bytes"},
    "10-moe-lora": {
        "dequantize_nf4": "miniquant.nf4.dequantize_nf4",
        "triton_dequantize_nf4": "miniquant.triton_dequant.triton_dequantize_nf4",
        "NF4Weight.dequantize": "miniquant.nf4.NF4Weight.dequantize",
    },
}

__all__ = ["REFERENCE", "DYNAMIC_CODE", "NF4_CODE", "NF4Weight", "dequantize_absmax_int8",
           "dequantize_blockwise_8bit", "dequantize_nf4", "dequantize_symmetric_per_group",
           "dynamic_map", "from_bnb", "nf4_bytes", "nf4_codebook", "quantize_absmax_int8",
           "quantize_blockwise_8bit", "quantize_nf4", "quantize_symmetric_per_group", "to_bnb"]
__all__ += ["NF4Config", "QuantizedLinear", "quantize_model", "selective_dequantize_nf4",
            "triton_dequantize_nf4"]
