#!/usr/bin/env python3
"""The nested GEMV's work splits on a GPU, at a model's own shapes, against MLX's products.

    python scripts/sweep_nested_gemv_gpu.py [--shapes 28672x4096 6144x4096 4096x4096 4096x14336]
        [--gears mid high] [--rows 1 2 4] [--vecs 4] [--int8x] [--biased6] [--device-only] [--out FILE.json]

For each shape (default: Llama-3-8B's stacked gate/up, stacked q/k/v, output
and down products) and gear, times every combination of rows per SIMD group,
chunk width, staging of x (threadgroup memory where K allows it, or read
from device memory), staged sums of x (``NestedTuning.xsums``) and biased
4-bit codes (``NestedTuning.biased``) and, with ``--biased6``, biased 6-bit
codes (``NestedTuning.biased6``, gears that read a 6-bit plane) and, with
``--int8x``, x rounded to int8 (``NestedTuning.int8x``, gears of 4-bit planes on CUDA), each
checked against the reference first, then MLX's 8-bit and 4-bit
``quantized_matmul`` (group 64) and the bf16 product at the same shape.
Prints, per shape and gear, the best split and its time against the
package's default and MLX's, and writes every timing to ``--out`` (default
``benchmarks/results/nested_gemv_sweep_<device>.json``). Times are per
product, many products over weight copies larger than the L2 cache in one
evaluated graph (``bench_nested_gpu.time_nested``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_nested_gpu as bench  # noqa: E402

from gearbx_mlx.bindings import gpu, nested_gpu  # noqa: E402
from gearbx_mlx.bindings.kernel_files import format_constant  # noqa: E402

LLAMA3_8B_SHAPES = ["28672x4096", "6144x4096", "4096x4096", "4096x14336"]


def parse_shape(text: str) -> tuple:
    try:
        out_features, in_features = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: a shape is OUTxIN (e.g. 4096x4096), got {text!r}") from None
    return out_features, in_features


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=LLAMA3_8B_SHAPES)
    ap.add_argument("--gears", nargs="+", default=["mid", "high"], choices=list(bench.GEARS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--vecs", nargs="+", type=int, default=[4])
    ap.add_argument("--int8x", action="store_true", help="also time x rounded to int8 (NestedTuning.int8x, "
                    "vec 4, gears of 4-bit planes only) at every --rows")
    ap.add_argument("--biased6", action="store_true", help="also the splits with 6-bit codes read biased")
    ap.add_argument("--device-only", action="store_true", help="float splits with x read from device memory "
                    "only (the default split's staging), not staged")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if gpu.gpu_backend() is None:
        print("no Metal/CUDA GPU on the default device: nothing to time", file=sys.stderr)
        return 2
    name = bench.device_name()
    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    out = args.out or ROOT / "benchmarks" / "results" / f"nested_gemv_sweep_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "plan": [list(p) for p in bench.PLAN], "default_tuning": {
                  n: vars(t) for n, t in nested_gpu.TUNING.items()},
              "command": " ".join(["python", "scripts/sweep_nested_gemv_gpu.py"] + list(argv or sys.argv[1:])),
              "runs": [], "baselines": []}
    shared_k = format_constant("GBX_SHARED_K")
    summary = []
    for text in args.shapes:
        shape = parse_shape(text)
        base = {fmt: bench.time_mlx(shape, fmt)["us"] for fmt in ("mlx-8", "mlx-4", "bf16")}
        report["baselines"].append({"shape": text, **base})
        print(f"{text}: MLX 8-bit {base['mlx-8']:.1f} us, MLX 4-bit {base['mlx-4']:.1f}, bf16 {base['bf16']:.1f}",
              flush=True)
        for gear in args.gears:
            n = bench.GEARS[gear]
            six = any(b == 6 for b, _ in bench.PLAN[:n])
            default = nested_gpu.default_tuning(n, shape[0])
            timed = {}
            stagings = [(True, False), (True, True), (False, False)] if shape[1] <= shared_k else [(False, False)]
            if args.device_only:
                stagings = [(False, False)]
            codes = [(False, False), (True, False)]  # (biased 4-bit codes, biased 6-bit codes)
            if six and args.biased6:
                codes += [(False, True), (True, True)]
            splits = [(rows, vec, staging, biased, False) for rows, vec, staging, biased
                      in itertools.product(args.rows, args.vecs, stagings, codes)]
            if args.int8x and nested_gpu.int8x_applies(gpu.gpu_backend(), [b for b, _ in bench.PLAN[:n]],
                                                       shape[1], 4):
                splits += [(rows, 4, (False, False), (False, False), True) for rows in args.rows]
            for rows, vec, (shared, xsums), (biased, biased6), int8x in splits:
                if six and vec % 2:
                    continue
                t = nested_gpu.NestedTuning(rows, vec, 1, xsums, biased, int8x=int8x, biased6=biased6)
                key = (rows, vec, shared, xsums, biased, int8x, biased6)
                split = {"shape": text, "gear": gear, "rows": rows, "vec": vec, "shared": shared, "xsums": xsums,
                         "biased": biased, "int8x": int8x, "biased6": biased6}
                try:
                    row = bench.time_nested(shape, n, True, t, shared)
                except Exception as e:  # a split that does not compile or fit: recorded
                    report["runs"].append({**split, "error": str(e)[:300]})
                    continue
                timed[key] = row["us"]
                report["runs"].append({**split, **row})
                print(f"  {gear:4s} rows={rows} vec={vec} {'shared' if shared else 'device'}"
                      f"{' xsums' if xsums else ''}{' biased' if biased else ''}{' int8x' if int8x else ''}"
                      f"{' biased6' if biased6 else ''}: "
                      f"{row['us']:.1f} us "
                      f"({row['GBps']:.0f} GB/s)", flush=True)
            if not timed:
                continue
            best = min(timed, key=timed.get)
            staged = default.stage and shape[1] <= shared_k
            dkey = (default.rows, default.vec, staged, default.xsums and staged, default.biased, default.int8x,
                    default.biased6)
            ref = base["bf16"] if gear == "high" else base["mlx-8"] if gear == "mid" else base["mlx-4"]
            summary.append((text, gear, best, timed[best], timed.get(dkey), ref))
            bench.planes_of.cache_clear()
            mx.clear_cache()
        out.write_text(json.dumps(report, indent=1, default=str))
    print("\nshape        gear  best (rows, vec, shared, xsums, biased, int8x, biased6) us  default us  MLX/bf16 us  "
          "best/MLX")
    for text, gear, best, us, dus, ref in summary:
        print(f"{text:12s} {gear:4s}  {str(best):38s} {us:6.1f} {dus if dus is None else round(dus, 1)!s:>10s}"
              f"  {ref:9.1f}  {ref / us:6.2f}x")
    report["summary"] = [{"shape": t, "gear": g, "best": list(b), "us": u, "default_us": d, "baseline_us": r}
                         for t, g, b, u, d, r in summary]
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
