#!/usr/bin/env python3
"""Benchmark the fused nested-plane GEMV on the default (GPU) device; print tables, write JSON.

The targets it measures (same run, same device): decode tok/s of the fused
nested low gear >= MLX 4-bit's, mid >= MLX 8-bit's, high >= 0.9x bf16's.

Sections (each recorded even if another fails):

1. ``bandwidth``: copy and read bandwidth of the device (as bench_kernels.py).
2. ``sweep``: rows per SIMD group x chunk width of the nested body, per gear
   (1, 2, 3 planes), at 4096x4096 and 14336x4096; the best (geometric mean)
   is used for the rest of the run (``--skip-sweep`` keeps the defaults).
   ``host``: host time per call while a graph is built (no evaluation): the
   nested product as a decode step calls it (the package's ``NestedLinear``
   view, and its bound launcher alone), MLX's ``quantized_matmul`` 4/8-bit
   and the bf16 product: on a fast GPU a decode step is bound by this.
3. ``gemv``: time per product, many products (over weight copies far larger
   than the L2 cache) in one evaluated graph, at 4096^2 and 8192^2 (and
   14336x4096 unless ``--quick``): the fused nested gears; the same gears the
   stock way (one ``mx.quantized_matmul`` per plane, ``reference_matmul``);
   MLX 4-bit and 8-bit ``quantized_matmul`` (group 64) and the bf16 product.
   GB/s of bytes read; each fused kernel checked against the reference first.
4. ``decode``: greedy decoding tok/s of an mlx-lm llama with random weights
   (Llama-3-8B shape; ``--models``), every Linear replaced: bf16 (none), MLX
   ``QuantizedLinear`` 4/8-bit, the package's ``NestedLinear`` views of nested
   planes (``--plan``, default the package's ``DEFAULT_PLAN``) through the
   fused kernel (``nested-low/mid/high``) and, for comparison, the same
   planes through ``reference_matmul`` (``nested-*-mlx``). A suffix
   ``-fused`` runs the low gear through the fused kernel instead of MLX's
   ``quantized_matmul`` on plane 0, ``-nocompile`` the one-token launches
   without ``mx.compile`` (:class:`~gearbx_mlx.nested.matmul.NestedKernelConfig`);
   ``-mlpc`` (any variant) compiles each block's MLP into one call, ``-grp`` reads
   each fused group (q/k/v, gate/up) in one launch (``gearbx_mlx.nested.fused``),
   ``-i8`` / ``-f32x`` (nested) the mid gear with x rounded to int8 or not,
   ``-b6`` (nested) the 6-bit plane's codes read biased (``NestedTuning.biased6``),
   ``-blockc`` (any variant) runs each block's one-token step as two compiled
   calls around the attention (``gearbx_mlx.blockstep``).
   ``--rounds`` passes over the variants, interleaved; medians, spreads and the
   host time to build one step's graph (``host_us_per_step``) reported.

Usage:
  python scripts/bench_nested_gpu.py [--out FILE] [--quick] [--skip-sweep] [--skip-gemv] [--skip-decode]
      [--models llama3-8b smollm2-135m] [--variants bf16 mlx-4 nested-low ...] [--rounds 3]
      [--plan 4:64,4:32,6:64] [--shapes 4096x4096 8192x8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import (  # noqa: E402
    MODEL_SHAPES,
    bench_bandwidth,
    build_model,
    device_name,
    greedy_decode,
    time_graph,
)

from gearbx_mlx.bindings import gpu, nested_gpu  # noqa: E402
from gearbx_mlx.blockstep import compile_block_steps, restore_block_steps  # noqa: E402
from gearbx_mlx.nested.fused import fuse_nested_views  # noqa: E402
from gearbx_mlx.nested.layers import NestedWeights, make_view  # noqa: E402
from gearbx_mlx.nested.matmul import DEFAULT_CONFIG, NestedKernelConfig  # noqa: E402
from gearbx_mlx.nested.planes import DEFAULT_PLAN, build_planes, reference_matmul  # noqa: E402

#: (bits, group size) per plane: the package's default (--plan replaces it).
PLAN = tuple(DEFAULT_PLAN)
GROUP = 64  # MLX's 4-bit and 8-bit baselines
GEARS = {"low": 1, "mid": 2, "high": 3}
ACT_DTYPE = mx.bfloat16
WORKING_SET = 512 << 20
MIN_PRODUCTS = 48
CHECK_TOL = 2e-2


@functools.lru_cache(maxsize=4)
def planes_of(out_features: int, in_features: int, seed: int = 0):
    """A random weight and its planes (cached: the sweep times one shape many times)."""
    mx.random.seed(seed)
    w = (mx.random.normal((out_features, in_features)) * 0.02).astype(ACT_DTYPE)
    planes = build_planes(w, PLAN)
    return w, planes


def plane_bytes(planes, n: int) -> int:
    return sum(p.weight.nbytes + p.scales.nbytes + p.biases.nbytes for p in planes[:n])


def copies_for(make: Callable[[int], tuple], per_copy: int) -> List[tuple]:
    out = [make(k) for k in range(max(1, math.ceil(WORKING_SET / per_copy)))]
    mx.eval([a for c in out for a in c if isinstance(a, mx.array)])
    return out


def _check(y: mx.array, ref: mx.array, what: str) -> float:
    err = (mx.max(mx.abs(y.astype(mx.float32) - ref.astype(mx.float32)))
           / mx.maximum(mx.max(mx.abs(ref.astype(mx.float32))), 1e-30)).item()
    if not err < CHECK_TOL:
        raise RuntimeError(f"{what}: kernel disagrees with the reference (max rel err {err:.3g}); not timed")
    return err


def time_nested(shape: Tuple[int, int], n: int, fused: bool, tuning=None, shared=None) -> Dict[str, float]:
    """Per-product time of the gear of ``n`` planes, fused kernel or ``reference_matmul``
    (``tuning`` and ``shared`` as :func:`gearbx_mlx.bindings.nested_gpu.launch_spec` takes them)."""
    out_features, in_features = shape
    _, first = planes_of(out_features, in_features)
    per_copy = plane_bytes(first, n)
    copies = [first] + [[type(p)(p.weight + 0, p.scales + 0, p.biases + 0, p.bits, p.group_size, p.exponent)
                         for p in first] for _ in range(max(1, math.ceil(WORKING_SET / per_copy)) - 1)]
    mx.eval([a for c in copies for p in c for a in p.arrays()])
    x = mx.random.normal((in_features,)).astype(ACT_DTYPE)
    if fused:
        bits, groups = tuple(b for b, _ in PLAN[:n]), tuple(g for _, g in PLAN[:n])
        run = nested_gpu.launcher(gpu.gpu_backend(), bits, groups, in_features, out_features, ACT_DTYPE,
                                  ACT_DTYPE, False, tuning=tuning, shared=shared)
        arrays = [nested_gpu.plane_arrays(c, n) for c in copies]
        factors = nested_gpu.factors_of(first, n)
        row = {"max_rel_err": _check(run(x, arrays[0], factors), reference_matmul(x[None], first, n)[0],
                                     f"nested {PLAN[:n]} {shape}")}

        def product(i: int) -> mx.array:
            return run(x, arrays[i % len(arrays)], factors)
    else:
        row = {}

        def product(i: int) -> mx.array:
            return reference_matmul(x[None], copies[i % len(copies)], n)
    k = max(MIN_PRODUCTS, 2 * len(copies))
    t = time_graph(lambda: [product(i) for i in range(k)])
    row.update(us=t / k * 1e6, bytes=per_copy, GBps=per_copy / (t / k) / 1e9, copies=len(copies))
    copies.clear()
    mx.clear_cache()
    return row


def time_mlx(shape: Tuple[int, int], fmt: str) -> Dict[str, float]:
    """MLX's 4/8-bit quantized_matmul (group 64) or the bf16 product."""
    out_features, in_features = shape
    x = mx.random.normal((in_features,)).astype(ACT_DTYPE)

    def make(_):
        w = (mx.random.normal((out_features, in_features)) * 0.02).astype(ACT_DTYPE)
        if fmt == "bf16":
            return (w,)
        return mx.quantize(w, GROUP, int(fmt[4]))

    one = make(0)
    per_copy = sum(a.nbytes for a in one)
    copies = [one] + copies_for(make, per_copy)[1:]
    bits = 16 if fmt == "bf16" else int(fmt[4])

    def product(i: int) -> mx.array:
        c = copies[i % len(copies)]
        if bits == 16:
            return x[None] @ c[0].T
        return mx.quantized_matmul(x[None], *c, transpose=True, group_size=GROUP, bits=bits)
    k = max(MIN_PRODUCTS, 2 * len(copies))
    t = time_graph(lambda: [product(i) for i in range(k)])
    copies.clear()
    mx.clear_cache()
    return {"us": t / k * 1e6, "bytes": per_copy, "GBps": per_copy / (t / k) / 1e9}


