"""Measuring a drafter against the high gear, and calibrating where it stops drafting.

Teacher-forced over a text, both gears score every position: the drafter's
entropy (float32, :func:`~gearbx_mlx.entropy.entropy_bits`), whether its
greedy choice agrees with the high gear's, and its acceptance probability
under speculative sampling (``sum min(p, q)``). From those: the acceptance
rate α, the AUC of entropy as a predictor of rejection, and a replay of
greedy speculative decoding (:func:`replay_speedup`).

The replay is exact for greedy decoding of a high-gear continuation: every
accepted draft is the high gear's own token, so each draft up to the first
rejection sees exactly the teacher-forced context. That is what
:func:`calibrate_draft_stop` maximizes: on the high gear's continuations of
the calibration prompts, it picks the block cap and the draft-entropy stop
(from the §4.1 percentile grid of the drafter's own entropies, or none) with
the best replayed speed-up at the draft and verify costs measured on this
machine. ``median`` and ``percentile`` give the §4 thresholds themselves.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from ..calibration import median_thresholds, percentile_thresholds
from ..chat import encode_chat
from ..config import CALIBRATION_PROMPTS
from ..entropy import entropy_bits
from ..gearbox import vocab_size_of
from .draft import PREFILL_ROWS, DraftModel, prefill_rows

#: Strategies of :func:`calibrate_draft_stop`.
STOP_STRATEGIES = ("replay", "median", "percentile")
#: Percentiles of draft entropy tried as stops by the replay strategy.
REPLAY_PERCENTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: Block caps tried by the replay strategy.
REPLAY_MAX_DRAFT = (*range(1, 7), 8)
#: Key of the speculative block in ``Calibration.extra`` (one entry per draft gear).
CALIBRATION_KEY = "speculative"
#: Tokens the high gear generates per calibration prompt (more than the
#: router's 24: the replay needs runs of consecutive positions).
CALIBRATION_TOKENS = 48


@dataclass
class DraftStats:
    """Per-position statistics of a drafter against the high gear.

    Each list has one entry per scored position (a position predicts the
    next token of the text).
    """

    draft_entropy: List[float] = field(default_factory=list)  # bits
    high_entropy: List[float] = field(default_factory=list)  # bits
    agree: List[bool] = field(default_factory=list)  # greedy draft == greedy high
    accept_prob: List[float] = field(default_factory=list)  # sum min(p, q) at temp 1

    def extend(self, other: "DraftStats") -> None:
        for name in ("draft_entropy", "high_entropy", "agree", "accept_prob"):
            getattr(self, name).extend(getattr(other, name))

    @property
    def n(self) -> int:
        return len(self.agree)

    def summary(self) -> Dict[str, float]:
        """α (greedy and sampled), AUCs of entropy predicting rejection."""
        n = max(self.n, 1)
        rejected = [not a for a in self.agree]
        return {
            "positions": self.n,
            "alpha_greedy": sum(self.agree) / n,
            "alpha_sampled": sum(self.accept_prob) / n,
            "auc_draft_entropy": auc(self.draft_entropy, rejected),
            "auc_high_entropy": auc(self.high_entropy, rejected),
        }


#: Positions compared at once by :func:`compare_logits`: the statistics hold about ten
#: ``(rows, V)`` float32 temporaries, 290 MB for a 39-token prompt of a 151,936-token
#: vocabulary when compared whole.
COMPARE_ROWS = 8


def compare_logits(high_logits: mx.array, draft_logits: mx.array) -> DraftStats:
    """Statistics of ``(L, V)`` draft logits against the high gear's at the same positions
    (row by row, so the same values whatever :data:`COMPARE_ROWS` is)."""
    out = DraftStats()
    for start in range(0, high_logits.shape[0], COMPARE_ROWS):
        hl = high_logits[start : start + COMPARE_ROWS].astype(mx.float32)
        dl = draft_logits[start : start + COMPARE_ROWS].astype(mx.float32)
        hp, dp = mx.softmax(hl, axis=-1), mx.softmax(dl, axis=-1)
        stats = [
            entropy_bits(dl),
            entropy_bits(hl),
            mx.argmax(dl, axis=-1) == mx.argmax(hl, axis=-1),
            mx.minimum(hp, dp).sum(axis=-1),
        ]
        mx.eval(stats)
        out.extend(DraftStats(*[s.tolist() for s in stats]))
    return out


def prompt_stats(model: nn.Module, draft: DraftModel, inputs: mx.array, high_cache: List[Any],
                 draft_cache: List[Any]) -> DraftStats:
    """:func:`compare_logits` of both gears over the prompt ``inputs`` ``(1, T)``, which fills
    both caches, a few positions at a time (:func:`~gearbx_mlx.speculative.draft.prefill_rows`):
    the same statistics as of the whole ``(T, V)`` logits up to float32 rounding, without holding them."""
    high, low = prefill_rows(model, inputs, high_cache), prefill_rows(draft, inputs, draft_cache)
    out = DraftStats()
    for start in range(0, inputs.shape[1], PREFILL_ROWS):
        out.extend(compare_logits(high(start), low(start)))
    return out


def draft_stats(
    model: nn.Module, draft: DraftModel, tokens: Sequence[int], window: int = 256
) -> DraftStats:
    """Teacher-force ``tokens`` through both models, window by window.

    Args:
        tokens: token ids of a text; cut into windows of ``window`` tokens,
            each a fresh context (no cache carried across windows). Every
            position counts, the last of a window too: the statistics compare
            the two models' predictions, not a prediction with the text.
    """
    out = DraftStats()
    for start in range(0, max(len(tokens) - 1, 0), window):
        chunk = list(tokens[start : start + window])
        if len(chunk) < 2:
            break
        x = mx.array(chunk)[None]
        out.extend(compare_logits(model(x)[0], draft(x)[0]))
    return out


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (ties count half).

    NaN when either class is empty.
    """
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return math.nan
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def replay_blocks(
    agree: Sequence[bool], draft_entropy: Sequence[float], max_draft: int, stop: Optional[float] = None
) -> List[Tuple[int, int]]:
    """Greedy speculative blocks replayed on teacher-forced statistics.

    Each block drafts at the next positions until a draft's entropy exceeds
    ``stop`` or ``max_draft`` drafts are out; the high gear accepts the prefix
    that agrees and adds one token (the correction or the bonus). So a block
    emits ``accepted + 1`` tokens for ``drafted`` draft steps and one verify
    of ``drafted + 1`` tokens.

    Args:
        agree, draft_entropy: per consecutive position of one text.

    Returns:
        ``(drafted, accepted)`` of each block, in order.
    """
    i, n, out = 0, len(agree), []
    limit = math.inf if stop is None else stop
    while i < n:
        drafted = accepted = 0
        rejected = False
        while drafted < max_draft and i + drafted < n:
            p = i + drafted
            drafted += 1
            if not rejected:
                if agree[p]:
                    accepted += 1
                else:
                    rejected = True
            if draft_entropy[p] > limit:
                break
        out.append((drafted, accepted))
        i += accepted + 1
    return out


