"""Per-layer, per-channel key/query/value statistics, from a short text or the weights.

What is measured (per layer, per key/value head, per channel; keys and
queries after RoPE, in the model's own basis, before any rotation):

* ``q_energy``: mean of q² over tokens and the query heads of the group;
* ``k_var``: variance of k over tokens (centred);
* ``k_mean``: mean of k over tokens (the key offset);
* ``k_wmean``: mean of k weighted by the attention each key receives;
* ``k_first``: the key of the first position (the attention sink);
* ``v_mean``: mean of v.

:mod:`gearbx_mlx.kvcache.transform` turns them into the scale λ and the key
offset μ for any rotation, so one calibration serves every rotation seed and
kind. They are small (five ``(n_kv_heads, head_dim)`` arrays a layer) and
serialise to JSON, to be stored beside the gearbox's thresholds.

Two sources:

* :func:`calibrate_text`: one forward pass over a short text (512 tokens by
  default) with the attention inputs recorded, then q/k/v recomputed from
  them with the layer's own modules. No KV cache is involved.
* :func:`calibrate_weights`: no text at all. Assuming the RMS-normalised
  attention input has uncorrelated unit-variance coordinates, a key channel's
  variance is ``||W_k[i] ⊙ g||²`` (``g`` the norm's weight) and its mean is
  the ``k_proj`` bias carried through RoPE and averaged over ``context``
  positions; queries likewise. Crude, but it finds the large ``k_proj``
  biases that make plain 4-bit keys fail on Qwen2.5, from the weights alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..atomicfile import write_json
from .arch import AttentionInfo, attention_modules, describe, input_norm_weight

KV_CALIBRATION_FORMAT = 1
SOURCES = ("text", "weights")
_FIELDS = ("q_energy", "k_var", "k_mean", "k_wmean", "k_first", "v_mean")


@dataclass
class LayerStats:
    """One layer's statistics; each array is ``(n_kv_heads, head_dim)`` float64."""

    q_energy: np.ndarray
    k_var: np.ndarray
    k_mean: np.ndarray
    k_wmean: np.ndarray
    k_first: np.ndarray
    v_mean: np.ndarray

    def to_dict(self) -> Dict[str, List[List[float]]]:
        return {f: np.round(getattr(self, f), 7).tolist() for f in _FIELDS}

    @classmethod
    def from_dict(cls, d: Dict[str, Any], where: str = "layer") -> "LayerStats":
        """Checked: every field a finite ``(n_kv_heads, head_dim)`` array, all of one shape.

        Raises:
            ValueError: names ``where`` and the field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object of statistics, got {type(d).__name__}")
        arrays = {f: _stat_array(d, f, where) for f in _FIELDS}
        first = _FIELDS[0]
        for f, a in arrays.items():
            if a.shape != arrays[first].shape:
                raise ValueError(f"{where}.{f} has shape {a.shape}, {where}.{first} has {arrays[first].shape}: "
                                 "one (n_kv_heads, head_dim) shape for every statistic of a layer")
        return cls(**arrays)

    @property
    def shape(self) -> Tuple[int, ...]:
        """``(n_kv_heads, head_dim)``."""
        return tuple(self.k_var.shape)


def _stat_array(d: Dict[str, Any], f: str, where: str) -> np.ndarray:
    """Field ``f`` of one layer's statistics as a finite 2-D float64 array (ValueError naming it)."""
    if f not in d:
        raise ValueError(f"{where} lacks {f!r}")
    try:
        a = np.asarray(d[f], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.{f} is not a (n_kv_heads, head_dim) array of numbers") from None
    if a.ndim != 2 or 0 in a.shape:
        raise ValueError(f"{where}.{f} must be a (n_kv_heads, head_dim) array, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{where}.{f} holds NaN or infinity (a statistic must be finite: calibrate again)")
    if np.abs(a).max() > MAX_STATISTIC:
        raise ValueError(f"{where}.{f} holds {np.abs(a).max():.3g}, beyond any key or query statistic "
                         f"(|x| <= {MAX_STATISTIC:.0e}): the file is damaged, calibrate again")
    return a


#: The largest magnitude a saved statistic may have: keys and queries of float16 models stay far below
#: float16's 65504 (their squares below 1e10); larger ones overflow the transform into NaN logits.
MAX_STATISTIC = 1e10


@dataclass
class KVCalibration:
    """Statistics of every attention layer of one model, and where they came from."""

    layers: List[LayerStats]
    fingerprint: Dict[str, Any]
    source: str
    n_tokens: int = 0
    text_sha256: str = ""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready (also to embed in a gearbox ``Calibration.extra``)."""
        return {
            "format": KV_CALIBRATION_FORMAT,
            "source": self.source,
            "n_tokens": self.n_tokens,
            "text_sha256": self.text_sha256,
            "created": self.created,
            "fingerprint": self.fingerprint,
            "layers": [s.to_dict() for s in self.layers],
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "KVCalibration":
        """Checked: every statistic finite and of the shape the saved fingerprint gives its layer.

        Raises:
            ValueError: names the field (``layers[i].k_var``, ...) and what is wrong.
        """
        if not isinstance(d, dict) or d.get("format") != KV_CALIBRATION_FORMAT:
            raise ValueError(f"not a KV calibration of format {KV_CALIBRATION_FORMAT}")
        if not isinstance(d.get("layers"), list):
            raise ValueError("malformed KV calibration ('layers' must be a list)")
        layers = [LayerStats.from_dict(x, f"layers[{i}]") for i, x in enumerate(d["layers"])]
        try:
            out = cls(
                layers=layers, fingerprint=d["fingerprint"], source=d["source"], n_tokens=int(d["n_tokens"]),
                text_sha256=d.get("text_sha256", ""), created=d.get("created", ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed KV calibration ({e})") from None
        if not isinstance(out.fingerprint, dict):
            raise ValueError("malformed KV calibration ('fingerprint' must be an object)")
        if not isinstance(out.source, str) or not out.source:
            raise ValueError(f"malformed KV calibration ('source' must name where the statistics came from, "
                             f"got {out.source!r})")
        out.check_shapes(_fingerprint_shapes(out.fingerprint), "the fingerprint's model")
        return out

    def check_shapes(self, shapes: Sequence[Tuple[int, int]], whose: str = "the model") -> None:
        """ValueError unless there is one layer per ``(n_kv_heads, head_dim)`` of ``shapes``, of that shape."""
        if len(self.layers) != len(shapes):
            raise ValueError(f"'layers' has {len(self.layers)} layers, {whose} has {len(shapes)}")
        for i, (s, want) in enumerate(zip(self.layers, shapes)):
            if s.shape != tuple(want):
                raise ValueError(f"layers[{i}] statistics have shape {s.shape}; {whose}'s layer {i} has "
                                 f"(n_kv_heads, head_dim) = {tuple(want)}")

    def save(self, path: "str | os.PathLike") -> Path:
        """Write JSON atomically (temporary file, then rename)."""
        path = Path(path)
        if not path.parent.exists():
            raise FileNotFoundError(f"cannot save the KV calibration: {path.parent} does not exist")
        return write_json(path, self.to_dict(), indent=None)

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "KVCalibration":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"KV calibration file not found: {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a KV calibration JSON file: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def check(self, model: nn.Module) -> None:
        """ValueError unless these statistics were taken on ``model``'s weights (and fit its shapes)."""
        mismatch = fingerprint_mismatch(self.fingerprint, model_fingerprint(model))
        if mismatch:
            raise ValueError(
                f"this KV calibration belongs to another model ({mismatch}); calibrate "
                "again on this model (calibrate_text or calibrate_weights)"
            )
        self.check_shapes([(i.n_kv_heads, i.head_dim) for i in describe(model)])


# -- fingerprints -------------------------------------------------------------------


def _fingerprint_shapes(fp: Dict[str, Any]) -> List[Tuple[int, int]]:
    """Per layer ``(n_kv_heads, head_dim)`` as a saved fingerprint states them."""
    n, heads, dims = fp.get("n_layers"), fp.get("n_kv_heads"), fp.get("head_dim")
    ok = (isinstance(n, int) and isinstance(heads, list) and isinstance(dims, list) and len(heads) == len(dims) == n
          and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in heads + dims))
    if not ok:
        raise ValueError("malformed KV calibration ('fingerprint' needs n_layers and, per layer, n_kv_heads and "
                         "head_dim as positive integers)")
    return list(zip(heads, dims))


