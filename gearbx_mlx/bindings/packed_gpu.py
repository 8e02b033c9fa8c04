"""Packed int4/int8 decode GEMV kernels for Metal and CUDA, built lazily.

The kernel text lives in ``metal_kernels/`` (one shared body, a small prelude
and entry per backend; see its README), after the format header
``metal_kernels/gearbx_format.h`` that the C kernels include too. This module
assembles it and builds ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``
objects on first use through :mod:`.gpu` (shared with the other GPU
kernels), which caches them; nothing is compiled at import. Every parameter baked into a
kernel (backend, bits, group size, rows per SIMD group, unroll, load width, variant, input
dtype, bias, and a hash of the source text) is in its name: MLX caches kernels
by name, in memory and, on CUDA, as PTX on disk.

The public entry point is :func:`gemv`; :func:`.gpu.gpu_backend` and
:func:`supports` tell a caller (``gearbx_mlx.packed.layers``) whether it applies.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..packed import formats
from . import gpu
from .gpu import DTYPE_TAG, SIMD_GROUPS, THREADS, constants_source
from .kernel_files import format_constant

#: Bit widths with a GPU kernel (int6/int2 use the reference).
KERNEL_BITS: Tuple[int, ...] = (4, 8)
#: Input dtypes the kernels read.
KERNEL_DTYPES: Tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
#: The matrix-unit variant (gemv_mma_body.inc): int4, 16-bit inputs, K a
#: multiple of 64 up to ``MMA_MAX_K``, per-row scales or groups of a multiple
#: of 64. Elsewhere the SIMT body runs.
MMA_BITS = 4
MMA_DTYPES: Tuple[mx.Dtype, ...] = (mx.float16, mx.bfloat16)
#: Rows of a matrix-unit threadgroup (two 8-row halves of a 16x16 operand).
MMA_ROWS = 16
#: Iterations (64 inputs each) whose loads a SIMD group issues together, per
#: row scales and with group scales (whose scales are loaded with the weights:
#: 4 would take 92 registers and halve the threadgroups per SM).
MMA_UNROLL = 2
MMA_UNROLL_GROUPS = 2


@dataclass(frozen=True)
class Tuning:
    """Work split of one kernel.

    rows: output rows per SIMD group (they share each input load);
    unroll: loads in flight per lane and row;
    vec: 32-bit words per load (4 = 16-byte loads; used where a row holds
    whole 16-byte chunks, else 1).
    """

    rows: int
    unroll: int
    vec: int = 1


#: Defaults per bit width: the best of the H100 sweep of scripts/bench_kernels.py
#: (benchmarks/results/kernels_nvidia_h100_80gb_hbm3.json; the spread between
#: the better settings was within 10%). Four rows per SIMD group share each
#: input load; 16-byte weight loads.
TUNING: Dict[int, Tuning] = {4: Tuning(rows=4, unroll=1, vec=4), 8: Tuning(rows=4, unroll=1, vec=4)}

#: Limits the kernels' threadgroup memory sets, read from the format header:
#: the largest K whose input vector the SIMT body stages (§8.1), and the
#: largest K of the matrix-unit variant.
_HEADER_LIMITS = {"SHARED_K": "GBX_SHARED_K", "MMA_MAX_K": "GBX_MMA_MAX_K"}


def __getattr__(name: str) -> int:
    # SHARED_K and MMA_MAX_K are read from metal_kernels/gearbx_format.h on first
    # use (not at import, and never restated here).
    if name in _HEADER_LIMITS:
        return format_constant(_HEADER_LIMITS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- sources --------------------------------------------------------------------


def kernel_sources(
    backend: str,
    has_bias: bool,
    directory: Optional[Path] = None,
    *,
    mma: bool = False,
    n_out: int = 1,
    compact: bool = False,
) -> Tuple[str, str]:
    """``(header, source)`` as handed to MLX for ``backend`` ("metal" or "cuda").

    ``mma`` picks the matrix-unit body (int4, 16-bit inputs) over the SIMT one;
    ``n_out`` > 1 (matrix-unit body only) writes rows to 2 or 3 outputs.
    ``directory`` replaces the package's sources (the syntax check uses it to
    compile a copy with a planted error); ``compact`` strips comments.
    """
    if n_out not in (1, 2, 3) or (n_out > 1 and not mma):
        raise ValueError(f"n_out must be 1, or 2-3 with the matrix-unit body, got {n_out}")
    # The bias and the output count are preprocessor switches, not template
    # arguments: without a bias input there is no `bias` name to refer to.
    return gpu.kernel_text(backend, ("gemv_common.h",), (("GBX_HAS_BIAS", has_bias), ("GBX_NOUT", n_out)),
                                 "gemv_mma_body.inc" if mma else "gemv_body.inc", directory, compact_text=compact)


def input_names(has_bias: bool) -> List[str]:
    return ["w", "scales", "x"] + (["bias"] if has_bias else [])


def output_names(n_out: int = 1) -> List[str]:
    return ["y", "y1", "y2"][:n_out]


@dataclass(frozen=True)
class Variant:
    """Overrides of a launch's kernel choice (benchmarks, tests, fused groups); ``None`` takes the default.

    tuning: :data:`TUNING`'s work split (the matrix-unit variant reads only
    ``unroll``); shared: the SIMT body's threadgroup-memory variant (default:
    used when K <= SHARED_K); mma: the matrix-unit variant (default: on where
    :func:`supports_mma`); splits: row boundaries of 2 or 3 outputs (matrix-unit
    variant only).
    """

    tuning: Optional[Tuning] = None
    shared: Optional[bool] = None
    mma: Optional[bool] = None
    splits: Tuple[int, ...] = ()


def variant_of(options: Dict[str, object]) -> Variant:
    """:class:`Variant` of a call's keyword options (``tuning``, ``shared``, ``mma``, ``splits``);
    TypeError names an unknown one."""
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Variant)})
    if unknown:
        raise TypeError(f"unknown packed GEMV option(s) {unknown}: take tuning, shared, mma, splits")
    v = Variant(**options)
    return v if isinstance(v.splits, tuple) else dataclasses.replace(v, splits=tuple(int(b) for b in v.splits))


@functools.lru_cache(maxsize=None)
def kernel_name(backend: str, bits: int, group_size: Optional[int], dtype: mx.Dtype, has_bias: bool,
                variant: Variant) -> str:
    """Name carrying every baked-in parameter, plus a hash of the source text.

    ``variant`` is resolved (its ``tuning`` set, ``shared`` and ``mma`` bools);
    ``variant.splits``: the output boundaries of a multi-output (fused) kernel.
    """
    mma, splits, tuning = bool(variant.mma), variant.splits, variant.tuning
    digest = gpu.digest(*kernel_sources(backend, has_bias, mma=mma, n_out=len(splits) + 1))
    gs = "row" if group_size is None else f"g{group_size}"
    bias = "bias" if has_bias else "nobias"
    if mma:
        outs = "_".join(f"s{b}" for b in splits)
        return (f"gbx_gemv_{backend}_mma_q{bits}_{gs}_u{tuning.unroll}_{DTYPE_TAG[dtype]}_"
                f"{bias}{'_' + outs if outs else ''}_{digest}")
    variant_tag = "shared" if variant.shared else "device"
    return (
        f"gbx_gemv_{backend}_q{bits}_{gs}_r{tuning.rows}_u{tuning.unroll}_v{tuning.vec}_"
        f"{variant_tag}_{DTYPE_TAG[dtype]}_{bias}_{digest}"
    )


# -- dispatch -----------------------------------------------------------------------


def supports(
    bits: int, group_size: Optional[int], in_features: int, out_features: int, dtype: mx.Dtype
) -> bool:
    """True if the GPU kernels handle this layer and input dtype.

    The kernels read 32-bit words of weights and aligned vectors of inputs: a
    row must hold whole words (K % 8 for int4, K % 4 for int8). Tiny layers
    (K < 32, O < 8) go to the reference: Metal passes arrays of fewer than 8
    elements in the constant address space, which the vector loads do not take.
    """
    if bits not in KERNEL_BITS or dtype not in KERNEL_DTYPES:
        return False
    if in_features % (32 // bits):
        return False
    if group_size is not None and (group_size % 32 or in_features % group_size):
        return False
    return in_features >= 32 and out_features >= 8


def supports_mma(
    bits: int, group_size: Optional[int], in_features: int, out_features: int, dtype: mx.Dtype
) -> bool:
    """True if the matrix-unit variant handles this layer (see :data:`MMA_MAX_K`)."""
    if not supports(bits, group_size, in_features, out_features, dtype):
        return False
    if bits != MMA_BITS or dtype not in MMA_DTYPES:
        return False
    if in_features % 64 or in_features > format_constant("GBX_MMA_MAX_K"):
        return False
    return group_size is None or group_size % 64 == 0


def constants(
    dtype: mx.Dtype, bits: int, group_size: Optional[int], tuning: Tuning, shared: bool
) -> List[Tuple[str, object]]:
    """The SIMT kernel's compile-time constants, by name (all of them are in its name)."""
    return [
        ("T", dtype),
        ("BITS", bits),
        ("GS", 0 if group_size is None else group_size),
        ("ROWS", tuning.rows),
        ("UNROLL", tuning.unroll),
        ("VEC", tuning.vec),
        ("SHARED", shared),
    ]


