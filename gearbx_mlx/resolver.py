"""Decide once where the gears live and which kernels run them, and record why.

A gearbox's store (nested planes or separate copies), its kernel (MLX's
``QuantizedLinear`` and pure-MLX paths, or the package's own kernels: C on the
CPU, Metal or CUDA on a GPU) and the layers it manages depend on the config,
the model and the machine. :func:`resolve` makes each of these choices from
one place and returns a :class:`Resolution` that the gearbox keeps, the trace
header records and the summary prints; nothing downstream guesses again.

``kernel="packed"`` means the same for both stores: the package's kernels (the
packed int4/int8 layers of the separate store, the fused plane kernels of the
nested store), each guarded by its first-call check against the pure-MLX
reference. ``kernel="auto"`` (the default) takes them where they are built and
checked to pay: the C kernels on the CPU, and the nested store's fused GPU
kernel on a GPU (its low gear, plane 0, is MLX's 4-bit layer and calls MLX's
``quantized_matmul`` there: :func:`gearbx_mlx.nested.matmul.low_gear_through_mlx`);
MLX's own elsewhere.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .config import GearboxConfig
from .distributed.layers import QUANTIZED_SHARDED
from .packed.layers import cpu_backend


@dataclass(frozen=True)
class Resolution:
    """What a gearbox runs with, each choice with its reason.

    Attributes:
        source: ``float``, ``quantized-8bit`` (every layer MLX 8-bit affine) or
            ``quantized`` (below 8 bits).
        store, kernel, scope: the resolved settings; why: ``{setting: reason}``.
    """

    source: str
    store: str
    kernel: str
    scope: str
    why: Tuple[Tuple[str, str], ...]

    def as_dict(self) -> Dict[str, Any]:
        return {"source": self.source, "store": self.store, "kernel": self.kernel, "scope": self.scope,
                "why": dict(self.why)}


def resolve(config: GearboxConfig, model: nn.Module, draft_scope: Optional[str] = None) -> Tuple[GearboxConfig,
                                                                                                  Resolution]:
    """``(config with store, kernel and scope resolved, the record of why)``.

    Args:
        draft_scope: the layers a speculative drafter quantizes; with the nested
            store the planes are built over them, so that drafter and gears share one copy.
    """
    source = weights_source(model)
    store, store_why = resolve_store(config, source)
    kernel, kernel_why = _kernel(config, store)
    scope, scope_why = config.scope, "asked for" if config.scope != "attention" else "the specification's default"
    if draft_scope is not None and store == "nested" and draft_scope != config.scope:
        scope, scope_why = draft_scope, "speculative decoding drafts from the planes of the drafter's scope"
    resolved = dataclasses.replace(config, store=store, kernel=kernel, scope=scope)
    return resolved, Resolution(source, store, kernel, scope,
                                (("store", store_why), ("kernel", kernel_why), ("scope", scope_why)))


def is_prequantized(model: nn.Module) -> bool:
    """True if any layer of the model is already quantized."""
    return any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        or type(m).__name__.startswith("Quantized")
        for _, m in model.named_modules()
    )


def weights_source(model: nn.Module) -> str:
    """``float``, ``quantized-8bit`` (every quantized layer MLX 8-bit affine) or ``quantized``."""
    if not is_prequantized(model):
        return "float"
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, *QUANTIZED_SHARDED)
    found = [m for _, m in model.named_modules() if isinstance(m, kinds)]
    eight = bool(found) and all(m.bits == 8 and getattr(m, "mode", "affine") == "affine" for m in found)
    return "quantized-8bit" if eight else "quantized"


def resolve_store(config: GearboxConfig, source: str) -> Tuple[str, str]:
    """``(store, why)`` for weights of ``source`` (see :func:`weights_source`)."""
    if config.store is not None:
        return config.store, "asked for"
    if config.high == "planes":
        return "nested", "the high gear reads the planes"
    if source != "float":
        return "separate", "the weights are already quantized: telemetry only"
    if config.bits != {"low": 4, "mid": 8}:
        return "separate", f"gears of {config.bits['low']} and {config.bits['mid']} bits are not the nested planes"
    return "nested", "float weights: one buffer of planes serves every gear"


def _kernel(config: GearboxConfig, store: str) -> Tuple[str, str]:
    if config.kernel != "auto":
        return config.kernel, "asked for"
    if mx.default_device() != mx.cpu:
        if store == "nested":
            return "packed", ("the nested store's fused GPU kernel for mid and high (its first-call check "
                              "guards it); MLX's quantized_matmul on plane 0 for low")
        return "mlx", "MLX's QuantizedLinear on a GPU"
    with warnings.catch_warnings():  # a missing optional build is no news here
        warnings.simplefilter("ignore")
        built = cpu_backend() is not None
    return ("packed", "the C kernels are built") if built else ("mlx", "the C kernels are not built")


def default_kernel() -> str:
    """The kernel ``kernel="auto"`` resolves to for the nested store on this machine."""
    return _kernel(GearboxConfig(kernel="auto"), "nested")[0]