# -- sections ----------------------------------------------------------------------------


def bench_sweep(quick: bool, gears=tuple(GEARS), shapes=None) -> Dict[str, object]:
    small = None if quick or shapes else (1024, 4096)  # Llama-3-8B's k/v projections: timed, not scored
    shapes = shapes or ([(1024, 1024)] if quick else [(4096, 4096), (14336, 4096)])
    # (rows, vec, ksplit): one SIMD group per row block, or all eight sharing it
    grid = [(1, 4, 1), (2, 4, 1), (4, 4, 1), (8, 4, 1), (2, 2, 1), (4, 2, 1), (8, 2, 1), (4, 1, 1), (8, 1, 1),
            (4, 2, 8), (2, 4, 8)]
    result: Dict[str, object] = {"shapes": shapes, "runs": [], "best": {}}
    for gear, n in GEARS.items():
        if gear not in gears:
            continue
        scores = {}
        six = any(b == 6 for b, _ in PLAN[:n])  # a 6-bit plane needs an even vec
        for t in [nested_gpu.NestedTuning(r, v, k) for r, v, k in grid if not (six and v % 2)]:
            try:
                us = [time_nested(s, n, True, t)["us"] for s in shapes]
                us_small = time_nested(small, n, True, t)["us"] if small else None
            except Exception as e:  # a tuning that does not compile or fit: record it
                result["runs"].append({"gear": gear, "rows": t.rows, "vec": t.vec, "ksplit": t.ksplit,
                                       "error": str(e)[:300]})
                continue
            result["runs"].append({"gear": gear, "rows": t.rows, "vec": t.vec, "ksplit": t.ksplit, "us": us,
                                   "us_1024x4096": us_small})
            scores[t] = math.exp(sum(math.log(u) for u in us) / len(us))
            print(f"  sweep {gear:4s} rows={t.rows} vec={t.vec} ksplit={t.ksplit}: " + ", ".join(f"{u:.1f}" for u in us) + " us"
                  + (f" (1024x4096: {us_small:.1f})" if us_small else ""), flush=True)
        if scores:
            best = min(scores, key=scores.get)
            nested_gpu.TUNING[n] = best
            result["best"][gear] = {"rows": best.rows, "vec": best.vec, "ksplit": best.ksplit}
    return result


