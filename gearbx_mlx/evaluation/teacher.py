"""Teacher-forced routing of many policies over a text: quality per position.

The text is cut into windows; each window is one "generation": a fresh KV
cache, the monitor reset, the policy restarted. Within a window, step t
feeds token t through the KV cache (as in decode) and its routed
distribution predicts token t+1. Each policy is one row; every row of a
window is compared with the window's reference row.

Lag 0, as ``GearboxConfig.lag = 0`` in generation: the entropy of the row's
own step-t distribution is pushed to its monitor, and the policy's answer
governs step t+1. The first step of a window runs in the policy's initial
gear, with ``high`` as the cold-start suggestion (there is no prompt to
classify).

The reference distribution is the static-high row itself: the loaded
weights, through the same layers, so its KL is 0 and its top-1 agreement 1
by construction. Rows are run many steps per forward pass
(:mod:`.chunked`), which computes what step-by-step decoding computes.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.nn as nn

from ..config import GEARS, GearboxConfig
from .chunked import CHUNKS, COLD_START, ChunkSettings, Reference, RowForcer, Steps, Work
from .specs import GEAR_CHAR, ModelLayout, PolicySpec
from .variants import VariantModel

__all__ = ["COLD_START", "GEAR_CHAR", "RowResult", "TeacherForcing", "split_windows", "stderr_progress",
           "teacher_forced"]
#: Reference rows (log-probabilities, KV cache) kept for a second pass, at most.
REFERENCE_BUDGET_BYTES = 1 << 30


@dataclass
class RowResult:
    """Accumulated quality of one policy over all scored positions."""

    spec: PolicySpec
    steps: int = 0
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    agree: int = 0
    hits: List[bool] = field(default_factory=list)  # per step: top-1 equals the reference's
    kl: List[float] = field(default_factory=list)  # per step: KL(reference || routed), nats
    nll: List[float] = field(default_factory=list)  # per step: NLL of the text's next token, nats
    bytes_sum: float = 0.0
    shifts: int = 0
    gears: List[str] = field(default_factory=list)  # one char per step
    # Bits, float32 (entropy_bits), of this row's own distribution at each step:
    # the router's signal, and a drafter's stop signal (.speculative).
    entropy: List[float] = field(default_factory=list)
    smoothed: List[float] = field(default_factory=list)
    window_nll: List[float] = field(default_factory=list)  # NLL sum of each window

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.steps)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.steps

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.steps

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_sum / self.steps

    def gear_counts(self) -> Dict[str, int]:
        trace = "".join(self.gears)
        return {g: trace.count(GEAR_CHAR[g]) for g in GEARS}

    def window_gears(self) -> List[str]:
        """The gear trace cut into windows (one string per window)."""
        trace, n = "".join(self.gears), len(self.window_nll)
        size = len(trace) // n if n else len(trace)
        return [trace[i * size : (i + 1) * size] for i in range(n)] if n else [trace]

    @classmethod
    def of_steps(cls, spec: PolicySpec, steps: Steps, layout: ModelLayout) -> "RowResult":
        """One window's result from its per-step numbers."""
        out = cls(spec, steps=len(steps.gears))
        out.nll_sum = math.fsum(steps.nll)
        out.kl_sum = math.fsum(steps.kl)
        out.agree = sum(steps.hits)
        out.hits = list(steps.hits)
        out.kl = list(steps.kl)
        out.nll = list(steps.nll)
        out.gears = [GEAR_CHAR[g] for g in steps.gears]
        out.shifts = sum(a != b for a, b in zip(steps.gears, steps.gears[1:]))
        out.entropy = list(steps.entropy)
        out.smoothed = list(steps.smoothed)
        out.bytes_sum = layout.sequence_bytes(spec, out.gear_counts())
        return out


