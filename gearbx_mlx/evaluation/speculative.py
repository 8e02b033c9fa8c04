"""The evaluation's ``speculative`` policy: a lower gear drafts, the high gear verifies.

Quality is exact by construction: greedy speculative decoding
(:mod:`gearbx_mlx.speculative.decode`) emits the high gear's own tokens, so its
perplexity, KL and top-1 agreement are the static-high row's, copied here,
never recomputed. What a drafter changes is the work per token, and that
comes from the teacher-forced pass (:mod:`.teacher`) that scored the other
policies:

* acceptance: the drafter's row (``static-low/all`` or ``static-mid/all``;
  ``all`` is :class:`~gearbx_mlx.speculative.decode.SpeculativeConfig`'s draft
  scope) was fed the text token by token, like the high gear. At each
  position its greedy token equals the high gear's or not
  (``RowResult.hits``), and its float32 entropy is ``RowResult.entropy``.
  Greedy blocks are replayed along each window by
  :func:`~gearbx_mlx.speculative.calibration.replay_blocks`: fixed blocks of
  :data:`FIXED_BLOCKS` drafts, and the block cap and draft-entropy stop that
  :func:`~gearbx_mlx.speculative.calibration.calibrate_draft_stop` picks on its own
  prompts (held out from this text). The context is the text, not the high
  gear's own continuation: acceptance of drafts on real text.
* bytes (modeled, the §9 accounting of :class:`.specs.ModelLayout`): a verify
  of k+1 tokens reads the weights once, so a produced token costs
  ``(drafted x drafter bytes + verify passes x high bytes) / produced``.
* speed (modeled): ``c`` = a draft step over a high step, from the harness's
  speed runs (:mod:`.speed`: decode tokens/s of the drafter's static row and
  of static high) when they ran, else timed directly
  (:func:`~gearbx_mlx.speculative.calibration.measure_costs`); a verify of k+1
  tokens in high steps is timed directly (k = 0 and 8, linear between).
  Speed-up = produced / (drafted x c + sum of verify costs), tokens/s = that
  x the measured static-high tokens/s. The closed form
  (1 - a^(k+1)) / ((1 - a)(k c + 1)), a = the drafter's top-1 agreement, is
  listed beside it for the fixed blocks.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.nn as nn

from ..gearbox import Gearbox
from ..speculative.calibration import (
    CALIBRATION_TOKENS,
    REPLAY_MAX_DRAFT,
    auc,
    calibrate_draft_stop,
    measure_costs,
    modeled_speedup,
    replay_blocks,
)
from ..speculative.decode import SpeculativeConfig
from ..speculative.draft import build_draft
from .specs import ModelLayout
from .teacher import RowResult

#: Fixed block lengths (drafts per block) evaluated beside the calibrated setting.
FIXED_BLOCKS = (2, 4, 6)
#: Gears that draft in the evaluation (both of :data:`gearbx_mlx.speculative.draft.DRAFT_GEARS`).
DRAFT_GEARS = ("low", "mid")
QUALITY_NOTE = (
    "exact by construction: greedy speculative decoding emits the high gear's tokens, so perplexity, "
    "KL and top-1 are the static-high row's (copied, not recomputed)"
)
METHOD_NOTE = (
    "acceptance: the drafter's static row of the teacher-forced pass (fed the text, like the high gear); "
    "greedy blocks replayed along each window (gearbx_mlx.speculative.calibration.replay_blocks); a draft is "
    "accepted when its greedy token equals the high gear's and every earlier draft of its block was; "
    "a block ends after max_draft drafts or after a draft whose float32 entropy exceeds stop_bits. "
    "bytes (modeled, §9 accounting of the other rows): (drafted x drafter bytes + verify passes x high "
    "bytes) / produced tokens, a verify of k+1 tokens reading the weights once. speed (modeled): "
    "speed-up = produced / (drafted x c + sum of verify costs) in high-gear steps, tokens/s = speed-up x "
    "the measured static-high tokens/s"
)


@dataclass
class ReplayCounts:
    """Blocks of a greedy speculative replay, summed over windows."""

    positions: int = 0
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    produced: int = 0
    sizes: Dict[int, int] = field(default_factory=dict)  # number of blocks by drafts in them

    def add(self, blocks: Sequence[Tuple[int, int]], positions: int) -> None:
        """Add ``(drafted, accepted)`` blocks replayed over ``positions`` positions."""
        self.positions += positions
        for drafted, accepted in blocks:
            self.blocks += 1
            self.drafted += drafted
            self.accepted += accepted
            self.produced += accepted + 1  # the correction, or the bonus token
            self.sizes[drafted] = self.sizes.get(drafted, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted / self.blocks if self.blocks else math.nan

    def high_steps(self, cost: float, verify_cost: Optional[Sequence[float]] = None) -> float:
        """Time spent in high-gear steps: ``drafted x cost`` plus each block's verify."""
        def v(d: int) -> float:
            return 1.0 if verify_cost is None else verify_cost[min(d, len(verify_cost) - 1)]

        return self.drafted * cost + sum(n * v(d) for d, n in self.sizes.items())

    def speedup(self, cost: float, verify_cost: Optional[Sequence[float]] = None) -> float:
        """Produced tokens per high-gear step (what ``replay_speedup`` returns)."""
        spent = self.high_steps(cost, verify_cost)
        return self.produced / spent if spent else 1.0

    def bytes_per_token(self, draft_bytes: float, high_bytes: float) -> float:
        """Modeled weight bytes read per produced token."""
        return (self.drafted * draft_bytes + self.blocks * high_bytes) / self.produced

    def to_dict(self) -> Dict[str, Any]:
        return {
            "positions": self.positions, "blocks": self.blocks, "drafted": self.drafted,
            "accepted": self.accepted, "produced": self.produced,
            "blocks_by_drafts": {str(d): n for d, n in sorted(self.sizes.items())},
        }


