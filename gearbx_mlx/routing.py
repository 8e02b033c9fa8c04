"""Hooking the router into mlx-lm's decode loop without forking it.

mlx-lm's ``generate_step`` builds the graph of step n+1 before it yields
token n (``tests/test_routing.py`` measures it), so a swap made when token n is handed out first changes
step n+2. Two hooks avoid forking the loop:

* a **logits processor** computes each step's entropy in float32 as a lazy
  device array (§3.6: nothing is read yet) and records which gear produced it;
* a thin **model proxy** runs just before every forward pass. With ``lag=0``
  it reads the pending entropy of the step just queued (this is the step's
  synchronisation, moved before the next graph is built) and shifts, so a
  decision made from step n's entropy governs step n+1, exactly. With
  ``lag=1`` it never forces a read: entropies are read after mlx-lm's own
  ``y.item()`` sync, so step n's entropy governs step n+2 and the async
  pipelining is kept.

Chunked prefill calls the proxy before any processor call: they run in the
initial gear.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx

from .entropy import entropy_bits, sanitize_logits
from .gearbox import Gearbox
from .policies import EntropyPolicy, Policy, make_policy


@dataclass
class StepRecord:
    """What happened at one decode step (the step that sampled token ``index``)."""

    index: int
    gear: str  # gear of the forward pass that produced this step's logits
    shifted: bool  # True if that gear differs from the previous step's
    shift_seconds: float  # cost of the shift made before this step's forward
    entropy: float = math.nan  # bits, float32 from the logits
    smoothed: float = math.nan
    predicted: float = math.nan
    next_gear: Optional[str] = None  # what the policy chose after seeing it
    catastrophic: bool = False
    nonfinite: bool = False  # the logits held NaN or an infinity (the NaN guard replaced them)

    @property
    def committed(self) -> bool:
        return not math.isnan(self.entropy)


class NonFiniteLogitsWarning(RuntimeWarning):
    """A step's logits held NaN or infinities: the weights or the activations are broken."""


class RoutingSession:
    """One generation's routing state: pending entropies, records, shifts.

    Args:
        gearbox: the model's gearbox.
        policy: routing policy; defaults to the config's (entropy or static).
        lag: 0 or 1 (see module doc); defaults to ``gearbox.config.lag``.
    """

    def __init__(self, gearbox: Gearbox, policy: Optional[Policy] = None, lag: Optional[int] = None):
        self.gearbox = gearbox
        self.policy = policy or make_policy(gearbox.config.static_gear)
        self.lag = gearbox.config.lag if lag is None else lag
        if self.lag not in (0, 1):
            raise ValueError(f"lag must be 0 or 1, got {lag!r}")
        self.records: List[StepRecord] = []
        self._pending: List[Tuple[int, mx.array, mx.array]] = []
        self._target = gearbox.manager.gear
        self._last_shift: Tuple[bool, float] = (False, 0.0)
        self._prev_gear: Optional[str] = None
        self.shift_seconds = 0.0
        self.nonfinite_steps = 0
        #: The KV cache's settings and bytes per token (set by generation).
        self.kv_cache: Optional[Dict[str, Any]] = None
        self._quantized_before = sum(gearbox.manager.quantize_seconds.values())
        #: :attr:`quantize_seconds` when the initial gear is in (``"start"``) and
        #: when the first token is out (``"first_token"``): what falls inside
        #: mlx-lm's prompt and generation timings (set by ``stream_generate``).
        self.quantize_marks: dict = {}

    # -- start ------------------------------------------------------------------
    def start(self, prompt_text: str) -> str:
        """Pick and install the initial gear; returns it."""
        suggested = self.gearbox.start(prompt_text)
        self._target = self.policy.initial(suggested)
        self._apply()
        return self._target

    # -- hooks --------------------------------------------------------------------
    def processor(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm logits processor: queue this step's entropy, record its gear."""
        index = len(self.records)
        gear = self.gearbox.manager.gear
        shifted = self._prev_gear is not None and gear != self._prev_gear
        did_shift, cost = self._last_shift
        self.records.append(StepRecord(index, gear, shifted, cost if did_shift else 0.0))
        self._last_shift = (False, 0.0)
        self._prev_gear = gear
        # Read with the entropy, in the same sync: a NaN guard that hides broken
        # logits (every step then looks maximally uncertain) must not hide that it did.
        bad = mx.logical_not(mx.all(mx.isfinite(logits)))
        self._pending.append((index, entropy_bits(logits).reshape(()), bad))
        return sanitize_logits(logits) if self.gearbox.config.nan_guard else logits

    def before_forward(self) -> None:
        """Model-proxy hook: settle the decision, then shift if needed."""
        if self.lag == 0:
            self.commit()
        self._apply()

    def commit(self, upto: Optional[int] = None) -> None:
        """Read pending entropies (of steps <= ``upto``; all if None) and decide.

        Reading is a sync with the step that produced them: the response loop
        passes ``upto`` so that a step still in flight is never waited for.
        """
        pending = [p for p in self._pending if upto is None or p[0] <= upto]
        if not pending:
            return
        self._pending = self._pending[len(pending):]
        mx.eval([x for _, h, bad in pending for x in (h, bad)])
        prewarm = isinstance(self.policy, EntropyPolicy)
        for index, h, bad in pending:
            seen = self.gearbox.observe(h.item(), prewarm=prewarm)
            rec = self.records[index]
            if bad.item():
                rec.nonfinite = True
                self.nonfinite_steps += 1
                if self.nonfinite_steps == 1:
                    warnings.warn(
                        f"step {index}: the logits hold NaN or infinity (broken weights, or an overflow in "
                        f"{self.gearbox.manager.gear} gear?); "
                        + ("the NaN guard sampled from finite stand-ins, so the text and the entropy of such "
                           "steps mean nothing; they are counted as nonfinite_steps"
                           if self.gearbox.config.nan_guard else "nan_guard is off"),
                        NonFiniteLogitsWarning, stacklevel=2,
                    )
            rec.entropy, rec.smoothed, rec.predicted = seen.entropy, seen.smoothed, seen.predicted
            rec.catastrophic = seen.catastrophic
            self._target = self.policy.next_gear(index, seen)
            rec.next_gear = self._target

    def _apply(self) -> None:
        record = self.gearbox.shift(self._target)
        if record is not None:
            self._last_shift = (True, record.seconds)
            self.shift_seconds += record.seconds - record.quantize_seconds

    @property
    def quantize_seconds(self) -> float:
        """Seconds spent quantizing during this session (shifts and pre-warming)."""
        return sum(self.gearbox.manager.quantize_seconds.values()) - self._quantized_before

    # -- summary ------------------------------------------------------------------
    def gear_counts(self) -> dict:
        counts = {"low": 0, "mid": 0, "high": 0}
        for r in self.records:
            counts[r.gear] += 1
        return counts


class RoutedModel:
    """A proxy for an mlx-lm model that calls the session before each forward.

    Everything else (``layers``, ``make_cache``, ``args``...) is the model's own.
    """

    def __init__(self, model: Any, session: RoutingSession) -> None:
        self._model = model
        self._session = session

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        self._session.before_forward()
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
