"""Prompt windows of both stores and of nested kernel settings, alternated in one process.

    python scripts/bench_prefill_inprocess.py [--rounds 14] [--threads N] [--model NAME] [--out FILE.json]

Loads the model twice in one process, once per store (``--scope all``), and
times mlx-lm's prompt window (the first response of ``run.tokens()``, as
``scripts/bench_prefill_store.py --clock cpu`` does) for each variant in a
shuffled order every round: separate copies, and the nested store with each
setting of ``NestedKernelConfig.dense_unpack_threads`` (the dense prefill's
C unpacking on the calling thread, or on the C kernels' pool, the default).
Every window after a first, untimed one per variant: so it times the steady
state that fresh processes reach after their first prompt, and every variant
meets the same machine and the same allocator state, where fresh processes
on a loaded machine swing far more (docs/BENCHMARKS.md, prompt tokens/s).
Each window is also split, on the wall clock, at the end of mlx-lm's first
evaluation in it: the prefill chunk (every prompt token but the last) and the
one-row steps after it (the prompt's last token and the next), which read a
gear's bytes once per step (the JSON's ``step_bytes``, per store and gear).
Writes the windows (wall and CPU time, and the split), each variant's
per-round ratio separate/variant (prompt tokens/s of the variant over
separate's, and the same for each part), the load average and the date to
``--out`` (default
``benchmarks/results/prefill_inprocess.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_prefill_store import PROMPT, _mark_mlx_lm_evals  # noqa: E402

sys.path.insert(0, str(ROOT))
from gearbx_mlx.evaluation.significance import median_verdict  # noqa: E402

#: variant -> (store, the nested dense unpacking's threads: 0 the C kernels' pool, 1 the caller)
VARIANTS: Dict[str, Tuple[str, Optional[int]]] = {
    "separate": ("separate", None),
    "nested_unpack_on_caller": ("nested", 1),
    "nested_unpack_on_pool": ("nested", 0),
}


def loaded(model: Optional[str]) -> Dict[str, Any]:
    import gearbx_mlx
    from gearbx_mlx import generation

    stores = {s: gearbx_mlx.load(model, scope="all", store=s) for s in ("separate", "nested")}
    generation.settle_loaded()
    return stores


def set_unpack_threads(gearbox: Any, threads: int) -> None:
    """Every nested matrix's dense unpacking on ``threads`` (0: the C kernels' pool)."""
    value = threads or None
    for weights in gearbox.manager.nested.values():
        product = weights.product
        product.config = dataclasses.replace(product.config, dense_unpack_threads=value)


def window(stores: Dict[str, Any], variant: str, marks: List[float]) -> Dict[str, Any]:
    """One timed prompt window; ``marks`` collects the wall-clock ends of mlx-lm's evaluations
    (:func:`bench_prefill_store._mark_mlx_lm_evals`), the first of which ends the prefill chunk."""
    import gearbx_mlx
    from gearbx_mlx.chat import apply_chat_template

    store, threads = VARIANTS[variant]
    model, tokenizer, gearbox = stores[store]
    if store == "nested":
        set_unpack_threads(gearbox, threads)
    text = apply_chat_template(tokenizer, PROMPT, None, use_template=True)
    run = gearbx_mlx.prepare(model, tokenizer, text, gearbox, max_tokens=4, prompt_text=PROMPT)
    tokens = run.tokens()
    marks.clear()
    start, cpu = time.perf_counter(), time.process_time()
    first = next(tokens)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    chunk = marks[0] - start if marks else None
    run.close()
    return {"variant": variant, "prompt_tokens": int(first.prompt_tokens), "gear": first.gear,
            "token": int(first.token), "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
            "chunk_wall_s": None if chunk is None else round(chunk, 4),
            "steps_wall_s": None if chunk is None else round(wall - chunk, 4)}


def ratios(runs: List[Dict[str, Any]], variant: str, key: str) -> List[float]:
    """Per round: separate's time over the variant's (the variant's prompt tokens/s over separate's)."""
    by_round: Dict[int, Dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["variant"]] = r[key]
    return [t["separate"] / t[variant] for t in by_round.values() if variant in t and "separate" in t]


def summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    out = {}
    for v in VARIANTS:
        if v == "separate":
            continue
        wall, cpu = ratios(runs, v, "wall_s"), ratios(runs, v, "cpu_s")
        out[v] = {"wall_ratios": wall, "cpu_ratios": cpu, "median_wall_ratio": statistics.median(wall),
                  "median_cpu_ratio": statistics.median(cpu)}
        out[v]["verdict"] = median_verdict(wall, 1.0)  # the target: the nested store >= separate copies
        if all(r["chunk_wall_s"] is not None for r in runs):  # as medians() asks
            out[v]["median_chunk_ratio"] = statistics.median(ratios(runs, v, "chunk_wall_s"))
            out[v]["median_steps_ratio"] = statistics.median(ratios(runs, v, "steps_wall_s"))
    return out


def medians(runs: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Per variant, the median seconds of the window, its prefill chunk and its one-row steps (wall)."""
    keys = ("wall_s", "chunk_wall_s", "steps_wall_s")
    return {v: {k: statistics.median(r[k] for r in runs if r["variant"] == v) for k in keys}
            for v in VARIANTS if all(r[k] is not None for r in runs if r["variant"] == v for k in keys)}


