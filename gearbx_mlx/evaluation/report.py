"""Results as data: per-policy rows, matched comparisons, the table, the JSON file.

Quality numbers are stored at full float precision (they are reproducible
bit for bit on one machine and command); the printed table rounds them.
A comparison's verdict comes from a paired test over positions
(:mod:`.significance`), not from which mean is smaller.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .. import atomicfile
from ..config import GEARS
from . import permutation, significance
from .teacher import RowResult

FORMAT = "gearbx-eval"
#: 2: random baselines permute the policy's own gears; comparisons carry a test; KL traces.
#: 3: the random baseline is a distribution over permutations (:mod:`.permutation`), and
#: ``beats_random`` is the permutation test's.
VERSION = 3
#: Entropies kept in the JSON trace are rounded: they only feed the figures.
TRACE_DECIMALS = 4
#: Significant digits of the per-position KL kept in the trace (enough to redo the test).
KL_DIGITS = 6
#: Words of a comparison's outcome (KL: lower is better).
OUTCOME_WORDS = {
    significance.LOWER: "beats",
    significance.HIGHER: "does worse than",
    significance.SAME: "is indistinguishable from",
}


def policy_row(res: RowResult, ref_bytes: float, speed: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One policy's numbers (quality from the teacher-forced pass, speed if measured)."""
    counts = res.gear_counts()
    return {
        "name": res.spec.name,
        "spec": res.spec.to_dict(),
        "perplexity": res.perplexity,
        "mean_kl": res.mean_kl,
        "top1_agreement": res.top1_agreement,
        "bytes_per_token": res.bytes_per_token,
        "relative_bytes": res.bytes_per_token / ref_bytes,
        "gear_counts": counts,
        "gear_fractions": {g: counts[g] / res.steps for g in GEARS},
        "shifts": res.shifts,
        "scored_positions": res.steps,
        "window_perplexity": [math.exp(x / (res.steps / len(res.window_nll))) for x in res.window_nll],
        "speed": speed,
    }


def trace_entry(res: RowResult, with_kl: bool = False) -> Dict[str, Any]:
    """A row's trace: gears; entropies for entropy rows; per-position KL if ``with_kl``."""
    out: Dict[str, Any] = {"gears": "".join(res.gears)}
    if res.spec.kind == "entropy":  # the other rows' entropies feed no figure
        out["entropy"] = [round(x, TRACE_DECIMALS) for x in res.entropy]
        out["smoothed"] = [round(x, TRACE_DECIMALS) for x in res.smoothed]
    if with_kl:
        out["kl"] = [float(f"{x:.{KL_DIGITS}g}") for x in res.kl]
    return out


def comparisons(
    rows: Sequence[Dict[str, Any]],
    kl: Optional[Dict[str, Sequence[float]]] = None,
    window_steps: Optional[int] = None,
    seed: int = 0,
    distributions: Optional[Dict[str, Dict[str, Any]]] = None,
) -> List[Dict[str, Any]]:
    """Each entropy policy against its matched position rule and random router.

    KL measures what routing is meant to preserve (closeness to the
    full-precision model), so the comparison is on KL; perplexity and top-1
    are listed beside it, and the byte budgets too, so that "equal bytes"
    can be checked, not assumed. With per-position KL (``kl[name]``, windows
    of ``window_steps`` positions) each comparison carries a paired test,
    ``test_<kind>``, and ``beats_<kind>`` is True only when the entropy
    policy's KL is lower with the test's interval below zero; without it
    (files saved before the test), ``beats_<kind>`` compares the means.
    With the policy's random-permutation distribution (``distributions[name]``,
    :func:`.permutation.random_distribution`) the entry carries it as
    ``random_distribution`` and ``beats_random`` is its permutation test's
    (the single random row's test stays beside it as ``test_random``).
    """
    distributions = distributions or {}
    out = []
    for r in rows:
        if r["spec"]["kind"] != "entropy":
            continue
        entry: Dict[str, Any] = {"entropy": _brief(r)}
        for kind in ("position", "random"):
            m = next((x for x in rows if x["spec"]["kind"] == kind and x["spec"]["matched_to"] == r["name"]), None)
            if m is None:
                continue
            entry[kind] = _brief(m)
            entry[f"bytes_difference_{kind}"] = m["bytes_per_token"] / r["bytes_per_token"] - 1
            if kl is not None and window_steps and r["name"] in kl and m["name"] in kl:
                test = significance.paired_difference(kl[r["name"]], kl[m["name"]], window_steps, seed)
                entry[f"test_{kind}"] = test
                entry[f"beats_{kind}"] = test["outcome"] == significance.LOWER
            else:
                entry[f"beats_{kind}"] = r["mean_kl"] < m["mean_kl"]
        dist = distributions.get(r["name"])
        if dist is not None:
            entry["random_distribution"] = dist
            entry["beats_random"] = dist["outcome"] == significance.LOWER
        out.append(entry)
    return out


