"""Nested planes on the CPU: a checked wrapper over the C ``gbx_nested_gemv``.

A gear of nested planes (``gearbx_mlx.nested.planes``) computes
``y = sum_{p<n} 2**-e_p * (x @ deq(plane p).T)``. The C kernels
(``gearbx_mlx/bindings/csrc/nested.c`` and its ``arch/`` files) read the first ``n``
planes of a matrix straight from MLX's storage (uint32 codes, float32 /
float16 / bfloat16 scales and biases), zero-copy, one output row at a time,
for one or a few activation rows (a verify of k tokens reads each weight row
once).

Paths (``path=``), as the packed kernels' (:mod:`.cpu`):

* ``"float"`` (and ``"auto"``): float32 activations, no error beyond float32
  summation order;
* ``"intdot"``: x quantized to int8 in blocks of 32, exact integer dot
  products (the bias term from the same int8 x); faster, adds the error of
  8-bit activations (``scripts/bench_nested_kernels.py`` measures it per gear);
* ``"ref"`` / ``"intdot_ref"``: the scalar C oracles (tests).

Planes are objects with ``weight``, ``scales``, ``biases``, ``bits``,
``group_size`` and ``exponent`` (``gearbx_mlx.nested.planes.Plane``); this
module does not import the nested package, which sits above the kernels.
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from ..mlx_tables import GROUP_SIZES
from . import cpu

__all__ = ["PreparedNested", "prepare_nested", "nested_gemv", "nested_unpack"]

ArrayLike = Union[mx.array, np.ndarray]
PATHS = cpu.PATHS
#: Plane bit widths the C kernels read (MLX's 6-bit codes as its bit stream).
NESTED_BITS = (4, 6, 8)


class PlaneLike(Protocol):
    weight: mx.array  # (out, in * bits / 32) uint32
    scales: mx.array  # (out, in / group_size)
    biases: mx.array
    bits: int
    group_size: int
    exponent: int


class PreparedNested:
    """A matrix's planes checked once, with host views and the C plane table.

    Attributes:
        n_planes: planes held (a gear reads the first ``n`` of them).
        out_features, in_features: the matrix.
        bits, group_sizes: of each plane.
        table: the C ``gbx_plane[]`` pointing into the planes' own buffers.
    """

    def __init__(self, planes: Sequence[PlaneLike]) -> None:
        ext = cpu.require()
        ffi, lib = ext.ffi, ext.lib
        if not 1 <= len(planes) <= lib.GBX_MAX_PLANES:
            raise ValueError(f"a nested matrix has 1 to {lib.GBX_MAX_PLANES} planes, got {len(planes)}")
        first = planes[0]
        self.out_features = int(first.weight.shape[0])
        self.in_features = int(first.weight.shape[1]) * 32 // int(first.bits)
        self.bits = tuple(int(p.bits) for p in planes)
        self.group_sizes = tuple(int(p.group_size) for p in planes)
        self.n_planes = len(planes)
        o, i = self.out_features, self.in_features
        self._keep: List[Any] = []  # the views and cffi buffers the table points into
        self.table = ffi.new("gbx_plane[]", len(planes))
        for k, p in enumerate(planes):
            if p.bits not in NESTED_BITS:
                raise ValueError(f"plane {k} has {p.bits} bits: the C kernels read planes of 4, 6 or 8 bits "
                                 "(use gearbx_mlx.nested.planes.reference_matmul for others)")
            gs = int(p.group_size)
            if gs not in GROUP_SIZES:
                raise ValueError(f"plane {k} has group size {gs}: the C kernels take groups of 32, 64 or 128")
            if p.weight.dtype != mx.uint32 or p.weight.ndim != 2 or p.weight.shape[0] != o \
                    or p.weight.shape[1] * 32 != i * p.bits:
                raise ValueError(f"plane {k}: codes must be uint32 ({o}, {i * p.bits // 32}) for {p.bits} bits, "
                                 f"got {p.weight.dtype} {tuple(p.weight.shape)}")
            code = cpu.dtype_code(lib, p.scales.dtype)
            if code is None or p.biases.dtype != p.scales.dtype:
                raise TypeError(f"plane {k}: scales and biases must share float32, float16 or bfloat16, "
                                f"got {p.scales.dtype} and {p.biases.dtype}")
            if i % gs or tuple(p.scales.shape) != (o, i // gs) or tuple(p.biases.shape) != (o, i // gs):
                raise ValueError(f"plane {k}: scales and biases must have shape ({o}, {i // gs}), "
                                 f"got {tuple(p.scales.shape)} and {tuple(p.biases.shape)}")
            views = [cpu.raw_view(p.weight, f"plane {k} codes"), cpu.raw_view(p.scales, f"plane {k} scales"),
                     cpu.raw_view(p.biases, f"plane {k} biases")]
            bufs = [ffi.from_buffer(v) for v in views]
            self._keep += views + bufs
            t = self.table[k]
            t.codes = ffi.cast("const uint32_t *", bufs[0])
            t.scales, t.biases = bufs[1], bufs[2]
            t.bits, t.group_size, t.dtype, t.factor = int(p.bits), gs, code, 2.0 ** -int(p.exponent)
        rc = lib.gbx_check_nested(self.table, len(planes), 1, o, i, 0)
        if rc != 0:
            cpu.raise_for(ext, rc, "gearbx_mlx.bindings.nested_cpu.prepare_nested")

    def gemv(
        self,
        x: ArrayLike,
        n: Optional[int] = None,
        *,
        path: str = "float",
        threads: Optional[int] = None,
        out: Optional[mx.array] = None,
    ) -> mx.array:
        """The gear of the first ``n`` planes (default all) times ``x``, float32.

        Args:
            x: ``(..., in_features)``: one activation row or a few (the
                leading dims are flattened), any float dtype.
            n: planes read (1 .. n_planes).
            path: ``"float"``/``"auto"``, ``"intdot"``, ``"ref"`` or ``"intdot_ref"``.
            threads: threads for this call (default :func:`gearbx_mlx.bindings.cpu.get_threads`).
            out: optional float32 MLX array of the result's shape, written in place.

        Returns:
            ``(..., out_features)`` float32, without any layer bias.
        """
        ext = cpu.require()
        n = self._planes_read(n)
        if path not in PATHS:
            raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
        cpu.check_threads(threads)
        xv, lead = cpu.float_rows(x, self.in_features)
        m = xv.shape[0]
        shape = lead + (self.out_features,)
        yv = cpu.writable_view(out, shape)
        if yv is None:
            yv = np.empty((m, self.out_features), dtype=np.float32)
        ffi = ext.ffi
        rc = ext.lib.gbx_nested_gemv(
            self.table, int(n), ffi.from_buffer("float[]", xv), ffi.from_buffer("float[]", yv, require_writable=True),
            m, self.out_features, self.in_features, PATHS[path],
            0 if threads is None else int(threads),
        )
        if rc != 0:
            cpu.raise_for(ext, rc, "gearbx_mlx.bindings.nested_cpu.gemv")
        return out if out is not None else mx.array(yv).reshape(shape)

    def _planes_read(self, n: Optional[int]) -> int:
        """``n`` planes (default all), checked against the planes this matrix has."""
        n = self.n_planes if n is None else n
        if not isinstance(n, (int, np.integer)) or not 1 <= n <= self.n_planes:
            raise ValueError(f"a gear reads 1 to {self.n_planes} planes, got {n!r}")
        return n

    def unpack(self, n: Optional[int] = None, rows: Optional[Tuple[int, int]] = None, *,
               threads: Optional[int] = None, out: Optional[mx.array] = None) -> mx.array:
        """The gear of the first ``n`` planes (default all) as one float32 matrix.

        ``sum_p 2**-e_p * deq(plane p)``, each plane's values formed as
        :func:`gearbx_mlx.nested.planes.unpack_plane` forms them and added in
        plane order: the same float32 values, bit for bit, from the C kernels'
        threads instead of MLX's element-wise operations.

        Args:
            n: planes read (1 .. n_planes).
            rows: ``(start, stop)``: only those output rows (default all).
            threads: threads for this call (default :func:`gearbx_mlx.bindings.cpu.get_threads`).
            out: optional float32 MLX array of the result's shape, written in
                place (a caller that reuses one must be done with its last values).

        Returns:
            ``(stop - start, in_features)`` float32, evaluated.
        """
        ext = cpu.require()
        n = self._planes_read(n)
        cpu.check_threads(threads)
        start, stop = (0, self.out_features) if rows is None else (int(rows[0]), int(rows[1]))
        if not 0 <= start <= stop <= self.out_features:
            raise ValueError(f"rows must satisfy 0 <= start <= stop <= {self.out_features}, got {rows!r}")
        shape = (stop - start, self.in_features)
        if out is None:
            # MLX's own buffer (its allocator recycles them; a fresh numpy one
            # costs page faults and a copy), written before anything else holds it.
            out = mx.zeros(shape, dtype=mx.float32)
        view = cpu.writable_view(out, shape)
        ffi = ext.ffi
        rc = ext.lib.gbx_nested_unpack(self.table, int(n), ffi.from_buffer("float[]", view, require_writable=True),
                                       start, stop, self.out_features, self.in_features,
                                       0 if threads is None else int(threads))
        if rc != 0:
            cpu.raise_for(ext, rc, "gearbx_mlx.bindings.nested_cpu.unpack")
        return out


def prepare_nested(planes: Sequence[PlaneLike]) -> PreparedNested:
    """Check a matrix's planes once and keep host views of them (see :class:`PreparedNested`).

    Raises:
        ValueError / TypeError: planes of different group sizes or shapes, bits
            other than 4 and 8, scale dtypes other than float32/float16/bfloat16.
        RuntimeError: the C extension is not built.
    """
    return PreparedNested(planes)


def nested_gemv(
    x: ArrayLike, planes: Sequence[PlaneLike], n: int, *, path: str = "float", threads: Optional[int] = None
) -> mx.array:
    """One-off :meth:`PreparedNested.gemv` (a layer keeps a :class:`PreparedNested`)."""
    return prepare_nested(planes).gemv(x, n, path=path, threads=threads)


def nested_unpack(planes: Sequence[PlaneLike], n: int, *, threads: Optional[int] = None) -> mx.array:
    """One-off :meth:`PreparedNested.unpack`: the first ``n`` planes summed, ``(out, in)`` float32."""
    return prepare_nested(planes).unpack(n, threads=threads)
