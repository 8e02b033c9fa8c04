"""``--speculative`` for ``python -m gearbx_mlx.generate``: flags, settings, summary lines.

The generate CLI adds these flags with :func:`add_speculative_args`, checks
them before loading with :func:`check_speculative_args`, turns them into a
:class:`SpeculativeConfig` with :func:`speculative_config` and runs the one
generation pipeline with it; :func:`speculative_lines` are the summary's
speculative block.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Dict, List, Optional, Union

from ..calibration import Calibration
from ..config import SCOPES
from ..console import mib, refuse_unused, say
from .calibration import CALIBRATION_KEY, calibrate_draft_stop, calibrated_stop
from .decode import MAX_DRAFT, SpeculativeConfig, get_draft
from .draft import DRAFT_GEARS
from .plan import CHOOSE, MIN_MODELED_SPEEDUP, MODES
from .sparse import (
    AUTO,
    MAX_SPARSITY,
    THRESHOLDS_KEY,
    calibration_tokens,
    check_sparsity,
    ffn_layers,
    layer_masses,
    quant_parts,
    threshold_curves,
)
from .sparse_gear import install_sparse_gear
from .sparse_plan import AUTO_SPARSITIES


def _draft_length(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_DRAFT}, got {text!r}") from None
    if not 1 <= v <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_DRAFT}, got {v}")
    return v


def _off_or_number(text: str, what: str, ok: Any) -> Optional[float]:
    """``off`` -> None; else the number, which ``ok`` must accept (NaN never does)."""
    if text.lower() == "off":
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} or 'off', got {text!r}") from None
    if not math.isfinite(v) or not ok(v):
        raise argparse.ArgumentTypeError(f"expected {what} or 'off', got {text!r}")
    return v


def _stop_bits(text: str) -> Optional[float]:
    """``off`` -> None (fixed-length blocks); else bits >= 0."""
    return _off_or_number(text, "bits (a number >= 0)", lambda v: v >= 0)


def _sparsity(text: str) -> Union[float, str, None]:
    """``off`` -> None (the dense drafter); ``auto`` (the decision chooses); else a fraction in ``[0, MAX_SPARSITY]``."""
    if text.lower() == AUTO:
        return AUTO
    return _off_or_number(text, f"'auto', a fraction in [0, {MAX_SPARSITY}]", lambda v: 0 <= v <= MAX_SPARSITY)


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--speculative`` group of flags to ``parser``."""
    d = SpeculativeConfig()
    g = parser.add_argument_group(
        "speculative decoding (output exactly the high gear's; the low gear drafts)"
    )
    g.add_argument("--speculative", nargs="?", const="auto", choices=MODES, default=None,
                   help="draft with a quantized gear, verify every token with the high gear. 'auto' (the "
                        "default): first time a draft step and a verify of every block length against a "
                        "high-gear step on the prompt, then choose plain decoding, fixed blocks or blocks gated by "
                        "the draft's entropy (and the block length) by the modeled speed-up, decoding plainly in "
                        f"the high gear where it is below {MIN_MODELED_SPEEDUP:g}x (drafting would be slower); "
                        "'force': draft anyway, the better of fixed and gated blocks. The fast "
                        "drafter (a numpy decode step around the C kernels, no MLX graph) applies to greedy "
                        "decoding of mlx-lm llama and qwen2 models in float32 on the CPU with --kernel packed (the "
                        "default there); elsewhere drafts go through the MLX module tree. The summary and the "
                        "trace say which path ran and why")
    g.add_argument("--draft-gear", choices=DRAFT_GEARS, default=d.draft_gear,
                   help="gear that drafts: low (4-bit) or mid (8-bit)")
    g.add_argument("--max-draft", type=_draft_length, default=None, metavar="N",
                   help="most tokens drafted per block; the decision models every length up to it (default: "
                        f"the calibrated cap of --calibrate/--calibration, else {d.max_draft})")
    g.add_argument("--draft-entropy-stop", type=_stop_bits, default=argparse.SUPPRESS, metavar="BITS",
                   help="end a block after a draft whose entropy exceeds BITS; 'off' for fixed-length "
                        "blocks (default: the decision picks a stop among the drafter's entropy percentiles, from "
                        "the saved calibration or the prompt, or none)")
    g.add_argument("--hard-max-draft", type=int, default=None, metavar="N",
                   help="cap blocks at N drafts while the predicted entropy is above the high "
                        "threshold (default: no cap)")
    g.add_argument("--draft-scope", choices=SCOPES, default=d.draft_scope,
                   help=f"layers the drafter quantizes (default {d.draft_scope})")
    g.add_argument("--draft-sparsity", type=_sparsity, default=d.draft_sparsity, metavar="auto|S|off",
                   help="draft with activation-sparse FFNs: one-token draft steps skip the lightest 64-neuron "
                        "blocks of down_proj, S of them on average (kept fractions per layer measured on the "
                        "evaluation text at start); the output stays the high gear's, only acceptance can drop. "
                        "gated-FFN models (SwiGLU or Gemma 3's GeGLU) with the low gear's MLX-quantized down_proj; 'auto': the start-of-run "
                        "decision also measures sparse drafters (at "
                        f"{', '.join(f'{x:g}' for x in AUTO_SPARSITIES)}) and drafts with the one of the best "
                        "modeled speed-up; 'off' (the default): the dense drafter")


