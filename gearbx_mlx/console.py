"""Console output shared by the command lines: streamed text coloured by gear,
traced as it goes, warnings and errors as one plain line each, and the checks
that refuse a flag with one such line."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import IO, Any, Callable, Dict, Iterable, Optional, Tuple, Union

from .config import ANSI_RESET, GEAR_ANSI
from .telemetry.trace import sigint_deferred

#: ``--color`` values: ``auto`` (the flag alone) colours only a terminal.
COLOR_MODES: Tuple[str, ...] = ("auto", "always", "never")


class CommandParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one ``error:`` line naming the flag (argparse's own
    prints its whole usage block first), then exit status 2 as argparse's."""

    def error(self, message: str) -> Any:  # argparse's signature: never returns
        self.exit(2, f"error: {message} ({self.prog} --help lists the flags)\n")


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
            # Traced and counted together: Ctrl-C between the two would leave a
            # summary that disagrees with the trace by one token.
            with sigint_deferred():
                if last is None and writer and header:
                    writer.header(**header(resp))
                if writer and record:
                    writer.token(**record(resp))
                last = resp
            text = f"{GEAR_ANSI[resp.gear]}{resp.text}{ANSI_RESET}" if color and resp.text else resp.text
            print(text, end="", flush=True)
        print(flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(flush=True)
    except OSError as e:  # stdout failed (a closed pipe, a full disk): the caller records what was generated
        e.last_response = last  # type: ignore[attr-defined]
        raise
    return last, interrupted


def stderr_line(text: str) -> None:
    """``text`` and its newline on stderr in one write: ``print`` writes them apart, and a line
    another thread printed in between (the server's loader, say) would join this one."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def mib(n: float) -> str:
    """``n`` bytes as the summaries print them: ``12.3 MiB``."""
    return f"{n / 2**20:.1f} MiB"


def say(args: Any, message: str) -> None:
    """``[gearbx] MESSAGE`` on stderr, from rank 0 only (``args.rank``; a run of one process is rank 0),
    and not with ``--quiet`` (``args.quiet``: the text only; warnings and errors still show)."""
    if getattr(args, "rank", 0) == 0 and not getattr(args, "quiet", False):
        stderr_line(f"[gearbx] {message}")


def show_warning(message: Any, category: Any, *_: Any, **__: Any) -> None:
    stderr_line(f"[gearbx] warning: {message}")


def error_line(e: BaseException) -> str:
    """``error: MESSAGE`` on one line, whatever the message holds (a server's or a
    template's text may carry newlines)."""
    return "error: " + (" ".join(str(e).split()) or type(e).__name__)


#: What a command line reports as one line instead of a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, OSError, KeyboardInterrupt)


def exit_status(e: BaseException) -> int:
    """Print ``e`` as one line on stderr and return the exit status: 130 for
    Ctrl-C (``interrupted``), 2 for a user error (:data:`USER_ERRORS`)."""
    if isinstance(e, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return 130
    print(error_line(e), file=sys.stderr)
    return 2


def read_stdin_text(what: str = "the prompt") -> str:
    """All of stdin as UTF-8 text.

    Raises:
        ValueError: stdin is not UTF-8 (names the first bad byte and its offset).
    """
    raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"stdin is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): pipe text as {what}"
        ) from None


def check_utf8(text: str, what: str) -> str:
    """``text`` if it encodes as UTF-8; else ValueError naming ``what`` and the first bad byte.

    A command-line argument that is not UTF-8 arrives as lone surrogates
    (Python's ``surrogateescape``), which the tokenizer refuses with a
    TypeError of its own after the model has loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"lone surrogate U+{bad:04X}"
        raise ValueError(f"{what} is not UTF-8 text ({byte} at character {e.start}): pass UTF-8 text") from None
    return text


def check_flag(ok: bool, flag: str, value: Any, want: str) -> None:
    """Raise ``ValueError("FLAG must be WANT, got VALUE")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{flag} must be {want}, got {value!r}")


def refuse_unused(flags: Iterable[Tuple[str, bool]], verbs: Tuple[str, str], rest: str) -> None:
    """Flags given that would do nothing: one ValueError naming each, ``"FLAG[, FLAG...] VERB REST"``.

    ``flags`` are ``(flag, given)`` pairs; ``verbs`` the verb for one flag and for several
    (``("applies", "apply")``). A command calls it before anything loads."""
    given = [flag for flag, on in flags if on]
    if given:
        raise ValueError(f"{', '.join(given)} {verbs[len(given) > 1]} {rest}")


def refuse_kv_flags_unused(args: Any) -> None:
    """Without ``--kv-bits`` the cache stays float: the other KV flags given are refused, one error naming them.

    ``--kv-rotation`` counts where it differs from its default ``auto``; a command without
    ``--quantized-kv-start`` leaves it out."""
    if getattr(args, "kv_bits", None) is not None:
        return
    refuse_unused((("--kv-group-size", getattr(args, "kv_group_size", None) is not None),
                   ("--quantized-kv-start", getattr(args, "quantized_kv_start", None) is not None),
                   ("--kv-rotation", getattr(args, "kv_rotation", "auto") != "auto")),
                  ("applies", "apply"), "to a quantized KV cache: give --kv-bits too (without it the cache stays float)")


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def kv_line(kv: Dict[str, Any]) -> str:
    """One line: the KV cache's kind, settings and bytes per token."""
    per = kv.get("bytes_per_token")
    size = f"{per / 1024:.1f} KiB per token" if per else "bytes per token unknown"
    if kv["kind"] == "float":
        return f"KV cache: float (mlx-lm's), {size} at {kv.get('dtype', 'float16')}"
    what = "rotated" if kv["kind"] == "rotated" else "mlx-lm affine"
    parts = [f"{'/'.join(kv['rotation'])}"] if kv["kind"] == "rotated" else []
    if kv.get("lambda"):
        parts.append(f"λ from {kv.get('statistics')}")
    if kv.get("key_offset"):
        parts.append("key offset")
    wide = [i for i, b in enumerate(kv.get("layer_bits") or []) if b != kv["bits"]]
    if wide:
        parts.append(f"layers {','.join(map(str, wide))} at {kv['layer_bits'][wide[0]]} bits")
    start = kv["quantized_kv_start"]
    return (f"KV cache: {what} {kv['bits']}-bit g{kv['group_size']}" + (f" ({', '.join(parts)})" if parts else "")
            + (f", quantized from token {start}" if start else ", quantized from the first token")
            + f": {kv['bits_per_element']:.2f} bits per element, {size}"
            + (f" ({kv['ratio_to_float']:.2f}x the {kv['float_dtype']} cache)" if kv.get("ratio_to_float")
               else f" ({kv['ratio_to_float16']:.2f}x float16)" if kv.get("ratio_to_float16") else ""))
