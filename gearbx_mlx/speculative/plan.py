"""Whether speculative decoding can pay on this machine, measured before decoding.

A block of ``k`` drafts costs ``k`` draft steps and one verify of ``k + 1``
tokens and emits ``(1 - α^(k+1)) / (1 - α)`` tokens on average (i.i.d.
acceptance α), so its speed-up over the high gear alone is

    S(k) = (1 - α^(k+1)) / ((1 - α)(k c + v(k)))

with ``c`` a draft step and ``v(k)`` a verify, both in high-gear steps
(:func:`~gearbx_mlx.speculative.calibration.modeled_speedup`).

:func:`measure_start` times the three calls on the prompt (the median of a
few interleaved rounds on warm caches, on the path that will draft) and reads α
off the same prefill: the share of prompt positions where both gears'
greedy choices agree. The prompt is user text, less predictable than the
model's own continuation, so this α tends to err low, on the side of
decoding plainly; a saved draft-stop calibration
(:func:`~gearbx_mlx.speculative.calibration.calibrate_draft_stop`) measured
α on the high gear's continuations, and wins when there is one.

:func:`plan_speculative` drafts only where the best ``S(k)`` over the block
caps ``k <= max_draft`` reaches :data:`MIN_MODELED_SPEEDUP`; ``mode="force"``
drafts anyway. The plan says which draft path runs and why
(:mod:`gearbx_mlx.speculative.drafter`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .calibration import compare_logits, cost_ratios, modeled_speedup
from .draft import DraftModel
from .drafter import make_drafter

#: How a run decides: ``auto`` measures and may decode plainly; ``force`` always drafts.
MODES = ("auto", "force")
#: Draft only where the best modeled speed-up reaches this: break-even. The
#: closed form leaves out each block's fixed costs (a sync, the acceptance
#: rule, Python), which makes it optimistic, but α read off the prompt errs
#: low, which makes it pessimistic; a margin on top of both declined the
#: default model's 4-bit drafter on a busy machine where it measured faster.
MIN_MODELED_SPEEDUP = 1.0
#: Prompt positions needed to trust α measured on the prompt; below, :data:`FALLBACK_ALPHA`.
MIN_ALPHA_POSITIONS = 8
#: α assumed where neither a calibration nor the prompt gives one: a middling guess.
FALLBACK_ALPHA = 0.5
#: Prompt tokens the start measurement reads at most (its last ones).
MEASURE_TOKENS = 256
#: Rounds of timed calls (each kind's median counts), after one to warm up.
MEASURE_REPS = 5


@dataclass
class StartMeasurement:
    """Step costs and agreement of a drafter, measured on the prompt.

    Attributes:
        seconds: ``{"high", "draft", "verify"}`` median seconds of a high-gear
            step, a draft step and a verify of ``max_k + 1`` tokens.
        max_k: the block cap the verify was timed at.
        alpha_greedy, alpha_sampled: agreement of the greedy choices and
            ``sum min(p, q)`` at temperature 1, over ``positions`` prompt positions.
    """

    seconds: Dict[str, float]
    max_k: int
    alpha_greedy: float
    alpha_sampled: float
    positions: int


def measure_start(
    model: nn.Module, draft: DraftModel, ids: Sequence[int], max_k: int, reps: int = MEASURE_REPS
) -> StartMeasurement:
    """Time both gears and read their agreement on the prompt ``ids`` (its last
    :data:`MEASURE_TOKENS`).

    One prefill each (its logits give α), then ``reps`` rounds, after one to
    warm up, each timing a high-gear step, a draft step and a verify of
    ``max_k + 1`` tokens back to back on the warm caches (trimmed back after
    each call). Each kind's median over the rounds counts: on a shared
    machine, interleaving puts a slow spell on all three alike, and the
    median drops the odd stalled call.
    """
    ids = list(ids)[-MEASURE_TOKENS:]
    x = mx.array(ids)[None]
    hc, dc = make_prompt_cache(model), make_prompt_cache(draft)
    stats = compare_logits(model(x, cache=hc)[0], draft(x, cache=dc)[0])
    mx.eval([c.state for c in hc], [c.state for c in dc])
    one = mx.array(ids[-1:])[None]
    block = mx.array((ids * (max_k + 1))[-(max_k + 1):])[None]
    calls = {"high": (model, one, hc), "draft": (draft, one, dc), "verify": (model, block, hc)}
    times: Dict[str, List[float]] = {k: [] for k in calls}
    for _ in range(reps + 1):
        for kind, (m, inp, cache) in calls.items():
            tic = time.perf_counter()
            mx.eval(m(inp, cache=cache))
            times[kind].append(time.perf_counter() - tic)
            trim_prompt_cache(cache, inp.shape[1])
    s = stats.summary()
    seconds = {k: statistics.median(t[1:]) for k, t in times.items()}
    return StartMeasurement(seconds, max_k, s["alpha_greedy"], s["alpha_sampled"], stats.n)


@dataclass
class SpeculativePlan:
    """What a run decided, and from which numbers (JSON-ready with :meth:`to_dict`).

    Attributes:
        speculate: draft (True) or decode with the high gear alone.
        mode: ``auto`` or ``force``.
        drafter: ``{"path", "detail", "reason"}`` of the path that drafts
            (:meth:`~gearbx_mlx.speculative.drafter.Drafter.describe`).
        draft_cost: c, a draft step in high-gear steps.
        verify_cost: ``v[k]``, a verify of ``k + 1`` tokens in high-gear steps.
        alpha, alpha_source: the acceptance used, and where it came from.
        speedups: ``S(k)`` for k = 1..max_draft.
        best_k, best_speedup: the best of them.
        high_ms, draft_ms: the measured steps.
    """

    speculate: bool
    mode: str
    drafter: Dict[str, Optional[str]]
    draft_cost: float
    verify_cost: List[float]
    alpha: float
    alpha_source: str
    speedups: List[float]
    best_k: int
    best_speedup: float
    high_ms: float
    draft_ms: float
    threshold: float = MIN_MODELED_SPEEDUP
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def message(self) -> str:
        """One paragraph for the user: the path, the numbers, the decision."""
        d = self.drafter
        why = f"; {d['reason']}" if d.get("reason") else ""
        head = (f"drafter: {d['path']} path ({d['detail']}{why}). A draft step costs {self.draft_cost:.2f} of a "
                f"high-gear step ({self.draft_ms:.1f} vs {self.high_ms:.1f} ms); alpha {self.alpha:.2f} "
                f"({self.alpha_source}); modeled speed-up {self.best_speedup:.2f}x at best (block of {self.best_k})")
        if self.speculate:
            return head + (": drafting (forced)." if self.best_speedup < self.threshold else ": drafting.")
        return (head + f", below {self.threshold:.2f}x: decoding plainly in the high gear "
                "(--speculative force drafts anyway).")


def plan_speculative(
    model: nn.Module,
    draft: DraftModel,
    ids: Sequence[int],
    max_draft: int,
    *,
    greedy: bool = True,
    mode: str = "auto",
    calibration: Optional[Mapping[str, Any]] = None,
    measured: Optional[StartMeasurement] = None,
) -> SpeculativePlan:
    """Decide whether to draft, from the costs measured here (see the module doc).

    Args:
        ids: the prompt's token ids (timed on, and α read off, unless ``measured``).
        max_draft: the block cap of the run.
        greedy: greedy decoding (α of the greedy choices; the host path).
        mode: ``auto`` (draft only where it models at least
            :data:`MIN_MODELED_SPEEDUP`) or ``force``.
        calibration: the saved draft-stop block of this drafter
            (``alpha_greedy``, ``alpha_sampled``, ``n_samples``), if any.
        measured: a :class:`StartMeasurement` to use instead of measuring.

    Raises:
        ValueError: an unknown mode, or a block cap below 1.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if max_draft < 1:
        raise ValueError(f"max_draft must be >= 1, got {max_draft}")
    m = measured if measured is not None else measure_start(model, draft, ids, max_draft)
    c, v = cost_ratios(m.seconds, m.max_k)
    v = [v[min(k, len(v) - 1)] for k in range(max_draft + 1)]
    key = "alpha_greedy" if greedy else "alpha_sampled"
    if calibration and calibration.get(key) is not None:
        alpha = float(calibration[key])
        source = f"saved calibration, {calibration.get('n_samples', '?')} positions of the high gear's continuations"
    elif m.positions >= MIN_ALPHA_POSITIONS:
        alpha = m.alpha_greedy if greedy else m.alpha_sampled
        source = f"measured on {m.positions} prompt positions"
    else:
        alpha, source = FALLBACK_ALPHA, f"assumed: the prompt has {m.positions} positions"
    speedups = [modeled_speedup(alpha, k, c, v[k]) for k in range(1, max_draft + 1)]
    best = max(range(max_draft), key=lambda i: speedups[i])
    sampled = None if greedy else _any_sampling  # make_drafter reads only whether drafts are sampled
    return SpeculativePlan(
        speculate=mode == "force" or speedups[best] >= MIN_MODELED_SPEEDUP, mode=mode,
        drafter=make_drafter(draft, log_dist=sampled).describe(), draft_cost=c, verify_cost=v, alpha=alpha,
        alpha_source=source, speedups=speedups, best_k=best + 1, best_speedup=speedups[best],
        high_ms=1e3 * m.seconds["high"], draft_ms=1e3 * m.seconds["draft"],
    )


def _any_sampling(logits: mx.array) -> mx.array:
    return logits


__all__ = [
    "FALLBACK_ALPHA", "MEASURE_REPS", "MEASURE_TOKENS", "MIN_ALPHA_POSITIONS", "MIN_MODELED_SPEEDUP", "MODES",
    "SpeculativePlan", "StartMeasurement", "measure_start", "plan_speculative",
]