def dense_weight(module: Any) -> Optional[mx.array]:
    """A float copy of a linear layer's weight (dequantized if need be)."""
    if isinstance(module, nn.QuantizedLinear):
        return mx.dequantize(module.weight, module.scales, module.get("biases"),
                             module.group_size, module.bits).astype(mx.float32)
    if isinstance(module, nn.Linear):
        return module.weight.astype(mx.float32)
    nested = getattr(module, "nested", None)
    shape = getattr(nested, "shape", None)
    if nested is not None and shape is not None and callable(module):
        # A gear view over nested bit planes (the default store): its weight
        # as that gear reads it, recovered by multiplying the identity.
        y = module(mx.eye(shape[1], dtype=mx.float32)).astype(mx.float32)
        b = linear_bias(module)
        return (y if b is None else y - b).T
    return None


def _probe(w: mx.array, n: int = 4) -> List[float]:
    """``n`` bilinear probes ``r_a^T W s_a`` of a weight with fixed ±1 vectors.

    Random-sign sums: two different models (even of one init distribution)
    give unrelated values, while a cast to float16 or an 8-bit gear moves them
    by well under a percent of their norm.
    """
    rng = np.random.default_rng(20260507)
    r = mx.array(rng.choice([-1.0, 1.0], size=(n, w.shape[0])).astype(np.float32))
    s = mx.array(rng.choice([-1.0, 1.0], size=(n, w.shape[1])).astype(np.float32))
    return [float(v) for v in ((r @ w) * s).sum(axis=1).tolist()]


