"""The routing table: every signal policy against its random permutations, a position rule and static 8-bit.

Built from the per-gear rows of :mod:`.signal_study` (see it for the method);
:func:`routing_table` returns the rows as data, :func:`format_table` as text.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..config import GearboxConfig
from .permutation import random_distribution
from .routers import ROUTERS, SIGNALS, RouterSettings, signal_policy
from .signal_study import METRICS, STATES, GearRows, calibrate, monitor_trace
from .significance import LOWER, paired_difference
from .specs import PolicySpec
from .teacher import RowResult

#: Name of the specification's router in the table.
MONITOR_ROW = "entropy-monitor"
METHOD = (
    "one teacher-forced pass per gear (high = loaded weights, the reference; mid = 8-bit; low = 4-bit; every "
    "linear layer, MLX affine group 64); each policy re-selected position by position from the row of its "
    "gear (a fallback step: the high row, at low + high bytes); thresholds and the learned router fitted on "
    "the calibration text to spend static 8-bit's bytes, applied to the evaluation text; random baseline: "
    "permutations of the policy's own states within each window (same bytes); test_random: paired block "
    "bootstrap of the policy's per-position KL minus the permutations' expected per-position KL"
)


def state_values(trace: str, rows: GearRows) -> Dict[str, np.ndarray]:
    """Per-position ``kl``, ``nll``, ``hits`` of a state trace (one char of :data:`STATES` a position)."""
    if len(trace) != rows.positions or set(trace) - set(STATES):
        raise ValueError(f"need {rows.positions} states over {sorted(STATES)}, got {len(trace)}")
    t = np.frombuffer(trace.encode(), dtype=np.uint8)
    out = {m: np.zeros(rows.positions) for m in METRICS}
    for c, g in STATES.items():
        mask = t == ord(c)
        for m in METRICS:
            out[m][mask] = rows.values[g][m][mask]
    return out


def state_bytes(costs: Dict[str, float]) -> Dict[str, float]:
    """Modeled weight bytes of one step in each state (a fallback step reads both gears)."""
    return {"l": costs["low"], "m": costs["mid"], "h": costs["high"], "f": costs["low"] + costs["high"]}


def trace_bytes(trace: str, costs: Dict[str, float]) -> float:
    """Mean modeled bytes per token of a state trace."""
    per = state_bytes(costs)
    return sum(trace.count(c) * per[c] for c in sorted(per)) / len(trace)


def expected_permutation_kl(trace: str, rows: GearRows) -> np.ndarray:
    """Per-position KL expected under a uniform permutation of the states within each window."""
    w = rows.window_steps
    out = np.zeros(rows.positions)
    for s in range(0, rows.positions, w):
        part = trace[s : s + w]
        for c in set(part):
            out[s : s + w] += part.count(c) / w * rows.values[STATES[c]]["kl"][s : s + w]
    return out


def position_trace(target_bytes: float, costs: Dict[str, float], positions: int, window_steps: int) -> str:
    """High then low in each window, with the share of high steps that spends ``target_bytes``."""
    lo, hi = costs["low"], costs["high"]
    k = int(round(min(max((target_bytes - lo) / (hi - lo), 0.0), 1.0) * window_steps))
    return ("h" * k + "l" * (window_steps - k)) * (positions // window_steps)


def _row_result(name: str, trace: str, v: Dict[str, np.ndarray]) -> RowResult:
    r = RowResult(PolicySpec(name, "entropy", "all", source="signal"), steps=len(trace))
    r.kl, r.nll, r.hits = v["kl"].tolist(), v["nll"].tolist(), [bool(x) for x in v["hits"]]
    r.kl_sum, r.nll_sum, r.agree = float(np.sum(v["kl"])), float(np.sum(v["nll"])), int(np.sum(v["hits"]))
    r.gears = list(trace)
    return r


def summarize(name: str, trace: str, rows: GearRows, costs: Dict[str, float], seed: int = 0,
              compare: bool = True) -> Dict[str, Any]:
    """One table row: quality, bytes, states; with ``compare``, the three comparisons at its bytes."""
    v = state_values(trace, rows)
    b = trace_bytes(trace, costs)
    out: Dict[str, Any] = {
        "name": name, "mean_kl": float(v["kl"].mean()), "perplexity": float(np.exp(v["nll"].mean())),
        "top1_agreement": float(v["hits"].mean()), "bytes_per_token": b, "relative_bytes": b / costs["high"],
        "bytes_vs_static_8bit": b / costs["mid"], "states": {c: trace.count(c) for c in sorted(set(trace))}, "trace": trace,
    }
    if not compare:
        return out
    w = rows.window_steps
    parts = {c: _row_result(c, c * rows.positions, state_values(c * rows.positions, rows)) for c in set(trace)}
    dist = random_distribution(_row_result(name, trace, v), parts, w, seed)
    out["random_distribution"] = {k: dist[k] for k in ("permutations", "mean_kl", "difference", "outcome", "p_value")}
    out["test_random"] = paired_difference(v["kl"], expected_permutation_kl(trace, rows), w, seed)
    pos = position_trace(b, costs, rows.positions, w)
    out["position"] = {"bytes_per_token": trace_bytes(pos, costs), "mean_kl": float(state_values(pos, rows)["kl"].mean())}
    out["test_position"] = paired_difference(v["kl"], state_values(pos, rows)["kl"], w, seed)
    out["test_static_8bit"] = paired_difference(v["kl"], rows.values["mid"]["kl"], w, seed)
    out["beats_random"] = out["test_random"]["outcome"] == LOWER and dist["outcome"] == LOWER
    return out


def routing_table(calibration: GearRows, evaluation: GearRows, costs: Dict[str, float], vocab_size: int,
                  names: Optional[Sequence[str]] = None, seed: int = 0,
                  settings: RouterSettings = ROUTERS, config: Optional[GearboxConfig] = None) -> Dict[str, Any]:
    """Static rows, the specification's router and every signal policy (``names``; None: the whole table)."""
    policies = [signal_policy(n) for n in (names if names is not None else SIGNALS)]
    budget = costs[settings.budget_gear]
    n = evaluation.positions
    rows: List[Dict[str, Any]] = [summarize(f"static-{g}", c * n, evaluation, costs, seed, compare=False)
                                  for g, c in (("high", "h"), ("mid", "m"), ("low", "l"))]
    rows.append(summarize(MONITOR_ROW, monitor_trace(evaluation, vocab_size, config or GearboxConfig()),
                          evaluation, costs, seed))
    learned: Dict[str, Any] = {}
    for p in policies:
        c = calibrate(p, calibration, costs, budget, settings)
        row = summarize(p.name, c.trace(evaluation), evaluation, costs, seed)
        row.update(rule=p.rule, signal=p.description, direction=c.direction, threshold=c.threshold,
                   target_fraction=c.target_fraction, calibration_fraction=c.calibration_fraction)
        if c.model is not None:
            learned[p.name] = c.model.to_dict()
        rows.append(row)
    return {"budget": {"gear": settings.budget_gear, "bytes_per_token": budget}, "costs": costs, "rows": rows,
            "learned": learned, "method": METHOD,
            "beats_random": [r["name"] for r in rows if r.get("beats_random")]}


def format_table(table: Dict[str, Any]) -> str:
    """The rows as text: KL, bytes, and each comparison's difference and 95% interval."""
    head = (f"{'policy':22} {'KL':>8} {'bytes/8bit':>10} {'vs random [95%]':>30} {'p':>6} "
            f"{'vs position [95%]':>30} {'vs static 8-bit [95%]':>30}")
    lines = [head, "-" * len(head)]
    for r in table["rows"]:
        cells = [f"{r['name']:22} {r['mean_kl']:8.4f} {r['bytes_vs_static_8bit']:10.3f}"]
        for key in ("test_random", "random_p", "test_position", "test_static_8bit"):
            if key == "random_p":
                cells.append(f"{r['random_distribution']['p_value']:6.3f}" if "random_distribution" in r else f"{'':6}")
            else:
                cells.append(f"{_interval(r.get(key)):>30}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _interval(test: Optional[Dict[str, Any]]) -> str:
    if not test:
        return ""
    low, high = test["interval"]
    return f"{test['mean_difference']:+.4f} [{low:+.4f},{high:+.4f}]"
