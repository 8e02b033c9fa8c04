#!/usr/bin/env python3
"""Where a speculative run's resident memory goes, stage by stage, in one fresh process.

    python scripts/bench_speculative_memory.py [--model qwen2.5-coder-1.5b] [--max-tokens 6]
                                               [--out benchmarks/results/speculative_memory_<model>.json]

Runs what ``python -m gearbx_mlx.generate --model M --speculative`` runs (the
load with the drafter's scope and gear, the settled heap, the chat template,
``gearbx_mlx.prepare`` with ``speculative="auto"``, whose decision times the
drafter on the prompt, then the tokens) in a child process, and records after
each stage the process's resident memory (``VmRSS``), its peak so far
(``VmHWM``), and MLX's active memory and peak since the stage before
(``mx.get_active_memory``, ``mx.get_peak_memory``). The child's peak
(``VmHWM`` at the end: the maximum resident set size ``/usr/bin/time -v``
reports) over the model's weight bytes is the ratio the laptop-model target
is stated in.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a Python function that reverses a string."


def _status() -> Dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def child(args: argparse.Namespace) -> None:
    """The measured run: one JSON line per stage on stdout."""
    import mlx.core as mx

    import gearbx_mlx
    from gearbx_mlx.chat import apply_chat_template
    from gearbx_mlx.generation import settle_loaded

    def stage(name: str, **extra: Any) -> None:
        print(json.dumps({"stage": name, **_status(), "mlx_active": mx.get_active_memory(),
                          "mlx_peak_since_last": mx.get_peak_memory(), **extra}), flush=True)
        mx.reset_peak_memory()

    stage("imports")
    model, tokenizer, gearbox = gearbx_mlx.load(args.model, draft_scope="all", draft_gear="low")
    settle_loaded()
    stage("loaded", managed=gearbox.manager.memory())
    text = apply_chat_template(tokenizer, PROMPT, None, use_template=True)
    run = gearbx_mlx.prepare(model, tokenizer, text, gearbox, speculative="auto", max_tokens=args.max_tokens)
    stage("decided", plan=run.plan.message() if run.plan is not None else None)
    count = 0
    for _ in run.tokens():
        count += 1
        if count == 1:
            stage("first token")
    run.close()
    stage("done", tokens=count)


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    from gearbx_mlx.sources.models import resolve_model

    weights = sum(f.stat().st_size for f in Path(resolve_model(args.model, None)).glob("*.safetensors"))
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--max-tokens", str(args.max_tokens)]
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    out, err = proc.stdout, proc.stderr
    stages = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not stages:
        raise SystemExit(f"error: the run failed (exit {proc.returncode}):\n{err[-2000:]}")
    peak = max(s["VmHWM"] for s in stages)
    result = {
        "what": "resident memory of a speculative run, stage by stage (one fresh process)",
        "command": "python scripts/bench_speculative_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "weights_bytes": weights, "prompt": PROMPT, "max_tokens": args.max_tokens,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "stages": stages, "peak_rss_bytes": peak, "peak_rss_over_weights": round(peak / weights, 4),
    }
    out_path = args.out or ROOT / "benchmarks" / "results" / f"speculative_memory_{args.model}.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    for s in stages:
        print(f"{s['stage']:<12} RSS {s['VmRSS'] / 2**20:8.0f} MiB  peak {s['VmHWM'] / 2**20:8.0f} MiB  "
              f"MLX active {s['mlx_active'] / 2**20:8.0f} MiB  MLX peak since {s['mlx_peak_since_last'] / 2**20:8.0f} MiB")
    print(f"peak RSS / weights: {peak / weights:.3f}; wrote {out_path}")


if __name__ == "__main__":
    main()
