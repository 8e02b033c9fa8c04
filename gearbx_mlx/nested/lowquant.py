"""The nested store's low gear by mlx-lm's own quantizers: ``--low-quant awq|gptq|dwq``.

Plane 0 of the nested store is an MLX 4-bit layer (groups of 64 by default).
By default it is MLX's round-to-nearest of the loaded weight
(:func:`~gearbx_mlx.nested.planes.build_planes`); here it is what one of
mlx-lm's quantizers (``mlx_lm.quant``) makes of the managed layers, run on a
copy of the model:

* ``gptq``: ``mlx_lm.quant.gptq.gptq_quantize`` (Hessians of the layers'
  inputs on the calibration text, then column-by-column error feedback); a
  managed tied embedding is given to it as the model's ``lm_head`` (an
  ``nn.Linear`` of the same weight), so that the output projection, the
  largest matrix of a small model, is GPTQ's too;
* ``awq``: ``mlx_lm.quant.awq.awq_quantize`` with the model's own AWQ
  configuration less its scale search (``scale_configs=[]``): the search
  divides a norm's weights by the scales it multiplies the next layers' columns
  by, and a norm is shared by every gear, so a low gear with those scales
  would need its own norms; what remains is AWQ's activation-aware clipping
  search, block by block, which mlx-lm keeps only where it lowers the block's
  output error;
* ``dwq``: ``mlx_lm.quant.dwq.dwq_quantize``: the managed layers start as
  round-to-nearest and their scales and biases are trained to the loaded
  model's logits (the codes stay).

Each keeps MLX's format: its layers are ``QuantizedLinear``/``QuantizedEmbedding``
of 4 bits and the store's group size, so plane 0 is still an MLX 4-bit layer
(checked here), and the mid and high planes then fit the residual to the
loaded weights as for ``rtn``. mlx-lm's command lines download a calibration
text or a hub data set; here every quantizer reads the package's own text
(:func:`calibration_tokens`, gensim's ``lee.cor``, fetched from its PyPI
wheel like the evaluation text). What a quantizer prints goes to stderr.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from typing import Any, Callable, Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optimizers
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize
from mlx_lm.quant.dwq import dwq_quantize
from mlx_lm.quant.gptq import gptq_quantize

from ..config import LOW_QUANT, LOW_QUANTS, LowQuantDefaults
from ..heap import reuse_large_buffers
from ..sources.models import corpus_path
from .planes import Plane

#: Bits of the low plane (the nested store's low gear is MLX 4-bit).
LOW_BITS = 4


def check_low_quant(method: str, model_type: str = "") -> None:
    """``ValueError`` naming ``--low-quant`` for a method mlx-lm has not, or an AWQ the
    model's architecture has no configuration for."""
    if method not in LOW_QUANTS:
        raise ValueError(f"--low-quant must be one of {', '.join(LOW_QUANTS)}, got {method!r}")
    if method == "awq" and model_type and model_type not in AWQ_MODEL_CONFIGS:
        raise ValueError(f"--low-quant awq: mlx-lm's AWQ has no configuration for {model_type!r} models "
                         f"(it has {', '.join(sorted(AWQ_MODEL_CONFIGS))}): use gptq or dwq")


def settings_of(method: str, settings: LowQuantDefaults = LOW_QUANT) -> Dict[str, Any]:
    """What the planes of ``method`` depend on besides the weights (the planes cache key's part)."""
    if method == "rtn":
        return {"method": "rtn"}
    keep = ("corpus", "sequence_length", "seed") + (
        ("dwq_learning_rate", "dwq_epochs", "dwq_batch_size") if method == "dwq" else ())
    return {"method": method, **{k: getattr(settings, k) for k in keep}}


def calibration_tokens(tokenizer: Any, settings: LowQuantDefaults = LOW_QUANT) -> mx.array:
    """``(samples, sequence_length)`` int32: the calibration text cut into samples (the tail dropped).

    Raises:
        ValueError: the text gives fewer than two samples.
    """
    text = corpus_path(settings.corpus).read_text(encoding="utf-8", errors="replace")
    ids = list(tokenizer.encode(text))
    n = len(ids) // settings.sequence_length
    if n < 2:
        raise ValueError(f"the calibration text has {len(ids)} tokens: fewer than two samples of "
                         f"{settings.sequence_length}")
    return mx.array(ids[: n * settings.sequence_length], dtype=mx.int32).reshape(n, settings.sequence_length)


