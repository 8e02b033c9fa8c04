"""An activation-sparse drafter: the low gear computing only the FFN blocks a token activates.

The verifier restores the high gear's output whatever the drafter computed,
so a drafter may skip work freely: only acceptance can drop. In a gated FFN
``down(act(gate(x)) * up(x))`` (SwiGLU, or Gemma 3's GeGLU: :data:`GATED_FFN`) most of the hidden activation's mass sits on
few neurons for any one token, and ``down_proj``'s weight is quantized along
its input (neuron) dimension in groups of ``group_size``: a block of
``group_size`` consecutive neurons is exactly one quantization group, so the
columns of a block are a slice of the packed weight, scales and biases.

:class:`SparseMLP` runs a one-token decode step as: gate and up densely, the
mass ``sum |h|`` of every block, the ``keep`` heaviest blocks, and
``down_proj`` over those blocks' columns alone, so it reads ``keep / blocks``
of down_proj's bytes. Ways (:data:`GATHERS`): ``take`` gathers the kept
columns of the packed weight, scales and biases (``mx.take`` along the packed
axis) and calls ``mx.quantized_matmul`` on the sub-matrix; ``experts`` keeps
a block-major copy of down_proj, one little matrix per block, and calls ``mx.gather_qmm`` with the kept blocks as the chosen experts, which
reads them in place (on the CPU the ``take`` gather costs more than the
product it saves; the copy costs down_proj's bytes once more). ``c`` reads
the kept blocks in place with a C kernel (:mod:`gearbx_mlx.bindings.sparse_cpu`);
``auto`` (the default) is ``c`` on the CPU where the kernel takes the
weight, else ``experts``, chosen at each call. On the CPU a drafter whose
dense twin has the host step (numpy around the C GEMV) drafts through it too,
its ``down_proj`` the C kernel over the kept blocks
(:mod:`gearbx_mlx.speculative.sparse_host`).
In the tree, several rows at once (the prompt's prefill, re-fed accepted
tokens) go dense: their KV entries stay the dense drafter's.

:func:`calibrate_keep` chooses each layer's kept fraction for a target
sparsity ``S``: one mass share ``m`` for all layers, each layer keeping the
median (over a calibration text's tokens) of the blocks it needs to carry
``m`` of its mass, with ``m`` bisected so that the layers' mean kept
fraction is ``1 - S``. Concentrated layers keep fewer blocks.

This is the pure-MLX reference path; the gather costs what it costs in MLX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from ..bindings import sparse_cpu, sparse_gpu
from ..sources.models import corpus_path
from .draft import DraftModel, graft
from .sparse_host import sparse_host


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_approx(gate) * up``: the gated FFN of Gemma 3 (mlx-lm's ``gemma3_text.MLP``)."""
    return nn.gelu_approx(gate) * up


#: Model types (and mlx-lm model modules) whose FFN is ``down(act(gate(x)) * up(x))``, with the
#: function of ``(gate(x), up(x))`` that gives the hidden activation: SwiGLU (mlx-lm's llama MLP and
#: kin) or GeGLU (Gemma 3).
GATED_FFN: Dict[str, Callable[[mx.array, mx.array], mx.array]] = {
    "llama": swiglu, "mistral": swiglu, "qwen2": swiglu, "qwen3": swiglu, "gemma3_text": geglu,
}
#: The most a drafter may drop; above it a block of drafts is mostly rejected.
MAX_SPARSITY = 0.95
#: ``draft_sparsity`` that leaves the choice to the start-of-run decision (:mod:`.sparse_plan`).
AUTO = "auto"
#: Tokens of the calibration text the kept fractions are measured on.
CALIBRATION_TOKENS = 128
#: Where a calibration file keeps the sparse drafter's thresholds (``Calibration.extra``).
THRESHOLDS_KEY = "sparse_drafter"
#: Mass shares at which the thresholds are saved (each layer's median kept fraction at each).
SHARE_GRID: Tuple[float, ...] = tuple(i / 100 for i in range(101))


