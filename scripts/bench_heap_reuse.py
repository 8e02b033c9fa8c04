"""mlx-lm's GPTQ on one large layer, with glibc's defaults and inside ``gearbx_mlx.heap.reuse_large_buffers``.

    python scripts/bench_heap_reuse.py [--shape 16384x768] [--rounds 2] [--out FILE.json]

Each run is a fresh process (glibc's settings are process-wide): a model of
one float32 ``nn.Linear`` of ``--shape`` (out x in, random weights, seed 0)
quantized by ``mlx_lm.quant.gptq.gptq_quantize`` to 4 bits in groups of 64
from 8 random input rows of 64 tokens, the quantizer alone timed: wall time,
the process's user and system CPU seconds and its minor page faults. The two
modes alternate in each of ``--rounds`` rounds, and each run prints a
SHA-256 of the quantized weight, scales and biases, which must be the same
in both modes (the arithmetic does not change, only where the memory comes
from). A weight above 32 MiB (glibc's largest mmap threshold on 64-bit) is
the case that matters: each column's update makes a new array of it. Prints
a table and writes JSON (default ``benchmarks/results/heap_reuse_gptq.json``)
with the machine's load average around each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
MODES = ("glibc defaults", "reuse_large_buffers")


def child(mode: str, out_features: int, in_features: int) -> Dict[str, Any]:
    """One quantization in this process; returns its measurements."""
    import contextlib
    import hashlib
    import io
    import resource
    import time

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_lm.quant.gptq import gptq_quantize

    from gearbx_mlx.heap import reuse_large_buffers

    class OneLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(in_features, out_features, bias=False)

        def __call__(self, x: mx.array) -> mx.array:
            return self.proj(x)

    mx.random.seed(0)
    model = OneLayer()
    data = mx.random.normal((8, 64, in_features))
    mx.eval(model.parameters(), data)
    block = reuse_large_buffers() if mode == MODES[1] else contextlib.nullcontext(False)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with block as on, contextlib.redirect_stderr(io.StringIO()):  # mlx-lm's progress bars
        gptq_quantize(model, data, 4, 64, 4, 64)
        mx.eval(model.parameters())
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    q = model.proj
    digest = hashlib.sha256(b"".join(np.array(a).tobytes() for a in (q.weight, q.scales, q.biases))).hexdigest()
    return {"mode": mode, "heap_reuse_on": bool(on), "wall_s": round(wall, 3),
            "user_s": round(r1.ru_utime - r0.ru_utime, 3), "sys_s": round(r1.ru_stime - r0.ru_stime, 3),
            "minor_faults": r1.ru_minflt - r0.ru_minflt, "sha256": digest}


def run(mode: str, shape: str) -> Dict[str, Any]:
    from gearbx_mlx.evaluation.machine import load_average

    load = load_average()
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--shape", shape], capture_output=True,
                          text=True, check=False, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"error: the {mode!r} run failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load_average_before"], result["load_average_after"] = load, load_average()
    return result


def table(runs: List[Dict[str, Any]]) -> str:
    lines = ["| mode | wall s, median [min-max] | user s | sys s | minor faults |", "| --- | ---: | ---: | ---: | ---: |"]
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        walls = [r["wall_s"] for r in rs]
        med = {k: statistics.median(r[k] for r in rs) for k in ("user_s", "sys_s", "minor_faults")}
        lines.append(f"| {mode} | {statistics.median(walls):.1f} [{min(walls):.1f}-{max(walls):.1f}] | "
                     f"{med['user_s']:.1f} | {med['sys_s']:.1f} | {med['minor_faults']:,.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="16384x768", help="OUTxIN of the layer (default 16384x768: 48 MiB float32)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "heap_reuse_gptq.json"))
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out_features, in_features = (int(v) for v in args.shape.lower().split("x"))
    if args.child:
        print(json.dumps(child(args.child, out_features, in_features)))
        return 0
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    runs = []
    for rnd in range(args.rounds):
        for mode in MODES:
            r = run(mode, args.shape)
            r["round"] = rnd
            runs.append(r)
            print(f"  round {rnd} {mode}: {r['wall_s']:.1f} s wall, {r['sys_s']:.1f} s sys, "
                  f"{r['minor_faults']:,} faults", file=sys.stderr)
    from gearbx_mlx.evaluation.machine import blas, hardware

    same = len({r["sha256"] for r in runs}) == 1
    print(table(runs))
    print(f"quantized arrays identical in every run: {same}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "what": "mlx_lm.quant.gptq.gptq_quantize on one float32 nn.Linear, 4 bits, groups of 64, 8x64 random "
                "input rows; a fresh process per run, modes alternating",
        "shape": args.shape, "rounds": args.rounds, "identical_outputs": same, "runs": runs,
        "command": "python scripts/bench_heap_reuse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "hardware": hardware(), "blas": blas(), "date": date.today().isoformat()}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
