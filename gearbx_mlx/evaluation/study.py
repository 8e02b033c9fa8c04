"""What ``python -m gearbx_mlx.evaluate`` runs by default, what ``--full`` adds, and how long each takes.

:data:`DEFAULT_STUDY` is the quick study (minutes on a two-core CPU): the
quality of the policies of the gearbox's own scope against their matched
baselines over one window of text. :data:`FULL_STUDY` is the whole study of
docs/BENCHMARKS.md: both scopes and the nested store, eight windows, decode
speed on the real kernels, the speculative rows and the gear-by-workload
generations (tens of minutes there). :func:`expected_seconds` is the cost
model behind the estimate printed before a run, and :class:`Eta` puts the
time elapsed and left before every progress line.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..config import SCOPES
from .workloads import WORKLOADS


@dataclass(frozen=True)
class Study:
    """The defaults of one kind of evaluation run (each a flag of ``evaluate``).

    Attributes:
        name: ``default`` or ``full``.
        tokens: tokens of text (``--tokens``).
        speed_tokens: decode tokens per policy on the real kernels (``--speed-tokens``; 0 skips).
        workload_tokens: tokens per workload prompt (``--workload-tokens``; 0 skips).
        speculative: the speculative rows (``--speculative`` / ``--no-speculative``).
        scopes: the scopes of the first pass's rows; None: the gearbox config's
            scope alone, without the nested store's rows (which manage every layer).
    """

    name: str
    tokens: int
    speed_tokens: int
    workload_tokens: int
    speculative: bool
    scopes: Optional[Tuple[str, ...]]


DEFAULT_STUDY = Study("default", tokens=512, speed_tokens=0, workload_tokens=0, speculative=False, scopes=None)
FULL_STUDY = Study("full", tokens=4096, speed_tokens=128, workload_tokens=48, speculative=True, scopes=SCOPES)

#: One-core (CPU) seconds of each piece of work on the default model
#: (SmolLM2-135M, float32, OpenBLAS), from the default run of
#: ``benchmarks/results/eval_quick.json`` (passes, calibration) and the full
#: run of ``benchmarks/results/eval_default.json`` (speed, speculative rows);
#: a model's work scales with its parameters.
COSTS = {
    "load": 3.0,  # importing, loading the converted model
    "calibration": 6.0,  # the threshold calibration's three prompts (3.9-8.3 measured)
    "pass1_step": 0.0105,  # one position of one row of the first teacher-forced pass
    "pass2_step": 0.0055,  # ... of the second (matched baselines: steps in the loaded weights are copied)
    "decode_token": 0.09,  # one decode step on the real kernels (speed, workloads)
    "speculative": 60.0,  # timing and calibrating the two drafters
}
REFERENCE_PARAMS = 135e6
#: Cores a run keeps busy on an idle machine (BLAS threads, about 1.5 of two).
PARALLEL = 1.5
#: Progress lines that open each phase: the first words of the harness's own lines.
PHASE_WORDS = (("calibration", "calibrating"), ("pass1", "pass 1"), ("pass2", "pass 2"), ("speed", "speed"),
               ("speculative", "speculative"), ("workloads", "workloads"))


def rows_of(scopes: Sequence[str], nested: bool) -> Tuple[int, int, int]:
    """First-pass rows, second-pass rows and entropy rows of the default policy set.

    Per scope: static mid and low, the mixed recipe, three entropy policies;
    static high once; the nested store: three rows, one of them entropy. The
    second pass: the reference and two baselines per entropy row.
    """
    entropy = 3 * len(scopes) + (1 if nested else 0)
    first = 1 + 6 * len(scopes) + (3 if nested else 0)
    return first, 1 + 2 * entropy, entropy


def expected_seconds(tokens: int, window: int, scopes: Sequence[str], nested: bool, speed_tokens: int,
                     workload_tokens: int, speculative: bool, params: float = REFERENCE_PARAMS
                     ) -> Dict[str, float]:
    """One-core seconds of each phase of a run (the keys of :data:`PHASE_WORDS`, ``load`` and ``total``).

    Teacher-forced passes cost rows x scored positions; speed costs (rows + 1
    warm-up + the plain baseline) x decode tokens; the workloads cost each
    entropy row of the config's scope x prompts x tokens.
    """
    scale = params / REFERENCE_PARAMS
    first, second, _ = rows_of(scopes, nested)
    windows = max(1, tokens // max(window, 2))
    steps = windows * (min(tokens, window) - 1)
    prompts = sum(len(v) for v in WORKLOADS.values())
    out = {
        "load": COSTS["load"] * scale,
        "calibration": COSTS["calibration"] * scale,
        "pass1": first * steps * COSTS["pass1_step"] * scale,
        "pass2": second * steps * COSTS["pass2_step"] * scale,
        "speed": (first + 2) * speed_tokens * COSTS["decode_token"] * scale,
        "speculative": COSTS["speculative"] * scale if speculative else 0.0,
        "workloads": 3 * prompts * workload_tokens * COSTS["decode_token"] * scale,
    }
    out["total"] = sum(out.values())
    return out


def wall_factor(load: Optional[float] = None, cpus: Optional[int] = None) -> float:
    """Wall seconds per one-core second: ``1 / PARALLEL`` idle, more while other jobs hold the CPUs."""
    cpus = cpus or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    return 1.0 / min(PARALLEL, cpus / (load + 1.0))


def minutes(seconds: float) -> str:
    """``m:ss``."""
    s = max(0, int(round(seconds)))
    return f"{s // 60}:{s % 60:02d}"


class Eta:
    """A progress callable that puts the time elapsed and the time left before each line.

    The time left is the cost model's for the phases not yet done, scaled by
    how the phases so far compared with the model (a busy machine's slowdown
    carries over), less the time already spent in the current phase.
    """

    def __init__(self, say: Callable[[str], None], seconds: Dict[str, float], factor: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.say, self.clock, self.factor = say, clock, factor
        self.order: List[str] = ["load"] + [k for k, _ in PHASE_WORDS]
        self.model = {k: seconds.get(k, 0.0) * factor for k in self.order}
        self.start = clock()
        self.phase, self.phase_start = "load", self.start
        self.worked: Optional[float] = None  # when the first phase after loading began

    def left(self) -> float:
        """Seconds left, as the model and the phases so far say (loading aside: a cached model loads
        in a moment, a first run downloads and converts it, and neither says how fast the work runs)."""
        i = self.order.index(self.phase)
        rate = 1.0
        if self.worked is not None:
            before = sum(self.model[k] for k in self.order[1:i])
            spent = self.phase_start - self.worked
            if before > 0 and spent > 0:
                rate = spent / before
        remaining = sum(self.model[k] for k in self.order[i:]) * rate
        return max(0.0, remaining - (self.clock() - self.phase_start))

    def __call__(self, msg: str) -> None:
        for key, words in PHASE_WORDS:
            if msg.startswith(words) and key != self.phase and self.order.index(key) > self.order.index(self.phase):
                self.phase, self.phase_start = key, self.clock()
                if self.worked is None:
                    self.worked = self.phase_start
                break
        self.say(f"[{minutes(self.clock() - self.start)} elapsed, about {minutes(self.left())} left] {msg}")


__all__ = ["COSTS", "DEFAULT_STUDY", "FULL_STUDY", "Eta", "PHASE_WORDS", "Study", "expected_seconds", "minutes",
           "rows_of", "wall_factor"]
