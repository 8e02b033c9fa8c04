"""A rotated, offset-corrected int4 KV cache on mlx-lm's own quantized attention.

Keys and queries are rotated after RoPE by a fixed random orthogonal matrix
(SRHT or SRFT, arXiv:2605.05699), rescaled per RoPE pair by λ (keys up,
queries down), and the keys' per-channel mean is removed before quantizing;
values are rotated (undone before ``o_proj``). Attention scores and outputs
are unchanged in float; what the 4-bit quantizer sees is flatter. mlx-lm's
``QuantizedKVCache`` format and ``quantized_scaled_dot_product_attention``
do the rest, on every backend.

Public API: :class:`KVConfig`, :func:`apply_kv` -> :class:`KVHandle`
(``make_cache()``, ``restore()``), :func:`calibrate_text`,
:func:`calibrate_weights`, :class:`KVCalibration`, :func:`outlier_layers`,
:func:`load_prompt_cache`. Importing has no side effects.
"""

from .api import KVHandle, apply_kv, layer_bits, rotation_kind
from .cache import RotatedKVCache, RotatedQuantizedKVCache, load_prompt_cache
from .calibrate import KVCalibration, calibrate_text, calibrate_weights
from .config import KVConfig, plain, rotated_only
from .outliers import outlier_layers, outlier_scores
from .quantize import SUPPORTED_BITS, SUPPORTED_GROUPS, bits_per_element
from .rotation import Rotation, hadamard_supported

__all__ = [
    "KVConfig", "KVHandle", "apply_kv", "layer_bits", "rotation_kind", "plain", "rotated_only",
    "KVCalibration", "calibrate_text", "calibrate_weights", "outlier_layers", "outlier_scores",
    "RotatedKVCache", "RotatedQuantizedKVCache", "load_prompt_cache",
    "SUPPORTED_BITS", "SUPPORTED_GROUPS", "bits_per_element", "Rotation", "hadamard_supported",
]
