"""Perplexity of the default model per dtype.

Usage: python scripts/check_default_model.py [--dtypes float32 float16] [--tokens 2048]
Scores the first N tokens of gensim's lee_background.cor in windows of 512
prints a table and writes benchmarks/results/default_model_ppl.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from gearbx_mlx.evaluation.perplexity import windowed_perplexity as perplexity
from gearbx_mlx.sources.models import corpus_path, default_model_path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes:
        model, tok = load(str(default_model_path(dtype)))
        ids = tok.encode(corpus_path().read_text())[: args.tokens + 1]
        tic = time.perf_counter()
        ppl = perplexity(model, ids, args.window)
        rows.append({"dtype": dtype, "perplexity": ppl, "tokens": len(ids) - 1,
                     "window": args.window, "seconds": time.perf_counter() - tic})
        print(f"{dtype:>9}  ppl {ppl:8.3f}  ({rows[-1]['seconds']:.0f} s)", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"command": "python scripts/check_default_model.py " + " ".join(
               f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
           "machine": f"{platform.machine()} {platform.processor() or ''} (MLX {mx.__version__}, "
                      f"device {mx.default_device()})",
           "results": rows}
    (RESULTS / "default_model_ppl.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
