"""Figures of an evaluation (the ``plot`` extra: matplotlib).

Three PNGs from the results dictionary alone (so they can be redrawn from
a committed JSON file):

* ``pareto.png``: perplexity and KL to the reference versus modeled weight
  bytes per token, one point per policy;
* ``routing_trace.png``: entropy, smoothed entropy, thresholds and the gear
  bands of one entropy policy over a passage;
* ``workloads.png``: the gear distribution of real generation by workload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from ..plotting import require_matplotlib

GEAR_COLORS = {"low": "#4caf50", "mid": "#ffb300", "high": "#e53935"}
KIND_MARKERS = {"static": "s", "entropy": "o", "mixed": "D", "position": "^", "random": "x"}
SCOPE_COLORS = {"attention": "#1e88e5", "all": "#8e24aa"}
#: KL of the reference is exactly 0: drawn at this floor on the log axis.
KL_FLOOR = 1e-5
#: Speculative rows (quality exact by construction), coloured by drafter gear.
SPECULATIVE_MARKER = "*"


def pareto(results: Dict[str, Any], path: Path) -> Path:
    plt = require_matplotlib()
    rows = results["policies"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, key, label in (
        (axes[0], "perplexity", "perplexity (teacher-forced)"),
        (axes[1], "mean_kl", "mean KL(reference ‖ routed), nats"),
    ):
        def point(r):
            y = r[key] if key != "mean_kl" else max(r[key], KL_FLOOR)
            return r["bytes_per_token"] / 1e6, y

        by_name = {r["name"]: r for r in rows}
        for r in rows:
            spec = r["spec"]
            scope = "all" if spec["kind"] == "static" and spec["gear"] == "high" else spec["scope"]
            x, y = point(r)
            ax.scatter(x, y, marker=KIND_MARKERS[spec["kind"]], color=SCOPE_COLORS[scope], s=48, zorder=3)
            if spec.get("matched_to") in by_name:
                # A baseline: a dotted line to the entropy policy whose budget it matches.
                x0, y0 = point(by_name[spec["matched_to"]])
                ax.plot([x0, x], [y0, y], ls=":", lw=0.8, color=SCOPE_COLORS[scope], zorder=2)
            else:
                ax.annotate(r["name"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        # Speculative rows: the high gear's quality exactly, at their modeled bytes.
        for r in (results.get("speculative") or {}).get("rows", []):
            x = r["modeled"]["bytes_per_token"] / 1e6
            y = r[key] if key != "mean_kl" else max(r[key], KL_FLOOR)
            ax.scatter(x, y, marker=SPECULATIVE_MARKER, color=GEAR_COLORS[r["draft_gear"]], s=60,
                       zorder=3)
            ax.annotate(r["name"].replace("speculative-", "spec-"), (x, y), fontsize=5,
                        xytext=(3, -7), textcoords="offset points", rotation=-30)
        ax.set_xlabel("modeled weight bytes per token (MB, §9 cost model)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    handles = [plt.Line2D([], [], marker=m, ls="", color="gray", label=k) for k, m in KIND_MARKERS.items()]
    handles += [plt.Line2D([], [], marker="o", ls="", color=c, label=f"scope {s}") for s, c in SCOPE_COLORS.items()]
    if (results.get("speculative") or {}).get("rows"):
        handles += [plt.Line2D([], [], marker=SPECULATIVE_MARKER, ls="", color=GEAR_COLORS[g],
                               label=f"speculative, {g} drafter (exact)") for g in ("low", "mid")]
    axes[0].legend(handles=handles, fontsize=7, loc="upper right")
    fig.suptitle(
        f"{results['model'].get('name', 'model')}: quality vs bytes per token "
        f"({results['text']['scored_positions']} scored positions; KL = 0 drawn at {KL_FLOOR:g}; "
        "dotted: baseline matched to an entropy policy's budget)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def routing_trace(results: Dict[str, Any], path: Path, policy: Optional[str] = None, span: int = 200) -> Path:
    """Entropy trace of one entropy policy over the first ``span`` positions."""
    plt = require_matplotlib()
    rows = {r["name"]: r for r in results["policies"]}
    traced = [n for n in results["traces"] if "entropy" in results["traces"][n]]
    if not traced:
        raise ValueError("the results hold no entropy trace (no entropy policy was evaluated)")
    name = policy or max(traced, key=lambda n: rows[n]["shifts"])
    tr = results["traces"][name]
    n = min(span, len(tr["entropy"]))
    low, high = rows[name]["spec"]["thresholds"] or results["thresholds"]["default"]
    fig, ax = plt.subplots(figsize=(13, 4.2))
    x = list(range(n))
    start = 0
    for i in range(1, n + 1):  # one coloured band per run of one gear
        if i == n or tr["gears"][i] != tr["gears"][start]:
            g = {"l": "low", "m": "mid", "h": "high"}[tr["gears"][start]]
            ax.axvspan(start - 0.5, i - 0.5, color=GEAR_COLORS[g], alpha=0.18, lw=0)
            start = i
    ax.plot(x, tr["entropy"][:n], color="0.45", lw=0.8, label="entropy H_t (bits)")
    ax.plot(x, tr["smoothed"][:n], color="black", lw=1.8, label=f"smoothed (window {results['routing']['monitor']['window']})")
    ax.axhline(low, color=GEAR_COLORS["low"], ls="--", lw=1.2, label=f"low threshold {low:.2f}")
    ax.axhline(high, color=GEAR_COLORS["high"], ls="--", lw=1.2, label=f"high threshold {high:.2f}")
    handles, _ = ax.get_legend_handles_labels()
    handles += [plt.Rectangle((0, 0), 1, 1, color=GEAR_COLORS[g], alpha=0.3, label=f"{g} gear") for g in GEAR_COLORS]
    ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper right")
    ax.set_xlabel("position in the first window (teacher-forced; band = gear of that step, lag 0)")
    ax.set_ylabel("bits")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_title(f"gear routing trace: {name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def workloads(results: Dict[str, Any], path: Path) -> Path:
    plt = require_matplotlib()
    data = results.get("workloads")
    if not data:
        raise ValueError("the results hold no workload runs (run with --workload-tokens > 0)")
    names = list(data)
    policies: List[str] = list(next(iter(data.values())))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(names) * len(policies)), 4.6))
    width = 0.8 / len(policies)
    for j, pol in enumerate(policies):
        for i, w in enumerate(names):
            counts = data[w][pol]
            total = sum(counts.values()) or 1
            bottom = 0.0
            for g in ("low", "mid", "high"):
                frac = counts[g] / total
                ax.bar(i + (j - (len(policies) - 1) / 2) * width, frac, width * 0.95, bottom=bottom,
                       color=GEAR_COLORS[g], edgecolor="white", lw=0.5)
                bottom += frac
            ax.text(i + (j - (len(policies) - 1) / 2) * width, 1.01, pol.replace("dynamic-", ""),
                    rotation=90, fontsize=6, ha="center", va="bottom")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylim(0, 1.35)
    ax.set_ylabel("fraction of generated tokens")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c, label=g) for g, c in GEAR_COLORS.items()],
              fontsize=8, loc="upper right")
    ax.set_title("gear distribution by workload (greedy generation with gearbx_mlx.stream_generate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def make_all(results: Dict[str, Any], out_dir: str | Path, prefix: str = "") -> List[Path]:
    """Draw every figure the results support into ``out_dir``; return the files."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FileNotFoundError(f"plot directory does not exist: {out_dir} (create it first)")
    files = [pareto(results, out_dir / f"{prefix}pareto.png")]
    if any("entropy" in t for t in results["traces"].values()):
        files.append(routing_trace(results, out_dir / f"{prefix}routing_trace.png"))
    if results.get("workloads"):
        files.append(workloads(results, out_dir / f"{prefix}workloads.png"))
    return files
