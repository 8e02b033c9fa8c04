#!/usr/bin/env python3
"""Benchmark ``python -m gearbx_mlx.server`` against ``mlx_lm.server``; print a table, write JSON.

Both servers run at once on the same model (the default model's converted
folder unless ``--model``), on 127.0.0.1, and answer the same greedy chat
requests, streamed:

  * mlx_lm.server (its own decode loop);
  * gearbx server, static high gear (``"gearbx": {"gear": "high", "speculative": "off"}``);
  * gearbx server, speculative (``"gearbx": {"speculative": "auto"}``; started with ``--speculative``).

The configurations run interleaved, prompt by prompt and round by round, so
that the drift of a shared machine falls on all of them alike, in an order
that changes from prompt to prompt
(:func:`gearbx_mlx.evaluation.significance.balanced_order`); one warm-up
request each comes first (the speculative one measures its plan there). Per
request: time to first token (first streamed content), decode tokens/s (tokens
after the first over the time after the first) and both servers' resident
memory (VmRSS) after it. Each gearbx configuration's decode speed is also
judged request by request against mlx_lm.server's for the same prompt in the
same round (a 95% bootstrap interval of the median ratio,
:func:`gearbx_mlx.evaluation.significance.median_verdict`). The load average
is recorded at the start and the end.

Usage:
  python scripts/bench_server.py [--rounds 3] [--tokens 48] [--model PATH]
      [--out benchmarks/results/server_<tag>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from gearbx_mlx.evaluation.significance import balanced_order, median_verdict

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = (
    "Explain in one paragraph why the sky is blue.",
    "Describe a walk along a river on an autumn morning.",
)
#: (name, which server, the request's extra fields)
CONFIGS: Tuple[Tuple[str, str, Dict[str, Any]], ...] = (
    ("mlx_lm.server", "mlx", {}),
    ("gearbx static high", "gearbx", {"gearbx": {"gear": "high", "speculative": "off"}}),
    ("gearbx speculative", "gearbx", {"gearbx": {"gear": "dynamic", "speculative": "auto"}}),
)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: List[str], log: Any) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)


def wait_ready(port: int, proc: subprocess.Popen, seconds: float = 300) -> None:
    """Until a one-token request answers (both servers load before serving it)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"error: a server exited with {proc.returncode} before it was ready")
        try:
            chat(port, "Hi", 1, {})
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"error: the server on port {port} was not ready after {seconds:.0f} s")


