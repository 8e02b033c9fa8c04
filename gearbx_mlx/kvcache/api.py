"""Apply the rotated KV cache to a loaded model, make its caches, and undo it.

    >>> from gearbx_mlx.kvcache import KVConfig, apply_kv, calibrate_text
    >>> cal = calibrate_text(model, tokenizer.encode(text))      # optional
    >>> with apply_kv(model, KVConfig(bits=4), cal) as kv:
    ...     cache = kv.make_cache()                              # one per layer
    ...     logits = model(tokens[None], cache=cache)
    >>> # here the model is back to the very modules it was loaded with

What applying does: each attention module becomes an instance of a small
subclass of its own class whose only change is attribute lookup of
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and ``rope``
(:mod:`.transform`); its parameters, child modules and ``__call__`` are
untouched, and :meth:`KVHandle.restore` sets the class back. A gear shift
(``model.update_modules``) during that time installs its modules as usual
and the transform follows them. Nothing is copied unless ``fold`` (float
q/k/v/o projections are then copied once with the transform folded in).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .arch import AttentionInfo, attention_modules, describe
from .cache import RotatedKVCache, RotatedQuantizedKVCache
from .calibrate import KVCalibration, calibrate_weights
from .config import KVConfig
from .outliers import OUTLIER_THRESHOLD, outlier_scores
from .quantize import bits_per_element
from .rotation import Rotation, hadamard_supported
from .sink import KeyRotation, sink_reflections
from .transform import LayerTransform, LayerView, install, key_scale, uninstall


def rotation_kind(config: KVConfig, head_dim: int) -> str:
    """The rotation a layer of ``head_dim`` gets (resolves ``"auto"``)."""
    if config.rotation != "auto":
        return config.rotation
    return "srht" if hadamard_supported(head_dim) else "srft"


def layer_bits(config: KVConfig, n_layers: int, scores: Optional[List[float]] = None) -> List[int]:
    """Cache bits of each layer: ``bits``, outlier layers, then ``layer_bits``."""
    out = [config.bits] * n_layers
    if config.outliers == "auto" and scores is not None:
        for i, s in enumerate(scores):
            if s > OUTLIER_THRESHOLD:
                out[i] = config.outlier_bits
    for i, b in config.layer_bits.items():
        if i >= n_layers:
            raise ValueError(f"layer_bits names layer {i}, but the model has {n_layers} layers")
        out[i] = b
    return out


def _check(config: KVConfig, infos: List[AttentionInfo]) -> None:
    for info in infos:
        d = info.head_dim
        if d % config.group_size:
            raise ValueError(
                f"layer {info.index}: head dimension {d} is not a multiple of the group size "
                f"{config.group_size}; pick a group size dividing {d}"
            )
        kind = rotation_kind(config, d)
        if kind == "srht" and not hadamard_supported(d):
            raise ValueError(
                f"layer {info.index}: the Hadamard rotation needs a head dimension m*2^k "
                f"(m in 1, 12, 20, 28), got {d}; use rotation='srft' or 'auto'"
            )


def build_transforms(
    model: nn.Module, config: KVConfig, calibration: Optional[KVCalibration], check_calibration: bool = True
) -> List[LayerTransform]:
    """Every layer's :class:`LayerTransform` (validates everything first)."""
    infos = describe(model)
    _check(config, infos)
    if calibration is not None:
        if check_calibration:
            calibration.check(model)
        calibration.check_shapes([(i.n_kv_heads, i.head_dim) for i in infos])
    scores = outlier_scores(model) if config.outliers == "auto" else None
    bits = layer_bits(config, len(infos), scores)
    out = []
    for info in infos:
        d = info.head_dim
        kind = rotation_kind(config, d)
        rot = Rotation.make(kind, d, config.seed, 2 * info.index)
        vrot = Rotation.make(kind, d, config.seed, 2 * info.index + 1)
        stats = calibration.layers[info.index] if calibration is not None else None
        scale = key_offset = value_offset = None
        key_rot = KeyRotation(rot, None, info.repeats)
        if stats is not None:
            lam = key_scale(stats, info, float(config.lam_alpha))
            if lam is not None:
                scale = mx.array(lam.astype("float32"))
            if config.sink and not rot.identity:
                w = sink_reflections(stats.k_first, stats.k_mean, lam, rot, config.group_size)
                if w is not None:
                    key_rot = KeyRotation(rot, mx.array(w.astype("float32")), info.repeats)
            if config.key_offset != "none":
                base = stats.k_mean if config.key_offset == "mean" else 0.5 * (stats.k_mean + stats.k_wmean)
                mu = mx.array(base.astype("float32"))
                if scale is not None:
                    mu = mu * scale  # λ per pair commutes with RoPE, so it scales the mean too
                key_offset = key_rot.forward_heads(mu)
            if config.value_offset:
                value_offset = mx.array(stats.v_mean.astype("float32"))
        out.append(LayerTransform(info, key_rot, vrot, scale, key_offset, value_offset,
                                  bits[info.index], config.group_size, config.quantizer))
    mx.eval([[t.scale, t.key_offset, t.value_offset] for t in out])
    return out


