"""One layer's function-preserving transform of queries, keys and values.

For a layer with rotation ``Q`` (keys/queries, after RoPE), value rotation
``P``, per-channel scale ``λ`` and offsets ``μ_k``, ``μ_v``::

    q'  = rope(q_proj(x) / λ) @ Q          # λ per RoPE pair commutes with RoPE
    k'  = rope(k_proj(x) * λ) @ Q          # the cache stores k' - μ_k
    v'  = (v_proj(x) - μ_v) @ P
    o   = o_proj(attention(q', k', v') @ P^T + μ_v)

Scores are unchanged (``q'·k' = q·k`` since ``Q`` is orthogonal and the λ
cancel; ``μ_k`` shifts all scores of a query alike, see :mod:`.cache`), and so
is the output (``P`` is orthogonal and the attention weights sum to one, so
``Σ p_j (v_j - μ_v) + μ_v = Σ p_j v_j``). In float this is the same function
up to rounding; only what the quantizer sees changes.

Each side of each pair is applied independently, either folded into a float
``nn.Linear`` (exact, once, no work per token) or to activations around
whatever module is installed (a gear's quantized layer, say); the two halves
of a pair never need to agree on which, so a gear may swap any subset of
the projections at any time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .arch import AttentionInfo
from .calibrate import LayerStats
from .rotation import Rotation
from .sink import KeyRotation

#: Bounds of λ relative to its geometric mean, against a pair with
#: near-zero calibration energy sending a scale to 0 or infinity.
LAMBDA_RANGE = 1e3


def key_scale(stats: LayerStats, info: AttentionInfo, alpha: float) -> Optional[np.ndarray]:
    """λ ``(n_kv_heads, head_dim)``, equal on both channels of each RoPE pair.

    Minimises the expected squared score error under a rotation that spreads
    the key quantization error evenly over channels: with error variance
    proportional to ``Σ λ_i² E[k_i²]`` and a score error ``Σ (q_i/λ_i) e_i``,
    the optimum is ``λ_i² ∝ sqrt(E[q_i²]/E[k_i²])`` (``alpha = 0.5``);
    ``alpha`` interpolates from no scale (0) to the full ratio (1). Key
    energies are taken centred, since the offset is removed before quantizing.
    Normalised to geometric mean 1 per head.
    """
    if alpha <= 0:
        return None
    pairs = info.pairs()
    n = pairs.max() + 1
    out = np.ones((info.n_kv_heads, info.head_dim))
    for h in range(info.n_kv_heads):
        eq = np.bincount(pairs, weights=stats.q_energy[h], minlength=n)
        ek = np.bincount(pairs, weights=stats.k_var[h], minlength=n)
        ok = (eq > 0) & (ek > 0)
        if not ok.any():
            continue
        lam = np.ones(n)
        lam[ok] = (eq[ok] / ek[ok]) ** (alpha / 2)
        lam /= np.exp(np.log(lam[ok]).mean())
        lam = np.clip(lam, 1 / LAMBDA_RANGE, LAMBDA_RANGE)
        out[h] = lam[pairs]
    return out


@dataclass
class LayerTransform:
    """Everything one attention layer needs (arrays float32).

    Attributes:
        rotation: of queries and keys after RoPE (per head, with the sink reflection).
        value_rotation: of values (``o_proj``'s input is rotated back).
        scale: λ ``(n_kv_heads, head_dim)`` or None.
        key_offset: μ_k ``(n_kv_heads, head_dim)`` in the stored keys' basis, or None.
        value_offset: μ_v ``(n_kv_heads, head_dim)`` in the values' own basis, or None.
        bits, group_size, quantizer: of this layer's cache.
    """

    info: AttentionInfo
    rotation: KeyRotation
    value_rotation: Rotation
    scale: Optional[mx.array]
    key_offset: Optional[mx.array]
    value_offset: Optional[mx.array]
    bits: int
    group_size: int
    quantizer: str = "minmax"

    def __post_init__(self) -> None:
        i = self.info
        rep = i.repeats
        self.k_mult = None if self.scale is None else self.scale.reshape(-1)
        self.q_mult = None if self.scale is None else mx.repeat(1.0 / self.scale, rep, axis=0).reshape(-1)
        self.v_sub = None if self.value_offset is None else self.value_offset.reshape(-1)
        self.o_add = None if self.value_offset is None else mx.repeat(self.value_offset, rep, axis=0)

    # -- on activations ------------------------------------------------------------
    def queries(self, y: mx.array) -> mx.array:
        """Queries before RoPE -> scaled by 1/λ.

        ``(B, L, n_heads*d)`` from ``q_proj``, or ``(B, L, n_heads, d)`` from a
        per-head ``q_norm`` (where λ goes when the attention has one).
        """
        if self.q_mult is None:
            return y
        m = self.q_mult if y.shape[-1] == self.q_mult.size else self.q_mult.reshape(-1, self.info.head_dim)
        return y * m.astype(y.dtype)

    def keys(self, y: mx.array) -> mx.array:
        """Keys before RoPE -> scaled by λ (shapes as :meth:`queries`)."""
        if self.k_mult is None:
            return y
        m = self.k_mult if y.shape[-1] == self.k_mult.size else self.k_mult.reshape(-1, self.info.head_dim)
        return y * m.astype(y.dtype)

    def values(self, y: mx.array) -> mx.array:
        """``v_proj`` output ``(B, L, n_kv_heads*d)`` -> centred and rotated."""
        if self.v_sub is not None:
            y = y - self.v_sub.astype(y.dtype)
        if self.value_rotation.identity:
            return y
        B, L, _ = y.shape
        d = self.info.head_dim
        return self.value_rotation.forward(y.reshape(B, L, -1, d)).reshape(B, L, -1)

    def output(self, x: mx.array) -> mx.array:
        """``o_proj`` input ``(B, L, n_heads*d)`` -> rotated back, offset restored."""
        if self.value_rotation.identity and self.o_add is None:
            return x
        B, L, _ = x.shape
        y = self.value_rotation.inverse(x.reshape(B, L, -1, self.info.head_dim))
        if self.o_add is not None:
            y = y + self.o_add.astype(y.dtype)
        return y.reshape(B, L, -1)

    def roped(self, y: mx.array) -> mx.array:
        """RoPE output ``(B, heads, L, d)`` -> rotated (queries and keys alike)."""
        return self.rotation.forward(y)

    # -- folded into float linear layers ---------------------------------------------
    def fold(self, name: str, module: nn.Linear) -> Optional[nn.Linear]:
        """A new ``nn.Linear`` computing ``module`` then this side's transform.

        None when this side does nothing (the module is used as is). Runs once
        at load on the CPU stream, in full float32: a GPU would run these
        products in TF32 (MLX's default there), ~50x float32's rounding,
        folded into the weights for good.
        """
        with mx.stream(mx.cpu):
            return self._fold(name, module)

    def _fold(self, name: str, module: nn.Linear) -> Optional[nn.Linear]:
        w = module.weight.astype(mx.float32)
        b = module.get("bias")
        b = None if b is None else b.astype(mx.float32)
        d = self.info.head_dim
        if name in ("q_proj", "k_proj"):
            mult = self.q_mult if name == "q_proj" else self.k_mult
            if mult is None:
                return None
            w2, b2 = w * mult[:, None], None if b is None else b * mult
        elif name == "v_proj":
            if self.value_rotation.identity and self.v_sub is None:
                return None
            nkv = w.shape[0] // d
            # y_h = (x W_h^T + b_h - μ_h) P  =>  W'_h = P^T W_h, b'_h = (b_h - μ_h) P
            wt = w.reshape(nkv, d, -1).transpose(0, 2, 1)  # (nkv, in, d)
            w2 = self.value_rotation.forward(wt).transpose(0, 2, 1).reshape(w.shape)
            bb = mx.zeros((nkv * d,)) if b is None else b
            if self.v_sub is not None:
                bb = bb - self.v_sub
            b2 = None if (b is None and self.v_sub is None) else self.value_rotation.forward(bb.reshape(nkv, d)).reshape(-1)
        elif name == "o_proj":
            if self.value_rotation.identity and self.o_add is None:
                return None
            out_f, nh = w.shape[0], w.shape[1] // d
            # out = Σ_h (z_h P^T + μ_h) W_h^T + b  =>  W'_h = W_h P, b' = b + Σ_h W_h μ_h
            wh = w.reshape(out_f, nh, d)
            w2 = self.value_rotation.forward(wh).reshape(w.shape)
            b2 = b
            if self.o_add is not None:
                extra = (wh * self.o_add[None]).sum(axis=(1, 2))
                b2 = extra if b is None else b + extra
        else:
            raise ValueError(f"no transform for {name!r}")
        out = nn.Linear(w.shape[1], w.shape[0], bias=b2 is not None)
        out.weight = w2.astype(module.weight.dtype)
        if b2 is not None:
            out.bias = b2.astype(module.weight.dtype)
        mx.eval(out.parameters())
        return out


class _Around:
    """Calls ``inner`` and applies ``after`` to its output (or ``before`` to its input)."""

    __slots__ = ("inner", "after", "before")

    def __init__(self, inner: Any, after: Any = None, before: Any = None) -> None:
        self.inner, self.after, self.before = inner, after, before

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self.before is not None:
            x = self.before(x)
        y = self.inner(x, *args, **kwargs)
        return y if self.after is None else self.after(y)


class LayerView:
    """What an intercepted attention sees in place of its five modules.

    The projection installed at call time is looked up in the attention's own
    dict each time: if it is the module that was there when the transform
    was applied and a folded copy exists, the copy is used; any other module
    (a gear's) is wrapped so the transform runs on its activations.
    """

    SIDES = {"q_proj": "queries", "k_proj": "keys", "v_proj": "values", "q_norm": "queries", "k_norm": "keys"}

    def __init__(self, transform: LayerTransform, attn: nn.Module, fold: bool) -> None:
        self.transform = transform
        # With per-head q/k norms λ must come after them: the projections stay as they are.
        self.norms = transform.info.head_norms
        self.loaded: Dict[str, Any] = {n: attn.get(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        self.folded: Dict[str, Optional[nn.Linear]] = {}
        if fold:
            for name, m in self.loaded.items():
                if type(m) is nn.Linear and not (self.norms and name in ("q_proj", "k_proj")):
                    self.folded[name] = transform.fold(name, m)
        self._wrapped: Dict[str, Any] = {}

    def view(self, name: str, module: Any) -> Any:
        t = self.transform
        if name == "rope":
            return self._cached(name, module, lambda: _Around(module, after=t.roped))
        if name in ("q_norm", "k_norm") and not self.norms:
            return module
        if self.norms and name in ("q_proj", "k_proj"):
            return module
        if name in self.folded and module is self.loaded[name]:
            folded = self.folded[name]
            return module if folded is None else folded
        if name == "o_proj":
            return self._cached(name, module, lambda: _Around(module, before=t.output))
        return self._cached(name, module, lambda: _Around(module, after=getattr(t, self.SIDES[name])))

    def _cached(self, name: str, module: Any, build: Any) -> Any:
        hit = self._wrapped.get(name)
        if hit is None or hit.inner is not module:
            hit = self._wrapped[name] = build()
        return hit


#: Attribute (in the instance ``__dict__``, outside the parameter tree) that
#: marks an intercepted attention.
VIEW_ATTR = "_gearbx_kv_view"
_NAMES = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "rope", "q_norm", "k_norm"))
_SUBCLASSES: Dict[type, type] = {}


def _intercepting(cls: type) -> type:
    """A subclass of ``cls`` that routes its five modules through a :class:`LayerView`.

    Only attribute lookup changes; ``__call__`` stays mlx-lm's. mlx keeps
    child modules as dict items, so ``self.q_proj`` reaches ``__getattr__``.
    """
    sub = _SUBCLASSES.get(cls)
    if sub is None:

        def __getattr__(self: Any, key: str) -> Any:
            view = self.__dict__.get(VIEW_ATTR)
            if view is not None and key in _NAMES:
                module = self.get(key)
                if module is not None:
                    return view.view(key, module)
            return cls.__getattr__(self, key)

        sub = type(f"KV{cls.__name__}", (cls,), {"__getattr__": __getattr__, "_gearbx_kv_base": cls})
        _SUBCLASSES[cls] = sub
    return sub


def install(attn: nn.Module, view: LayerView) -> None:
    """Intercept ``attn`` (in place; :func:`uninstall` undoes it exactly)."""
    if VIEW_ATTR in attn.__dict__:
        raise ValueError("this attention already carries a KV transform: restore that handle first")
    attn.__class__ = _intercepting(type(attn))
    attn.__dict__[VIEW_ATTR] = view


def uninstall(attn: nn.Module) -> None:
    base = getattr(type(attn), "_gearbx_kv_base", None)
    if base is not None:
        attn.__class__ = base
    attn.__dict__.pop(VIEW_ATTR, None)
