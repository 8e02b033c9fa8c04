#!/usr/bin/env python3
"""Benchmark self-speculative decoding; print a table, write JSON (and a figure).

Rows, all greedy, same prompts, same run:
  high alone (mlx-lm's own decode loop on the loaded model), low/mid alone
  (the drafter in the same loop), speculative with fixed blocks k = 2/4/6
  (``--ks``) and entropy-gated: the block cap and draft-entropy stop that
  ``gearbx_mlx.speculative.calibration.calibrate_draft_stop`` picks (replay of the
  calibration prompts at the step costs measured here). The configurations
  run interleaved, prompt by prompt, so that the drift of a shared machine
  falls on all of them alike.

Also measured:
  * step costs: one high-gear step, one draft step, one verify of k+1 tokens
    (warm cache, synchronous, best and median of ``--reps``);
  * α, the drafter's greedy agreement with the high gear on the high gear's
    own continuations of the prompts (teacher-forced), for real models;
  * the speed-up model ``(1 - α^(k+1)) / ((1 - α)(k·c + 1))`` with c = draft
    step / high step, and a refined one that uses the measured verify cost
    ``v(k)`` (in high steps) instead of 1: ``(1 - α^(k+1)) / ((1 - α)(k·c + v(k)))``.

Models: the default model (``--model``), or a random-weight mlx-lm llama of a
named shape (``--shape smollm2-135m|llama3-8b``; acceptance on random weights
is meaningless, so modeled speed-ups there use ``--alpha`` from a real model).

Usage:
  python scripts/bench_speculative.py [--kernel mlx|packed] [--tokens 64] [--quick]
      [--shape llama3-8b --dtype bfloat16 --alpha low=0.6 mid=0.9]
      [--out benchmarks/results/speculative_<tag>.json] [--plot PATH.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from gearbx_mlx.speculative.calibration import modeled_speedup  # noqa: E402

PROMPTS = (
    "Explain in one paragraph why the sky is blue.",
    "Write the days of the week in order, separated by commas.",
    "Describe a walk along a river on an autumn morning.",
    "What is the capital of France? Answer in one sentence.",
)

SHAPES: Dict[str, Dict[str, Any]] = {
    # A smoke test of this script.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
    # SmolLM2-135M: tied embeddings, vocab 49,152.
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0),
    # Llama-3-8B.
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      tie_word_embeddings=False, rope_theta=500000.0),
}


def machine() -> Dict[str, Any]:
    from importlib.metadata import version

    info = {"platform": platform.platform(), "python": platform.python_version(),
            "mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "device": str(mx.default_device()),
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "MLX_CUDA_USE_CUDNN_SDPA": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", ""),
            "loadavg_start": list(os.getloadavg())}
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, str, float))}
    except Exception:  # older MLX or no GPU
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        info["cpus"] = os.cpu_count()
    except OSError:
        pass
    return info


def load_model(args: argparse.Namespace):
    """``(model, tokenizer or None, gearbox, name)``."""
    import gearbx_mlx
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox

    config = GearboxConfig(kernel=args.kernel, scope="all")
    if args.shape is None:
        model, tok, gb = gearbx_mlx.load(args.model, config=config, dtype=args.dtype)
        return model, tok, gb, gb.model_name
    from mlx_lm.models import llama

    margs = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **SHAPES[args.shape])
    mx.random.seed(0)
    model = llama.Model(margs)
    dtype = getattr(mx, args.dtype or "bfloat16")
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, None, Gearbox(model, config, vocab_size=margs.vocab_size), f"{args.shape} (random {args.dtype or 'bfloat16'})"


def prompt_ids(tok: Any, vocab: int, n: int, length: int = 32) -> List[List[int]]:
    if tok is None:  # random weights: random prompts
        mx.random.seed(1)
        return [mx.random.randint(0, vocab, (length,)).tolist() for _ in range(n)]
    from gearbx_mlx.chat import encode_chat

    return [encode_chat(tok, p) for p in PROMPTS[:n]]


def timed(tokens: Iterable[Any], n: int) -> Dict[str, float]:
    """Decode tokens/s, the first token (prefill) excluded, like mlx-lm."""
    t0 = time.perf_counter()
    first, count = None, 0
    for count, _ in enumerate(tokens, 1):
        if count == 1:
            first = time.perf_counter()
        if count >= n:
            break
    end = time.perf_counter()
    return {"tokens": count, "seconds": end - (first or t0), "prefill_seconds": (first or t0) - t0}


def run_plain(model: Any, ids: Sequence[int], n: int) -> Dict[str, float]:
    from mlx_lm.generate import generate_step

    return timed(generate_step(mx.array(ids), model, max_tokens=n), n)


def run_spec(model: Any, draft: Any, gb: Any, ids: Sequence[int], n: int, config: Any) -> Dict[str, Any]:
    from gearbx_mlx.entropy import EntropyMonitor
    from gearbx_mlx.speculative.decode import SpeculativeStats, single_token_drafts, speculative_generate_step

    stats = SpeculativeStats()
    monitor = EntropyMonitor(gb.vocab_size, gb.config, gb.thresholds)
    steps = speculative_generate_step(mx.array(ids), model, draft, config, max_tokens=n, monitor=monitor,
                                      stats=stats, single_token_drafts=single_token_drafts(gb.config))
    out = timed(steps, n)
    steps.close()
    return {**out, **stats.summary()}


def aggregate(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    tokens = sum(r["tokens"] - 1 for r in runs)  # decode tokens after the first
    seconds = sum(r["seconds"] for r in runs)
    out: Dict[str, Any] = {"tokens_per_second": tokens / seconds if seconds else math.nan,
                           "decode_tokens": tokens, "seconds": seconds}
    if "drafted" in runs[0]:
        drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
        blocks = sum(r["blocks"] for r in runs)
        out.update(acceptance_rate=accepted / drafted if drafted else None,
                   mean_accepted_length=accepted / max(blocks, 1),
                   tokens_per_block=sum(r["tokens"] for r in runs) / max(blocks, 1),
                   mean_drafted_length=drafted / max(blocks, 1),
                   stops={k: sum(r["stops"][k] for r in runs) for k in runs[0]["stops"]})
    return out


def step_costs(model: Any, drafts: Dict[str, Any], ids: Sequence[int], ks: Sequence[int], reps: int) -> Dict[str, Any]:
    """Milliseconds (best, median) of one step of each model and of verifies of k+1 tokens."""
    from gearbx_mlx.speculative.calibration import step_seconds

    def cost(m: Any, n_in: int) -> Dict[str, float]:
        ts = step_seconds(m, ids, n_in, reps)
        return {"best_ms": 1e3 * min(ts), "median_ms": 1e3 * statistics.median(ts)}

    out: Dict[str, Any] = {"high": cost(model, 1)}
    for gear, d in drafts.items():
        out[gear] = cost(d, 1)
    out["verify"] = {str(k): cost(model, k + 1) for k in sorted(set(ks))}
    return out


def continuations(model: Any, prompts: List[List[int]], n: int) -> List[List[int]]:
    """Each prompt followed by the high gear's greedy continuation of ``n`` tokens."""
    from mlx_lm.generate import generate_step

    return [list(ids) + [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=n), range(n))]
            for ids in prompts]


