"""Convert a llama-architecture GGUF file into a folder ``mlx_lm.load`` accepts.

MLX reads GGUF natively (``mx.load(path, return_metadata=True)``): quantized
tensors come back as MLX triples (packed uint32, scales, biases; group 32).
We dequantize them to a float dtype, rename tensors to mlx-lm's llama names,
undo llama.cpp's Q/K row permutation (a wrong one still loads and generates
garbage), and build a byte-level BPE tokenizer from the metadata. No torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx

GGUF_GROUP = 32
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _scalar(meta: Dict[str, Any], key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) else v


def unpermute_qk(w: mx.array, n_head: int) -> mx.array:
    """Invert llama.cpp's ``permute`` of Q/K rows (its RoPE layout).

    llama.cpp stores ``w.reshape(n, 2, d/2, ...).swapaxes(1, 2)``; we undo it.

    Args:
        w: ``(n_head · head_dim, in)`` rows as stored in the GGUF file.
    """
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _dequantize(weights: Dict[str, mx.array], name: str, dtype: mx.Dtype) -> mx.array:
    w = weights[f"{name}.weight"]
    scales = weights.get(f"{name}.scales")
    if scales is None:
        return w.astype(dtype)
    biases = weights.get(f"{name}.biases")
    # Bits follow from the shapes: 32 bits per uint32 over the group's columns.
    bits = 32 * w.shape[-1] // (scales.shape[-1] * GGUF_GROUP)
    out = mx.dequantize(w, scales, biases, group_size=GGUF_GROUP, bits=bits)
    return out.astype(dtype)


def _config(meta: Dict[str, Any], has_output: bool) -> Dict[str, Any]:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by the converter (llama only); "
            "convert the model with mlx_lm.convert and pass the folder with --model"
        )
    p = "llama."
    heads = int(_scalar(meta, p + "attention.head_count"))
    hidden = int(_scalar(meta, p + "embedding_length"))
    vocab = _scalar(meta, p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, p + "block_count")),
        "intermediate_size": int(_scalar(meta, p + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, p + "attention.head_count_kv", heads)),
        "head_dim": int(_scalar(meta, p + "rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(_scalar(meta, p + "context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
    }


def _tokenizer_files(meta: Dict[str, Any]) -> Dict[str, Any]:
    """tokenizer.json and tokenizer_config.json from GGUF metadata (gpt2 BPE)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported "
            "(byte-level BPE 'gpt2' only)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"):
        # llama.cpp's pre-tokenizer for these splits every digit, then GPT-2's regex.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("gpt2", "default", "gpt-2"):
        tok.pre_tokenizer = byte_level
    elif pre in ("llama3", "llama-bpe", "smaug-bpe"):
        llama3 = (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by the converter")
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are special: never split, skipped when decoding.
    from tokenizers import AddedToken

    specials = [tokens[i] for i, t in enumerate(types) if t == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])

    def name(key: str) -> Optional[str]:
        i = _scalar(meta, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer": tok, "config": cfg}


def read_gguf(gguf_path: Path, dtype: str) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Check the arguments of a conversion, then read the GGUF's tensors and metadata."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    return mx.load(str(gguf_path), return_metadata=True)


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float16",
    progress: Optional[Callable[[int, int], None]] = None,
) -> Path:
    """Write an mlx-lm folder for ``gguf_path`` into ``out_dir`` (must not exist).

    Args:
        dtype: ``float16``, ``bfloat16`` or ``float32`` for the dequantized weights.
        progress: called as ``progress(done, total)`` over the tensors.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    weights, meta = read_gguf(gguf_path, dtype)
    has_output = "output.weight" in weights
    config = _config(meta, has_output)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    tdtype = _DTYPES[dtype]

    names = sorted({k.rsplit(".", 1)[0] for k in weights})
    out: Dict[str, mx.array] = {}
    for i, name in enumerate(names):
        w = _dequantize(weights, name, tdtype)
        if name.startswith("blk."):
            _, layer, kind = name.split(".", 2)
            if kind not in _BLOCK_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            if kind == "attn_q":
                w = unpermute_qk(w, n_head)
            elif kind == "attn_k":
                w = unpermute_qk(w, n_kv)
            key = f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.weight"
        elif name in _TENSOR_NAMES:
            key = f"{_TENSOR_NAMES[name]}.weight"
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        out[key] = w
        mx.eval(out[key])
        if progress:
            progress(i + 1, len(names))

    config["torch_dtype"] = dtype
    return write_model_folder(out_dir, out, config, meta, gguf_path)


def write_model_folder(
    out_dir: Path,
    tensors: Dict[str, mx.array],
    config: Dict[str, Any],
    meta: Dict[str, Any],
    gguf_path: Path,
    **source: Any,
) -> Path:
    """Write safetensors, ``config.json`` and the tokenizer files into ``out_dir``.

    ``source`` adds fields to ``config["gearbx_source"]`` (where it came from).
    """
    tok = _tokenizer_files(meta)
    out_dir.mkdir(parents=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), tensors, metadata={"format": "mlx"})
    config["gearbx_source"] = {
        "gguf": gguf_path.name, "file_type": _scalar(meta, "general.file_type"), **source
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok["tokenizer"].save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok["config"], indent=2) + "\n")
    specials = {k: v for k, v in tok["config"].items() if k.endswith("_token") and v}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out_dir


def text_progress(label: str) -> Callable[[int, int], None]:
    """A one-line progress counter on stderr."""

    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        # Redraw in place on a terminal; in a log, a line every 10%.
        if tty:
            end = "\n" if done == total else ""
            print(f"\r{label}: {done}/{total}", end=end, file=sys.stderr, flush=True)
        elif done == total or done % max(1, total // 10) == 0:
            print(f"{label}: {done}/{total}", file=sys.stderr, flush=True)

    return report
