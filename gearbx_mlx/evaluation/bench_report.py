"""The bench JSON: read it back, print it as a table, set two side by side.

:func:`load_result` reads and checks a file :func:`~.bench.run_bench` wrote
(its ``kind`` and ``format_version``, the keys the tables read), so a file
attached to a bug report fails with a message that names it and what is
wrong, not with a ``KeyError``. :func:`format_result` prints one run;
:func:`format_compare` prints two (two machines, or two versions on one),
row by row, with the ratio of their speeds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..console import mib
from .bench import FORMAT_VERSION
from .bench_checks import describe_check, verdict_of

#: Keys every bench JSON has (docs/BENCHMARKS.md, "The bench JSON").
REQUIRED = ("format_version", "kind", "machine", "model", "settings", "rows", "plain_tokens_per_s", "speculative",
            "memory", "checks")
ROW_KEYS = ("section", "label", "tokens_per_s", "x_plain")


def load_result(path: str) -> Dict[str, Any]:
    """A bench JSON file, checked.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, not a bench result, or a format this version cannot read.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"bench result not found: {path}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}): give a file that python -m gearbx_mlx.bench wrote") from None
    check_result(data, str(path))
    return data


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _speed(x: Any) -> bool:
    """A speed or a ratio of speeds: a finite number above 0 (JSON read by Python takes NaN and Infinity)."""
    return _number(x) and math.isfinite(x) and x > 0


#: The machine's sections the tables read, and the numbers read in each (where present).
MACHINE_NUMBERS = {"hardware": ("memory_bytes", "cpu_count"), "software": (),
                   "bandwidth": ("read_gb_s", "numpy_read_gb_s")}


def _check_machine(machine: Dict[str, Any], name: str) -> None:
    for section, numbers in MACHINE_NUMBERS.items():
        part = machine.get(section, {})
        if not isinstance(part, dict):
            raise ValueError(f"{name}: \"machine.{section}\" is {_kind(part)}, not an object")
        for key in numbers:
            if part.get(key) is not None and not _number(part[key]):
                raise ValueError(f"{name}: \"machine.{section}.{key}\" is {_kind(part[key])}, not a number")
    gpus = machine.get("hardware", {}).get("nvidia", [])
    if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus):
        raise ValueError(f"{name}: \"machine.hardware.nvidia\" is not a list of objects")


#: Top-level keys whose value must be an object (``speculative`` may also be null), and must be a list.
OBJECTS = ("machine", "model", "settings", "memory")
LISTS = ("rows", "checks")


def check_result(data: Any, name: str = "the result") -> None:
    """Raise ``ValueError`` naming ``name`` and the field unless ``data`` is a bench result this version
    reads, with every field the tables read of the type they read it as."""
    if not isinstance(data, dict) or data.get("kind") != "gearbx-bench":
        raise ValueError(f"{name} is not a gearbx bench result (no \"kind\": \"gearbx-bench\")")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{name} has bench format {version!r}; this gearbx_mlx reads up to {FORMAT_VERSION}: "
                         "upgrade gearbx_mlx to read it")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{name} lacks {', '.join(missing)}: it is damaged or cut short")
    for key in OBJECTS + LISTS + ("speculative",):
        want = list if key in LISTS else dict
        if not isinstance(data[key], want) and not (key == "speculative" and data[key] is None):
            what = "a list" if want is list else "an object"
            raise ValueError(f"{name}: \"{key}\" is {_kind(data[key])}, not {what}")
    if not isinstance(data["model"].get("name"), str):
        raise ValueError(f"{name}: \"model.name\" is {_kind(data['model'].get('name'))}, not a string")
    if not _speed(data["plain_tokens_per_s"]):
        raise ValueError(f"{name}: \"plain_tokens_per_s\" is {_kind(data['plain_tokens_per_s'])}, "
                         "not a number above 0")
    _check_machine(data["machine"], name)
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS):
            raise ValueError(f"{name}: row {i} lacks one of {', '.join(ROW_KEYS)}")
        for key in ("tokens_per_s", "x_plain"):
            if not _speed(row[key]):
                raise ValueError(f"{name}: \"rows[{i}].{key}\" is {_kind(row[key])}, not a number above 0 "
                                 f"(row {row.get('label')!r})")
        if not isinstance(row["label"], str):
            raise ValueError(f"{name}: \"rows[{i}].label\" is {_kind(row['label'])}, not a string")
    for i, check in enumerate(data["checks"]):
        if not isinstance(check, dict) or not isinstance(check.get("name"), str):
            raise ValueError(f"{name}: \"checks[{i}]\" is not an object with a \"name\"")
        if check.get("value") is not None and not _number(check["value"]):
            raise ValueError(f"{name}: \"checks[{i}].value\" is {_kind(check['value'])}, not a number")
    costs = (data["speculative"] or {}).get("costs")
    if costs:
        if not isinstance(costs, dict) or not all(_number(costs.get(k)) for k in ("c", "high_ms", "draft_ms")) \
                or not isinstance(costs.get("v"), list) or not all(_number(x) for x in costs["v"]):
            raise ValueError(f"{name}: \"speculative.costs\" lacks the numbers c, high_ms, draft_ms and the list v")


