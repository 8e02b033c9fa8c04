"""Per-token telemetry as JSON Lines: one header, one record per token, one summary.

Written incrementally and flushed after every record, so a run stopped with
Ctrl-C leaves a valid trace whose summary says ``"interrupted": true``. The
file never exists without its header: the header is written into a temporary
file renamed over the trace, and may be written again (more fields known,
e.g. after the model loaded) until the first token, each time atomically.
SIGINT is held back while a header or the summary is written, so Ctrl-C
cannot cut one in half. :func:`read_trace` validates a trace, every field's
type included, and names the line of any fault.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import threading
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO, Any, Dict, Iterable, Iterator, List, Optional

from ..atomicfile import check_target
from ..config import GEARS
from ..jsonsafe import dumps

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


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold SIGINT back for the duration (main thread); it is delivered after.

    The handler is swapped for one that notes the signal, and the old one is called
    with it on the way out. (Blocking SIGINT in the main thread's signal mask does not
    hold it back: the kernel then hands it to another thread of the process, the MLX
    stream's, a BLAS or C-kernel worker, and Python raises KeyboardInterrupt in the
    main thread at its next instruction anyway.) Nested uses pass it outwards.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # not the main thread, or a handler installed outside Python (it could not be put back)
        return
    noted: list = []
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(frame))
    except (ValueError, TypeError, OSError):  # a handler that cannot be replaced here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if noted:
            if callable(old):
                old(signal.SIGINT, noted[0])  # the default handler raises KeyboardInterrupt here
            elif old == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


class TraceWriter:
    """Writes a trace file record by record (flushed each time).

    Nothing is created until the first record; a token or summary written
    before any header gets a minimal header first, so every file this writer
    leaves is a valid trace.

    Args:
        path: the ``.jsonl`` file; its directory must exist and accept a new file
            (checked here: :func:`~gearbx_mlx.atomicfile.check_target`).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = check_target(path, "trace")
        self._f: Optional[IO[str]] = None
        self._fields: Dict[str, Any] = {}
        self._start: Optional[str] = None
        self._closed = False
        self.tokens = 0
        self.summarized = False

    @staticmethod
    def _line(record: Dict[str, Any]) -> str:
        return dumps(record, ensure_ascii=False) + "\n"  # non-finite values become null at any depth

    def _write(self, record: Dict[str, Any]) -> None:
        if self._closed:
            raise ValueError(f"trace {self.path} is closed")
        if self._f is None:
            self.header()
        assert self._f is not None
        self._f.write(self._line(record))
        self._f.flush()

    def header(self, **fields: Any) -> None:
        """Write (or, before the first token, rewrite) the header with ``fields``
        added to those given before."""
        if self._closed:
            raise ValueError(f"trace {self.path} is closed")
        if self.tokens or self.summarized:
            raise ValueError(f"trace {self.path}: the header must come before the first token")
        self._fields.update(fields)
        self._start = self._start or time.strftime("%Y-%m-%dT%H:%M:%S%z")
        line = self._line({"type": "header", "format": FORMAT, "version": VERSION, "start_time": self._start,
                           "versions": versions(), **self._fields})
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with sigint_deferred():
            f = open(tmp, "w", encoding="utf-8")
            try:
                f.write(line)
                f.flush()
                os.replace(tmp, self.path)
            except BaseException:
                f.close()
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            old, self._f = self._f, f
            if old is not None:
                old.close()

    def token(self, **fields: Any) -> None:
        self._write({"type": "token", **fields})
        self.tokens += 1

    def summary(self, **fields: Any) -> None:
        """Write the summary (once)."""
        if self.summarized:
            raise ValueError(f"trace {self.path} already has its summary")
        with sigint_deferred():
            self._write({"type": "summary", **fields})
            self.summarized = True

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._closed = True

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
        "nonfinite": bool(getattr(resp, "nonfinite", False)),
        **ranks_record(resp),
        **speculative_record(resp),
    }


