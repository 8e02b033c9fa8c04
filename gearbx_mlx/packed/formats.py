"""Packed symmetric integer formats (GEARBX §5) and their pure-MLX reference.

This module is the oracle every fast kernel is checked against and the
fallback that runs wherever no kernel applies. Everything here is plain MLX
ops, lazy like any other MLX computation.

Format (shared with the C kernels of ``gearbx_mlx.bindings.cpu``; do not change it):

* Scales: per row (``group_size=None``) or per group of ``group_size``
  consecutive inputs. ``s = max|W| / qmax`` over the row or group, floored at
  ``1e-4`` for float16/bfloat16 sources and ``1e-8`` for float32 sources;
  ``q = clamp(round(W / s), -qmax, qmax)``. Every element is then within
  ``s / 2`` of its reconstruction ``q * s``. Scales are float32, shape
  ``(O, n_groups)`` (``n_groups == 1`` per row).
* Storage of the ``(O, I)`` integer matrix, row-major:

  ====  =====  =========================================================
  bits  dtype  layout of one row
  ====  =====  =========================================================
  8     int8   ``(I,)``, two's complement
  6     uint8  ``(3*I/4,)``: values ``q+32``, four in three bytes, low bits first
  4     uint8  ``(I/2,)``: values ``q+8``; element ``j`` in byte ``j//2``,
               low nibble for even ``j``
  2     uint8  ``(I/4,)``: values ``q+2``, four per byte, low bits first
  ====  =====  =========================================================

* ``y_i = sum_j q_ij * s_{i,g(j)} * x_j (+ b_i)``, accumulated in float32,
  returned in the dtype of ``x``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import mlx.core as mx

from ..mlx_tables import GROUP_SIZES as MLX_GROUP_SIZES

#: Bit widths of the packed formats.
SUPPORTED_BITS: Tuple[int, ...] = (2, 4, 6, 8)
#: Largest magnitude of a quantized value, per bit width (§5.1, Table 4).
QMAX: Dict[int, int] = {8: 127, 6: 31, 4: 7, 2: 1}
#: Offset added before packing, so stored fields are unsigned (§5.2, §16.2).
OFFSET: Dict[int, int] = {8: 0, 6: 32, 4: 8, 2: 2}
#: Inputs per packed unit (a byte, or three bytes for int6), per bit width.
ELEMENTS_PER_UNIT: Dict[int, int] = {8: 1, 6: 4, 4: 2, 2: 4}
#: Bytes per packed unit.
BYTES_PER_UNIT: Dict[int, int] = {8: 1, 6: 3, 4: 1, 2: 1}
#: Group sizes allowed besides per-row scales (``None``).
GROUP_SIZES: Tuple[int, ...] = MLX_GROUP_SIZES
#: Scale floors (§5.1, §16.2): half-precision sources, float32 sources.
SCALE_FLOOR_HALF = 1e-4
SCALE_FLOOR_FP32 = 1e-8


def check_bits(bits: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is a packed bit width."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(
            f"unsupported bit width {bits!r}: packed formats exist for {SUPPORTED_BITS}"
        )


def check_shape(in_features: int, bits: int, group_size: Optional[int]) -> None:
    """Raise ``ValueError`` if a row of ``in_features`` cannot hold this format."""
    check_bits(bits)
    per_unit = ELEMENTS_PER_UNIT[bits]
    if in_features <= 0 or in_features % per_unit:
        raise ValueError(
            f"int{bits} packs {per_unit} inputs per unit: the input size "
            f"{in_features} must be a positive multiple of {per_unit}"
        )
    if group_size is not None:
        if group_size not in GROUP_SIZES:
            raise ValueError(
                f"group_size must be None (per-row scales) or one of {GROUP_SIZES}, "
                f"got {group_size!r}"
            )
        if in_features % group_size:
            raise ValueError(
                f"the input size {in_features} is not a multiple of group_size "
                f"{group_size}: use group_size=None (per-row scales) for this layer"
            )


def scale_floor(dtype: mx.Dtype) -> float:
    """Smallest scale for weights stored in ``dtype`` (§5.1)."""
    return SCALE_FLOOR_FP32 if dtype == mx.float32 else SCALE_FLOOR_HALF


def n_groups(in_features: int, group_size: Optional[int]) -> int:
    """Scale columns per row: 1 per row, else ``in_features // group_size``."""
    return 1 if group_size is None else in_features // group_size


