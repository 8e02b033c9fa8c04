"""The draft model of self-speculative decoding: the model tree, managed layers in a lower gear.

:func:`build_draft` makes a second module tree that shares every array of
the loaded model except the managed layers, which are quantized copies (the
low or mid gear). Containers along the managed paths are shallow copies
(``copy.copy`` of an ``nn.Module`` copies its child table, not the children),
so norms, embeddings that are not managed, RoPE and every unmanaged linear
are the very same objects in both trees. Both gears stay resident at once;
only the quantized managed layers are extra, and :func:`resident_bytes`
counts each array once.

On the CPU with the packed kernels, :class:`HostForward` runs the drafter's
decode steps in numpy around the C GEMV on a :class:`HostKVCache` (the
drafter's ``make_cache`` returns one), bypassing the MLX graph; the MLX tree
stays the oracle and the fallback.

How well a drafter predicts the high gear, and where it should stop
drafting, is measured in :mod:`gearbx_mlx.speculative.calibration`.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from ..affine import fake_quantize
from ..bindings import cpu as cpu_kernels
from ..config import GearboxConfig, bits_for
from ..precision import PrecisionManager, nbytes
from .host import HOST_PREFILL_MAX, HostForward, HostKVCache, host_support

#: Gears that may draft: the high gear verifies, it cannot draft for itself.
DRAFT_GEARS = ("low", "mid")
#: How the draft's managed layers are built: the gearbox's kernels, or
#: quantize-then-dequantize float weights (same values, fast multi-token
#: products on the CPU; for analysis, never for speed).
DRAFT_QUANTIZERS = ("gearbox", "fake")
#: mlx-lm architectures whose logits are their body's last hidden states through the output
#: projection alone (``Model.__call__``: ``self.model(...)``, then ``lm_head`` or the tied
#: embedding's ``as_linear``), so that logits can be taken a few positions at a time.
HEAD_SPLIT_ARCHITECTURES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")
#: Positions whose logits :func:`prefill_rows` holds at once.
PREFILL_ROWS = 2


def body_and_head(module: nn.Module) -> Optional[Tuple[nn.Module, Callable[[mx.array], mx.array]]]:
    """``(body, head)`` of an mlx-lm model of :data:`HEAD_SPLIT_ARCHITECTURES` on the CPU whose
    output projection is a float ``nn.Linear`` or tied ``nn.Embedding`` (``module(x) ==
    head(body(x))``, and a few rows through the head are those rows of the whole product), or
    None: another architecture, device or head (a quantized product may take another kernel
    for fewer rows)."""
    if type(module).__module__ not in HEAD_SPLIT_ARCHITECTURES or mx.default_device() != mx.cpu:
        return None
    body = module.model
    tied = module.args.tie_word_embeddings
    head = body.embed_tokens if tied else module.lm_head
    if type(head) is not (nn.Embedding if tied else nn.Linear):
        return None
    return body, (head.as_linear if tied else head)


def prefill_rows(module: Any, inputs: mx.array, cache: List[Any]) -> Callable[[int], mx.array]:
    """Prefill ``cache`` with ``inputs`` ``(1, T)`` and give ``rows(start)``: the ``(n, V)`` logits
    of positions ``start .. start + PREFILL_ROWS`` (``n`` fewer at the end), to be called for
    ``start = 0, PREFILL_ROWS, ...`` in turn; the values are those of one call on the whole prompt
    up to float32 rounding (a BLAS may sum a few rows' product in another order than the whole's;
    the cache is filled bitwise alike).

    The prompt's ``(T, V)`` logits are not held whole where that gives the same values (39 x
    151,936 float32 is 24 MB, 256 positions 156 MB): a model the head splits from
    (:func:`body_and_head`) runs its body over the whole prompt and its head a few rows at a
    time; a drafter's host step feeds the tokens in turn anyway, a few per call. Otherwise
    (a drafter's multi-token pass through quantized layers among them) slices of the whole logits."""
    draft = module if isinstance(module, DraftModel) else None
    if draft is not None:
        if cache and isinstance(cache[0], HostKVCache) and inputs.size <= HOST_PREFILL_MAX:
            return lambda start: draft(inputs[:, start : start + PREFILL_ROWS], cache=cache)[0]
        split = None
    else:
        split = body_and_head(module)
    if split is None:
        logits = module(inputs, cache=cache)[0]
        return lambda start: logits[start : start + PREFILL_ROWS]
    body, head = split
    hidden = body(inputs, cache)[0]
    mx.eval(hidden, [c.state for c in cache])
    return lambda start: head(hidden[start : start + PREFILL_ROWS])


@dataclass
class DraftModel:
    """A drafter: the model tree with its managed layers in a lower gear.

    Attributes:
        module: callable like the mlx-lm model (``module(ids, cache=...)``).
        gear: ``"low"`` or ``"mid"``.
        bits: bit width of the managed layers.
        scope: which layers are quantized (``attention`` or ``all``).
        paths: the managed module paths.
        quantizer: ``"gearbox"`` (the gearbox's kernel) or ``"fake"``.
        kernel: the managed layers' kernel (the gearbox's, or ``"fake"``).
        host: the decode step in numpy around the C GEMV (:class:`HostForward`),
            where it applies; ``host_reason`` says why not where it does not.
        sparse: what an activation-sparse drafter keeps of its FFNs
            (:func:`~gearbx_mlx.speculative.sparse.build_sparse_draft`); None: dense.
        kairox: the sparse drafter's online state (hot sets, predictor,
            balancer: :class:`~gearbx_mlx.speculative.kairox.Kairox`), fed
            each verified block's acceptance; None without one.
    """

    module: nn.Module
    gear: str
    bits: int
    scope: str
    paths: List[str]
    quantizer: str = "gearbox"
    kernel: str = "mlx"
    memory: Dict[str, int] = field(default_factory=dict)
    host: Optional["HostForward"] = field(default=None, repr=False)
    host_reason: Optional[str] = None
    sparse: Optional[Dict[str, Any]] = None
    kairox: Optional[Any] = field(default=None, repr=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None, **kwargs: Any) -> mx.array:
        """``(1, T)`` ids -> ``(1, T, V)`` logits, through the host forward when
        ``cache`` is a host cache (:meth:`make_cache`), else the MLX tree."""
        if cache and isinstance(cache[0], HostKVCache):
            if self.host is None or kwargs:
                raise ValueError("a host KV cache needs the drafter's host forward and token ids only")
            if inputs.size > HOST_PREFILL_MAX:
                return self._tree_prefill(inputs, cache)
            return mx.array(self.host(inputs.reshape(-1).tolist(), cache))[None]
        return self.module(inputs, cache=cache, **kwargs)

    def feed(self, inputs: mx.array, cache: List[Any]) -> None:
        """Prefill ``cache`` with ``inputs`` ``(1, T)`` as a call would, computing no logits: the
        host step feeds the tokens in turn without its head (a call holds ``(T, V)`` float32
        logits twice, numpy's and MLX's: 47 MB for 39 tokens of a 151,936-token vocabulary), a
        longer input runs the tree's body alone on :data:`HEAD_SPLIT_ARCHITECTURES`, and the
        tree's own cache evaluates its state alone."""
        if not (cache and isinstance(cache[0], HostKVCache)):
            self.module(inputs, cache=cache)
            mx.eval([c.state for c in cache])
        elif inputs.size <= HOST_PREFILL_MAX and self.host is not None:
            for t in inputs.reshape(-1).tolist():
                self.host.step(int(t), cache, logits=False)
        else:
            split = type(self.module).__module__ in HEAD_SPLIT_ARCHITECTURES and not self.sparse
            self._tree_prefill(inputs, cache, self.module.model if split else None)

    def _tree_prefill(self, inputs: mx.array, cache: List["HostKVCache"], fn: Optional[Callable[..., mx.array]] = None
                      ) -> mx.array:
        """A long input through the MLX tree (one multi-token pass instead of
        a GEMV per token), on a KV cache seeded from the host cache and copied back.
        ``fn``: what runs on the tree's cache (default the tree; its body leaves the head out)."""
        tmp = []
        for c in cache:
            kv = KVCache()
            if c.offset:
                kv.update_and_fetch(mx.array(c.keys[None, :, : c.offset]), mx.array(c.values[None, :, : c.offset]))
            tmp.append(kv)
        out = (fn or self.module)(inputs, cache=tmp)
        mx.eval(out, [(t.keys, t.values) for t in tmp])
        n = inputs.shape[-1]
        for c, t in zip(cache, tmp):
            c.reserve(n)
            c.keys[:, c.offset : c.offset + n] = np.asarray(t.keys[0, :, c.offset : t.offset])
            c.values[:, c.offset : c.offset + n] = np.asarray(t.values[0, :, c.offset : t.offset])
            c.offset += n
        return out

    def make_cache(self) -> List[Any]:
        """The drafter's KV cache (mlx-lm's ``make_prompt_cache`` calls this):
        host caches when the host forward applies, else the tree's own."""
        if self.host is not None:
            return self.host.make_cache()
        if hasattr(self.module, "make_cache"):
            return self.module.make_cache()
        return [KVCache() for _ in self.module.layers]

    def __getattr__(self, name: str) -> Any:
        # ``layers``, ``make_cache``, ``args``...: the tree's own (make_prompt_cache reads them).
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)