def mma_constants(
    dtype: mx.Dtype, group_size: Optional[int], unroll: int, splits: Tuple[int, ...] = ()
) -> List[Tuple[str, object]]:
    """The matrix-unit kernel's compile-time constants (all of them are in its name)."""
    consts: List[Tuple[str, object]] = [
        ("T", dtype), ("GS", 0 if group_size is None else group_size), ("UNROLL", unroll)]
    consts += [(f"OUT{i + 1}", b) for i, b in enumerate(splits)]
    return consts


def _tuning_for(bits: int, tuning: Optional[Tuning], in_features: int) -> Tuning:
    t = tuning or TUNING[bits]
    if t.rows < 1 or t.unroll < 1 or t.vec not in (1, 4):
        raise ValueError(f"rows and unroll must be >= 1 and vec 1 or 4, got {t}")
    if t.vec == 4 and (in_features * bits // 8) % 16:
        t = Tuning(t.rows, t.unroll, 1)  # rows of partial 16-byte chunks: word loads
    return t


def build_kernel(backend: str, name: str, has_bias: bool, consts_source: str, mma: bool = False,
                 n_out: int = 1) -> Callable:
    """The ``mx.fast`` kernel object of one variant (built once per process by :func:`.gpu.build`)."""
    header, source = kernel_sources(backend, has_bias, mma=mma, n_out=n_out, compact=True)
    return gpu.build(backend, name, tuple(input_names(has_bias)), tuple(output_names(n_out)), header,
                           gpu.compact(consts_source) + source)


def _check_splits(splits: Tuple[int, ...], mma: bool, out_features: int) -> None:
    if splits and (not mma or len(splits) > 2 or list(splits) != sorted(set(splits)) or not 0 < splits[0]
                   or splits[-1] >= out_features):
        raise ValueError(f"splits must be 1-2 increasing row boundaries inside (0, {out_features}) "
                         f"of a matrix-unit kernel, got {splits}")


def _resolve(variant: Variant, bits: int, group_size: Optional[int], x: mx.array, out_features: int) -> Variant:
    """``variant`` with every default taken (tuning set, shared and mma bools), or ValueError."""
    in_features = x.shape[-1]
    can_mma = supports_mma(bits, group_size, in_features, out_features, x.dtype)
    mma = can_mma if variant.mma is None else variant.mma
    if mma and not can_mma:
        raise ValueError(
            f"the matrix-unit variant takes int4, float16/bfloat16 inputs and K % 64 == 0, "
            f"K <= {format_constant('GBX_MMA_MAX_K')}: got int{bits}, {x.dtype}, K={in_features}, "
            f"group_size={group_size}")
    _check_splits(variant.splits, mma, out_features)
    if mma:
        default = MMA_UNROLL if group_size is None else MMA_UNROLL_GROUPS
        unroll = variant.tuning.unroll if variant.tuning else default
        return Variant(Tuning(MMA_ROWS, unroll, 1), False, True, variant.splits)
    shared_k = format_constant("GBX_SHARED_K")
    shared = in_features <= shared_k if variant.shared is None else variant.shared
    if shared and in_features > shared_k:
        raise ValueError(f"the threadgroup-memory variant holds K <= {shared_k}, got {in_features}")
    return Variant(_tuning_for(bits, variant.tuning, in_features), bool(shared), False, variant.splits)


def launch_spec(
    backend: str,
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    bias: Optional[mx.array],
    *,
    bits: int,
    group_size: Optional[int],
    **options: object,
) -> dict:
    """Everything :func:`gemv` passes to MLX, without building or running anything.

    ``options``: :class:`Variant`'s ``tuning``, ``shared``, ``mma``, ``splits``
    (``mma`` forces the matrix-unit variant on or off, default on where
    :func:`supports_mma`; ``shared`` the SIMT body's threadgroup-memory
    variant, default used when K <= SHARED_K; ``splits``, matrix-unit variant
    only: row boundaries of 2 or 3 outputs). Split out so the argument
    plumbing is tested on any machine.
    """
    in_features = x.shape[-1]
    if x.size != in_features:
        raise ValueError(f"the GEMV takes one input vector (K values), got shape {x.shape}")
    out_features = weight.shape[0]
    if not supports(bits, group_size, in_features, out_features, x.dtype):
        raise ValueError(
            f"no GPU kernel for int{bits}, group_size={group_size}, shape "
            f"({out_features}, {in_features}), input {x.dtype}: use the reference path"
        )
    v = _resolve(variant_of(options), bits, group_size, x, out_features)
    has_bias = bias is not None
    bounds = (0,) + v.splits + (out_features,)
    out_shapes = [x.shape[:-1] + (b - a,) for a, b in zip(bounds, bounds[1:])]
    if v.mma:
        n_groups = -(-out_features // MMA_ROWS)
        consts = mma_constants(x.dtype, group_size, v.tuning.unroll, v.splits)
    else:
        n_groups = -(-out_features // (SIMD_GROUPS * v.tuning.rows))
        consts = constants(x.dtype, bits, group_size, v.tuning, v.shared)
    return dict(
        name=kernel_name(backend, bits, group_size, x.dtype, has_bias, v),
        has_bias=has_bias,
        mma=v.mma,
        n_out=len(out_shapes),
        inputs=[weight, scales, x] + ([bias] if has_bias else []),
        constants=consts,
        # Both MLX back ends take the grid in threads, not threadgroups.
        grid=(n_groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=[x.dtype] * len(out_shapes),
    )


Launcher = Callable[..., mx.array]


@functools.lru_cache(maxsize=None)
def launcher(
    backend: str,
    bits: int,
    group_size: Optional[int],
    in_features: int,
    out_features: int,
    dtype: mx.Dtype,
    has_bias: bool,
    **options: object,
) -> Launcher:
    """A cached ``run(x, weight, scales, bias) -> y`` for one layer shape and dtype.

    ``options``: :class:`Variant`'s fields, as :func:`launch_spec` takes them.
    Everything but the arrays is worked out once, so a decode step pays only
    for MLX's own kernel call (a model has a few hundred of them per token).
    ``x`` may keep leading dims of size 1; ``y`` then has them too, so no
    reshape (each one an extra graph node) surrounds the kernel. With
    ``splits``, ``run`` returns the list of outputs. The kernel itself is
    compiled by MLX on the first evaluation.
    """
    x = mx.zeros((in_features,), dtype=dtype)  # shapes and dtypes only, never evaluated
    w = mx.zeros(formats.packed_shape(out_features, in_features, bits), formats.packed_dtype(bits))
    s = mx.zeros((out_features, formats.n_groups(in_features, group_size)))
    b = mx.zeros((out_features,), dtype=dtype) if has_bias else None
    spec = launch_spec(backend, x, w, s, b, bits=bits, group_size=group_size, **options)
    kernel = build_kernel(backend, spec["name"], has_bias, constants_source(backend, spec["constants"]),
                          spec["mma"], spec["n_out"])
    return _runner(kernel, spec)


def _runner(kernel: Callable, spec: dict) -> Launcher:
    """The per-call function of :func:`launcher` (one output, or the list of a split launch)."""
    grid, threadgroup, out_dtypes = spec["grid"], spec["threadgroup"], spec["output_dtypes"]
    tails = [shape[-1:] for shape in spec["output_shapes"]]

    if len(tails) == 1:
        out_tail = tails[0]

        def run(x: mx.array, weight: mx.array, scales: mx.array,
                bias: Optional[mx.array] = None) -> mx.array:
            inputs = [weight, scales, x] if bias is None else [weight, scales, x, bias]
            return kernel(inputs=inputs, grid=grid, threadgroup=threadgroup,
                          output_shapes=[x.shape[:-1] + out_tail], output_dtypes=out_dtypes)[0]

        run.kernel_name = spec["name"]  # what the first-use guard's warning names
        return run

    def run_split(x: mx.array, weight: mx.array, scales: mx.array,
                  bias: Optional[mx.array] = None) -> List[mx.array]:
        inputs = [weight, scales, x] if bias is None else [weight, scales, x, bias]
        lead = x.shape[:-1]
        return kernel(inputs=inputs, grid=grid, threadgroup=threadgroup,
                      output_shapes=[lead + t for t in tails], output_dtypes=out_dtypes)

    run_split.kernel_name = spec["name"]
    return run_split


def gemv(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    bias: Optional[mx.array] = None,
    *,
    bits: int,
    group_size: Optional[int],
    backend: Optional[str] = None,
    **options: object,
):
    """``y = dequantize(weight, scales) @ x (+ bias)`` with the packed kernel.

    Args:
        x: ``(..., K)`` with leading dims of size 1; float32, float16 or bfloat16.
        weight: packed ``(O, K*bits/8)`` storage (uint8 int4 / int8 int8).
        scales: ``(O, K/group_size)`` or ``(O, 1)`` float32.
        bias: ``(O,)`` or None.
        backend: "metal" or "cuda"; default :func:`.gpu.gpu_backend`.
        options: :class:`Variant`'s ``tuning``, ``shared``, ``mma`` (override
            :data:`TUNING` and the variant: benchmarks, tests; the matrix-unit
            variant reads only ``tuning.unroll``) and ``splits`` (row
            boundaries: return the rows in 2 or 3 arrays, one launch).

    Returns:
        ``(..., O)`` in ``x.dtype``; with ``splits``, a list of ``(..., O_i)``.
    """
    backend = backend or gpu.gpu_backend()
    if backend is None:
        raise ValueError(
            "no GPU back end on the default device: call gearbx_mlx.packed.formats.reference_matmul"
        )
    in_features = x.shape[-1]
    if x.size != in_features:
        raise ValueError(f"the GEMV takes one input vector (K values), got shape {x.shape}")
    if not supports(bits, group_size, in_features, weight.shape[0], x.dtype):
        raise ValueError(
            f"no GPU kernel for int{bits}, group_size={group_size}, shape "
            f"({weight.shape[0]}, {in_features}), input {x.dtype}: use the reference path"
        )
    v = variant_of(options)
    run = launcher(backend, bits, group_size, in_features, weight.shape[0], x.dtype, bias is not None,
                   **{f.name: getattr(v, f.name) for f in dataclasses.fields(v)})
    return run(x, weight, scales, bias)
