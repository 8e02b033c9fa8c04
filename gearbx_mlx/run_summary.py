"""The summary ``python -m gearbx_mlx.generate`` prints after a run, from its record's summary.

One function per line or group of lines: prompt and generation rates (with and
without one-time quantization), gears and shifts, entropy, memory, the bytes a
step reads, the resolver's choices, the KV cache, the ranks of a sharded run.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from .config import GEARS, LITTLE_TO_GAIN
from .console import kv_line, mib
from .speculative.cli import speculative_lines

__all__ = ["format_summary", "memory_line", "ranks_line"]


def _rate(s: Dict[str, Any], phase: str) -> str:
    """mlx-lm's tokens-per-sec, and the rate without one-time quantization inside it."""
    if phase == "generation" and s["generation_tokens"] < 2:
        # mlx-lm's rate starts its clock at the first token, which comes with the prompt
        return "too few tokens to time (the first one is timed with the prompt)"
    line = f"{s[phase + '_tps']:.3f} tokens-per-sec"
    q = s.get(f"{phase}_quantize_seconds") or 0.0
    if q > 0:
        line += f" ({s[phase + '_tps_excluding_quantize']:.3f} without {q:.2f} s of one-time quantization)"
    return line


def _bytes_lines(s: Dict[str, Any]) -> List[str]:
    """A telemetry-only run's resident weights, or the share of a step's bytes that routing can touch."""
    model = s.get("model_bytes")
    if s["telemetry_only"]:
        return [f"Model weights resident: {mib(model)} (telemetry only: {s.get('telemetry_reason')}; "
                "no gear was built, nothing swapped)"] if model is not None else []
    lines = []
    step, share, loaded = s.get("step_bytes"), s.get("managed_share"), s.get("loaded_read_bytes")
    if step and share is not None and loaded:
        low, mid = step["low"] / step["high"], step["mid"] / step["high"]
        line = (f"Bytes per step: the gears manage {100 * share:.0f}% of the {mib(loaded)} a step of the "
                f"loaded model reads "
                f"(--scope {s.get('scope')}); low reads {low:.2f}x, mid {mid:.2f}x the high gear's")
        if low >= LITTLE_TO_GAIN:
            other = s.get("managed_share_scope_all")
            line += ("; little to gain from routing" + (
                f": --scope all manages {100 * other:.0f}%" if other is not None and s.get("scope") != "all"
                else ": unmanaged layers dominate each step"))
        lines.append(line)
    return lines


def format_summary(s: Dict[str, Any], thresholds: Sequence[float]) -> str:
    """The summary printed after a run, from its record's summary (routed or speculative)."""
    g = s["tokens_per_gear"]
    n = max(s["generation_tokens"], 1)
    mean = s["mean_entropy"]
    speculative = s.get("mode") == "speculative"
    gears = "Gears: " + ", ".join(f"{k} {v} ({100 * v / n:.0f}%)" for k, v in g.items())
    if speculative:
        gears += " (an accepted draft counts as its draft gear; the high gear verified every token)"
    else:
        gears += f"; shifts: {s['shifts']}" + (" (telemetry only: nothing swapped)" if s["telemetry_only"] else "")
    lines = [
        f"Prompt: {s['prompt_tokens']} tokens, {_rate(s, 'prompt')}",
        f"Generation: {s['generation_tokens']} tokens, {_rate(s, 'generation')}",
        f"Peak memory: {s['peak_memory_gb']:.3f} GB",
        gears,
        f"Entropy: mean {mean:.3f} bits; thresholds low {thresholds[0]:.3f} / high {thresholds[1]:.3f} bits"
        if mean is not None else "Entropy: no tokens",
    ]
    lines += speculative_lines(s) if speculative else _routed_lines(s)
    if s.get("resolution") and not s.get("telemetry_only"):  # telemetry only: nothing was resolved into gears
        lines.append(_resolution_line(s["resolution"]))
    if s.get("kv_cache"):
        kv = s["kv_cache"]
        lines.append(kv_line(kv) + (f" ({kv['caches']})" if kv.get("caches") else "") + _kv_held_text(kv))
    if s.get("nonfinite_steps"):
        lines.append(f"Non-finite logits: {s['nonfinite_steps']} steps (NaN or infinity; the NaN guard replaced "
                     "them, so those steps' text and entropy mean nothing)")
    if s["interrupted"]:
        lines.append("Interrupted.")
    return "\n".join(lines)


