"""``python -m gearbx_mlx.analyze TRACE.jsonl [...]``: what a trace says about routing.

Per trace: tokens per gear, shifts and runs, entropy quantiles overall and
per gear, time per token per gear, the cost of shifts; with several traces,
side by side, plus the entropy shift of each against the first over their
common prefix (e.g. a float and a pre-quantized model on the same greedy
prompt: until the texts diverge, the difference is quantization's alone).

Works on any trace of :mod:`gearbx_mlx.telemetry.trace`'s format (generation, the
remote client, whose ``entropy`` is a lower bound: the header says so) and on
the JSON report of ``gearbx_mlx.evaluation.harness`` (one trace per policy, gears and
entropies, no timing). Fields a producer leaves out are reported as missing.

Conventions, so that numbers can be recomputed by hand:

* a gear's tokens are those whose ``gear`` field names it: the gear of the
  forward pass that produced the distribution whose entropy is recorded. The
  entropy that *made* the router enter a gear was computed before the shift,
  in the previous gear, so ``entropy.high`` can average less than
  ``entropy.low`` (a spike is read in the low gear; the high gear then sees
  what follows it). The decision view is kept apart: ``entropy.chose_G`` is
  the entropy of the tokens after which the router chose gear G (the
  ``next_gear`` field; for traces without it, the gear ``1 + lag`` tokens
  later in the same generation, which is what the decision governed);
* a shift is a token whose gear differs from the previous token's in the
  same generation; a run is a maximal stretch of one gear within one
  generation (a remote session's prompts and an evaluation's text windows
  are generations of their own); a speculative trace has none (both gears
  stay resident: a token's gear says which forward pass chose it, the
  drafter's for an accepted draft), though its runs are counted;
* quantiles interpolate linearly between order statistics (numpy's default);
* time per token averages ``step_seconds`` over tokens that do not start a
  generation (the first token of a trace, or of each prompt in a remote
  session, also carries the prompt's processing);
* shift cost is the ``shift_seconds`` the producer measured, and the mean
  step time of shift tokens against the others.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..config import GEARS
from .trace import Trace, TraceError, read_trace

QUANTILES: Tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's ``linear``)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def entropy_stats(values: Sequence[float]) -> Dict[str, float]:
    """``n``, mean, min, max and :data:`QUANTILES` of the finite values."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    out: Dict[str, float] = {"n": len(v), "mean": statistics.fmean(v) if v else math.nan,
                             "min": v[0] if v else math.nan, "max": v[-1] if v else math.nan}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = quantile(v, q)
    return out


def runs(gears: Sequence[str], starts: Optional[Sequence[bool]] = None) -> List[Tuple[str, int]]:
    """Maximal runs of one gear, as ``(gear, length)``; ``starts`` marks tokens
    that begin a new generation (a run never crosses one)."""
    out: List[Tuple[str, int]] = []
    for i, g in enumerate(gears):
        if out and out[-1][0] == g and not (starts and starts[i]):
            out[-1] = (g, out[-1][1] + 1)
        else:
            out.append((g, 1))
    return out


def _starts(tokens: Sequence[Dict[str, Any]]) -> List[bool]:
    """Which tokens start a generation (their step time includes the prompt)."""
    return [i == 0 or t.get("prompt") != tokens[i - 1].get("prompt") for i, t in enumerate(tokens)]


def chosen_gears(tokens: Sequence[Dict[str, Any]], lag: Optional[int], starts: Sequence[bool]) -> List[Optional[str]]:
    """Per token, the gear the router chose after reading its entropy (None if unknown).

    The ``next_gear`` field where the producer wrote it; else the gear of the
    token ``1 + lag`` later within the same generation (lag 0 for evaluation
    reports), which is the forward pass that decision governed.
    """
    if any("next_gear" in t for t in tokens):
        return [t.get("next_gear") for t in tokens]  # checked by analyze_trace (_check_next_gears)
    if lag not in (0, 1):
        return [None] * len(tokens)
    out: List[Optional[str]] = []
    for i in range(len(tokens)):
        j = i + 1 + lag
        same = j < len(tokens) and not any(starts[i + 1 : j + 1])
        out.append(tokens[j]["gear"] if same else None)
    return out


