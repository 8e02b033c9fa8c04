"""Console output shared by the command lines: streamed text coloured by gear,
traced as it goes, and warnings as one plain line each."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from .config import ANSI_RESET, GEAR_ANSI


def print_stream(
    stream: Iterable[Any],
    *,
    color: bool,
    writer: Any = None,
    record: Optional[Callable[[Any], Dict[str, Any]]] = None,
    header: Optional[Callable[[Any], Dict[str, Any]]] = None,
) -> Tuple[Any, bool]:
    """Print each response's text as it arrives (coloured by its gear with
    ``color``) and trace it; Ctrl-C ends the stream cleanly.

    Returns:
        ``(last response or None, interrupted)``.
    """
    last, interrupted = None, False
    try:
        for resp in stream:
            if last is None and writer and header:
                writer.header(**header(resp))
            last = resp
            text = f"{GEAR_ANSI[resp.gear]}{resp.text}{ANSI_RESET}" if color and resp.text else resp.text
            print(text, end="", flush=True)
            if writer and record:
                writer.token(**record(resp))
        print(flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(flush=True)
    return last, interrupted


def show_warning(message: Any, category: Any, *_: Any, **__: Any) -> None:
    print(f"[gearbx] warning: {message}", file=sys.stderr, flush=True)
