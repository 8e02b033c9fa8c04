#!/usr/bin/env python3
"""Gears on a sharded model: decision overhead, and tokens/s of one process against N ranks.

Runs ``python -m gearbx_mlx.generate`` once in one process and once under
``mlx.launch -n N --backend ring`` (ranks on this machine, over the
loopback), the same prompt, flags and token count, each with a trace, and
reads from the traces:

* tokens/s (mlx-lm's generation rate) of each run;
* the decision collectives per forward step (the gearbox's exchange: rank
  0's token, entropy and NaN flag), and each step's wait for it once the
  step's own values were ready (``exchange_seconds``, median and total);
* whether every rank's own token and entropy equalled rank 0's at every step.

What the gears hold on each rank against one process (every gear built, each
store): ``PrecisionManager.memory()['resident_total']``, which should be one
shard's share of one process's, and each process's peak resident set.

Then, on the ranks, what the exchange costs a token: the same generation
with rank 0's values shared (the default) and with every rank deciding on its
own logits (``Ranks.exchange = None``; valid here only because the traces show
the ranks' logits agreeing bit for bit), interleaved over rounds, tokens/s of
each (median); and the exchange timed on its own: ``StepExchange.share`` of
one step's values, evaluated alone, beside an ``all_sum`` of its table alone
(built beforehand) and of one hidden-state row (what each sharded-to-all
layer of the model does, twice per layer and step).

What it says and does not: ranks on ONE machine share its cores and talk over
the loopback, so their tokens/s measures the cost of the collectives here,
not the speed of a model split over several Macs (unmeasured).

Usage:
  python scripts/bench_distributed.py [--model NAME] [--ranks N] [--tokens 32] [--quick]
      [--out benchmarks/results/distributed_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gearbx_mlx.distributed.ranks import free_port_base  # noqa: E402
from gearbx_mlx.telemetry.trace import read_trace  # noqa: E402

PROMPT = "Explain in one paragraph why the sky is blue."

#: The exchange timed alone, on every rank: one step's values, then a hidden row's all_sum.
MICRO = r"""
import json, statistics, sys, time
import mlx.core as mx
from gearbx_mlx.distributed import StepExchange, launched_group
g = launched_group()
ex = StepExchange(g)
reps, hidden = int(sys.argv[1]), int(sys.argv[2])
def timed(make):
    mx.eval(make(0))
    out = []
    for i in range(reps):
        x = make(i)
        tic = time.perf_counter()
        mx.eval(x)
        out.append(time.perf_counter() - tic)
    return statistics.median(out)
step = lambda i: ex.share(mx.array([i], mx.uint32), mx.array(1.5 + i), mx.array(False), mx.array(2, mx.uint32)).table
row = lambda i: mx.distributed.all_sum(mx.full((1, hidden), float(i)), group=g)
words = ex.share(mx.array([0], mx.uint32), mx.array(1.5), mx.array(False), mx.array(2, mx.uint32)).table.shape
table = lambda i: mx.distributed.all_sum(mx.full(words, i, mx.uint32), group=g)
print("MICRO", json.dumps({"rank": g.rank(), "exchange_s": timed(step), "hidden_row_all_sum_s": timed(row),
                           "table_all_sum_s": timed(table), "table_shape": list(words)}))
"""


#: The same generation with and without the exchange, interleaved, on every rank.
AB = r"""
import json, statistics, sys, time
import mlx.core as mx
from gearbx_mlx import load, stream_generate
from gearbx_mlx.chat import apply_chat_template
from gearbx_mlx.distributed import launched_group
model, tok, gb = load(sys.argv[1] or None, group=launched_group())
tokens, rounds, prompt = int(sys.argv[2]), int(sys.argv[3]), apply_chat_template(tok, sys.argv[4])
exchange = gb.ranks.exchange
rates = {"shared": [], "own": []}
texts, counts = {}, {}
for r in range(rounds + 1):  # the first round warms up
    for mode in ("shared", "own"):
        gb.ranks.exchange = exchange if mode == "shared" else None
        ids, stamps = [], []
        for resp in stream_generate(model, tok, prompt, gb, max_tokens=tokens):
            ids.append(int(resp.token))
            stamps.append(time.perf_counter())
        texts.setdefault(mode, ids)
        counts[mode] = len(ids)
        if r and len(ids) > 1:  # decode steps after the first token, as mlx-lm's generation rate
            rates[mode].append((len(ids) - 1) / (stamps[-1] - stamps[0]))
