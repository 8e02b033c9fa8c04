"""The nested store's dense prefill on the CPU: its C unpacking, and the product after it, by kernel.

    python scripts/bench_unpack_cpu.py [--shapes 1536x576 576x1536 576x576] [--rows 56]
                                       [--rounds 400] [--threads 1] [--out FILE.json]

For each shape, the planes of a random weight (the default plan) are unpacked
into one float32 matrix as a prefill unpacks them
(``PreparedNested.unpack``, the mid gear's two planes and the high gear's
three), and ``x @ w.T`` of ``--rows`` float32 input rows follows each
unpacking. The C library's kernels are taken in turn, alternated call by
call in one process so that both meet the same machine:

* ``best``: what the library picks (on a CPU with AVX-512F: each span of 32
  weights formed from every 4- and 8-bit plane in registers and stored once;
  a plan with a 6-bit plane keeps the AVX2 kernel);
* ``avx2``: the plain AVX2 kernels (``gbx_set_isa_limit(1)``), a plane at a
  time.

Both give the same values bit for bit (checked here before timing). Prints
the medians in microseconds and writes them, the load average, the BLAS MLX
calls and the CPU to ``--out`` (default
``benchmarks/results/unpack_cpu.json``). Preload an optimized BLAS for the
product's times to mean anything (``LD_PRELOAD`` of Debian's OpenBLAS, as
``.ci/run`` does). ``PYTHONPATH=OTHER_CHECKOUT`` times that checkout's
package and kernels instead (the code before a change, say); the JSON says
which (``package``: this checkout's or PYTHONPATH's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import mlx.core as mx  # noqa: E402

from gearbx_mlx import blas  # noqa: E402
from gearbx_mlx.atomicfile import write_json  # noqa: E402
from gearbx_mlx.bindings import cpu, nested_cpu  # noqa: E402
from gearbx_mlx.nested.planes import build_planes  # noqa: E402

#: kernel name -> gbx_set_isa_limit level
KERNELS: Dict[str, int] = {"best": 0, "avx2": 1}


def parse_shape(text: str) -> tuple[int, int]:
    try:
        out, inp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is OUTxIN, got {text!r}") from None
    if out < 1 or inp < 64 or inp % 64:  # the default plan's groups of 64
        raise argparse.ArgumentTypeError(f"OUT >= 1 and IN a multiple of 64, got {text!r}")
    return out, inp


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def bench_shape(shape: tuple[int, int], n: int, rows: int, rounds: int, threads: int) -> Dict[str, Any]:
    """Median unpacking and product microseconds of each kernel, alternated call by call."""
    w = mx.random.normal(shape, key=mx.random.key(shape[0] * 7 + shape[1])) * 0.02
    planes = build_planes(w.astype(mx.bfloat16))[:n]
    mx.eval([p.arrays() for p in planes])
    prep = nested_cpu.prepare_nested(planes)
    x = mx.random.normal((rows, shape[1]), key=mx.random.key(1))
    out = mx.zeros(shape, dtype=mx.float32)
    values = {}
    for name, level in KERNELS.items():
        with cpu.isa_limit(level):
            values[name] = np.array(prep.unpack(n, threads=threads))
    if not all(np.array_equal(values["best"], v) for v in values.values()):
        raise SystemExit(f"error: the kernels' matrices differ at {shape}, {n} planes")
    times: Dict[str, Dict[str, List[float]]] = {k: {"unpack": [], "product": []} for k in KERNELS}
    for i in range(rounds):
        order = list(KERNELS.items()) if i % 2 == 0 else list(reversed(KERNELS.items()))
        for name, level in order:
            with cpu.isa_limit(level):
                t0 = time.perf_counter()
                prep.unpack(n, out=out, threads=threads)
                t1 = time.perf_counter()
                mx.eval(x @ out.T)
                t2 = time.perf_counter()
            times[name]["unpack"].append(t1 - t0)
            times[name]["product"].append(t2 - t1)
    return {name: {part: round(statistics.median(ts) * 1e6, 1) for part, ts in parts.items()}
            for name, parts in times.items()}


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[(1536, 576), (576, 1536), (576, 576)])
    ap.add_argument("--rows", type=positive, default=56, help="input rows of the product (default 56: a prompt)")
    ap.add_argument("--rounds", type=positive, default=400)
    ap.add_argument("--threads", type=positive, default=1, help="threads of the unpacking (and OpenBLAS's)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "unpack_cpu.json")
    args = ap.parse_args(argv)
    if not cpu.available():
        raise SystemExit("error: the C extension is not built (python gearbx_mlx/bindings/build.py)")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    mx.set_default_device(mx.cpu)
    # Imported once the package is (bench_cpu puts this checkout first on the path,
    # where PYTHONPATH=OTHER_CHECKOUT asked for that checkout's kernels).
    from bench_cpu import machine_info

    load_before = os.getloadavg()
    results = []
    print(f"{'shape':>10} {'gear':>5} {'kernel':>6} {'unpack us':>10} {'product us':>11}")
    for shape in args.shapes:
        for gear, n in (("mid", 2), ("high", 3)):
            res = bench_shape(shape, n, args.rows, args.rounds, args.threads)
            for name, r in res.items():
                print(f"{shape[0]:>5}x{shape[1]:<4} {gear:>5} {name:>6} {r['unpack']:>10.1f} {r['product']:>11.1f}")
            results.append({"shape": list(shape), "gear": gear, "planes": n, **res,
                            "unpack_best_over_avx2": round(res["best"]["unpack"] / res["avx2"]["unpack"], 3)})
    record = {"what": "C unpacking of the nested planes and the float32 product after it, medians in us",
              "command": "python scripts/bench_unpack_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "rows": args.rows, "rounds": args.rounds, "threads": args.threads,
              "package": "this checkout" if Path(cpu.__file__).resolve().parents[2] == ROOT else "PYTHONPATH's",
              "blas": blas.shown_path(blas.mlx_blas()), "machine": machine_info(),
              "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "results": results}
    print(f"wrote {write_json(args.out, record)}")


if __name__ == "__main__":
    main()