def _kv_held_text(kv: Dict[str, Any]) -> str:
    if kv.get("held_tokens") is None:
        return ""
    if kv["quantized_tokens"]:
        return f"; this run's cache held {kv['held_tokens']} tokens, all quantized"
    return (f"; this run's cache held {kv['held_tokens']} tokens, none quantized (it stays float below token "
            f"{kv['quantized_kv_start']}: --quantized-kv-start)")


def _resolution_line(r: Dict[str, Any]) -> str:
    why = r.get("why", {})
    parts = [f"{k} {r[k]} ({why.get(k, '')})" for k in ("store", "kernel", "scope") if k in r]
    parts += [f"{g} gear: {why[g]}" for g in ("mid", "low") if g in why]
    return "Resolved: " + "; ".join(parts)


def _routed_lines(s: Dict[str, Any]) -> List[str]:
    """The routed run's lines: time quantizing and swapping, shift costs, memory, bytes, ranks."""
    lines = []
    if not s["telemetry_only"]:
        lines.append(
            f"Time quantizing: {1e3 * s['quantize_seconds']:.1f} ms, swapping: {1e3 * s['swap_seconds']:.2f} ms")
    if s.get("low_quant") not in (None, "rtn"):
        how = f"built in {s['low_quant_seconds']:.1f} s" if s.get("low_quant_seconds") else "read from the planes cache"
        lines.append(f"Low gear: mlx-lm's {s['low_quant'].upper()} (--low-quant), {how}")
    costs = []
    for g, e in s.get("entries", {}).items():
        parts = [f"quantized once in {1e3 * e['quantize_seconds']:.1f} ms"] if e["quantize_seconds"] else []
        if e["entries"]:
            n = e["entries"]
            parts.append(f"{n} {'entry' if n == 1 else 'entries'}, median swap {1e3 * e['swap_median_seconds']:.2f} ms")
        if parts:
            costs.append(f"{g}: " + ", ".join(parts))
    if costs:
        lines.append("Shift cost: " + "; ".join(costs))
    if not s["telemetry_only"]:
        lines.append(memory_line(s["memory"], s.get("store", "separate"), s.get("high", "original")))
    lines += _bytes_lines(s)
    if s.get("distributed"):
        lines.append(ranks_line(s["distributed"]))
    return lines


def ranks_line(d: Dict[str, Any]) -> str:
    """One line: a sharded run's ranks, its decision collectives and whether the ranks agreed."""
    per = d.get("collectives_per_step")
    median = d.get("exchange_seconds_median")
    steps = d["steps_ranks_agree"] + d["steps_ranks_differ"]
    return (f"Ranks: {d['ranks']} (tensor parallel, this summary is rank 0's); gear decisions: rank 0's, "
            f"{d['decision_collectives']} collectives for {d['forward_steps']} forward steps"
            + (f" ({per:.2f} per step)" if per is not None else "")
            + (f", median wait {1e3 * median:.3f} ms" if median is not None else "")
            + f"; every rank's own token and entropy equal to rank 0's at {d['steps_ranks_agree']} of {steps} steps")


def memory_line(mem: Dict[str, Any], store: str, high: str) -> str:
    """One line: what the managed layers hold, and what each built gear reads."""
    mib = 2**20
    gears = ", ".join(f"{g} {mem[f'{g}_bytes'] / mib:.1f}" for g in GEARS if f"{g}_bytes" in mem)
    ratio = f" = {mem['resident_total'] / mem['fp16_bytes']:.2f}x their float16 bytes" if mem.get("fp16_bytes") else ""
    where = (f"nested planes, high = {'all planes' if high == 'planes' else 'the loaded weights'}"
             if store == "nested" else "separate copies beside the loaded weights")
    return (f"Managed layers: {mem['resident_total'] / mib:.1f} MiB resident{ratio} ({where}; "
            f"unified memory: nothing is offloaded); read per step, MiB: {gears}")
