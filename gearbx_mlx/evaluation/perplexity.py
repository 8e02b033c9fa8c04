"""Plain perplexity of a model on token ids, scored in independent windows.

The oracle for the default model's quality (``scripts/check_default_model.py``
scores 2,048 tokens of the Lee corpus in four windows of 512) and for the
converters.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import mlx.core as mx


def windowed_perplexity(model: Any, ids: Sequence[int], window: int = 512) -> float:
    """exp(mean NLL) of ``ids[1:]``, each window of ``window`` predictions fresh.

    Args:
        model: an mlx-lm model, ``(1, T) ids -> (1, T, V) logits``.
        ids: at least 2 token ids.
    """
    if len(ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    nll, n = 0.0, 0
    for i in range(0, len(ids) - 1, window):
        x = mx.array(list(ids[i : i + window + 1]))[None]
        lg = model(x[:, :-1]).astype(mx.float32)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        tok = -mx.take_along_axis(lp, x[:, 1:, None], axis=-1)
        nll += tok.sum().item()
        n += tok.size
    return math.exp(nll / n)
