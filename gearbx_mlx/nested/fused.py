"""Fused nested projections: one GPU launch for q/k/v, one for gate/up, in every gear.

A one-token decode step on a GPU pays the host's time per kernel call and
the GPU's per-launch latency (a Llama-3-8B k/v projection of 1024 rows takes
about as long as a 4096-row one). Sibling projections read the same input,
so their planes can be stacked by rows and read in one launch: the nested
kernel for the mid and high gears, MLX's ``quantized_matmul`` on the stacked
plane 0 for the low gear. This is :mod:`gearbx_mlx.packed.fused` for nested
planes.

mlx-lm's models call the siblings one after another with the same input
array (``q_proj(x), k_proj(x), v_proj(x)``; ``gate_proj(x)``, ``up_proj(x)``).
:class:`FusedNestedLinear` members keep that interface: the first member
called with a new input computes the stacked product (one launch) and keeps
its row slices; a sibling called with the *same array object* and the same
gear takes its output from there. Anything else (more than one input row,
the CPU, a sibling called with another array) is the member's own
:class:`~gearbx_mlx.nested.layers.NestedLinear` product over its rows, so
results never depend on the call order.

Stacking needs one exponent per plane across the siblings; a plane whose
exponent differs is re-expressed at the group's (scales and biases times a
power of two, exact unless it would leave the scale dtype's range: then the
siblings are not fused). Memory: each member's planes are row slices of the
group's (views, not copies).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..bindings import gpu
from ..packed.fused import FUSE_SETS, sibling_sets
from .layers import NestedLinear, NestedWeights
from .planes import Plane


def _at_exponent(p: Plane, exponent: int) -> Optional[Plane]:
    """``p`` re-expressed to hold ``residual * 2**exponent``; None where that is not exact."""
    if p.exponent == exponent:
        return p
    k = 2.0 ** (exponent - p.exponent)
    s, b = p.scales * k, p.biases * k
    exact = mx.array_equal(s / k, p.scales).item() and mx.array_equal(b / k, p.biases).item()
    finite = mx.isfinite(s).all().item() and mx.isfinite(b).all().item()
    return Plane(p.weight, s, b, p.bits, p.group_size, exponent) if exact and finite else None


def stack_planes(members: Sequence[NestedWeights]) -> Optional[List[Plane]]:
    """The members' planes stacked by rows, one exponent per plane; None where they cannot stack."""
    first = members[0]
    same = all(m.bits == first.bits and m.group_sizes == first.group_sizes and m.shape[1] == first.shape[1]
               and m.scales[0].dtype == first.scales[0].dtype and ("bias" in m) == ("bias" in first)
               for m in members)
    if not same:
        return None
    stacked = []
    for i in range(first.depth):
        exponent = max(m.exponents[i] for m in members)
        parts = [_at_exponent(m.planes[i], exponent) for m in members]
        if any(p is None for p in parts):
            return None
        stacked.append(Plane(mx.concatenate([p.weight for p in parts]), mx.concatenate([p.scales for p in parts]),
                             mx.concatenate([p.biases for p in parts]), first.bits[i], first.group_sizes[i],
                             exponent))
    return stacked