def check_speculative_flags_unused(args: argparse.Namespace) -> None:
    """Without ``--speculative``, a drafter flag would do nothing: one error naming it, before anything loads.

    ``--draft-gear`` and ``--draft-scope`` count where they differ from their
    defaults (argparse cannot tell the default given on purpose from none)."""
    d = SpeculativeConfig()
    refuse_unused((
        ("--draft-gear", getattr(args, "draft_gear", d.draft_gear) != d.draft_gear),
        ("--max-draft", getattr(args, "max_draft", None) is not None),
        ("--draft-entropy-stop", hasattr(args, "draft_entropy_stop")),
        ("--hard-max-draft", getattr(args, "hard_max_draft", None) is not None),
        ("--draft-scope", getattr(args, "draft_scope", d.draft_scope) != d.draft_scope),
        ("--draft-sparsity", getattr(args, "draft_sparsity", None) is not None),
    ), ("sets", "set"), "the speculative drafter: add --speculative (without it nothing drafts)")


def check_speculative_args(args: argparse.Namespace) -> None:
    """Fail on options speculative decoding does not take, before anything loads; without
    ``--speculative``, on the drafter flags (:func:`check_speculative_flags_unused`).

    Also sets ``MLX_CUDA_USE_CUDNN_SDPA=0`` unless already set (no effect on the CPU).
    """
    if not getattr(args, "speculative", False):
        check_speculative_flags_unused(args)
        return
    for flag, given, why in (
        ("--max-kv-size", getattr(args, "max_kv_size", None) is not None,
         "its drafts are taken back from KV caches that grow without a window"),
        ("--static-gear", getattr(args, "static_gear", None) is not None,
         "its output is the high gear's, drafted by --draft-gear (drop --speculative to decode in one gear)"),
        ("--telemetry-only", getattr(args, "telemetry_only", False),
         "its drafter runs a swapped-in gear, and telemetry-only swaps nothing"),
    ):
        if given:
            raise ValueError(f"{flag} cannot be combined with --speculative: {why}")
    hard = getattr(args, "hard_max_draft", None)
    if getattr(args, "draft_sparsity", None) is not None and args.draft_gear != "low":
        raise ValueError("--draft-sparsity drafts with the low gear (its 4-bit down_proj is gathered by block): "
                         "drop --draft-gear mid")
    check_sparse_calibration(args)
    if hard is not None and (hard < 0 or (args.max_draft is not None and hard > args.max_draft)):
        raise ValueError(f"--hard-max-draft must be in [0, --max-draft], got {hard}")
    # MLX-CUDA reads this once, at the first attention call: set it before any
    # forward pass so that verify blocks skip cuDNN's per-shape plan builds
    # (gearbx_mlx.speculative.decode, "On a GPU"). A value the user set wins.
    os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")


def speculative_config(args: argparse.Namespace, gearbox: Any) -> SpeculativeConfig:
    """The config of a CLI run before the decision: flags first, then the saved calibration, then the defaults.

    ``max_draft`` is the block cap the decision models lengths up to; the
    entropy stop is the flag's where one was given (the decision keeps it;
    ``off``: fixed blocks only), else the calibrated one (the decision may
    choose another, or none).
    """
    block = calibrated_stop(gearbox, args.draft_gear) or {}
    plan_options: Dict[str, Any] = {}
    if hasattr(args, "draft_entropy_stop"):
        stop = args.draft_entropy_stop
        if stop is None:
            plan_options["stop"] = None
    else:
        stop = block.get("stop_bits")
        if stop is not None:  # the saved stop is the decision's candidate (with its gating), not a fixed one
            plan_options["stop"] = CHOOSE
    max_draft = args.max_draft or block.get("max_draft") or SpeculativeConfig.max_draft
    hard = args.hard_max_draft
    if hard is not None and hard > max_draft:
        raise ValueError(f"--hard-max-draft {hard} exceeds the block cap {max_draft}")
    return SpeculativeConfig(
        draft_gear=args.draft_gear, max_draft=int(max_draft), draft_entropy_stop=stop,
        hard_max_draft=hard, draft_scope=args.draft_scope, mode=args.speculative, plan_options=plan_options,
        draft_sparsity=getattr(args, "draft_sparsity", None),
    )


