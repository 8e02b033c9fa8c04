"""Prompt tokens/s of the nested store against separate copies, through the README's command.

    python scripts/bench_prefill_store.py [--pairs 3] [--blas openblas|restart|reference] [--max-tokens 4]
                                          [--clock wall|cpu] [--threads N] [--tree NAME=PATH ...]
                                          [--model NAME] [--extra ARGS] [--out FILE.json]

Runs ``python -m gearbx_mlx.generate --scope all --store S -p PROMPT -m N`` in
a fresh process per run, separate and nested interleaved (``--pairs`` pairs, in
:func:`gearbx_mlx.evaluation.significance.balanced_order`: the stores' order
changes every pair, the trees' every second), and reads
mlx-lm's ``Prompt: ... tokens-per-sec`` and ``Generation:`` lines. ``--blas
openblas`` preloads Debian's OpenBLAS (as ``.ci/run`` does); ``--blas
restart`` preloads nothing, so the command restarts itself onto the OpenBLAS
it finds (what the README's install gets); ``--blas reference`` runs MLX's own
reference BLAS (no preload, and no restart onto one). Prints a table and
writes the runs, the per-pair ratios, the load average, the BLAS, the date and
the commands to ``--out`` (default
``benchmarks/results/prefill_store_<blas>.json``). The verdict on the target
(nested >= separate) accounts for the pairs' spread: a 95% bootstrap interval
of the median ratio
(:func:`gearbx_mlx.evaluation.significance.median_verdict`), **met** only
where the whole interval is at or above 1.

``--clock cpu`` is for a machine others load: each fresh process loads the
model as the command does (``gearbx_mlx.load``, its warm-up pass
``gearbx_mlx.generation.warm_up`` and the loaded objects out of the garbage
collector's scans with ``gearbx_mlx.generation.settle_loaded`` where the
checkout has them, the chat template, the generation set up with
``gearbx_mlx.prepare``, the cold-start classifier reading the prompt as
typed, so the same gear; the separate store's
one-time quantization stays outside, as it does from mlx-lm's prompt
timing) and times the same window as mlx-lm's prompt time, the first
response of ``run.tokens()``, both on the wall clock and in the process's
CPU time (every thread's), which another program's load stretches far less;
the ratios are then separate's CPU time over nested's (default out
``prefill_store_<blas>_cpu.json``). Each run also counts the garbage
collector's passes in the window, and the CPU time of its full ones, and the
CPU time of the window's prefill chunk (to the end of mlx-lm's first
evaluation in it; the rest of the window is the one-row steps of the
prompt's last token and the next).

``--threads N`` (with ``--clock cpu``) runs the window on ``N`` threads:
OpenBLAS's (``OPENBLAS_NUM_THREADS``) and the C kernels' pool
(``gearbx_mlx.bindings.cpu.set_threads``). With ``--threads 1`` the CPU
time is the window's work, without the time threads spend waiting for one
another, which on a loaded machine shifts with every run (default out
``prefill_store_<blas>_cpu1.json``).

``--tree NAME=PATH`` adds another checkout (say, the code before a change,
from ``git worktree add``) whose runs take their places in every pair, so
both codes see the same load; the JSON then gives each tree's ratios, and
each store's prompt and decode tokens/s in each tree over the first's, pair
by pair, with their verdicts. ``--extra ARGS`` (wall clock) adds arguments to
the command, after its own: ``--extra "-m 64 --speculative"`` times decoding.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
PROMPT = ("Explain how a bicycle gearbox works, what the gears are for, and why a rider shifts "
          "between them when climbing a steep hill.")
PROMPT_RE = re.compile(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec")
GEN_RE = re.compile(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec")


def command(store: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "gearbx_mlx.generate", "--scope", "all", "--store", store,
           "-p", PROMPT, "-m", str(args.max_tokens)]
    return cmd + (["--model", args.model] if args.model else []) + shlex.split(args.extra or "")


def environment(blas: str, tree: Path = ROOT, threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if threads:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    if tree != ROOT:  # another checkout's package (a run before a change, say)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    for key in ("GEARBX_BLAS_REEXEC", "GEARBX_NO_BLAS_PRELOAD"):
        env.pop(key, None)
    if blas == "openblas":
        env["LD_PRELOAD"] = OPENBLAS
    elif blas == "reference":
        env["GEARBX_NO_BLAS_PRELOAD"] = "1"
    return env


def run_once(store: str, args: argparse.Namespace, tree: Path = ROOT) -> dict[str, Any]:
    tic = time.perf_counter()
    proc = subprocess.run(command(store, args), check=False, capture_output=True, text=True, cwd=tree,
                          env=environment(args.blas, tree), timeout=args.timeout)
    text = proc.stdout + proc.stderr
    p, g = PROMPT_RE.search(text), GEN_RE.search(text)
    gears = next((line for line in text.splitlines() if line.startswith("Gears:")), "")
    if proc.returncode or not p:
        raise SystemExit(f"error: {store} run failed (exit {proc.returncode}):\n{text[-2000:]}")
    return {"store": store, "prompt_tokens": int(p.group(1)), "prompt_tps": float(p.group(2)),
            "generation_tps": float(g.group(2)) if g else None, "gears": gears,
            "wall_s": round(time.perf_counter() - tic, 2), "load_avg_after": os.getloadavg()}


def child(store: str, args: argparse.Namespace) -> None:
    """``--clock cpu``'s measurement, in this fresh process: one JSON line on stdout."""
    import gearbx_mlx
    from gearbx_mlx import generation
    from gearbx_mlx.bindings import cpu
    from gearbx_mlx.chat import apply_chat_template

    if args.blas == "restart":  # as the command does first
        from gearbx_mlx.blas import ensure_fast_blas

        ensure_fast_blas()
    if args.threads:
        cpu.set_threads(args.threads)
    model, tokenizer, gearbox = gearbx_mlx.load(args.model, scope="all", store=store)
    # As the command does once the model is loaded (a checkout from before either has not it).
    if hasattr(generation, "warm_up"):
        generation.warm_up(model)
    if hasattr(generation, "settle_loaded"):
        generation.settle_loaded()
    text = apply_chat_template(tokenizer, PROMPT, None, use_template=True)  # as the command does
    run = gearbx_mlx.prepare(model, tokenizer, text, gearbox, max_tokens=args.max_tokens, prompt_text=PROMPT)
    passes: list[tuple[str, int, float]] = []  # the garbage collector's, in the window
    gc.callbacks.append(lambda phase, info: passes.append((phase, info["generation"], time.process_time())))
    evals = _mark_mlx_lm_evals()
    wall, start = time.perf_counter(), time.process_time()
    first = next(run.tokens())
    wall, cpu = time.perf_counter() - wall, time.process_time() - start
    gc.callbacks.clear()
    run.close()
    spans = [(a[1], b[2] - a[2]) for a, b in zip(passes[::2], passes[1::2])]
    print(json.dumps({"prompt_tokens": int(first.prompt_tokens), "window_wall_s": round(wall, 4),
                      "window_cpu_s": round(cpu, 4), "prompt_tps": round(first.prompt_tps, 3), "gear": first.gear,
                      "gc_passes": {g: sum(1 for k, _ in spans if k == g) for g in (0, 1, 2)},
                      "gc_full_cpu_s": round(sum(t for k, t in spans if k == 2), 4),
                      "prefill_chunk_cpu_s": round(evals[0] - start, 4) if evals else None}))


