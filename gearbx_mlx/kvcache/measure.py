"""Measuring KV caches: quality against the float cache, bytes per token, decode speed.

Shared by ``scripts/eval_kv.py`` and, later, by the routing and speculative
evaluations (their KV column). A cache is named by a :class:`CacheSpec`:

* ``float``: mlx-lm's ``KVCache`` (the reference);
* ``affine-<bits>-g<group>``: mlx-lm's ``QuantizedKVCache`` (``--kv-bits``);
* ``rot-<bits>-g<group>``: rotation alone (no λ, no offset);
* ``kv-<bits>-g<group>``: the package's default recipe (rotation, key offset,
  λ), with a calibration; ``+ls``, ``@weights`` and other suffixes vary it
  (:func:`spec`); ``kv-<bits>`` takes the group generation picks for the
  model when none is given.

Quality is scored like the issue's probe, on longer windows: each window is
fed through a fresh cache in chunks (128 tokens by default), so every chunk
attends to quantized keys and values of all earlier tokens and of itself;
perplexity is ``exp`` of the mean NLL over all scored tokens, KL the mean
over positions of ``KL(float || quantized)`` of the next-token distributions.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .api import apply_kv
from .calibrate import KVCalibration
from .config import KVConfig, plain, rotated_only
from .outliers import DEFAULT_GROUP_SIZE, default_group_size
from .quantize import bits_per_element

MakeCache = Callable[[], List[Any]]


@dataclass(frozen=True)
class CacheSpec:
    """A named cache to measure.

    Attributes:
        name: label in tables.
        kind: ``"float"``, ``"affine"`` (mlx-lm's) or ``"kv"`` (this package's).
        config: the :class:`KVConfig` of ``"kv"`` (and the bits of ``"affine"``).
        calibration: ``"text"`` or ``"weights"`` statistics for ``"kv"``.
        use_kernel: the caches' write (``+ops``: False, MLX ops even where the
            fused write kernel applies; None: the package's choice).
    """

    name: str
    kind: str
    config: Optional[KVConfig] = None
    calibration: str = "text"
    use_kernel: Optional[bool] = None

    @property
    def bits_per_element(self) -> float:
        """Stored bits per element with float16 scales (16 for the float cache)."""
        if self.kind == "float":
            return 16.0
        assert self.config is not None
        return bits_per_element(self.config.bits, self.config.group_size)


def spec(name: str, model: Optional[nn.Module] = None, check_only: bool = False) -> CacheSpec:
    """Parse ``float``, ``affine-4-g64``, ``rot-3-g32``, ``kv-4-g64[+minmax][+mix][+vo][+a0.25][+outliers][+ops][@weights]``.

    ``kv-4`` (no group) takes :func:`~gearbx_mlx.kvcache.outliers.default_group_size`
    of ``model``, as generation does without ``--kv-group-size`` (with
    ``check_only``, the name is only checked and ``model`` not needed).
    """
    if name == "float":
        return CacheSpec(name, "float")
    head, _, source = name.partition("@")
    base, *mods = head.split("+")
    parts = base.split("-")
    if len(parts) == 2 and parts[0] == "kv":
        if model is None and not check_only:
            raise ValueError(f"{name!r} takes the model's default group size: give the model")
        parts.append(f"g{DEFAULT_GROUP_SIZE if model is None else default_group_size(model)}")
    try:
        kind, bits, group = parts
        bits_i, group_i = int(bits), int(group.lstrip("g"))
    except ValueError:
        raise ValueError(f"cannot read cache name {name!r}: expected e.g. affine-4-g64, kv-4-g64 or kv-4") from None
    if kind == "affine":
        return CacheSpec(name, "affine", plain(bits_i, group_i))
    if kind == "rot":
        return CacheSpec(name, "kv", rotated_only(bits_i, group_i))
    if kind != "kv":
        raise ValueError(f"unknown cache kind {kind!r} in {name!r} (float, affine, rot, kv)")
    cfg = KVConfig(bits=bits_i, group_size=group_i)
    use_kernel = None
    for m in mods:
        if m == "ops":
            use_kernel = False
        elif m in ("ls", "minmax"):
            cfg = cfg.replace(quantizer=m)
        elif m == "mix":
            cfg = cfg.replace(key_offset="mix")
        elif m == "nosink":
            cfg = cfg.replace(sink=False)
        elif m == "vo":
            cfg = cfg.replace(value_offset=True)
        elif m == "nolam":
            cfg = cfg.replace(lam_alpha=0.0)
        elif m == "nooff":
            cfg = cfg.replace(key_offset="none")
        elif m.startswith("a"):
            cfg = cfg.replace(lam_alpha=float(m[1:]))
        elif m == "outliers":
            cfg = cfg.replace(outliers="auto")
        elif m in ("srft", "srht", "none"):
            cfg = cfg.replace(rotation=m)
        elif m.startswith("s") and m[1:].isdigit():
            cfg = cfg.replace(seed=int(m[1:]))
        else:
            raise ValueError(f"unknown modifier {m!r} in {name!r}")
    if source not in ("", "text", "weights"):
        raise ValueError(f"unknown calibration source {source!r} in {name!r} (text or weights)")
    return CacheSpec(name, "kv", cfg, source or "text", use_kernel)


@contextmanager
def prepared(model: nn.Module, s: CacheSpec, calibrations: Dict[str, KVCalibration]) -> Iterator[MakeCache]:
    """Yield a cache factory for ``s`` (applying and then restoring the KV transform)."""
    n = len(model.layers)
    if s.kind == "float":
        yield lambda: [KVCache() for _ in range(n)]
        return
    assert s.config is not None
    if s.kind == "affine":
        g, b = s.config.group_size, s.config.bits
        yield lambda: [QuantizedKVCache(group_size=g, bits=b) for _ in range(n)]
        return
    cal = calibrations.get(s.calibration) if s.config.needs_statistics else None
    if s.config.needs_statistics and cal is None:
        raise ValueError(f"{s.name} needs a {s.calibration} calibration")
    handle = apply_kv(model, s.config, cal)

    def make_cache() -> List[Any]:
        caches = handle.make_cache()
        for c in caches:
            c.use_kernel = s.use_kernel
        return caches

    try:
        yield make_cache
    finally:
        handle.restore()


class Dequantized(KVCache):
    """A quantized cache read through mlx-lm's float attention: same codes, faster on a CPU.

    ``inner`` (a ``QuantizedKVCache`` or :class:`~.cache.RotatedQuantizedKVCache`)
    stores every key and value exactly as it would in generation; this
    wrapper hands attention their dequantized values instead of the codes,
    so ``scaled_dot_product_attention`` takes its float path. The scores
    differ from mlx-lm's quantized attention by float32 rounding only
    (``eval_kv.py quality`` reports both on a short window), while MLX's CPU
    ``quantized_matmul`` over a long cache is several times slower.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    @property
    def offset(self) -> int:  # type: ignore[override]
        return self.inner.offset

    @offset.setter
    def offset(self, v: int) -> None:
        if hasattr(self, "inner"):
            self.inner.offset = v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        qk, qv = self.inner.update_and_fetch(keys, values)
        g, b = self.inner.group_size, self.inner.bits
        return (mx.dequantize(*qk, group_size=g, bits=b).astype(keys.dtype),
                mx.dequantize(*qv, group_size=g, bits=b).astype(values.dtype))

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def dequantized(make_cache: MakeCache) -> MakeCache:
    """``make_cache`` with each quantized layer cache wrapped in :class:`Dequantized`."""
    return lambda: [Dequantized(c) if hasattr(c, "bits") else c for c in make_cache()]


