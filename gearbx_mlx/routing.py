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

On a model sharded over several ranks (``mlx.distributed``) every rank must
take the same gear at the same step. A decision reads the step's entropy,
and ranks' logits may differ in their last bits, so the values a decision
reads are rank 0's: the sampler is wrapped (:meth:`RoutingSession.sampler`)
so that each step's token, entropy and NaN flag go through one small
collective (:class:`~gearbx_mlx.distributed.exchange.StepExchange`), lazily,
inside the step's graph. Every rank then runs the same deterministic policy
on the same numbers. The same collective carries each rank's own values and
gear, so :meth:`RoutingSession.commit` checks that every rank ran the step in
the same gear (and raises on every rank if not) and records whether the
ranks' own tokens and entropies agreed with rank 0's.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .config import GEAR_INDEX, GEARS
from .distributed.exchange import Shared, agreement
from .distributed.ranks import RankError
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
    # Sharded runs only: every rank's gear of this step, whether every rank's own
    # token, entropy and NaN flag equalled rank 0's, and the wait for the exchange.
    rank_gears: Optional[List[str]] = None
    ranks_agree: Optional[bool] = None
    exchange_seconds: float = math.nan

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
        # (index, entropy, NaN flag, the step's exchange on a sharded model)
        self._pending: List[Tuple[int, mx.array, mx.array, Optional[Shared]]] = []
        self._shape: Tuple[int, ...] = ()  # the model's logits at the latest step
        #: step index -> (the sampler's token, whether it is a vocabulary id, the vocabulary's
        #: size), read at commit
        self._sampled: Dict[int, Tuple[mx.array, mx.array, int]] = {}
        #: Rank 0's values of each step, on a sharded model (None on one process).
        self.exchange = gearbox.ranks.exchange if gearbox.ranks is not None else None
        self.exchange_seconds = 0.0
        self._exchanges_before = self.exchange.count if self.exchange is not None else 0
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
        self._shape = tuple(logits.shape)
        self._pending.append((index, entropy_bits(logits).reshape(()), bad, None))
        return sanitize_logits(logits) if self.gearbox.config.nan_guard else logits

    def guard_after(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm logits processor, after the caller's: the NaN guard again on the logits that
        are sampled (a caller's processor may make them non-finite), counted as this step's."""
        if not self._pending:
            return logits
        if tuple(logits.shape) != self._shape:  # a token would be drawn from a cut or padded vocabulary
            raise ValueError(f"a logits processor returned logits of shape {tuple(logits.shape)}; the model's "
                             f"are {self._shape}")
        index, h, bad, shared = self._pending[-1]
        self._pending[-1] = (index, h, mx.logical_or(bad, mx.logical_not(mx.all(mx.isfinite(logits)))), shared)
        return sanitize_logits(logits) if self.gearbox.config.nan_guard else logits

    def sampler(self, inner: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        """mlx-lm sampler: ``inner``'s token, checked (:meth:`_checked`); on a sharded model,
        rank 0's token, and the step's entropy and NaN flag replaced by rank 0's (one
        collective, in the graph)."""
        if self.exchange is None:
            return lambda logprobs: self._checked(inner(logprobs), logprobs.shape[-1])

        def sample(logprobs: mx.array) -> mx.array:
            token = self._checked(inner(logprobs), logprobs.shape[-1])
            index, h, bad, _ = self._pending[-1]
            gear = mx.array(GEAR_INDEX[self.records[index].gear], dtype=mx.uint32)
            shared = self.exchange.share(token, h, bad, gear)
            # The step up to its own values is one evaluation and the collective the next
            # (mlx-lm's), so the wait between the two is the collective's (timed in _settle).
            mx.async_eval(shared.local)
            self._pending[-1] = (index, shared.values[1], shared.values[2], shared)
            return shared.values[0]

        return sample

    def _checked(self, token: Any, vocab: int) -> mx.array:
        """A sampler's token, with an id outside ``[0, vocab)`` replaced by 0 in the graph (the
        model's embedding would read past its table: MLX ends the process) and remembered, so
        that :meth:`commit` raises one ValueError naming it; checked without a sync."""
        if not isinstance(token, mx.array) or not mx.issubdtype(token.dtype, mx.integer):
            what = str(token.dtype) if isinstance(token, mx.array) else type(token).__name__
            raise TypeError(f"a sampler returns an mx.array of integer token ids, got {what}")
        ok = mx.all(mx.logical_and(token >= 0, token < vocab))
        if self._pending:
            self._sampled[self._pending[-1][0]] = (token, ok, vocab)
        return mx.where(ok, token, mx.zeros_like(token))

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
        shared = [x for *_, x in pending if x is not None]
        if shared:
            self._settle(pending, shared)
        sampled = [(i, self._sampled.pop(i)) for i, *_ in pending if i in self._sampled]
        mx.eval([x for _, h, bad, _ in pending for x in (h, bad)] + [ok for _, (_, ok, _) in sampled])
        for index, (token, ok, vocab) in sampled:
            if not ok.item():
                raise ValueError(f"step {index}: the sampler returned token id(s) {token.tolist()}, outside the "
                                 f"model's vocabulary of {vocab} ids")
        prewarm = isinstance(self.policy, EntropyPolicy)
        for index, h, bad, _ in pending:
            seen = self.gearbox.observe(h.item(), prewarm=prewarm)
            rec = self.records[index]
            if bad.item():
                rec.nonfinite = True
                self.nonfinite_steps += 1
                if self.nonfinite_steps == 1:
                    warnings.warn(
                        f"step {index}: the logits hold NaN or infinity (broken weights, an overflow in "
                        f"{self.gearbox.manager.gear} gear, or a logits processor?); "
                        + ("the NaN guard sampled from finite stand-ins, so the text and the entropy of such "
                           "steps mean nothing; they are counted as nonfinite_steps"
                           if self.gearbox.config.nan_guard else "nan_guard is off"),
                        NonFiniteLogitsWarning, stacklevel=2,
                    )
            rec.entropy, rec.smoothed, rec.predicted = seen.entropy, seen.smoothed, seen.predicted
            rec.catastrophic = seen.catastrophic
            self._target = self.policy.next_gear(index, seen)
            rec.next_gear = self._target

    def _settle(self, pending: List[Tuple[int, mx.array, mx.array, Optional[Shared]]],
                shared: List[Shared]) -> None:
        """Read the steps' exchanges: check every rank's gear, record agreement and the wait.

        The wait runs from the step's own values being ready to rank 0's being
        known: the collective as it delays the step (with ``lag=0``; with
        ``lag=1`` mlx-lm's own sync has already waited for it, and it reads ~0).

        Raises:
            RankError: on every rank alike, if some rank ran a step in another gear.
        """
        mx.eval([s.local for s in shared])  # this rank's own values: the step itself
        tic = time.perf_counter()
        mx.eval([s.table for s in shared])
        wait = (time.perf_counter() - tic) / len(shared)
        self.exchange_seconds += wait * len(shared)
        for index, _, _, s in pending:
            if s is None:
                continue
            rows = s.rows()
            rec = self.records[index]
            gears = [GEARS[int(g)] if int(g) < len(GEARS) else "?" for g in rows[:, s.columns(3)].reshape(-1)]
            rec.rank_gears, rec.exchange_seconds = gears, wait
            rec.ranks_agree = all(agreement(rows, [s.columns(i) for i in range(3)]))
            if any(g != gears[0] for g in gears):
                raise RankError(
                    f"step {index}: the ranks ran in different gears ({', '.join(gears)}): their routing "
                    "diverged, which rank 0's shared decisions should make impossible; please report it")

    def _apply(self) -> None:
        record = self.gearbox.shift(self._target)
        if record is not None:
            self._last_shift = (True, record.seconds)
            self.shift_seconds += record.seconds - record.quantize_seconds

    @property
    def exchanges(self) -> int:
        """Decision collectives this session made (one per forward step on a sharded model, else 0)."""
        return self.exchange.count - self._exchanges_before if self.exchange is not None else 0

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
