"""Cold-start prompt classifier (§11).

The monitor needs a few tokens of history, so the first gear comes from a
cheap heuristic on the prompt text:

    score = 2·n_math + 1.5·n_code + 0.3·min(|W|/50, 3) + 1.5·[mean word length > 6.5]

Scores >= 4.0 start in the high gear, >= 1.5 in the mid gear, others in low.
Observed entropy overrides it within a few decode steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HIGH_CUTOFF = 4.0
MID_CUTOFF = 1.5

#: Characters counted as mathematical symbols. A hyphen counts only between
#: digits or spaces ("3 - 2"), never inside a word ("well-known").
MATH_CHARS = frozenset("+=*/^<>%√∑∏∫∂∞≈≠≤≥±×÷πθλσμΔ∇∈∀∃")
_MINUS = re.compile(r"(?<=[\d\s])-(?=[\d\s(])")

#: Programming and reasoning keywords (whole words, case-insensitive).
CODE_KEYWORDS = frozenset(
    """
    def class return import function lambda const var let void public static
    struct enum async await yield print printf println int float double bool
    string array list dict tuple null none true false elif else while for
    foreach switch case break continue try catch except finally throw raise
    sql select from where join regex compile debug algorithm recursion
    complexity prove proof theorem lemma derive derivative integral equation
    solve calculate compute evaluate simplify factor matrix vector probability
    """.split()
)

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\S+")


@dataclass(frozen=True)
class PromptClass:
    """The classifier's verdict and the counts behind it."""

    gear: str
    score: float
    n_math: int
    n_code: int
    n_words: int
    mean_word_length: float


def classify_prompt(prompt: str) -> PromptClass:
    """Score a prompt with the §11 formula and pick the starting gear."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    n_math = sum(1 for ch in prompt if ch in MATH_CHARS) + len(_MINUS.findall(prompt))
    words = prompt.split()
    tokens = [t.lower() for t in _WORD.findall(prompt)]
    n_code = sum(1 for t in tokens if t in CODE_KEYWORDS)
    n_words = len(words)
    mean_len = sum(len(w) for w in words) / n_words if n_words else 0.0
    score = (
        2.0 * n_math
        + 1.5 * n_code
        + 0.3 * min(n_words / 50.0, 3.0)
        + (1.5 if mean_len > 6.5 else 0.0)
    )
    if score >= HIGH_CUTOFF:
        gear = "high"
    elif score >= MID_CUTOFF:
        gear = "mid"
    else:
        gear = "low"
    return PromptClass(gear, score, n_math, n_code, n_words, mean_len)
