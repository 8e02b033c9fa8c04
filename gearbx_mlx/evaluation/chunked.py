"""One policy row over one window, many decode steps per forward pass.

Teacher forcing fixes the tokens, so only the gears make a row sequential:
the gear of step t+1 depends on the entropy of step t (lag 0). One forward
pass over L positions, each position through its own gear's weights
(:mod:`.variants`), computes exactly what L decode steps compute: a
position's keys and values come from its own gear, and attention only looks
back. So:

* a row whose gears do not depend on entropy (static, position rule, a
  replayed sequence) runs a window in passes as long as allowed
  (:class:`ChunkSettings`: 256 positions on the default model);
* an entropy row runs in chunks: the chunk's gears are guessed by replaying
  the policy on predicted entropies (the row's own from an earlier chunk
  where known, else the reference's), the chunk is run, and the policy,
  replayed on the entropies the chunk produced, confirms the guess up to the
  first step it would have routed differently. Those steps are kept, the KV
  cache is trimmed back to them, and the next chunk starts at the first
  unconfirmed step, whose gear is now known. A wrong guess costs only the
  discarded positions; every kept step is what step-by-step decoding
  computes (up to float rounding of the batched products).

A row that is in the loaded weights (every managed layer in its high gear)
up to step k equals the reference up to step k: those steps are copied from
the reference (the static-high row) with its KV cache, not recomputed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..config import GearboxConfig
from ..entropy import EntropyMonitor
from . import metrics
from .specs import PolicySpec
from .variants import ORIGINAL, VariantModel

#: Cold-start suggestion for the first step of a window (no prompt to classify).
COLD_START = "high"


@dataclass(frozen=True)
class ChunkSettings:
    """How many positions one forward pass runs.

    Attributes:
        logits_budget: most logits one pass may hold (positions x vocabulary):
            2**25 float32 logits are 128 MiB, and the log-probabilities and
            KL terms of a chunk take a few times that.
        max_chunk: most positions per pass in any case: attention over a
            long chunk costs more per position than over the cache (measured
            on the default model: 511 positions in two passes of 256 take 8%
            less CPU than in one).
        first_guess: positions of an entropy row's first chunk after the
            reference prefix.
        growth: after a chunk confirmed in full, the next is ``growth``
            times longer; after a wrong guess, ``growth`` times the steps kept.
        min_guess: the smallest chunk after a wrong guess.
        stepwise: one step per pass and no reference prefix: the plain
            decode loop, the reference the chunked one is tested against.
        metrics: ``numpy`` or ``mlx`` (:mod:`.metrics`; mlx is its reference).

    The guess settings come from replaying the six default entropy rows of a
    512-token window of the default model: guesses fail about once in 50-80
    steps, and a pass in three gears costs as much as ~40 more positions
    (it reads every variant's weights once), so long chunks with some
    positions run twice beat short ones; these settings were within 1% of
    the best tried.
    """

    logits_budget: int = 1 << 25
    max_chunk: int = 256
    first_guess: int = 64
    growth: int = 3
    min_guess: int = 32
    stepwise: bool = False
    metrics: str = "numpy"

    def max_positions(self, vocab_size: int, cap: Optional[int] = None) -> int:
        """Positions per pass for this vocabulary (``cap``: a smaller limit asked for)."""
        n = min(self.max_chunk, max(1, self.logits_budget // max(vocab_size, 1)))
        return max(1, min(n, cap)) if cap else n


CHUNKS = ChunkSettings()


@dataclass
class Reference:
    """The static-high row of one window: what every other row is compared with.

    Attributes:
        rows: its log-probabilities, probabilities and top-1 token per step.
        nll, entropy: per step (nats; bits, as :mod:`.metrics` computes them).
        cache: the KV cache after the S inputs (a row's prefix in the high
            gear is a slice of it).
    """

    rows: metrics.ReferenceRows
    nll: List[float]
    entropy: List[float]
    cache: List[Any]

    @property
    def nbytes(self) -> int:
        # mlx-lm's own count: a quantized cache keeps (codes, scales, biases) tuples.
        kv = sum(int(c.nbytes) for c in self.cache if getattr(c, "keys", None) is not None)
        return self.rows.nbytes + kv


@dataclass
class Steps:
    """Per-step numbers of one row over one window (lists of one length)."""

    gears: List[str] = field(default_factory=list)
    nll: List[float] = field(default_factory=list)
    kl: List[float] = field(default_factory=list)
    hits: List[bool] = field(default_factory=list)
    entropy: List[float] = field(default_factory=list)
    smoothed: List[float] = field(default_factory=list)


@dataclass
class Work:
    """What the passes cost: forward passes, positions run, kept, copied from the reference."""

    passes: int = 0
    positions_run: int = 0
    positions_kept: int = 0
    positions_copied: int = 0

    def to_dict(self) -> Dict[str, int]:
        return dict(self.__dict__)


@dataclass
class RowForcer:
    """Runs the reference and the policy rows of windows through installed variant layers.

    Attributes:
        model: the mlx-lm model, with ``vm``'s variant layers installed.
        vm: the variant layers (they hold every gear the rows use).
        paths: the managed paths, in the order of the variant-key tables.
        config: monitor settings; vocab_size: the monitor's ``V``.
        max_positions: most positions per forward pass.
        chunks: chunking and metrics settings.
        work: what the passes cost (accumulates).
    """

    model: nn.Module
    vm: VariantModel
    paths: Sequence[str]
    config: GearboxConfig
    vocab_size: int
    max_positions: int
    chunks: ChunkSettings = CHUNKS
    work: Work = field(default_factory=Work)

    def reference(self, tokens: Sequence[int]) -> Reference:
        """Run the loaded weights over a window (``S = len(tokens) - 1`` scored steps)."""
        steps = len(tokens) - 1
        cache = make_prompt_cache(self.model)
        parts, nll, ent = [], [], []
        for start in range(0, steps, self.max_positions):
            n = min(self.max_positions, steps - start)
            self.vm.set_keys({p: (ORIGINAL,) for p in self.paths})
            logits = self.model(mx.array([tokens[start : start + n]], dtype=mx.uint32), cache=cache)[0]
            rows, nl, h = metrics.reference(logits, tokens[start + 1 : start + n + 1], self.chunks.metrics)
            parts.append(rows)
            nll += nl
            ent += h
            self.work.passes += 1
            self.work.positions_run += n
        self.work.positions_kept += steps
        return Reference(metrics.ReferenceRows.concatenate(parts), nll, ent, cache)

    def reference_steps(self, ref: Reference, spec: PolicySpec) -> Steps:
        """The reference row's own steps (KL 0 and top-1 agreement 1 by construction)."""
        monitor = EntropyMonitor(self.vocab_size, self.config, thresholds=spec.thresholds)
        monitor.reset(COLD_START)
        out = Steps()
        for t in range(len(ref.nll)):
            _record(out, "high", ref.nll[t], 0.0, True, monitor.push(ref.entropy[t]))
        return out

    def row(
        self, spec: PolicySpec, tables: Dict[str, Tuple[int, ...]], tokens: Sequence[int], ref: Reference,
        stream: int,
    ) -> Steps:
        """Route ``spec`` over one window, teacher-forced; see the module docstring.

        Args:
            tables: variant keys over :attr:`paths` of each gear of ``spec``.
            tokens: the window (``S + 1`` ids; step t feeds token t, predicts t+1).
            ref: the window's reference row.
            stream: the window index (a random policy's stream, a replayed sequence).
        """
        steps, chunks = len(tokens) - 1, self.chunks
        policy = spec.make_policy(stream=stream)
        monitor = EntropyMonitor(self.vocab_size, self.config, thresholds=spec.thresholds)
        monitor.reset(COLD_START)
        gear = policy.initial(COLD_START)  # certain: nothing has been seen yet
        out = Steps()
        acc = 0

        # Steps in the loaded weights from the start are the reference's steps.
        prefix_ok = _can_slice(ref.cache) and not chunks.stepwise
        while prefix_ok and acc < steps and all(k == ORIGINAL for k in tables[gear]):
            seen = monitor.push(ref.entropy[acc])
            _record(out, gear, ref.nll[acc], 0.0, True, seen)
            gear = policy.next_gear(acc, seen)
            acc += 1
        copied = acc
        self.work.positions_copied += copied
        if acc == steps:
            return out
        cache = _prefix_cache(self.model, ref.cache, acc)
        trimmable = can_trim_prompt_cache(cache)
        # Predicted entropy of every step: the reference's until the row's own is known.
        predicted = list(ref.entropy)
        horizon = chunks.first_guess if spec.reacts else steps
        if not trimmable or chunks.stepwise:
            horizon = 1  # nothing can be taken back: run only the step whose gear is certain

        while acc < steps:
            n = max(1, min(horizon, self.max_positions, steps - acc))
            guess = _guess(policy, monitor, gear, acc, n, predicted)
            stats = self._chunk(tables, guess, tokens, acc, ref, cache)
            kept = n
            for i in range(n):
                seen = monitor.push(stats["entropy"][i])
                _record(out, guess[i], stats["nll"][i], stats["kl"][i], stats["hits"][i], seen)
                gear = policy.next_gear(acc + i, seen)
                if i + 1 < n and gear != guess[i + 1]:
                    kept = i + 1
                    break
            predicted[acc : acc + n] = stats["entropy"]
            if kept < n:
                trim_prompt_cache(cache, n - kept)
                horizon = max(chunks.min_guess, chunks.growth * kept)  # (a 1-step pass never misses)
            elif spec.reacts and horizon > 1:
                horizon = chunks.growth * n
            acc += kept
        self.work.positions_kept += steps - copied
        return out

    def _chunk(
        self, tables: Dict[str, Tuple[int, ...]], gears: Sequence[str], tokens: Sequence[int], start: int,
        ref: Reference, cache: List[Any],
    ) -> Dict[str, list]:
        """Steps ``start .. start+len(gears)-1`` through the cache, each in its gear."""
        n = len(gears)
        if len(set(gears)) == 1:
            keys = {p: (k,) for p, k in zip(self.paths, tables[gears[0]])}  # one key per path: the fast path
        else:
            keys = dict(zip(self.paths, zip(*(tables[g] for g in gears))))
        self.vm.set_keys(keys)
        logits = self.model(mx.array([tokens[start : start + n]], dtype=mx.uint32), cache=cache)[0]
        self.work.passes += 1
        self.work.positions_run += n
        return metrics.routed(logits, tokens[start + 1 : start + n + 1], ref.rows.rows(start, start + n),
                              self.chunks.metrics)


def _guess(policy: Any, monitor: EntropyMonitor, gear: str, start: int, n: int, predicted: List[float]) -> List[str]:
    """Gears of steps ``start .. start+n-1``: the first is certain, the rest replayed on predictions."""
    guess = [gear]
    if n > 1:
        p, m = copy.deepcopy(policy), copy.deepcopy(monitor)
        for i in range(n - 1):
            guess.append(p.next_gear(start + i, m.push(predicted[start + i])))
    return guess


def _record(out: Steps, gear: str, nll: float, kl: float, hit: bool, seen: Any) -> None:
    out.gears.append(gear)
    out.nll.append(nll)
    out.kl.append(kl)
    out.hits.append(bool(hit))
    out.entropy.append(seen.entropy)
    out.smoothed.append(seen.smoothed)


def _can_slice(cache: Sequence[Any]) -> bool:
    """Only mlx-lm's plain KVCache is sliced for a prefix (rotating or quantized caches are not)."""
    return bool(cache) and all(type(c) is KVCache and c.keys is not None for c in cache)


def _prefix_cache(model: nn.Module, ref_cache: Sequence[Any], n: int) -> List[Any]:
    """A fresh cache holding the reference's first ``n`` positions."""
    cache = make_prompt_cache(model)
    if n:
        if not all(type(c) is KVCache for c in cache):
            raise ValueError("a reference prefix needs mlx-lm KVCache layers")
        for c, r in zip(cache, ref_cache):
            # Slices are new arrays: the row's later writes never reach the reference.
            c.keys, c.values, c.offset = r.keys[..., :n, :], r.values[..., :n, :], n
    return cache
