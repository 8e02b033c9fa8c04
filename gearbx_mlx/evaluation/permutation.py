"""The random routing baseline as a distribution over random permutations of a policy's gears.

One random router (``random@X``, pass 2) is one draw: a policy could beat
it, or lose to it, by the luck of that draw. The baseline here is the
distribution of :data:`PERMUTATIONS` random permutations of the policy's own
gears within each window (each the same gears in the same number, so the
same bytes), with its median and 2.5/97.5 percentiles, and the policy is
compared with all of them.

No permutation costs a forward pass. The first pass scored every position in
every gear of the policy's layers (the static low, mid and high rows of its
scope and store), so a permutation's per-position KL, NLL and top-1 are
re-selected from those rows, each position from the row of the gear the
permutation gives it. That treats a position's numbers as depending on its
own gear alone; in a routed run the earlier positions' keys and values came
from their own gears too. The policy is re-selected the same way from its
own gear trace, so both sides of the comparison carry the same
approximation, and the one permutation run for real in pass 2 says how
large it is: its re-selected mean KL beside its measured one
(``approximation``).

The comparison is a permutation test: the policy's re-selected mean KL
minus each permutation's gives a distribution of differences; the policy is
``lower`` (it beats random routing) when the 97.5th percentile of the
differences is below zero, ``higher`` when the 2.5th is above zero, else
``indistinguishable``; ``p_value`` is the share of permutations (one added
to each count) whose mean KL is at or below the policy's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..config import GEARS
from .significance import HIGHER, LOWER, SAME
from .specs import GEAR_CHAR
from .teacher import RowResult

#: Random permutations of the baseline distribution (the percentiles need a few dozen at least).
PERMUTATIONS = 200
#: The percentiles reported of every distribution.
PERCENTILES = (2.5, 50.0, 97.5)
METHOD = (
    "per-window random permutations of the policy's own gears; each position's KL, NLL and top-1 re-selected "
    "from the first pass's static row of the gear the permutation gives it (no forward pass per permutation); "
    "the policy re-selected the same way from its own gears; a permutation test on mean KL"
)


def gear_rows(first: Sequence[RowResult], row: RowResult) -> Optional[Dict[str, RowResult]]:
    """``{gear char: the first pass's static row of that gear}`` for ``row``'s layers, or None if a gear
    it uses has none. The high gear is the reference (the loaded weights, as a nested store's high gear reads by
    default); the low gear is MLX 4-bit in either store (the nested low plane is MLX's)."""
    spec = row.spec
    out: Dict[str, RowResult] = {}
    for g in GEARS:
        for r in first:
            s = r.spec
            if s.kind != "static" or s.gear != g:
                continue
            if g == "high" and s.is_reference:
                out[GEAR_CHAR[g]] = r
            elif g != "high" and s.scope == spec.scope and (s.store == spec.store or g == "low"):
                out.setdefault(GEAR_CHAR[g], r)
    return out if set("".join(row.gears)) <= set(out) else None


METRICS = ("kl", "nll", "hits")


def _tables(rows: Dict[str, RowResult]) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
    """``(lookup from a gear char's byte to its row index, {metric: (gears, positions) values})``."""
    order = sorted(rows)
    lookup = np.full(256, -1, dtype=np.int64)
    for i, c in enumerate(order):
        lookup[ord(c)] = i
    return lookup, {m: np.stack([np.asarray(getattr(rows[c], m), dtype=np.float64) for c in order]) for m in METRICS}


def _select(idx: np.ndarray, tables: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Values of each metric at ``idx`` ``(..., positions)`` of row indices, position by position."""
    cols = np.arange(idx.shape[-1])
    return {m: t[idx, cols] for m, t in tables.items()}


def reselect(gears: str, rows: Dict[str, RowResult]) -> Dict[str, np.ndarray]:
    """Per-position ``kl``, ``nll`` and ``hits`` of a gear trace (one char a position), each position
    from the row of its gear."""
    lookup, tables = _tables(rows)
    return _select(lookup[np.frombuffer(gears.encode(), dtype=np.uint8)], tables)


def _summary(values: np.ndarray) -> Dict[str, float]:
    low, mid, high = (float(v) for v in np.percentile(values, PERCENTILES))
    return {"median": mid, "p2_5": low, "p97_5": high}


def _means(v: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Mean KL, perplexity and top-1 over the last axis (positions)."""
    return {"mean_kl": v["kl"].mean(axis=-1), "perplexity": np.exp(v["nll"].mean(axis=-1)),
            "top1_agreement": v["hits"].mean(axis=-1)}


def random_distribution(
    row: RowResult,
    rows: Dict[str, RowResult],
    window_steps: int,
    seed: int = 0,
    permutations: int = PERMUTATIONS,
    measured: Optional[RowResult] = None,
) -> Dict[str, Any]:
    """The random baseline of ``row`` (an entropy policy) as a distribution, and the test against it.

    Args:
        rows: :func:`gear_rows` of the policy.
        window_steps: positions per window (permutations stay within windows).
        measured: the pass-2 random row run for real, if any (its gears are one permutation).

    Returns:
        ``{"permutations", "seed", "mean_kl" | "perplexity" | "top1_agreement": {"median", "p2_5", "p97_5"},
        "policy_reselected", "policy_measured", "difference", "outcome", "p_value", "approximation", "method"}``.
    """
    trace = "".join(row.gears)
    if window_steps < 1 or len(trace) % window_steps:
        raise ValueError(f"window_steps must divide the {len(trace)} positions, got {window_steps}")
    lookup, tables = _tables(rows)
    idx = lookup[np.frombuffer(trace.encode(), dtype=np.uint8)]
    windows = np.tile(idx.reshape(-1, window_steps), (permutations, 1, 1))
    shuffled = np.random.default_rng(seed).permuted(windows, axis=2).reshape(permutations, -1)
    stats = _means(_select(shuffled, tables))
    own = {k: float(v) for k, v in _means(_select(idx, tables)).items()}
    d = _summary(own["mean_kl"] - stats["mean_kl"])
    outcome = LOWER if d["p97_5"] < 0 else HIGHER if d["p2_5"] > 0 else SAME
    out: Dict[str, Any] = {
        "permutations": permutations, "seed": seed, **{k: _summary(v) for k, v in stats.items()},
        "policy_reselected": own, "policy_measured": {"mean_kl": row.mean_kl, "perplexity": row.perplexity,
                                                      "top1_agreement": row.top1_agreement},
        "difference": d, "outcome": outcome,
        "p_value": float((1 + np.sum(stats["mean_kl"] <= own["mean_kl"])) / (1 + permutations)),
        "method": METHOD,
    }
    if measured is not None:
        out["approximation"] = {"measured_random_mean_kl": measured.mean_kl,
                                "reselected_random_mean_kl": float(reselect("".join(measured.gears), rows)["kl"].mean())}
    return out


def describe(dist: Optional[Dict[str, Any]]) -> str:
    """``random over 200 permutations, re-selected: KL median 0.0123 [0.0119, 0.0128] vs the policy 0.0101,
    p = 0.005; re-selection vs a real run: ...``."""
    if not dist:
        return ""
    k, a = dist["mean_kl"], dist.get("approximation")
    shown = (f"; re-selection vs a real run: the policy {dist['policy_reselected']['mean_kl']:.3g} vs "
             f"{dist['policy_measured']['mean_kl']:.3g}, its random draw {a['reselected_random_mean_kl']:.3g} vs "
             f"{a['measured_random_mean_kl']:.3g}") if a else ""
    return (f"random over {dist['permutations']} permutations, re-selected: KL median {k['median']:.3g} "
            f"[{k['p2_5']:.3g}, {k['p97_5']:.3g}] vs the policy {dist['policy_reselected']['mean_kl']:.3g}, "
            f"p = {dist['p_value']:.3g}{shown}")
