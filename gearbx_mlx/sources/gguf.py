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
BF16, Q4_0, Q4_1 and Q8_0 is read by :func:`read_gguf_numpy` instead: a small
GGUF parser with NumPy ports of ggml's reference dequantizers (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; bit-exact against llama.cpp's gguf-py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from . import gemma3
from .entries import TMP_PREFIX, failure_cause
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


# -- a small GGUF reader (header, metadata, NumPy dequantization) -----------

#: ggml tensor types: name, elements per block, bytes per block.
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
#: Types left to ``mx.load`` (quantized ones as MLX triples with float16
#: scales and biases, as the default model has always been read).
MLX_NATIVE_TYPES = frozenset({0, 1, 2, 3, 8, 30})

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
            7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


#: Deepest nesting of GGUF arrays the reader follows (real files nest one level).
MAX_ARRAY_DEPTH = 8
#: Most dimensions of a tensor (ggml has 4).
MAX_DIMS = 8


class _Cursor:
    """Reads little-endian fields from ``buf``; every read is bounds-checked, so a
    lying count or length fails with the byte offset instead of reading past the end."""

    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def _need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.pos + nbytes > len(self.buf):
            raise ValueError(
                f"truncated or corrupt at byte {self.pos}: {what} needs {nbytes} bytes, "
                f"{len(self.buf) - self.pos} are left"
            )

    def take(self, dtype: str, count: int = 1) -> np.ndarray:
        self._need(np.dtype(dtype).itemsize * count, f"{count} x {dtype}")
        a = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += a.nbytes
        return a

    def int(self, dtype: str = "<u8") -> int:
        return int(self.take(dtype)[0])

    def str(self) -> str:
        n = self.int()
        self._need(n, "a string")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == 8:
            return self.str()
        if vtype == 9:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"arrays nested deeper than {MAX_ARRAY_DEPTH} at byte {self.pos}")
            etype, n = self.int("<u4"), self.int()
            if etype == 8:
                return [self.str() for _ in range(n)]
            if etype == 9:
                return [self.value(9, depth + 1) for _ in range(n)]
            if etype not in _SCALARS:
                raise ValueError(f"unknown GGUF array element type {etype} at byte {self.pos}")
            return self.take(_SCALARS[etype], n).copy()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        v = self.take(_SCALARS[vtype])[0]
        return bool(v) if vtype == 7 else v.item()


def read_gguf_header(gguf_path: str | Path) -> Tuple[Dict[str, Any], List[Dict[str, Any]], int]:
    """Parse a GGUF (v2/v3) header.

    Returns:
        ``(meta, tensors, data_start)``: metadata (scalars as Python values,
        numeric arrays as NumPy arrays, string arrays as lists), one dict per
        tensor (``name``, ``shape`` in NumPy order, ``type``, ``offset`` from
        ``data_start``), and the byte offset of the tensor data.

    Raises:
        ValueError: not a GGUF file, or a header that lies (counts, lengths,
            types, alignment, tensors past the end of the file); the message
            names the file and the byte offset.
    """
    size = Path(gguf_path).stat().st_size
    if size < 24:  # magic, version, two counts
        raise ValueError(f"{gguf_path} is not a GGUF file ({size} bytes)")
    buf = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file")
    try:
        return _parse_header(buf)
    except ValueError as e:
        raise ValueError(f"{gguf_path}: malformed GGUF header: {e}") from None


