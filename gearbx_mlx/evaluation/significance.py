"""Is a difference in KL real? A paired block bootstrap over the scored positions.

Two rows of the evaluation are scored at the same positions of the same
text, so their per-position KL values pair up, and the question "does the
entropy policy beat its baseline" is whether the mean of the paired
differences is below zero by more than chance. Neighbouring positions are
not independent (a gear is held for several steps, and a step's error stays
in the KV cache), so the bootstrap resamples blocks of consecutive positions,
never across a window boundary, rather than single positions; the interval
is the percentile interval of the resampled means. A difference whose
interval covers zero is reported as indistinguishable.

:func:`median_verdict` is the speed benchmarks' counterpart: repeated runs'
ratios against a target, judged by a bootstrap interval of their median.
:func:`balanced_order` is the order those runs take round by round, so that
no configuration always runs at the same place (fresh processes measured
faster or slower by their place in a fixed order).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

#: Verdicts of :func:`median_verdict`.
MET, MISSED, WITHIN_NOISE = "met", "missed", "within noise"
#: Outcomes of a comparison of ``a`` with ``b`` (on KL, lower is better).
LOWER, HIGHER, SAME = "lower", "higher", "indistinguishable"


@dataclass(frozen=True)
class BootstrapSettings:
    """Settings of :func:`paired_difference`.

    Attributes:
        block: consecutive positions resampled together (32: longer than a
            gear is usually held, short enough for 15 blocks in a 512-token
            window).
        resamples: bootstrap resamples (2,000 put the 2.5% and 97.5%
            quantiles within a few percent of their limit).
        level: two-sided confidence level of the interval.
    """

    block: int = 32
    resamples: int = 2000
    level: float = 0.95

    def __post_init__(self) -> None:
        if self.block < 1 or self.resamples < 1 or not 0 < self.level < 1:
            raise ValueError(f"bootstrap settings need block >= 1, resamples >= 1, 0 < level < 1; got {self}")


BOOTSTRAP = BootstrapSettings()

#: Fewest blocks that give a verdict. A percentile bootstrap over a handful of blocks has too few
#: distinct resampled means for its interval to hold its level: with no real difference, 2, 4 and
#: 16 blocks of 32 positions called one in 55%, 19% and 8% of trials against the 5% asked for
#: (``tests/test_eval_harness.py`` repeats the check). Fewer blocks: ``indistinguishable``, and
#: the test says why.
MIN_BLOCKS = 10


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    window_steps: int,
    seed: int = 0,
    settings: BootstrapSettings = BOOTSTRAP,
) -> Dict[str, Any]:
    """Mean of ``a - b`` over positions, its bootstrap interval, and what it says.

    Args:
        a, b: per-position values of two rows (same positions, same order).
        window_steps: positions per window (blocks never cross a window).
        seed: seeds the resampling (the same inputs give the same interval).

    Returns:
        ``{"mean_difference", "interval": [low, high], "outcome": "lower" |
        "higher" | "indistinguishable", "positions", "blocks", ...settings,
        "method"}``. ``lower`` means ``a`` is below ``b`` with the interval
        wholly below zero. Fewer than two blocks, or identical rows, give
        ``indistinguishable``.
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"need two equal-length, non-empty sequences of values, got {x.shape} and {y.shape}")
    if window_steps < 1 or x.size % window_steps:
        raise ValueError(f"window_steps must divide the {x.size} positions, got {window_steps}")
    d = x - y
    sums, counts = _blocks(d, window_steps, settings.block)
    mean = float(d.mean())
    out: Dict[str, Any] = {
        "mean_difference": mean,
        "interval": [mean, mean],
        "outcome": SAME,
        "positions": int(d.size),
        "blocks": int(sums.size),
        **asdict(settings),
        "method": (
            f"paired block bootstrap of the per-position difference: blocks of {settings.block} consecutive "
            f"positions within windows, {settings.resamples} resamples, percentile interval"
        ),
    }
    if sums.size < 2 or not d.any():
        return out
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, sums.size, size=(settings.resamples, sums.size))
    means = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    # The resampled means spread by (B - 1) / B of the variance of the mean over B blocks:
    # widened back about their centre, as the bootstrap-t's small-sample correction does.
    means = mean + (means - mean) * np.sqrt(sums.size / (sums.size - 1))
    tail = (1 - settings.level) / 2
    low, high = (float(v) for v in np.quantile(means, [tail, 1 - tail]))
    out["interval"] = [low, high]
    if sums.size < MIN_BLOCKS:
        out["too_few_blocks"] = (f"{sums.size} blocks of {settings.block} positions: a verdict needs "
                                 f"{MIN_BLOCKS} (score more positions)")
        return out
    out["outcome"] = LOWER if high < 0 else HIGHER if low > 0 else SAME
    return out


