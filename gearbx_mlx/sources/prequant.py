"""A truly pre-quantized default model: the GGUF's Q4_1 weights as MLX quantized layers.

:func:`gearbx_mlx.sources.gguf.convert_gguf` dequantizes the GGUF to floats (the
reference the gearbox quantizes on the fly). This module keeps the GGUF's own
quantized triples instead: MLX reads Q4_1 (and Q8_0) tensors as affine
``(uint32 weight, scales, biases)`` with group size 32, which is exactly what
``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` hold. The folder it writes
has a ``quantization`` entry in ``config.json`` (a default plus per-module
overrides, the form ``mlx_lm.utils.load_model`` reads), so ``mlx_lm.load``
builds quantized layers and the precision manager sees a pre-quantized model
and runs in telemetry-only mode (§12.2).

The weights are the GGUF's values, unchanged: the float model of
``convert_gguf`` is their dequantization, so both score the same perplexity.
Only the scales and biases may be widened from float16 to float32 (exact):
MLX's Linux CPU backend runs quantized products far slower with half
precision inputs (``scripts/bench_cpu.py`` times them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx

from .cache import cache_dir, converted_gguf, default_dtype, entry_usable, fetch_default_gguf
from .gguf import (
    BLOCK_NAMES,
    DTYPES,
    GGUF_GROUP,
    TENSOR_NAMES,
    mlx_config,
    read_gguf,
    unpermute_qk,
    write_model_folder,
)
from .registry import DEFAULT_NAME

#: ``--model`` name of the pre-quantized default model.
PREQUANT_MODEL = "smollm2-135m-q4"


def _bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per element of a packed triple: 32 bits per uint32 over the group's columns."""
    return 32 * weight.shape[-1] // (scales.shape[-1] * GGUF_GROUP)


def _mlx_name(name: str) -> str:
    """mlx-lm's module path of a GGUF tensor prefix (``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``)."""
    if name.startswith("blk."):
        _, layer, kind = name.split(".", 2)
        if kind not in BLOCK_NAMES:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        return f"model.layers.{layer}.{BLOCK_NAMES[kind]}"
    if name in TENSOR_NAMES:
        return TENSOR_NAMES[name]
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def quantized_weights(
    weights: Dict[str, mx.array], n_head: int, n_kv: int, dtype: str, permuted: bool = True
) -> Tuple[Dict[str, mx.array], Dict[str, Dict[str, int]]]:
    """Rename GGUF tensors to mlx-lm's, un-permute Q/K rows, keep the packing.

    Args:
        weights: ``mx.load(gguf)``'s tensors: for a quantized tensor ``t``,
            ``t.weight`` ``(out, in·bits/32)`` uint32, ``t.scales`` and
            ``t.biases`` ``(out, in/32)``; float tensors as ``t.weight``.
        n_head, n_kv: query and key/value head counts (for the Q/K permutation).
        permuted: llama.cpp permuted the Q/K rows (its llama converter does;
            its qwen2 converter does not).
        dtype: float dtype of the scales, biases and unquantized tensors.

    Returns:
        ``(tensors, layers)``: mlx-lm named tensors, and ``{module path:
        {"group_size": 32, "bits": b}}`` for every quantized module.
    """
    tdtype = DTYPES[dtype]
    out: Dict[str, mx.array] = {}
    layers: Dict[str, Dict[str, int]] = {}
    for name in sorted({k.rsplit(".", 1)[0] for k in weights}):
        path = _mlx_name(name)
        parts = {s: weights[f"{name}.{s}"] for s in ("weight", "scales", "biases") if f"{name}.{s}" in weights}
        quantized = "scales" in parts
        if quantized and "biases" not in parts:
            raise ValueError(f"GGUF tensor {name!r} has scales but no biases: not an affine quantization")
        # llama.cpp permutes whole Q/K output rows; a packed row is one output
        # channel (its scales and biases too), so the same row permutation applies.
        heads = n_head if name.endswith("attn_q") else n_kv if name.endswith("attn_k") else None
        heads = heads if permuted else None
        for s, a in parts.items():
            if heads is not None:
                a = unpermute_qk(a, heads)
            if s != "weight" or not quantized:
                a = a.astype(tdtype)
            out[f"{path}.{s}"] = a
        if quantized:
            layers[path] = {"group_size": GGUF_GROUP, "bits": _bits(parts["weight"], parts["scales"])}
    return out, layers


def quantization_config(layers: Dict[str, Dict[str, int]]) -> Dict[str, Any]:
    """The ``quantization`` entry of ``config.json``: the commonest setting as
    the default, every module that differs as an override (mlx-lm reads
    ``config["quantization"][path]`` before its default)."""
    if not layers:
        raise ValueError("the GGUF has no quantized tensors: use convert_gguf for a float model")
    settings = [tuple(sorted(v.items())) for v in layers.values()]
    common = dict(max(set(settings), key=settings.count))
    q: Dict[str, Any] = {**common, "mode": "affine"}
    for path, v in layers.items():
        if v != common:
            q[path] = dict(v)
    return q


def convert_gguf_quantized(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    progress: Optional[Callable[[int, int], None]] = None,
) -> Path:
    """Write an mlx-lm folder of quantized layers for ``gguf_path`` into ``out_dir`` (must not exist).

    Args:
        dtype: dtype of the scales, biases and float tensors (norms); the
            packed weights are kept bit for bit.
        progress: called as ``progress(done, total)`` (one step per stage).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    weights, meta = read_gguf(gguf_path, dtype)
    config = mlx_config(meta, "output.weight" in weights)
    tensors, layers = quantized_weights(
        weights, config["num_attention_heads"], config["num_key_value_heads"], dtype,
        permuted=config["model_type"] == "llama",
    )
    mx.eval(tensors)
    if progress:
        progress(1, 2)
    config["torch_dtype"] = dtype
    config["quantization"] = quantization_config(layers)
    write_model_folder(out_dir, tensors, config, meta, gguf_path, prequantized=True)
    if progress:
        progress(2, 2)
    return out_dir


def prequantized_model_path(dtype: Optional[str] = None, progress: bool = True) -> Path:
    """The pre-quantized default model folder, converted on first use and cached.

    Same fetch and atomic rename as :func:`gearbx_mlx.sources.models.default_model_path`.
    """

    dtype = dtype or default_dtype()
    out = cache_dir() / "models" / f"{DEFAULT_NAME}-Q4_1-mlx-{dtype}"
    if entry_usable(out):
        return out
    return converted_gguf(
        fetch_default_gguf(), out, dtype, progress, converter=convert_gguf_quantized,
        what=f"MLX quantized layers (no dequantization, scales {dtype})",
    )
