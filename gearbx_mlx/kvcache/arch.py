"""Which attention modules the KV transforms can take, and their geometry.

The transforms never touch mlx-lm's model code. They rely on the contract
that mlx-lm's llama-family and qwen2 attention follow (``mlx_lm/models/
llama.py``, ``qwen2.py``)::

    q, k, v = q_proj(x), k_proj(x), v_proj(x)        # (B, L, heads * d)
    q, k = rope(q, offset=...), rope(k, offset=...)  # (B, heads, L, d)
    k, v = cache.update_and_fetch(k, v)
    o = scaled_dot_product_attention(q, k, v, cache=cache, ...)
    return o_proj(o)                                 # o: (B, L, n_heads * d)

An attention without ``q_proj/k_proj/v_proj/o_proj/rope`` or its head counts
is refused with one ValueError before anything is changed. Where per-head
norms sit between the projections and RoPE (``q_norm``/``k_norm``, Qwen3),
the per-channel scale λ is applied to the norms' outputs instead of the
projections' (a norm would undo a scale applied before it).

The scale λ must commute with RoPE to be applied before it: RoPE rotates
channel pairs (``(i, i + dims/2)``, or ``(2i, 2i+1)`` when ``traditional``)
by position-dependent angles, and a scale equal on both channels of a pair
commutes with every such rotation; channels beyond ``dims`` are not rotated
and take any scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class AttentionInfo:
    """Geometry of one attention module.

    Attributes:
        index: layer index.
        path: the module's path in the model (``model.layers.3.self_attn``).
        n_heads, n_kv_heads, head_dim: head counts and size.
        rope_dims: channels RoPE rotates (``head_dim`` when unknown).
        rope_traditional: RoPE pairs ``(2i, 2i+1)`` instead of ``(i, i+dims/2)``.
        head_norms: the attention normalises q/k per head before RoPE.
    """

    index: int
    path: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dims: int
    rope_traditional: bool
    head_norms: bool

    @property
    def repeats(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.n_heads // self.n_kv_heads

    def pairs(self) -> np.ndarray:
        """``(head_dim,)`` int: the RoPE pair id of each channel.

        Channels outside RoPE are their own group (any scale commutes there).
        """
        d, r = self.head_dim, self.rope_dims
        ids = np.arange(d)
        if self.rope_traditional:
            ids[:r] = np.arange(r) // 2
        else:
            half = r // 2
            ids[:half] = np.arange(half)
            ids[half:r] = np.arange(half)
        ids[r:] = np.arange(r // 2, r // 2 + d - r)
        return ids


def _out_features(module: Any) -> Optional[int]:
    if not isinstance(module, nn.Module):
        return None
    w = getattr(module, "weight", None)
    if w is None:
        # A gear view over nested bit planes keeps its shape with the planes.
        shape = getattr(getattr(module, "nested", None), "shape", None)
        return None if shape is None else int(shape[0])
    return int(w.shape[0])


def layer_list(model: nn.Module) -> List[Any]:
    """The model's transformer blocks (``model.layers``, as mlx-lm exposes them)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(
            "the KV cache transforms need an mlx-lm model with a 'layers' list of "
            f"transformer blocks; {type(model).__name__} has none"
        )
    return list(layers)


def _attention_of(layer: Any) -> Tuple[str, Any]:
    for name in ("self_attn", "attention", "attn"):
        attn = layer.get(name) if isinstance(layer, dict) else getattr(layer, name, None)
        if attn is not None:
            return name, attn
    return "", None


def describe(model: nn.Module) -> List[AttentionInfo]:
    """Geometry of every attention layer; ValueError naming what is missing.

    Raises:
        ValueError: no layers, a block without attention, an attention without
            the projections/RoPE/head counts this package relies on, or head
            counts that do not divide.
    """
    prefix = "model.layers" if getattr(model, "model", None) is not None else "layers"
    out = []
    for i, layer in enumerate(layer_list(model)):
        name, attn = _attention_of(layer)
        if attn is None:
            raise ValueError(
                f"layer {i} has no self_attn module: the KV cache transforms support "
                "mlx-lm's llama-family and qwen2 attention only"
            )
        missing = [p for p in (*_PROJ, "rope") if attn.get(p, None) is None and getattr(attn, p, None) is None]
        nh, nkv = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
        if missing or not isinstance(nh, int) or not isinstance(nkv, int):
            what = ", ".join(missing) if missing else "n_heads/n_kv_heads"
            raise ValueError(
                f"the attention of layer {i} ({type(attn).__name__}) has no {what}: rotation, "
                "key offset and λ need q/k/v/o projections, a rope module and head counts "
                "(mlx-lm's llama-family and qwen2 attention); run this model with "
                "mlx-lm's plain --kv-bits instead"
            )
        if nkv < 1 or nh % nkv:
            raise ValueError(f"layer {i}: {nh} query heads do not group over {nkv} key/value heads")
        kout = _out_features(attn["k_proj"])
        d = getattr(attn, "head_dim", None)
        if not isinstance(d, int):
            if kout is None:
                raise ValueError(f"layer {i}: cannot tell the head size of {type(attn).__name__}")
            d = kout // nkv
        rope = attn["rope"]
        dims = getattr(rope, "dims", getattr(rope, "dim", d))
        dims = int(dims) if isinstance(dims, int) and 0 < dims <= d else d
        trad = bool(getattr(rope, "traditional", False))
        norms = any(attn.get(n, None) is not None for n in ("q_norm", "k_norm"))
        out.append(AttentionInfo(i, f"{prefix}.{i}.{name}", nh, nkv, d, dims, trad, norms))
    return out


def attention_modules(model: nn.Module) -> List[nn.Module]:
    """The attention module of every layer, in order."""
    return [_attention_of(layer)[1] for layer in layer_list(model)]


def input_norm_weight(model: nn.Module, index: int) -> Optional[mx.array]:
    """The RMSNorm weight in front of layer ``index``'s attention, if there is one."""
    layer = layer_list(model)[index]
    norm = getattr(layer, "input_layernorm", None)
    w = getattr(norm, "weight", None) if norm is not None else None
    return w if isinstance(w, mx.array) else None
