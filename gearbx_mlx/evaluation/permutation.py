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

import math
from typing import Any, Dict, Optional, Sequence

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


def reselect(gears: str, rows: Dict[str, RowResult]) -> Dict[str, np.ndarray]:
    """Per-position ``kl``, ``nll`` and ``hits`` of a gear trace (one char a position), each position
    from the row of its gear."""
    pick = np.frombuffer(gears.encode(), dtype=np.uint8)
    out = {}
    for name in ("kl", "nll", "hits"):
        values = np.zeros(pick.size)
        for c, r in rows.items():
            mask = pick == ord(c)
            values[mask] = np.asarray(getattr(r, name), dtype=np.float64)[mask]
        out[name] = values
    return out


def _summary(values: np.ndarray) -> Dict[str, float]:
    low, mid, high = (float(v) for v in np.percentile(values, PERCENTILES))
    return {"median": mid, "p2_5": low, "p97_5": high}


def _means(v: Dict[str, np.ndarray]) -> Dict[str, float]:
    return {"mean_kl": float(v["kl"].mean()), "perplexity": math.exp(float(v["nll"].mean())),
            "top1_agreement": float(v["hits"].mean())}


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
        "policy_reselected", "difference": {...}, "outcome", "p_value", "approximation", "method"}``.
    """
    trace = "".join(row.gears)
    if window_steps < 1 or len(trace) % window_steps:
        raise ValueError(f"window_steps must divide the {len(trace)} positions, got {window_steps}")
    rng = np.random.default_rng(seed)
    chars = np.frombuffer(trace.encode(), dtype=np.uint8).reshape(-1, window_steps)
    stats = {k: np.empty(permutations) for k in ("mean_kl", "perplexity", "top1_agreement")}
    for i in range(permutations):
        shuffled = rng.permuted(chars, axis=1).tobytes().decode()
        for k, v in _means(reselect(shuffled, rows)).items():
            stats[k][i] = v
    own = _means(reselect(trace, rows))
    diff = own["mean_kl"] - stats["mean_kl"]
    d = _summary(diff)
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
                                "reselected_random_mean_kl": _means(reselect("".join(measured.gears), rows))["mean_kl"]}
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
