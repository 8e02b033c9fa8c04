"""How tight are the top-k entropy bounds of the server backend? (§12.3)

Usage: python scripts/check_remote_bounds.py [--top-k 5 10] [--tokens 24]
Starts ``mlx_lm.server`` with the default model on a free local port, asks it
four prompts (greedy) through :class:`gearbx_mlx.remote.RemoteSession`, then
teacher-forces the server's tokens through the same model here and compares
the exact entropy with the trace's lower bound and §12.3's uniform-residual
value (an upper bound). Prints a table, writes
benchmarks/results/remote_entropy_bounds.json. The server is always stopped.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load

from gearbx_mlx import remote
from gearbx_mlx.chat import encode_chat
from gearbx_mlx.entropy import entropy_bits
from gearbx_mlx.remote.openai_client import local_mlx_server
from gearbx_mlx.sources.models import default_model_path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
PROMPTS = ("Name three colours of the rainbow.", "Write a short poem about the sea.",
           "Solve 12*7+5 and explain.", "def fib(n): # complete this Python function")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--top-k", type=int, nargs="+", default=[5, 10])
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    model_dir = str(default_model_path())
    rows = []
    with local_mlx_server(model_dir, start_timeout=120.0) as url:
        model, tok = load(model_dir)
        variants = remote.parse_variants([f"{url},{model_dir}"])
        for k in args.top_k:
            h, lo, up = [], [], []
            for p in PROMPTS:
                s = remote.RemoteSession(variants, 49152, top_k=k, max_tokens=args.tokens, history=False,
                                         stream="off", say=lambda m: None)
                s.ask(p)
                ids = [r["token"] for r in s.records]
                pre = encode_chat(tok, p)
                h += entropy_bits(model(mx.array(pre + ids[:-1])[None])[0, len(pre) - 1:]).tolist()
                lo += [r["entropy"] for r in s.records]
                up += [r["entropy_upper"] for r in s.records]
            h, lo, up = map(np.array, (h, lo, up))
            row = {"top_k": k, "tokens": len(h), "exact_mean": h.mean(), "lower_mean": lo.mean(),
                   "upper_mean": up.mean(), "lower_abs_err": np.abs(h - lo).mean(),
                   "upper_abs_err": np.abs(up - h).mean(), "lower_violations": int((lo > h + 1e-3).sum()),
                   "upper_violations": int((up < h - 1e-3).sum())}
            rows.append({k2: float(v) if isinstance(v, np.floating) else v for k2, v in row.items()})
            print(f"k={k:>2} tokens {len(h)}: exact {h.mean():.3f} bits, lower {lo.mean():.3f} "
                  f"(|err| {row['lower_abs_err']:.3f}), upper/§12.3 {up.mean():.3f} (|err| {row['upper_abs_err']:.3f}), "
                  f"violations {row['lower_violations']}/{row['upper_violations']}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"command": f"python scripts/check_remote_bounds.py --top-k {' '.join(map(str, args.top_k))} "
                      f"--tokens {args.tokens}",
           "machine": f"{platform.machine()} (MLX {mx.__version__}, device {mx.default_device()})",
           "server": "mlx_lm.server 0.32.2, default model (float32), greedy, non-streamed logprobs",
           "prompts": list(PROMPTS), "results": rows}
    (RESULTS / "remote_entropy_bounds.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