def speculative_record(resp: Any) -> Dict[str, Any]:
    """A speculative run's fields of one token (none in routed decoding)."""
    if getattr(resp, "drafted", None) is None:
        return {}
    sparse = {k: getattr(resp, k, None) for k in ("kept_fraction", "hot_hit_rate")}
    return {"drafted": resp.drafted, "accepted": bool(resp.accepted), "verified_by": resp.verified_by,
            "draft_entropy": resp.draft_entropy, "block": resp.block, "stop": resp.stop,
            **{k: v for k, v in sparse.items() if v is not None}}


def ranks_record(resp: Any) -> Dict[str, Any]:
    """A sharded run's fields of one token: every rank's gear, whether the ranks' own
    token and entropy agreed with rank 0's, the wait for the step's exchange (none on one process)."""
    if getattr(resp, "rank_gears", None) is None:
        return {}
    return {"rank_gears": list(resp.rank_gears), "ranks_agree": bool(resp.ranks_agree),
            "exchange_seconds": resp.exchange_seconds}


class TraceError(ValueError):
    """A trace file that is not valid; the message names the line."""


@dataclass
class Trace:
    path: Path
    header: Dict[str, Any]
    tokens: List[Dict[str, Any]]
    summary: Optional[Dict[str, Any]]


def looks_like_trace(path: "str | Path") -> bool:
    """True if the file at ``path`` starts with a gearbx trace's header line (of any version):
    a file a new trace may replace. Reads its first line only (at most 1 MiB)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(2**20)
        rec = json.loads(first.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(rec, dict) and rec.get("type") == "header" and rec.get("format") == FORMAT


def read_trace(path: str | Path) -> Trace:
    """Read and validate a trace; raise :class:`TraceError` naming the bad line.

    Every field a reader uses is type-checked (a number where a number
    belongs, a gear name, a bool), so a hand-edited or foreign file fails
    here, with its line, rather than somewhere in an analysis.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory: give a trace file (.jsonl)")
    if path.exists() and not path.is_file():
        raise TraceError(f"{path} is not a regular file (a device, pipe or socket): give a trace file (.jsonl)")
    if not path.is_file():
        raise FileNotFoundError(f"trace not found: {path}")
    header, tokens, summary = None, [], None
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text (byte {e.start}): not a gearbx trace") from None
    while lines and not lines[-1].strip():  # blank lines at the end (an editor's, `echo >>`): not records
        lines.pop()
    for no, line in enumerate(lines, 1):
        where = f"{path}:{no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            kind = "truncated" if no == len(lines) else "not JSON"
            raise TraceError(f"{where}: {kind} ({e.msg})") from None
        except RecursionError:
            raise TraceError(f"{where}: nested too deeply to be a trace record") from None
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
            _check_header(rec, where)
            header = rec
        elif t == "token":
            if summary is not None:
                raise TraceError(f"{where}: a token record after the summary (two runs written into one file?)")
            _check_token(rec, where, header)
            if rec["index"] != len(tokens):  # a writer numbers its tokens 0, 1, 2, ...
                raise TraceError(f"{where}: token index {rec['index']} where {len(tokens)} was due (records "
                                 "missing, repeated or out of order)")
            tokens.append(rec)
        elif t == "summary":
            if summary is not None:
                raise TraceError(f"{where}: a second summary (two runs written into one file?)")
            _check_summary(rec, where, len(tokens))
            summary = rec
        elif t == "header":
            raise TraceError(f"{where}: a second header (two traces written into one file?)")
        else:
            raise TraceError(f"{where}: unknown record type {t!r}")
    if header is None:
        raise TraceError(f"{path}: empty trace")
    return Trace(path, header, tokens, summary)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: What a field must be when present (None is always allowed: JSON's null for NaN).
_KINDS = {
    "number": (_is_number, "a number"),
    "int": (_is_int, "an integer"),
    "str": (lambda v: isinstance(v, str), "text"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "gear": (lambda v: v in GEARS, f"a gear ({', '.join(GEARS)})"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}
_HEADER_FIELDS = {
    "vocab_size": "int", "model": "str", "label": "str", "source": "str", "top_k": "int",
    "entropy_is_lower_bound": "bool", "telemetry_only": "bool", "thresholds": "object",
}
_TOKEN_FIELDS = {
    "index": "int", "token": "int", "text": "str", "entropy": "number", "smoothed_entropy": "number",
    "predicted_entropy": "number", "gear": "gear", "shift": "bool", "shift_seconds": "number",
    "step_seconds": "number", "entropy_upper": "number", "logprob": "number", "residual_mass": "number",
    "prompt": "int", "variant": "gear", "nonfinite": "bool", "ranks_agree": "bool", "exchange_seconds": "number",
}
_SUMMARY_FIELDS = {
    "interrupted": "bool", "error": "str", "generation_tokens": "int", "tokens_per_gear": "object",
    "mean_entropy": "number", "nonfinite_steps": "int", "kv_cache": "object",
}
#: Token fields that are durations: never negative.
_SECONDS = ("shift_seconds", "step_seconds", "exchange_seconds")


def _check_summary(rec: Dict[str, Any], where: str, n_tokens: int) -> None:
    _check_fields(rec, where, _SUMMARY_FIELDS)
    n = rec.get("generation_tokens")
    if n is not None and n != n_tokens:
        raise TraceError(f"{where}: the summary counts {n} generated tokens, the trace holds {n_tokens} token "
                         "records")
    per = rec.get("tokens_per_gear") or {}
    if any(not _is_int(v) or v < 0 for v in per.values()):
        raise TraceError(f"{where}: tokens_per_gear must give a count >= 0 per gear, got {json.dumps(per)[:60]}")


def _check_fields(rec: Dict[str, Any], where: str, fields: Dict[str, str]) -> None:
    for name, kind in fields.items():
        v = rec.get(name)
        test, want = _KINDS[kind]
        if v is not None and not test(v):
            raise TraceError(f"{where}: field {name!r} must be {want}, got {json.dumps(v)[:60]}")
        if kind == "number" and v is not None and not math.isfinite(v):
            raise TraceError(f"{where}: field {name!r} must be finite (write null for NaN), got {v}")


def _check_header(rec: Dict[str, Any], where: str) -> None:
    _check_fields(rec, where, _HEADER_FIELDS)
    for name, v in (rec.get("thresholds") or {}).items():
        if name in ("low", "high") and v is not None and not (_is_number(v) and math.isfinite(v)):
            raise TraceError(f"{where}: thresholds.{name} must be a finite number of bits, got {json.dumps(v)[:60]}")
    v = rec.get("vocab_size")
    if v is not None and v < 2:
        raise TraceError(f"{where}: vocab_size must be >= 2, got {v}")


def _check_token(rec: Dict[str, Any], where: str, header: Optional[Dict[str, Any]]) -> None:
    missing = [k for k in ("index", "entropy", "gear", "shift") if k not in rec]
    if missing:
        raise TraceError(f"{where}: token record lacks {missing}")
    if rec["gear"] not in GEARS:
        raise TraceError(f"{where}: unknown gear {json.dumps(rec['gear'])[:40]}")
    _check_fields(rec, where, _TOKEN_FIELDS)
    h = rec["entropy"]
    vmax = math.log2(header["vocab_size"]) if header and header.get("vocab_size") else math.inf
    if h is not None and not (0 <= h <= vmax + 1e-6):
        raise TraceError(f"{where}: entropy {h} outside [0, log2 V]")
    for name in _SECONDS:
        if rec.get(name) is not None and rec[name] < 0:
            raise TraceError(f"{where}: {name} must be >= 0, got {rec[name]}")


def iter_records(trace: Trace) -> Iterable[Dict[str, Any]]:
    yield trace.header
    yield from trace.tokens
    if trace.summary:
        yield trace.summary
