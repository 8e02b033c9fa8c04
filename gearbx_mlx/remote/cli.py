"""``python -m gearbx_mlx.remote``: route prompts across OpenAI-compatible servers.

The command line over :mod:`gearbx_mlx.remote.session`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import launch
from ..atomicfile import check_target
from ..config import ANSI_RESET, GEAR_ANSI, GearboxConfig
from ..console import CommandParser, add_color_arg, check_flag, error_line, finite, read_stdin_text, use_color
from ..telemetry.trace import TraceWriter
from .session import DEFAULT_TOP_K, RemoteSession, SessionOptions, parse_variants, resolve_vocab_size
from .transport import Limits


# -- command line ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m gearbx_mlx.remote",
        description="Chat with OpenAI-compatible servers (mlx-lm, Ollama, llama.cpp), routing each "
        "prompt to a variant and recording per-token entropy bounds from top_logprobs.",
    )
    p.add_argument("--variant", action="append", default=[], metavar="[GEAR=]URL[,MODEL]",
                   help="a server variant for gear low/mid/high (repeat); without GEAR it serves every gear")
    p.add_argument("--prompt", "-p", action="append", default=[],
                   help="a prompt (repeat for a session); '-' reads one prompt per line from stdin")
    p.add_argument("--system-prompt")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, dest="top_logprobs",
                   help=f"top_logprobs to ask for per token (default {DEFAULT_TOP_K}; mlx-lm allows <= 11)")
    p.add_argument("--vocab-size", type=int,
                   help="the model's vocabulary size (default: from the model folder's config)")
    p.add_argument("--stream", choices=("auto", "on", "off"), default="auto",
                   help="auto: stream, and ask again without streaming if the server streams no logprobs")
    p.add_argument("--no-history", action="store_true", help="send each prompt alone")
    p.add_argument("--thresholds", nargs=2, type=float, metavar=("LOW", "HIGH"),
                   help="entropy thresholds in bits of this model (default: scaled, §3.4)")
    p.add_argument("--window", type=int, default=GearboxConfig.window)
    p.add_argument("--hysteresis", type=float, default=GearboxConfig.hysteresis)
    p.add_argument("--min-gear-duration", type=int, default=GearboxConfig.min_gear_duration)
    p.add_argument("--connect-timeout", type=float, default=Limits.connect_timeout, help="seconds to reach a server")
    p.add_argument("--timeout", type=float, default=Limits.idle_timeout,
                   help="seconds a server may go without progress (a whole event, or the answer's start; "
                   f"keep-alive comments do not count) (default {Limits.idle_timeout:g})")
    p.add_argument("--deadline", type=float, default=Limits.deadline,
                   help=f"seconds one answer may take in all (default {Limits.deadline:g})")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (over https, or plain http to this machine)")
    p.add_argument("--allow-plain-http-key", action="store_true",
                   help="send --api-key over plain http to another host too (readable on the way)")
    p.add_argument("--trace", metavar="FILE.jsonl", help="write per-token telemetry as JSON Lines")
    add_color_arg(p)
    p.add_argument("--quiet", action="store_true", help="print the text only")
    return p


def _prompts(args: argparse.Namespace) -> List[str]:
    prompts: List[str] = []
    for p in args.prompt or ["Explain in one paragraph why the sky is blue."]:
        prompts += [line for line in read_stdin_text("prompts").splitlines() if line.strip()] if p == "-" else [p]
    if not prompts or any(not p.strip() for p in prompts):
        raise ValueError("a prompt is empty: pass --prompt TEXT (or '-' with one prompt per line on stdin)")
    return prompts


#: The longest timeout or deadline taken (a year).
MAX_SECONDS = 365 * 86400.0


def check_args(args: argparse.Namespace) -> None:
    """Every flag in its range, before any server is asked (one message naming the flag)."""
    check_flag(args.max_tokens >= 1, "--max-tokens", args.max_tokens, "an integer >= 1")
    for flag, v in (("--timeout", args.timeout), ("--connect-timeout", args.connect_timeout),
                    ("--deadline", args.deadline)):
        # a socket timeout is a C time value: threading and sockets refuse more than ~2**63 ns
        check_flag(finite(v) and 0 < v <= MAX_SECONDS, flag, v, f"a positive number of seconds, at most {MAX_SECONDS:g}")
    check_flag(finite(args.temp) and args.temp >= 0, "--temp", args.temp, "a number >= 0 (0 = greedy)")
    if args.top_p is not None:
        check_flag(finite(args.top_p) and 0 < args.top_p <= 1, "--top-p", args.top_p, "in (0, 1]")
    check_flag(1 <= args.top_logprobs <= 20, "--top-k", args.top_logprobs,
               "in 1..20 (servers cap top_logprobs; mlx-lm at 11)")
    if args.vocab_size is not None:
        check_flag(args.vocab_size >= 2, "--vocab-size", args.vocab_size, "an integer >= 2")
    if args.thresholds:
        low, high = args.thresholds
        if not (finite(low) and finite(high) and 0 <= low < high):
            raise ValueError(f"--thresholds LOW HIGH must be finite with 0 <= LOW < HIGH, got {low} {high}")
    if args.api_key:
        check_flag(args.api_key.strip() == args.api_key and "\n" not in args.api_key, "--api-key", "...",
                   "one line without surrounding spaces")
    if args.trace:
        check_target(args.trace, "--trace")


def _check_thresholds(thresholds: Optional[Sequence[float]], vocab: int) -> None:
    if thresholds and thresholds[1] > math.log2(vocab):
        raise ValueError(
            f"--thresholds HIGH {thresholds[1]:.6g} is above log2({vocab}) = {math.log2(vocab):.3f} bits, "
            "the largest entropy possible: the high gear would be unreachable"
        )


def run(args: argparse.Namespace) -> int:
    check_args(args)
    variants = parse_variants(args.variant)
    vocab, vocab_source = resolve_vocab_size(variants, args.vocab_size)
    _check_thresholds(args.thresholds, vocab)
    prompts = _prompts(args)
    config = GearboxConfig(window=args.window, hysteresis=args.hysteresis, min_gear_duration=args.min_gear_duration)
    sampling = {"temperature": args.temp}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.seed is not None:
        sampling["seed"] = args.seed
    writer = TraceWriter(Path(args.trace).expanduser()) if args.trace else None

    color = use_color(args.color)

    def show(text: str, gear: str) -> None:
        if text.startswith("<|") and text.endswith("|>"):
            return  # an end-of-turn token: the server's text leaves it out too
        print(f"{GEAR_ANSI[gear]}{text}{ANSI_RESET}" if color and text else text, end="", flush=True)

    def record(rec: Dict[str, Any]) -> None:
        if writer:
            writer.token(**rec)
        show(rec["text"] or "", rec["gear"])

    options = SessionOptions(
        top_k=args.top_logprobs, max_tokens=args.max_tokens, sampling=sampling, stream=args.stream,
        system_prompt=args.system_prompt, history=not args.no_history, connect_timeout=args.connect_timeout,
        read_timeout=args.timeout, deadline=args.deadline, api_key=args.api_key,
        allow_plain_http_key=args.allow_plain_http_key,
    )
    session = RemoteSession(variants, vocab, config, tuple(args.thresholds) if args.thresholds else None,
                            on_token=record, on_text=show, say=(lambda m: None) if args.quiet else None,
                            options=options)
    if writer:
        writer.header(**session.header(), vocab_source=vocab_source, prompt_count=len(prompts))
    interrupted, error, code = False, None, 0
    try:
        for prompt in prompts:
            session.ask(prompt)
            print(flush=True)
    except KeyboardInterrupt:
        interrupted, code = True, 130
        print(flush=True)
    except (ConnectionError, ValueError, OSError) as e:
        print(flush=True)
        error, code = " ".join(str(e).split()), 1
        raise
    finally:
        summary = session.summary(interrupted, error)
        if writer:
            writer.summary(**summary)
            writer.close()
        if not args.quiet and summary["generation_tokens"]:  # as generate: no summary of nothing (the error says why)
            _print_summary(summary, session.thresholds)
    return code


def _print_summary(s: Dict[str, Any], thresholds: Tuple[float, float]) -> None:
    n = max(s["generation_tokens"], 1)
    g, v = s["tokens_per_gear"], s["tokens_per_variant"]
    print("=" * 10, file=sys.stderr)
    print(f"Generation: {s['generation_tokens']} tokens over {len(s['prompts'])} prompt(s)", file=sys.stderr)
    print("Variants: " + ", ".join(f"{k} {c}" for k, c in v.items() if c), file=sys.stderr)
    print("Monitor gears (telemetry): " + ", ".join(f"{k} {c} ({100 * c / n:.0f}%)" for k, c in g.items())
          + f"; shifts: {s['shifts']}", file=sys.stderr)
    if s["mean_entropy"] is not None:
        print(f"Entropy: mean lower bound {s['mean_entropy']:.3f} bits, upper {s['mean_entropy_upper']:.3f}; "
              f"thresholds low {thresholds[0]:.3f} / high {thresholds[1]:.3f} bits", file=sys.stderr)
    if s["interrupted"]:
        print("Interrupted.", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch.started()  # Ctrl-C raises KeyboardInterrupt again: this command handles it from here
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConnectionError, ValueError, FileNotFoundError, OSError) as e:
        print(error_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the session started: nothing to summarise
        print("interrupted", file=sys.stderr)
        return 130