def _mean_ms(values: Sequence[Optional[float]]) -> float:
    v = [x for x in values if x is not None]
    return 1e3 * statistics.fmean(v) if v else math.nan


EVAL_FORMAT = "gearbx-eval"
_EVAL_GEARS = {"l": "low", "m": "mid", "h": "high"}


def _evaluation_traces(path: Path, report: Dict[str, Any]) -> List[Trace]:
    """One :class:`Trace` per policy of an evaluation report (``traces`` entries:
    ``{"gears": "lmh...", "entropy": [...], "smoothed": [...]}``). Each text
    window is a generation of its own (a fresh cache and monitor)."""
    traces = report.get("traces")
    if not isinstance(traces, dict) or not traces:
        raise TraceError(f"{path}: evaluation report without per-policy traces")
    text = report.get("text") if isinstance(report.get("text"), dict) else {}
    windows = text.get("windows") or 1
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise TraceError(f"{path}: text.windows must be an integer >= 1, got {json.dumps(windows)[:40]}")
    model = report.get("model") if isinstance(report.get("model"), dict) else {}
    vocab = model.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2):
        raise TraceError(f"{path}: model.vocab_size must be an integer >= 2, got {json.dumps(vocab)[:40]}")
    out = []
    for name, entry in traces.items():
        gears = entry.get("gears", "") if isinstance(entry, dict) else ""
        if not isinstance(gears, str):
            raise TraceError(f"{path}: policy {name!r}: 'gears' must be a string of l/m/h letters")
        bad = set(gears) - set(_EVAL_GEARS)
        if not gears or bad:
            raise TraceError(f"{path}: policy {name!r} has no gear trace or unknown gear letters {sorted(bad)}")
        ent = _series(entry.get("entropy"), len(gears), path, name, "entropy")
        sm = _series(entry.get("smoothed"), len(gears), path, name, "smoothed")
        per = len(gears) // windows if len(gears) % windows == 0 else len(gears)
        tokens = [{"index": i, "prompt": i // per, "entropy": ent[i], "smoothed_entropy": sm[i],
                   "gear": _EVAL_GEARS[c], "shift": i % per != 0 and c != gears[i - 1]}
                  for i, c in enumerate(gears)]
        header = {"type": "header", "format": EVAL_FORMAT, "source": "evaluation", "label": f"{path.stem}:{name}",
                  "lag": 0,  # the teacher-forced pass: step t's entropy decides step t+1's gear
                  "model": f"{path.stem} ({name})", "vocab_size": vocab}
        out.append(Trace(path, header, tokens, {"interrupted": False}))
    return out


def _series(values: Any, n: int, path: Path, name: str, field: str) -> List[Optional[float]]:
    """A per-token series of an evaluation trace: ``n`` finite numbers or nulls (absent: all null)."""
    if values is None or values == []:
        return [None] * n
    if not isinstance(values, list) or len(values) != n:
        raise TraceError(f"{path}: policy {name!r}: {field!r} must be a list of {n} numbers (one per gear letter)")
    for v in values:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise TraceError(f"{path}: policy {name!r}: {field!r} holds {json.dumps(v)[:40]}, not a finite number")
    return values


def load_traces(path: Union[str, Path]) -> List[Trace]:
    """The traces in a file: one for a JSON Lines trace, one per policy for an
    evaluation report."""
    path = Path(path)
    if not path.is_file():
        return [read_trace(path)]  # says what the path is instead
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except UnicodeDecodeError:
        return [read_trace(path)]  # says it is not text
    try:
        head = json.loads(first)
    except (json.JSONDecodeError, RecursionError):
        head = None
    if isinstance(head, dict) and "type" in head:
        return [read_trace(path)]
    try:  # an evaluation report is one (indented) JSON object
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return [read_trace(path)]  # names the bad line
    if isinstance(report, dict) and report.get("format") == EVAL_FORMAT:
        return _evaluation_traces(path, report)
    return [read_trace(path)]


