"""Where GPTQ's low plane beats round-to-nearest and where it loses, layer by layer.

    python scripts/diagnose_gptq_layers.py [--model NAME] [--scope attention|all] [--tokens 512]
                                          [--out FILE.json]

Builds plane 0 of the managed linears both ways (``mx.quantize`` and mlx-lm's GPTQ on the
package's calibration text, :mod:`gearbx_mlx.nested.lowquant`), records each layer's inputs
in the loaded model on ``--tokens`` of the calibration text (``lee.cor``) and of the
evaluation text (``lee_background.cor``), and reports each layer's relative output error
``|X (W - W_low)^T|^2 / |X W^T|^2`` both ways, grouped by projection (GPTQ minimizes
exactly this on its calibration inputs), with and without each window's first position
(an attention sink whose inputs can dominate the Hessian). Then the same error on the inputs
each layer sees in the low gear itself (every managed layer at its low-plane values), the
weight error ``|W - W_low|^2 / |W|^2``, and the low gear's mean KL(loaded || low) over the
evaluation tokens: where GPTQ has the smaller error on the loaded model's inputs and the larger
KL, its error grows with the inputs the other low layers perturb.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent


def _inputs(model: Any, paths: List[str], windows: List[List[int]]) -> Dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    class Rec(nn.Module):
        def __init__(self, layer: Any) -> None:
            super().__init__()
            self.layer, self.seen = layer, []

        def __call__(self, x: Any) -> Any:
            self.seen.append(x.reshape(-1, x.shape[-1]))
            return self.layer(x)

    mods = dict(model.named_modules())
    recs = {p: Rec(mods[p]) for p in paths}
    model.update_modules(tree_unflatten(list(recs.items())))
    for w in windows:
        mx.eval(model(mx.array(w)[None]))
    model.update_modules(tree_unflatten([(p, r.layer) for p, r in recs.items()]))
    return {p: mx.concatenate(r.seen) for p, r in recs.items()}


def main(argv: Optional[List[str]] = None) -> int:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm import load as mlx_load

    from gearbx_mlx.evaluation.harness import text_tokens
    from gearbx_mlx.evaluation.machine import hardware, load_average
    from gearbx_mlx.nested.lowquant import calibration_tokens, low_planes
    from gearbx_mlx.nested.planes import quantize_plane
    from gearbx_mlx.sources.models import corpus_path, resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--scope", default="attention", choices=("attention", "all"))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    before = load_average()
    model, tok = mlx_load(resolve_model(args.model))
    paths = [q for q, m in model.named_modules() if type(m) is nn.Linear
             and (args.scope == "all" or ".self_attn." in q)]
    cal = calibration_tokens(tok)
    gptq = low_planes(model, paths, "gptq", cal)
    mods = dict(model.named_modules())

    def deq(pl: Any) -> Any:
        return mx.dequantize(pl.weight, pl.scales, pl.biases, pl.group_size, pl.bits)

    texts = {"calibration (lee.cor)": cal.reshape(-1).tolist()[: args.tokens],
             "evaluation (lee_background)": text_tokens(tok, corpus_path("lee_background").read_text(encoding="utf-8"),
                                                        args.tokens)}
    rows: Dict[str, Dict[str, Any]] = {}
    for name, ids in texts.items():
        windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
        xs = _inputs(model, paths, windows)
        first = mx.array([i % args.window == 0 for i in range(sum(len(w) for w in windows))])
        for q in paths:
            w = mods[q].weight
            x = xs[q]
            ref = x @ w.T
            for way, wl in (("rtn", deq(quantize_plane(w, 4, 64))), ("gptq", deq(gptq[q]))):
                e = ((x @ (w - wl).T) ** 2).sum(axis=-1)
                r = (ref ** 2).sum(axis=-1)
                kind = q.rsplit(".", 1)[-1]
                d = rows.setdefault(name, {}).setdefault(kind, {}).setdefault(way, {"err": 0.0, "ref": 0.0,
                                                                                    "err_rest": 0.0, "ref_rest": 0.0})
                d["err"] += e.sum().item()
                d["ref"] += r.sum().item()
                d["err_rest"] += mx.where(first, 0, e).sum().item()
                d["ref_rest"] += mx.where(first, 0, r).sum().item()
            norms = mx.sqrt((x ** 2).sum(axis=-1))
            d = rows[name][kind].setdefault("input_norm", {"first": 0.0, "rest": 0.0, "n": 0})
            d["first"] += mx.where(first, norms, 0).sum().item() / max(len(windows), 1)
            d["rest"] += mx.where(first, 0, norms).sum().item() / max(x.shape[0] - len(windows), 1)
            d["n"] += 1
    ids = texts["evaluation (lee_background)"]
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    ref_logits = [model(mx.array(w)[None])[0] for w in windows]
    own: Dict[str, Any] = {}
    for way, planes in (("rtn", {q: quantize_plane(mods[q].weight, 4, 64) for q in paths}), ("gptq", gptq)):
        low = []
        for q in paths:
            lin = nn.Linear(1, 1, bias="bias" in mods[q])
            lin.update(mods[q].parameters())
            lin.weight = deq(planes[q])
            low.append((q, lin))
        model.update_modules(tree_unflatten(low))
        xs = _inputs(model, paths, windows)
        kl = []
        for w, r in zip(windows, ref_logits):
            lp, lq = nn.log_softmax(r, axis=-1), nn.log_softmax(model(mx.array(w)[None])[0], axis=-1)
            kl.append((mx.exp(lp) * (lp - lq)).sum(axis=-1))
        model.update_modules(tree_unflatten([(q, mods[q]) for q in paths]))
        per: Dict[str, Dict[str, float]] = {}
        for q in paths:
            w, wl, x = mods[q].weight, deq(planes[q]), xs[q]
            d = per.setdefault(q.rsplit(".", 1)[-1], {"err": 0.0, "ref": 0.0, "werr": 0.0, "wref": 0.0})
            d["err"] += ((x @ (w - wl).T) ** 2).sum().item()
            d["ref"] += ((x @ w.T) ** 2).sum().item()
            d["werr"] += ((w - wl) ** 2).sum().item()
            d["wref"] += (w ** 2).sum().item()
        own[way] = {"kl_nats": mx.concatenate(kl).mean().item(),
                    "by_projection": {k: {"relative_error_own_inputs": d["err"] / d["ref"],
                                          "relative_weight_error": d["werr"] / d["wref"]} for k, d in per.items()}}
    print(f"low gear KL(loaded || low) on the evaluation text: rtn {own['rtn']['kl_nats']:.4f}, "
          f"gptq {own['gptq']['kl_nats']:.4f}")
    for k in own["rtn"]["by_projection"]:
        r, g = own["rtn"]["by_projection"][k], own["gptq"]["by_projection"][k]
        print(f"  {k:<10} own-input error rtn {r['relative_error_own_inputs']:.2e} gptq "
              f"{g['relative_error_own_inputs']:.2e}; weight error rtn {r['relative_weight_error']:.2e} "
              f"gptq {g['relative_weight_error']:.2e}")
    out: Dict[str, Any] = {}
    print(f"{'text':<28} {'proj':<10} {'rtn err':>9} {'gptq err':>9} {'gptq/rtn':>8} {'w/o pos 0':>9} "
          f"{'|x| pos0/rest':>13}")
    for name, kinds in rows.items():
        for kind, d in kinds.items():
            rel = {w: d[w]["err"] / d[w]["ref"] for w in ("rtn", "gptq")}
            rest = {w: d[w]["err_rest"] / d[w]["ref_rest"] for w in ("rtn", "gptq")}
            n = d["input_norm"]
            out.setdefault(name, {})[kind] = {"relative_error": rel, "relative_error_without_first_position": rest,
                                              "gptq_over_rtn": rel["gptq"] / rel["rtn"],
                                              "gptq_over_rtn_without_first_position": rest["gptq"] / rest["rtn"],
                                              "input_norm_first_over_rest": n["first"] / n["rest"]}
            print(f"{name:<28} {kind:<10} {rel['rtn']:>9.2e} {rel['gptq']:>9.2e} {rel['gptq'] / rel['rtn']:>8.3f} "
                  f"{rest['gptq'] / rest['rtn']:>9.3f} {n['first'] / n['rest']:>13.1f}")
    result = {"command": "python " + " ".join(["scripts/diagnose_gptq_layers.py"] + (argv or sys.argv[1:])),
              "date": date.today().isoformat(), "model": args.model or "SmolLM2-135M-Instruct (float32, default)",
              "scope": args.scope, "tokens": args.tokens, "window": args.window,
              "load_average_before": before, "load_average_after": load_average(), "hardware": hardware(),
              "layers": len(paths), "by_text_and_projection": out, "in_the_low_gear": own}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
