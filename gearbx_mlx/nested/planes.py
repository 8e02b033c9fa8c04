"""Nested bit planes: every gear of a weight matrix in one buffer, in pure MLX.

A weight ``W`` of shape ``(out, in)`` is stored as planes of affine group
quantization in MLX's format (codes packed in uint32 words, a float scale and
bias per group), each quantizing what the planes before it left over:

* plane 0 (4 bits, groups of 64): ``W`` itself; alone, it *is* MLX's 4-bit
  quantization of ``W`` (``mx.quantize``: same codes, scales and biases): the
  low gear (or an MLX 4-bit layer made by one of mlx-lm's quantizers,
  :mod:`gearbx_mlx.nested.lowquant`, with the planes below fitting ``W``);
* plane 1 (4 bits, groups of 32): ``W - deq(p0)``; planes 0-1 are the mid
  gear, closer to ``W`` than MLX's 8-bit quantization (as KL to the loaded
  weights: ``scripts/bench_nested.py``);
* plane 2 (6 bits, groups of 64): what remains; planes 0-2 are the high
  gear, within about 1e-6 nats of the loaded weights.

With half-precision scales the planes cost 4.5 + 5 + 6.5 = 16 bits a weight
(1.0x float16) for all three gears. The residual planes choose, per group,
the clipping of the residual's range that minimizes the squared error
(:func:`quantize_residual`): MLX aligns its grid so that zero is exact, which
leaves a few elements of many groups up to a whole step off. A residual is
small, and a float16 scale of a residual of a residual would fall below
float16's normal range, so each residual plane quantizes ``residual * 2**e``
(``e`` chosen per plane and matrix so that the largest magnitude is about 1)
and its products are multiplied by ``2**-e``, which is exact in floating point.

A gear reads its first ``n`` planes, ``y = sum_p x @ deq(p_p).T``: one to
three ``mx.quantized_matmul`` calls here (:func:`reference_matmul`, the
oracle and the fallback of every fused kernel), or one launch of a kernel
that reads ``n`` planes. Shifting gears changes ``n``; nothing is quantized
or allocated at shift time. The planes are built upward from the 4-bit gear,
not downward from 8-bit codes: the top nibble of 8-bit codes cannot represent
a group's extreme weights and makes a much worse low gear.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..bindings import cpu, nested_cpu
from ..mlx_tables import GROUP_SIZES as MLX_GROUP_SIZES, QUANT_BITS

#: ``(bits, group size)`` of each plane, low gear first: the default nesting.
PlaneSpec = Tuple[int, int]
DEFAULT_PLAN: Tuple[PlaneSpec, ...] = ((4, 64), (4, 32), (6, 64))
#: The planes re-expressing an MLX 8-bit layer: a 4-bit low gear and a 4-bit
#: residual (9.5 bits a weight with half-precision scales).
QUANTIZED_SOURCE_PLAN: Tuple[PlaneSpec, ...] = DEFAULT_PLAN[:2]
#: Residual planes of these widths use the error-minimizing clipping (:func:`quantize_residual`).
CLIPPED_PLANE_BITS: Tuple[int, ...] = (2, 4)
#: Group sizes MLX's affine quantization supports.
GROUP_SIZES: Tuple[int, ...] = MLX_GROUP_SIZES
#: Bit widths MLX's affine quantization supports.
PLANE_BITS: Tuple[int, ...] = QUANT_BITS


@dataclass
class Plane:
    """One MLX affine quantization: ``deq = scales * q + biases`` per group.

    Attributes:
        weight: ``(out, in * bits / 32)`` uint32, MLX's packing.
        scales, biases: ``(out, in / group_size)``, the source's float dtype.
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    exponent: int = 0  #: the plane holds ``residual * 2**exponent``

    @property
    def factor(self) -> float:
        """What the plane's products are multiplied by: ``2**-exponent`` (exact)."""
        return 2.0 ** -self.exponent

    @property
    def shape(self) -> Tuple[int, int]:
        """``(out, in)`` of the matrix this plane quantizes."""
        return self.weight.shape[0], self.weight.shape[1] * 32 // self.bits

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    def arrays(self) -> List[mx.array]:
        return [self.weight, self.scales, self.biases]

    def dequantize(self) -> mx.array:
        """``(out, in)`` float32: the values this plane adds to the weight.

        ``scales * q + biases`` in float32, as every kernel forms it: MLX's
        ``dequantize`` in a half-precision dtype would round each value to it
        (about 2**-9 of a group's range in bfloat16), and residuals formed
        from those rounded values would nest against arithmetic no kernel
        does (the high gear's error then grows a hundredfold).
        """
        w = mx.dequantize(self.weight, self.scales.astype(mx.float32), self.biases.astype(mx.float32),
                          group_size=self.group_size, bits=self.bits)
        return w * self.factor if self.exponent else w


