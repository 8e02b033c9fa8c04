"""``python -m gearbx_mlx.server``: start mlx-lm's HTTP server on the gearbox's generator.

mlx-lm's pieces run as they do in ``mlx_lm.server``: the threading HTTP
server and its SSE, the handler and its chat templates, tool calls and
logprobs, the LRU prompt cache, the FIFO request queue and its generation
thread. The flags are checked, and the model loads, before the first
request is served; requests that arrive while it loads wait in the queue.
Ctrl-C (or SIGTERM) stops after the token in flight and exits with 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import Optional, Sequence

from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import _run_http_server

from .. import launch
from ..blas import ensure_fast_blas
from ..console import error_line, show_warning, stderr_line
from ..generate import check_args, gearbox_config
from ..speculative.cli import check_speculative_args
from .generator import GearResponseGenerator
from .handler import GearAPIHandler
from .options import build_parser, check_max_tokens, check_server_args
from .provider import GearModelProvider


def serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM; the exit status (130 when stopped, 1 when the model failed to load)."""
    # The provider exists before the loading thread starts, so a load that fails at
    # once (its interrupt landing while the generator is still being built) is seen.
    provider = GearModelProvider(args, gearbox_config(args))
    generator: Optional[GearResponseGenerator] = None
    try:
        generator = GearResponseGenerator(provider, LRUPromptCache(args.prompt_cache_size))
        # mlx-lm's: on Ctrl-C it shuts the HTTP server down and joins the generation thread.
        _run_http_server(args.host, args.port, generator, handler_class=GearAPIHandler)
    except KeyboardInterrupt:
        pass  # before the server was up, or the load failed
    finally:
        if generator is not None:
            generator.stop_and_join()
    if provider.load_error is not None:
        stderr_line(error_line(provider.load_error))
        return 1
    return 130


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch.started()  # Ctrl-C raises KeyboardInterrupt again: this command handles it from here
    args = build_parser().parse_args(argv)
    warnings.showwarning = show_warning
    ensure_fast_blas(argv)  # a program on Linux: restart once with OpenBLAS preloaded, or say how
    try:
        check_max_tokens(args)
        check_args(args)
        check_speculative_args(args)  # or, without --speculative, refuses the drafter flags
        check_server_args(args)
    except (ValueError, FileNotFoundError) as e:
        stderr_line(error_line(e))
        return 1
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    launch.terminate_as_interrupt()
    try:
        return serve(args)
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # the port is taken, the address not this machine's
        stderr_line(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}")
        return 1


def entry() -> None:
    """The command's entry: :func:`main`, then leave without the interpreter's teardown.

    By then the HTTP server is shut down and the generation thread joined;
    what remains are mlx-lm's daemon handler threads (one may still be writing
    the last chunk of a stream that Ctrl-C cut). The interpreter's teardown
    ends such threads from under the native frames on their stacks, which
    aborted the process now and then ("terminate called without an active
    exception", exit -6 instead of 130); ``os._exit`` skips it.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
