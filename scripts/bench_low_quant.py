"""The nested store's low gear by each quantizer (``--low-quant``): quality, build time, acceptance.

    python scripts/bench_low_quant.py [--quantizers rtn gptq awq dwq] [--scope all] [--tokens 2048]
                                      [--window 512] [--budget 300] [--out FILE.json]

Each quantizer runs in a child process of its own, given ``--budget`` seconds
(a quantizer that does not finish in them is recorded as such, with the
progress its own progress bar had reached), on the default model with the
nested store over ``--scope``'s layers and a planes cache in a fresh folder:

* the time the quantizer took (``PrecisionManager.low_quant_seconds``: its
  calibration tokens and mlx-lm's quantizer; the residual planes excluded),
  and that a second load with the same settings reads the planes cache;
* quality of the low gear (and of the mid gear, planes 0-1) against the
  loaded weights, teacher-forced over ``--tokens`` of gensim's
  ``lee_background`` (the evaluation text; the quantizers calibrate on
  ``lee.cor``): perplexity, mean KL(loaded || gear) in nats and greedy top-1
  agreement, with the evaluation harness's metrics
  (:mod:`gearbx_mlx.evaluation.metrics`), each gear through float layers that
  hold exactly the values its quantized layers multiply by (MLX's quantized
  CPU kernels are far too slow for thousands of positions);
* speculative acceptance with the low plane drafting: greedy blocks of k
  drafts replayed along the text from the low gear's per-position agreement
  with the loaded weights, as the evaluation harness replays its drafters
  (:func:`gearbx_mlx.evaluation.speculative.replay`).

End to end (``--keep-planes DIR`` keeps each quantizer's planes file;
``--speculative-reps N`` then, or later with ``--speculative-only``, runs N
interleaved rounds of speculative generation drafting with each low plane,
one fresh process each): fixed blocks of ``--draft-k`` drafts, greedy, C
kernels, one generation of ``--max-tokens`` from each of ``--prompts``
prompts of the evaluation text, acceptance summed over them. A
``--speculative-only`` run keeps the file's earlier speculative section under
``speculative_earlier``. Each quantizer's runs are compared with
round-to-nearest's on the same prompts (``paired_vs_rtn``: prompts higher,
lower and equal with the sign test's p, and the aggregate acceptance
difference with its 95% interval from a paired bootstrap over the prompts);
``--paired FILE`` adds that comparison to a file written before it existed.

Prints a table and writes JSON (default
``benchmarks/results/low_quant_smollm2-135m.json``) with the machine's load
average before and after each child (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
QUANTIZERS = ("rtn", "gptq", "awq", "dwq")
BLOCKS = (2, 4, 6)


def _as_float(module: Any) -> Any:
    """A float layer holding the exact weight values a nested view multiplies by."""
    import mlx.core as mx
    import mlx.nn as nn

    from gearbx_mlx.nested.planes import reconstruct

    weights = getattr(module, "nested", None)
    if weights is None:
        return module
    w, bias = reconstruct(weights.planes, module.n, mx.float32), weights.get("bias")
    out = nn.Embedding(*w.shape) if hasattr(module, "as_linear") else nn.Linear(w.shape[1], w.shape[0],
                                                                                 bias=bias is not None)
    out.weight = w
    if bias is not None:
        out.bias = bias
    mx.eval(out.parameters())
    return out


def _load(method: str, scope: str, planes_dir: str, model: Optional[str] = None):
    from gearbx_mlx import precision
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.generation import load

    # The planes cache in the run's own folder: the first load builds the planes, the second reads them.
    precision.cache_path = lambda model_dir, key, fallback: Path(planes_dir) / f"{key}.safetensors"
    return load(model, config=GearboxConfig(scope=scope, store="nested", kernel="mlx", low_quant=method))


def _quality(model: Any, gb: Any, ids: List[int], window: int) -> Dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    from gearbx_mlx.evaluation import metrics
    from gearbx_mlx.evaluation.speculative import replay

    windows = [ids[i : i + window + 1] for i in range(0, len(ids) - window, window)]
    mgr = gb.manager
    out: Dict[str, Any] = {}
    refs = []
    for gear in ("high", "low", "mid"):
        mods = mgr.cache[gear]
        model.update_modules(tree_unflatten([(p, _as_float(m)) for p, m in mods.items()]))
        per: Dict[str, List] = {"nll": [], "kl": [], "hits": [], "entropy": []}
        for wi, w in enumerate(windows):
            logits = model(mx.array(w[:-1])[None])[0]
            if gear == "high":
                refs.append(metrics.reference(logits, list(w[1:]))[0])
                continue
            r = metrics.routed(logits, list(w[1:]), refs[wi])
            for k in per:
                per[k] += r[k]
        if gear == "high":
            continue
        n = len(per["kl"])
        out[gear] = {"perplexity": math.exp(sum(per["nll"]) / n), "kl_nats": sum(per["kl"]) / n,
                     "top1": sum(per["hits"]) / n, "positions": n}
        if gear == "low":
            out["acceptance"] = {}
            for k in BLOCKS:
                c = replay(per["hits"], per["entropy"], window, k)
                out["acceptance"][str(k)] = {"acceptance_rate": c.acceptance_rate,
                                             "mean_accepted_length": c.mean_accepted_length, **c.to_dict()}
    model.update_modules(tree_unflatten(list(mgr.cache["high"].items())))
    return out


def child(args: argparse.Namespace) -> Dict[str, Any]:
    from gearbx_mlx.evaluation.harness import text_tokens
    from gearbx_mlx.nested.lowquant import calibration_tokens
    from gearbx_mlx.sources.models import corpus_path

    tic = time.perf_counter()
    model, tok, gb = _load(args.child, args.scope, args.planes_dir, args.model)
    mgr = gb.manager
    built = {"origin": mgr.planes_origin, "planes_seconds": mgr.planes_seconds,
             "quantizer_seconds": mgr.low_quant_seconds, "load_seconds": time.perf_counter() - tic,
             "planes_file": mgr.planes_file.name if mgr.planes_file else None, "managed_layers": len(mgr.paths),
             "calibration_samples_x_length": list(calibration_tokens(tok).shape)}
    ids = text_tokens(tok, corpus_path("lee_background").read_text(encoding="utf-8"), args.tokens + 1)
    quality = _quality(model, gb, ids, args.window)
    del model, gb, mgr
    _, _, again = _load(args.child, args.scope, args.planes_dir, args.model)
    second = {"origin": again.manager.planes_origin, "planes_seconds": again.manager.planes_seconds,
              "quantizer_seconds": again.manager.low_quant_seconds}
    return {"quantizer": args.child, "finished": True, "build": built, "second_load": second, **quality}


def speculative_child(args: argparse.Namespace) -> Dict[str, Any]:
    """Speculative generations drafting with ``args.child``'s low plane (read from the kept
    planes): fixed blocks of ``--draft-k`` drafts, the C kernels, greedy, one from each of
    ``--prompts`` prompts of the evaluation text (``--prompt-tokens`` each, ``--prompt-tokens +
    --max-tokens`` apart, so no continuation overlaps the next prompt); drafts and acceptances
    summed over the prompts, tokens/s their median."""
    import mlx.core as mx

    from gearbx_mlx import precision
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.evaluation.harness import text_tokens
    from gearbx_mlx.generation import load
    from gearbx_mlx.pipeline import prepare
    from gearbx_mlx.sources.models import corpus_path
    from gearbx_mlx.speculative.decode import SpeculativeConfig

    precision.cache_path = lambda model_dir, key, fallback: Path(args.planes_dir) / f"{key}.safetensors"
    model, tok, gb = load(args.model, config=GearboxConfig(scope=args.scope, store="nested", kernel="packed",
                                                            low_quant=args.child))
    span = args.prompt_tokens + args.max_tokens
    text = text_tokens(tok, corpus_path("lee_background").read_text(encoding="utf-8"), args.prompts * span)
    if len(text) < args.prompts * span:
        raise SystemExit(f"error: the evaluation text has {len(text)} tokens, {args.prompts} prompts need "
                         f"{args.prompts * span}")
    cfg = SpeculativeConfig(max_draft=args.draft_k, draft_entropy_stop=None)
    prompts = []
    for k in range(args.prompts):
        ids = text[k * span:k * span + args.prompt_tokens]
        run = prepare(model, tok, ids, gb, speculative=cfg, max_tokens=args.max_tokens)
        last, tokens = None, []
        for r in run.tokens():
            last = r
            tokens.append(r.token)
        stats = run.record.stats
        prompts.append({"offset": k * span, "drafted": stats.drafted, "accepted": stats.accepted,
                        "acceptance_rate": stats.accepted / max(stats.drafted, 1),
                        "generation_tps": last.generation_tps, "generation_tokens": last.generation_tokens,
                        "tokens": tokens})
    mx.eval(mx.array(0))
    drafted, accepted = sum(p["drafted"] for p in prompts), sum(p["accepted"] for p in prompts)
    return {"quantizer": args.child, "planes_origin": gb.manager.planes_origin, "drafter": stats.drafter,
            "generation_tps": statistics.median(p["generation_tps"] for p in prompts),
            "generation_tokens": sum(p["generation_tokens"] for p in prompts),
            "prompt_tokens": args.prompt_tokens, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / max(drafted, 1), "draft_k": args.draft_k, "prompts": prompts}


def _speculative(args: argparse.Namespace) -> Dict[str, Any]:
    """Interleaved runs (rtn, gptq, rtn, gptq, ...) of :func:`speculative_child`, each in a fresh
    process, on the planes the quantizers' children kept."""
    from gearbx_mlx.evaluation.machine import load_average

    runs = []
    for rep in range(args.speculative_reps):
        for method in args.quantizers:
            with tempfile.NamedTemporaryFile(suffix=".json") as res:
                cmd = ([sys.executable, __file__, "--child", method, "--speculative-child", "--planes-dir",
                       str(Path(args.keep_planes) / method), "--result", res.name, "--scope", args.scope,
                       "--draft-k", str(args.draft_k), "--max-tokens", str(args.max_tokens),
                       "--prompt-tokens", str(args.prompt_tokens), "--prompts", str(args.prompts)]
                       + (["--model", args.model] if args.model else []))
                before = load_average()
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                if proc.returncode != 0:
                    runs.append({"quantizer": method, "rep": rep, "error": proc.stderr.strip().splitlines()[-3:]})
                    continue
                out = json.loads(Path(res.name).read_text())
            out.update(rep=rep, load_average_before=before, load_average_after=load_average())
            print(f"  {method} rep {rep}: {out['generation_tps']:.2f} tok/s, acceptance {out['acceptance_rate']:.3f}",
                  file=sys.stderr, flush=True)
            runs.append(out)
    return {"what": "end-to-end speculative generation drafting with each low plane (fresh process each, "
                    "interleaved), fixed blocks, greedy, C kernels (kernel=packed), planes from the runs above",
            "ld_preload": os.environ.get("LD_PRELOAD"), "draft_k": args.draft_k, "max_tokens": args.max_tokens,
            "prompt": f"{args.prompts} prompt(s) of {args.prompt_tokens} tokens of lee_background.cor from its "
                      f"start, {args.prompt_tokens + args.max_tokens} tokens apart", "runs": runs}


