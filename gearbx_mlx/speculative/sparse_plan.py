"""``draft_sparsity="auto"``: the start-of-run decision between the dense drafter and sparse ones.

The planner (:func:`~gearbx_mlx.speculative.plan.plan_speculative`) measures
a drafter on the prompt (a draft step, the verifies, the agreement with the
high gear) and models the speed-up of every block length. For ``auto``
it does so for the dense drafter and for the sparse drafter at each of
:data:`AUTO_SPARSITIES`, and runs the one of the best modeled speed-up: a
sparse drafter only where its cheaper step outweighs the acceptance it
loses. Every candidate's α is read off the same prompt positions (a saved
draft-stop calibration measured the dense drafter only, so it is left out of
the comparison). The candidates' numbers go in ``plan.extra``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import mlx.nn as nn

from .decode import SpeculativeConfig, get_draft
from .draft import DraftModel
from .plan import SpeculativePlan, plan_speculative
from .sparse import AUTO

#: The sparse drafters the decision weighs against the dense one.
AUTO_SPARSITIES: Tuple[float, ...] = (0.25, 0.5)


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
                                **{**options, "calibration": None})
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


__all__ = ["AUTO", "AUTO_SPARSITIES", "chosen_sparsity", "plan_sparsity"]
