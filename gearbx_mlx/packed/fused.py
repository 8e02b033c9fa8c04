"""Fused packed projections: one GPU launch for q/k/v, one for gate/up.

A decode step on a GPU is bound by the host's cost per kernel call long
before the packed kernels run out of memory bandwidth (a Llama-3-8B step
makes 225 linear calls). Sibling projections read the same input, so their
packed rows can live in one matrix and be computed by one launch of the
matrix-unit kernel with 2 or 3 outputs (``packed_gpu.gemv(..., splits=...)``).

mlx-lm's models call the siblings one after another with the same input
array (``q_proj(x), k_proj(x), v_proj(x)``; ``gate_proj(x)``, ``up_proj(x)``).
:class:`FusedPackedLinear` members keep that interface: the first member
called with a new input runs the fused kernel and keeps every output; a
sibling called with the *same array object* takes its output from there.
Anything else (prefill, the CPU, an input dtype the kernel does not take, a
sibling called with another array) falls back to the member's own product
over its rows, so results never depend on the call order.

Memory: the members' ``weight``/``scales``/``bias`` parameters are row
slices of the group's matrices (views, not copies), so
``tree_flatten(model.parameters())`` counts every byte once.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..bindings import gpu, packed_gpu
from .layers import KernelRuntime, PackedLinear

#: Sibling projections fused per parent module (attribute names as in mlx-lm's
#: llama, mistral, qwen2, gemma and phi3-style blocks).
FUSE_SETS: Tuple[Tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """The concatenated matrices of 2-3 sibling layers and the last fused result."""

    def __init__(self, layers: Sequence[PackedLinear]) -> None:
        first = layers[0]
        self.bits, self.group_size = first.bits, first.group_size
        self.in_features = first.in_features
        self.out_features = sum(m.out_features for m in layers)
        self.weight = mx.concatenate([m["weight"] for m in layers], axis=0)
        self.scales = mx.concatenate([m["scales"] for m in layers], axis=0)
        has_bias = "bias" in first
        self.bias = mx.concatenate([m["bias"] for m in layers], axis=0) if has_bias else None
        # Materialize now, so the siblings' separate matrices can be freed.
        mx.eval(self.weight, self.scales, *([self.bias] if has_bias else []))
        bounds, total = [], 0
        for m in layers[:-1]:
            total += m.out_features
            bounds.append(total)
        self.splits = tuple(bounds)
        self.row_ranges = [(0,) + self.splits, self.splits + (self.out_features,)]
        self.runtime = KernelRuntime()
        self._last_x: Optional[mx.array] = None
        self._last: Optional[List[mx.array]] = None

    def outputs(self, x: mx.array) -> Optional[List[mx.array]]:
        """Every member's output for one input vector ``x`` on a GPU, else None."""
        if x is self._last_x:
            return self._last
        if x.size != self.in_features or x.shape[-1] != self.in_features:
            return None
        backend = gpu.gpu_backend()
        if backend is None:
            return None
        run = self.runtime.launcher(self, backend, x.dtype, self.bias is not None, self.splits)
        if not run:
            return None
        self._last = run(x, self.weight, self.scales, self.bias)
        self._last_x = x
        return self._last


class FusedPackedLinear(PackedLinear):
    """Member ``index`` of a fused group: a :class:`PackedLinear` over its rows."""

    def __init__(self, group: _Group, index: int) -> None:
        lo, hi = group.row_ranges[0][index], group.row_ranges[1][index]
        super().__init__(group.in_features, hi - lo, group.bias is not None, group.bits,
                         group.group_size)
        self.weight = group.weight[lo:hi]
        self.scales = group.scales[lo:hi]
        if group.bias is not None:
            self.bias = group.bias[lo:hi]
        self.freeze()
        self._group = group
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        outs = self._group.outputs(x)
        if outs is not None:
            return outs[self._index]
        return super().__call__(x)


def fusable(layers: Sequence[nn.Module]) -> bool:
    """True if ``layers`` are packed int4 siblings one matrix-unit launch can compute."""
    if len(layers) < 2 or not all(type(m) is PackedLinear for m in layers):
        return False
    first = layers[0]
    same = all(m.in_features == first.in_features and m.bits == first.bits
               and m.group_size == first.group_size and ("bias" in m) == ("bias" in first)
               for m in layers)
    # Any 16-bit input dtype will do for the shape test; the dtype is checked per call.
    total = sum(m.out_features for m in layers)
    return same and packed_gpu.supports_mma(first.bits, first.group_size, first.in_features,
                                         total, mx.bfloat16)


def fuse_modules(modules: Dict[str, nn.Module]) -> Dict[str, nn.Module]:
    """``modules`` (path -> layer) with every fusable sibling set made fused members.

    Siblings are paths ``parent.q_proj``, ``parent.k_proj``, ... of one
    :data:`FUSE_SETS` entry, all present and :func:`fusable`; every other
    entry is returned as it is. The precision manager calls this on a packed
    gear's layers.
    """
    out = dict(modules)
    for paths in sibling_sets(modules):
        layers = [modules.get(p) for p in paths]
        if any(m is None for m in layers) or not fusable(layers):
            continue
        group = _Group(layers)
        for i, path in enumerate(paths):
            out[path] = FusedPackedLinear(group, i)
    return out


def sibling_sets(modules: Dict[str, Any]) -> Iterator[List[str]]:
    """The paths ``parent.q_proj``, ``parent.k_proj``, ... of every :data:`FUSE_SETS` entry under
    every parent of ``modules``' paths (present or not), parents in sorted order."""
    parents = {p.rsplit(".", 1)[0] if "." in p else "" for p in modules}
    for parent in sorted(parents):
        prefix = f"{parent}." if parent else ""
        for names in FUSE_SETS:
            yield [prefix + n for n in names]


def fuse_plan(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(path, FusedPackedLinear)`` for every fusable sibling set of ``model``.

    Pass the list to ``model.update_modules(tree_unflatten(plan))``. Layers
    that are not :class:`PackedLinear` (or not alike) are left alone.
    """
    names = {n for names in FUSE_SETS for n in names}
    candidates = {p: m for p, m in model.named_modules() if p.rsplit(".", 1)[-1] in names}
    fused = fuse_modules(candidates)
    return [(p, m) for p, m in fused.items() if m is not candidates[p]]
