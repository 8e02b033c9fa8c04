"""Flags of ``python -m gearbx_mlx.server`` and the ``gearbx`` object of a request.

The flags are the generate CLI's (model, gears, store, calibration,
speculative decoding, KV cache: :func:`gearbx_mlx.generate.build_parser`,
less the few that only make sense for one prompt on a terminal) plus
``mlx_lm.server``'s server flags under their mlx-lm names.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..config import GEARS
from ..generate import build_parser as generate_parser
from ..speculative.plan import MODES

#: Generate flags with no meaning for a server: prompts and their output come with each request.
CLI_ONLY = ("--prompt", "--system-prompt", "--trace", "--color", "--quiet", "--ignore-chat-template", "--sparse-gear")
#: ``gearbx.gear`` values: entropy routing, or one static gear.
GEAR_CHOICES: Tuple[str, ...] = ("dynamic",) + GEARS
#: ``gearbx.speculative`` values.
SPECULATIVE_CHOICES: Tuple[str, ...] = ("off",) + MODES
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class ServerDefaults:
    """Defaults of the server flags (mlx-lm's)."""

    host: str = "127.0.0.1"
    port: int = 8080
    prompt_cache_size: int = 10
    log_level: str = "INFO"
    allowed_origins: str = "*"
    chat_template_args: str = "{}"
    #: A request's max_tokens when it names none (mlx_lm.server's default).
    max_tokens: int = 512
    #: The largest request body read: 16 MiB holds a prompt far longer than any model's context.
    max_request_bytes: int = 16 * 2**20


#: mlx-lm's ``ModelProvider``/``APIHandler`` read these from the flags; the server fixes them.
FIXED = dict(adapter_path=None, draft_model=None, pipeline=False, num_draft_tokens=0, prefill_step_size=2048,
             prompt_cache_bytes=None, decode_concurrency=1, prompt_concurrency=1,
             prompt=None, system_prompt=None, trace=None, color="never", quiet=True, ignore_chat_template=False)


def _drop_flags(parser: argparse.ArgumentParser, flags: Tuple[str, ...]) -> None:
    """Remove the options ``flags`` from ``parser`` (argparse has no public call for it)."""
    for action in list(parser._actions):
        if any(s in flags for s in action.option_strings):
            parser._remove_action(action)
            for group in parser._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
            for s in action.option_strings:
                parser._option_string_actions.pop(s, None)


def build_parser() -> argparse.ArgumentParser:
    """The generate CLI's model, gear and speculative flags plus mlx-lm's server flags."""
    p = generate_parser()
    p.prog = "python -m gearbx_mlx.server"
    p.description = ("An OpenAI-compatible HTTP server (mlx_lm.server's) whose tokens come from entropy-routed "
                     "generation: each decode step runs in the 4-bit, 8-bit or full-precision gear.")
    _drop_flags(p, CLI_ONLY)
    d = ServerDefaults()
    for action in p._actions:
        if "--max-tokens" in action.option_strings:
            action.default = None
            action.help = (f"max_tokens of a request that names none (default {d.max_tokens}, as mlx_lm.server); "
                           "when given, also the most a request may ask for (default: no cap but the model's "
                           "context)")
    s = p.add_argument_group("server options (as mlx_lm.server)")
    s.add_argument("--host", default=d.host, help="host for the HTTP server (default %(default)s)")
    s.add_argument("--port", type=int, default=d.port, help="port for the HTTP server (default %(default)s)")
    s.add_argument("--allowed-origins", type=lambda x: x.split(","), default=d.allowed_origins,
                   help="allowed CORS origins, comma-separated (default *)")
    s.add_argument("--prompt-cache-size", type=int, default=d.prompt_cache_size,
                   help="most distinct KV caches the prompt cache holds (default %(default)s)")
    s.add_argument("--chat-template", default="", help="a chat template for the tokenizer")
    s.add_argument("--use-default-chat-template", action="store_true", help="use the tokenizer's default template")
    s.add_argument("--chat-template-args", type=json.loads, default=d.chat_template_args,
                   help="JSON arguments for apply_chat_template, e.g. '{\"enable_thinking\":false}'")
    s.add_argument("--trust-remote-code", action="store_true", help="trust remote code for the tokenizer")
    s.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level)
    s.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body the server reads; a larger one gets a 413 (default %(default)s)")
    p.set_defaults(**FIXED)
    return p


