#!/usr/bin/env python3
"""Time the fused KV write kernel against the MLX ops it replaces, on the default device.

One cache write of one attention layer: the keys (minus a per-channel offset)
and the values of a step quantized into MLX's affine format. Paths:

* ``fused``: :func:`gearbx_mlx.kvcache.write_kernel.fused_write`, one launch
  (skipped, with a note, where the default device has no Metal/CUDA GPU);
* ``ops``: ``quantize`` twice with the offset subtraction, op by op;
* ``step``: :func:`gearbx_mlx.kvcache.quantize.quantize_step`, the cache's
  own write (least squares compiled for both halves at up to
  ``COMPILED_MAX_TOKENS`` tokens).

Shape: a Llama-3-8B layer (batch 1, 8 kv heads, head dim 128, float16 by
default) at L = 1 (a decode step) and L = 512 (a prefill chunk); quantizers
ls and minmax, 4 and 3 bits, groups of 64 and 32. Two measurements per case:

* ``latency_us``: one write, then ``mx.eval`` of it, again and again (median
  over rounds of the mean per call): what a step pays when nothing else
  is in flight;
* ``per_layer_us``: 32 writes (a 32-layer model's step, each layer its own
  inputs) built into one graph and evaluated once, divided by 32.

Before timing, the fused output is compared with the ``ops`` path: the
share of groups (scale, bias and codes) that differ is recorded.

Usage: python scripts/bench_kv_write.py [--out FILE] [--lengths 1 512] [--rounds 5] [--calls 50] [--dtype float16]
Writes JSON (default benchmarks/results/kv_write_<device>.json) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import device_name  # noqa: E402

from gearbx_mlx.kvcache import write_kernel  # noqa: E402
from gearbx_mlx.kvcache.quantize import offset_keys, quantize, quantize_step  # noqa: E402

#: Llama-3-8B's attention: kv heads, head dim, layers.
HEADS, HEAD_DIM, LAYERS = 8, 128, 32
CASES = list(itertools.product(("ls", "minmax"), (4, 3), (64, 32)))

Write = Callable[[mx.array, mx.array, Optional[mx.array]], tuple]


def ops_write(quantizer: str, bits: int, group: int) -> Write:
    def run(k: mx.array, v: mx.array, off: Optional[mx.array]) -> tuple:
        return quantize(offset_keys(k, off), group, bits, quantizer), quantize(v, group, bits, quantizer)
    return run


def step_write(quantizer: str, bits: int, group: int) -> Write:
    return lambda k, v, off: quantize_step(k, v, off, group, bits, quantizer)


def fused(quantizer: str, bits: int, group: int) -> Write:
    return lambda k, v, off: write_kernel.fused_write(k, v, off, group, bits, quantizer)


def make_inputs(length: int, dtype: mx.Dtype, n: int, seed: int = 0) -> List[Tuple[mx.array, mx.array, mx.array]]:
    """``n`` layers' (keys, values, key offset): keys with a per-channel offset, as k_proj biases give."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        chan = rng.standard_normal((HEADS, HEAD_DIM)).astype(np.float32) * 3.0
        k = rng.standard_normal((1, HEADS, length, HEAD_DIM)).astype(np.float32) + chan[None, :, None, :]
        v = rng.standard_normal((1, HEADS, length, HEAD_DIM)).astype(np.float32)
        out.append((mx.array(k).astype(dtype), mx.array(v).astype(dtype), mx.array(chan)))
    mx.eval(out)
    return out


def latency_us(write: Write, inputs, calls: int, rounds: int) -> float:
    """Median over rounds of the mean time of one write evaluated on its own."""
    k, v, off = inputs[0]
    mx.eval(write(k, v, off))  # compile, allocate
    per = []
    for _ in range(rounds):
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            mx.eval(write(k, v, off))
        mx.synchronize()
        per.append((time.perf_counter() - t0) / calls)
    return 1e6 * statistics.median(per)