def continuation_stats(model: Any, draft: Any, prompts: List[List[int]], seqs: List[List[int]]) -> Any:
    """The drafter's statistics (``DraftStats``) on the high gear's continuations only."""
    from gearbx_mlx.speculative.calibration import DraftStats, draft_stats

    stats = DraftStats()
    for ids, seq in zip(prompts, seqs):
        full = draft_stats(model, draft, seq, window=len(seq))
        keep = slice(len(ids) - 1, len(seq) - 1)
        stats.extend(DraftStats(full.draft_entropy[keep], full.high_entropy[keep], full.agree[keep],
                                full.accept_prob[keep]))
    return stats


def alpha_teacher_forced(model: Any, draft: Any, prompts: List[List[int]], seqs: List[List[int]]) -> Dict[str, float]:
    """Greedy agreement of the drafter with the high gear on the high gear's continuations."""
    return continuation_stats(model, draft, prompts, seqs).summary()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="mlx-lm folder (default: the default model)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random-weight llama of this shape instead")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16")
    p.add_argument("--kernel", choices=("mlx", "packed"), default="mlx", help="drafter's quantized kernel")
    p.add_argument("--gears", nargs="+", default=["low", "mid"], choices=("low", "mid"))
    p.add_argument("--ks", nargs="+", type=int, default=[2, 4, 6])
    p.add_argument("--max-draft", type=int, default=None, help="block cap of the gated runs (default: calibrated)")
    p.add_argument("--stop", type=float, default=None, help="draft-entropy stop (default: calibrated)")
    p.add_argument("--rounds", type=int, default=1, help="passes over the prompts (configs interleaved)")
    p.add_argument("--hard-max-draft", type=int, default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--alpha", nargs="*", default=[], help="gear=α for modeled speed-ups (random weights)")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    out_path = Path(args.out or ROOT / "benchmarks" / "results" / f"speculative_{args.tag}.json")

    from gearbx_mlx.speculative.calibration import best_replay, calibrate_draft_stop
    from gearbx_mlx.speculative.decode import SpeculativeConfig
    from gearbx_mlx.speculative.draft import build_draft

    model, tok, gb, name = load_model(args)
    drafts = {g: build_draft(model, gb, g) for g in args.gears}
    prompts = prompt_ids(tok, gb.vocab_size, args.prompts)
    result: Dict[str, Any] = {"machine": machine(), "model": name, "kernel": args.kernel,
                              "tokens": args.tokens, "prompts": len(prompts), "rows": [],
                              "memory": {g: d.memory for g, d in drafts.items()}}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    log("step costs ...")
    costs = step_costs(model, drafts, prompts[0], sorted(set(args.ks + [8])), args.reps)
    result["step_costs"] = costs
    high_ms = costs["high"]["best_ms"]

    alphas = {g: float(a) for g, a in (kv.split("=") for kv in args.alpha)}
    result["alpha"] = {}
    seqs: List[List[int]] = []
    if tok is not None:
        log("α: the high gear's continuations, scored by each drafter ...")
        seqs = continuations(model, prompts, args.tokens)
        for g, d in drafts.items():
            result["alpha"][g] = alpha_teacher_forced(model, d, prompts, seqs)
            alphas.setdefault(g, result["alpha"][g]["alpha_greedy"])

    def row(label: str, gear: Optional[str], k: Optional[int], runs: List[Dict[str, Any]]) -> Dict[str, Any]:
        r = {"label": label, "gear": gear, "k": k, **aggregate(runs)}
        base = result["rows"][0]["tokens_per_second"] if result["rows"] else r["tokens_per_second"]
        r["speedup"] = r["tokens_per_second"] / base
        if gear and k and gear in alphas:
            c = costs[gear]["best_ms"] / high_ms
            v = verify[min(k, len(verify) - 1)]
            r.update(alpha=alphas[gear], c=c, v=v, modeled_speedup=modeled_speedup(alphas[gear], k, c),
                     modeled_speedup_verify=modeled_speedup(alphas[gear], k, c, v))
        result["rows"].append(r)
        return r

    # Verify cost in high steps for k = 0..8, linear between the measured points.
    pts = sorted([(0, 1.0)] + [(int(k), v["best_ms"] / high_ms) for k, v in costs["verify"].items()])
    verify = [_interp(pts, k) for k in range(9)]
    result["verify_cost"] = verify

    runners: List[Any] = [("high alone", None, None, lambda ids: run_plain(model, ids, args.tokens))]
    for g, d in drafts.items():
        runners.append((f"{g} alone", g, None, lambda ids, d=d: run_plain(d, ids, args.tokens)))
    for g, d in drafts.items():
        for k in args.ks:
            cfg = SpeculativeConfig(g, max_draft=k)
            runners.append((f"spec {g} k={k}", g, k,
                            lambda ids, d=d, cfg=cfg: run_spec(model, d, gb, ids, args.tokens, cfg)))
        c = costs[g]["best_ms"] / high_ms
        log(f"calibrating the {g} drafter's stop and block cap (replay) ...")
        if tok is not None:
            cal = calibrate_draft_stop(model, d, tok, "replay", cost=(c, verify))
        else:  # random weights: the same replay on the random prompts' continuations
            seqs = seqs or continuations(model, prompts, args.tokens)
            stats = continuation_stats(model, d, prompts, seqs)
            cal = {**stats.summary(), **best_replay(stats, c, verify)}
        result.setdefault("calibration", {})[g] = cal
        stop = args.stop if args.stop is not None else cal["stop_bits"]
        k_max = args.max_draft or cal["max_draft"]
        cfg = SpeculativeConfig(g, max_draft=k_max, draft_entropy_stop=stop, hard_max_draft=args.hard_max_draft)
        label = f"spec {g} gated k<={k_max}" + (f" stop {stop:.2f}" if stop is not None else " no stop")
        runners.append((label, g, None, lambda ids, d=d, cfg=cfg: run_spec(model, d, gb, ids, args.tokens, cfg)))

    log("decode (configurations interleaved, prompt by prompt) ...")
    runs: Dict[str, List[Dict[str, Any]]] = {r[0]: [] for r in runners}
    for rnd in range(args.rounds):
        for ids in prompts:
            for label, _, _, fn in runners:
                runs[label].append(fn(ids))
    for label, gear, k, _ in runners:
        r = row(label, gear, k, runs[label])
        if "gated" in label:
            cal = result["calibration"][gear]
            r.update(stop_bits=cfg_stop(label, args, cal), max_draft=args.max_draft or cal["max_draft"],
                     replayed_speedup=cal.get("replayed_speedup"))
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["draft_forward"] = {g: "host (numpy + C GEMV)" if getattr(d, "host", None) else "mlx"
                               for g, d in drafts.items()}
    result["target"] = target_check(result)
    print_table(result)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    log(f"wrote {out_path}")
    plot(result, Path(args.plot) if args.plot else out_path.with_suffix(".png"))
    return 0


def target_check(result: Dict[str, Any]) -> Dict[str, Any]:
    """The target per drafter: where its gear alone is >= 2x the high gear,
    the gated run must be >= 1.5x the high gear and faster than every fixed k."""
    out: Dict[str, Any] = {}
    rows = result["rows"]
    for g in ("low", "mid"):
        alone = next((r for r in rows if r["label"] == f"{g} alone"), None)
        gated = next((r for r in rows if r["gear"] == g and "gated" in r["label"]), None)
        fixed = [r for r in rows if r["gear"] == g and r["k"]]
        if alone is None or gated is None:
            continue
        best = max(fixed, key=lambda r: r["speedup"]) if fixed else None
        applies = alone["speedup"] >= 2.0
        out[g] = {"gear_alone_speedup": alone["speedup"], "applies": applies,
                  "gated_speedup": gated["speedup"],
                  "best_fixed": best["label"] if best else None,
                  "best_fixed_speedup": best["speedup"] if best else None,
                  # None where the target does not apply (the drafter alone is < 2x).
                  "met": None if not applies else (
                      gated["speedup"] >= 1.5
                      and (best is None or gated["speedup"] > best["speedup"]))}
    return out


def _interp(pts: Sequence[Any], x: float) -> float:
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9)
    return pts[-1][1]


