"""``python -m gearbx_mlx.evaluate``: quality and speed of every gear policy on a real model.

The command line over :func:`gearbx_mlx.evaluation.harness.evaluate`: a table
on stdout, JSON with ``--out``, PNGs with ``--plots``, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from mlx.utils import tree_flatten

from . import launch
from .atomicfile import check_directory, check_target
from .blas import ensure_fast_blas
from .config import MAX_RUN_TOKENS, GearboxConfig
from .console import CommandParser, error_line, refuse_kv_flags_unused, refuse_unused
from .evaluation import report
from .evaluation.harness import DEFAULT_SPEED_PROMPT, DEFAULT_WINDOW, PLOT_PREFIX, evaluate, read_text
from .evaluation.machine import blas, load_average
from .evaluation.plots import make_all
from .evaluation.sparse_gear import sparse_gear_table
from .evaluation.study import DEFAULT_STUDY, FULL_STUDY, Eta, Study, expected_seconds, minutes, wall_factor
from .evaluation.teacher import stderr_progress
from .evaluation.text import check_encoding
from .generation import load
from .kvcache.option import ROTATION_CHOICES, KVOptions
from .plotting import require_matplotlib
from .sources.registry import MODEL_HELP
from .speculative.sparse import MAX_SPARSITY, ffn_layers
from .telemetry.trace import versions

# -- CLI ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m gearbx_mlx.evaluate",
        description="Measure quality (teacher-forced perplexity, KL and top-1 agreement to the "
        "full-precision model) of the gear policies against their matched baselines on a real model; with "
        "--full, of both scopes and the nested store over more text, with decode speed, the speculative rows "
        "and the gear-by-workload generations. Prints the expected duration first.",
    )
    d, f = DEFAULT_STUDY, FULL_STUDY
    p.add_argument("--full", action="store_true",
                   help=f"the whole study: {f.tokens} tokens, both scopes and the nested store, "
                   f"{f.speed_tokens} speed tokens, {f.workload_tokens} workload tokens, the speculative rows "
                   "(tens of minutes on a two-core CPU; the default is a few minutes: "
                   f"{d.tokens} tokens, the gearbox's scope, quality only)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--text", metavar="FILE", help="text to evaluate on (default: gensim's lee_background.cor)")
    p.add_argument("--encoding", metavar="NAME",
                   help="encoding of --text, a Python codec name such as utf-8, cp1252, utf-16 (default: a "
                   "byte-order mark's, else UTF-8, else Latin-1 byte for byte, which the run reports)")
    p.add_argument("--tokens", type=int, help=f"tokens of text to use (default {d.tokens}; --full {f.tokens})")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"tokens per scoring window; each window is one sequence (default {DEFAULT_WINDOW})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random routers (default 0)")
    p.add_argument("--speed-tokens", type=int,
                   help=f"decode tokens per policy on the real kernels; 0 skips speed (default {d.speed_tokens}; "
                   f"--full {f.speed_tokens})")
    p.add_argument("--speed-prompt", type=int, default=DEFAULT_SPEED_PROMPT,
                   help=f"prompt tokens before the timed decode (default {DEFAULT_SPEED_PROMPT})")
    p.add_argument("--workload-tokens", type=int,
                   help=f"tokens per prompt of the gear-by-workload generations; 0 skips (default "
                   f"{d.workload_tokens}; --full {f.workload_tokens})")
    spec = p.add_mutually_exclusive_group()
    spec.add_argument("--speculative", action="store_true", default=None,
                      help="add the speculative rows (low/mid gear drafts, high gear verifies; on with --full)")
    spec.add_argument("--no-speculative", dest="speculative", action="store_false",
                      help="leave out the speculative rows")
    p.add_argument("--sparse-gear", type=_sparsities, default=(), metavar="S[,S...]",
                   help="add rows of the low gear computed sparsely (each position keeps its heaviest FFN blocks, "
                        "a fraction S of them skipped on average), with their KL and bytes beside the dense gears'")
    p.add_argument("--draft-calibration-tokens", type=int, metavar="N",
                   help="high-gear tokens per calibration prompt when choosing each drafter's block cap "
                   "and entropy stop (default: the calibration's own, as gearbx-generate --speculative --calibrate)")
    p.add_argument("--max-positions", type=int, metavar="N",
                   help="most positions per forward pass (default: as many as keep its logits near 128 MiB, "
                   "at most 256)")
    # Rows are no longer batched (each runs many steps per pass instead): accepted so old commands run.
    p.add_argument("--max-rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--kv-bits", type=int, default=None,
                   help="quantize the KV cache of every pass and speed run to this many bits, from the first "
                        "token (default: mlx-lm's float cache); its bytes are a column beside the weights'")
    p.add_argument("--kv-group-size", type=int, default=None,
                   help="group size for KV cache quantization (default 64; the rotated cache takes 32 on "
                   "models whose k_proj biases put outlying offsets on the keys)")
    p.add_argument("--kv-rotation", choices=ROTATION_CHOICES, default="auto",
                   help="with --kv-bits: the rotated cache (auto, srht, srft) or mlx-lm's own ('none')")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="dtype of the converted default model (default: float32 on a Linux CPU)")
    p.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG figures into DIR (needs matplotlib)")
    p.add_argument("--from-json", metavar="FILE.json",
                   help="evaluate nothing: print the table of a saved run (and redraw it with --plots)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _command(argv: Sequence[str]) -> str:
    env = " ".join(f"{k}={os.environ[k]}" for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS") if os.environ.get(k))
    return (env + " " if env else "") + "python -m gearbx_mlx.evaluate " + shlex.join(list(argv))


def resolve_study(args: argparse.Namespace) -> Study:
    """The study the flags ask for: ``--full`` or the default, then each flag given (in ``args`` too)."""
    base = FULL_STUDY if args.full else DEFAULT_STUDY
    for key in ("tokens", "speed_tokens", "workload_tokens", "speculative"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(base, key))
    scopes = base.scopes
    if scopes is None and args.speculative:  # the drafters are the static rows of every layer
        scopes = tuple(dict.fromkeys((GearboxConfig().scope, "all")))
    return Study(base.name if scopes == base.scopes else base.name + "+speculative", args.tokens,
                 args.speed_tokens, args.workload_tokens, args.speculative, scopes)


def _check_args(args: argparse.Namespace) -> None:
    """Fail on bad input before the model loads (minutes saved, one clear message)."""
    if args.tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (one scored prediction needs two tokens), got {args.tokens}")
    for flag, n in (("--tokens", args.tokens), ("--window", args.window), ("--speed-tokens", args.speed_tokens),
                    ("--workload-tokens", args.workload_tokens)):
        if n > MAX_RUN_TOKENS:
            raise ValueError(f"{flag} must be at most {MAX_RUN_TOKENS:,}, got {n}")
    if args.window < 2:
        raise ValueError(f"--window must be >= 2, got {args.window}")
    if args.speed_tokens < 0 or args.workload_tokens < 0:
        raise ValueError("--speed-tokens and --workload-tokens must be >= 0 (0 skips that part)")
    if args.speed_prompt < 1:
        raise ValueError(f"--speed-prompt must be >= 1, got {args.speed_prompt}")
    if args.draft_calibration_tokens is not None and args.draft_calibration_tokens < 1:
        raise ValueError(f"--draft-calibration-tokens must be >= 1, got {args.draft_calibration_tokens}")
    if not args.speculative:  # resolved: --speculative, or --full without --no-speculative
        refuse_unused((("--draft-calibration-tokens", args.draft_calibration_tokens is not None),),
                      ("calibrates", "calibrate"), "the drafters of the speculative rows: add --speculative "
                      "(or --full without --no-speculative; without the rows nothing drafts)")
    if args.max_positions is not None and args.max_positions < 1:
        raise ValueError(f"--max-positions must be >= 1, got {args.max_positions}")
    _kv(args)
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.text is not None and Path(args.text).expanduser().is_dir():
        raise ValueError(f"--text {args.text} is a directory: pass a text file")
    if args.text is not None and not Path(args.text).expanduser().is_file():
        raise FileNotFoundError(f"text file not found: {args.text} (pass an existing text file to --text)")
    _check_text_encoding(args.encoding)
    if args.out is not None:  # an empty name too: it is refused, not taken for no --out
        check_target(args.out, "--out", example="eval.json")  # writable before the run, not found so after it
    if args.plots is not None:
        require_matplotlib()
        check_directory(args.plots, "--plots")  # created where missing, as analyze --plots does


def _check_text_encoding(encoding: Optional[str]) -> None:
    """A codec Python has that also decodes bytes to text (``base64``, ``rot13`` and the like do not)."""
    if check_encoding(encoding) is None:
        return
    try:
        b"A".decode(encoding)  # an empty input decodes even where the codec is not a text encoding
    except UnicodeError:
        pass
    except LookupError:
        raise ValueError(f"--encoding {encoding!r} is not a text encoding: give one such as utf-8, latin-1, "
                         "cp1252 or utf-16") from None


def _kv(args: argparse.Namespace) -> Optional[KVOptions]:
    """The KV flags as options (None without --kv-bits, which refuses the other KV flags given); ValueError
    naming the flag."""
    if getattr(args, "kv_bits", None) is None:
        refuse_kv_flags_unused(args)
        return None
    try:
        return KVOptions(bits=args.kv_bits, group_size=args.kv_group_size, quantized_kv_start=0,
                         rotation=args.kv_rotation)
    except ValueError as e:
        msg = str(e)
        for name in ("kv_bits", "kv_group_size", "kv_rotation"):
            msg = msg.replace(name, "--" + name.replace("_", "-"))
        raise ValueError(msg) from None


def replot(args: argparse.Namespace) -> Dict[str, Any]:
    """``--from-json``: a saved run's results, figures redrawn if ``--plots``."""
    refuse_unused((("--out", args.out is not None),), ("writes", "write"),
                  "a new run's results: --from-json evaluates nothing and only reprints its file (drop --out)")
    path = Path(args.from_json).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"results file not found: {args.from_json}")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not a JSON file ({e})") from None
    if not isinstance(results, dict) or results.get("format") != "gearbx-eval":
        raise ValueError(f"{path} is not a gearbx evaluation result (format 'gearbx-eval')")
    try:  # everything the table and the figures read, before anything is drawn
        results["comparisons"] = report.refresh_comparisons(results)
        results["verdict"] = report.verdict(results["comparisons"])
        render(results, args)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        # The right format but not this version's shape (or edited by hand).
        raise ValueError(
            f"{path} is not a complete gearbx evaluation result ({type(e).__name__}: {e}); "
            "was it written by another version?"
        ) from None
    if args.plots is not None:
        require_matplotlib()
        out = check_directory(args.plots, "--plots")
        try:
            results["figures"] = [str(p) for p in make_all(results, out, PLOT_PREFIX)]
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"cannot draw the figures of {path} ({type(e).__name__}: {e})") from None
    return results


