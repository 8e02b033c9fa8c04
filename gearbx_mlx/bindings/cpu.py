"""Packed int4/int8 GEMV on the CPU: a checked wrapper over the C kernels.

The kernels (``gearbx_mlx/bindings/csrc/``, built by cffi in API mode as ``gearbx_mlx.bindings._gearbx_cpu``)
compute ``y = W x`` for one activation vector straight from the packed format
of :mod:`gearbx_mlx.packed.formats`: int8 ``(O, I)``, or uint8 ``(O, I/2)`` int4 with the
low nibble first and an offset of 8, with float32 scales ``(O, n_groups)``.

Paths (``path=``):

* ``"intdot"``: ``x`` is quantized to int8 once per call, one scale per block of
  32 values; exact integer dot products (AVX2 ``vpmaddubsw``, NEON
  ``vdotq_s32``). Reads the weights at memory speed. Adds the error of 8-bit
  activations (about ``max|x_block| / 254`` per element) to that of the weights.
* ``"float"``: float32 activations and accumulation; no activation error, but
  compute-bound at roughly a third of the int-dot speed.
* ``"auto"``: ``"intdot"``.
* ``"ref"`` / ``"intdot_ref"``: the scalar C oracles of the two (slow; tests).

The extension is loaded on first use, never at import. If it is missing (the
build is optional), :func:`available` returns False after one warning and the
callers (``PackedLinear``) use MLX instead.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from ..mlx_tables import GROUP_SIZES as MLX_GROUP_SIZES

__all__ = ["available", "contiguous_numpy", "gemv", "prepare", "PreparedWeights", "raise_for", "require", "reset",
           "set_threads", "get_threads", "info", "isa_limit", "unavailable"]

PATHS = {"auto": 0, "float": 1, "intdot": 2, "ref": 3, "intdot_ref": 4}
#: GBX_ABI_VERSION of the C library this wrapper speaks to (csrc/gearbx_cpu.h).
ABI_VERSION = 2
GROUP_SIZES = (None, *MLX_GROUP_SIZES)

ArrayLike = Union[mx.array, np.ndarray]

_lock = threading.Lock()
_ext: Optional[Any] = None
_load_error: Optional[str] = None


def _load() -> Optional[Any]:
    """The compiled module, or None (warns once, the first time it is missing)."""
    global _ext, _load_error
    if _ext is not None or _load_error is not None:
        return _ext
    with _lock:
        if _ext is not None or _load_error is not None:
            return _ext
        try:  # optional, built at install
            _gearbx_cpu = importlib.import_module(f"{__package__}._gearbx_cpu")
        except ImportError as e:
            _load_error = (
                f"gearbx_mlx: the C CPU kernels are not built ({e}); packed layers use the "
                "pure-MLX path. Rebuild with `pip install -e .` or `python gearbx_mlx/bindings/build.py`."
            )
            warnings.warn(_load_error, RuntimeWarning, stacklevel=3)
            return None
        version = _gearbx_cpu.lib.GBX_ABI_VERSION
        if version != ABI_VERSION:
            _load_error = (f"gearbx_mlx: C CPU kernels have ABI {version}, this wrapper expects {ABI_VERSION}; "
                           "rebuild them (`python gearbx_mlx/bindings/build.py` or `pip install -e .`)")
            warnings.warn(_load_error, RuntimeWarning, stacklevel=3)
            return None
        _ext = _gearbx_cpu
        return _ext


def available() -> bool:
    """True when the compiled kernels import (warns once when they do not)."""
    return _load() is not None


def unavailable() -> Optional[str]:
    """None when the compiled kernels load, else why not (for the self-test's table)."""
    if available():
        return None
    return f"the C kernels are not built ({_load_error or 'unavailable'})"


def require() -> Any:
    """The compiled module (``.lib``, ``.ffi``); RuntimeError saying why when it did not load."""
    ext = _load()
    if ext is None:
        raise RuntimeError(_load_error or "gearbx_mlx: C CPU kernels unavailable")
    return ext


def reset() -> None:
    """Forget the loaded library and its load error: the next call loads it again.

    For a process that rebuilt the library, and for tests of the missing-library
    path (the warning is issued once per load attempt).
    """
    global _ext, _load_error
    with _lock:
        _ext = None
        _load_error = None


def set_threads(n: Optional[int]) -> int:
    """Threads a call uses by default (None or <= 0: all online CPUs). Returns the value set."""
    if n is not None and not isinstance(n, (int, np.integer)):
        raise TypeError(f"threads must be an int or None, got {type(n).__name__}")
    return int(require().lib.gbx_set_threads(0 if n is None else int(n)))


def get_threads() -> int:
    return int(require().lib.gbx_get_threads())


@contextlib.contextmanager
def isa_limit(level: int) -> Iterator[None]:
    """The C kernels chosen at ``gbx_set_isa_limit(level)`` inside the block (0: the best this CPU
    runs; 1: plain AVX2; 2: no AVX512-VNNI), the previous setting restored after. Process-wide:
    for tests and benchmarks that compare the kernels, not for code running beside others."""
    lib = require().lib
    old = lib.gbx_set_isa_limit(int(level))
    try:
        yield
    finally:
        lib.gbx_set_isa_limit(old)


def info() -> dict:
    """What was compiled in and what this CPU runs (``{"available": False, ...}`` if not built)."""
    ext = _load()
    if ext is None:
        return {"available": False, "error": _load_error}
    ffi, lib = ext.ffi, ext.lib
    i = ffi.new("gbx_info_t *")
    lib.gbx_get_info(i)
    return {
        "available": True,
        "abi_version": i.abi_version,
        "compiled": {"avx2": bool(i.compiled_avx2), "neon": bool(i.compiled_neon), "dotprod": bool(i.compiled_dotprod)},
        "cpu": {"avx2_fma": bool(i.cpu_avx2), "vnni": bool(i.cpu_vnni), "dotprod": bool(i.cpu_dotprod)},
        "float_isa": ffi.string(i.float_isa).decode(),
        "intdot_isa": ffi.string(i.intdot_isa).decode(),
        "nested_float_isa": ffi.string(i.nested_float_isa).decode(),
        "nested_intdot_isa": ffi.string(i.nested_intdot_isa).decode(),
        "threads": i.threads,
        "max_threads": i.max_threads,
        "block": lib.GBX_QK,
        "extension": os.path.basename(getattr(ext, "__file__", "") or "") or None,
    }


# -- buffers ---------------------------------------------------------------------

_NP_OF_MX = {mx.uint8: np.uint8, mx.int8: np.int8, mx.float32: np.float32}


def contiguous_numpy(a: mx.array) -> np.ndarray:
    """``a`` evaluated and viewed by numpy without a copy, made C-contiguous
    first if its layout is not (a transposed array would be read in storage order)."""
    mx.eval(a)
    v = np.asarray(a)
    if not v.flags.c_contiguous:
        a = mx.contiguous(a)
        mx.eval(a)
        v = np.asarray(a)
    return v


def dtype_code(lib: Any, dtype: mx.Dtype) -> Optional[int]:
    """The C ``GBX_DTYPE_*`` code of a scale dtype (float32, float16, bfloat16), or None."""
    return {mx.float32: lib.GBX_DTYPE_F32, mx.float16: lib.GBX_DTYPE_F16, mx.bfloat16: lib.GBX_DTYPE_BF16}.get(dtype)


def raw_view(a: mx.array, name: str) -> np.ndarray:
    """A C-contiguous numpy view of an MLX array's bytes (bfloat16 as uint16), no copy."""
    if not isinstance(a, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)  # numpy has no bfloat16; the kernels read the bits
    return contiguous_numpy(a)


def float_rows(x: Any, in_features: int) -> Tuple[np.ndarray, Tuple[int, ...]]:
    """``x`` as a C-contiguous float32 ``(m, in_features)`` buffer, and its leading shape."""
    if not isinstance(x, (mx.array, np.ndarray)):
        raise TypeError(f"x must be an mlx.core.array or numpy.ndarray, got {type(x).__name__}")
    if not x.shape or x.shape[-1] != in_features or x.size == 0:
        raise ValueError(f"x must have shape (..., {in_features}), got {tuple(x.shape)}")
    lead = tuple(x.shape[:-1])
    m = x.size // in_features
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"x must be floating point, got {x.dtype}")
        return np.ascontiguousarray(x.reshape(m, in_features), dtype=np.float32), lead
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(f"x must be floating point, got {x.dtype}")
    x = mx.contiguous(x.astype(mx.float32).reshape(m, in_features))
    mx.eval(x)
    return np.asarray(x), lead