def check_max_tokens(args: argparse.Namespace) -> None:
    """Resolve ``--max-tokens``: given, it is each request's default and cap (``max_tokens_cap``),
    so it has no "-1: no limit" here (checked before the generate CLI's checks, whose message
    offers -1); not given, a request's default is mlx_lm.server's and only the model's context
    caps it."""
    if args.max_tokens is None:
        args.max_tokens, args.max_tokens_cap = ServerDefaults().max_tokens, None
        return
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1 for the server (it caps each request; a request without "
                         f"max_tokens gets the cap, or what the model's context leaves), got {args.max_tokens}")
    args.max_tokens_cap = args.max_tokens


def check_server_args(args: argparse.Namespace) -> None:
    """The server's own flags (the generate flags are checked by the generate CLI's checks)."""
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    try:
        socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {args.host}: no such address ({getattr(e, 'strerror', None) or e})") from None
    if args.prompt_cache_size < 0:
        raise ValueError(f"--prompt-cache-size must be >= 0, got {args.prompt_cache_size}")
    if not isinstance(args.chat_template_args, dict):
        raise ValueError(f"--chat-template-args must be a JSON object, got {args.chat_template_args!r}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {args.max_request_bytes}")


@dataclass(frozen=True)
class GearOptions:
    """One request's routing, from its ``gearbx`` object and the server's flags.

    Attributes:
        gear: ``"dynamic"`` (entropy routing) or the static gear.
        thresholds: ``(low, high)`` entropy thresholds in bits, or None for the server's.
        speculative: ``"off"``, ``"auto"`` or ``"force"``.
    """

    gear: str = "dynamic"
    thresholds: Optional[Tuple[float, float]] = None
    speculative: str = "off"

    def to_dict(self) -> Dict[str, Any]:
        return {"gear": self.gear, "thresholds": list(self.thresholds) if self.thresholds else None,
                "speculative": self.speculative}


def server_options(args: argparse.Namespace) -> GearOptions:
    """What a request without a ``gearbx`` object gets."""
    return GearOptions(gear=args.static_gear or "dynamic", speculative=args.speculative or "off")


def _thresholds(value: Any) -> Tuple[float, float]:
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    if not ok:
        raise ValueError(f"gearbx.thresholds must be two finite numbers of bits [low, high], got {value!r}")
    low, high = float(value[0]), float(value[1])
    if not 0 <= low < high:
        raise ValueError(f"gearbx.thresholds must have 0 <= low < high, got [{low}, {high}]")
    return low, high


def request_options(value: Any, default: GearOptions, speculative_loaded: bool) -> GearOptions:
    """The ``gearbx`` object of a request body (None: the server's defaults).

    Unknown keys are ignored, as the OpenAI API ignores unknown fields.

    Raises:
        ValueError: one message naming the field and what it must be.
    """
    if value is None:
        return default
    if not isinstance(value, dict):
        raise ValueError(f"gearbx must be an object, got {value!r}")
    gear = value.get("gear")
    gear = default.gear if gear is None else gear  # null: the server's, as for speculative
    if gear not in GEAR_CHOICES:
        raise ValueError(f"gearbx.gear must be one of {', '.join(GEAR_CHOICES)}, got {gear!r}")
    spec = value.get("speculative", default.speculative)
    spec = "off" if spec is False or spec is None else spec
    if spec not in SPECULATIVE_CHOICES:
        raise ValueError(f"gearbx.speculative must be one of {', '.join(SPECULATIVE_CHOICES)}, got {spec!r}")
    if spec != "off" and not speculative_loaded:
        raise ValueError("gearbx.speculative needs a server started with --speculative (its drafter is built at load)")
    thresholds = _thresholds(value["thresholds"]) if value.get("thresholds") is not None else None
    if spec != "off" and gear != "dynamic":
        raise ValueError(f"gearbx.gear {gear!r} cannot be combined with speculative decoding, which outputs the high "
                         "gear's tokens exactly: give gear 'dynamic' or speculative 'off'")
    if thresholds is not None and gear != "dynamic" and spec == "off":
        raise ValueError(f"gearbx.thresholds apply to the dynamic policy: the request's gear is the static {gear!r}")
    if thresholds is not None and spec != "off":
        raise ValueError("gearbx.thresholds apply to the dynamic policy, and speculative decoding outputs the high "
                         "gear's tokens (its drafter stops by its own calibrated entropy): give speculative 'off'")
    return GearOptions(gear=gear, thresholds=thresholds, speculative=spec)
