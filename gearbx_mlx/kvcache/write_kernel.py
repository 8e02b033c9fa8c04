"""The KV cache's write step as one GPU launch: keys and values into MLX's affine format.

A rotated cache (:class:`gearbx_mlx.kvcache.cache.RotatedQuantizedKVCache`)
stores, per layer and step, ``quantize(keys - key_offset)`` and
``quantize(values)`` (:func:`gearbx_mlx.kvcache.quantize.quantize_step`):
about forty small MLX ops for the least-squares quantizer. The kernel
``metal_kernels/kv_write_body.inc`` (helpers in ``kv_write_common.h``) does
both in one launch, one thread per group of ``group_size`` elements: the
offset subtracted in the keys' dtype, MLX's GPU min-max grid, the
least-squares refit in float32, and the codes packed into MLX's bit stream.
One body for Metal (``mx.fast.metal_kernel``) and CUDA (``mx.fast.cuda_kernel``)
with the preludes and entries of :mod:`gearbx_mlx.bindings.gpu`, which builds it.

Its output equals the MLX path's except at rounding ties: its sums run in
another order than MLX's reductions, and MLX's GPU dequantize (which the
least-squares step compares against) may fuse a product into an add where
the kernel rounds twice (``tests/test_kv_write_kernel.py`` bounds how often
groups differ, and by how much). MLX's CPU quantizer differs from its GPU kernels
(round half to even; the maximum not clamped at 0), so on the CPU the MLX
path is the reference, and :func:`write` takes it there.

Entry points: :func:`write` (the kernel on a GPU, the MLX ops otherwise),
:func:`fused_write` (the kernel), :func:`reference_write` (the MLX ops),
:func:`available`. Nothing is read or compiled at import.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from ..bindings import gpu, kernel_files
from ..bindings.gpu import DTYPE_TAG
from .quantize import QUANTIZERS, SUPPORTED_BITS, SUPPORTED_GROUPS, check_bits_group, quantize_step

Quantized = Tuple[mx.array, mx.array, mx.array]

#: Input dtypes the kernel reads (scales and biases are written in the same).
KERNEL_DTYPES: Tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
#: Refits of the least-squares quantizer (``quantize_ls``'s default ``iters``).
LS_ITERS = 2
#: Largest element count of keys or values one launch takes (int32 indices).
MAX_ELEMENTS = 2**31 - 1

_COMMON = "kv_write_common.h"
_BODY = "kv_write_body.inc"


# -- sources and names ----------------------------------------------------------------


def kernel_sources(backend: str, has_offset: bool, directory: Optional[Path] = None, *,
                   compact: bool = False) -> Tuple[str, str]:
    """``(header, source)`` as handed to MLX: format header, prelude, ``gemv_common.h``,
    ``kv_write_common.h``; then the entry and the body (``directory`` replaces the package's)."""
    # The offset is a preprocessor switch: without it there is no key_offset input.
    return gpu.kernel_text(backend, ("gemv_common.h", _COMMON), (("GBX_KV_OFFSET", has_offset),), _BODY, directory,
                           compact_text=compact)


@functools.lru_cache(maxsize=None)
def threads_per_group(directory: Optional[Path] = None) -> int:
    """``GBX_KV_THREADS`` of ``kv_write_common.h``: the launch's threadgroup size."""
    d = Path(directory) if directory is not None else kernel_files.source_dir()
    return kernel_files.parse_defines(kernel_files.read(d, _COMMON))["GBX_KV_THREADS"]


def input_names(has_offset: bool) -> List[str]:
    return ["keys", "values"] + (["key_offset"] if has_offset else [])


def output_names() -> List[str]:
    return ["kw", "ks", "kb", "vw", "vs", "vb"]


def constants(dtype: mx.Dtype, bits: int, group_size: int, quantizer: str) -> List[Tuple[str, object]]:
    """The body's compile-time constants, by name (every one of them is in the kernel's name)."""
    return [("T", dtype), ("BITS", bits), ("GS", group_size), ("LS", quantizer == "ls"), ("ITERS", LS_ITERS)]


@functools.lru_cache(maxsize=None)
def kernel_name(backend: str, bits: int, group_size: int, quantizer: str, dtype: mx.Dtype,
                has_offset: bool) -> str:
    """Every baked parameter, plus a hash of the source text (MLX caches kernels by name)."""
    digest = gpu.digest(*kernel_sources(backend, has_offset))
    quant = f"ls{LS_ITERS}" if quantizer == "ls" else "minmax"
    return (f"gbx_kvwrite_{backend}_q{bits}_g{group_size}_{quant}_{DTYPE_TAG[dtype]}_"
            f"{'off' if has_offset else 'nooff'}_{digest}")


# -- where it applies -----------------------------------------------------------------


def supports(bits: int, group_size: int, k_dim: int, v_dim: int, dtype: mx.Dtype,
             quantizer: str = "minmax") -> bool:
    """True if the kernel writes keys of ``k_dim`` and values of ``v_dim`` channels in ``dtype``."""
    return (bits in SUPPORTED_BITS and group_size in SUPPORTED_GROUPS and quantizer in QUANTIZERS
            and dtype in KERNEL_DTYPES and k_dim > 0 and v_dim > 0
            and k_dim % group_size == 0 and v_dim % group_size == 0)


def available() -> bool:
    """True when the default device is a GPU with ``mx.fast.metal_kernel`` or ``mx.fast.cuda_kernel``."""
    backend = gpu.gpu_backend()
    return backend is not None and hasattr(mx.fast, f"{backend}_kernel")


def _check_shapes(keys: mx.array, values: mx.array, key_offset: Optional[mx.array]) -> None:
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys and values are (B, n_kv_heads, L, head_dim) with the same B, heads "
                         f"and L, got {keys.shape} and {values.shape}")
    if key_offset is not None and tuple(key_offset.shape) != (keys.shape[1], keys.shape[3]):
        raise ValueError(f"key_offset is (n_kv_heads, head_dim) = {(keys.shape[1], keys.shape[3])}, "
                         f"got {key_offset.shape}")