def chat(port: int, prompt: str, tokens: int, extra: Dict[str, Any]) -> Dict[str, Any]:
    """One streamed greedy chat request: time to first token, decode rate, tokens."""
    body = {"model": "default_model", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    text, n = "", None
    with _OPENER.open(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
            for c in event.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += piece
    n = n or 0
    decode = (n - 1) / (last - first) if first is not None and last > first and n > 1 else None
    return {"ttft_s": (first - t0) if first else None, "decode_tps": decode, "tokens": n, "text": text}


def rss_mib(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def soak_rss(port: int, pid: int, n: int) -> Dict[str, Any]:
    """``n`` short sequential requests (routed and speculative in turn); RSS after each, and its
    growth per request over the second half (the first half includes one-time allocations)."""
    rss: List[Optional[float]] = []
    for i in range(n):
        extra = {"gearbx": {"speculative": "auto" if i % 2 else "off"}}
        chat(port, PROMPTS[i % len(PROMPTS)], 8, extra)
        rss.append(rss_mib(pid))
    vals = [v for v in rss if v is not None]
    half = vals[len(vals) // 2:]
    growth = (half[-1] - half[0]) / max(len(half) - 1, 1) if len(half) > 1 else None
    return {"requests": n, "tokens_each": 8, "rss_mib": rss, "growth_mib_per_request_second_half": growth}


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, _, _ in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        ttft = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        tps = [r["decode_tps"] for r in mine if r["decode_tps"] is not None]
        out[name] = {"requests": len(mine), "ttft_median_s": statistics.median(ttft) if ttft else None,
                     "decode_tps_median": statistics.median(tps) if tps else None}
    base = out["mlx_lm.server"]["decode_tps_median"]
    by = {(r["round"], r["prompt"], r["config"]): r["decode_tps"] for r in rows}
    for name in out:
        tps = out[name]["decode_tps_median"]
        out[name]["decode_vs_mlx_lm"] = tps / base if tps and base else None
        # Each request over mlx_lm.server's for the same prompt in the same round, judged against 1.
        paired = [by[(i, p, name)] / by[(i, p, "mlx_lm.server")] for i, p, c in by
                  if c == name and by[(i, p, name)] and by.get((i, p, "mlx_lm.server"))]
        if paired and name != "mlx_lm.server":
            out[name]["paired_vs_mlx_lm"] = median_verdict(paired, 1.0)
    return out


def model_path(arg: Optional[str]) -> str:
    if arg:
        return arg
    sys.path.insert(0, str(ROOT))
    from gearbx_mlx.sources.models import resolve_model

    return resolve_model(None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an mlx-lm model folder both servers load (default: the default model's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--soak", type=int, default=0, metavar="N",
                    help="after the rounds, N more short sequential requests to the gearbx server (alternating "
                         "routed and speculative), its resident memory read after each: per-request growth")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/server_cpu_default.json"))
    args = ap.parse_args()
    if args.soak < 0 or args.rounds < 1 or args.tokens < 2:
        ap.error("--rounds must be >= 1, --tokens >= 2 and --soak >= 0")
    path = model_path(args.model)
    ports = {"mlx": free_port(), "gearbx": free_port()}
    logs = {k: tempfile.TemporaryFile("w+") for k in ports}
    cmds = {"mlx": [sys.executable, "-m", "mlx_lm", "server", "--model", path, "--port", str(ports["mlx"])],
            "gearbx": [sys.executable, "-m", "gearbx_mlx.server", "--model", path, "--speculative",
                       "--max-tokens", str(max(args.tokens, 64)), "--port", str(ports["gearbx"])]}
    load_start = os.getloadavg()
    procs = {k: start(cmds[k], logs[k]) for k in ports}
    rows: List[Dict[str, Any]] = []
    soak: Dict[str, Any] = {"requests": 0, "rss_mib": [], "growth_mib_per_request_second_half": None}
    try:
        for k in ports:
            wait_ready(ports[k], procs[k])
        for _name, server, extra in CONFIGS:  # warm-up (the speculative plan is measured here)
            chat(ports[server], PROMPTS[0], 8, extra)
        for rnd in range(args.rounds):
            for j, prompt in enumerate(PROMPTS):  # no configuration always first (or last) after a prompt
                for name, server, extra in balanced_order(CONFIGS, rnd * len(PROMPTS) + j):
                    r = chat(ports[server], prompt, args.tokens, extra)
                    rows.append({"round": rnd, "prompt": prompt, "config": name, **r,
                                 "rss_mib": {k: rss_mib(p.pid) for k, p in procs.items()}})
                    print(f"{name:22s} ttft {r['ttft_s']:.3f} s  decode {r['decode_tps'] or 0:.2f} tok/s  "
                          f"{r['tokens']} tokens", flush=True)
        soak = soak_rss(ports["gearbx"], procs["gearbx"].pid, args.soak)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGINT)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    summary = summarize(rows)
    same = {p: len({r["text"] for r in rows if r["prompt"] == p}) == 1 for p in PROMPTS}
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": {"machine": platform.machine(), "processor": platform.processor() or None,
                     "cpus": os.cpu_count(), "system": platform.platform()},
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "model": Path(path).name, "rounds": args.rounds, "max_tokens": args.tokens, "prompts": list(PROMPTS),
        "servers": {k: " ".join(c[1:]).replace(path, Path(path).name) for k, c in cmds.items()},
        "same_text_every_config": same,
        "summary": summary, "requests": rows,
        "rss_mib_after_each_request": {k: [r["rss_mib"][k] for r in rows] for k in ports},
        "soak": soak,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'config':22s} {'TTFT median s':>14s} {'decode tok/s':>13s} {'vs mlx_lm':>10s}")
    for name, s in summary.items():
        ttft, tps, rel = s["ttft_median_s"], s["decode_tps_median"], s["decode_vs_mlx_lm"]
        print(f"{name:22s} {ttft if ttft is not None else float('nan'):14.3f} "
              f"{tps if tps is not None else float('nan'):13.2f} {rel if rel is not None else float('nan'):10.2f}"
              + (f"  paired {j['median']:.2f} (95% interval {j['interval_95'][0]:.2f}-{j['interval_95'][1]:.2f}, "
                 f">= 1: {j['verdict']})" if (j := s.get("paired_vs_mlx_lm")) else ""))
    for k, series in result["rss_mib_after_each_request"].items():
        vals = [v for v in series if v is not None]
        if vals:
            print(f"RSS {k}: {vals[0]:.0f} MiB after the first request, {vals[-1]:.0f} MiB after the last "
                  f"({len(vals)} requests)")
    if soak["requests"]:
        print(f"soak: {soak['requests']} requests, gearbx server RSS {soak['rss_mib'][0]:.0f} -> "
              f"{soak['rss_mib'][-1]:.0f} MiB; growth per request over the second half "
              f"{soak['growth_mib_per_request_second_half']:.3f} MiB")
    print(f"load average: start {load_start[0]:.2f}, end {result['load_average_end'][0]:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
