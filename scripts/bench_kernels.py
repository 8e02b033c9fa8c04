#!/usr/bin/env python3
"""Benchmark the packed GEMV kernels on the default (GPU) device; print a table, write JSON.

Sections (each recorded even if another fails):

1. ``bandwidth``: the device's copy bandwidth (``a + 1`` over 1 GiB: bytes read
   plus written, per second) and read bandwidth (``sum`` over 1 GiB).
2. ``sweep``: rows per SIMD group x words in flight per lane of the SIMT
   body, for int4 and int8, at a device-variant shape and a shared-variant
   shape; the best (by geometric mean) is used for the rest of the run and
   reported (``--skip-sweep`` keeps the defaults). ``mma_sweep``: iterations
   in flight of the matrix-unit int4 body, per row and at group 64.
   ``dispatch``: host cost per layer call in a chain of tiny layers.
3. ``gemv``: for each shape (O x K), each format's time per product with many
   products (over distinct weight copies, together far larger than the L2
   cache) inside one evaluated graph; GB/s of bytes read (weights + scales),
   the fraction of copy bandwidth, and speed relative to MLX's
   ``quantized_matmul`` (4 and 8 bits, group 64) and to the fp16 product.
   Every kernel is checked against the reference before it is timed. The
   ``null`` format is a launch that reads no weights: the harness's floor.
4. ``decode``: greedy decoding tok/s of mlx-lm llama models with random
   weights (Llama-3-8B shape and SmolLM2-135M shape), bf16 vs MLX
   ``QuantizedLinear`` 4/8-bit vs ``PackedLinear`` 4/8-bit on every Linear
   (and the tied embedding of the small model), ``-fused`` with q/k/v and
   gate/up in one launch each, and ``null``/``null-fused``: every Linear a
   launch that does no work, the ceiling of any kernel at that launch count.
   ``--rounds`` passes over the variants, interleaved; medians reported.

Usage:
  python scripts/bench_kernels.py [--out FILE] [--quick] [--skip-decode] [--skip-sweep]
      [--models llama3-8b smollm2-135m] [--variants bf16 mlx-4 packed-4-fused ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gearbx_mlx.bindings import gpu, packed_gpu  # noqa: E402
from gearbx_mlx.packed import formats  # noqa: E402
from gearbx_mlx.packed.fused import fuse_plan  # noqa: E402
from gearbx_mlx.packed.layers import PackedEmbedding, PackedLinear  # noqa: E402

SHAPES: List[Tuple[int, int]] = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)]
#: Weight copies per format are chosen so that together they exceed this many
#: bytes: far beyond any L2 cache, so every product streams from DRAM.
WORKING_SET = 512 << 20
#: Products per evaluated graph (at least; at least two passes over the copies).
MIN_PRODUCTS = 48
REPEATS = 7
ACT_DTYPE = mx.float16  # the GEMV table's activations (the fp16 product's dtype)
#: Max |kernel - reference| / max|reference| accepted before timing.
CHECK_TOL = 2e-2


# -- helpers ----------------------------------------------------------------------------


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info = mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or info)
    except Exception:
        return f"{mx.default_device()} on {platform.machine()}"


def time_graph(build: Callable[[], List[mx.array]], repeats: int = REPEATS) -> float:
    """Median seconds to evaluate the graph ``build()`` returns (built outside the timer)."""
    mx.eval(build())  # warm up: compile kernels, allocate
    times = []
    for _ in range(repeats):
        outs = build()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def nbytes(*arrays: Optional[mx.array]) -> int:
    return sum(a.nbytes for a in arrays if a is not None)


# -- 1. bandwidth --------------------------------------------------------------------------


def bench_bandwidth(quick: bool) -> Dict[str, float]:
    n = (256 << 20) // (4 if quick else 1)  # float32 elements: 1 GiB (256 MiB quick)
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)
    steps = 10

    def copy_chain():
        b = a
        for _ in range(steps):
            b = b + 1.0
        return [b]

    t_copy = time_graph(copy_chain)
    t_read = time_graph(lambda: [mx.sum(a) for _ in range(steps)])
    copy = 2 * a.nbytes * steps / t_copy / 1e9
    read = a.nbytes * steps / t_read / 1e9
    a = None  # frees the buffer (a del would leave the closures above a dangling name)
    mx.clear_cache()
    return {"copy_GBps": copy, "read_GBps": read, "bytes": n * 4}


# -- weights of each format ----------------------------------------------------------------


def packed_format(fmt: str) -> Tuple[int, Optional[int], Optional[bool]]:
    """``packed_<bits>_<row|gN>[_simt|_mma]`` -> (bits, group size, mma: None = dispatch)."""
    parts = fmt.split("_")
    bits = int(parts[1])
    gs = None if parts[2] == "row" else int(parts[2][1:])
    mma = {"simt": False, "mma": True}.get(parts[3]) if len(parts) > 3 else None
    return bits, gs, mma


def random_weights(fmt: str, out_features: int, in_features: int) -> Tuple[tuple, int]:
    """One copy of random weights in ``fmt`` and the bytes a product reads."""
    if fmt.startswith("packed"):
        bits, gs, _ = packed_format(fmt)
        shape = formats.packed_shape(out_features, in_features, bits)
        if bits == 4:
            w = mx.random.randint(0, 256, shape).astype(mx.uint8)
        else:
            w = mx.random.randint(-127, 128, shape).astype(mx.int8)
        s = mx.random.uniform(1e-3, 2e-3, (out_features, formats.n_groups(in_features, gs)))
        return (w, s, bits, gs), nbytes(w, s)
    if fmt.startswith("mlx"):
        bits = int(fmt[4])
        w = mx.random.normal((out_features, in_features)).astype(ACT_DTYPE)
        wq, scales, biases = mx.quantize(w, 64, bits)
        return (wq, scales, biases, bits), nbytes(wq, scales, biases)
    w = (mx.random.normal((out_features, in_features)) * 0.02).astype(ACT_DTYPE)
    return (w,), nbytes(w)


def product(fmt: str, x: mx.array, weights: tuple, tuning=None, shared=None) -> mx.array:
    if fmt.startswith("packed"):
        w, s, bits, gs = weights
        return packed_gpu.gemv(x, w, s, bits=bits, group_size=gs, tuning=tuning, shared=shared,
                            mma=packed_format(fmt)[2])
    if fmt.startswith("mlx"):
        wq, scales, biases, bits = weights
        return mx.quantized_matmul(x[None], wq, scales, biases, transpose=True,
                                   group_size=64, bits=bits)
    return x[None] @ weights[0].T


def check_packed(fmt: str, x: mx.array, weights: tuple, tuning=None, shared=None) -> float:
    w, s, bits, gs = weights
    y = product(fmt, x, weights, tuning, shared).astype(mx.float32)
    ref = formats.reference_matmul(x, w, s, bits=bits, group_size=gs,
                                 in_features=x.shape[0]).astype(mx.float32)
    return (mx.max(mx.abs(y - ref)) / mx.maximum(mx.max(mx.abs(ref)), 1e-30)).item()


def time_null(shape: Tuple[int, int]) -> Dict[str, float]:
    """The harness's floor: products that launch a kernel but read no weights."""
    out_features, in_features = shape
    x = mx.random.normal((in_features,)).astype(ACT_DTYPE)
    null = NullKernel((out_features,))
    n = MIN_PRODUCTS * 2
    t = time_graph(lambda: [null(x)[0] for _ in range(n)])
    return {"us": t / n * 1e6, "bytes": 0}