def _host_us(make: Callable[[], mx.array], calls: int = 2000) -> float:
    """Host microseconds per call of ``make`` while building a graph (nothing evaluated)."""
    for _ in range(50):
        make()  # warm up: compile, bind, cache
    outs = []
    t0 = time.perf_counter()
    for _ in range(calls):
        outs.append(make())
    t = time.perf_counter() - t0
    mx.eval(outs[-1])
    return t / calls * 1e6


def bench_host(shape=(4096, 4096)) -> Dict[str, float]:
    """Host time per call of each product a decode step makes, one token."""
    out_features, in_features = shape
    w, planes = planes_of(out_features, in_features)
    x = mx.random.normal((1, 1, in_features)).astype(ACT_DTYPE)
    mx.eval(x)
    result: Dict[str, float] = {}
    for variant in ("", "-fused", "-nocompile", "-fused-nocompile"):
        weights = NestedWeights(planes)
        weights.use_kernel_config(variant_config(variant))
        for gear, n in GEARS.items():
            if "fused" in variant and n > 1:
                continue  # the low gear's choice only
            view = make_view(weights, n, False)
            result[f"nested-{gear}{variant} view"] = _host_us(lambda: view(x))
            y, ref = view(x).astype(mx.float32), reference_matmul(x, planes, n).astype(mx.float32)
            err = (mx.abs(y - ref).max() / mx.abs(ref).max()).item()  # the warm (bound, compiled) call
            result[f"nested-{gear}{variant} rel_err"] = err
            if not err < CHECK_TOL:
                print(f"  WRONG nested-{gear}{variant}: relative error {err:.3g}", flush=True)
    for gear, n in GEARS.items():
        run = nested_gpu.launcher(gpu.gpu_backend(), tuple(b for b, _ in PLAN[:n]), tuple(g for _, g in PLAN[:n]),
                                  in_features, out_features, ACT_DTYPE, ACT_DTYPE, False).bound(
            nested_gpu.plane_arrays(planes, n), nested_gpu.factors_of(planes, n))
        result[f"nested-{gear} launcher"] = _host_us(lambda: run(x, x.shape, None))
    for bits in (4, 8):
        layer = nn.QuantizedLinear.from_linear(nn.Linear(in_features, out_features, bias=False), GROUP, bits)
        mx.eval(layer.parameters())
        result[f"mlx-{bits} QuantizedLinear"] = _host_us(lambda: layer(x))
    lin = nn.Linear(in_features, out_features, bias=False)
    lin.weight = w
    result["bf16 Linear"] = _host_us(lambda: lin(x))
    for k, v in result.items():
        if "rel_err" not in k:
            print(f"  host {k:30s} {v:6.2f} us/call", flush=True)
    return result