def low_planes(
    model: nn.Module,
    paths: Sequence[str],
    method: str,
    tokens: mx.array,
    group_size: int = 64,
    settings: LowQuantDefaults = LOW_QUANT,
) -> Dict[str, Plane]:
    """``{path: plane 0}`` of every managed path by ``method`` (not ``rtn``), on a copy of ``model``.

    Args:
        model: the loaded float model (left as it is; DWQ's teacher).
        paths: the managed ``nn.Linear`` (and tied ``nn.Embedding``) paths.
        tokens: ``(samples, length)`` calibration token ids (:func:`calibration_tokens`).

    Raises:
        ValueError: ``rtn`` or an unknown method; a layer the method left other than
            an MLX 4-bit layer of ``group_size`` (a bug, not a user error).
    """
    if method not in QUANTIZERS:
        raise ValueError(f"low_planes builds the low plane by {', '.join(QUANTIZERS)}, not {method!r}")
    check_low_quant(method, getattr(model, "model_type", ""))
    student = copy.deepcopy(model)  # MLX's copy of an evaluated array shares its buffer: no second copy
    mx.random.seed(settings.seed)
    np.random.seed(settings.seed)
    # mlx-lm's prints never reach a generated text's stream; its GPTQ makes a new array of a whole
    # weight per column, which the heap then reuses (gearbx_mlx.heap).
    with contextlib.redirect_stdout(sys.stderr), reuse_large_buffers():
        QUANTIZERS[method](student, model, list(paths), tokens, group_size, settings)
    modules = dict(student.named_modules())
    out = {}
    for p in paths:
        m = modules[p]
        if not (isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.bits == LOW_BITS
                and m.group_size == group_size and getattr(m, "mode", "affine") == "affine"):
            raise ValueError(f"{method} left {p} as {type(m).__name__}, not an MLX {LOW_BITS}-bit layer "
                             f"of group {group_size}")
        out[p] = Plane(m.weight, m.scales, m.biases, LOW_BITS, group_size)
    mx.eval([a for pl in out.values() for a in pl.arrays()])
    return out


class _LeftAlone(nn.Linear):
    """An ``nn.Linear`` outside the managed paths: mlx-lm's GPTQ takes layers of the exact
    type ``nn.Linear``, so it computes this one as loaded and spends no time on it."""