def _host_view(a: ArrayLike, dtype: type, name: str) -> np.ndarray:
    """A C-contiguous numpy view of ``a`` in ``dtype``, without a copy when possible.

    An MLX array is evaluated, and made contiguous if its layout is not (a
    transposed array would otherwise be read in storage order); numpy then
    views its buffer (the view keeps the MLX array alive).
    """
    if isinstance(a, mx.array):
        if _NP_OF_MX.get(a.dtype) is not dtype:
            raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
        return contiguous_numpy(a)
    if isinstance(a, np.ndarray):
        if a.dtype != dtype:
            raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
        return np.ascontiguousarray(a)
    raise TypeError(f"{name} must be an mlx.core.array or numpy.ndarray, got {type(a).__name__}")


def check_threads(threads: Optional[int]) -> None:
    """One clear error for a thread count that is neither None nor a positive int."""
    if threads is not None and (not isinstance(threads, (int, np.integer)) or threads < 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")


def writable_view(out: Optional[mx.array], shape: Tuple[int, ...]) -> Optional[np.ndarray]:
    """The numpy view a kernel writes ``out`` through (None where ``out`` is None):
    ``out`` must be a float32 MLX array of ``shape``, evaluated here, contiguous and writable."""
    if out is None:
        return None
    if not isinstance(out, mx.array) or out.dtype != mx.float32 or tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must be a float32 mlx array of shape {tuple(shape)}")
    mx.eval(out)
    view = np.asarray(out)
    if not (view.flags.c_contiguous and view.flags.writeable):
        raise ValueError("out must be contiguous and writable")
    return view


def _activations(x: ArrayLike, in_features: int) -> np.ndarray:
    """``x`` as a float32 (in_features,) buffer; any leading dims must be 1.

    On the decode path of every packed layer: kept to a few attribute checks.
    """
    if not isinstance(x, (mx.array, np.ndarray)):
        raise TypeError(f"x must be an mlx.core.array or numpy.ndarray, got {type(x).__name__}")
    if x.size != in_features or not x.shape or x.shape[-1] != in_features:
        raise ValueError(f"x must hold one vector of {in_features} features (shape (..., {in_features}) "
                         f"with leading dims 1), got shape {tuple(x.shape)}")
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"x must be floating point, got {x.dtype}")
        return np.ascontiguousarray(x.reshape(in_features), dtype=np.float32)
    if x.dtype != mx.float32:
        if not mx.issubdtype(x.dtype, mx.floating):
            raise TypeError(f"x must be floating point, got {x.dtype}")
        x = x.astype(mx.float32)
    if x.ndim != 1:
        x = x.reshape(in_features)
    mx.eval(x)
    v = np.asarray(x)
    if not v.flags.c_contiguous:  # e.g. a strided slice
        x = mx.contiguous(x)
        mx.eval(x)
        v = np.asarray(x)
    return v


