"""``python -m gearbx_mlx.evaluate``: quality and speed of every gear policy on a real model.

:func:`evaluate` is the library function; :func:`main` is the thin CLI on
top of it (a table on stdout, JSON with ``--out``, PNGs with ``--plots``,
progress on stderr). The pieces live in :mod:`gearbx_mlx.evaluation`.

What is measured (issue 4; GEARBX §9, §13, §15, §17):

* quality, teacher-forced: the text is fed token by token through the KV
  cache, each policy routing its own row of one batched pass; lag 0 (the
  entropy of step t governs step t+1); perplexity, mean KL(reference ‖
  routed), top-1 agreement, tokens per gear, shifts, modeled bytes/token;
* speed, on the real kernels (``QuantizedLinear`` swapped by the
  ``PrecisionManager`` inside ``stream_generate``) over a shorter stretch;
* the speculative policy (issue 7): the low or mid gear drafts, the high gear
  verifies; quality is the static-high row's by construction, acceptance is
  replayed on the same pass, bytes and speed are modeled
  (:mod:`gearbx_mlx.evaluation.speculative`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import resource
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

DEFAULT_TOKENS = 4096
DEFAULT_WINDOW = 512
DEFAULT_SPEED_TOKENS = 128
DEFAULT_SPEED_PROMPT = 32
DEFAULT_WORKLOAD_TOKENS = 48
#: Figure names in --plots DIR: eval_pareto.png, eval_routing_trace.png, eval_workloads.png.
PLOT_PREFIX = "eval_"
LAG_NOTE = (
    "lag 0: the entropy of the distribution computed at step t decides the gear of step t+1, "
    "as GearboxConfig.lag=0 in generation; the first step of each window runs in the "
    "policy's initial gear (cold-start suggestion: high)"
)


def read_text(path: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    """The evaluation text and a description of it (default: gensim's lee_background.cor)."""
    from .models import CORPUS_PACKAGE, corpus_path

    if path is None:
        p = corpus_path("lee_background")
        source = f"lee_background.cor from {CORPUS_PACKAGE}"
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"text file not found: {path} (pass an existing UTF-8 text file to --text)")
        source = str(path)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text ({e}); pass a UTF-8 text file") from None
    if not text.strip():
        raise ValueError(f"{p} is empty: pass a file with some text")
    return text, {"source": source, "sha256": hashlib.sha256(data).hexdigest(), "chars": len(text)}


def text_tokens(tokenizer: Any, text: str, n: int) -> List[int]:
    """The first ``n`` token ids of ``text`` (raw text: no chat template, no BOS added)."""
    # Encode a growing prefix, not the whole corpus; tokens well before the
    # cut do not depend on it (only the last word can be split differently).
    margin = 16
    chars = max(256, n * 6)
    while True:
        whole = chars >= len(text)
        ids = tokenizer.encode(text[:chars])
        if whole or len(ids) >= n + margin:
            return list(ids[:n])
        chars *= 2


def calibrated_thresholds(model: Any, tokenizer: Any, vocab_size: int) -> Tuple[Dict[str, Tuple[float, float]], Dict[str, Any]]:
    """Median (§4.2) and percentile (§4.1) thresholds from the default calibration prompts."""
    import statistics

    from .calibration import collect_entropies, median_thresholds, percentile_thresholds
    from .config import CALIBRATION_PROMPTS

    samples = collect_entropies(model, tokenizer)
    th = {"median": median_thresholds(samples), "percentile": percentile_thresholds(samples, vocab_size)}
    info = {
        "prompts": list(CALIBRATION_PROMPTS),
        "samples": len(samples),
        "median_entropy": statistics.median(samples),
        "note": "entropies of greedy generation in the high gear (gearbx_mlx.calibration.collect_entropies)",
    }
    return th, info


