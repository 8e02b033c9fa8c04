"""A routing policy for tests: the high gear until a given step, then the low gear."""

from __future__ import annotations


class SwitchAt:
    """High until step ``k`` has been seen, then low (a first entry mid-generation)."""

    name = "switch"

    def __init__(self, k: int) -> None:
        self.k = k

    def initial(self, suggested: str) -> str:
        return "high"

    def next_gear(self, step, seen) -> str:
        return "low" if step >= self.k else "high"