def variant_config(suffix: str) -> NestedKernelConfig:
    """The package's kernel config for a decode variant's suffix: ``-fused`` (the low gear
    through the fused kernel, not MLX's quantized_matmul), ``-nocompile`` (no
    ``mx.compile`` around the one-token launch), ``-i8`` (the mid gear's 4 + 4-bit
    planes with x rounded to int8, ``gpu_int8x_plans``), ``-f32x`` (no gear so), or several."""
    # Inside a compiled block a launch is traced once anyway: no compile of its own.
    no_compile = "nocompile" in suffix or "blockc" in suffix
    parts = suffix.split("-")
    int8x = ((4, 4),) if "i8" in parts else () if "f32x" in parts else DEFAULT_CONFIG.gpu_int8x_plans
    return dataclasses.replace(DEFAULT_CONFIG, gpu_low_mlx=DEFAULT_CONFIG.gpu_low_mlx and "fused" not in parts,
                               gpu_compile=DEFAULT_CONFIG.gpu_compile and not no_compile, gpu_int8x_plans=int8x)


def gpu_state() -> Dict[str, object]:
    """The GPU's clocks, power, temperature and throttle reasons now (``nvidia-smi``), and the
    host's load average: what may differ between two runs of the same code."""
    import os
    import subprocess

    fields = "clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active"
    state: Dict[str, object] = {"loadavg": list(os.getloadavg())}
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        if out:
            state.update(zip(fields.split(","), (v.strip() for v in out[0].split(","))))
    except (OSError, subprocess.SubprocessError):
        pass
    return state


