"""miniquant: 4-bit NF4 quantization, bit-for-bit with bitsandbytes (Labs 01–03).

The package is importable from the start so that the course installs as one piece; its
contents (absmax int8, per-group symmetric, NF4 with double quantization, QuantizedLinear,
Triton dequantization) arrive with Labs 01–03. See BLUEPRINT.md for the plan.
"""

__all__: list[str] = []
