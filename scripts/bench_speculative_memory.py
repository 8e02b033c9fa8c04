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
reports) over the model's weight bytes is one ratio.

The other is over the loaded model's own resident memory: a second child
loads the same model with mlx-lm alone (``mlx_lm.load`` of the converted
directory, no gears) and streams the same prompt's tokens with
``mlx_lm.stream_generate``, and its peak is what the model costs without this
package: weights, runtime, tokenizer and KV cache. Both children run one after
the other, never at once.
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


def stage(name: str, **extra: Any) -> None:
    """One JSON line on stdout: the stage, the process's resident memory and MLX's since the last."""
    import mlx.core as mx

    print(json.dumps({"stage": name, **_status(), "mlx_active": mx.get_active_memory(),
                      "mlx_peak_since_last": mx.get_peak_memory(), **extra}), flush=True)
    mx.reset_peak_memory()


def child(args: argparse.Namespace) -> None:
    """The measured run: one JSON line per stage on stdout."""
    import gearbx_mlx
    from gearbx_mlx.chat import apply_chat_template
    from gearbx_mlx.generation import settle_loaded

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


def plain_child(args: argparse.Namespace) -> None:
    """The loaded model alone: mlx-lm's load and stream_generate, one JSON line per stage."""
    from mlx_lm import load, stream_generate

    from gearbx_mlx.sources.models import resolve_model

    stage("imports")
    model, tokenizer = load(str(resolve_model(args.model, None)))
    stage("loaded")
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    count = 0
    for _ in stream_generate(model, tokenizer, text, max_tokens=args.max_tokens):
        count += 1
        if count == 1:
            stage("first token")
    stage("done", tokens=count)


def run_child(args: argparse.Namespace, mode: str) -> List[Dict[str, Any]]:
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--max-tokens", str(args.max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    stages = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not stages:
        raise SystemExit(f"error: the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return stages


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=("speculative", "plain"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return (child if args.child == "speculative" else plain_child)(args)
    from gearbx_mlx.sources.models import resolve_model

    weights = sum(f.stat().st_size for f in Path(resolve_model(args.model, None)).glob("*.safetensors"))
    load_before = os.getloadavg()
    stages = run_child(args, "speculative")
    plain = run_child(args, "plain")
    peak = max(s["VmHWM"] for s in stages)
    plain_peak = max(s["VmHWM"] for s in plain)
    result = {
        "what": "resident memory of a speculative run, stage by stage (one fresh process)",
        "command": "python scripts/bench_speculative_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "weights_bytes": weights, "prompt": PROMPT, "max_tokens": args.max_tokens,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "stages": stages, "peak_rss_bytes": peak, "peak_rss_over_weights": round(peak / weights, 4),
        "plain_mlx_lm_stages": plain, "plain_mlx_lm_peak_rss_bytes": plain_peak,
        "peak_rss_over_plain_mlx_lm": round(peak / plain_peak, 4),
    }
    out_path = args.out or ROOT / "benchmarks" / "results" / f"speculative_memory_{args.model}.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    for s in stages:
        print(f"{s['stage']:<12} RSS {s['VmRSS'] / 2**20:8.0f} MiB  peak {s['VmHWM'] / 2**20:8.0f} MiB  "
              f"MLX active {s['mlx_active'] / 2**20:8.0f} MiB  MLX peak since {s['mlx_peak_since_last'] / 2**20:8.0f} MiB")
    print(f"mlx-lm alone: peak {plain_peak / 2**20:8.0f} MiB")
    print(f"peak RSS / weights: {peak / weights:.3f}; / mlx-lm's own run of the model: {peak / plain_peak:.3f}; "
          f"wrote {out_path}")


if __name__ == "__main__":
    main()
