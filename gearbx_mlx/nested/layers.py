"""Layers that read the first ``n`` planes of shared nested weights.

:class:`NestedWeights` holds the planes of one matrix (and its bias), once.
:class:`NestedLinear` and :class:`NestedEmbedding` are *views*: each holds
the same :class:`NestedWeights` object and a plane count ``n`` (1 = low,
2 = mid, 3 = high). The precision manager builds one view per gear and path
when the planes exist, and a gear shift installs the views of another ``n``
with one ``update_modules`` call: nothing is quantized or allocated at shift
time, and every view of a layer shares the very same arrays.

Products go through the matrix's :class:`~gearbx_mlx.nested.matmul.NestedProduct`,
which picks a fused kernel at call time where one applies (Metal or CUDA for
one token on a GPU, the C kernels on the CPU) and the pure-MLX oracle
(:func:`~gearbx_mlx.nested.planes.reference_matmul`) otherwise; a view made
with ``fused=False`` always takes the oracle.

The low gear's view is MLX's 4-bit layer by construction: plane 0 is
``mx.quantize``'s codes, scales and biases of the weight. Where
:func:`~gearbx_mlx.nested.matmul.low_gear_through_mlx` says so (the oracle
asked for, or a GPU, whose per-call host time bounds decode), it calls
``mx.quantized_matmul`` on plane 0's arrays (the same objects, no copy) exactly
as ``nn.QuantizedLinear`` (a tied embedding's ``as_linear``: as
``nn.QuantizedEmbedding``) does, with no dispatch in between.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .matmul import DEFAULT_CONFIG, NestedKernelConfig, NestedProduct, low_gear_through_mlx
from .planes import DEFAULT_PLAN, QUANTIZED_SOURCE_PLAN, Plane, PlaneSpec, build_planes, reference_matmul


class NestedWeights(nn.Module):
    """The planes of one ``(out, in)`` matrix and its bias, shared by every view.

    Attributes:
        weights, scales, biases: one array per plane (see :class:`Plane`).
        bits, group_sizes, exponents: one int per plane.
        bias: the layer's own bias ``(out,)``, if it has one.
    """

    def __init__(self, planes: Sequence[Plane], bias: Optional[mx.array] = None) -> None:
        super().__init__()
        if not planes:
            raise ValueError("nested weights need at least one plane")
        shapes = {p.shape for p in planes}
        if len(shapes) != 1:
            raise ValueError(f"the planes of one matrix must share its shape, got {shapes}")
        self.weights = [p.weight for p in planes]
        self.scales = [p.scales for p in planes]
        self.biases = [p.biases for p in planes]
        self.bits = tuple(p.bits for p in planes)
        self.exponents = tuple(p.exponent for p in planes)
        self.group_sizes = tuple(p.group_size for p in planes)
        if bias is not None:
            self.bias = bias
        self.freeze()

    @property
    def product(self) -> NestedProduct:
        """The kernels' state of these planes, built on first use and shared by every view."""
        prod = self.__dict__.get("_product")
        if prod is None:
            prod = NestedProduct(self.planes, self.kernel_config)
            self.__dict__["_product"] = prod
        return prod

    @property
    def kernel_config(self) -> NestedKernelConfig:
        """Where each kernel is used for these planes (default :data:`~.matmul.DEFAULT_CONFIG`)."""
        return self.__dict__.get("_kernel_config", DEFAULT_CONFIG)

    def use_kernel_config(self, config: NestedKernelConfig) -> None:
        """Use ``config`` from now on (the kernels' state is rebuilt; views built
        before keep their low-gear choice: build views after this)."""
        self.__dict__["_kernel_config"] = config
        self.__dict__.pop("_product", None)

    @property
    def planes(self) -> List[Plane]:
        return [
            Plane(w, s, b, bits, g, e)
            for w, s, b, bits, g, e in zip(self.weights, self.scales, self.biases, self.bits, self.group_sizes,
                                           self.exponents)
        ]

    @property
    def shape(self) -> Tuple[int, int]:
        """``(out, in)``."""
        return self.planes[0].shape

    @property
    def depth(self) -> int:
        """Number of planes."""
        return len(self.bits)

    def plane_bytes(self, n: Optional[int] = None) -> int:
        """Bytes the first ``n`` planes hold (what a gear of ``n`` planes reads), bias excluded."""
        n = self.depth if n is None else n
        return sum(p.nbytes for p in self.planes[:n])

    @classmethod
    def from_weight(
        cls, weight: mx.array, bias: Optional[mx.array] = None, *, plan: Sequence[PlaneSpec] = DEFAULT_PLAN,
        low: Optional[Plane] = None,
    ) -> "NestedWeights":
        """Planes of ``weight`` (plane 0 ``low`` where given: :func:`build_planes`)."""
        return cls(build_planes(weight, plan, low), bias)