def evaluate(
    model: Any,
    tokenizer: Any,
    text: str,
    policies: Optional[Sequence[Any]] = None,
    *,
    tokens: int = DEFAULT_TOKENS,
    window: int = DEFAULT_WINDOW,
    config: Any = None,
    seed: int = 0,
    matched: bool = True,
    speed_tokens: int = DEFAULT_SPEED_TOKENS,
    speed_prompt: int = DEFAULT_SPEED_PROMPT,
    workload_tokens: int = DEFAULT_WORKLOAD_TOKENS,
    speculative: bool = True,
    draft_calibration_tokens: Optional[int] = None,
    max_rows: int = 128,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Any]:
    """Evaluate gear policies on ``model`` over the first ``tokens`` tokens of ``text``.

    Args:
        model, tokenizer: an mlx-lm model with its loaded weights, and its tokenizer.
        text: the evaluation text (raw; no chat template).
        policies: first-pass :class:`~gearbx_mlx.evaluation.specs.PolicySpec`
            rows, one of them static high; None = the default set (static
            high/mid/low, mlx-lm's mixed_4_6, entropy with default, median
            and percentile thresholds; scopes attention and all).
        tokens: tokens of text used (>= 2), cut into windows of ``window``
            tokens; each window is one sequence (fresh cache and monitor).
        config: :class:`~gearbx_mlx.config.GearboxConfig` of the monitor and gears.
        seed: seeds the random routers.
        matched: add, for each entropy policy, a position rule at equal
            modeled bytes and a random router with equal gear fractions
            (a second batched pass).
        speed_tokens: decode tokens per policy on the real kernels (0: skip).
        workload_tokens: tokens per workload prompt for the gear-by-workload
            generations (0: skip).
        speculative: add the speculative rows (needs the static low/mid rows
            of the draft scope in ``policies``; the default set has them).
        draft_calibration_tokens: high-gear tokens per calibration prompt
            when calibrating each drafter's block cap and stop (None: the
            calibration's own default, as ``--speculative --calibrate``).
        max_rows: batch rows per pass chunk (windows x policies).
        progress: status lines (e.g. :func:`~gearbx_mlx.evaluation.teacher.stderr_progress`).

    Returns:
        The results dictionary (see ``benchmarks/results/eval_default.json``).
    """
    from .config import GearboxConfig
    from .entropy import scaled_thresholds
    from .evaluation import report
    from .evaluation.specs import ModelLayout, base_specs, matched_specs
    from .evaluation.speed import SpeedBench, measure_speed
    from .evaluation.teacher import split_windows, teacher_forced
    from .evaluation.workloads import gear_by_workload
    from .gearbox import vocab_size_of
    from .precision import is_prequantized

    if not isinstance(tokens, int) or tokens < 2:
        raise ValueError(f"tokens must be an integer >= 2 (one scored prediction needs two tokens), got {tokens!r}")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    if speed_tokens < 0 or workload_tokens < 0 or speed_prompt < 1:
        raise ValueError("speed_tokens and workload_tokens must be >= 0 (0 skips), speed_prompt >= 1")
    if draft_calibration_tokens is not None and draft_calibration_tokens < 1:
        raise ValueError(f"draft_calibration_tokens must be >= 1, got {draft_calibration_tokens!r}")
    if is_prequantized(model):
        raise ValueError("the model is already quantized: evaluate a float16/bfloat16/float32 model")
    say = progress or (lambda _msg: None)
    config = config or GearboxConfig()
    timings: Dict[str, float] = {}
    vocab = vocab_size_of(model, tokenizer)
    ids = text_tokens(tokenizer, text, tokens)
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s): at least 2 are needed")
    windows = split_windows(ids, window)
    layout = ModelLayout.of(model, config, vocab)

    tic = time.perf_counter()
    thresholds: Dict[str, Optional[Tuple[float, float]]] = {"default": scaled_thresholds(config, vocab)}
    calibration_info: Dict[str, Any] = {}
    if policies is None:
        say("calibrating thresholds (median and percentile) on the default prompts ...")
        cal, calibration_info = calibrated_thresholds(model, tokenizer, vocab)
        thresholds.update(cal)
        policies = base_specs({"default": None, "median": cal["median"], "percentile": cal["percentile"]})
    timings["calibration_s"] = time.perf_counter() - tic

    tic = time.perf_counter()
    first = teacher_forced(model, windows, policies, layout, config, vocab, say, "pass 1", max_rows)
    timings["pass1_s"] = time.perf_counter() - tic
    results = list(first)
    reference_repeat: Optional[Dict[str, float]] = None
    if matched:
        entropy_rows = [(r.spec, r.gear_counts(), r.bytes_per_token) for r in first if r.spec.kind == "entropy"]
        if entropy_rows:
            ref_spec = next(r.spec for r in first if r.spec.is_reference)
            second_specs = [ref_spec] + matched_specs(entropy_rows, layout, len(windows[0]), seed)
            tic = time.perf_counter()
            second = teacher_forced(model, windows, second_specs, layout, config, vocab, say, "pass 2", max_rows)
            timings["pass2_s"] = time.perf_counter() - tic
            # The second pass scores its rows against its own static-high row;
            # a different batch rounds differently, so record by how much.
            ref1 = next(r for r in first if r.spec.is_reference)
            reference_repeat = {"pass1_perplexity": ref1.perplexity, "pass2_perplexity": second[0].perplexity}
            results += second[1:]

    ref_bytes = next(r for r in results if r.spec.is_reference).bytes_per_token
    speed: Dict[str, Dict[str, Any]] = {}
    if speed_tokens:
        tic = time.perf_counter()
        bench = SpeedBench(model, tokenizer, layout, config, vocab)
        need = speed_prompt + speed_tokens
        speed_ids = ids if len(ids) >= need else text_tokens(tokenizer, text, need)
        if len(speed_ids) >= need:
            # Speed of the first-pass policies (every kernel configuration); the
            # matched baselines differ only in their gear sequence.
            speed = measure_speed(bench, [r.spec for r in first], speed_ids, len(windows[0]),
                                  speed_prompt, speed_tokens, say)
        else:
            say(f"speed skipped: the text has fewer than {need} tokens")
        timings["speed_s"] = time.perf_counter() - tic

    rows = [report.policy_row(r, ref_bytes, speed.get(r.spec.name)) for r in results]
    spec_section: Optional[Dict[str, Any]] = None
    if speculative:
        from .evaluation.speculative import evaluate_speculative

        tic = time.perf_counter()
        spec_section = evaluate_speculative(
            model, tokenizer, first, layout, config, vocab, len(windows[0]) - 1, speed, ids[:speed_prompt],
            draft_calibration_tokens, say,
        )
        timings["speculative_s"] = time.perf_counter() - tic
    work: Dict[str, Any] = {}
    if workload_tokens:
        tic = time.perf_counter()
        # The entropy policies of the config's scope (the paper's default: attention).
        work_specs = [r.spec for r in first if r.spec.kind == "entropy" and r.spec.scope == config.scope]
        work = gear_by_workload(model, tokenizer, work_specs, config, vocab, workload_tokens, progress=say)
        timings["workloads_s"] = time.perf_counter() - tic

    comps = report.comparisons(rows)
    return {
        "format": report.FORMAT,
        "version": report.VERSION,
        "model": {"vocab_size": vocab, "layout": layout.to_dict()},
        "text": {
            "tokens_requested": tokens,
            "tokens_used": len(windows) * len(windows[0]),
            "window": len(windows[0]),
            "windows": len(windows),
            "scored_positions": len(windows) * (len(windows[0]) - 1),
            "tokenization": "tokenizer.encode(raw text), no chat template, no BOS added",
        },
        "routing": {
            "lag": 0,
            "lag_note": LAG_NOTE,
            "reference": "static-high row of the same batched pass (the loaded weights)",
            "kl_units": "nats",
            "quality_method": (
                "teacher-forced, one batched pass: each row is one (window, policy); managed layers hold "
                "the loaded weight and fake-quantized copies (mx.quantize then mx.dequantize, affine, "
                f"group {config.group_size}) and each row uses its own gear's copy"
            ),
            "speed_method": (
                "gearbx_mlx.stream_generate on the real kernels (MLX QuantizedLinear/QuantizedEmbedding "
                "swapped by PrecisionManager), forced to the text's tokens: "
                f"{speed_prompt}-token prompt, {speed_tokens} decode tokens, lag 0, one run per first-pass "
                "policy after one warm-up"
            ),
            "monitor": config.to_dict(),
            "reference_in_pass2": reference_repeat,
        },
        "thresholds": {k: list(v) if v else None for k, v in thresholds.items()},
        "calibration": calibration_info,
        "policies": rows,
        "speculative": spec_section,
        "comparisons": comps,
        "verdict": report.verdict(comps),
        "traces": {r.spec.name: report.trace_entry(r) for r in results},
        "workloads": work,
        "timings": timings,
    }


