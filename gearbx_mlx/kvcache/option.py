"""The KV-cache option of generation: mlx-lm's flags in, an applied transform per stream out.

Generation takes mlx-lm's ``kv_bits``, ``kv_group_size`` and
``quantized_kv_start`` with mlx-lm's meaning (bits per cached element,
elements per quantization group along the head, and the cache length at
which the float cache is converted), plus
``kv_rotation``:

* ``"none"``: mlx-lm's own ``QuantizedKVCache``, unchanged;
* ``"auto"`` (the default), ``"srht"`` or ``"srft"``: the rotated cache of
  this package with the recipe :func:`recipe` picks for the model from its
  weights (rotation, λ, key offset, the attention sink; more bits for the
  layers whose ``k_proj`` biases put outlying offsets on the keys).

Where ``quantized_kv_start`` is not given, the rotated cache (built to keep
quality from the first token) quantizes the whole cache once the prompt has
been processed, so the prompt's prefill runs on float attention and every
generated token reads the quantized cache; mlx-lm's own cache keeps mlx-lm's
default of 5000 tokens.

:func:`open_kv` checks everything and applies the transform before the
first token; :class:`KVSession` makes the caches (or adopts a prompt cache),
takes a drafter's module tree too, and restores every module it changed
when the stream ends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..mlx_tables import KV_PLAIN_BITS
from .api import KVHandle, apply_kv
from .arch import attention_modules, describe
from .calibrate import KVCalibration, calibrate_weights
from .config import KVConfig, plain
from .outliers import DEFAULT_GROUP_SIZE, default_group_size
from .quantize import SUPPORTED_BITS, SUPPORTED_GROUPS, bits_per_element, check_quantized_attention

#: ``kv_rotation`` values: ``none`` is mlx-lm's plain cache.
ROTATION_CHOICES = ("auto", "srht", "srft", "none")
#: Bits ``mx.quantize`` takes (mlx-lm's plain cache).
PLAIN_BITS = KV_PLAIN_BITS
#: mlx-lm's default ``quantized_kv_start`` (``mlx_lm.generate.DEFAULT_QUANTIZED_KV_START``).
DEFAULT_QUANTIZED_KV_START = 5000


@dataclass(frozen=True)
class KVOptions:
    """The KV options of one generation call (mlx-lm's names and meaning).

    Attributes:
        bits: bits per cached element; None keeps mlx-lm's float cache.
        group_size: elements per quantization group (32, 64 or 128); None:
            64 for mlx-lm's cache, and for the rotated cache the model's
            default (:func:`~gearbx_mlx.kvcache.outliers.default_group_size`:
            32 where ``k_proj`` biases put outlying offsets on the keys).
        quantized_kv_start: the float cache is quantized once it holds this
            many tokens (0: from the first token). None (not given): for the
            rotated cache, which is made to be quantized early, the end of the
            stream's prompt (:meth:`at_prompt_end`; 0 where no prompt is known,
            :attr:`start`), and mlx-lm's 5000 for its own cache, whose plain
            4-bit quantization loses far more quality when it starts early.
        rotation: one of :data:`ROTATION_CHOICES`.
    """

    bits: Optional[int] = None
    group_size: Optional[int] = None
    quantized_kv_start: Optional[int] = None
    rotation: str = "auto"

    def __post_init__(self) -> None:
        if self.rotation not in ROTATION_CHOICES:
            raise ValueError(f"kv_rotation must be one of {', '.join(ROTATION_CHOICES)}, got {self.rotation!r}")
        # mx.quantize also takes 1 bit, which mlx-lm's plain cache may use; the
        # rotated cache's own quantizer and kernels stop at 2.
        allowed = PLAIN_BITS if self.rotation == "none" else SUPPORTED_BITS
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in allowed):
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, allowed))} with kv_rotation "
                             f"{self.rotation!r}, got {self.bits!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool)
                                            or self.group_size not in SUPPORTED_GROUPS):
            raise ValueError(f"kv_group_size must be one of {', '.join(map(str, SUPPORTED_GROUPS))}, "
                             f"got {self.group_size!r}")
        q = self.quantized_kv_start
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 0):
            raise ValueError(f"quantized_kv_start must be an integer >= 0, got {q!r}")

    @property
    def active(self) -> bool:
        """True when the cache is quantized at all."""
        return self.bits is not None

    @property
    def rotated(self) -> bool:
        return self.active and self.rotation != "none"

    def at_prompt_end(self, tokens: int) -> "KVOptions":
        """These options for a stream whose prompt ends at cache length ``tokens``.

        Where no start is given, the rotated cache holds the prompt in float while it is
        processed and quantizes all of it once the prompt is in, so every generated token
        reads a quantized cache: a prefill attending over a quantized cache ran 3.06x
        slower on a CPU (``scripts/bench_kv_prefill.py``, docs/BENCHMARKS.md). A given start,
        and mlx-lm's own cache, are left as they are.
        """
        if not self.rotated or self.quantized_kv_start is not None:
            return self
        return dataclasses.replace(self, quantized_kv_start=max(int(tokens), 0))

    @property
    def start(self) -> int:
        """The cache length at which quantizing starts (see ``quantized_kv_start``)."""
        if self.quantized_kv_start is not None:
            return self.quantized_kv_start
        return 0 if self.rotation != "none" else DEFAULT_QUANTIZED_KV_START

    @property
    def plain_group_size(self) -> int:
        """The group of mlx-lm's own cache (its default where none is given)."""
        return DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size


