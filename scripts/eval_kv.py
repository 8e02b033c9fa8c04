"""Evaluate KV caches: quality against the float cache, bytes per token, decode speed.

Usage:
  python scripts/eval_kv.py quality [--model NAME|PATH] [--window 2048] [--windows 2]
        [--chunk 128] [--caches float,affine-4-g64,...] [--calib-tokens 512] [--out FILE]
  python scripts/eval_kv.py bytes [--model NAME|PATH | --shape llama3-8b] [--tokens 2048,8192]
  python scripts/eval_kv.py speed [--model NAME|PATH | --shape llama3-8b] [--contexts 1024,4096]
        [--steps 32] [--caches float,kv-4-g64] [--dtype float16]
  python scripts/eval_kv.py table FILE.json ...   (Markdown tables of saved results)
  python scripts/eval_kv.py probe [float16]       (does this MLX run quantized attention, per shape)
  add --quick to any part for a smoke run (short windows, few steps).

quality: each of ``--windows`` windows of ``--window`` tokens of gensim's
lee_background.cor (consecutive, from the start) is fed through a fresh cache
of each kind in chunks of ``--chunk`` tokens, quantizing from the first
token; perplexity over all scored tokens and the mean KL(float || cache) of
the next-token distributions are reported. The calibration text (λ and the
key offset) is the first ``--calib-tokens`` tokens of gensim's lee.cor,
another file than the one scored. Cache names: see
``gearbx_mlx.kvcache.measure.spec``.

bytes: every cache kind filled with ``N`` random tokens of the model's (or
shape's) geometry in float16 (float16 scales), nbytes / N, and the ratio to
the float16 cache.

speed: decode tokens/s after ``C`` tokens of context (random ids, prefilled
untimed), float cache versus the named caches, each in the same process.
``--shape llama3-8b`` builds a random-weight model of Llama-3-8B's geometry
(32 layers, hidden 4096, 32/8 heads of 128, MLP 14336, vocab 128256) in
``--dtype`` (bfloat16 by default there): ~16 GB, for a GPU; ``--layers``
shortens it for a smoke run.

Results are printed as a table and written as JSON (``--out``; defaults under
benchmarks/results/). Every JSON records its command, machine and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_QUALITY = ("float,affine-8-g64,affine-8-g32,affine-4-g64,affine-4-g32,affine-3-g64,affine-3-g32,"
                   "rot-4-g64,rot-3-g64,rot-4-g32,kv-4-g64,kv-3-g64,kv-4-g32,kv-4-g64@weights")
#: --resume: the float row rerun must equal the saved one this closely (same
#: model, text and settings give the same bits on one machine; another BLAS
#: or CPU rounds differently).
RESUME_RTOL = 1e-6
#: --resume: settings a resumed quality run must share with the saved one.
RESUME_KEYS = ("window", "windows", "chunk", "attention")
DEFAULT_BYTES = "float,affine-8-g64,affine-4-g64,affine-4-g32,affine-3-g64,kv-4-g64,kv-3-g64"
DEFAULT_SPEED = "float,affine-4-g64,kv-4-g64"

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0),
    # Small enough for a CPU smoke run of the same code path.
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
}


def machine() -> Dict[str, Any]:
    import mlx.core as mx

    info: Dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(),
        "mlx": mx.__version__, "device": str(mx.default_device()), "cpus": os.cpu_count(),
    }
    try:
        import mlx_lm

        info["mlx_lm"] = mlx_lm.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if mx.default_device() == mx.gpu:
        try:
            info["gpu"] = mx.device_info().get("device_name", "?")
        except Exception:  # noqa: BLE001
            pass
    info["ld_preload"] = os.environ.get("LD_PRELOAD", "")
    info["openblas_num_threads"] = os.environ.get("OPENBLAS_NUM_THREADS", "")
    info["load_average_at_start"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    info["commit"] = code_commit()
    return info


def code_commit() -> Optional[str]:
    """The repository's commit, with ``+changes`` when files differ from it (None outside a clone)."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--",
                                "gearbx_mlx", "scripts"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def load_model(args: argparse.Namespace, materialize: bool = True) -> Any:
    """(model, tokenizer or None, label); ``materialize=False`` leaves random weights lazy."""
    import mlx.core as mx

    if args.shape:
        from mlx_lm.models import llama

        geo = dict(SHAPES[args.shape])
        if args.layers:
            geo["num_hidden_layers"] = args.layers
        a = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False, **geo)
        mx.random.seed(0)
        model = llama.Model(a)
        dtype = getattr(mx, args.dtype or "bfloat16")
        # Random weights at a sane scale (the speed does not depend on them).
        model.set_dtype(dtype)
        if materialize:
            mx.eval(model.parameters())
        return model, None, f"random {args.shape}" + (f" ({args.layers} layers)" if args.layers else "")
    from mlx_lm import load

    from gearbx_mlx.sources.models import resolve_model

    path = resolve_model(args.model, args.dtype)
    model, tok = load(path)
    return model, tok, Path(path).name