def raise_for(ext: Any, rc: int, what: str) -> None:
    """ValueError (bad arguments) or RuntimeError naming ``what`` for a C return code ``rc`` != 0."""
    lib = ext.lib
    msg = f"{what}: {ext.ffi.string(lib.gbx_strerror(rc)).decode()}"
    if rc in (lib.GBX_E_BITS, lib.GBX_E_GROUP, lib.GBX_E_SHAPE, lib.GBX_E_PATH, lib.GBX_E_PLANES):
        raise ValueError(msg)
    raise RuntimeError(msg)


# -- the product -----------------------------------------------------------------


@dataclass(frozen=True)
class PreparedWeights:
    """Packed weights checked once, for repeated products (a layer's decode steps).

    ``weight``: ``(O, I/2)`` uint8 (int4) or ``(O, I)`` int8; ``scales``:
    ``(O, n_groups)`` float32, both C-contiguous host views.
    """

    weight: np.ndarray
    scales: np.ndarray
    bits: int
    group_size: Optional[int]
    in_features: int

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def gemv(
        self,
        x: ArrayLike,
        *,
        path: str = "auto",
        threads: Optional[int] = None,
        out: Optional[mx.array] = None,
    ) -> mx.array:
        """``W x`` as a float32 ``(O,)`` array; see :func:`gemv`."""
        ext = require()
        if path not in PATHS:
            raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
        check_threads(threads)
        xv = _activations(x, self.in_features)
        o = self.out_features
        yv = writable_view(out, (o,))
        if yv is None:
            yv = np.empty(o, dtype=np.float32)
        ffi = ext.ffi
        rc = ext.lib.gbx_gemv(
            ffi.from_buffer(self.weight), ffi.from_buffer("float[]", self.scales), ffi.from_buffer("float[]", xv),
            ffi.from_buffer("float[]", yv, require_writable=True), o, self.in_features, self.bits,
            self.group_size or 0, PATHS[path], 0 if threads is None else int(threads),
        )
        if rc != 0:
            raise_for(ext, rc, "gearbx_mlx.bindings.cpu.gemv")
        # mx.array(numpy) copies (about 2 us for 11k floats); `out` avoids it
        return out if out is not None else mx.array(yv)


