"""Whether speculative decoding can pay on this machine, and how, measured before decoding.

A block of ``k`` drafts costs ``k`` draft steps and one verify of ``k + 1``
tokens and emits ``(1 - α^(k+1)) / (1 - α)`` tokens on average (i.i.d.
acceptance α), so fixed blocks speed the high gear up by

    S(k) = (1 - α^(k+1)) / ((1 - α)(k c + v(k)))

with ``c`` a draft step and ``v(k)`` a verify, both in high-gear steps
(:func:`~gearbx_mlx.speculative.calibration.modeled_speedup`). Gated blocks
end early after a draft whose entropy exceeds a stop: with ``p`` the share of
drafts at or below it and ``α_lo``, ``α_hi`` the acceptance on each side,
:func:`~gearbx_mlx.speculative.calibration.gated_speedup` is the same
expectation for blocks of random length.

:func:`measure_start` times, on the prompt, a high-gear step, a draft step
and a verify of ``k + 1`` tokens for every ``k`` up to the block cap (the
median of a few interleaved rounds on warm caches, on the path that will
draft), and reads the drafter's statistics off the same prefill: where its
greedy choice agrees with the high gear's, and its entropy, per prompt
position. The prompt is user text, less predictable than the model's own
continuation, so this α tends to err low, on the side of decoding plainly; a
saved draft-stop calibration
(:func:`~gearbx_mlx.speculative.calibration.calibrate_draft_stop`, run by
``--calibrate --speculative``) measured α and the gating statistics on the
high gear's continuations, and wins when there is one.

:func:`plan_speculative` models every fixed block length up to the cap and
every candidate stop (the drafter's entropy percentiles) and picks plain
decoding, fixed blocks or gated blocks: it drafts only where the best
modeled speed-up reaches :data:`MIN_MODELED_SPEEDUP` (``mode="force"``
drafts anyway), and prefers gated blocks only where they beat the best fixed
length by :data:`GATED_MARGIN`. The plan says which draft path runs, what it
chose and why (:mod:`gearbx_mlx.speculative.drafter`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .calibration import DraftStats, cost_ratios, gated_speedup, gating_table, modeled_speedup, prompt_stats
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
#: Gated blocks are chosen only where they model this much above the best
#: fixed length: their stop is picked from a few candidates on few
#: positions, so their best is the more optimistic of the two.
GATED_MARGIN = 1.02
#: ``plan_speculative(stop=CHOOSE)``: the plan picks fixed or gated blocks.
CHOOSE = "choose"
#: Prompt positions needed to trust α measured on the prompt; below, :data:`FALLBACK_ALPHA`.
MIN_ALPHA_POSITIONS = 8
#: α assumed where neither a calibration nor the prompt gives one: a middling guess.
FALLBACK_ALPHA = 0.5
#: Prompt tokens the start measurement reads at most (its last ones).
MEASURE_TOKENS = 256
#: Rounds of timed calls (each kind's median counts), after one to warm up.
#: Each round is also a speed-up of its own (its own c and v), whose spread is
#: the decision's noise: seven rounds give a lower quartile between two rounds.
MEASURE_REPS = 7
#: ``auto`` drafts only where the lower quartile of the rounds' modeled speed-ups
#: clears :data:`MIN_MODELED_SPEEDUP`: a decision within the timing noise of
#: break-even decodes plainly, so identical runs do not flip between the two.
NOISE_QUANTILE = 0.25
#: What a plan chooses.
CHOICES = ("plain", "fixed", "gated")
#: How long one decision's step costs serve the later decisions of a gearbox
#: (:class:`StepCosts`): a server's requests within it skip the timed rounds,
#: and a changed load on the machine is measured again after it.
REUSE_SECONDS = 300.0


@dataclass
class StartMeasurement:
    """Step costs and agreement of a drafter, measured on the prompt.

    Attributes:
        seconds: ``{"high", "draft", "verify"}`` median seconds of a high-gear
            step, a draft step, and (a list) a verify of ``k + 1`` tokens for
            k = 1..max_k; a single number is the verify at ``max_k`` alone.
        max_k: the block cap the verifies were timed up to.
        alpha_greedy, alpha_sampled: agreement of the greedy choices and
            ``sum min(p, q)`` at temperature 1, over ``positions`` prompt positions.
        stats: the per-position statistics (entropy, agreement) they came from.
    """

    seconds: Dict[str, Any]
    max_k: int
    alpha_greedy: float
    alpha_sampled: float
    positions: int
    stats: Optional[DraftStats] = None
    #: Each timed round's own seconds (same layout as ``seconds``), for the noise.
    rounds: List[Dict[str, Any]] = field(default_factory=list)
    #: Where the step costs were an earlier decision's (:class:`StepCosts`): its age in seconds.
    reused_age_s: Optional[float] = None


class StepCosts:
    """The step costs of a gearbox's earlier decisions, reused by its later ones.

    What a high-gear step, a draft step and the verifies cost depends on the
    model, the draft path, the block cap and the caches, not on the prompt's
    text; α does, and is read off every prompt. (The context's length matters
    little: every measurement reads at most :data:`MEASURE_TOKENS` of it, a
    long prompt's last ones, so it never timed a longer one.) A decision
    whose key (:meth:`key`) was measured within ``max_age_s`` takes those
    costs, and the noise of their rounds, and skips the timed rounds: on a
    two-core CPU they took seconds of each request with the default model.

    Args:
        max_age_s: how long a measurement serves (:data:`REUSE_SECONDS`); 0: never.
    """

    def __init__(self, max_age_s: float = REUSE_SECONDS) -> None:
        if not max_age_s >= 0:
            raise ValueError(f"max_age_s must be >= 0, got {max_age_s!r}")
        self.max_age_s = float(max_age_s)
        self._entries: Dict[Hashable, Tuple[float, StartMeasurement]] = {}

    @staticmethod
    def key(draft: Any, max_k: int, context: Hashable = None) -> Hashable:
        """What the costs depend on: the drafter's gear, width, scope, kernel and path, the block
        cap and ``context`` (the caches' kind)."""
        path = ("host" if getattr(draft, "host", None) is not None else "tree",
                None if getattr(draft, "sparse", None) is None else "sparse")
        shape = tuple(getattr(draft, a, None) for a in ("gear", "bits", "scope", "kernel"))
        return shape + path + (int(max_k), context)

    def get(self, key: Hashable) -> Optional[Tuple[float, StartMeasurement]]:
        """``(age in seconds, measurement)`` of ``key`` within ``max_age_s``, else None."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        age = time.monotonic() - hit[0]
        if age > self.max_age_s or not self.max_age_s:
            del self._entries[key]
            return None
        return age, hit[1]

    def put(self, key: Hashable, measured: StartMeasurement) -> None:
        self._entries[key] = (time.monotonic(), measured)

    def clear(self) -> None:
        """Measure afresh at the next decision."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_OWNED: "weakref.WeakKeyDictionary[Any, StepCosts]" = weakref.WeakKeyDictionary()


def step_costs_of(owner: Any) -> StepCosts:
    """The :class:`StepCosts` of ``owner`` (the pipeline passes each run's gearbox), made on first
    use and dropped with the owner: ``step_costs_of(gearbox).clear()`` makes the next decision measure."""
    costs = _OWNED.get(owner)
    if costs is None:
        costs = _OWNED[owner] = StepCosts()
    return costs


def measure_start(
    model: nn.Module, draft: DraftModel, ids: Sequence[int], max_k: int, reps: int = MEASURE_REPS,
    caches: Optional[Tuple[Callable[[], List[Any]], Callable[[], List[Any]]]] = None,
    reuse: Optional[Tuple[StepCosts, Hashable]] = None,
) -> StartMeasurement:
    """Time both gears and read their agreement on the prompt ``ids`` (its last
    :data:`MEASURE_TOKENS`).

    One prefill each (its logits give the statistics), then ``reps`` rounds,
    after one to warm up, each timing a high-gear step, a draft step and a
    verify of ``k + 1`` tokens for k = 1..max_k back to back on the warm
    caches (trimmed back after each call). Each kind's median over the rounds
    counts: on a shared machine, interleaving puts a slow spell on all of
    them alike, and the median drops the odd stalled call. ``caches``: makers of
    the high gear's and the drafter's caches as the run makes them (a quantized
    KV cache: the MLX draft path, quantized attention); None: mlx-lm's (a host
    cache for a drafter with a host step). ``reuse``: ``(StepCosts, its key)``:
    an earlier measurement of the key, where fresh, gives the step costs, and
    one made here is kept for the next.
    """
    ids = list(ids)[-MEASURE_TOKENS:]
    x = mx.array(ids)[None]
    hc, dc = (caches[0](), caches[1]()) if caches else (make_prompt_cache(model), make_prompt_cache(draft))
    stats = prompt_stats(model, draft, x, hc, dc)
    mx.eval([c.state for c in hc], [c.state for c in dc])
    s = stats.summary()
    hit = reuse[0].get(reuse[1]) if reuse is not None else None
    if hit is not None:
        age, old = hit
        return StartMeasurement(old.seconds, old.max_k, s["alpha_greedy"], s["alpha_sampled"], stats.n, stats,
                                old.rounds, reused_age_s=age)
    one = mx.array(ids[-1:])[None]
    calls = {"high": (model, one, hc), "draft": (draft, one, dc)}
    for k in range(1, max_k + 1):
        calls[f"verify{k}"] = (model, mx.array((ids * (k + 1))[-(k + 1):])[None], hc)
    times: Dict[str, List[float]] = {k: [] for k in calls}
    for _ in range(reps + 1):
        for kind, (m, inp, cache) in calls.items():
            tic = time.perf_counter()
            mx.eval(m(inp, cache=cache))
            times[kind].append(time.perf_counter() - tic)
            trim_prompt_cache(cache, inp.shape[1])
    med = {k: statistics.median(t[1:]) for k, t in times.items()}

    def layout(t: Dict[str, float]) -> Dict[str, Any]:
        return {"high": t["high"], "draft": t["draft"], "verify": [t[f"verify{k}"] for k in range(1, max_k + 1)]}

    rounds = [layout({k: t[i] for k, t in times.items()}) for i in range(1, reps + 1)]
    m = StartMeasurement(layout(med), max_k, s["alpha_greedy"], s["alpha_sampled"], stats.n, stats, rounds)
    if reuse is not None:
        reuse[0].put(reuse[1], m)
    return m


@dataclass
class SpeculativePlan:
    """What a run decided, and from which numbers (JSON-ready with :meth:`to_dict`).

    Attributes:
        speculate: draft (True) or decode with the high gear alone.
        mode: ``auto`` or ``force``.
        drafter: ``{"path", "detail", "reason"}`` of the path that drafts
            (:meth:`~gearbx_mlx.speculative.drafter.Drafter.describe`).
        draft_cost: c, a draft step in high-gear steps.
        verify_cost: ``v[k]``, a verify of ``k + 1`` tokens in high-gear steps (k = 0..cap).
        alpha, alpha_source: the acceptance used, and where it came from.
        speedups: fixed blocks' ``S(k)`` for k = 1..cap.
        best_k, best_speedup: the chosen block cap and its modeled speed-up
            (of gated blocks where ``choice == "gated"``).
        high_ms, draft_ms: the measured steps.
        choice: ``plain``, ``fixed`` or ``gated`` (what runs).
        stop_bits: the entropy stop of gated blocks, else None.
        fixed: ``{"k", "speedup"}`` of the best fixed length.
        gated: the best gated candidate (``k``, ``stop_bits``, ``percentile``,
            ``p_continue``, ``alpha_below``, ``alpha_above``, ``speedup``), or
            None where no statistics gave candidates.
        gating_source: where the gated candidates came from.
        speedup_low: the chosen speed-up at the timing noise's lower quartile.
        costs_age_s: where the step costs were an earlier decision's
            (:class:`StepCosts`), how many seconds ago they were measured; None: measured here.
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
    choice: str = "fixed"
    stop_bits: Optional[float] = None
    fixed: Dict[str, float] = field(default_factory=dict)
    gated: Optional[Dict[str, float]] = None
    gating_source: Optional[str] = None
    #: The best speed-up scaled by the rounds' lower quartile (:data:`NOISE_QUANTILE`):
    #: ``auto`` drafts only where this clears the threshold too.
    speedup_low: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    costs_age_s: Optional[float] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def chosen(self) -> str:
        """The blocks that run, in words."""
        if self.choice == "gated":
            return f"gated blocks of up to {self.best_k} drafts, ending after a draft above {self.stop_bits:.2f} bits"
        if self.choice == "fixed":
            return f"fixed blocks of {self.best_k} drafts"
        return "plain decoding in the high gear"

    def message(self) -> str:
        """One paragraph for the user: the path, the numbers, the decision."""
        d = self.drafter
        why = f"; {d['reason']}" if d.get("reason") else ""
        v = "/".join(f"{x:.2f}" for x in self.verify_cost[1:])
        earlier = "" if self.costs_age_s is None else f", as measured {self.costs_age_s:.0f} s earlier"
        head = (f"drafter: {d['path']} path ({d['detail']}{why}). A draft step costs {self.draft_cost:.2f} of a "
                f"high-gear step ({self.draft_ms:.1f} vs {self.high_ms:.1f} ms{earlier}), a verify of k+1 tokens "
                f"{v} (k = 1..{len(self.verify_cost) - 1}); alpha {self.alpha:.2f} ({self.alpha_source}). "
                f"Modeled: fixed blocks {self.fixed.get('speedup', 0.0):.2f}x at best (k={self.fixed.get('k')})")
        if self.gated is not None:
            g = self.gated
            head += f", gated {g['speedup']:.2f}x (k<={g['k']}, stop {g['stop_bits']:.2f} bits)"
        if self.speedup_low is not None:
            head += (f"; the chosen {self.best_speedup:.2f}x is {self.speedup_low:.2f}x at the timing noise's "
                     "lower quartile")
        if self.speculate:
            forced = " (forced)" if min(self.best_speedup, self.speedup_low or 1e9) < self.threshold else ""
            return head + f": drafting{forced}, {self.chosen()}."
        if self.best_speedup >= self.threshold:
            return (head + f"; within the timing noise of {self.threshold:.2f}x: decoding plainly in the high gear "
                    "(--speculative force drafts anyway).")
        return (head + f"; below {self.threshold:.2f}x: decoding plainly in the high gear "
                "(--speculative force drafts anyway).")


def _gate_at(stats: DraftStats, stop: float, greedy: bool) -> Optional[Dict[str, float]]:
    """The gating statistics of one given stop (None where a side is empty)."""
    accept = [float(a) for a in stats.agree] if greedy else list(stats.accept_prob)
    below = [a for h, a in zip(stats.draft_entropy, accept) if h <= stop]
    above = [a for h, a in zip(stats.draft_entropy, accept) if h > stop]
    if not below or not above:
        return None
    return {"percentile": None, "stop_bits": stop, "p_continue": len(below) / len(accept),
            "alpha_below": sum(below) / len(below), "alpha_above": sum(above) / len(above)}


@dataclass(frozen=True)
class PlanOptions:
    """How :func:`plan_speculative` decides (every default in one place).

    Attributes:
        greedy: greedy decoding (α of the greedy choices; the host path).
        mode: ``auto`` (draft only where it models at least
            :data:`MIN_MODELED_SPEEDUP`) or ``force``.
        calibration: the saved draft-stop block of this drafter
            (``alpha_greedy``, ``alpha_sampled``, ``n_samples``, ``gating``), if any.
        measured: a :class:`StartMeasurement` to use instead of measuring.
        stop: :data:`CHOOSE` (the plan picks fixed or gated blocks), None
            (fixed blocks only), or bits (gated blocks at this stop only).
        exact_k: model only ``max_draft`` itself, not the shorter lengths.
        caches: makers of the run's high-gear and draft caches (:func:`measure_start`).
        step_costs: earlier decisions' step costs to reuse where fresh, and to keep this
            one's in (:class:`StepCosts`); None: measure every time, keep nothing.
        costs_context: what else the costs depend on (the KV caches' kind), part of the key.
    """

    greedy: bool = True
    mode: str = "auto"
    calibration: Optional[Mapping[str, Any]] = None
    measured: Optional[StartMeasurement] = None
    stop: Union[str, float, None] = CHOOSE
    exact_k: bool = False
    caches: Optional[Tuple[Callable[[], List[Any]], Callable[[], List[Any]]]] = None
    step_costs: Optional[StepCosts] = None
    costs_context: Hashable = None


def plan_speculative(
    model: nn.Module,
    draft: DraftModel,
    ids: Sequence[int],
    max_draft: int,
    **options: Any,
) -> SpeculativePlan:
    """Decide between plain decoding, fixed blocks and gated blocks from the costs measured here.

    Args:
        ids: the prompt's token ids (timed on, and α read off, unless ``measured``).
        max_draft: the block cap of the run: lengths 1..max_draft are modeled.
        options: :class:`PlanOptions` fields (``greedy=``, ``mode=``,
            ``calibration=``, ``measured=``, ``stop=``, ``exact_k=``), or
            ``options=PlanOptions(...)``.

    Raises:
        ValueError: an unknown mode, a block cap below 1, or a negative stop.
        TypeError: an unknown option.
    """
    o = dataclasses.replace(options.pop("options", None) or PlanOptions(), **options)
    greedy, mode, calibration, measured, stop, exact_k = o.greedy, o.mode, o.calibration, o.measured, o.stop, o.exact_k
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if max_draft < 1:
        raise ValueError(f"max_draft must be >= 1, got {max_draft}")
    if stop != CHOOSE and stop is not None and not (isinstance(stop, (int, float)) and stop >= 0):
        raise ValueError(f"stop must be {CHOOSE!r}, None or bits >= 0, got {stop!r}")
    reuse = None
    if o.step_costs is not None:
        reuse = (o.step_costs, StepCosts.key(draft, max_draft, o.costs_context))
    m = measured if measured is not None else measure_start(model, draft, ids, max_draft, caches=o.caches,
                                                            reuse=reuse)
    c, v = cost_ratios(m.seconds, m.max_k)
    v = [v[min(k, len(v) - 1)] for k in range(max_draft + 1)]
    key = "alpha_greedy" if greedy else "alpha_sampled"
    saved = calibration.get("gating", {}).get("greedy" if greedy else "sampled") if calibration else None
    if calibration and calibration.get(key) is not None:
        alpha = float(calibration[key])
        source = f"saved calibration, {calibration.get('n_samples', '?')} positions of the high gear's continuations"
    elif m.positions >= MIN_ALPHA_POSITIONS:
        alpha = m.alpha_greedy if greedy else m.alpha_sampled
        source = f"measured on {m.positions} prompt positions"
    else:
        alpha, source = FALLBACK_ALPHA, f"assumed: the prompt has {m.positions} positions"
    ks = [max_draft] if exact_k else list(range(1, max_draft + 1))
    speedups = [modeled_speedup(alpha, k, c, v[k]) for k in range(1, max_draft + 1)]
    best_fixed = max(ks, key=lambda k: (round(speedups[k - 1], 9), -k))
    fixed = {"k": best_fixed, "speedup": speedups[best_fixed - 1]}

    gated, gating_source = _gated_candidate(m, stop, greedy, saved, ks, (c, v), alpha, fixed)
    if stop is None or gated is None:
        choice, best = "fixed", fixed
    elif stop != CHOOSE or gated["speedup"] > GATED_MARGIN * fixed["speedup"]:
        choice, best = "gated", gated
    else:
        choice, best = "fixed", fixed
    low = _noise_floor(m, alpha, ks, fixed["speedup"]) * best["speedup"]
    speculate = mode == "force" or (best["speedup"] >= MIN_MODELED_SPEEDUP and low >= MIN_MODELED_SPEEDUP)
    sampled = None if greedy else _any_sampling  # make_drafter reads only whether drafts are sampled
    return SpeculativePlan(
        speculate=speculate, mode=mode, draft_cost=c,
        drafter=make_drafter(draft, o.caches[1]() if o.caches else None, log_dist=sampled).describe(),
        verify_cost=v, alpha=alpha, alpha_source=source, speedups=speedups, best_k=int(best["k"]),
        best_speedup=float(best["speedup"]), high_ms=1e3 * m.seconds["high"], draft_ms=1e3 * m.seconds["draft"],
        choice=choice if speculate else "plain", stop_bits=float(best["stop_bits"]) if choice == "gated" else None,
        fixed=fixed, gated=gated, gating_source=gating_source, speedup_low=float(low),
        costs_age_s=m.reused_age_s,
    )


def _gated_candidate(m: StartMeasurement, stop: Union[str, float, None], greedy: bool,
                     saved: Optional[List[Dict[str, float]]], ks: Sequence[int], costs: Tuple[float, List[float]],
                     alpha: float, fixed: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """The best gated-block candidate (the calibration's table, else the prompt's
    statistics, or the stop asked for) and where it came from; None where there is none.
    ``costs``: ``(c, v)``, the draft step and the verifies in high-gear steps."""
    c, v = costs
    stats = m.stats if m.stats is not None and m.positions >= MIN_ALPHA_POSITIONS else None
    if stop == CHOOSE or stop is None:
        table = saved if saved else (gating_table(stats, greedy) if stats is not None else [])
        gating_source = ("saved calibration" if saved else "prompt positions" if stats is not None else None)
    else:
        at = _gate_at(stats, float(stop), greedy) if stats is not None else None
        table = [at] if at else []
        gating_source = f"the stop asked for, on {'prompt positions' if at else 'no statistics'}"
    gated = None
    if stop is not None and table:
        cands = [{**g, "k": k, "speedup": gated_speedup(k, c, v, g["p_continue"], g["alpha_below"],
                                                          g["alpha_above"])} for g in table for k in ks]
        gated = max(cands, key=lambda g: (round(g["speedup"], 9), -g["k"]))
    if stop not in (CHOOSE, None) and gated is None:
        # A stop asked for without statistics to model it: model its blocks as fixed ones (p = 1).
        gated = {"percentile": None, "stop_bits": float(stop), "p_continue": 1.0, "alpha_below": alpha,
                 "alpha_above": alpha, "k": fixed["k"], "speedup": fixed["speedup"]}
    return gated, gating_source


def _noise_floor(m: StartMeasurement, alpha: float, ks: Sequence[int], median_fixed: float) -> float:
    """The :data:`NOISE_QUANTILE` of the rounds' best fixed speed-ups, relative to the median's (1.0
    without rounds): how much lower the modeled speed-up may really be."""
    if not m.rounds or median_fixed <= 0:
        return 1.0
    per_round = []
    for r in m.rounds:
        c, v = cost_ratios(r, m.max_k)
        per_round.append(max(modeled_speedup(alpha, k, c, v[min(k, len(v) - 1)]) for k in ks))
    per_round.sort()
    q = per_round[min(int(NOISE_QUANTILE * len(per_round)), len(per_round) - 1)]
    return min(q / median_fixed, 1.0)


def _any_sampling(logits: mx.array) -> mx.array:
    return logits


__all__ = [
    "CHOICES", "CHOOSE", "FALLBACK_ALPHA", "GATED_MARGIN", "MEASURE_REPS", "MEASURE_TOKENS", "MIN_ALPHA_POSITIONS",
    "MIN_MODELED_SPEEDUP", "MODES", "REUSE_SECONDS", "SpeculativePlan", "StartMeasurement", "StepCosts",
    "measure_start", "plan_speculative", "step_costs_of",
]
