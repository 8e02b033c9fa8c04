"""Tiny real model folders for the fault-injection tests (seconds, not minutes).

A 2-layer qwen2 GGUF (tests/test_models.py's builder) converted by the
package's own converter: a folder ``mlx_lm.load`` and ``gearbx_mlx.generate``
take like any model, with a byte-level BPE tokenizer of 266 tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from gearbx_mlx.sources.gguf import convert_gguf


def tiny_gguf(path: Path, seed: int = 0) -> Path:
    from test_models import tiny_qwen2_gguf

    tiny_qwen2_gguf(path, np.random.default_rng(seed))
    return path


def tiny_model_folder(root: Path, name: str = "tiny") -> Path:
    """A converted tiny model under ``root`` (no chat template)."""
    root.mkdir(parents=True, exist_ok=True)
    return convert_gguf(tiny_gguf(root / f"{name}.gguf"), root / name, dtype="float32")


def copy_model(src: Path, dest: Path, chat_template: str | None = None) -> Path:
    """A copy of a model folder, optionally with ``chat_template`` in its tokenizer config."""
    shutil.copytree(src, dest)
    if chat_template is not None:
        cfg_path = dest / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = chat_template
        cfg_path.write_text(json.dumps(cfg))
    return dest
