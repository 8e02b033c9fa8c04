"""The drafter's decode step on the CPU without MLX: numpy around the packed C GEMV.

On MLX's CPU backend a packed layer has to hand its input to C: an ``mx.eval``
per linear, 211 per token of the default model, which cost more than the
products themselves (a draft step took 24 ms, of which ~3 ms of GEMV). The
host forward runs the whole decode step of a llama-shaped drafter in numpy
around the same C kernels, on a KV cache in host memory: no MLX graph, no
sync. The MLX module tree stays the oracle and the fallback (other
architectures, a GPU, multi-token calls without a host cache).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import _BaseCache

from ..bindings import cpu as cpu_kernels, nested_cpu
from ..distributed.layers import group_of
from ..mlx_tables import GROUP_SIZES
from ..nested.layers import NestedEmbedding, NestedLinear
from ..nested.matmul import nested_kernels_trusted
from ..packed import layers as packed_layers
from ..packed.layers import PackedBase, PackedEmbedding, cpu_backend, cpu_kernels_trusted

HOST_PREFILL_MAX = 64
#: mlx-lm architectures whose decode step the host forward reproduces: llama, and qwen2 (llama
#: with biases on q/k/v, which each host linear adds).
HOST_ARCHITECTURES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")


class HostKVCache(_BaseCache):
    """One layer's keys and values in host memory, trimmable like mlx-lm's ``KVCache``.

    ``keys``, ``values``: ``(n_kv_heads, capacity, head_dim)`` float32 (RoPE
    applied to the keys); the first ``offset`` positions hold the context.
    """

    step = 256

    def __init__(self, n_kv_heads: int, head_dim: int) -> None:
        self.keys = np.zeros((n_kv_heads, 0, head_dim), np.float32)
        self.values = np.zeros((n_kv_heads, 0, head_dim), np.float32)
        self.offset = 0

    def reserve(self, n: int) -> None:
        """Room for ``n`` more positions (grows by whole steps, keeps the context)."""
        need = self.offset + n
        if need > self.keys.shape[1]:
            cap = -(-need // self.step) * self.step
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = np.zeros((old.shape[0], cap, old.shape[2]), np.float32)
                new[:, : self.offset] = old[:, : self.offset]
                setattr(self, name, new)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def state(self) -> List[mx.array]:
        return []  # nothing lazy: mlx-lm evaluates ``c.state`` after a prefill chunk

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class _HostLinear:
    """``y = W x (+ b)`` of one layer: the packed C GEMV, or numpy for float32 weights.

    ``__call__`` reads the input through the cffi pointer given and returns
    its own output buffer (overwritten by the next call).
    """

    def __init__(self, layer: Optional[nn.Module], ext: Any, dense: Optional[np.ndarray] = None) -> None:
        self.lib, self.ffi = ext.lib, ext.ffi
        self.bias = np.asarray(layer["bias"]) if layer is not None and "bias" in layer else None
        self.nested = None
        if isinstance(layer, (NestedLinear, NestedEmbedding)):
            # A view of the nested store: the C kernel reads its planes in place.
            bias = layer.nested.get("bias")
            self.bias = np.asarray(bias.astype(mx.float32)) if bias is not None else None
            prod = layer.nested.product
            prepared = prod.cpu_prepared()
            self.nested = (prepared, prepared.table, layer.n, nested_cpu.PATHS[prod.cpu_path(layer.n)])
            self.dense = None
            out = prod.out_features
            self.args = (1, out, prod.in_features)
        elif dense is not None:
            self.dense = dense
            out = dense.shape[0]
        elif isinstance(layer, PackedBase):
            mx.eval(layer.weight, layer.scales)
            self.w, self.s = np.asarray(layer.weight), np.asarray(layer.scales)
            self.pw = self.ffi.from_buffer(self.w)
            self.ps = self.ffi.from_buffer("float[]", self.s)
            self.args = (layer.out_features, layer.in_features, layer.bits, layer.group_size or 0,
                         cpu_kernels.PATHS[packed_layers.CPU_GEMV_PATH], 0)
            self.dense = None
            out = layer.out_features
        else:
            mx.eval(layer.weight)
            self.dense = np.asarray(layer.weight)
            out = self.dense.shape[0]
        self.out = np.empty(out, np.float32)
        self.py = self.ffi.from_buffer("float[]", self.out, require_writable=True)

    def __call__(self, x: np.ndarray, px: Any) -> np.ndarray:
        if self.nested is not None:
            _, table, n, path = self.nested
            rc = self.lib.gbx_nested_gemv(table, n, px, self.py, *self.args, path, 0)
            if rc != 0:
                raise RuntimeError(f"gearbx_mlx: host drafter nested GEMV failed ({rc})")
        elif self.dense is None:
            rc = self.lib.gbx_gemv(self.pw, self.ps, px, self.py, *self.args)
            if rc != 0:
                raise RuntimeError(f"gearbx_mlx: host drafter GEMV failed ({rc})")
        else:
            np.dot(self.dense, x, out=self.out)
        if self.bias is not None:
            self.out += self.bias
        return self.out


def _supported_linear(layer: Any) -> bool:
    if isinstance(layer, (NestedLinear, NestedEmbedding)):
        prepared = layer.nested.product.cpu_prepared()
        return prepared is not None and layer.n <= prepared.n_planes
    if isinstance(layer, PackedBase):
        return layer.bits in (4, 8) and layer.group_size in (None, *GROUP_SIZES)
    return type(layer) is nn.Linear and layer.weight.dtype == mx.float32


class HostForward:
    """The decode step of a llama-shaped drafter in numpy around the packed C GEMV.

    Built by :func:`host_forward` only for what it reproduces exactly: mlx-lm's
    ``llama`` and ``qwen2`` architectures (full attention, plain RoPE, RMSNorm, SwiGLU) with
    float32 norms and embedding/linears that are packed int4/int8 or float32.
    Numerically it is the MLX tree's single-token path (the same kernels) up
    to float rounding in the norms, RoPE and attention.
    """

    def __init__(self, module: nn.Module, ext: Any) -> None:
        inner = module.model
        a = module.args
        self.ffi = ext.ffi
        self.n_heads = a.num_attention_heads
        self.n_kv = a.num_key_value_heads
        self.head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
        self.rep = self.n_heads // self.n_kv
        self.eps = float(a.rms_norm_eps)
        self.hidden = a.hidden_size
        attn0 = inner.layers[0].self_attn
        self.scale = float(attn0.scale)
        rope = attn0.rope
        self.rope_dims, self.rope_half = rope.dims, rope.dims // 2
        self.inv_freq = (float(rope.base) ** (-np.arange(0, rope.dims, 2, dtype=np.float32) / rope.dims)).astype(np.float32)
        self.rope_scale = float(rope.scale)
        self.cos = self.sin = np.zeros((0, self.rope_half), np.float32)
        self.embed = inner.embed_tokens
        mx.eval(self.embed.parameters())
        # A nested embedding's rows are looked up through its view (one small MLX call a token).
        self.nested_embed = isinstance(self.embed, NestedEmbedding)
        self.embed_w = None if self.nested_embed else np.asarray(self.embed.weight)
        self.embed_s = np.asarray(self.embed.scales) if not self.nested_embed and "scales" in self.embed else None
        self.layers = []
        for layer in inner.layers:
            at, mlp = layer.self_attn, layer.mlp
            mx.eval(layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            self.layers.append((
                np.asarray(layer.input_layernorm.weight), np.asarray(layer.post_attention_layernorm.weight),
                *(_HostLinear(m, ext) for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj,
                                                mlp.gate_proj, mlp.up_proj, mlp.down_proj)),
            ))
        mx.eval(inner.norm.weight)
        self.norm = np.asarray(inner.norm.weight)
        head = inner.embed_tokens if a.tie_word_embeddings else module.lm_head
        if a.tie_word_embeddings and self.embed_s is None and not self.nested_embed:  # a float table: numpy
            self.head = _HostLinear(None, ext, dense=self.embed_w)
        else:
            self.head = _HostLinear(head, ext)
        self.vocab = self.head.out.shape[0]
        inter = self.layers[0][6].out.shape[0]
        self.xn = np.empty(self.hidden, np.float32)  # normalized hidden: input of q/k/v, gate/up
        self.attn = np.empty(self.n_heads * self.head_dim, np.float32)  # input of o_proj
        self.act = np.empty(inter, np.float32)  # input of down_proj
        self.tmp = np.empty(inter, np.float32)
        self.pxn, self.pattn, self.pact = (self.ffi.from_buffer("float[]", b) for b in (self.xn, self.attn, self.act))

    def make_cache(self) -> List[HostKVCache]:
        return [HostKVCache(self.n_kv, self.head_dim) for _ in self.layers]

    def _embed_row(self, tok: int) -> np.ndarray:
        if self.nested_embed:
            row = self.embed(mx.array([tok]))[0].astype(mx.float32)
            mx.eval(row)
            return np.array(row)
        w = self.embed_w[tok]
        if self.embed_s is None:
            return w.astype(np.float32)
        if self.embed.bits == 4:
            q = np.empty(w.size * 2, np.int8)
            q[0::2] = w & 0xF
            q[1::2] = w >> 4
            q -= 8
        else:
            q = w
        s = self.embed_s[tok]
        return (q.reshape(s.size, -1) * s[:, None]).reshape(-1).astype(np.float32)

    def _rope_tables(self, n: int) -> None:
        if n > self.cos.shape[0]:
            n = max(n, 2 * self.cos.shape[0], 256)
            t = np.arange(n, dtype=np.float32)[:, None] * np.float32(self.rope_scale) * self.inv_freq[None]
            self.cos, self.sin = np.cos(t), np.sin(t)

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        """Non-traditional RoPE of ``(heads, head_dim)`` at one position (a new array)."""
        c, s, h = self.cos[pos], self.sin[pos], self.rope_half
        a, b = x[:, :h], x[:, h : self.rope_dims]
        out = x.copy()
        out[:, :h] = a * c - b * s
        out[:, h : self.rope_dims] = a * s + b * c
        return out

    def _rms(self, h: np.ndarray, w: np.ndarray) -> None:
        r = np.float32(1.0) / np.sqrt(np.dot(h, h) / np.float32(h.size) + np.float32(self.eps))
        np.multiply(h, w, out=self.xn)
        self.xn *= r

    def step(self, tok: int, caches: Sequence[HostKVCache], logits: bool = True) -> Optional[np.ndarray]:
        """Feed one token; return the ``(V,)`` float32 logits (an internal buffer) or None."""
        pos = caches[0].offset
        self._rope_tables(pos + 1)
        h = self._embed_row(tok)
        nkv, rep, hd = self.n_kv, self.rep, self.head_dim
        for (w_in, w_post, q_p, k_p, v_p, o_p, g_p, u_p, d_p), c in zip(self.layers, caches):
            self._rms(h, w_in)
            q = self._rope(q_p(self.xn, self.pxn).reshape(self.n_heads, hd), pos)
            k = self._rope(k_p(self.xn, self.pxn).reshape(nkv, hd), pos)
            c.reserve(1)
            c.keys[:, pos] = k
            c.values[:, pos] = v_p(self.xn, self.pxn).reshape(nkv, hd)
            c.offset = pos + 1
            s = np.matmul(q.reshape(nkv, rep, hd), c.keys[:, : pos + 1].transpose(0, 2, 1))
            s *= np.float32(self.scale)
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            np.matmul(s, c.values[:, : pos + 1], out=self.attn.reshape(nkv, rep, hd))
            h += o_p(self.attn, self.pattn)
            self._rms(h, w_post)
            g = g_p(self.xn, self.pxn)
            u = u_p(self.xn, self.pxn)
            np.negative(g, out=self.tmp)
            np.exp(self.tmp, out=self.tmp)
            self.tmp += 1
            np.divide(g, self.tmp, out=self.act)  # silu(g) = g / (1 + e^-g)
            self.act *= u
            h += d_p(self.act, self.pact)
        if not logits:
            return None
        self._rms(h, self.norm)
        return self.head(self.xn, self.pxn)

    def __call__(self, tokens: Sequence[int], caches: Sequence[HostKVCache]) -> np.ndarray:
        """``(T, V)`` float32 logits of each token fed in turn."""
        out = np.empty((len(tokens), self.vocab), np.float32)
        for i, t in enumerate(tokens):
            out[i] = self.step(int(t), caches)
        return out


def host_support(module: nn.Module) -> Optional[str]:
    """Why :class:`HostForward` cannot run ``module``, or None when it can.

    It runs on the CPU device with the C kernels built, mlx-lm's llama and qwen2 models
    (full attention, plain RoPE, float32 norms) whose linears are all packed
    int4/int8 or float32, embedding included. The reason names the first
    condition that fails, for the user (``--speculative`` prints it).
    """
    if mx.default_device() != mx.cpu:
        return f"the device is {mx.default_device()}: the host step runs on the CPU only"
    group = group_of(module)
    if group is not None:
        return f"the model is sharded over {group.size()} ranks: the host step computes whole layers in one process"
    if cpu_backend() is None:
        return "the C kernels are not built (pip install -e . builds them)"
    if not cpu_kernels_trusted():  # the host step calls the C GEMV without a layer's first-use check
        return "the C kernels failed their first-use check (python -m gearbx_mlx.selftest says more)"
    nested = any(isinstance(m, (NestedLinear, NestedEmbedding)) for _, m in module.named_modules())
    if nested and not nested_kernels_trusted():
        return "the C nested kernels failed their first-use check (python -m gearbx_mlx.selftest says more)"
    kind = type(module).__module__
    if kind not in HOST_ARCHITECTURES:
        return f"the model is {kind.rsplit('.', 1)[-1]!r}: the host step covers mlx-lm's llama and qwen2 only"
    inner, a = getattr(module, "model", None), getattr(module, "args", None)
    if inner is None or a is None or not getattr(inner, "layers", None):
        return "the model has no llama layer stack (model.layers) or args"
    if a.num_attention_heads % a.num_key_value_heads:
        return "the attention heads are not a multiple of the key/value heads"
    emb = inner.embed_tokens
    if isinstance(emb, NestedEmbedding):
        if not _supported_linear(emb):
            return "the nested embedding's planes are not all 4- or 8-bit (the C kernels' widths)"
    elif isinstance(emb, PackedEmbedding):
        if emb.bits not in (4, 8) or emb.lookup_dtype != mx.float32:
            return f"the packed embedding is {emb.bits}-bit or not float32"
    elif type(emb) is not nn.Embedding or emb.weight.dtype != mx.float32:
        return "the embedding is neither packed nor a float32 table"
    if not a.tie_word_embeddings and not _supported_linear(getattr(module, "lm_head", None)):
        return "the output head is neither packed int4/int8 nor float32"
    if inner.norm.weight.dtype != mx.float32:
        return f"the norms are {inner.norm.weight.dtype}, not float32 (load with --dtype float32)"
    for layer in inner.layers:
        at, mlp = layer.self_attn, layer.mlp
        if getattr(layer, "use_sliding", False) or type(at.rope) is not nn.RoPE or at.rope.traditional:
            return "a layer uses sliding-window attention or a RoPE other than plain nn.RoPE"
        if at.rope.dims % 2 or at.rope.dims > (getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads):
            return "a layer's RoPE dimensions are odd or exceed the head dimension"
        if not all(_supported_linear(m) for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj,
                                                  mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "a layer's linears are neither packed int4/int8 nor float32 (load with --dtype float32)"
        if any(n.weight.dtype != mx.float32 for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return "a layer's norms are not float32 (load with --dtype float32)"
    return None


def host_forward(module: nn.Module) -> Optional[HostForward]:
    """A :class:`HostForward` of ``module``, or None where it does not apply (:func:`host_support`)."""
    if host_support(module) is not None:
        return None
    return HostForward(module, cpu_kernels.require())


__all__ = ["HOST_PREFILL_MAX", "HostForward", "HostKVCache", "host_forward", "host_support"]