def _kind(x: Any) -> str:
    """How a JSON value reads in a message: null, a string, a list, ..."""
    if x is None:
        return "null"
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}.get(type(x), f"{x!r}")


def _gib(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _mib(n: Optional[float]) -> str:
    return "?" if n is None else mib(n)


def machine_line(result: Dict[str, Any]) -> str:
    hw, sw, bw = (result["machine"].get(k, {}) for k in ("hardware", "software", "bandwidth"))
    gpus = ", ".join(g.get("name", "?") for g in hw.get("nvidia", []))
    band = f"{bw.get('read_gb_s', 0):.0f} GB/s read" if bw else "?"
    if bw.get("numpy_read_gb_s"):
        band += f" (numpy {bw['numpy_read_gb_s']:.1f})"
    blas = sw.get("blas") if isinstance(sw.get("blas"), dict) else {}
    return (f"{hw.get('chip') or '?'}{' + ' + gpus if gpus else ''}, {_gib(hw.get('memory_bytes'))}, "
            f"{sw.get('default_device', '?')}, MLX {sw.get('mlx', '?')}, gearbx_mlx {sw.get('gearbx_mlx', '?')}, "
            f"BLAS {blas.get('name', '?')}, bandwidth {band}")


def _table(head: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[int] = ()) -> List[str]:
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(head).rstrip(), "  ".join("-" * w for w in widths)] + [line(b).rstrip() for b in body]


def _notes(row: Dict[str, Any], tokens: Optional[int] = None) -> str:
    parts = []
    runs = row.get("runs_decode_tokens") or []
    if tokens and runs and min(runs) < tokens:  # the time budget cut some runs short
        parts.append(f"{min(runs)}-{max(runs)} tokens")
    if row.get("paired_x_plain"):
        parts.append("x plain: median of " + "/".join(f"{x:.2f}" for x in row["paired_x_plain"])
                     + " against the plain runs beside each")
    if row.get("gears"):
        parts.append("gears " + "/".join(f"{g} {n}" for g, n in row["gears"].items() if n))
    if row.get("acceptance_rate") is not None:
        parts.append(f"accept {100 * row['acceptance_rate']:.0f}%, {row.get('tokens_per_block', 0):.2f} tok/block")
    if row.get("modeled_x_high") is not None:
        parts.append(f"modeled {row['modeled_x_high']:.2f}x")
    return "; ".join(parts)


def _warmup_note(warmup: Any) -> str:
    """The header's note on the untimed warm-up runs (files from before it have none)."""
    if not isinstance(warmup, dict):
        return ""
    return f"; every row first ran {warmup.get('tokens')} tokens untimed ({warmup.get('seconds', 0):.0f} s)"