def host_us_per_step(model, prompt: mx.array, steps: int = 24) -> Dict[str, float]:
    """Host microseconds of one decode step, unpipelined, over ``steps`` steps after the
    prompt: building its graph (``model(y, cache)``, nothing evaluated; ``median``,
    ``min``, ``max``), then ``mx.async_eval`` of the next token (``encode_median``: the
    host encoding and launching every kernel; it returns before the GPU is done), then
    waiting for the result (``wait_median``: what the GPU had left), and all three
    (``total_median``). A step whose wait is near zero is paced by the host."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    build, encode, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(y[None], cache=cache)
        t1 = time.perf_counter()
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        build.append((t1 - t0) * 1e6)
        encode.append((t2 - t1) * 1e6)
        wait.append((t3 - t2) * 1e6)
    total = [a + b + c for a, b, c in zip(build, encode, wait)]
    return {"median": statistics.median(build), "min": min(build), "max": max(build),
            "encode_median": statistics.median(encode), "wait_median": statistics.median(wait),
            "total_median": statistics.median(total), "nodes": node_census(model(y[None], cache=cache))}


def node_census(out: mx.array) -> Dict[str, int]:
    """The nodes of ``out``'s unevaluated graph (one decode step), counted by primitive: the
    host encodes each of them (``mx.export_to_dot``'s labels; every fused element-wise
    ``Compiled...`` node counts as ``Compiled``). ``total``: all of them."""
    import io
    import re

    buf = io.StringIO()
    mx.export_to_dot(buf, out)
    labels = re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue())
    counts: Dict[str, int] = {}
    for label in labels:
        kind = "Compiled" if label.startswith("Compiled") else label
        counts[kind] = counts.get(kind, 0) + 1
    return {"total": len(labels), **dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


GEMV_FORMATS = ["nested-low", "nested-mid", "nested-high", "nested-low-mlx", "nested-mid-mlx", "nested-high-mlx",
                "mlx-4", "mlx-8", "bf16"]


def bench_gemv(shapes, formats=None) -> List[Dict[str, object]]:
    rows = []
    for shape in shapes:
        timed: Dict[str, Dict[str, object]] = {}
        for fmt in formats or GEMV_FORMATS:
            try:
                if fmt.startswith("nested"):
                    n = GEARS[fmt.split("-")[1]]
                    timed[fmt] = time_nested(shape, n, not fmt.endswith("mlx"))
                else:
                    timed[fmt] = time_mlx(shape, {"mlx-4": "mlx_4", "mlx-8": "mlx_8", "bf16": "bf16"}[fmt])
            except Exception as e:  # record and carry on
                timed[fmt] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
        for fmt, r in timed.items():
            entry = {"shape": list(shape), "format": fmt, **r}
            for ref in ("mlx-4", "mlx-8", "bf16"):
                if "us" in r and "us" in timed.get(ref, {}):
                    entry[f"speedup_vs_{ref}"] = timed[ref]["us"] / r["us"]
            rows.append(entry)
    return rows


def print_gemv(rows, copy_gbps: float) -> None:
    print(f"{'shape (OxK)':>13} {'format':>16} {'us':>8} {'GB/s':>7} {'%copy':>6} {'vs mlx4':>8} {'vs mlx8':>8} "
          f"{'vs bf16':>8}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:>13} {r['format']:>16}  ERROR {r['error'][:80]}")
            continue
        print(f"{shape:>13} {r['format']:>16} {r['us']:8.1f} {r['GBps']:7.0f} {100 * r['GBps'] / copy_gbps:5.0f}% "
              + " ".join(f"{r.get(k, float('nan')):8.2f}" for k in ("speedup_vs_mlx-4", "speedup_vs_mlx-8",
                                                                      "speedup_vs_bf16")))


def bench_decode(kind: str, variants: List[str], prompt_len=32, n_tokens=128, rounds=3,
                 progress: Callable[[List[Dict[str, object]]], None] = lambda rows: None) -> List[Dict[str, object]]:
    from mlx.utils import tree_unflatten

    model = build_model(kind)
    linears = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    products: Dict[str, NestedWeights] = {}
    if any(v.startswith("nested") for v in variants):
        t0 = time.perf_counter()
        for path, m in linears:
            products[path] = NestedWeights(build_planes(m.weight, PLAN), m.get("bias"))
            mx.eval(products[path].parameters())
        build_s = time.perf_counter() - t0
        print(f"  built planes of {len(linears)} linears in {build_s:.1f} s", flush=True)
    vocab = MODEL_SHAPES[kind]["vocab_size"]
    prompt = mx.random.randint(0, vocab, (prompt_len,))
    entries = {v: {"model": kind, "variant": v, "rounds_tok_per_s": []} for v in variants}
    reference_tokens = None
    tunings = dict(nested_gpu.TUNING)  # as the run started (--tuning); -b6 variants change them per variant
    mlps: List[Tuple[nn.Module, nn.Module]] = []
    groups: Dict[tuple, tuple] = {}  # the fused groups' stacked planes, shared by every gear and round
    for r in range(rounds):
        for variant in variants:
            entry = entries[variant]
            try:
                if variant.split("-")[0] == "bf16":
                    plan = []
                elif variant.startswith("mlx"):
                    bits = int(variant.split("-")[1])
                    plan = [(p, nn.QuantizedLinear.from_linear(m, GROUP, bits)) for p, m in linears]
                    mx.eval([m.parameters() for _, m in plan])
                else:
                    parts = variant.split("-")
                    n = GEARS[parts[1]]
                    config = variant_config("-".join(parts[2:]))
                    nested_gpu.TUNING.update({k: dataclasses.replace(v, biased6=v.biased6 or "b6" in parts)
                                              for k, v in tunings.items()})
                    nested_gpu.launcher.cache_clear()  # launchers of the default split are cached by shape
                    for p, _ in linears:
                        products[p].use_kernel_config(config)
                    plan = [(p, make_view(products[p], n, False, fused=parts[-1] != "mlx")) for p, _ in linears]
                    if "grp" in parts:
                        plan = list(fuse_nested_views(dict(plan), groups).items())
                        for _, group in groups.values():
                            if group is not None:
                                group.weights.use_kernel_config(config)
                        entry["fused_groups"] = sum(g is not None for _, g in groups.values())
                    entry["low_through_mlx"] = bool(getattr(plan[0][1], "through_mlx", False))
                    entry["compiled"] = config.gpu_compile
                    entry["bits_per_weight"] = 8 * sum(plane_bytes(products[p].planes, n) for p, _ in linears) / sum(
                        m.weight.size for _, m in linears)
                if plan:
                    model.update_modules(tree_unflatten(plan))
                probe = mx.zeros((1, 1, model.args.hidden_size), dtype=ACT_DTYPE)
                if variant.startswith("nested"):
                    entry["path"] = products[linears[0][0]].product.backend_for(probe, GEARS[variant.split("-")[1]])
                greedy_decode(model, prompt[:8], 8)  # warm up: compile kernels, settle first-use checks
                if variant.endswith("-mlpc"):
                    mlps = compile_mlps(model)
                    greedy_decode(model, prompt[:8], 8)
                if "-blockc" in variant:
                    compile_block_steps(model)  # a gear's steps compile from its second one-token call
                    greedy_decode(model, prompt[:8], 8)
                tokens, prefill_s, tps = greedy_decode(model, prompt, n_tokens)
                entry.setdefault("rounds_gpu_state", []).append(gpu_state())  # right after the decode
                entry["rounds_tok_per_s"].append(tps)
                entry.setdefault("rounds_host_us_per_step", []).append(host_us_per_step(model, prompt))
                h = entry["rounds_host_us_per_step"][-1]
                print(f"  repeat {r + 1} {variant:26s} {tps:7.1f} tok/s, host {h['median']:.0f} us/step to build, "
                      f"{h['encode_median']:.0f} to encode, {h['wait_median']:.0f} waiting "
                      f"({h['total_median']:.0f} a step unpipelined)", flush=True)
                entry.update(prefill_s=prefill_s, n_tokens=len(tokens))
                if reference_tokens is None:
                    reference_tokens = tokens
                entry["same_tokens_as_first_variant"] = sum(
                    a == b for a, b in zip(tokens, reference_tokens)) / len(tokens)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            finally:
                for layer, mlp in mlps:
                    layer.mlp = mlp
                mlps = []
                restore_block_steps(model)
                model.update_modules(tree_unflatten(linears))
                plan = None
                mx.clear_cache()
            if r == rounds - 1:
                runs = entry["rounds_tok_per_s"]
                if runs:
                    entry["tok_per_s"] = statistics.median(runs)
                    entry["tok_per_s_spread"] = [min(runs), max(runs)]
                    hosts = entry["rounds_host_us_per_step"]
                    entry["host_us_per_step"] = statistics.median(h["median"] for h in hosts)
                    for part in ("encode", "wait", "total"):
                        entry[f"{part}_us_per_step"] = statistics.median(h[f"{part}_median"] for h in hosts)
                print(f"  decode {kind:13s} {variant:26s} "
                      + (f"{entry['tok_per_s']:7.1f} tok/s median of " + "/".join(f"{t:.0f}" for t in runs)
                         + f", host {entry['host_us_per_step']:.0f} us/step, encode {entry['encode_us_per_step']:.0f}, "
                         f"wait {entry['wait_us_per_step']:.0f}"
                         if "tok_per_s" in entry else entry.get("error", "")), flush=True)
        progress(list(entries.values()))  # each round's tok/s kept, should the run be stopped
    nested_gpu.TUNING.update(tunings)
    nested_gpu.launcher.cache_clear()
    del model, products
    mx.clear_cache()
    return list(entries.values())


class CompiledMLP(nn.Module):
    """A block's MLP as one ``mx.compile``d call (its three products and the gating):
    how much a decode step gains from fewer host calls per block."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.inner = mlp
        self.__dict__["run"] = mx.compile(lambda x: mlp(x))

    def __call__(self, x: mx.array) -> mx.array:
        return self.run(x)