def _parse_header(buf: Any) -> Tuple[Dict[str, Any], List[Dict[str, Any]], int]:
    c = _Cursor(buf, 4)
    version = c.int("<u4")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.int(), c.int()
    meta: Dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.str()
        meta[key] = c.value(c.int("<u4"))
    tensors = []
    for _ in range(n_tensors):
        name = c.str()
        n_dims = c.int("<u4")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
        dims = [c.int() for _ in range(n_dims)]
        ttype, offset = c.int("<u4"), c.int()
        tensors.append({"name": name, "shape": tuple(reversed(dims)), "type": ttype, "offset": offset})
    align = meta.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align % 8:
        raise ValueError(f"general.alignment must be a positive multiple of 8, got {align!r}")
    data_start = (c.pos + align - 1) // align * align
    for t in tensors:
        if t["type"] in GGML_TYPES:
            _, qk, nbytes = GGML_TYPES[t["type"]]
            end = data_start + t["offset"] + -(-int(np.prod(t["shape"], dtype=object)) // qk) * nbytes
            if end > len(buf):
                raise ValueError(
                    f"tensor {t['name']!r} ends at byte {end}, past the end of the file ({len(buf)} bytes): truncated?"
                )
    return meta, tensors, data_start


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """A float16 field at byte ``start`` of each block, as float32 ``(n, 1)``."""
    return blocks[:, start : start + 2].copy().view("<f2").astype(np.float32)


def _scale_min_k4(q: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes (llama.cpp's get_scale_min_k4)."""
    q = q.astype(np.uint8)
    sc = np.empty((q.shape[0], 8), np.uint8)
    mn = np.empty((q.shape[0], 8), np.uint8)
    sc[:, :4] = q[:, 0:4] & 63
    mn[:, :4] = q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def dequantize_blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Dequantize a tensor's raw bytes (uint8) of ggml type ``ggml_type`` to flat float32.

    Follows ggml's reference ``dequantize_row_*`` for each block format.
    """
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"GGUF tensor type {ggml_type} is not supported by the converter")
    name, qk, size = GGML_TYPES[ggml_type]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if name == "F32":
        return raw.view("<f4").astype(np.float32)
    if name == "F16":
        return raw.view("<f2").astype(np.float32)
    if name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    b = raw.reshape(-1, size)
    if name == "Q8_0":
        return (_f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    if name in ("Q4_0", "Q4_1"):
        qs = b[:, size - 16 :]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
        if name == "Q4_0":
            return (_f16(b, 0) * (q - 8)).reshape(-1)
        return (_f16(b, 0) * q + _f16(b, 2)).reshape(-1)
    if name in ("Q5_0", "Q5_1"):
        o = 2 if name == "Q5_0" else 4
        qh = b[:, o : o + 4].copy().view("<u4")  # (n, 1): bit j is the 5th bit of element j
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        qs = b[:, o + 4 :]
        q = (np.concatenate([qs & 0xF, qs >> 4], axis=1) | hi).astype(np.float32)
        if name == "Q5_0":
            return (_f16(b, 0) * (q - 16)).reshape(-1)
        return (_f16(b, 0) * q + _f16(b, 2)).reshape(-1)
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _scale_min_k4(b[:, 4:16])
        qs = b[:, -128:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: low nibbles, then high
        q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32)
        if name == "Q5_K":
            qh = b[:, 16:48]  # bit k of qh[l] is the 5th bit of element l of sub-block k
            q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        y = (d * sc)[:, :, None] * q.astype(np.float32) - (dmin * mn)[:, :, None]
        return y.reshape(-1)
    if name == "Q6_K":
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)  # one scale per 16 elements
        d = _f16(b, 208)
        lo = np.stack([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = (lo | (hi << 4)).astype(np.float32) - 32  # (n, 2 halves, 4 quarters, 32)
        return ((d * sc)[:, :, None] * q.reshape(-1, 16, 16)).reshape(-1)
    raise AssertionError(name)


def read_gguf_numpy(gguf_path: str | Path) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Read every tensor of a GGUF file dequantized to float32 (``name -> array``), and its metadata."""
    meta, tensors, start = read_gguf_header(gguf_path)
    buf = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    out: Dict[str, mx.array] = {}
    for t in tensors:
        if t["type"] not in GGML_TYPES:
            raise ValueError(f"GGUF tensor {t['name']!r} has type {t['type']}, which the converter does not support")
        _, qk, size = GGML_TYPES[t["type"]]
        n = int(np.prod(t["shape"]))
        if n % qk:
            raise ValueError(f"GGUF tensor {t['name']!r}: {n} elements is not a whole number of blocks")
        lo = start + t["offset"]
        raw = buf[lo : lo + n // qk * size]
        out[t["name"]] = mx.array(dequantize_blocks(raw, t["type"]).reshape(t["shape"]))
    return out, meta


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
