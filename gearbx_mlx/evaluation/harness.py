"""Quality and speed of every gear policy on a real model: :func:`evaluate`.

``python -m gearbx_mlx.evaluate`` is the command line on top of it (a table
on stdout, JSON with ``--out``, PNGs with ``--plots``, progress on stderr).

What is measured (GEARBX §9, §13, §15, §17):

* quality, teacher-forced: the text is fed through the KV cache as in
  decode, each policy routing its own row, many steps per forward pass
  (:mod:`.chunked`); lag 0 (the entropy of step t governs step t+1);
  perplexity, mean KL(reference ‖ routed), top-1 agreement, tokens per
  gear, shifts, modeled bytes/token;
* matched baselines (a second pass): for each entropy policy, a position
  rule at its bytes and a random router replaying a per-window permutation
  of its own gears (equal bytes by construction); each comparison is a
  paired test over positions (:mod:`.significance`);
* speed, on the real kernels (``QuantizedLinear`` swapped by the
  ``PrecisionManager`` inside ``stream_generate``) over a shorter stretch;
* the speculative policy: the low or mid gear drafts, the high gear
  verifies; quality is the static-high row's by construction, acceptance is
  replayed on the same pass, bytes and speed are modeled
  (:mod:`gearbx_mlx.evaluation.speculative`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..calibration import cached_calibration_path, collect_entropies, median_thresholds, percentile_thresholds
from ..config import CALIBRATION, CALIBRATION_PROMPTS, GearboxConfig
from ..entropy import scaled_thresholds
from ..gearbox import vocab_size_of
from ..kvcache.option import KVOptions, open_kv, plain_summary
from ..precision import is_prequantized
from . import permutation, report
from .permutation import gear_rows, random_distribution
from .significance import BOOTSTRAP
from .sparse_gear import sparse_gear_rows
from .specs import ModelLayout, PolicySpec, base_specs, matched_specs
from .speculative import DraftSubject, evaluate_speculative
from .speed import SpeedBench, measure_speed
from .teacher import RowResult, TeacherForcing, split_windows
from .text import read_text, text_tokens, tokenization_note
from .workloads import gear_by_workload

__all__ = ["evaluate", "read_text", "text_tokens", "calibrated_thresholds", "DEFAULT_TOKENS", "DEFAULT_WINDOW",
           "DEFAULT_SPEED_TOKENS", "DEFAULT_SPEED_PROMPT", "DEFAULT_WORKLOAD_TOKENS", "PLOT_PREFIX"]

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
RANDOM_NOTE = (
    "random@X replays, in each window, a random permutation (seeded) of X's own gears in that window: "
    "the same gears in the same number, hence the same modeled bytes, at positions the entropy did not choose; "
    "it is one draw, run for real; the comparison with random routing is against the distribution of many "
    "permutations (comparisons[].random_distribution)"
)


def calibrated_thresholds(
    model: Any, tokenizer: Any, vocab_size: int
) -> Tuple[Dict[str, Tuple[float, float]], Dict[str, Any]]:
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


def cached_thresholds(
    model: Any, tokenizer: Any, vocab_size: int, model_dir: Optional[Path], say: Callable[[str], None]
) -> Tuple[Dict[str, Tuple[float, float]], Dict[str, Any]]:
    """:func:`calibrated_thresholds`, kept in the package's cache keyed by the weights of
    ``model_dir`` and the calibration's prompts and length (None: computed every time).
    A cache file that cannot be read is computed again and rewritten."""
    settings = {"evaluate_thresholds": list(CALIBRATION_PROMPTS), "tokens": CALIBRATION.tokens_per_prompt,
                "vocab": vocab_size}
    path = cached_calibration_path(model_dir, str(model_dir), settings) if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            saved = json.loads(path.read_text())
            th = {k: (float(a), float(b)) for k, (a, b) in saved["thresholds"].items()}
            say(f"reusing the thresholds an earlier run calibrated on these weights: {path} (delete it to calibrate again)")
            return th, {**saved["info"], "reused": str(path)}
        except (OSError, ValueError, KeyError, TypeError) as e:
            say(f"the saved thresholds {path} cannot be read ({type(e).__name__}): calibrating again")
    say("calibrating thresholds (median and percentile) on the default prompts ...")
    th, info = calibrated_thresholds(model, tokenizer, vocab_size)
    if path is not None:
        try:  # written whole or not at all: another run may read it at the same time
            path.parent.mkdir(parents=True, exist_ok=True)
            report.write_json({"thresholds": th, "info": info}, path)
        except OSError as e:
            say(f"the thresholds were not saved ({e})")
    return th, info


@dataclass
class Quality:
    """The teacher-forced passes: first-pass rows, all rows, what they cost."""

    first: List[RowResult]
    rows: List[RowResult]
    reference_repeat: Optional[Dict[str, float]] = None
    forcing: Dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _timed(timings: Dict[str, float], key: str) -> Iterator[None]:
    """Wall seconds as ``key``, CPU seconds (all threads) as ``key`` with ``_cpu_s``: on a
    shared machine the wall time says as much about the neighbours as about the work."""
    tic, cpu = time.perf_counter(), time.process_time()
    yield
    timings[key] = time.perf_counter() - tic
    timings[key.replace("_s", "_cpu_s")] = time.process_time() - cpu


@dataclass(frozen=True)
class EvalOptions:
    """How :func:`evaluate` runs (every default in one place).

    Attributes:
        tokens: tokens of text used (>= 2), cut into windows of ``window``
            tokens; each window is one sequence (fresh cache and monitor).
        seed: seeds the random routers' permutations and the bootstrap.
        matched: add, for each entropy policy, a position rule at equal
            modeled bytes and a random router replaying a permutation of its
            gears (a second pass), each compared with it by a paired test.
        speed_tokens, speed_prompt: decode tokens per policy on the real
            kernels (0: skip), after a prompt of this many tokens.
        workload_tokens: tokens per workload prompt for the gear-by-workload
            generations (0: skip).
        speculative: add the speculative rows (needs the static low/mid rows
            of the draft scope in the policies; the default set has them).
        draft_calibration_tokens: high-gear tokens per calibration prompt
            when calibrating each drafter's block cap and stop (None: the
            calibration's own default, as ``--speculative --calibrate``).
        max_positions: most positions per forward pass (None: as many as
            keep a pass's logits near 128 MiB).
        scopes: the scopes of the default set's rows (policies None): None =
            both scopes and the nested store's rows; a list without ``all``
            leaves the nested store's rows out (they manage every layer).
        sparse_gear: target sparsities of the sparse low gear's rows
            (:mod:`.sparse_gear`, in ``"sparse_gear"`` of the results); empty: none.
        model_dir: the loaded model's folder: the thresholds' calibration and
            the nested store's planes (those of the quality passes' nested
            rows and of the speed and workload runs) are cached by its weights
            and read back by a later run (None: built every run).
    """

    tokens: int = DEFAULT_TOKENS
    window: int = DEFAULT_WINDOW
    seed: int = 0
    matched: bool = True
    speed_tokens: int = DEFAULT_SPEED_TOKENS
    speed_prompt: int = DEFAULT_SPEED_PROMPT
    workload_tokens: int = DEFAULT_WORKLOAD_TOKENS
    speculative: bool = True
    draft_calibration_tokens: Optional[int] = None
    max_positions: Optional[int] = None
    scopes: Optional[Sequence[str]] = None
    model_dir: Optional[Path] = None
    sparse_gear: Sequence[float] = ()


def evaluate(
    model: Any,
    tokenizer: Any,
    text: str,
    policies: Optional[Sequence[PolicySpec]] = None,
    *,
    config: Optional[GearboxConfig] = None,
    progress: Optional[Callable[[str], None]] = None,
    kv: Optional[KVOptions] = None,
    kv_calibration: Any = None,
    **options: Any,
) -> Dict[str, Any]:
    """Evaluate gear policies on ``model`` over the first ``tokens`` tokens of ``text``.

    Args:
        model, tokenizer: an mlx-lm model with its loaded weights, and its tokenizer.
        text: the evaluation text (raw; no chat template).
        policies: first-pass :class:`~gearbx_mlx.evaluation.specs.PolicySpec`
            rows, one of them static high; None = the default set (static
            high/mid/low, mlx-lm's mixed_4_6, entropy with default, median
            and percentile thresholds; scopes attention and all).
        config: :class:`~gearbx_mlx.config.GearboxConfig` of the monitor and gears.
        progress: status lines (e.g. :func:`~gearbx_mlx.evaluation.teacher.stderr_progress`).
        kv: the KV cache of every pass and speed run, quantized from the
            first token (``quantized_kv_start`` is taken as 0); None: mlx-lm's
            float cache. Each row gains the cache's modeled bytes per step
            beside the weights' (:func:`kv_columns`).
        kv_calibration: statistics for the rotated cache (as
            :func:`gearbx_mlx.stream_generate`'s); None: from the weights.
        options: :class:`EvalOptions` fields (``tokens``, ``window``, ...), or ``options=EvalOptions(...)``.

    Returns:
        The results dictionary (see ``benchmarks/results/eval_default.json``).
    """
    given = options.pop("options", None) or EvalOptions()
    # MLX's kernels by default: the quality rows are MLX's affine format (fake-quantized), and the
    # speed rows time the same layers for real (the package's kernels when the config says so).
    study = _Study(model, tokenizer, text, dataclasses.replace(given, **options), config or GearboxConfig(kernel="mlx"),
                   progress or (lambda _msg: None))
    return study.run(policies, kv, kv_calibration)


class _Study:
    """One evaluation's state: the text's windows, the layout, the timings."""

    def __init__(self, model: Any, tokenizer: Any, text: str, opts: EvalOptions, config: GearboxConfig,
                 say: Callable[[str], None]) -> None:
        _check_arguments(model, opts)
        self.model, self.tokenizer, self.text, self.opts, self.config, self.say = (
            model, tokenizer, text, opts, config, say)
        self.timings: Dict[str, float] = {}
        self.vocab = vocab_size_of(model, tokenizer)
        self.ids = text_tokens(tokenizer, text, opts.tokens)
        if len(self.ids) < 2:
            raise ValueError(f"the text has {len(self.ids)} token(s): at least 2 are needed")
        self.windows = split_windows(self.ids, opts.window)
        used = len(self.windows) * len(self.windows[0])
        if used < opts.tokens:
            say(f"the text gives {len(self.ids)} tokens for --tokens {opts.tokens}: scoring {used} "
                f"({len(self.windows)} window(s) of {len(self.windows[0])}; a shorter tail is dropped)")
        self.layout = ModelLayout.of(model, config, self.vocab)

    def run(self, policies: Optional[Sequence[PolicySpec]], kv: Optional[KVOptions],
            kv_calibration: Any) -> Dict[str, Any]:
        o, say, timings, width = self.opts, self.say, self.timings, len(self.windows[0])
        with _timed(timings, "calibration_s"):
            policies, thresholds, calibration_info = _policies(self.model, self.tokenizer, self.config, self.vocab,
                                                               policies, say, o)
        kv = dataclasses.replace(kv, quantized_kv_start=0) if kv is not None and kv.active else None
        with kv_cache(self.model, kv, kv_calibration) as kv_info:
            quality = _quality(self, policies)
        kv_info = {**kv_info, "context": width / 2, "bytes_per_step": kv_step_bytes(kv_info, width),
                   "method": KV_NOTE}
        speed: Dict[str, Dict[str, Any]] = {}
        if o.speed_tokens:
            with _timed(timings, "speed_s"):
                speed = _speed(self, quality.first, kv, kv_calibration)
        spec_section: Optional[Dict[str, Any]] = None
        if o.speculative:
            with _timed(timings, "speculative_s"):
                subject = DraftSubject(self.model, self.tokenizer, self.layout, self.config, self.vocab, width - 1,
                                       self.ids[:o.speed_prompt], o.draft_calibration_tokens)
                spec_section = evaluate_speculative(subject, quality.first, speed, say)
        work: Dict[str, Any] = {}
        if o.workload_tokens:
            with _timed(timings, "workloads_s"):
                # The entropy policies of the config's scope (the paper's default: attention).
                specs = [r.spec for r in quality.first if r.spec.kind == "entropy" and r.spec.scope == self.config.scope]
                work = gear_by_workload(self.model, self.tokenizer, specs, self.config, self.vocab, o.workload_tokens,
                                        progress=say)
        if spec_section:
            for r in spec_section["rows"]:
                # Each draft step reads the drafter's cache, each verify pass the high gear's: alike.
                kv_columns(r["modeled"], kv_info["bytes_per_step"] * (r["drafted_per_token"]
                                                                       + r["verify_passes_per_token"]))
        out = _document(self, quality, speed, spec_section, work, thresholds, calibration_info)
        for row in out["policies"]:
            kv_columns(row, kv_info["bytes_per_step"])
        out["kv_cache"] = kv_info
        if o.sparse_gear:
            with _timed(timings, "sparse_gear_s"):
                out["sparse_gear"] = sparse_gear_rows(self.model, self.tokenizer, self.windows, o.sparse_gear,
                                                      self.vocab)
        return out


#: How the KV column is made (recorded with the results).
KV_NOTE = ("the cache of every teacher-forced pass and speed run, quantized from the first token; bytes per step = "
           "cache bytes per cached token x the mean context of a window's steps (window / 2), in the model's "
           "float dtype (a float cache's keys and values, a quantized cache's scales and biases)")


@contextlib.contextmanager
def kv_cache(model: Any, kv: Optional[KVOptions], kv_calibration: Any) -> Iterator[Dict[str, Any]]:
    """The teacher-forced passes' KV cache; yields its summary (settings, bytes per cached token).

    The passes make their caches with mlx-lm's ``make_prompt_cache(model)``,
    which calls ``model.make_cache()``: for the passes that is pointed at the
    transform's own (an instance attribute, removed after), and the model's
    attention is restored when they end. The speed runs go through
    ``stream_generate``, which applies the same cache itself.
    """
    if kv is None:
        yield plain_summary(model, KVOptions())
        return
    session = open_kv(model, kv, kv_calibration, plain_too=True)
    model.make_cache = session.handle.make_cache
    try:
        yield session.summary()
    finally:
        del model.make_cache
        session.restore()


def kv_step_bytes(kv_info: Dict[str, Any], window: int) -> float:
    """Modeled cache bytes a decode step reads: bytes per cached token x the mean context (window / 2)."""
    per = kv_info.get("bytes_per_token") or 0.0
    return per * window / 2


def kv_columns(row: Dict[str, Any], kv_bytes: float) -> Dict[str, Any]:
    """Add the cache's bytes per token, and weights and cache together, to ``row`` (in place)."""
    row["kv_bytes_per_token"] = kv_bytes
    row["total_bytes_per_token"] = row["bytes_per_token"] + kv_bytes
    return row


def _check_arguments(model: Any, o: EvalOptions) -> None:
    """One clear error for bad arguments, before anything runs."""
    tokens, window, speed_tokens, speed_prompt = o.tokens, o.window, o.speed_tokens, o.speed_prompt
    workload_tokens, draft_calibration_tokens = o.workload_tokens, o.draft_calibration_tokens
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


def _policies(
    model: Any, tokenizer: Any, config: GearboxConfig, vocab: int, policies: Optional[Sequence[PolicySpec]],
    say: Callable[[str], None], opts: EvalOptions,
) -> Tuple[List[PolicySpec], Dict[str, Optional[Tuple[float, float]]], Dict[str, Any]]:
    """The first-pass specs, the thresholds behind them, and the calibration that gave them."""
    thresholds: Dict[str, Optional[Tuple[float, float]]] = {"default": scaled_thresholds(config, vocab)}
    if policies is not None:
        return list(policies), thresholds, {}
    scopes = opts.scopes
    cal, info = cached_thresholds(model, tokenizer, vocab, opts.model_dir, say)
    thresholds.update(cal)
    chosen = {"default": None, "median": cal["median"], "percentile": cal["percentile"]}
    if scopes is None:
        return base_specs(chosen), thresholds, info
    return base_specs(chosen, nested="all" in scopes, scopes=tuple(scopes)), thresholds, info


def _quality(study: _Study, policies: Sequence[PolicySpec]) -> Quality:
    """Pass 1 (the policies), then pass 2 (baselines matched to each entropy policy's gears)."""
    windows, layout, timings = study.windows, study.layout, study.timings
    matched, seed = study.opts.matched, study.opts.seed
    with TeacherForcing(study.model, windows, layout, study.config, study.vocab, policies,
                        max_positions=study.opts.max_positions, progress=study.say,
                        model_dir=study.opts.model_dir) as tf:
        with _timed(timings, "pass1_s"):
            first = tf.run(policies, "pass 1")
        out = Quality(first, list(first))
        entropy_rows = [(r.spec, r.window_gears(), r.bytes_per_token) for r in first if r.spec.kind == "entropy"]
        if matched and entropy_rows:
            ref = next(r for r in first if r.spec.is_reference)
            second_specs = [ref.spec] + matched_specs(entropy_rows, layout, len(windows[0]), seed)
            with _timed(timings, "pass2_s"):
                second = tf.run(second_specs, "pass 2")
            # The reference is kept from pass 1 (or recomputed the same way): record that it repeats.
            out.reference_repeat = {"pass1_perplexity": ref.perplexity, "pass2_perplexity": second[0].perplexity}
            out.rows += second[1:]
        out.forcing = {label: w.to_dict() for label, w in tf.work.items()}
        out.forcing["max_positions"] = tf.max_positions
    return out


def random_distributions(quality: Quality, steps: int, seed: int) -> Dict[str, Dict[str, Any]]:
    """``{entropy policy: its random baseline as a distribution}`` (:mod:`.permutation`), for each
    policy whose gears all have a static row in the first pass."""
    out = {}
    for r in quality.first:
        rows = gear_rows(quality.first, r) if r.spec.kind == "entropy" else None
        if rows is None:
            continue
        drawn = next((x for x in quality.rows if x.spec.kind == "random" and x.spec.matched_to == r.spec.name), None)
        out[r.spec.name] = random_distribution(r, rows, steps, seed, measured=drawn)
    return out


def _speed(study: _Study, first: Sequence[RowResult], kv: Optional[KVOptions] = None,
           kv_calibration: Any = None) -> Dict[str, Dict[str, Any]]:
    """Decode speed of the first-pass policies on the real kernels (the matched baselines differ
    only in their gear sequence)."""
    tokenizer, text, ids, say = study.tokenizer, study.text, study.ids, study.say
    speed_prompt, speed_tokens = study.opts.speed_prompt, study.opts.speed_tokens
    need = speed_prompt + speed_tokens
    speed_ids = ids if len(ids) >= need else text_tokens(tokenizer, text, need)
    if len(speed_ids) < need:
        say(f"speed skipped: the text has fewer than {need} tokens")
        return {}
    bench = SpeedBench(study.model, tokenizer, study.layout, study.config, study.vocab)
    bench.planes_dir = study.opts.model_dir
    if kv is not None:
        bench.kv = {"kv_bits": kv.bits, "kv_group_size": kv.group_size, "quantized_kv_start": 0,
                    "kv_rotation": kv.rotation, "kv_calibration": kv_calibration}
    return measure_speed(bench, [r.spec for r in first], speed_ids, len(study.windows[0]), speed_prompt,
                         speed_tokens, say)


def _document(study: _Study, quality: Quality, speed: Dict[str, Dict[str, Any]],
              spec_section: Optional[Dict[str, Any]], work: Dict[str, Any],
              thresholds: Dict[str, Optional[Tuple[float, float]]], calibration_info: Dict[str, Any]) -> Dict[str, Any]:
    """The results dictionary: rows, comparisons and verdict, traces, and how they were made."""
    timings, layout, config, vocab, tokenizer, text = (study.timings, study.layout, study.config, study.vocab,
                                                       study.tokenizer, study.text)
    tokens, windows, seed = study.opts.tokens, study.windows, study.opts.seed
    speed_prompt, speed_tokens = study.opts.speed_prompt, study.opts.speed_tokens
    ref_bytes = next(r for r in quality.rows if r.spec.is_reference).bytes_per_token
    rows = [report.policy_row(r, ref_bytes, speed.get(r.spec.name)) for r in quality.rows]
    compared = {r.spec.name for r in quality.rows if r.spec.kind == "entropy" or r.spec.matched_to}
    kl = {r.spec.name: r.kl for r in quality.rows if r.spec.name in compared}
    steps = len(windows[0]) - 1
    with _timed(timings, "random_distribution_s"):
        dists = random_distributions(quality, steps, seed)
    comps = report.comparisons(rows, kl, steps, seed, dists)
    return {
        "format": report.FORMAT,
        "version": report.VERSION,
        "model": {"vocab_size": vocab, "layout": layout.to_dict()},
        "text": {
            "tokens_requested": tokens,
            "tokens_used": len(windows) * len(windows[0]),
            "window": len(windows[0]),
            "windows": len(windows),
            "scored_positions": len(windows) * steps,
            "tokenization": tokenization_note(tokenizer, text, len(windows)),
        },
        "routing": {
            "lag": 0,
            "lag_note": LAG_NOTE,
            "reference": "static-high row of the same layers (the loaded weights)",
            "kl_units": "nats",
            "quality_method": (
                "teacher-forced: each row feeds the text through the KV cache, many steps per forward pass, "
                "each position through its own gear's weights (what step-by-step decoding computes); an entropy "
                "row's gears are guessed, run, and kept up to the first step its policy routes otherwise; "
                "managed layers hold the loaded weight and fake-quantized copies (mx.quantize then "
                f"mx.dequantize, affine, group {config.group_size})"
            ),
            "random_baseline": RANDOM_NOTE,
            "random_distribution": permutation.METHOD,
            "speed_method": (
                "gearbx_mlx.stream_generate on the real kernels (MLX QuantizedLinear/QuantizedEmbedding "
                "swapped by PrecisionManager), forced to the text's tokens: "
                f"{speed_prompt}-token prompt, {speed_tokens} decode tokens, lag 0, one run per first-pass "
                "policy after one warm-up"
            ),
            "monitor": config.to_dict(),
            "reference_in_pass2": quality.reference_repeat,
            "forcing": quality.forcing,
        },
        "significance": {"seed": seed, "test": "paired block bootstrap of per-position KL", **BOOTSTRAP.__dict__},
        "thresholds": {k: list(v) if v else None for k, v in thresholds.items()},
        "calibration": calibration_info,
        "policies": rows,
        "speculative": spec_section,
        "comparisons": comps,
        "verdict": report.verdict(comps),
        "traces": {r.spec.name: report.trace_entry(r, r.spec.name in compared) for r in quality.rows},
        "workloads": work,
        "timings": timings,
    }
