"""A small GGUF reader: the header, the metadata and NumPy ports of ggml's dequantizers.

MLX reads GGUF natively but fails on some tensor types (Q5_0 among them, which
llama.cpp's Q4_K_M recipe uses for matrices whose rows are not a multiple of
256). :func:`read_gguf_header` parses a file's header and metadata without
reading a tensor (with bounds on every count, length and nesting it reads), and
:func:`read_gguf_numpy` reads every tensor dequantized to float32 by
:func:`dequantize_blocks` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K;
bit-exact against llama.cpp's gguf-py). :mod:`.gguf` converts what it reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import numpy as np

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


__all__ = ["GGML_TYPES", "MAX_ARRAY_DEPTH", "MAX_DIMS", "MLX_NATIVE_TYPES", "dequantize_blocks", "read_gguf_header",
           "read_gguf_numpy"]