def _mark_mlx_lm_evals(clock: Any = time.process_time) -> list[float]:
    """``clock()`` (default the process's CPU time) at the end of each ``mx.eval`` of mlx-lm's generation
    loop. Its first in the window ends the prompt's first prefill chunk (all but the last token, for a
    prompt shorter than the 2,048-token chunk), before the one-row steps of the prompt's last token and
    the next."""
    import importlib

    import mlx.core as mx

    module = importlib.import_module("mlx_lm.generate")  # the package's attribute is the function
    marks: list[float] = []

    class Marked:
        def __getattr__(self, name: str) -> Any:
            return getattr(mx, name)

        @staticmethod
        def eval(*arrays: Any) -> None:
            mx.eval(*arrays)
            marks.append(clock())

    module.mx = Marked()
    return marks


def run_child(store: str, args: argparse.Namespace, tree: Path = ROOT) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", store, "--max-tokens", str(args.max_tokens),
           "--blas", args.blas]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--threads", str(args.threads)] if args.threads else []
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tree,
                          env=environment(args.blas, tree, args.threads), timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"error: {store} run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
    return {"store": store, **json.loads(lines[-1]), "load_avg_after": os.getloadavg()}


def mlx_blas(blas: str, tree: Path = ROOT) -> dict[str, str | None]:
    """The BLAS library MLX calls in ``tree``'s runs, and ``OPENBLAS_THREAD_TIMEOUT`` there (how long
    OpenBLAS's idle workers spin; ``--blas restart`` restarts this ``python -c`` as the command does)."""
    restart = "blas.ensure_fast_blas(); " if blas == "restart" else ""
    code = (f"import os; from gearbx_mlx import blas; {restart}print(blas.shown_path(blas.mlx_blas())); "
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT', ''))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=tree,
                         env=environment(blas, tree))
    lines = out.stdout.splitlines() + ["", ""]
    return {"mlx_blas_library": lines[0] or None, "openblas_thread_timeout": lines[1] or None}