# -- launch ---------------------------------------------------------------------------


def build_kernel(backend: str, name: str, has_offset: bool, consts_source: str) -> Callable:
    """The ``mx.fast`` kernel object of one variant (built once per process by :func:`gearbx_mlx.bindings.gpu.build`)."""
    header, source = kernel_sources(backend, has_offset, compact=True)
    return gpu.build(backend, name, tuple(input_names(has_offset)), tuple(output_names()), header,
                     gpu.compact(consts_source) + source)


@functools.lru_cache(maxsize=None)
def launcher(backend: str, bits: int, group_size: int, quantizer: str, dtype: mx.Dtype,
             has_offset: bool) -> Callable[..., Tuple[Quantized, Quantized]]:
    """A cached ``run(keys, values, key_offset) -> (kq, vq)`` for one variant."""
    kernel = build_kernel(backend, kernel_name(backend, bits, group_size, quantizer, dtype, has_offset), has_offset,
                    gpu.constants_source(backend, constants(dtype, bits, group_size, quantizer)))
    threads = threads_per_group()
    out_dtypes = [mx.uint32, dtype, dtype, mx.uint32, dtype, dtype]

    def run(keys: mx.array, values: mx.array, key_offset: Optional[mx.array]) -> Tuple[Quantized, Quantized]:
        lead = keys.shape[:3]
        dk, dv = keys.shape[3], values.shape[3]
        rows = lead[0] * lead[1] * lead[2]
        n = rows * (dk + dv) // group_size
        inputs = [keys, values] if key_offset is None else [keys, values, key_offset]
        kw, ks, kb, vw, vs, vb = kernel(
            inputs=inputs, grid=(-(-n // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[lead + (dk * bits // 32,), lead + (dk // group_size,), lead + (dk // group_size,),
                           lead + (dv * bits // 32,), lead + (dv // group_size,), lead + (dv // group_size,)],
            output_dtypes=out_dtypes)
        return (kw, ks, kb), (vw, vs, vb)

    run.kernel_name = kernel_name(backend, bits, group_size, quantizer, dtype, has_offset)
    return run


def fused_write(keys: mx.array, values: mx.array, key_offset: Optional[mx.array], group_size: int, bits: int,
                quantizer: str, *, backend: Optional[str] = None) -> Tuple[Quantized, Quantized]:
    """``quantize(keys - key_offset)`` and ``quantize(values)`` in one kernel launch.

    Args:
        keys: ``(B, n_kv_heads, L, d_k)``; values: ``(B, n_kv_heads, L, d_v)``;
            one dtype, float32, float16 or bfloat16; ``d_k`` and ``d_v``
            multiples of ``group_size``.
        key_offset: ``(n_kv_heads, d_k)`` (any float dtype; rounded to the
            keys' dtype before the subtraction, as the cache does), or None.
        group_size, bits, quantizer: as :func:`gearbx_mlx.kvcache.quantize.quantize`.
        backend: "metal" or "cuda" (default: the default device's GPU).

    Returns:
        ``((packed (B, H, L, d_k*bits/32) uint32, scales (B, H, L, d_k/g), biases), the same for the values)``,
        scales and biases in the keys' dtype. L = 0 launches nothing (the MLX ops return the empty arrays).
    """
    check_bits_group(bits, group_size)
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
    _check_shapes(keys, values, key_offset)
    if keys.dtype != values.dtype:
        raise ValueError(f"the kernel takes keys and values of one dtype, got {keys.dtype} and {values.dtype}")
    backend = backend or gpu.gpu_backend()
    if backend is None:
        raise ValueError("no GPU back end on the default device: call reference_write (or write)")
    if not supports(bits, group_size, keys.shape[3], values.shape[3], keys.dtype, quantizer):
        raise ValueError(f"no KV write kernel for {keys.dtype}, head dims {keys.shape[3]}/{values.shape[3]}, "
                         f"group {group_size}: use reference_write")
    if max(keys.size, values.size) > MAX_ELEMENTS:
        raise ValueError(f"one launch takes at most {MAX_ELEMENTS} elements a tensor, got {keys.size}")
    if keys.size == 0:
        return reference_write(keys, values, key_offset, group_size, bits, quantizer)  # nothing to launch
    if key_offset is not None and key_offset.dtype != mx.float32:
        key_offset = key_offset.astype(mx.float32)  # exact: the kernel rounds it to the keys' dtype
    run = launcher(backend, bits, group_size, quantizer, keys.dtype, key_offset is not None)
    return run(keys, values, key_offset)


def reference_write(keys: mx.array, values: mx.array, key_offset: Optional[mx.array], group_size: int,
                    bits: int, quantizer: str) -> Tuple[Quantized, Quantized]:
    """The same with MLX ops: :func:`gearbx_mlx.kvcache.quantize.quantize_step`, the
    cache's own write (``quantize(keys - key_offset.astype(keys.dtype))``, ``quantize(values)``).

    Shapes as :func:`fused_write`.
    """
    _check_shapes(keys, values, key_offset)
    return quantize_step(keys, values, key_offset, group_size, bits, quantizer)


@functools.lru_cache(maxsize=None)
def _kernel_for(backend: str, bits: int, group_size: int, quantizer: str, dtype: mx.Dtype, k_dim: int, v_dim: int,
                has_offset: bool) -> Optional[Callable[..., Tuple[Quantized, Quantized]]]:
    """The launcher of one layer's write, or None where the kernel does not apply (cached)."""
    if not hasattr(mx.fast, f"{backend}_kernel") or not supports(bits, group_size, k_dim, v_dim, dtype, quantizer):
        return None
    return launcher(backend, bits, group_size, quantizer, dtype, has_offset)


def write(keys: mx.array, values: mx.array, key_offset: Optional[mx.array], group_size: int, bits: int,
          quantizer: str, use_kernel: Optional[bool] = None) -> Tuple[Quantized, Quantized]:
    """One cache write: :func:`fused_write` on a GPU where it applies, else :func:`reference_write`.

    ``use_kernel``: None picks per call (the default device, dtype and head
    dims); True requires the kernel (ValueError where it does not apply);
    False takes the MLX ops. Shapes and results as :func:`fused_write`.
    The choice is cached per layer shape, so a decode step pays a few
    lookups before MLX's kernel call.
    """
    if use_kernel is None:
        backend = gpu.gpu_backend()
        if backend is not None and keys.ndim == 4 and values.ndim == 4 and keys.dtype == values.dtype:
            shape = keys.shape
            run = _kernel_for(backend, bits, group_size, quantizer, keys.dtype, shape[3], values.shape[3],
                              key_offset is not None)
            if (run is not None and shape[:3] == values.shape[:3] and 0 < keys.size
                    and max(keys.size, values.size) <= MAX_ELEMENTS
                    and (key_offset is None or tuple(key_offset.shape) == (shape[1], shape[3]))):
                if key_offset is not None and key_offset.dtype != mx.float32:
                    key_offset = key_offset.astype(mx.float32)
                return run(keys, values, key_offset)
        use_kernel = False
    if use_kernel:
        return fused_write(keys, values, key_offset, group_size, bits, quantizer)
    return reference_write(keys, values, key_offset, group_size, bits, quantizer)
