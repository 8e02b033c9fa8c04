"""The block-sparse decode GEMV on Metal and CUDA: ``down_proj`` over the kept input groups only.

``metal_kernels/sparse_gemv_body.inc`` is the GPU twin of the C kernel of
:mod:`.sparse_cpu`: one activation row times one MLX affine 4-bit plane
(``QuantizedLinear``, or plane 0 of the nested store), reading for each output
row only the contiguous segments of the kept groups (``group_size / 8`` words
each), their scales and biases. One body, a Metal source and its CUDA twin,
with the prelude and entry of the packed kernels (:mod:`.gpu`); every baked
parameter (backend, group size, x and scale dtypes, rows per SIMD group, bias,
source hash) is in the kernel's name.

:func:`sparse_gemv` is the entry point; it returns ``None`` where the kernel
does not apply (no GPU, unsupported bits, group size or dtypes), so a caller
falls back to :func:`reference`, the pure-MLX product (gather the kept
columns, then ``mx.quantized_matmul``). The body is syntax-checked for both
back ends (``scripts/check_metal_syntax.py --cuda``), run on the host
through ``metal_kernels/check/host_emulation.h`` by the tests, and on CUDA
GPUs by their CUDA tests (``tests/test_sparse_gpu.py``); it has not run on
Metal.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from . import gpu
from .gpu import DTYPE_TAG, SIMD_GROUPS, THREADS, constants_source

__all__ = ["SPARSE_GPU_DTYPES", "SPARSE_GPU_GROUPS", "constants", "input_names", "kernel_name", "kernel_sources",
           "launch_spec", "reference", "sparse_gemv", "unsupported"]

#: dtypes of x and of the scales and biases.
SPARSE_GPU_DTYPES: Tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
#: Group sizes the body reads (a kept group is whole 32-byte segments).
SPARSE_GPU_GROUPS: Tuple[int, ...] = (64, 128)
#: Output rows per SIMD group (they share each loaded x chunk).
ROWS = 2


def kernel_sources(backend: str, has_bias: bool, directory: Optional[Path] = None, *,
                   compact: bool = False) -> Tuple[str, str]:
    """``(header, source)`` as handed to MLX: format header, prelude, ``gemv_common.h``; entry and body."""
    return gpu.kernel_text(backend, ("gemv_common.h",), (("GBX_HAS_BIAS", has_bias),), "sparse_gemv_body.inc",
                           directory, compact_text=compact)


def input_names(has_bias: bool) -> List[str]:
    return ["x", "w", "s", "b", "blocks"] + (["bias"] if has_bias else [])


def constants(dtype: mx.Dtype, group_size: int, rows: int = ROWS) -> List[Tuple[str, object]]:
    """The body's compile-time constants, by name (all of them are in its name; the scales' dtype is
    their buffers', also in the name)."""
    return [("T", dtype), ("GS", group_size), ("ROWS", rows)]


@functools.lru_cache(maxsize=None)
def kernel_name(backend: str, group_size: int, rows: int, dtype: mx.Dtype, scale_dtype: mx.Dtype,
                has_bias: bool) -> str:
    digest = gpu.digest(*kernel_sources(backend, has_bias))
    return (f"gbx_sparse_{backend}_q4g{group_size}_r{rows}_{DTYPE_TAG[dtype]}_s{DTYPE_TAG[scale_dtype]}_"
            f"{'bias' if has_bias else 'nobias'}_{digest}")


def unsupported(parts: Any, dtype: mx.Dtype) -> Optional[str]:
    """Why the body cannot multiply ``x`` of ``dtype`` by ``parts`` (None when it can)."""
    if parts.bits != 4 or parts.group_size not in SPARSE_GPU_GROUPS:
        return f"the body reads 4-bit codes in groups of 64 or 128, not {parts.bits}-bit / {parts.group_size}"
    if dtype not in SPARSE_GPU_DTYPES or parts.scales.dtype not in SPARSE_GPU_DTYPES:
        return f"x is {dtype} and the scales {parts.scales.dtype}: the body takes float32, float16, bfloat16"
    if parts.biases.dtype != parts.scales.dtype:
        return "the scales and biases differ in dtype"
    return None


def launch_spec(out_features: int, rows: int = ROWS) -> Dict[str, Any]:
    """Grid and threadgroup: 256-thread threadgroups of 8 SIMD groups, ``rows`` rows each."""
    groups = max(1, -(-out_features // (SIMD_GROUPS * rows)))
    return {"grid": (groups * THREADS, 1, 1), "threadgroup": (THREADS, 1, 1)}


@functools.lru_cache(maxsize=None)
def _kernel(backend: str, group_size: int, rows: int, dtype: mx.Dtype, scale_dtype: mx.Dtype, has_bias: bool):
    header, source = kernel_sources(backend, has_bias, compact=True)
    source = constants_source(backend, constants(dtype, group_size, rows)) + source
    name = kernel_name(backend, group_size, rows, dtype, scale_dtype, has_bias)
    return gpu.build(backend, name, tuple(input_names(has_bias)), ("y",), header, source)


def reference(h: mx.array, parts: Any, blocks: mx.array) -> mx.array:
    """``(1, I) -> (1, out)``: the pure-MLX product over ``blocks``' groups (gathered copies), bias added."""
    out, nb = parts.scales.shape
    g = parts.group_size
    w = mx.take(parts.weight.reshape(out, nb, -1), blocks, axis=1).reshape(out, -1)
    s = mx.take(parts.scales, blocks, axis=1)
    b = mx.take(parts.biases, blocks, axis=1)
    x = mx.take(h.reshape(nb, g), blocks, axis=0).reshape(1, -1)
    y = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=g, bits=parts.bits)
    bias = getattr(parts, "bias", None)
    return y + bias if bias is not None else y


def sparse_gemv(h: mx.array, parts: Any, blocks: mx.array, rows: int = ROWS) -> Optional[mx.array]:
    """``(1, I) -> (1, out)`` in ``h.dtype`` by the GPU body, or None where it does not apply
    (no GPU back end, or :func:`unsupported` names a reason): the caller takes :func:`reference`."""
    backend = gpu.gpu_backend()
    if backend is None or unsupported(parts, h.dtype) is not None or h.size != parts.weight.shape[1] * 8:
        return None
    bias = getattr(parts, "bias", None)
    out = parts.weight.shape[0]
    if blocks.size == 0:  # nothing kept: no launch over an empty buffer
        y = mx.zeros((out,), h.dtype) if bias is None else bias.astype(h.dtype)
        return y.reshape(1, out)
    kernel = _kernel(backend, parts.group_size, rows, h.dtype, parts.scales.dtype, bias is not None)
    inputs = [h.reshape(-1), parts.weight, parts.scales, parts.biases, blocks.astype(mx.uint32)]
    if bias is not None:
        inputs.append(bias.astype(h.dtype))
    spec = launch_spec(out, rows)
    y = kernel(inputs=inputs, grid=spec["grid"], threadgroup=spec["threadgroup"], output_shapes=[(out,)],
               output_dtypes=[h.dtype])[0]
    return y.reshape(1, out)
