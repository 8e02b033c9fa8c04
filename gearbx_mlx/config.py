"""Every default of gearbx_mlx, in one place.

The constants come from the GEARBX specification (§3, §4, §5.1, §11, §16);
where the specification is silent the choice is ours and says so. Config flows
down as one :class:`GearboxConfig` object, never as loose keyword arguments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from .mlx_tables import GROUP_SIZES, QUANT_BITS

#: Gear names, from cheapest to most precise.
GEARS: Tuple[str, ...] = ("low", "mid", "high")
GEAR_INDEX: Dict[str, int] = {g: i for i, g in enumerate(GEARS)}

#: Bit widths that MLX's ``QuantizedLinear`` supports and we allow for a gear.
SUPPORTED_BITS: Tuple[int, ...] = QUANT_BITS

#: Terminal colours of the gears (ANSI): green low, yellow mid, red high.
GEAR_ANSI: Dict[str, str] = {"low": "\033[32m", "mid": "\033[33m", "high": "\033[31m"}
ANSI_RESET = "\033[0m"

#: Reference vocabulary of the paper's thresholds (§3.4).
REFERENCE_VOCAB = 32768

#: The longest entropy window (tokens): far beyond any context, and within what a deque holds.
MAX_WINDOW = 1_000_000
#: The most tokens a measuring command (evaluate, bench) takes per part: days of decoding on any machine.
MAX_RUN_TOKENS = 1_000_000
#: The most rounds of bench.
MAX_ROUNDS = 1_000

#: Scopes of the precision manager (§6.1): the paper's attention-only default,
#: or every linear layer including a tied output projection.
SCOPES: Tuple[str, ...] = ("attention", "all")

#: Kernels of the low and mid gears: ``mlx`` (MLX's ``QuantizedLinear``, and the
#: nested store's pure-MLX path), ``packed`` (the package's own: C on the CPU,
#: Metal or CUDA on a GPU, for either store), or ``auto`` (the resolver's pick:
#: :mod:`gearbx_mlx.resolver`).
KERNELS: Tuple[str, ...] = ("auto", "mlx", "packed")

#: Where the gears' weights live: ``separate`` quantized copies beside the loaded
#: weights (one per gear entered), or ``nested`` bit planes that every gear
#: shares (:mod:`gearbx_mlx.nested`). ``GearboxConfig.store=None`` picks
#: ``nested`` for float weights (the gears cost 1.59x the float16 bytes of the
#: managed layers instead of 1.81x, the mid gear is closer to the loaded
#: weights than MLX 8-bit, and a shift quantizes nothing) and leaves an
#: already quantized model telemetry-only, as before.
STORES: Tuple[str, ...] = ("separate", "nested")

#: What the high gear of the nested store reads: the loaded weights
#: (``original``, bit-identical to the unmodified model) or all the planes
#: (``planes``: the loaded weights are dropped; all three gears then fit in
#: about 1.0x the float16 bytes).
HIGH_SOURCES: Tuple[str, ...] = ("original", "planes")

#: How the nested store's low gear (plane 0, an MLX 4-bit layer) is made: ``rtn``, MLX's
#: round-to-nearest (``mx.quantize``); or mlx-lm's own quantizers (``mlx_lm.quant``):
#: ``awq`` (its activation-aware clipping search), ``gptq``, ``dwq`` (scales and biases
#: distilled from the loaded model), calibrated on :data:`LOW_QUANT`'s text
#: (:mod:`gearbx_mlx.nested.lowquant`). The mid and high planes fit the loaded weights whatever
#: the low gear is.
LOW_QUANTS: Tuple[str, ...] = ("rtn", "awq", "gptq", "dwq")


@dataclass(frozen=True)
class LowQuantDefaults:
    """How :data:`LOW_QUANTS` other than ``rtn`` are calibrated (our choices; mlx-lm's
    command lines download a hub text or data set, which the package never does).

    Attributes:
        corpus: the package's calibration text: gensim's ``lee.cor`` news articles,
            which the KV calibration reads too; not the evaluation text
            (``lee_background.cor``), so the evaluation does not score on it.
        sequence_length: tokens per calibration sample (the text is cut into
            samples of this many tokens: 19 for SmolLM2's tokenizer).
        dwq_learning_rate: Adam's rate for DWQ (mlx-lm's 1e-6 is for thousands of
            samples; a few dozen steps need more to move the scales).
        dwq_epochs: passes of DWQ over the calibration samples.
        dwq_batch_size: samples per DWQ step.
        seed: seeds the quantizers' sampling (mlx-lm's ``mx.random`` and NumPy).
        gptq_hessian_bytes: most bytes of GPTQ's Hessians held at once (mlx-lm's GPTQ
            holds one ``d_in x d_in`` float32 matrix per layer until it quantizes them:
            10.6 GB for a 1.5B qwen2); more than this and the layers are quantized in
            groups, one calibration pass each, to the same planes (the Hessians are of
            the loaded model's inputs either way).
    """

    corpus: str = "lee"
    sequence_length: int = 256
    dwq_learning_rate: float = 1e-4
    dwq_epochs: int = 2
    dwq_batch_size: int = 2
    seed: int = 0
    gptq_hessian_bytes: int = 2 * 2**30


LOW_QUANT = LowQuantDefaults()

#: Prompt tokens per prefill chunk, in every mode. mlx-lm's default is 2,048;
#: Python handles Ctrl-C only between MLX evaluations, so a chunk is also how
#: late an interrupt during the prefill can arrive: 512 keeps that to a
#: quarter of mlx-lm's at little cost to prefill speed.
PREFILL_STEP_SIZE = 512

#: Our choice: a low gear that still reads this share of the high gear's
#: weight bytes per step (§9) leaves little to gain from routing, and the
#: summary says so (e.g. attention scope on a large-vocabulary model, where
#: the unmanaged output projection dominates).
LITTLE_TO_GAIN = 0.8


@dataclass(frozen=True)
class CalibrationDefaults:
    """§4 constants."""

    # Percentile strategy (§4.1): p30 low, p60 high, at least 5 samples.
    p_low: float = 0.30
    p_high: float = 0.60
    min_samples: int = 5
    low_floor: float = 0.01
    cap_low_frac: float = 0.06  # × log2 V
    cap_high_frac: float = 0.12  # × log2 V
    min_band_percentile: float = 0.2
    # MLX median strategy (§4.2): low = median, high = 2.5 × median.
    median_high_factor: float = 2.5
    min_band_median: float = 0.3
    # Our choice: how many tokens each calibration prompt generates.
    tokens_per_prompt: int = 24


CALIBRATION = CalibrationDefaults()

#: The short mixed-difficulty prompts of the median strategy (§4.2): one easy,
#: one moderate, one hard. Ours; the paper does not list its own.
CALIBRATION_PROMPTS: Tuple[str, ...] = (
    "Write the days of the week in order, separated by commas.",
    "Describe a walk along a river on an autumn morning.",
    "Prove that the square root of 2 is irrational, step by step.",
)


@dataclass
class GearboxConfig:
    """Configuration of the entropy router and the precision manager.

    Thresholds are in bits at the reference vocabulary (32,768 tokens) and are
    scaled by ``log2 V / log2 32768`` for a model of vocabulary ``V`` (§3.4),
    unless ``scale_thresholds`` is False (calibrated thresholds are already in
    the model's own bits and are never scaled).
    """

    # §3.2 rolling window: 3 for MLX.
    window: int = 3
    # §3.3 thresholds and hysteresis, at the reference vocabulary.
    low_threshold: float = 1.8
    high_threshold: float = 3.5
    hysteresis: float = 0.1
    scale_thresholds: bool = True
    reference_vocab: int = REFERENCE_VOCAB
    # §10.2: tokens a gear is held before another shift. The paper gives no
    # number; 3 (one window) keeps KV-cache blocks contiguous at little cost.
    min_gear_duration: int = 3
    # §3.5 look-ahead and catastrophic fallback.
    lookahead: int = 2
    catastrophic_fraction: float = 0.9
    # Quantize the predicted gear ahead of the shift (§3.5 pre-warming).
    prewarm: bool = True
    # §6: what is managed and how.
    scope: str = "attention"
    group_size: int = 64
    bits: Dict[str, int] = field(default_factory=lambda: {"low": 4, "mid": 8})
    # "auto": the resolver picks (gearbx_mlx.resolver); "mlx" or "packed" as asked.
    kernel: str = "auto"
    # Where the gears' weights live, and what the nested store's high gear reads.
    store: Optional[str] = None
    high: str = "original"
    # How the nested store's low gear is quantized (LOW_QUANTS).
    low_quant: str = "rtn"
    telemetry_only: bool = False
    # A fixed gear (a baseline): the monitor still measures, nothing routes.
    static_gear: Optional[str] = None
    # Gear of the prefill and first steps; None = the §11 classifier decides.
    initial_gear: Optional[str] = None
    # Steps between the entropy a decision reads and the forward pass it
    # governs (measured in tests/test_routing.py): 0 = the very next pass (one sync per step, taken
    # before the next graph is built), 1 = mlx-lm's natural pipelining.
    lag: int = 0
    # §10.1 NaN guard on the logits that are sampled.
    nan_guard: bool = True

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ---------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field and what to do."""
        if not isinstance(self.window, int) or not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"window must be an integer from 1 to {MAX_WINDOW:,}, got {self.window!r}")
        for name in ("low_threshold", "high_threshold", "hysteresis"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.low_threshold >= self.high_threshold:
            raise ValueError(
                f"thresholds are in the wrong order: low={self.low_threshold} must be "
                f"below high={self.high_threshold} (give LOW then HIGH)"
            )
        if self.reference_vocab < 2:
            raise ValueError("reference_vocab must be >= 2")
        if not isinstance(self.min_gear_duration, int) or self.min_gear_duration < 1:
            raise ValueError(
                f"min_gear_duration must be an integer >= 1, got {self.min_gear_duration!r}"
            )
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ValueError(f"lookahead must be an integer >= 0, got {self.lookahead!r}")
        if not 0 < self.catastrophic_fraction <= 1:
            raise ValueError("catastrophic_fraction must be in (0, 1]")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.store is not None and self.store not in STORES:
            raise ValueError(f"store must be one of {STORES} (or None: nested for float weights), got {self.store!r}")
        if self.high not in HIGH_SOURCES:
            raise ValueError(f"high must be one of {HIGH_SOURCES}, got {self.high!r}")
        if self.low_quant not in LOW_QUANTS:
            raise ValueError(f"low_quant must be one of {LOW_QUANTS}, got {self.low_quant!r}")
        if self.low_quant != "rtn" and self.store == "separate":
            raise ValueError(f"low_quant={self.low_quant!r} builds the nested store's low plane: it needs store='nested'")
        if self.high == "planes" and self.store == "separate":
            raise ValueError("high='planes' reads the nested store's planes: it needs store='nested'")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size!r}")
        if set(self.bits) != {"low", "mid"}:
            raise ValueError(f"bits must give exactly 'low' and 'mid', got {self.bits!r}")
        for gear, b in self.bits.items():
            if b not in SUPPORTED_BITS:
                raise ValueError(
                    f"unsupported bit width {b!r} for the {gear} gear: "
                    f"choose one of {SUPPORTED_BITS}"
                )
        for name in ("static_gear", "initial_gear"):
            g = getattr(self, name)
            if g is not None and g not in GEARS:
                raise ValueError(f"{name} must be one of {GEARS} or None, got {g!r}")
        if self.lag not in (0, 1):
            raise ValueError(f"lag must be 0 or 1, got {self.lag!r}")

    # -- helpers ------------------------------------------------------------
    def replace(self, **changes: Any) -> "GearboxConfig":
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GearboxConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown GearboxConfig fields: {sorted(unknown)}")
        return cls(**d)


def bits_for(gear: str, config: GearboxConfig) -> Optional[int]:
    """Bits of ``gear`` (None for the high gear: the loaded weights)."""
    if gear not in GEARS:
        raise ValueError(f"unknown gear {gear!r}: choose one of {GEARS}")
    return None if gear == "high" else config.bits[gear]
