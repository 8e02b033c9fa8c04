"""``python -m gearbx_mlx.generate``: entropy-routed generation from the command line.

Flags follow ``mlx_lm.generate``; the gearbox adds its own. Text streams to
stdout as it is generated; the summary goes to stderr after a separator.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from . import launch
from .atomicfile import check_target
from .blas import ensure_fast_blas
from .calibration import Calibration
from .chat import apply_chat_template
from .config import (
    ANSI_RESET,
    GEAR_ANSI,
    GEARS,
    HIGH_SOURCES,
    KERNELS,
    LOW_QUANTS,
    MAX_WINDOW,
    SCOPES,
    STORES,
    GearboxConfig,
)
from .console import (
    CommandParser,
    add_color_arg,
    check_flag,
    check_utf8,
    error_line,
    finite,
    print_stream,
    read_stdin_text,
    say,
    show_warning,
    use_color,
)
from .distributed.ranks import Ranks, launched_ranks, stage
from .generation import SamplingOptions, check_generation_options, load, past_context, settle_loaded, warm_up
from .kvcache.option import DEFAULT_QUANTIZED_KV_START, ROTATION_CHOICES
from .pipeline import generate as library_generate, prepare
from .record import empty_summary
from .run_summary import format_summary
from .sources.registry import MODEL_HELP
from .speculative.cli import (
    add_sparse_gear_arg,
    add_speculative_args,
    check_sparse_gear_args,
    check_sparse_model,
    check_speculative_args,
    speculative_config,
    use_sparse_gear,
)
from .telemetry.trace import TraceWriter, looks_like_trace, token_record
from .thresholds import check_thresholds, kv_options, set_thresholds

DEFAULT_MAX_TOKENS = 256


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m gearbx_mlx.generate",
        description="Generate text, routing each step through 4-bit, 8-bit or full "
        "precision weights by the entropy of the next-token distribution.",
    )
    g = p.add_argument_group("mlx-lm options")
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--prompt", "-p", default="Explain in one paragraph why the sky is blue.",
                   help="the prompt, or '-' to read it from stdin")
    g.add_argument("--system-prompt", help="system message for the chat template")
    g.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS)
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-chat-template", action="store_true")
    g.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the KV cache to this many bits (rotated per --kv-rotation)")
    g.add_argument("--kv-group-size", type=int, default=None,
                   help="group size for KV cache quantization (default 64; the rotated cache takes 32 on "
                   "models whose k_proj biases put outlying offsets on the keys)")
    g.add_argument("--quantized-kv-start", type=int, default=None,
                   help="when --kv-bits is set, start quantizing the KV cache from this step onwards (default: 0, "
                        f"the first token, for the rotated cache; {DEFAULT_QUANTIZED_KV_START}, mlx-lm's default, "
                        "with --kv-rotation none)")
    g.add_argument("--max-kv-size", type=int, default=None)
    g.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="dtype of the converted default model (default: float32 on a Linux CPU, else float16)")

    r = p.add_argument_group("gearbox options")
    r.add_argument("--scope", choices=SCOPES, default="attention",
                   help="manage attention projections only (paper default) or every linear layer")
    r.add_argument("--kernel", choices=KERNELS, default=GearboxConfig.kernel,
                   help="low/mid gears through MLX's own kernels ('mlx': QuantizedLinear, and the nested store's "
                        "pure-MLX path) or the package's ('packed': C on the CPU, Metal or CUDA on a GPU, for either "
                        "store; each checked against the pure-MLX reference on first use); 'auto' (default): the "
                        "package's where they are built (the C kernels on the CPU, the nested store's fused kernel "
                        "on a GPU), else MLX's. The summary's 'Resolved:' line says what ran and why")
    r.add_argument("--store", choices=STORES, default=GearboxConfig.store,
                   help="where the gears' weights live: 'nested' bit planes that every gear shares (one "
                        "buffer, nothing quantized at a shift) or 'separate' quantized copies per gear "
                        "(default: nested for float weights; an already quantized model stays "
                        "telemetry-only unless --store nested re-expresses its 8-bit layers)")
    r.add_argument("--high", choices=HIGH_SOURCES, default=GearboxConfig.high,
                   help="nested store only: the high gear reads the loaded weights ('original', exact) or "
                        "every plane ('planes': the loaded weights are dropped, all gears in ~1.0x the "
                        f"float16 bytes) (default {GearboxConfig.high})")
    r.add_argument("--low-quant", choices=LOW_QUANTS, default=GearboxConfig.low_quant,
                   help="nested store only: how the low gear (an MLX 4-bit layer) is quantized: 'rtn' "
                        "round-to-nearest, or mlx-lm's own 'awq' (its clipping search), 'gptq' or 'dwq', "
                        "calibrated on the package's text; built once, then read from the planes cache "
                        f"(default {GearboxConfig.low_quant})")
    r.add_argument("--thresholds", nargs=2, type=float, metavar=("LOW", "HIGH"),
                   help="entropy thresholds in bits of this model (no vocabulary scaling)")
    r.add_argument("--calibrate", nargs="?", const="median", choices=("median", "percentile"),
                   help="calibrate thresholds before generating (default strategy: median)")
    r.add_argument("--calibration", metavar="FILE",
                   help="load thresholds from FILE, or save them there with --calibrate")
    r.add_argument("--window", type=int, default=GearboxConfig.window)
    r.add_argument("--hysteresis", type=float, default=GearboxConfig.hysteresis)
    r.add_argument("--min-gear-duration", type=int, default=GearboxConfig.min_gear_duration)
    r.add_argument("--lag", type=int, choices=(0, 1), default=GearboxConfig.lag,
                   help="0: a decision governs the very next forward pass; 1: the one after")
    r.add_argument("--telemetry-only", action="store_true",
                   help="track gears, swap nothing (automatic for pre-quantized models)")
    r.add_argument("--static-gear", choices=GEARS, help="stay in one gear (a baseline)")
    add_sparse_gear_arg(r)
    r.add_argument("--kv-rotation", choices=ROTATION_CHOICES, default="auto",
                   help="with --kv-bits: rotate keys and values before quantizing (srht: random-sign Hadamard, "
                        "srft: random-sign FFT, auto: srht where the head size allows), with per-channel "
                        "scales and key offsets from the --calibration file (else estimated from the weights) "
                        "and more bits for layers with outlying k_proj biases; 'none': mlx-lm's own cache "
                        "(default auto)")
    r.add_argument("--trace", metavar="FILE.jsonl", help="write per-token telemetry as JSON Lines")
    add_color_arg(r)
    r.add_argument("--quiet", action="store_true", help="print the text only, no summary")
    add_speculative_args(p)
    return p


def _read_prompt(args: argparse.Namespace) -> str:
    prompt = read_stdin_text() if args.prompt == "-" else check_utf8(args.prompt, "--prompt")
    if not prompt or not prompt.strip():
        raise ValueError("the prompt is empty: pass --prompt TEXT (or '-' with text on stdin)")
    if args.system_prompt is not None:
        check_utf8(args.system_prompt, "--system-prompt")
    args.user_prompt = prompt  # what the cold-start classifier reads (the templated text is what is encoded)
    return prompt


def gearbox_config(args: argparse.Namespace) -> GearboxConfig:
    return GearboxConfig(
        window=args.window,
        hysteresis=args.hysteresis,
        min_gear_duration=args.min_gear_duration,
        # Speculative decoding drafts from the nested store's planes: build the
        # store over the layers the drafter quantizes, so there is one copy.
        scope=args.scope,
        kernel=args.kernel,
        store=args.store,
        high=args.high,
        low_quant=args.low_quant,
        telemetry_only=args.telemetry_only,
        static_gear=args.static_gear,
        lag=args.lag,
    )


def check_args(args: argparse.Namespace) -> None:
    """Fail on bad input before anything slow happens."""
    if args.max_tokens == 0 or args.max_tokens < -1:
        raise ValueError("--max-tokens must be positive (or -1 for no limit)")
    check_generation_options(flags=True, temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
                             seed=args.seed, kv_bits=args.kv_bits, max_kv_size=args.max_kv_size)
    kv_options(args)
    check_flag(1 <= args.window <= MAX_WINDOW, "--window", args.window, f"an integer from 1 to {MAX_WINDOW:,}")
    check_flag(finite(args.hysteresis) and args.hysteresis >= 0, "--hysteresis", args.hysteresis, "a number >= 0")
    check_flag(args.min_gear_duration >= 1, "--min-gear-duration", args.min_gear_duration, "an integer >= 1")
    if getattr(args, "sparse_gear", None) is not None:  # the server takes no --sparse-gear
        check_sparse_gear_args(args)
    if args.low_quant != "rtn" and (args.store == "separate" or args.telemetry_only):
        raise ValueError(f"--low-quant {args.low_quant} builds the nested store's low gear: it needs the nested "
                         f"store, not {'--telemetry-only' if args.telemetry_only else '--store separate'}")
    if args.thresholds and not all(finite(t) for t in args.thresholds):
        raise ValueError(f"--thresholds must be finite numbers of bits, got {args.thresholds[0]} {args.thresholds[1]}")
    if args.thresholds and args.thresholds[0] < 0:
        raise ValueError(f"--thresholds are entropies in bits, >= 0: got LOW={args.thresholds[0]}")
    if args.thresholds and not 0 <= args.thresholds[0] < args.thresholds[1]:
        raise ValueError(
            f"thresholds are in the wrong order: LOW={args.thresholds[0]} must be below "
            f"HIGH={args.thresholds[1]} (and >= 0)"
        )
    if args.thresholds and (args.calibrate or args.calibration):
        raise ValueError("give --thresholds or --calibrate/--calibration, not both")
    if args.max_kv_size is not None and args.kv_bits is not None:
        raise ValueError("--max-kv-size (a rotating window cache) cannot be combined with --kv-bits: neither the "
                         "rotated cache nor mlx-lm's window cache quantizes a window; drop one")
    writes = getattr(args, "rank", 0) == 0  # a sharded run: rank 0 alone writes the trace and a calibration
    if args.trace is not None and writes:
        check_target(args.trace, "--trace")
        check_not_overwritten(args)
    if args.calibration is not None and not args.calibration.strip():
        raise ValueError("--calibration needs a file name, got an empty one")
    if args.calibration and not args.calibrate and not Path(args.calibration).is_file():
        p = Path(args.calibration).expanduser()
        if p.is_dir():
            raise ValueError(f"--calibration {args.calibration} is a directory, not a calibration file")
        if p.exists():
            raise ValueError(f"--calibration {args.calibration} is not a regular file (a device, pipe or socket)")
        raise FileNotFoundError(f"calibration file not found: {args.calibration}")
    if args.calibration and not args.calibrate:
        Calibration.load(args.calibration)  # a damaged or ill-shaped file: one error before the model loads
    if args.calibrate and args.calibration and writes:
        check_target(args.calibration, "--calibration")


def check_not_overwritten(args: argparse.Namespace) -> None:
    """``--trace`` replaces its file: refuse a path that is also an input or output of the run
    (``--calibration``, a ``--prompt`` file read from stdin cannot be told), and an existing
    file that is not a gearbx trace (an earlier trace is replaced, as a user reruns a command)."""
    trace = Path(args.trace).expanduser()
    if not trace.is_file():
        return
    if args.calibration and Path(args.calibration).expanduser().exists() and \
            os.path.samefile(trace, Path(args.calibration).expanduser()):
        raise ValueError(f"--trace and --calibration name the same file ({args.trace}): the trace would "
                         "replace the calibration; give the trace another name")
    if trace.stat().st_size and not looks_like_trace(trace):
        raise ValueError(f"--trace {args.trace} exists and is not a gearbx trace: refusing to replace it "
                         "(remove it, or give another name)")


def _templated(tokenizer: Any, args: argparse.Namespace, prompt: str) -> Any:
    return apply_chat_template(tokenizer, prompt, args.system_prompt, use_template=not args.ignore_chat_template)


def run(args: argparse.Namespace) -> int:
    """Generate as the flags say; the trace, if any, is valid whenever this returns or raises.

    Its header is written before the model loads (and rewritten with more
    fields as they become known), so Ctrl-C at any point leaves a trace whose
    summary says ``"interrupted": true``, with ``stage`` telling where.

    Under ``mlx.launch`` with several processes the model is sharded over
    them (tensor parallelism, mlx-lm's ``model.shard()``): every rank runs
    this alike, rank 0 alone prints the text and the summary and writes the
    trace, the others print nothing but an error.
    """
    ranks = launched_ranks()
    args.rank = ranks.rank if ranks is not None else 0
    if args.rank == 0:
        return _run(args, ranks)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args.quiet = True
        return _run(args, ranks)


def _run(args: argparse.Namespace, ranks: Optional[Ranks]) -> int:
    with stage(ranks, "checking the flags"):
        prompt = _read_prompt(args)
        check_args(args)
        check_speculative_args(args)  # or, without --speculative, refuses the drafter flags
        config = gearbox_config(args)
    writer = TraceWriter(Path(args.trace).expanduser()) if args.trace and args.rank == 0 else None
    stage_name, interrupted, error, streaming = "loading", False, None, False
    try:
        if writer:
            writer.header(model=args.model or "default", sampling=_sampling(args))
        sharded = {"group": ranks.group} if ranks is not None else {}
        if args.low_quant != "rtn":
            say(args, f"loading; the low gear by mlx-lm's {args.low_quant.upper()} is built once and then read from "
                "the planes cache" + (" (its first build takes many minutes on a CPU)"
                                       if args.low_quant in ("awq", "dwq") else "") + " ...")
        model, tokenizer, gearbox = load(args.model, config=config, dtype=args.dtype,
                                         draft_scope=args.draft_scope if args.speculative else None,
                                         draft_gear=args.draft_gear if args.speculative else None, **sharded)
        check_sparse_model(args, model)
        warm_up(model)
        settle_loaded()
        if args.calibrate and not args.thresholds:
            stage_name = "calibrating"
        stage_name = set_thresholds(args, model, tokenizer, gearbox, ranks)
        with stage(ranks, "preparing the prompt"):
            check_thresholds(gearbox)
            templated = _templated(tokenizer, args, prompt)
        streaming = True
        return run_loaded(args, model, tokenizer, gearbox, templated, writer)
    except KeyboardInterrupt:
        interrupted = True
        doing = {"loading": "loading the model", "prefill": "preparing the prompt"}.get(stage_name, stage_name)
        print(f"interrupted while {doing}", file=sys.stderr)
    except Exception as e:
        error = error_line(e)[len("error: "):]
        raise
    finally:
        if not streaming:
            _finish(args, writer, None, None, interrupted, error, stage_name)
    return 130


def run_loaded(args: argparse.Namespace, model: Any, tokenizer: Any, gearbox: Any, templated: Any,
               writer: Optional[TraceWriter] = None) -> int:
    """Generate as the flags say with a model already loaded (and its thresholds set);
    returns the exit status. The trace (``writer``, else ``args.trace``) is valid however this ends."""
    if writer is None and args.trace and getattr(args, "rank", 0) == 0:
        writer = TraceWriter(Path(args.trace).expanduser())
    last, interrupted, error, run = None, False, None, None
    # Where an interrupt before the first token lands: a speculative run first times its drafter.
    stage_name = "timing the drafter" if args.speculative else "prefill"
    try:
        run = _prepare(args, model, tokenizer, gearbox, templated)
        stage_name = "prefill"
        if writer:
            writer.header(**run.record.header(), sampling=_sampling(args))
        if not args.quiet:
            print("=" * 10, file=sys.stderr, flush=True)
        last, interrupted = print_stream(
            run.tokens(), color=args.color, writer=writer, record=token_record,
            header=lambda first: {**first.run.header(first), "sampling": _sampling(args)},
        )
        if interrupted and last is None:
            print("interrupted during the prefill (no token was generated)", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted while {'timing the drafter' if stage_name != 'prefill' else 'preparing the prompt'}",
              file=sys.stderr)
    except Exception as e:
        error = error_line(e)[len("error: "):]
        last = getattr(e, "last_response", last)  # the tokens streamed before stdout failed
        raise
    finally:
        if run is not None:
            run.close()
        _finish(args, writer, gearbox, last, interrupted, error, stage_name)
    return 130 if interrupted else 0


def _prepare(args: argparse.Namespace, model: Any, tokenizer: Any, gearbox: Any, templated: Any) -> Any:
    """Set the run up through the one pipeline, saying what the user should know first."""
    spec = None
    if getattr(args, "sparse_gear", None) is not None:
        use_sparse_gear(args, model, tokenizer, gearbox)
    if args.speculative:
        spec = speculative_config(args, gearbox)
        say(args, "timing the drafter against the high gear on the prompt ...")
    else:
        if args.static_gear != "high":
            gearbox.warn_if_prequantized_source()  # before the text starts streaming
        if gearbox.manager.telemetry_only and not args.quiet:
            say(args, f"telemetry only: {gearbox.manager.telemetry_reason}. Gears are tracked per token "
                "but nothing is swapped: every token runs on the loaded weights.")
    run = prepare(
        model, tokenizer, templated, gearbox, speculative=spec, max_tokens=args.max_tokens,
        sampling=SamplingOptions(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k),
        kv_options=kv_options(args), seed=args.seed, max_kv_size=args.max_kv_size,
        prompt_text=None if args.speculative else getattr(args, "user_prompt", None),
    )
    if run.plan is not None:
        say(args, run.plan.message())
    beyond = past_context(model, run.ids.size, args.max_tokens)
    if beyond:
        warnings.warn(beyond, stacklevel=2)
    return run


def _finish(args: argparse.Namespace, writer: Optional[TraceWriter], gearbox: Any, last: Any,
            interrupted: bool, error: Optional[str], stage_name: str) -> None:
    """Write the trace's summary and print the summary, from the run's one record."""
    if last is not None:
        summary = last.run.summary(last, interrupted, error)
    else:
        summary = empty_summary(interrupted, error, stage_name)
    if writer and not writer.summarized:
        writer.summary(**summary)
    if last is not None and not args.quiet:
        print("=" * 10, file=sys.stderr)
        print(format_summary(summary, gearbox.thresholds), file=sys.stderr)
        if use_color(args.color):  # a key for the colours the text was written in
            print("Colours: " + " ".join(f"{GEAR_ANSI[g]}{g}{ANSI_RESET}" for g in GEARS), file=sys.stderr)
    if writer:
        writer.close()


def _sampling(args: argparse.Namespace) -> Dict[str, Any]:
    return {"temp": args.temp, "top_p": args.top_p, "min_p": args.min_p, "top_k": args.top_k, "seed": args.seed}


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch.started()  # Ctrl-C raises KeyboardInterrupt again: this command handles it from here
    launch.terminate_as_interrupt()  # and SIGTERM as Ctrl-C
    args = build_parser().parse_args(argv)
    warnings.showwarning = show_warning  # one plain line, not a source excerpt
    ensure_fast_blas(argv)  # a program on Linux: restart once with OpenBLAS preloaded, or say how
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(error_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the run began (reading stdin): nothing to record
        print("interrupted", file=sys.stderr)
        return 130


class _CommandModule(types.ModuleType):
    """This module, callable as the library's :func:`gearbx_mlx.generate`.

    ``gearbx_mlx.generate`` names both the library function and this command's
    module, and importing a submodule binds the package's attribute of that name
    to the module: after ``import gearbx_mlx.generate`` (or ``python -m``), the
    function would be hidden behind the module. Calling the module calls it.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        return library_generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CommandModule

if __name__ == "__main__":
    sys.exit(main())

