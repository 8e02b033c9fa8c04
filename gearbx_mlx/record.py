"""One record of a generation run, whatever its mode: the trace header and the summary.

:class:`RunRecord` is made by :mod:`gearbx_mlx.pipeline` when a run is set up
and rides on every response (``response.run``). The CLI's trace header, its
summary lines, the trace's summary record and the server's usage block are all
built from it, so routed and speculative runs share one format: the common
fields, then the routed fields or a ``"speculative"`` block.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from .config import GEARS
from .kvcache.option import KVOptions

#: The generation modes of a run.
MODES = ("routed", "speculative")


@dataclass
class RunRecord:
    """What one generation decided and did.

    Attributes:
        gearbox: the model's gearbox.
        mode: ``"routed"`` or ``"speculative"``.
        kv_options: the KV options of the run; kv_cache: its cache's summary
            (settings and bytes per token).
        session: the routing session (routed runs).
        stats, draft, plan, config: the speculative counters, the drafter, the
            start-of-run decision (or None) and the settings that ran.
        gears, entropies: gear and entropy of each emitted token of a
            speculative run (the routed session keeps its own records).
    """

    gearbox: Any
    mode: str
    kv_options: KVOptions
    kv_cache: Optional[Dict[str, Any]]
    session: Any = None
    stats: Any = None
    draft: Any = None
    plan: Any = None
    config: Any = None
    gears: List[str] = field(default_factory=list)
    entropies: List[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    def note(self, gear: str, entropy: float) -> None:
        """Count one emitted token of a speculative run."""
        self.gears.append(gear)
        self.entropies.append(entropy)

    # -- header -------------------------------------------------------------------------
    def header(self, first: Any = None) -> Dict[str, Any]:
        """The trace header: the model, gearbox settings, KV options and this mode's block."""
        gb, c = self.gearbox, self.gearbox.config
        mgr = gb.manager
        out: Dict[str, Any] = {
            "model": gb.model_name,
            "vocab_size": gb.vocab_size,
            "thresholds": {"low": gb.thresholds[0], "high": gb.thresholds[1],
                           "source": gb.threshold_source},
            "scope": c.scope, "kernel": c.kernel, "store": mgr.store,
            "high": c.high if mgr.store == "nested" else "original",
            "low_quant": c.low_quant if mgr.store == "nested" else None,
            "window": c.window, "hysteresis": c.hysteresis, "min_gear_duration": c.min_gear_duration,
            "telemetry_only": mgr.telemetry_only, "managed_modules": len(mgr.paths),
            "resolution": gb.resolution.as_dict(),
            "kv": {"bits": self.kv_options.bits, "group_size": self.kv_options.group_size,
                   "quantized_kv_start": self.kv_options.start,
                   "rotation": self.kv_options.rotation},
            "mode": self.mode,
            **ranks_header(gb),
        }
        if first is not None:
            out["prompt_tokens"] = first.prompt_tokens
        if self.mode == "routed":
            s, pc = self.session, gb.prompt_class
            out.update(lag=s.lag, policy=s.policy.name,
                       initial_gear=s.records[0].gear if s.records else None,
                       prompt_class={"gear": pc.gear, "score": pc.score} if pc else None)
        else:
            out.update(policy="speculative", speculative=self._speculative_header())
        return out

    def _speculative_header(self) -> Dict[str, Any]:
        d, cfg, plan = self.draft, self.config, self.plan
        return {
            "draft_gear": d.gear if d else cfg.draft_gear, "draft_bits": d.bits if d else None,
            "draft_scope": d.scope if d else cfg.draft_scope, "max_draft": cfg.max_draft,
            "draft_entropy_stop": cfg.draft_entropy_stop, "hard_max_draft": cfg.hard_max_draft,
            "mode": plan.mode if plan else cfg.mode, "drafting": plan.speculate if plan else d is not None,
            "drafter": dict(self.stats.drafter) if self.stats.drafter else (plan.drafter if plan else None),
            "plan": plan.to_dict() if plan else None,
        }

    # -- summary ------------------------------------------------------------------------
    def summary(self, last: Any, interrupted: bool = False, error: Optional[str] = None) -> Dict[str, Any]:
        """The run's summary from its last response: common fields, then the mode's."""
        gears, ents, nonfinite = self._emitted(last)
        counts = {g: 0 for g in GEARS}
        for g in gears:
            counts[g] += 1
        out = {
            "mode": self.mode,
            "interrupted": interrupted,
            "error": error,
            "finish_reason": getattr(last, "finish_reason", None),
            "prompt_tokens": getattr(last, "prompt_tokens", 0),
            "prompt_tps": getattr(last, "prompt_tps", 0.0),
            "generation_tokens": len(gears),
            "generation_tps": getattr(last, "generation_tps", 0.0),
            "peak_memory_gb": getattr(last, "peak_memory", 0.0),
            "tokens_per_gear": counts,
            "mean_entropy": statistics.fmean(ents) if ents else None,
            "nonfinite_steps": nonfinite,
            "kv_cache": kv_held(self.kv_cache, getattr(last, "prompt_tokens", 0) + len(gears),
                                last_fed=self.mode == "routed"),
            "resolution": self.gearbox.resolution.as_dict(),
        }
        if self.mode == "routed":
            out.update(self._routed(last, out))
        else:
            spec = self._speculative()
            distributed = spec.pop("distributed", None)  # a sharded run's block: the same key in every mode
            out.update({"speculative": spec, **({"distributed": distributed} if distributed else {})})
        return out

    def _emitted(self, last: Any) -> tuple:
        n = getattr(last, "generation_tokens", 0) if last is not None else 0
        if self.mode == "speculative":
            ents = [e for e in self.entropies[:n] if math.isfinite(e)]
            return self.gears[:n], ents, 0
        recs = [r for r in self.session.records if r.committed][:n]
        return ([r.gear for r in recs], [r.entropy for r in recs],
                sum(1 for r in recs if getattr(r, "nonfinite", False)))

    def _routed(self, last: Any, common: Dict[str, Any]) -> Dict[str, Any]:
        session, mgr = self.session, self.gearbox.manager
        recs = [r for r in session.records if r.committed][: common["generation_tokens"]]
        # One-time quantization inside mlx-lm's timings: between the initial gear
        # and the first token (prompt), and after it (generation).
        marks = session.quantize_marks
        q_total = session.quantize_seconds
        q_first = marks.get("first_token", q_total)
        q_prompt, q_gen = max(q_first - marks.get("start", q_first), 0.0), max(q_total - q_first, 0.0)
        return {
            "prompt_quantize_seconds": q_prompt,
            "prompt_tps_excluding_quantize": rate_without(common["prompt_tokens"], common["prompt_tps"], q_prompt),
            "generation_quantize_seconds": q_gen,
            "generation_tps_excluding_quantize": rate_without(
                getattr(last, "generation_tokens", 0), common["generation_tps"], q_gen),
            "shifts": sum(1 for r in recs if r.shifted),
            "quantize_seconds": session.quantize_seconds,
            "swap_seconds": session.shift_seconds,
            "telemetry_only": mgr.telemetry_only,
            "telemetry_reason": mgr.telemetry_reason,
            "entries": mgr.entries(),
            "memory": mgr.memory(),
            "store": mgr.store,
            "high": mgr.config.high if mgr.store == "nested" else "original",
            "planes_seconds": mgr.planes_seconds,
            "low_quant": mgr.config.low_quant if mgr.store == "nested" else None,
            "low_quant_seconds": mgr.low_quant_seconds,
            "model_bytes": mgr.model_bytes,
            "loaded_read_bytes": mgr.loaded_read_bytes,
            "scope": mgr.config.scope,
            "step_bytes": mgr.step_bytes(),
            "managed_share": mgr.managed_share(),
            "managed_share_scope_all": (mgr.managed_bytes_scope_all / mgr.loaded_read_bytes
                                        if mgr.loaded_read_bytes and not mgr.telemetry_only else None),
            **ranks_summary(session, len(recs)),
        }

    def _speculative(self) -> Dict[str, Any]:
        d = self.draft
        return {
            "draft_gear": d.gear if d else self.config.draft_gear,
            "draft_bits": d.bits if d else None,
            "draft_scope": d.scope if d else self.config.draft_scope,
            "config": asdict(self.config),
            **self.stats.summary(),
            "memory": dict(d.memory) if d else {},
        }