def time_format(fmt: str, shape: Tuple[int, int], tuning=None, shared=None) -> Dict[str, float]:
    if fmt == "null":
        return time_null(shape)
    out_features, in_features = shape
    x = mx.random.normal((in_features,)).astype(ACT_DTYPE)
    first, per_copy = random_weights(fmt, out_features, in_features)
    copies = [first] + [random_weights(fmt, out_features, in_features)[0]
                        for _ in range(max(1, math.ceil(WORKING_SET / per_copy)) - 1)]
    mx.eval([a for c in copies for a in c if isinstance(a, mx.array)])
    row: Dict[str, float] = {}
    if fmt.startswith("packed"):
        row["max_rel_err"] = check_packed(fmt, x, first, tuning, shared)
        if not row["max_rel_err"] < CHECK_TOL:
            raise RuntimeError(f"{fmt} {shape}: kernel disagrees with the reference "
                               f"(max rel err {row['max_rel_err']:.3g}); not timed")
    n = max(MIN_PRODUCTS, 2 * len(copies))
    t = time_graph(lambda: [product(fmt, x, copies[i % len(copies)], tuning, shared)
                            for i in range(n)])
    row.update(us=t / n * 1e6, bytes=per_copy, GBps=per_copy / (t / n) / 1e9, copies=len(copies))
    copies = None  # frees the weights (see bench_bandwidth)
    mx.clear_cache()
    return row


