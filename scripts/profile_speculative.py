#!/usr/bin/env python3
"""Where a speculative block's time goes: host graph building or waiting on the device.

Runs mlx-lm's plain decode and greedy speculative decoding (fixed block
length, no entropy stop) on a random-weight Llama-3-8B-shaped model with the
given drafter kernel, then profiles one speculative run with cProfile: the
model's ``__call__`` cumulative time is the host's graph building; the
generator's own time is mostly spent in ``mx.eval`` waiting for the device.

Usage: python scripts/profile_speculative.py [mlx|packed] [--k 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_speculative as bs  # noqa: E402
import mlx.core as mx  # noqa: E402,F401

from gearbx_mlx.speculative.decode import SpeculativeConfig  # noqa: E402
from gearbx_mlx.speculative.draft import build_draft  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", nargs="?", default="mlx", choices=("mlx", "packed"))
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(bs.SHAPES))
    a = ap.parse_args()
    args = argparse.Namespace(kernel=a.kernel, shape=a.shape, dtype="bfloat16", model=None)
    model, _, gb, name = bs.load_model(args)
    draft = build_draft(model, gb, "low", "all")
    ids = bs.prompt_ids(None, bs.SHAPES[a.shape]["vocab_size"], 1)[0]
    cfg = SpeculativeConfig(max_draft=a.k, draft_entropy_stop=None, draft_gear="low")
    print(f"{name}, drafter kernel {a.kernel}, k={a.k}, device {mx.default_device()}")
    plain = bs.run_plain(model, ids, a.tokens)
    print(f"plain decode: {(plain['tokens'] - 1) / plain['seconds']:.1f} tok/s")
    bs.run_spec(model, draft, gb, ids, 16, cfg)  # warm up
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    r = bs.run_spec(model, draft, gb, ids, a.tokens, cfg)
    prof.disable()
    wall = time.perf_counter() - t0
    print(f"speculative: {(r['tokens'] - 1) / r['seconds']:.1f} tok/s, {r['blocks']} blocks, "
          f"drafted {r['drafted']}, accepted {r['accepted']}, {wall:.3f} s profiled")
    stats = pstats.Stats(prof)
    # The outermost llama __call__ (the Model's) has the largest cumulative time.
    build = max((v[3] for k, v in stats.stats.items()
                 if k[0].endswith("llama.py") and k[2] == "__call__"), default=0.0)
    print(f"host graph building (the model's __call__, cumulative): {build:.3f} s of {wall:.3f} s; "
          "the rest is mostly mx.eval waiting for the device (in the generator's own time)")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
