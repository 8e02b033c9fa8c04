"""The decode targets of the nested gears, judged on the rounds of several runs together.

    python scripts/pool_gpu_decode.py --start E=RUN.json,RUN.json --start F=RUN.json ...
                                      [--variant high=nested-high-grp-blockc-b6] [--resamples 4000] [--out FILE.json]

Reads the JSON of ``scripts/bench_nested_gpu.py`` runs (interleaved rounds of
``bf16``, ``mlx-4``, ``mlx-8`` and the nested gears, ``nested-low/mid/high``
with any suffix; ``--variant GEAR=NAME`` picks one where a run holds several),
grouped by the machine start they ran on. For each gear
and its target (low >= 1.0x MLX 4-bit, mid >= 0.9x MLX 8-bit, high >= 0.9x
bf16), each round's ratio of the gear's tokens/s to its baseline's in the
same round, then per start and over every start: the median, a 95%
bootstrap interval of that median (seeded, ``--resamples`` draws), and the
rounds at or above the target. The verdict accounts for the rounds' spread:
**met** where the whole interval is at or above the target, **missed**
where it is below, else **within noise**. A run without a gear or its
baseline adds no round to it. Prints a table and writes it to ``--out``
(default ``benchmarks/results/nested_gpu_pooled.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gearbx_mlx.evaluation.significance import median_verdict as judge  # noqa: E402

#: gear -> (baseline variant, target ratio)
TARGETS: Dict[str, Tuple[str, float]] = {"low": ("mlx-4", 1.0), "mid": ("mlx-8", 0.9), "high": ("bf16", 0.9)}


def parse_start(text: str) -> Tuple[str, List[Path]]:
    name, sep, files = text.partition("=")
    paths = [Path(f) for f in files.split(",") if f]
    if not sep or not name or not paths:
        raise argparse.ArgumentTypeError(f"a start is NAME=FILE[,FILE...], got {text!r}")
    return name, paths


def round_ratios(path: Path, gear: str, variant: str | None = None) -> List[float]:
    """Each round's tokens/s of the nested gear over its baseline's, in one run: its one
    variant of the gear, or ``variant`` where the run holds it."""
    try:
        runs = json.loads(path.read_text())["decode"]
        rounds = {r["variant"]: [float(v) for v in r["rounds_tok_per_s"]] for r in runs}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SystemExit(f"error: {path}: not a bench_nested_gpu.py result ({err})") from None
    base = rounds.get(TARGETS[gear][0])
    mine = [v for k, v in rounds.items() if k == f"nested-{gear}" or k.startswith(f"nested-{gear}-")]
    if variant in rounds:
        mine = [rounds[variant]]
    if base is None or len(mine) != 1:
        return []
    return [a / b for a, b in zip(mine[0], base) if b > 0]


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", action="append", type=parse_start, required=True,
                    help="NAME=FILE[,FILE...]: the runs of one machine start")
    ap.add_argument("--variant", action="append", default=[], metavar="GEAR=VARIANT",
                    help="the variant pooled for GEAR in runs that hold several (e.g. high=nested-high-grp-blockc)")
    ap.add_argument("--resamples", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "nested_gpu_pooled.json")
    args = ap.parse_args(argv)
    if args.resamples < 100:
        ap.error("--resamples must be at least 100")
    chosen = dict(v.split("=", 1) for v in args.variant if "=" in v)
    if len(chosen) != len(args.variant) or not set(chosen) <= set(TARGETS):
        ap.error(f"--variant takes GEAR=VARIANT with GEAR one of {', '.join(TARGETS)}, got {args.variant}")
    table: Dict[str, Dict[str, Any]] = {}
    print(f"{'gear':>5} {'start':>6} {'rounds':>6} {'median':>7} {'95% interval':>14} {'at target':>9}  verdict")
    for gear, (base, target) in TARGETS.items():
        pooled: List[float] = []
        table[gear] = {"baseline": base, "target": target, "starts": {}}
        for name, paths in args.start:
            ratios = [r for p in paths for r in round_ratios(p, gear, chosen.get(gear))]
            if not ratios:
                continue
            pooled += ratios
            table[gear]["starts"][name] = judge(ratios, target, args.resamples)
        if pooled:
            table[gear]["pooled"] = judge(pooled, target, args.resamples)
        for name, j in [*table[gear]["starts"].items(), *([("all", table[gear]["pooled"])] if pooled else [])]:
            lo, hi = j["interval_95"]
            print(f"{gear:>5} {name:>6} {j['rounds']:>6} {j['median']:>6.3f}x {f'{lo:.3f}-{hi:.3f}x':>14} "
                  f"{j['rounds_at_target']:>4}/{j['rounds']:<4}  {j['verdict']} (target {target}x {base})")
    record = {"what": "nested gears' decode tokens/s over their baselines', per round, pooled by machine start",
              "command": "python scripts/pool_gpu_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "starts": {name: [p.name for p in paths] for name, paths in args.start}, "gears": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