# -- 2. tuning sweep ------------------------------------------------------------------------


def bench_sweep(quick: bool) -> Dict[str, object]:
    shapes = [(8192, 8192), (14336, 4096)] if not quick else [(1024, 1024)]
    grid = [packed_gpu.Tuning(*t) for t in ((2, 4, 1), (4, 2, 1), (4, 4, 1), (1, 2, 4), (2, 1, 4),
                                         (2, 2, 4), (4, 1, 4), (4, 2, 4))]
    result: Dict[str, object] = {"shapes": shapes, "runs": [], "best": {}}
    for bits in (4, 8):
        fmt = f"packed_{bits}_row_simt"
        scores = {}
        for t in grid:
            us = [time_format(fmt, s, t)["us"] for s in shapes]
            result["runs"].append({"bits": bits, "rows": t.rows, "unroll": t.unroll,
                                   "vec": t.vec, "us": us})
            scores[t] = math.exp(sum(math.log(u) for u in us) / len(us))
            print(f"  sweep int{bits} rows={t.rows} unroll={t.unroll} vec={t.vec}: "
                  + ", ".join(f"{u:.1f}" for u in us) + " us", flush=True)
        best = min(scores, key=scores.get)
        packed_gpu.TUNING[bits] = best
        result["best"][bits] = {"rows": best.rows, "unroll": best.unroll, "vec": best.vec}
        # §8.1's two variants at a K both can take: is staging x worth it here?
        for shape in ([(4096, 4096), (14336, 4096)] if not quick else [(1024, 1024)]):
            for shared in (True, False):
                us = time_format(fmt, shape, best, shared)["us"]
                result["runs"].append({"bits": bits, "rows": best.rows, "unroll": best.unroll,
                                       "vec": best.vec, "shape": shape, "shared": shared,
                                       "us": [us]})
                print(f"  variant int{bits} {shape} {'shared' if shared else 'device'}: "
                      f"{us:.1f} us", flush=True)
    return result


def bench_mma_sweep(quick: bool) -> Dict[str, object]:
    """Iterations in flight per SIMD group of the matrix-unit int4 kernel, per
    row scales and with groups of 64 (the gears' format); the best of each is kept."""
    shapes = [(8192, 8192), (14336, 4096), (4096, 14336)] if not quick else [(1024, 1024)]
    result: Dict[str, object] = {"shapes": shapes, "runs": [], "best": {}}
    for fmt, attr in (("packed_4_row_mma", "MMA_UNROLL"), ("packed_4_g64_mma", "MMA_UNROLL_GROUPS")):
        scores = {}
        for unroll in (1, 2, 4):
            t = packed_gpu.Tuning(packed_gpu.MMA_ROWS, unroll, 1)
            us = [time_format(fmt, s, t)["us"] for s in shapes]
            result["runs"].append({"format": fmt, "unroll": unroll, "us": us})
            scores[unroll] = math.exp(sum(math.log(u) for u in us) / len(us))
            print(f"  mma sweep {fmt} unroll={unroll}: " + ", ".join(f"{u:.1f}" for u in us)
                  + " us", flush=True)
        best = min(scores, key=scores.get)
        setattr(packed_gpu, attr, best)
        result["best"][fmt] = best
    return result


