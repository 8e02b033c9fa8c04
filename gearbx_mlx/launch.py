"""Start-up of the package's commands: Ctrl-C while their imports load prints one line and exits 130.

``python -m gearbx_mlx.generate`` (and every other command) imports the
package before any of the command's code runs, and the package imports MLX,
mlx-lm and transformers: a second or more in which Python's own SIGINT
handler would end the process with a traceback from deep inside some import.

The package's ``__init__`` calls :func:`guard_start_up` before anything else.
In a process started as one of the commands (``python -m`` one of
:data:`COMMAND_MODULES`, or a console script of :data:`COMMAND_SCRIPTS`) it
installs a SIGINT handler that writes ``interrupted`` and exits 130 at once
(nothing is open yet: no trace, no model); anywhere else (a library import, a
test run, an interactive session) it does nothing. Each command's ``main``
calls :func:`started` first, which hands SIGINT back to Python's handler:
from then on Ctrl-C raises ``KeyboardInterrupt`` and the command's own
handling applies (it names the stage and closes the trace).

Standard library only: this runs before anything heavy is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

#: Modules whose ``python -m`` run is one of the package's commands.
COMMAND_MODULES = (
    "gearbx_mlx.generate", "gearbx_mlx.evaluate", "gearbx_mlx.bench", "gearbx_mlx.analyze", "gearbx_mlx.selftest",
    "gearbx_mlx.server", "gearbx_mlx.remote", "gearbx_mlx.remote.cli",
)
#: The console scripts of pyproject.toml's ``[project.scripts]``.
COMMAND_SCRIPTS = ("gearbx-generate", "gearbx-analyze", "gearbx-remote", "gearbx-selftest", "gearbx-bench",
                   "gearbx-server")
#: What a Ctrl-C during start-up writes to stderr; the exit status is 130 (128 + SIGINT).
MESSAGE = "interrupted"
EXIT_STATUS = 130


def command_of(argv0: str, orig_argv: Sequence[str]) -> Optional[str]:
    """The command this process was started as, or None.

    Args:
        argv0: ``sys.argv[0]`` while the package is imported: ``"-m"`` while
            ``python -m`` still imports the parents of the module it runs,
            else the script's path.
        orig_argv: ``sys.orig_argv``, the interpreter's own command line.
    """
    if argv0 == "-m":
        for i, arg in enumerate(orig_argv[1:], start=1):
            if arg == "-m":
                module = orig_argv[i + 1] if i + 1 < len(orig_argv) else ""
                return module if module in COMMAND_MODULES else None
            if arg.startswith("-m"):
                return arg[2:] if arg[2:] in COMMAND_MODULES else None
        return None
    name = Path(argv0).name
    name = name[: -len(".exe")] if name.endswith(".exe") else name
    return name if name in COMMAND_SCRIPTS else None


def _exit_interrupted(signum: int, frame: Any) -> None:
    os.write(2, f"{MESSAGE}\n".encode())
    os._exit(EXIT_STATUS)  # mid-import: nothing to flush or close, and no library's cleanup to wait for


def guard_start_up() -> bool:
    """In a process started as a command, make Ctrl-C exit at once with one line (see the module doc).

    Returns:
        True if the handler was installed. Not where SIGINT is ignored (a
        background job keeps ignoring it) or off the main thread.
    """
    if command_of(sys.argv[0] if sys.argv else "", getattr(sys, "orig_argv", ())) is None:
        return False
    return _take_over(signal.SIGINT, signal.default_int_handler, _exit_interrupted)


def _take_over(sig: int, expected: Any, handler: Any) -> bool:
    """Install ``handler`` for ``sig`` where its handler is still ``expected`` (Python's or the
    system's default) and this is the main thread; True if it did."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(sig) is not expected:
        return False
    signal.signal(sig, handler)
    return True


def started() -> None:
    """A command's ``main`` has begun: Ctrl-C raises ``KeyboardInterrupt`` again (no-op if
    :func:`guard_start_up` installed nothing)."""
    if signal.getsignal(signal.SIGINT) is _exit_interrupted and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def terminate_as_interrupt() -> bool:
    """SIGTERM (``kill``, ``timeout``) stops a command as Ctrl-C does: a clean stop after the token
    in flight, its trace summarized and marked interrupted, exit status 130. Not where SIGTERM
    is ignored or handled already, or off the main thread. Returns True if installed."""
    return _take_over(signal.SIGTERM, signal.SIG_DFL, _raise_interrupt)


__all__ = ["COMMAND_MODULES", "COMMAND_SCRIPTS", "EXIT_STATUS", "MESSAGE", "command_of", "guard_start_up",
           "started", "terminate_as_interrupt"]
