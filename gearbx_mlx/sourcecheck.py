"""Was the source model already quantized? (§6.4, §13.3)

Weights that were quantized and expanded back to float lie, block by block,
on an affine grid ``w = q·s + b`` with few levels. Counting unique values per
row is not enough (a bf16 row of 4,096 random weights repeats values too), so
the check samples aligned blocks of 32 elements (the smallest common group
size) and asks whether every gap between the block's sorted unique values is
an integer multiple of the smallest gap, with at most 255 steps across the
block. Random floats almost never pass (30 near-integer ratios by chance);
dequantized 2-8-bit weights pass whatever their group size, as long as it is a
multiple of 32. Re-quantizing such weights compounds error (§13.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import mlx.core as mx
import numpy as np

BLOCK = 32
#: A gap ratio within this of an integer counts as on the grid (absorbs the
#: rounding of q·s + b to float16 storage).
GRID_TOLERANCE = 0.08
#: Fraction of sampled blocks on a grid above which we warn.
SUSPECT_FRACTION = 0.9


@dataclass(frozen=True)
class SourceCheck:
    """Verdict of the double-quantization heuristic."""

    suspected: bool
    fraction_on_grid: float  # sampled blocks that lie on a small affine grid
    estimated_bits: Optional[int]  # median bits those grids need
    blocks: int

    def message(self) -> str:
        if not self.suspected:
            return "source weights look like floats (no double-quantization risk found)"
        return (
            f"the source weights look already quantized (~{self.estimated_bits}-bit: "
            f"{self.fraction_on_grid:.0%} of {self.blocks} sampled blocks lie on a small "
            "grid); re-quantizing them compounds error (GEARBX §13.3) - prefer the mid "
            "gear or a float source when quality matters"
        )


def _grid_bits(block: np.ndarray) -> Optional[int]:
    """Bits of the affine grid a block lies on, or None if it lies on none."""
    u = np.unique(block.astype(np.float64))
    if len(u) < 2:
        return 1
    d = np.diff(u)
    step = d.min()
    if step <= 0:
        return None
    # Refine the step by least squares over the gaps: storage rounding (e.g.
    # float16) jitters single gaps by a few percent of a step.
    for _ in range(3):
        n = np.maximum(np.round(d / step), 1.0)
        step = d.sum() / n.sum()
    offsets = (u - u[0]) / step
    steps = round(offsets[-1])
    if steps > 255 or np.max(np.abs(offsets - np.round(offsets))) > GRID_TOLERANCE:
        return None
    return max(1, math.ceil(math.log2(steps + 1)))


def check_weights(
    weights: Iterable[np.ndarray], rows_per_matrix: int = 8, seed: int = 0
) -> SourceCheck:
    """Sample rows of each 2-D weight matrix and test their blocks.

    Args:
        weights: float matrices ``(O, I)`` (numpy, any float dtype).
        rows_per_matrix: rows sampled from each matrix.
    """
    rng = np.random.default_rng(seed)
    on_grid, bits, total = 0, [], 0
    for w in weights:
        w = np.asarray(w)
        if w.ndim != 2 or w.shape[1] < BLOCK:
            continue
        rows = rng.choice(w.shape[0], size=min(rows_per_matrix, w.shape[0]), replace=False)
        nblocks = w.shape[1] // BLOCK
        for r in rows:
            b = int(rng.integers(nblocks))
            g = _grid_bits(w[r, b * BLOCK : (b + 1) * BLOCK])
            total += 1
            if g is not None:
                on_grid += 1
                bits.append(g)
    if total == 0:
        return SourceCheck(False, 0.0, None, 0)
    frac = on_grid / total
    est = int(np.median(bits)) if bits else None
    return SourceCheck(frac >= SUSPECT_FRACTION, frac, est, total)


def check_modules(modules: Iterable, max_modules: int = 8) -> SourceCheck:
    """Run :func:`check_weights` on the ``weight`` of up to ``max_modules`` modules."""
    mats = []
    for i, m in enumerate(modules):
        if i >= max_modules:
            break
        w = getattr(m, "weight", None)
        if w is None or w.ndim != 2 or not mx.issubdtype(w.dtype, mx.floating):
            continue
        mats.append(np.array(w.astype(mx.float32)))
    return check_weights(mats)
