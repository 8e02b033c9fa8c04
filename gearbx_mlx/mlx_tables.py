"""MLX's quantization tables, written once for the whole package.

What MLX's affine quantization (``mx.quantize``, ``nn.QuantizedLinear``,
``mx.quantized_matmul``) accepts, as of MLX 0.32. Every module that checks a
bit width or a group size reads it from here, so that a change in MLX is one
edit.
"""

from __future__ import annotations

from typing import Tuple

#: Bit widths of MLX's affine quantization (weights, gears, nested planes, the rotated KV cache).
QUANT_BITS: Tuple[int, ...] = (2, 3, 4, 5, 6, 8)
#: Bit widths of mlx-lm's own ``QuantizedKVCache``: it passes any to ``mx.quantize``, which takes
#: these (mlx-lm's flag lists 1, which MLX 0.32 refuses).
KV_PLAIN_BITS: Tuple[int, ...] = QUANT_BITS
#: Elements per quantization group MLX's kernels take.
GROUP_SIZES: Tuple[int, ...] = (32, 64, 128)
#: MLX's and mlx-lm's default group size.
DEFAULT_GROUP_SIZE = 64
