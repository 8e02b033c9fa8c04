#!/usr/bin/env python3
"""Decode tokens/s of every gear of a real model on the CPU, interleaved rounds; print a table, write JSON.

Each variant is the same loaded model with every linear and the tied
embedding managed (``--scope all``), one gear installed for the whole run:

* ``float``: the loaded weights (the separate store's high gear);
* ``mlx-4`` / ``mlx-8``: MLX's own ``QuantizedLinear`` 4- and 8-bit g64 (the
  separate store's low and mid gears with ``kernel="mlx"``);
* ``packed-4`` / ``packed-8``: the same copies through the package's C packed
  GEMV (the separate store with ``kernel="packed"``);
* ``nested-low`` / ``nested-mid`` / ``nested-high``: the nested store's gears
  (the default store, C kernels); ``nested-high`` reads all planes
  (``high="planes"``), i.e. the gearbox holds no other copy of the weights.

A round decodes ``--tokens`` greedy tokens after the same prompt with each
variant in turn (mlx-lm's ``generate_step``; the prompt's prefill is not
timed); ``--rounds`` rounds, so every variant sees the same drift of a shared
machine. Reported per variant: median tokens/s with its min-max spread, the
median ratio to its baseline within each round (``mlx-4`` for the low gears,
``mlx-8`` for the mid gears, ``float`` for the high), and the host time per
step: the median time of the model call that builds one step's graph,
before its evaluation. On the CPU the package's C kernels run inside that
call (they are eager), so for them it holds their compute as well; for MLX's
own layers it is the graph's Python cost alone.

Usage:
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python scripts/bench_gears_cpu.py [--model NAME] [--tokens 48] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_nested_gpu import host_us_per_step  # noqa: E402

import gearbx_mlx  # noqa: E402
from gearbx_mlx.evaluation.machine import blas, load_average  # noqa: E402
from gearbx_mlx.jsonsafe import dumps  # noqa: E402

#: variant -> (store, kernel, high, gear)
VARIANTS: Dict[str, Tuple[str, str, str, str]] = {
    "float": ("separate", "mlx", "original", "high"),
    "mlx-4": ("separate", "mlx", "original", "low"),
    "mlx-8": ("separate", "mlx", "original", "mid"),
    "packed-4": ("separate", "packed", "original", "low"),
    "packed-8": ("separate", "packed", "original", "mid"),
    "nested-low": ("nested", "auto", "planes", "low"),
    "nested-mid": ("nested", "auto", "planes", "mid"),
    "nested-high": ("nested", "auto", "planes", "high"),
}
#: The baseline each variant's ratio is taken against.
BASELINE = {"mlx-4": "mlx-4", "packed-4": "mlx-4", "nested-low": "mlx-4", "mlx-8": "mlx-8", "packed-8": "mlx-8",
            "nested-mid": "mlx-8", "float": "float", "nested-high": "float"}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def build(model_name: str, store: str, kernel: str, high: str) -> Tuple[Any, Any, Any]:
    """One loaded model and its gearbox over every layer."""
    return gearbx_mlx.load(model_name, scope="all", store=store, kernel=kernel, high=high)


def decode(model: Any, prompt: mx.array, tokens: int) -> float:
    """Tokens/s of ``tokens`` greedy steps after ``prompt`` (the prefill and first token not timed)."""
    steps = generate_step(prompt, model, max_tokens=tokens + 1, sampler=lambda x: mx.argmax(x, axis=-1))
    next(steps)
    tic = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - tic)


def host_us(model: Any, prompt: mx.array, steps: int = 8) -> float:
    """Median microseconds of the call that builds one decode step's graph (evaluated after)."""
    return host_us_per_step(model, prompt, steps)["median"]


def run(args: argparse.Namespace) -> Dict[str, Any]:
    loaded: Dict[Tuple[str, str, str], Tuple[Any, Any, Any]] = {}
    variants = list(args.variants)
    for name in variants:
        key = VARIANTS[name][:3]
        if key not in loaded:
            print(f"loading {key}", file=sys.stderr, flush=True)
            loaded[key] = build(args.model, *key)
    tok = next(iter(loaded.values()))[1]
    prompt = mx.array(tok.encode(PROMPT))
    gc.collect()
    gc.freeze()
    for (model, _, gearbox), name in ((loaded[VARIANTS[n][:3]], n) for n in variants):  # build every gear once
        gearbox.shift(VARIANTS[name][3])
        decode(model, prompt, 4)
    rounds: List[Dict[str, float]] = []
    host: Dict[str, List[float]] = {n: [] for n in variants}
    loads = [load_average()]
    for r in range(args.rounds):
        row = {}
        for name in variants:
            model, _, gearbox = loaded[VARIANTS[name][:3]]
            gearbox.shift(VARIANTS[name][3])
            row[name] = decode(model, prompt, args.tokens)
            host[name].append(host_us(model, prompt))
        rounds.append(row)
        loads.append(load_average())
        print(f"repeat {r + 1}/{args.rounds}: " + "  ".join(f"{n} {v:.1f}" for n, v in row.items()),
              file=sys.stderr, flush=True)
    return {"rounds": rounds, "host_us": host, "load_average": loads, "summary": summarize(rounds, host, variants)}


def summarize(rounds: List[Dict[str, float]], host: Dict[str, List[float]], variants: List[str]) -> List[Dict]:
    out = []
    for name in variants:
        tps = [r[name] for r in rounds]
        base = BASELINE[name]
        ratios = [r[name] / r[base] for r in rounds] if base in variants else []
        out.append({"variant": name, "median_tok_s": statistics.median(tps), "min_tok_s": min(tps),
                    "max_tok_s": max(tps), "baseline": base if ratios else None,
                    "median_ratio": statistics.median(ratios) if ratios else None,
                    "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                    "host_us_per_step": statistics.median(host[name])})
    return out


def table(summary: List[Dict[str, Any]]) -> str:
    fmt: Callable[[Any], str] = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| variant | tok/s median [min-max] | × baseline, median [range] | host µs/step |",
             "| --- | ---: | ---: | ---: |"]
    for s in summary:
        ratio = "-" if s["median_ratio"] is None else (
            f"{fmt(s['median_ratio'])} [{fmt(s['ratio_range'][0])}-{fmt(s['ratio_range'][1])}] vs {s['baseline']}")
        lines.append(f"| {s['variant']} | {s['median_tok_s']:.1f} [{s['min_tok_s']:.1f}-{s['max_tok_s']:.1f}] | "
                     f"{ratio} | {s['host_us_per_step']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a --model name (default: the default model)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.tokens < 2 or args.rounds < 1:
        ap.error("--tokens must be >= 2 and --rounds >= 1")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result = run(args)
    print(table(result["summary"]))
    record = {"command": "python scripts/bench_gears_cpu.py " + " ".join(sys.argv[1:]), "started": started,
              "model": args.model or "default", "tokens": args.tokens, "rounds": args.rounds,
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "blas": blas(), "mlx": mx.__version__},
              **result}
    if args.out:
        args.out.write_text(dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
