"""The precision manager: discovery, lazy quantization, gear cache, swaps (§6).

A gear shift is one ``model.update_modules`` call driven by a plan
``{module path: module}``. The high gear re-installs the very module objects
that were loaded, so its logits are bit-identical to the unmodified model.

Memory, truthfully: MLX on Apple Silicon has one unified memory pool, and on
the Linux CPU backend there is no device pool at all. The loaded originals are
kept referenced (the high gear needs them), so they stay resident; each gear
that was entered also keeps its quantized modules resident in the cache.
:meth:`PrecisionManager.memory` reports exactly that, not an offload.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .config import GEARS, GearboxConfig, bits_for
from .packed.fused import fuse_modules
from .packed.layers import PackedEmbedding, PackedLinear, cpu_backend

#: Path components (lower-cased, underscores removed) that mark attention (§6.1).
ATTENTION_NAMES = ("selfattn", "attention", "attn", "selfattention")

_NUM = re.compile(r"(\d+)")


def _natural_key(path: str) -> Tuple:
    """Sort ``layers.10`` after ``layers.9`` (§6.1 step 4)."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(path))


def _is_attention(path: str) -> bool:
    parts = [p.lower().replace("_", "") for p in path.split(".")]
    return any(any(a in p for a in ATTENTION_NAMES) for p in parts[:-1])


def nbytes(module: nn.Module) -> int:
    """Bytes of every array a module holds."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def is_prequantized(model: nn.Module) -> bool:
    """True if any layer of the model is already quantized."""
    return any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        or type(m).__name__.startswith("Quantized")
        for _, m in model.named_modules()
    )


def _output_is_tied(model: nn.Module) -> bool:
    """True if the model projects to the vocabulary through its embedding.

    The config says so where it can (``args.tie_word_embeddings``); otherwise
    a model with no output head module (``lm_head``/``output``) is tied.
    """
    tie = getattr(getattr(model, "args", None), "tie_word_embeddings", None)
    if isinstance(tie, bool):
        return tie
    heads = ("lm_head", "output", "embed_out")
    return not any(
        isinstance(m, nn.Linear) and path.rsplit(".", 1)[-1] in heads
        for path, m in model.named_modules()
    )


def discover(
    model: nn.Module, scope: str, group_size: int
) -> Tuple[List[str], List[str]]:
    """Paths of the modules to manage, and of those skipped (and why).

    ``attention``: every ``nn.Linear`` inside an attention container (§6.1).
    ``all``: every ``nn.Linear``, plus the embedding of a tied-embedding model
    (its ``as_linear`` is the output projection, the largest matrix of a
    small model). Layers whose input size is not a multiple of the group size
    cannot be quantized by MLX and stay in full precision.
    """
    managed, skipped = [], []
    tied = scope == "all" and _output_is_tied(model)
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear):
            if scope == "attention" and not _is_attention(path):
                continue
        elif isinstance(m, nn.Embedding) and tied:
            pass
        else:
            continue
        if m.weight.shape[-1] % group_size:
            skipped.append(f"{path} (input size {m.weight.shape[-1]} not a multiple of {group_size})")
            continue
        managed.append(path)
    return sorted(managed, key=_natural_key), skipped


@dataclass
class ShiftRecord:
    """One gear shift: from, to, and what it cost."""

    source: str
    target: str
    seconds: float  # wall time of the whole shift (quantization included)
    quantize_seconds: float  # 0 on a cached re-entry
    first_entry: bool


Quantizer = Callable[[nn.Module, int, int], nn.Module]


def mlx_quantizer(module: nn.Module, bits: int, group_size: int) -> nn.Module:
    """MLX's own quantized layers (``QuantizedLinear`` / ``QuantizedEmbedding``)."""
    if isinstance(module, nn.Embedding):
        return nn.QuantizedEmbedding.from_embedding(module, group_size, bits)
    return nn.QuantizedLinear.from_linear(module, group_size, bits)


def packed_quantizer(module: nn.Module, bits: int, group_size: int) -> nn.Module:
    """Our packed int4/int8 layers (``PackedLinear`` / ``PackedEmbedding``)."""
    if isinstance(module, nn.Embedding):
        return PackedEmbedding.from_embedding(module, bits, group_size)
    return PackedLinear.from_linear(module, bits, group_size)


def default_kernel() -> str:
    """The CLI's kernel when ``--kernel`` is not given: the fastest one available.

    "packed" on the CPU device when the C kernels are built (they decode
    several times faster than MLX's quantized CPU kernels, and the
    speculative drafter's host step needs them); "mlx" elsewhere (on a GPU
    neither is reliably faster, and Metal speed is unmeasured).
    """
    if mx.default_device() != mx.cpu:
        return "mlx"
    with warnings.catch_warnings():  # a missing optional build is no news here
        warnings.simplefilter("ignore")
        return "packed" if cpu_backend() is not None else "mlx"


