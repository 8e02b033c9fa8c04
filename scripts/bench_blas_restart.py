"""Decode tokens/s of speculative and plain high-gear decoding, with and without the BLAS restart.

    python scripts/bench_blas_restart.py [--pairs 3] [--max-tokens 64] [--out FILE.json]

Each run is a fresh ``python -c`` that calls
:func:`gearbx_mlx.blas.ensure_fast_blas` first, as a command line's ``main``
does, then ``gearbx_mlx.generate.main`` with the README's arguments plus
``--scope all --speculative`` or ``--scope all --static-gear high``. No
``LD_PRELOAD`` is set by hand: ``restart`` lets the function restart the
process onto an installed OpenBLAS, ``reference`` sets
``GEARBX_NO_BLAS_PRELOAD=1`` (what MLX's Linux wheel gives by itself). Runs
are interleaved (each pair runs all four once, in the order of
:func:`gearbx_mlx.evaluation.significance.balanced_order`, which changes pair by
pair). Prints a table and writes the runs, the per-pair ratios with a verdict on
"speculative faster" (:func:`~gearbx_mlx.evaluation.significance.median_verdict`
against 1), the load average, the BLAS each run used, the date and the commands
to ``--out`` (default ``benchmarks/results/blas_restart_speculative.json``).
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

from gearbx_mlx.evaluation.significance import balanced_order, median_verdict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefill_store import environment  # noqa: E402  (the same modes: restart, reference)

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write two sentences about the moon."
GEN_RE = re.compile(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec")
DECODES = {"speculative": ["--speculative"], "plain-high": ["--static-gear", "high"]}
MODES = ("restart", "reference")
CHILD = ("import sys; from gearbx_mlx import blas; blas.ensure_fast_blas(); "
         "print('[bench] blas', blas.shown_path(blas.mlx_blas()), file=sys.stderr, flush=True); "
         "from gearbx_mlx.generate import main; sys.exit(main(sys.argv[1:]))")


def command(decode: str, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-c", CHILD, "--scope", "all", *DECODES[decode], "-p", PROMPT,
            "-m", str(args.max_tokens)]


def run_once(mode: str, decode: str, args: argparse.Namespace) -> dict[str, Any]:
    tic = time.perf_counter()
    proc = subprocess.run(command(decode, args), check=False, capture_output=True, text=True, cwd=ROOT,
                          env=environment(mode), timeout=args.timeout)
    text = proc.stdout + proc.stderr
    g = GEN_RE.search(text)
    if proc.returncode or not g:
        raise SystemExit(f"error: {mode}/{decode} run failed (exit {proc.returncode}):\n{text[-2000:]}")
    lib = re.search(r"\[bench\] blas (\S+)", text)
    spec = [line for line in text.splitlines() if line.startswith(("Speculative", "Blocks", "Decision"))]
    return {"mode": mode, "decode": decode, "tokens": int(g.group(1)), "generation_tps": float(g.group(2)),
            "blas_library": lib.group(1) if lib else None, "speculative_lines": spec[:6],
            "wall_s": round(time.perf_counter() - tic, 2), "load_avg_after": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "blas_restart_speculative.json")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    runs = []
    for i in range(args.pairs):
        for mode, decode in balanced_order([(m, d) for m in MODES for d in DECODES], i):  # no run at one place
            r = run_once(mode, decode, args)
            r["pair"] = i
            runs.append(r)
            print(f"pair {i} {mode:9s} {decode:11s} {r['generation_tps']:7.2f} tok/s  "
                  f"blas {r['blas_library']}", flush=True)

    def tps(i: int, mode: str, decode: str) -> float:
        return next(r["generation_tps"] for r in runs if (r["pair"], r["mode"], r["decode"]) == (i, mode, decode))

    speedups = {m: [tps(i, m, "speculative") / tps(i, m, "plain-high") for i in range(args.pairs)] for m in MODES}
    print(f"\n{'pair':>4} " + " ".join(f"{m + ' ' + d:>24}" for m in MODES for d in DECODES)
          + " " + " ".join(f"{'spec/plain ' + m:>22}" for m in MODES))
    for i in range(args.pairs):
        print(f"{i:>4} " + " ".join(f"{tps(i, m, d):>24.2f}" for m in MODES for d in DECODES)
              + " " + " ".join(f"{speedups[m][i]:>22.2f}" for m in MODES))
    verdicts = {m: median_verdict(v, 1.0) for m, v in speedups.items()}
    for m in MODES:
        j = verdicts[m]
        print(f"median speculative/plain-high, {m}: {statistics.median(speedups[m]):.2f} (95% interval "
              f"{j['interval_95'][0]:.2f}-{j['interval_95'][1]:.2f}, {j['rounds_at_target']} of {j['rounds']} "
              f"pairs at or above 1; speculative >= plain: {j['verdict']})")
    result = {
        "what": "decode tokens/s, --speculative vs --static-gear high, --scope all, default model, "
                "restarted onto OpenBLAS by gearbx_mlx.blas.ensure_fast_blas vs MLX's own reference BLAS",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commands": {d: " ".join(["python", "-c", repr(CHILD)] + command(d, args)[3:]) for d in DECODES},
        "modes": {"restart": "no LD_PRELOAD set by hand; ensure_fast_blas restarts onto an installed OpenBLAS",
                  "reference": "GEARBX_NO_BLAS_PRELOAD=1"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "runs": runs,
        "speculative_over_plain": speedups,
        "median_speculative_over_plain": {m: statistics.median(v) for m, v in speedups.items()},
        "verdict_speculative_faster": verdicts, "order": "gearbx_mlx.evaluation.significance.balanced_order",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