def check_plan(plan: Sequence[PlaneSpec], in_features: int) -> None:
    """Raise ``ValueError`` unless MLX can quantize rows of ``in_features`` this way."""
    if not plan or len(plan) > 3:
        raise ValueError(f"a nesting plan has one to three planes, got {tuple(plan)!r}")
    for spec in plan:
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise ValueError(f"a plane is (bits, group size), got {spec!r}")
        bits, group = spec
        if bits not in PLANE_BITS:
            raise ValueError(f"unsupported plane bits {bits}: MLX quantizes to {PLANE_BITS} bits")
        if group not in GROUP_SIZES:
            raise ValueError(f"a plane's group size must be one of {GROUP_SIZES}, got {group!r}")
        if in_features % group:
            raise ValueError(f"the input size {in_features} is not a multiple of the group size {group}")


def quantize_plane(w: mx.array, bits: int, group_size: int, exponent: int = 0,
                   dtype: Optional[mx.Dtype] = None, clip: bool = False) -> Plane:
    """Affine quantization of ``w * 2**exponent`` in ``dtype`` (default ``w``'s):
    MLX's own (min-max), or with ``clip`` the least-squares clipping of
    :func:`quantize_residual`."""
    src = w * (2.0 ** exponent) if exponent else w
    if clip:
        q, s, b = quantize_residual(src, bits, group_size, dtype or w.dtype)
    else:
        q, s, b = mx.quantize(src.astype(dtype or w.dtype), group_size=group_size, bits=bits)
    return Plane(q, s, b, bits, group_size, exponent)


#: Shrink factors of a group's range tried by :func:`quantize_residual`, per side.
CLIP_SHRINKS: Tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
#: Rows quantized at once by :func:`quantize_residual` (bounds its temporary memory).
RESIDUAL_ROW_CHUNK = 4096


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """``(out, in)`` integer codes -> MLX's packing: uint32 words, least significant first."""
    if 32 % bits:
        raise ValueError(f"codes of {bits} bits do not pack whole into 32-bit words")
    per = 32 // bits
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    rows = codes.shape[0]
    return (codes.astype(mx.uint32).reshape(rows, -1, per) << shifts).sum(axis=-1).astype(mx.uint32)


def clip_candidates() -> List[Tuple[float, float]]:
    """``(low, high)`` shrinks of a group's range that :func:`quantize_residual` tries, in order."""
    return [(lo, hi) for shrink in CLIP_SHRINKS for lo, hi in (((shrink, 0.0), (0.0, shrink)) if shrink else ((0.0, 0.0),))]