def format_result(result: Dict[str, Any]) -> str:
    """One bench run as text: the machine, the rows, the speculative costs, memory, checks."""
    m = result["model"]
    load = result["machine"].get("load_average") or {}
    busy = (f" (load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end)"
            if load.get("start") and load.get("end") else "")
    lines = [f"Machine: {machine_line(result)}{busy}",
             f"Model: {m['name']} ({m.get('dtype')}, {_mib(m.get('weight_bytes'))} of weights, vocab "
             f"{m.get('vocab_size')}); up to {result['settings']['tokens']} decode tokens per run, "
             f"{result['settings']['rounds']} round(s), scope {result['settings']['scope']}"
             + (f", {result['settings']['budget_s']:.0f} s budget" if result["settings"].get("budget_s") else "")
             + _warmup_note(result.get("warmup")),
             ""]
    tokens = result["settings"]["tokens"]
    body = [(r["section"], r["label"], f"{r['tokens_per_s']:.1f}", f"{r['x_plain']:.2f}", _notes(r, tokens))
            for r in result["rows"]]
    lines += _table(("section", "configuration", "tok/s", "x plain", "notes"), body, right=(2, 3))
    sp = result["speculative"]
    c = sp.get("costs", {})
    if c:
        v = "/".join(f"{x:.2f}" for x in c.get("v", [])[1:])
        a = sp.get("alpha", {})
        lines += ["", f"Speculative ({sp.get('draft_gear')} gear drafts, {sp.get('drafter', {}).get('path')} path): "
                      f"high step {c['high_ms']:.2f} ms, draft step {c['draft_ms']:.2f} ms (c = {c['c']:.3f}), "
                      f"verify of k+1 tokens v(k) = {v} high steps; alpha {a.get('continuation', 0):.2f} on the "
                      f"continuation, {a.get('prompt', 0):.2f} on the prompt"]
        for name, plan in (sp.get("plans") or {}).items():
            if plan:
                lines.append(f"  decision ({name}): {plan['choice']}" + (
                    f", k={plan['best_k']}" if plan["choice"] != "plain" else "")
                    + (f", stop {plan['stop_bits']:.2f} bits" if plan.get("stop_bits") is not None else "")
                    + f" (modeled {plan['best_speedup']:.2f}x; alpha from {plan['alpha_source']})")
    mem = result["memory"]
    stores = "; ".join(f"{k} {_mib(s.get('resident_total'))}" for k, s in (mem.get("stores") or {}).items())
    lines += ["", f"Memory: weights {_mib(mem.get('weights_bytes'))}; managed layers per store: {stores}; "
                  f"process peak {_mib(mem.get('process_peak_rss_bytes'))}, MLX peak {_mib(mem.get('mlx_peak_bytes'))}"]
    failed = (result.get("first_use") or {}).get("failed") or {}
    if failed:
        lines.append("Custom kernels that failed their first-use check (MLX's path ran instead): "
                     + ", ".join(failed))
    noise = result.get("plain_noise") or {}
    if noise.get("ratios"):
        lines.append("Plain decoding against itself, each run over the one before: "
                     + "/".join(f"{x:.2f}" for x in noise["ratios"])
                     + " (a check below its floor by less than this spread reads \"within noise\")")
    else:
        lines.append("Plain decoding ran once: how far runs of identical code differ on this machine was not "
                     "measured, so no \"x plain\" above is told from noise (--rounds 3 measures it)")
    for ch in result["checks"]:
        lines.append(describe_check(ch))
    lines.append(f"Bench time: {result.get('seconds', 0):.0f} s.")
    return "\n".join(lines)


def _pair(a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> List[Tuple[Optional[Dict], Optional[Dict]]]:
    """Rows of ``a`` and ``b`` matched by ``key`` (rows whose label names a decision
    measured on the machine) or label, in ``a``'s order, then ``b``'s extra rows."""
    by_b = {_key(r): r for r in b}
    out = [(r, by_b.pop(_key(r), None)) for r in a]
    return out + [(None, r) for r in b if _key(r) in by_b]


def _key(row: Dict[str, Any]) -> str:
    return row.get("key") or row["label"]


def format_compare(a: Dict[str, Any], b: Dict[str, Any], names: Tuple[str, str] = ("A", "B")) -> str:
    """Two bench runs side by side: the machines, then every row's tok/s and ``B / A``."""
    lines = [f"{name}: {machine_line(r)}; model {r['model']['name']}{_warmup_note(r.get('warmup'))}"
             for name, r in zip(names, (a, b))] + [""]
    body = []
    for ra, rb in _pair(a["rows"], b["rows"]):
        label = (ra or rb)["label"] if not (ra and rb) or ra["label"] == rb["label"] else (
            f"{_key(ra)} ({ra['label'].split(': ')[-1]} / {rb['label'].split(': ')[-1]})")
        ta = f"{ra['tokens_per_s']:.1f}" if ra else "-"
        tb = f"{rb['tokens_per_s']:.1f}" if rb else "-"
        xa = f"{ra['x_plain']:.2f}" if ra else "-"
        xb = f"{rb['x_plain']:.2f}" if rb else "-"
        ratio = f"{rb['tokens_per_s'] / ra['tokens_per_s']:.2f}" if ra and rb and ra["tokens_per_s"] else "-"
        body.append((label, ta, xa, tb, xb, ratio))
    head = ("configuration", f"{names[0]} tok/s", "x plain", f"{names[1]} tok/s", "x plain", f"{names[1]}/{names[0]}")
    lines += _table(head, body, right=(1, 2, 3, 4, 5))
    for name, r in zip(names, (a, b)):
        c = (r["speculative"] or {}).get("costs") or {}
        if c:
            lines.append(f"{name}: c = {c['c']:.3f}, v(k) = " + "/".join(f"{x:.2f}" for x in c["v"][1:])
                         + "; checks: " + (", ".join(verdict_of(ch) for ch in r["checks"]) or "none"))
    return "\n".join(lines)


__all__ = ["LISTS", "OBJECTS", "REQUIRED", "check_result", "format_compare", "format_result", "load_result",
           "machine_line"]
