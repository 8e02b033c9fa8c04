"""Teacher-forced routing of many policies in one batched pass.

The text is cut into windows; each window is one "generation": a fresh KV
cache, the monitor reset, the policy restarted. Within a window, token t is
fed alone through mlx-lm's KV cache (as in decode). Every (window, policy)
pair is one row of the batch: the rows of a window are fed the same token,
and each row has its own gear in every managed layer (:mod:`.variants`).
The routed distribution of step t predicts token t+1.

Lag 0, as ``GearboxConfig.lag = 0`` in generation: the entropy of the row's
own step-t distribution is pushed to its monitor, and the policy's answer
governs step t+1. The first step of a window runs in the policy's initial
gear, with ``high`` as the cold-start suggestion (there is no prompt to
classify).

The reference distribution is the static-high row itself: the loaded
weights, in the same batched computation, so its KL is 0 and its top-1
agreement 1 by construction, and every other row is compared with exactly
the numbers it would be compared with alone.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..config import GEARS, GearboxConfig
from ..entropy import EntropyMonitor, entropy_bits
from .specs import ModelLayout, PolicySpec
from .variants import VariantModel

#: One character per gear in the stored gear traces.
GEAR_CHAR = {"low": "l", "mid": "m", "high": "h"}
#: Cold-start suggestion for the first step of a window (no prompt to classify).
COLD_START = "high"


@dataclass
class RowResult:
    """Accumulated quality of one policy over all scored positions."""

    spec: PolicySpec
    steps: int = 0
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    agree: int = 0
    hits: List[bool] = field(default_factory=list)  # per step: top-1 equals the reference's
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


def teacher_forced(
    model: nn.Module,
    windows: Sequence[Sequence[int]],
    specs: Sequence[PolicySpec],
    layout: ModelLayout,
    config: GearboxConfig,
    vocab_size: int,
    progress: Optional[Callable[[str], None]] = None,
    label: str = "quality",
    max_rows: int = 128,
) -> List[RowResult]:
    """Run every spec over every window; return one result per spec.

    The batch holds ``windows x specs`` rows (row ``w * len(specs) + s``), in
    chunks of at most ``max_rows`` rows: a larger batch amortizes each weight
    read over more rows, which is what makes this affordable on a CPU.

    Args:
        model: an mlx-lm model with its loaded (unquantized) weights.
        windows: token ids, one equal-length list per window (each window is
            a separate sequence).
        specs: the policies; exactly one must be static high (the reference).
        layout: managed paths and cost model of ``model``.
        config: monitor settings (window, hysteresis, duration, bits...).
        vocab_size: output vocabulary size (the monitor's ``V``).
        progress: called with a status line now and then (e.g. to stderr).
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"policy names must be unique, got {names}")
    refs = [i for i, s in enumerate(specs) if s.is_reference]
    if len(refs) != 1:
        raise ValueError("exactly one policy must be static high (the reference distribution)")
    if not windows or len({len(w) for w in windows}) != 1 or len(windows[0]) < 2:
        raise ValueError("windows must be non-empty lists of one length >= 2 (use split_windows)")
    n_specs = len(specs)
    per_batch = max(1, max_rows // n_specs)
    chunks = [list(range(i, min(i + per_batch, len(windows)))) for i in range(0, len(windows), per_batch)]
    # Variant keys and modeled bytes of each (spec, gear), computed once.
    tables = [{g: layout.keys(s, g) for g in GEARS} for s in specs]
    cost = [{g: layout.bytes_per_token(s, g) for g in GEARS} for s in specs]
    # per_window[w][s]: spec s on window w, merged in window order at the end.
    per_window: Dict[int, List[RowResult]] = {}
    steps = len(windows[0]) - 1
    meter = _Progress(progress, label, steps * len(chunks), n_specs * len(windows))

    with VariantModel(model, layout.bits_per_path(specs), config.group_size) as vm:
        for chunk in chunks:
            rows = [(w, s) for w in chunk for s in range(n_specs)]
            n_rows = len(rows)
            results = [RowResult(specs[s]) for _, s in rows]
            policies = [specs[s].make_policy(stream=w) for w, s in rows]
            monitors = [EntropyMonitor(vocab_size, config, thresholds=specs[s].thresholds) for _, s in rows]
            ref_rows = mx.array([ci * n_specs + refs[0] for ci, _ in enumerate(chunk) for _ in range(n_specs)])
            gears, prev = [], [None] * n_rows
            for r in range(n_rows):
                monitors[r].reset(COLD_START)
                gears.append(policies[r].initial(COLD_START))
            cache = make_prompt_cache(model)
            for t in range(steps):
                columns = [tables[s][gears[r]] for r, (_, s) in enumerate(rows)]
                vm.set_keys(dict(zip(layout.paths, zip(*columns))))
                inputs = mx.array([[windows[w][t]] for w, _ in rows], dtype=mx.uint32)
                targets = mx.array([[windows[w][t + 1]] for w, _ in rows], dtype=mx.uint32)
                logits = model(inputs, cache=cache)[:, -1, :]
                logp = logits.astype(mx.float32)
                logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
                ref_lp = mx.take(logp, ref_rows, axis=0)
                nll = -mx.take_along_axis(logp, targets, axis=-1)[:, 0]
                # KL(reference || routed) in nats; exactly 0 on the reference row.
                kl = mx.sum(mx.exp(ref_lp) * (ref_lp - logp), axis=-1)
                top = mx.argmax(logp, axis=-1)
                agree = top == mx.take(top, ref_rows)
                ent = entropy_bits(logits)
                mx.eval(nll, kl, agree, ent)
                nll_l, kl_l, agree_l, ent_l = nll.tolist(), kl.tolist(), agree.tolist(), ent.tolist()
                for r in range(n_rows):
                    res, g = results[r], gears[r]
                    res.steps += 1
                    res.nll_sum += nll_l[r]
                    res.kl_sum += kl_l[r]
                    res.agree += int(agree_l[r])
                    res.hits.append(bool(agree_l[r]))
                    res.bytes_sum += cost[rows[r][1]][g]
                    res.gears.append(GEAR_CHAR[g])
                    if prev[r] is not None and prev[r] != g:
                        res.shifts += 1
                    prev[r] = g
                    seen = monitors[r].push(ent_l[r])
                    res.entropy.append(seen.entropy)
                    res.smoothed.append(seen.smoothed)
                    # Lag 0: step t's entropy decides step t+1's gear.
                    gears[r] = policies[r].next_gear(t, seen)
                meter.step()
            for ci, w in enumerate(chunk):
                per_window[w] = results[ci * n_specs : (ci + 1) * n_specs]
            del cache
    return [_merge([per_window[w][s] for w in range(len(windows))]) for s in range(n_specs)]


def _merge(parts: Sequence[RowResult]) -> RowResult:
    """One spec's results over consecutive windows, in window order."""
    out = RowResult(parts[0].spec)
    for p in parts:
        out.steps += p.steps
        out.nll_sum += p.nll_sum
        out.kl_sum += p.kl_sum
        out.agree += p.agree
        out.hits += p.hits
        out.bytes_sum += p.bytes_sum
        out.shifts += p.shifts  # a window boundary is a new sequence, not a shift
        out.gears += p.gears
        out.entropy += p.entropy
        out.smoothed += p.smoothed
        out.window_nll.append(p.nll_sum)
    return out


class _Progress:
    """Rate and ETA lines every ~10 s (the quality pass takes minutes)."""

    def __init__(self, sink: Optional[Callable[[str], None]], label: str, total: int, rows: int) -> None:
        self.sink, self.label, self.total, self.rows = sink, label, total, rows
        self.done, self.tic, self.last = 0, time.perf_counter(), 0.0

    def step(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.sink and (now - self.last > 10 or self.done == self.total):
            self.last = now
            rate = self.done / (now - self.tic)
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            self.sink(
                f"{self.label}: step {self.done}/{self.total} ({self.rows} rows = windows x policies), "
                f"{rate:.2f} steps/s, eta {eta / 60:.1f} min"
            )


def stderr_progress(msg: str) -> None:
    print(f"[gearbx.evaluate] {msg}", file=sys.stderr, flush=True)
