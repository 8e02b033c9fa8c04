"""Hot sets, next-layer prediction and online balancing for the activation-sparse drafter.

The sparse drafter (:mod:`gearbx_mlx.speculative.sparse`) keeps, per one-token
step and layer, the ``keep`` blocks of 64 neurons whose hidden activation
carries the most mass, and reads only their columns of ``down_proj``. Three
mechanisms refine it, each switchable in :class:`KairoxOptions` (every default
there) for ablation:

* **Hot sets** (``hot``): a few blocks per layer are kept on every step and
  packed into one contiguous copy of their ``down_proj`` columns, so they run
  as one dense ``mx.quantized_matmul``; the cold blocks a token activates take
  the gathered path. ``static``: the blocks most often kept on the
  calibration text. ``tam``: Temporal Activation Momentum, per block
  ``score_t = beta * score_{t-1} + (1 - beta) * active_t`` (``active``: the
  block was among the token's ``keep`` heaviest), refreshed every
  ``refresh`` steps: the hot set is the ``budget`` (a share of ``keep``)
  highest scores among blocks active at least ``min_hits`` times since the
  last refresh (the one-hit filter: a block seen once does not get in).
  Bytes per step are the same as without a hot set (the same number of
  blocks is read); what changes is the kernel, and which blocks are kept.
* **Live Pipeline** (``predictor``): the residual stream changes little from
  one layer to the next, so layer ``l``'s kept blocks predict layer
  ``l + 1``'s: a transition table measured on the calibration text
  (``P(j kept at l + 1 | i kept at l)``) plus the next layer's TAM scores
  rank its blocks, and layer ``l + 1`` computes ``gate_proj`` and
  ``up_proj`` for the ``candidates`` best (and its hot blocks) only. Their
  rows of a block are contiguous in the packed weights, so this reads
  ``candidates / blocks`` of them. Its hit rate (the share of the blocks a
  dense step would keep that were among the candidates) is measured with
  ``audit`` (which computes the dense activation as well).
* **Adaptive Balancer** (``balancer``): every ``window`` drafts, the
  acceptance of the drafts since the last change is compared with
  ``target_acceptance``: below it, the layers that dropped the largest share
  of their mass keep one more block each; above it (by ``tolerance``), those
  that dropped the least keep one fewer (as many layers as the gap times the
  layer count: a proportional step). Every block of a layer costs the same
  bytes, so this moves bytes to where they buy acceptance.

Drafts stay proposals: the verifier's output is the high gear's whatever
these choose. One-token steps only; several rows (prefill, re-fed tokens) go
dense, as in :class:`~gearbx_mlx.speculative.sparse.SparseMLP`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .draft import DraftModel, graft
from .kairox_blocks import (
    block_mass_rows,
    choose_hot,
    index_mask,
    kept_masks,
    pack_hot,
    row_blocks,
    rows_product,
    tam_update,
    top_mask,
    transitions,
)
from .sparse import (
    block_major,
    build_sparse_draft,
    expert_down,
    ffn_layers,
    glu_of,
    hidden,
    layer_masses,
    quant_parts,
)

#: Ways of choosing a hot set.
HOT_SETS = ("off", "static", "tam")


@dataclasses.dataclass(frozen=True)
class KairoxOptions:
    """The mechanisms of the sparse drafter and their settings (see the module doc).

    Attributes:
        hot: ``off``, ``static`` or ``tam``.
        beta: TAM's momentum, in ``[0, 1)``.
        budget: the hot set's size at most, as a share of each layer's kept blocks.
        min_hits: activations since the last refresh a block needs to enter the hot set (1: no filter).
        refresh: one-token steps between hot-set refreshes (each repacks the hot copy where it changed).
        predictor: compute gate/up for the blocks predicted from the layer before only.
        candidates: blocks predicted, as a multiple of the layer's kept blocks (at least ``keep``).
        audit: also compute the dense activation, to measure the predictor's hit rate.
        balancer: adjust the layers' kept blocks online.
        target_acceptance: the acceptance the balancer holds.
        tolerance: how far above the target acceptance must be before a block is dropped.
        window: drafts between the balancer's moves.
    """

    hot: str = "off"
    beta: float = 0.8
    budget: float = 0.5
    min_hits: int = 2
    refresh: int = 8
    predictor: bool = False
    candidates: float = 1.5
    audit: bool = False
    balancer: bool = False
    target_acceptance: float = 0.5
    tolerance: float = 0.1
    window: int = 16

    def __post_init__(self) -> None:
        checks = [
            (self.hot in HOT_SETS, f"hot must be one of {HOT_SETS}"),
            (0 <= self.beta < 1, "beta must be in [0, 1)"),
            (0 <= self.budget <= 1, "budget must be in [0, 1]"),
            (isinstance(self.min_hits, int) and self.min_hits >= 1, "min_hits must be an integer >= 1"),
            (isinstance(self.refresh, int) and self.refresh >= 1, "refresh must be an integer >= 1"),
            (self.candidates >= 1, "candidates must be >= 1"),
            (0 <= self.target_acceptance <= 1, "target_acceptance must be in [0, 1]"),
            (0 <= self.tolerance <= 1, "tolerance must be in [0, 1]"),
            (isinstance(self.window, int) and self.window >= 1, "window must be an integer >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"KairoxOptions: {message}")

    @property
    def active(self) -> bool:
        """Whether any mechanism is on (else the plain sparse drafter)."""
        return self.hot != "off" or self.predictor or self.balancer


class Kairox:
    """The state the sparse drafter's layers share: options, per-layer kept blocks, TAM scores, hot sets,
    the predictor's tables, the balancer's counters, and the statistics of the steps since the last read.

    Args:
        options: the mechanisms.
        keep: each layer's kept blocks at the start.
        blocks: each layer's blocks.
        prior: ``[(nb,)]`` each layer's share of calibration tokens that kept each block (TAM's start
            and the static hot set).
        table: the predictor's ``[(nb_l, nb_{l+1})]`` transitions, or None.
    """

    def __init__(self, options: KairoxOptions, keep: Sequence[int], blocks: Sequence[int],
                 prior: Sequence[np.ndarray], table: Optional[Sequence[np.ndarray]] = None) -> None:
        self.options = options
        self.keep, self.blocks = [int(k) for k in keep], list(blocks)
        self.score = [mx.array(p, dtype=mx.float32) for p in prior]
        self.hits = [mx.zeros((n,), dtype=mx.int32) for n in blocks]
        self.table = [mx.array(t) for t in table] if table is not None else None
        self.layers: List["KairoxMLP"] = []
        self.predicted: Dict[int, mx.array] = {}
        self.steps = 0
        self.pending: List[Dict[str, mx.array]] = []  # per layer step: lazily computed statistics
        self.totals = {"layer_steps": 0, "kept": 0.0, "rows": 0.0, "blocks": 0, "hot_hits": 0.0, "hot": 0,
                       "pred_hits": 0.0, "pred_needed": 0, "dropped_mass": [0.0] * len(blocks),
                       "refreshes": 0, "repacked_bytes": 0, "moves": []}
        self.window = {"drafted": 0, "accepted": 0}
        self.dropped = [0.0] * len(blocks)  # the balancer's per-layer EMA of the dropped mass share
        self.hot_sets: List[List[int]] = [[] for _ in blocks]
        if options.hot == "static":
            self.hot_sets = [sorted(np.argsort(-p, kind="stable")[: self.hot_size(i)].tolist())
                             for i, p in enumerate(prior)]

    def hot_size(self, layer: int) -> int:
        return int(self.options.budget * self.keep[layer]) if self.options.hot != "off" else 0

    def candidates(self, layer: int) -> int:
        return min(self.blocks[layer], max(self.keep[layer], round(self.options.candidates * self.keep[layer])))

    # -- per step ----------------------------------------------------------------------

    def start_step(self) -> None:
        """Called by layer 0 on each one-token step: refresh the hot sets when due."""
        self.steps += 1
        self.predicted.clear()
        if len(self.pending) > 64 * len(self.keep):
            self.collect()  # bound the lazy graph of statistics nobody has read
        if self.options.hot == "tam" and self.steps % self.options.refresh == 0:
            self.refresh()

    def refresh(self) -> None:
        """Re-choose every layer's TAM hot set and repack the layers whose set changed."""
        self.collect()  # the steps so far are counted against the hot sets they ran with
        mx.eval(self.score, self.hits)
        self.totals["refreshes"] += 1
        for i, layer in enumerate(self.layers):
            hot = choose_hot(np.array(self.score[i]), np.array(self.hits[i]), self.hot_size(i),
                             self.options.min_hits)
            if hot != self.hot_sets[i]:
                self.hot_sets[i] = hot
                layer.repack()
            self.hits[i] = mx.zeros_like(self.hits[i])

    def record(self, layer: int, stats: Dict[str, mx.array]) -> None:
        self.pending.append({"layer": layer, **stats})

    def collect(self) -> None:
        """Fold the pending steps' statistics into the totals (one evaluation)."""
        if not self.pending:
            return
        mx.eval([[v for k, v in p.items() if k != "layer"] for p in self.pending])
        t = self.totals
        for p in self.pending:
            i = p["layer"]
            t["layer_steps"] += 1
            t["kept"] += float(p["kept"])
            t["rows"] += float(p["rows"])
            t["blocks"] += self.blocks[i]
            t["hot"] += len(self.hot_sets[i])
            t["hot_hits"] += float(p["hot_hits"])
            share = float(p["dropped"])
            t["dropped_mass"][i] += share
            self.dropped[i] = 0.9 * self.dropped[i] + 0.1 * share
            if "pred_hits" in p:
                t["pred_hits"] += float(p["pred_hits"])
                t["pred_needed"] += self.keep[i]
        self.pending = []

    def read(self) -> Dict[str, Optional[float]]:
        """The kept fraction, hot-set hit rate and predictor hit rate of the steps since the last read."""
        before = dict(self.totals)
        self.collect()
        t = self.totals
        steps, blocks = t["layer_steps"] - before["layer_steps"], t["blocks"] - before["blocks"]
        hot = t["hot"] - before["hot"]
        needed = t["pred_needed"] - before["pred_needed"]
        return {"kept_fraction": (t["kept"] - before["kept"]) / blocks if steps else None,
                "hot_hit_rate": (t["hot_hits"] - before["hot_hits"]) / hot if hot else None,
                "predictor_hit_rate": (t["pred_hits"] - before["pred_hits"]) / needed if needed else None}

    def summary(self) -> Dict[str, Any]:
        """Totals over the run: kept fraction (of down_proj's blocks), gate/up fraction (of their rows
        computed), hit rates, refreshes, repacked bytes, the balancer's moves."""
        self.collect()
        t = self.totals
        return {"kept_fraction": t["kept"] / t["blocks"] if t["blocks"] else None,
                "gate_up_fraction": t["rows"] / t["blocks"] if t["blocks"] else None,
                "hot_hit_rate": t["hot_hits"] / t["hot"] if t["hot"] else None,
                "predictor_hit_rate": t["pred_hits"] / t["pred_needed"] if t["pred_needed"] else None,
                "layer_steps": t["layer_steps"], "refreshes": t["refreshes"],
                "repacked_bytes": t["repacked_bytes"], "keep": list(self.keep), "moves": len(t["moves"])}

    # -- the balancer ------------------------------------------------------------------

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified block's drafts and how many were accepted (the balancer's signal)."""
        if not self.options.balancer or drafted <= 0:
            return
        w = self.window
        w["drafted"] += drafted
        w["accepted"] += accepted
        if w["drafted"] < self.options.window:
            return
        self.collect()
        rate = w["accepted"] / w["drafted"]
        w["drafted"] = w["accepted"] = 0
        self.balance(rate)

    def balance(self, rate: float) -> List[int]:
        """Moves at acceptance ``rate``: a block more in the layers that drop the most mass, or one fewer in
        those that drop the least; as many layers as ``|gap| * layers`` (at least one), the gap measured
        from the target (or the target plus the tolerance). Returns the layers moved."""
        o = self.options
        n = len(self.keep)
        if rate < o.target_acceptance:
            order = sorted((i for i in range(n) if self.keep[i] < self.blocks[i]), key=lambda i: (-self.dropped[i], i))
            step, gap = 1, o.target_acceptance - rate
        elif rate > o.target_acceptance + o.tolerance:
            order = sorted((i for i in range(n) if self.keep[i] > max(1, len(self.hot_sets[i]))),
                           key=lambda i: (self.dropped[i], i))
            step, gap = -1, rate - o.target_acceptance - o.tolerance
        else:
            return []
        moved = order[: max(1, round(gap * n))]
        for layer in moved:
            self.keep[layer] += step
            self.totals["moves"].append((self.steps, layer, step, rate))
        return moved


class KairoxMLP(nn.Module):
    """A drafter's FFN under :class:`Kairox`: ``(B, T, D) -> (B, T, D)``; one row goes sparse."""

    def __init__(self, mlp: nn.Module, index: int, state: Kairox) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.__dict__["_glu"] = glu_of(mlp)
        self.index = index
        self.parts = quant_parts(mlp.down_proj)
        g = self.parts.group_size
        self.__dict__["_state"] = state
        self.__dict__["_major"] = block_major(self.parts)
        self.__dict__["_hot"] = None
        self.__dict__["_rows"] = None
        if state.options.predictor:
            gp, up = quant_parts(mlp.gate_proj), quant_parts(mlp.up_proj)
            self.__dict__["_rows"] = (gp, row_blocks(gp, g), up, row_blocks(up, g))
        state.layers.append(self)
        self.freeze()
        self.repack()

    @property
    def extra_bytes(self) -> int:
        """Bytes of the block-major copy and the hot copy."""
        arrays = list(self.__dict__["_major"]) + list(self.__dict__["_hot"] or [])
        return sum(a.nbytes for a in arrays)

    def repack(self) -> None:
        """Rebuild the contiguous copy of this layer's hot blocks."""
        state = self.__dict__["_state"]
        hot = state.hot_sets[self.index]
        self.__dict__["_hot"] = pack_hot(self.parts, hot)
        self.__dict__["_hot_idx"] = mx.array(hot, dtype=mx.uint32) if hot else None
        mask = np.zeros(self.parts.scales.shape[1], dtype=bool)
        mask[hot] = True
        self.__dict__["_hot_mask"] = mx.array(mask)
        if hot:
            state.totals["repacked_bytes"] += sum(a.nbytes for a in self.__dict__["_hot"])

    def __call__(self, x: mx.array) -> mx.array:
        if x.size != x.shape[-1]:
            return self.down_proj(hidden(self, x))
        state: Kairox = self.__dict__["_state"]
        if self.index == 0:
            state.start_step()
        y = self.step(x.reshape(1, -1), state)
        return y.reshape(*x.shape[:-1], -1)

    def step(self, x: mx.array, state: Kairox) -> mx.array:
        """``(1, D) -> (1, out)``: one token through the hot copy and the gathered cold blocks."""
        i, g, nb = self.index, self.parts.group_size, self.parts.scales.shape[1]
        keep = min(state.keep[i], nb)
        hot_mask = self.__dict__["_hot_mask"]
        stats: Dict[str, mx.array] = {}
        cand = state.predicted.get(i) if self.__dict__["_rows"] is not None else None
        if cand is not None:
            h = self.candidate_hidden(x, cand, nb)
            if state.options.audit:
                dense = block_mass_rows(hidden(self, x).reshape(nb, g))
                need = top_mask(dense, keep)
                stats["pred_hits"] = mx.sum(need & index_mask(cand, nb))
        else:
            h = hidden(self, x).reshape(nb, g)
        mass = block_mass_rows(h)
        hot_idx = self.__dict__["_hot_idx"]
        n_hot = 0 if hot_idx is None else hot_idx.size
        cold_mass = mx.where(hot_mask, -1.0, mass)
        n_cold = max(keep - n_hot, 0)
        cold = mx.sort(mx.argpartition(-cold_mass, kth=n_cold - 1)[:n_cold]).astype(mx.uint32) if n_cold else None
        y = None
        if hot_idx is not None:
            w, s, b = self.__dict__["_hot"]
            xh = mx.take(h, hot_idx, axis=0).reshape(1, -1)
            y = mx.quantized_matmul(xh, w, s, b, transpose=True, group_size=g, bits=self.parts.bits)
        if cold is not None:
            yc = expert_down(h.reshape(1, -1), self.__dict__["_major"], self.parts, cold)
            y = yc if y is None else y + yc  # expert_down adds the bias
        elif self.parts.bias is not None:
            y = y + self.parts.bias
        active = top_mask(mass, keep)
        kept_mask = hot_mask if cold is None else (hot_mask | index_mask(cold, nb))
        total = mx.maximum(mass.sum(), 1e-30)
        stats.update(kept=mx.array(n_hot + n_cold), rows=mx.array(nb if cand is None else cand.size),
                     hot_hits=mx.sum(active & hot_mask),
                     dropped=1 - mx.sum(mx.where(kept_mask, mass, 0)) / total)
        state.record(i, stats)
        self.update_scores(state, active)
        if state.table is not None and i + 1 < len(state.keep):
            self.predict_next(state, kept_mask)
        return y

    def candidate_hidden(self, x: mx.array, cand: mx.array, nb: int) -> mx.array:
        """``(1, D) -> (nb, group)``: the hidden activation of the candidate blocks, zero elsewhere."""
        gp, grows, up, urows = self.__dict__["_rows"]
        hc = self.__dict__["_glu"](rows_product(x, grows, gp, cand), rows_product(x, urows, up, cand))
        return mx.zeros((nb, hc.shape[-1]), dtype=hc.dtype).at[cand].add(hc)

    def update_scores(self, state: Kairox, active: mx.array) -> None:
        if state.options.hot == "tam" or state.options.predictor:
            state.score[self.index] = tam_update(state.score[self.index], active, state.options.beta)
        if state.options.hot == "tam":
            state.hits[self.index] = state.hits[self.index] + active.astype(mx.int32)

    def predict_next(self, state: Kairox, kept_mask: mx.array) -> None:
        """Rank layer ``i + 1``'s blocks from this layer's kept ones; its hot blocks first."""
        j = self.index + 1
        nxt = state.layers[j]
        score = kept_mask.astype(mx.float32) @ state.table[self.index] + 0.5 * state.score[j]
        score = mx.where(nxt.__dict__["_hot_mask"], 1e9, score)
        n = state.candidates(j)
        state.predicted[j] = mx.sort(mx.argpartition(-score, kth=n - 1)[:n]).astype(mx.uint32)


