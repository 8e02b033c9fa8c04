"""Routers on per-step signals: the table of signal policies, their rules, and their calibration.

Two rules turn a signal into gears (low = 4-bit, high = the loaded weights):

* ``lagged`` (the specification's shape, lag 0): the signal of step t, in
  whatever gear step t ran, smoothed over the last ``smooth`` steps, decides
  the gear of step t+1: high above the threshold, else low. The first step of
  a window runs high (the cold start).
* ``fallback``: every step runs low; when the low gear's own signal at that
  step is above the threshold, the step is computed again in the high gear
  and that answer is used. Such a step reads both gears' weights.

Each policy's threshold is calibrated on a calibration text to spend a byte
budget (by default the bytes of static 8-bit weights); a signal whose
direction is not known in advance (the hidden-state norm) takes the sign of
its rank correlation with the low gear's KL on the calibration text. The
learned router is a logistic regression (Newton's method, L2, numpy) on the
cheap per-step features, trained on the calibration text to flag the steps
whose low-gear KL is in the budget's top fraction.

:data:`SIGNALS` is the table of policies and :data:`ROUTERS` the defaults;
:func:`signal_policy` turns a name into its entry or one clear error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

#: Rules (see the module doc).
LAGGED, FALLBACK = "lagged", "fallback"
#: Feature a learned policy scores with (its own model, not one measured feature).
LEARNED = "learned"
#: Per-step features the learned router reads (``log_hidden_norm`` is the log of :func:`.signals.hidden_norm`).
FEATURES = ("entropy", "varentropy", "margin", "log_hidden_norm")


@dataclass(frozen=True)
class SignalPolicy:
    """One row of the routing table.

    Attributes:
        name: the row's label.
        feature: a feature of :data:`FEATURES`, or :data:`LEARNED`.
        rule: :data:`LAGGED` or :data:`FALLBACK`.
        direction: +1: a larger value asks for the high gear; -1: a smaller
            one; 0: the sign is calibrated (:func:`calibrated_sign`).
        smooth: steps of the trailing mean (lagged rule only).
        description: what the signal is, for the table.
    """

    name: str
    feature: str
    rule: str
    direction: int = 1
    smooth: int = 1
    description: str = ""

    def __post_init__(self) -> None:
        if self.feature not in FEATURES + (LEARNED,):
            raise ValueError(f"{self.name}: feature must be one of {FEATURES + (LEARNED,)}, got {self.feature!r}")
        if self.rule not in (LAGGED, FALLBACK):
            raise ValueError(f"{self.name}: rule must be {LAGGED!r} or {FALLBACK!r}, got {self.rule!r}")
        if self.direction not in (-1, 0, 1) or self.smooth < 1:
            raise ValueError(f"{self.name}: direction must be -1, 0 or 1 and smooth >= 1")


@dataclass(frozen=True)
class RouterSettings:
    """Defaults of the signal routers (one place).

    Attributes:
        budget_gear: the static gear whose modeled bytes every policy is
            calibrated to spend (``mid``: 8-bit weights everywhere).
        smooth: the specification's smoothing window (``GearboxConfig.window``).
        l2: L2 penalty of the learned router (standardized features).
        newton_steps: Newton iterations of the logistic regression.
        bisection_steps: halvings of a lagged threshold's search.
    """

    budget_gear: str = "mid"
    smooth: int = 3
    l2: float = 1e-2
    newton_steps: int = 30
    bisection_steps: int = 40


ROUTERS = RouterSettings()

#: The routing table: every signal policy, by name (defaults above).
SIGNALS: Dict[str, SignalPolicy] = {p.name: p for p in (
    SignalPolicy("entropy-lagged", "entropy", LAGGED, 1, ROUTERS.smooth,
                 "the specification's signal: entropy, trailing mean of 3 steps, decides the next step"),
    SignalPolicy("varentropy", "varentropy", LAGGED, 1, 1, "variance of the surprisal, decides the next step"),
    SignalPolicy("margin", "margin", LAGGED, -1, 1, "top-1 minus top-2 probability (small: high gear), next step"),
    SignalPolicy("hidden-norm", "log_hidden_norm", LAGGED, 0, 1,
                 "norm of the last hidden state, sign calibrated, decides the next step"),
    SignalPolicy("learned", LEARNED, LAGGED, 1, 1, "logistic regression on the four features, next step"),
    SignalPolicy("low-entropy-fallback", "entropy", FALLBACK, 1, 1,
                 "the low gear's own entropy at this step; above the threshold the step is redone in high"),
    SignalPolicy("learned-fallback", LEARNED, FALLBACK, 1, 1,
                 "logistic regression on the low gear's own features at this step; fallback to high"),
)}


def signal_policy(name: str) -> SignalPolicy:
    """The table's entry for ``name``; ``ValueError`` naming the choices if there is none."""
    if name not in SIGNALS:
        raise ValueError(f"unknown signal policy {name!r}: choose from {', '.join(SIGNALS)}")
    return SIGNALS[name]


# -- rules ---------------------------------------------------------------------------------------