def check_draft_gear(gear: str) -> None:
    if gear not in DRAFT_GEARS:
        hint = " (the high gear verifies; it cannot draft for itself)" if gear == "high" else ""
        raise ValueError(f"draft gear must be one of {DRAFT_GEARS}, got {gear!r}{hint}")


def _path_tree(paths: Sequence[str], modules: Dict[str, nn.Module]) -> Dict[str, Any]:
    """``{"model": {"layers": {"0": {...: module}}}}`` from dotted paths."""
    tree: Dict[str, Any] = {}
    for p in paths:
        node = tree
        *parents, leaf = p.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = modules[p]
    return tree


def graft(node: Any, tree: Dict[str, Any]) -> Any:
    """A copy of ``node`` with the modules of ``tree`` installed at their paths.

    Only containers on the way to a replaced module are copied (shallowly);
    every other child is shared with ``node``, which is left untouched.
    """
    if isinstance(node, list):
        new: Any = list(node)
    elif isinstance(node, nn.Module):
        new = copy.copy(node)
    elif isinstance(node, dict):
        new = dict(node)
    else:
        raise TypeError(f"cannot graft into a {type(node).__name__}")
    for key, sub in tree.items():
        k: Any = int(key) if isinstance(node, list) else key
        new[k] = sub if isinstance(sub, nn.Module) else graft(node[k], sub)
    return new