def quantize_residual(r: mx.array, bits: int, group_size: int, dtype: mx.Dtype) -> Tuple[mx.array, mx.array, mx.array]:
    """Affine group quantization of a residual with the clipping that minimizes its squared error.

    The residual of MLX's 4-bit quantization is not spread evenly over each
    group's range: MLX aligns its grid so that zero is exact, which leaves a
    few elements of many groups up to a whole step off while the rest lie
    within half a step. Min-max quantization spends its levels on those few;
    this tries each shrink of :data:`CLIP_SHRINKS` from either end of the
    range and keeps, per group, the one with the least error (the first of
    equals), computed with the scales and biases rounded to ``dtype`` as they
    are stored. Each candidate costs one fused pass that keeps only its
    per-group error; the codes are formed once, with each group's winner.

    Returns:
        ``(weight, scales, biases)`` in MLX's format (readable by
        ``mx.dequantize`` and ``mx.quantized_matmul``).
    """
    rows, cols = r.shape
    levels = 2**bits - 1
    shrinks = clip_candidates()
    table = mx.array(shrinks, dtype=mx.float32)  # (C, 2)
    error = _clip_error(levels, dtype)
    outs = []
    for start in range(0, rows, RESIDUAL_ROW_CHUNK):
        x = r[start : start + RESIDUAL_ROW_CHUNK].astype(mx.float32)
        x = x.reshape(x.shape[0], cols // group_size, group_size)
        lo0, hi0 = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
        span = hi0 - lo0
        mx.eval(x, lo0, span)
        best_err, best = None, None
        for i, (lo_w, hi_w) in enumerate(shrinks):
            err = error(x, lo0, hi0, span, mx.array(lo_w), mx.array(hi_w))
            if best_err is None:
                best_err, best = err, mx.zeros(err.shape, dtype=mx.uint32)
            else:
                best_err, best = _keep_lower(err, best_err, best, mx.array(i, dtype=mx.uint32))
            mx.eval(best_err, best)
        pick = table[best]  # (rows, groups, 1, 2): each group's shrinks
        _, q, scale, lo = _clip_candidate(levels, dtype)(x, lo0, hi0, span, pick[..., 0], pick[..., 1])
        outs.append((pack_codes(q.reshape(q.shape[0], cols), bits), scale[..., 0].astype(dtype), lo[..., 0].astype(dtype)))
        mx.eval(outs[-1])
        del x, lo0, hi0, span, best_err, best, pick, q, scale, lo
    return tuple(mx.concatenate([o[i] for o in outs]) for i in range(3))


def _clip_fields(x, lo0, hi0, span, lo_w, hi_w, levels, dtype):  # noqa: ANN001, ANN202
    lo = (lo0 + lo_w * span).astype(dtype).astype(mx.float32)
    scale = mx.maximum((hi0 - hi_w * span - lo) / levels, 1e-30).astype(dtype).astype(mx.float32)
    scale = mx.where(scale > 0, scale, 1.0)  # a constant group: any scale, code 0
    q = mx.clip(mx.round((x - lo) / scale), 0, levels)
    err = ((scale * q + lo - x) ** 2).sum(axis=-1, keepdims=True)
    return err, q, scale, lo


@functools.lru_cache(maxsize=None)
def _clip_candidate(levels: int, dtype: mx.Dtype) -> Any:
    """``(x, lo0, hi0, span, lo_w, hi_w) -> (error, codes, scale, bias)`` of each group with its
    range shrunk by ``lo_w``/``hi_w`` of its span."""
    # One fused pass per candidate instead of a dozen element-wise ones
    # (compiled per bit width and dtype; the shrinks are array inputs).
    return mx.compile(lambda x, lo0, hi0, span, lo_w, hi_w: _clip_fields(x, lo0, hi0, span, lo_w, hi_w, levels, dtype))


@functools.lru_cache(maxsize=None)
def _clip_error(levels: int, dtype: mx.Dtype) -> Any:
    """The error alone of :func:`_clip_candidate`: no full-size codes are written."""
    return mx.compile(lambda x, lo0, hi0, span, lo_w, hi_w: _clip_fields(x, lo0, hi0, span, lo_w, hi_w, levels, dtype)[0])


@mx.compile
def _keep_lower(err: mx.array, best_err: mx.array, best: mx.array, i: mx.array) -> Tuple[mx.array, mx.array]:
    keep = err < best_err
    return mx.where(keep, err, best_err), mx.where(keep, i, best)


def residual_exponent(r: mx.array) -> int:
    """``e`` such that ``max|r| * 2**e`` lies in [0.5, 1) (0 for an all-zero residual)."""
    m = float(mx.max(mx.abs(r)).item())
    if not math.isfinite(m):
        raise ValueError("the weight holds a NaN or an infinity: it cannot be quantized")
    return 0 if m == 0.0 else -math.frexp(m)[1]


def build_planes(weight: mx.array, plan: Sequence[PlaneSpec] = DEFAULT_PLAN, low: Optional[Plane] = None) -> List[Plane]:
    """Planes of ``weight`` ``(out, in)``, each quantizing the residual of those before.

    Residuals are formed in float32 whatever the weight's dtype; every
    plane's scales and biases are in the source's dtype, as MLX's quantized
    layers of that source would hold them.

    Args:
        low: plane 0 made elsewhere (another quantizer's MLX layer of the plan's
            first bits and group size, :mod:`gearbx_mlx.nested.lowquant`); None:
            MLX's round-to-nearest of ``weight``. The planes after it fit the
            residual to ``weight`` either way.
    """
    check_plan(plan, weight.shape[-1])
    if weight.ndim != 2:
        raise ValueError(f"planes quantize a matrix (out, in), got shape {tuple(weight.shape)}")
    if low is not None and ((low.bits, low.group_size) != tuple(plan[0]) or low.shape != tuple(weight.shape)
                            or low.exponent):
        raise ValueError(f"a given low plane must be {tuple(plan[0])} of shape {tuple(weight.shape)}, got "
                         f"{(low.bits, low.group_size)} of shape {low.shape}")
    dtype = weight.dtype
    planes: List[Plane] = []
    residual = weight.astype(mx.float32)
    for i, (bits, group_size) in enumerate(plan):
        if i == 0:
            # Exactly MLX's quantization of the source, unless another quantizer made it.
            p = quantize_plane(weight, bits, group_size) if low is None else low
        else:
            p = quantize_plane(residual, bits, group_size, residual_exponent(residual), dtype,
                               clip=bits in CLIPPED_PLANE_BITS)
        planes.append(p)
        if i + 1 < len(plan):
            residual = residual - p.dequantize()
            mx.eval(residual)
    mx.eval([a for p in planes for a in p.arrays()])
    return planes


def reconstruct(planes: Sequence[Plane], n: Optional[int] = None, dtype: Optional[mx.Dtype] = None) -> mx.array:
    """The sum of the first ``n`` planes' dequantizations, ``(out, in)``, summed in
    float32 and returned in ``dtype`` (default: the planes' scale dtype)."""
    n = len(planes) if n is None else n
    w = planes[0].dequantize()
    for p in planes[1:n]:
        w = w + p.dequantize()
    return w.astype(dtype or planes[0].scales.dtype)


def reference_matmul(
    x: mx.array, planes: Sequence[Plane], n: int, bias: Optional[mx.array] = None
) -> mx.array:
    """``x @ (deq(p0) + ... + deq(p_{n-1})).T (+ bias)``: one quantized product per plane.

    On the CPU device a half-precision ``x`` is multiplied in float32 (the
    planes' scales promoted with it): MLX's CPU ``quantized_matmul`` has no
    half-precision path that sums in float32 (it sums in the half type, whole
    units off over a thousand inputs, where it takes the input at all).

    Args:
        x: ``(..., in)``.
    Returns:
        ``(..., out)`` in the dtype of ``x``.
    """
    if not 1 <= n <= len(planes):
        raise ValueError(f"a gear reads 1 to {len(planes)} planes, got {n}")
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    xq = x.astype(mx.float32) if on_cpu and x.dtype in (mx.float16, mx.bfloat16) else x
    y = None
    for p in planes[:n]:
        t = mx.quantized_matmul(xq, p.weight, p.scales, p.biases, transpose=True, group_size=p.group_size, bits=p.bits)
        if n == 1:
            y = t
            break
        t = t.astype(mx.float32)
        if p.exponent:
            t = t * p.factor
        y = t if y is None else y + t
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


#: The most weights :func:`dense_matmul` dequantizes at once (float32: 16 MiB); a larger
#: matrix is multiplied a block of output rows at a time.
DENSE_BLOCK_ELEMENTS = 1 << 22


def dense_matmul(
    x: mx.array, planes: Sequence[Plane], n: int, bias: Optional[mx.array] = None, prepared: Optional[Any] = None,
    unpack_threads: Optional[int] = None,
) -> mx.array:
    """The product of :func:`reference_matmul` as one BLAS product: the first ``n`` planes
    dequantized and summed in float32 (:meth:`Plane.dequantize`), then ``x @ w.T`` in float32.

    Several input rows on a CPU: MLX's CPU ``quantized_matmul`` computes each
    output without BLAS (about one multiply-add per nanosecond,
    ``scripts/bench_qmm_cpu.py``) and the oracle makes ``n`` of them, while
    a dequantization costs about one product of a single row. The planes are
    summed by the C kernels' threads where they can read them
    (:meth:`gearbx_mlx.bindings.nested_cpu.PreparedNested.unpack`: the values of
    :func:`unpack_plane`, bit for bit, several times faster) where the matrix is
    one block of :data:`DENSE_BLOCK_ELEMENTS`, and the product is evaluated at
    once; else by :func:`unpack_plane`, lazily. The dequantized weights live only
    during the call, a block of :data:`DENSE_BLOCK_ELEMENTS` at a time.

    Args:
        x: ``(..., in)``, any float dtype.
        prepared: the planes as the C kernels read them, where the caller keeps
            them (a ``PreparedNested`` of at least ``n`` planes: a layer's
            :class:`~gearbx_mlx.nested.matmul.NestedProduct` builds one for both
            its paths); else checked here once and kept while the planes live.
        unpack_threads: threads of the C unpacking (default the C kernels' count,
            :func:`gearbx_mlx.bindings.cpu.get_threads`).
    Returns:
        ``(..., out)`` in the dtype of ``x``.
    """
    if not 1 <= n <= len(planes):
        raise ValueError(f"a gear reads 1 to {len(planes)} planes, got {n}")
    out_features, in_features = planes[0].shape
    xf = x.astype(mx.float32)
    step = max(1, DENSE_BLOCK_ELEMENTS // in_features)
    # The C path works at once and evaluates its product; a matrix of several
    # blocks (an output embedding) keeps MLX's lazy unpacking, so that a
    # product nobody reads (the logits of a prefill chunk) costs nothing.
    if step < out_features:
        prepared = None
    elif prepared is None or prepared.n_planes < n or mx.default_device().type != mx.DeviceType.cpu:
        prepared = _c_planes(planes[:n])
    parts = []
    if prepared is not None:
        parts.append(xf @ prepared.unpack(n, out=_scratch(out_features, in_features), threads=unpack_threads).T)
        mx.eval(parts[0])  # done with the scratch weights before the next call rewrites them
    for start in range(0, out_features, step) if prepared is None else ():
        block = [_rows_of(p, start, start + step) for p in planes[:n]] if step < out_features else planes[:n]
        if parts:
            # Each block is unpacked after the product before it: MLX would otherwise unpack
            # several blocks at once (an output embedding's prefill held ~0.4 of its float32 size).
            block = [_after(p, parts[-1]) for p in block]
        w = unpack_plane(block[0])
        for p in block[1:]:
            w = w + unpack_plane(p)
        parts.append(xf @ w.T)
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.astype(x.dtype)


#: Per thread, ``(out, in)`` -> the float32 matrix :func:`dense_matmul` unpacks a gear into
#: through the C kernels (one allocation per shape, not a fresh zeroed one per call).
_SCRATCH = threading.local()
#: ``(id of the first plane, n)`` -> ``(the planes' arrays, their PreparedNested)``; an entry
#: goes with its first plane (checking planes costs more than a small product's unpacking).
_PREPARED: Dict[Tuple[int, int], Tuple[Tuple[mx.array, ...], Any]] = {}


def _scratch(rows: int, cols: int) -> mx.array:
    cache = _SCRATCH.__dict__.setdefault("by_shape", {})
    w = cache.get((rows, cols))
    if w is None:
        w = cache[(rows, cols)] = mx.zeros((rows, cols), dtype=mx.float32)
    return w


def reserve_dense_scratch(out_features: int, in_features: int) -> bool:
    """Allocate and write, on this thread, the float32 ``(out, in)`` matrix that :func:`dense_matmul`
    unpacks a gear of that shape into through the C kernels (one per shape and thread), now rather
    than in the first prefill, where faulting its pages in costs about 2 us per 4 KiB.

    Returns False for a shape :func:`dense_matmul` unpacks a block at a time in MLX (no scratch).
    """
    if max(1, DENSE_BLOCK_ELEMENTS // in_features) < out_features:
        return False
    mx.eval(_scratch(out_features, in_features))
    return True


def _c_planes(planes: Sequence[Plane]) -> Optional[Any]:
    """The planes as the C kernels read them (a ``PreparedNested``, kept while the first plane
    lives), or None where they cannot: no extension, a device other than the CPU, or planes of
    other bits, groups or dtypes."""
    if mx.default_device().type != mx.DeviceType.cpu or not cpu.available():
        return None
    key = (id(planes[0]), len(planes))
    arrays = tuple(a for p in planes for a in p.arrays())
    hit = _PREPARED.get(key)
    if hit is not None and len(hit[0]) == len(arrays) and all(a is b for a, b in zip(hit[0], arrays)):
        return hit[1]
    if any(p.bits not in nested_cpu.NESTED_BITS or p.group_size not in MLX_GROUP_SIZES for p in planes):
        return None
    try:
        prepared = nested_cpu.prepare_nested(planes)
    except (ValueError, TypeError):
        return None
    if hit is None:
        weakref.finalize(planes[0], _PREPARED.pop, key, None)
    _PREPARED[key] = (arrays, prepared)
    return prepared


def unpack_plane(p: Plane) -> mx.array:
    """:meth:`Plane.dequantize` (the same float32 values) through element-wise MLX
    operations on the codes' bytes where codes do not straddle a byte (2, 4 and 8
    bits): on the CPU 1.3-2x faster than ``mx.dequantize`` (``scripts/bench_qmm_cpu.py``). Other widths take
    ``mx.dequantize``. The factor ``2**-exponent`` is applied to the scales and
    biases, which is exact."""
    if 8 % p.bits:
        return p.dequantize()
    rows, cols = p.shape
    b = p.weight.view(mx.uint8)  # MLX packs least significant first: byte order is code order
    mask = (1 << p.bits) - 1
    fields = [b] if p.bits == 8 else [(b >> (k * p.bits)) & mask for k in range(8 // p.bits)]
    q = (mx.stack(fields, axis=-1) if len(fields) > 1 else b).reshape(rows, cols // p.group_size, p.group_size)
    scales, biases = p.scales.astype(mx.float32), p.biases.astype(mx.float32)
    if p.exponent:
        scales, biases = scales * p.factor, biases * p.factor
    return (q.astype(mx.float32) * scales[..., None] + biases[..., None]).reshape(rows, cols)


def _after(p: Plane, done: mx.array) -> Plane:
    """``p`` whose codes are read only once ``done`` is computed (same values)."""
    return Plane(mx.depends(p.weight, done), p.scales, p.biases, p.bits, p.group_size, p.exponent)


def _rows_of(p: Plane, start: int, stop: int) -> Plane:
    return Plane(p.weight[start:stop], p.scales[start:stop], p.biases[start:stop], p.bits, p.group_size, p.exponent)


def bits_per_weight(planes: Sequence[Plane], n: Optional[int] = None) -> float:
    """Stored bits per weight of the first ``n`` planes, scales and biases included."""
    n = len(planes) if n is None else n
    rows, cols = planes[0].shape
    return 8 * sum(p.nbytes for p in planes[:n]) / (rows * cols)