def _check_next_gears(trace: Trace) -> None:
    """TraceError naming the file and line of a ``next_gear`` that is not a gear (null: unknown)."""
    bad = next((i for i, t in enumerate(trace.tokens) if t.get("next_gear") not in (None, *GEARS)), None)
    if bad is None:
        return
    value = json.dumps(trace.tokens[bad]["next_gear"])[:40]
    raise TraceError(f"{trace.path}:{_token_line(trace.path, bad)}: field 'next_gear' must be a gear "
                     f"({', '.join(GEARS)}) or null, got {value}")


def _token_line(path: Path, index: int) -> Union[int, str]:
    """The line number of the ``index``-th token record of a trace file ('?' if it cannot be found)."""
    seen = -1
    try:
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    continue
                seen += isinstance(rec, dict) and rec.get("type") == "token"
                if seen == index:
                    return no
    except (OSError, UnicodeDecodeError):
        pass
    return "?"


def label_of(trace: Trace) -> str:
    return trace.header.get("label") or trace.path.stem


def analyze_trace(trace: Union[Trace, str, Path]) -> Dict[str, Any]:
    """Everything :mod:`analyze` reports about one trace, as plain data."""
    if not isinstance(trace, Trace):
        trace = read_trace(trace)
    _check_next_gears(trace)
    h, toks = trace.header, trace.tokens
    gears = [t["gear"] for t in toks]
    starts = _starts(toks)
    steady = [t for t, s in zip(toks, starts) if not s]
    run_list = runs(gears, starts)
    swaps = h.get("mode") != "speculative"
    shift_tokens = [i for i in range(1, len(gears)) if swaps and gears[i] != gears[i - 1] and not starts[i]]
    transitions: Dict[str, int] = {}
    for i in shift_tokens:
        key = f"{gears[i - 1]}->{gears[i]}"
        transitions[key] = transitions.get(key, 0) + 1
    shift_secs = [t.get("shift_seconds") for t in toks if t.get("shift")]
    shift_secs = [x for x in shift_secs if x is not None]
    shifted = set(shift_tokens)
    chosen = chosen_gears(toks, h.get("lag"), starts)
    out: Dict[str, Any] = {
        "path": str(trace.path),
        "label": label_of(trace),
        "model": h.get("model"),
        "source": h.get("source", "generation"),
        "telemetry_only": h.get("telemetry_only"),
        "entropy_is_lower_bound": bool(h.get("entropy_is_lower_bound", False)),
        "top_k": h.get("top_k"),
        "thresholds": h.get("thresholds"),
        "complete": trace.summary is not None and not trace.summary.get("interrupted")
                    and not trace.summary.get("error"),
        "tokens": len(toks),
        "tokens_per_gear": {g: gears.count(g) for g in GEARS},
        "shifts": len(shift_tokens),
        "transitions": transitions,
        "runs": {g: sum(1 for r in run_list if r[0] == g) for g in GEARS},
        "mean_run": {g: (statistics.fmean([n for r, n in run_list if r == g])
                         if any(r == g for r, _ in run_list) else math.nan) for g in GEARS},
        "entropy": entropy_stats([t["entropy"] for t in toks]),
        "entropy_per_gear": {g: entropy_stats([t["entropy"] for t in toks if t["gear"] == g]) for g in GEARS},
        "entropy_per_chosen_gear": {g: entropy_stats([t["entropy"] for t, c in zip(toks, chosen) if c == g])
                                    for g in GEARS},
        "ms_per_token": _mean_ms([t.get("step_seconds") for t in steady]),
        "ms_per_token_per_gear": {g: _mean_ms([t.get("step_seconds") for t in steady if t["gear"] == g])
                                  for g in GEARS},
        "shift_seconds_total": sum(shift_secs),
        "shift_seconds_mean": statistics.fmean(shift_secs) if shift_secs else math.nan,
        "ms_per_token_after_shift": _mean_ms(
            [t.get("step_seconds") for i, t in enumerate(toks) if i in shifted and not starts[i]]),
        "ms_per_token_no_shift": _mean_ms(
            [t.get("step_seconds") for i, t in enumerate(toks) if i not in shifted and not starts[i]]),
    }
    if any("entropy_upper" in t for t in toks):
        out["entropy_upper"] = entropy_stats([t.get("entropy_upper") for t in toks])
    if any("variant" in t for t in toks):
        out["tokens_per_variant"] = {g: sum(1 for t in toks if t.get("variant") == g) for g in GEARS}
    return out