class KVHandle:
    """An applied KV transform: makes the caches, reports, restores.

    Attributes:
        model: the model it is applied to.
        config: the settings.
        calibration: the statistics used (None: rotation only).
        transforms: one :class:`LayerTransform` per layer.
    """

    def __init__(self, model: nn.Module, config: KVConfig, calibration: Optional[KVCalibration],
                 transforms: List[LayerTransform]) -> None:
        self.model = model
        self.config = config
        self.calibration = calibration
        self.transforms = transforms
        self._attns = attention_modules(model)
        self.active = False
        # The basis, not where quantizing starts: a later turn's start (its prompt's end) differs,
        # and the cache it adopts holds keys and values in the same basis either way.
        basis = {k: v for k, v in config.to_dict().items() if k != "quantized_kv_start"}
        digest = hashlib.sha256(json.dumps(basis, sort_keys=True).encode())
        if calibration is not None:
            digest.update(json.dumps(calibration.to_dict()["layers"]).encode())
        #: Names this transform; the caches it makes carry it.
        self.tag = digest.hexdigest()[:16]

    def _install(self) -> None:
        views = []
        for attn, t in zip(self._attns, self.transforms):
            views.append(LayerView(t, attn, self.config.fold))
        done = []
        try:
            for attn, v in zip(self._attns, views):
                install(attn, v)
                done.append(attn)
        except Exception:
            for attn in done:
                uninstall(attn)
            raise
        self.active = True

    # -- caches ----------------------------------------------------------------------
    def make_cache(self) -> List[Any]:
        """One cache per layer (what ``model.make_cache()`` would return).

        Quantized from the first token when ``quantized_kv_start`` is 0; else
        float caches that mlx-lm's ``maybe_quantize_kv_cache`` converts.
        """
        if not self.active:
            raise ValueError("this KV handle was restored; apply_kv again to make caches")
        start = self.config.quantized_kv_start
        out: List[Any] = []
        for t in self.transforms:
            if start > 0:
                out.append(RotatedKVCache(t.key_offset, t.group_size, t.bits, t.quantizer, self.tag))
            else:
                out.append(RotatedQuantizedKVCache(t.group_size, t.bits, t.key_offset, t.quantizer, self.tag))
        return out

    def check_cache(self, cache: List[Any]) -> None:
        """ValueError unless ``cache`` (e.g. a loaded prompt cache) was made by this transform.

        Its keys and values live in this transform's rotated basis; a cache
        of another transform, or an mlx-lm cache that already holds tokens,
        would be read as noise.
        """
        if len(cache) != len(self.transforms):
            raise ValueError(f"the cache has {len(cache)} layers, the model {len(self.transforms)}")
        for i, c in enumerate(cache):
            tag = getattr(c, "tag", None)
            if tag == self.tag:
                continue
            if tag is None and getattr(c, "offset", 0) == 0:
                continue  # an empty mlx-lm cache holds nothing in any basis
            raise ValueError(
                f"layer {i}'s cache was made under another KV transform (or none): its keys are "
                "in another basis; start from an empty cache or the same settings and calibration"
            )

    # -- reporting -------------------------------------------------------------------
    @property
    def layer_bits(self) -> List[int]:
        return [t.bits for t in self.transforms]

    def bits_per_element(self, scale_bytes: int = 2) -> float:
        """Mean stored bits per cached element over layers, scales and biases included."""
        per = [bits_per_element(t.bits, t.group_size, scale_bytes) * t.info.n_kv_heads * t.info.head_dim
               for t in self.transforms]
        n = sum(t.info.n_kv_heads * t.info.head_dim for t in self.transforms)
        return sum(per) / n

    def bytes_per_token(self, scale_bytes: int = 2) -> float:
        """Cache bytes one token adds (keys and values of every layer)."""
        return sum(2 * t.info.n_kv_heads * t.info.head_dim * bits_per_element(t.bits, t.group_size, scale_bytes) / 8
                   for t in self.transforms)

    def summary(self) -> Dict[str, Any]:
        c = self.config
        return {
            "bits": c.bits, "group_size": c.group_size,
            "rotation": sorted({t.rotation.kind for t in self.transforms}),
            "sink": any(t.rotation.reflect is not None for t in self.transforms),
            "lambda": any(t.scale is not None for t in self.transforms),
            "key_offset": any(t.key_offset is not None for t in self.transforms),
            "value_offset": any(t.value_offset is not None for t in self.transforms),
            "layer_bits": self.layer_bits, "bits_per_element": round(self.bits_per_element(), 4),
            "calibration": None if self.calibration is None else self.calibration.source,
            "quantizer": c.quantizer, "fold": c.fold,
        }

    # -- undo ------------------------------------------------------------------------
    def restore(self) -> None:
        """Put every attention back to its own class (idempotent)."""
        for attn in self._attns:
            uninstall(attn)
        self.active = False

    def __enter__(self) -> "KVHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def apply_kv(
    model: nn.Module,
    config: Optional[KVConfig] = None,
    calibration: Optional[KVCalibration] = None,
    check_calibration: bool = True,
) -> KVHandle:
    """Transform ``model``'s attention for a quantized KV cache (reversibly).

    Args:
        model: an mlx-lm model with llama-family or qwen2 attention.
        config: the settings (default :class:`KVConfig`).
        calibration: statistics for λ and the offsets. None: taken from the
            weights (:func:`calibrate_weights`) when ``config`` asks for any.
        check_calibration: check that ``calibration`` was taken on this
            model's weights; off for a drafter's tree (its quantized
            ``k_proj`` is the calibrated model's, rounded).

    Raises:
        ValueError: an unsupported attention, bits or group size, a head size
            the rotation or group cannot take, a calibration of another
            model, or a model already carrying a KV transform.
    """
    config = config or KVConfig()
    if not isinstance(config, KVConfig):
        raise TypeError(f"config must be a KVConfig, got {type(config).__name__}")
    if calibration is not None and not isinstance(calibration, KVCalibration):
        raise TypeError(f"calibration must be a KVCalibration, got {type(calibration).__name__}")
    if calibration is None and config.needs_statistics:
        calibration = calibrate_weights(model)
    handle = KVHandle(model, config, calibration, build_transforms(model, config, calibration, check_calibration))
    handle._install()
    return handle