def geometry(model: Any) -> Dict[str, List[int]]:
    from gearbx_mlx.kvcache.arch import describe

    infos = describe(model)
    return {"n_kv_heads": [i.n_kv_heads for i in infos], "head_dim": [i.head_dim for i in infos]}


def corpus_ids(tok: Any, name: str) -> List[int]:
    from gearbx_mlx.sources.models import corpus_path

    # lee.cor is not valid UTF-8 everywhere (a stray 0xa3); keep every other byte.
    return tok.encode(corpus_path(name).read_text(encoding="utf-8", errors="replace"))


def part_quality(args: argparse.Namespace, model: Any, tok: Any,
                 partial: Any = lambda _result: None) -> Dict[str, Any]:
    from gearbx_mlx.kvcache import calibrate_text, calibrate_weights, outlier_scores
    from gearbx_mlx.kvcache.measure import chunked_logprobs, dequantized, prepared, score, spec

    if tok is None:
        raise SystemExit("error: quality needs a real model (--model), not --shape")
    ids = corpus_ids(tok, "lee_background")
    need = args.windows * args.window + 1
    if len(ids) < need:
        raise SystemExit(f"error: the corpus has {len(ids)} tokens, {need} needed")
    windows = [ids[i * args.window : (i + 1) * args.window + 1] for i in range(args.windows)]
    specs = [spec(n, model) for n in args.caches.split(",")]
    cal_ids = corpus_ids(tok, "lee")[: args.calib_tokens]
    tic = time.perf_counter()
    cals = {"text": calibrate_text(model, cal_ids, max_tokens=args.calib_tokens),
            "weights": calibrate_weights(model)}
    cal_s = time.perf_counter() - tic
    ref = None
    rows = []
    kept = {r["cache"]: r for r in (args.resume_rows or [])}
    for s in specs:
        if s.name in kept and s.kind != "float":  # measured by the run resumed (float is rerun: the KL reference)
            rows.append(kept[s.name])
            print(f"{s.name:28s} kept from {args.out}", flush=True)
            continue
        tic = time.perf_counter()
        with prepared(model, s, cals) as make_cache:
            bpe = stored_bits_per_element(model, make_cache(), s.bits_per_element)
            if args.attention == "dequantized":
                make_cache = dequantized(make_cache)
            lps = [chunked_logprobs(model, w, make_cache, args.chunk) for w in windows]
        q = score(windows, lps, ref)
        if s.kind == "float" and ref is None:
            ref = lps
            base = q.perplexity
            if s.name in kept and not math.isclose(kept[s.name]["perplexity"], base, rel_tol=RESUME_RTOL):
                raise SystemExit(f"error: the float cache now gives perplexity {base:.6f}, the run resumed "
                                 f"{kept[s.name]['perplexity']:.6f}: not the same setup, start a new --out")
        row = {"cache": s.name, "kind": s.kind, "bits_per_element": bpe,
               "perplexity": q.perplexity, "kl": q.kl if ref is not lps else 0.0,
               "per_window": q.per_window, "seconds": time.perf_counter() - tic}
        if s.config is not None:
            row["config"] = s.config.to_dict()
            row["calibration"] = s.calibration if s.kind == "kv" and s.config.needs_statistics else None
        rows.append(row)
        partial({"rows": rows, "complete": False, **{k: getattr(args, k) for k in RESUME_KEYS}})  # a long run keeps what it has measured
        rel = f"{100 * (q.perplexity / base - 1):+6.2f}%" if ref is not None else ""
        print(f"{s.name:28s} {row['bits_per_element']:5.2f} b  ppl {q.perplexity:8.3f} {rel}  "
              f"KL {row['kl']:.4f}  ({row['seconds']:.0f} s)", flush=True)
    if ref is None:
        raise SystemExit("error: include 'float' in --caches (the reference)")
    for r in rows:
        r["perplexity_increase"] = r["perplexity"] / base - 1
    check = attention_check(args, model, windows[0][: args.check_tokens + 1], specs, cals) \
        if args.attention == "dequantized" and args.check_tokens else None
    return {"attention": args.attention, "attention_check": check, "windows": args.windows, "window": args.window, "chunk": args.chunk,
            "scored_tokens": args.windows * args.window, "corpus": "gensim 4.4.0 lee_background.cor",
            "calibration_text": f"first {len(cal_ids)} tokens of gensim lee.cor",
            "calibration_seconds": cal_s, "outlier_scores": [round(x, 2) for x in outlier_scores(model)],
            "rows": rows}