class NestedGroup:
    """The stacked planes of 2-3 sibling matrices and the last fused result.

    Args:
        members: the siblings' :class:`NestedWeights` (same input size, plan and
            scale dtype; see :func:`stack_planes`).
    """

    def __init__(self, members: Sequence[NestedWeights], planes: Sequence[Plane]) -> None:
        has_bias = "bias" in members[0]
        bias = mx.concatenate([m["bias"] for m in members]) if has_bias else None
        self.weights = NestedWeights(planes, bias)
        mx.eval(self.weights.parameters())  # materialize now: the members become views of these rows
        self.in_features = members[0].shape[1]
        bounds = [0]
        for m in members:
            bounds.append(bounds[-1] + m.shape[0])
        self.bounds = tuple(bounds)
        self._last: Optional[Tuple[mx.array, int, List[mx.array]]] = None
        self._members: Dict[int, NestedWeights] = {}

    def member_weights(self, index: int) -> NestedWeights:
        """Member ``index``'s planes (and bias): row slices of the group's, one object per member
        (every gear's view of it shares them)."""
        if index not in self._members:
            self._members[index] = self._slice(index)
        return self._members[index]

    def _slice(self, index: int) -> NestedWeights:
        lo, hi = self.bounds[index], self.bounds[index + 1]
        planes = [Plane(p.weight[lo:hi], p.scales[lo:hi], p.biases[lo:hi], p.bits, p.group_size, p.exponent)
                  for p in self.weights.planes]
        bias = self.weights.get("bias")
        return NestedWeights(planes, None if bias is None else bias[lo:hi])

    def outputs(self, x: mx.array, n: int, low_mlx: bool) -> Optional[List[mx.array]]:
        """Every member's output for one input vector ``x`` on a GPU (gear of ``n`` planes), else None.

        ``low_mlx``: a low gear (``n == 1``) calls MLX's ``quantized_matmul`` on the stacked plane 0.
        """
        last = self._last
        if last is not None and last[0] is x and last[1] == n:
            return last[2]
        if x.size != self.in_features or x.shape[-1] != self.in_features or gpu.gpu_backend() is None:
            return None
        w = self.weights
        bias = w.get("bias")
        if n == 1 and low_mlx:
            y = mx.quantized_matmul(x, w.weights[0], scales=w.scales[0], biases=w.biases[0], transpose=True,
                                    group_size=w.group_sizes[0], bits=w.bits[0])
            if bias is not None:
                y = y + bias
        else:
            product = w.__dict__.get("_product") or w.product
            y = product(x, n, bias)
        b = self.bounds
        outs = [y[..., b[i]:b[i + 1]] for i in range(len(b) - 1)]
        self._last = (x, n, outs)
        return outs


class FusedNestedLinear(NestedLinear):
    """Member ``index`` of a fused group, reading ``n`` planes: a :class:`NestedLinear` over its rows."""

    def __init__(self, group: NestedGroup, index: int, n: int, fused: bool = True) -> None:
        super().__init__(group.member_weights(index), n, fused)
        self.__dict__["_group"] = group  # outside the module tree: the members' arrays are already there
        self.__dict__["_index"] = index

    def __call__(self, x: mx.array) -> mx.array:
        outs = self._group.outputs(x, self.n, self._mlx_low is not None)
        if outs is not None:
            return outs[self._index]
        return super().__call__(x)


def fuse_nested_views(modules: Dict[str, nn.Module],
                      groups: Optional[Dict[Tuple[int, ...], tuple]] = None) -> Dict[str, nn.Module]:
    """``modules`` (path -> :class:`NestedLinear` view) with every stackable sibling set fused.

    Siblings are paths ``parent.q_proj``, ... of one :data:`FUSE_SETS` entry,
    all present, plain ``NestedLinear`` views of one gear whose planes stack
    (:func:`stack_planes`), through the kernels or MLX's low-gear call (not
    the oracle); every other entry is returned as it is.
    ``groups``: the groups stacked so far, by the members' weights; pass one
    dict for every gear of a model so that its gears share one stacked copy.
    """
    groups = {} if groups is None else groups
    out = dict(modules)
    for paths in sibling_sets(modules):
        views = [modules.get(p) for p in paths]
        if any(type(v) is not NestedLinear for v in views) or len({(v.n, v.fused) for v in views}) != 1:
            continue
        if not views[0].fused and not all(v.through_mlx for v in views):
            continue  # the oracle asked for: each view keeps its own
        members = [v["nested"] for v in views]
        key = tuple(id(m) for m in members)
        if key not in groups:  # (members, group): the members kept alive, so their ids stay theirs
            planes = stack_planes(members)
            groups[key] = (members, None if planes is None else NestedGroup(members, planes))
        group = groups[key][1]
        if group is None:
            continue
        for i, path in enumerate(paths):
            out[path] = FusedNestedLinear(group, i, views[i].n, views[i].fused)
    return out


__all__ = ["FUSE_SETS", "FusedNestedLinear", "NestedGroup", "fuse_nested_views", "stack_planes"]
