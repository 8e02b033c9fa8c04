"""Per-group affine quantization in MLX's own format, and what it costs in bytes.

MLX's ``mx.quantize`` (mode "affine") stores, per group of ``group_size``
elements along the last axis, integer codes ``c`` in ``[0, 2^bits)`` packed
LSB-first into a little-endian bit stream of ``uint32`` words, and one scale
and one bias in the input dtype; ``x ≈ scale·c + bias``. mlx-lm's
``QuantizedKVCache`` and ``quantized_scaled_dot_product_attention`` read that
format, so anything written in it is attended to by mlx-lm unchanged.

Two ways to fill it:

* ``"minmax"``: ``mx.quantize`` itself (the group's extremes set the grid).
* ``"ls"``: the same codes, then ``scale`` and ``bias`` refitted by least
  squares to the group and the codes rounded again, ``iters`` times. The
  grid no longer has to reach the extremes, so the bulk of the group is
  quantized more finely: on unit Gaussian groups of 64 at 4 bits the mean
  squared error drops from 0.0085 to 0.0075 (-12%). Every step is plain MLX
  ops, so it runs on every backend; it costs a few element-wise passes over
  the vectors being written, none over the stored cache.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from ..mlx_tables import GROUP_SIZES, QUANT_BITS

#: Bit widths and group sizes MLX's affine quantization supports.
SUPPORTED_BITS = QUANT_BITS
SUPPORTED_GROUPS = GROUP_SIZES
QUANTIZERS = ("minmax", "ls")


def check_bits_group(bits: int, group_size: int) -> None:
    """ValueError unless MLX can quantize with ``bits`` and ``group_size``."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group size must be an int, got {type(group_size).__name__}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"MLX quantizes KV caches to {SUPPORTED_BITS} bits, not {bits}")
    if group_size not in SUPPORTED_GROUPS:
        raise ValueError(f"MLX quantizes in groups of {SUPPORTED_GROUPS}, not {group_size}")


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes (``(..., n)``, each ``< 2^bits``) into MLX's uint32 words.

    MLX's layout is one LSB-first bit stream per row, cut into 32-bit words
    (checked against ``mx.quantize`` for every supported width), so codes of 3,
    5 or 6 bits straddle word boundaries. Returns ``(..., n·bits/32)`` uint32.
    """
    n = codes.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole 32-bit words")
    c = codes.astype(mx.uint32)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (mx.arange(per, dtype=mx.uint32) * bits).astype(mx.uint32)
        c = c.reshape(*c.shape[:-1], n // per, per)
        return (c << shifts).sum(axis=-1).astype(mx.uint32)
    one = mx.array(1, dtype=mx.uint32)
    stream = (c[..., None] >> mx.arange(bits, dtype=mx.uint32)) & one
    stream = stream.reshape(*c.shape[:-1], n * bits // 32, 32)
    return (stream << mx.arange(32, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def _codes(x: mx.array, scale: mx.array, bias: mx.array, bits: int) -> mx.array:
    # MLX picks a negative scale when the group's largest magnitude is its
    # maximum; guard the division by magnitude, keeping the sign.
    safe = mx.where(mx.abs(scale) > 1e-30, scale, 1e-30)
    return mx.clip(mx.round((x - bias) / safe), 0, 2**bits - 1)


def quantize_ls(
    x: mx.array, group_size: int, bits: int, iters: int = 2
) -> Tuple[mx.array, mx.array, mx.array]:
    """``mx.quantize``'s format with least-squares scales and biases.

    Args:
        x: ``(..., n)`` with ``n`` a multiple of ``group_size``.
    Returns:
        ``(packed (..., n·bits/32) uint32, scales (..., n/g), biases (..., n/g))``,
        scales and biases in ``x.dtype``.
    """
    check_bits_group(bits, group_size)
    w, scale, bias = mx.quantize(x, group_size=group_size, bits=bits)
    if iters <= 0:
        return w, scale, bias
    shape = x.shape
    xg = x.astype(mx.float32).reshape(*shape[:-1], shape[-1] // group_size, group_size)
    s = scale.astype(mx.float32)[..., None]
    b = bias.astype(mx.float32)[..., None]
    c = _codes(xg, s, b, bits)
    n = float(group_size)
    for _ in range(iters):
        sc, scc = c.sum(-1, keepdims=True), (c * c).sum(-1, keepdims=True)
        sx, scx = xg.sum(-1, keepdims=True), (c * xg).sum(-1, keepdims=True)
        det = n * scc - sc * sc
        ok = det > 1e-6  # a group on one code keeps MLX's own scale and bias
        s_new = mx.where(ok, (n * scx - sc * sx) / mx.where(ok, det, 1.0), s)
        b = mx.where(ok, (sx - s_new * sc) / n, b)
        s = s_new
        c = _codes(xg, s, b, bits)
    # The refit is kept only where it lowers the group's error in the stored
    # dtype (a float16 scale can round away a tiny gain).
    s16, b16 = s.astype(x.dtype).astype(mx.float32), b.astype(x.dtype).astype(mx.float32)
    err_new = ((c * s16 + b16 - xg) ** 2).sum(-1)
    err_old = ((mx.dequantize(w, scale, bias, group_size, bits).astype(mx.float32).reshape(xg.shape) - xg) ** 2).sum(-1)
    better = err_new < err_old
    packed = pack(c.reshape(shape).astype(mx.uint32), bits)
    words = mx.repeat(better, w.shape[-1] // better.shape[-1], axis=-1)
    w = mx.where(words, packed, w)
    scale = mx.where(better, s[..., 0].astype(x.dtype), scale)
    bias = mx.where(better, b[..., 0].astype(x.dtype), bias)
    return w, scale, bias


def quantize(
    x: mx.array, group_size: int, bits: int, method: str = "minmax"
) -> Tuple[mx.array, mx.array, mx.array]:
    """Quantize the last axis of ``x`` into MLX's affine format by ``method``."""
    if method == "minmax":
        return mx.quantize(x, group_size=group_size, bits=bits)
    if method == "ls":
        return quantize_ls(x, group_size, bits)
    raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {method!r}")


