"""The default model: GGUF conversion, cache, and its quality."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gearbx_mlx import models
from gearbx_mlx.evaluation.perplexity import windowed_perplexity as perplexity
from gearbx_mlx.gguf import convert_gguf, unpermute_qk

#: FACTS.md: perplexity of the float model on the first 2,048 tokens of
#: lee_background.cor, scored in 4 windows of 512, is 30.81.
EXPECTED_PPL = 30.81
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

    monkeypatch.setattr("gearbx_mlx.gguf.convert_gguf", boom)
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
    ids = tok.encode(text)[:2049]
    assert perplexity(model, ids) == pytest.approx(EXPECTED_PPL, rel=PPL_RTOL)


@pytest.mark.slow
def test_default_model_chat_answer_is_coherent(default_model):
    from mlx_lm import generate

    model, tok, _ = default_model
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert "Paris" in generate(model, tok, prompt, max_tokens=20)
