"""Ablation of the sparse drafter's mechanisms, dense and sparse drafters in one run; print a table, write JSON.

Drafters (the low gear, 4-bit g64, scope all; the sparse ones at ``--sparsity``):
  * ``dense-host``: the default fast drafter (numpy decode step around the C GEMV);
  * ``dense-tree``: the dense drafter in the MLX module tree (the sparse drafters' reference path);
  * ``sparse``: no hot set (every kept block gathered, :class:`SparseMLP`);
  * ``static``: a static hot set (the blocks kept most often on the calibration text), packed;
  * ``tam``: TAM hot sets (momentum, one-hit filter, budget), refreshed online;
  * ``tam+pred-all``: the predictor's path with every block a candidate (a control, see :func:`variants`);
  * ``tam+pred``: and the next-layer predictor (gate/up for the predicted blocks only);
  * ``tam+pred+bal``: and the balancer holding ``--target`` acceptance.

Measured per drafter, interleaved (each repeat runs all drafters in turn, each
mechanism variant freshly built so that its online state starts alike):
  * modeled weight bytes per one-token draft step: every managed linear's
    low-gear bytes, down_proj for its kept blocks and gate/up for the rows
    computed (as measured over the run; the hot copies' repacking amortized);
  * one draft step's time (median of ``--steps`` one-token steps on a warm cache);
  * acceptance and end-to-end tokens/s of greedy speculative decoding
    (``--tokens`` tokens, blocks of ``--max-draft``), from the pipeline's responses;
  * agreement: one-token steps along ``--positions`` tokens of the evaluation text (past the
    calibration tokens), the share where the drafter's greedy token is the high gear's: the
    deterministic measure of a drafter's quality (the acceptance of a few dozen tokens is noisy);
  * kept fraction, hot-set hit rate; the predictor's hit rate from a separate
    audited run (the audit computes the dense activation too, so it is not timed).

Run with OpenBLAS preloaded, as the CPU benchmarks are:
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      python scripts/bench_sparse_ablation.py [--model NAME] [--repeats 2] [--out benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from typing import Any, Dict, List, Optional

import mlx.core as mx
from bench_sparse_drafter import speculative_run, time_step
from mlx_lm.models.cache import make_prompt_cache

from gearbx_mlx.chat import encode_chat
from gearbx_mlx.evaluation.machine import load_average, write_result
from gearbx_mlx.evaluation.text import read_text, text_tokens
from gearbx_mlx.generation import load
from gearbx_mlx.precision import nbytes
from gearbx_mlx.speculative.decode import SpeculativeConfig, get_draft
from gearbx_mlx.speculative.kairox import KairoxOptions, build_kairox_draft
from gearbx_mlx.speculative.sparse import build_sparse_draft, calibration_tokens, ffn_layers, quant_parts

PROMPT = "Describe a walk along a river on an autumn morning."
#: The agreement positions start this far into the evaluation text (past the calibration tokens).
AGREEMENT_FROM = 1000


def variants(target: float, candidates: float) -> Dict[str, Optional[KairoxOptions]]:
    """name -> mechanisms (None: the plain sparse drafter; the dense ones are added apart).

    ``tam+pred-all`` is a control: the predictor's path with every block a candidate (no gate/up
    saved), which separates the effect of its kernel (gate/up through ``mx.gather_qmm`` on plane 0
    instead of the gear's own product) from the effect of predicting."""
    tam = KairoxOptions(hot="tam")
    pred = dataclasses.replace(tam, predictor=True, candidates=candidates)
    return {"sparse": None, "static": KairoxOptions(hot="static"), "tam": tam,
            "tam+pred-all": dataclasses.replace(pred, candidates=1e6), "tam+pred": pred,
            "tam+pred+bal": dataclasses.replace(pred, balancer=True, target_acceptance=target)}


def linear_bytes(module: Any) -> int:
    try:
        q = quant_parts(module)
        return q.weight.nbytes + q.scales.nbytes + q.biases.nbytes
    except ValueError:
        return nbytes(module)


def step_bytes(draft: Any, summary: Optional[Dict[str, Any]], tokens: int) -> int:
    """Weight bytes of one one-token draft step: managed layers, down_proj's kept blocks and gate/up's
    computed rows only (``summary``: the mechanisms' totals over a run of ``tokens`` drafts)."""
    mods = dict(draft.module.named_modules())
    total = sum(linear_bytes(mods[p]) for p in draft.paths)
    if not draft.sparse:
        return int(total)
    kept = summary["kept_fraction"] if summary and summary["kept_fraction"] is not None else draft.sparse["kept_fraction"]
    total -= draft.sparse["down_bytes"] * (1 - kept)
    if summary and summary.get("gate_up_fraction") is not None:
        gate_up = sum(linear_bytes(layer.mlp.gate_proj) + linear_bytes(layer.mlp.up_proj)
                      for layer in ffn_layers(draft.module))
        total -= gate_up * (1 - summary["gate_up_fraction"])
    if summary and tokens:
        total += summary["repacked_bytes"] / tokens
    return int(total)


def agreement(draft: Any, ids: List[int], high: List[int], start: int) -> float:
    """Share of positions past ``start`` where the drafter's greedy token, fed ``ids`` one token per step
    (its one-token path), equals the high gear's (``high``, teacher-forced on the same ids)."""
    cache = draft.make_cache() if draft.host is not None else make_prompt_cache(draft.module)
    draft(mx.array(ids[:start])[None], cache=cache)
    hits = 0
    for i in range(start, len(ids)):
        hits += int(mx.argmax(draft(mx.array([[ids[i]]]), cache=cache)[0, -1])) == high[i]
    return hits / (len(ids) - start)


def generate(model: Any, tok: Any, gearbox: Any, ids: List[int], draft: Any, n: int, k: int) -> Dict:
    return speculative_run(model, tok, gearbox, ids, draft, n, SpeculativeConfig(max_draft=k))


def spread(xs: List[float]) -> Dict[str, Any]:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs} if xs else {}