def packed_shape(out_features: int, in_features: int, bits: int) -> Tuple[int, int]:
    """Shape of the packed storage of an ``(out_features, in_features)`` matrix."""
    check_shape(in_features, bits, None)
    return out_features, in_features // ELEMENTS_PER_UNIT[bits] * BYTES_PER_UNIT[bits]


def packed_dtype(bits: int) -> mx.Dtype:
    """Storage dtype: int8 for 8 bits, uint8 for the sub-byte formats."""
    check_bits(bits)
    return mx.int8 if bits == 8 else mx.uint8


# -- quantization -------------------------------------------------------------


def quantize(
    w: mx.array, bits: int, group_size: Optional[int] = None
) -> Tuple[mx.array, mx.array]:
    """Symmetric quantization of a weight matrix.

    Args:
        w: ``(O, I)`` float weights (float32, float16 or bfloat16).
        bits: 8, 6, 4 or 2.
        group_size: None for one scale per row, else 32, 64 or 128.

    Returns:
        ``q``: ``(O, I)`` int8 in ``[-qmax, qmax]``;
        ``scales``: ``(O, n_groups)`` float32.
    """
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D (out, in) weight matrix, got shape {w.shape}")
    if not mx.issubdtype(w.dtype, mx.floating):
        raise TypeError(f"expected floating-point weights, got {w.dtype}")
    out_features, in_features = w.shape
    check_shape(in_features, bits, group_size)
    qmax = QMAX[bits]
    g = n_groups(in_features, group_size)
    wf = w.astype(mx.float32).reshape(out_features, g, in_features // g)
    scales = mx.maximum(mx.max(mx.abs(wf), axis=-1) / qmax, scale_floor(w.dtype))
    q = mx.clip(mx.round(wf / scales[..., None]), -qmax, qmax)
    return q.astype(mx.int8).reshape(out_features, in_features), scales


def pack(q: mx.array, bits: int) -> mx.array:
    """Pack ``(O, I)`` integers in ``[-qmax, qmax]`` into the storage layout.

    Returns an array of ``packed_shape(O, I, bits)`` and ``packed_dtype(bits)``.
    """
    if q.ndim != 2:
        raise ValueError(f"expected a 2-D (out, in) integer matrix, got shape {q.shape}")
    out_features, in_features = q.shape
    check_shape(in_features, bits, None)
    if bits == 8:
        return q.astype(mx.int8)
    # Work in uint32 so the shifts of int6 (up to 18 bits) do not overflow.
    u = (q.astype(mx.int32) + OFFSET[bits]).astype(mx.uint32)
    if bits == 4:
        u = u.reshape(out_features, in_features // 2, 2)
        return (u[..., 0] | (u[..., 1] << 4)).astype(mx.uint8)
    u = u.reshape(out_features, in_features // 4, 4)
    if bits == 2:
        byte = u[..., 0] | (u[..., 1] << 2) | (u[..., 2] << 4) | (u[..., 3] << 6)
        return byte.astype(mx.uint8)
    # int6: four 6-bit fields make one 24-bit little-endian word, low bits first.
    word = u[..., 0] | (u[..., 1] << 6) | (u[..., 2] << 12) | (u[..., 3] << 18)
    three = mx.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], axis=-1)
    return three.astype(mx.uint8).reshape(out_features, in_features // 4 * 3)


def unpack(packed: mx.array, bits: int, in_features: int) -> mx.array:
    """Inverse of :func:`pack`: ``packed_shape(O, I, bits)`` -> ``(O, I)`` int8."""
    check_shape(in_features, bits, None)
    row_bytes = in_features // ELEMENTS_PER_UNIT[bits] * BYTES_PER_UNIT[bits]
    if packed.ndim != 2 or packed.shape[1] != row_bytes:
        raise ValueError(
            f"packed int{bits} storage of {in_features} inputs per row has shape "
            f"(O, {row_bytes}), got {packed.shape}"
        )
    if packed.dtype != packed_dtype(bits):
        raise TypeError(f"int{bits} storage is {packed_dtype(bits)}, got {packed.dtype}")
    out_features = packed.shape[0]
    if bits == 8:
        return packed
    u = packed.astype(mx.int32)
    if bits == 4:
        fields = mx.stack([u & 0xF, u >> 4], axis=-1)
    elif bits == 2:
        fields = mx.stack([u & 3, (u >> 2) & 3, (u >> 4) & 3, u >> 6], axis=-1)
    else:
        b = u.reshape(out_features, in_features // 4, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        fields = mx.stack(
            [word & 63, (word >> 6) & 63, (word >> 12) & 63, word >> 18], axis=-1
        )
    return (fields.reshape(out_features, in_features) - OFFSET[bits]).astype(mx.int8)


def dequantize(
    packed: mx.array,
    scales: mx.array,
    bits: int,
    group_size: Optional[int],
    in_features: int,
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """Reconstruct ``(O, I)`` weights ``q * s`` in ``dtype`` (computed in float32)."""
    q = unpack(packed, bits, in_features)
    out_features = q.shape[0]
    g = n_groups(in_features, group_size)
    if scales.shape != (out_features, g):
        raise ValueError(
            f"scales of {out_features} rows with {g} group(s) have shape "
            f"({out_features}, {g}), got {scales.shape}"
        )
    w = q.astype(mx.float32).reshape(out_features, g, in_features // g)
    w = w * scales.astype(mx.float32)[..., None]
    return w.reshape(out_features, in_features).astype(dtype)


def quantize_packed(
    w: mx.array, bits: int, group_size: Optional[int] = None
) -> Tuple[mx.array, mx.array]:
    """:func:`quantize` then :func:`pack`: ``(O, I)`` -> (storage, ``(O, G)`` scales)."""
    q, scales = quantize(w, bits, group_size)
    return pack(q, bits), scales


# -- the reference product ------------------------------------------------------


def reference_matmul(
    x: mx.array,
    packed: mx.array,
    scales: mx.array,
    *,
    bits: int,
    group_size: Optional[int],
    in_features: int,
    bias: Optional[mx.array] = None,
) -> mx.array:
    """The oracle: ``x @ dequantize(W).T (+ bias)`` in float32, cast to ``x.dtype``.

    Args:
        x: ``(..., I)``.
        packed, scales: storage and ``(O, G)`` scales of an ``(O, I)`` matrix.
        bias: ``(O,)`` or None; added in float32 after the product.

    Returns:
        ``(..., O)`` in ``x.dtype``.
    """
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer expects {in_features}")
    w = dequantize(packed, scales, bits, group_size, in_features, mx.float32)
    y = x.astype(mx.float32) @ w.T
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.astype(x.dtype)


# -- quality ------------------------------------------------------------------


def fake_quantize_packed(w: mx.array, bits: int, group_size: Optional[int] = None) -> mx.array:
    """Round trip through the packed format: ``(O, I)`` -> ``(O, I)`` in ``w.dtype``.

    Exactly the weights a packed layer multiplies by, as a float matrix: swap
    it into an ``nn.Linear`` to measure the perplexity of a format (per-row
    vs per-group) without the packed kernels.
    """
    packed, scales = quantize_packed(w, bits, group_size)
    return dequantize(packed, scales, bits, group_size, w.shape[1], w.dtype)


def reconstruction_error(
    w: mx.array, bits: int, group_size: Optional[int] = None
) -> Dict[str, float]:
    """Error of quantizing ``w`` (``(O, I)``), for comparing per-row and per-group.

    Returns relative Frobenius error ``|W - W~| / |W|``, mean absolute error, and
    the signal-to-quantization-noise ratio in dB, all computed in float32.
    """
    packed, scales = quantize_packed(w, bits, group_size)
    wf = w.astype(mx.float32)
    err = wf - dequantize(packed, scales, bits, group_size, w.shape[1])
    num = mx.sqrt(mx.sum(err * err))
    den = mx.sqrt(mx.sum(wf * wf))
    rel = (num / mx.maximum(den, 1e-30)).item()
    return {
        "relative_error": rel,
        "mean_abs_error": mx.mean(mx.abs(err)).item(),
        "sqnr_db": float("inf") if rel == 0 else -20.0 * math.log10(rel),
    }