#: Writes of at most this many tokens take the compiled least-squares step
#: (:func:`quantize_step`): decode steps and speculative verifies, a bounded
#: set of shapes, each traced once. Longer prefill chunks run the same ops
#: uncompiled rather than trace every prompt length.
COMPILED_MAX_TOKENS = 16

Quantized = Tuple[mx.array, mx.array, mx.array]


def offset_keys(keys: mx.array, offset: Optional[mx.array]) -> mx.array:
    """``keys (B, n_kv, L, d) - offset (n_kv, d)`` in the keys' dtype (``keys`` if no offset)."""
    if offset is None:
        return keys
    return keys - offset.astype(keys.dtype)[None, :, None, :]


def _step(keys: mx.array, values: mx.array, offset: Optional[mx.array], group_size: int, bits: int,
          method: str) -> Tuple[Quantized, Quantized]:
    keys = offset_keys(keys, offset)
    if method == "ls" and keys.shape == values.shape and keys.dtype == values.dtype:
        # One quantizer call for both halves: at decode every op is tiny, so the
        # cost is per op, not per element.
        h = keys.shape[1]
        w, s, b = quantize_ls(mx.concatenate([keys, values], axis=1), group_size, bits)
        return (w[:, :h], s[:, :h], b[:, :h]), (w[:, h:], s[:, h:], b[:, h:])
    return quantize(keys, group_size, bits, method), quantize(values, group_size, bits, method)


@functools.lru_cache(maxsize=None)
def _compiled_step(group_size: int, bits: int, method: str, has_offset: bool):
    if has_offset:
        return mx.compile(lambda k, v, o: _step(k, v, o, group_size, bits, method))
    return mx.compile(lambda k, v: _step(k, v, None, group_size, bits, method))


def quantize_step(keys: mx.array, values: mx.array, key_offset: Optional[mx.array], group_size: int,
                  bits: int, method: str = "minmax") -> Tuple[Quantized, Quantized]:
    """What one cache write stores: ``quantize(keys - key_offset)`` and ``quantize(values)``.

    Args:
        keys: ``(B, n_kv_heads, L, d_k)``; values: ``(B, n_kv_heads, L, d_v)``.
        key_offset: ``(n_kv_heads, d_k)`` or None.
    Returns:
        ``((packed, scales, biases) of the keys, the same of the values)``,
        bit-identical to :func:`quantize` of each on the CPU (on a GPU a
        compiled graph may fuse a product into a sum). Least-squares writes of up
        to :data:`COMPILED_MAX_TOKENS` tokens run as one compiled function
        for both halves (``scripts/eval_kv.py speed`` times the decode step).
    """
    if method == "ls" and keys.shape[-2] <= COMPILED_MAX_TOKENS:
        f = _compiled_step(group_size, bits, method, key_offset is not None)
        return f(keys, values, key_offset) if key_offset is not None else f(keys, values)
    return _step(keys, values, key_offset, group_size, bits, method)


