"""The low gear computed sparsely in routed decoding (``--sparse-gear S``, opt-in, not exact).

In routed decoding the low gear's tokens are the output, so skipping FFN
blocks there changes the text (unlike the sparse drafter, whose drafts the
high gear verifies). :func:`install_sparse_gear` replaces every FFN of the
model with a :class:`SparseGearMLP` holding the same ``gate_proj``,
``up_proj`` and ``down_proj`` children (the gearbox's shifts keep swapping
them by path): while the gearbox is in the low gear, a one-token step keeps
each layer's ``keep`` heaviest blocks of 64 neurons and multiplies
``down_proj``'s columns of those only; in the other gears, and for several
rows (prefill), it is the dense FFN. The kept fractions are calibrated in
the low gear as the sparse drafter's are (:func:`~.sparse.calibrate_keep`,
or a calibration file's saved thresholds).

``teacher=True`` applies the same per-token choice to every row of a
teacher-forced pass (each position masked by its own heaviest blocks: one
pass equals that many one-token steps), which the evaluation's rows use.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .sparse import (
    block_mass,
    calibrate_keep,
    check_sparsity,
    ffn_layers,
    glu_of,
    hidden,
    keep_from_curves,
    layer_masses,
    quant_parts,
    sparse_down,
    top_blocks,
)


def row_mask(h: mx.array, keep: int, group_size: int) -> mx.array:
    """``(..., I) -> (..., I)``: 1 on the neurons of each row's ``keep`` heaviest blocks, else 0."""
    mass = block_mass(h, group_size)
    nb = mass.shape[-1]
    if keep >= nb:
        return mx.ones_like(h)
    kth = mx.sort(mass, axis=-1)[..., nb - keep : nb - keep + 1]
    return mx.repeat((mass >= kth).astype(h.dtype), group_size, axis=-1)


class SparseGearMLP(nn.Module):
    """An FFN whose low gear keeps ``keep`` of its blocks per token: ``(B, T, D) -> (B, T, D)``."""

    def __init__(self, mlp: nn.Module, keep: int, group_size: int, gearbox: Any) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.__dict__["_glu"] = glu_of(mlp)
        self.keep, self.group_size = int(keep), group_size
        self.__dict__["_gearbox"] = gearbox
        self.__dict__["_original"] = mlp
        self.teacher = False
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        h = hidden(self, x)
        if self.__dict__["_gearbox"].manager.gear != "low":
            return self.down_proj(h)
        if self.teacher:
            return self.down_proj(h * row_mask(h, self.keep, self.group_size))
        if h.size != h.shape[-1]:
            return self.down_proj(h)
        blocks = top_blocks(h.reshape(-1), self.keep, self.group_size)
        try:
            parts = quant_parts(self.down_proj)
        except ValueError:  # a float down_proj (the low gear does not manage the FFNs): mask it
            return self.down_proj(h * row_mask(h, self.keep, self.group_size))
        return sparse_down(h.reshape(1, -1), parts, blocks).reshape(*x.shape[:-1], -1)


def low_gear_keep(model: nn.Module, gearbox: Any, sparsity: float, tokens: Sequence[int],
                  thresholds: Optional[Dict[str, Any]] = None, group_size: int = 64) -> Tuple[List[int], List[int]]:
    """Each layer's kept blocks at the target ``sparsity``, measured in the low gear on ``tokens`` (or
    solved from ``thresholds``), and its blocks; the gearbox is back in its gear after."""
    check_sparsity(sparsity)
    before = gearbox.manager.gear
    gearbox.manager.shift("low")
    try:
        masses = layer_masses(model, tokens, group_size)
    finally:
        gearbox.manager.shift(before)
    blocks = [int(m.shape[1]) for m in masses]
    fractions = keep_from_curves(thresholds, sparsity) if thresholds is not None else calibrate_keep(masses, sparsity)
    return [max(1, min(n, round(f * n))) for f, n in zip(fractions, blocks)], blocks


def install_sparse_gear(model: nn.Module, gearbox: Any, sparsity: float, tokens: Sequence[int],
                        thresholds: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Make the low gear of ``model`` sparse (see the module doc); returns what was kept
    (``{"sparsity", "kept_fraction", "kept_blocks", "blocks"}``). :func:`remove_sparse_gear` undoes it."""
    layers = ffn_layers(model)
    remove_sparse_gear(model)
    keep, blocks = low_gear_keep(model, gearbox, sparsity, tokens, thresholds)
    for layer, k in zip(layers, keep):
        layer.mlp = SparseGearMLP(layer.mlp, k, 64, gearbox)
    return {"sparsity": float(sparsity), "kept_fraction": sum(keep) / sum(blocks), "kept_blocks": keep,
            "blocks": blocks}


def remove_sparse_gear(model: nn.Module) -> None:
    """Put the model's own FFNs back (nothing where none is sparse)."""
    for layer in ffn_layers(model):
        if isinstance(layer.mlp, SparseGearMLP):
            original = layer.mlp.__dict__["_original"]
            for name in ("gate_proj", "up_proj", "down_proj"):  # the gear in place now
                setattr(original, name, getattr(layer.mlp, name))
            layer.mlp = original


def set_teacher(model: nn.Module, on: bool) -> None:
    """Teacher-forced passes mask every row by its own kept blocks (``on``), or go dense for several rows."""
    for layer in ffn_layers(model):
        if isinstance(layer.mlp, SparseGearMLP):
            layer.mlp.teacher = on


__all__ = ["SparseGearMLP", "install_sparse_gear", "low_gear_keep", "remove_sparse_gear", "row_mask", "set_teacher"]
