"""Convert a llama-, qwen2- or gemma3-architecture GGUF file into a folder ``mlx_lm.load`` accepts.

MLX reads GGUF natively (``mx.load(path, return_metadata=True)``): quantized
tensors come back as MLX triples (packed uint32, scales, biases; group 32).
We dequantize them to a float dtype, rename tensors to mlx-lm's names,
undo llama.cpp's Q/K row permutation for llama (a wrong one still loads and
generates garbage; llama.cpp does not permute qwen2), keep qwen2's Q/K/V
biases, and build a byte-level BPE tokenizer from the metadata (or a
SentencePiece-style one, :mod:`.spm`; Gemma 3's own changes are in
:mod:`.gemma3`). The architecture and tokenizer are checked from the header
before any tensor is read. No torch.

MLX's reader keeps Q4_0, Q4_1 and Q8_0 tensors as quantized triples but
fails on a file holding Q5_0 ("gguf_tensor_to_f16 failed", MLX 0.32), which
llama.cpp's Q4_K_M recipe uses for matrices whose rows are not a multiple of
256 (e.g. hidden size 896). A file with any tensor type outside F32, F16,
BF16, Q4_0, Q4_1 and Q8_0 is read by :func:`read_gguf_numpy` (:mod:`.gguf_reader`) instead: a small
GGUF parser with NumPy ports of ggml's reference dequantizers (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; bit-exact against llama.cpp's gguf-py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from . import gemma3
from .entries import TMP_PREFIX, failure_cause
from .gguf_reader import (  # re-exported: callers read them here
    GGML_TYPES as GGML_TYPES,
    MLX_NATIVE_TYPES,
    dequantize_blocks as dequantize_blocks,
    read_gguf_header,
    read_gguf_numpy,
)
from .spm import spm_tokenizer

GGUF_GROUP = 32
#: dtypes a converted model's float tensors may take.
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

#: GGUF tensor names outside the blocks -> mlx-lm parameter paths.
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
#: GGUF names of a block's tensors -> their paths under ``model.layers.<i>`` (llama and qwen2).
BLOCK_NAMES = {
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

#: GGUF architectures the converter handles, with mlx-lm's model type.
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
#: Block tensor names of each architecture (llama's and qwen2's are the same).
_ARCH_BLOCK_NAMES = {"gemma3": gemma3.BLOCK_NAMES}
#: ``tokenizer.ggml.model`` values the converter rebuilds.
_TOKENIZERS = ("gpt2", "llama")

#: What works for a GGUF the converter refuses: mlx_lm.convert reads Hugging
#: Face checkpoints, not GGUF, so go through one.
_CONVERT_ADVICE = (
    "convert the model's original Hugging Face checkpoint instead "
    "(mlx_lm.convert --hf-path ORG/MODEL --mlx-path DIR) and pass DIR with --model; "
    "mlx_lm.convert does not read GGUF files"
)


def check_supported(meta: Dict[str, Any], path: Any = "the GGUF file") -> str:
    """The architecture of a GGUF header, if the converter handles it and its tokenizer.

    Reads metadata only, so an unsupported file is refused before any tensor
    is dequantized.

    Raises:
        ValueError: naming the file, what it holds, what is supported and what to do.
    """
    arch = _scalar(meta, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported by the converter "
            f"({', '.join(sorted(_ARCHITECTURES))} are); {_CONVERT_ADVICE}"
        )
    model = meta.get("tokenizer.ggml.model")
    if model not in _TOKENIZERS:
        raise ValueError(
            f"{path}: GGUF tokenizer {model!r} is not supported by the converter "
            f"(byte-level BPE 'gpt2' and SentencePiece 'llama' are); {_CONVERT_ADVICE}"
        )
    return str(arch)


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


def mlx_config(meta: Dict[str, Any], has_output: bool) -> Dict[str, Any]:
    """The mlx-lm ``config.json`` of a GGUF model from its metadata (``has_output``: an untied ``lm_head``)."""
    arch = check_supported(meta)
    model_type, hf_class = _ARCHITECTURES[arch]
    p = arch + "."
    heads = int(_scalar(meta, p + "attention.head_count"))
    hidden = int(_scalar(meta, p + "embedding_length"))
    vocab = _scalar(meta, p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    out = {
        "model_type": model_type,
        "architectures": [hf_class],
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
    if arch == "gemma3":
        out.update(gemma3.config(meta, _scalar))
    return out


def _tokenizer_files(meta: Dict[str, Any]) -> Dict[str, Any]:
    """tokenizer.json and tokenizer_config.json from GGUF metadata (gpt2 BPE or SentencePiece)."""
    if meta.get("tokenizer.ggml.model") == "llama":
        return {"tokenizer": spm_tokenizer(meta), "config": _tokenizer_config(meta)}
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported "
            "(byte-level BPE 'gpt2' and SentencePiece 'llama' only)"
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
    elif pre == "qwen2":
        # Qwen2's tokenizer.json: NFC, then llama3's regex with single digits.

        qwen2 = (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(qwen2), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported by the converter")
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are special: never split, skipped when decoding.
    # User-defined tokens (type 4, e.g. Qwen's <tool_call>) are never split either.

    specials = [tokens[i] for i, t in enumerate(types) if t == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    user = [tokens[i] for i, t in enumerate(types) if t == 4]
    if user:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in user])
    return {"tokenizer": tok, "config": _tokenizer_config(meta)}


def _tokenizer_config(meta: Dict[str, Any]) -> Dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS policy, chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    arch = _scalar(meta, "general.architecture") or "llama"

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
        "model_max_length": int(_scalar(meta, f"{arch}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


def read_gguf(gguf_path: Path, dtype: str) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Check the arguments of a conversion, then read the GGUF's tensors and metadata.

    Files whose tensors are all of a type MLX reads (F32/F16/BF16, Q4_0, Q4_1,
    Q8_0) come from ``mx.load`` (quantized tensors as MLX triples); any other
    file from :func:`read_gguf_numpy` (every tensor dequantized to float32).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    meta, tensors, _ = read_gguf_header(gguf_path)
    check_supported(meta, gguf_path)  # before seconds of dequantizing
    if all(t["type"] in MLX_NATIVE_TYPES for t in tensors):
        return mx.load(str(gguf_path), return_metadata=True)
    return read_gguf_numpy(gguf_path)


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
    config = mlx_config(meta, has_output)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    tdtype = DTYPES[dtype]

    # llama.cpp permutes llama's Q/K rows for its RoPE layout, not qwen2's or gemma3's.
    permuted = config["model_type"] == "llama"
    arch = _scalar(meta, "general.architecture")
    block_names = _ARCH_BLOCK_NAMES.get(arch, BLOCK_NAMES)
    names = sorted({k.rsplit(".", 1)[0] for k in weights})
    out: Dict[str, mx.array] = {}
    for i, name in enumerate(names):
        if name.startswith("blk."):
            _, layer, kind = name.split(".", 2)
            if kind not in block_names:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            path = f"model.layers.{layer}.{block_names[kind]}"
            heads = {"attn_q": n_head, "attn_k": n_kv}.get(kind) if permuted else None
        elif name in TENSOR_NAMES:
            path, heads = TENSOR_NAMES[name], None
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        w = _dequantize(weights, name, mx.float32)
        if arch == "gemma3":  # norms stored as 1 + w; undone before rounding to dtype
            w = gemma3.fix_tensor(f"{name}.weight", w)
        parts = {"weight": w.astype(tdtype)}
        if f"{name}.bias" in weights:  # qwen2's Q/K/V biases (float32 in the file)
            parts["bias"] = weights[f"{name}.bias"].astype(tdtype)
        for field, w in parts.items():
            if heads is not None:
                w = unpermute_qk(w, heads)
            out[f"{path}.{field}"] = w
            mx.eval(w)
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
    weights = out_dir / "model.safetensors"
    try:
        with open(weights, "wb") as fh:  # a Python file: MLX then reports a failed write as the OSError it is
            mx.save_safetensors(fh, tensors, metadata={"format": "mlx"})
    except (OSError, RuntimeError) as e:
        cause = failure_cause(e)
        home = out_dir.parent  # the cache folder, above the build's temporaries
        while home.name.startswith(TMP_PREFIX) and home.parent != home:
            home = home.parent
        raise OSError(f"cannot write the converted model into {home} ({cause}): free space there "
                      "or point GEARBX_CACHE elsewhere") from None
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
