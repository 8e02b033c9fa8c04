"""Multi-variant layers: one forward pass, a different gear per row or per position.

The quality evaluation feeds a policy's teacher-forced tokens through a
model whose every managed layer can use a different precision at each
position (each position is one decode step, and the gear is chosen per
step). A :class:`VariantLinear` (or :class:`VariantEmbedding` for a tied
embedding) holds the loaded weight and "fake-quantized" float copies of it
(MLX affine quantize, then dequantize: within 5e-7 of ``QuantizedLinear``
with float32 inputs, see the tests). Before each forward pass a
:class:`RowRouter` is told, for every managed path, which variant each batch
row uses, or each position of each row; a layer then computes only the
variants in use, on the rows or positions that use them, and puts them back
in order. Since a position's keys and values are computed with its own
gear, one pass over ``L`` positions equals ``L`` decode steps.

Variant keys are bit widths; ``0`` is the loaded weight (the high gear);
the negative keys are the nested store's gears that differ from an MLX
format (:data:`NESTED_MID`, :data:`NESTED_HIGH`: the sums of the first two
or three planes of :mod:`gearbx_mlx.nested.planes`, exactly the values its
layers multiply by).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..affine import fake_quantize
from ..nested.planes import DEFAULT_PLAN, Plane, PlaneSpec, build_planes, reconstruct
from ..nested.store import cache_key, cache_path, cached_nested, fingerprint
from ..precision import discover
from ..sources.cache import cache_dir

#: Variant key of the loaded weights (the high gear).
ORIGINAL = 0
#: Variant keys of the nested store's mid gear (planes 0-1) and of its high
#: gear read from every plane (planes 0-2). Its low gear is MLX 4-bit (key 4).
NESTED_MID = -2
NESTED_HIGH = -3


def variant_weight(weight: mx.array, key: int, group_size: int) -> mx.array:
    """The float weight ``(out, in)`` that variant ``key`` multiplies by."""
    return variant_weights(weight, (key,), group_size)[key]


def variant_weights(weight: mx.array, keys: Iterable[int], group_size: int,
                    planes: Optional[Sequence[Plane]] = None) -> Dict[int, mx.array]:
    """:func:`variant_weight` of several keys; the nested keys share one build of the planes.

    Planes are built in order, each from the residual of those before, so the
    mid gear's two planes are the first two of the high gear's three: one
    build serves both (the second plane's clipping search is the costly part).

    Args:
        planes: this weight's planes made before (the nested store's cache,
            :func:`nested_planes`); used where they are at least as many as a
            nested key needs, else the planes are built here.
    """
    keys = sorted(set(keys))
    out = {k: fake_quantize(weight, k, group_size) for k in keys if k > 0}
    nested = [k for k in keys if k in (NESTED_MID, NESTED_HIGH)]
    if nested:
        n = max(-k for k in nested)
        if planes is None or len(planes) < n:
            planes = build_planes(weight, nested_plan(n, group_size))
        out.update({k: reconstruct(planes, -k, dtype=weight.dtype) for k in nested})
    for k in keys:
        if k not in out:
            raise ValueError(f"unknown variant key {k}")
    return out


def nested_plan(n: int, group_size: int) -> Tuple[PlaneSpec, ...]:
    """The first ``n`` planes of the nested store's plan, plane 0 in ``group_size``."""
    return ((DEFAULT_PLAN[0][0], group_size),) + DEFAULT_PLAN[1:n]


def nested_planes(model: nn.Module, paths: Sequence[str], n: int, group_size: int,
                  model_dir: Optional[Path], say: Optional[Callable[[str], None]] = None) -> Dict[str, List[Plane]]:
    """The first ``n`` planes of each float layer of ``paths`` through the nested store's
    cache in ``model_dir``: the file ``generate --store nested --scope all`` reads (two planes;
    ``--high planes``: three), built and written there when missing, so a run after either
    command skips the build. ``{}`` where there is no folder to cache in, or for another
    model's layers than the store's own (a quantized model, fewer layers than ``--scope all``).
    ``say``: told where the planes come from (a large model's build takes minutes).
    """
    modules = dict(model.named_modules())
    if model_dir is None or not paths or any(not isinstance(modules.get(p), (nn.Linear, nn.Embedding))
                                             for p in paths):
        return {}
    every, _ = discover(model, "all", group_size)
    if not set(paths) <= set(every):
        return {}
    plan = nested_plan(n, group_size)
    key = cache_key(fingerprint(model_dir), every, plan)
    file = cache_path(model_dir, key, cache_dir() / "planes")
    if say is not None:
        say(f"the nested store's planes: reading {file}" if file.exists() else
            f"building the nested store's planes of {len(every)} layers (kept in {file} for later runs) ...")
    weights, _ = cached_nested(file, key, {p: modules[p] for p in every}, plan)
    return {p: weights[p].planes for p in paths}


Groups = Tuple[List[Tuple[int, Optional[mx.array]]], Optional[mx.array]]