def check_sparsity(value: Optional[float], flag: str = "draft_sparsity") -> None:
    """``ValueError`` naming ``flag`` unless ``value`` is None or in ``[0, MAX_SPARSITY]``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SPARSITY:
        raise ValueError(f"{flag} must be in [0, {MAX_SPARSITY}] (the fraction of FFN neurons the drafter "
                         f"skips) or off, got {value!r}")


def ffn_layers(model: nn.Module) -> List[nn.Module]:
    """The decoder layers of a model with a gated FFN (:data:`GATED_FFN`); ``ValueError`` naming what is
    missing otherwise."""
    args = getattr(model, "args", None)
    kind = getattr(args, "model_type", None) or getattr(model, "model_type", None)
    if kind not in GATED_FFN:
        raise ValueError(f"the sparse drafter needs a gated FFN (gate_proj, up_proj, down_proj; model types "
                         f"{', '.join(GATED_FFN)}); this model is {kind!r}")
    layers = list(getattr(getattr(model, "model", model), "layers", []))
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"the sparse drafter needs gate_proj, up_proj and down_proj in every FFN; "
                             f"layer {i}'s has not")
    if not layers:
        raise ValueError("the sparse drafter found no decoder layers in this model")
    return layers


def glu_of(mlp: nn.Module) -> Callable[[mx.array, mx.array], mx.array]:
    """The gated activation of ``mlp``: the one a wrapper of this module keeps (``_glu``), else the one of
    its mlx-lm model module (:data:`GATED_FFN`), else SwiGLU."""
    glu = mlp.__dict__.get("_glu")
    return glu if glu is not None else GATED_FFN.get(type(mlp).__module__.rsplit(".", 1)[-1], swiglu)


def hidden(mlp: nn.Module, x: mx.array) -> mx.array:
    """``(..., D) -> (..., I)``: the FFN's hidden activation ``act(gate(x)) * up(x)`` (:func:`glu_of`)."""
    return glu_of(mlp)(mlp.gate_proj(x), mlp.up_proj(x))


@dataclasses.dataclass
class QuantParts:
    """``down_proj`` as one MLX affine quantization (packed along its input dimension).

    Attributes:
        weight: ``(out, in * bits / 32)`` uint32; scales, biases: ``(out, in / group_size)``.
        bias: ``(out,)`` or None.
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bias: Optional[mx.array]
    bits: int
    group_size: int


def quant_parts(module: nn.Module) -> QuantParts:
    """The packed arrays of a low-gear linear: a ``QuantizedLinear``, or a nested view of its first plane."""
    if isinstance(module, nn.QuantizedLinear):
        return QuantParts(module.weight, module.scales, module["biases"], module.get("bias"),
                          module.bits, module.group_size)
    nested = module.get("nested") if isinstance(module, nn.Module) else None
    if nested is not None and getattr(module, "n", None) == 1:
        plane = nested.planes[0]
        if plane.exponent == 0:
            return QuantParts(plane.weight, plane.scales, plane.biases, nested.get("bias"),
                              plane.bits, plane.group_size)
    raise ValueError(f"the sparse drafter gathers blocks of an MLX-quantized down_proj (a QuantizedLinear or "
                     f"the nested store's first plane); this one is a {type(module).__name__}")


def block_mass(h: mx.array, group_size: int) -> mx.array:
    """``(..., I) -> (..., I / group_size)``: ``sum |h|`` over each block of consecutive neurons."""
    return mx.abs(h).reshape(*h.shape[:-1], -1, group_size).sum(-1)


def top_blocks(h: mx.array, keep: int, group_size: int) -> mx.array:
    """``(I,) -> (keep,)`` uint32: the ``keep`` blocks of largest mass, in ascending order."""
    mass = block_mass(h, group_size)
    if keep >= mass.size:
        return mx.arange(mass.size, dtype=mx.uint32)
    idx = mx.argpartition(-mass, kth=keep - 1)[:keep]
    return mx.sort(idx).astype(mx.uint32)


def sparse_down(h: mx.array, parts: QuantParts, blocks: mx.array) -> mx.array:
    """``(1, I) -> (1, out)``: ``down_proj`` over the neurons of ``blocks`` only.

    Gathers the blocks' columns of the packed weight (``group_size * bits / 32``
    words each), scales and biases, and multiplies the kept activations by them.
    """
    return sparse_gpu.reference(h, parts, blocks)  # the pure-MLX product every kernel is checked against


def block_major(parts: QuantParts) -> Tuple[mx.array, mx.array, mx.array]:
    """``down_proj``'s blocks as ``nb`` little matrices: ``(nb, out, words)``, ``(nb, out, 1)`` x 2 (a copy)."""
    out, nb = parts.scales.shape
    arrays = (mx.contiguous(parts.weight.reshape(out, nb, -1).transpose(1, 0, 2)),
              mx.contiguous(parts.scales.reshape(out, nb, 1).transpose(1, 0, 2)),
              mx.contiguous(parts.biases.reshape(out, nb, 1).transpose(1, 0, 2)))
    mx.eval(arrays)
    return arrays


