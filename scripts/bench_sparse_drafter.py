"""Dense vs activation-sparse drafter on one model, in one run; print a table, write JSON.

Drafters (all the low gear, 4-bit g64, scope all; ``--variants`` picks some):
  * ``dense-host``: the default fast drafter (numpy decode step around the C GEMV);
  * ``dense-tree``: the dense drafter in the MLX module tree (``--draft-sparsity 0``:
    every block kept), the fair reference of the tree's gathers;
  * ``sparse-S`` (S = 0.1, 0.25, 0.5): the sparse drafter at that target sparsity,
    its default gather (``auto``): the host step with down_proj the C block-sparse
    kernel over the kept blocks (``gbx_sparse_gemv_top``);
  * ``sparse-S-experts`` / ``sparse-S-take``: the same in the MLX tree, gathering
    with ``mx.gather_qmm`` over a block-major copy of down_proj, or with ``mx.take``
    of the packed columns before ``mx.quantized_matmul``.

Measured per drafter, interleaved (every repeat runs all drafters in turn):
  * modeled weight bytes per one-token draft step: every managed linear's
    low-gear bytes, down_proj counted for its kept blocks only;
  * one draft step's time (a one-token step on a warm cache, median of ``--steps``);
  * acceptance and end-to-end tokens/s of ``--speculative force`` (greedy,
    ``--tokens`` tokens), from the pipeline's own responses.
Median and spread (min, max) over ``--repeats``. Then one layer's down_proj
for one token, alone: the dense products (MLX, and the dense host step's C
nested GEMV) against the gathers and the C block-sparse kernel at half the blocks.

Run with OpenBLAS preloaded, as the CPU benchmarks are:
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      python scripts/bench_sparse_drafter.py [--repeats 3] [--model qwen2.5-coder-0.5b] \\
      [--variants dense-host sparse-0.25 ...] [--out benchmarks/results/sparse_drafter_cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from gearbx_mlx.bindings import cpu as cpu_kernels, sparse_cpu
from gearbx_mlx.chat import encode_chat
from gearbx_mlx.evaluation.machine import load_average, write_result
from gearbx_mlx.generation import load
from gearbx_mlx.pipeline import stream_speculative_generate
from gearbx_mlx.precision import nbytes
from gearbx_mlx.speculative.decode import SpeculativeConfig, get_draft
from gearbx_mlx.speculative.sparse import (
    block_major,
    build_sparse_draft,
    calibration_tokens,
    expert_down,
    ffn_layers,
    quant_parts,
    sparse_down,
    sparse_path,
    top_blocks,
)

#: name -> (target sparsity, gather); None: the dense drafter of the default path.
VARIANTS = {"dense-host": (None, None), "dense-tree": (0.0, "experts"),
            **{f"sparse-{s:g}": (s, "auto") for s in (0.1, 0.25, 0.5)},
            **{f"sparse-{s:g}-experts": (s, "experts") for s in (0.25, 0.5)}, "sparse-0.5-take": (0.5, "take")}
DEFAULT_VARIANTS = ("dense-host", "sparse-0.1", "sparse-0.25", "sparse-0.5", "sparse-0.25-experts")
PROMPT = "Describe a walk along a river on an autumn morning."


def step_bytes(draft: Any) -> int:
    """Weight bytes one one-token draft step reads (managed layers; down_proj's kept blocks only)."""
    mods = dict(draft.module.named_modules())
    total = 0
    for p in draft.paths:
        try:
            q = quant_parts(mods[p])
            total += q.weight.nbytes + q.scales.nbytes + q.biases.nbytes
        except ValueError:
            total += nbytes(mods[p])
    if draft.sparse:
        total -= draft.sparse["down_bytes"] - draft.sparse["kept_down_bytes"]
    return int(total)


def time_step(draft: Any, ids: List[int], steps: int) -> float:
    """Median seconds of a one-token draft step after the prompt."""
    cache = draft.make_cache() if draft.host is not None else make_prompt_cache(draft.module)
    out = draft(mx.array(ids)[None], cache=cache)
    mx.eval(out)
    tok = int(mx.argmax(out[0, -1]))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = draft(mx.array([[tok]]), cache=cache)
        mx.eval(out)
        times.append(time.perf_counter() - t0)
        tok = int(mx.argmax(out[0, -1]))
    return statistics.median(times)


def layer_product(draft: Any, kept: float, reps: int) -> Dict[str, float]:
    """Microseconds of one layer's down_proj for one token (layer 0 of the drafter): the dense
    ``mx.quantized_matmul`` and the dense host step's C nested GEMV (raw cffi call), and at
    ``kept`` of the blocks the ``take`` gather and product, ``gather_qmm`` over the block-major
    copy, and the C block-sparse kernel (block choice included: ``gbx_sparse_gemv_top``, raw
    cffi call, on the host step's path); ``(median, min)`` of ``reps`` timed calls each."""
    down = ffn_layers(draft.module)[0].mlp.down_proj
    parts = quant_parts(down)
    nb, g = parts.scales.shape[1], parts.group_size
    out, inp = parts.weight.shape[0], nb * g
    h = mx.random.normal((1, inp), key=mx.random.key(0))
    keep = max(1, round(kept * nb))
    blocks = top_blocks(h[0], keep, g)
    major = block_major(parts)
    ext = cpu_kernels.require()
    ffi, lib = ext.ffi, ext.lib
    path = sparse_path(down)
    hn = np.array(h[0])
    y = np.empty(out, np.float32)
    px, py = ffi.from_buffer("float[]", hn), ffi.from_buffer("float[]", y, require_writable=True)
    prep = sparse_cpu.prepared_sparse(parts)
    kept_buf = np.zeros(keep, np.int32)
    pk = ffi.from_buffer("int32_t[]", kept_buf, require_writable=True)
    cases = {
        "dense_quantized_matmul": lambda: mx.eval(mx.quantized_matmul(h, parts.weight, parts.scales, parts.biases,
                                                                      transpose=True, group_size=g, bits=parts.bits)),
        "take_then_quantized_matmul": lambda: mx.eval(sparse_down(h, parts, blocks)),
        "gather_qmm_block_major": lambda: mx.eval(expert_down(h, major, parts, blocks)),
        "block_ranking": lambda: mx.eval(top_blocks(h[0], keep, g)),
        f"c_sparse_top_{path}": lambda: lib.gbx_sparse_gemv_top(prep.plane, px, keep, pk, py, out, inp,
                                                                  cpu_kernels.PATHS[path], 0),
    }
    nested = down.get("nested")
    if nested is not None and nested.product.cpu_prepared() is not None:
        table = nested.product.cpu_prepared().table
        cases[f"c_dense_nested_{path}"] = lambda: lib.gbx_nested_gemv(table, 1, px, py, 1, out, inp,
                                                                       cpu_kernels.PATHS[path], 0)
    res: Dict[str, float] = {}
    for _ in range(2):  # interleaved: every case in each round, the second round's numbers kept
        for name, f in cases.items():
            f()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            res[name] = 1e6 * statistics.median(ts)
            res[name + "_min"] = 1e6 * min(ts)
    return res


def generate(model: Any, tok: Any, gearbox: Any, ids: List[int], draft: Any, n: int) -> Dict:
    sparsity = draft.sparse["sparsity"] if draft.sparse else None
    return speculative_run(model, tok, gearbox, ids, draft, n, SpeculativeConfig(mode="force", draft_sparsity=sparsity))


def speculative_run(model: Any, tok: Any, gearbox: Any, ids: List[int], draft: Any, n: int,
                    config: SpeculativeConfig) -> Dict:
    """``n`` tokens of speculative decoding with ``draft``: its tokens, accepted and drafted counts,
    acceptance and the pipeline's own tokens/s."""
    accepted = 0
    tokens, last, blocks = [], None, {}
    for r in stream_speculative_generate(model, tok, ids, gearbox, config=config, max_tokens=n, draft=draft):
        tokens.append(r.token)
        accepted += r.accepted
        blocks[r.block] = r.drafted
        last = r
    drafted = sum(blocks.values())
    return {"tokens": tokens, "accepted": accepted, "drafted": drafted,
            "acceptance": accepted / drafted if drafted else None, "tokens_per_s": last.generation_tps}


def spread(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def measure(args: argparse.Namespace) -> Dict:
    model, tok, gearbox = load(args.model)
    ids = encode_chat(tok, PROMPT)
    dense = get_draft(model, gearbox, "low", "all")
    calib = calibration_tokens(tok)
    drafts = {}
    for name in args.variants:
        sparsity, gather = VARIANTS[name]
        drafts[name] = dense if sparsity is None else build_sparse_draft(dense, sparsity, calib, gather)
    runs: Dict[str, Dict[str, List[Any]]] = {n: {"step_s": [], "acceptance": [], "tokens_per_s": []} for n in drafts}
    texts: Dict[str, List[int]] = {}
    for rep in range(args.repeats):
        for name in drafts:
            runs[name]["step_s"].append(time_step(drafts[name], ids, args.steps))
            g = generate(model, tok, gearbox, ids, drafts[name], args.tokens)
            runs[name]["acceptance"].append(g["acceptance"])
            runs[name]["tokens_per_s"].append(g["tokens_per_s"])
            texts.setdefault(name, g["tokens"])
            print(f"repeat {rep + 1} {name:<16} step {1e3 * runs[name]['step_s'][-1]:7.1f} ms  acceptance "
                  f"{g['acceptance'] or 0:.3f}  {g['tokens_per_s']:.2f} tok/s", flush=True)
    same = len({tuple(t) for t in texts.values()}) == 1
    out = {}
    base = step_bytes(dense)
    for name, d in drafts.items():
        out[name] = {
            "draft_sparsity": VARIANTS[name][0], "gather": VARIANTS[name][1],
            "path": "host" if d.host is not None else "mlx",
            "kept_fraction": d.sparse["kept_fraction"] if d.sparse else 1.0,
            "step_bytes": step_bytes(d), "step_bytes_vs_dense": step_bytes(d) / base,
            "step_s": spread(runs[name]["step_s"]),
            "acceptance": spread(runs[name]["acceptance"]), "tokens_per_s": spread(runs[name]["tokens_per_s"]),
        }
    layer = {"kept_fraction": 0.5, "reps": 200, **layer_product(dense, 0.5, 200)}
    ratios = {name: [t / d for t, d in zip(runs[name]["tokens_per_s"], runs["dense-host"]["tokens_per_s"])]
              for name in drafts if "dense-host" in drafts}
    return {"prompt": PROMPT, "tokens_per_s_vs_dense_host_per_repeat": ratios, "tokens": args.tokens, "repeats": args.repeats, "steps": args.steps,
            "outputs_identical": same, "drafters": out, "down_proj_layer_us": layer}


def table(r: Dict) -> str:
    lines = [f"{'drafter':<20} {'path':>4} {'kept':>5} {'MB/step':>8} {'bytes':>5} {'step ms':>16} "
             f"{'acceptance':>18} {'tok/s':>18}"]
    for name, d in r["drafters"].items():
        s, a, t = d["step_s"], d["acceptance"], d["tokens_per_s"]
        lines.append(f"{name:<20} {d['path']:>4} {d['kept_fraction']:5.2f} {d['step_bytes'] / 1e6:8.2f} "
                     f"{d['step_bytes_vs_dense']:5.2f} "
                     f"{1e3 * s['median']:6.1f} [{1e3 * s['min']:.0f}-{1e3 * s['max']:.0f}] "
                     f"{a['median']:6.3f} [{a['min']:.2f}-{a['max']:.2f}] "
                     f"{t['median']:6.2f} [{t['min']:.1f}-{t['max']:.1f}]")
    lines.append(f"greedy outputs identical across drafters: {r['outputs_identical']}")
    for name, ratio in r["tokens_per_s_vs_dense_host_per_repeat"].items():
        lines.append(f"tokens/s / dense-host's, per repeat, {name}: " + ", ".join(f"{x:.2f}" for x in ratio))
    lay = r["down_proj_layer_us"]
    lines.append("one layer's down_proj, one token, half the blocks kept (us, median): " + ", ".join(
        f"{k} {v:.0f}" for k, v in lay.items() if k not in ("kept_fraction", "reps") and not k.endswith("_min")))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="draft steps timed per repeat")
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per speculative run")
    p.add_argument("--model", default=None, help="a named model (qwen2.5-coder-0.5b, ...); default: the default model")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS))
    p.add_argument("--out", default="benchmarks/results/sparse_drafter_cpu.json")
    a = p.parse_args(argv)
    load_before = load_average()
    r = measure(a)
    print(table(r))
    r.update(model=a.model or "SmolLM2-135M-Instruct (default, float32)", c_kernels=cpu_kernels.info())
    write_result(a.out, r, "python scripts/bench_sparse_drafter.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 load_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