class _Called(nn.Module):
    """Stands in for a layer and notes that the model called it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.called = False

    def __call__(self, x: mx.array) -> mx.array:
        self.called = True
        return self.layer(x)


def _untie(student: nn.Module, paths: List[str]) -> str:
    """Where a managed tied embedding is the output projection of an mlx-lm model that reads
    ``lm_head`` when ``args.tie_word_embeddings`` is off: give it that ``lm_head`` (an ``nn.Linear``
    of the embedding's weight), so that GPTQ quantizes the output projection from its inputs.
    Returns the embedding's path ('' where not: it keeps GPTQ's fallback, round-to-nearest)."""
    args = getattr(student, "args", None)
    embedding = next((p for p in paths if isinstance(dict(student.named_modules())[p], nn.Embedding)), "")
    if not embedding or not getattr(args, "tie_word_embeddings", False) or "lm_head" in student:
        return ""
    weight = dict(student.named_modules())[embedding].weight
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = weight
    probe = _Called(head)
    student.lm_head, args.tie_word_embeddings = probe, False
    student(mx.array([[0, 1]]))
    if not probe.called:  # this architecture ties regardless of the flag
        del student["lm_head"]
        args.tie_word_embeddings = True
        return ""
    student.lm_head = head
    return embedding


def hessian_groups(shapes: Dict[str, Sequence[int]], budget: int) -> List[List[str]]:
    """The layers of ``{path: (d_out, d_in)}``, in order, cut into groups whose GPTQ Hessians
    (one ``d_in x d_in`` float32 matrix a layer) hold at most ``budget`` bytes (a layer larger
    than that alone)."""
    groups: List[List[str]] = [[]]
    held = 0
    for p, (_, d_in) in shapes.items():
        size = 4 * d_in * d_in
        if groups[-1] and held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(p)
        held += size
    return groups


def _gptq(student: nn.Module, teacher: nn.Module, paths: List[str], tokens: mx.array, group_size: int,
          settings: LowQuantDefaults) -> None:
    embedding = _untie(student, paths)
    modules = dict(student.named_modules())
    linear = {p: modules[p].weight.shape for p in list(paths) + ["lm_head"] * bool(embedding)
              if type(modules[p]) is nn.Linear}
    done: List[Any] = []
    for group in hessian_groups(linear, settings.gptq_hessian_bytes):
        # GPTQ takes layers of the exact type nn.Linear: every other one is computed as loaded
        # (mlx-lm holds the Hessians of all it takes until it quantizes them). Each group's
        # Hessians are of the loaded model's inputs, as in one pass over every layer.
        part = copy.deepcopy(student)
        keep = set(group)
        left = []
        for p, m in part.named_modules():
            if type(m) is nn.Linear and p not in keep:
                alone = _LeftAlone(1, 1, bias="bias" in m)
                alone.update(m.parameters())
                left.append((p, alone))
        part.update_modules(tree_unflatten(left))
        gptq_quantize(part, tokens, LOW_BITS, group_size, LOW_BITS, group_size)
        quantized = dict(part.named_modules())
        done += [(p, quantized[p]) for p in group]
        mx.eval([m.parameters() for _, m in done[-len(group):]])
        del part, quantized
    # Layers GPTQ does not take (an embedding) get its fallback: round-to-nearest at these bits.
    rest = [(p, nn.QuantizedEmbedding.from_embedding(modules[p], group_size, LOW_BITS)) for p in paths
            if type(modules[p]) is nn.Embedding and p != embedding]
    student.update_modules(tree_unflatten(done + rest))
    if embedding:  # the tied embedding's plane 0 is GPTQ's output projection
        head = student.lm_head
        parent, _, name = embedding.rpartition(".")
        q = nn.QuantizedEmbedding(head.weight.shape[0], head.weight.shape[1] * 32 // LOW_BITS, group_size, LOW_BITS)
        q.weight, q.scales, q.biases = head.weight, head.scales, head.biases
        dict(student.named_modules())[parent][name] = q


def _awq(student: nn.Module, teacher: nn.Module, paths: List[str], tokens: mx.array, group_size: int,
         settings: LowQuantDefaults) -> None:
    config = dataclasses.replace(AWQ_MODEL_CONFIGS[student.model_type], scale_configs=[])
    awq_quantize(student, tokens, config, group_size=group_size, bits=LOW_BITS, embed_group_size=group_size,
                 embed_bits=LOW_BITS)


def _dwq(student: nn.Module, teacher: nn.Module, paths: List[str], tokens: mx.array, group_size: int,
         settings: LowQuantDefaults) -> None:
    student.freeze()  # dwq_quantize unfreezes the scales and biases of the quantized layers alone
    modules = dict(student.named_modules())
    low = [(p, nn.QuantizedEmbedding.from_embedding(modules[p], group_size, LOW_BITS)
            if isinstance(modules[p], nn.Embedding) else nn.QuantizedLinear.from_linear(modules[p], group_size, LOW_BITS))
           for p in paths]
    student.update_modules(tree_unflatten(low))
    rows = [(r, 0) for r in tokens.tolist()]  # (tokens, prompt offset), as mlx-lm's datasets give them
    valid = rows[-settings.dwq_batch_size:]
    train = rows[: -settings.dwq_batch_size] * settings.dwq_epochs
    dtype = next(iter(modules[paths[0]].parameters().values())).dtype
    opt = optimizers.Adam(learning_rate=settings.dwq_learning_rate, bias_correction=True)
    dwq_quantize(student, lambda batch, _i, split: teacher(batch), opt, train, valid, settings.dwq_batch_size,
                 tokens.shape[1] + 1, settings.seed, dtype=dtype)
    student.eval()


#: The quantizers of :func:`low_planes`: ``(student, teacher, paths, tokens, group_size, settings)``,
#: each turning ``student``'s managed layers into MLX 4-bit layers in place.
QUANTIZERS: Dict[str, Callable[..., None]] = {"awq": _awq, "gptq": _gptq, "dwq": _dwq}
