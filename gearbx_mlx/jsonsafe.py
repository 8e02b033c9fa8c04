"""JSON the package writes is JSON: no NaN or infinity, at any depth.

Python's :func:`json.dumps` writes ``NaN``/``Infinity`` bare, which no strict
JSON reader accepts. Every file the package writes (traces, calibrations,
evaluation and bench results) goes through :func:`dumps`: non-finite floats,
however deeply nested in dicts, lists or tuples, become ``null``, and
``allow_nan=False`` makes any that were missed an error instead of a bad file.
"""

from __future__ import annotations

import json
import math
from typing import Any


def clean(x: Any) -> Any:
    """``x`` with every non-finite float (in dicts, lists and tuples, at any depth) replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def dumps(obj: Any, **kwargs: Any) -> str:
    """:func:`json.dumps` of ``clean(obj)`` with ``allow_nan=False`` (other keywords pass through)."""
    return json.dumps(clean(obj), allow_nan=False, **kwargs)