def _key(t: Dict[str, Any]) -> Any:
    return t.get("token") if t.get("token") is not None else t.get("text")


def compare_traces(a: Union[Trace, str, Path], b: Union[Trace, str, Path]) -> Dict[str, Any]:
    """Entropy of ``b`` against ``a`` over their common prefix of tokens.

    On the same prompt with greedy decoding, both saw the same context until
    the first differing token, so the per-token difference there is the
    models' own (e.g. quantization's).
    """
    ta = a if isinstance(a, Trace) else read_trace(a)
    tb = b if isinstance(b, Trace) else read_trace(b)
    n = 0
    # Teacher-forced evaluation rows all read the same text: every position is shared.
    forced = ta.header.get("source") == tb.header.get("source") == "evaluation"
    for x, y in zip(ta.tokens, tb.tokens):
        if not forced and (_key(x) != _key(y) or _key(x) is None):
            break
        n += 1
    diffs = [tb.tokens[i]["entropy"] - ta.tokens[i]["entropy"] for i in range(n)
             if ta.tokens[i]["entropy"] is not None and tb.tokens[i]["entropy"] is not None]
    mean = lambda xs: statistics.fmean(xs) if xs else math.nan  # noqa: E731
    ea = [t["entropy"] for t in ta.tokens if t["entropy"] is not None]
    eb = [t["entropy"] for t in tb.tokens if t["entropy"] is not None]
    return {
        "baseline": label_of(ta), "other": label_of(tb), "common_prefix": n,
        "entropy_diff_mean": mean(diffs), "entropy_absdiff_mean": mean([abs(d) for d in diffs]),
        "entropy_absdiff_max": max((abs(d) for d in diffs), default=math.nan),
        "mean_entropy_diff": mean(eb) - mean(ea) if ea and eb else math.nan,
    }


def analyze(paths: Sequence[Union[str, Path]]) -> Dict[str, Any]:
    """Analyses of the traces in ``paths``, and each compared with the first."""
    if not paths:
        raise ValueError("give at least one trace file")
    traces = [t for p in paths for t in load_traces(p)]
    return {"traces": [analyze_trace(t) for t in traces],
            "comparisons": [compare_traces(traces[0], t) for t in traces[1:]]}


