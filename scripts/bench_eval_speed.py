"""Wall and CPU time of the evaluation harness, this checkout and optionally an older revision.

Usage:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python scripts/bench_eval_speed.py --tokens 512 [--baseline REV --baseline-tokens 128]

Each run is ``python -m gearbx_mlx.evaluate --tokens N --speed-tokens 0
--workload-tokens 0 --no-speculative`` on the default model (the quality part
alone: calibration and the teacher-forced passes), as a child process; its
wall time, its CPU time (user + system, all threads) and the machine's load
average around it are recorded with the phase timings the run writes. A
baseline revision is exported from git into a temporary directory and run
the same way. The CPU time is the fairer number on a shared machine: the
wall time also measures the neighbours.

``--metrics`` also times the per-position metrics of one window (NLL, KL,
top-1, entropy of 511 x 49,152 logits, the default model's shape) with each
backend of ``gearbx_mlx.evaluation.metrics``, in this process.

Prints a table and writes benchmarks/results/eval_harness_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EVAL_ARGS = ["--speed-tokens", "0", "--workload-tokens", "0", "--no-speculative", "--quiet"]
ENV_KEYS = ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def export_revision(rev: str, into: Path) -> str:
    """The package of ``rev`` under ``into`` (``git archive``); returns the full commit."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    archive = into / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "archive", commit, "gearbx_mlx"], cwd=ROOT, check=True, stdout=f)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    return commit


def run_once(package_root: Path, tokens: int, out: Path) -> Dict[str, Any]:
    """One evaluation as a child process: wall, CPU, load, and the run's own timings."""
    # The full policy set: since evaluate's default became the quick study, that takes --full
    # (a revision from before then has no such flag and runs the full set by default).
    full = ["--full"] if '"--full"' in (package_root / "gearbx_mlx" / "evaluate.py").read_text() else []
    cmd = [sys.executable, "-m", "gearbx_mlx.evaluate", "--tokens", str(tokens), *full, *EVAL_ARGS, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    tic = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=package_root, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"evaluate failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    result = json.loads(out.read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "tokens": tokens,
        "scored_positions": result["text"]["scored_positions"],
        "policies": len(result["policies"]),
        "wall_s": wall,
        "cpu_s": cpu,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "timings": result["timings"],
        "forcing": result["routing"].get("forcing"),
        "command": "python -m gearbx_mlx.evaluate " + shlex.join(["--tokens", str(tokens), *full, *EVAL_ARGS]),
    }


def time_metrics(positions: int = 511, vocab: int = 49152, repeats: int = 3) -> Dict[str, Any]:
    """CPU seconds of ``metrics.reference`` + ``metrics.routed`` on one window's logits, per backend."""
    import mlx.core as mx
    import numpy as np

    from gearbx_mlx.evaluation import metrics

    rng = np.random.default_rng(0)
    ref_logits = mx.array((rng.normal(size=(positions, vocab)) * 3).astype(np.float32))
    logits = mx.array((np.array(ref_logits) + rng.normal(size=(positions, vocab)) * 0.1).astype(np.float32))
    targets = rng.integers(0, vocab, positions).tolist()
    out: Dict[str, Any] = {"positions": positions, "vocab": vocab, "repeats": repeats}
    for backend in metrics.BACKENDS:
        ref, _, _ = metrics.reference(ref_logits, targets, backend)
        tic = time.process_time()
        for _ in range(repeats):
            metrics.routed(logits, targets, ref, backend)
        out[f"{backend}_routed_cpu_s"] = (time.process_time() - tic) / repeats
    return out


def table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'revision':<10} {'tokens':>6} {'wall s':>7} {'CPU s':>7} {'load':>9} "
            f"{'calib s':>7} {'pass1 s':>7} {'pass2 s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r["timings"]
        load = "{:.1f}-{:.1f}".format(*r["load_average_1min"])
        lines.append(
            f"{r['revision'][:10]:<10} {r['tokens']:>6d} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {load:>9} "
            f"{t.get('calibration_s', 0):>7.1f} {t.get('pass1_s', 0):>7.1f} {t.get('pass2_s', 0):>7.1f}"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512], help="token counts for this checkout")
    ap.add_argument("--baseline", metavar="REV", help="also time this git revision (e.g. the commit before a change)")
    ap.add_argument("--baseline-tokens", type=int, nargs="+", default=[128], help="token counts for the baseline")
    ap.add_argument("--metrics", action="store_true", help="also time the per-position metrics per backend")
    ap.add_argument("--out", default=str(RESULTS / "eval_harness_speed.json"), help="results JSON")
    args = ap.parse_args(argv)
    if any(n < 2 for n in args.tokens + args.baseline_tokens):
        raise SystemExit("error: --tokens and --baseline-tokens must be >= 2")
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "gearbx_mlx"))
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(head + ("+changes" if dirty else ""), ROOT, n) for n in args.tokens]
        if args.baseline:
            base = Path(tmp) / "baseline"
            base.mkdir()
            commit = export_revision(args.baseline, base)
            runs = [(commit, base, n) for n in args.baseline_tokens] + runs
        for i, (rev, root, n) in enumerate(runs):
            print(f"[{i + 1}/{len(runs)}] {rev[:10]} --tokens {n} ...", file=sys.stderr, flush=True)
            row = run_once(root, n, Path(tmp) / f"run{i}.json")
            rows.append({"revision": rev, **row})
    print(table(rows))
    micro = None
    if args.metrics:
        micro = time_metrics()
        print(f"metrics of one window ({micro['positions']} x {micro['vocab']}), CPU s per row: "
              + ", ".join(f"{b} {micro[b + '_routed_cpu_s']:.2f}" for b in ("numpy", "mlx")))
    out = {
        "script": "python scripts/bench_eval_speed.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            **{k: os.environ.get(k) for k in ENV_KEYS},
        },
        "note": "wall time depends on the machine's load (load_average_1min, before and after each run); "
        "cpu_s is user + system time of the run, all threads",
        "runs": rows,
        "metrics": micro,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