def recipe(model: nn.Module, options: KVOptions) -> KVConfig:
    """The :class:`KVConfig` the package uses for ``model``.

    Every model gets the rotation, λ, the key offset and the sink mapping, at
    the bits asked for in every layer. What differs between models comes from
    their statistics, never their name: where ``k_proj`` has biases (Qwen2.5),
    the key offset removes the large per-channel offsets they put on the keys
    (estimated from the biases through RoPE when no text calibration is
    given), which is what keeps 4-bit keys usable there. Unless a group size
    is asked for, such models (detected from the biases,
    :func:`~gearbx_mlx.kvcache.outliers.default_group_size`) get groups of
    32: statistics estimated from the weights leave more of the offset
    behind than a text calibration does. Giving their outlier layers 8 bits
    instead (``KVConfig(outliers="auto")``) costs 5.5 bits per element on
    Qwen2.5-Coder-0.5B, over the 5.0 of groups of 32 (docs/BENCHMARKS.md,
    "KV cache").
    """
    if not options.active:
        raise ValueError("no KV bits given: the float cache needs no recipe")
    if options.rotation == "none":
        return plain(options.bits, options.plain_group_size, options.start)
    group = default_group_size(model) if options.group_size is None else options.group_size
    return KVConfig(bits=options.bits, group_size=group, rotation=options.rotation,
                    quantized_kv_start=options.start)


def check_caches(model: nn.Module) -> None:
    """ValueError unless every layer of ``model`` keeps a plain growing ``KVCache``.

    Sliding-window (rotating) and state-space caches keep other states than
    a list of keys and values; neither mlx-lm nor this package quantizes them.
    """
    make = getattr(model, "make_cache", None)
    if make is None:
        return
    kinds = sorted({type(c).__name__ for c in make() if type(c) is not KVCache})
    if kinds:
        raise ValueError(
            f"this model's layers keep {', '.join(kinds)} caches (sliding-window or state caches), which "
            "cannot be quantized: run it without --kv-bits"
        )