# -- 2b. per-layer dispatch cost ---------------------------------------------------------------


def bench_dispatch(n_layers: int = 200, dim: int = 256) -> Dict[str, Dict[str, float]]:
    """Host cost per layer call in a decode-like chain of tiny layers.

    The GPU work is negligible here, so the time is what building and
    launching one layer costs: what bounds decoding once the kernels are fast.
    """
    mx.random.seed(0)
    linears = []
    for _ in range(n_layers):
        lin = nn.Linear(dim, dim, bias=False)
        lin.set_dtype(mx.bfloat16)
        linears.append(lin)
    layers = {
        "linear_bf16": linears,
        "mlx_4_g64": [nn.QuantizedLinear.from_linear(m, 64, 4) for m in linears],
        "packed_4_row": [PackedLinear.from_linear(m, bits=4) for m in linears],
    }
    mx.eval([m.parameters() for ms in layers.values() for m in ms])
    layers["null_kernel"] = [NullLinear(NullGroup((dim,)), 0) for _ in range(n_layers)]
    x = mx.random.normal((1, 1, dim)).astype(mx.bfloat16)
    out = {}
    for name, ms in layers.items():
        builds, totals = [], []
        for rep in range(6):
            mx.synchronize()
            t0 = time.perf_counter()
            y = x
            for m in ms:
                y = m(y) * 0.05
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            if rep:
                builds.append(t1 - t0)
                totals.append(t2 - t0)
        out[name] = {"build_us_per_layer": statistics.median(builds) / n_layers * 1e6,
                     "total_us_per_layer": statistics.median(totals) / n_layers * 1e6}
        print(f"  dispatch {name:13s} build {out[name]['build_us_per_layer']:.1f} us/layer, "
              f"build+eval {out[name]['total_us_per_layer']:.1f} us/layer", flush=True)
    return out


# -- 3. GEMV table ---------------------------------------------------------------------------

FORMATS = ["packed_4_row", "packed_4_g64", "packed_4_row_simt", "packed_8_row", "mlx_4_g64",
           "mlx_8_g64", "fp16", "null"]


def bench_gemv(shapes, copy_GBps: float) -> List[Dict[str, object]]:
    rows = []
    for shape in shapes:
        timed = {}
        for fmt in FORMATS:
            try:
                timed[fmt] = time_format(fmt, shape)
            except Exception as e:  # record and carry on
                timed[fmt] = {"error": f"{type(e).__name__}: {e}"}
        for fmt, r in timed.items():
            entry = {"shape": list(shape), "format": fmt, **r}
            if "us" in r and fmt != "null":
                entry["frac_copy_bw"] = r["GBps"] / copy_GBps
                for ref in ("mlx_4_g64", "mlx_8_g64", "fp16"):
                    if "us" in timed.get(ref, {}):
                        entry[f"speedup_vs_{ref}"] = timed[ref]["us"] / r["us"]
            rows.append(entry)
    return rows


def print_gemv(rows):
    print(f"{'shape (OxK)':>13} {'format':>13} {'us':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'vs mlx4':>8} {'vs mlx8':>8} {'vs fp16':>8}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:>13} {r['format']:>13}  ERROR {r['error'][:80]}")
            continue
        if r["format"] == "null":
            print(f"{shape:>13} {'null':>13} {r['us']:8.1f}   (a launch that reads no weights)")
            continue
        print(f"{shape:>13} {r['format']:>13} {r['us']:8.1f} {r['GBps']:7.0f} "
              f"{100 * r['frac_copy_bw']:5.0f}% "
              + " ".join(f"{r.get(k, float('nan')):8.2f}"
                         for k in ("speedup_vs_mlx_4_g64", "speedup_vs_mlx_8_g64",
                                   "speedup_vs_fp16")))


# -- 4. decode -------------------------------------------------------------------------------------


