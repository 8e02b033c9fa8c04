"""Self-checks of the packed GEMV kernels (see :mod:`gearbx_mlx.kernelcheck`).

Each :class:`~gearbx_mlx.kernelcheck.KernelCheck` here runs one body of the
packed GEMV on this machine against the pure-MLX reference, over the kernel
tests' odd shapes and every input dtype it takes:

* GPU (Metal or CUDA, whichever this MLX has): the SIMT body for int4 and
  int8, both its threadgroup-memory and device-memory variants; the
  matrix-unit body (int4, 16-bit inputs); the matrix-unit body with 2 and 3
  outputs (fused q/k/v and gate/up);
* CPU: every path of the C kernels (``float``, ``intdot``, ``auto`` and the
  scalar oracles ``ref`` and ``intdot_ref``), int4 and int8;
* the layer dispatch: a ``PackedLinear`` decode call on whatever path this
  machine takes, through the first-use guard.

GPU kernels are compared with the MLX float32 reference under ``OUTPUT_RTOL``
and ``ACCUM_TOL`` (as ``tests/test_kernels_cuda.py`` does); the C kernels with
a float64 product of the reference's dequantized weights under ``FLOAT_RTOL``
and the int-dot activation term (as ``tests/test_cpu_kernels.py`` does).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..bindings import cpu, gpu, packed_gpu
from ..kernelcheck import (
    FLOAT_RTOL,
    Case,
    KernelCheck,
    Plant,
    compare,
    dtype_name,
    gemv_bound,
    gpu_case_dtypes,
    shape_label,
    shard_of,
)
from . import formats, layers
from .layers import PackedLinear, backend_for

#: Input dtypes every kernel is checked with.
DTYPES: Tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
#: SIMT cases (out, in, group size, bias): fewer words than lanes, a tail past
#: the last full step, rows not a multiple of a threadgroup's, and K above the
#: threadgroup-memory limit (tests/test_kernels_cuda.py, ODD_SHAPES).
SIMT_CASES: Tuple[Tuple[int, int, Optional[int], bool], ...] = (
    (67, 96, 32, True), (33, 4104, None, False), (37, 1152, 128, True), (9, 6272, 64, False),
)
#: Matrix-unit cases (K % 64 == 0): one iteration, rows not a multiple of 16,
#: K above the threadgroup-memory limit, K at its largest.
MMA_CASES: Tuple[Tuple[int, int, Optional[int], bool], ...] = (
    (37, 1152, None, True), (9, 6272, 64, False), (67, 576, 64, True), (16, 64, None, False),
    (41, packed_gpu.MMA_MAX_K, None, False),
)
#: Fused cases: (out, in, group size, bias, split rows).
FUSED_CASES: Tuple[Tuple[int, int, Optional[int], bool, Tuple[int, ...]], ...] = (
    (67, 576, None, True, (5,)), (37, 1152, 64, False, (3, 20)),
)
#: C kernel cases (out, in, group size): a single row, a K that is no multiple
#: of the activation block, odd rows, and the SIMT shapes.
C_CASES: Tuple[Tuple[int, int, Optional[int]], ...] = (
    (1, 2, None), (5, 34, None), (67, 96, 32), (33, 4104, None), (37, 1152, 128), (9, 6272, 64),
)
C_PATHS: Tuple[str, ...] = ("float", "intdot", "auto", "ref", "intdot_ref")


def make_case(out_features: int, in_features: int, bits: int, group_size: Optional[int], dtype: mx.Dtype,
              bias: bool, seed: int = 0) -> Tuple[mx.array, mx.array, mx.array, Optional[mx.array]]:
    """``(packed, scales, x, bias)``: random weights with a few outliers per row (as the tests')."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 20.0
    with mx.stream(mx.cpu):  # on a GPU, only the kernel under test runs there
        packed, scales = formats.quantize_packed(mx.array(w).astype(mx.bfloat16), bits, group_size)
        mx.eval(packed, scales)
    xs = rng.standard_normal(in_features).astype(np.float32)
    xs[rng.random(in_features) < 0.02] *= 30.0  # activation outliers
    x = mx.array(xs).astype(dtype)
    b = mx.array(rng.standard_normal(out_features).astype(np.float32)).astype(dtype) if bias else None
    return packed, scales, x, b


def _planted(packed: mx.array, bits: int, plant: Optional[Plant]) -> mx.array:
    return packed if plant is None else plant(packed, bits)


# -- GPU ---------------------------------------------------------------------------------


def _gpu_case(shape: Tuple[int, int, int, Optional[int]], bias: bool, dtype: mx.Dtype, plant: Optional[Plant],
              *, mma: bool, splits: Tuple[int, ...] = (), seed: int = 0) -> Case:
    """One checked GPU product of ``shape`` = ``(bits, out, in, group size)``."""
    bits, o, k, gs = shape
    packed, scales, x, b = make_case(o, k, bits, gs, dtype, bias, seed)
    y = packed_gpu.gemv(x, _planted(packed, bits, plant), scales, b, bits=bits, group_size=gs, mma=mma,
                     splits=splits)
    if splits:
        y = mx.concatenate(y, axis=-1)
    mx.eval(y)
    with mx.stream(mx.cpu):
        ref = formats.reference_matmul(x, packed, scales, bits=bits, group_size=gs, in_features=k, bias=b)
        w = formats.dequantize(packed, scales, bits, gs, k)
        bound = gemv_bound(x, w, ref.astype(mx.float32), out_dtype=dtype)
        mx.eval(ref, bound)
    extra = [f"{len(splits) + 1} outputs"] if splits else []
    variant = [] if mma else ["shared" if k <= packed_gpu.SHARED_K else "device"]
    return Case(shape_label(o, k, gs, bias, variant + extra), dtype_name(dtype), compare(y, ref, bound))


def _simt(bits: int):
    def run(plant: Optional[Plant]) -> List[Case]:
        dtypes = gpu_case_dtypes(len(SIMT_CASES), DTYPES)
        return [_gpu_case((bits, o, k, gs), bias, dtypes[i], plant, mma=False, seed=i)
                for i, (o, k, gs, bias) in shard_of(SIMT_CASES)]
    return run


def _mma(plant: Optional[Plant]) -> List[Case]:
    dtypes = gpu_case_dtypes(len(MMA_CASES), packed_gpu.MMA_DTYPES)
    return [_gpu_case((4, o, k, gs), bias, dtypes[i], plant, mma=True, seed=i)
            for i, (o, k, gs, bias) in shard_of(MMA_CASES)]


def _fused(plant: Optional[Plant]) -> List[Case]:
    dtypes = gpu_case_dtypes(len(FUSED_CASES), packed_gpu.MMA_DTYPES)
    return [_gpu_case((4, o, k, gs), bias, dtypes[i], plant, mma=True, splits=splits, seed=i)
            for i, (o, k, gs, bias, splits) in enumerate(FUSED_CASES)]


# -- the C kernels -----------------------------------------------------------------------


def _c_device(path: str) -> str:
    info = cpu.info()
    if not info.get("available"):
        return "cpu C"
    isa = {"float": info["float_isa"], "intdot": info["intdot_isa"], "auto": info["intdot_isa"]}.get(path, "scalar")
    return f"cpu C {isa}"


def _c_path(path: str):
    intdot = path in ("intdot", "auto", "intdot_ref")

    def run(plant: Optional[Plant]) -> List[Case]:
        cases = []
        for dtype in DTYPES:
            for bits in (4, 8):
                for i, (o, k, gs) in enumerate(C_CASES):
                    packed, scales, x, _ = make_case(o, k, bits, gs, dtype, False, seed=i)
                    y = cpu.gemv(_planted(packed, bits, plant), scales, x, bits=bits, group_size=gs, in_features=k,
                                 path=path)
                    # The reference's dequantized weights, multiplied in float64 (the C tests' oracle).
                    w = formats.dequantize(packed, scales, bits, gs, k)
                    x32 = x.astype(mx.float32)
                    ref = np.array(w).astype(np.float64) @ np.array(x32).astype(np.float64)
                    bound = gemv_bound(x32, w, mx.array(ref.astype(np.float32)), out_dtype=None, accum=FLOAT_RTOL,
                                       intdot=intdot)
                    cases.append(Case(shape_label(o, k, gs, False, [f"int{bits}"]), dtype_name(dtype),
                                      compare(y, ref, bound)))
        return cases

    return run


# -- the layer dispatch --------------------------------------------------------------------


def gpu_dispatch_cases() -> List[Tuple[mx.Dtype, int, int, int, Optional[int]]]:
    """``(dtype, bits, out, in, group size)`` of the GPU dispatch check: per dtype, the first
    case with a bias that a GPU family above already ran in that dtype (SIMT cases as
    PackedLinear runs them: int4 16-bit layers the matrix units take go to the MMA cases),
    so the dispatch and its first-use guard reuse a compiled kernel rather than build one."""
    ran = []
    for (o, k, gs, bias), dtype in zip(SIMT_CASES, gpu_case_dtypes(len(SIMT_CASES), DTYPES)):
        ran += [(dtype, bits, o, k, gs) for bits in (4, 8)
                if bias and not packed_gpu.supports_mma(bits, gs, k, o, dtype)]
    for (o, k, gs, bias), dtype in zip(MMA_CASES, gpu_case_dtypes(len(MMA_CASES), packed_gpu.MMA_DTYPES)):
        ran += [(dtype, packed_gpu.MMA_BITS, o, k, gs)] if bias else []
    return [next(c for c in ran if c[0] == dtype) for dtype in DTYPES if any(c[0] == dtype for c in ran)]


def _dispatch(plant: Optional[Plant]) -> List[Case]:
    """A ``PackedLinear`` decode call on this machine's path, first-use guard included.

    ``plant`` corrupts the layer's packed weights after the reference is
    taken, so the guard's fallback cannot hide it: the layer's output must
    then differ from the true weights' reference. On a GPU each dtype runs
    one of :func:`gpu_dispatch_cases` (a kernel compiled by the checks above).
    """
    cases = []
    if gpu.gpu_backend() is not None:
        runs = gpu_dispatch_cases()
    else:
        runs = [(dtype, bits, 67, 1152, 64) for dtype in DTYPES for bits in (4, 8)]
    for dtype, bits, o, k, gs in runs:
        packed, scales, x, b = make_case(o, k, bits, gs, dtype, True, seed=bits)
        layer = PackedLinear.from_linear(nn.Linear(k, o), bits=bits, group_size=gs)
        layer.weight, layer.scales, layer.bias = _planted(packed, bits, plant), scales, b
        path = backend_for(x, bits, k, o, gs)
        y = layer(x[None])[0]
        mx.eval(y)
        with mx.stream(mx.cpu):  # on a GPU, only the layer under test runs there
            ref = formats.reference_matmul(x, packed, scales, bits=bits, group_size=gs, in_features=k, bias=b)
            w = formats.dequantize(packed, scales, bits, gs, k)
            bound = gemv_bound(x, w, ref.astype(mx.float32), out_dtype=dtype,
                               intdot=path == "cpu" and layers.CPU_GEMV_PATH in ("auto", "intdot"))
            mx.eval(ref, bound)
        cases.append(Case(shape_label(o, k, gs, True, [f"int{bits}", f"via {path}"]), dtype_name(dtype),
                          compare(y, ref, bound)))
    return cases


def _dispatch_device() -> str:
    path = backend_for(mx.zeros((1152,)), 4, 1152, 67, 64)
    return gpu.device_label() if path in ("metal", "cuda") else ("cpu C" if path == "cpu" else f"{mx.default_device()}")


def checks() -> List[KernelCheck]:
    """The packed GEMV's checks, in the order the table prints them."""
    out = [
        KernelCheck(f"packed GEMV int{bits} SIMT", "a GPU (Metal or CUDA)", gpu.unavailable, gpu.device_label,
                    _simt(bits), shards=2)
        for bits in (4, 8)
    ]
    out.append(KernelCheck("packed GEMV int4 matrix-unit", "a GPU (Metal or CUDA)", gpu.unavailable,
                           gpu.device_label, _mma, shards=2))
    out.append(KernelCheck("packed GEMV int4 fused 2-3 outputs", "a GPU (Metal or CUDA)", gpu.unavailable,
                           gpu.device_label, _fused))
    out += [KernelCheck(f"C packed GEMV {path}", "the C kernels (built at install)", cpu.unavailable,
                        lambda p=path: _c_device(p), _c_path(path)) for path in C_PATHS]
    out.append(KernelCheck("PackedLinear decode dispatch", "any device", lambda: None, _dispatch_device,
                           _dispatch))
    return out


#: The registry entry of this family (``gearbx_mlx.selftest`` runs every module's ``CHECKS``).
CHECKS: Sequence[KernelCheck] = tuple(checks())

__all__ = ["CHECKS", "C_CASES", "C_PATHS", "DTYPES", "FUSED_CASES", "MMA_CASES", "SIMT_CASES", "checks",
           "make_case"]
