#!/usr/bin/env python3
"""Benchmark the C kernels of the nested gears on the CPU; print tables, write JSON.

Each gear of a plan of planes the kernels read (default the package's,
4:64,4:32,6:64; ``--plan`` for another, bits:group per plane) reads its first n planes of a 4096x4096
matrix (``--shape``). Sections (each recorded even if
another fails):

1. ``bandwidth``: read bandwidth of this machine, 1 and 2 threads, measured
   in the same run by the probe the packed benchmark uses
   (``scripts/bench_cpu.py``: the C pool streams 8 MiB pieces of a set far
   larger than the last-level cache).
2. ``gemv``: each gear x path (float, intdot) x threads (1, 2): seconds per
   product with the weights cold (rotating copies larger than twice the LLC),
   the bytes the gear reads (codes, scales and biases of its planes), GB/s,
   and that rate over the read bandwidth of the same thread count and
   statistic (the target: >= 70%). Each kernel is checked against the scalar
   C oracle of its path before it is timed. Also the oracle of the package,
   ``reference_matmul`` (one MLX ``quantized_matmul`` per plane), once per gear.
3. ``verify``: the multi-row kernel, 4 activation rows of the high gear in one
   call, against 4 single-row calls.
4. ``compute``: each plane kind of the plan alone (bits, group), one thread,
   on a 1024-row matrix read again and again (hot in the caches): codes per
   second and the GB/s of its bytes, over the read bandwidth (best). A kind
   whose hot rate is under the target cannot reach it from DRAM either: the
   kernel is bound by its instructions, not by memory.
5. ``accuracy``: per gear and path, the relative RMS error of y against the
   gear's exact product (float64; the kernel's own error) and against the
   unquantized weight (the gear's error plus the kernel's): what the int8
   activations of the intdot path cost next to the gear's own error. For
   Gaussian activations, Gaussian ones with outliers, and the real inputs
   of two layers of the default model on English text (its weights).

Timing: each call timed on its own; median and best reported (shared VMs:
the best call is the closest to an idle machine, the median to what a user
gets now); bandwidth and GEMV rows use the same statistic.

Usage:
  python scripts/bench_nested_kernels.py [--out benchmarks/results/nested_cpu.json] [--quick]
      [--shape 4096 4096] [--scale-dtype bfloat16] [--seconds 0.6]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mlx.core as mx  # noqa: E402
from bench_cpu import bench_bandwidth, llc_bytes, machine_info, time_calls  # noqa: E402

from gearbx_mlx.bindings import cpu, nested_cpu  # noqa: E402
from gearbx_mlx.nested.planes import DEFAULT_PLAN, build_planes, reference_matmul  # noqa: E402

#: (bits, group size) per plane: the package's default plan; --plan replaces it.
PLAN = tuple(DEFAULT_PLAN)
GEARS = {1: "low", 2: "mid", 3: "high"}
PATHS = ("float", "intdot")
TARGET = 0.7


def plane_bytes(planes, n: int) -> int:
    return sum(p.weight.nbytes + p.scales.nbytes + p.biases.nbytes for p in planes[:n])


def copy_planes(planes):
    """The same planes in new buffers (so rotating copies stream from DRAM)."""
    out = []
    for p in planes:
        q = type(p)(p.weight + 0, p.scales + 0, p.biases + 0, p.bits, p.group_size, p.exponent)
        mx.eval(q.weight, q.scales, q.biases)
        out.append(q)
    return out


def make_weight(shape, dtype, seed=0) -> mx.array:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    w[rng.random(shape) < 0.001] *= 10.0  # a few outliers, as trained weights have
    return mx.array(w).astype(dtype)


def make_x(k: int, seed=1) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(k).astype(np.float32)
    x[rng.random(k) < 0.01] *= 20.0  # activation outliers
    return mx.array(x)


def bench_gemv(planes, x, cold: int, seconds: float) -> List[Dict[str, Any]]:
    per_copy = plane_bytes(planes, len(planes))
    copies = [planes] + [copy_planes(planes) for _ in range(max(1, math.ceil(cold / per_copy)) - 1)]
    preps = [nested_cpu.prepare_nested(c) for c in copies]
    rows = []
    for n in (1, 2, 3):
        nbytes = plane_bytes(planes, n)
        for path in PATHS:
            y = np.asarray(preps[0].gemv(x, n, path=path))
            ref = np.asarray(preps[0].gemv(x, n, path="ref" if path == "float" else "intdot_ref"))
            err = float(np.max(np.abs(y - ref)) / (np.max(np.abs(ref)) + 1e-30))
            if err > 1e-4:
                raise AssertionError(f"{GEARS[n]} {path}: max rel. error {err:.2e} against its oracle; not timed")
            for threads in (1, 2):
                t = time_calls([(lambda p=p: p.gemv(x, n, path=path, threads=threads)) for p in preps],
                               seconds, min_calls=2 * len(preps))
                rows.append({"gear": GEARS[n], "planes": n, "plan": [list(p) for p in PLAN[:n]], "path": path,
                             "threads": threads, "bytes": nbytes, "copies": len(preps), **t,
                             "median_gbs": nbytes / t["median_s"] / 1e9, "best_gbs": nbytes / t["best_s"] / 1e9,
                             "max_rel_err_vs_oracle": err})
                print(f"  {GEARS[n]:<4} {path:<6} {threads} thr: {t['median_s'] * 1e3:7.3f} ms median, "
                      f"{rows[-1]['median_gbs']:5.1f} GB/s", flush=True)
        # the package's oracle: one quantized_matmul per plane (MLX's CPU kernels)
        t = time_calls([(lambda c=c: mx.eval(reference_matmul(x[None], c, n))) for c in copies], seconds,
                       min_calls=len(copies), max_calls=20)
        rows.append({"gear": GEARS[n], "planes": n, "plan": [list(p) for p in PLAN[:n]], "path": "mlx reference_matmul",
                     "threads": "mlx", "bytes": nbytes, "copies": len(copies), **t,
                     "median_gbs": nbytes / t["median_s"] / 1e9, "best_gbs": nbytes / t["best_s"] / 1e9})
    return rows


def bench_compute(k: int, scale_dtype: mx.Dtype, seconds: float) -> List[Dict[str, Any]]:
    """Hot-cache rate of each (bits, group) plane kind of PLAN alone, one thread, both paths."""
    rows = []
    for bits, group in dict.fromkeys(PLAN):
        planes = build_planes(make_weight((1024, k), scale_dtype, seed=3), ((bits, group),))
        prep = nested_cpu.prepare_nested(planes)
        x = make_x(k)
        for path in PATHS:
            for _ in range(3):
                prep.gemv(x, 1, path=path, threads=1)  # warm the caches
            t = time_calls([lambda: prep.gemv(x, 1, path=path, threads=1)], seconds, min_calls=20)
            nbytes = plane_bytes(planes, 1)
            rows.append({"bits": bits, "group": group, "path": path, "shape": [1024, k], "bytes": nbytes, **t,
                         "gcodes_per_s_best": 1024 * k / t["best_s"] / 1e9, "best_gbs": nbytes / t["best_s"] / 1e9})
            print(f"  hot {bits}-bit g{group:<3} {path:<6}: {rows[-1]['gcodes_per_s_best']:5.1f} Gcodes/s, "
                  f"{rows[-1]['best_gbs']:5.1f} GB/s (best)", flush=True)
    return rows


def bench_verify(planes, k: int, seconds: float, rows: int = 4) -> Dict[str, Any]:
    prep = nested_cpu.prepare_nested(planes)
    xs = mx.stack([make_x(k, seed=s) for s in range(rows)])
    mx.eval(xs)
    singles = [xs[i] for i in range(rows)]
    mx.eval(singles)
    out = {"rows": rows, "gear": "high"}
    for path in PATHS:
        batch = time_calls([lambda: prep.gemv(xs, 3, path=path)], seconds)
        one = time_calls([lambda: [prep.gemv(s, 3, path=path) for s in singles]], seconds)
        out[path] = {"batched_median_s": batch["median_s"], "separate_median_s": one["median_s"],
                     "speedup": one["median_s"] / batch["median_s"]}
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def accuracy(w: mx.array, planes, x: mx.array, source: str) -> List[Dict[str, Any]]:
    """Relative RMS errors of each gear and path for activations ``x`` ``(..., in)``."""
    prep = nested_cpu.prepare_nested(planes)
    x64 = np.asarray(x.astype(mx.float32)).astype(np.float64).reshape(-1, x.shape[-1])
    exact_w = x64 @ np.asarray(w.astype(mx.float32)).astype(np.float64).T
    out = []
    for n in (1, 2, 3):
        gear = np.zeros_like(exact_w)  # the gear's exact product, from the stored planes
        for p in planes[:n]:
            deq = np.asarray(mx.dequantize(p.weight, p.scales.astype(mx.float32), p.biases.astype(mx.float32),
                                           group_size=p.group_size, bits=p.bits)).astype(np.float64)
            gear += 2.0 ** -p.exponent * (x64 @ deq.T)
        for path in PATHS:
            y = np.asarray(prep.gemv(x, n, path=path)).astype(np.float64).reshape(gear.shape)
            out.append({"activations": source, "gear": GEARS[n], "path": path, "rel_rmse_vs_gear": _rel(y, gear),
                        "rel_rmse_vs_weight": _rel(y, exact_w), "gear_rel_rmse_vs_weight": _rel(gear, exact_w)})
    return out


def model_activations(layer: int, names: Sequence[str], tokens: int = 64):
    """``{name: (weight, inputs (tokens, in))}`` of linear layers of the default
    model (SmolLM2-135M-Instruct, float32) on real English text."""
    import mlx.nn as nn  # noqa: PLC0415
    from mlx_lm import load  # noqa: PLC0415

    from gearbx_mlx.sources import models  # noqa: PLC0415

    model, tokenizer = load(models.resolve_model(None))
    text = models.corpus_path().read_text()[:4000]
    ids = mx.array(tokenizer.encode(text)[:tokens])[None]
    seen: Dict[str, mx.array] = {}

    class Recorder(nn.Module):
        def __init__(self, name: str, inner: nn.Module):
            super().__init__()
            self.name, self.inner = name, inner

        def __call__(self, x):
            seen[self.name] = x
            return self.inner(x)

    block = model.model.layers[layer]
    originals = {}
    for name in names:
        parent_name, attr = name.split(".")
        parent = getattr(block, parent_name)
        originals[name] = getattr(parent, attr)
        setattr(parent, attr, Recorder(name, originals[name]))
    mx.eval(model(ids))
    for name in names:
        parent_name, attr = name.split(".")
        setattr(getattr(block, parent_name), attr, originals[name])
    return {name: (originals[name].weight, seen[name][0]) for name in names}


def accuracy_all(args, w: mx.array, planes) -> List[Dict[str, Any]]:
    dtype = getattr(mx, args.scale_dtype)
    rng = np.random.default_rng(2)
    k = w.shape[1]
    gauss = mx.array(rng.standard_normal((16, k)).astype(np.float32))
    out = accuracy(w, planes, gauss, "gaussian")
    out += accuracy(w, planes, mx.stack([make_x(k, seed=s) for s in range(16)]), "gaussian, 1% of inputs x20")
    try:
        for name, (wm, xm) in model_activations(15, ("self_attn.q_proj", "mlp.down_proj")).items():
            wm = wm.astype(dtype)
            out += accuracy(wm, build_planes(wm, PLAN), xm, f"default model layer 15 {name}")
    except Exception:  # noqa: BLE001  (no model in the cache: the random rows stand)
        traceback.print_exc()
    return out


def add_bandwidth_fractions(result: Dict[str, Any]) -> None:
    """Each kernel row's GB/s over the read bandwidth of its thread count (same statistic)."""
    bw = result.get("bandwidth", {})
    for r in result.get("gemv", []):
        if r["path"] not in PATHS:
            continue
        ref = bw.get(f"threads{r['threads']}")
        if not ref:
            continue
        for stat in ("median", "best"):
            r[f"bw_fraction_{stat}"] = r[f"{stat}_gbs"] / ref[f"{stat}_gbs"]
    one = bw.get("threads1")
    for r in result.get("compute", []) if one else []:
        r["bw_fraction_best"] = r["best_gbs"] / one["best_gbs"]


