"""Per-step routing signals, each a small pure function of one step's numbers.

A router decides a step's gear from what earlier steps (or, with a
fallback, the step itself in the low gear) computed. The candidates measured
by :mod:`.signal_study` are all cheap by-products of a decode step:

* :func:`entropy_bits`: Shannon entropy of the next-token distribution (what
  the specification's router smooths over a window and lags by one step);
* :func:`varentropy_bits`: the variance of the surprisal ``-log2 p`` under
  ``p`` (how unevenly the mass is spread, which entropy alone does not say);
* :func:`top_margin`: the probability gap between the two most likely tokens;
* :func:`hidden_norm`: the L2 norm of the last hidden state (the input of the
  model's final norm).

The specification's smoothing (a trailing mean of 3 steps) depends on the
gears a router chose, so it lives in the router (:func:`.routers.route_lagged`).

Every function takes ``(S, V)`` log-probabilities (natural log) or ``(S, D)``
hidden states and returns one float64 value per position ``(S,)``.
"""

from __future__ import annotations

import math
from typing import Dict

import numpy as np

LN2 = math.log(2.0)


def log_probs(logits: np.ndarray) -> np.ndarray:
    """``(S, V)`` log-probabilities (natural log, float64) of ``(S, V)`` logits."""
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(f"need (positions, vocabulary >= 2) logits, got shape {z.shape}")
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def entropy_bits(lp: np.ndarray) -> np.ndarray:
    """Entropy in bits of each row of ``(S, V)`` log-probabilities, in ``[0, log2 V]``."""
    p = np.exp(lp)
    h = -np.einsum("sv,sv->s", p, np.where(p > 0, lp, 0.0)) / LN2
    return np.clip(h, 0.0, math.log2(lp.shape[-1]))


def varentropy_bits(lp: np.ndarray) -> np.ndarray:
    """Variance of the surprisal ``-log2 p(x)`` under ``p`` (bits squared), per row; >= 0.

    Computed as ``E[(s - H)^2]`` around the row's own entropy, not as
    ``E[s^2] - H^2``, which cancels badly for peaked rows.
    """
    p = np.exp(lp)
    s = np.where(p > 0, -lp / LN2, 0.0)
    h = np.einsum("sv,sv->s", p, s)
    return np.maximum(np.einsum("sv,sv->s", p, (s - h[:, None]) ** 2), 0.0)


def top_margin(lp: np.ndarray) -> np.ndarray:
    """``p1 - p2``, the probability gap between the two most likely tokens, per row; in ``[0, 1]``."""
    top2 = np.partition(lp, lp.shape[-1] - 2, axis=-1)[:, -2:]
    p = np.exp(top2)
    return np.clip(np.abs(p[:, 1] - p[:, 0]), 0.0, 1.0)


def hidden_norm(hidden: np.ndarray) -> np.ndarray:
    """L2 norm of each position's hidden state ``(S, D)`` -> ``(S,)``."""
    h = np.asarray(hidden, dtype=np.float64)
    if h.ndim != 2:
        raise ValueError(f"need (positions, hidden size) states, got shape {h.shape}")
    return np.sqrt(np.einsum("sd,sd->s", h, h))


def distribution_signals(logits: np.ndarray, rows: int = 32) -> Dict[str, np.ndarray]:
    """``{"entropy", "varentropy", "margin"}`` per position of ``(S, V)`` logits, ``rows`` positions at
    a time (a large vocabulary's float64 temporaries stay small)."""
    parts = []
    for i in range(0, len(logits), rows):
        lp = log_probs(logits[i : i + rows])
        parts.append((entropy_bits(lp), varentropy_bits(lp), top_margin(lp)))
    cols = [np.concatenate(c) if c else np.zeros(0) for c in zip(*parts)] or [np.zeros(0)] * 3
    return dict(zip(("entropy", "varentropy", "margin"), cols))