class NullKernel:
    """A kernel launch that does no real work: every output element copies x[0].

    A measuring instrument: decoding with every linear layer replaced by one
    of these gives the tokens/s the rest of the model and the host's cost per
    launch allow, whatever the product kernel.
    """

    def __init__(self, out_dims: Tuple[int, ...]) -> None:
        self.out_dims = tuple(out_dims)
        self._names = [f"y{i}" for i in range(len(out_dims))]
        if gpu.gpu_backend() == "metal":
            self._index = "const uint i = thread_position_in_grid.x;\n"
        else:
            self._index = "const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        self._kernels: Dict[int, Callable] = {}

    def _kernel(self, lead: int) -> Callable:
        """The kernel for ``lead`` input rows (output j has ``lead * out_dims[j]`` elements)."""
        k = self._kernels.get(lead)
        if k is None:
            src = self._index + "".join(f"if (i < {lead * d}) y{j}[i] = x[0];\n"
                                        for j, d in enumerate(self.out_dims))
            make = mx.fast.metal_kernel if gpu.gpu_backend() == "metal" else mx.fast.cuda_kernel
            k = make(name=f"gbx_null_{lead}_{'_'.join(map(str, self.out_dims))}",
                     input_names=["x"], output_names=self._names, source=src)
            self._kernels[lead] = k
        return k

    def __call__(self, x: mx.array) -> List[mx.array]:
        lead = x.size // x.shape[-1]
        n = lead * max(self.out_dims)
        return self._kernel(lead)(
            inputs=[x], grid=(-(-n // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
            output_shapes=[x.shape[:-1] + (d,) for d in self.out_dims],
            output_dtypes=[x.dtype] * len(self.out_dims))


class NullLinear(nn.Module):
    """A linear layer's shape without its product (see :class:`NullKernel`).

    Members of one group (``group``, ``index``) share a launch per input array,
    as :class:`gearbx_mlx.packed.fused.FusedPackedLinear` members do.
    """

    def __init__(self, group: "NullGroup", index: int) -> None:
        super().__init__()
        self._group, self._index = group, index

    def __call__(self, x: mx.array) -> mx.array:
        return self._group(x)[self._index]


class NullGroup:
    def __init__(self, out_dims: Tuple[int, ...]) -> None:
        self.kernel = NullKernel(out_dims)
        self._x: Optional[mx.array] = None
        self._outs: List[mx.array] = []

    def __call__(self, x: mx.array) -> List[mx.array]:
        if x is not self._x:
            self._outs, self._x = self.kernel(x), x
        return self._outs


def null_plan(model, fused: bool) -> List[Tuple[str, nn.Module]]:
    """Every Linear replaced by a null launch; q/k/v and gate/up sharing one if ``fused``."""
    from gearbx_mlx.packed.fused import FUSE_SETS

    plan, done = [], set()
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for names in (FUSE_SETS if fused else ()):
            layers = [getattr(module, n, None) for n in names]
            if all(isinstance(m, nn.Linear) for m in layers):
                group = NullGroup(tuple(m.weight.shape[0] for m in layers))
                for i, n in enumerate(names):
                    plan.append((prefix + n, NullLinear(group, i)))
                    done.add(prefix + n)
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear) and path not in done:
            plan.append((path, NullLinear(NullGroup((m.weight.shape[0],)), 0)))
    return plan


def import_llama():
    """mlx_lm.models.llama without mlx_lm/__init__ (which needs transformers) if need be."""
    try:
        from mlx_lm.models import cache, llama
        return llama, cache
    except Exception:  # ImportError, or a transformers version mlx_lm does not take
        spec = importlib.util.find_spec("mlx_lm")
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = pkg
        from mlx_lm.models import cache, llama
        return llama, cache


MODEL_SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0, tie_word_embeddings=True),
}


def build_model(kind: str):
    llama, _ = import_llama()
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **MODEL_SHAPES[kind])
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    for _, m in model.named_modules():  # materialize layer by layer: bounded peak memory
        if isinstance(m, (nn.Linear, nn.Embedding)):
            mx.eval(m.parameters())
    mx.eval(model.parameters())
    return model