def per_layer_us(write: Write, inputs, rounds: int) -> float:
    """Median over rounds of (one evaluation of every layer's write) / layers."""
    mx.eval([write(k, v, off) for k, v, off in inputs])
    per = []
    for _ in range(rounds):
        outs = [write(k, v, off) for k, v, off in inputs]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        per.append((time.perf_counter() - t0) / len(inputs))
    return 1e6 * statistics.median(per)


def differing_groups(got: tuple, want: tuple, group: int, bits: int) -> float:
    """Share of groups (keys and values) whose scale, bias or codes differ."""
    diff = total = 0
    for g, w in zip(got, want):
        words = group * bits // 32
        codes_same = mx.all(mx.equal(g[0], w[0]).reshape(*g[0].shape[:-1], -1, words), axis=-1)
        same = codes_same & mx.equal(g[1], w[1]) & mx.equal(g[2], w[2])
        diff += int((~same).sum().item())
        total += same.size
    return diff / total


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/kv_write_<device>.json)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 512], help="tokens per write")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="writes per latency round")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    args = ap.parse_args(argv)
    dtype = getattr(mx, args.dtype)

    name = device_name()
    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    out = args.out or ROOT / "benchmarks" / "results" / f"kv_write_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    has_kernel = write_kernel.available()
    note = None if has_kernel else (f"no Metal/CUDA GPU on the default device ({mx.default_device()}): "
                                    "the fused kernel is not timed")
    report: Dict[str, object] = {
        "device": name, "default_device": str(mx.default_device()), "mlx": mx.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python", "scripts/bench_kv_write.py"] + list(argv if argv is not None else sys.argv[1:])),
        "shape": {"batch": 1, "kv_heads": HEADS, "head_dim": HEAD_DIM, "layers": LAYERS, "dtype": args.dtype},
        "rounds": args.rounds, "calls": args.calls, "note": note, "cases": [],
    }
    print(f"device: {name} ({mx.default_device()}), mlx {mx.__version__}, {args.dtype}")
    if note:
        print(f"note: {note}")
    head = f"{'L':>4} {'quant':>6} {'bits':>4} {'group':>5} | {'latency us: fused':>17} {'ops':>8} {'step':>8} | " \
           f"{'per layer us: fused':>19} {'ops':>8} {'step':>8} | {'differ':>6}"
    print(head)
    print("-" * len(head))
    for length in args.lengths:
        inputs = make_inputs(length, dtype, LAYERS)
        for quantizer, bits, group in CASES:
            paths = {"ops": ops_write(quantizer, bits, group), "step": step_write(quantizer, bits, group)}
            if has_kernel:
                paths["fused"] = fused(quantizer, bits, group)
            case: Dict[str, object] = {"L": length, "quantizer": quantizer, "bits": bits, "group_size": group,
                                       "latency_us": {}, "per_layer_us": {}}
            if has_kernel:
                k, v, off = inputs[0]
                case["differing_group_share"] = differing_groups(paths["fused"](k, v, off), paths["ops"](k, v, off),
                                                                 group, bits)
            for path, write in paths.items():
                case["latency_us"][path] = latency_us(write, inputs, args.calls, args.rounds)
                case["per_layer_us"][path] = per_layer_us(write, inputs, args.rounds)
            report["cases"].append(case)
            out.write_text(json.dumps(report, indent=1))
            lat, thr = case["latency_us"], case["per_layer_us"]

            def cell(d: dict, key: str, width: int) -> str:
                return f"{d[key]:{width}.1f}" if key in d else f"{'-':>{width}}"

            differ = f"{case['differing_group_share']:6.2%}" if "differing_group_share" in case else f"{'-':>6}"
            print(f"{length:4d} {quantizer:>6} {bits:4d} {group:5d} | {cell(lat, 'fused', 17)} {cell(lat, 'ops', 8)} "
                  f"{cell(lat, 'step', 8)} | {cell(thr, 'fused', 19)} {cell(thr, 'ops', 8)} {cell(thr, 'step', 8)} | "
                  f"{differ}", flush=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