def check_backend(model: nn.Module, bits: Sequence[int], group_size: int, copies: bool = False) -> None:
    """ValueError before generation where this MLX build cannot attend over such a cache
    (:func:`~gearbx_mlx.kvcache.quantize.check_quantized_attention`, per head size and bits;
    ``copies``: the caches are this package's, which hand attention contiguous copies
    where the backend needs them)."""
    try:
        dims = sorted({i.head_dim for i in describe(model)})
    except ValueError:  # an architecture the rotation cannot take may still run mlx-lm's plain cache
        a = getattr(model, "args", None)
        d = getattr(a, "head_dim", None) or (
            a.hidden_size // a.num_attention_heads if getattr(a, "num_attention_heads", None) else None)
        dims = [d] if d else []
    floats = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    dtype = floats[0] if floats else mx.float16
    for d in dims:
        for b in bits:
            check_quantized_attention(b, group_size, d, dtype, copies=copies)


def float_bytes_per_token(model: nn.Module, dtype_bytes: int = 2) -> float:
    """Bytes one token adds to a float cache of ``dtype_bytes`` per element (keys and values, all layers)."""
    return float(sum(2 * i.n_kv_heads * i.head_dim * dtype_bytes for i in describe(model)))


def float_cache_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of mlx-lm's float cache for ``model``: that of the keys it computes, i.e. of the
    first attention layer's ``k_proj`` weight (its scales if quantized, any nested plane's scales);
    float16 if none is found."""
    for attn in attention_modules(model)[:1]:
        for _, a in tree_flatten(attn["k_proj"].parameters()):
            if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
                return a.dtype
    return mx.float16


class KVSession:
    """One stream's KV transform: the model's handle, a drafter's, and the caches.

    Attributes:
        options: what was asked.
        config: the recipe applied.
        handle: the model's :class:`~gearbx_mlx.kvcache.KVHandle`.
    """

    def __init__(self, model: nn.Module, options: KVOptions, config: KVConfig, handle: KVHandle,
                 calibration: Optional[KVCalibration]) -> None:
        self.model = model
        self.options = options
        self.config = config
        self.handle = handle
        self.calibration = calibration
        self.handles: List[KVHandle] = [handle]

    def quantize_due(self, caches: List[Any]) -> None:
        """Convert float caches that reached ``quantized_kv_start`` (in place).

        What mlx-lm's ``maybe_quantize_kv_cache`` does in its own loop, for
        loops that are not mlx-lm's (speculative decoding).
        """
        start = self.config.quantized_kv_start
        for i, c in enumerate(caches):
            if hasattr(c, "to_quantized") and getattr(c, "tag", None) is not None and c.offset >= start:
                caches[i] = c.to_quantized()

    def prompt_cache(self, cache: Optional[List[Any]] = None) -> List[Any]:
        """The model's cache for this stream: new, or ``cache`` adopted in place.

        An empty list or a list of empty mlx-lm caches (``make_prompt_cache``)
        is filled in place with this transform's caches, so the caller's list
        carries the conversation to the next call; a cache this transform
        (same settings and calibration) made is used as is.

        Raises:
            ValueError: a cache that holds tokens in another basis.
        """
        if cache is None:
            return self.handle.make_cache()
        check_cache_list(cache)
        if not cache or all(getattr(c, "tag", None) is None and getattr(c, "offset", 0) == 0 for c in cache):
            cache[:] = self.handle.make_cache()
            return cache
        self.handle.check_cache(cache)
        return cache

    def attach(self, module: nn.Module) -> KVHandle:
        """Apply the same transform to a drafter's module tree (its attention copies).

        Raises:
            ValueError: the tree shares attention modules with the model, or
                another architecture.
        """
        mine = {id(a) for a in attention_modules(self.model)}
        if any(id(a) in mine for a in attention_modules(module)):
            raise ValueError("the drafter shares attention modules with the model: it already carries the transform")
        # The calibration was checked against the model; the drafter's
        # quantized k_proj would not match its probe exactly.
        h = apply_kv(module, self.config, self.handle.calibration, check_calibration=False)
        self.handles.append(h)
        return h

    def bytes_per_token(self) -> float:
        """Cache bytes one token adds once quantized: codes, and scales and biases in the
        model's float dtype (the keys' dtype, which ``mx.quantize`` keeps)."""
        return self.handle.bytes_per_token(float_cache_dtype(self.model).size)

    def summary(self) -> Dict[str, Any]:
        """JSON-ready: the cache's settings, its bytes per token, and those of the float cache it replaces."""
        s = self.handle.summary()
        dtype = float_cache_dtype(self.model)
        f16 = float_bytes_per_token(self.model)
        bpt = self.bytes_per_token()
        cal = self.calibration
        return {
            "kind": "rotated" if self.options.rotated else "affine",
            "bits": self.config.bits, "group_size": self.config.group_size,
            "quantized_kv_start": self.config.quantized_kv_start,
            "rotation": s["rotation"], "lambda": s["lambda"], "key_offset": s["key_offset"], "sink": s["sink"],
            "statistics": None if cal is None else cal.source,
            "layer_bits": s["layer_bits"], "bits_per_element": round(self.handle.bits_per_element(dtype.size), 4),
            "scale_dtype": _name(dtype), "bytes_per_token": bpt, **_against_float(f16, dtype, bpt),
        }

    def restore(self) -> None:
        """Put every module back as loaded (idempotent)."""
        for h in reversed(self.handles):
            h.restore()

    def __enter__(self) -> "KVSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def plain_summary(model: nn.Module, options: KVOptions) -> Dict[str, Any]:
    """The summary of mlx-lm's own cache (``kv_rotation='none'`` or no bits)."""
    try:
        f16 = float_bytes_per_token(model)
    except ValueError:
        f16 = None
    dtype = float_cache_dtype(model)  # the cache holds keys and values (or scales and biases) in it
    if not options.active:
        ratio = dtype.size / 2
        return {"kind": "float", "dtype": _name(dtype), "bytes_per_token": None if f16 is None
                else f16 * ratio, "float16_bytes_per_token": f16, "ratio_to_float16": ratio if f16 else None}
    bpe = bits_per_element(options.bits, options.plain_group_size, dtype.size)
    bpt = None if f16 is None else f16 * bpe / 16
    return {"kind": "affine", "bits": options.bits, "group_size": options.plain_group_size,
            "quantized_kv_start": options.start, "rotation": ["none"], "lambda": False,
            "key_offset": False, "sink": False, "statistics": None, "bits_per_element": bpe,
            "scale_dtype": _name(dtype), "bytes_per_token": bpt, **_against_float(f16, dtype, bpt)}


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]


