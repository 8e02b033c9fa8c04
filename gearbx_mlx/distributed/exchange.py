"""Rank 0's values of a step on every rank, in one small collective.

Every rank of a sharded model computes the same logits, or nearly: after a
sharded-to-all layer's ``all_sum`` each rank holds the same hidden state, but
a backend or a mix of machines may round the last bits differently, and an
entropy read on logits that differ in their last bits could route two ranks
into different gears (or a greedy near-tie into different tokens), after
which their collectives no longer match. So the values a decision reads are
rank 0's, on every rank: the sampled token, the entropy, the NaN flag (and in
speculative decoding each draft and each block's verdict).

How: each rank writes its own values, as 32-bit words (a float by its bits),
into its own row of a ``(ranks, words)`` uint32 table, zeros elsewhere, and
the group sums the table (``mx.distributed.all_sum``, the backend's own
collective: ring, MPI, NCCL, JACCL alike). A sum of integers with zeros is
exact in any order, so every rank reads back every rank's words bit for bit:
row 0 is what all ranks use, and the other rows say whether each rank's own
values agreed with rank 0's, for the trace. The collective is lazy, part of
the step's graph: it adds no synchronisation of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import mlx.core as mx
import numpy as np


def _words(x: mx.array) -> mx.array:
    """``x`` flattened to uint32 words (bits kept; a bool or a byte-sized value by its value)."""
    x = x.reshape(-1)
    if x.dtype == mx.bool_ or x.dtype.size == 1:
        return x.astype(mx.uint32)
    if x.dtype.size == 2:
        return mx.view(x, mx.uint16).astype(mx.uint32)
    return mx.view(x, mx.uint32)  # 4 bytes: one word each; 8 bytes: two


def _from_words(w: mx.array, dtype: mx.Dtype, shape: Tuple[int, ...]) -> mx.array:
    if dtype == mx.bool_ or dtype.size == 1:
        out = w.astype(dtype)
    elif dtype.size == 2:
        out = mx.view(w.astype(mx.uint16), dtype)
    else:
        out = mx.view(w, dtype)
    return out.reshape(shape)


def _count(dtype: mx.Dtype, size: int) -> int:
    return size * 2 if dtype.size == 8 else size


@dataclass
class Shared:
    """One exchange: rank 0's values (lazy arrays, each as given), and the whole table.

    Attributes:
        values: rank 0's arrays, of the dtypes and shapes given.
        table: ``(ranks, words)`` uint32, row ``r`` rank ``r``'s own words.
        widths: words of each value, in order.
        local: this rank's own words, before the collective (evaluating it
            waits for the step, not for the other ranks).
    """

    values: Tuple[mx.array, ...]
    table: mx.array
    widths: Tuple[int, ...]
    local: mx.array

    def rows(self) -> np.ndarray:
        """The table read on the host ``(ranks, words)`` (evaluates it)."""
        return np.asarray(self.table)

    def columns(self, index: int) -> slice:
        """The table's columns of value ``index``."""
        start = sum(self.widths[:index])
        return slice(start, start + self.widths[index])


class StepExchange:
    """Shares rank 0's values of each step with every rank (see the module doc).

    Args:
        group: the ``mx.distributed`` group the model is sharded over.

    Attributes:
        count: exchanges made (each one collective).
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.count = 0

    def share(self, *values: Any) -> Shared:
        """Rank 0's ``values`` on every rank (lazy; one ``all_sum`` of ``ranks x words`` uint32).

        Args:
            values: arrays (or Python numbers) of any shape; every rank must
                pass the same dtypes and shapes.
        """
        arrays = [v if isinstance(v, mx.array) else mx.array(v) for v in values]
        words = [_words(a) for a in arrays]
        row = mx.concatenate(words) if len(words) > 1 else words[0]
        mine = (mx.arange(self.size) == self.rank)[:, None]
        table = mx.distributed.all_sum(mx.where(mine, row[None, :], mx.zeros_like(row)[None, :]), group=self.group)
        self.count += 1
        out: List[mx.array] = []
        widths = []
        start = 0
        for a in arrays:
            n = _count(a.dtype, a.size)
            out.append(_from_words(table[0, start:start + n], a.dtype, tuple(a.shape)))
            widths.append(n)
            start += n
        return Shared(tuple(out), table, tuple(widths), row)

    def greedy_sampler(self) -> Any:
        """A sampler (mlx-lm's interface) that takes rank 0's argmax on every rank."""

        def sample(logprobs: mx.array) -> mx.array:
            return self.share(mx.argmax(logprobs, axis=-1)).values[0]

        return sample


def agreement(rows: np.ndarray, columns: Sequence[slice]) -> Tuple[bool, ...]:
    """For each column range, whether every rank's words equal rank 0's."""
    return tuple(bool((rows[:, c] == rows[:1, c]).all()) for c in columns)


__all__ = ["Shared", "StepExchange", "agreement"]