def check_sparse_model(args: argparse.Namespace, model: Any) -> None:
    """``--draft-sparsity`` on a model the sparse drafter cannot run: one error naming the flag, right after loading."""
    if getattr(args, "draft_sparsity", None) is None:
        return
    try:
        ffn_layers(model)
    except ValueError as e:
        raise ValueError(f"--draft-sparsity: {e}") from None


def add_sparse_gear_arg(group: Any) -> None:
    """Add ``--sparse-gear`` (the routed low gear computed sparsely) to a group of the generate CLI."""
    group.add_argument("--sparse-gear", type=float, default=None, metavar="S",
                       help="compute the low gear sparsely: on one-token steps in the low gear each FFN keeps its "
                            "heaviest 64-neuron blocks, a fraction S of them skipped on average (kept fractions "
                            "calibrated in the low gear at start, or from the --calibration file's sparse "
                            "thresholds); changes the low gear's tokens (routed decoding only; opt-in)")


def check_sparse_gear_args(args: argparse.Namespace) -> None:
    """``--sparse-gear``: a sparsity in range, routed decoding, a gear that can be the low one."""
    try:
        check_sparsity(args.sparse_gear, "--sparse-gear")
    except ValueError as e:
        raise ValueError(str(e).replace(" or off", "").replace("the drafter skips", "skipped")) from None
    if args.speculative:
        raise ValueError("--sparse-gear computes the routed low gear sparsely; speculative decoding outputs the high "
                         "gear's tokens: use --draft-sparsity for a sparse drafter")
    if args.static_gear in ("mid", "high"):
        raise ValueError(f"--sparse-gear changes the low gear only: --static-gear {args.static_gear} never uses it")


def use_sparse_gear(args: argparse.Namespace, model: Any, tokenizer: Any, gearbox: Any) -> None:
    """Install the sparse low gear (after loading: the model must have gated FFNs)."""
    try:
        ffn_layers(model)
    except ValueError as e:
        raise ValueError(f"--sparse-gear: {e}") from None
    cal = gearbox.calibration
    info = install_sparse_gear(model, gearbox, args.sparse_gear, calibration_tokens(tokenizer),
                               cal.extra.get(THRESHOLDS_KEY) if cal is not None else None)
    say(args, f"sparse low gear: one-token steps keep {100 * info['kept_fraction']:.1f}% of the FFN blocks "
              f"(target sparsity {args.sparse_gear:g})")


def check_sparse_calibration(args: argparse.Namespace) -> None:
    """``--draft-sparsity`` with a ``--calibration`` file read as is: the file must hold the sparse drafter's
    thresholds (one error naming both flags, before the model loads)."""
    if getattr(args, "draft_sparsity", None) is None or not getattr(args, "calibration", None) or args.calibrate:
        return
    if THRESHOLDS_KEY not in Calibration.load(args.calibration).extra:
        raise ValueError(f"--calibration {args.calibration} has no sparse-drafter thresholds for --draft-sparsity "
                         "(each layer's kept fraction per mass share): add them with --calibrate --speculative "
                         f"--draft-sparsity {args.draft_sparsity} --calibration {args.calibration}, or drop --calibration")


def calibrate_sparse(args: argparse.Namespace, model: Any, tokenizer: Any, gearbox: Any) -> None:
    """``--calibrate --speculative --draft-sparsity``: the sparse drafter's thresholds (median-based, on the
    evaluation text's opening) into the gearbox's calibration (and its file)."""
    draft = get_draft(model, gearbox, args.draft_gear, args.draft_scope)
    group = quant_parts(ffn_layers(draft.module)[0].mlp.down_proj).group_size
    say(args, "calibrating the sparse drafter's thresholds ...")
    masses = layer_masses(draft.module, calibration_tokens(tokenizer), group)
    gearbox.calibration.extra[THRESHOLDS_KEY] = threshold_curves(masses, group)