def kairox_module(module: nn.Module, state: Kairox) -> nn.Module:
    """A copy of the drafter's tree whose FFNs are :class:`KairoxMLP` sharing ``state``."""
    layers = ffn_layers(module)
    tree: Dict[str, Any] = {"model": {"layers": {str(i): {"mlp": KairoxMLP(layer.mlp, i, state)}
                                                 for i, layer in enumerate(layers)}}}
    return graft(module, tree)


def build_kairox_draft(draft: DraftModel, sparsity: float, tokens: Sequence[int],
                       options: KairoxOptions, thresholds: Optional[Dict[str, Any]] = None) -> DraftModel:
    """The sparse drafter of ``draft`` at ``sparsity`` with the mechanisms of ``options``.

    Its kept blocks start where :func:`~gearbx_mlx.speculative.sparse.build_sparse_draft`
    puts them (from ``thresholds`` where given); the hot sets' prior and the
    predictor's table are measured on ``tokens``; ``kairox`` on the result is the shared :class:`Kairox` state
    (the drafter feeds it each block's acceptance, traces read it).
    """
    base = build_sparse_draft(draft, sparsity, tokens, "take", thresholds)  # the kept blocks, no layout copy
    info = dict(base.sparse)
    keep, blocks = info["kept_blocks"], info["blocks"]
    masses = layer_masses(draft.module, tokens, info["group_size"])
    masks = kept_masks(masses, keep)
    prior = [m.mean(0) for m in masks]
    table = transitions(masks) if options.predictor else None
    state = Kairox(options, keep, blocks, prior, table)
    module = kairox_module(draft.module, state)
    extra = sum(layer.mlp.extra_bytes for layer in ffn_layers(module))
    info.update(gather="experts", layout_bytes=extra, mechanisms=dataclasses.asdict(options))
    memory = dict(draft.memory)
    if memory:
        memory.update(extra_bytes=memory["extra_bytes"] + extra, resident_total=memory["resident_total"] + extra)
    return dataclasses.replace(base, module=module, memory=memory, sparse=info, kairox=state)


__all__ = ["HOT_SETS", "Kairox", "KairoxMLP", "KairoxOptions", "build_kairox_draft", "kairox_module"]
