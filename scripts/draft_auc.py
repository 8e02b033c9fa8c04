#!/usr/bin/env python3
"""How well does entropy predict that the high gear rejects a draft? (teacher-forced)

On the evaluation corpus (gensim's Lee corpus, ``gearbx_mlx.sources.models.corpus_path``)
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
quant", the exact values ``QuantizedLinear`` multiplies by; the tests check
the two agree), so that multi-token products use the fast float path.

Also reported: each gear's perplexity on the same windows (every position
with a next token in the text), a cheap check of the drafters' quality.

``--model`` takes what ``python -m gearbx_mlx.generate --model`` takes
(default: the default model; ``qwen2.5-coder-0.5b``: the second real model
from PyPI); the result goes to ``speculative_auc.json`` for the default model
and ``speculative_auc_<model>.json`` otherwise.

Usage: python scripts/draft_auc.py [--model NAME] [--tokens 2048] [--window 256]
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
RESULTS = ROOT / "benchmarks" / "results"

#: llama.cpp's ``general.file_type`` values for the sources we meet.
GGUF_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 15: "Q4_K_M", 17: "Q5_K_M", 18: "Q6_K"}


def default_out(model: Optional[str]) -> Path:
    from gearbx_mlx.sources.models import DEFAULT_MODEL

    if model is None or model == DEFAULT_MODEL:
        return RESULTS / "speculative_auc.json"
    name = Path(model).name if Path(model).expanduser().exists() else model.replace("/", "_")
    return RESULTS / f"speculative_auc_{name}.json"


def source_notes(folder: Path) -> Dict[str, Any]:
    """Where the converted weights came from, and the caveat for a quantized source."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    src = cfg.get("gearbx_source")
    if not src:
        return {}
    ftype = GGUF_FILE_TYPES.get(src.get("file_type"), src.get("file_type"))
    out: Dict[str, Any] = {"source": {**src, "file_type_name": ftype, "model_type": cfg.get("model_type"),
                                      "dtype": cfg.get("torch_dtype")}}
    if ftype not in ("F32", "F16", None):
        out["notes"] = [
            f"The source GGUF is already quantized ({ftype}); the high gear is its dequantization to "
            f"{cfg.get('torch_dtype')}, not the original float model. The drafters re-quantize those "
            "already-quantized weights (MLX affine, group 64), which compounds error (GEARBX §13.3): "
            "α here measures agreement with the dequantized GGUF, and is likely lower than against a "
            "float source.",
        ]
        if "awq" in str(src.get("gguf", "")).lower():
            out["notes"].append(
                "The GGUF was made from an AWQ (4-bit) release: its weights were quantized twice before "
                "the drafters quantize them a third time."
            )
    return out


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
    from gearbx_mlx.speculative.calibration import replay_speedup

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


def iid_speedup(alpha: float, c: float, k: int) -> float:
    """The closed-form model: (1 - α^(k+1)) / ((1 - α)(k·c + 1)), acceptances independent."""
    accepted = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return accepted / (k * c + 1)


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
    p.add_argument("--model", help="as generate's --model (default: the default model)")
    p.add_argument("--dtype", help="of a converted model (default: the platform's)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out", help="default: benchmarks/results/speculative_auc[_<model>].json")
    p.add_argument("--dump", help="also write the per-position statistics (JSON) here")
    args = p.parse_args(argv)

    import mlx.core as mx

    import gearbx_mlx
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.sources.models import corpus_path, resolve_model
    from gearbx_mlx.speculative.calibration import DraftStats, auc, compare_logits, replay_speedup, stop_threshold
    from gearbx_mlx.speculative.draft import build_draft

    out_path = Path(args.out) if args.out else default_out(args.model)
    model, tok, gb = gearbx_mlx.load(args.model, dtype=args.dtype, config=GearboxConfig(scope="all"))
    folder = resolve_model(args.model, args.dtype)  # cached by now
    ids = tok.encode(corpus_path().read_text(encoding="utf-8", errors="replace"))[: args.tokens]
    drafts = {g: build_draft(model, gb, g, quantizer="fake") for g in ("low", "mid")}
    stats = {g: DraftStats() for g in drafts}
    nll = {g: 0.0 for g in ("high", *drafts)}
    scored = 0
    starts = []
    tic = time.perf_counter()

    def nll_sum(logits: mx.array, targets: mx.array) -> float:
        lg = logits[: targets.size].astype(mx.float32)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        return -mx.take_along_axis(lp, targets[:, None], axis=-1).sum().item()

    for start in range(0, len(ids) - 1, args.window):
        chunk = ids[start : start + args.window]
        starts.append(start)
        x = mx.array(chunk)[None]
        targets = mx.array(ids[start + 1 : start + len(chunk) + 1])
        high = model(x)[0]
        mx.eval(high)
        nll["high"] += nll_sum(high, targets)
        for g, d in drafts.items():
            dl = d(x)[0]
            stats[g].extend(compare_logits(high, dl))
            nll[g] += nll_sum(dl, targets)
        scored += targets.size
        print(f"  {start + len(chunk)}/{len(ids)} tokens, {time.perf_counter() - tic:.0f} s",
              file=sys.stderr, flush=True)

    result: Dict[str, Any] = {"model": gb.model_name,
                              "folder": Path(folder).name, **source_notes(Path(folder)),
                              "command": "python scripts/draft_auc.py " + " ".join(sys.argv[1:] if argv is None else argv),
                              "corpus": "gensim lee_background.cor",
                              "tokens": len(ids), "window": args.window, "quantizer": "fake (MLX affine, group 64)",
                              "perplexity": {"positions": scored, **{g: math.exp(v / scored) for g, v in nll.items()}},
                              "seconds": time.perf_counter() - tic,
                              "drafters": {}}
    print("perplexity (windows of %d): " % args.window
          + ", ".join(f"{g} {v:.3f}" for g, v in result["perplexity"].items() if g != "positions"))
    for g, st in stats.items():
        rejected = [not a for a in st.agree]
        pred = predicted_entropies(st.high_entropy, starts, gb.vocab_size)
        keep = [i for i, v in enumerate(pred) if not math.isnan(v)]
        r: Dict[str, Any] = {"bits": drafts[g].bits, **st.summary(),
                             "auc_predicted_entropy": auc([pred[i] for i in keep], [rejected[i] for i in keep]),
                             "median_draft_entropy": statistics.median(st.draft_entropy),
                             "by_draft_entropy_decile": deciles(st.draft_entropy, st.agree)}
        r["simulated_speedup"] = sweep(st.agree, st.draft_entropy)
        # The closed form at the measured α, beside the replay (which keeps the
        # real order of agreements, so runs of easy tokens count).
        r["iid_model_speedup"] = {f"c={c}": {k: iid_speedup(r["alpha_greedy"], c, k) for k in range(1, 9)}
                                  for c in (0.25, 0.5, 0.9)}
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
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    if args.dump:
        Path(args.dump).write_text(json.dumps({g: vars(st) for g, st in stats.items()}))
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
