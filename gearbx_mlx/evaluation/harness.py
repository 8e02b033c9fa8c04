"""Quality and speed of every gear policy on a real model: :func:`evaluate`.

``python -m gearbx_mlx.evaluate`` is the command line on top of it (a table
on stdout, JSON with ``--out``, PNGs with ``--plots``, progress on stderr).

What is measured (GEARBX §9, §13, §15, §17):

* quality, teacher-forced: the text is fed token by token through the KV
  cache, each policy routing its own row of one batched pass; lag 0 (the
  entropy of step t governs step t+1); perplexity, mean KL(reference ‖
  routed), top-1 agreement, tokens per gear, shifts, modeled bytes/token;
* speed, on the real kernels (``QuantizedLinear`` swapped by the
  ``PrecisionManager`` inside ``stream_generate``) over a shorter stretch;
* the speculative policy: the low or mid gear drafts, the high gear
  verifies; quality is the static-high row's by construction, acceptance is
  replayed on the same pass, bytes and speed are modeled
  (:mod:`gearbx_mlx.evaluation.speculative`).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..calibration import collect_entropies, median_thresholds, percentile_thresholds
from ..config import CALIBRATION_PROMPTS, GearboxConfig
from ..entropy import scaled_thresholds
from ..gearbox import vocab_size_of
from ..precision import is_prequantized
from ..sources.models import CORPUS_PACKAGE, corpus_path
from . import report
from .specs import ModelLayout, base_specs, matched_specs
from .speculative import evaluate_speculative
from .speed import SpeedBench, measure_speed
from .teacher import split_windows, teacher_forced
from .workloads import gear_by_workload

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