class RowRouter:
    """Per forward pass, which variant each row (or position) uses in each managed layer.

    The keys of a path are one per batch row (the whole row uses it) or one
    per position, rows after rows (``B * L`` keys for a ``(B, L)`` input).
    Grouping by variant is memoized by the tuple of keys: a pass has only a
    few distinct patterns (attention vs MLP, 4- vs 6-bit layers).
    """

    def __init__(self) -> None:
        self._keys: Dict[str, Tuple[int, ...]] = {}
        self._memo: Dict[Tuple[int, ...], Groups] = {}
        # The last input split into groups: q/k/v (and gate/up) read the same
        # input with the same groups, so it is gathered once, not three times.
        self._split: Tuple[Optional[mx.array], Optional[Groups], List[mx.array]] = (None, None, [])
        self._flat_of: Tuple[Optional[mx.array], Optional[mx.array]] = (None, None)

    def set_keys(self, keys: Dict[str, Tuple[int, ...]]) -> None:
        """``keys[path]``: the variant key of every batch row or position, one tuple per path."""
        if len({len(k) for k in keys.values()}) > 1:
            raise ValueError("every path needs one variant key per batch row or position (lengths differ)")
        self._keys = keys
        self._split, self._flat_of = (None, None, []), (None, None)
        if len(self._memo) > 4096:  # random routers make many patterns
            self._memo.clear()

    def groups(self, path: str) -> Tuple[Groups, int]:
        """``([(key, indices or None for all)], inverse permutation)`` and the number of keys."""
        keys = self._keys.get(path)
        if keys is None:
            raise RuntimeError(f"no variant keys were set for {path} before the forward pass")
        out = self._memo.get(keys)
        if out is None:
            distinct = sorted(set(keys))
            if len(distinct) == 1:
                out = ([(distinct[0], None)], None)
            else:
                order: List[int] = []
                parts = []
                for k in distinct:
                    idx = [r for r, kk in enumerate(keys) if kk == k]
                    order.extend(idx)
                    parts.append((k, mx.array(idx, dtype=mx.uint32)))
                inverse = [0] * len(order)
                for pos, r in enumerate(order):
                    inverse[r] = pos
                out = (parts, mx.array(inverse, dtype=mx.uint32))
            self._memo[keys] = out
        return out, len(keys)

    def split(self, x: mx.array, groups: Groups) -> List[mx.array]:
        """``x``'s rows of each group (``x`` flattened to one row per key), gathered once per input."""
        last_x, last_groups, rows = self._split
        if x is not last_x or groups is not last_groups:
            rows = [mx.take(x, idx, axis=0) for _, idx in groups[0]]
            self._split = (x, groups, rows)
        return rows

    def route(self, path: str, x: mx.array, fn) -> mx.array:
        """Apply ``fn(key, rows)`` to each group of ``path``'s keys and restore the order.

        ``x`` is ``(B, L, ...)``; with ``B`` keys the groups are rows, with
        ``B * L`` keys they are positions (``x`` is flattened to ``(B * L, ...)``
        and the answer reshaped back).
        """
        groups, n_keys = self.groups(path)
        parts, inverse = groups
        if inverse is None:
            return fn(parts[0][0], x)
        lead = x.shape[:2]
        flat = x
        if n_keys != x.shape[0]:
            if x.ndim < 2 or n_keys != lead[0] * lead[1]:
                raise ValueError(f"{n_keys} variant keys for an input of shape {x.shape}: give B or B*L keys")
            flat = self._flat(x, n_keys)
        ys = [fn(k, rows) for (k, _), rows in zip(parts, self.split(flat, groups))]
        y = mx.take(mx.concatenate(ys, axis=0), inverse, axis=0)
        return y if n_keys == lead[0] else y.reshape(*lead, *y.shape[1:])

    def _flat(self, x: mx.array, n_keys: int) -> mx.array:
        # The same input reshaped twice must be the same object for split() to see it.
        if self._flat_of[0] is not x:
            self._flat_of = (x, x.reshape(n_keys, *x.shape[2:]))
        return self._flat_of[1]


class WeightVariants(nn.Module):
    """A layer's weight (variant 0) and its fake-quantized copies, chosen per batch row by ``router``.

    The copies are kept outside the module's parameter tree: nothing here is
    trained, saved or swapped, and int keys have no place in a parameter path.
    """

    def __init__(self, weight: mx.array, bits: Iterable[int], group_size: int, router: RowRouter, path: str,
                 planes: Optional[Sequence[Plane]] = None) -> None:
        super().__init__()
        object.__setattr__(self, "_variants", {ORIGINAL: weight})
        self._router = router
        self._path = path
        self.add(bits, group_size, planes)

    def add(self, bits: Iterable[int], group_size: int, planes: Optional[Sequence[Plane]] = None) -> None:
        """Build the fake-quantized copies of these bit widths that are missing (lazy); ``planes``:
        this weight's nested planes made before (:func:`variant_weights`)."""
        self._variants.update(variant_weights(self._variants[ORIGINAL], set(bits) - set(self._variants), group_size,
                                              planes))

    def weights(self) -> List[mx.array]:
        return list(self._variants.values())


