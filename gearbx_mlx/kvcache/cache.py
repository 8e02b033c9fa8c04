"""mlx-lm KV caches that subtract a per-channel key offset before storing.

Why the offset needs no add-back: every query meets every stored key through
``q·k``; storing ``k - μ`` instead turns each score into ``q·k - q·μ``, and
``q·μ`` is the same for all keys of that query, so the softmax over keys is
unchanged, exactly, whatever RoPE did to ``k`` (``μ`` is subtracted after
RoPE and is the same vector at every position). The mask is additive per
position, so it commutes too. What changes is what the quantizer sees: on
Qwen2.5 the ``k_proj`` biases put offsets of up to ~200 on a few channels of
keys whose spread is ~1 (measured on the Lee corpus), and every 4-bit group
spends its 16 levels on that offset.

Both classes keep mlx-lm's storage, masks, trimming and ``bits``/
``group_size`` attributes, so ``scaled_dot_product_attention`` in
``mlx_lm/models/base.py`` takes its quantized path for
:class:`RotatedQuantizedKVCache` and its float path for :class:`RotatedKVCache`
(used before ``quantized_kv_start``; mlx-lm's ``maybe_quantize_kv_cache``
converts it through :meth:`RotatedKVCache.to_quantized`).

Prompt-cache files: mlx-lm's ``load_prompt_cache`` finds cache classes by
name in its own module, so files holding these caches are read with
:func:`load_prompt_cache` here (it knows both names and defers to mlx-lm for
the rest); mlx-lm's ``save_prompt_cache`` writes them unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.models import cache as mlc

from .quantize import QUANTIZERS, attention_reads, check_bits_group, contiguous_reads, offset_keys, quantize
from .write_kernel import write as write_step


class RotatedQuantizedKVCache(mlc.QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` with a key offset and a choice of quantizer.

    Args:
        group_size, bits: as mlx-lm's (the attention reads them).
        key_offset: ``(n_kv_heads, head_dim)`` subtracted from every key, or None.
        quantizer: ``"minmax"`` (``mx.quantize``) or ``"ls"`` (least-squares
            scales, :func:`gearbx_mlx.kvcache.quantize.quantize_ls`).
        tag: names the transform whose basis the stored keys and values are in
            (:attr:`gearbx_mlx.kvcache.KVHandle.tag`); saved with the cache so
            that a prompt cache is never reused under another transform.

    Attributes:
        use_kernel: how a write runs (:func:`gearbx_mlx.kvcache.write_kernel.write`):
            None, the fused kernel on a GPU where it applies and MLX ops
            elsewhere; False, always the MLX ops (the benchmarks' baseline).
    """

    use_kernel: Optional[bool] = None

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 4,
        key_offset: Optional[mx.array] = None,
        quantizer: str = "minmax",
        tag: str = "",
    ) -> None:
        check_bits_group(bits, group_size)
        if quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
        super().__init__(group_size=group_size, bits=bits)
        self.key_offset = key_offset
        self.quantizer = quantizer
        self.tag = tag

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[Any, Any]:
        # mlx-lm's growth and write logic, with this package's write step in
        # place of mx.quantize (same format, so the same attention reads it).
        B, n_kv_heads, num_steps, k_head_dim = keys.shape
        v_head_dim = values.shape[-1]
        prev = self.offset
        if self.keys is None or (prev + num_steps) > self.keys[0].shape[-2]:
            new_steps = (self.step + num_steps - 1) // self.step * self.step
            shape = (B, n_kv_heads, new_steps)

            def init_quant(dim: int) -> Tuple[mx.array, mx.array, mx.array]:
                return (  # bits*dim/32 words: 3/5/6-bit codes straddle words
                    mx.zeros((*shape, dim * self.bits // 32), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                )

            def expand_quant(x: mx.array) -> mx.array:
                new_x = mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)
                return mx.concatenate([x, new_x], axis=-2)

            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = tree_map(expand_quant, (self.keys, self.values))
            else:
                self.keys, self.values = init_quant(k_head_dim), init_quant(v_head_dim)
        self.offset += num_steps
        qk, qv = write_step(keys, values, self.key_offset, self.group_size, self.bits, self.quantizer,
                            use_kernel=self.use_kernel)
        for i in range(len(self.keys)):
            self.keys[i][..., prev : self.offset, :] = qk[i]
            self.values[i][..., prev : self.offset, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> Tuple[Any, Any]:
        """The stored tokens, as slices of the buffers, or contiguous copies
        where the backend's quantized attention takes nothing else
        (:func:`~gearbx_mlx.kvcache.quantize.attention_reads`)."""
        kv = super().keys_and_values()
        head_dim = self.keys[0].shape[-1] * 32 // self.bits
        if attention_reads(self.bits, self.group_size, head_dim, self.keys[1].dtype) == "copies":
            return contiguous_reads(kv)
        return kv

    @property
    def state(self) -> Tuple[Any, ...]:
        off = self.key_offset if self.key_offset is not None else mx.zeros((0,))
        return (*super().state, off, self.quantizer, self.tag)

    @state.setter
    def state(self, v: Tuple[Any, ...]) -> None:
        *base, off, quantizer, tag = v
        mlc.QuantizedKVCache.state.fset(self, tuple(base))
        self.key_offset = off if isinstance(off, mx.array) and off.size else None
        self.quantizer = quantizer if isinstance(quantizer, str) else "minmax"
        self.tag = tag if isinstance(tag, str) else ""


class RotatedKVCache(mlc.KVCache):
    """mlx-lm's float ``KVCache`` with a key offset; quantizes into the class above.

    Args:
        key_offset: as :class:`RotatedQuantizedKVCache`.
        group_size, bits, quantizer: what :meth:`to_quantized` converts to. They
            win over the arguments mlx-lm passes, which it takes from its own
            ``--kv-bits``/``--kv-group-size`` for every layer alike, while this
            cache may belong to a layer given other bits.
        tag: as :class:`RotatedQuantizedKVCache`.
    """

    def __init__(
        self,
        key_offset: Optional[mx.array] = None,
        group_size: int = 64,
        bits: int = 4,
        quantizer: str = "minmax",
        tag: str = "",
    ) -> None:
        check_bits_group(bits, group_size)
        super().__init__()
        self.key_offset = key_offset
        self.target = (group_size, bits, quantizer)
        self.tag = tag

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        return super().update_and_fetch(offset_keys(keys, self.key_offset), values)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> RotatedQuantizedKVCache:
        g, b, method = self.target
        out = RotatedQuantizedKVCache(g, b, self.key_offset, method, self.tag)
        out.offset = self.offset
        if self.keys is not None:
            # The stored keys already have the offset removed.
            out.keys = quantize(self.keys, g, b, method)
            out.values = quantize(self.values, g, b, method)
        return out

    @property
    def state(self) -> Tuple[Any, ...]:
        off = self.key_offset if self.key_offset is not None else mx.zeros((0,))
        g, b, method = self.target
        return (*super().state, off, g, b, method, self.tag)

    @state.setter
    def state(self, v: Tuple[Any, ...]) -> None:
        *base, off, g, b, method, tag = v
        mlc.KVCache.state.fset(self, tuple(base))
        self.key_offset = off if isinstance(off, mx.array) and off.size else None
        self.target = (int(g), int(b), str(method))
        self.tag = tag if isinstance(tag, str) else ""


CACHE_CLASSES: Dict[str, type] = {
    "RotatedQuantizedKVCache": RotatedQuantizedKVCache,
    "RotatedKVCache": RotatedKVCache,
}


def load_prompt_cache(file_name: str, return_metadata: bool = False) -> Any:
    """mlx-lm's ``load_prompt_cache``, also for files holding the caches above.

    Mirrors ``mlx_lm.models.cache.load_prompt_cache`` (0.32), whose class
    lookup is limited to its own module.
    """
    arrays, cache_metadata = mx.load(file_name, return_metadata=True)
    cache_metadata = tree_unflatten(list(cache_metadata.items()))
    metadata, classes, scalars = cache_metadata
    for pos, kind in scalars[1:]:
        array = arrays[pos]
        if kind == "scalar":
            arrays[pos] = array.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"{file_name}: unknown prompt-cache entry type {kind!r}")
    arrays = tree_unflatten(list(arrays.items()))
    out: List[Any] = []
    for name, state in zip(classes, arrays):
        cls = CACHE_CLASSES.get(name) or getattr(mlc, name, None)
        if cls is None:
            raise ValueError(f"{file_name}: unknown KV cache class {name!r}")
        out.append(cls.from_state(state))
    return (out, metadata) if return_metadata else out