def calibrate_drafter(args: argparse.Namespace, model: Any, tokenizer: Any, gearbox: Any) -> None:
    """``--calibrate`` with ``--speculative``: the drafter's entropy stop and block cap, measured
    by replaying the model's own continuations, into the gearbox's calibration (and its file)."""
    ranks = gearbox.ranks  # a sharded model: measured choices are rank 0's, every rank takes them
    draft = get_draft(model, gearbox, args.draft_gear, args.draft_scope)
    say(args, "calibrating the draft stop and block cap ...")
    block = calibrate_draft_stop(model, draft, tokenizer, "replay",
                                 sampler=ranks.exchange.greedy_sampler() if ranks and ranks.exchange else None)
    block = ranks.first(block) if ranks else block
    gearbox.calibration.extra.setdefault(CALIBRATION_KEY, {})[args.draft_gear] = block


def speculative_lines(summary: Dict[str, Any]) -> List[str]:
    """The summary lines of a speculative run (its ``"speculative"`` block)."""
    s = summary["speculative"]
    config = SpeculativeConfig(**{k: v for k, v in s["config"].items() if k in SpeculativeConfig.__dataclass_fields__})
    rate = s["acceptance_rate"]
    mem = s.get("memory") or {}
    stop = "off" if config.draft_entropy_stop is None else f"{config.draft_entropy_stop:.3f} bits"
    lines = [
        f"Speculative: {s['draft_gear']} gear drafts ({s['draft_bits']}-bit, scope {s['draft_scope']}), "
        f"high verifies; max draft {config.max_draft}, entropy stop {stop}"
        if (s.get("drafter") or {}).get("path") != "none" else
        f"Speculative: no drafts, the high gear decoded alone (the {s['draft_gear']} gear, "
        f"{s['draft_bits']}-bit, would have drafted)",
        _drafter_line(s.get("drafter") or {}),
        f"Blocks: {s['blocks']}; drafted {s['drafted']}, accepted {s['accepted']} "
        f"(acceptance {'n/a' if rate is None else f'{100 * rate:.1f}%'}); "
        f"mean accepted length {s['mean_accepted_length']:.2f}, tokens per block {s['tokens_per_block']:.2f}",
        "Block ends: " + ", ".join(f"{k} {v}" for k, v in s["stops"].items()),
    ]
    if mem:
        lines.append(
            f"Resident: {mib(mem['resident_total'])} (model {mib(mem['high_bytes'])} "
            f"+ gear store {mib(mem.get('store_bytes', 0))} + drafter's own {mib(mem['extra_bytes'])}; "
            f"the drafter shares {mib(mem['shared_bytes'])})"
        )
    d = summary.get("distributed")
    if d:
        lines.append(f"Ranks: {d['ranks']} (tensor parallel, this summary is rank 0's); drafts and verdicts: rank "
                     f"0's, {d['decision_collectives']} collectives for {d['forward_steps']} forward passes")
    plan = s.get("plan")
    if plan:
        v = "/".join(f"{x:.2f}" for x in plan["verify_cost"][1:])
        gated = plan.get("gated")
        low = plan.get("speedup_low")
        plain = (f"within the timing noise of {plan['threshold']:.2f}x (lower quartile {low:.2f}x): decoded plainly"
                 if low is not None and plan["best_speedup"] >= plan["threshold"]
                 else f"below {plan['threshold']:.2f}x: decoded plainly")
        lines.append(
            f"Decision ({plan['mode']}): c {plan['draft_cost']:.2f}, v(k) {v}"
            + ("" if plan.get("costs_age_s") is None else f" (as measured {plan['costs_age_s']:.0f} s earlier)")
            + f", alpha {plan['alpha']:.2f} "
            f"({plan['alpha_source']}); modeled fixed {plan['fixed']['speedup']:.2f}x (k={plan['fixed']['k']})"
            + (f", gated {gated['speedup']:.2f}x (k<={gated['k']}, stop {gated['stop_bits']:.2f} bits)"
               if gated else ", gated: no statistics")
            + " -> " + {"plain": plain,
                        "fixed": f"fixed blocks of {plan['best_k']}",
                        "gated": f"gated blocks of up to {plan['best_k']}"}[plan["choice"]])
        cands = (plan.get("extra") or {}).get("sparse_candidates")
        if cands:
            chosen = plan["extra"].get("draft_sparsity")
            lines.append("Draft sparsity (auto): " + ", ".join(
                f"{name} {c['speedup']:.2f}x (alpha {c['alpha']:.2f}, step {c['draft_ms']:.1f} ms)"
                for name, c in cands.items()) + f" -> {'dense' if chosen is None else f'{chosen:g}'}")
    return lines


def _drafter_line(d: Dict[str, Any]) -> str:
    why = f"; {d['reason']}" if d.get("reason") else ""
    return f"Drafter: {d.get('path', '?')} path ({d.get('detail', '')}{why})"
