"""The nested-plane GEMV on Metal and CUDA: one launch reads a gear's 1-3 planes.

A gear of nested planes (``gearbx_mlx.nested.planes``) is ``y = sum_p 2**-e_p
* (x @ deq(plane p).T)``; with stock MLX that is one ``mx.quantized_matmul``
per plane. ``metal_kernels/nested_gemv_body.inc`` reads every plane of the gear
in one pass over the rows, for one input vector (decode), with the prelude and
entry of the packed kernels (:mod:`.gpu`): one body, a Metal source and its
CUDA twin. Every baked parameter (backend, plane bits and group sizes, x
dtype, scale dtype, bias, rows per SIMD group, chunk width, staging, source
hash) is in the kernel's name.

:func:`nested_gemv` is the entry point; it returns ``None`` where the kernel
does not apply (no GPU, several input rows, unsupported bits, dtypes or
shapes), so a caller falls back to the pure-MLX oracle. Planes are passed as
objects with ``weight``, ``scales``, ``biases``, ``bits``, ``group_size`` and
``exponent`` (``gearbx_mlx.nested.planes.Plane``); this module does not import
the nested package, which sits above the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx

from ..mlx_tables import GROUP_SIZES
from . import gpu
from .gpu import DTYPE_TAG, SIMD_GROUPS, THREADS, constants_source
from .kernel_files import format_constant

#: Plane bit widths the body reads (others take the oracle). 6-bit codes are
#: MLX's bit stream (four codes in three bytes); a chunk of them is whole
#: words only for an even ``vec``.
NESTED_BITS: Tuple[int, ...] = (4, 6, 8)
#: Group sizes of MLX's affine quantization.
NESTED_GROUP_SIZES: Tuple[int, ...] = GROUP_SIZES
#: dtypes of x and of the planes' scales and biases.
NESTED_DTYPES: Tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)


class PlaneLike(Protocol):
    """What the launcher reads of a plane (``gearbx_mlx.nested.planes.Plane``)."""

    weight: mx.array  # (out, in * bits / 32) uint32
    scales: mx.array  # (out, in / group_size)
    biases: mx.array  # (out, in / group_size)
    bits: int
    group_size: int
    exponent: int


@dataclass(frozen=True)
class NestedTuning:
    """Work split of the nested body.

    rows: output rows per SIMD group (they share each input chunk);
    vec: 32-bit words of a 4-bit plane per lane chunk, so a chunk is
    ``8 * vec`` inputs (an 8-bit plane reads ``2 * vec`` words of it);
    ksplit: 1, or 8: the threadgroup's eight SIMD groups share its ``rows``
    rows, each summing every eighth stripe of K (8x the threadgroups);
    xsums: where x is staged in threadgroup memory, the sum of every 8 inputs
    is staged beside it, so a chunk's sum of x (the biases' term) is ``vec``
    reads instead of ``8 * vec`` additions per row block (ignored unstaged);
    biased: 4-bit codes are read as biased floats, a mask-and-or and a
    multiply-add each, with no subtraction per code; each chunk subtracts the
    biases' product once (``gbx_dot8_biased4`` in ``nested_common.h``);
    biased6: 6-bit codes are read as biased floats too, a pair of codes
    brought into place by one shift (``gbx_dot8_biased6``);
    stage: x is staged in threadgroup memory where K allows it (False: every
    lane reads x from device memory, through the L1 cache, and a threadgroup
    holds no staging buffer, so more of them fit on a core);
    int8x: where every plane read has 4 bits, ``vec`` is 4 and K is at most
    ``GBX_INT8_K``, each threadgroup rounds x to int8 once (one step
    ``max|x| / 127`` per 32 inputs, the C kernels' int-dot rounding) and
    reads a word of codes with two 4-way integer dot products instead of
    eight multiply-adds (:func:`int8x_applies` says where; ``xsums``,
    ``biased`` and ``stage`` then do not apply). The package asks for it per
    gear (``NestedKernelConfig.gpu_int8x_plans``), never by default here.
    """

    rows: int
    vec: int
    ksplit: int = 1
    xsums: bool = False
    biased: bool = False
    stage: bool = True
    int8x: bool = False
    biased6: bool = False


#: Defaults by the number of planes a gear reads, for the package's default
#: plan (4/64, 4/32, 6/64). One plane: the best (geometric mean over
#: 4096x4096 and 14336x4096) of the H200 sweep of scripts/bench_nested_gpu.py
#: (benchmarks/results/nested_gpu_h200_default_plan.json). Two and three: the
#: split that was best or within the sweep's noise at all four of
#: Llama-3-8B's shapes in scripts/sweep_nested_gemv_gpu.py on an H200
#: (benchmarks/results/nested_gemv_sweep_h200.json): two rows, biased codes,
#: x read from device memory; the three-plane gear reads its 6-bit plane's
#: codes biased too, which took its products to 0.92-0.97x their time at the
#: four shapes (benchmarks/results/nested_gemv_sweep_h200_biased6.json).
#: Metal takes the same splits, unmeasured.
TUNING: Dict[int, NestedTuning] = {
    1: NestedTuning(rows=4, vec=4),
    2: NestedTuning(rows=2, vec=4, biased=True, stage=False),
    3: NestedTuning(rows=2, vec=4, biased=True, stage=False, biased6=True),
}
#: A default tuning's rows per SIMD group shrink (to 1 at least) until the
#: launch has this many threadgroups: a GPU of ~100+ cores needs one or more
#: per core to keep memory busy, and a small matrix (Llama-3-8B's 1024-row
#: k/v projections) at 4 rows per SIMD group would get 32.
MIN_THREADGROUPS = 128


# -- sources and names ----------------------------------------------------------------


def kernel_sources(
    backend: str, n_planes: int, has_bias: bool, directory: Optional[Path] = None, *, compact: bool = False
) -> Tuple[str, str]:
    """``(header, source)`` as handed to MLX: the format header, the backend's
    prelude, the shared helpers; then the entry and the nested body."""
    if n_planes not in (1, 2, 3):
        raise ValueError(f"a gear reads 1 to 3 planes, got {n_planes}")
    # Plane count and bias are preprocessor switches: the names of absent
    # inputs (w2, bias) must not appear in the compiled text.
    return gpu.kernel_text(backend, ("gemv_common.h", "nested_common.h"),
                                 (("GBX_NPLANES", n_planes), ("GBX_HAS_BIAS", has_bias)), "nested_gemv_body.inc",
                                 directory, compact_text=compact)


def input_names(n_planes: int, has_bias: bool) -> List[str]:
    names = ["x"]
    for p in range(n_planes):
        names += [f"w{p}", f"s{p}", f"b{p}"]
    return names + ["factors"] + (["bias"] if has_bias else [])


def constants(
    dtype: mx.Dtype, scale_dtype: mx.Dtype, bits: Tuple[int, ...], group_sizes: Tuple[int, ...],
    tuning: NestedTuning, shared: bool,
) -> List[Tuple[str, object]]:
    """The body's compile-time constants, by name (all of them are in its name).
    Planes a gear does not read get plane 0's bits and group (their code is
    compiled, never run)."""
    b = tuple(bits) + (bits[0],) * (3 - len(bits))
    g = tuple(group_sizes) + (group_sizes[0],) * (3 - len(group_sizes))
    return [("T", dtype), ("S", scale_dtype), ("B0", b[0]), ("B1", b[1]), ("B2", b[2]),
            ("GS0", g[0]), ("GS1", g[1]), ("GS2", g[2]), ("ROWS", tuning.rows), ("VEC", tuning.vec),
            ("KSPLIT", tuning.ksplit), ("SHARED", shared), ("XSUMS", bool(tuning.xsums and shared)),
            ("BIASED", bool(tuning.biased and not tuning.int8x)), ("INT8X", bool(tuning.int8x)),
            ("BIASED6", bool(tuning.biased6 and not tuning.int8x))]


@functools.lru_cache(maxsize=None)
def kernel_name(
    backend: str, bits: Tuple[int, ...], group_sizes: Tuple[int, ...], tuning: NestedTuning, shared: bool,
    dtype: mx.Dtype, scale_dtype: mx.Dtype, has_bias: bool,
) -> str:
    digest = gpu.digest(*kernel_sources(backend, len(bits), has_bias))
    plan = "_".join(f"q{b}g{g}" for b, g in zip(bits, group_sizes))
    staged = ('shared_xsums' if tuning.xsums else 'shared') if shared else 'device'
    codes = "_i8x" if tuning.int8x else ("_biased" if tuning.biased else "") + ("_b6" if tuning.biased6 else "")
    return (f"gbx_nested_{backend}_{plan}_r{tuning.rows}_v{tuning.vec}_k{tuning.ksplit}{codes}_"
            f"{staged}_{DTYPE_TAG[dtype]}_s{DTYPE_TAG[scale_dtype]}_"
            f"{'bias' if has_bias else 'nobias'}_{digest}")


# -- where it applies -----------------------------------------------------------------


def supports(
    bits: Sequence[int], group_sizes: Sequence[int], in_features: int, out_features: int, dtype: mx.Dtype,
    scale_dtype: mx.Dtype,
) -> bool:
    """True if the body handles a gear of planes of these ``bits`` and ``group_sizes``.

    Every plane must share the scale dtype (as ``build_planes`` makes them).
    Tiny layers (K < 32, O < 8) take the oracle: Metal passes arrays of fewer
    than 8 elements in the constant address space, which the vector loads do
    not take.
    """
    if not 1 <= len(bits) <= format_constant("GBX_MAX_PLANES") or any(b not in NESTED_BITS for b in bits):
        return False
    if len(group_sizes) != len(bits) or any(g not in NESTED_GROUP_SIZES or in_features % g for g in group_sizes):
        return False
    if dtype not in NESTED_DTYPES or scale_dtype not in NESTED_DTYPES:
        return False
    return in_features >= 32 and out_features >= 8


def _plan_of(planes: Sequence[PlaneLike], n: int) -> Tuple[Tuple[int, ...], Tuple[int, ...], mx.Dtype, int, int]:
    """(bits, group sizes, scale dtype, out, in) of the first ``n`` planes, or ValueError."""
    if not 1 <= n <= len(planes):
        raise ValueError(f"a gear reads 1 to {len(planes)} planes, got {n}")
    used = planes[:n]
    sdt = used[0].scales.dtype
    if any(p.scales.dtype != sdt or p.biases.dtype != sdt for p in used):
        raise ValueError("the nested GPU kernel needs one scale dtype across a gear's planes")
    out_features, words = used[0].weight.shape
    return (tuple(p.bits for p in used), tuple(p.group_size for p in used), sdt, out_features,
            words * 32 // used[0].bits)


def factors_of(planes: Sequence[PlaneLike], n: int) -> mx.array:
    """float32 ``(n,)``: ``2**-exponent`` of each plane read (exact)."""
    return mx.array([2.0 ** -p.exponent for p in planes[:n]], dtype=mx.float32)


# -- launch ---------------------------------------------------------------------------


def int8x_applies(backend: str, bits: Sequence[int], in_features: int, vec: int) -> bool:
    """True where :attr:`NestedTuning.int8x` can run: on CUDA (its 4-way integer
    dot product is one instruction; Apple GPUs have none, so Metal keeps float
    activations), every plane read of 4 bits, ``vec`` 4 (one int8 step per
    chunk of 32 inputs) and K at most ``GBX_INT8_K`` (the staged int8 x)."""
    return (backend == "cuda" and all(b == 4 for b in bits) and vec == 4
            and in_features <= format_constant("GBX_INT8_K"))


def default_tuning(n: int, out_features: int) -> NestedTuning:
    """:data:`TUNING` of a gear of ``n`` planes, its rows shrunk for a small
    matrix so that the launch keeps :data:`MIN_THREADGROUPS` threadgroups."""
    t = TUNING[n]
    rows = t.rows
    while rows > 1 and -(-out_features // (SIMD_GROUPS // t.ksplit * rows)) < MIN_THREADGROUPS:
        rows //= 2
    return t if rows == t.rows else dataclasses.replace(t, rows=rows)


def int8x_tuning(n: int, out_features: int) -> NestedTuning:
    """The split of a gear of ``n`` 4-bit planes with x rounded to int8
    (:attr:`NestedTuning.int8x`): :func:`default_tuning`'s rows, ``vec`` 4."""
    return dataclasses.replace(default_tuning(n, out_features), vec=4, int8x=True)