def _fake_quantized(module: nn.Module, bits: int, group_size: int) -> nn.Module:
    """A float layer holding quantize-then-dequantize weights (analysis only)."""
    w = fake_quantize(module.weight, bits, group_size)
    if isinstance(module, nn.Embedding):
        out: nn.Module = nn.Embedding(*w.shape)
    elif isinstance(module, nn.Linear):
        out = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
        if "bias" in module:
            out.bias = module.bias
    else:
        raise TypeError(f"cannot fake-quantize a {type(module).__name__}")
    out.weight = w
    return out


_SCOPE_MANAGERS: "weakref.WeakKeyDictionary[Any, Dict[str, PrecisionManager]]" = weakref.WeakKeyDictionary()


def scope_manager(gearbox: Any, scope: str) -> PrecisionManager:
    """A manager of ``scope`` beside the gearbox's own, built once per gearbox and scope.

    It only discovers and quantizes, reading the loaded weights as its high
    gear, so it never touches the model; the low and mid drafters of one scope
    share it (with the nested store, one set of planes). Its nested planes are
    cached on disk beside the gearbox's (the key holds the scope's layers), so
    a later run reads them instead of building them. To share one store with
    the gearbox itself, give the gearbox the drafter's scope (``draft_scope``).
    """
    per_box = _SCOPE_MANAGERS.setdefault(gearbox, {})
    if scope not in per_box:
        mgr: PrecisionManager = gearbox.manager
        # The model's folder also holds the tokenizer that a low plane of another quantizer reads.
        folder = mgr.planes_dir if mgr.planes_dir is not None else getattr(gearbox, "model_dir", None)
        per_box[scope] = PrecisionManager(mgr.model, gearbox.config.replace(scope=scope, high="original"),
                                          planes_dir=folder)
    return per_box[scope]


