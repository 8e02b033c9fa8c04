"""Activation sparsity of the low-gear drafter's FFNs (the default model, or ``--model``).

Teacher-forces the first ``--tokens`` tokens of the evaluation text through
the drafter (the model's managed layers in the 4-bit low gear, MLX tree) and
measures, over every layer's hidden activation ``h = silu(gate(x)) * up(x)``:

* concentration: the share of ``sum |h|`` the top 10/25/35/50% of neurons
  carry (and of the blocks of 64 consecutive neurons, the unit the sparse
  drafter keeps or drops);
* the agreement cost: the share of positions where the drafter's greedy
  token equals the high gear's, dense and with the smallest X% of down_proj's
  inputs zeroed per token and layer (X in 25, 50, 70), by neuron and by block;
* temporal locality: the Jaccard index of consecutive tokens' top-10% and
  top-35% neuron sets.

Usage: python scripts/kairox_stats.py [--model NAME] [--tokens 256] [--out benchmarks/results/kairox_stats_default.json]
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from gearbx_mlx.evaluation.machine import load_average, write_result
from gearbx_mlx.evaluation.text import read_text, text_tokens
from gearbx_mlx.generation import load
from gearbx_mlx.speculative.draft import build_draft
from gearbx_mlx.speculative.sparse import ffn_layers, hidden

TOPS = (0.10, 0.25, 0.35, 0.50)
DROPS = (0.0, 0.25, 0.50, 0.70)
GROUP = 64


class Tap(nn.Module):
    """An FFN that records ``h`` and zeroes the smallest ``drop`` of its neurons (or blocks) per row."""

    def __init__(self, mlp: nn.Module, store: List[np.ndarray]) -> None:
        super().__init__()
        self.mlp, self.store = mlp, store
        self.drop, self.unit = 0.0, 1

    def __call__(self, x: mx.array) -> mx.array:
        h = hidden(self.mlp, x)
        if self.drop == 0:
            self.store.append(np.array(h[0], dtype=np.float32))
            return self.mlp.down_proj(h)
        mass = mx.abs(h).reshape(*h.shape[:-1], -1, self.unit).sum(-1)
        k = int(round(self.drop * mass.shape[-1]))
        thr = mx.sort(mass, axis=-1)[..., k - 1 : k]
        keep = mx.repeat((mass > thr).astype(h.dtype), self.unit, axis=-1)
        return self.mlp.down_proj(h * keep)


def concentration(hs: List[np.ndarray], unit: int) -> Dict[str, float]:
    out = {}
    for top in TOPS:
        shares = []
        for h in hs:
            m = np.abs(h).reshape(h.shape[0], -1, unit).sum(-1)
            k = max(1, int(round(top * m.shape[1])))
            s = -np.sort(-m, axis=1)
            shares.append(s[:, :k].sum(1) / s.sum(1))
        out[f"top_{int(top * 100)}"] = float(np.mean(shares))
    return out


def jaccard(hs: List[np.ndarray], top: float) -> float:
    vals = []
    for h in hs:
        k = int(round(top * h.shape[1]))
        idx = np.argpartition(-np.abs(h), k - 1, axis=1)[:, :k]
        sets = np.zeros(h.shape, dtype=bool)
        np.put_along_axis(sets, idx, True, axis=1)
        inter = (sets[1:] & sets[:-1]).sum(1)
        vals.append(inter / (2 * k - inter))
    return float(np.mean(vals))


def measure(tokens: int, model_name: Optional[str] = None) -> Dict:
    model, tokenizer, gearbox = load(model_name)
    draft = build_draft(model, gearbox, "low", "all", host=False)
    text, about = read_text(None)
    ids = text_tokens(tokenizer, text, tokens + 1)
    x = mx.array(ids[:-1])[None]
    target = np.array(mx.argmax(model(x)[0], axis=-1))
    store: List[np.ndarray] = []
    layers = ffn_layers(draft.module)
    taps = [Tap(layer.mlp, store) for layer in layers]
    originals = [layer.mlp for layer in layers]
    for layer, tap in zip(layers, taps):
        layer.mlp = tap
    agreement: Dict[str, Dict[str, float]] = {"neuron": {}, "block": {}}
    try:
        for unit, name in ((1, "neuron"), (GROUP, "block")):
            for drop in DROPS:
                for tap in taps:
                    tap.drop, tap.unit = drop, unit
                got = np.array(mx.argmax(draft.module(x)[0], axis=-1))
                agreement[name][f"drop_{int(drop * 100)}"] = float(np.mean(got == target))
    finally:
        for layer, mlp in zip(layers, originals):
            layer.mlp = mlp
    hs = store[: len(layers)]
    return {
        "text": about["source"], "tokens": tokens, "layers": len(layers), "neurons": int(hs[0].shape[1]),
        "concentration": {"neuron": concentration(hs, 1), "block": concentration(hs, GROUP)},
        "agreement_with_high_gear": agreement,
        "jaccard_consecutive": {"top_10": jaccard(hs, 0.10), "top_35": jaccard(hs, 0.35)},
    }


def table(r: Dict) -> str:
    lines = [f"{r['layers']} layers x {r['neurons']} neurons, {r['tokens']} tokens of {r['text']}",
             "mass carried by the top    " + "  ".join(f"{int(t * 100):>5d}%" for t in TOPS)]
    for unit in ("neuron", "block"):
        c = r["concentration"][unit]
        lines.append(f"  {unit + 's':<24}" + "  ".join(f"{c[f'top_{int(t * 100)}']:6.3f}" for t in TOPS))
    lines.append("greedy agreement, drop    " + "  ".join(f"{int(d * 100):>5d}%" for d in DROPS))
    for unit in ("neuron", "block"):
        a = r["agreement_with_high_gear"][unit]
        lines.append(f"  {unit + 's':<24}" + "  ".join(f"{a[f'drop_{int(d * 100)}']:6.3f}" for d in DROPS))
    j = r["jaccard_consecutive"]
    lines.append(f"Jaccard of consecutive tokens' sets: top 10% {j['top_10']:.3f}, top 35% {j['top_35']:.3f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--model", default=None, help="a model name or folder (default: the default model)")
    p.add_argument("--out", default="benchmarks/results/kairox_stats_default.json")
    a = p.parse_args(argv)
    load_before = load_average()
    r = measure(a.tokens, a.model)
    print(table(r))
    r.update(model=a.model or "SmolLM2-135M-Instruct (default)", drafter="low gear (4-bit g64), scope all, MLX tree")
    write_result(a.out, r, "python scripts/kairox_stats.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 load_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