def prepare(
    packed: ArrayLike, scales: ArrayLike, *, bits: int, group_size: Optional[int], in_features: int
) -> PreparedWeights:
    """Check the packed weights once and keep host views of them.

    Args:
        packed: int4: uint8 ``(O, in_features // 2)``; int8: int8 ``(O, in_features)``.
        scales: float32 ``(O, n_groups)``, ``n_groups = 1`` per row (``group_size=None``)
            or ``in_features // group_size``; ``(O,)`` is accepted per row.
        bits: 4 or 8.
        group_size: None (per row), 32, 64 or 128; must divide ``in_features``.
        in_features: I (the packed shape alone cannot tell it for int4 with padding).
    """
    ext = require()
    if bits not in (4, 8):
        raise ValueError(f"the CPU kernels handle bits 4 and 8, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if not isinstance(in_features, (int, np.integer)) or in_features < 1:
        raise ValueError(f"in_features must be a positive int, got {in_features!r}")
    if group_size is not None and in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    if bits == 4 and in_features % 2:
        raise ValueError(f"int4 needs an even in_features, got {in_features}")
    w = _host_view(packed, np.uint8 if bits == 4 else np.int8, "packed")
    row_bytes = in_features // 2 if bits == 4 else in_features
    if w.ndim != 2 or w.shape[1] != row_bytes:
        raise ValueError(f"packed int{bits} weights of {in_features} inputs have shape (O, {row_bytes}), "
                         f"got {tuple(w.shape)}")
    ng = 1 if group_size is None else in_features // group_size
    s = _host_view(scales, np.float32, "scales")
    if s.ndim == 1 and ng == 1:
        s = s.reshape(-1, 1)
    if s.shape != (w.shape[0], ng):
        raise ValueError(f"scales must have shape ({w.shape[0]}, {ng}), got {tuple(s.shape)}")
    rc = ext.lib.gbx_check_args(w.shape[0], int(in_features), bits, group_size or 0, 0)
    if rc != 0:
        raise_for(ext, rc, "gearbx_mlx.bindings.cpu.prepare")
    return PreparedWeights(w, s, bits, group_size, int(in_features))


def gemv(
    packed: ArrayLike,
    scales: ArrayLike,
    x: ArrayLike,
    *,
    bits: int,
    group_size: Optional[int],
    in_features: int,
    **call: Any,
) -> mx.array:
    """``y = W x`` from packed weights, float32 of shape ``(O,)`` (no bias: add it).

    Args:
        packed, scales, bits, group_size, in_features: see :func:`prepare`.
        x: ``(in_features,)`` (leading dims of size 1 allowed), any float dtype;
            computed in float32.
        call: the call's ``path``, ``threads`` and ``out``:
            ``path``: ``"auto"`` (default), ``"intdot"``, ``"float"``, ``"ref"``
            or ``"intdot_ref"`` (module docstring);
            ``threads``: threads for this call (default :func:`get_threads`);
            small products use fewer. The result does not depend on it;
            ``out``: optional float32 ``(O,)`` MLX array written in place and
            returned; it must not feed any computation that is still pending.

    Raises:
        TypeError / ValueError: wrong dtype, shape, bits, group size or path.
        RuntimeError: the extension is not built, or a C failure.
    """
    return prepare(packed, scales, bits=bits, group_size=group_size, in_features=in_features).gemv(x, **call)