def greedy_decode(model, prompt: mx.array, n_tokens: int) -> Tuple[List[int], float, float]:
    """Tokens, prefill seconds and decode tok/s, with mlx-lm's pipelining."""
    try:
        from mlx_lm.generate import generate_step
    except Exception:
        generate_step = None
    tokens = []
    t0 = time.perf_counter()
    t_first = None
    if generate_step is not None:
        gen = generate_step(prompt, model, max_tokens=n_tokens,
                            sampler=lambda logits: mx.argmax(logits, axis=-1))
        for tok, _ in gen:
            tokens.append(int(tok))
            if t_first is None:
                t_first = time.perf_counter()
    else:  # the same pipelining as generate_step, by hand
        _, cache_mod = import_llama()
        cache = cache_mod.make_prompt_cache(model)

        def step(y):
            return mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)

        y = step(prompt)
        mx.async_eval(y)
        for i in range(n_tokens):
            nxt = step(y) if i + 1 < n_tokens else None
            if nxt is not None:
                mx.async_eval(nxt)
            tokens.append(int(y.item()))
            if t_first is None:
                t_first = time.perf_counter()
            y = nxt
    t_end = time.perf_counter()
    return tokens, t_first - t0, (len(tokens) - 1) / (t_end - t_first)


def swap_plan(model, variant: str) -> List[Tuple[str, nn.Module]]:
    """Quantized replacements of every Linear (and a tied embedding) for ``variant``."""
    if variant == "bf16":
        return []
    if variant.startswith("null"):
        return null_plan(model, variant.endswith("fused"))
    kind, bits = variant.split("-")[0], int(variant.split("-")[1])
    gs = None
    if kind == "packed" and "g64" in variant:
        gs = 64
    tied = getattr(model.args, "tie_word_embeddings", False)
    plan = []
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear):
            new = (nn.QuantizedLinear.from_linear(m, 64, bits) if kind == "mlx"
                   else PackedLinear.from_linear(m, bits=bits, group_size=gs))
        elif isinstance(m, nn.Embedding) and tied:
            new = (nn.QuantizedEmbedding.from_embedding(m, 64, bits) if kind == "mlx"
                   else PackedEmbedding.from_embedding(m, bits=bits, group_size=gs))
        else:
            continue
        mx.eval(new.parameters())
        plan.append((path, new))
    return plan


