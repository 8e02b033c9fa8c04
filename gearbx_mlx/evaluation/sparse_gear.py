"""Evaluation rows of the sparse low gear (``--sparse-gear``): its KL and bytes beside the dense gears.

Each row teacher-forces the evaluation windows through the model in one
static gear of a :class:`~gearbx_mlx.gearbox.Gearbox` of scope ``all``
(MLX kernels, separate copies: the low gear is MLX's 4-bit affine format, as
in the harness's static-low rows, and builds in seconds): the high gear (the reference), the dense low gear, and the
low gear keeping each layer's heaviest FFN blocks per position at each
target sparsity (:mod:`gearbx_mlx.speculative.sparse_gear`; every position
masked by its own blocks, as a one-token step is). Per row: the mean
``KL(high || row)`` over positions (nats), the agreement of the greedy
choices with the high gear's, perplexity of the text, and the weight bytes
of one decode step (the gear's step bytes less the ``down_proj`` blocks
skipped).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import mlx.core as mx

from ..config import GearboxConfig
from ..gearbox import Gearbox
from ..speculative.sparse import calibration_tokens, ffn_layers, quant_parts
from ..speculative.sparse_gear import install_sparse_gear, remove_sparse_gear, set_teacher


def _logprobs(model: Any, windows: Sequence[Sequence[int]]) -> List[mx.array]:
    out = []
    for w in windows:
        logits = model(mx.array(list(w))[None])[0].astype(mx.float32)
        out.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(out[-1])
    return out


def _row(name: str, ref: List[mx.array], got: List[mx.array], windows: Sequence[Sequence[int]],
         step_bytes: float) -> Dict[str, Any]:
    kl, agree, nll, n = 0.0, 0.0, 0.0, 0
    for p, q, w in zip(ref, got, windows):
        kl += float(mx.sum(mx.exp(p) * (p - q)))
        agree += float(mx.sum(mx.argmax(p, axis=-1) == mx.argmax(q, axis=-1)))
        targets = mx.array(list(w[1:]))
        nll -= float(mx.sum(mx.take_along_axis(q[:-1], targets[:, None], axis=-1)))
        n += p.shape[0]
    positions = sum(len(w) - 1 for w in windows)
    return {"name": name, "kl": kl / n, "agreement": agree / n, "perplexity": math.exp(nll / max(positions, 1)),
            "bytes_per_token": step_bytes}


def sparse_gear_rows(model: Any, tokenizer: Any, windows: Sequence[Sequence[int]], sparsities: Sequence[float],
                     vocab: int) -> Dict[str, Any]:
    """The rows (see the module doc) for each of ``sparsities``; the model is left as it was."""
    ffn_layers(model)  # a model without a gated FFN: refused before anything slow
    gearbox = Gearbox(model, GearboxConfig(scope="all", kernel="mlx", store="separate"), vocab_size=vocab)
    tokens = calibration_tokens(tokenizer)
    rows = []
    try:
        gearbox.manager.shift("high")
        ref = _logprobs(model, windows)
        bytes_ = gearbox.manager.step_bytes()
        rows.append(_row("static-high", ref, ref, windows, bytes_["high"]))
        gearbox.manager.shift("low")
        down = [quant_parts(layer.mlp.down_proj) for layer in ffn_layers(model)]
        down_bytes = [p.weight.nbytes + p.scales.nbytes + p.biases.nbytes for p in down]
        rows.append(_row("static-low", ref, _logprobs(model, windows), windows, bytes_["low"]))
        for s in sparsities:
            info = install_sparse_gear(model, gearbox, s, tokens)
            set_teacher(model, True)
            gearbox.manager.shift("low")
            saved = sum(d * (1 - k / n) for d, k, n in zip(down_bytes, info["kept_blocks"], info["blocks"]))
            row = _row(f"static-low-sparse-{s:g}", ref, _logprobs(model, windows), windows, bytes_["low"] - saved)
            rows.append({**row, "sparsity": s, "kept_fraction": info["kept_fraction"]})
            remove_sparse_gear(model)
    finally:
        remove_sparse_gear(model)
        gearbox.manager.shift("high")  # the loaded modules back
    return {"rows": rows, "scope": "all", "kernel": "mlx", "store": "separate", "positions": sum(len(w) for w in windows),
            "method": "teacher-forced static gears of a scope-all gearbox; sparse rows mask each position's "
                      "lightest FFN blocks in the low gear; KL(high || row) in nats per position"}


def sparse_gear_table(section: Dict[str, Any]) -> str:
    """The rows of :func:`sparse_gear_rows` as a text table."""
    lines = [f"{'sparse low gear':<26} {'kept':>5} {'KL':>8} {'agree':>6} {'ppl':>8} {'MB/step':>8}"]
    for r in section["rows"]:
        lines.append(f"{r['name']:<26} {r.get('kept_fraction', 1.0):5.2f} {r['kl']:8.4f} {r['agreement']:6.3f} "
                     f"{r['perplexity']:8.2f} {r['bytes_per_token'] / 1e6:8.2f}")
    return "\n".join(lines)


__all__ = ["sparse_gear_rows", "sparse_gear_table"]
