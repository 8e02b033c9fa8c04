"""Which modules a precision manager manages, and the bytes a forward pass reads (§6.1).

:func:`discover` lists the modules of a scope (``attention``: every linear
inside an attention container; ``all``: every linear and a tied embedding),
skipping those MLX cannot quantize at the group size. :func:`read_bytes`,
:func:`step_read_bytes` and :func:`managed_bytes` count what a module, a decode
step of the loaded model and a scope's modules read, for the summary's bytes
per step. :mod:`.precision` swaps the modules :func:`discover` finds.
"""

from __future__ import annotations

import re
from typing import List, Tuple

import mlx.nn as nn
from mlx.utils import tree_flatten

from .distributed.layers import FLOAT_SHARDED, QUANTIZED_SHARDED, ShardedSumLinear
from .nested.layers import NestedWeights
from .nested.store import module_shape
from .resolver import is_prequantized

#: Path components (lower-cased, underscores removed) that mark attention (§6.1).
ATTENTION_NAMES = ("selfattn", "attention", "attn", "selfattention")

_NUM = re.compile(r"(\d+)")


def _natural_key(path: str) -> Tuple:
    """Sort ``layers.10`` after ``layers.9`` (§6.1 step 4)."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(path))


def _is_attention(path: str) -> bool:
    parts = [p.lower().replace("_", "") for p in path.split(".")]
    return any(any(a in p for a in ATTENTION_NAMES) for p in parts[:-1])


def nbytes(module: nn.Module) -> int:
    """Bytes of every array a module holds."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _output_is_tied(model: nn.Module) -> bool:
    """True if the model projects to the vocabulary through its embedding.

    The config says so where it can (``args.tie_word_embeddings``); otherwise
    a model with no output head module (``lm_head``/``output``) is tied.
    """
    tie = getattr(getattr(model, "args", None), "tie_word_embeddings", None)
    if isinstance(tie, bool):
        return tie
    heads = ("lm_head", "output", "embed_out")
    return not any(
        isinstance(m, nn.Linear) and path.rsplit(".", 1)[-1] in heads
        for path, m in model.named_modules()
    )


def discover(
    model: nn.Module, scope: str, group_size: int, quantized: bool = False
) -> Tuple[List[str], List[str]]:
    """Paths of the modules to manage, and of those skipped (and why).

    ``attention``: every ``nn.Linear`` inside an attention container (§6.1).
    ``all``: every ``nn.Linear``, plus the embedding of a tied-embedding model
    (its ``as_linear`` is the output projection, the largest matrix of a
    small model). Layers whose input size is not a multiple of the group size
    cannot be quantized by MLX and stay in full precision (for a sharded
    linear, the input size of the rank's shard). With ``quantized``,
    MLX's quantized layers are managed instead of float ones (the nested store
    re-expresses 8-bit layers).
    """
    managed, skipped = [], []
    tied = scope == "all" and _output_is_tied(model)
    # MLX's sharded linears count as linears: their gears are built from the rank's shard.
    linear = (nn.QuantizedLinear, *QUANTIZED_SHARDED) if quantized else (nn.Linear, *FLOAT_SHARDED)
    embedding = nn.QuantizedEmbedding if quantized else nn.Embedding
    for path, m in model.named_modules():
        if isinstance(m, linear):
            if scope == "attention" and not _is_attention(path):
                continue
        elif isinstance(m, embedding) and tied:
            pass
        else:
            continue
        cols = module_shape(m)[1]
        if cols % group_size:
            skipped.append(f"{path} (input size {cols} not a multiple of {group_size})")
            continue
        managed.append(path)
    return sorted(managed, key=_natural_key), skipped


def read_bytes(module: nn.Module) -> int:
    """Bytes a forward pass through ``module`` reads: a nested view's planes, else every array."""
    if isinstance(module, ShardedSumLinear):
        bias = module.get("bias")
        return read_bytes(module.local) + (bias.nbytes if bias is not None else 0)
    weights = getattr(module, "nested", None)
    if isinstance(weights, NestedWeights):
        bias = weights.get("bias")
        return weights.plane_bytes(module.n) + (bias.nbytes if bias is not None else 0)
    return nbytes(module)


def step_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads from the loaded model.

    Every parameter is read once, except an embedding table that is not also
    the output projection: a step looks up one row of it.
    """
    total = nbytes(model)
    if not _output_is_tied(model):
        for _, m in model.named_modules():
            if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
                table = nbytes(m)
                total -= table - table // max(int(m.weight.shape[0]), 1)
    return total


def managed_bytes(model: nn.Module, scope: str, group_size: int) -> int:
    """Bytes of the modules a manager of ``scope`` would swap (0 for a pre-quantized model)."""
    if is_prequantized(model):
        return 0
    modules = dict(model.named_modules())
    return sum(nbytes(modules[p]) for p in discover(model, scope, group_size)[0])


__all__ = ["ATTENTION_NAMES", "discover", "managed_bytes", "nbytes", "read_bytes", "step_read_bytes"]
