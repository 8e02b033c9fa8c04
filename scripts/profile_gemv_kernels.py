#!/usr/bin/env python3
"""Launch each decode GEMV of one shape a few times, for a GPU profiler to read.

    ncu --kernel-name regex:"gbx_nested|qmv|gemv" --section SpeedOfLight ... \
        python scripts/profile_gemv_kernels.py [--shape 28672x4096] [--launches 3]

Builds one random bfloat16 weight, its nested planes (the package's plan)
and MLX's 8-bit quantization, then evaluates, each ``--launches`` times and
synchronized between: the mid and high gears' kernels at the package's
default split and at another (x rounded to int8 where the gear's planes and
the GPU allow it, else two rows with x's sums staged and biased codes), MLX's 8-bit
``quantized_matmul`` and the bf16 product. Prints the kernel name of each
nested variant, so a profile's rows can be told apart. Times nothing itself
(``scripts/sweep_nested_gemv_gpu.py`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gearbx_mlx.bindings import gpu, nested_gpu  # noqa: E402
from gearbx_mlx.nested.planes import DEFAULT_PLAN, build_planes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="28672x4096")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args(argv)
    backend = gpu.gpu_backend()
    if backend is None:
        print("no Metal/CUDA GPU on the default device", file=sys.stderr)
        return 2
    out_features, in_features = (int(v) for v in args.shape.lower().split("x"))
    mx.random.seed(0)
    w = (mx.random.normal((out_features, in_features)) * 0.02).astype(mx.bfloat16)
    planes = build_planes(w, DEFAULT_PLAN)
    q8 = mx.quantize(w, 64, 8)
    x = mx.random.normal((in_features,)).astype(mx.bfloat16)
    mx.eval(w, q8, x)

    def repeat(make):
        for _ in range(args.launches):
            mx.eval(make())
            mx.synchronize()

    for n in (2, 3):
        default = nested_gpu.default_tuning(n, out_features)
        bits, groups = tuple(b for b, _ in DEFAULT_PLAN[:n]), tuple(g for _, g in DEFAULT_PLAN[:n])
        other = (nested_gpu.int8x_tuning(n, out_features) if nested_gpu.int8x_applies(backend, bits, in_features, 4)
                 else dataclasses.replace(default, rows=2, xsums=True, biased=True))
        for tuning in (default, other):
            run = nested_gpu.launcher(backend, bits, groups, in_features, out_features, mx.bfloat16, mx.bfloat16,
                                      False, tuning=tuning)
            print(f"planes {n}, {tuning}: {run.kernel_name}", flush=True)
            arrays, factors = nested_gpu.plane_arrays(planes, n), nested_gpu.factors_of(planes, n)
            repeat(lambda: run(x, arrays, factors))
    print("MLX 8-bit quantized_matmul", flush=True)
    repeat(lambda: mx.quantized_matmul(x[None], *q8, transpose=True, group_size=64, bits=8))
    print("bf16 product", flush=True)
    repeat(lambda: x[None] @ w.T)
    return 0


if __name__ == "__main__":
    sys.exit(main())