def stored_bits_per_element(model: Any, caches: List[Any], default: float) -> float:
    """Bits per cached element over all layers, each layer at its own bits (a recipe
    may give some layers more), weighted by the layer's kv heads x head size;
    ``default`` for caches that keep floats."""
    from gearbx_mlx.kvcache.quantize import bits_per_element

    bits = [getattr(c, "bits", None) for c in caches]
    if not caches or any(b is None for b in bits):
        return default
    geo = geometry(model)
    sizes = [h * d for h, d in zip(geo["n_kv_heads"], geo["head_dim"])]
    per = [bits_per_element(b, c.group_size) for b, c in zip(bits, caches)]
    return sum(p * n for p, n in zip(per, sizes)) / sum(sizes)


def attention_check(args: argparse.Namespace, model: Any, ids: List[int], specs: List[Any],
                    cals: Dict[str, Any]) -> List[Dict[str, Any]]:
    """mlx-lm's quantized attention against the dequantized read, same caches, first tokens."""
    import mlx.core as mx

    from gearbx_mlx.kvcache.measure import chunked_logprobs, dequantized, prepared

    out = []
    for s in specs:
        if s.kind == "float" or s.name not in args.check_caches.split(","):
            continue
        with prepared(model, s, cals) as make_cache:
            a = chunked_logprobs(model, ids, make_cache, args.chunk)
            b = chunked_logprobs(model, ids, dequantized(make_cache), args.chunk)
        tgt = mx.array(ids[1:])[:, None]
        nll = [float(-mx.take_along_axis(x, tgt, axis=-1).mean().item()) for x in (a, b)]
        row = {"cache": s.name, "tokens": len(ids) - 1, "max_abs_logprob_diff": float(mx.abs(a - b).max().item()),
               "perplexity_quantized_attention": math.exp(nll[0]), "perplexity_dequantized": math.exp(nll[1])}
        out.append(row)
        print(f"check {s.name:24s} max |dlogprob| {row['max_abs_logprob_diff']:.2e}  ppl "
              f"{row['perplexity_quantized_attention']:.4f} (quantized attention) vs "
              f"{row['perplexity_dequantized']:.4f} (dequantized)", flush=True)
    return out


