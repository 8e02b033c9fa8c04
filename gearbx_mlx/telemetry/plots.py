"""PNG figures of traces (the ``plot`` extra): §17's figures 5 and 8 for real runs.

* ``<label>_routing.png`` (figure 5): per-token entropy, its rolling mean and
  the thresholds, over bands coloured by the gear in force; for remote
  traces the band between the lower and upper entropy bounds.
* ``<label>_entropy_by_gear.png``: histograms of entropy, one per gear.
* with several traces, ``gear_distribution.png`` (figure 8: share of tokens
  per gear, per trace) and ``entropy_overlay.png`` (entropy per token of
  every trace on one axis: the entropy shift between two models).

matplotlib is imported only when a figure is drawn, with the Agg backend (no
display needed).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Sequence, Union

from ..config import GEARS
from ..plotting import require_matplotlib
from .trace import Trace

GEAR_COLORS = {"low": "#2ca02c", "mid": "#ff7f0e", "high": "#d62728"}


#: Opacity of the gear bands (the key's swatches use the same).
BAND_ALPHA = 0.15


def routing_figure(plt: Any, trace: Trace, label: str) -> Any:
    """Figure 5 for one trace: entropy over bands of the gear in force, with a
    key for every line, threshold and gear colour."""
    from matplotlib.patches import Patch

    toks = trace.tokens
    x = list(range(len(toks)))
    fig, ax = plt.subplots(figsize=(10, 3.6))
    start = 0
    for i in range(1, len(toks) + 1):
        if i == len(toks) or toks[i]["gear"] != toks[start]["gear"]:
            ax.axvspan(start - 0.5, i - 0.5, color=GEAR_COLORS[toks[start]["gear"]], alpha=BAND_ALPHA, lw=0)
            start = i
    ent = [t["entropy"] if t["entropy"] is not None else float("nan") for t in toks]
    if any("entropy_upper" in t for t in toks):
        up = [t.get("entropy_upper", float("nan")) for t in toks]
        ax.fill_between(x, ent, up, color="0.5", alpha=0.3, step="mid", label="lower..upper bound")
    ax.plot(x, ent, ".-", color="0.2", lw=0.8, ms=3, label="entropy")
    sm = [t.get("smoothed_entropy") for t in toks]
    if any(v is not None for v in sm):
        ax.plot(x, [v if v is not None else float("nan") for v in sm], color="C0", lw=1.5, label="rolling mean")
    th = trace.header.get("thresholds") or {}
    for name in ("low", "high"):
        if isinstance(th.get(name), (int, float)):
            ax.axhline(th[name], color=GEAR_COLORS[name], ls="--", lw=1, label=f"{name} threshold")
    ax.set_xlabel("token")
    ax.set_ylabel("entropy (bits)")
    ax.set_title(f"{label}: routing trace (bands: gear in force)")
    handles, _ = ax.get_legend_handles_labels()
    present = {t["gear"] for t in toks}
    handles += [Patch(color=GEAR_COLORS[g], alpha=BAND_ALPHA, label=f"{g} gear") for g in GEARS if g in present]
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    fig.tight_layout()
    return fig


def _routing(plt: Any, trace: Trace, label: str, out: Path) -> Path:
    fig = routing_figure(plt, trace, label)
    path = out / f"{label}_routing.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _histograms(plt: Any, trace: Trace, label: str, out: Path) -> Path:
    vals = {g: [t["entropy"] for t in trace.tokens if t["gear"] == g and t["entropy"] is not None] for g in GEARS}
    allv = [v for vs in vals.values() for v in vs]
    top = max(allv) if allv else 1.0
    bins = [top * i / 30 for i in range(31)] if top > 0 else 10
    fig, axes = plt.subplots(1, len(GEARS), figsize=(10, 3), sharex=True)
    for ax, g in zip(axes, GEARS):
        ax.hist(vals[g], bins=bins, color=GEAR_COLORS[g])
        ax.set_title(f"{g} ({len(vals[g])} tokens)")
        ax.set_xlabel("entropy (bits)")
    axes[0].set_ylabel("tokens")
    fig.suptitle(f"{label}: entropy by gear")
    fig.tight_layout()
    path = out / f"{label}_entropy_by_gear.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _distribution(plt: Any, results: Sequence[Dict[str, Any]], labels: List[str], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(labels) + 2), 3.5))
    bottom = [0.0] * len(labels)
    for g in GEARS:
        share = [r["tokens_per_gear"][g] / r["tokens"] if r["tokens"] else 0.0 for r in results]
        ax.bar(labels, share, bottom=bottom, color=GEAR_COLORS[g], label=g)
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set_ylabel("share of tokens")
    ax.set_title("gear distribution")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=7)
    fig.tight_layout()
    path = out / "gear_distribution.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _overlay(plt: Any, traces: Sequence[Trace], labels: List[str], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for t, lab in zip(traces, labels):
        ax.plot([r["entropy"] if r["entropy"] is not None else float("nan") for r in t.tokens], ".-",
                lw=0.8, ms=3, label=lab)
    ax.set_xlabel("token")
    ax.set_ylabel("entropy (bits)")
    ax.set_title("entropy per token")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "entropy_overlay.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(traces: Sequence[Trace], result: Dict[str, Any], out_dir: Union[str, Path]) -> List[Path]:
    """Write every figure for ``traces`` (and their :func:`analyze` result) into ``out_dir``."""
    plt = require_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Labels become file names: keep them portable.
    labels = [re.sub(r"[^A-Za-z0-9._-]+", "_", r["label"]) for r in result["traces"]]
    if len(set(labels)) < len(labels):
        labels = [f"{i}_{lab}" for i, lab in enumerate(labels)]
    files: List[Path] = []
    for t, lab in zip(traces, labels):
        files += [_routing(plt, t, lab, out), _histograms(plt, t, lab, out)]
    if len(traces) > 1:
        files += [_distribution(plt, result["traces"], labels, out), _overlay(plt, traces, labels, out)]
    return files
