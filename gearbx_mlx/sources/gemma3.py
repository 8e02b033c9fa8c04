"""Gemma 3 in GGUF, as mlx-lm's ``gemma3_text`` reads it.

What llama.cpp's converter changed, and what it leaves implicit:

* every RMSNorm weight (the four per block, Q/K norms, the final one) is
  stored as ``1 + w``: Gemma's norm scales by ``1 + w`` and llama.cpp folds
  the one in. mlx-lm adds it at run time, so we subtract it;
* Q/K rows are not permuted (only llama's are);
* there is no ``output`` tensor: the embedding is the output projection
  (mlx-lm ties it when ``lm_head`` is absent);
* the file states the sliding window but not which layers slide: llama.cpp
  hard-codes every sixth layer global, with RoPE base 10,000 on the sliding
  layers and ``rope.freq_base`` on the global ones, and scales queries by
  ``1/sqrt(key_length)`` (``query_pre_attn_scalar``) except for the 27B
  model, whose scalar is ``hidden / heads``;
* the vocabulary is SentencePiece-style (:mod:`.spm`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import mlx.core as mx

#: GGUF block tensor -> mlx-lm gemma3_text module (below ``model.layers.N.``).
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

#: llama.cpp's fixed layout of Gemma 3 (not written to the file).
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_BASE = 10_000.0
#: Block count of Gemma 3 27B, the one model whose query scale is hidden / heads.
BLOCKS_27B = 62


def config(meta: Dict[str, Any], scalar: Callable[[Dict[str, Any], str, Any], Any]) -> Dict[str, Any]:
    """mlx-lm ``gemma3_text`` config fields from ``gemma3.*`` metadata.

    Args:
        scalar: reads one metadata value as a Python scalar (``scalar(meta, key, default)``).
    """
    p = "gemma3."
    hidden = int(scalar(meta, p + "embedding_length", None))
    heads = int(scalar(meta, p + "attention.head_count", None))
    blocks = int(scalar(meta, p + "block_count", None))
    head_dim = int(scalar(meta, p + "attention.key_length", 256))
    out: Dict[str, Any] = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // heads if blocks == BLOCKS_27B else head_dim,
        "rope_theta": float(scalar(meta, p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "sliding_window": int(scalar(meta, p + "attention.sliding_window", 512)),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "rms_norm_eps": float(scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-6)),
    }
    if scalar(meta, p + "rope.scaling.type", None) == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(scalar(meta, p + "rope.scaling.factor", 1.0))}
    return out


def fix_tensor(name: str, w: mx.array) -> mx.array:
    """Undo llama.cpp's ``1 + w`` on a norm weight (``name`` is the GGUF tensor name)."""
    return w - 1 if name.endswith("norm.weight") else w
