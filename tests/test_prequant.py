"""Truly pre-quantized models: the GGUF's Q4_1 triples as MLX quantized layers, telemetry only."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gearbx_mlx.chat import apply_chat_template
from gearbx_mlx.sources import prequant
from gearbx_mlx.sources.gguf import GGUF_GROUP, unpermute_qk


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of Q/K rows (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@settings(max_examples=15, deadline=None)
@given(n_head=st.integers(1, 4), half=st.integers(1, 4), groups=st.integers(1, 3), bits=st.sampled_from([4, 8]))
def test_packed_rows_unpermute_like_float_rows(n_head, half, groups, bits):
    """Un-permuting packed rows (weight, scales, biases together) dequantizes to
    the un-permuted float rows: a packed row is one whole output channel."""
    rows, cols = n_head * 2 * half, groups * GGUF_GROUP
    w = np.random.default_rng(rows * cols).standard_normal((rows, cols)).astype(np.float32)
    stored = mx.array(permute(w, n_head))  # as llama.cpp writes it
    q, s, b = mx.quantize(stored, group_size=GGUF_GROUP, bits=bits)
    gguf = {"blk.0.attn_q.weight": q, "blk.0.attn_q.scales": s, "blk.0.attn_q.biases": b}
    out, layers = prequant.quantized_weights(gguf, n_head, n_head, "float32")
    p = "model.layers.0.self_attn.q_proj"
    assert layers == {p: {"group_size": GGUF_GROUP, "bits": bits}}
    assert out[f"{p}.weight"].dtype == mx.uint32 and out[f"{p}.scales"].dtype == mx.float32
    got = mx.dequantize(out[f"{p}.weight"], out[f"{p}.scales"], out[f"{p}.biases"], group_size=GGUF_GROUP, bits=bits)
    want = unpermute_qk(mx.dequantize(q, s, b, group_size=GGUF_GROUP, bits=bits), n_head)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-6)


def test_unpermuted_sources_keep_their_rows():
    """llama.cpp's qwen2 converter does not permute Q/K: nothing to undo."""
    w = np.random.default_rng(1).standard_normal((8, GGUF_GROUP)).astype(np.float32)
    q, s, b = mx.quantize(mx.array(w), group_size=GGUF_GROUP, bits=4)
    gguf = {"blk.0.attn_k.weight": q, "blk.0.attn_k.scales": s, "blk.0.attn_k.biases": b}
    out, _ = prequant.quantized_weights(gguf, 2, 2, "float32", permuted=False)
    p = "model.layers.0.self_attn.k_proj"
    assert mx.array_equal(out[f"{p}.weight"], q) and mx.array_equal(out[f"{p}.scales"], s)
    out, _ = prequant.quantized_weights(gguf, 2, 2, "float32")
    assert not mx.array_equal(out[f"{p}.weight"], q)


def test_quantization_config_has_default_and_overrides():
    layers = {"a": {"group_size": 32, "bits": 4}, "b": {"group_size": 32, "bits": 4},
              "model.embed_tokens": {"group_size": 32, "bits": 8}}
    q = prequant.quantization_config(layers)
    assert q == {"group_size": 32, "bits": 4, "mode": "affine", "model.embed_tokens": {"group_size": 32, "bits": 8}}
    with pytest.raises(ValueError, match="no quantized tensors"):
        prequant.quantization_config({})


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError):
        prequant.convert_gguf_quantized(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        prequant.convert_gguf_quantized(tmp_path / "missing.gguf", tmp_path / "out", dtype="int3")


#: The tests of q4_model run in one pytest-xdist worker: the model is loaded (and on first use converted) once.
ONE_WORKER = pytest.mark.xdist_group("prequantized-default-model")


@pytest.fixture(scope="module")
def q4_model():
    from gearbx_mlx.generation import load

    return load("smollm2-135m-q4")


@ONE_WORKER
@pytest.mark.slow
def test_prequantized_default_model_loads_quantized_and_telemetry_only(q4_model):
    model, tok, gearbox = q4_model
    layers = {p: m for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert len(layers) == 30 * 7 + 1  # every projection, and the (tied) embedding
    emb = model.model.embed_tokens
    assert isinstance(emb, nn.QuantizedEmbedding) and (emb.bits, emb.group_size) == (8, 32)
    q = model.model.layers[0].self_attn.q_proj
    assert (q.bits, q.group_size) == (4, 32)
    assert gearbox.manager.telemetry_only and gearbox.manager.paths == []


@ONE_WORKER
@pytest.mark.slow
def test_prequantized_logits_match_the_dequantized_model(q4_model, default_model):
    """Same GGUF values: the float model is their dequantization (its weights
    rounded through float16), so the logits agree closely."""
    fmodel, tok, _ = default_model
    qmodel = q4_model[0]
    ids = mx.array(tok.encode("The quick brown fox jumps over the lazy dog because"))[None]
    a = fmodel(ids).astype(mx.float32)
    b = qmodel(ids).astype(mx.float32)
    assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1))
    la = a - mx.logsumexp(a, -1, keepdims=True)
    lb = b - mx.logsumexp(b, -1, keepdims=True)
    kl = (mx.exp(la) * (la - lb)).sum(-1).max().item()
    assert kl < 1e-3


@ONE_WORKER
@pytest.mark.slow
def test_prequantized_chat_answer_is_coherent(q4_model):
    from mlx_lm import generate

    model, tok, _ = q4_model
    prompt = apply_chat_template(tok, "What is the capital of France?")
    assert "Paris" in generate(model, tok, prompt, max_tokens=12)


@pytest.mark.slow
def test_any_mlx_lm_quantized_folder_runs_telemetry_only(tmp_path, capsys):
    """An mlx_lm.convert-ed 4-bit folder: the CLI detects it, says so, and swaps nothing."""
    from mlx_lm import convert

    from gearbx_mlx.generate import main as generate_main
    from gearbx_mlx.sources.models import default_model_path
    from gearbx_mlx.telemetry.trace import read_trace

    folder = tmp_path / "q4g64"
    convert(str(default_model_path()), str(folder), quantize=True, q_group_size=64, q_bits=4)
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    trace = tmp_path / "t.jsonl"
    assert generate_main(["--model", str(folder), "-p", "Hello", "-m", "4", "--trace", str(trace)]) == 0
    assert "telemetry only" in capsys.readouterr().err
    t = read_trace(trace)
    assert t.header["telemetry_only"] and t.header["managed_modules"] == 0
    assert len(t.tokens) == 4 and t.summary["telemetry_only"] and t.summary["quantize_seconds"] == 0