def model_fingerprint(model: nn.Module) -> Dict[str, Any]:
    """Shape of the attention stack and, per layer, probes of the ``k_proj`` weight."""
    infos = describe(model)
    digest = []
    for attn in attention_modules(model):
        w = dense_weight(attn["k_proj"])
        digest.append(None if w is None else _probe(w))
    return {
        "n_layers": len(infos),
        "n_heads": [i.n_heads for i in infos],
        "n_kv_heads": [i.n_kv_heads for i in infos],
        "head_dim": [i.head_dim for i in infos],
        "k_proj_probe": digest,
    }


def fingerprint_mismatch(saved: Dict[str, Any], now: Dict[str, Any], rtol: float = 0.05) -> str:
    """'' if two fingerprints describe one model, else what differs."""
    for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim"):
        if saved.get(key) != now.get(key):
            return f"{key} {saved.get(key)} here, {now.get(key)} in the model"
    for i, (a, b) in enumerate(zip(saved.get("k_proj_probe", []), now.get("k_proj_probe", []))):
        if a is None or b is None:
            continue
        a, b = np.asarray(a), np.asarray(b)
        if np.linalg.norm(a - b) > rtol * max(np.linalg.norm(a), np.linalg.norm(b), 1e-12):
            return f"layer {i} k_proj weights differ"
    return ""


# -- from a text ---------------------------------------------------------------------


class _Recorder:
    """Stands in for ``q_proj`` during one forward pass and keeps its input."""

    def __init__(self, inner: Any, store: List[mx.array]) -> None:
        self.inner, self.store = inner, store

    def __call__(self, x: mx.array) -> mx.array:
        self.store.append(x)
        return self.inner(x)


def _heads(y: mx.array, n: int, d: int) -> mx.array:
    """``(1, T, n*d) -> (n, T, d)``"""
    return y.reshape(y.shape[1], n, d).transpose(1, 0, 2)


def _layer_stats(attn: Any, info: AttentionInfo, x: mx.array) -> LayerStats:
    nh, nkv, d, rep = info.n_heads, info.n_kv_heads, info.head_dim, info.repeats
    q, k, v = attn["q_proj"](x), attn["k_proj"](x), attn["v_proj"](x)
    q = _heads(q, nh, d)
    k = _heads(k, nkv, d)
    if info.head_norms:
        q, k = attn["q_norm"](q), attn["k_norm"](k)
    q = attn["rope"](q[None])[0].astype(mx.float32)  # positions 0..T-1
    k = attn["rope"](k[None])[0].astype(mx.float32)
    v = _heads(v, nkv, d).astype(mx.float32)
    T = k.shape[1]
    # Attention each key receives (column sums over the causal rows), per kv head.
    scale = float(getattr(attn, "scale", d**-0.5))
    scores = (q.reshape(nkv, rep * T, d) @ k.transpose(0, 2, 1)) * scale
    causal = mx.arange(T)[:, None] >= mx.arange(T)[None]
    scores = mx.where(mx.tile(causal, (rep, 1))[None], scores, -mx.inf)
    mass = mx.softmax(scores, axis=-1).sum(axis=1)  # (nkv, T)
    k_mean = k.mean(axis=1)
    out = {
        "q_energy": (q * q).reshape(nkv, rep * T, d).mean(axis=1),
        "k_var": ((k - k_mean[:, None]) ** 2).mean(axis=1),
        "k_mean": k_mean,
        "k_wmean": (mass[..., None] * k).sum(axis=1) / mass.sum(axis=1)[:, None],
        "k_first": k[:, 0],
        "v_mean": v.mean(axis=1),
    }
    mx.eval(out)
    return LayerStats(**{f: np.array(a, dtype=np.float64) for f, a in out.items()})


