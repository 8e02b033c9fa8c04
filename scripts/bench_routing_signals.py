"""The routing table: routing signals against random permutations of their own gears, at equal bytes.

Every policy of ``gearbx_mlx.evaluation.routers.SIGNALS`` (lagged entropy,
varentropy, top-1/top-2 margin, last hidden-state norm, a learned logistic
router; the low gear's own entropy and the learned router with a fallback
to the high gear) is calibrated on one text to spend the bytes of static
8-bit weights and measured on another text it never saw, beside the
specification's entropy monitor and the static gears. Each row: mean KL to
the loaded weights, bytes relative to static 8-bit, and the paired block
bootstrap 95% interval of its KL minus (a) its random permutations'
expected KL, (b) a position rule's at its bytes, (c) static 8-bit's; the
permutation test's p over 200 permutations. Method:
``gearbx_mlx.evaluation.signal_study``.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      python scripts/bench_routing_signals.py [--model qwen2.5-coder-0.5b] [--tokens 512] \\
      [--out benchmarks/results/routing_signals_smollm2-135m.json]

Defaults: calibration text gensim's ``lee.cor``, evaluation text gensim's
``lee_background.cor`` (different documents), 512 tokens of each in windows
of 256.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import List, Optional, Sequence

from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.console import error_line
from gearbx_mlx.evaluation.machine import load_average, write_result
from gearbx_mlx.evaluation.routers import SIGNALS, signal_policy
from gearbx_mlx.evaluation.signal_study import GearLayers, measure_gears, real_runs
from gearbx_mlx.evaluation.signal_table import format_table, routing_table, state_values
from gearbx_mlx.evaluation.specs import ModelLayout, PolicySpec
from gearbx_mlx.evaluation.teacher import split_windows, stderr_progress
from gearbx_mlx.evaluation.text import read_text, text_tokens
from gearbx_mlx.gearbox import vocab_size_of
from gearbx_mlx.generation import load
from gearbx_mlx.sources.models import corpus_path


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model name or folder (default: the default model)")
    p.add_argument("--text", metavar="FILE", help="evaluation text (default: gensim's lee_background.cor)")
    p.add_argument("--calibration-text", metavar="FILE", help="calibration text (default: gensim's lee.cor)")
    p.add_argument("--tokens", type=int, default=512, help="tokens of each text (default 512)")
    p.add_argument("--window", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--signals", default=",".join(SIGNALS), help=f"comma-separated policies (default: all of "
                   f"{', '.join(SIGNALS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the permutations and the bootstrap (default 0)")
    p.add_argument("--max-positions", type=int, default=128, help="positions per forward pass (default 128)")
    p.add_argument("--real-runs", metavar="POLICY", action="append", default=[],
                   help="also run POLICY's gears and --real-permutations permutations of them for real (every "
                   "position's keys and values from its own gear), to check re-selection; repeatable")
    p.add_argument("--real-permutations", type=int, default=5, help="permutations run for real (default 5)")
    low = p.add_mutually_exclusive_group()
    low.add_argument("--packed", action="store_true",
                     help="run each quantized gear on MLX's quantized layers (less memory, several times slower on "
                     "a CPU) instead of a float copy beside the model")
    low.add_argument("--in-place", action="store_true",
                     help="quantize each gear's float weights in place and read the loaded ones back from the model "
                     "folder after it (no copy beside the model; as fast as the copy)")
    p.add_argument("--out", metavar="FILE.json", help="write the table as JSON")
    args = p.parse_args(argv)
    args.signals = [s.strip() for s in args.signals.split(",") if s.strip()]
    if not args.signals:
        raise ValueError("--signals is empty: name at least one policy")
    for s in args.signals:
        try:
            signal_policy(s)
        except ValueError as e:
            raise ValueError(f"--signals: {e}") from None
    for s in args.real_runs:
        try:
            signal_policy(s)
        except ValueError as e:
            raise ValueError(f"--real-runs: {e}") from None
    if args.real_permutations < 1:
        raise ValueError(f"--real-permutations must be >= 1, got {args.real_permutations}")
    if args.tokens < 2 * args.window or args.window < 2:
        raise ValueError(f"--tokens ({args.tokens}) must hold at least two --window ({args.window}) windows, "
                         "window >= 2")
    if args.max_positions < 1:
        raise ValueError(f"--max-positions must be >= 1, got {args.max_positions}")
    return args


def windows_of(tokenizer, text: str, source: str, tokens: int, window: int) -> list:
    ids = text_tokens(tokenizer, text, tokens)
    if len(ids) < 2 * window:
        raise ValueError(f"{source} has {len(ids)} tokens: fewer than two windows of {window}")
    return split_windows(ids, window)


def run(args: argparse.Namespace, argv: List[str]) -> int:
    load_before = load_average()
    tic = time.perf_counter()
    cal_text, cal_info = read_text(args.calibration_text or str(corpus_path("lee")))
    eval_text, eval_info = read_text(args.text)
    if cal_info["sha256"] == eval_info["sha256"]:
        raise ValueError("--calibration-text and --text are the same file: the evaluation text must be unseen")
    model, tokenizer, gearbox = load(args.model)
    config = GearboxConfig(kernel="mlx")
    vocab = vocab_size_of(model, tokenizer)
    layout = ModelLayout.of(model, config, vocab)
    costs = {g: layout.bytes_per_token(PolicySpec(f"static-{g}/all", "static", "all", g), g)
             for g in ("low", "mid", "high")}
    cal_windows = windows_of(tokenizer, cal_text, cal_info["source"], args.tokens, args.window)
    eval_windows = windows_of(tokenizer, eval_text, eval_info["source"], args.tokens, args.window)
    layers = GearLayers(args.packed, gearbox.model_dir if args.in_place else None)
    if args.in_place and gearbox.model_dir is None:
        raise ValueError("--in-place needs a model loaded from a folder of safetensors")
    cal = measure_gears(model, cal_windows, layout, config, args.max_positions, stderr_progress, layers)
    ev = measure_gears(model, eval_windows, layout, config, args.max_positions, stderr_progress, layers)
    table = routing_table(cal, ev, costs, vocab, args.signals, args.seed, config=config)
    print(format_table(table))
    table["real_runs"] = {}
    for name in args.real_runs:
        row = next((r for r in table["rows"] if r["name"] == name), None)
        if row is None:
            raise ValueError(f"--real-runs {name}: not among --signals")
        real = real_runs(model, eval_windows, layout, config, vocab, row["trace"], args.real_permutations, args.seed)
        real["reselected_mean_kl"] = [float(state_values(s, ev)["kl"].mean()) for s in real["sequences"]]
        table["real_runs"][name] = real
        print(f"{name} run for real: KL {real['mean_kl'][0]:.4f} vs its permutations "
              + ", ".join(f"{x:.4f}" for x in real["mean_kl"][1:])
              + f" (re-selected {real['reselected_mean_kl'][0]:.4f} vs "
              + ", ".join(f"{x:.4f}" for x in real["reselected_mean_kl"][1:]) + ")")
    print("beats its random permutations (both tests, 95%):", ", ".join(table["beats_random"]) or "none")
    if args.out:
        table.update(
            model=str(gearbox.model_dir or args.model), vocab_size=vocab,
            texts={"calibration": {**cal_info, "tokens": len(cal_windows) * args.window},
                   "evaluation": {**eval_info, "tokens": len(eval_windows) * args.window}},
            window=args.window, layers={"packed": args.packed, "in_place": args.in_place}, scored_positions=ev.positions, seconds=time.perf_counter() - tic,
        )
        cmd = "python scripts/bench_routing_signals.py " + shlex.join(argv)
        write_result(args.out, table, cmd, load_before)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(parse(argv), argv)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(error_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
