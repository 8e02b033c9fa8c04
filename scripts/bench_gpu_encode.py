"""Host cost of one graph node on MLX's GPU back end, by kind of node and by its inputs.

A decode step of the nested gears on a GPU was measured to be paced by the
host: ``mx.async_eval`` of a mid-gear step took 1.3-1.8 ms more than an MLX
8-bit step although it launches fewer kernels. This isolates what a node costs
the host. Each case is a chain of ``--nodes`` nodes (each reads the one
before, like a model's layers), built inside ``mx.compile`` as the package's
blocks are, then timed per round:

* ``build``: calling the compiled function (the graph of its nodes),
* ``encode``: ``mx.async_eval`` (each node's ``eval_gpu``: arguments, CUDA
  graph nodes, launches),
* ``wait``: ``mx.eval`` after it (what the GPU had left).

Cases: a custom kernel (``mx.fast.cuda_kernel``/``metal_kernel``) with each of
``--inputs`` inputs that it all reads, then with the most of them at 16 MiB each
(the size of an input should not matter), then with its output cut in three
slices that the next node reads (as the q/k/v of a fused product); MLX's ``quantized_matmul`` (4 inputs)
at 4 and 8 bits; an element-wise ``add`` (2 inputs); with ``--package`` the
package's own mid-gear product, launched as a decode step launches it (``--inline-text``: built
from its whole text, not from ``#include`` lines); with ``--text-kb`` a one-input kernel whose
header carries that much comment (MLX hashes a kernel's text on every call). Run it once per value of
``MLX_MAX_OPS_PER_BUFFER`` to see the cost per CUDA graph (``--graph-sizes``
starts one process per size).

    python scripts/bench_gpu_encode.py --out benchmarks/results/gpu_encode_h200.json

Prints a table of microseconds per node (median over rounds) and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

#: Width of the chained activation; each extra input is a small float32 vector.
WIDTH = 4096
EXTRA = 256


def custom_kernel(backend: str, n_inputs: int, extra: int = EXTRA, split: int = 1, text_kb: int = 0) -> Callable:
    """A kernel reading ``x`` and ``n_inputs - 1`` more inputs of ``extra`` floats each:
    ``y[i] = x[i] + sum_j a_j[i % EXTRA]``. With ``split > 1`` it writes ``split`` blocks of
    ``WIDTH`` (as a fused q/k/v product does) and the node returns them as slices, the first
    as the next node's ``x`` and the others among its inputs. ``text_kb`` > 0 adds that many
    KiB of comment to its header: the same compiled code, a longer text for MLX to handle."""
    names = ["x"] + [f"a{j}" for j in range(1, n_inputs)]
    terms = " + ".join(f"static_cast<float>({n}[i % {EXTRA}])" for n in names[1:]) or "0.0f"
    width = WIDTH * split
    if backend == "cuda":
        source = (f"unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                  f"if (i < {width}) y[i] = static_cast<float>(x[i % {WIDTH}]) + {terms};\n")
        make = mx.fast.cuda_kernel
    else:
        source = (f"uint i = thread_position_in_grid.x;\n"
                  f"if (i < {width}) y[i] = static_cast<float>(x[i % {WIDTH}]) + {terms};\n")
        make = mx.fast.metal_kernel
    header = "".join(f"// {'x' * 60} {j}\n" for j in range(text_kb * 1024 // 66))
    kernel = make(name=f"gbx_encode_probe_{n_inputs}_{split}_{extra}_{text_kb}", input_names=names,
                  output_names=["y"], source=source, header=header, ensure_row_contiguous=True)
    extras = [mx.random.normal((extra,)) for _ in range(n_inputs - 1)]
    mx.eval(extras)

    def launch(x: mx.array, inputs: List[mx.array]) -> mx.array:
        return kernel(inputs=[x, *inputs], grid=(width, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(width,)],
                      output_dtypes=[mx.float32])[0]

    if split == 1:
        return lambda x: launch(x, extras)

    def node(x: mx.array) -> mx.array:  # x: the last node's blocks, concatenated by the chain
        blocks = [x[j * WIDTH:(j + 1) * WIDTH] for j in range(split)]
        return launch(blocks[0], [*blocks[1:split], *extras[split - 1:]])

    return node


def nested_mid(backend: str, width: int = WIDTH) -> Callable:
    """The package's mid-gear product (two 4-bit planes) of a ``width x width`` bfloat16
    weight, launched as a decode step launches it (``Launcher.bound``); bfloat16 in and out.
    A small ``width`` leaves the GPU idle: what remains of ``encode`` is the host's alone."""
    from gearbx_mlx.bindings import nested_gpu
    from gearbx_mlx.nested.planes import DEFAULT_PLAN, build_planes

    plan = DEFAULT_PLAN[:2]
    planes = build_planes((mx.random.normal((width, width)) * 0.02).astype(mx.bfloat16), plan)
    launcher = nested_gpu.launcher(backend, tuple(b for b, _ in plan), tuple(g for _, g in plan), width, width,
                                   mx.bfloat16, mx.bfloat16, False)
    run = launcher.bound(nested_gpu.plane_arrays(planes, 2), nested_gpu.factors_of(planes, 2))
    mx.eval(planes[0].weight)
    return lambda x: run(x, x.shape, None)


def inline_cuda_text() -> None:
    """Build the package's CUDA kernels from their whole text, as the package did before it
    handed MLX ``#include`` lines of files (``gearbx_mlx.bindings.cuda_text``)."""
    from gearbx_mlx.bindings import cuda_text

    cuda_text.include_text = lambda name, input_names, header, source, folder=None: (header, source)