def _sparsities(text: str) -> Tuple[float, ...]:
    """``S[,S...]``: target sparsities of the sparse low gear's rows, each in ``[0, MAX_SPARSITY]``."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fractions in [0, {MAX_SPARSITY}], comma-separated, got {text!r}") from None
    if not all(0 <= v <= MAX_SPARSITY for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions in [0, {MAX_SPARSITY}], comma-separated, got {text!r}")
    return values


def expectation(args: argparse.Namespace, study: Study) -> Tuple[Dict[str, float], float, str]:
    """The cost model's one-core seconds per phase, the wall factor of this machine now, and the line
    printed before a run (the default model's size: another model scales it)."""
    scopes = study.scopes or (GearboxConfig().scope,)
    cost = expected_seconds(args.tokens, args.window, scopes, "all" in scopes, args.speed_tokens,
                            args.workload_tokens, bool(args.speculative))
    load1 = (load_average() or [0.0])[0]
    factor = wall_factor(load1)
    line = (f"expected: about {minutes(cost['total'] * wall_factor(0.0))} on an idle {os.cpu_count()}-CPU machine "
            f"for the default model ({study.name} study{'' if study.name == 'full' else '; --full for the whole one'}), about "
            f"{minutes(cost['total'] * factor)} at this load average ({load1:.1f})")
    return cost, factor, line


def run(args: argparse.Namespace, argv: Sequence[str]) -> Dict[str, Any]:
    study = resolve_study(args)
    _check_args(args)
    cost, factor, line = expectation(args, study)
    load_start = load_average()
    say = (lambda _m: None) if args.quiet else Eta(stderr_progress, cost, factor)
    if not args.quiet:
        stderr_progress(line)
    text, text_info = read_text(args.text, args.encoding)
    if text_info.get("encoding_note"):
        print(f"warning: {text_info['encoding_note']}", file=sys.stderr)
    if args.max_rows is not None:
        say("--max-rows has no effect any more: rows run many steps per pass (see --max-positions)")
    tic = time.perf_counter()
    say(f"loading {args.model or 'the default model'} ...")
    model, tokenizer, gearbox = load(args.model, dtype=args.dtype)
    if args.sparse_gear:
        try:
            ffn_layers(model)  # before the long passes
        except ValueError as e:
            raise ValueError(f"--sparse-gear: {e}") from None
    results = evaluate(
        model, tokenizer, text, tokens=args.tokens, window=args.window, seed=args.seed,
        speed_tokens=args.speed_tokens, speed_prompt=args.speed_prompt, workload_tokens=args.workload_tokens,
        speculative=args.speculative, draft_calibration_tokens=args.draft_calibration_tokens,
        max_positions=args.max_positions, progress=say, kv=_kv(args),
        kv_calibration=gearbox.calibration.kv if gearbox.calibration is not None else None,
        scopes=study.scopes or (GearboxConfig().scope,), model_dir=gearbox.model_dir, sparse_gear=args.sparse_gear,
    )
    results["study"] = {"name": study.name, "scopes": list(study.scopes or (GearboxConfig().scope,)),
                        "expected_one_core_s": cost, "expected_wall_s": cost["total"] * factor,
                        "load_average_start": load_start}
    results["timings"]["total_s"] = time.perf_counter() - tic
    # CPU seconds too: on a shared machine the wall time says more about the neighbours.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    results["timings"]["cpu_s"] = usage.ru_utime + usage.ru_stime
    results["command"] = _command(argv)
    results["text"].update(text_info)
    results["model"].update({
        "name": gearbox.model_name,
        "dtype": str(tree_flatten(model.parameters())[0][1].dtype),
        "source_check": gearbox.source_check().message() if gearbox.source_check().suspected else None,
    })
    results["environment"] = {
        **versions(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
        "blas": blas(),
        "load_average": {"start": results["study"]["load_average_start"], "end": load_average()},
        "note": "speed depends on the machine and its load; quality numbers are reproducible for one "
        "command and environment (BLAS library included)",
    }
    # Results first, figures second: a plotting failure must not lose a long run.
    if args.out:
        report.write_json(results, Path(args.out).expanduser())
    if args.plots:
        results["figures"] = [str(p) for p in make_all(results, Path(args.plots).expanduser(), PLOT_PREFIX)]
        if args.out:
            report.write_json(results, Path(args.out).expanduser())
    return results


def render(results: Dict[str, Any], args: argparse.Namespace) -> str:
    """The tables and notes printed for ``results``."""
    out = [report.table(results["policies"])]
    if results.get("speculative"):  # absent from runs saved by earlier versions
        out += ["", report.speculative_table(results["speculative"])]
    if results.get("sparse_gear"):
        out += ["", sparse_gear_table(results["sparse_gear"])]
    note = report.kv_note(results.get("kv_cache"))
    out += ["", note] if note else []
    out += ["", results["routing"]["lag_note"],
            f"reference: {results['routing']['reference']}; KL in nats; bytes: §9 cost model"]
    if results["verdict"]:
        out += ["", results["verdict"]]
    if results.get("figures"):
        out.append("\nfigures: " + ", ".join(results["figures"]))
    if args.out and not args.from_json:
        out.append(f"results: {args.out}")
    return "\n".join(str(x) for x in out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch.started()  # Ctrl-C raises KeyboardInterrupt again: this command handles it from here
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    ensure_fast_blas(None if program else argv)  # a program on Linux: restart once with OpenBLAS preloaded
    try:
        results = replot(args) if args.from_json else run(args, argv)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError, OSError) as e:
        # RuntimeError: the package cache's (a damaged entry it cannot replace, a download that
        # does not match its pin) and MLX's own, one line each as generate prints them
        print(error_line(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    print(render(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