def _blocks(d: np.ndarray, window_steps: int, block: int):
    """Sums and sizes of consecutive blocks of ``block`` positions, cut at window boundaries."""
    starts = [w + i for w in range(0, d.size, window_steps) for i in range(0, window_steps, block)]
    ends = [min(s + block, (s // window_steps + 1) * window_steps) for s in starts]
    sums = np.array([d[s:e].sum() for s, e in zip(starts, ends)])
    counts = np.array([e - s for s, e in zip(starts, ends)], dtype=np.float64)
    return sums, counts


def describe(test: Optional[Dict[str, Any]]) -> str:
    """``difference -0.00061 nats [95% CI -0.0008, -0.0004]`` or '' without a test."""
    if not test:
        return ""
    low, high = test["interval"]
    return (
        f"difference {test['mean_difference']:+.3g} nats, {100 * test['level']:.0f}% interval "
        f"[{low:+.3g}, {high:+.3g}] over {test['positions']} positions"
        + (f"; no verdict: {test['too_few_blocks']}" if test.get("too_few_blocks") else "")
    )


def median_verdict(ratios: Sequence[float], target: float, resamples: int = 4000, seed: int = 0) -> Dict[str, Any]:
    """Repeated runs' ratios (say, tokens/s of a variant over its baseline's, one per interleaved pair
    or round) judged against ``target``, accounting for their spread.

    The median, a 95% percentile bootstrap interval of the median (``resamples`` draws, seeded), and
    the verdict: **met** where the whole interval is at or above ``target``, **missed** where it is
    below, else **within noise**. The runs of one machine are not independent draws (they share its
    state), so the interval is a guide to the spread, not a guarantee.

    Raises:
        ValueError: no ratios, or fewer than 100 resamples.
    """
    values = [float(r) for r in ratios]
    if not values:
        raise ValueError("median_verdict needs at least one ratio")
    if resamples < 100:
        raise ValueError(f"resamples must be at least 100, got {resamples}")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    verdict = MET if low >= target else MISSED if high < target else WITHIN_NOISE
    return {"rounds": len(values), "median": round(statistics.median(values), 3),
            "interval_95": [round(low, 3), round(high, 3)], "min": round(min(values), 3),
            "max": round(max(values), 3), "rounds_at_target": sum(r >= target for r in values), "verdict": verdict}


def balanced_order(items: Sequence[T], round_index: int) -> List[T]:
    """``items`` in the order of round ``round_index`` of interleaved runs: rotated by
    ``round_index // 2`` places, reversed on odd rounds. Over ``2 * len(items)``
    rounds every item runs at every place equally often, and the runs next to it
    change from round to round. With a fixed order, one configuration always ran
    last in its round of fresh processes, and that place measured slowest
    (``docs/BENCHMARKS.md``, the OpenBLAS spin).

    Raises:
        ValueError: a negative ``round_index``.
    """
    if round_index < 0:
        raise ValueError(f"round_index must be at least 0, got {round_index}")
    items = list(items)
    if not items:
        return items
    k = (round_index // 2) % len(items)
    turned = items[k:] + items[:k]
    return turned[::-1] if round_index % 2 else turned