# -- CLI ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gearbx_mlx.evaluate",
        description="Measure quality (teacher-forced perplexity, KL and top-1 agreement to the "
        "full-precision model) and decode speed of every gear policy on a real model.",
    )
    p.add_argument("--model", help="mlx-lm folder, hub id, a .gguf file, or a name: smollm2-135m-q4, "
                   "qwen2.5-coder-0.5b (from PyPI) (default: SmolLM2-135M-Instruct from PyPI)")
    p.add_argument("--text", metavar="FILE", help="UTF-8 text to evaluate on (default: gensim's lee_background.cor)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens of text to use (default {DEFAULT_TOKENS})")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"tokens per scoring window; each window is one sequence (default {DEFAULT_WINDOW})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random routers (default 0)")
    p.add_argument("--speed-tokens", type=int, default=DEFAULT_SPEED_TOKENS,
                   help=f"decode tokens per policy on the real kernels; 0 skips speed (default {DEFAULT_SPEED_TOKENS})")
    p.add_argument("--speed-prompt", type=int, default=DEFAULT_SPEED_PROMPT,
                   help=f"prompt tokens before the timed decode (default {DEFAULT_SPEED_PROMPT})")
    p.add_argument("--workload-tokens", type=int, default=DEFAULT_WORKLOAD_TOKENS,
                   help=f"tokens per prompt of the gear-by-workload generations; 0 skips (default {DEFAULT_WORKLOAD_TOKENS})")
    p.add_argument("--no-speculative", action="store_true",
                   help="leave out the speculative rows (low/mid gear drafts, high gear verifies)")
    p.add_argument("--draft-calibration-tokens", type=int, metavar="N",
                   help="high-gear tokens per calibration prompt when choosing each drafter's block cap "
                   "and entropy stop (default: the calibration's own, as gearbx-generate --speculative --calibrate)")
    p.add_argument("--max-rows", type=int, default=128, help="batch rows (windows x policies) per chunk")
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