def calibrate_text(model: nn.Module, tokens: Sequence[int], max_tokens: int = 512) -> KVCalibration:
    """Statistics from one forward pass over ``tokens`` (the first ``max_tokens``).

    Args:
        model: an mlx-lm model (llama-family or qwen2 attention).
        tokens: token ids of the calibration text; at least 16.
    """
    ids = [int(t) for t in list(tokens)[:max_tokens]]
    if len(ids) < 16:
        raise ValueError(f"KV calibration needs at least 16 tokens of text, got {len(ids)}")
    infos = describe(model)
    attns = attention_modules(model)
    stores: List[List[mx.array]] = [[] for _ in attns]
    saved = [a["q_proj"] for a in attns]
    try:
        for a, s in zip(attns, stores):
            # A plain object, not a Module: mlx keeps it out of the parameter tree.
            a.__dict__["q_proj"] = _Recorder(a["q_proj"], s)
            a.pop("q_proj")
        model(mx.array(ids)[None])
        mx.eval([s[0] for s in stores if s])
    finally:
        for a, q in zip(attns, saved):
            a.__dict__.pop("q_proj", None)
            a["q_proj"] = q
    if any(len(s) != 1 for s in stores):
        raise ValueError("the model did not call every layer's q_proj once; its attention is not supported")
    layers = [_layer_stats(a, i, s[0]) for a, i, s in zip(attns, infos, stores)]
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()
    return KVCalibration(layers, model_fingerprint(model), "text", len(ids), digest)


# -- from the weights ----------------------------------------------------------------


def linear_bias(module: Any) -> Optional[mx.array]:
    """A linear layer's bias as float32 (a nested view keeps it with its planes), or None."""
    b = module.get("bias") if isinstance(module, dict) else None
    nested = getattr(module, "nested", None)
    if b is None and isinstance(nested, dict):
        b = nested.get("bias")
    return b.astype(mx.float32) if isinstance(b, mx.array) else None


def calibrate_weights(model: nn.Module, context: int = 4096) -> KVCalibration:
    """Statistics predicted from the weights alone (no text; see the module notes).

    Args:
        context: positions over which the RoPE'd key bias is averaged.
    """
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    infos = describe(model)
    layers = []
    for attn, info in zip(attention_modules(model), infos):
        nkv, d = info.n_kv_heads, info.head_dim
        if info.head_norms:
            # Per-head norms hide the keys' scale and offset from the weights:
            # neutral statistics (λ = 1, no offset); calibrate from a text instead.
            one, zero = np.ones((nkv, d)), np.zeros((nkv, d))
            layers.append(LayerStats(one, one.copy(), zero, zero.copy(), zero.copy(), zero.copy()))
            continue
        wq, wk = dense_weight(attn["q_proj"]), dense_weight(attn["k_proj"])
        if wq is None or wk is None:
            raise ValueError(
                f"layer {info.index}: cannot read the q/k projection weights "
                f"({type(attn['k_proj']).__name__}); calibrate from a text instead"
            )
        g = input_norm_weight(model, info.index)
        if g is not None:
            wq, wk = wq * g.astype(mx.float32), wk * g.astype(mx.float32)
        qe = (wq * wq).sum(axis=1)
        ke = (wk * wk).sum(axis=1)
        bq, bk, bv = linear_bias(attn["q_proj"]), linear_bias(attn["k_proj"]), linear_bias(attn["v_proj"])
        if bq is not None:
            qe = qe + bq * bq
        # RoPE's channel pairs rotate: per pair, the energy is position-free.
        rope = attn["rope"]
        q_energy = qe.reshape(nkv, info.repeats, d).mean(axis=1)
        if bk is not None:
            pos = mx.broadcast_to(bk.reshape(1, nkv, 1, d), (1, nkv, context, d))
            k_mean = rope(pos)[0].mean(axis=1)
        else:
            k_mean = mx.zeros((nkv, d))
        v_mean = bv.reshape(nkv, d) if bv is not None else mx.zeros((nkv, d))
        out = {"q_energy": q_energy, "k_var": ke.reshape(nkv, d), "k_mean": k_mean,
               "k_wmean": k_mean, "k_first": k_mean, "v_mean": v_mean}
        mx.eval(out)
        layers.append(LayerStats(**{f: np.array(a, dtype=np.float64) for f, a in out.items()}))
    return KVCalibration(layers, model_fingerprint(model), "weights", 0)