class PrecisionManager:
    """Swaps managed modules of a live model between gears.

    Args:
        model: an mlx-lm model (any ``nn.Module`` tree).
        config: scope, bits per gear, group size, kernel, telemetry-only.
    """

    def __init__(self, model: nn.Module, config: Optional[GearboxConfig] = None) -> None:
        self.model = model
        self.config = config or GearboxConfig()
        self.telemetry_only = self.config.telemetry_only or is_prequantized(model)
        if self.telemetry_only:
            self.paths, self.skipped = [], []
        else:
            self.paths, self.skipped = discover(model, self.config.scope, self.config.group_size)
        modules = dict(model.named_modules())
        # The very objects that were loaded: the high gear restores these.
        self.originals: Dict[str, nn.Module] = {p: modules[p] for p in self.paths}
        self.cache: Dict[str, Dict[str, nn.Module]] = {"high": self.originals}
        self.gear = "high"
        # Swap seconds (quantization excluded) of every entry into each gear.
        self.swaps: Dict[str, List[float]] = {g: [] for g in GEARS}
        self.quantize_seconds: Dict[str, float] = {}
        self.history: List[ShiftRecord] = []
        self._quantizer: Quantizer = (
            packed_quantizer if self.config.kernel == "packed" else mlx_quantizer
        )

    # -- quantization -------------------------------------------------------
    def prepare(self, gear: str) -> float:
        """Quantize ``gear``'s modules if not yet cached; return seconds spent."""
        bits = bits_for(gear, self.config)
        if gear in self.cache or self.telemetry_only:
            return 0.0
        tic = time.perf_counter()
        built = {
            p: self._quantizer(m, bits, self.config.group_size) for p, m in self.originals.items()
        }
        mx.eval([m.parameters() for m in built.values()])
        if self.config.kernel == "packed":
            # q/k/v and gate/up in one GPU launch each (a no-op where they
            # cannot fuse; on the CPU each member computes its own rows).

            built = fuse_modules(built)
        dt = time.perf_counter() - tic
        self.cache[gear] = built
        self.quantize_seconds[gear] = dt
        return dt

    # -- shifting -----------------------------------------------------------
    def shift(self, gear: str) -> Optional[ShiftRecord]:
        """Install ``gear``'s modules; None if already there (idempotent)."""
        bits_for(gear, self.config)  # validates the name
        if gear == self.gear:
            return None
        tic = time.perf_counter()
        first = gear not in self.cache and not self.telemetry_only
        q_dt = self.prepare(gear) if first else 0.0
        if not self.telemetry_only and self.paths:
            self.model.update_modules(tree_unflatten(list(self.cache[gear].items())))
        dt = time.perf_counter() - tic
        record = ShiftRecord(self.gear, gear, dt, q_dt, first)
        self.swaps[gear].append(dt - q_dt)
        self.gear = gear
        self.history.append(record)
        return record

    # -- reporting ----------------------------------------------------------
    def installed(self) -> Dict[str, nn.Module]:
        """The modules now in the tree at the managed paths."""
        modules = dict(self.model.named_modules())
        return {p: modules[p] for p in self.paths}

    def memory(self) -> Dict[str, int]:
        """Resident bytes: originals, each cached gear, what the tree uses now.

        ``resident_total`` counts every managed array that is referenced
        (originals plus every built gear): on unified memory nothing is
        offloaded, so this is what the managed layers hold.
        """
        out = {f"{g}_bytes": sum(nbytes(m) for m in mods.values()) for g, mods in self.cache.items()}
        out["active_bytes"] = out.get(f"{self.gear}_bytes", 0)
        out["resident_total"] = sum(v for k, v in out.items() if k.endswith("_bytes") and k != "active_bytes")
        return out

    def managed_parameters(self) -> int:
        """Number of weight elements in the managed modules (for §9 cost model)."""
        return sum(m.weight.size for m in self.originals.values())

    def entries(self) -> Dict[str, Dict[str, object]]:
        """Per gear: one-time quantization seconds, entries, median swap seconds."""
        out = {}
        for g, swaps in self.swaps.items():
            ordered = sorted(swaps)
            out[g] = {
                "quantize_seconds": self.quantize_seconds.get(g),
                "entries": len(ordered),
                "swap_median_seconds": ordered[len(ordered) // 2] if ordered else None,
            }
        return out

    def summary(self) -> Dict[str, object]:
        return {
            "gear": self.gear,
            "managed_modules": len(self.paths),
            "skipped_modules": self.skipped,
            "telemetry_only": self.telemetry_only,
            "shifts": len(self.history),
            "quantize_seconds": dict(self.quantize_seconds),
            "swap_seconds": sum(r.seconds - r.quantize_seconds for r in self.history),
            "entries": self.entries(),
            "memory": self.memory(),
        }