class VariantLinear(WeightVariants):
    """An ``nn.Linear`` with several weight variants, chosen per batch row.

    Args:
        linear: the loaded layer (its weight is variant 0).
        bits: bit widths to build fake-quantized copies for.
        group_size: MLX quantization group size.
        router: says which variant each row uses at the current step.
        path: this layer's path in the model (the router's key).
    """

    def __init__(
        self, linear: nn.Linear, bits: Iterable[int], group_size: int, router: RowRouter, path: str,
        planes: Optional[Sequence[Plane]] = None,
    ) -> None:
        super().__init__(linear.weight, bits, group_size, router, path, planes)
        object.__setattr__(self, "_bias", linear.bias if "bias" in linear else None)

    def __call__(self, x: mx.array) -> mx.array:
        """``(R, L, in) -> (R, L, out)``, each row or position through its own variant."""

        def fn(key: int, rows: mx.array) -> mx.array:
            return rows @ self._variants[key].T

        y = self._router.route(self._path, x, fn)
        return y if self._bias is None else y + self._bias


class VariantEmbedding(WeightVariants):
    """A tied ``nn.Embedding`` with weight variants (lookup and output projection)."""

    def __init__(
        self, embedding: nn.Embedding, bits: Iterable[int], group_size: int, router: RowRouter, path: str,
        planes: Optional[Sequence[Plane]] = None,
    ) -> None:
        super().__init__(embedding.weight, bits, group_size, router, path, planes)

    def __call__(self, ids: mx.array) -> mx.array:
        """``(R, L)`` token ids -> ``(R, L, dims)``."""
        return self._router.route(self._path, ids, lambda k, rows: self._variants[k][rows])

    def as_linear(self, x: mx.array) -> mx.array:
        """``(R, L, dims) -> (R, L, vocab)``: the tied output projection."""
        return self._router.route(self._path, x, lambda k, rows: rows @ self._variants[k].T)


class VariantModel:
    """Installs variant layers in a model and restores the loaded ones.

    Use as a context manager; inside it, call :meth:`set_keys` before each
    forward pass. Restoring re-installs the very objects that were loaded.

    Args:
        model: an mlx-lm model.
        bits_per_path: for each managed path, the bit widths its rows may use.
        group_size: MLX quantization group size.
        model_dir: the loaded model's folder, where the nested keys' planes are
            read from the nested store's cache, or written to it once built
            (:func:`nested_planes`); None: built here, not kept.
        progress: status lines (where the nested planes come from).
    """

    def __init__(self, model: nn.Module, bits_per_path: Dict[str, Sequence[int]], group_size: int,
                 model_dir: Optional[Path] = None, progress: Optional[Callable[[str], None]] = None) -> None:
        self.model = model
        self.router = RowRouter()
        modules = dict(model.named_modules())
        missing = [p for p in bits_per_path if p not in modules]
        if missing:
            raise ValueError(f"paths not in the model: {missing[:3]}")
        self.originals = {p: modules[p] for p in bits_per_path}
        self.variants: Dict[str, nn.Module] = {}
        depth = {p: max((-b for b in bits if b in (NESTED_MID, NESTED_HIGH)), default=0) for p, bits in bits_per_path.items()}
        nested = [p for p, n in depth.items() if n]
        planes = nested_planes(model, nested, max(depth.values()), group_size, model_dir, progress) if nested else {}
        for p, bits in bits_per_path.items():
            m = self.originals[p]
            if isinstance(m, nn.Embedding):
                self.variants[p] = VariantEmbedding(m, bits, group_size, self.router, p, planes.get(p))
            elif isinstance(m, nn.Linear):
                self.variants[p] = VariantLinear(m, bits, group_size, self.router, p, planes.get(p))
            else:
                raise ValueError(f"{p} is a {type(m).__name__}: only Linear and Embedding have variants")
        self.group_size = group_size
        mx.eval([v.weights() for v in self.variants.values()])

    def ensure(self, bits_per_path: Dict[str, Sequence[int]]) -> None:
        """Build any variant a later pass needs that is not there yet."""
        missing = [p for p in bits_per_path if p not in self.variants]
        if missing:
            raise ValueError(f"paths without variant layers: {missing[:3]} (build the VariantModel with them)")
        for p, bits in bits_per_path.items():
            self.variants[p].add(bits, self.group_size)
        mx.eval([v.weights() for v in self.variants.values()])

    def set_keys(self, keys: Dict[str, Tuple[int, ...]]) -> None:
        self.router.set_keys(keys)

    def __enter__(self) -> "VariantModel":
        self.model.update_modules(tree_unflatten(list(self.variants.items())))
        return self

    def __exit__(self, *exc) -> None:
        self.model.update_modules(tree_unflatten(list(self.originals.items())))