gb.ranks.exchange = exchange
tps = {m: statistics.median(v) for m, v in rates.items()}
print("AB", json.dumps({"rank": gb.ranks.rank, "tps": tps, "rounds": rounds, "tokens": counts,
                        "exchange_ms_per_token": 1e3 * (1 / tps["shared"] - 1 / tps["own"]),
                        "same_tokens": texts["shared"] == texts["own"]}))
"""


#: What the gears hold on each rank (and in one process): every gear built, with each store.
MEMORY = r"""
import json, resource, sys
import mlx.core as mx
from gearbx_mlx import load
from gearbx_mlx.distributed import launched_group
g = launched_group()
out = {"rank": g.rank() if g is not None else 0, "ranks": g.size() if g is not None else 1, "stores": {}}
for store in ("separate", "nested"):
    model, tok, gb = load(sys.argv[1] or None, group=g, store=store)
    for gear in ("mid", "low"):
        gb.manager.prepare(gear)
    mem = gb.manager.memory()
    out["stores"][store] = {"managed_modules": len(gb.manager.paths), **mem}
    del model, tok, gb
out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("MEMORY", json.dumps(out))
"""


def machine() -> Dict[str, Any]:
    from importlib.metadata import version

    info: Dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "cpus": os.cpu_count(),
                            "loadavg_start": list(os.getloadavg()),
                            "ld_preload": os.environ.get("LD_PRELOAD", "")}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return info


def run(cmd: List[str], timeout: int) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; kill the group if it outlives ``timeout``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise SystemExit(f"{' '.join(cmd[:6])} ... outlived {timeout} s") from None
    if p.returncode != 0 or "error:" in err:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def launcher(ranks: int) -> List[str]:
    exe = shutil.which("mlx.launch", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
    if exe is None:
        raise SystemExit("mlx.launch is not installed beside this Python")
    env = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return [exe, "-n", str(ranks), "--backend", "ring", "-p", str(free_port_base(ranks)), "--env",
            f"PYTHONPATH={env}", "--python", sys.executable]


def generate(args: argparse.Namespace, flags: List[str], ranks: int, trace: Path) -> Dict[str, Any]:
    """One CLI run (alone, or on ``ranks`` ranks); what its trace says."""
    cli = ["-m", "gearbx_mlx.generate", "--prompt", PROMPT, "--max-tokens", str(args.tokens), "--quiet",
           "--trace", str(trace), *(["--model", args.model] if args.model else []), *flags]
    cmd = [*launcher(ranks), *cli] if ranks > 1 else [sys.executable, *cli]
    tic = time.perf_counter()
    run(cmd, args.timeout)
    wall = time.perf_counter() - tic
    t = read_trace(trace)
    s = t.summary
    shown = [c if c != str(trace) else "TRACE.jsonl" for c in cli]
    launch = ["mlx.launch", "-n", str(ranks), "--backend", "ring", "--python", "python"] if ranks > 1 else ["python"]
    out = {"ranks": ranks, "flags": flags, "command": shlex.join(launch + shown),
           "generation_tokens": s["generation_tokens"], "generation_tps": s["generation_tps"],
           "prompt_tps": s["prompt_tps"], "wall_seconds": wall,
           "tokens_per_gear": s["tokens_per_gear"]}
    d = s.get("distributed")
    if d:
        waits = [r["exchange_seconds"] for r in t.tokens if r.get("exchange_seconds") is not None]
        out.update(distributed=d, exchange_seconds_per_token_median=statistics.median(waits) if waits else None,
                   exchange_share_of_step=(sum(waits) / len(waits)) * s["generation_tps"] if waits else None)
    return out


def launched(script: str, tag: str, ranks: int, argv: List[str], timeout: int) -> List[Dict[str, Any]]:
    """Run ``script`` on ``ranks`` ranks; the JSON each rank printed after ``tag``."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        p = run([*launcher(ranks), f.name, *argv], timeout)
    finally:
        os.unlink(f.name)
    return sorted((json.loads(ln.split(" ", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith(tag + " ")),
                  key=lambda r: r["rank"])


def alone(script: str, tag: str, argv: List[str], timeout: int) -> Dict[str, Any]:
    """Run ``script`` in one process; the JSON it printed after ``tag``."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        p = run([sys.executable, f.name, *argv], timeout)
    finally:
        os.unlink(f.name)
    return next(json.loads(ln.split(" ", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith(tag + " "))


def memory_rows(one: Dict[str, Any], ranks: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per store and rank: the gears' resident bytes against one process's, and the share expected."""
    rows = []
    for store, mem in one["stores"].items():
        for r in ranks:
            got = r["stores"][store]
            rows.append({"store": store, "rank": r["rank"], "ranks": r["ranks"],
                         "resident_bytes": got["resident_total"], "one_process_bytes": mem["resident_total"],
                         "fraction_of_one_process": got["resident_total"] / mem["resident_total"],
                         "managed_modules": got["managed_modules"]})
    return rows


def table(result: Dict[str, Any]) -> str:
    lines = [f"{'run':44s} {'ranks':>5s} {'tok/s':>8s} {'coll/step':>9s} {'wait ms':>8s} {'agree':>7s}"]
    for r in result["runs"]:
        d = r.get("distributed") or {}
        wait = r.get("exchange_seconds_per_token_median")
        agree = f"{d['steps_ranks_agree']}/{d['steps_ranks_agree'] + d['steps_ranks_differ']}" if d else "-"
        lines.append(f"{' '.join(r['flags']) or 'dynamic':44s} {r['ranks']:5d} {r['generation_tps']:8.2f} "
                     f"{d.get('collectives_per_step', 0) or 0:9.2f} "
                     f"{'-' if wait is None else f'{1e3 * wait:.3f}':>8s} {agree:>7s}")
    for ab in result["exchange_ab"]:
        t = ab["tps"]
        lines.append(f"rank {ab['rank']}: {t['shared']:.2f} tok/s with rank 0's values shared, {t['own']:.2f} with "
                     f"each rank deciding alone ({ab['exchange_ms_per_token']:+.2f} ms a token; median of "
                     f"{ab['rounds']} rounds of {ab['tokens']['shared']} tokens; same tokens: {ab['same_tokens']})")
    for m in result["memory"]:
        lines.append(f"rank {m['rank']} of {m['ranks']}, {m['store']} store: gears hold "
                     f"{m['resident_bytes'] / 2**20:.2f} MiB, one process {m['one_process_bytes'] / 2**20:.2f} MiB "
                     f"({m['fraction_of_one_process']:.4f}; one shard = {1 / m['ranks']:.4f})")
    for m in result["micro"]:
        lines.append(f"rank {m['rank']}: exchange alone {1e3 * m['exchange_s']:.3f} ms (its table's all_sum alone "
                     f"{1e3 * m['table_all_sum_s']:.3f} ms), one hidden row's all_sum "
                     f"{1e3 * m['hidden_row_all_sum_s']:.3f} ms (median of {result['reps']})")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a name or folder the generate command takes (default: its default model)")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks (default: the smallest that divides the model's heads)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=200, help="repetitions of the exchange timed alone")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the with/without-exchange comparison")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--quick", action="store_true", help="8 tokens, 50 repetitions: a smoke test")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "distributed_cpu.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.reps, args.rounds = 8, 50, 1
    from mlx_lm import load as mlx_load

    from gearbx_mlx.distributed.shard import world_sizes
    from gearbx_mlx.sources.models import resolve_model

    path = resolve_model(args.model)
    model, _ = mlx_load(path, lazy=True)  # the shapes only: nothing is read
    sizes = world_sizes(model)
    hidden = model.args.hidden_size
    del model
    ranks = args.ranks or (sizes[0] if sizes else None)
    if ranks is None or ranks not in sizes:
        raise SystemExit(f"{ranks} ranks cannot split this model's heads: choose one of {sizes}")
    result: Dict[str, Any] = {
        "what": "gears on a model sharded with mlx.distributed: one process against ranks on this machine",
        "caveat": "ranks on one machine share its cores and talk over the loopback: this measures the decision "
                  "overhead and correctness here, not the speed of a model split over several Macs (unmeasured)",
        "date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": args.model or "default",
        "model_path_name": Path(path).name, "tokens": args.tokens, "reps": args.reps,
        "command": "python scripts/bench_distributed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for flags in (["--static-gear", "high"], []):
            for n in (1, ranks):
                trace = Path(tmp) / f"{n}-{len(flags)}.jsonl"
                r = generate(args, flags, n, trace)
                result["runs"].append(r)
                print(f"{n} rank(s) {' '.join(flags) or 'dynamic'}: {r['generation_tps']:.2f} tok/s", flush=True)
    print("with and without the exchange ...", flush=True)
    result["exchange_ab"] = launched(AB, "AB", ranks, [args.model or "", str(args.tokens), str(args.rounds), PROMPT],
                                     args.timeout)
    print("memory of the gears ...", flush=True)
    one = alone(MEMORY, "MEMORY", [args.model or ""], args.timeout)
    result["memory_one_process"] = one
    result["memory_ranks"] = launched(MEMORY, "MEMORY", ranks, [args.model or ""], args.timeout)
    result["memory"] = memory_rows(one, result["memory_ranks"])
    result["micro"] = launched(MICRO, "MICRO", ranks, [str(args.reps), str(hidden)], args.timeout)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
