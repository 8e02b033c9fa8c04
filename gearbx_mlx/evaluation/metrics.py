"""Per-position numbers of a routed distribution against the reference.

For each scored position: the NLL of the next token, KL(reference ‖ routed)
in nats, whether the top-1 token is the reference's, and the entropy in bits
of the routed distribution (the router's signal). The arrays are positions x
vocabulary (511 x 49,152 floats per window on the default model), so the
element-wise work is as large as a layer's products: it runs in numpy, whose
vectorized ``exp`` is several times faster than MLX's on a CPU, with the
same formulas in MLX beside it (``backend="mlx"``). The tests hold both to a
float64 computation; numpy is the closer of the two (its float32 sums are
pairwise, MLX's CPU sums over the vocabulary run in one sequence).

Entropy follows :func:`gearbx_mlx.entropy.entropy_bits`: non-finite logits
are replaced as the §10.1 guard does, and the result is clipped to
``[0, log2 V]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np

from ..entropy import NAN_GUARD, entropy_bits

BACKENDS = ("numpy", "mlx")
LN2 = math.log(2.0)


@dataclass
class ReferenceRows:
    """The reference distribution at a window's positions.

    Attributes:
        logprobs: ``(S, V)`` float32 log-probabilities.
        probs: ``(S, V)`` float32 probabilities (``exp(logprobs)``, kept: every
            row's KL needs them).
        top: ``(S,)`` the reference's top-1 token.
    """

    logprobs: np.ndarray
    probs: np.ndarray
    top: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.logprobs.nbytes + self.probs.nbytes + self.top.nbytes)

    @classmethod
    def concatenate(cls, parts: Sequence["ReferenceRows"]) -> "ReferenceRows":
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("logprobs", "probs", "top")))

    def rows(self, start: int, stop: int) -> "ReferenceRows":
        return ReferenceRows(self.logprobs[start:stop], self.probs[start:stop], self.top[start:stop])


def to_numpy(logits: mx.array) -> np.ndarray:
    """``(..., V)`` logits as float32 numpy, with the §10.1 guard applied when needed."""
    z = np.array(logits.astype(mx.float32), copy=True)
    if not np.isfinite(z).all():
        nan, posinf, neginf = NAN_GUARD
        np.nan_to_num(z, copy=False, nan=nan, posinf=posinf, neginf=neginf)
    return z


def log_softmax(z: np.ndarray):
    """``(log p, exp(z - max), sum of it)`` of ``(S, V)`` float32 logits; ``z`` is overwritten by ``log p``.

    The unnormalized exponentials are returned instead of ``p``: the entropy
    needs them only in one weighted sum, divided once per row.
    """
    m = z.max(axis=-1, keepdims=True)
    np.subtract(z, m, out=z)
    e = np.exp(z)
    s = e.sum(axis=-1, keepdims=True, dtype=np.float32)
    np.subtract(z, np.log(s), out=z)
    return z, e, s[:, 0]


def _entropy(lp: np.ndarray, e: np.ndarray, s: np.ndarray) -> np.ndarray:
    h = -np.einsum("sv,sv->s", e, lp) / (s * np.float32(LN2))
    return np.clip(h, 0.0, math.log2(lp.shape[-1]))


def reference(logits: mx.array, targets: Sequence[int], backend: str = "numpy"):
    """The reference's own rows: ``(ReferenceRows, nll list, entropy list)``."""
    _check_backend(backend)
    if backend == "mlx":
        z = logits.astype(mx.float32)
        lp = z - mx.logsumexp(z, axis=-1, keepdims=True)
        nll = -mx.take_along_axis(lp, mx.array(targets, dtype=mx.uint32)[:, None], axis=-1)[:, 0]
        ent = entropy_bits(logits)
        lp_np = np.array(lp)
        rows = ReferenceRows(lp_np, np.exp(lp_np), np.array(mx.argmax(lp, axis=-1)))
        return rows, nll.tolist(), ent.tolist()
    lp, e, s = log_softmax(to_numpy(logits))
    idx = np.arange(lp.shape[0])
    nll = -lp[idx, np.asarray(targets)]
    ent = _entropy(lp, e, s)
    p = np.divide(e, s[:, None], out=e)
    return ReferenceRows(lp, p, lp.argmax(axis=-1)), nll.tolist(), ent.tolist()


def routed(logits: mx.array, targets: Sequence[int], ref: ReferenceRows, backend: str = "numpy") -> Dict[str, List]:
    """``{"nll", "kl", "hits", "entropy"}`` per position of routed ``(S, V)`` logits.

    ``kl`` is KL(reference ‖ routed) = Σ p_ref (log p_ref - log p) in nats,
    summed term by term (not as a difference of two entropies, which would
    cancel away the small KLs that matter here).
    """
    _check_backend(backend)
    if backend == "mlx":
        z = logits.astype(mx.float32)
        lp = z - mx.logsumexp(z, axis=-1, keepdims=True)
        ref_lp = mx.array(ref.logprobs)
        kl = mx.sum(mx.exp(ref_lp) * (ref_lp - lp), axis=-1)
        nll = -mx.take_along_axis(lp, mx.array(targets, dtype=mx.uint32)[:, None], axis=-1)[:, 0]
        hits = mx.argmax(lp, axis=-1) == mx.array(ref.top)
        ent = entropy_bits(logits)
        mx.eval(kl, nll, hits, ent)
        return {"nll": nll.tolist(), "kl": kl.tolist(), "hits": hits.tolist(), "entropy": ent.tolist()}
    lp, e, s = log_softmax(to_numpy(logits))
    idx = np.arange(lp.shape[0])
    nll = -lp[idx, np.asarray(targets)]
    hits = lp.argmax(axis=-1) == ref.top
    ent = _entropy(lp, e, s)
    np.subtract(ref.logprobs, lp, out=e)  # e is no longer needed: reuse it for the log-ratio
    kl = np.einsum("sv,sv->s", ref.probs, e)
    return {"nll": nll.tolist(), "kl": kl.tolist(), "hits": hits.tolist(), "entropy": ent.tolist()}


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"metrics backend must be one of {BACKENDS}, got {backend!r}")
