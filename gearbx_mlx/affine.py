"""MLX's affine group quantization, as the gears use it.

MLX quantizes a weight matrix ``(out, in)`` in groups of ``group_size``
consecutive inputs: ``w ≈ scale * q + bias`` with ``q`` an unsigned
``bits``-bit code and one float scale and bias per group. This module holds
the round trip (the values a ``QuantizedLinear`` multiplies by) and the cost
of the format in bytes, so that every consumer (the evaluation's variants,
analysis drafters, the nested planes) agrees on both.
"""

from __future__ import annotations

import mlx.core as mx


def fake_quantize(weight: mx.array, bits: int, group_size: int) -> mx.array:
    """MLX affine quantization round trip, in the weight's dtype.

    Args:
        weight: ``(out, in)`` with ``in`` a multiple of ``group_size``.

    Returns:
        ``(out, in)``: exactly the values a ``QuantizedLinear`` of this
        format multiplies by (the product itself may round differently).
    """
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(weight.dtype)


def bytes_per_weight(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Bytes one weight costs in MLX's format: its code plus its share of a
    scale and a bias (``scale_bytes`` each, 2 for float16/bfloat16)."""
    return bits / 8 + 2 * scale_bytes / group_size