def quantized(bits: int) -> Callable:
    w = mx.random.normal((WIDTH, WIDTH)) * 0.02
    q, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=bits)
    mx.eval(q, s, b)

    def node(x: mx.array) -> mx.array:
        return mx.quantized_matmul(x.reshape(1, WIDTH).astype(mx.bfloat16), q, s, b, transpose=True,
                                   group_size=64, bits=bits).reshape(WIDTH).astype(mx.float32)

    return node


def add() -> Callable:
    a = mx.random.normal((WIDTH,))
    mx.eval(a)
    return lambda x: x + a


def chain(node: Callable, nodes: int) -> Callable:
    def run(x: mx.array) -> mx.array:
        for _ in range(nodes):
            x = node(x)
        return x

    return mx.compile(run)


def time_case(fn: Callable, rounds: int, width: int = WIDTH, dtype: mx.Dtype = mx.float32) -> Dict[str, float]:
    x = mx.random.normal((width,)).astype(dtype)
    mx.eval(x)
    for _ in range(3):  # trace, compile the kernels, warm the CUDA graphs
        mx.eval(fn(x))
    build, encode, wait = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        y = fn(x)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        encode.append(t2 - t1)
        wait.append(t3 - t2)
    return {"build_us": statistics.median(build) * 1e6, "encode_us": statistics.median(encode) * 1e6,
            "wait_us": statistics.median(wait) * 1e6, "encode_min_us": min(encode) * 1e6}


def run_cases(args: argparse.Namespace) -> Dict[str, object]:
    backend = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else None
    if backend is None:
        raise SystemExit("bench_gpu_encode: no GPU back end (MLX with CUDA or Metal is needed)")
    mx.random.seed(0)
    cases: Dict[str, Callable] = {f"custom, {k} inputs": custom_kernel(backend, k) for k in args.inputs}
    k = max(args.inputs)
    cases[f"custom, {k} inputs of 16 MiB"] = custom_kernel(backend, k, extra=1 << 22)
    if k >= 3:
        cases[f"custom, {k} inputs, 3 slices out"] = custom_kernel(backend, k, split=3)
    # Four kernels of different names in turn, as a decode step's products of different shapes.
    turn = [custom_kernel(backend, k, extra=EXTRA + j) for j in range(4)]
    order = itertools.cycle(turn)
    cases[f"custom, {k} inputs, 4 kernels in turn"] = lambda x: next(order)(x)
    cases.update({"quantized_matmul 4-bit": quantized(4), "quantized_matmul 8-bit": quantized(8), "add": add()})
    for kb in args.text_kb:
        cases[f"custom, 1 input, {kb} KiB of text"] = custom_kernel(backend, 1, text_kb=kb)
    if args.package:
        cases["the package's mid gear, 4096x4096"] = nested_mid(backend)
        cases["the package's mid gear, 256x256"] = nested_mid(backend, 256)
    rows = []
    for name, node in cases.items():
        width = 256 if "256x256" in name else WIDTH * (3 if "slices" in name else 1)
        t = time_case(chain(node, args.nodes), args.rounds, width, mx.bfloat16 if "package" in name else mx.float32)
        rows.append({"case": name, "nodes": args.nodes, "package_text": "inline" if args.inline_text else "files", **t,
                     **{f"{k[:-3]}_us_per_node": v / args.nodes for k, v in t.items() if k.endswith("_us")}})
        print(f"{name:26s} build {rows[-1]['build_us_per_node']:6.2f}  encode {rows[-1]['encode_us_per_node']:6.2f}"
              f"  wait {rows[-1]['wait_us_per_node']:6.2f} us/node", flush=True)
    return {"backend": backend, "mlx": mx.__version__, "device": str(mx.default_device()),
            "max_ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default"), "rows": rows}


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=512, help="nodes per chain (default 512, about a decode step's)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--text-kb", type=int, nargs="*", default=[],
                   help="also a one-input kernel whose header has this many KiB of comment, for each value given")
    p.add_argument("--inputs", type=int, nargs="+", default=[1, 2, 4, 8, 12], help="custom kernels' input counts")
    p.add_argument("--graph-sizes", type=int, nargs="*", default=[],
                   help="run once per MLX_MAX_OPS_PER_BUFFER value, each in its own process")
    p.add_argument("--package", action="store_true",
                   help="also the package's own mid-gear product (gearbx_mlx's nested GPU kernel)")
    p.add_argument("--inline-text", action="store_true",
                   help="hand MLX the package kernels' whole text, not the #include lines of its files (as before)")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    if args.inline_text:
        inline_cuda_text()
    if args.nodes < 1 or args.rounds < 1 or min(args.inputs) < 1:
        p.error("--nodes, --rounds and --inputs must be at least 1")
    runs = []
    if args.graph_sizes:
        for size in args.graph_sizes:
            print(f"MLX_MAX_OPS_PER_BUFFER={size}", flush=True)
            child = [sys.executable, __file__, "--nodes", str(args.nodes), "--rounds", str(args.rounds), "--inputs",
                     *map(str, args.inputs), "--text-kb", *map(str, args.text_kb), "--out", "/dev/stdout",
                     *(["--package"] if args.package else []), *(["--inline-text"] if args.inline_text else [])]
            done = subprocess.run(child, env={**os.environ, "MLX_MAX_OPS_PER_BUFFER": str(size)},
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"bench_gpu_encode: the run at MLX_MAX_OPS_PER_BUFFER={size} failed:\n"
                                 + done.stderr[-3000:])
            out = done.stdout
            print("\n".join(line for line in out.splitlines() if " us/node" in line), flush=True)
            runs += json.loads(out[out.index("{"):])["runs"]
    else:
        runs.append(run_cases(args))
    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "runs": runs}
    if args.out:
        text = json.dumps(result, indent=1)
        if str(args.out) == "/dev/stdout":
            sys.stdout.write(text + "\n")
        else:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