def bench_decode(kind: str, variants: List[str], prompt_len=32, n_tokens=128, rounds=3):
    """Decode tok/s of each variant: ``rounds`` passes over the variants, interleaved,
    so that a shared machine's drift falls on all of them alike; the median is reported."""
    from mlx.utils import tree_flatten, tree_unflatten

    model = build_model(kind)
    originals = [(p, m) for p, m in model.named_modules()
                 if isinstance(m, (nn.Linear, nn.Embedding))]
    vocab = MODEL_SHAPES[kind]["vocab_size"]
    prompt = mx.random.randint(0, vocab, (prompt_len,))
    entries: Dict[str, Dict[str, object]] = {
        v: {"model": kind, "variant": v, "rounds_tok_per_s": []} for v in variants}
    reference_tokens = None
    for r in range(rounds):
        for variant in variants:
            entry = entries[variant]
            try:
                t0 = time.perf_counter()
                plan = swap_plan(model, variant)
                entry["quantize_s"] = time.perf_counter() - t0
                if plan:
                    model.update_modules(tree_unflatten(plan))
                if variant.startswith("packed") and variant.endswith("fused"):
                    fusion = fuse_plan(model)
                    entry["fused_layers"] = len(fusion)
                    model.update_modules(tree_unflatten(fusion))
                    fusion = None
                entry["weight_GB"] = sum(
                    v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9
                probe = mx.zeros((1, 1, model.args.hidden_size), dtype=mx.bfloat16)
                sample = next((m for _, m in model.named_modules()
                               if isinstance(m, PackedLinear)), None)
                entry["packed_path"] = sample.backend_for(probe) if sample is not None else None
                if sample is not None and entry["packed_path"] in ("cuda", "metal"):
                    entry["mma"] = packed_gpu.supports_mma(sample.bits, sample.group_size,
                                                        sample.in_features, sample.out_features,
                                                        mx.bfloat16)
                greedy_decode(model, prompt[:8], 8)  # warm up: compile kernels
                tokens, prefill_s, tps = greedy_decode(model, prompt, n_tokens)
                entry["rounds_tok_per_s"].append(tps)
                entry.update(prefill_s=prefill_s, n_tokens=len(tokens))
                if reference_tokens is None:
                    reference_tokens = tokens
                entry["same_tokens_as_first_variant"] = sum(
                    a == b for a, b in zip(tokens, reference_tokens)) / len(tokens)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            finally:
                model.update_modules(tree_unflatten(originals))
                plan = None
                mx.clear_cache()
            if r == rounds - 1:
                runs = entry["rounds_tok_per_s"]
                if runs:
                    entry["tok_per_s"] = statistics.median(runs)
                print(f"  decode {kind:13s} {variant:18s} "
                      + (f"{entry['tok_per_s']:7.1f} tok/s median of "
                         + "/".join(f"{t:.0f}" for t in runs)
                         + f"  ({entry['weight_GB']:.2f} GB, path {entry['packed_path']})"
                         if "tok_per_s" in entry else entry.get("error", "")),
                      flush=True)
    del model
    mx.clear_cache()
    return list(entries.values())


# -- main ----------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/kernels_<device>.json)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="decode variants (default: all; see swap_plan)")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODEL_SHAPES),
                    help="decode model shapes (default: both)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved decode passes (median)")
    args = ap.parse_args(argv)

    if gpu.gpu_backend() is None:
        print("no Metal/CUDA GPU on the default device: nothing to benchmark", file=sys.stderr)
        return 2
    global WORKING_SET, MIN_PRODUCTS
    if args.quick:
        WORKING_SET, MIN_PRODUCTS = 64 << 20, 8
    name = device_name()
    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    out = args.out or ROOT / "benchmarks" / "results" / f"kernels_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: Dict[str, object] = {
        "device": name, "backend": gpu.gpu_backend(), "mlx": mx.__version__,
        "python": platform.python_version(), "activation_dtype": str(ACT_DTYPE),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

    def save():
        out.write_text(json.dumps(report, indent=1, default=str))

    print(f"device: {name} ({report['backend']}), mlx {mx.__version__}", flush=True)
    bw = bench_bandwidth(args.quick)
    report["bandwidth"] = bw
    print(f"copy bandwidth {bw['copy_GBps']:.0f} GB/s, read bandwidth {bw['read_GBps']:.0f} GB/s",
          flush=True)
    save()
    def section(key: str, run: Callable[[], object]) -> None:
        """Record one section, or its error, and save: a failure loses nothing else."""
        try:
            report[key] = run()
        except Exception as e:
            report[key] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        save()

    if not args.skip_sweep:
        section("sweep", lambda: bench_sweep(args.quick))
    section("mma_sweep", lambda: bench_mma_sweep(args.quick))
    report["tuning"] = {b: {"rows": t.rows, "unroll": t.unroll, "vec": t.vec}
                        for b, t in packed_gpu.TUNING.items()}
    report["tuning"]["mma"] = {"rows": packed_gpu.MMA_ROWS, "unroll": packed_gpu.MMA_UNROLL,
                               "unroll_groups": packed_gpu.MMA_UNROLL_GROUPS}
    section("dispatch", bench_dispatch)
    shapes = SHAPES if not args.quick else [(1024, 1024)]
    report["gemv"] = bench_gemv(shapes, bw["copy_GBps"])
    print_gemv(report["gemv"])
    save()
    if not args.skip_decode:
        variants = args.variants or [
            "bf16", "mlx-4", "mlx-8", "packed-4", "packed-4-fused", "packed-8", "packed-4-g64",
            "packed-4-g64-fused", "null", "null-fused"]
        report["decode"] = []
        kinds = args.models or (["smollm2-135m"] if args.quick else ["llama3-8b", "smollm2-135m"])
        for kind in kinds:
            report["decode"] += bench_decode(kind, variants, n_tokens=32 if args.quick else 128,
                                             rounds=args.rounds)
            save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
