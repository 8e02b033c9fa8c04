"""Teacher-forced greedy agreement of sparse host drafters with the high gear; write JSON.

Every drafter is the low gear's host step (numpy around the C kernels), fed the
evaluation text's tokens 128-255 one at a time; a position agrees when its
argmax is the high gear's (one MLX forward over the same tokens). Drafters:

  * ``dense``: the default drafter;
  * ``down-S``: the sparse drafter at target sparsity S (``down_proj`` over the
    kept blocks, the ``Σ|h|`` ranking of ``gbx_sparse_gemv_top``);
  * ``down-S-colnorm`` / ``down-S-colnorm2``: the same blocks kept per layer,
    ranked by ``Σ_j |h_j| ‖W_:,j‖`` (or ``Σ_j (h_j ‖W_:,j‖)²``) instead;
  * ``gateup-K``: dense ``down_proj``, ``gate_proj`` and ``up_proj`` over the
    ``K`` input blocks of 64 with the largest ``Σ|x|`` (TEAL-style input
    sparsity, through the same kernel).

Usage: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python scripts/bench_sparse_agreement.py [--model NAME] [--out benchmarks/results/sparse_agreement_default.json]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np

from gearbx_mlx.bindings import cpu as cpu_kernels, sparse_cpu
from gearbx_mlx.evaluation.machine import load_average, write_result
from gearbx_mlx.generation import load
from gearbx_mlx.speculative.decode import get_draft
from gearbx_mlx.speculative.host import HostForward
from gearbx_mlx.speculative.sparse import build_sparse_draft, calibration_tokens, ffn_layers, quant_parts, sparse_path
from gearbx_mlx.speculative.sparse_host import DOWN_SLOT

GATE_SLOT, UP_SLOT = 6, 7


class RankedDown:
    """``down_proj`` over ``keep`` blocks ranked by the column-norm-weighted mass (numpy), then the C kernel."""

    def __init__(self, prepared: Any, keep: int, path: str, colnorm: np.ndarray, square: bool) -> None:
        self.p, self.keep, self.path, self.cn, self.square = prepared, keep, path, colnorm, square

    def __call__(self, x: np.ndarray, px: Any) -> np.ndarray:
        v = x * self.cn
        score = (v * v if self.square else np.abs(v)).reshape(-1, self.p.group_size).sum(1)
        blocks = np.sort(np.argpartition(-score, self.keep - 1)[: self.keep]).astype(np.int32)
        return np.array(self.p.gemv(x, blocks, path=self.path))


def agreement(host: Any, make_cache: Any, tokens: List[int], want: np.ndarray) -> float:
    cache = make_cache()
    hits = [int(host.step(int(t), cache).argmax()) == int(want[i]) for i, t in enumerate(tokens[:-1])]
    return float(np.mean(hits))


def measure(model_name: Optional[str]) -> Dict[str, Any]:
    model, tok, gearbox = load(model_name)
    dense = get_draft(model, gearbox, "low", "all")
    calib = calibration_tokens(tok)
    tokens = calibration_tokens(tok, 256)[128:256]
    want = np.array(model(mx.array(tokens)[None])[0]).argmax(-1)
    out: Dict[str, Any] = {"dense": agreement(dense.host, dense.make_cache, tokens, want)}
    for s in (0.25, 0.5):
        sp = build_sparse_draft(dense, s, calib)
        out[f"down-{s:g}"] = agreement(sp.host, sp.make_cache, tokens, want)
        for square in (False, True):
            for i, layer in enumerate(ffn_layers(sp.module)):
                row = list(sp.host.layers[i])
                if not isinstance(row[DOWN_SLOT], (sparse_cpu.TopBlocksProduct, RankedDown)):
                    continue
                down = layer.mlp.down_proj
                p = quant_parts(down)
                w = np.array(mx.dequantize(p.weight, p.scales, p.biases, group_size=p.group_size, bits=p.bits))
                row[DOWN_SLOT] = RankedDown(sparse_cpu.prepared_sparse(p), row[DOWN_SLOT].keep, sparse_path(down),
                                            np.linalg.norm(w, axis=0).astype(np.float32), square)
                sp.host.layers[i] = tuple(row)
            out[f"down-{s:g}-colnorm{'2' if square else ''}"] = agreement(sp.host, sp.make_cache, tokens, want)
    layers = ffn_layers(dense.module)
    nb = sparse_cpu.prepared_sparse(quant_parts(layers[0].mlp.gate_proj)).blocks
    for keep in (nb - 1, nb - 2):
        host = HostForward(dense.module, cpu_kernels.require())
        for i, layer in enumerate(layers):
            row = list(host.layers[i])
            for slot, lin in ((GATE_SLOT, layer.mlp.gate_proj), (UP_SLOT, layer.mlp.up_proj)):
                prepared = sparse_cpu.prepared_sparse(quant_parts(lin))
                row[slot] = sparse_cpu.TopBlocksProduct(prepared, keep, sparse_path(lin))
            host.layers[i] = tuple(row)
        out[f"gateup-{keep}-of-{nb}"] = agreement(host, host.make_cache, tokens, want)
    return {"positions": len(tokens) - 1, "tokens": "evaluation text, tokens 128-255", "agreement": out}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="benchmarks/results/sparse_agreement_default.json")
    a = p.parse_args(argv)
    before = load_average()
    r = measure(a.model)
    for name, v in r["agreement"].items():
        print(f"{name:<22} {v:.3f}")
    r.update(model=a.model or "SmolLM2-135M-Instruct (default, float32)")
    write_result(a.out, r, "python scripts/bench_sparse_agreement.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