def print_tables(result: Dict[str, Any]) -> None:
    bw = result.get("bandwidth", {})
    if result.get("compute"):
        print(f"\nplane kinds alone, hot in the caches, 1 thread (instruction-bound rate; target {TARGET:.0%} "
              "of the read bandwidth):")
        for r in result["compute"]:
            frac = r.get("bw_fraction_best", float("nan"))
            print(f"  {r['bits']}-bit g{r['group']:<3} {r['path']:<6} {r['gcodes_per_s_best']:6.1f} Gcodes/s "
                  f"{r['best_gbs']:6.1f} GB/s  {frac:5.0%} of read BW" + ("  < target" if frac < TARGET else ""))
    print("\nread bandwidth (8 MiB pieces, cold):")
    for k in ("threads1", "threads2"):
        if k in bw:
            print(f"  {k}: median {bw[k]['median_gbs']:.1f} GB/s, best {bw[k]['best_gbs']:.1f} GB/s")
    o, i = result["shape"]
    print(f"\nnested gears, {o}x{i}, planes (bits, group) {PLAN}, scales {result['scale_dtype']}:")
    print(f"{'gear':<5} {'path':<21} {'thr':>4} {'MB':>6} {'median ms':>10} {'best ms':>8} {'med GB/s':>9} "
          f"{'%BW med':>8} {'%BW best':>9}")
    for r in result.get("gemv", []):
        fm, fb = r.get("bw_fraction_median"), r.get("bw_fraction_best")
        mark = "" if fb is None else ("" if fb >= TARGET else "  < 70%")
        print(f"{r['gear']:<5} {r['path']:<21} {str(r['threads']):>4} {r['bytes'] / 1e6:6.1f} "
              f"{r['median_s'] * 1e3:10.3f} {r['best_s'] * 1e3:8.3f} {r['median_gbs']:9.1f} "
              f"{'' if fm is None else f'{fm:.0%}':>8} {'' if fb is None else f'{fb:.0%}':>9}{mark}")
    v = result.get("verify")
    if v:
        print(f"\nverify of {v['rows']} rows, high gear, one call vs {v['rows']} calls:")
        for path in PATHS:
            print(f"  {path:<6} {v[path]['batched_median_s'] * 1e3:.3f} ms vs {v[path]['separate_median_s'] * 1e3:.3f}"
                  f" ms ({v[path]['speedup']:.2f}x)")
    acc = result.get("accuracy")
    if acc:
        print("\naccuracy (relative RMS error of y):")
        source = None
        for r in acc:
            if r["activations"] != source:
                source = r["activations"]
                print(f"  activations: {source}")
                print(f"  {'gear':<5} {'path':<7} {'vs gear (kernel)':>17} {'vs weight (total)':>18} "
                      f"{'gear alone':>11}")
            print(f"  {r['gear']:<5} {r['path']:<7} {r['rel_rmse_vs_gear']:17.2e} {r['rel_rmse_vs_weight']:18.2e} "
                  f"{r['gear_rel_rmse_vs_weight']:11.2e}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "nested_cpu.json"))
    ap.add_argument("--shape", type=int, nargs=2, default=(4096, 4096), metavar=("OUT", "IN"))
    ap.add_argument("--plan", default=None, help="bits:group per plane (default the package's, 4:64,4:32,6:64)")
    ap.add_argument("--scale-dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--seconds", type=float, default=0.6, help="timing budget per case")
    ap.add_argument("--quick", action="store_true", help="1024x1024, 0.1 s per case (a smoke test)")
    ap.add_argument("--skip-accuracy", action="store_true", help="leave out the accuracy section (the default "
                    "model's activations)")
    args = ap.parse_args(argv)
    if not cpu.available():
        print("gearbx_mlx.bindings.cpu: extension not built; nothing to measure", file=sys.stderr)
        return 2
    mx.set_default_device(mx.cpu)  # the C kernels' benchmark: MLX's parts on the CPU too
    global PLAN
    if args.plan:
        PLAN = tuple(tuple(int(v) for v in spec.split(":")) for spec in args.plan.split(","))
    shape = (1024, 1024) if args.quick else tuple(args.shape)
    seconds = 0.1 if args.quick else args.seconds
    cold = 2 * llc_bytes()
    command = " ".join(["python", "scripts/bench_nested_kernels.py"] + list(sys.argv[1:] if argv is None else argv))
    result: Dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command, "shape": list(shape),
                              "scale_dtype": args.scale_dtype, "plan": [list(p) for p in PLAN],
                              "cold_set_bytes": cold, "machine": machine_info(), "gemv": []}
    print(f"machine: {result['machine'].get('cpu_model', '?')}, {os.cpu_count()} CPUs; nested kernels: "
          f"{cpu.info()}; cold set {cold >> 20} MiB", flush=True)
    w = make_weight(shape, getattr(mx, args.scale_dtype))
    planes = build_planes(w, PLAN)
    x = make_x(shape[1])
    mx.eval(x)

    def section(key: str, run) -> None:
        try:
            result[key] = run()
        except Exception:  # noqa: BLE001  (record and go on)
            result[f"{key}_error"] = traceback.format_exc()
            print(result[f"{key}_error"], file=sys.stderr)

    section("bandwidth", lambda: bench_bandwidth(max(cold, 256 << 20), seconds))
    section("gemv", lambda: bench_gemv(planes, x, cold, seconds))
    section("verify", lambda: bench_verify(planes, shape[1], seconds))
    section("compute", lambda: bench_compute(shape[1], getattr(mx, args.scale_dtype), seconds))
    if not args.skip_accuracy:
        section("accuracy", lambda: accuracy_all(args, w, planes))
    try:
        result["machine"]["loadavg_at_end"] = os.getloadavg()
    except OSError:
        pass
    add_bandwidth_fractions(result)
    print_tables(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
