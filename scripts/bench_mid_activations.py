#!/usr/bin/env python3
"""What int8 activations cost the mid gear on the CPU, in both stores, decoding step by step.

    python scripts/bench_mid_activations.py [--tokens 1024] [--window 256] [--model NAME]
                                            [--out benchmarks/results/mid_activations.json]

The text (gensim's Lee corpus, as ``scripts/bench_nested.py --parts quality``)
is cut into windows; each window is decoded one token at a time through a
fresh KV cache, teacher-forced, so every product of a managed layer takes one
input row: the C kernels' single-row GEMV, as a decode step (and the step of
a prompt's last token) takes it. Each variant's distribution at every
position is compared with the loaded float weights' (the whole window in one
forward pass): mean KL (nats), top-1 agreement, perplexity of the text.

Variants: the mid gear of each store with float32 activations (C path
``float``) and with int8 activations in blocks of 32 (``intdot``; the packed
kernel's ``auto``):

* ``separate-mid-float`` / ``separate-mid-int8``: MLX-format 8-bit packed
  layers (``PackedLinear``; ``gearbx_mlx.packed.layers.CPU_GEMV_PATH``);
* ``nested-mid-float`` / ``nested-mid-int8``: planes 4:64 + 4:32
  (``NestedKernelConfig.intdot_one_row_plans`` without or with ``(4, 4)``).

Writes the rows, the int8-minus-float differences per store, the machine and
the date to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _windows(tok: Any, tokens: int, window: int) -> List[List[int]]:
    from gearbx_mlx.evaluation.text import text_tokens
    from gearbx_mlx.sources.models import corpus_path

    ids = text_tokens(tok, corpus_path("lee_background").read_text(encoding="utf-8"), tokens)
    out = [ids[i: i + window + 1] for i in range(0, len(ids) - 1, window)]
    return [w for w in out if len(w) > 1]


def _stepwise_logits(model: Any, window: List[int]) -> mx.array:
    """``(len(window) - 1, V)``: the model's logits at each position, one token per forward pass."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = []
    for t in window[:-1]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        mx.eval(logits)
        rows.append(logits)
    return mx.stack(rows)


def _score(model: Any, windows: List[List[int]], refs: List[Any]) -> Dict[str, float]:
    from gearbx_mlx.evaluation import metrics

    nll = kl = hits = n = 0.0
    tic = time.perf_counter()
    for w, ref in zip(windows, refs):
        r = metrics.routed(_stepwise_logits(model, w), list(w[1:]), ref)
        nll, kl, hits, n = nll + sum(r["nll"]), kl + sum(r["kl"]), hits + sum(r["hits"]), n + len(r["kl"])
    return {"perplexity": math.exp(nll / n), "kl_nats": kl / n, "top1": hits / n, "positions": int(n),
            "seconds": round(time.perf_counter() - tic, 1)}


def _store_rows(store: str, args: argparse.Namespace, windows_of: Any, refs_of: Any) -> List[Dict[str, Any]]:
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.generation import load
    from gearbx_mlx.nested.matmul import DEFAULT_CONFIG
    from gearbx_mlx.packed import layers as packed_layers

    model, tok, gb = load(args.model, config=GearboxConfig(scope="all", store=store, kernel="packed"))
    windows = windows_of(tok)
    refs = refs_of(model, windows)
    mgr = gb.manager
    mgr.shift("mid")
    rows = []
    for act in ("float", "int8"):
        if store == "separate":
            packed_layers.CPU_GEMV_PATH = "auto" if act == "int8" else "float"
        else:
            config = dataclasses.replace(DEFAULT_CONFIG, intdot_plans=((4,),),
                                         intdot_one_row_plans=((4, 4),) if act == "int8" else ())
            for w in mgr.nested.values():
                w.use_kernel_config(config)
        row = {"variant": f"{store}-mid-{act}", **_score(model, windows, refs)}
        print(f"{row['variant']:<20} ppl {row['perplexity']:8.3f}  KL {row['kl_nats']:.3e}  top-1 {row['top1']:.4f}"
              f"  ({row['seconds']} s)", flush=True)
        rows.append(row)
    packed_layers.CPU_GEMV_PATH = "auto"
    return rows


def main(argv: List[str] | None = None) -> None:
    from gearbx_mlx.evaluation import metrics

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mid_activations.json")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    held: Dict[str, Any] = {}

    def windows_of(tok: Any) -> List[List[int]]:
        held.setdefault("windows", _windows(tok, args.tokens, args.window))
        return held["windows"]

    def refs_of(model: Any, windows: List[List[int]]) -> List[Any]:
        if "refs" not in held:  # the loaded float weights (the high gear as loaded), a window per pass
            held["refs"] = [metrics.reference(model(mx.array(w[:-1])[None])[0], list(w[1:]))[0] for w in windows]
        return held["refs"]

    rows = _store_rows("separate", args, windows_of, refs_of) + _store_rows("nested", args, windows_of, refs_of)
    by = {r["variant"]: r for r in rows}
    cost = {s: {k: by[f"{s}-mid-int8"][k] - by[f"{s}-mid-float"][k] for k in ("kl_nats", "top1", "perplexity")}
            for s in ("separate", "nested")}
    result = {
        "what": "mid gear, float32 vs int8 activations in the C single-row GEMV, teacher-forced step by step "
                "against the loaded float weights",
        "command": "python scripts/bench_mid_activations.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model or "default", "tokens": args.tokens, "window": args.window,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "rows": rows, "int8_minus_float": cost,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(cost, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
