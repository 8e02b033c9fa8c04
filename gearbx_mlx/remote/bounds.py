"""Entropy of a distribution known only by its top-k probabilities (§12.3).

An opaque server reports, per token, the ``k`` largest log-probabilities of
the next-token distribution over a vocabulary of ``V`` tokens. The rest, the
residual mass ``r = 1 − Σ p_i``, is spread over the other ``V − k`` tokens in
an unknown way, each of them at most ``p_min`` (the smallest reported
probability, since the report is the top k). Given that, the full entropy
``H`` lies in ``[lower, upper]``:

* ``upper`` — the §12.3 estimate: ``r`` spread uniformly over the ``V − k``
  other tokens. A uniform spread *maximises* the entropy of the tail for a
  given mass, so this is an upper bound, not the lower bound §12.3 calls it
  (the paper's wording is wrong; see ``tests/test_remote.py``, which checks
  both bounds against the exact entropy of a real model).
* ``lower`` — the tail packed as tightly as the report allows: ``⌊r/p_min⌋``
  tokens at ``p_min`` and one with the remainder. Entropy is concave, so its
  minimum over ``{0 ≤ q_j ≤ p_min, Σ q_j = r}`` is at a vertex of that set,
  and every vertex is this packing.

The gap ``upper − lower`` is the slack that ``k`` leaves; it shrinks to 0 as
the residual mass does. All values in bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

#: Residual mass below this is rounding in the reported log-probabilities.
RESIDUAL_EPS = 1e-9


@dataclass(frozen=True)
class EntropyBounds:
    """What the top-k report says about one token's entropy (bits)."""

    lower: float  # tightest packing of the residual mass: H >= lower
    upper: float  # residual spread uniformly (§12.3's estimate): H <= upper
    residual: float  # 1 − Σ top-k probabilities (clipped at 0)
    k: int  # how many probabilities the server reported

    @property
    def slack(self) -> float:
        """``upper − lower``: how far the truth can be from either bound."""
        return self.upper - self.lower


def _h(p: float) -> float:
    """``−p log2 p`` (0 at p = 0)."""
    return -p * math.log2(p) if p > 0 else 0.0


def entropy_bounds(logprobs: Sequence[float], vocab_size: int) -> EntropyBounds:
    """Bounds on the entropy of a ``vocab_size`` distribution from its top-k logprobs.

    Args:
        logprobs: the ``k`` reported natural-log probabilities, any order
            (mlx-lm's server returns them unsorted); ``-inf`` allowed.
        vocab_size: ``V`` >= ``k``.

    Returns:
        :class:`EntropyBounds`, with ``0 <= lower <= upper <= log2 V``.
    """
    k = len(logprobs)
    if k == 0:
        raise ValueError("no log-probabilities reported: ask the server for top_logprobs >= 1")
    if vocab_size < k:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {k} reported tokens: pass --vocab-size")
    probs = []
    for lp in logprobs:
        lp = float(lp)
        if math.isnan(lp) or lp > 1e-6:
            raise ValueError(f"not a log-probability: {lp}")
        probs.append(math.exp(min(lp, 0.0)))
    top = sum(_h(p) for p in probs)
    residual = max(0.0, 1.0 - sum(probs))
    rest = vocab_size - k
    hmax = math.log2(vocab_size)
    if residual <= RESIDUAL_EPS or rest == 0:
        h = min(top, hmax)
        return EntropyBounds(h, h, residual, k)
    upper = top + residual * math.log2(rest / residual)
    p_min = min(probs)
    if p_min <= 0.0:
        # A reported zero says nothing about how the tail is packed.
        lower = top
    else:
        full = min(int(residual // p_min), rest)
        remainder = max(0.0, residual - full * p_min)
        lower = top + full * _h(p_min) + (_h(remainder) if full < rest else 0.0)
    lower = min(max(lower, 0.0), hmax)
    upper = min(max(upper, lower), hmax)
    return EntropyBounds(lower, upper, residual, k)


def max_slack(residual: float, p_min: float, vocab_size: int, k: int) -> float:
    """An upper bound on ``upper − lower`` from the residual mass alone.

    Every tail token has ``q <= p_min``, so the tail entropy is at least
    ``r log2(1/p_min)``; the uniform tail has ``r log2((V−k)/r)``. Hence
    ``slack <= r · log2((V − k) · p_min / r)`` (0 when ``r`` is 0).
    """
    if residual <= RESIDUAL_EPS:
        return 0.0
    return max(0.0, residual * math.log2((vocab_size - k) * p_min / residual))