def compile_mlps(model) -> List[Tuple[nn.Module, nn.Module]]:
    """Wrap every block's MLP in :class:`CompiledMLP`; ``[(block, its MLP)]`` to restore."""
    out = []
    for layer in model.layers:
        out.append((layer, layer.mlp))
        layer.mlp = CompiledMLP(layer.mlp)
    return out


def decode_targets(rows: List[Dict[str, object]]) -> List[str]:
    """The targets' lines: each nested gear (as named, and as the package builds it on a GPU,
    ``-grp-blockc``) over its baseline, medians, and the ratio round by round (min-max)."""
    lines = []
    by = {(r["model"], r["variant"]): r for r in rows}
    for model in sorted({r["model"] for r in rows}):
        for gear, ref, factor in (("low", "mlx-4", 1.0), ("mid", "mlx-8", 0.9), ("high", "bf16", 0.9)):
            base = by.get((model, ref), {})
            for variant in (f"nested-{gear}", f"nested-{gear}-grp-blockc", f"nested-{gear}-fused-grp-blockc",
                            f"nested-{gear}-grp-blockc-b6"):
                mine = by.get((model, variant), {})
                a, b = mine.get("tok_per_s"), base.get("tok_per_s")
                if not (a and b):
                    continue
                pairs = [x / y for x, y in zip(mine["rounds_tok_per_s"], base["rounds_tok_per_s"])]
                lo, mid, hi = min(pairs), statistics.median(pairs), max(pairs)
                verdict = ("met in every round" if lo >= factor else "met at the median, not in every round"
                           if mid >= factor else "MISSED")
                lines.append(f"target {model} {variant} >= {factor:g}x {ref}: {a:.1f} vs {b:.1f} tok/s = "
                             f"{a / b:.2f}x; by repeat {mid:.2f}x ({lo:.2f}-{hi:.2f}) [{verdict}]")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/nested_gpu_<device>.json)")
    ap.add_argument("--quick", action="store_true", help="small sizes, smollm2 shape, for a smoke test")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-gemv", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODEL_SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plan", default=None, help="bits:group per plane (default: the package's, 4:64,4:32,6:64)")
    ap.add_argument("--shapes", nargs="+", default=None, help="GEMV shapes OUTxIN (default 4096x4096 8192x8192 "
                    "14336x4096)")
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--sweep-gears", nargs="+", default=list(GEARS), choices=list(GEARS))
    ap.add_argument("--sweep-shapes", nargs="+", default=None, help="sweep shapes OUTxIN (default 4096x4096 "
                    "14336x4096, and 1024x4096 timed)")
    ap.add_argument("--formats", nargs="+", default=None, choices=GEMV_FORMATS, help="GEMV formats (default all)")
    ap.add_argument("--tuning", nargs="+", default=[], metavar="GEAR=ROWS,VEC,KSPLIT,XSUMS,BIASED,STAGE[,BIASED6]",
                    help="replace a gear's default split for the whole run (e.g. mid=2,4,1,0,1,0; "
                         "high=2,4,1,0,1,0,1 reads the 6-bit plane's codes biased too)")
    ap.add_argument("--inline-cuda-text", action="store_true",
                    help="hand MLX the CUDA kernels' whole text, not #include lines of its files (as before)")
    args = ap.parse_args(argv)
    if args.inline_cuda_text:
        from bench_gpu_encode import inline_cuda_text

        inline_cuda_text()
    for item in args.tuning:
        try:
            gear, values = item.split("=")
            rows, vec, ksplit, xsums, biased, stage, *b6 = (int(v) for v in values.split(","))
            if len(b6) > 1:
                raise ValueError(item)
            nested_gpu.TUNING[GEARS[gear]] = nested_gpu.NestedTuning(rows, vec, ksplit, bool(xsums), bool(biased),
                                                                     bool(stage), biased6=bool(b6 and b6[0]))
        except (ValueError, KeyError):
            ap.error(f"--tuning takes GEAR=ROWS,VEC,KSPLIT,XSUMS,BIASED,STAGE[,BIASED6] (gear low, mid or high), "
                     f"got {item!r}")
    global PLAN
    if args.plan:
        try:
            PLAN = tuple(tuple(int(v) for v in s.split(":")) for s in args.plan.split(","))
        except ValueError:
            ap.error(f"--plan takes bits:group per plane, comma-separated (e.g. 4:64,4:32,6:64), got {args.plan!r}")

    if gpu.gpu_backend() is None:
        print("no Metal/CUDA GPU on the default device: nothing to benchmark", file=sys.stderr)
        return 2
    global WORKING_SET, MIN_PRODUCTS
    if args.quick:
        WORKING_SET, MIN_PRODUCTS = 64 << 20, 8
    name = device_name()
    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    out = args.out or ROOT / "benchmarks" / "results" / f"nested_gpu_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: Dict[str, object] = {
        "device": name, "backend": gpu.gpu_backend(), "mlx": mx.__version__, "python": platform.python_version(),
        "activation_dtype": str(ACT_DTYPE), "plan": [list(p) for p in PLAN], "mlx_group_size": GROUP,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", "scripts/bench_nested_gpu.py"]
                                                                       + list(argv or sys.argv[1:])),
        # MLX's settings from the environment (MLX_MAX_OPS_PER_BUFFER: nodes per CUDA graph, ...)
        "mlx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")},
        "cuda_kernel_text": "inline" if args.inline_cuda_text else "files",
    }

    def save():
        out.write_text(json.dumps(report, indent=1, default=str))

    def section(key: str, run: Callable[[], object]) -> None:
        try:
            report[key] = run()
        except Exception as e:
            report[key] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        save()

    print(f"device: {name} ({report['backend']}), mlx {mx.__version__}", flush=True)
    section("bandwidth", lambda: bench_bandwidth(args.quick))
    bw = report["bandwidth"]
    if "copy_GBps" in bw:
        print(f"copy bandwidth {bw['copy_GBps']:.0f} GB/s, read bandwidth {bw['read_GBps']:.0f} GB/s", flush=True)
    def parse_shapes(items):
        return [tuple(int(v) for v in x.lower().split("x")) for x in items] if items else None

    if not args.skip_sweep:
        section("sweep", lambda: bench_sweep(args.quick, tuple(args.sweep_gears), parse_shapes(args.sweep_shapes)))
    report["tuning"] = {n: dataclasses.asdict(t) for n, t in nested_gpu.TUNING.items()}
    if not args.skip_host:
        section("host", lambda: bench_host((1024, 1024) if args.quick else (4096, 4096)))
    if args.shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    else:
        shapes = [(1024, 1024)] if args.quick else [(4096, 4096), (8192, 8192), (14336, 4096)]
    if not args.skip_gemv:
        section("gemv", lambda: bench_gemv(shapes, args.formats))
        if isinstance(report["gemv"], list):
            print_gemv(report["gemv"], bw.get("copy_GBps", float("nan")))
    if not args.skip_decode:
        variants = args.variants or ["bf16", "mlx-4", "mlx-8", "nested-low", "nested-mid", "nested-high",
                                     "nested-high-mlx"]
        kinds = args.models or (["smollm2-135m"] if args.quick else ["llama3-8b"])
        report["decode"] = []
        for kind in kinds:
            try:
                done = list(report["decode"])
                report["decode"] = done + bench_decode(
                    kind, variants, n_tokens=32 if args.quick else 128, rounds=args.rounds,
                    progress=lambda rows: (report.__setitem__("decode", done + rows), save()))
            except Exception as e:
                report["decode"].append({"model": kind, "error": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
            save()
        report["targets"] = decode_targets(report["decode"])
        for line in report["targets"]:
            print(line)
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