def expert_down(h: mx.array, blocks_major: Tuple[mx.array, mx.array, mx.array], parts: QuantParts,
                blocks: mx.array) -> mx.array:
    """``(1, I) -> (1, out)``: :func:`sparse_down` as MLX's gathered quantized product, each block an expert.

    ``mx.gather_qmm`` reads the kept blocks of the block-major copy in place
    (no gathered copy of the weight) and their partial products are summed.
    """
    w, s, b = blocks_major
    x = h.reshape(-1, 1, parts.group_size)
    y = mx.gather_qmm(x, w, s, b, lhs_indices=blocks, rhs_indices=blocks, transpose=True,
                      group_size=parts.group_size, bits=parts.bits).sum(0)
    return y + parts.bias if parts.bias is not None else y


def masked_down(h: mx.array, down: nn.Module, blocks: mx.array, group_size: int) -> mx.array:
    """The reference of :func:`sparse_down`: zero the dropped blocks, then the dense ``down_proj``."""
    nb = h.shape[-1] // group_size
    mask = mx.zeros((nb,), dtype=h.dtype)
    mask[blocks] = 1
    return down(h * mx.repeat(mask, group_size))


#: How a one-token step reads the kept blocks: ``experts`` (``mx.gather_qmm`` over a
#: block-major copy of down_proj), ``take`` (gather the packed columns, then
#: ``mx.quantized_matmul``; no copy, but the gather itself is a copy every step),
#: ``c`` (the C kernel, in place: CPU, 4-bit, groups of 64 or 128) or ``auto``
#: (``c`` where it applies at the call, else ``experts``).
GATHERS: Tuple[str, ...] = ("auto", "c", "experts", "take")


class SparseMLP(nn.Module):
    """A drafter's FFN that keeps ``keep`` of its ``blocks`` blocks on one-token steps.

    ``(B, T, D) -> (B, T, D)``; a single row reads the kept blocks only (see
    :data:`GATHERS`), several rows (or ``keep == blocks``) the dense ``down_proj``.
    """

    def __init__(self, mlp: nn.Module, keep: int, gather: str = "auto") -> None:
        super().__init__()
        if gather not in GATHERS:
            raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.__dict__["_glu"] = glu_of(mlp)
        self.parts = quant_parts(mlp.down_proj)
        self.blocks = self.parts.scales.shape[1]
        self.keep = max(1, min(int(keep), self.blocks))
        self.gather = gather
        dense = self.keep >= self.blocks
        self.c_reason = sparse_cpu.unsupported(self.parts) if gather in ("auto", "c") else f"gather {gather!r}"
        if gather == "c" and self.c_reason is not None:
            raise ValueError(f"the C gather cannot run here: {self.c_reason}")
        self.c_path = sparse_path(mlp.down_proj)
        major = gather == "experts" or (gather == "auto" and self.c_reason is not None)
        self.__dict__["_major"] = block_major(self.parts) if major and not dense else None
        self.freeze()

    @property
    def extra_bytes(self) -> int:
        """Bytes of the block-major copy (0 without one)."""
        major = self.__dict__["_major"]
        return sum(a.nbytes for a in major) if major is not None else 0

    def __call__(self, x: mx.array) -> mx.array:
        h = hidden(self, x)
        if self.keep >= self.blocks or h.size != h.shape[-1]:
            return self.down_proj(h)
        blocks = top_blocks(h.reshape(-1), self.keep, self.parts.group_size)
        major = self.__dict__["_major"]
        if self.c_reason is None and mx.default_device() == mx.cpu:
            y = sparse_cpu.sparse_down(h.reshape(1, -1), self.parts, blocks, self.c_path)
        elif major is not None:
            y = expert_down(h.reshape(1, -1), major, self.parts, blocks)
        else:
            y = sparse_down(h.reshape(1, -1), self.parts, blocks)
        return y.reshape(*x.shape[:-1], -1)


def _needed_fraction(mass: mx.array, share: float) -> mx.array:
    """``(T, nb) -> (T,)``: fraction of blocks, heaviest first, that carry ``share`` of each row's mass."""
    ranked = -mx.sort(-mass, axis=-1)
    cum = mx.cumsum(ranked, axis=-1) / mx.maximum(ranked.sum(-1, keepdims=True), 1e-30)
    return (mx.sum(cum < share, axis=-1) + 1) / mass.shape[-1]