# -- flat views: the printed table and the CSV show the same numbers ---------------
def flat_metrics(r: Dict[str, Any], comparison: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One analysis as ordered ``{metric: value}`` rows."""
    model = r["model"]
    if isinstance(model, str) and "/" in model:  # a folder or URL: its last part is the name
        model = ", ".join(m.rstrip("/").rsplit("/", 1)[-1] for m in model.split(", "))
    out: Dict[str, Any] = {"model": model, "source": r["source"], "tokens": r["tokens"]}
    for g in GEARS:
        out[f"tokens.{g}"] = r["tokens_per_gear"][g]
    for g in GEARS:
        out[f"share.{g}"] = r["tokens_per_gear"][g] / r["tokens"] if r["tokens"] else math.nan
    if "tokens_per_variant" in r:
        for g in GEARS:
            out[f"variant_tokens.{g}"] = r["tokens_per_variant"][g]
    out["shifts"] = r["shifts"]
    for g in GEARS:
        out[f"runs.{g}"] = r["runs"][g]
        out[f"mean_run.{g}"] = r["mean_run"][g]
    stats = ["mean", "min"] + [f"p{round(q * 100)}" for q in QUANTILES] + ["max"]
    label = "entropy_lower_bound" if r["entropy_is_lower_bound"] else "entropy"
    for s in stats:
        out[f"{label}.{s}"] = r["entropy"][s]
    if "entropy_upper" in r:
        for s in stats:
            out[f"entropy_upper_bound.{s}"] = r["entropy_upper"][s]
    for g in GEARS:
        for s in ("mean", "p10", "p50", "p90"):
            out[f"{label}.{g}.{s}"] = r["entropy_per_gear"][g][s]
    if "entropy_per_chosen_gear" in r and any(r["entropy_per_chosen_gear"][g]["n"] for g in GEARS):
        for g in GEARS:
            for s in ("mean", "p50"):
                out[f"{label}.chose_{g}.{s}"] = r["entropy_per_chosen_gear"][g][s]
    out["ms_per_token"] = r["ms_per_token"]
    for g in GEARS:
        out[f"ms_per_token.{g}"] = r["ms_per_token_per_gear"][g]
    out["shift_seconds.total"] = r["shift_seconds_total"]
    out["shift_seconds.mean"] = r["shift_seconds_mean"]
    out["ms_per_token.after_shift"] = r["ms_per_token_after_shift"]
    out["ms_per_token.no_shift"] = r["ms_per_token_no_shift"]
    if comparison is not None:
        for k in ("common_prefix", "entropy_diff_mean", "entropy_absdiff_mean", "entropy_absdiff_max",
                  "mean_entropy_diff"):
            out[f"vs_first.{k}"] = comparison[k]
    return out


def _columns(result: Dict[str, Any]) -> Tuple[List[str], List[str], List[Dict[str, Any]]]:
    """Labels, metric names (in order) and one flat dict per trace."""
    comps: List[Optional[Dict[str, Any]]] = [None] + list(result["comparisons"])
    flats = [flat_metrics(r, c if len(result["traces"]) > 1 else None)
             for r, c in zip(result["traces"], comps)]
    if len(flats) > 1:  # the baseline's own comparison rows are empty
        for k in flats[1]:
            flats[0].setdefault(k, None)
    labels = [r["label"] for r in result["traces"]]
    if len(set(labels)) < len(labels):
        labels = [f"{i}:{lab}" for i, lab in enumerate(labels)]
    names = list(dict.fromkeys(k for f in flats for k in f))
    return labels, names, flats


def fmt(v: Any) -> str:
    """How the table prints a value: integers as they are, floats to 4 decimals."""
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4f}"
    return str(v)


def format_table(result: Dict[str, Any]) -> str:
    """Traces side by side: one row per metric, one column per trace."""
    labels, names, flats = _columns(result)
    rows = [["metric"] + labels] + [[n] + [fmt(f.get(n)) for f in flats] for n in names]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    notes = []
    for r in result["traces"]:
        if r["entropy_is_lower_bound"]:
            notes.append(f"{r['label']}: entropy is a lower bound from the top-{r['top_k']} log-probabilities")
        if not r["complete"]:
            notes.append(f"{r['label']}: the run did not finish (interrupted, error, or no summary)")
    return "\n".join(lines + [f"note: {n}" for n in notes])


def write_csv(result: Dict[str, Any], path: Union[str, Path]) -> Path:
    """The table as CSV (full precision; empty cells for missing values)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"CSV directory does not exist: {path.parent}")
    labels, names, flats = _columns(result)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["metric"] + labels)
        for n in names:
            w.writerow([n] + ["" if f.get(n) is None or (isinstance(f.get(n), float) and math.isnan(f[n]))
                              else f[n] for f in flats])
    return path