def chunked_logprobs(model: nn.Module, ids: Sequence[int], make_cache: MakeCache, chunk: int = 128) -> mx.array:
    """Next-token log-probabilities ``(len(ids) - 1, V)`` float32, fed in chunks."""
    if len(ids) < 2:
        raise ValueError("need at least 2 tokens")
    cache = make_cache()
    x = mx.array(list(ids))[None]
    out = []
    for i in range(0, len(ids) - 1, chunk):
        lg = model(x[:, i : min(i + chunk, len(ids) - 1)], cache=cache)[0].astype(mx.float32)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out, axis=0)


@dataclass
class Quality:
    """Perplexity and KL to the float cache over some windows."""

    perplexity: float
    kl: float
    nll: float
    tokens: int
    per_window: List[Dict[str, float]] = field(default_factory=list)


def score(windows: Sequence[Sequence[int]], logprobs: Sequence[mx.array],
          reference: Optional[Sequence[mx.array]] = None) -> Quality:
    """Perplexity (and KL to ``reference``) of per-window log-probabilities."""
    nll_sum, kl_sum, n = 0.0, 0.0, 0
    rows = []
    for i, (ids, lp) in enumerate(zip(windows, logprobs)):
        tgt = mx.array(list(ids[1:]))
        nll = -mx.take_along_axis(lp, tgt[:, None], axis=-1).sum().item()
        kl = 0.0
        if reference is not None:
            ref = reference[i]
            kl = (mx.exp(ref) * (ref - lp)).sum(axis=-1).sum().item()
        m = len(ids) - 1
        rows.append({"perplexity": math.exp(nll / m), "kl": kl / m})
        nll_sum, kl_sum, n = nll_sum + nll, kl_sum + kl, n + m
    return Quality(math.exp(nll_sum / n), kl_sum / n, nll_sum / n, n, rows)


