"""Prompt tokens/s of the nested store against separate copies, through the README's command.

    python scripts/bench_prefill_store.py [--pairs 3] [--blas openblas|reference] [--max-tokens 4]
                                          [--model NAME] [--out FILE.json]

Runs ``python -m gearbx_mlx.generate --scope all --store S -p PROMPT -m N`` in
a fresh process per run, separate and nested interleaved (A/B/A/B, ``--pairs``
pairs), and reads mlx-lm's ``Prompt: ... tokens-per-sec`` and ``Generation:``
lines. ``--blas openblas`` preloads Debian's OpenBLAS (as ``.ci/run`` does);
``--blas reference`` runs MLX's own reference BLAS (no preload, and no restart
onto one). Prints a table and writes the runs, the per-pair ratios, the load
average, the BLAS, the date and the commands to ``--out`` (default
``benchmarks/results/prefill_store_<blas>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
PROMPT = ("Explain how a bicycle gearbox works, what the gears are for, and why a rider shifts "
          "between them when climbing a steep hill.")
PROMPT_RE = re.compile(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec")
GEN_RE = re.compile(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec")


def command(store: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "gearbx_mlx.generate", "--scope", "all", "--store", store,
           "-p", PROMPT, "-m", str(args.max_tokens)]
    return cmd + (["--model", args.model] if args.model else [])


def environment(blas: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if blas == "openblas":
        env["LD_PRELOAD"] = OPENBLAS
    else:
        env["GEARBX_NO_BLAS_PRELOAD"] = "1"
    return env


def run_once(store: str, args: argparse.Namespace) -> dict[str, Any]:
    tic = time.perf_counter()
    proc = subprocess.run(command(store, args), check=False, capture_output=True, text=True, cwd=ROOT,
                          env=environment(args.blas), timeout=args.timeout)
    text = proc.stdout + proc.stderr
    p, g = PROMPT_RE.search(text), GEN_RE.search(text)
    gears = next((line for line in text.splitlines() if line.startswith("Gears:")), "")
    if proc.returncode or not p:
        raise SystemExit(f"error: {store} run failed (exit {proc.returncode}):\n{text[-2000:]}")
    return {"store": store, "prompt_tokens": int(p.group(1)), "prompt_tps": float(p.group(2)),
            "generation_tps": float(g.group(2)) if g else None, "gears": gears,
            "wall_s": round(time.perf_counter() - tic, 2), "load_avg_after": os.getloadavg()}


def mlx_blas(blas: str) -> str | None:
    code = "from gearbx_mlx import blas; print(blas.shown_path(blas.mlx_blas()))"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT,
                         env=environment(blas))
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--blas", choices=("openblas", "reference"), default="openblas")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.blas == "openblas" and not Path(OPENBLAS).is_file():
        raise SystemExit(f"error: --blas openblas needs {OPENBLAS} (apt-get install libopenblas0-pthread)")
    out = args.out or ROOT / "benchmarks" / "results" / f"prefill_store_{args.blas}.json"
    load_before = os.getloadavg()
    runs = []
    for i in range(args.pairs):
        for store in ("separate", "nested"):
            r = run_once(store, args)
            r["pair"] = i
            runs.append(r)
            print(f"pair {i} {store:9s} prompt {r['prompt_tokens']} tok at {r['prompt_tps']:8.2f} tok/s, "
                  f"decode {r['generation_tps']} tok/s | {r['gears']}", flush=True)
    ratios = []
    for i in range(args.pairs):
        sep, nest = (next(r for r in runs if r["pair"] == i and r["store"] == s) for s in ("separate", "nested"))
        ratios.append(nest["prompt_tps"] / sep["prompt_tps"])
    print(f"\n{'pair':>4} {'separate':>10} {'nested':>10} {'nested/separate':>16}")
    for i, ratio in enumerate(ratios):
        sep, nest = (next(r for r in runs if r["pair"] == i and r["store"] == s) for s in ("separate", "nested"))
        print(f"{i:>4} {sep['prompt_tps']:>10.2f} {nest['prompt_tps']:>10.2f} {ratio:>16.2f}")
    print(f"median nested/separate prompt tokens/s: {statistics.median(ratios):.2f}")
    result = {
        "what": "prompt tokens/s, nested store vs separate copies, interleaved fresh processes",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commands": {s: " ".join(command(s, args)[1:]) for s in ("separate", "nested")},
        "blas": args.blas, "ld_preload": environment(args.blas).get("LD_PRELOAD"),
        "mlx_blas_library": mlx_blas(args.blas),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count()},
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "runs": runs, "ratios_nested_over_separate": ratios,
        "median_ratio": statistics.median(ratios),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
