"""Fixed random orthogonal rotations of one attention head's vectors.

Two kinds, both a random sign flip followed by a fixed orthonormal transform
(arXiv:2605.05699, §3.1; the paper finds them equal in quality):

* ``srht``: ``x -> H·diag(s)·x`` with ``H`` the normalised Walsh-Hadamard
  matrix, through ``mx.hadamard_transform`` (O(d log d)). MLX computes it for
  ``d = m·2^k`` with ``m`` in 1, 12, 20, 28 only, and for other sizes it does
  not reliably raise: MLX 0.32.4 returned a non-orthogonal matrix for d = 72
  or 100 and aborted the process for d = 30. :func:`hadamard_supported` is
  therefore checked before every call. For ``m`` = 20 or 28 MLX's matrix is
  orthogonal but not symmetric, so the inverse is the transpose, never the
  transform applied twice.
* ``srft``: ``x -> P·F·diag(s)·x`` with ``F`` the unitary DFT and ``P`` the
  paper's real packing (eq. 2: DC, Nyquist, √2·Re and √2·Im of the other
  bins), an exact real orthonormal map for any ``d >= 2``. It is applied as a
  dense ``d × d`` product here (4 K multiply-adds a vector at d = 64, nothing
  beside the projections), which also makes it the choice for head sizes the
  Hadamard path rejects.

Vectors are rows: ``forward(x)`` maps the last axis of ``x`` (``(..., d)``).
:func:`srft_reference` (``mx.fft.rfft`` and the packing written out) and
:func:`hadamard_reference` (Sylvester's construction) are the pure-mx oracles
the tests hold the fast paths to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

ROTATIONS = ("none", "srht", "srft")

#: Odd factors ``m`` for which ``mx.hadamard_transform`` computes ``d = m·2^k``.
_HADAMARD_M = (1, 12, 20, 28)


def hadamard_supported(d: int) -> bool:
    """True if ``mx.hadamard_transform`` is exact for vectors of size ``d``."""
    if d < 1:
        return False
    for m in _HADAMARD_M:
        if d % m == 0:
            q = d // m
            if q & (q - 1) == 0:
                return True
    return False


def random_signs(d: int, seed: int, layer: int) -> np.ndarray:
    """A reproducible ±1 vector of size ``d`` for one layer (float32).

    Seeded by ``(seed, layer)`` so that a calibration file needs to hold only
    the seed to rebuild every layer's rotation.
    """
    rng = np.random.default_rng([int(seed), int(layer)])
    return rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=d)


def srft_matrix(d: int) -> np.ndarray:
    """The real packed unitary DFT of size ``d`` as a dense orthonormal matrix.

    Row ``k`` of the result gives packed coefficient ``k``: 0 the DC bin,
    ``d/2`` (even ``d``) the Nyquist bin, then √2·Re and √2·Im of bins
    ``1..ceil(d/2)-1`` (float64, shape ``(d, d)``).
    """
    if d < 2:
        raise ValueError(f"the SRFT needs a head dimension of at least 2, got {d}")
    n = np.arange(d)
    half = (d - 1) // 2  # complex bins with both a real and an imaginary part
    rows = [np.full(d, 1.0 / math.sqrt(d))]
    for k in range(1, half + 1):
        rows.append(math.sqrt(2.0 / d) * np.cos(2 * math.pi * k * n / d))
    if d % 2 == 0:
        rows.append((-1.0) ** n / math.sqrt(d))
    for k in range(1, half + 1):
        rows.append(-math.sqrt(2.0 / d) * np.sin(2 * math.pi * k * n / d))
    return np.stack(rows)


def srft_reference(x: mx.array, signs: mx.array) -> mx.array:
    """SRFT of the last axis through ``mx.fft.rfft`` and eq. 2's packing (oracle).

    Same ordering as :func:`srft_matrix`: DC, the real parts, Nyquist (even
    ``d``), then the imaginary parts.
    """
    d = x.shape[-1]
    y = mx.fft.rfft((x * signs).astype(mx.float32), axis=-1) / math.sqrt(d)
    half = (d - 1) // 2
    re = mx.real(y[..., 1 : half + 1]) * math.sqrt(2.0)
    im = mx.imag(y[..., 1 : half + 1]) * math.sqrt(2.0)
    parts = [mx.real(y[..., :1]), re]
    if d % 2 == 0:
        parts.append(mx.real(y[..., half + 1 : half + 2]))
    parts.append(im)
    return mx.concatenate(parts, axis=-1)


def hadamard_reference(x: mx.array, signs: mx.array) -> mx.array:
    """SRHT of the last axis by Sylvester's construction (power-of-two ``d``; oracle)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the reference Hadamard needs a power of two, got {d}")
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (x * signs) @ mx.array((h / math.sqrt(d)).T.astype(np.float32))


@dataclass
class Rotation:
    """One layer's rotation: ``forward(x) = x @ (R·diag(s))^T`` on the last axis.

    Attributes:
        kind: ``"none"``, ``"srht"`` or ``"srft"``.
        signs: ``(d,)`` float32 ±1 (None for ``"none"``).
    """

    kind: str
    d: int
    signs: Optional[mx.array] = None

    def __post_init__(self) -> None:
        if self.kind not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.kind!r}")
        if self.kind == "srht" and not hadamard_supported(self.d):
            raise ValueError(
                f"the Hadamard rotation (srht) needs a head dimension m*2^k with m in "
                f"{_HADAMARD_M}, got {self.d}; use rotation='srft' (any size) or 'none'"
            )
        self._dense: Optional[mx.array] = None  # (d, d), x -> x @ dense
        self._symmetric = True
        if self.kind == "none":
            return
        if self.signs is None or tuple(self.signs.shape) != (self.d,):
            raise ValueError(f"a {self.kind} rotation needs a ({self.d},) sign vector")
        s = np.array(self.signs, dtype=np.float64)
        if self.kind == "srft":
            r = srft_matrix(self.d)
        else:
            r = np.array(mx.hadamard_transform(mx.eye(self.d, dtype=mx.float32))).astype(np.float64).T
            self._symmetric = bool(np.allclose(r, r.T))
        # forward(x) = (R·diag(s)·x^T)^T = x @ (R·diag(s))^T
        self._dense = mx.array((r * s[None, :]).T.astype(np.float32))

    @classmethod
    def make(cls, kind: str, d: int, seed: int, layer: int) -> "Rotation":
        """The rotation of ``layer`` drawn from ``seed``."""
        signs = None if kind == "none" else mx.array(random_signs(d, seed, layer))
        return cls(kind, d, signs)

    @property
    def identity(self) -> bool:
        return self.kind == "none"

    def matrix(self) -> mx.array:
        """``Q`` (``(d, d)``, float32) with ``forward(x) == x @ Q``."""
        if self._dense is None:
            return mx.eye(self.d, dtype=mx.float32)
        return self._dense

    def forward(self, x: mx.array) -> mx.array:
        """Rotate the last axis (``(..., d) -> (..., d)``, dtype kept)."""
        if self.identity:
            return x
        if self.kind == "srht":
            return mx.hadamard_transform(x * self.signs.astype(x.dtype))
        return x @ self._dense.astype(x.dtype)

    def inverse(self, x: mx.array) -> mx.array:
        """Undo :meth:`forward` (``(..., d) -> (..., d)``)."""
        if self.identity:
            return x
        if self.kind == "srht" and self._symmetric:
            return mx.hadamard_transform(x) * self.signs.astype(x.dtype)
        return x @ self._dense.T.astype(x.dtype)