def build(name: str, options: Optional[KairoxOptions], dense: Any, sparsity: float, calib: List[int]) -> Any:
    if name == "dense-host":
        return dense
    if name == "dense-tree":
        return build_sparse_draft(dense, 0.0, calib)
    if options is None:
        return build_sparse_draft(dense, sparsity, calib)
    return build_kairox_draft(dense, sparsity, calib, options)


def measure(args: argparse.Namespace) -> Dict:
    model, tok, gearbox = load(args.model)
    ids = encode_chat(tok, PROMPT)
    dense = get_draft(model, gearbox, "low", "all")
    calib = calibration_tokens(tok)
    text, _ = read_text(None)
    forced = text_tokens(tok, text, AGREEMENT_FROM + args.positions + 8)[AGREEMENT_FROM:]  # past the calibration
    high = mx.argmax(model(mx.array(forced)[None])[0], axis=-1).tolist()
    table = {"dense-host": None, "dense-tree": None, **variants(args.target, args.candidates)}
    runs: Dict[str, Dict[str, List[Any]]] = {n: {k: [] for k in ("step_s", "acceptance", "tokens_per_s", "bytes",
                                                               "kept", "hot_hit", "agreement")}
                                               for n in table}
    texts: Dict[str, List[int]] = {}
    info: Dict[str, Dict[str, Any]] = {}
    for rep in range(args.repeats):
        for name, options in table.items():
            draft = build(name, options, dense, args.sparsity, calib)
            r = runs[name]
            if rep == 0:  # deterministic: once is enough (its steps also warm the online state up alike)
                r["agreement"].append(agreement(draft, forced, high, 8))
                draft = build(name, options, dense, args.sparsity, calib)
            g = generate(model, tok, gearbox, ids, draft, args.tokens, args.max_draft)
            s = draft.kairox.summary() if draft.kairox is not None else None
            r["step_s"].append(time_step(draft, ids, args.steps))
            r["acceptance"].append(g["acceptance"])
            r["tokens_per_s"].append(g["tokens_per_s"])
            r["bytes"].append(step_bytes(draft, s, g["drafted"]))
            r["kept"].append(s["kept_fraction"] if s else (draft.sparse or {}).get("kept_fraction", 1.0))
            r["hot_hit"].append(s["hot_hit_rate"] if s else None)
            texts.setdefault(name, g["tokens"])
            info[name] = {"mechanisms": dataclasses.asdict(options) if options else None,
                          "path": "host" if draft.host is not None else "mlx",
                          "summary": {k: v for k, v in (s or {}).items() if k != "keep"} or None}
            print(f"repeat {rep + 1} {name:<14} step {1e3 * r['step_s'][-1]:6.1f} ms  acceptance "
                  f"{g['acceptance'] or 0:.3f}  {g['tokens_per_s']:.2f} tok/s  {r['bytes'][-1] / 1e6:.2f} MB  "
                  f"kept {r['kept'][-1]:.3f}", flush=True)
    out = {name: {**info[name], **{k: spread(v) for k, v in runs[name].items()}} for name in table}
    for name, options in table.items():  # the predictor's hit rate, audited (untimed)
        if options is not None and options.predictor:
            draft = build(name, dataclasses.replace(options, audit=True), dense, args.sparsity, calib)
            generate(model, tok, gearbox, ids, draft, args.tokens, args.max_draft)
            out[name]["predictor_hit_rate"] = draft.kairox.summary()["predictor_hit_rate"]
    return {"prompt": PROMPT, "sparsity": args.sparsity, "tokens": args.tokens, "repeats": args.repeats,
            "steps": args.steps, "max_draft": args.max_draft, "target_acceptance": args.target,
            "candidates": args.candidates, "agreement_positions": args.positions,
            "outputs_identical": len({tuple(t) for t in texts.values()}) == 1, "drafters": out}