def replay(
    hits: Sequence[bool], entropy: Sequence[float], steps: int, max_draft: int, stop: Optional[float] = None
) -> ReplayCounts:
    """Replay greedy blocks over consecutive windows of ``steps`` positions each.

    Args:
        hits, entropy: one entry per scored position, windows one after
            another (``RowResult.hits`` and ``.entropy`` of the drafter's row).
        steps: positions per window; a window is a fresh sequence, so no
            block crosses a window boundary.
    """
    if len(hits) != len(entropy) or steps < 1 or len(hits) % steps:
        raise ValueError(f"need equal-length lists of whole windows of {steps} positions, "
                         f"got {len(hits)} agreements and {len(entropy)} entropies")
    out = ReplayCounts()
    for s in range(0, len(hits), steps):
        out.add(replay_blocks(hits[s : s + steps], entropy[s : s + steps], max_draft, stop), steps)
    return out


def formula_speedup(alpha: float, k: int, cost: float) -> float:
    """The expected speed-up (1 - a^(k+1)) / ((1 - a)(k c + 1)) (i.i.d. acceptance, verify = 1 step)."""
    return modeled_speedup(alpha, k, cost)


def measure_drafters(
    model: nn.Module,
    tokenizer: Any,
    gearbox: Any,
    gears: Sequence[str],
    ids: Sequence[int],
    step_cost: Dict[str, Optional[float]],
    calibration_tokens: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Dict[str, Any]]:
    """Costs and calibrated setting of each drafter.

    Args:
        gearbox: a :class:`~gearbx_mlx.gearbox.Gearbox` of ``model`` whose
            scope is the draft scope, in the high gear.
        ids: a prompt for the timed calls (a few tokens of the text).
        step_cost: per gear, ``c`` from the speed runs (None: time it here).
        calibration_tokens: high-gear tokens per calibration prompt (None:
            :data:`~gearbx_mlx.speculative.calibration.CALIBRATION_TOKENS`).

    Returns:
        ``{gear: {"costs": {...}, "calibration": {...}}}``.
    """
    say = progress or (lambda _msg: None)
    out: Dict[str, Dict[str, Any]] = {}
    scope = gearbox.config.scope
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the double-quantization warning is known and recorded
        for gear in gears:
            say(f"speculative: timing the {gear} drafter and a verify block ...")
            real = build_draft(model, gearbox, gear, scope)
            c_direct, verify = measure_costs(model, real, ids, max(REPLAY_MAX_DRAFT))
            c = step_cost.get(gear)
            costs = {
                "draft_cost": c if c is not None else c_direct,
                # The speed runs: static-high tokens/s over the drafter row's.
                "draft_cost_source": "speed runs" if c is not None else "measure_costs",
                "draft_cost_direct": c_direct,
                "verify_cost": list(verify),
                "verify_cost_source": "speculative.calibration.measure_costs: a verify of k+1 tokens in high-gear "
                f"steps, best of 3, timed at every k from 0 to {max(REPLAY_MAX_DRAFT)}",
            }
            # Same values as the real kernels; fast multi-token products on a CPU.
            fake = build_draft(model, gearbox, gear, scope, quantizer="fake")
            say(f"speculative: calibrating the {gear} drafter's block cap and stop (replay) ...")
            cal = calibrate_draft_stop(model, fake, tokenizer, "replay", max_tokens=calibration_tokens or CALIBRATION_TOKENS,
                                       cost=(costs["draft_cost"], verify))
            out[gear] = {"costs": costs, "calibration": cal}
    return out