def split_windows(tokens: Sequence[int], window: int) -> List[List[int]]:
    """Consecutive windows of ``window`` tokens (a shorter text is one window).

    Windows run side by side in one batch, so they have one length: a tail
    shorter than ``window`` is dropped.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if len(tokens) < 2:
        raise ValueError(f"need at least 2 tokens to score one prediction, got {len(tokens)}")
    n = min(window, len(tokens))
    return [list(tokens[i : i + n]) for i in range(0, len(tokens) - n + 1, n)]


@dataclass(frozen=True)
class ForcingOptions:
    """How :class:`TeacherForcing` runs.

    Attributes:
        max_positions: most positions per forward pass (None: as many as
            :class:`~.chunked.ChunkSettings` allows for this vocabulary).
        progress: called with a status line now and then (e.g. to stderr).
        chunks: chunking settings; ``ChunkSettings(stepwise=True)`` is the
            plain one-step-per-pass loop the chunked one must equal.
        model_dir: the loaded model's folder, where the nested store's planes
            are cached (:class:`~.variants.VariantModel`); None: not cached.
    """

    max_positions: Optional[int] = None
    progress: Optional[Callable[[str], None]] = None
    chunks: ChunkSettings = CHUNKS
    model_dir: Optional[Path] = None


class TeacherForcing:
    """Teacher-forced rows over fixed windows, one pass of specs at a time.

    Use as a context manager (it installs the variant layers and restores
    the loaded ones); :meth:`run` may be called several times, and the
    reference rows are computed once when they fit in
    :data:`REFERENCE_BUDGET_BYTES`.

    Args:
        model: an mlx-lm model with its loaded (unquantized) weights.
        windows: token ids, one equal-length list per window (each window is
            a separate sequence).
        layout: managed paths and cost model of ``model``.
        config: monitor settings (window, hysteresis, duration, bits...).
        vocab_size: output vocabulary size (the monitor's ``V``).
        specs: every spec that will be run (decides the variants built).
        options: :class:`ForcingOptions` fields (``max_positions=``,
            ``progress=``, ``chunks=``).
    """

    def __init__(
        self,
        model: nn.Module,
        windows: Sequence[Sequence[int]],
        layout: ModelLayout,
        config: GearboxConfig,
        vocab_size: int,
        specs: Sequence[PolicySpec],
        **options: Any,
    ) -> None:
        o = ForcingOptions(**options)
        max_positions, progress, chunks = o.max_positions, o.progress, o.chunks
        if not windows or len({len(w) for w in windows}) != 1 or len(windows[0]) < 2:
            raise ValueError("windows must be non-empty lists of one length >= 2 (use split_windows)")
        if max_positions is not None and max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        self.model, self.windows, self.layout, self.config = model, [list(w) for w in windows], layout, config
        self.vocab_size, self.progress, self.chunks = vocab_size, progress, chunks
        self.max_positions = chunks.max_positions(vocab_size, max_positions)
        self.variants = VariantModel(model, layout.bits_per_path(specs), config.group_size, o.model_dir, progress)
        self.references: Dict[int, Reference] = {}
        self.work: Dict[str, Work] = {}

    def __enter__(self) -> "TeacherForcing":
        self.variants.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.references.clear()
        self.variants.__exit__(*exc)

    def run(self, specs: Sequence[PolicySpec], label: str = "quality") -> List[RowResult]:
        """Run every spec over every window; one merged result per spec, in order."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique, got {names}")
        if sum(s.is_reference for s in specs) != 1:
            raise ValueError("exactly one policy must be static high (the reference distribution)")
        self.variants.ensure(self.layout.bits_per_path(specs))
        forcer = RowForcer(self.model, self.variants, self.layout.paths, self.config, self.vocab_size,
                           self.max_positions, self.chunks, self.work.setdefault(label, Work()))
        tables = [{g: self.layout.keys(s, g) for g in GEARS} for s in specs]
        steps = len(self.windows[0]) - 1
        meter = _Progress(self.progress, label, steps * len(self.windows) * len(specs), len(specs), len(self.windows))
        per_window: List[List[RowResult]] = []
        for w, tokens in enumerate(self.windows):
            ref = self._reference(w, forcer)
            rows = []
            for s, spec in enumerate(specs):
                st = forcer.reference_steps(ref, spec) if spec.is_reference else forcer.row(spec, tables[s], tokens,
                                                                                             ref, w)
                rows.append(RowResult.of_steps(spec, st, self.layout))
                meter.step(steps, forcer.work)
            per_window.append(rows)
        return [_merge([per_window[w][s] for w in range(len(self.windows))]) for s in range(len(specs))]

    def _reference(self, w: int, forcer: RowForcer) -> Reference:
        ref = self.references.get(w)
        if ref is None:
            ref = forcer.reference(self.windows[w])
            # Keep it for the next pass only if every window's would fit.
            if ref.nbytes * len(self.windows) <= REFERENCE_BUDGET_BYTES:
                self.references[w] = ref
        return ref


def teacher_forced(
    model: nn.Module,
    windows: Sequence[Sequence[int]],
    specs: Sequence[PolicySpec],
    layout: ModelLayout,
    config: GearboxConfig,
    vocab_size: int,
    label: str = "quality",
    **options: Any,
) -> List[RowResult]:
    """Run every spec over every window; return one result per spec.

    One pass of :class:`TeacherForcing` (see it for the arguments and the
    :class:`ForcingOptions`); exactly one spec must be static high (the reference).
    """
    with TeacherForcing(model, windows, layout, config, vocab_size, specs, **options) as tf:
        return tf.run(specs, label)


def _merge(parts: Sequence[RowResult]) -> RowResult:
    """One spec's results over consecutive windows, in window order."""
    out = RowResult(parts[0].spec)
    for p in parts:
        out.steps += p.steps
        out.nll_sum += p.nll_sum
        out.kl_sum += p.kl_sum
        out.agree += p.agree
        out.hits += p.hits
        out.kl += p.kl
        out.nll += p.nll
        out.bytes_sum += p.bytes_sum
        out.shifts += p.shifts  # a window boundary is a new sequence, not a shift
        out.gears += p.gears
        out.entropy += p.entropy
        out.smoothed += p.smoothed
        out.window_nll.append(p.nll_sum)
    return out


class _Progress:
    """Rate and ETA lines every ~10 s (a pass takes minutes on a CPU)."""

    def __init__(self, sink: Optional[Callable[[str], None]], label: str, total: int, rows: int, windows: int) -> None:
        self.sink, self.label, self.total, self.rows, self.windows = sink, label, total, rows, windows
        self.done, self.tic, self.last = 0, time.perf_counter(), time.perf_counter()

    def step(self, steps: int, work: Work) -> None:
        self.done += steps
        now = time.perf_counter()
        if self.sink and (now - self.last > 10 or self.done == self.total):
            self.last = now
            rate = self.done / (now - self.tic)
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            self.sink(
                f"{self.label}: {self.done}/{self.total} steps ({self.rows} policies x {self.windows} windows), "
                f"{work.passes} forward passes, {rate:.0f} steps/s, eta {eta / 60:.1f} min"
            )


def stderr_progress(msg: str) -> None:
    print(f"[gearbx.evaluate] {msg}", file=sys.stderr, flush=True)