def table(r: Dict) -> str:
    lines = [f"{'drafter':<14} {'kept':>5} {'MB/step':>8} {'step ms':>7} {'accept':>6} {'tok/s':>6} "
             f"{'hot hit':>7} {'pred hit':>8} {'agree':>6}"]
    for name, d in r["drafters"].items():
        hh, ph = d["hot_hit"].get("median"), d.get("predictor_hit_rate")
        lines.append(f"{name:<14} {d['kept']['median']:5.2f} {d['bytes']['median'] / 1e6:8.2f} "
                     f"{1e3 * d['step_s']['median']:7.1f} {d['acceptance']['median']:6.3f} "
                     f"{d['tokens_per_s']['median']:6.2f} {'' if hh is None else f'{hh:.3f}':>7} "
                     f"{'' if ph is None else f'{ph:.3f}':>8} {d['agreement']['median']:6.3f}")
    lines.append(f"greedy outputs identical across drafters: {r['outputs_identical']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model name or folder (default: the default model)")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--target", type=float, default=0.5, help="the balancer's target acceptance")
    p.add_argument("--candidates", type=float, default=1.15,
                   help="blocks the predictor computes gate/up for, as a multiple of the kept blocks")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=16, help="draft steps timed per repeat")
    p.add_argument("--tokens", type=int, default=40, help="tokens generated per speculative run")
    p.add_argument("--max-draft", type=int, default=4)
    p.add_argument("--positions", type=int, default=96, help="one-token steps of the agreement measurement")
    p.add_argument("--out", default="benchmarks/results/sparse_ablation_cpu.json")
    a = p.parse_args(argv)
    load_before = load_average()
    r = measure(a)
    print(table(r))
    r.update(model=a.model or "SmolLM2-135M-Instruct (default, float32)")
    write_result(a.out, r, "python scripts/bench_sparse_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 load_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