def speculative_rows(
    reference: RowResult,
    drafter: RowResult,
    gear: str,
    steps: int,
    layout: ModelLayout,
    drafter_info: Dict[str, Any],
    high_tps: Optional[float] = None,
) -> List[Dict[str, Any]]:
    """The rows of one drafter: fixed blocks of :data:`FIXED_BLOCKS`, then the calibrated setting."""
    costs, cal = drafter_info["costs"], drafter_info["calibration"]
    c, verify = costs["draft_cost"], costs["verify_cost"]
    high_bytes = layout.bytes_per_token(reference.spec, "high")
    draft_bytes = layout.bytes_per_token(drafter.spec, gear)
    alpha = drafter.top1_agreement
    settings = [(k, None, "fixed") for k in FIXED_BLOCKS]
    settings.append((int(cal["max_draft"]), cal["stop_bits"], "calibrated"))
    rows = []
    for k, stop, setting in settings:
        n = replay(drafter.hits, drafter.entropy, steps, k, stop)
        speedup = n.speedup(c, verify)
        rows.append({
            "name": f"speculative-{gear}/{'k' + str(k) if setting == 'fixed' else setting}",
            "draft_gear": gear,
            "draft_row": drafter.spec.name,
            "setting": setting,
            "max_draft": k,
            "stop_bits": stop,
            "quality": "exact by construction (= static-high)",
            "perplexity": reference.perplexity,
            "mean_kl": reference.mean_kl,
            "top1_agreement": reference.top1_agreement,
            "replay": n.to_dict(),
            "acceptance_rate": n.acceptance_rate,
            "mean_accepted_length": n.mean_accepted_length,
            "drafted_per_token": n.drafted / n.produced,
            "verify_passes_per_token": n.blocks / n.produced,
            "modeled": {
                "bytes_per_token": n.bytes_per_token(draft_bytes, high_bytes),
                "relative_bytes": n.bytes_per_token(draft_bytes, high_bytes) / high_bytes,
                "speedup": speedup,
                "speedup_formula": formula_speedup(alpha, k, c) if stop is None else None,
                "tokens_per_s": speedup * high_tps if high_tps else None,
            },
        })
    return rows


@dataclass(frozen=True)
class DraftSubject:
    """What the speculative rows are evaluated on.

    Attributes:
        model, tokenizer: the loaded model and its tokenizer.
        layout: the managed paths and their bytes.
        config: the evaluation's :class:`~gearbx_mlx.config.GearboxConfig`.
        vocab_size: the model's vocabulary size.
        steps: scored positions per window.
        ids: a prompt for the directly timed calls.
        calibration_tokens: high-gear tokens per calibration prompt when
            choosing each drafter's block cap and stop (None: the calibration's own).
    """

    model: nn.Module
    tokenizer: Any
    layout: ModelLayout
    config: Any
    vocab_size: int
    steps: int
    ids: Sequence[int]
    calibration_tokens: Optional[int] = None


def evaluate_speculative(
    subject: DraftSubject,
    first: Sequence[RowResult],
    speed: Dict[str, Dict[str, Any]],
    progress: Optional[Callable[[str], None]] = None,
) -> Optional[Dict[str, Any]]:
    """The ``speculative`` section of the results, or None without a drafter row.

    Args:
        subject: the model and settings (:class:`DraftSubject`).
        first: the first teacher-forced pass; a drafter is evaluated when it
            holds the static row of its gear in the draft scope.
        speed: the speed runs by policy name (empty when skipped).
    """
    model, tokenizer, layout, config = subject.model, subject.tokenizer, subject.layout, subject.config
    vocab_size, steps, ids, calibration_tokens = subject.vocab_size, subject.steps, subject.ids, subject.calibration_tokens
    scope = SpeculativeConfig().draft_scope or config.scope
    rows = {g: _static_row(first, g, scope) for g in DRAFT_GEARS}
    rows = {g: r for g, r in rows.items() if r is not None}
    if not rows:
        return None
    ref = next(r for r in first if r.spec.is_reference)
    high_tps = (speed.get(ref.spec.name) or {}).get("tokens_per_s")
    tps = {g: (speed.get(r.spec.name) or {}).get("tokens_per_s") for g, r in rows.items()}
    step_cost = {g: high_tps / t if high_tps and t else None for g, t in tps.items()}
    # The drafter rows are the separate store's (the nested low gear is the same MLX 4-bit).
    gearbox = Gearbox(model, config.replace(scope=scope, store="separate", high="original"), vocab_size)
    drafters = measure_drafters(model, tokenizer, gearbox, list(rows), ids, step_cost, calibration_tokens, progress)
    section: Dict[str, Any] = {
        "quality": QUALITY_NOTE, "method": METHOD_NOTE, "draft_scope": scope,
        "high_tokens_per_s_measured": high_tps, "drafters": {}, "rows": [],
    }
    for gear, d in rows.items():
        section["drafters"][gear] = {
            "row": d.spec.name,
            "alpha_positions": d.top1_agreement,
            "auc_draft_entropy": auc(d.entropy, [not h for h in d.hits]),  # entropy predicting rejection
            "draft_bytes_per_step": layout.bytes_per_token(d.spec, gear),
            "draft_tokens_per_s_measured": tps[gear],
            **drafters[gear],
        }
        section["rows"] += speculative_rows(ref, d, gear, steps, layout, drafters[gear], high_tps)
    return section


def _static_row(first: Sequence[RowResult], gear: str, scope: str) -> Optional[RowResult]:
    return next((r for r in first if r.spec.kind == "static" and r.spec.gear == gear and r.spec.scope == scope
                 and r.spec.store == "separate"), None)
