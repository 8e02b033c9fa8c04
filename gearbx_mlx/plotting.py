"""matplotlib, the optional ``plot`` extra: the one place that imports it for a figure.

The evaluation's figures (:mod:`gearbx_mlx.evaluation.plots`) and the traces'
(:mod:`gearbx_mlx.telemetry.plots`) both draw through :func:`require_matplotlib`,
so a missing install says the same thing, once, wherever ``--plots`` was asked for.
"""

from __future__ import annotations

from typing import Any


def require_matplotlib() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed), or ImportError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "figures (--plots) need matplotlib: pip install matplotlib (or the package's 'plot' extra: "
            "pip install 'gearbx-mlx[plot]'), or leave out --plots"
        ) from None
    return plt


__all__ = ["require_matplotlib"]