def layer_masses(model: nn.Module, tokens: Sequence[int], group_size: int) -> List[mx.array]:
    """``[(T, nb)] * layers``: each layer's block masses over ``tokens``, teacher-forced through ``model``."""
    layers = ffn_layers(model)
    seen: List[mx.array] = []
    originals = [layer.mlp for layer in layers]

    class Probe(nn.Module):
        def __init__(self, mlp: nn.Module) -> None:
            super().__init__()
            self.mlp = mlp

        def __call__(self, x: mx.array) -> mx.array:
            h = hidden(self.mlp, x)
            seen.append(block_mass(h[0], group_size))
            return self.mlp.down_proj(h)

    try:
        for layer, mlp in zip(layers, originals):
            layer.mlp = Probe(mlp)
        mx.eval(model(mx.array(list(tokens))[None]))
    finally:
        for layer, mlp in zip(layers, originals):
            layer.mlp = mlp
    return seen


def calibrate_keep(masses: Sequence[mx.array], sparsity: float, iters: int = 30) -> List[float]:
    """Each layer's kept fraction for the target ``sparsity`` (see the module doc); their mean is ``1 - sparsity``
    up to one block's worth."""
    check_sparsity(sparsity)
    target = 1.0 - sparsity

    def kept(share: float) -> List[float]:
        return [float(mx.median(_needed_fraction(m, share))) for m in masses]

    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if sum(kept(mid)) / len(masses) < target:
            lo = mid
        else:
            hi = mid
    return kept(hi)


def threshold_curves(masses: Sequence[mx.array], group_size: int) -> Dict[str, Any]:
    """The sparse drafter's thresholds of a calibration file: each layer's median (over the tokens of
    ``masses``) kept fraction at every share of :data:`SHARE_GRID` (JSON-ready); any target sparsity
    is then solved from them as :func:`calibrate_keep` does from the masses."""
    return {"shares": list(SHARE_GRID), "group_size": group_size, "tokens": int(masses[0].shape[0]),
            "blocks": [int(m.shape[1]) for m in masses],
            "kept": [[float(mx.median(_needed_fraction(m, share))) for share in SHARE_GRID] for m in masses]}


def check_curves(curves: Any, blocks: Sequence[int], group_size: int) -> None:
    """``ValueError`` unless ``curves`` (a calibration file's thresholds) fit a model of these FFN blocks."""
    ok = (isinstance(curves, dict) and isinstance(curves.get("kept"), list) and isinstance(curves.get("shares"), list)
          and isinstance(curves.get("blocks"), list) and len(curves["kept"]) == len(curves["blocks"]) > 0
          and all(isinstance(k, list) and len(k) == len(curves["shares"]) for k in curves["kept"]))
    if not ok:
        raise ValueError(f"the calibration's {THRESHOLDS_KEY} thresholds are damaged: recalibrate "
                         "(--calibrate --speculative --draft-sparsity S)")
    if list(curves["blocks"]) != list(blocks) or curves.get("group_size") != group_size:
        raise ValueError(f"the calibration's sparse-drafter thresholds are for {len(curves['blocks'])} FFN layers of "
                         f"{curves['blocks'][0] if curves['blocks'] else 0} blocks of {curves.get('group_size')}, this "
                         f"model has {len(blocks)} of {blocks[0]} of {group_size}: a calibration of another model")


def keep_from_curves(curves: Dict[str, Any], sparsity: float, iters: int = 30) -> List[float]:
    """:func:`calibrate_keep` from saved thresholds (each layer's curve interpolated between the saved shares)."""
    check_sparsity(sparsity)
    shares = np.array(curves["shares"])
    table = [np.array(k) for k in curves["kept"]]

    def kept(share: float) -> List[float]:
        return [float(np.interp(share, shares, k)) for k in table]

    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if sum(kept(mid)) / len(table) < 1.0 - sparsity:
            lo = mid
        else:
            hi = mid
    return kept(hi)


def sparse_module(module: nn.Module, keep: Sequence[int], gather: str = "auto") -> nn.Module:
    """A copy of the drafter's tree whose FFNs are :class:`SparseMLP` keeping ``keep[i]`` blocks."""
    layers = ffn_layers(module)
    tree: Dict[str, Any] = {"model": {"layers": {str(i): {"mlp": SparseMLP(layer.mlp, k, gather)}
                                                 for i, (layer, k) in enumerate(zip(layers, keep))}}}
    return graft(module, tree)


