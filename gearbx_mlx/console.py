"""Console output shared by the command lines: streamed text coloured by gear,
traced as it goes, and warnings as one plain line each."""

from __future__ import annotations

import os
import sys
from typing import IO, Any, Callable, Dict, Iterable, Optional, Tuple, Union

from .config import ANSI_RESET, GEAR_ANSI

#: ``--color`` values: ``auto`` (the flag alone) colours only a terminal.
COLOR_MODES: Tuple[str, ...] = ("auto", "always", "never")


def add_color_arg(parser: Any) -> None:
    """``--color [auto|always|never]``: the flag alone means ``auto``."""
    parser.add_argument(
        "--color", nargs="?", const="auto", default="never", choices=COLOR_MODES,
        help="colour each token by its gear: alone or 'auto' only when stdout is a terminal "
             "(and NO_COLOR is unset), 'always' even into a file or pipe",
    )


def use_color(mode: Union[str, bool, None], stream: Optional[IO[str]] = None) -> bool:
    """Whether to write colour codes to ``stream`` (stdout by default).

    ``auto`` (and ``True``, the old flag) colours a terminal only, so a file
    or a pipe gets plain text; ``always`` colours anything; ``never`` nothing.
    """
    if mode in (None, False, "never"):
        return False
    if mode == "always":
        return True
    if mode not in ("auto", True):
        raise ValueError(f"--color must be one of {COLOR_MODES}, got {mode!r}")
    stream = stream or sys.stdout
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def print_stream(
    stream: Iterable[Any],
    *,
    color: Union[str, bool],
    writer: Any = None,
    record: Optional[Callable[[Any], Dict[str, Any]]] = None,
    header: Optional[Callable[[Any], Dict[str, Any]]] = None,
) -> Tuple[Any, bool]:
    """Print each response's text as it arrives (coloured by its gear as
    :func:`use_color` decides for ``color``) and trace it; Ctrl-C ends the
    stream cleanly.

    Returns:
        ``(last response or None, interrupted)``.
    """
    last, interrupted = None, False
    color = use_color(color)
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
