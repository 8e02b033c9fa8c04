"""MLX's CPU ``quantized_matmul`` against dequantize-then-matmul, by scale dtype and input rows.

    python scripts/bench_qmm_cpu.py [--rows 1 8 54] [--reps 5] [--out FILE.json]

For the default model's MLP shape (1536 x 576) and its 4-bit groups of 64:
milliseconds (best of ``--reps``) of ``mx.quantized_matmul`` with float32
inputs and float32, float16 or bfloat16 scales and biases, and of the same
product as ``mx.dequantize`` then ``x @ w.T`` (float32) and as a float32
matmul of the dense weight alone, on the CPU device, for each row count;
and (independent of rows) one 4-bit plane dequantized by ``mx.dequantize``
and by :func:`gearbx_mlx.nested.planes.unpack_plane`.
Run it twice, with and without ``LD_PRELOAD`` of an optimized BLAS: the JSON
records which BLAS MLX called (:func:`gearbx_mlx.blas.mlx_blas`), the load
average and the date. Default output:
``benchmarks/results/qmm_cpu_<openblas|reference>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx

from gearbx_mlx import blas
from gearbx_mlx.nested.planes import build_planes, unpack_plane

ROOT = Path(__file__).resolve().parent.parent
SHAPE = (1536, 576)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def best_ms(fn, reps: int) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - tic)
    return best * 1e3


def measure(rows: int, reps: int, bits: int = 4, group: int = 64) -> dict:
    in_f = SHAPE[1]
    w = mx.random.normal(SHAPE, key=mx.random.key(0)) * 0.02
    x = mx.random.normal((rows, in_f), key=mx.random.key(1))
    row = {"rows": rows, "bits": bits, "group_size": group, "shape": list(SHAPE)}
    for name, dt in DTYPES.items():
        q, s, b = mx.quantize(w.astype(dt), group_size=group, bits=bits)
        mx.eval(q, s, b)
        row[f"qmm_scales_{name}_ms"] = best_ms(
            lambda q=q, s=s, b=b: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group, bits=bits),
            reps)
        row[f"dequant_matmul_scales_{name}_ms"] = best_ms(
            lambda q=q, s=s, b=b: x @ mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32),
                                                    group_size=group, bits=bits).T, reps)
    row["dense_matmul_ms"] = best_ms(lambda: x @ w.T, reps)
    plane = build_planes(w, ((bits, group),))[0]
    row["mx_dequantize_ms"] = best_ms(plane.dequantize, reps)
    row["unpack_plane_ms"] = best_ms(lambda: unpack_plane(plane), reps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 54])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    lib = blas.mlx_blas()
    kind = "openblas" if lib and "openblas" in lib.lower() else "optimized" if blas.optimized() else "reference"
    load_before = os.getloadavg()
    rows = [measure(r, args.reps) for r in args.rows]
    cols = [k for k in rows[0] if k.endswith("_ms")]
    print(f"{'rows':>5} " + " ".join(f"{c[:-3]:>28}" for c in cols))
    for r in rows:
        print(f"{r['rows']:>5} " + " ".join(f"{r[c]:>28.3f}" for c in cols))
    out = args.out or ROOT / "benchmarks" / "results" / f"qmm_cpu_{kind}.json"
    result = {
        "what": "MLX CPU quantized_matmul vs dequantize+matmul, float32 inputs, ms (best of reps)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": f"{'LD_PRELOAD=' + os.environ['LD_PRELOAD'] + ' ' if os.environ.get('LD_PRELOAD') else ''}"
                   f"python scripts/bench_qmm_cpu.py --rows {' '.join(map(str, args.rows))} --reps {args.reps}",
        "mlx": mx.__version__, "mlx_blas_library": blas.shown_path(lib), "blas": kind,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