def kv_held(kv: Optional[Dict[str, Any]], tokens: int, last_fed: bool = True) -> Optional[Dict[str, Any]]:
    """The KV summary with what the cache held at the end of a run of ``tokens`` tokens
    (prompt and generated).

    A quantized cache converts all it holds once it reaches its start (mlx-lm's
    rule), so ``quantized_tokens`` is all or nothing. mlx-lm's loop feeds each
    token before it hands it out (``last_fed``: the cache holds every token);
    speculative decoding keeps what precedes its last token (one less).
    """
    if kv is None or kv.get("kind") == "float":
        return kv
    held = max(tokens - (0 if last_fed else 1), 0)
    return {**kv, "held_tokens": held, "quantized_tokens": held if held >= kv["quantized_kv_start"] else 0}


def rate_without(tokens: int, rate: float, seconds: float) -> float:
    """``rate`` (tokens / elapsed) with ``seconds`` taken out of the elapsed time."""
    if not tokens or not rate or rate <= 0:
        return rate
    elapsed = tokens / rate - seconds
    return tokens / elapsed if elapsed > 0 else rate


def empty_summary(interrupted: bool = False, error: Optional[str] = None,
                  stage: Optional[str] = None) -> Dict[str, Any]:
    """Summary of a run that produced no token (stopped while loading, calibrating, in the prefill)."""
    return {
        "interrupted": interrupted, "error": error, "stage": stage, "finish_reason": None,
        "prompt_tokens": 0, "prompt_tps": 0.0, "generation_tokens": 0, "generation_tps": 0.0,
        "peak_memory_gb": 0.0, "tokens_per_gear": {g: 0 for g in GEARS}, "shifts": 0, "mean_entropy": None,
        "nonfinite_steps": 0,
    }


