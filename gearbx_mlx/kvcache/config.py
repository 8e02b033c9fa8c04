"""Settings of the rotated KV cache, with their defaults and validation (once, here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .quantize import QUANTIZERS, SUPPORTED_BITS, check_bits_group
from .rotation import ROTATIONS

#: What the key offset μ is: the plain mean of the calibration keys, or the
#: halfway point between it and the attention-weighted mean (nearer the keys
#: that attention actually reads, e.g. the first token's).
KEY_OFFSETS = ("none", "mean", "mix")
#: Per-layer precision for layers whose keys carry outlying offsets.
OUTLIER_POLICIES = ("none", "auto")


@dataclass(frozen=True)
class KVConfig:
    """How the KV cache is transformed and quantized.

    Attributes:
        bits: cache bits for every layer (MLX affine: 2, 3, 4, 5, 6 or 8).
        group_size: elements per quantization group along the head (MLX's ``GROUP_SIZES``).
        rotation: ``"srht"`` (random-sign Hadamard), ``"srft"`` (random-sign
            real FFT, any head size), ``"none"``, or ``"auto"`` (srht where
            ``mx.hadamard_transform`` takes the head size, else srft).
        seed: draws every layer's sign vectors.
        lam_alpha: strength of the per-channel scale λ between keys and
            queries: λ = (E[q²]/E[k²])^(alpha/2) per RoPE pair; 0 turns it off.
        key_offset: see :data:`KEY_OFFSETS`.
        value_offset: remove the values' mean (added back before ``o_proj``).
            Off by default: the first token's value is often near zero and
            carries most of the attention, and shifting it costs precision
            there (measured: worse on both models).
        sink: map the calibrated attention-sink key onto the direction each
            quantization group stores for free (:mod:`gearbx_mlx.kvcache.sink`).
        quantizer: ``"ls"`` (least-squares scales, the default) or
            ``"minmax"`` (MLX's own). Same format; on the default model's
            2,048-token window ls took the 4-bit g64 recipe from +2.06% to
            +1.44% perplexity over the float cache (scripts/eval_kv.py).
        quantized_kv_start: keep the float cache until this many tokens
            (mlx-lm's ``--quantized-kv-start``), then quantize.
        layer_bits: per-layer bits overriding ``bits`` (``{layer: bits}``).
        outliers: ``"auto"`` gives :attr:`outlier_bits` to the layers whose
            ``k_proj`` biases dwarf their keys' spread (detected from the
            weights, :func:`gearbx_mlx.kvcache.outliers.outlier_layers`).
        outlier_bits: bits of such layers.
        fold: fold the per-channel scale and the value rotation into float
            q/k/v/o projections once (no work per token, a copy of those
            weights held while applied); False applies them to activations.
    """

    bits: int = 4
    group_size: int = 64
    rotation: str = "auto"
    seed: int = 0
    lam_alpha: float = 0.5
    key_offset: str = "mean"
    value_offset: bool = False
    sink: bool = True
    quantizer: str = "ls"
    quantized_kv_start: int = 0
    layer_bits: Dict[int, int] = field(default_factory=dict)
    outliers: str = "none"
    outlier_bits: int = 8
    fold: bool = True

    def __post_init__(self) -> None:
        check_bits_group(self.bits, self.group_size)
        if self.rotation not in ROTATIONS + ("auto",):
            raise ValueError(f"rotation must be one of {ROTATIONS + ('auto',)}, got {self.rotation!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if isinstance(self.lam_alpha, bool) or not isinstance(self.lam_alpha, (int, float)):
            raise TypeError(f"lam_alpha must be a number, got {type(self.lam_alpha).__name__}")
        if not 0.0 <= float(self.lam_alpha) <= 1.0:
            raise ValueError(f"lam_alpha must be in [0, 1] (0 turns λ off), got {self.lam_alpha}")
        if not isinstance(self.sink, bool) or not isinstance(self.value_offset, bool) or not isinstance(self.fold, bool):
            raise TypeError("sink, value_offset and fold must be True or False")
        if self.key_offset not in KEY_OFFSETS:
            raise ValueError(f"key_offset must be one of {KEY_OFFSETS}, got {self.key_offset!r}")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")
        if isinstance(self.quantized_kv_start, bool) or not isinstance(self.quantized_kv_start, int):
            raise TypeError("quantized_kv_start must be an int")
        if self.quantized_kv_start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {self.quantized_kv_start}")
        if not isinstance(self.layer_bits, dict):
            raise TypeError("layer_bits must be a dict {layer index: bits}")
        for layer, b in self.layer_bits.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer_bits keys must be layer indices >= 0, got {layer!r}")
            check_bits_group(b, self.group_size)
        if self.outliers not in OUTLIER_POLICIES:
            raise ValueError(f"outliers must be one of {OUTLIER_POLICIES}, got {self.outliers!r}")
        check_bits_group(self.outlier_bits, self.group_size)

    @property
    def needs_statistics(self) -> bool:
        """True if λ or an offset is asked for (they come from a calibration)."""
        return self.lam_alpha > 0 or self.key_offset != "none" or self.value_offset or self.sink

    def replace(self, **changes: Any) -> "KVConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_bits"] = {str(k): v for k, v in self.layer_bits.items()}
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "KVConfig":
        d = dict(d)
        d["layer_bits"] = {int(k): int(v) for k, v in d.get("layer_bits", {}).items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown KV settings {unknown}; known: {sorted(known)}")
        return cls(**d)


def plain(bits: int = 4, group_size: int = 64, quantized_kv_start: int = 0) -> KVConfig:
    """mlx-lm's own ``--kv-bits`` behaviour: no rotation, no λ, no offset."""
    return KVConfig(bits=bits, group_size=group_size, rotation="none", lam_alpha=0.0,
                    key_offset="none", sink=False, quantizer="minmax", quantized_kv_start=quantized_kv_start)


def rotated_only(bits: int = 4, group_size: int = 64, rotation: str = "auto") -> KVConfig:
    """Rotation alone (the paper's recipe without λ): the plain-rotation baseline."""
    return KVConfig(bits=bits, group_size=group_size, rotation=rotation, lam_alpha=0.0,
                    key_offset="none", sink=False, quantizer="minmax")


def bits_summary(bits: Optional[int], group_size: int) -> str:
    """'4-bit g64' style label."""
    return "float" if bits is None else f"{bits}-bit g{group_size}"


SUPPORTED = {"bits": SUPPORTED_BITS, "rotation": ROTATIONS + ("auto",)}