def _against_float(f16: Optional[float], dtype: mx.Dtype, bpt: Optional[float]) -> Dict[str, Any]:
    """A quantized cache's bytes per token against float16's and against the float cache it
    replaces (the model's dtype: a float32 model's float cache is twice float16's)."""
    if f16 is None or bpt is None:
        return {"float16_bytes_per_token": f16, "ratio_to_float16": None, "float_dtype": _name(dtype),
                "ratio_to_float": None}
    return {"float16_bytes_per_token": f16, "ratio_to_float16": bpt / f16, "float_dtype": _name(dtype),
            "ratio_to_float": bpt / (f16 * dtype.size / 2)}


def as_calibration(value: Any) -> Optional[KVCalibration]:
    """A :class:`KVCalibration` from one, its dict (as saved in a calibration file), or None."""
    if value is None or isinstance(value, KVCalibration):
        return value
    if isinstance(value, dict):
        return KVCalibration.from_dict(value)
    raise TypeError(f"kv_calibration must be a KVCalibration or its dict, got {type(value).__name__}")


def check_cache_list(cache: Any) -> None:
    """A caller's ``prompt_cache`` must be a list (it is filled or extended in place) of mlx-lm caches."""
    if not isinstance(cache, list) or not all(hasattr(c, "state") for c in cache):
        raise TypeError(f"prompt_cache must be a list of KV caches, one per layer (mlx_lm.models.cache."
                        f"make_prompt_cache(model)), got {type(cache).__name__}")


