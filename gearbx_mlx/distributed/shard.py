"""Sharding a loaded model for tensor parallelism with mlx-lm's own ``model.shard()``.

mlx-lm's ``shard()`` splits every attention's heads and every MLP's hidden
units over the group, but checks nothing: a world size that does not divide
the heads gives a model whose attention fails at its first call (or, where
the shapes happen to fit, computes garbage). :func:`check_shardable` says so
before anything is split, naming the world sizes that would work.
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

import mlx.nn as nn


def head_counts(model: nn.Module) -> List[Tuple[str, int, int]]:
    """``(path, heads, key/value heads)`` of every attention module with ``n_heads``."""
    out = []
    for path, m in model.named_modules():
        heads = getattr(m, "n_heads", None)
        if isinstance(heads, int) and not isinstance(m, nn.MultiHeadAttention):
            kv = getattr(m, "n_kv_heads", heads)
            out.append((path, heads, kv if isinstance(kv, int) else heads))
    return out


def world_sizes(model: nn.Module, most: int = 64) -> List[int]:
    """World sizes (> 1, up to ``most``) that divide every attention's heads and key/value heads."""
    g = 0
    for _, heads, kv in head_counts(model):
        g = math.gcd(g, math.gcd(heads, kv))
    return [n for n in range(2, most + 1) if g and g % n == 0]


def check_shardable(model: nn.Module, size: int) -> None:
    """Raise unless mlx-lm can shard ``model`` over ``size`` ranks.

    Raises:
        ValueError: the model's mlx-lm class has no ``shard()``, or ``size``
            does not divide some attention's heads or key/value heads.
    """
    arch = type(model).__module__.rsplit(".", 1)[-1]
    if not callable(getattr(model, "shard", None)):
        raise ValueError(
            f"mlx-lm's {arch!r} model has no shard(): it cannot be split over {size} ranks for tensor "
            "parallelism. Run it in one process (without mlx.launch), or use a model whose mlx-lm class "
            "has shard() (llama, qwen2, mistral and others)")
    counts = head_counts(model)
    bad = [(path, heads, kv) for path, heads, kv in counts if heads % size or kv % size]
    if bad:
        path, heads, kv = bad[0]
        where = "every attention layer" if len(bad) == len(counts) else path
        sizes = world_sizes(model)
        hint = (f"launch {' or '.join(f'-n {n}' for n in sizes[:4])}" if sizes
                else "this model cannot be split by heads; run it in one process")
        raise ValueError(
            f"{size} ranks do not divide the model's {heads} attention heads and {kv} key/value heads "
            f"({where}): each rank must hold whole heads; {hint}")


def shard_model(model: nn.Module, group: Any) -> nn.Module:
    """``model.shard(group)`` after :func:`check_shardable`; the model, sharded in place."""
    check_shardable(model, group.size())
    model.shard(group)
    return model


__all__ = ["check_shardable", "head_counts", "shard_model", "world_sizes"]
