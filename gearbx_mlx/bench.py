"""``python -m gearbx_mlx.bench``: what gearbx_mlx buys on this machine, in one table and one JSON file.

The command line over :mod:`gearbx_mlx.evaluation.bench` (the measurements)
and :mod:`gearbx_mlx.evaluation.bench_report` (the table, the comparison).
``--compare A.json B.json`` prints two runs side by side and measures
nothing. The JSON layout is documented in docs/BENCHMARKS.md ("The bench
JSON"); attach the file to a bug report.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence, Tuple

from . import launch
from .atomicfile import check_target
from .blas import ensure_fast_blas
from .console import USER_ERRORS, CommandParser, exit_status, show_warning
from .evaluation.bench import (
    MIN_RUN_TOKENS,
    QUICK,
    SHAPES,
    WARMUP_TOKENS,
    BenchSettings,
    environment_command,
    load_subject,
    run_bench,
)
from .evaluation.bench_report import format_compare, format_result, load_result
from .jsonsafe import dumps

DEFAULT_OUT = "gearbx-bench.json"


def build_parser() -> argparse.ArgumentParser:
    d = BenchSettings()
    p = CommandParser(
        prog="python -m gearbx_mlx.bench",
        description="Measure decode speed on this machine: plain decoding, every static gear with MLX's and the "
                    "packed kernels, the dynamic policy (separate and nested store), speculative decoding (fixed "
                    "and gated blocks, the automatic decision, with the draft and verify costs and acceptance "
                    "measured here), memory. Prints a table and writes JSON.",
    )
    p.add_argument("--model", help="mlx-lm folder or hub id (default: the default model)")
    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="a random-weight llama of this shape instead (speed only: acceptance and entropy of random "
                        "weights are not a real model's)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="dtype of the default model's conversion (default: float32 on a Linux CPU, float16 elsewhere), "
                        "or of a --shape's weights (default bfloat16)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run for CI: {QUICK.tokens} tokens, {QUICK.rounds} round, one fixed block length, "
                        f"the packed kernels alone, a {QUICK.budget_s:.0f} s budget that set-up shares with the runs; "
                        "about a CPU-minute of work after loading the model, so several minutes of wall time on a "
                        "busy machine, whose runs overrun the budget (each decodes at least "
                        f"{MIN_RUN_TOKENS} tokens): 31 s on two quiet CPUs, 286 s at load average 17 "
                        "(docs/BENCHMARKS.md)")
    p.add_argument("--tokens", type=int, help=f"decode tokens per run (default {d.tokens})")
    p.add_argument("--rounds", type=int, help=f"passes over every configuration (default {d.rounds})")
    p.add_argument("--ks", type=int, nargs="+", help=f"fixed block lengths to run (default {' '.join(map(str, d.ks))})")
    p.add_argument("--max-draft", type=int, help=f"block cap of the automatic decision (default {d.max_draft})")
    p.add_argument("--draft-gear", choices=("low", "mid"), help="the drafter's gear (default low)")
    p.add_argument("--scope", choices=("attention", "all"), help=f"layers the gears manage (default {d.scope})")
    p.add_argument("--kernels", nargs="+", choices=("mlx", "packed"), help="quantized kernels of the gear rows")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help=f"the whole run's time (default {d.budget_s:.0f}): each timed run stops after --tokens or "
                        "its share of the time left, so a slow machine decodes fewer tokens per run")
    p.add_argument("--no-budget", action="store_true", help="no time limit: every run decodes --tokens")
    warm = p.add_mutually_exclusive_group()
    warm.add_argument("--warmup", dest="warmup", action="store_const", const=True, default=None,
                      help=f"run every row once, untimed ({WARMUP_TOKENS} tokens), before the timed rounds "
                           "(default: on a GPU, where a first use compiles kernels)")
    warm.add_argument("--no-warmup", dest="warmup", action="store_const", const=False,
                      help="no warm-up runs: the first round also times each path's first use")
    p.add_argument("--no-nested", action="store_true", help="skip the nested store")
    p.add_argument("--no-calibrate", action="store_true", help="skip the calibrated decision's row")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="FILE.json",
                   help=f"where the JSON goes (default {DEFAULT_OUT})")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two results side by side and exit")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The settings the flags ask for: ``--quick`` or the defaults, then each flag given."""
    base = QUICK if args.quick else BenchSettings()
    changes = {k: v for k, v in {
        "tokens": args.tokens, "rounds": args.rounds, "ks": tuple(args.ks) if args.ks else None,
        "max_draft": args.max_draft, "draft_gear": args.draft_gear, "scope": args.scope,
        "kernels": tuple(args.kernels) if args.kernels else None, "budget_s": args.budget, "warmup": args.warmup,
    }.items() if v is not None}
    if args.no_budget:
        changes["budget_s"] = None
    if args.no_nested:
        changes["nested"] = False
    if args.no_calibrate:
        changes["calibrate"] = False
    return dataclasses.replace(base, **changes)


def check_args(args: argparse.Namespace) -> Tuple[BenchSettings, Path]:
    """Every flag checked before anything slow: the settings and the JSON's path, or one error naming the flag."""
    if args.model and args.shape:
        raise ValueError("give --model or --shape, not both")
    if args.budget is not None and args.no_budget:  # one of them would be ignored
        raise ValueError("give --budget or --no-budget, not both")
    settings = settings_from(args)
    return settings, check_target(args.out, "--out", example=DEFAULT_OUT)


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch.started()  # Ctrl-C raises KeyboardInterrupt again: this command handles it from here
    args = build_parser().parse_args(argv)
    warnings.showwarning = show_warning
    ensure_fast_blas(argv)  # a program on Linux: restart once with OpenBLAS preloaded, or say how
    try:
        if args.compare:
            a, b = (load_result(p) for p in args.compare)
            print(format_compare(a, b, (Path(args.compare[0]).stem, Path(args.compare[1]).stem)))
            return 0
        settings, out = check_args(args)
        # As the speculative CLI does: MLX-CUDA reads it once, before the first attention call.
        os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
        progress = None if args.quiet else (lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
        if progress:
            progress(f"loading {args.shape or args.model or 'the default model'} ...")
        subject = load_subject(args.model, args.shape, args.dtype, settings.prompt)
        result = run_bench(subject, settings, progress)
        result["command"] = environment_command() if argv is None else "python -m gearbx_mlx.bench " + " ".join(argv)
        out.write_text(dumps(result, indent=1, default=str) + "\n")
        print(format_result(result))
        print(f"wrote {out}: attach it to a bug report, or compare two with --compare A.json B.json",
              file=sys.stderr)
        return 0
    except USER_ERRORS as e:
        return exit_status(e)


if __name__ == "__main__":
    sys.exit(main())
