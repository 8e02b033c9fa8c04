"""``PackedLinear`` and ``PackedEmbedding``: layers that hold packed int weights.

Their parameters are exactly what they store (packed weights, float32 scales,
and the bias of a linear layer), so ``tree_flatten(module.parameters())``
counts their bytes truthfully. The product is chosen at call time
(:func:`backend_for`), in the order of §7.2:

1. single-token input (``x.size == in_features``) on a GPU: the packed GEMV
   kernel of :mod:`gearbx_mlx.bindings.packed_gpu` (Metal, or its CUDA twin);
2. single-token input on the CPU: the C kernels of ``gearbx_mlx.bindings.cpu`` (int4 and
   int8), when that module imports and reports ``available()``;
3. with ``dequant_cache=True``: the §7.1 path, weights dequantized once into the
   input dtype and reused until the input dtype changes;
4. otherwise the reference of :mod:`gearbx_mlx.packed.formats`: dequantize, then matmul
   in float32. Multi-token input (prefill) always takes 3 or 4.

A kernel's first call per layer shape checks itself against the reference
(:mod:`gearbx_mlx.bindings.guard`); a kernel that fails to build or disagrees
is dropped for 3 or 4 with one warning, and the generation goes on.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..bindings import cpu, gpu, guard, packed_gpu
from . import formats

#: Names :func:`backend_for` returns.
BACKENDS = ("metal", "cuda", "cpu", "dequant-cache", "reference")
#: Path of ``gearbx_mlx.bindings.cpu.gemv``: "auto" is its int8-activation integer dot
#: product (memory speed, adds activation rounding); "float" keeps float32
#: activations at about a third of the speed.
CPU_GEMV_PATH = "auto"


def cpu_backend() -> Optional[Any]:
    """:mod:`gearbx_mlx.bindings.cpu` if its C library loaded, else None.

    The library is optional and loaded on first use (tried once), never at
    import time.
    """
    try:
        return cpu if cpu.available() else None
    except Exception:  # a broken build must not break the reference path
        return None


def is_single_token(x: mx.array, in_features: int) -> bool:
    """True for one input vector, whatever its leading dims of size 1."""
    return x.size == in_features and x.shape[-1] == in_features


def backend_for(
    x: mx.array,
    bits: int,
    in_features: int,
    out_features: int,
    group_size: Optional[int] = None,
    dequant_cache: bool = False,
) -> str:
    """Which path a packed layer would take for input ``x`` now (see module doc)."""
    if is_single_token(x, in_features):
        backend = gpu.gpu_backend()
        if backend is not None:
            if packed_gpu.supports(bits, group_size, in_features, out_features, x.dtype):
                return backend
        elif bits in (4, 8) and cpu_backend() is not None:
            return "cpu"
    return "dequant-cache" if dequant_cache else "reference"


def cpu_launcher(bits: int, group_size: Optional[int], in_features: int, out_features: int):
    """``run(x, weight, scales, bias) -> y`` through the C kernels, like a GPU launcher.

    ``y`` has ``x``'s dtype and leading dims; the C kernel computes in float32
    on the path :data:`CPU_GEMV_PATH`.
    """
    lib = cpu_backend()
    if lib is None:
        raise RuntimeError("the C CPU kernels are not available")

    def run(x: mx.array, weight: mx.array, scales: mx.array, bias: Optional[mx.array] = None) -> mx.array:
        y = lib.gemv(weight, scales, x.reshape(in_features), bits=bits, group_size=group_size,
                     in_features=in_features, path=CPU_GEMV_PATH)
        if bias is not None:
            y = y + bias.astype(mx.float32)
        return y.astype(x.dtype).reshape(*x.shape[:-1], out_features)

    run.kernel_name = f"gbx_gemv_cpu_q{bits}_{'row' if group_size is None else f'g{group_size}'}_{CPU_GEMV_PATH}"
    return run


def cpu_kernels_trusted() -> bool:
    """True if the C kernels load and pass a first-use check on a small odd layer of each bit width.

    For callers that use the C GEMV without a packed layer's dispatch (the
    speculative drafter's host step): a failure warns once, like a layer's.
    """
    if cpu_backend() is None:
        return False
    for bits in (4, 8):  # explicit keys: the caller's random stream is left alone
        layer = PackedLinear(96, 37, bias=True, bits=bits, group_size=32)
        layer.weight, layer.scales = formats.quantize_packed(mx.random.normal((37, 96), key=mx.random.key(bits)),
                                                             bits, 32)
        layer(mx.random.normal((1, 96), key=mx.random.key(7)))
    return not guard.family_failed("gbx_gemv_cpu")


class KernelRuntime:
    """Per-layer state that is not a parameter: kernel launchers and the §7.1 cache.

    A plain object, not ``mx.array``/dict attributes of the module, so that it
    is never counted among (or saved with) the module's parameters.
    """

    def __init__(self) -> None:
        # (backend, dtype, bias) -> launcher, or False where the kernel does not
        # apply or failed its first-use check (gearbx_mlx.bindings.guard).
        self.launchers: dict = {}
        self.weight: Optional[mx.array] = None  # the dequant cache

    def launcher(self, layer: Any, backend: str, dtype: mx.Dtype, has_bias: bool,
                 splits: Tuple[int, ...] = ()):
        """The layer's cached kernel launcher, or False where no kernel applies.

        ``layer`` needs ``bits``, ``group_size``, ``in_features`` and
        ``out_features``; ``backend`` is "metal", "cuda" or "cpu" (the C
        kernels); ``splits`` asks for the matrix-unit kernel with 2-3 outputs
        (a fused group, ``gearbx_mlx.packed.fused``). The first call of a new
        launcher checks itself against the reference (:func:`guard.guarded`).
        """
        key = (backend, dtype, has_bias)
        run = self.launchers.get(key)
        if run is None:
            bits, gs, k, o = layer.bits, layer.group_size, layer.in_features, layer.out_features
            if backend == "cpu":
                ok, build = bits in (4, 8), lambda: cpu_launcher(bits, gs, k, o)
            else:
                ok = (packed_gpu.supports_mma if splits else packed_gpu.supports)(bits, gs, k, o, dtype)
                build = lambda: packed_gpu.launcher(  # noqa: E731
                    backend, bits, gs, k, o, dtype, has_bias, mma=True if splits else None, splits=tuple(splits))
            family = "C packed GEMV" if backend == "cpu" else f"{backend} packed GEMV"
            spec = guard.KernelSpec(family, bits, gs, k, o, tuple(splits),
                                    intdot=backend == "cpu" and CPU_GEMV_PATH in ("auto", "intdot"))
            run = ok and guard.guarded(spec, build, lambda r: self.launchers.__setitem__(key, r))
            self.launchers[key] = run
        return run

    def dequantized(self, layer: "PackedBase", dtype: mx.Dtype) -> mx.array:
        if self.weight is None or self.weight.dtype != dtype:
            self.weight = formats.dequantize(
                layer.weight, layer.scales, layer.bits, layer.group_size, layer.in_features, dtype
            )
        return self.weight


class PackedBase(nn.Module):
    """Packed storage of an ``(out_features, in_features)`` matrix and its product."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: Optional[int],
        dequant_cache: bool,
    ) -> None:
        super().__init__()
        formats.check_shape(in_features, bits, group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        self.dequant_cache = dequant_cache
        self.runtime = KernelRuntime()
        self.weight = mx.zeros(
            formats.packed_shape(out_features, in_features, bits), dtype=formats.packed_dtype(bits)
        )
        self.scales = mx.ones((out_features, formats.n_groups(in_features, group_size)))

    def backend_for(self, x: mx.array) -> str:
        return backend_for(
            x, self.bits, self.in_features, self.out_features, self.group_size, self.dequant_cache
        )

    def clear_cache(self) -> None:
        """Drop the dequantized weights of the §7.1 cache (a gear shift does this)."""
        self.runtime.weight = None

    def dequantized_weight(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """``(out_features, in_features)`` weights ``q * s`` in ``dtype``."""
        return formats.dequantize(
            self.weight, self.scales, self.bits, self.group_size, self.in_features, dtype
        )

    def _product(self, x: mx.array, bias: Optional[mx.array]) -> mx.array:
        """``x @ W.T (+ bias)`` for ``x`` of shape ``(..., in_features)``."""
        # Fast path, taken a few hundred times per decoded token: one input
        # vector on a GPU. Plain attribute and dict reads only (a Module's
        # __getattr__ costs about a microsecond).
        if x.size == self.in_features and x.shape[-1] == self.in_features:
            backend = gpu.gpu_backend()
            if backend is not None:
                run = self.runtime.launcher(self, backend, x.dtype, bias is not None)
                if run:
                    return run(x, self["weight"], self["scales"], bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"input has {x.shape[-1]} features, the layer expects {self.in_features}"
            )
        path = self.backend_for(x)
        if path == "cpu":
            run = self.runtime.launcher(self, "cpu", x.dtype, bias is not None)
            if run:
                return run(x, self["weight"], self["scales"], bias)
            path = "dequant-cache" if self.dequant_cache else "reference"  # the C kernel failed here
        if path == "dequant-cache":
            y = x @ self.runtime.dequantized(self, x.dtype).T
            return y if bias is None else y + bias.astype(x.dtype)
        return formats.reference_matmul(
            x, self.weight, self.scales, bits=self.bits, group_size=self.group_size,
            in_features=self.in_features, bias=bias,
        )

    def _extra_repr(self) -> str:
        gs = "per-row" if self.group_size is None else f"group_size={self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, {gs}"
        )


class PackedLinear(PackedBase):
    """A linear layer ``y = x W^T + b`` with ``W`` stored packed (int8/6/4/2).

    Args:
        input_dims, output_dims: the ``(O, I)`` shape of ``W``.
        bias: keep a bias vector (added after the product).
        bits: 8, 6, 4 or 2 (GPU and CPU kernels exist for 4 and 8).
        group_size: None for per-row scales, else 32, 64 or 128.
        dequant_cache: use the §7.1 dequant cache where no kernel applies.
    """

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = True,
        bits: int = 4,
        group_size: Optional[int] = None,
        dequant_cache: bool = False,
    ) -> None:
        super().__init__(input_dims, output_dims, bits, group_size, dequant_cache)
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.freeze()

    @classmethod
    def from_linear(
        cls,
        linear: nn.Module,
        *,
        bits: int = 4,
        group_size: Optional[int] = None,
        dequant_cache: bool = False,
    ) -> "PackedLinear":
        """Quantize an ``nn.Linear`` (its weight is ``(O, I)``).

        Keyword arguments, as ``nn.QuantizedLinear.from_linear(linear,
        group_size=..., bits=...)`` takes them by name (its positional order is
        group size first).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"PackedLinear.from_linear takes an nn.Linear, got {type(linear).__name__}"
            )
        out_features, in_features = linear.weight.shape
        has_bias = "bias" in linear
        layer = cls(in_features, out_features, has_bias, bits, group_size, dequant_cache)
        layer.weight, layer.scales = formats.quantize_packed(linear.weight, bits, group_size)
        if has_bias:
            layer.bias = linear.bias
        layer.freeze()
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        """``(..., in_features)`` -> ``(..., out_features)`` in ``x.dtype``."""
        return self._product(x, self.get("bias"))


class PackedEmbedding(PackedBase):
    """An embedding table stored packed, usable as the tied output projection.

    ``__call__(ids)`` looks rows up and dequantizes them; ``as_linear(x)`` is
    the product with the table (mlx-lm's tied-embedding models call it for
    the logits), dispatched like :class:`PackedLinear`.
    """

    def __init__(
        self,
        num_embeddings: int,
        dims: int,
        bits: int = 4,
        group_size: Optional[int] = None,
        dequant_cache: bool = False,
        dtype: mx.Dtype = mx.float32,
    ) -> None:
        super().__init__(dims, num_embeddings, bits, group_size, dequant_cache)
        self.num_embeddings = num_embeddings
        self.dims = dims
        self.lookup_dtype = dtype  # of the lookups: the table's original dtype
        self.freeze()

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Module,
        *,
        bits: int = 4,
        group_size: Optional[int] = None,
        dequant_cache: bool = False,
    ) -> "PackedEmbedding":
        """Quantize an ``nn.Embedding`` (its weight is ``(num_embeddings, dims)``);
        keyword arguments as :meth:`PackedLinear.from_linear`."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(
                "PackedEmbedding.from_embedding takes an nn.Embedding, "
                f"got {type(embedding).__name__}"
            )
        num, dims = embedding.weight.shape
        layer = cls(num, dims, bits, group_size, dequant_cache, embedding.weight.dtype)
        layer.weight, layer.scales = formats.quantize_packed(embedding.weight, bits, group_size)
        layer.freeze()
        return layer

    def __call__(self, ids: mx.array) -> mx.array:
        """Integer ``ids`` of any shape -> ``ids.shape + (dims,)`` in the table's dtype."""
        flat = ids.reshape(-1)
        rows = formats.dequantize(
            self.weight[flat], self.scales[flat], self.bits, self.group_size, self.dims,
            self.lookup_dtype,
        )
        return rows.reshape(*ids.shape, self.dims)

    def as_linear(self, x: mx.array) -> mx.array:
        """``(..., dims)`` -> ``(..., num_embeddings)``: ``x`` times the table, transposed."""
        return self._product(x, None)
