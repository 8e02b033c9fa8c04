"""Prompt and decode speed of the rotated KV cache by where it starts quantizing, in one process.

    python scripts/bench_kv_prefill.py [--tokens 1500] [--rounds 6] [--bits 4] [--model NAME] [--out FILE.json]

One load of the model (the static high gear, so every variant runs the same
weights), one prompt of about ``--tokens`` tokens, and for each variant in a
balanced order every round (``significance.balanced_order``):

* ``float``: no ``kv_bits`` (mlx-lm's float cache);
* ``prompt_end``: ``kv_bits`` alone, the package's default: the prompt is
  processed in float and the whole cache quantized once it is in;
* ``first_token``: ``kv_bits`` with ``quantized_kv_start=0``: every prefill
  chunk attends over the quantized cache.

Records each run's prompt and generation tokens/s (mlx-lm's, from the last
response), the ratios ``prompt_end / first_token`` and ``prompt_end / float``
per round with their medians and 95% bootstrap intervals
(``significance.median_verdict``, against 1.0), the machine's BLAS, load
average and date, to ``--out`` (default ``benchmarks/results/kv_prefill_cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gearbx_mlx.evaluation.significance import balanced_order, median_verdict  # noqa: E402

VARIANTS = ("float", "prompt_end", "first_token")


def kv_kwargs(variant: str, bits: int) -> Dict[str, Any]:
    """mlx-lm's KV keywords of a variant."""
    if variant == "float":
        return {}
    return {"kv_bits": bits} if variant == "prompt_end" else {"kv_bits": bits, "quantized_kv_start": 0}


def one_run(model: Any, tokenizer: Any, gearbox: Any, ids: List[int], variant: str, bits: int,
            max_tokens: int) -> Dict[str, Any]:
    import gearbx_mlx

    last = None
    for last in gearbx_mlx.stream_generate(model, tokenizer, ids, gearbox, max_tokens=max_tokens, policy="high",
                                           **kv_kwargs(variant, bits)):
        pass
    kv = last.run.summary(last)["kv_cache"]
    return {"variant": variant, "prompt_tokens": last.prompt_tokens, "prompt_tps": last.prompt_tps,
            "generation_tokens": last.generation_tokens, "generation_tps": last.generation_tps,
            "quantized_kv_start": kv.get("quantized_kv_start"), "quantized_tokens": kv.get("quantized_tokens")}


def ratios(runs: List[Dict[str, Any]], num: str, den: str, key: str) -> List[float]:
    by_round: Dict[int, Dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["variant"]] = r[key]
    return [v[num] / v[den] for v in by_round.values() if num in v and den in v and v[den] > 0]


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500, help="prompt length, about (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated a run (default %(default)s)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_prefill_cpu.json"))
    args = ap.parse_args(argv)
    if args.tokens < 16 or args.rounds < 1 or args.max_tokens < 2:
        ap.error("--tokens >= 16, --rounds >= 1 and --max-tokens >= 2")
    import mlx.core as mx

    import gearbx_mlx
    from gearbx_mlx.blas import mlx_blas, shown_path

    model, tokenizer, gearbox = gearbx_mlx.load(args.model)
    words = "The tide rises and falls with the moon, and sailors have read it for centuries. "
    ids = tokenizer.encode(words * (args.tokens // 16 + 1))[: args.tokens]
    load_before = os.getloadavg()
    one_run(model, tokenizer, gearbox, ids[:64], "prompt_end", args.bits, 2)  # warm: kernels, allocator
    runs: List[Dict[str, Any]] = []
    for i in range(args.rounds):
        for variant in balanced_order(VARIANTS, i):
            r = {"round": i, **one_run(model, tokenizer, gearbox, ids, variant, args.bits, args.max_tokens)}
            runs.append(r)
            print(f"round {i + 1} {variant:12s} prompt {r['prompt_tps']:8.1f} tok/s, "
                  f"generation {r['generation_tps']:6.2f} tok/s", flush=True)
    out = {"what": "prompt and generation tokens/s, rotated KV cache by where it starts quantizing",
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "mlx": mx.__version__, "blas": shown_path(mlx_blas()),
           "device": str(mx.default_device()), "bits": args.bits, "prompt_tokens": len(ids),
           "max_tokens": args.max_tokens, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           "command": "python scripts/bench_kv_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "runs": runs, "verdicts": {}}
    print(f"{'ratio':40s} {'median':>7s}  95% interval   verdict (against 1.0)")
    for num, den in (("prompt_end", "first_token"), ("prompt_end", "float")):
        for key in ("prompt_tps", "generation_tps"):
            v = median_verdict(ratios(runs, num, den, key), 1.0)
            out["verdicts"][f"{num}/{den} {key}"] = v
            lo, hi = v["interval_95"]
            print(f"{num + '/' + den + ' ' + key:40s} {v['median']:7.3f}  {lo:.3f}-{hi:.3f}    {v['verdict']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
