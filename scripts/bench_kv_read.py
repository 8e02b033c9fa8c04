#!/usr/bin/env python3
"""Time what a decode step spends reading the KV cache, one layer, on the default device.

A Llama-3-8B layer (32 query heads over 8 kv heads, head dim 128, float16) at
a given context: the cache is a buffer with room for 256 more tokens, and
attention reads its first ``context`` rows, as mlx-lm's caches hand them over.
Paths, each timed as 32 layers' worth (separate buffers) built into one graph
and evaluated once, per layer, median over rounds:

* ``float16``: ``mx.fast.scaled_dot_product_attention`` over the float slices;
* ``quantized-views``: mlx-lm's quantized attention over slices of a 4-bit
  g64 cache (fails where the backend takes only contiguous operands);
* ``copies``: only making the quantized slices contiguous (``mx.contiguous``
  of codes, scales and biases of keys and values);
* ``quantized-copies``: the copies, then mlx-lm's quantized attention over them
  (what the package's cache does on such a backend).

Usage: python scripts/bench_kv_read.py [--contexts 1024 4096] [--rounds 5] [--out FILE]
Writes JSON (default benchmarks/results/kv_read_<device>.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import device_name  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS, SPARE = 32, 8, 128, 32, 256
BITS, GROUP = 4, 64


def layer_inputs(context: int, seed: int) -> Dict[str, object]:
    """One layer: a query, float buffers and 4-bit buffers with ``SPARE`` rows past ``context``."""
    k = mx.random.normal((1, KV_HEADS, context + SPARE, HEAD_DIM), key=mx.random.key(seed)).astype(mx.float16)
    v = mx.random.normal((1, KV_HEADS, context + SPARE, HEAD_DIM), key=mx.random.key(seed + 1)).astype(mx.float16)
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM), key=mx.random.key(seed + 2)).astype(mx.float16)
    qk, qv = mx.quantize(k, GROUP, BITS), mx.quantize(v, GROUP, BITS)
    mx.eval(k, v, q, qk, qv)
    return {"q": q, "k": k, "v": v, "qk": qk, "qv": qv}


def paths(context: int) -> Dict[str, Callable[[Dict[str, object]], mx.array]]:
    def sl(x: mx.array) -> mx.array:
        return x[..., :context, :]

    def float16(d):
        return mx.fast.scaled_dot_product_attention(d["q"], sl(d["k"]), sl(d["v"]), scale=HEAD_DIM**-0.5)

    def views(d):
        return quantized_scaled_dot_product_attention(
            d["q"], tuple(sl(a) for a in d["qk"]), tuple(sl(a) for a in d["qv"]), scale=HEAD_DIM**-0.5,
            mask=None, group_size=GROUP, bits=BITS)

    def copies(d):
        return [mx.contiguous(sl(a)) for a in (*d["qk"], *d["qv"])]

    def quantized_copies(d):
        return quantized_scaled_dot_product_attention(
            d["q"], tuple(mx.contiguous(sl(a)) for a in d["qk"]), tuple(mx.contiguous(sl(a)) for a in d["qv"]),
            scale=HEAD_DIM**-0.5, mask=None, group_size=GROUP, bits=BITS)

    return {"float16": float16, "quantized-views": views, "copies": copies, "quantized-copies": quantized_copies}


def per_layer_us(f: Callable, layers: List[Dict[str, object]], rounds: int) -> float:
    mx.eval([f(d) for d in layers])  # warm: compile and allocate
    times = []
    for _ in range(rounds):
        tic = time.perf_counter()
        mx.eval([f(d) for d in layers])
        times.append((time.perf_counter() - tic) / len(layers) * 1e6)
    return statistics.median(times)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    dev = device_name()
    rows = []
    print(f"device: {dev}, mlx {mx.__version__}; per layer, {LAYERS} layers a graph, median of {args.rounds}")
    for ctx in args.contexts:
        layers = [layer_inputs(ctx, 10 * i) for i in range(LAYERS)]
        for name, f in paths(ctx).items():
            row = {"context": ctx, "path": name}
            try:
                row["per_layer_us"] = per_layer_us(f, layers, args.rounds)
                print(f"context {ctx:6d}  {name:17s} {row['per_layer_us']:9.1f} us", flush=True)
            except Exception as e:  # noqa: BLE001 - a path the backend lacks is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"context {ctx:6d}  {name:17s} FAILED {row['error']}", flush=True)
            rows.append(row)
    out = args.out or ROOT / "benchmarks" / "results" / f"kv_read_{dev.lower().replace(' ', '_')}.json"
    doc = {"device": dev, "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"),
           "command": "python scripts/bench_kv_read.py " + " ".join(argv),
           "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "bits": BITS, "group": GROUP,
                     "dtype": "float16", "layers_per_graph": LAYERS},
           "rounds": args.rounds, "rows": rows}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