def route_lagged(scores: np.ndarray, threshold: float, smooth: int = 1) -> np.ndarray:
    """High-gear steps of one window under the lagged rule.

    Args:
        scores: ``(2, S)``: row 0 the signal of each step in the low gear, row
            1 in the high gear (a step's signal is the one of the gear it ran in).
        threshold: the next step is high when the trailing mean is above it.
        smooth: steps of the trailing mean.

    Returns:
        ``(S,)`` bool: True where the step runs in the high gear (step 0 always).
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[0] != 2 or smooth < 1:
        raise ValueError(f"need (2, steps) scores and smooth >= 1, got {scores.shape} and {smooth}")
    n = scores.shape[1]
    high = np.zeros(n, dtype=bool)
    if n == 0:
        return high
    high[0] = True
    seen: List[float] = []
    for t in range(n - 1):
        seen.append(scores[int(high[t]), t])
        high[t + 1] = sum(seen[-smooth:]) / len(seen[-smooth:]) > threshold
    return high


def route_fallback(low_scores: np.ndarray, threshold: float) -> np.ndarray:
    """``(S,)`` bool: True where a step falls back (its low-gear signal is above ``threshold``)."""
    return np.asarray(low_scores, dtype=np.float64) > threshold


def route_windows(route: Callable[[slice], np.ndarray], positions: int, window_steps: int) -> np.ndarray:
    """``route(window's slice)`` over consecutive windows (each a fresh sequence), concatenated."""
    if window_steps < 1 or positions % window_steps:
        raise ValueError(f"window_steps must divide the {positions} positions, got {window_steps}")
    return np.concatenate([route(slice(s, s + window_steps)) for s in range(0, positions, window_steps)])


def fit_threshold(fraction: Callable[[float], float], target: float, low: float, high: float,
                  steps: int = ROUTERS.bisection_steps) -> float:
    """The threshold in ``[low, high]`` whose ``fraction(threshold)`` (non-increasing) is nearest ``target``.

    Bisection; ``fraction`` is the share of high (or fallback) steps a threshold gives.
    """
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target fraction must be in [0, 1], got {target}")
    a, b = float(low), float(high)
    for _ in range(steps):
        mid = (a + b) / 2
        a, b = (mid, b) if fraction(mid) > target else (a, mid)
    return min((a, b), key=lambda x: abs(fraction(x) - target))


def calibrated_sign(feature: np.ndarray, cost: np.ndarray) -> int:
    """+1 if ``feature`` rises with ``cost`` (Spearman's rank correlation >= 0), else -1."""
    f, c = np.asarray(feature, dtype=np.float64), np.asarray(cost, dtype=np.float64)
    if f.shape != c.shape or f.size < 2:
        raise ValueError(f"need two equal-length sequences of >= 2 values, got {f.shape} and {c.shape}")
    rf, rc = np.argsort(np.argsort(f)), np.argsort(np.argsort(c))
    if rf.std() == 0 or rc.std() == 0:
        return 1  # a constant says nothing: keep the default direction
    return 1 if np.corrcoef(rf, rc)[0, 1] >= 0 else -1


# -- the learned router ------------------------------------------------------------------------------


@dataclass
class Logistic:
    """A fitted logistic regression on standardized features; :meth:`score` is its logit."""

    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float
    names: Tuple[str, ...] = field(default=FEATURES)

    def score(self, x: np.ndarray) -> np.ndarray:
        """``(N, F)`` features -> ``(N,)`` logits."""
        return ((np.asarray(x, dtype=np.float64) - self.mean) / self.scale) @ self.weights + self.bias

    def to_dict(self) -> Dict[str, object]:
        return {"features": list(self.names), "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "weights": self.weights.tolist(), "bias": self.bias}


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = ROUTERS.l2, steps: int = ROUTERS.newton_steps,
                 names: Sequence[str] = FEATURES) -> Logistic:
    """Logistic regression of ``y`` (0/1, ``(N,)``) on ``x`` ``(N, F)`` by Newton's method with an L2 penalty
    (the bias is not penalized); features are standardized first."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],) or x.shape[0] < 2 or not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"need (N, F) features and N labels of 0/1 (N >= 2), got {x.shape} and {y.shape}")
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    z = np.hstack([(x - mean) / scale, np.ones((x.shape[0], 1))])
    w = np.zeros(z.shape[1])
    penalty = np.full(z.shape[1], l2 * x.shape[0])
    penalty[-1] = 0.0
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ w, -30, 30)))
        grad = z.T @ (p - y) + penalty * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty) + 1e-9 * np.eye(z.shape[1])
        w = w - np.linalg.solve(hess, grad)
    return Logistic(mean, scale, w[:-1], float(w[-1]), tuple(names))


def top_fraction_labels(cost: np.ndarray, fraction: float) -> np.ndarray:
    """1 where ``cost`` is in its top ``fraction`` (ties above the cut included), else 0."""
    c = np.asarray(cost, dtype=np.float64)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    return (c >= np.quantile(c, 1.0 - fraction)).astype(np.float64)