def _brief(r: Dict[str, Any]) -> Dict[str, Any]:
    return {k: r[k] for k in ("name", "perplexity", "mean_kl", "top1_agreement", "bytes_per_token", "relative_bytes")}


def refresh_comparisons(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A saved run's comparisons, with their tests redone where the file allows.

    Files with tests keep theirs; files without tests but with per-position
    KL in the traces get them computed; older files keep their comparisons
    (rendered without a test).
    """
    comps = results.get("comparisons") or []
    if any(k.startswith("test_") for c in comps for k in c):
        return comps
    traces = results.get("traces") or {}
    kl = {name: t["kl"] for name, t in traces.items() if "kl" in t}
    if not kl:
        return comps
    steps = results["text"]["window"] - 1
    dists = {c["entropy"]["name"]: c["random_distribution"] for c in comps if "random_distribution" in c}
    return comparisons(results["policies"], kl, steps, (results.get("significance") or {}).get("seed", 0), dists)


def verdict(comps: Sequence[Dict[str, Any]]) -> str:
    """One plain sentence per entropy policy: does it beat its matched baselines?"""
    lines, untested = [], False
    for c in comps:
        e = c["entropy"]
        parts = []
        dist = c.get("random_distribution")
        if dist is not None:
            parts.append(f"{OUTCOME_WORDS[dist['outcome']]} random routing on KL ({permutation.describe(dist)})")
        for kind in ("random", "position"):
            if kind not in c:
                continue
            m, test = c[kind], c.get(f"test_{kind}")
            if kind == "random" and dist is not None:  # the one permutation run for real, beside the distribution
                shown = f", {significance.describe(test)}" if test else ""
                parts.append(f"its one random draw run for real: mean {_kl(e['mean_kl'])} vs {_kl(m['mean_kl'])} "
                             f"nats{shown}")
                continue
            if test is not None:
                word = OUTCOME_WORDS[test["outcome"]]
                how = f"mean {_kl(e['mean_kl'])} vs {_kl(m['mean_kl'])} nats, {significance.describe(test)}"
            else:
                untested = True
                tie = e["mean_kl"] == m["mean_kl"]
                word = "beats" if c[f"beats_{kind}"] else "ties with" if tie else "does not beat"
                how = f"{_kl(e['mean_kl'])} vs {_kl(m['mean_kl'])} nats"
            same = e["bytes_per_token"] == m["bytes_per_token"]
            parts.append(
                f"{word} the {kind} baseline on KL ({how}; ppl {e['perplexity']:.3f} vs {m['perplexity']:.3f}; "
                f"top-1 {e['top1_agreement']:.3f} vs {m['top1_agreement']:.3f}; bytes {e['relative_bytes']:.4f} vs "
                f"{m['relative_bytes']:.4f} of fp16{', equal' if same else ''})"
            )
        lines.append(f"{e['name']}: " + "; ".join(parts))
    if untested and lines:
        lines.append("(saved without per-position KL: no significance test; 'beats' compares the means only)")
    return "\n".join(lines)


def _kl(x: float) -> str:
    """KL with 3 significant digits: small values stay readable (1.2e-05, not 0.0000)."""
    return format(x, ".3g")


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """A fixed-width table of every policy."""
    head = (
        f"{'policy':<30} {'ppl':>8} {'KL nats':>9} {'top1':>6} {'MB/tok':>7} {'rel':>6} {'KV MB':>6} {'tot MB':>7} "
        f"{'low%':>5} {'mid%':>5} {'high%':>5} {'shifts':>6} {'tok/s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        f = r["gear_fractions"]
        sp = r.get("speed") or {}
        tps = sp.get("tokens_per_s")
        lines.append(
            f"{r['name']:<30} {r['perplexity']:>8.3f} {_kl(r['mean_kl']):>9} {r['top1_agreement']:>6.3f} "
            f"{r['bytes_per_token'] / 1e6:>7.1f} {r['relative_bytes']:>6.3f} "
            f"{_mb(r.get('kv_bytes_per_token')):>6} {_mb(r.get('total_bytes_per_token'), 1):>7} "
            f"{100 * f['low']:>5.1f} {100 * f['mid']:>5.1f} {100 * f['high']:>5.1f} {r['shifts']:>6d} "
            f"{'' if tps is None else format(tps, '.1f'):>6}"
        )
    return "\n".join(lines)


def speculative_table(section: Dict[str, Any]) -> str:
    """The speculative rows (:mod:`.speculative`): exact quality, replayed acceptance, modeled cost."""
    head = (
        f"{'policy':<26} {'k':>2} {'stop':>5} {'ppl':>8} {'KL':>4} {'top1':>5} {'accept':>6} {'acc/blk':>7} "
        f"{'drf/tok':>7} {'ver/tok':>7} {'MB/tok*':>7} {'rel*':>6} {'KV MB*':>6} {'xhigh*':>6} {'formula*':>8} "
        f"{'tok/s*':>6}"
    )
    lines = [
        f"speculative (draft scope {section['draft_scope']}): quality {section['quality']}",
        "accept = accepted / drafted on the text (replayed greedy blocks); * = modeled: bytes by the §9 "
        "accounting, speed-up x measured static-high tok/s",
        head, "-" * len(head),
    ]
    for r in section["rows"]:
        m = r["modeled"]
        stop = "-" if r["stop_bits"] is None else format(r["stop_bits"], ".2f")
        lines.append(
            f"{r['name']:<26} {r['max_draft']:>2d} {stop:>5} {r['perplexity']:>8.3f} {r['mean_kl']:>4.0f} "
            f"{r['top1_agreement']:>5.3f} {_num(r['acceptance_rate'], '.3f'):>6} "
            f"{_num(r['mean_accepted_length'], '.2f'):>7} {r['drafted_per_token']:>7.3f} "
            f"{r['verify_passes_per_token']:>7.3f} {m['bytes_per_token'] / 1e6:>7.1f} {m['relative_bytes']:>6.3f} "
            f"{_mb(m.get('kv_bytes_per_token')):>6} "
            f"{m['speedup']:>6.3f} {_num(m['speedup_formula'], '.3f'):>8} {_num(m['tokens_per_s'], '.1f'):>6}"
        )
    for gear, d in section["drafters"].items():
        c, cal = d["costs"], d["calibration"]
        stop = "none" if cal["stop_bits"] is None else f"{cal['stop_bits']:.2f} bits"
        lines.append(
            f"{gear} drafter ({d['row']}): top-1 agreement {d['alpha_positions']:.3f}, AUC of its entropy for "
            f"rejection {_num(d['auc_draft_entropy'], '.3f') or 'n/a'}; c = {c['draft_cost']:.3f} (from "
            f"{c['draft_cost_source']}), "
            f"verify of 7 tokens = {c['verify_cost'][min(6, len(c['verify_cost']) - 1)]:.3f} high steps; "
            f"calibrated: k <= {cal['max_draft']}, stop {stop}"
        )
    return "\n".join(lines)


def _mb(x: Optional[float], decimals: int = 2) -> str:
    """Megabytes with ``decimals`` decimals ('' when absent: results saved before the KV column)."""
    return "" if x is None else f"{x / 1e6:.{decimals}f}"


def kv_note(kv: Optional[Dict[str, Any]]) -> str:
    """One line saying which KV cache the run used and how its bytes are counted ('' before the column)."""
    if not kv:
        return ""
    what = "float (mlx-lm's)" if kv["kind"] == "float" else (
        f"{'rotated' if kv['kind'] == 'rotated' else 'mlx-lm affine'} {kv['bits']}-bit g{kv['group_size']}, "
        "quantized from the first token")
    per = kv.get("bytes_per_token") or 0.0
    return (f"KV cache: {what}; {per / 1024:.1f} KiB per cached token; KV MB = that x {kv['context']:.0f} tokens "
            "of mean context per step; tot MB = weights + KV")


def _num(x: Optional[float], fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def markdown_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The same table in Markdown, for docs/BENCHMARKS.md."""
    out = [
        "| policy | ppl | KL (nats) | top-1 | MB/token | × fp16 bytes | KV MB/token | total MB/token "
        "| low/mid/high % | shifts | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        f = r["gear_fractions"]
        tps = (r.get("speed") or {}).get("tokens_per_s")
        out.append(
            f"| {r['name']} | {r['perplexity']:.3f} | {_kl(r['mean_kl'])} | {r['top1_agreement']:.3f} | "
            f"{r['bytes_per_token'] / 1e6:.1f} | {r['relative_bytes']:.3f} | "
            f"{_mb(r.get('kv_bytes_per_token'))} | {_mb(r.get('total_bytes_per_token'), 1)} | "
            f"{100 * f['low']:.0f}/{100 * f['mid']:.0f}/{100 * f['high']:.0f} | {r['shifts']} | "
            f"{'' if tps is None else format(tps, '.1f')} |"
        )
    return "\n".join(out)


def write_json(results: Dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the results atomically (a temporary file of this process, then rename: two runs
    writing one path at once leave one whole file)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output directory does not exist: {path.parent} (create it first)")
    return atomicfile.write_json(path, results)
