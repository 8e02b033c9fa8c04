"""One-token block steps in two compiled calls: a decode step of few host calls per block.

On a fast GPU a one-token decode step is bound by the host: every operation
of every block is a graph node that the host builds and the back end encodes,
and a custom kernel's node costs more than MLX's own
(``docs/BENCHMARKS.md``, the GPU gears). :func:`compile_block_steps` gives
each supported block of a model (mlx-lm's llama and qwen2 blocks, which
mistral and SmolLM2 use) a one-token step of two ``mx.compile``d calls around
the attention, whose KV cache grows every step and stays outside: the norm and
the q/k/v products (reshaped into heads) before it; the output product,
residual, norm, MLP and residual after it.

A compiled call captures the arrays of the modules it traced, so the pair is
kept per set of the block's seven projection modules (a gear's): a gear shift
finds its own pair, built on that gear's second one-token call. The first
call with a new set runs the block as it is, so every kernel's first-use
check (:mod:`gearbx_mlx.bindings.guard`), which evaluates, runs outside a
trace. A block keeps at most :data:`MAX_STEPS` pairs (and their modules, so
that an ``id`` is never reused while it is a key). Prompts and verifies
(several tokens), and calls without a cache, run the block itself.

The module tree does not change: a block's class becomes a subclass with
this step (:func:`restore_block_steps` undoes it), so the paths a gearbox
swaps modules under stay the same. Whatever the blocks call must trace: MLX
operations and GPU kernels, not the C kernels of the CPU, which evaluate
their input (the precision manager compiles steps on a GPU only).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

#: The blocks whose step this module knows (mlx-lm module, block and attention class).
SUPPORTED: Tuple[Tuple[str, str, str], ...] = (
    ("mlx_lm.models.llama", "TransformerBlock", "Attention"),
    ("mlx_lm.models.qwen2", "TransformerBlock", "Attention"),
)
#: The projections whose modules key a compiled pair: (child, name).
PROJECTIONS: Tuple[Tuple[str, str], ...] = (
    ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
    ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
)
#: Compiled pairs a block keeps (a gearbox has three gears and a drafter's).
MAX_STEPS = 4
_STEPS = "_gbx_block_steps"
_SUBCLASSES: Dict[type, type] = {}


def supported(block: nn.Module) -> bool:
    """True if ``block`` is one of :data:`SUPPORTED`, with its classes' own calls and every projection."""
    cls, attn = type(block), block.get("self_attn") if isinstance(block, dict) else None
    for module, block_name, attn_name in SUPPORTED:
        mod = sys.modules.get(module)
        if mod is None or cls is not getattr(mod, block_name, None):
            continue
        if type(attn) is not getattr(mod, attn_name, None):
            return False  # another attention (a KV transform's, say): its calls are its own
        return all(child in block and name in block[child] for child, name in PROJECTIONS)
    return False


class _Step:
    """The two compiled calls of one block with one set of projection modules."""

    def __init__(self, block: nn.Module, modules: Tuple[nn.Module, ...]) -> None:
        self.modules = modules  # held: their ids are the key
        attn, mlp = block["self_attn"], block["mlp"]
        norm_in, norm_post = block["input_layernorm"], block["post_attention_layernorm"]
        n_heads, n_kv = attn.n_heads, attn.n_kv_heads

        def pre(x: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
            B, L, _ = x.shape
            h = norm_in(x)
            q, k, v = attn["q_proj"](h), attn["k_proj"](h), attn["v_proj"](h)
            return (q.reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3),
                    k.reshape(B, L, n_kv, -1).transpose(0, 2, 1, 3),
                    v.reshape(B, L, n_kv, -1).transpose(0, 2, 1, 3))

        def post(x: mx.array, o: mx.array) -> mx.array:
            B, L, _ = x.shape
            h = x + attn["o_proj"](o.transpose(0, 2, 1, 3).reshape(B, L, -1))
            return h + mlp(norm_post(h))

        self.pre: Callable[[mx.array], Tuple[mx.array, mx.array, mx.array]] = mx.compile(pre)
        self.post: Callable[[mx.array, mx.array], mx.array] = mx.compile(post)
        # The model module's own attention function (whatever it is bound to there).
        self.sdpa = sys.modules[type(attn).__module__].scaled_dot_product_attention


class CompiledStep:
    """Mixin of a supported block's class: the one-token step through :class:`_Step`."""

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        if cache is None or x.shape[1] != 1:
            return super().__call__(x, mask, cache)
        modules = tuple(self[child][name] for child, name in PROJECTIONS)
        key = tuple(map(id, modules))
        steps = self.__dict__[_STEPS]
        step = steps.get(key)
        if step is None:  # first call with these modules: the block itself, first-use checks outside a trace
            steps[key] = False
            while len(steps) > MAX_STEPS:
                steps.pop(next(iter(steps)))
            return super().__call__(x, mask, cache)
        if step is False:
            step = steps[key] = _Step(self, modules)
        attn = self["self_attn"]
        q, k, v = step.pre(x)
        q, k = attn.rope(q, offset=cache.offset), attn.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        o = step.sdpa(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        return step.post(x, o)


def _compiled_class(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(f"Compiled{cls.__name__}", (CompiledStep, cls), {"_gbx_block_base": cls})
    return sub


def blocks_of(model: nn.Module) -> list:
    """The model's transformer blocks (``model.layers``, as mlx-lm's models expose them), or []."""
    try:
        layers = model.layers
    except AttributeError:
        return []
    return list(layers) if isinstance(layers, (list, tuple)) else []


def compile_block_steps(model: nn.Module) -> int:
    """Give every :func:`supported` block of ``model`` the compiled one-token step; how many took it."""
    n = 0
    for block in blocks_of(model):
        if isinstance(block, CompiledStep):
            n += 1
        elif supported(block):
            block.__class__ = _compiled_class(type(block))
            block.__dict__[_STEPS] = {}
            n += 1
    return n


def restore_block_steps(model: nn.Module) -> None:
    """Undo :func:`compile_block_steps` (blocks get their own class back, compiled pairs dropped)."""
    for block in blocks_of(model):
        base = getattr(type(block), "_gbx_block_base", None)
        if base is not None:
            block.__class__ = base
            block.__dict__.pop(_STEPS, None)


__all__ = ["CompiledStep", "MAX_STEPS", "PROJECTIONS", "SUPPORTED", "blocks_of", "compile_block_steps",
           "restore_block_steps", "supported"]