def part_bytes(args: argparse.Namespace, model: Any) -> Dict[str, Any]:
    import mlx.core as mx

    from gearbx_mlx.kvcache.measure import cache_nbytes_per_token, prepared, spec

    geo = geometry(model)
    rows = []
    for name in args.caches.split(","):
        s = spec(name, model)
        row: Dict[str, Any] = {"cache": name, "bits_per_element": s.bits_per_element}
        if s.kind == "kv":
            # Statistics change no byte (the key offset is one vector a layer,
            # not per token): measure without them, so no weights are read.
            s = dataclasses.replace(s, config=s.config.replace(lam_alpha=0.0, key_offset="none", sink=False))
        with prepared(model, s, {}) as make_cache:
            for n in args.tokens_list:
                row[f"bytes_per_token_{n}"] = cache_nbytes_per_token(
                    make_cache, geo["n_kv_heads"], geo["head_dim"], n, mx.float16)
        rows.append(row)
    fl = {n: next(r[f"bytes_per_token_{n}"] for r in rows if r["cache"] == "float") for n in args.tokens_list}
    for r in rows:
        for n in args.tokens_list:
            r[f"ratio_to_float16_{n}"] = r[f"bytes_per_token_{n}"] / fl[n]
        print(f"{r['cache']:20s} " + "  ".join(
            f"{n}: {r[f'bytes_per_token_{n}']:9.0f} B/token ({r[f'ratio_to_float16_{n}']:.3f}x)"
            for n in args.tokens_list), flush=True)
    return {"dtype": "float16 keys/values and scales", "geometry": geo, "rows": rows}