def build_draft(
    model: nn.Module,
    gearbox: Any,
    gear: str = "low",
    scope: Optional[str] = None,
    quantizer: str = "gearbox",
    host: Optional[bool] = None,
) -> DraftModel:
    """Build the drafter of ``model`` in ``gear``, sharing all unmanaged arrays.

    Args:
        model: the loaded mlx-lm model (the high gear); it is not modified.
        gearbox: its :class:`~gearbx_mlx.gearbox.Gearbox` (bits, group size,
            kernel; its gear cache is reused when ``scope`` is the gearbox's).
        gear: ``"low"`` or ``"mid"``.
        scope: ``"attention"`` or ``"all"``; None means the gearbox's scope.
        quantizer: ``"gearbox"`` or ``"fake"`` (see :data:`DRAFT_QUANTIZERS`).
        host: decode steps through :class:`HostForward` (numpy around the C
            kernels, no MLX graph): None uses it where it applies (the
            gearbox's packed kernels on the CPU, a llama model), False never,
            True requires it.

    Raises:
        ValueError: bad gear or quantizer, a pre-quantized model, or a model
            whose gearbox is not in the high gear.
    """
    check_draft_gear(gear)
    if quantizer not in DRAFT_QUANTIZERS:
        raise ValueError(f"quantizer must be one of {DRAFT_QUANTIZERS}, got {quantizer!r}")
    config: GearboxConfig = gearbox.config
    scope = scope or config.scope
    mgr: PrecisionManager = gearbox.manager
    if mgr.telemetry_only:
        raise ValueError(
            "speculative decoding needs a model whose gears can be built; this one is "
            "pre-quantized (or telemetry-only): load its full-precision weights"
        )
    if mgr.gear != "high":
        raise ValueError(f"the gearbox is in the {mgr.gear} gear: shift it to 'high' first")
    bits = bits_for(gear, config)
    if scope != config.scope:
        mgr = scope_manager(gearbox, scope)
    if not mgr.paths:
        raise ValueError(f"scope {scope!r} manages no layer of this model: nothing to draft with")
    if quantizer == "gearbox":
        mgr.prepare(gear)
        modules = dict(mgr.cache[gear])
    else:
        modules = {p: _fake_quantized(m, bits, config.group_size) for p, m in mgr.originals.items()}
        mx.eval([m.parameters() for m in modules.values()])
    module = graft(model, _path_tree(mgr.paths, modules))
    kernel = config.kernel if quantizer == "gearbox" else "fake"
    draft = DraftModel(module, gear, int(bits), scope, list(mgr.paths), quantizer, kernel)
    # With the nested store the drafter's layers are views of the store's
    # planes, and with the separate store of the gearbox's own gear cache:
    # count what is already resident there as resident, not as the drafter's.
    draft.memory = resident_bytes(model, draft, held=[gearbox.manager, mgr])
    attach_host(draft, host)
    return draft


def attach_host(draft: DraftModel, host: Optional[bool] = None) -> None:
    """Give ``draft`` its host step where it applies, or say why not (``draft.host_reason``).

    ``host``: None attaches it to a drafter of the gearbox's packed kernels
    wherever :func:`~gearbx_mlx.speculative.host.host_support` allows; True
    requires it (ValueError naming the reason otherwise); False never.
    """
    if host is False:
        reason: Optional[str] = "the host step was turned off (host=False)"
    elif host is None and draft.kernel != "packed":
        reason = (f"the drafter's kernel is {draft.kernel!r}: the host step runs the packed kernels "
                  "(--kernel packed, the default on a CPU with the C kernels built)")
    else:
        reason = host_support(draft.module)
    if host and reason is not None:
        raise ValueError(f"the host forward does not apply here: {reason}")
    draft.host = HostForward(draft.module, cpu_kernels.require()) if reason is None else None
    draft.host_reason = reason


def resident_bytes(model: nn.Module, draft: DraftModel, held: Sequence[Any] = ()) -> Dict[str, int]:
    """Bytes of both trees, each array counted once.

    ``high_bytes``: the loaded model; ``draft_bytes``: the drafter's tree as
    if alone; ``shared_bytes``: its arrays the model or the gear stores in
    ``held`` (precision managers) already hold; ``extra_bytes``: what the
    drafter adds; ``store_bytes``: the stores' arrays outside the model tree;
    ``resident_total``: the model, the stores and the drafter's extra.
    """
    hi = {id(v): v.nbytes for _, v in tree_flatten(model.parameters())}
    store: Dict[int, int] = {}
    for mgr in held:
        for mods in getattr(mgr, "cache", {}).values():
            for m in mods.values():
                for _, v in tree_flatten(m.parameters()):
                    if id(v) not in hi:
                        store[id(v)] = v.nbytes
    dr = {id(v): v.nbytes for _, v in tree_flatten(draft.module.parameters())}
    shared = sum(n for k, n in dr.items() if k in hi or k in store)
    extra = sum(n for k, n in dr.items() if k not in hi and k not in store)
    return {
        "high_bytes": sum(hi.values()),
        "store_bytes": sum(store.values()),
        "draft_bytes": sum(dr.values()),
        "shared_bytes": shared,
        "extra_bytes": extra,
        "resident_total": sum(hi.values()) + sum(store.values()) + extra,
        "managed_high_bytes": sum(nbytes(m) for m in _at(model, draft.paths)),
        "managed_draft_bytes": sum(nbytes(m) for m in _at(draft.module, draft.paths)),
    }


def _at(model: nn.Module, paths: Sequence[str]) -> List[nn.Module]:
    mods = dict(model.named_modules())
    return [mods[p] for p in paths]


__all__ = [
    "DRAFT_GEARS", "DRAFT_QUANTIZERS", "DraftModel", "attach_host", "build_draft", "check_draft_gear",
    "graft", "resident_bytes",
]