def launch_spec(
    backend: str, x: mx.array, planes: Sequence[PlaneLike], n: int, has_bias: bool, *,
    tuning: Optional[NestedTuning] = None, shared: Optional[bool] = None,
) -> dict:
    """Everything :func:`nested_gemv` passes to MLX, without building or running
    anything (so the argument plumbing is tested on any machine)."""
    bits, gs, sdt, out_features, in_features = _plan_of(planes, n)
    if x.shape[-1] != in_features or x.size != in_features:
        raise ValueError(f"the nested GEMV takes one input vector of {in_features} values, got shape {x.shape}")
    if not supports(bits, gs, in_features, out_features, x.dtype, sdt):
        raise ValueError(f"no nested GPU kernel for planes {bits}, groups {gs}, shape ({out_features}, "
                         f"{in_features}), x {x.dtype}, scales {sdt}: use the reference")
    t = tuning or default_tuning(n, out_features)
    if t.int8x and not int8x_applies(backend, bits, in_features, t.vec):
        raise ValueError(f"int8 activations need CUDA, 4-bit planes, vec 4 and K <= "
                         f"{format_constant('GBX_INT8_K')}: got {backend}, planes {bits}, K {in_features}, {t}")
    if t.rows < 1 or t.vec not in (1, 2, 4) or 8 * t.vec > min(gs):
        raise ValueError(f"rows >= 1 and vec 1, 2 or 4 with 8 * vec <= the smallest group {min(gs)}, got {t}")
    if t.ksplit not in (1, SIMD_GROUPS):
        raise ValueError(f"ksplit is 1 or {SIMD_GROUPS} (the SIMD groups of a threadgroup), got {t}")
    if 6 in bits and t.vec % 2:
        raise ValueError(f"a 6-bit plane needs an even vec (a chunk of 8 * vec codes in whole words), got {t}")
    shared_k = format_constant("GBX_SHARED_K")
    if shared is None:
        shared = t.stage and not t.int8x and in_features <= shared_k
    elif shared and t.int8x:
        raise ValueError("int8 activations stage x as int8: the float staging (shared=True) does not apply")
    elif shared and in_features > shared_k:
        raise ValueError(f"the threadgroup-memory variant holds K <= {shared_k}, got {in_features}")
    n_groups = -(-out_features // (SIMD_GROUPS // t.ksplit * t.rows))
    return dict(
        name=kernel_name(backend, bits, gs, t, bool(shared), x.dtype, sdt, has_bias),
        n_planes=n,
        has_bias=has_bias,
        input_names=input_names(n, has_bias),
        constants=constants(x.dtype, sdt, bits, gs, t, bool(shared)),
        grid=(n_groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape[:-1] + (out_features,)],
        output_dtypes=[x.dtype],
    )


def build_kernel(backend: str, name: str, n_planes: int, has_bias: bool, consts_source: str) -> Callable:
    """The ``mx.fast`` kernel object of one variant (built once per process by :func:`.gpu.build`)."""
    header, source = kernel_sources(backend, n_planes, has_bias, compact=True)
    return gpu.build(backend, name, tuple(input_names(n_planes, has_bias)), ("y",), header,
                           gpu.compact(consts_source) + source)


class Launcher:
    """The compiled kernel of one gear's shape: ``run(x, arrays, factors, bias=None) -> y``.

    ``arrays`` is ``[w0, s0, b0, w1, s1, b1, ...]`` of the planes read, and
    ``factors`` their float32 ``(n,)`` factors. :meth:`bound` fixes them for
    a matrix: the per-call path of a decode step, which does no more than the
    launch needs (output shapes cached by input shape).
    """

    def __init__(self, kernel: Callable, grid: tuple, threadgroup: tuple, dtype: mx.Dtype, out_features: int,
                 has_bias: bool) -> None:
        self.kernel, self.grid, self.threadgroup = kernel, grid, threadgroup
        self.out_dtypes = [dtype]
        self.dtype, self.out_features, self.has_bias = dtype, out_features, has_bias

    def __call__(self, x: mx.array, arrays: List[mx.array], factors: mx.array,
                 bias: Optional[mx.array] = None) -> mx.array:
        inputs = [x, *arrays, factors] if bias is None else [x, *arrays, factors, bias]
        return self.kernel(inputs=inputs, grid=self.grid, threadgroup=self.threadgroup,
                           output_shapes=[x.shape[:-1] + (self.out_features,)], output_dtypes=self.out_dtypes)[0]

    def bound(self, arrays: List[mx.array], factors: mx.array) -> Callable[[mx.array, tuple, Optional[mx.array]],
                                                                          mx.array]:
        """``run(x, x_shape, bias) -> y`` with the planes' arrays fixed. ``x_shape``
        is ``x.shape`` (the caller has read it); ``bias`` is cast to x's dtype if needed."""
        kernel, grid, threadgroup, out_dtypes = self.kernel, self.grid, self.threadgroup, self.out_dtypes
        dtype, tail, has_bias = self.dtype, (self.out_features,), self.has_bias
        rest = [*arrays, factors]
        out_shapes: Dict[tuple, List[tuple]] = {}

        def run(x: mx.array, shape: tuple, bias: Optional[mx.array]) -> mx.array:
            shapes = out_shapes.get(shape)
            if shapes is None:
                shapes = out_shapes[shape] = [shape[:-1] + tail]
            if has_bias:
                if bias.dtype != dtype:
                    bias = bias.astype(dtype)
                inputs = [x, *rest, bias]
            else:
                inputs = [x, *rest]
            return kernel(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=shapes,
                          output_dtypes=out_dtypes)[0]

        return run


def compiled(run: Callable[[mx.array, tuple, Optional[mx.array]], mx.array],
             has_bias: bool) -> Callable[[mx.array, tuple, Optional[mx.array]], mx.array]:
    """:meth:`Launcher.bound`'s ``run`` wrapped in ``mx.compile``: the same signature and result.

    A custom-kernel call builds a new primitive each time (its source text
    copied in); a compiled call replays the traced node, retraced only for a
    new input shape or dtype. The planes' arrays are captured (they never change).
    """
    if has_bias:
        traced_bias = mx.compile(lambda x, bias: run(x, x.shape, bias))
        return lambda x, shape, bias: traced_bias(x, bias)
    traced = mx.compile(lambda x: run(x, x.shape, None))
    return lambda x, shape, bias: traced(x)


class _ShapeOnly:
    """Stands in for a plane in :func:`launcher`: shapes and dtypes, never evaluated."""

    def __init__(self, bits: int, group_size: int, out_features: int, in_features: int, dtype: mx.Dtype):
        self.bits, self.group_size, self.exponent = bits, group_size, 0
        self.weight = mx.zeros((out_features, in_features * bits // 32), dtype=mx.uint32)
        self.scales = self.biases = mx.zeros((out_features, in_features // group_size), dtype=dtype)


@functools.lru_cache(maxsize=None)
def launcher(
    backend: str, bits: Tuple[int, ...], group_sizes: Tuple[int, ...], in_features: int, out_features: int,
    dtype: mx.Dtype, scale_dtype: mx.Dtype, has_bias: bool, **options: object,
) -> Launcher:
    """A cached :class:`Launcher` ``run(x, arrays, factors, bias=None) -> y`` for one gear's shape.

    ``arrays`` is ``[w0, s0, b0, w1, s1, b1, ...]`` of the planes read, and
    ``factors`` their float32 ``(n,)`` factors; everything else is worked out
    once. ``x`` may keep leading dims of size 1; ``y`` has them too.
    ``options``: ``tuning`` and ``shared``, as :func:`launch_spec` takes them
    (tests, benchmarks).
    """
    unknown = sorted(set(options) - {"tuning", "shared"})
    if unknown:
        raise TypeError(f"unknown nested GEMV option(s) {unknown}: take tuning, shared")
    shapes = [_ShapeOnly(b, g, out_features, in_features, scale_dtype) for b, g in zip(bits, group_sizes)]
    x = mx.zeros((in_features,), dtype=dtype)  # shapes and dtypes only
    spec = launch_spec(backend, x, shapes, len(bits), has_bias, **options)
    kernel = build_kernel(backend, spec["name"], len(bits), has_bias, constants_source(backend, spec["constants"]))
    run = Launcher(kernel, spec["grid"], spec["threadgroup"], dtype, out_features, has_bias)
    run.kernel_name = spec["name"]  # what the first-use guard's warning names
    return run


def plane_arrays(planes: Sequence[PlaneLike], n: int) -> List[mx.array]:
    """``[w0, s0, b0, w1, ...]`` of the first ``n`` planes, in the kernel's input order."""
    return [a for p in planes[:n] for a in (p.weight, p.scales, p.biases)]


def nested_gemv(
    x: mx.array, planes: Sequence[PlaneLike], n: int, bias: Optional[mx.array] = None, *,
    backend: Optional[str] = None, tuning: Optional[NestedTuning] = None, shared: Optional[bool] = None,
) -> Optional[mx.array]:
    """``x @ (sum of the first n planes' dequantizations).T (+ bias)`` in one launch.

    Args:
        x: ``(..., in)`` with leading dims of size 1 (one token); float32,
            float16 or bfloat16.
        planes: the matrix's planes (``Plane``); ``n`` of them are read.
        bias: ``(out,)`` in ``x.dtype``, or None.
        backend: "metal" or "cuda" (default: the default device's GPU).
        tuning, shared: override :data:`TUNING` and the staging (tests, benchmarks).

    Returns:
        ``(..., out)`` in ``x.dtype``; None where the kernel does not apply (no
        GPU back end, several input rows, or planes/shapes/dtypes outside
        :func:`supports`): the caller then takes ``reference_matmul``.
    """
    backend = backend or gpu.gpu_backend()
    if backend is None or not 1 <= n <= len(planes):
        return None
    bits, gs, sdt, out_features, in_features = _plan_of(planes, n)
    if x.size != in_features or x.shape[-1] != in_features:
        return None
    if not supports(bits, gs, in_features, out_features, x.dtype, sdt):
        return None
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.astype(x.dtype)
    run = launcher(backend, bits, gs, in_features, out_features, x.dtype, sdt, bias is not None, tuning=tuning,
                   shared=shared)
    return run(x, plane_arrays(planes, n), factors_of(planes, n), bias)