class _View(nn.Module):
    def __init__(self, weights: NestedWeights, n: int, fused: bool) -> None:
        super().__init__()
        if not 1 <= n <= weights.depth:
            raise ValueError(f"a view reads 1 to {weights.depth} planes of these weights, got {n}")
        self.nested = weights
        self.n = n
        self.fused = fused
        self.freeze()
        # (weight, scales, biases, group size, bits, bias) of plane 0 when this is a low
        # gear that calls MLX's quantized_matmul; kept outside the module's tree (the
        # arrays are already there, under ``nested``).
        self.__dict__["_mlx_low"] = None
        if n == 1 and low_gear_through_mlx(weights.planes[0], fused, weights.kernel_config):
            p = weights.planes[0]
            self.__dict__["_mlx_low"] = (p.weight, p.scales, p.biases, p.group_size, p.bits, weights.get("bias"))

    def matmul(self, x: mx.array) -> mx.array:
        # Item reads, not attributes: nn.Module resolves a child module through
        # __getattr__ (~2 us a read), and a decode step makes hundreds of calls.
        nested = self["nested"]
        bias = nested.get("bias")
        if self.fused:
            product = nested.__dict__.get("_product") or nested.product
            return product(x, self.n, bias)
        return reference_matmul(x, nested.planes, self.n, bias)

    @property
    def through_mlx(self) -> bool:
        """True if this view's products call ``mx.quantized_matmul`` on plane 0 directly (a low gear)."""
        return self._mlx_low is not None

    def _extra_repr(self) -> str:
        out, inp = self.nested.shape
        return f"in={inp}, out={out}, planes={self.n}/{self.nested.depth}, bits={self.nested.bits[: self.n]}"


class NestedLinear(_View):
    """A linear layer reading the first ``n`` planes: ``(..., in) -> (..., out)``."""

    def __call__(self, x: mx.array) -> mx.array:
        low = self._mlx_low
        if low is not None:  # nn.QuantizedLinear's own call, on plane 0
            w, scales, biases, group_size, bits, bias = low
            y = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                                    bits=bits)
            return y if bias is None else y + bias
        return self.matmul(x)


class NestedEmbedding(_View):
    """A tied embedding reading the first ``n`` planes: ids -> rows, and ``as_linear``."""

    def __call__(self, ids: mx.array) -> mx.array:
        """``(...)`` ids -> ``(..., dims)`` rows, summed over the planes read, in the scales' dtype."""
        rows = None
        for p in self.nested.planes[: self.n]:
            r = mx.dequantize(p.weight[ids], p.scales[ids], p.biases[ids], group_size=p.group_size, bits=p.bits)
            if self.n > 1:
                r = r.astype(mx.float32) * p.factor if p.exponent else r.astype(mx.float32)
            rows = r if rows is None else rows + r
        return rows.astype(self.nested.scales[0].dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        low = self._mlx_low
        if low is not None:  # nn.QuantizedEmbedding.as_linear, on plane 0
            w, scales, biases, group_size, bits, _ = low
            return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                                       bits=bits)
        return self.matmul(x)


def nested_weights_of(module: nn.Module, plan: Optional[Sequence[PlaneSpec]] = None,
                      low: Optional[Plane] = None) -> NestedWeights:
    """Planes of a float ``nn.Linear``/``nn.Embedding`` (default :data:`DEFAULT_PLAN`) or of an
    MLX 8-bit ``QuantizedLinear``/``QuantizedEmbedding`` (re-expressed as the planes of
    :data:`QUANTIZED_SOURCE_PLAN` of its dequantized weight); ``low``: a float source's
    plane 0 made by another quantizer (:mod:`gearbx_mlx.nested.lowquant`).

    Raises:
        ValueError: a quantized source of another width, or a mode other than affine;
            ``low`` for a quantized source.
    """
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        mode = getattr(module, "mode", "affine")
        if mode != "affine" or module.bits != 8:
            raise ValueError(
                f"nested planes re-express MLX 8-bit affine layers only; this layer is {module.bits}-bit "
                f"{mode}: a lower-precision source has no room for a finer gear (use the telemetry-only mode)"
            )
        if low is not None:
            raise ValueError("a low plane from another quantizer needs float weights, not an MLX 8-bit layer")
        w = mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                          bits=module.bits)
        return NestedWeights.from_weight(w, module.get("bias"), plan=plan or QUANTIZED_SOURCE_PLAN)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return NestedWeights.from_weight(module.weight, module.get("bias"), plan=plan or DEFAULT_PLAN, low=low)
    raise TypeError(f"cannot build nested planes of a {type(module).__name__}")


def make_view(weights: NestedWeights, n: int, embedding: bool, fused: bool = True) -> _View:
    """The view of ``weights`` that reads ``n`` planes, as a linear or a tied embedding."""
    return (NestedEmbedding if embedding else NestedLinear)(weights, n, fused)


def is_embedding(module: Any) -> bool:
    return isinstance(module, (nn.Embedding, nn.QuantizedEmbedding, NestedEmbedding))


__all__ = [
    "NestedEmbedding", "NestedLinear", "NestedWeights", "is_embedding", "make_view", "nested_weights_of",
]