def replay_speedup(
    agree: Sequence[bool],
    draft_entropy: Sequence[float],
    cost: float,
    max_draft: int,
    stop: Optional[float] = None,
    verify_cost: Optional[Sequence[float]] = None,
) -> float:
    """Tokens per high-gear step of the blocks :func:`replay_blocks` replays.

    Args:
        cost: a draft step in high-gear steps (c).
        verify_cost: ``v[k]``, a verify of ``k + 1`` tokens in high-gear
            steps (default 1 for every k).

    Returns:
        The modeled speed-up over the high gear.
    """
    blocks = replay_blocks(agree, draft_entropy, max_draft, stop)

    def verify(drafted: int) -> float:
        return 1.0 if verify_cost is None else verify_cost[min(drafted, len(verify_cost) - 1)]

    spent = sum(d * cost + verify(d) for d, _ in blocks)
    return sum(a + 1 for _, a in blocks) / spent if spent else 1.0


def step_seconds(model: Any, ids: Sequence[int], n_in: int, reps: int,
                 cache: Optional[List[Any]] = None) -> List[float]:
    """Seconds of ``reps`` synchronous calls of ``model`` on ``n_in`` tokens.

    The cache holds ``ids`` first (the calls extend it and are trimmed back
    after each one); a first call to warm up is not counted.

    Args:
        cache: a KV cache of ``model`` already holding ``ids`` (else one is
            made and filled here).
    """
    if cache is None:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(ids)[None], cache=cache))
        mx.eval([c.state for c in cache])
    x = mx.array((list(ids) * (n_in // max(len(ids), 1) + 1))[:n_in])[None]
    times = []
    for _ in range(reps + 1):
        tic = time.perf_counter()
        mx.eval(model(x, cache=cache))
        times.append(time.perf_counter() - tic)
        trim_prompt_cache(cache, n_in)
    return times[1:]


def step_costs(
    model: nn.Module, draft: DraftModel, ids: Sequence[int], max_k: int, reps: int = 3,
    caches: Optional[Tuple[List[Any], List[Any]]] = None,
) -> Dict[str, Any]:
    """Seconds of one high-gear step, one draft step and a verify of ``k + 1`` tokens for k = 1..max_k.

    Best of ``reps`` synchronous calls on a warm cache (the best call is the
    closest to an idle machine). ``"verify"`` is the list of the verify
    seconds, ``verify[k - 1]`` for a block of k drafts.

    Args:
        caches: ``(high, draft)`` KV caches already holding ``ids`` (else made).
    """
    hc, dc = caches if caches is not None else (None, None)
    if hc is None:
        hc = make_prompt_cache(model)
        mx.eval(model(mx.array(ids)[None], cache=hc))
    return {
        "high": min(step_seconds(model, ids, 1, reps, hc)),
        "draft": min(step_seconds(draft, ids, 1, reps, dc)),
        "verify": [min(step_seconds(model, ids, k + 1, reps, hc)) for k in range(1, max_k + 1)],
    }


def cost_ratios(seconds: Dict[str, Any], max_k: int) -> Tuple[float, List[float]]:
    """``(c, v)`` in high-gear steps from :func:`step_costs`: ``v[k]`` for k = 0..max_k.

    ``v[0] = 1`` (a plain step). ``seconds["verify"]`` is either the list of
    measured verifies for k = 1.. (beyond its end the last one holds), or one
    number, the verify at ``max_k`` (then ``v`` is linear between 1 and it).
    """
    high = seconds["high"]
    verify = seconds["verify"]
    if isinstance(verify, (list, tuple)):
        measured = [t / high for t in verify]
        v = [1.0] + [measured[min(k, len(measured)) - 1] for k in range(1, max_k + 1)]
    else:
        v_max = verify / high
        v = [1.0 + (v_max - 1.0) * k / max(max_k, 1) for k in range(max_k + 1)]
    return seconds["draft"] / high, v


def measure_costs(
    model: nn.Module, draft: DraftModel, ids: Sequence[int], max_k: int, reps: int = 3
) -> Tuple[float, List[float]]:
    """``(c, v)``: a draft step and verifies of ``k + 1`` tokens (k = 0..max_k), in high steps
    (:func:`step_costs`, :func:`cost_ratios`)."""
    return cost_ratios(step_costs(model, draft, ids, max_k, reps), max_k)


def modeled_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Expected tokens per block over its cost in high-gear steps (i.i.d. acceptance).

    ``(1 - α^(k+1)) / ((1 - α)(k c + v))``: a block of ``k`` drafts emits the
    accepted prefix plus one token and costs ``k`` draft steps (``c`` each)
    and a verify of ``k + 1`` tokens (``v``), all in high-gear steps.
    """
    if k == 0:
        return 1.0 / v
    tokens = float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


def gated_speedup(k: int, c: float, v: Sequence[float], p_continue: float, alpha_below: float,
                  alpha_above: float) -> float:
    """Expected tokens per block over its cost, for blocks that stop at a high draft entropy.

    Each draft independently has entropy at or below the stop with
    probability ``p_continue`` (acceptance ``alpha_below``; drafting goes on)
    or above it (acceptance ``alpha_above``; the block ends after it); at
    most ``k`` drafts. A block of ``d`` drafts costs ``d c + v[d]`` high steps
    and emits its accepted prefix plus one token, so (renewal reward) the
    speed-up is ``(1 + Σ_i (p a_lo)^(i-1) ā) / (c Σ_i p^(i-1) + Σ_d P(D = d) v[d])``
    with ``ā = p a_lo + (1 - p) a_hi``. With ``p_continue = 1`` it is
    :func:`modeled_speedup`.

    Args:
        v: ``v[d]``, a verify of ``d + 1`` tokens in high steps, d = 0..k.
    """
    if k == 0:
        return 1.0 / v[0]
    p, lo, hi = p_continue, alpha_below, alpha_above
    mean = p * lo + (1 - p) * hi
    tokens = 1.0 + sum((p * lo) ** (i - 1) * mean for i in range(1, k + 1))
    drafted = sum(p ** (i - 1) for i in range(1, k + 1))
    verify = sum(p ** (d - 1) * (1 - p) * v[d] for d in range(1, k)) + p ** (k - 1) * v[k]
    return tokens / (c * drafted + verify)


def gating_table(stats: DraftStats, greedy: bool = True) -> List[Dict[str, float]]:
    """Candidate entropy stops and what :func:`gated_speedup` needs of each.

    One entry per percentile of :data:`REPLAY_PERCENTILES` of the drafter's
    entropies: ``stop_bits``, ``percentile``, ``p_continue`` (share of
    positions at or below the stop), ``alpha_below`` and ``alpha_above``
    (greedy agreement, or ``sum min(p, q)`` with ``greedy=False``, on each
    side). Stops with no position on one side are left out.
    """
    e = sorted(stats.draft_entropy)
    accept = [float(a) for a in stats.agree] if greedy else list(stats.accept_prob)
    out = []
    for q in REPLAY_PERCENTILES if e else ():
        stop = e[min(int(q * len(e)), len(e) - 1)]
        below = [a for h, a in zip(stats.draft_entropy, accept) if h <= stop]
        above = [a for h, a in zip(stats.draft_entropy, accept) if h > stop]
        if below and above:
            out.append({"percentile": q, "stop_bits": stop, "p_continue": len(below) / len(accept),
                        "alpha_below": sum(below) / len(below), "alpha_above": sum(above) / len(above)})
    return out


def calibrated_stop(gearbox: Any, draft_gear: str) -> Optional[Dict[str, Any]]:
    """The saved draft-stop calibration of ``draft_gear`` (:func:`calibrate_draft_stop`'s block), if any."""
    cal = getattr(gearbox, "calibration", None)
    block = (cal.extra.get(CALIBRATION_KEY) or {}).get(draft_gear) if cal is not None else None
    return block if isinstance(block, dict) and ("stop_bits" in block or "max_draft" in block) else None


def stop_threshold(draft_entropies: Sequence[float], strategy: str, vocab_size: int) -> float:
    """The §4 low threshold of the drafter's own entropies, as a draft stop (bits).

    ``median`` (§4.2): the median; ``percentile`` (§4.1): p30, floored at
    0.01 bits and capped at 0.06·log2 V. The drafter keeps drafting where the
    router would trust the low gear. The high thresholds make no stop: the
    §4.2 one (2.5 × median) lies above nearly every draft entropy (12.9 bits
    for the default model's 4-bit drafter, whose entropies peak near 11).
    """
    if strategy == "median":
        return median_thresholds(draft_entropies)[0]
    if strategy == "percentile":
        return percentile_thresholds(draft_entropies, vocab_size)[0]
    raise ValueError(f"unknown stop strategy {strategy!r}: choose median or percentile (or replay)")


def best_replay(
    stats: DraftStats, cost: float, verify_cost: Optional[Sequence[float]] = None
) -> Dict[str, Any]:
    """The block cap and stop (percentile grid of draft entropy, or none) with the best replay.

    Ties go to no stop and to the shorter cap (cheaper when unsure). Also
    returns the best fixed-length setting for comparison.
    """
    e = sorted(stats.draft_entropy)
    stops: List[Tuple[Optional[float], Optional[float]]] = [(None, None)]
    stops += [(q, e[min(int(q * len(e)), len(e) - 1)]) for q in REPLAY_PERCENTILES] if e else []
    grid = []
    for k in REPLAY_MAX_DRAFT:
        for q, stop in stops:
            s = replay_speedup(stats.agree, stats.draft_entropy, cost, k, stop, verify_cost)
            grid.append((s, k, q, stop))
    fixed = max((g for g in grid if g[3] is None), key=lambda g: (round(g[0], 6), -g[1]))
    best = max(grid, key=lambda g: (round(g[0], 6), g[3] is None, -g[1]))
    return {
        "max_draft": best[1], "stop_percentile": best[2], "stop_bits": best[3],
        "replayed_speedup": best[0], "best_fixed_k": fixed[1], "best_fixed_speedup": fixed[0],
    }


def calibrate_draft_stop(
    model: nn.Module,
    draft: DraftModel,
    tokenizer: Any,
    strategy: str = "replay",
    prompts: Optional[Sequence[str]] = None,
    max_tokens: int = CALIBRATION_TOKENS,
    cost: Optional[Tuple[float, Sequence[float]]] = None,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
) -> Dict[str, Any]:
    """Calibrate the drafter's stop (and, with ``replay``, its block cap).

    The calibration prompts (§4.2's three, by default) are continued greedily
    by the high gear; both gears then score prompt + continuation in one
    forward each, and the continuation's positions are the samples.

    Args:
        strategy: ``replay`` (best replayed speed-up; measures the costs
            unless ``cost`` gives ``(c, v)``), ``median`` or ``percentile``.
        sampler: the high gear's greedy choice (default argmax; a sharded
            model passes one that takes rank 0's).

    Returns:
        The JSON-ready block saved under
        ``Calibration.extra["speculative"][draft gear]``; ``stop_bits`` is
        None when no stop pays, ``max_draft`` only with ``replay``.
    """
    if strategy not in STOP_STRATEGIES:
        raise ValueError(f"unknown stop strategy {strategy!r}: choose one of {STOP_STRATEGIES}")
    prompts = list(prompts or CALIBRATION_PROMPTS)
    stats = DraftStats()
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    first_ids: List[int] = []
    for prompt in prompts:
        ids = encode_chat(tokenizer, prompt)
        first_ids = first_ids or ids
        gen: List[int] = []
        for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens, sampler=sampler):
            gen.append(int(tok))
            if int(tok) in eos or len(gen) >= max_tokens:
                break
        seq = ids + gen
        full = draft_stats(model, draft, seq, window=len(seq))
        keep = slice(len(ids) - 1, len(seq) - 1)  # the positions that predict the continuation
        stats.extend(DraftStats(*[getattr(full, f)[keep] for f in
                                  ("draft_entropy", "high_entropy", "agree", "accept_prob")]))
    out: Dict[str, Any] = {"draft_gear": draft.gear, "bits": draft.bits, "scope": draft.scope,
                           "strategy": strategy, "n_samples": stats.n, **stats.summary()}
    if strategy == "replay":
        if cost is None:
            seconds = step_costs(model, draft, first_ids, max(REPLAY_MAX_DRAFT))
            c, v = cost_ratios(seconds, max(REPLAY_MAX_DRAFT))
            out["step_ms"] = {"high": 1e3 * seconds["high"], "draft": 1e3 * seconds["draft"],
                              "verify": [1e3 * t for t in seconds["verify"]]}
        else:
            c, v = cost
        out.update(draft_cost=c, verify_cost=list(v), **best_replay(stats, c, v))
    else:
        out["stop_bits"] = stop_threshold(stats.draft_entropy, strategy, vocab_size_of(model))
    stop = out["stop_bits"]
    if stop is not None:
        below = [a for h, a in zip(stats.draft_entropy, stats.agree) if h <= stop]
        above = [a for h, a in zip(stats.draft_entropy, stats.agree) if h > stop]
        out["alpha_below_stop"] = sum(below) / len(below) if below else None
        out["alpha_above_stop"] = sum(above) / len(above) if above else None
    out["median_draft_entropy"] = statistics.median(stats.draft_entropy) if stats.n else None
    # What the start-of-run decision (gearbx_mlx.speculative.plan) reads instead of the prompt's statistics.
    out["gating"] = {"greedy": gating_table(stats, True), "sampled": gating_table(stats, False)}
    out["prompts"] = prompts
    return out


__all__ = [
    "CALIBRATION_KEY", "CALIBRATION_TOKENS", "calibrated_stop", "DraftStats", "STOP_STRATEGIES", "auc", "best_replay",
    "calibrate_draft_stop", "compare_logits", "cost_ratios", "draft_stats", "gated_speedup", "gating_table",
    "measure_costs", "modeled_speedup", "replay_blocks", "replay_speedup", "step_costs", "step_seconds",
    "stop_threshold",
]
