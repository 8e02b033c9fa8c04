"""Gears of a layer sharded for tensor parallelism, built from the rank's shard.

mlx-lm's ``model.shard(group)`` turns q/k/v and gate/up into
``AllToShardedLinear`` (each rank computes its rows of the output, no
communication) and o/down into ``ShardedToAllLinear`` (each rank multiplies
its columns of the input, then ``all_sum`` over the group, then the bias).
Each holds only the rank's shard. A gear of such a layer is built from that
shard alone, and computes what the sharded layer computes:

* :func:`local_linear`: the shard as a plain ``nn.Linear`` (or MLX
  ``QuantizedLinear`` for a quantized sharded layer) over the very same
  arrays: what the quantizers and the nested store take. The bias of a
  sharded-to-all layer stays out of it: it is added once, after the sum.
* :func:`shard_gear`: the gear as the model must call it. An all-to-sharded
  gear is the quantized shard itself (still free of communication, so the
  packed kernels may fuse q/k/v); a sharded-to-all gear is a
  :class:`ShardedSumLinear`: the local product, the group's sum, the bias.

MLX's own ``shard_linear`` is not used on gears: it takes any module that is
not an ``nn.Linear`` for an MLX quantized layer and would misread ours.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

#: MLX's sharded linears, by what they do with the output.
ALL_TO_SHARDED: Tuple[type, ...] = (AllToShardedLinear, QuantizedAllToShardedLinear)
SHARDED_TO_ALL: Tuple[type, ...] = (ShardedToAllLinear, QuantizedShardedToAllLinear)
FLOAT_SHARDED: Tuple[type, ...] = (AllToShardedLinear, ShardedToAllLinear)
QUANTIZED_SHARDED: Tuple[type, ...] = (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)
SHARDED: Tuple[type, ...] = ALL_TO_SHARDED + SHARDED_TO_ALL


class ShardedSumLinear(nn.Module):
    """A gear of a sharded-to-all layer: ``all_sum(local(x)) (+ bias)``.

    Args:
        local: the gear of the rank's columns, without the bias
            (``(..., in / N) -> (..., out)``).
        group: the group the layer is sharded over.
        bias: the layer's whole bias ``(out,)``, added after the sum.
    """

    def __init__(self, local: nn.Module, group: Any, bias: Optional[mx.array] = None) -> None:
        super().__init__()
        self.local = local
        self.group = group
        if bias is not None:
            self.bias = bias
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        """``(..., in / N)`` -> ``(..., out)``, the same on every rank."""
        y = mx.distributed.all_sum(self.local(x), group=self.group)
        return y + self["bias"] if "bias" in self else y

    def _extra_repr(self) -> str:
        return f"ranks={self.group.size()}"


def is_sharded(module: Any) -> bool:
    """True for MLX's sharded linears (float or quantized)."""
    return isinstance(module, SHARDED)


def group_of(model: nn.Module) -> Optional[Any]:
    """The group the model's layers are sharded over (None if none is, or it is one process)."""
    for _, m in model.named_modules():
        if is_sharded(m) and m.group.size() > 1:
            return m.group
    return None


def sharded_paths(model: nn.Module) -> Tuple[str, ...]:
    """Paths of the model's sharded linears."""
    return tuple(p for p, m in model.named_modules() if is_sharded(m))


def local_linear(module: nn.Module) -> nn.Module:
    """The rank's shard of a sharded linear as an ``nn.Linear``/``nn.QuantizedLinear``.

    The arrays are the shard's own (nothing is copied); the bias is kept for an
    all-to-sharded layer (its shard of the bias) and left out for a
    sharded-to-all one (the whole bias, added after the sum).

    Raises:
        TypeError: not a sharded linear.
    """
    if not is_sharded(module):
        raise TypeError(f"{type(module).__name__} is not one of MLX's sharded linears")
    quantized = isinstance(module, QUANTIZED_SHARDED)
    # Built without __init__: a fresh layer draws random weights, which would
    # move the global random state between sharded and one-process runs.
    out: nn.Module = (nn.QuantizedLinear if quantized else nn.Linear).__new__(
        nn.QuantizedLinear if quantized else nn.Linear)
    nn.Module.__init__(out)
    out.weight = module.weight
    if quantized:
        out.scales = module.scales
        out.biases = module.get("biases")
        out.group_size, out.bits = module.group_size, module.bits
        out.mode = getattr(module, "mode", "affine")
    if "bias" in module and isinstance(module, ALL_TO_SHARDED):
        out.bias = module.bias
    if quantized:
        out.freeze()
    return out


def shard_gear(gear: nn.Module, original: nn.Module) -> nn.Module:
    """``gear`` (built from ``local_linear(original)``) as the model calls it.

    The original itself, a layer that is not sharded and an all-to-sharded
    layer's gear come back as they are; a sharded-to-all layer's gear is
    wrapped in :class:`ShardedSumLinear` with the original's bias.
    """
    if gear is original or not isinstance(original, SHARDED_TO_ALL):
        return gear
    return ShardedSumLinear(gear, original.group, original.get("bias"))


def unwrap(module: nn.Module) -> nn.Module:
    """The local gear inside a :class:`ShardedSumLinear` (anything else as it is)."""
    return module.local if isinstance(module, ShardedSumLinear) else module


__all__ = [
    "ALL_TO_SHARDED", "FLOAT_SHARDED", "QUANTIZED_SHARDED", "SHARDED", "SHARDED_TO_ALL", "ShardedSumLinear",
    "group_of", "is_sharded", "local_linear", "shard_gear", "sharded_paths", "unwrap",
]
