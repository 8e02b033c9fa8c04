#!/usr/bin/env python3
"""How well does entropy predict that the high gear rejects a draft? (teacher-forced)

On the evaluation corpus (gensim's Lee corpus, ``gearbx_mlx.models.corpus_path``)
cut into windows, both the high gear and each drafter (4-bit ``low``, 8-bit
``mid``, every linear and the tied embedding) score every position. A draft
is "rejected" (greedy speculative decoding) where its argmax differs from the
high gear's. Reported per drafter:

* α: greedy agreement, and ``sum min(p, q)`` (the acceptance probability of
  speculative sampling at temperature 1);
* AUC of three scores as predictors of rejection: the drafter's own entropy
  at the position (what the gated drafter reads), the high gear's entropy
  there (not available before verifying: an upper reference), and the
  monitor's predicted entropy (§3.5, fed the high gear's entropies of the
  previous positions: what ``hard_max_draft`` reads);
* agreement below/above the calibrated stops (median and percentile
  strategies of §4 applied to the drafter's entropies) and by entropy decile;
* replayed greedy speculative throughput (in high-gear steps, verify = one
  step) for draft cost c = 0.25/0.5/0.9: fixed k = 1..8 against blocks
  stopped at each decile of draft entropy and at the calibrated stops.

The drafters' weights are MLX-quantized then dequantized to float32 ("fake
quant", the exact values ``QuantizedLinear`` multiplies by; FACTS.md: same
perplexity), so that multi-token products use the fast float path.

Usage: python scripts/draft_auc.py [--tokens 2048] [--window 256]
           [--out benchmarks/results/speculative_auc.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def deciles(scores: Sequence[float], agree: Sequence[bool]) -> List[Dict[str, float]]:
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    out = []
    for d in range(10):
        idx = order[d * len(order) // 10 : (d + 1) * len(order) // 10]
        if idx:
            out.append({"decile": d + 1, "max_entropy": scores[idx[-1]],
                        "alpha_greedy": sum(agree[i] for i in idx) / len(idx)})
    return out


def sweep(agree: Sequence[bool], draft_h: Sequence[float]) -> Dict[str, Any]:
    """Fixed k = 1..8 against entropy-stopped blocks (k <= 8) at each decile of draft entropy."""
    from gearbx_mlx.draft_calibration import replay_speedup

    qs = sorted(draft_h)
    out: Dict[str, Any] = {}
    for c in (0.25, 0.5, 0.9):
        fixed = {k: replay_speedup(agree, draft_h, c, k) for k in range(1, 9)}
        gated = {}
        for d in range(1, 10):
            stop = qs[d * len(qs) // 10]
            gated[f"p{10 * d}"] = {"stop_bits": stop, "speedup": replay_speedup(agree, draft_h, c, 8, stop)}
        best_k = max(fixed, key=fixed.get)
        best_g = max(gated, key=lambda q: gated[q]["speedup"])
        out[f"c={c}"] = {"fixed": fixed, "gated_k8": gated, "best_fixed_k": best_k,
                         "best_fixed": fixed[best_k], "best_gated": best_g,
                         "best_gated_speedup": gated[best_g]["speedup"]}
    return out


def predicted_entropies(high: Sequence[float], window_starts: Sequence[int], vocab: int) -> List[float]:
    """The monitor's look-ahead before each position, fed the previous high entropies."""
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.entropy import EntropyMonitor

    mon = EntropyMonitor(vocab, GearboxConfig())
    starts = set(window_starts)
    out, last = [], math.nan
    for i, h in enumerate(high):
        if i in starts:
            mon.reset()
            last = math.nan
        out.append(last)
        last = mon.push(h).predicted
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative_auc.json"))
    p.add_argument("--dump", help="also write the per-position statistics (JSON) here")
    args = p.parse_args(argv)

    import mlx.core as mx

    import gearbx_mlx
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.draft import build_draft
    from gearbx_mlx.draft_calibration import DraftStats, auc, compare_logits, replay_speedup, stop_threshold
    from gearbx_mlx.models import corpus_path

    model, tok, gb = gearbx_mlx.load(config=GearboxConfig(scope="all"))
    ids = tok.encode(corpus_path().read_text(encoding="utf-8", errors="replace"))[: args.tokens]
    drafts = {g: build_draft(model, gb, g, quantizer="fake") for g in ("low", "mid")}
    stats = {g: DraftStats() for g in drafts}
    starts = []
    tic = time.perf_counter()
    for start in range(0, len(ids) - 1, args.window):
        chunk = ids[start : start + args.window]
        starts.append(start)
        x = mx.array(chunk)[None]
        high = model(x)[0]
        mx.eval(high)
        for g, d in drafts.items():
            stats[g].extend(compare_logits(high, d(x)[0]))
        print(f"  {start + len(chunk)}/{len(ids)} tokens, {time.perf_counter() - tic:.0f} s",
              file=sys.stderr, flush=True)

    result: Dict[str, Any] = {"model": gb.model_name, "corpus": "gensim lee_background.cor",
                              "tokens": len(ids), "window": args.window, "quantizer": "fake (MLX affine, group 64)",
                              "drafters": {}}
    for g, st in stats.items():
        rejected = [not a for a in st.agree]
        pred = predicted_entropies(st.high_entropy, starts, gb.vocab_size)
        keep = [i for i, v in enumerate(pred) if not math.isnan(v)]
        r: Dict[str, Any] = {"bits": drafts[g].bits, **st.summary(),
                             "auc_predicted_entropy": auc([pred[i] for i in keep], [rejected[i] for i in keep]),
                             "median_draft_entropy": statistics.median(st.draft_entropy),
                             "by_draft_entropy_decile": deciles(st.draft_entropy, st.agree)}
        r["simulated_speedup"] = sweep(st.agree, st.draft_entropy)
        for c, sw in r["simulated_speedup"].items():
            print(f"  {g} {c}: best fixed k={sw['best_fixed_k']} x{sw['best_fixed']:.3f}; "
                  f"best gated stop at {sw['best_gated']} x{sw['best_gated_speedup']:.3f}")
        for strategy in ("median", "percentile"):
            stop = stop_threshold(st.draft_entropy, strategy, gb.vocab_size)
            below = [a for h, a in zip(st.draft_entropy, st.agree) if h <= stop]
            above = [a for h, a in zip(st.draft_entropy, st.agree) if h > stop]
            r[f"stop_{strategy}"] = {"stop_bits": stop, "fraction_above": len(above) / st.n,
                                     "alpha_below": sum(below) / max(len(below), 1),
                                     "alpha_above": sum(above) / len(above) if above else None,
                                     "simulated_speedup_k8": {
                                         f"c={c}": replay_speedup(st.agree, st.draft_entropy, c, 8, stop)
                                         for c in (0.25, 0.5, 0.9)}}
        result["drafters"][g] = r
        print(f"{g} ({r['bits']}-bit): α greedy {r['alpha_greedy']:.3f}, sampled {r['alpha_sampled']:.3f}; "
              f"AUC draft entropy {r['auc_draft_entropy']:.3f}, high entropy {r['auc_high_entropy']:.3f}, "
              f"predicted {r['auc_predicted_entropy']:.3f}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.dump:
        Path(args.dump).write_text(json.dumps({g: vars(st) for g, st in stats.items()}))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
