"""``draft_sparsity="auto"``: the start-of-run decision between the dense drafter and sparse ones.

The planner (:func:`~gearbx_mlx.speculative.plan.plan_speculative`) measures
a drafter on the prompt (a draft step, the verifies, the agreement with the
high gear) and models the speed-up of every block length. For ``auto``
it does so for the dense drafter and for the sparse drafter at each of
:data:`AUTO_SPARSITIES`, and runs the one of the best modeled speed-up: a
sparse drafter only where its cheaper step outweighs the acceptance it
loses. Every candidate's α and gating statistics are read off the same last
:data:`STEPPED_POSITIONS` prompt positions, the sparse drafters' by one-token
steps (their prefill is dense, so the planner's own prompt statistics would
be the dense drafter's); a saved draft-stop calibration measured the dense
drafter only, so it is left out of the comparison. The candidates' numbers
go in ``plan.extra``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .calibration import DraftStats, compare_logits
from .decode import SpeculativeConfig, get_draft
from .draft import DraftModel
from .plan import MEASURE_TOKENS, SpeculativePlan, StartMeasurement, measure_start, plan_speculative
from .sparse import AUTO

#: The sparse drafters the decision weighs against the dense one.
AUTO_SPARSITIES: Tuple[float, ...] = (0.25, 0.5)
#: Prompt positions every candidate's α is read off (one-token steps of the sparse drafters).
STEPPED_POSITIONS = 32


def stepped_measurement(model: nn.Module, draft: DraftModel, ids: Sequence[int], max_k: int) -> StartMeasurement:
    """:func:`~gearbx_mlx.speculative.plan.measure_start`, with α and the statistics of the last
    :data:`STEPPED_POSITIONS` positions only, a sparse drafter's from one-token steps."""
    m = measure_start(model, draft, ids, max_k)
    ids = list(ids)[-MEASURE_TOKENS:]
    n = min(STEPPED_POSITIONS, len(ids) - 1)
    if n < 1 or m.stats is None:
        return m
    if draft.sparse:
        x = mx.array(ids)[None]
        high = model(x)[0, -n:]
        cache = make_prompt_cache(draft.module)
        draft(x[:, :-n], cache=cache)
        logits = mx.concatenate([draft(x[:, i : i + 1], cache=cache)[0] for i in range(len(ids) - n, len(ids))])
        stats = compare_logits(high, logits)
    else:
        stats = DraftStats(*[getattr(m.stats, f)[-n:] for f in ("draft_entropy", "high_entropy", "agree",
                                                                 "accept_prob")])
    s = stats.summary()
    return dataclasses.replace(m, alpha_greedy=s["alpha_greedy"], alpha_sampled=s["alpha_sampled"],
                               positions=stats.n, stats=stats)


def chosen_sparsity(plan: Optional[SpeculativePlan]) -> Optional[float]:
    """The sparsity an ``auto`` decision chose (None: the dense drafter, or no ``auto`` decision)."""
    return (plan.extra or {}).get("draft_sparsity") if plan is not None else None


def plan_sparsity(model: nn.Module, gearbox: Any, tokenizer: Any, spec: SpeculativeConfig, ids: Sequence[int],
                  greedy: bool, **options: Any) -> Tuple[Optional[float], DraftModel, SpeculativePlan]:
    """``(sparsity, drafter, plan)`` of the best of the dense and the :data:`AUTO_SPARSITIES` drafters.

    ``options``: more :class:`~gearbx_mlx.speculative.plan.PlanOptions` fields
    (``stop=``, ...), the same for every candidate. Ties go to the denser drafter.
    """
    if spec.mode is None or spec.mode == "plain":
        raise ValueError("draft_sparsity='auto' is chosen by the start-of-run decision: give mode 'auto' or 'force'")
    candidates: Dict[Optional[float], Tuple[DraftModel, SpeculativePlan]] = {}
    for s in (None, *AUTO_SPARSITIES):
        draft = get_draft(model, gearbox, spec.draft_gear, spec.draft_scope, s, tokenizer, spec.sparse_options)
        plan = plan_speculative(model, draft, ids, spec.max_draft, greedy=greedy, mode=spec.mode,
                                **{**options, "calibration": None,
                                   "measured": stepped_measurement(model, draft, ids, spec.max_draft)})
        candidates[s] = (draft, plan)
    best = max(candidates, key=lambda s: (candidates[s][1].best_speedup, -(s or 0.0)))
    draft, plan = candidates[best]
    plan.extra["draft_sparsity"] = best
    plan.extra["sparse_candidates"] = {
        "dense" if s is None else f"{s:g}": {
            "speedup": p.best_speedup, "speculate": p.speculate, "alpha": p.alpha, "draft_ms": p.draft_ms,
            "kept_fraction": d.sparse["kept_fraction"] if d.sparse else 1.0}
        for s, (d, p) in candidates.items()}
    return best, draft, plan


__all__ = ["AUTO", "AUTO_SPARSITIES", "STEPPED_POSITIONS", "chosen_sparsity", "plan_sparsity", "stepped_measurement"]