def cache_nbytes_per_token(make_cache: MakeCache, n_kv_heads: Sequence[int], head_dim: Sequence[int],
                           tokens: int, dtype: Any = mx.float16, chunk: int = 512) -> float:
    """Bytes the caches hold per token after ``tokens`` random keys and values.

    Measured from the arrays (mlx-lm's ``nbytes``: codes, scales, biases and
    the unused tail of the last 256-token block; pick ``tokens`` a multiple of
    256 for the steady state). Layers alike in head count, size, bits and
    group are filled once and counted for all of them.
    """
    caches = make_cache()
    measured: Dict[tuple, int] = {}
    total = 0
    for c, h, d in zip(caches, n_kv_heads, head_dim):
        key = (type(c).__name__, h, d, getattr(c, "bits", None), getattr(c, "group_size", None))
        if key not in measured:
            done = 0
            while done < tokens:
                n = min(chunk, tokens - done)
                k = mx.random.normal((1, h, n, d)).astype(dtype)
                v = mx.random.normal((1, h, n, d)).astype(dtype)
                c.update_and_fetch(k, v)
                done += n
                mx.eval(c.keys, c.values)
            measured[key] = c.nbytes
        total += measured[key]
    return total / tokens


def decode_speed(model: nn.Module, make_cache: MakeCache, context: int, steps: int = 32,
                 prefill_chunk: int = 512, seed: int = 0) -> Dict[str, float]:
    """Greedy decode tokens/s after ``context`` random prompt tokens.

    The prompt is prefilled in chunks (not timed); then ``steps`` single-token
    forward passes, each evaluated before the next, are timed (the median
    step and the mean rate). Token ids are random: speed does not depend on
    them.
    """
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 1000)
    mx.random.seed(seed)
    prompt = mx.random.randint(0, vocab, (context,))
    cache = make_cache()
    for i in range(0, context, prefill_chunk):
        model(prompt[None, i : i + prefill_chunk], cache=cache)
        mx.eval([c.state for c in cache])
    y = prompt[-1:]
    times = []
    for _ in range(steps + 2):
        tic = time.perf_counter()
        logits = model(y[None], cache=cache)
        y = mx.argmax(logits[0, -1:], axis=-1)
        mx.eval(y)
        times.append(time.perf_counter() - tic)
    times = times[2:]  # the first steps build and warm the graph
    times_sorted = sorted(times)
    return {
        "context": context,
        "steps": steps,
        "tokens_per_s": steps / sum(times),
        "median_step_ms": 1e3 * times_sorted[len(times) // 2],
        "best_step_ms": 1e3 * times_sorted[0],
    }
