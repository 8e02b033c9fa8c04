"""Layers whose keys carry outlying per-channel offsets, found from the weights.

A key channel is ``k_i = W_k[i]·x + b_i`` with ``x`` the RMS-normalised
attention input scaled by the norm's weight ``g``. Taking ``x``'s
coordinates as uncorrelated with unit variance, channel ``i`` varies by about
``σ_i = ||W_k[i] ⊙ g||`` around its bias. The outlier score of a layer is
``max_i |b_i| / median_i σ_i``: how many typical key spreads the largest bias
puts between the keys and zero. On Qwen2.5-Coder-0.5B (weights as converted
here) five layers score far above the rest (see :func:`outlier_scores`);
models without ``k_proj`` biases score 0. The score reads the weights only,
never the model's name.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn

from .arch import attention_modules, describe, input_norm_weight
from .calibrate import dense_weight, linear_bias

#: Score above which a layer counts as an outlier layer. Between the two
#: groups seen on Qwen2.5-Coder-0.5B (see :func:`outlier_scores`).
OUTLIER_THRESHOLD = 20.0


def outlier_scores(model: nn.Module) -> List[float]:
    """Per layer, the largest ``k_proj`` bias in units of the median key spread.

    0 for layers without a ``k_proj`` bias or with weights that cannot be read.
    """
    scores = []
    for attn, info in zip(attention_modules(model), describe(model)):
        bias = linear_bias(attn["k_proj"])
        w = dense_weight(attn["k_proj"])
        if bias is None or w is None:
            scores.append(0.0)
            continue
        g = input_norm_weight(model, info.index)
        if g is not None:
            w = w * g.astype(mx.float32)
        spread = mx.sqrt((w * w).sum(axis=1))
        med = mx.sort(spread)[spread.size // 2]
        scores.append(float((mx.abs(bias).max() / mx.maximum(med, 1e-12)).item()))
    return scores


def outlier_layers(model: nn.Module, threshold: float = OUTLIER_THRESHOLD) -> List[int]:
    """Indices of the layers scoring above ``threshold``."""
    return [i for i, s in enumerate(outlier_scores(model)) if s > threshold]


#: The rotated cache's group size where none is asked for: 64 (mlx-lm's), or
#: 32 for models with outlier layers. On Qwen2.5-Coder-0.5B with statistics
#: from the weights alone (no calibration text), 4-bit groups of 64 raised
#: perplexity by 5.18% and groups of 32 by 2.11%, at 4.5 and 5.0 stored bits
#: per element (docs/BENCHMARKS.md, "KV cache").
DEFAULT_GROUP_SIZE, OUTLIER_GROUP_SIZE = 64, 32


def default_group_size(model: nn.Module) -> int:
    """:data:`OUTLIER_GROUP_SIZE` if ``model`` has outlier layers, else :data:`DEFAULT_GROUP_SIZE`."""
    return OUTLIER_GROUP_SIZE if outlier_layers(model) else DEFAULT_GROUP_SIZE