def bits_per_element(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Stored bits per cached element: the code plus its share of scale and bias."""
    return bits + 2 * 8 * scale_bytes / group_size


#: The probe: a prefill chunk of 3 tokens, then one decode step, through
#: mlx-lm's own QuantizedKVCache and attention, with grouped-query heads (2 kv
#: heads, 2 queries each). Backends differ in which shapes they take, so the
#: probe is the real path.
_PROBE_PREFILL, _PROBE_KV_HEADS, _PROBE_REPEATS = 3, 2, 2
#: How a backend reads a quantized cache: mlx-lm's slices of its buffer
#: (``"views"``), only contiguous copies of them (``"copies"``), or not at all
#: (MLX's error). MLX 0.32's CUDA ``quantized_matmul`` takes only operands
#: whose storage is contiguous, and a cache's first ``offset`` rows of a
#: buffer of ``(B, heads, capacity, d)`` are not, for more than one head.
READS = ("views", "copies")
_probed: Dict[tuple, str] = {}


class _CopyingCache(QuantizedKVCache):
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return contiguous_reads(super().update_and_fetch(keys, values))


def contiguous_reads(kv: Any) -> Any:
    """The cache's ``(keys, values)`` tuples of arrays, each made contiguous."""
    return tuple(tuple(mx.contiguous(a) for a in part) for part in kv)


def attention_reads(bits: int, group_size: int, head_dim: int, dtype: mx.Dtype = mx.float16) -> str:
    """How this MLX build reads a quantized cache: one of :data:`READS`, or the error it raised.

    Runs the probe (mlx-lm's quantized attention over a short prefill and a
    decode step at the real head dimension, bits, group and dtype, on the
    default device) over the cache's slices, then, if that fails, over
    contiguous copies of them; remembered per process.
    """
    key = (str(mx.default_device()), bits, group_size, head_dim, str(dtype))
    if key not in _probed:
        err = _probe(QuantizedKVCache, bits, group_size, head_dim, dtype)
        _probed[key] = "views" if not err else ("copies" if not _probe(_CopyingCache, bits, group_size, head_dim,
                                                                       dtype) else err)
    return _probed[key]


def check_quantized_attention(bits: int, group_size: int, head_dim: int, dtype: mx.Dtype = mx.float16,
                              copies: bool = False) -> str:
    """ValueError unless this MLX build can run quantized attention over such a cache.

    mlx-lm's quantized attention multiplies queries by the quantized keys
    (``mx.quantized_matmul`` with ``transpose=True``) and the scores by the
    quantized values (``transpose=False``). Some backends lack these products
    for some operands (MLX 0.32's CUDA backend raises "No implementation for
    problem shape" at the first attention call), which would stop a stream in
    the middle: :func:`attention_reads` finds that before generation.

    Args:
        copies: the cache can hand attention contiguous copies (this
            package's caches do; mlx-lm's own do not).
    Returns:
        ``"views"`` or (with ``copies``) ``"copies"``.
    """
    how = attention_reads(bits, group_size, head_dim, dtype)
    if how == "views" or (how == "copies" and copies):
        return how
    if how == "copies":
        raise ValueError(
            f"MLX {mx.__version__} on {mx.default_device()} runs quantized attention over a {bits}-bit, group "
            f"{group_size} cache with head dimension {head_dim} only on contiguous copies, which mlx-lm's own "
            "cache does not make: use the rotated cache (--kv-rotation auto), or the float cache (no --kv-bits)"
        )
    raise ValueError(
        f"MLX {mx.__version__} on {mx.default_device()} cannot run quantized attention over a "
        f"{bits}-bit, group {group_size} cache with head dimension {head_dim} ({how}); "
        + ("try a smaller --kv-group-size (" + ", ".join(str(g) for g in SUPPORTED_GROUPS if g < group_size)
           + "), or " if any(g < group_size for g in SUPPORTED_GROUPS) else "")
        + "run with the float cache (no --kv-bits)"
    )


def _probe(cache_class: type, bits: int, group_size: int, head_dim: int, dtype: mx.Dtype) -> str:
    """'' when mlx-lm's quantized attention runs a prefill and a decode step, else MLX's error."""
    heads = _PROBE_KV_HEADS * _PROBE_REPEATS
    cache = cache_class(group_size=group_size, bits=bits)
    try:
        for n, mask in ((_PROBE_PREFILL, "causal"), (1, None)):
            k = mx.random.normal((1, _PROBE_KV_HEADS, n, head_dim), key=mx.random.key(n)).astype(dtype)
            q = mx.random.normal((1, heads, n, head_dim), key=mx.random.key(n + 7)).astype(dtype)
            keys, values = cache.update_and_fetch(k, k)
            mx.eval(scaled_dot_product_attention(q, keys, values, cache, scale=head_dim**-0.5, mask=mask))
    except (RuntimeError, ValueError) as e:
        return str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return ""
