"""Block-sparse one-row product on the CPU: a checked wrapper over the C ``gbx_sparse_gemv``.

An activation-sparse drafter multiplies one activation row by a few input
groups of a low-gear weight only (the blocks a token activates). The weight is
one MLX affine quantization (``QuantizedLinear``, or plane 0 of the nested
store): ``(out, in / 8)`` uint32 4-bit codes, ``(out, in / group_size)``
scales and biases. A block is one quantization group, so its codes are the
``group_size / 2`` bytes at offset ``g * group_size / 2`` of every row: the C
kernel (``csrc/sparse.c`` and its ``arch/`` files) reads, per output row and
kept block, one contiguous segment, a scale and a bias, and nothing of the
dropped blocks, straight from MLX's buffers (zero-copy).

* :func:`sparse_down` is the drop-in of ``gearbx_mlx.speculative.sparse.sparse_down``
  (the pure-MLX oracle, which gathers copies): it evaluates its inputs,
  calls C, and returns an MLX array;
* :class:`TopBlocksProduct` is the host drafter's form: one C call that picks
  the ``keep`` heaviest blocks of a numpy row and multiplies by them, into a
  buffer of its own (no MLX graph at all);
* :func:`unsupported` says why C cannot take a weight (None where it can):
  callers fall back to MLX.

Paths as :mod:`.nested_cpu`'s: ``"float"`` (fp32 activations), ``"intdot"``
(int8 activations in blocks of 32, quantized as the dense intdot kernel
quantizes them), ``"ref"`` / ``"intdot_ref"`` (the scalar C oracles).
Weights are duck-typed (``weight``, ``scales``, ``biases``, ``bits``,
``group_size``; ``bias`` optional): this module imports nothing above the bindings.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import mlx.core as mx
import numpy as np

from . import cpu

__all__ = ["PREPARED_ATTR", "SPARSE_BITS", "SPARSE_GROUP_SIZES", "PreparedSparse", "TopBlocksProduct", "prepared_sparse",
           "sparse_down", "top_blocks", "unsupported"]

ArrayLike = Union[mx.array, np.ndarray]
#: What the C kernel reads: 4-bit codes in groups of whole 64-code spans.
SPARSE_BITS = 4
SPARSE_GROUP_SIZES = (64, 128)
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def unsupported(parts: Any) -> Optional[str]:
    """Why the C kernel cannot multiply by ``parts`` here (None when it can): the device, the
    extension, the bits, the group size or the arrays' dtypes and shapes."""
    if mx.default_device() != mx.cpu:
        return f"the device is {mx.default_device()}: the C kernel runs on the CPU"
    if not cpu.available():
        return cpu.unavailable() or "the C kernels are not built"
    if parts.bits != SPARSE_BITS or parts.group_size not in SPARSE_GROUP_SIZES:
        return (f"the weight is {parts.bits}-bit in groups of {parts.group_size}: the C kernel reads 4-bit codes "
                f"in groups of {' or '.join(map(str, SPARSE_GROUP_SIZES))}")
    w, s, b = parts.weight, parts.scales, parts.biases
    out, words = (w.shape + (0, 0))[:2] if w.ndim == 2 else (0, 0)
    i = words * 8
    if w.dtype != mx.uint32 or w.ndim != 2 or out == 0 or i % parts.group_size:
        return f"the codes are {w.dtype} {tuple(w.shape)}, not uint32 (out, in / 8)"
    if s.dtype not in _DTYPES or b.dtype != s.dtype or s.shape != b.shape or tuple(s.shape) != (out, i // parts.group_size):
        return f"the scales and biases are {s.dtype} {tuple(s.shape)} and {b.dtype} {tuple(b.shape)}"
    return None


class PreparedSparse:
    """One weight checked once, with host views of its arrays and the C plane that points into them.

    Attributes:
        out_features, in_features, group_size, blocks: the weight (``blocks`` = groups per row).
        source: the codes' MLX array (kept alive by the views).
        bias: the layer's bias as float32 numpy, or None (the kernel does not add it).
    """

    def __init__(self, parts: Any) -> None:
        reason = unsupported(parts)
        if reason is not None:
            raise ValueError(f"gearbx_mlx.bindings.sparse_cpu: {reason}")
        ext = cpu.require()
        self.ext, self.ffi, self.lib = ext, ext.ffi, ext.lib
        self.source = parts.weight  # the codes' array the views read
        self.out_features = int(parts.weight.shape[0])
        self.in_features = int(parts.weight.shape[1]) * 8
        self.group_size = int(parts.group_size)
        self.blocks = self.in_features // self.group_size
        bias = getattr(parts, "bias", None)
        self.bias = None if bias is None else np.array(bias.astype(mx.float32))
        views = [cpu.raw_view(parts.weight, "codes"), cpu.raw_view(parts.scales, "scales"), cpu.raw_view(parts.biases, "biases")]
        bufs = [self.ffi.from_buffer(v) for v in views]
        self._keep = views + bufs  # what the plane points into
        self.plane = self.ffi.new("gbx_plane *")
        p = self.plane
        p.codes = self.ffi.cast("const uint32_t *", bufs[0])
        p.scales, p.biases = bufs[1], bufs[2]
        p.bits, p.group_size, p.factor = SPARSE_BITS, self.group_size, 1.0
        p.dtype = cpu.dtype_code(self.lib, parts.scales.dtype)
        self._check(self.lib.gbx_check_sparse(self.plane, self.out_features, self.in_features, 0), "prepare")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            cpu.raise_for(self.ext, rc, f"gearbx_mlx.bindings.sparse_cpu.{what}")

    def gemv(self, x: ArrayLike, blocks: ArrayLike, *, path: str = "float", threads: Optional[int] = None,
             bias: bool = True) -> mx.array:
        """``(..., in) -> (..., out)`` float32: the product over the groups ``blocks`` only.

        Args:
            x: one activation row (leading dims 1), any float dtype.
            blocks: ``(k,)`` strictly ascending group indices in ``[0, blocks)``.
            path: ``"float"``/``"auto"``, ``"intdot"``, ``"ref"`` or ``"intdot_ref"``.
            threads: threads for this call (default :func:`gearbx_mlx.bindings.cpu.get_threads`).
            bias: add the layer's bias (if it has one).
        """
        if path not in cpu.PATHS:
            raise ValueError(f"path must be one of {sorted(cpu.PATHS)}, got {path!r}")
        cpu.check_threads(threads)
        xv = _row(x, self.in_features)
        if isinstance(blocks, mx.array):
            mx.eval(blocks)
        bv = np.ascontiguousarray(np.asarray(blocks).reshape(-1), dtype=np.int32)
        y = np.empty(self.out_features, np.float32)
        ffi = self.ffi
        rc = self.lib.gbx_sparse_gemv(self.plane, ffi.from_buffer("float[]", xv), ffi.from_buffer("int32_t[]", bv),
                                      int(bv.size), ffi.from_buffer("float[]", y, require_writable=True),
                                      self.out_features, self.in_features, cpu.PATHS[path],
                                      0 if threads is None else int(threads))
        self._check(rc, "gemv")
        if bias and self.bias is not None:
            y += self.bias
        return mx.array(y).reshape(*tuple(x.shape[:-1]), self.out_features)


def _row(x: ArrayLike, n: int) -> np.ndarray:
    """``x`` as a C-contiguous float32 ``(n,)`` buffer (leading dims must be 1)."""
    if isinstance(x, (mx.array, np.ndarray)) and (x.size != n or not x.shape or x.shape[-1] != n):
        raise ValueError(f"x must hold one row of {n} features, got shape {tuple(x.shape)}")
    return cpu.float_rows(x, n)[0].reshape(n)


class TopBlocksProduct:
    """``y = W x`` over the ``keep`` heaviest groups of ``x`` (``sum |x|``), one C call
    (``gbx_sparse_gemv_top``), the host drafter's ``down_proj``.

    ``__call__(x, px)`` takes the numpy row and its cffi pointer and returns its
    own output buffer (overwritten by the next call), like the host step's
    dense linears; ``last_blocks`` holds the groups it kept.
    """

    def __init__(self, prepared: PreparedSparse, keep: int, path: str = "float") -> None:
        if path not in cpu.PATHS:
            raise ValueError(f"path must be one of {sorted(cpu.PATHS)}, got {path!r}")
        self.p = prepared
        self.keep = max(0, min(int(keep), prepared.blocks))
        self.path = cpu.PATHS[path]
        self.out = np.empty(prepared.out_features, np.float32)
        self.last_blocks = np.zeros(max(1, self.keep), np.int32)
        ffi = prepared.ffi
        self.py = ffi.from_buffer("float[]", self.out, require_writable=True)
        self.pb = ffi.from_buffer("int32_t[]", self.last_blocks, require_writable=True)
        self.args = (prepared.out_features, prepared.in_features, self.path, 0)

    def __call__(self, x: np.ndarray, px: Any) -> np.ndarray:
        rc = self.p.lib.gbx_sparse_gemv_top(self.p.plane, px, self.keep, self.pb, self.py, *self.args)
        if rc != 0:
            self.p._check(rc, "top")
        if self.p.bias is not None:
            self.out += self.p.bias
        return self.out


def top_blocks(x: ArrayLike, group_size: int, keep: int) -> np.ndarray:
    """``(n,) -> (k,)`` int32: the C choice of the ``keep`` heaviest groups (``sum |x|``; ties: the lower),
    ascending; ``k = min(keep, n / group_size)``."""
    ext = cpu.require()
    xv = _row(x, int(x.shape[-1]))
    out = np.zeros(max(1, int(keep)), np.int32)
    k = ext.lib.gbx_top_blocks(ext.ffi.from_buffer("float[]", xv), xv.size, int(group_size), int(keep),
                               ext.ffi.from_buffer("int32_t[]", out, require_writable=True))
    if k < 0:
        cpu.raise_for(ext, k, "gearbx_mlx.bindings.sparse_cpu.top_blocks")
    return out[:k]


#: The attribute a weight's parts object keeps its :class:`PreparedSparse` under (its lifetime theirs).
PREPARED_ATTR = "sparse_cpu_prepared"


def prepared_sparse(parts: Any) -> PreparedSparse:
    """The :class:`PreparedSparse` of ``parts``, built on first use and kept on ``parts`` itself
    (where it takes attributes; else built anew each call)."""
    prepared = getattr(parts, PREPARED_ATTR, None)
    if prepared is None or prepared.source is not parts.weight:
        prepared = PreparedSparse(parts)
        try:
            setattr(parts, PREPARED_ATTR, prepared)
        except AttributeError:  # a frozen or slotted parts object
            pass
    return prepared


def sparse_down(h: mx.array, parts: Any, blocks: mx.array, path: str = "float") -> mx.array:
    """``(1, I) -> (1, out)``: the product over ``blocks``' groups only, by the C kernel.

    The C twin of ``gearbx_mlx.speculative.sparse.sparse_down`` (same
    arguments, layer bias added): it evaluates ``h`` and ``blocks`` (one sync)
    and reads the kept segments of the weight in place. ``ValueError`` where
    :func:`unsupported` names a reason.
    """
    return prepared_sparse(parts).gemv(h, blocks, path=path)
