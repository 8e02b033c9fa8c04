"""The gearbox: monitor + precision manager + config (+ calibration).

One :class:`Gearbox` belongs to one loaded model. It is what
``gearbx_mlx.load`` returns beside the model and tokenizer, and what
``gearbx_mlx.stream_generate`` drives.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import mlx.nn as nn

from .calibration import Calibration, calibrate
from .classifier import PromptClass, classify_prompt
from .config import GearboxConfig
from .distributed.ranks import Ranks, model_identity
from .entropy import EntropyMonitor, MonitorStep, scaled_thresholds
from .precision import PrecisionManager
from .sourcecheck import SourceCheck, check_modules
from .sources.entries import note_once


def vocab_size_of(model: nn.Module, tokenizer: Any = None) -> int:
    """The model's output vocabulary size (config first, then the embedding)."""
    args = getattr(model, "args", None)
    v = getattr(args, "vocab_size", None)
    if isinstance(v, int) and v > 1:
        return v
    for _, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            return int(m.weight.shape[0])
    if tokenizer is not None:
        return len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else int(tokenizer.vocab_size)
    raise ValueError("cannot tell the model's vocabulary size; pass vocab_size=")


class Gearbox:
    """Entropy monitor and precision manager of one model.

    Args:
        model: the mlx-lm model whose modules are swapped.
        config: router and manager settings.
        vocab_size: output vocabulary size (read from the model if omitted).
        calibration: calibrated thresholds (override the scaled defaults).
        model_name: for telemetry.
        planes_dir: the model's folder, where the nested store caches its planes.
        ranks: the ranks the model is sharded over (found from the model's
            sharded layers when None; stays None for a model on one process).
            A sharded model's gears are built from each rank's shard, and
            every rank takes rank 0's routing decisions.
        draft: ``draft_scope=`` and ``draft_gear=`` of the speculative drafter,
            as :class:`~gearbx_mlx.precision.PrecisionManager` takes them.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Optional[GearboxConfig] = None,
        vocab_size: Optional[int] = None,
        calibration: Optional[Calibration] = None,
        model_name: str = "",
        planes_dir: Optional[Path] = None,
        ranks: Optional[Ranks] = None,
        **draft: Optional[str],
    ) -> None:
        self.model = model
        self.ranks = ranks or Ranks.of_model(model)
        if self.ranks is not None and self.ranks.identity is None:
            # Before the manager: a nested high gear drops the loaded weights.
            self.ranks.identity = model_identity(model)
        self.vocab_size = vocab_size or vocab_size_of(model)
        self.model_name = model_name
        self.manager = PrecisionManager(model, config or GearboxConfig(), planes_dir, **draft)
        #: The config as resolved: store, kernel and scope decided once (:attr:`resolution` says why).
        self.config = self.manager.config
        #: The loaded model's folder, where :func:`gearbx_mlx.load` knows it (keys saved calibrations).
        self.model_dir: Optional[Path] = None
        #: Where the thresholds come from: ``default-scaled``, ``manual`` or ``calibration:<strategy>``.
        self.threshold_source = "default-scaled"
        self.monitor = EntropyMonitor(self.vocab_size, self.config)
        self.calibration: Optional[Calibration] = None
        if calibration is not None:
            self.set_calibration(calibration)
        self._source_check: Optional[SourceCheck] = None
        self._warned = False
        self.prompt_class: Optional[PromptClass] = None
        #: Held while a generation is set up or streams on this gearbox (from
        #: :func:`gearbx_mlx.pipeline.prepare` to the run's ``close()``): its gear,
        #: hooks and KV transform are the model's state, so a second one at once,
        #: in another thread or interleaved in this one, is refused.
        self.busy = threading.Lock()

    @property
    def resolution(self) -> Any:
        """What the gearbox runs with and why (:class:`~gearbx_mlx.resolver.Resolution`)."""
        return self.manager.resolution

    # -- thresholds -----------------------------------------------------------
    @property
    def thresholds(self) -> Tuple[float, float]:
        """``(low, high)`` in the model's bits, after scaling or calibration."""
        return self.monitor.low, self.monitor.high

    def set_thresholds(self, low: float, high: float) -> None:
        self.monitor.set_thresholds(low, high)
        self.threshold_source = "manual"

    def set_calibration(self, calibration: Calibration) -> None:
        if calibration.vocab_size != self.vocab_size:
            raise ValueError(
                f"calibration was made for a vocabulary of {calibration.vocab_size} tokens, "
                f"this model has {self.vocab_size}: calibrate again for this model"
            )
        self.monitor.set_thresholds(calibration.low, calibration.high)
        self.calibration = calibration
        self.threshold_source = f"calibration:{calibration.strategy}"

    def calibrate(self, tokenizer: Any, strategy: str = "median", prompts=None) -> Calibration:
        """Calibrate thresholds once for this session (in the high gear)."""
        previous = self.manager.gear
        self.manager.shift("high")
        # Sharded: every rank generates rank 0's text, and takes rank 0's thresholds.
        sampler = self.ranks.exchange.greedy_sampler() if self.ranks and self.ranks.exchange else None
        try:
            cal = calibrate(
                self.model, tokenizer, strategy, prompts, self.vocab_size, self.model_name, sampler=sampler
            )
        finally:
            self.manager.shift(previous)
        if self.ranks:
            cal.low, cal.high = self.ranks.first([cal.low, cal.high])
        self.set_calibration(cal)
        return cal

    def default_thresholds(self) -> Tuple[float, float]:
        return scaled_thresholds(self.config, self.vocab_size)

    # -- the source check (§6.4) ---------------------------------------------------
    def source_check(self) -> SourceCheck:
        """Double-quantization heuristic on a spread of managed modules (cached)."""
        if self._source_check is None:
            mods = list(self.manager.originals.values())
            step = max(1, len(mods) // 8)
            self._source_check = check_modules(mods[::step])
        return self._source_check

    def warn_if_prequantized_source(self) -> Optional[str]:
        """Warn once, before the first low-gear quantization, if the source was quantized."""
        if self.manager.telemetry_only or not self.manager.paths:
            return None
        check = self.source_check()
        if not check.suspected:
            return None
        if not self._warned:
            self._warned = True
            # Once per converted model, not once per run: remembered in its cache entry.
            if self.model_dir is None or note_once(self.model_dir, "warned: source already quantized"):
                warnings.warn(check.message(), stacklevel=3)
        return check.message()

    # -- routing ---------------------------------------------------------------
    def start(self, prompt: str, initial: Optional[str] = None) -> str:
        """Reset the monitor for a new generation and pick the first gear.

        The classifier (§11) suggests the gear unless ``config.initial_gear``
        or ``initial`` says otherwise.
        """
        self.prompt_class = classify_prompt(prompt)
        gear = initial or self.config.initial_gear or self.prompt_class.gear
        self.monitor.reset(gear)
        return gear

    def observe(self, entropy: float, prewarm: bool = False) -> MonitorStep:
        """Feed one entropy; with ``prewarm``, build the predicted gear now (§3.5)."""
        seen = self.monitor.push(entropy)
        if prewarm and self.config.prewarm and seen.predicted_gear not in self.manager.cache:
            self.prepare(seen.predicted_gear)
        return seen

    def shift(self, gear: str):
        """Install ``gear`` (warning first if its first quantization compounds error)."""
        if gear != "high" and gear not in self.manager.cache:
            self.warn_if_prequantized_source()
        return self.manager.shift(gear)

    def prepare(self, gear: str) -> float:
        if gear != "high" and gear not in self.manager.cache:
            self.warn_if_prequantized_source()
        return self.manager.prepare(gear)

    def summary(self) -> Dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "thresholds": list(self.thresholds),
            "calibration": self.calibration.strategy if self.calibration else None,
            "scope": self.config.scope,
            "kernel": self.config.kernel,
            **self.manager.summary(),
        }
