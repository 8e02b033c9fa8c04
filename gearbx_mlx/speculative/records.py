"""What speculative decoding records: each emitted token, each block, a run's counters.

:class:`SpeculativeToken` is what :func:`gearbx_mlx.speculative.decode.speculative_generate_step`
yields; :class:`SpeculativeStats` collects its blocks (:class:`BlockRecord`) and
the draft path that ran, and summarizes them for a run's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx

from .draft import DraftModel

#: Why a draft block ended.
STOPS = ("max", "entropy", "predicted", "limit")


@dataclass
class SpeculativeToken:
    """What happened to one emitted token of speculative decoding."""

    token: int
    index: int  # 0-based among generated tokens
    block: int  # 0-based block number
    drafted: int  # drafts proposed in this token's block
    accepted: bool  # a draft the high gear accepted (else the high gear's own)
    gear: str  # gear whose forward pass chose the token
    entropy: float  # bits, the high gear's distribution at this position
    draft_entropy: float  # bits, the drafter's there (NaN for a bonus token)
    smoothed: float
    predicted: float
    stop: str  # why the block ended (see STOPS)
    logprobs: mx.array  # (V,) the high gear's log-probabilities
    #: the sparse drafter's block: kept fraction, hot-set and predictor hit rates of its draft steps
    sparse: Optional[Dict[str, Optional[float]]] = None


@dataclass
class BlockRecord:
    drafted: int
    accepted: int
    stop: str
    seconds: float


@dataclass
class SpeculativeStats:
    """Counters of one speculative generation, and the draft path that ran
    (``drafter``: ``{"path", "detail", "reason"}`` of :meth:`Drafter.describe`)."""

    blocks: List[BlockRecord] = field(default_factory=list)
    tokens: int = 0
    drafter: Dict[str, Optional[str]] = field(default_factory=dict)
    plan: Optional[Dict[str, Any]] = None  # the start-of-run decision, where one was made
    ranks: int = 1  # processes the model is sharded over
    exchanges: int = 0  # their decision collectives (drafts and verdicts), sharded only
    #: The KV caches' settings and bytes per token (``gearbx_mlx.kvcache.option``).
    kv_cache: Optional[Dict[str, Any]] = None

    @property
    def drafted(self) -> int:
        return sum(b.drafted for b in self.blocks)

    @property
    def accepted(self) -> int:
        return sum(b.accepted for b in self.blocks)

    def summary(self) -> Dict[str, Any]:
        nb = max(len(self.blocks), 1)
        stops = {s: 0 for s in STOPS}
        for b in self.blocks:
            stops[b.stop] += 1
        drafted = self.drafted
        return {
            "blocks": len(self.blocks),
            "drafted": drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / drafted if drafted else None,
            "mean_accepted_length": self.accepted / nb,
            "mean_drafted_length": drafted / nb,
            "tokens_per_block": self.tokens / nb,
            "stops": stops,
            "drafter": dict(self.drafter),
            "plan": self.plan,
            **({"distributed": {
                "ranks": self.ranks, "decision_collectives": self.exchanges,
                # a draft is one drafter forward pass, a block one verify pass
                "forward_steps": drafted + len(self.blocks),
                "collectives_per_step": self.exchanges / max(drafted + len(self.blocks), 1),
            }} if self.ranks > 1 else {}),
            "kv_cache": self.kv_cache,
        }


def sparse_step_stats(draft: Optional[DraftModel]) -> Optional[Dict[str, Optional[float]]]:
    """The sparse drafter's statistics of the draft steps since the last call (None for a dense drafter):
    ``kept_fraction`` of the FFN blocks, ``hot_hit_rate`` (hot blocks a dense step would have kept),
    ``predictor_hit_rate`` (where audited)."""
    if draft is None or not draft.sparse:
        return None
    if draft.kairox is not None:
        return draft.kairox.read()
    return {"kept_fraction": draft.sparse["kept_fraction"], "hot_hit_rate": None, "predictor_hit_rate": None}