def cfg_stop(label: str, args: argparse.Namespace, cal: Dict[str, Any]) -> Optional[float]:
    return args.stop if args.stop is not None else cal.get("stop_bits")


def print_table(result: Dict[str, Any]) -> None:
    c = result["step_costs"]
    print(f"model {result['model']}, kernel {result['kernel']}, device {result['machine']['device']}")
    print("step ms (best/median): high {:.2f}/{:.2f}; ".format(c["high"]["best_ms"], c["high"]["median_ms"])
          + "; ".join(f"{g} {c[g]['best_ms']:.2f}/{c[g]['median_ms']:.2f}" for g in ("low", "mid") if g in c)
          + "; verify " + ", ".join(f"k={k}: {v['best_ms']:.2f}" for k, v in c["verify"].items()))
    for g, a in result.get("alpha", {}).items():
        print(f"α {g}: greedy {a['alpha_greedy']:.3f}, sampled {a['alpha_sampled']:.3f}, "
              f"AUC(draft entropy -> rejection) {a['auc_draft_entropy']:.3f}")
    print(f"{'run':<28} {'tok/s':>8} {'x high':>7} {'accept':>7} {'acc/blk':>7} {'model':>6} {'model_v':>7}")

    def fmt(r: Dict[str, Any], key: str, width: int) -> str:
        v = r.get(key)
        return f"{'' if v is None else f'{v:.2f}':>{width}}"

    for r in result["rows"]:
        print(f"{r['label']:<28} {r['tokens_per_second']:8.2f} {r['speedup']:7.2f} "
              + " ".join((fmt(r, "acceptance_rate", 7), fmt(r, "mean_accepted_length", 7),
                          fmt(r, "modeled_speedup", 6), fmt(r, "modeled_speedup_verify", 7))))
    for g, t in result.get("target", {}).items():
        print(f"target ({g}): gear alone {t['gear_alone_speedup']:.2f}x (applies: {t['applies']}), gated "
              f"{t['gated_speedup']:.2f}x, best fixed {t['best_fixed']} {t['best_fixed_speedup']:.2f}x -> "
              + ("not applicable (drafter alone < 2x)" if t["met"] is None
                 else "met" if t["met"] else "NOT met"))