def _check_args(args: argparse.Namespace) -> None:
    """Fail on bad input before the model loads (minutes saved, one clear message)."""
    if args.tokens < 2:
        raise ValueError(f"--tokens must be >= 2 (one scored prediction needs two tokens), got {args.tokens}")
    if args.window < 2:
        raise ValueError(f"--window must be >= 2, got {args.window}")
    if args.speed_tokens < 0 or args.workload_tokens < 0:
        raise ValueError("--speed-tokens and --workload-tokens must be >= 0 (0 skips that part)")
    if args.speed_prompt < 1:
        raise ValueError(f"--speed-prompt must be >= 1, got {args.speed_prompt}")
    if args.draft_calibration_tokens is not None and args.draft_calibration_tokens < 1:
        raise ValueError(f"--draft-calibration-tokens must be >= 1, got {args.draft_calibration_tokens}")
    if args.max_rows < 1:
        raise ValueError(f"--max-rows must be >= 1, got {args.max_rows}")
    if args.text is not None and not Path(args.text).expanduser().is_file():
        raise FileNotFoundError(f"text file not found: {args.text} (pass an existing UTF-8 text file to --text)")
    if args.out and not Path(args.out).expanduser().parent.is_dir():
        raise FileNotFoundError(f"directory of --out does not exist: {Path(args.out).parent} (create it first)")
    if args.plots:
        if not Path(args.plots).expanduser().is_dir():
            raise FileNotFoundError(f"--plots directory does not exist: {args.plots} (create it first)")
        from .evaluation.plots import require_matplotlib

        require_matplotlib()


def replot(args: argparse.Namespace) -> Dict[str, Any]:
    """``--from-json``: a saved run's results, figures redrawn if ``--plots``."""
    import json

    path = Path(args.from_json).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"results file not found: {args.from_json}")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a JSON file ({e})") from None
    if not isinstance(results, dict) or results.get("format") != "gearbx-eval":
        raise ValueError(f"{path} is not a gearbx evaluation result (format 'gearbx-eval')")
    if args.plots:
        from .evaluation.plots import make_all, require_matplotlib

        if not Path(args.plots).expanduser().is_dir():
            raise FileNotFoundError(f"--plots directory does not exist: {args.plots} (create it first)")
        require_matplotlib()
        results["figures"] = [str(p) for p in make_all(results, Path(args.plots).expanduser(), PLOT_PREFIX)]
    from .evaluation import report

    results["verdict"] = report.verdict(results["comparisons"])
    return results


def run(args: argparse.Namespace, argv: Sequence[str]) -> Dict[str, Any]:
    from mlx.utils import tree_flatten

    from .evaluation import report
    from .evaluation.teacher import stderr_progress
    from .generation import load
    from .trace import versions

    _check_args(args)
    say = (lambda _m: None) if args.quiet else stderr_progress
    text, text_info = read_text(args.text)
    tic = time.perf_counter()
    model, tokenizer, gearbox = load(args.model, dtype=args.dtype)
    results = evaluate(
        model, tokenizer, text, tokens=args.tokens, window=args.window, seed=args.seed,
        speed_tokens=args.speed_tokens, speed_prompt=args.speed_prompt, workload_tokens=args.workload_tokens,
        speculative=not args.no_speculative, draft_calibration_tokens=args.draft_calibration_tokens,
        max_rows=args.max_rows, progress=say,
    )
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
        "note": "speed depends on the machine and its load; quality numbers are reproducible for one "
        "command and environment (BLAS library included)",
    }
    # Results first, figures second: a plotting failure must not lose a long run.
    if args.out:
        report.write_json(results, Path(args.out).expanduser())
    if args.plots:
        from .evaluation.plots import make_all

        results["figures"] = [str(p) for p in make_all(results, Path(args.plots).expanduser(), PLOT_PREFIX)]
        if args.out:
            report.write_json(results, Path(args.out).expanduser())
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        results = replot(args) if args.from_json else run(args, argv)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .evaluation import report

    print(report.table(results["policies"]))
    if results.get("speculative"):  # absent from runs saved before issue 7
        print()
        print(report.speculative_table(results["speculative"]))
    print()
    print(results["routing"]["lag_note"])
    print(f"reference: {results['routing']['reference']}; KL in nats; bytes: §9 cost model")
    if results["verdict"]:
        print()
        print(results["verdict"])
    if results.get("figures"):
        print("\nfigures: " + ", ".join(results["figures"]))
    if args.out and not args.from_json:
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
