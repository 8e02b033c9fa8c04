#!/usr/bin/env python3
"""Benchmark the C CPU kernels of ``gearbx_mlx.bindings.cpu``; print a table, write JSON.

Sections (each recorded even if another fails):

1. ``machine``: CPU model, flags, cache sizes, what the extension compiled.
2. ``bandwidth``: read bandwidth, 1 and 2 threads, measured like a GEMV: the
   same C thread pool and row split streams 8 MiB pieces of a buffer set far
   larger than the last-level cache (``--cold-mib``, default 1 GiB).
3. ``gemv``: 4096x4096 and 11008x4096, int4/int8 x float/intdot x 1/2
   threads, weights cold (rotating among copies that together exceed the
   cache); numpy float32 ``W @ x`` and MLX CPU (``nn.Linear`` float32 and 4-bit
   ``QuantizedLinear``, i.e. ``mx.quantized_matmul``, group 64) on the same
   shapes, also cold.  Every kernel is checked against its scalar oracle
   before it is timed.
4. ``decode``: end-to-end tokens/s of the default model (``bench_decode``;
   runs only with ``--decode``).

Timing: each call is timed on its own (time.perf_counter_ns); the table shows
the median and the best call. These machines are shared VMs: the best call is
the closest to an idle machine, the median to what a user gets now. Both the
bandwidth and the GEMV rows use the same statistic, so their ratio is fair.

Usage:
  python scripts/bench_cpu.py [--out benchmarks/results/cpu_gemv.json] [--cold-mib 1024]
                              [--quick] [--decode]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from gearbx_mlx.bindings import cpu  # noqa: E402

SHAPES = ((4096, 4096), (11008, 4096))
PIECE = 8 << 20  # bytes per bandwidth-probe call, about one int4 4096x4096 matrix


# -- timing ------------------------------------------------------------------------


def time_calls(calls: Sequence[Callable[[], Any]], min_seconds: float, min_calls: int = 5,
               max_calls: int = 2000) -> Dict[str, float]:
    """Run the callables in rotation, timing each call; seconds per call."""
    times: List[float] = []
    start = time.perf_counter()
    i = 0
    while i < max_calls and (i < min_calls or time.perf_counter() - start < min_seconds):
        f = calls[i % len(calls)]
        t0 = time.perf_counter_ns()
        f()
        times.append((time.perf_counter_ns() - t0) * 1e-9)
        i += 1
    return {"median_s": statistics.median(times), "best_s": min(times), "calls": len(times)}


# -- sections ----------------------------------------------------------------------


def machine_info() -> Dict[str, Any]:
    info: Dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mlx": getattr(mx, "__version__", "?"),
        "cpus_online": os.cpu_count(),
        "mlx_device": str(mx.default_device()),
        "extension": cpu.info(),
    }
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))
                break
    except OSError:
        pass
    caches = {}
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            caches[f"L{level}{'d' if kind == 'Data' else 'i' if kind == 'Instruction' else ''}"] = (
                idx / "size").read_text().strip()
        except OSError:
            pass
    info["caches"] = caches
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def llc_bytes() -> int:
    try:
        s = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


def bench_bandwidth(cold_bytes: int, seconds: float) -> Dict[str, Any]:
    ext = cpu.require()
    buf = np.ones(cold_bytes, dtype=np.uint8)  # written once: pages are real
    ptr = ext.ffi.from_buffer(buf)
    n = cold_bytes // PIECE
    out: Dict[str, Any] = {"piece_bytes": PIECE, "set_bytes": n * PIECE}
    for threads in (1, 2):
        calls = [(lambda k=k: ext.lib.gbx_read_bandwidth(ptr + k * PIECE, PIECE, threads)) for k in range(n)]
        t = time_calls(calls, seconds, min_calls=2 * n)
        out[f"threads{threads}"] = {"median_gbs": PIECE / t["median_s"] / 1e9, "best_gbs": PIECE / t["best_s"] / 1e9,
                                    "calls": t["calls"]}
    return out


def _pack_int4(q: np.ndarray) -> np.ndarray:
    u = (q + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def bench_gemv(shape: tuple, cold_bytes: int, seconds: float, rng: np.random.Generator) -> List[Dict[str, Any]]:
    ext = cpu.require()
    ffi, lib = ext.ffi, ext.lib
    o, i = shape
    x = rng.standard_normal(i).astype(np.float32)
    y = np.empty(o, dtype=np.float32)
    px, py = ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y)
    rows: List[Dict[str, Any]] = []
    w_f32 = (rng.standard_normal((o, i)) * 0.02).astype(np.float32)
    for bits in (4, 8):
        qmax = 7 if bits == 4 else 127
        s = (np.abs(w_f32).max(axis=1, keepdims=True) / qmax).astype(np.float32)
        q = np.clip(np.rint(w_f32 / s), -qmax, qmax).astype(np.int8)
        one = _pack_int4(q) if bits == 4 else q
        copies = max(2, math.ceil(cold_bytes / one.nbytes))
        stack = np.empty((copies,) + one.shape, dtype=one.dtype)
        stack[:] = one
        ps = ffi.from_buffer("float[]", s)
        ptrs = [ffi.from_buffer(stack[k]) for k in range(copies)]
        for path, code in (("float", lib.GBX_PATH_FLOAT), ("intdot", lib.GBX_PATH_INTDOT)):
            # check against the oracle before timing
            ref_code = lib.GBX_PATH_REF if path == "float" else lib.GBX_PATH_INTDOT_REF
            y_ref = np.empty_like(y)
            assert lib.gbx_gemv(ptrs[0], ps, px, ffi.from_buffer("float[]", y_ref), o, i, bits, 0, ref_code, 1) == 0
            assert lib.gbx_gemv(ptrs[0], ps, px, py, o, i, bits, 0, code, 1) == 0
            err = float(np.max(np.abs(y - y_ref)) / (np.max(np.abs(y_ref)) + 1e-30))
            if err > 1e-4:
                raise AssertionError(f"{path} int{bits} {shape}: max rel. error {err:.2e} vs oracle")
            for threads in (1, 2):
                calls = [(lambda p=p: lib.gbx_gemv(p, ps, px, py, o, i, bits, 0, code, threads)) for p in ptrs]
                t = time_calls(calls, seconds, min_calls=copies)
                nbytes = one.nbytes + s.nbytes
                rows.append({"shape": [o, i], "impl": f"gearbx int{bits} {path}", "bits": bits, "path": path,
                             "threads": threads, "bytes": nbytes, "copies": copies, **t,
                             "median_gbs": nbytes / t["median_s"] / 1e9, "best_gbs": nbytes / t["best_s"] / 1e9,
                             "max_rel_err_vs_oracle": err})
        del stack, ptrs

    # numpy float32 (OpenBLAS with its default threads, and with one thread)
    copies = max(2, math.ceil(cold_bytes / w_f32.nbytes))
    ws = [w_f32.copy() for _ in range(copies)]
    t = time_calls([(lambda w=w: w @ x) for w in ws], seconds, min_calls=copies)
    rows.append({"shape": [o, i], "impl": "numpy fp32", "threads": "blas", "bytes": w_f32.nbytes, "copies": copies,
                 **t, "median_gbs": w_f32.nbytes / t["median_s"] / 1e9, "best_gbs": w_f32.nbytes / t["best_s"] / 1e9})
    del ws
    t = numpy_one_thread(shape, cold_bytes, seconds)
    rows.append({"shape": [o, i], "impl": "numpy fp32", "threads": 1, "bytes": w_f32.nbytes, "copies": copies,
                 **t, "median_gbs": w_f32.nbytes / t["median_s"] / 1e9, "best_gbs": w_f32.nbytes / t["best_s"] / 1e9})

    # MLX CPU: nn.Linear fp32 is x @ W.T; QuantizedLinear is mx.quantized_matmul
    xm = mx.array(x)[None]
    wm = [mx.array(w_f32) for _ in range(max(2, math.ceil(cold_bytes / w_f32.nbytes)))]
    mx.eval(wm)
    t = time_calls([(lambda w=w: mx.eval(xm @ w.T)) for w in wm], seconds, min_calls=len(wm), max_calls=60)
    rows.append({"shape": [o, i], "impl": "mlx nn.Linear fp32", "threads": 1, "bytes": w_f32.nbytes,
                 "copies": len(wm), **t, "median_gbs": w_f32.nbytes / t["median_s"] / 1e9,
                 "best_gbs": w_f32.nbytes / t["best_s"] / 1e9})
    wq, sc, bi = mx.quantize(wm[0], group_size=64, bits=4)
    del wm
    qbytes = wq.nbytes + sc.nbytes + bi.nbytes
    trip = [(wq + 0, sc + 0, bi + 0) for _ in range(max(2, math.ceil(cold_bytes / qbytes)))]
    mx.eval(trip)
    t = time_calls([(lambda a=a: mx.eval(mx.quantized_matmul(xm, *a, transpose=True, group_size=64, bits=4)))
                    for a in trip], seconds, min_calls=5, max_calls=60)
    rows.append({"shape": [o, i], "impl": "mlx QuantizedLinear 4-bit g64", "threads": 1, "bytes": qbytes,
                 "copies": len(trip), **t, "median_gbs": qbytes / t["median_s"] / 1e9,
                 "best_gbs": qbytes / t["best_s"] / 1e9})
    return rows


def numpy_one_thread(shape: tuple, cold_bytes: int, seconds: float) -> Dict[str, float]:
    """numpy float32 W @ x with OpenBLAS held to one thread (set before numpy loads: a subprocess)."""
    code = (
        "import json, math, sys; sys.path.insert(0, %r); import numpy as np; import bench_cpu as b; "
        "o, i = %d, %d; w = np.random.default_rng(0).standard_normal((o, i)).astype(np.float32); "
        "x = np.ones(i, np.float32); ws = [w.copy() for _ in range(max(2, math.ceil(%d / w.nbytes)))]; "
        "print(json.dumps(b.time_calls([(lambda w=w: w @ x) for w in ws], %r, min_calls=len(ws))))"
    ) % (str(Path(__file__).parent), shape[0], shape[1], cold_bytes, seconds)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- end-to-end decode ----------------------------------------------------------------
# Kept apart from the GEMV sections: it depends on the generation side of the
# package (PrecisionManager, PackedLinear), not only on the kernels.

DECODE_PROMPT = "The history of the printing press begins in the fifteenth century, when"


def _decode_tps(model: Any, prompt: mx.array, tokens: int) -> Dict[str, float]:
    """Greedy decode tok/s after prefill (mlx-lm's loop, its default argmax sampler)."""
    from mlx_lm.generate import generate_step  # noqa: PLC0415

    t0: Optional[float] = None
    n = 0
    for _tok, _ in generate_step(prompt, model, max_tokens=tokens + 1):
        if t0 is None:
            t0 = time.perf_counter()  # the first token ends the prefill
        else:
            n += 1
    dt = time.perf_counter() - (t0 or time.perf_counter())
    return {"tokens": n, "seconds": dt, "tok_s": n / dt if dt > 0 else float("nan")}


def bench_decode(args: argparse.Namespace) -> Dict[str, Any]:
    """End-to-end decode tok/s of the default model, scope ``all``, static gears.

    high: the MLX float32 model; low/mid: every Linear (and the tied
    embedding) swapped by ``PrecisionManager`` to MLX ``QuantizedLinear``
    (kernel "mlx") or to ``PackedLinear`` on the C kernels (kernel "packed"),
    group size 64 (the config default). Same prompt, same run.
    """
    from mlx_lm import load  # noqa: PLC0415

    from gearbx_mlx.config import GearboxConfig  # noqa: PLC0415
    from gearbx_mlx.precision import PrecisionManager  # noqa: PLC0415
    from gearbx_mlx.sources import models  # noqa: PLC0415

    path = models.default_model_path()
    model, tokenizer = load(str(path))
    prompt = mx.array(tokenizer.encode(DECODE_PROMPT))
    tokens = args.decode_tokens
    out: Dict[str, Any] = {"model": str(path), "prompt_tokens": int(prompt.size), "tokens": tokens, "runs": []}
    _decode_tps(model, prompt, 4)  # warm-up
    out["runs"].append({"gear": "high", "kernel": "mlx fp32", **_decode_tps(model, prompt, tokens)})
    for kernel in ("mlx", "packed"):
        pm = PrecisionManager(model, GearboxConfig(scope="all", kernel=kernel))
        for gear in ("low", "mid"):
            pm.shift(gear)
            _decode_tps(model, prompt, 2)
            out["runs"].append({"gear": gear, "kernel": kernel, "bits": pm.config.bits[gear],
                                "group_size": pm.config.group_size, "managed": len(pm.paths),
                                **_decode_tps(model, prompt, tokens)})
        pm.shift("high")
    base = out["runs"][0]["tok_s"]
    for r in out["runs"]:
        r["vs_high"] = r["tok_s"] / base
    return out


# -- report ------------------------------------------------------------------------


def print_table(result: Dict[str, Any]) -> None:
    bw = result.get("bandwidth", {})
    print("\nread bandwidth (8 MiB pieces, cold):")
    for k in ("threads1", "threads2"):
        if k in bw:
            print(f"  {k}: median {bw[k]['median_gbs']:.1f} GB/s, best {bw[k]['best_gbs']:.1f} GB/s")
    print(f"\n{'shape':>11} {'impl':<32} {'thr':>4} {'median ms':>10} {'best ms':>9} {'med GB/s':>9} "
          f"{'best GB/s':>9} {'vs np':>6}")
    print("  (vs np: median time of the faster numpy fp32 row / this row's median)")
    np_ms: Dict[tuple, float] = {}  # the faster numpy (default threads or one)
    for r in result.get("gemv", []):
        if r["impl"] == "numpy fp32":
            np_ms[tuple(r["shape"])] = min(np_ms.get(tuple(r["shape"]), math.inf), r["median_s"])
    for r in result.get("gemv", []):
        speed = np_ms.get(tuple(r["shape"]), float("nan")) / r["median_s"]
        print(f"{r['shape'][0]:>5}x{r['shape'][1]:<5} {r['impl']:<32} {str(r['threads']):>4} "
              f"{r['median_s'] * 1e3:>10.3f} {r['best_s'] * 1e3:>9.3f} {r['median_gbs']:>9.1f} "
              f"{r['best_gbs']:>9.1f} {speed:>5.1f}x")
    for line in result.get("targets", {}).get("lines", []):
        print(line)
    dec = result.get("decode")
    if dec:
        print(f"\ndecode, {Path(dec['model']).name}, {dec['tokens']} tokens, greedy:")
        for r in dec["runs"]:
            print(f"  {r['gear']:<5} {r['kernel']:<9} {r['tok_s']:7.1f} tok/s  ({r['vs_high']:.2f}x high)")


def targets(result: Dict[str, Any]) -> Dict[str, Any]:
    """The GEMV targets: int4 intdot 4096^2 1 thread >= 70% of read BW, >= 5x numpy."""
    out: Dict[str, Any] = {"lines": []}
    bw = result.get("bandwidth", {}).get("threads1")
    rows = {(tuple(r["shape"]), r["impl"], r["threads"]): r for r in result.get("gemv", [])}
    k = rows.get(((4096, 4096), "gearbx int4 intdot", 1))
    numpys = [r for key, r in rows.items() if key[:2] == ((4096, 4096), "numpy fp32")]
    n = {f"{st}_s": min(r[f"{st}_s"] for r in numpys) for st in ("median", "best")} if numpys else None
    if bw and k:
        for stat in ("median", "best"):
            frac = k[f"{stat}_gbs"] / bw[f"{stat}_gbs"]
            out[f"bw_fraction_{stat}"] = frac
            out["lines"].append(f"target int4 intdot 4096x4096 1 thread: {frac:.0%} of read BW ({stat}) "
                                f"[{'met' if frac >= 0.7 else 'MISSED'}: >= 70%]")
    if n and k:
        for stat in ("median", "best"):
            sp = n[f"{stat}_s"] / k[f"{stat}_s"]
            out[f"speedup_vs_numpy_{stat}"] = sp
            out["lines"].append(f"target int4 intdot vs faster numpy fp32: {sp:.1f}x ({stat}) "
                                f"[{'met' if sp >= 5 else 'MISSED'}: >= 5x]")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_gemv.json"))
    ap.add_argument("--cold-mib", type=int, default=None,
                    help="bytes of rotating weight copies per case (default: max(1 GiB, 2x LLC))")
    ap.add_argument("--seconds", type=float, default=0.6, help="timing budget per case")
    ap.add_argument("--quick", action="store_true", help="4096x4096 only, 0.3 s per case")
    ap.add_argument("--decode", action="store_true", help="also run bench_decode")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--skip-gemv", action="store_true", help="only the decode section (with --decode)")
    args = ap.parse_args(argv)
    if not cpu.available():
        print("gearbx_mlx.bindings.cpu: extension not built; nothing to measure", file=sys.stderr)
        return 2
    cold = (args.cold_mib << 20) if args.cold_mib else max(1 << 30, 2 * llc_bytes())
    seconds = 0.3 if args.quick else args.seconds
    result: Dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cold_set_bytes": cold,
                              "machine": machine_info(), "gemv": []}
    print(f"machine: {result['machine'].get('cpu_model', '?')}, LLC {result['machine']['caches'].get('L3', '?')}, "
          f"{os.cpu_count()} CPUs; kernels: {cpu.info()['intdot_isa']}; cold set {cold >> 20} MiB")
    try:
        if not args.skip_gemv:
            result["bandwidth"] = bench_bandwidth(cold, seconds)
    except Exception:  # noqa: BLE001  (record and go on)
        result["bandwidth_error"] = traceback.format_exc()
    rng = np.random.default_rng(0)
    for shape in () if args.skip_gemv else SHAPES[:1] if args.quick else SHAPES:
        try:
            result["gemv"] += bench_gemv(shape, cold, seconds, rng)
        except Exception:  # noqa: BLE001
            result.setdefault("gemv_errors", []).append(traceback.format_exc())
    if args.decode:
        try:
            result["decode"] = bench_decode(args)
        except Exception:  # noqa: BLE001
            result["decode_error"] = traceback.format_exc()
    try:
        result["machine"]["loadavg_at_end"] = os.getloadavg()
    except OSError:
        pass
    result["targets"] = targets(result)
    print_table(result)
    for k in ("bandwidth_error", "gemv_errors", "decode_error"):
        if k in result:
            print(f"{k}:\n{result[k]}", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
