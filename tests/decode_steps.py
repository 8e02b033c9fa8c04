"""Greedy one-token decode steps of a model after a prompt, as a gear decodes."""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache


def step_logits(model, tokens: Sequence[int], steps: int) -> List[np.ndarray]:
    """The prompt ``tokens``, then ``steps`` greedy one-token steps: each step's logits (float32 numpy)."""
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array(tokens)[None], cache=cache)[:, -1, :], axis=-1)
    out = []
    for _ in range(steps):
        logits = model(y[None], cache=cache)[:, -1, :]
        out.append(np.array(logits.astype(mx.float32)))
        y = mx.argmax(logits, axis=-1)
    return out
