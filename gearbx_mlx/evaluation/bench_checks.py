"""The bench's verdicts: a measured ratio against a floor, judged against the spread of identical runs.

A bench on a shared or throttling machine sees plain decoding, the same code
run after run, differ by tens of percent between neighbouring runs. A
verdict that compares one ratio with a fixed floor then reports that noise as
a failure. :func:`plain_noise` measures the spread from the bench's own plain
runs (each over the plain run before it, in the order they ran: identical
code, so any ratio away from 1 is the machine), and :func:`auto_check` judges
an automatic speculative row against the floor with it:

* ``ok``: the row's paired ratio meets the floor;
* ``within noise``: it is below the floor by no more than identical runs
  differed (the ratio times the widest plain-vs-plain factor reaches the
  floor), or there are too few plain runs to tell;
* ``FAILED``: it is below the floor by more than identical runs ever differed;
* ``n/a: decoded plainly``: the decision was plain decoding, which runs
  mlx-lm's own loop: that row is plain decoding measured against itself.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

#: The automatic decision must decode at least this share of plain decoding's speed, in the same run.
AUTO_FLOOR = 0.95
#: The verdicts (``passed``: True, None, False, None).
OK, WITHIN_NOISE, FAILED, PLAIN = "ok", "within noise", "FAILED", "n/a: decoded plainly"


def neighbour_ratios(runs: Sequence[float]) -> List[float]:
    """Each run over the one before it: ``runs[i + 1] / runs[i]`` (positive runs only)."""
    return [b / a for a, b in zip(runs, runs[1:]) if a > 0 and b > 0]


def plain_noise(plain_runs: Sequence[float]) -> Dict[str, Any]:
    """The spread of plain decoding against itself.

    Args:
        plain_runs: tokens/s of every plain run, in the order they ran.

    Returns:
        ``{"ratios": [...], "low": ..., "high": ...}``: the neighbour ratios,
        and the band they span taken both ways round (``high`` is the widest
        factor by which two neighbouring runs of identical code differed,
        ``low = 1 / high``); ``low`` and ``high`` are None with fewer than two
        runs (no spread measured: every shortfall is then "within noise").
    """
    ratios = neighbour_ratios(plain_runs)
    if not ratios:
        return {"ratios": [], "low": None, "high": None}
    widest = max(abs(math.log(r)) for r in ratios)
    return {"ratios": ratios, "low": math.exp(-widest), "high": math.exp(widest)}


def auto_check(row: Dict[str, Any], noise: Dict[str, Any], floor: float = AUTO_FLOOR) -> Dict[str, Any]:
    """The verdict on one automatic speculative row (a summarized bench row) against ``floor``.

    ``passed`` is True (ok), False (FAILED) or None (within noise, or not judged).
    """
    value: Optional[float] = row.get("x_plain")
    high = noise.get("high")
    if row.get("choice") == "plain":
        verdict, passed = PLAIN, None
    elif value is not None and value >= floor:
        verdict, passed = OK, True
    elif value is None or high is None or value * high >= floor:
        verdict, passed = WITHIN_NOISE, None
    else:
        verdict, passed = FAILED, False
    return {"name": f"{row['label']} >= {floor:.2f}x plain decoding", "value": value, "floor": floor,
            "verdict": verdict, "passed": passed, "pairs": row.get("paired_x_plain"),
            "noise": {"low": noise.get("low"), "high": noise.get("high")}}


def verdict_of(check: Dict[str, Any]) -> str:
    """A check's verdict; files written before verdicts existed have only ``passed`` (True or False)."""
    if check.get("verdict"):
        return str(check["verdict"])
    return OK if check.get("passed") else FAILED


def describe_check(check: Dict[str, Any]) -> str:
    """One line of the printed table: the ratio, the plain runs' spread, the verdict."""
    value = check.get("value")
    noise = check.get("noise") or {}
    spread = (f" (plain vs plain: {noise['low']:.2f}-{noise['high']:.2f}x)"
              if noise.get("low") is not None and noise.get("high") is not None else "")
    shown = "?" if value is None else f"{value:.2f}"
    return f"Check: {check['name']}: {shown}{spread} -> {verdict_of(check)}"


__all__ = ["AUTO_FLOOR", "FAILED", "OK", "PLAIN", "WITHIN_NOISE", "auto_check", "describe_check",
           "neighbour_ratios", "plain_noise", "verdict_of"]