def _paired(runs: List[Dict[str, Any]], resamples: int = 10_000, seed: int = 0) -> Dict[str, Any]:
    """Each quantizer's drafts against round-to-nearest's on the same prompts (the first repeat of
    each): prompts where acceptance is higher / lower / equal with the sign test's exact two-sided
    p (the direction alone), and the aggregate acceptance difference with a paired bootstrap over
    the prompts (its 95% interval: prompts resampled with replacement, both quantizers' drafts
    and acceptances summed over the same resample)."""
    first = {r["quantizer"]: r for r in runs if r.get("rep", 0) == 0 and "prompts" in r}
    rtn, out = first.get("rtn"), {}
    for name, run in first.items():
        if rtn is None or name == "rtn" or len(run["prompts"]) != len(rtn["prompts"]):
            continue
        a, b = rtn["prompts"], run["prompts"]
        diffs = [y["acceptance_rate"] - x["acceptance_rate"] for x, y in zip(a, b)]
        higher, lower = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        n = higher + lower
        sign_p = min(1.0, 2 * sum(math.comb(n, k) for k in range(min(higher, lower) + 1)) / 2 ** n) if n else 1.0

        def rate_gap(idx: List[int]) -> float:
            return (sum(b[i]["accepted"] for i in idx) / max(1, sum(b[i]["drafted"] for i in idx))
                    - sum(a[i]["accepted"] for i in idx) / max(1, sum(a[i]["drafted"] for i in idx)))

        rng = random.Random(seed)
        gaps = sorted(rate_gap([rng.randrange(len(a)) for _ in a]) for _ in range(resamples))
        out[name] = {"prompts": len(a), "higher": higher, "lower": lower, "equal": len(a) - n,
                     "sign_test_p": sign_p, "acceptance_difference": rate_gap(list(range(len(a)))),
                     "bootstrap_95": [gaps[int(0.025 * resamples)], gaps[int(0.975 * resamples) - 1]],
                     "bootstrap": {"resamples": resamples, "seed": seed, "over": "prompts"},
                     "same_tokens": sum(x.get("tokens") == y.get("tokens") for x, y in zip(a, b))}
        print(f"  {name} vs rtn over {len(a)} prompts: acceptance {out[name]['acceptance_difference']:+.3f} "
              f"[{out[name]['bootstrap_95'][0]:+.3f}, {out[name]['bootstrap_95'][1]:+.3f}], higher on {higher}, "
              f"lower on {lower} (sign test p {sign_p:.3f})", file=sys.stderr)
    return out


