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
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .bench import FORMAT_VERSION

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


def check_result(data: Any, name: str = "the result") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``data`` is a bench result this version reads."""
    if not isinstance(data, dict) or data.get("kind") != "gearbx-bench":
        raise ValueError(f"{name} is not a gearbx bench result (no \"kind\": \"gearbx-bench\")")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{name} has bench format {version!r}; this gearbx_mlx reads up to {FORMAT_VERSION}: "
                         "upgrade gearbx_mlx to read it")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{name} lacks {', '.join(missing)}: it is damaged or cut short")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS):
            raise ValueError(f"{name}: row {i} lacks one of {', '.join(ROW_KEYS)}")


def _gib(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _mib(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def machine_line(result: Dict[str, Any]) -> str:
    hw, sw, bw = (result["machine"].get(k, {}) for k in ("hardware", "software", "bandwidth"))
    gpus = ", ".join(g.get("name", "?") for g in hw.get("nvidia", []))
    band = f"{bw.get('read_gb_s', 0):.0f} GB/s read" if bw else "?"
    if bw.get("numpy_read_gb_s"):
        band += f" (numpy {bw['numpy_read_gb_s']:.1f})"
    return (f"{hw.get('chip') or '?'}{' + ' + gpus if gpus else ''}, {_gib(hw.get('memory_bytes'))}, "
            f"{sw.get('default_device', '?')}, MLX {sw.get('mlx', '?')}, gearbx_mlx {sw.get('gearbx_mlx', '?')}, "
            f"bandwidth {band}")


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
             + (f", {result['settings']['budget_s']:.0f} s budget" if result["settings"].get("budget_s") else ""),
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
    for ch in result["checks"]:
        lines.append(f"Check: {ch['name']}: {ch['value']:.2f} -> {'ok' if ch['passed'] else 'FAILED'}")
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
    lines = [f"{names[0]}: {machine_line(a)}; model {a['model']['name']}",
             f"{names[1]}: {machine_line(b)}; model {b['model']['name']}", ""]
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
                         + "; checks: " + (", ".join("ok" if ch["passed"] else "FAILED" for ch in r["checks"])
                                            or "none"))
    return "\n".join(lines)


__all__ = ["REQUIRED", "check_result", "format_compare", "format_result", "load_result", "machine_line"]
