"""Routing policies: which gear the next forward pass uses.

The entropy policy is GEARBX itself; the others are baselines with the same
interface (a fixed gear, a position rule as in progressive mixed-precision
decoding, a seeded random router with given gear fractions, a replayed gear
sequence such as a shuffle of another policy's own gears). A policy sees
the monitor's conclusion for each step and the step's index; it must be
deterministic given those (the random policy draws from its own seeded
generator).
"""

from __future__ import annotations

import random
from typing import Dict, Optional, Protocol, Sequence, Union

from .config import GEARS
from .entropy import MonitorStep


class Policy(Protocol):
    name: str

    def initial(self, suggested: str) -> str:
        """Gear of the prefill and first step (``suggested`` is the classifier's)."""

    def next_gear(self, step: int, seen: MonitorStep) -> str:
        """Gear for the forward pass after step ``step`` (0-based)."""


class EntropyPolicy:
    """GEARBX: follow the monitor (window, hysteresis, duration, fallback)."""

    name = "entropy"

    def initial(self, suggested: str) -> str:
        return suggested

    def next_gear(self, step: int, seen: MonitorStep) -> str:
        return seen.gear


class StaticPolicy:
    """One gear throughout; the monitor still measures entropy."""

    def __init__(self, gear: str) -> None:
        if gear not in GEARS:
            raise ValueError(f"unknown gear {gear!r}: choose one of {GEARS}")
        self.gear = gear
        self.name = f"static-{gear}"

    def initial(self, suggested: str) -> str:
        return self.gear

    def next_gear(self, step: int, seen: MonitorStep) -> str:
        return self.gear


class PositionPolicy:
    """The first ``k`` steps in ``early`` gear, then ``late`` (PMPD-style)."""

    def __init__(self, k: int, early: str = "high", late: str = "low") -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        for g in (early, late):
            if g not in GEARS:
                raise ValueError(f"unknown gear {g!r}: choose one of {GEARS}")
        self.k, self.early, self.late = k, early, late
        self.name = f"position-{k}"

    def initial(self, suggested: str) -> str:
        return self.early if self.k > 0 else self.late

    def next_gear(self, step: int, seen: MonitorStep) -> str:
        return self.early if step + 1 < self.k else self.late


class RandomPolicy:
    """Each step's gear drawn independently with the given fractions.

    With the fractions of an entropy run, it spends the same bit budget
    without the entropy signal: the difference isolates the signal's value.
    """

    def __init__(self, fractions: Dict[str, float], seed: int = 0) -> None:
        total = sum(fractions.values())
        if total <= 0 or any(v < 0 for v in fractions.values()) or set(fractions) - set(GEARS):
            raise ValueError(f"fractions must be non-negative over {GEARS}, got {fractions}")
        self.gears = [g for g in GEARS if fractions.get(g, 0) > 0]
        self.weights = [fractions[g] / total for g in self.gears]
        self.rng = random.Random(seed)
        self.name = "random"

    def _draw(self) -> str:
        return self.rng.choices(self.gears, weights=self.weights)[0]

    def initial(self, suggested: str) -> str:
        return self._draw()

    def next_gear(self, step: int, seen: MonitorStep) -> str:
        return self._draw()


class ReplayPolicy:
    """A given gear sequence, one gear per step (the last one held after its end).

    The evaluation's random baseline replays a random permutation of an
    entropy policy's own gears in each window: the same gears, hence the same
    bytes, at positions the entropy did not choose.
    """

    def __init__(self, gears: Sequence[str]) -> None:
        gears = list(gears)
        if not gears or any(g not in GEARS for g in gears):
            bad = next((g for g in gears if g not in GEARS), None)
            raise ValueError(f"gears must be a non-empty sequence over {GEARS}, got {bad!r} in {len(gears)} gears")
        self.gears = gears
        self.name = "replay"

    def initial(self, suggested: str) -> str:
        return self.gears[0]

    def next_gear(self, step: int, seen: MonitorStep) -> str:
        return self.gears[min(step + 1, len(self.gears) - 1)]


def make_policy(static_gear: Optional[str] = None) -> Policy:
    """The policy a config asks for: static if ``static_gear``, else entropy."""
    return StaticPolicy(static_gear) if static_gear else EntropyPolicy()


def as_policy(value: Union[None, str, Policy]) -> Optional[Policy]:
    """A caller's ``policy=``: None (the config's), a gear's name (that gear throughout, as
    ``--static-gear`` takes it), or a policy.

    Raises:
        ValueError: an unknown gear name.
        TypeError: anything else that is not a policy (no ``initial`` and ``next_gear``).
    """
    if value is None or isinstance(value, str):
        return None if value is None else StaticPolicy(value)
    if not (callable(getattr(value, "next_gear", None)) and callable(getattr(value, "initial", None))):
        raise TypeError(f"policy must be a gear name ({', '.join(GEARS)}) or a routing policy "
                        f"(gearbx_mlx.policies), got {type(value).__name__}")
    return value