def speed(run: dict[str, Any], clock: str) -> float:
    """Prompt tokens per second of a run: mlx-lm's (wall), or over the window's CPU time."""
    return run["prompt_tps"] if clock == "wall" else run["prompt_tokens"] / run["window_cpu_s"]


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """The interleaved runs and, per tree, each pair's nested/separate ratio of :func:`speed`."""
    runs: list[dict[str, Any]] = []
    ratios: dict[str, list[float]] = {name: [] for name in args.trees}
    from gearbx_mlx.evaluation.significance import balanced_order

    for i in range(args.pairs):
        for name, tree in balanced_order(list(args.trees.items()), i // 2):  # no run always at one place
            pair = {}
            for store in balanced_order(("separate", "nested"), i):
                r = run_once(store, args, tree) if args.clock == "wall" else run_child(store, args, tree)
                r.update(pair=i, **({"tree": name} if name else {}))
                runs.append(r)
                pair[store] = r
                extra = (f"decode {r['generation_tps']} tok/s | {r['gears']}" if args.clock == "wall" else
                         f"window {r['window_wall_s']:.3f} s wall, {r['window_cpu_s']:.3f} s CPU "
                         f"(full collections {r['gc_passes']['2']}, {r['gc_full_cpu_s']:.3f} s) | {r['gear']}")
                print(f"pair {i} {name} {store:9s} prompt {r['prompt_tokens']} tok at {speed(r, args.clock):8.2f} "
                      f"tok/s ({args.clock}), {extra}", flush=True)
            ratios[name].append(speed(pair["nested"], args.clock) / speed(pair["separate"], args.clock))
    return runs, ratios


def against_first(runs: list[dict[str, Any]], tree: str, first: str, clock: str) -> dict[str, Any]:
    """Per store, the pairs' ratios of ``tree``'s prompt (and, on the wall clock, decode) tokens/s over
    ``first``'s, each with :func:`median_verdict` against 1 (``tree`` as fast as ``first``)."""
    from gearbx_mlx.evaluation.significance import median_verdict

    out: dict[str, Any] = {}
    for store in ("separate", "nested"):
        mine = {r["pair"]: r for r in runs if r.get("tree") == tree and r["store"] == store}
        base = {r["pair"]: r for r in runs if r.get("tree") == first and r["store"] == store}
        pairs = sorted(set(mine) & set(base))
        speeds = {"prompt": [speed(mine[i], clock) / speed(base[i], clock) for i in pairs]}
        if clock == "wall" and all(mine[i]["generation_tps"] and base[i]["generation_tps"] for i in pairs):
            speeds["decode"] = [mine[i]["generation_tps"] / base[i]["generation_tps"] for i in pairs]
        out[store] = {what: {"ratios": [round(x, 4) for x in r], **median_verdict(r, 1.0)}
                      for what, r in speeds.items() if r}
    return out


def git_commit(tree: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], check=False, capture_output=True, text=True)
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--blas", choices=("openblas", "restart", "reference"), default="openblas")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--threads", type=int, default=None,
                    help="with --clock cpu: OpenBLAS's and the C kernels' threads in the window")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="also a checkout at PATH (its package first on PYTHONPATH), interleaved pair by pair")
    ap.add_argument("--model", default=None)
    ap.add_argument("--extra", default=None, metavar="ARGS", help="more arguments of the command (wall clock)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=("separate", "nested"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args)
    if args.extra and args.clock != "wall":
        raise SystemExit("error: --extra is for the command's runs (--clock wall)")
    if args.threads is not None and (args.threads < 1 or args.clock != "cpu"):
        raise SystemExit("error: --threads takes a positive count, with --clock cpu")
    if args.blas in ("openblas", "restart") and not Path(OPENBLAS).is_file():
        raise SystemExit(f"error: --blas {args.blas} needs {OPENBLAS} (apt-get install libopenblas0-pthread)")
    bad = [t for t in args.tree if "=" not in t or not Path(t.split("=", 1)[1], "gearbx_mlx").is_dir()]
    if bad:
        raise SystemExit(f"error: --tree {bad[0]!r}: want NAME=PATH of a checkout with gearbx_mlx/ in it")
    args.trees = {"this": ROOT, **{t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree}} \
        if args.tree else {"": ROOT}
    suffix = "" if args.clock == "wall" else f"_cpu{args.threads or ''}"
    out = args.out or ROOT / "benchmarks" / "results" / f"prefill_store_{args.blas}{suffix}.json"
    load_before = os.getloadavg()
    runs, ratios = measure(args)
    from gearbx_mlx.evaluation.significance import median_verdict

    verdicts = {name: median_verdict(tree_ratios, 1.0) for name, tree_ratios in ratios.items()}
    for name, tree_ratios in ratios.items():
        print(f"\n{name or 'this tree'}: {'pair':>4} {'nested/separate':>16}   ({args.clock} clock)")
        for i, ratio in enumerate(tree_ratios):
            print(f"{i:>4} {ratio:>16.2f}")
        print(f"median nested/separate prompt tokens/s: {statistics.median(tree_ratios):.2f}")
        j = verdicts[name]
        print(f"95% bootstrap interval of the median: {j['interval_95'][0]:.2f}-{j['interval_95'][1]:.2f}, "
              f"{j['rounds_at_target']} of {j['rounds']} pairs at or above 1: {j['verdict']} "
              f"(target: nested >= separate)")
    from gearbx_mlx.evaluation.machine import hardware  # the CPU's name

    probes = {tree: mlx_blas(args.blas, tree) for tree in {ROOT, *args.trees.values()}}  # once per checkout
    result = {
        "what": "prompt tokens/s, nested store vs separate copies, interleaved fresh processes",
        "clock": args.clock, "threads": args.threads,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commands": {s: " ".join(command(s, args)[1:]) if args.clock == "wall" else
                     f"scripts/bench_prefill_store.py --child {s} --max-tokens {args.max_tokens} --blas {args.blas}"
                     + (f" --threads {args.threads}" if args.threads else "")
                     for s in ("separate", "nested")},
        "blas": args.blas, "ld_preload": environment(args.blas).get("LD_PRELOAD"), **probes[ROOT],
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)), **hardware()},
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "runs": runs, "ratios_nested_over_separate": next(iter(ratios.values())),
        "median_ratio": statistics.median(next(iter(ratios.values()))),
        "verdict": next(iter(verdicts.values())),
    }
    if args.tree:
        first = next(iter(args.trees))
        result["trees"] = {name: {"commit": git_commit(tree), **probes[tree],  # no host paths
                                  "ratios": ratios[name],
                                  "median_ratio": statistics.median(ratios[name]), "verdict": verdicts[name],
                                  **({"over_first_tree": against_first(runs, name, first, args.clock)}
                                     if name != first else {})}
                           for name, tree in args.trees.items()}
        for name, stores in list(result["trees"].items())[1:]:
            for store, speeds in stores["over_first_tree"].items():
                print(f"{name}/{first} {store:9s} " + ", ".join(
                    f"{what} {j['median']:.3f} ({j['interval_95'][0]:.3f}-{j['interval_95'][1]:.3f}, {j['verdict']})"
                    for what, j in speeds.items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