def plain_prompt_cache(model: nn.Module, cache: Optional[List[Any]], max_kv_size: Optional[int] = None
                       ) -> Optional[List[Any]]:
    """A caller's prompt cache for a stream on mlx-lm's own caches (no rotated cache).

    An empty list is filled in place with ``make_prompt_cache(model, max_kv_size)``,
    as :meth:`KVSession.prompt_cache` fills it for the rotated cache (mlx-lm's own
    loop fails on one with an ``IndexError``).

    Raises:
        TypeError: not a list of caches.
        ValueError: another number of layers than the model's, or a cache the rotated
            KV cache made: its keys and values are in a rotated basis that these layers'
            attention does not undo (read as noise).
    """
    if cache is None:
        return None
    check_cache_list(cache)
    layers = len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)  # as mlx-lm counts
    if cache and len(cache) != layers:
        raise ValueError(f"prompt_cache holds {len(cache)} layer caches, the model has {layers}: make it with "
                         "mlx_lm.models.cache.make_prompt_cache(model) for this model")
    for i, c in enumerate(cache):
        if getattr(c, "tag", None) is not None:
            raise ValueError(f"layer {i}'s cache was made by the rotated KV cache: its keys are in a rotated basis "
                             "that mlx-lm's caches do not read; continue it with the same kv_bits, kv_rotation and "
                             "calibration, or start from an empty cache")
    if not cache:
        cache[:] = make_prompt_cache(model, max_kv_size)
    return cache


def open_kv(model: nn.Module, options: KVOptions, calibration: Any = None,
            draft: Optional[nn.Module] = None, plain_too: bool = False) -> Optional[KVSession]:
    """Check and apply the rotated cache for one stream; None for mlx-lm's own caches.

    Args:
        model: the loaded mlx-lm model (the gearbox's, in any gear).
        options: the stream's KV options.
        calibration: statistics for λ and the offsets (text-calibrated, as
            saved with the calibration file); None: estimated from the weights.
        draft: a drafter's module tree that gets the same transform.
        plain_too: also make mlx-lm's plain quantized cache (``rotation
            "none"``) through a session, for loops that make their own caches
            (speculative decoding); the cache format is mlx-lm's.

    Raises:
        ValueError: an architecture whose attention or caches cannot take the
            rotation, a calibration of another model, a head size the group
            does not divide; all before any module changes.
    """
    if not options.active:
        return None
    check_caches(model)
    config = recipe(model, options)
    bits = {config.bits, *config.layer_bits.values()} | ({config.outlier_bits} if config.outliers != "none" else set())
    check_backend(model, sorted(bits), config.group_size, copies=options.rotated or plain_too)
    if not (options.rotated or plain_too):
        return None
    cal = as_calibration(calibration) if config.needs_statistics else None
    if cal is None and config.needs_statistics:
        cal = calibrate_weights(model)
    handle = apply_kv(model, config, cal)
    session = KVSession(model, options, config, handle, cal)
    if draft is not None:
        try:
            session.attach(draft)
        except BaseException:
            session.restore()
            raise
    return session


def options_from(kwargs: Dict[str, Any], keys: Sequence[str] = ("kv_bits", "kv_group_size", "quantized_kv_start",
                                                                  "kv_rotation")) -> KVOptions:
    """Pop mlx-lm-style KV keyword arguments from ``kwargs`` into :class:`KVOptions`."""
    got = {k: kwargs.pop(k) for k in keys if k in kwargs}
    return KVOptions(
        bits=got.get("kv_bits"),
        group_size=got.get("kv_group_size"),
        quantized_kv_start=got.get("quantized_kv_start"),
        rotation=got.get("kv_rotation") or "auto",
    )
