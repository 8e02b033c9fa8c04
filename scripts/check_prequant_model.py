"""Perplexity of the pre-quantized default model (``--model smollm2-135m-q4``).

Usage: python scripts/check_prequant_model.py [--tokens 2048] [--window 512]
Scores the first N tokens of gensim's lee_background.cor in windows of 512,
as scripts/check_default_model.py does for the float model,
with the GGUF's Q4_1 weights kept as MLX quantized layers (group 32). Also
prints a greedy chat answer. Writes benchmarks/results/prequant_ppl.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import generate, load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_default_model import RESULTS  # noqa: E402

from gearbx_mlx.chat import apply_chat_template  # noqa: E402
from gearbx_mlx.evaluation.perplexity import windowed_perplexity as perplexity  # noqa: E402
from gearbx_mlx.sources.models import corpus_path, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-q4", "smollm2-135m"])
    args = ap.parse_args()
    rows = []
    for name in args.models:
        model, tok = load(resolve_model(name))
        chat = apply_chat_template(tok, "What is the capital of France?")
        answer = generate(model, tok, chat, max_tokens=30)
        ids = tok.encode(corpus_path().read_text())[: args.tokens + 1]
        tic = time.perf_counter()
        ppl = perplexity(model, ids, args.window)
        rows.append({"model": name, "perplexity": ppl, "tokens": len(ids) - 1, "window": args.window,
                     "seconds": time.perf_counter() - tic, "greedy_answer": answer})
        print(f"{name:>16}  ppl {ppl:8.3f}  ({rows[-1]['seconds']:.0f} s)  {answer!r}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"command": "python scripts/check_prequant_model.py --tokens "
                      f"{args.tokens} --window {args.window} --models {' '.join(args.models)}",
           "machine": f"{platform.machine()} (MLX {mx.__version__}, device {mx.default_device()})",
           "results": rows}
    (RESULTS / "prequant_ppl.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
