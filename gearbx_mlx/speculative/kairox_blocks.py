"""Block arithmetic of the KAIROX mechanisms: momentum scores, hot sets, transition tables, masks.

Pure functions over blocks of ``group`` neurons (one quantization group of
``down_proj``'s input), used by :mod:`gearbx_mlx.speculative.kairox`: the
Temporal Activation Momentum update, the hot set's choice with its one-hit
filter, the layer-to-layer transition table of the Live Pipeline predictor,
each row's kept blocks, the gate/up rows of chosen blocks, and the packed
copy of the hot blocks' ``down_proj`` columns.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .sparse import QuantParts


def tam_update(score: mx.array, active: mx.array, beta: float) -> mx.array:
    """``(nb,) -> (nb,)``: one step of Temporal Activation Momentum, ``beta * score + (1 - beta) * active``."""
    return beta * score + (1 - beta) * active.astype(score.dtype)


def choose_hot(score: np.ndarray, hits: np.ndarray, size: int, min_hits: int) -> List[int]:
    """The hot set: the ``size`` best ``score``s among blocks with ``hits >= min_hits`` and a positive
    score, ascending block order."""
    eligible = [b for b in range(len(score)) if hits[b] >= min_hits and score[b] > 0]
    eligible.sort(key=lambda b: (-score[b], b))
    return sorted(eligible[: max(size, 0)])


def transitions(masks: Sequence[np.ndarray]) -> List[np.ndarray]:
    """``[(T, nb_l)] bool -> [(nb_l, nb_{l+1})]``: ``P(j kept at l + 1 | i kept at l)`` over the rows."""
    out = []
    for a, b in zip(masks[:-1], masks[1:]):
        joint = a.astype(np.float32).T @ b.astype(np.float32)
        out.append(joint / np.maximum(a.sum(0), 1)[:, None])
    return out


def kept_masks(masses: Sequence[mx.array], keep: Sequence[int]) -> List[np.ndarray]:
    """``[(T, nb)] -> [(T, nb)] bool``: each row's ``keep[l]`` heaviest blocks."""
    out = []
    for m, k in zip(masses, keep):
        m = np.array(m)
        order = np.argsort(-m, axis=1, kind="stable")[:, :k]
        mask = np.zeros(m.shape, dtype=bool)
        np.put_along_axis(mask, order, True, axis=1)
        out.append(mask)
    return out


def row_blocks(parts: QuantParts, group: int) -> Sequence[mx.array]:
    """A gate/up linear's rows as blocks of ``group`` neurons: ``(nb, group, words)`` and two
    ``(nb, group, in / group_size)`` (views: rows of a block are contiguous), and its bias ``(nb, 1, group)``."""
    out = parts.weight.shape[0]
    nb = out // group
    w = parts.weight.reshape(nb, group, -1)
    s = parts.scales.reshape(nb, group, -1)
    b = parts.biases.reshape(nb, group, -1)
    bias = parts.bias.reshape(nb, 1, group) if parts.bias is not None else None
    return w, s, b, bias


def rows_product(x: mx.array, rows: Sequence[mx.array], parts: QuantParts, blocks: mx.array) -> mx.array:
    """``(1, D) -> (n, group)``: a quantized linear's outputs for the neurons of ``blocks`` only."""
    w, s, b, bias = rows
    y = mx.gather_qmm(x.reshape(1, 1, -1), w, s, b, lhs_indices=mx.zeros(blocks.shape, dtype=mx.uint32),
                      rhs_indices=blocks, transpose=True, group_size=parts.group_size, bits=parts.bits)
    if bias is not None:
        y = y + mx.take(bias, blocks, axis=0)
    return y.reshape(blocks.size, -1)


def pack_hot(parts: QuantParts, hot: Sequence[int]) -> Optional[Sequence[mx.array]]:
    """The hot blocks' ``down_proj`` columns as one contiguous quantized matrix (a copy), or None."""
    if not hot:
        return None
    idx = mx.array(list(hot), dtype=mx.uint32)
    out, nb = parts.scales.shape
    arrays = (mx.contiguous(mx.take(parts.weight.reshape(out, nb, -1), idx, axis=1).reshape(out, -1)),
              mx.contiguous(mx.take(parts.scales, idx, axis=1)), mx.contiguous(mx.take(parts.biases, idx, axis=1)))
    mx.eval(arrays)
    return arrays


def block_mass_rows(h: mx.array) -> mx.array:
    """``(nb, group) -> (nb,)``: ``sum |h|`` per block."""
    return mx.abs(h).sum(-1)


def top_mask(mass: mx.array, k: int) -> mx.array:
    """``(nb,) -> (nb,)`` bool: the ``k`` heaviest blocks."""
    nb = mass.size
    if k >= nb:
        return mx.ones((nb,), dtype=mx.bool_)
    return index_mask(mx.argpartition(-mass, kth=k - 1)[:k], nb)


def index_mask(idx: mx.array, n: int) -> mx.array:
    """``(k,) -> (n,)`` bool: True at ``idx``."""
    return mx.zeros((n,), dtype=mx.float32).at[idx].add(1.0) > 0


__all__ = ["block_mass_rows", "choose_hot", "index_mask", "kept_masks", "pack_hot", "row_blocks", "rows_product", "tam_update", "top_mask", "transitions"]