def part_speed(args: argparse.Namespace, model: Any) -> Dict[str, Any]:
    import mlx.core as mx

    from gearbx_mlx.kvcache import calibrate_weights
    from gearbx_mlx.kvcache.measure import decode_speed, prepared, spec

    cal = calibrate_weights(model)
    cals = {"text": cal, "weights": cal}
    names = args.caches.split(",")
    rows = []
    for ctx in args.contexts_list:
        for _ in range(args.repeats):  # rounds over the caches, so drift hits every cache alike
            for name in names:
                try:
                    with prepared(model, spec(name, model), cals) as make_cache:
                        r = decode_speed(model, make_cache, ctx, args.steps)
                except Exception as e:  # noqa: BLE001 - one cache failing on a backend must not lose the rest
                    r = {"context": ctx, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"context {ctx:6d}  {name:20s} FAILED {r['error']}", flush=True)
                else:
                    print(f"context {ctx:6d}  {name:20s} {r['tokens_per_s']:8.2f} tok/s  "
                          f"(median step {r['median_step_ms']:.2f} ms)", flush=True)
                r["cache"] = name
                rows.append(r)
                mx.clear_cache()
    summary = []
    for ctx in args.contexts_list:
        base = None
        for name in names:
            steps = sorted(r["median_step_ms"] for r in rows if r["cache"] == name and r["context"] == ctx
                           and "error" not in r)
            if not steps:
                continue
            med = steps[len(steps) // 2]
            base = med if name == "float" else base
            summary.append({"context": ctx, "cache": name, "median_step_ms": med, "tokens_per_s": 1e3 / med,
                            "speed_vs_float": None if base is None else base / med})
    for r in summary:
        vs = "" if r["speed_vs_float"] is None else f"  {r['speed_vs_float']:.3f}x float"
        print(f"median: context {r['context']:6d}  {r['cache']:20s} {r['tokens_per_s']:8.2f} tok/s{vs}")
    return {"steps": args.steps, "repeats": args.repeats, "rows": rows, "summary": summary,
            "note": "statistics from the weights (speed does not depend on them); per cache and context the "
                    "median over rounds of each run's median step"}


def markdown(paths: List[str]) -> str:
    """Markdown tables of saved results (quality, bytes or speed), as docs/BENCHMARKS.md shows them."""
    out = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        out.append(f"{d['model']}, `{d['command']}`, {d['date'][:10]}:\n")
        if "quality" in d:
            q = d["quality"]
            rows = q["rows"]
            base = next(r["perplexity"] for r in rows if r["cache"] == "float")
            out += ["| cache | bits/element | perplexity | vs float | KL (nats) |", "|---|---:|---:|---:|---:|"]
            out += [f"| {r['cache']} | {r['bits_per_element']:.2f} | {r['perplexity']:.3f} | "
                    f"{100 * (r['perplexity'] / base - 1):+.2f}% | {r['kl']:.4f} |" for r in rows]
            if not q.get("rows_complete", True) or q.get("complete") is False:
                out.append("\n(partial: the run was stopped after these rows)")
        elif "bytes" in d:
            rows = d["bytes"]["rows"]
            ns = [k.split("_")[-1] for k in rows[0] if k.startswith("bytes_per_token_")]
            out += ["| cache | " + " | ".join(f"bytes/token at {n}" for n in ns) + " | × float16 |",
                    "|---|" + "---:|" * (len(ns) + 1)]
            out += [f"| {r['cache']} | " + " | ".join(f"{r['bytes_per_token_' + n]:.0f}" for n in ns)
                    + f" | {r['ratio_to_float16_' + ns[-1]]:.3f} |" for r in rows]
        else:
            out += ["| context | cache | tokens/s | × float |", "|---:|---|---:|---:|"]
            out += [f"| {r['context']} | {r['cache']} | {r['tokens_per_s']:.2f} | "
                    f"{'' if r['speed_vs_float'] is None else format(r['speed_vs_float'], '.3f')} |"
                    for r in d["speed"]["summary"]]
        out.append("")
    return "\n".join(out)


def resumable(path: Path, label: str, args: argparse.Namespace) -> Dict[str, Any]:
    """The saved quality run that ``--resume`` continues, after checking it is the same setup."""
    try:
        saved = json.loads(path.read_text())
        q = saved["quality"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: --resume needs a quality result at {path}: {e}") from None
    commit, theirs = code_commit(), saved.get("machine", {}).get("commit")
    if commit is None or theirs != commit or commit.endswith("+changes"):
        raise SystemExit(f"error: {path} was measured by code at {theirs or 'an unknown commit'}, this is "
                         f"{commit or 'not a clone'}: rows of other code cannot be mixed, start a new --out")
    if saved.get("model") != label:
        raise SystemExit(f"error: {path} is of model {saved.get('model')!r}, not {label!r}")
    for k in RESUME_KEYS:
        if k in q and q[k] != getattr(args, k):
            raise SystemExit(f"error: {path} was run with {k}={q[k]!r}, this run has {getattr(args, k)!r}")
    return saved


def probe(dtype: str) -> int:
    """Print how this MLX build reads a quantized cache, per bits, group and head size."""
    import mlx.core as mx

    from gearbx_mlx.kvcache.quantize import attention_reads

    info = mx.device_info().get("device_name", "") if mx.default_device() == mx.gpu else ""
    print(f"MLX {mx.__version__} {mx.default_device()} {info}".rstrip())
    for bits, group in ((4, 64), (4, 32), (8, 64), (3, 64)):
        for head in (64, 128):
            how = attention_reads(bits, group, head, getattr(mx, dtype))
            verdict = {"views": "runs over the cache's slices (mlx-lm's cache and this package's)",
                       "copies": "runs over contiguous copies only (this package's cache, not mlx-lm's)"}.get(
                           how, "refused: " + how)
            print(f"{dtype} bits {bits} group {group:3d} head {head:3d}: {verdict}", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "table":  # python scripts/eval_kv.py table FILE.json ...
        print(markdown(argv[1:]))
        return 0
    if argv and argv[0] == "probe":  # python scripts/eval_kv.py probe [DTYPE]
        return probe(argv[1] if len(argv) > 1 else "float16")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("quality", "bytes", "speed"))
    ap.add_argument("--model", default=None, help="default model, a PyPI model name, or an mlx-lm folder")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this geometry instead")
    ap.add_argument("--layers", type=int, default=0, help="with --shape: this many layers")
    ap.add_argument("--dtype", default=None, help="weights dtype (default: the platform's; bfloat16 for --shape)")
    ap.add_argument("--caches", default=None, help="comma-separated cache names")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--attention", choices=("quantized", "dequantized"), default="quantized",
                    help="quality: read the quantized caches through mlx-lm's quantized attention, or hand "
                         "float attention their dequantized codes (same codes; several times faster on a CPU)")
    ap.add_argument("--check-tokens", type=int, default=256,
                    help="with --attention dequantized: score this many tokens both ways (0: no check)")
    ap.add_argument("--check-caches", default="affine-4-g64,kv-4-g64", help="caches of that check")
    ap.add_argument("--tokens", default="2048,8192", help="bytes: cache lengths")
    ap.add_argument("--contexts", default="1024,4096", help="speed: context lengths")
    ap.add_argument("--steps", type=int, default=32, help="speed: timed decode steps")
    ap.add_argument("--repeats", type=int, default=1, help="speed: rounds over the caches")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny windows, few steps")
    ap.add_argument("--out", default=None, help="JSON output (default under benchmarks/results/)")
    ap.add_argument("--resume", action="store_true",
                    help="quality: keep the rows already in --out (same code commit, model and settings) and "
                         "measure the other caches; the float cache is rerun as the KL reference and must match")
    args = ap.parse_args(argv)
    if args.shape and args.model:
        ap.error("give --model or --shape, not both")
    if args.quick:
        args.window, args.windows, args.steps = 256, 1, 4
        args.tokens, args.contexts = "256,512", "128,256"
        if args.shape and not args.layers:
            args.layers = 2
    args.tokens_list = [int(x) for x in args.tokens.split(",")]
    args.contexts_list = [int(x) for x in args.contexts.split(",")]
    args.caches = args.caches or {"quality": DEFAULT_QUALITY, "bytes": DEFAULT_BYTES, "speed": DEFAULT_SPEED}[args.part]
    if args.window < 2 or args.windows < 1 or args.chunk < 1:
        ap.error("--window >= 2, --windows >= 1 and --chunk >= 1 are needed")

    from gearbx_mlx.kvcache.measure import spec

    for name in args.caches.split(","):
        try:
            spec(name, check_only=True)
        except ValueError as e:
            ap.error(str(e))

    model, tok, label = load_model(args, materialize=args.part != "bytes")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        f"kv_{args.part}_{(args.shape or label).replace(' ', '_')}{'_quick' if args.quick else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "python scripts/eval_kv.py " + " ".join(argv if argv is not None else sys.argv[1:])
    earlier: List[Dict[str, Any]] = []
    args.resume_rows = None
    if args.resume:
        if args.part != "quality":
            ap.error("--resume is for the quality part")
        saved = resumable(path, label, args)
        args.resume_rows = saved["quality"]["rows"]
        earlier = saved.get("earlier_runs", []) + [
            {k: saved[k] for k in ("command", "date", "machine")} | {"caches": [r["cache"] for r in args.resume_rows]}]

    host = machine()  # at the start: the code that runs is the code of this moment

    def write(result: Dict[str, Any]) -> None:
        out = {"command": command, "date": started, "model": label, "machine": host, args.part: result}
        if earlier:
            out["earlier_runs"] = earlier  # the rows kept by --resume were measured by these
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        os.replace(tmp, path)

    if args.part == "quality":
        result = part_quality(args, model, tok, write)
    elif args.part == "bytes":
        result = part_bytes(args, model)
    else:
        result = part_speed(args, model)
    write(result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
