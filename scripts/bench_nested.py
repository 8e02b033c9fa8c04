"""Nested gears against separate copies: memory, quality, shift time and decode speed.

    python scripts/bench_nested.py [--model NAME] [--dtype float16] [--tokens 2048]
                                   [--parts memory quality shift speed] [--out FILE.json]

* memory: one fresh process per store (separate, nested with the loaded high
  gear, nested reading every plane; each also with the speculative drafter
  built): the managed layers' resident bytes after every gear was entered
  (the precision manager's count, each array once) against their float16
  bytes, and the process's peak resident set (``ru_maxrss``);
* quality: teacher-forced over ``--tokens`` of gensim's Lee corpus in windows
  of ``--window``, every linear layer managed (scope ``all``): perplexity,
  mean KL(reference || gear) and top-1 agreement with the loaded weights,
  for MLX 4-bit and 8-bit (group 64) and the nested low, mid and high-planes
  gears, each through float layers that hold exactly the values its
  quantized layers multiply by (``tests/test_nested.py`` and the evaluation's
  tests check the two agree; MLX's quantized CPU kernels are far too slow for
  thousands of positions);
* shift: median seconds of a gear shift after load, per store;
* speed: greedy decode tokens/s per static gear, per store and kernel.

Prints a table per part and writes everything to ``--out`` (default
``benchmarks/results/nested_<model>_<dtype>.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
STORES = (("separate", "original"), ("nested", "original"), ("nested", "planes"))
GEARS = ("low", "mid", "high")
QUALITY_VARIANTS = ("mlx-4bit", "mlx-8bit", "nested-low", "nested-mid", "nested-high-planes")


def _load(model: Optional[str], dtype: Optional[str], store: str, high: str, kernel: str = "mlx", scope: str = "all"):
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.generation import load

    config = GearboxConfig(scope=scope, store=store, high=high, kernel=kernel)
    return load(model, config=config, dtype=dtype)


def _maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if platform.system() == "Darwin" else r * 1024


# -- memory: one process per store -------------------------------------------------------------


def memory_child(model: Optional[str], dtype: Optional[str], store: str, high: str, draft: bool,
                 planes_dir: str = "") -> Dict[str, Any]:
    from gearbx_mlx import precision
    from gearbx_mlx.speculative.draft import build_draft

    if planes_dir:
        # The planes cache in a folder of the benchmark's own: the first child
        # with it builds the planes (and writes them), the next reads them.
        precision.cache_path = lambda model_dir, key, fallback: Path(planes_dir) / f"{key}.safetensors"
    rss0 = _maxrss_bytes()
    m, tok, gb = _load(model, dtype, store, high)
    mgr = gb.manager
    for g in GEARS:  # enter every gear, as a run that routed through all of them would
        mgr.shift(g)
        out = m(mx.array([[1, 2, 3]]))
        mx.eval(out)
    mem = mgr.memory()
    row: Dict[str, Any] = {"store": store, "high": high, "draft": draft, **mem,
                           "ratio_fp16": mem["resident_total"] / mem["fp16_bytes"],
                           "planes_seconds": mgr.planes_seconds, "planes_origin": mgr.planes_origin}
    if draft:
        d = build_draft(m, gb, "low", scope="all")
        out = d.module(mx.array([[1, 2, 3]]))
        mx.eval(out)
        row["draft_memory"] = d.memory
    row["peak_rss_bytes"] = _maxrss_bytes()
    row["rss_before_load_bytes"] = rss0
    return row


def run_memory(args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows = []
    for store, high in STORES:
        with tempfile.TemporaryDirectory(prefix="gearbx-planes-") as planes:
            # Nested: built at the first load (float weights read), then read
            # from the cache (with high='planes' the float weights never are).
            for draft in (False, True):
                for _ in range(2 if store == "nested" else 1):
                    cmd = [sys.executable, __file__, "--child-memory", store, high, str(int(draft)),
                           planes if store == "nested" else ""]
                    cmd += ["--dtype", args.dtype] if args.dtype else []
                    cmd += ["--model", args.model] if args.model else []
                    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                    if proc.returncode != 0:
                        raise RuntimeError(f"memory run {store}/{high} failed:\n{proc.stderr[-2000:]}")
                    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                if store == "nested" and not draft:
                    for f in Path(planes).glob("*.safetensors"):
                        f.unlink()  # the drafter's rows start cold again
    print(f"{'store':<10} {'high':<9} {'draft':<6} {'planes':<7} {'resident MiB':>12} {'x fp16':>7} {'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['store']:<10} {r['high']:<9} {str(r['draft']):<6} {r['planes_origin'] or '-':<7} "
              f"{r['resident_total'] / 2**20:>12.1f} {r['ratio_fp16']:>7.3f} {r['peak_rss_bytes'] / 2**20:>12.1f}")
    return rows


# -- quality: teacher-forced, through the real layers ------------------------------------------


def _as_float(module: Any) -> Any:
    """A float layer holding the exact weight values ``module`` multiplies by."""
    import mlx.nn as nn

    from gearbx_mlx.nested.planes import reconstruct

    weights = getattr(module, "nested", None)
    if weights is not None:
        w, bias = reconstruct(weights.planes, module.n, mx.float32), weights.get("bias")
    elif isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(module.weight, module.scales, module.get("biases"), group_size=module.group_size,
                          bits=module.bits).astype(mx.float32)
        bias = module.get("bias")
    else:
        return module
    embedding = hasattr(module, "as_linear")
    out = nn.Embedding(*w.shape) if embedding else nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    out.weight = w
    if bias is not None:
        out.bias = bias
    mx.eval(out.parameters())
    return out


def run_quality(args: argparse.Namespace) -> List[Dict[str, Any]]:
    from mlx.utils import tree_unflatten

    from gearbx_mlx.evaluation import metrics
    from gearbx_mlx.evaluation.harness import text_tokens
    from gearbx_mlx.nested.store import DEFAULT_PLAN, build_nested, gear_views
    from gearbx_mlx.sources.models import corpus_path

    m, tok, gb = _load(args.model, args.dtype, "separate", "original")
    text = corpus_path("lee_background").read_text(encoding="utf-8")
    ids = text_tokens(tok, text, args.tokens)
    windows = [ids[i : i + args.window + 1] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]
    sep = gb.manager
    sep.prepare("low")
    sep.prepare("mid")
    views = gear_views(build_nested(sep.originals, DEFAULT_PLAN), sep.originals, "planes", fused=False)
    variants = {
        "reference": sep.originals, "mlx-4bit": sep.cache["low"], "mlx-8bit": sep.cache["mid"],
        "nested-low": views["low"], "nested-mid": views["mid"], "nested-high-planes": views["high"],
    }
    unknown = set(args.variants) - set(variants)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {list(variants)}")
    variants = {k: v for k, v in variants.items() if k == "reference" or k in args.variants}
    # Products on the CPU through float weights holding each gear's exact values:
    # MLX's quantized CPU kernels would take an hour here for the same numbers.
    # One variant's float copy at a time (a 0.5B model's is 2 GB); the
    # reference rows of each window are kept for the others. The metrics are
    # the evaluation harness's (numpy, tested against their MLX formulas).
    stats: Dict[str, Dict[str, float]] = {}
    refs: List[Any] = []
    for vi, (name, mods) in enumerate(variants.items()):
        tree = tree_unflatten([(p, _as_float(mod)) for p, mod in mods.items()])
        m.update_modules(tree)
        s = stats.setdefault(name, {"nll": 0.0, "kl": 0.0, "top1": 0.0, "n": 0})
        for wi, w in enumerate(windows):
            logits = m(mx.array(w[:-1])[None])[0]
            targets = list(w[1:])
            if vi == 0:
                rows, _, _ = metrics.reference(logits, targets)
                refs.append(rows)
            r = metrics.routed(logits, targets, refs[wi])
            s["nll"] += sum(r["nll"])
            s["kl"] += sum(r["kl"])
            s["top1"] += sum(r["hits"])
            s["n"] += len(r["kl"])
        del tree
        print(f"  {name} done", file=sys.stderr, flush=True)
    m.update_modules(tree_unflatten(list(variants["reference"].items())))
    rows = [{"variant": k, "perplexity": math.exp(s["nll"] / s["n"]), "kl_nats": s["kl"] / s["n"],
             "top1": s["top1"] / s["n"], "positions": s["n"]} for k, s in stats.items()]
    print(f"{'variant':<20} {'ppl':>9} {'KL (nats)':>11} {'top-1':>7}")
    for r in rows:
        print(f"{r['variant']:<20} {r['perplexity']:>9.3f} {r['kl_nats']:>11.3e} {r['top1']:>7.4f}")
    return rows


# -- shift time ------------------------------------------------------------------------------------


def run_shift(args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows = []
    for store, high in STORES:
        m, tok, gb = _load(args.model, args.dtype, store, high)
        mgr = gb.manager
        for g in GEARS:
            mgr.shift(g)
        ts = []
        for _ in range(args.shift_rounds):
            for g in GEARS:
                t = time.perf_counter()
                mgr.shift(g)
                ts.append(time.perf_counter() - t)
        rows.append({"store": store, "high": high, "modules": len(mgr.paths), "median_shift_s": statistics.median(ts),
                     "first_entry_s": {g: mgr.quantize_seconds.get(g, 0.0) for g in GEARS},
                     "planes_seconds": mgr.planes_seconds, "planes_origin": mgr.planes_origin})
        del m, gb
    print(f"{'store':<10} {'high':<9} {'median shift ms':>16} {'one-time build s':>17}")
    for r in rows:
        once = r["planes_seconds"] if r["store"] == "nested" else sum(r["first_entry_s"].values())
        print(f"{r['store']:<10} {r['high']:<9} {1e3 * r['median_shift_s']:>16.3f} {once:>17.2f}")
    return rows


# -- decode speed ------------------------------------------------------------------------------------


def run_speed(args: argparse.Namespace) -> List[Dict[str, Any]]:
    from gearbx_mlx.pipeline import stream_generate

    rows = []
    for store, high in STORES:
        for kernel in args.kernels:
            if store == "separate" and high == "planes":
                continue
            m, tok, gb = _load(args.model, args.dtype, store, high, kernel=kernel)
            for gear in GEARS:
                gb.config.static_gear = gear
                n, t0 = 0, None
                for r in stream_generate(m, tok, "Write a short story about a lighthouse keeper.", gb,
                                         max_tokens=args.speed_tokens, prompt_text="story"):
                    if n == 0:
                        t0 = time.perf_counter()  # after the prompt and the first token, as mlx-lm counts
                    n += 1
                tps = (n - 1) / (time.perf_counter() - t0) if n > 1 else float("nan")
                rows.append({"store": store, "high": high, "kernel": kernel, "gear": gear, "tokens_per_s": tps})
            gb.config.static_gear = None
            del m, gb
    print(f"{'store':<10} {'high':<9} {'kernel':<7} " + " ".join(f"{g:>8}" for g in GEARS))
    for store, high in STORES:
        for kernel in args.kernels:
            sel = {r["gear"]: r["tokens_per_s"] for r in rows if (r["store"], r["high"], r["kernel"]) == (store, high, kernel)}
            if sel:
                print(f"{store:<10} {high:<9} {kernel:<7} " + " ".join(f"{sel[g]:>8.2f}" for g in GEARS))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a --model name or folder (default: the default model)")
    p.add_argument("--dtype", default=None, help="dtype of a converted PyPI model (float16 measures the "
                   "ratios people quote; default: the package's default for this device)")
    p.add_argument("--parts", nargs="+", default=["memory", "quality", "shift", "speed"],
                   choices=["memory", "quality", "shift", "speed"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--variants", nargs="+", default=list(QUALITY_VARIANTS), choices=QUALITY_VARIANTS,
                   help="quality rows besides the reference (nested-low is MLX 4-bit bit for bit: "
                        "the tests check it, so a large model may leave both out)")
    p.add_argument("--shift-rounds", type=int, default=50)
    p.add_argument("--speed-tokens", type=int, default=48)
    p.add_argument("--kernels", nargs="+", default=["mlx", "packed"], choices=["mlx", "packed"])
    p.add_argument("--out", default=None)
    p.add_argument("--child-memory", nargs=4, metavar=("STORE", "HIGH", "DRAFT", "PLANES_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_memory:
        store, high, draft, planes = args.child_memory
        print(json.dumps(memory_child(args.model, args.dtype, store, high, draft == "1", planes)))
        return 0
    result: Dict[str, Any] = {
        "command": "python scripts/bench_nested.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": date.today().isoformat(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "mlx": mx.__version__, "device": str(mx.default_device())},
        "model": args.model or "smollm2-135m", "dtype": args.dtype,
    }
    name = (args.model or "smollm2-135m").replace("/", "_")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"nested_{name}_{args.dtype or 'default'}.json"
    for part in args.parts:
        print(f"== {part}", flush=True)
        result[part] = {"memory": run_memory, "quality": run_quality, "shift": run_shift, "speed": run_speed}[part](args)
        out.write_text(json.dumps(result, indent=1) + "\n")  # after each part: a long run keeps what it measured
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
