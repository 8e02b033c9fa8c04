"""Per-token telemetry as JSON Lines: one header, one record per token, one summary.

Written incrementally and flushed after every record, so a run stopped with
Ctrl-C leaves a valid trace whose summary says ``"interrupted": true``.
:func:`read_trace` validates a trace and names the line of any fault.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO, Any, Dict, Iterable, List, Optional

from ..config import GEARS
from ..precision import managed_bytes

FORMAT = "gearbx-trace"
VERSION = 1

TOKEN_FIELDS = (
    "index", "token", "text", "entropy", "smoothed_entropy", "predicted_entropy",
    "gear", "next_gear", "shift", "shift_seconds", "step_seconds",
)


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("gearbx-mlx", "mlx", "mlx-lm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def _clean(x: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class TraceWriter:
    """Writes a trace file record by record (flushed each time).

    Args:
        path: the ``.jsonl`` file; its directory must exist.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"trace directory does not exist: {path.parent}")
        self.path = path
        self._f: Optional[IO[str]] = open(path, "w", encoding="utf-8")
        self.tokens = 0

    def _write(self, record: Dict[str, Any]) -> None:
        if self._f is None:
            raise ValueError(f"trace {self.path} is closed")
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}, ensure_ascii=False) + "\n")
        self._f.flush()

    def header(self, **fields: Any) -> None:
        self._write({"type": "header", "format": FORMAT, "version": VERSION,
                     "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "versions": versions(), **fields})

    def token(self, **fields: Any) -> None:
        self._write({"type": "token", **fields})
        self.tokens += 1

    def summary(self, **fields: Any) -> None:
        self._write({"type": "summary", **fields})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def token_record(resp: Any) -> Dict[str, Any]:
    """The trace record of one :class:`GearboxResponse`."""
    return {
        "index": resp.index,
        "token": int(resp.token),
        "text": resp.text,
        "entropy": resp.entropy,
        "smoothed_entropy": resp.smoothed_entropy,
        "predicted_entropy": resp.predicted_entropy,
        "gear": resp.gear,
        "next_gear": getattr(resp, "next_gear", None),
        "shift": bool(resp.shifted),
        "shift_seconds": resp.shift_seconds,
        "step_seconds": resp.step_seconds,
    }


def run_summary(session: Any, last: Any, interrupted: bool = False) -> Dict[str, Any]:
    """Summary of a generation from its routing session and last response."""
    recs = [r for r in session.records if r.committed][: (last.generation_tokens if last else 0)]
    ents = [r.entropy for r in recs]
    counts = {g: 0 for g in GEARS}
    for r in recs:
        counts[r.gear] += 1
    mgr = session.gearbox.manager
    # One-time quantization inside mlx-lm's timings: between the initial gear
    # and the first token (prompt), and after it (generation).
    marks = getattr(session, "quantize_marks", {})
    q_total = session.quantize_seconds
    q_first = marks.get("first_token", q_total)
    q_prompt, q_gen = max(q_first - marks.get("start", q_first), 0.0), max(q_total - q_first, 0.0)
    prompt_tokens, prompt_tps = getattr(last, "prompt_tokens", 0), getattr(last, "prompt_tps", 0.0)
    gen_tokens, gen_tps = getattr(last, "generation_tokens", 0), getattr(last, "generation_tps", 0.0)
    return {
        "interrupted": interrupted,
        "finish_reason": getattr(last, "finish_reason", None),
        "prompt_tokens": prompt_tokens,
        "prompt_tps": prompt_tps,
        "prompt_quantize_seconds": q_prompt,
        "prompt_tps_excluding_quantize": _rate_without(prompt_tokens, prompt_tps, q_prompt),
        "generation_tokens": len(recs),
        "generation_tps": gen_tps,
        "generation_quantize_seconds": q_gen,
        "generation_tps_excluding_quantize": _rate_without(gen_tokens, gen_tps, q_gen),
        "peak_memory_gb": getattr(last, "peak_memory", 0.0),
        "tokens_per_gear": counts,
        "shifts": sum(1 for r in recs if r.shifted),
        "mean_entropy": statistics.fmean(ents) if ents else None,
        "quantize_seconds": session.quantize_seconds,
        "swap_seconds": session.shift_seconds,
        "telemetry_only": mgr.telemetry_only,
        "telemetry_reason": mgr.telemetry_reason,
        "entries": mgr.entries(),
        "memory": mgr.memory(),
        "store": mgr.config.store,
        "high": mgr.config.high,
        "planes_seconds": mgr.planes_seconds,
        "model_bytes": mgr.model_bytes,
        "loaded_read_bytes": mgr.loaded_read_bytes,
        "scope": mgr.config.scope,
        "step_bytes": mgr.step_bytes(),
        "managed_share": mgr.managed_share(),
        "managed_share_scope_all": (
            managed_bytes(session.gearbox.model, "all", mgr.config.group_size) / mgr.loaded_read_bytes
            if mgr.loaded_read_bytes and not mgr.telemetry_only else None
        ),
    }


def _rate_without(tokens: int, rate: float, seconds: float) -> float:
    """``rate`` (tokens / elapsed) with ``seconds`` taken out of the elapsed time."""
    if not tokens or not rate or rate <= 0:
        return rate
    elapsed = tokens / rate - seconds
    return tokens / elapsed if elapsed > 0 else rate


class TraceError(ValueError):
    """A trace file that is not valid; the message names the line."""


@dataclass
class Trace:
    path: Path
    header: Dict[str, Any]
    tokens: List[Dict[str, Any]]
    summary: Optional[Dict[str, Any]]


def read_trace(path: str | Path) -> Trace:
    """Read and validate a trace; raise :class:`TraceError` naming the bad line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace not found: {path}")
    header, tokens, summary = None, [], None
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for no, line in enumerate(lines, 1):
        where = f"{path}:{no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            kind = "truncated" if no == len(lines) else "not JSON"
            raise TraceError(f"{where}: {kind} ({e.msg})") from None
        if not isinstance(rec, dict) or "type" not in rec:
            raise TraceError(f"{where}: not a trace record (no 'type')")
        t = rec["type"]
        if no == 1:
            if t != "header" or rec.get("format") != FORMAT:
                raise TraceError(f"{where}: not a gearbx trace (first line must be its header)")
            if rec.get("version") != VERSION:
                raise TraceError(
                    f"{where}: trace version {rec.get('version')!r}, this gearbx_mlx reads {VERSION}"
                )
            header = rec
        elif t == "token":
            _check_token(rec, where, header)
            tokens.append(rec)
        elif t == "summary":
            summary = rec
        else:
            raise TraceError(f"{where}: unknown record type {t!r}")
    if header is None:
        raise TraceError(f"{path}: empty trace")
    return Trace(path, header, tokens, summary)


def _check_token(rec: Dict[str, Any], where: str, header: Optional[Dict[str, Any]]) -> None:
    missing = [k for k in ("index", "entropy", "gear", "shift") if k not in rec]
    if missing:
        raise TraceError(f"{where}: token record lacks {missing}")
    if rec["gear"] not in GEARS:
        raise TraceError(f"{where}: unknown gear {rec['gear']!r}")
    h = rec["entropy"]
    vmax = math.log2(header["vocab_size"]) if header and header.get("vocab_size") else math.inf
    if h is not None and not (0 <= h <= vmax + 1e-6):
        raise TraceError(f"{where}: entropy {h} outside [0, log2 V]")


def iter_records(trace: Trace) -> Iterable[Dict[str, Any]]:
    yield trace.header
    yield from trace.tokens
    if trace.summary:
        yield trace.summary
