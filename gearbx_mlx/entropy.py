"""Shannon entropy of the next-token distribution and the gear monitor (§3).

Two pieces:

* :func:`entropy_bits` turns logits into entropy in bits, in float32 whatever
  the model's dtype (half-precision log-probabilities lose the digits that
  low entropies are made of), as a lazy device array so it can be read after the step's natural
  synchronisation (§3.6).
* :class:`EntropyMonitor` is the pure-Python state machine: rolling window,
  vocabulary-scaled thresholds, hysteresis, minimum gear duration, slope and
  look-ahead prediction, catastrophic fallback. Deterministic given the
  sequence of entropies it is fed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Tuple

import mlx.core as mx
import numpy as np

from .config import GEAR_INDEX, GEARS, GearboxConfig

LN2 = math.log(2.0)
#: §16.2 NaN guard: NaN -> 0, +inf -> 1e4, -inf -> -1e4.
NAN_GUARD = (0.0, 1e4, -1e4)


def sanitize_logits(logits: mx.array) -> mx.array:
    """§10.1 guard: replace NaN and infinities so softmax stays finite."""
    nan, posinf, neginf = NAN_GUARD
    return mx.nan_to_num(logits, nan=nan, posinf=posinf, neginf=neginf)


def entropy_bits(logits: mx.array) -> mx.array:
    """Shannon entropy in bits of ``softmax(logits)`` along the last axis.

    Args:
        logits: ``(..., V)`` logits in any float dtype.

    Returns:
        ``(...)`` float32 entropies, clipped to ``[0, log2 V]`` (lazy).
    """
    z = sanitize_logits(logits.astype(mx.float32))
    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    h = -mx.sum(mx.exp(logp) * logp, axis=-1) / LN2
    return mx.clip(h, 0.0, math.log2(logits.shape[-1]))


def entropy_bits_np(z: np.ndarray) -> float:
    """:func:`entropy_bits` of one ``(V,)`` float32 numpy vector, on the host.

    For logits already in host memory (the speculative verify reads k+1 rows
    at once; the host drafter's logits never leave numpy): MLX's CPU exp over
    those rows cost more than this.
    """
    if not np.isfinite(z).all():
        z = np.nan_to_num(z, nan=NAN_GUARD[0], posinf=NAN_GUARD[1], neginf=NAN_GUARD[2])
    zm = z - z.max()
    e = np.exp(zm)
    s = float(e.sum())
    h = (math.log(s) - float(np.dot(e, zm)) / s) / math.log(2.0)
    return min(max(h, 0.0), math.log2(z.size))


def scaled_thresholds(config: GearboxConfig, vocab_size: int) -> Tuple[float, float]:
    """Thresholds in the model's bits (§3.4): ``θ · log2 V / log2 V_ref``."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    scale = math.log2(vocab_size) / math.log2(config.reference_vocab)
    if not config.scale_thresholds:
        scale = 1.0
    return config.low_threshold * scale, config.high_threshold * scale


def classify(h: float, low: float, high: float) -> str:
    """Gear of a smoothed entropy without hysteresis (§3.3)."""
    if h <= low:
        return "low"
    if h >= high:
        return "high"
    return "mid"


@dataclass(frozen=True)
class MonitorStep:
    """What the monitor concluded after one entropy value."""

    entropy: float  # raw H_t, bits
    smoothed: float  # rolling mean over the window
    slope: float  # bits per step over the window
    predicted: float  # smoothed + lookahead × slope (§3.5)
    predicted_gear: str  # classify(predicted), for pre-warming
    proposed: str  # classification with hysteresis, before the duration rule
    gear: str  # the gear the next forward pass should use
    catastrophic: bool


class EntropyMonitor:
    """Rolling-window entropy monitor with hysteresis and minimum duration.

    Args:
        vocab_size: the model's vocabulary size ``V``.
        config: router settings (window, thresholds, hysteresis, ...).
        thresholds: ``(low, high)`` in the model's bits, e.g. from calibration;
            overrides the scaled defaults of ``config``.
        initial_gear: the gear in force before any entropy is seen.
    """

    def __init__(
        self,
        vocab_size: int,
        config: Optional[GearboxConfig] = None,
        thresholds: Optional[Tuple[float, float]] = None,
        initial_gear: str = "high",
    ) -> None:
        self.config = config or GearboxConfig()
        self.vocab_size = int(vocab_size)
        self.max_entropy = math.log2(self.vocab_size)
        if thresholds is None:
            thresholds = scaled_thresholds(self.config, self.vocab_size)
        self.set_thresholds(*thresholds)
        self.reset(initial_gear)

    # -- state -------------------------------------------------------------
    def set_thresholds(self, low: float, high: float) -> None:
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(f"thresholds must be finite, got ({low}, {high})")
        if not 0 <= low < high:
            raise ValueError(
                f"thresholds are in the wrong order: low={low:.4g} must be below "
                f"high={high:.4g} and both >= 0 (give LOW then HIGH)"
            )
        self.low, self.high = float(low), float(high)

    def reset(self, initial_gear: str = "high") -> None:
        """Forget the history (thresholds and calibration are kept)."""
        if initial_gear not in GEAR_INDEX:
            raise ValueError(f"unknown gear {initial_gear!r}: choose one of {GEARS}")
        self.window: Deque[float] = deque(maxlen=self.config.window)
        self.recent: Deque[float] = deque(maxlen=2)
        self.gear = initial_gear
        # The initial gear counts as held long enough: observed entropy
        # overrides the cold-start guess at the first decision (§11).
        self.tokens_in_gear = self.config.min_gear_duration
        self.steps = 0

    # -- the decision -------------------------------------------------------
    def _with_hysteresis(self, h: float) -> str:
        """§3.3: leave an extreme gear only after crossing its threshold by h."""
        m = self.config.hysteresis
        if self.gear == "low" and h <= self.low + m:
            return "low"
        if self.gear == "high" and h >= self.high - m:
            return "high"
        return classify(h, self.low, self.high)

    def push(self, entropy: float) -> MonitorStep:
        """Feed one raw entropy (bits); return the gear for the next step."""
        h = float(entropy)
        if not math.isfinite(h):
            # A non-finite entropy means non-finite logits: treat as worst case.
            h = self.max_entropy
        h = min(max(h, 0.0), self.max_entropy)
        self.window.append(h)
        self.recent.append(h)
        self.steps += 1
        n = len(self.window)
        smoothed = sum(self.window) / n
        slope = (self.window[-1] - self.window[0]) / (n - 1) if n > 1 else 0.0
        predicted = smoothed + self.config.lookahead * slope
        limit = self.config.catastrophic_fraction * self.max_entropy
        catastrophic = len(self.recent) == 2 and all(x > limit for x in self.recent)

        proposed = "high" if catastrophic else self._with_hysteresis(smoothed)
        # Catastrophic entropy overrides the duration rule: it is the safety net.
        may_shift = catastrophic or self.tokens_in_gear >= self.config.min_gear_duration
        gear = proposed if (proposed != self.gear and may_shift) else self.gear
        if gear != self.gear:
            self.gear = gear
            self.tokens_in_gear = 1
        else:
            self.tokens_in_gear += 1
        return MonitorStep(
            entropy=h,
            smoothed=smoothed,
            slope=slope,
            predicted=predicted,
            predicted_gear=classify(predicted, self.low, self.high),
            proposed=proposed,
            gear=gear,
            catastrophic=catastrophic,
        )