def _progress(stderr: str) -> str:
    """The last progress line a quantizer wrote (tqdm redraws with carriage returns)."""
    lines = [ln.strip() for ln in stderr.replace("\r", "\n").splitlines() if "%|" in ln or "it/s" in ln
             or "s/it" in ln]
    return lines[-1] if lines else ""


def _run_child(method: str, args: argparse.Namespace) -> Dict[str, Any]:
    from gearbx_mlx.evaluation.machine import load_average

    with tempfile.TemporaryDirectory() as tmp, tempfile.NamedTemporaryFile(suffix=".json") as res:
        planes = str(Path(args.keep_planes) / method) if args.keep_planes else tmp
        if args.keep_planes:  # a fresh build: the first load must not read an earlier run's planes
            Path(planes).mkdir(parents=True, exist_ok=True)
            for old in Path(planes).glob("*.safetensors"):
                old.unlink()
        cmd = [sys.executable, __file__, "--child", method, "--planes-dir", planes, "--result", res.name,
               "--scope", args.scope, "--tokens", str(args.tokens), "--window", str(args.window)]
        cmd += ["--model", args.model] if args.model else []
        before, tic = load_average(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            _, err = proc.communicate(timeout=args.budget)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return {"quantizer": method, "finished": False, "budget_seconds": args.budget,
                    "progress_at_budget": _progress(err), "load_average_before": before,
                    "load_average_after": load_average()}
        wall = time.perf_counter() - tic
        if proc.returncode != 0:
            return {"quantizer": method, "finished": False, "error": err.strip().splitlines()[-1:],
                    "load_average_before": before}
        out = json.loads(Path(res.name).read_text())
    out.update(child_wall_seconds=wall, load_average_before=before, load_average_after=load_average())
    return out


def _table(rows: List[Dict[str, Any]]) -> str:
    rtn = next((r for r in rows if r["quantizer"] == "rtn" and r.get("finished")), None)
    head = (f"{'low gear':<8} {'quant s':>8} {'ppl':>8} {'KL nats':>9} {'vs rtn':>7} {'top-1':>6} "
            f"{'mid KL':>9} " + " ".join(f"{'acc k=' + str(k):>8}" for k in BLOCKS) + f" {'2nd load':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.get("finished"):
            why = r.get("progress_at_budget") or r.get("error")
            lines.append(f"{r['quantizer']:<8} not finished in {r.get('budget_seconds', '?')} s: {why}")
            continue
        low, rel = r["low"], r["low"]["kl_nats"] / rtn["low"]["kl_nats"] - 1 if rtn else float("nan")
        acc = " ".join(f"{r['acceptance'][str(k)]['acceptance_rate']:>8.3f}" for k in BLOCKS)
        lines.append(f"{r['quantizer']:<8} {r['build']['quantizer_seconds']:>8.1f} {low['perplexity']:>8.3f} "
                     f"{low['kl_nats']:>9.4f} {100 * rel:>6.1f}% {low['top1']:>6.3f} {r['mid']['kl_nats']:>9.2e} "
                     f"{acc} {r['second_load']['origin']:>8}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=QUANTIZERS)
    p.add_argument("--scope", default="all", choices=("attention", "all"),
                   help="the managed layers (default all: the speculative drafter's scope)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--budget", type=int, default=300, help="seconds each quantizer's child may take")
    p.add_argument("--model", default=None, help="a model name or folder (default: the default model)")
    p.add_argument("--out", default=None, help="default benchmarks/results/low_quant_<model>.json")
    p.add_argument("--keep-planes", default=None,
                   help="a folder that keeps each quantizer's planes file (for a later speculative run)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of --out's other quantizers (runs of different budgets in one file)")
    p.add_argument("--speculative-reps", type=int, default=0,
                   help="interleaved end-to-end speculative runs per quantizer (needs --keep-planes)")
    p.add_argument("--draft-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=1,
                   help="speculative runs: prompts of the evaluation text per run (acceptance summed over them)")
    p.add_argument("--speculative-only", action="store_true",
                   help="only the speculative runs, on planes an earlier run kept (merged into --out)")
    p.add_argument("--speculative-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--planes-dir", help=argparse.SUPPRESS)
    p.add_argument("--paired", metavar="FILE",
                   help="add the paired comparison of the speculative runs to an earlier result FILE, and stop")
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = args.out or str(ROOT / f"benchmarks/results/low_quant_{args.model or 'smollm2-135m'}.json")
    if args.keep_planes:
        Path(args.keep_planes).mkdir(parents=True, exist_ok=True)
    if args.paired:  # the comparison added to a result written before it existed
        saved = json.loads(Path(args.paired).read_text())
        saved["speculative"]["paired_vs_rtn"] = _paired(saved["speculative"]["runs"])
        Path(args.paired).write_text(json.dumps(saved, indent=1) + "\n")
        return 0
    if args.child:
        Path(args.result).write_text(json.dumps(speculative_child(args) if args.speculative_child else child(args)))
        return 0
    if args.prompts < 1:
        print("error: --prompts must be at least 1", file=sys.stderr)
        return 2
    if args.speculative_reps and not args.keep_planes:
        print("error: --speculative-reps reads the planes --keep-planes kept: give --keep-planes", file=sys.stderr)
        return 2
    from gearbx_mlx.evaluation.machine import hardware, load_average, software

    if args.speculative_only:
        saved = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {
            "runs": [], "model": args.model, "scope": args.scope, "hardware": hardware(), "software": software()}
        if "speculative" in saved:  # an earlier speculative section stays, under its own key
            saved.setdefault("speculative_earlier", []).append(saved["speculative"])
        saved["speculative"] = _speculative(args)
        saved["speculative"]["paired_vs_rtn"] = _paired(saved["speculative"]["runs"])
        saved["runs"].append({"command": "python " + " ".join([str(Path(__file__).relative_to(ROOT))]
                                                                + (argv or sys.argv[1:])),
                              "date": date.today().isoformat(), "load_average_end": load_average()})
        Path(args.out).write_text(json.dumps(saved, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    rows, runs = [], []
    if args.merge and Path(args.out).is_file():
        saved = json.loads(Path(args.out).read_text())
        rows = [r for r in saved["rows"] if r["quantizer"] not in args.quantizers]
        runs = saved.get("runs", [])
    for q in args.quantizers:
        print(f"{q} ...", file=sys.stderr, flush=True)
        rows.append(_run_child(q, args))
    rows.sort(key=lambda r: QUANTIZERS.index(r["quantizer"]))
    print(_table(rows))
    command = "python " + " ".join([str(Path(__file__).relative_to(ROOT))] + (argv or sys.argv[1:]))
    runs.append({"command": command, "quantizers": args.quantizers, "budget_seconds": args.budget,
                 "date": date.today().isoformat(), "load_average_end": load_average()})
    result = {
        "runs": runs, "model": args.model or "SmolLM2-135M-Instruct (float32, the default model)",
        "scope": args.scope, "tokens": args.tokens, "window": args.window,
        "text": "gensim lee_background.cor (evaluation); the quantizers calibrate on lee.cor",
        "acceptance_method": "greedy blocks of k drafts replayed along the text from the low gear's per-position "
                             "top-1 agreement with the loaded weights (gearbx_mlx.evaluation.speculative.replay)",
        "hardware": hardware(), "software": software(), "rows": rows,
    }
    if args.speculative_reps:
        result["speculative"] = _speculative(args)
        result["speculative"]["paired_vs_rtn"] = _paired(result["speculative"]["runs"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