def plot(result: Dict[str, Any], path: Path) -> None:
    """Speed vs block length (one line per drafter, gated runs as points), if matplotlib exists."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure", file=sys.stderr)
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="high gear alone")
    for i, g in enumerate(("low", "mid")):
        fixed = [r for r in rows if r["gear"] == g and r["k"]]
        if not fixed:
            continue
        color = f"C{i}"
        ax.plot([r["k"] for r in fixed], [r["speedup"] for r in fixed], "o-", color=color, label=f"{g} drafts, fixed k")
        if "modeled_speedup" in fixed[0]:
            ax.plot([r["k"] for r in fixed], [r["modeled_speedup_verify"] for r in fixed], ":", color=color,
                    label=f"{g}: model (α={fixed[0]['alpha']:.2f}, c={fixed[0]['c']:.2f}, measured v)")
        for r in (r for r in rows if r["gear"] == g and "gated" in r["label"]):
            ax.plot([r["mean_drafted_length"]], [r["speedup"]], "*", ms=12, color=color,
                    label=f"{g} gated (at its mean block length)")
        alone = [r for r in rows if r["label"] == f"{g} alone"]
        if alone:
            ax.axhline(alone[0]["speedup"], color=color, lw=0.8, ls="-.", label=f"{g} gear alone")
    ax.set_xlabel("drafted tokens per block (k)")
    ax.set_ylabel("tokens/s relative to the high gear")
    ax.set_title(f"{result['model']} [{result['kernel']}] on {result['machine']['device']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