def calibration_tokens(tokenizer: Any, n: int = CALIBRATION_TOKENS) -> List[int]:
    """The first ``n`` tokens of the evaluation corpus (the text the kept fractions are measured on)."""
    text = corpus_path().read_bytes()[: 16 * n].decode("utf-8", errors="replace")
    return list(tokenizer.encode(text))[:n]


def build_sparse_draft(draft: DraftModel, sparsity: float, tokens: Sequence[int],
                       gather: str = "auto", thresholds: Optional[Dict[str, Any]] = None) -> DraftModel:
    """The sparse drafter of ``draft`` at the target ``sparsity``, its kept fractions measured on ``tokens``
    (or solved from a calibration file's ``thresholds``, :func:`threshold_curves`).

    It shares every array with ``draft``. Where ``draft`` has the host step
    and ``gather`` is ``auto`` or ``c``, so does the result (its ``down_proj``
    the C kernel over the kept blocks); else it drafts through the MLX tree.
    ``sparse`` on the result records what was kept:
    ``{"sparsity", "kept_fraction", "kept_blocks", "blocks", "group_size",
    "calibration_tokens", "down_bytes", "kept_down_bytes", "gather",
    "layout_bytes", "path"}`` (``path``: ``host`` or ``mlx``) (bytes of every layer's ``down_proj``, and of its kept
    blocks, per one-token step; bytes of the block-major copies).
    """
    check_sparsity(sparsity)
    layers = ffn_layers(draft.module)
    parts = [quant_parts(layer.mlp.down_proj) for layer in layers]
    blocks = [p.scales.shape[1] for p in parts]
    if thresholds is not None:
        check_curves(thresholds, blocks, parts[0].group_size)
    if sparsity == 0:
        fractions = [1.0] * len(layers)
    elif thresholds is not None:
        fractions = keep_from_curves(thresholds, sparsity)
    else:
        fractions = calibrate_keep(layer_masses(draft.module, tokens, parts[0].group_size), sparsity)
    keep = [max(1, min(n, round(f * n))) for f, n in zip(fractions, blocks)]
    down = [p.weight.nbytes + p.scales.nbytes + p.biases.nbytes for p in parts]
    info = {
        "sparsity": float(sparsity), "kept_fraction": sum(keep) / sum(blocks), "kept_blocks": keep,
        "blocks": blocks, "group_size": parts[0].group_size,
        "calibration_tokens": thresholds["tokens"] if thresholds is not None else len(tokens),
        "thresholds": "calibration" if thresholds is not None else "measured at start",
        "down_bytes": sum(down), "kept_down_bytes": int(sum(d * k / n for d, k, n in zip(down, keep, blocks))),
    }
    module = sparse_module(draft.module, keep, gather)
    extra = sum(layer.mlp.extra_bytes for layer in ffn_layers(module))
    info.update(gather=gather, layout_bytes=extra)
    memory = dict(draft.memory)
    if memory:
        memory.update(extra_bytes=memory["extra_bytes"] + extra, resident_total=memory["resident_total"] + extra)
    host, reason = None, "the sparse drafter runs its FFNs in the MLX tree"
    if draft.host is not None and gather in ("auto", "c") and sparsity > 0:
        paths = [sparse_path(layer.mlp.down_proj) for layer in layers]
        host, why = sparse_host(module, parts, keep, paths)
        reason = None if host is not None else f"{reason}: {why}"
    info.update(path="host" if host is not None else "mlx")
    return dataclasses.replace(draft, module=module, host=host, memory=memory, host_reason=reason, sparse=info)


def sparse_path(down: nn.Module) -> str:
    """The C path of the host step's sparse ``down_proj``: the dense host step's own for a nested view
    (``intdot`` for the 4-bit low gear), ``float`` otherwise."""
    nested = down.get("nested") if isinstance(down, nn.Module) else None
    return nested.product.cpu_path(down.n) if nested is not None else "float"


__all__ = [
    "AUTO", "CALIBRATION_TOKENS", "SHARE_GRID", "THRESHOLDS_KEY", "check_curves", "keep_from_curves",
    "threshold_curves", "GATHERS", "MAX_SPARSITY", "QuantParts", "GATED_FFN", "geglu", "glu_of", "SparseMLP", "block_major",
    "block_mass", "build_sparse_draft", "calibrate_keep", "calibration_tokens", "check_sparsity", "expert_down",
    "ffn_layers", "hidden", "layer_masses", "masked_down", "quant_parts", "sparse_down", "sparse_module", "sparse_path",
    "top_blocks",
]