def measure(args: argparse.Namespace, report: Callable[[str], None]) -> Dict[str, Any]:
    if args.threads:
        from gearbx_mlx.bindings import cpu

        cpu.set_threads(args.threads)
    stores = loaded(args.model)
    marks = _mark_mlx_lm_evals(time.perf_counter)
    first = {v: window(stores, v, marks) for v in VARIANTS}  # untimed: first use of every path
    if len({r["token"] for r in first.values()}) != 1:
        raise SystemExit(f"error: the variants' first tokens differ: {first}")
    load_before, runs = os.getloadavg(), []
    for k in range(args.rounds):
        order = list(VARIANTS)
        random.Random(k).shuffle(order)
        for v in order:
            runs.append({**window(stores, v, marks), "round": k})
            report(f"round {k} {v:22s} wall {runs[-1]['wall_s']:.4f} s  cpu {runs[-1]['cpu_s']:.4f} s")
    return {"what": "prompt window, both stores and nested settings alternated in one process",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
            "threads": args.threads, "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
            "ld_preload": os.environ.get("LD_PRELOAD"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
            "step_bytes": {store: stores[store][2].manager.step_bytes() for store in ("separate", "nested")},
            "medians": medians(runs), "runs": runs, "variants": summary(runs)}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--threads", type=int, default=None, help="the C kernels' threads (set OPENBLAS_NUM_THREADS too)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill_inprocess.json")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("error: --rounds must be at least 1")
    result = measure(args, print)
    for v, m in result["medians"].items():
        print(f"{v:24s} median window {1e3 * m['wall_s']:.1f} ms: prefill chunk {1e3 * m['chunk_wall_s']:.1f} ms, "
              f"one-row steps {1e3 * m['steps_wall_s']:.1f} ms")
    for v, s in result["variants"].items():
        print(f"{v}: median prompt tokens/s over separate's: wall {s['median_wall_ratio']:.3f}, "
              f"cpu {s['median_cpu_ratio']:.3f}; the chunk's {s.get('median_chunk_ratio', float('nan')):.3f}, "
              f"the steps' {s.get('median_steps_ratio', float('nan')):.3f}; 95% interval of the wall median "
              f"{s['verdict']['interval_95'][0]:.3f}-{s['verdict']['interval_95'][1]:.3f}: {s['verdict']['verdict']}")
    for store, b in result["step_bytes"].items():
        print(f"{store}: bytes a one-row step reads, per gear: "
              + ", ".join(f"{g} {v / 2**20:.1f} MiB" for g, v in b.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