def ranks_header(gearbox: Any) -> Dict[str, Any]:
    """A sharded run's header block (empty on one process)."""
    ranks = getattr(gearbox, "ranks", None)
    if ranks is None:
        return {}
    return {"distributed": {
        "ranks": ranks.size, "sharding": "tensor parallel, mlx-lm model.shard()",
        "decisions": "rank 0's, shared in one all_sum per forward step", "written_by": "rank 0",
    }}


def ranks_summary(session: Any, tokens: int) -> Dict[str, Any]:
    """A sharded run's summary block (empty on one process): ranks, the decision
    collectives made against the forward steps they served, their wait, agreement."""
    exchange = getattr(session, "exchange", None)
    if exchange is None:
        return {}
    recs = [r for r in session.records if r.rank_gears is not None]
    emitted = recs[:tokens]
    waits = sorted(r.exchange_seconds for r in emitted if math.isfinite(r.exchange_seconds))
    return {"distributed": {
        "ranks": exchange.size,
        "decision_collectives": session.exchanges,
        "forward_steps": len(session.records),
        "collectives_per_step": session.exchanges / len(session.records) if session.records else None,
        "exchange_seconds_total": sum(waits),
        "exchange_seconds_median": waits[len(waits) // 2] if waits else None,
        "steps_ranks_agree": sum(1 for r in emitted if r.ranks_agree),
        "steps_ranks_differ": sum(1 for r in emitted if not r.ranks_agree),
        "gears_agree": all(len(set(r.rank_gears)) == 1 for r in emitted),
    }}
