"""mlx-lm's ``APIHandler`` with the ``gearbx`` request object and response fields.

Requests and responses are mlx-lm's (and so OpenAI's). Added:

* a request may carry ``"gearbx": {"gear", "thresholds", "speculative"}``
  (:func:`~gearbx_mlx.server.options.request_options`); wrong values get a 400;
* every choice (and every streamed chunk) carries ``"gearbx": {"tokens": [...]}``,
  one ``{"token", "gear", "entropy", "drafted", "accepted"}`` per token it covers;
* a streamed chunk carries the ``logprobs`` of its tokens when asked for;
* ``usage`` carries ``"gearbx": {"tokens_per_gear", "weight_bytes_read", ...}``;
* ``max_tokens`` above the server's ``--max-tokens`` gets a 400;
* ``n`` other than 1 gets a 400 (mlx-lm's server would answer one choice whatever it asked for);
* penalties outside OpenAI's [-2, 2] or not finite, ``logit_bias`` past the vocabulary or not
  finite, and a ``response_format`` other than text get a 400 (mlx-lm would sample from NaN
  logits, index past them, or answer free text where JSON was asked for);
* ``/health`` tells whether the model has loaded, the gear it is in, the queue's length and
  the speculative decisions measured so far;
* a client that closes its connection before the answer ends, streamed or not, stops its
  generation within a token or two (:func:`peer_closed`, checked between tokens), and its
  prompt's processing at the next chunk;
* the body is read here first (:meth:`GearAPIHandler.do_POST`): a ``Content-Length`` that is no
  count (400) or past ``--max-request-bytes`` (413), bytes that are not UTF-8 or not JSON (400)
  are refused before mlx-lm's handler runs, and OpenAI's optional fields sent as null are left
  out; chat messages need a role and text content (:func:`check_messages`: an image part is
  refused before mlx-lm would fetch its URL).
"""

from __future__ import annotations

import io
import json
import logging
import math
import select
import socket
from typing import Any, Dict, List, Optional

from mlx_lm.server import APIHandler, CompletionRequest

from ..generation import check_generation_options
from .generator import GearRequest, Response, ServerStopping
from .options import ServerDefaults, request_options, server_options

#: mlx-lm's endpoint of text completions (the others are chat completions).
TEXT_COMPLETIONS = "/v1/completions"
#: The endpoints mlx-lm's ``do_POST`` serves.
REQUEST_PATHS = (TEXT_COMPLETIONS, "/v1/chat/completions", "/chat/completions")
#: OpenAI's request fields that may be null, meaning left out (mlx-lm would read null as a value).
NULLABLE_FIELDS = ("n", "temperature", "top_p", "stream", "stop", "max_tokens", "max_completion_tokens",
                   "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "seed",
                   "user", "stream_options", "response_format", "tools", "tool_choice")
#: Request fields -> the generation options that check them (:func:`~gearbx_mlx.generation.check_generation_options`).
SAMPLING_FIELDS = (("temperature", "temp"), ("top_p", "top_p"), ("min_p", "min_p"), ("top_k", "top_k"),
                   ("seed", "seed"), ("presence_penalty", "presence_penalty"),
                   ("frequency_penalty", "frequency_penalty"), ("repetition_penalty", "repetition_penalty"))


def logprobs_content(records: List[Response], top: bool) -> List[Dict[str, Any]]:
    """``choices[].logprobs.content``: each chosen token's id and log-probability, with its
    ``top_logprobs`` most likely first where asked. (mlx-lm's server names the first of its
    unsorted top tokens instead of the chosen one.)"""
    out = []
    for r in records:
        entry: Dict[str, Any] = {"id": r.token, "logprob": r.logprob}
        if top:
            ranked = sorted(r.top_tokens, key=lambda t: -t["logprob"])
            entry.update(token=r.token_text, top_logprobs=ranked)
        out.append(entry)
    return out


def peer_closed(conn: socket.socket) -> bool:
    """Whether the client has closed its end of ``conn`` (or reset it), without waiting: the
    socket is readable and a peek reads end-of-file. Bytes waiting there (a pipelined request)
    are no close, and a socket beyond ``select``'s descriptor limit is taken as open."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except ValueError:  # a descriptor number above FD_SETSIZE: nothing known
        return False
    except OSError:  # reset by the peer
        return True


def check_request_shape(body: Any, path: str) -> None:
    """Refuse, with a 400 naming the field, request values mlx-lm's checks let through and
    then fail on after the 200 (a closed connection, a stream cut without ``[DONE]``) or
    answer with a library's message: token counts that are not integers (``true`` is one to
    Python), ``stream_options`` that is not an object, chat messages that are not objects,
    and text that is not valid Unicode (a lone surrogate from a ``\\ud800`` escape). Also
    what mlx-lm takes and then misreads: ``logit_bias`` values that are not finite numbers,
    and a ``response_format`` asking for JSON, which this server would answer with free text.
    (Penalties are sampling fields: :func:`check_request_values`.)"""
    if not isinstance(body, dict):
        return  # mlx-lm's own check answers it
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and not all(type(b) in (int, float) and math.isfinite(b) for b in bias.values()):
        raise ValueError(f"logit_bias values must be finite numbers, got {json.dumps(bias)[:60]}")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ValueError(f"response_format {json.dumps(kind)[:40]} is not supported: this server answers free "
                         "text only (no JSON mode or schema); leave response_format out or give {\"type\": \"text\"}")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and type(v) is not int:
            raise ValueError(f"{key} must be an integer, got {json.dumps(v)[:40]}")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ValueError(f"stream_options must be an object, got {json.dumps(opts)[:40]}")
    if path != TEXT_COMPLETIONS and "messages" in body:
        check_messages(body["messages"])
    bad = _invalid_text(body)
    if bad is not None:
        raise ValueError(f"{bad} is not valid Unicode text (a lone surrogate such as \\ud800)")


def check_messages(msgs: Any) -> None:
    """Chat messages as the chat template reads them, refused with a 400 naming the message: a
    list of objects, each with a string ``role`` and a ``content`` that is a string, null or a
    list of text parts (``{"type": "text", "text": ...}``). Image parts are refused here, before
    mlx-lm's handler would fetch their URLs for a model that reads text only."""
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise ValueError("messages must be a list of objects with a role and content, got "
                         f"{json.dumps(msgs)[:40]}")
    for i, m in enumerate(msgs):
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] needs a role (a string), got {json.dumps(m.get('role'))[:40]}")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got "
                             f"{json.dumps(content)[:40]}")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported (this server's model "
                                 f"reads text), got type {json.dumps(kind)[:40]}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}] needs a text (a string)")


def _invalid_text(x: Any, where: str = "") -> Optional[str]:
    """Where ``x`` holds a string that UTF-8 cannot encode, or None."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return where or "the request"
        return None
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        bad = _invalid_text(v, (f"{where}.{k}" if where else k) if isinstance(k, str) else f"{where}[{k}]")
        if bad is not None:
            return bad
    return None


def check_request_values(body: Dict[str, Any], values: Dict[str, Any], path: str) -> None:
    """What mlx-lm's server lets through but the generation refuses after the response has begun
    (then the client would get no answer at all): a 400 naming the field instead.

    Args:
        body: the request body; values: its sampling fields as the handler read them (with
            the server's defaults); path: the endpoint.

    Raises:
        ValueError: the first field out of range.
    """
    for field, option in SAMPLING_FIELDS:
        try:
            check_generation_options(**{option: values[field]})
        except ValueError as e:
            raise ValueError(f"{field}{str(e)[len(option):]}") from None
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(w, str) for w in stop)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if path == TEXT_COMPLETIONS and not isinstance(body.get("prompt"), str):
        raise ValueError(f"prompt must be a string, got {body.get('prompt')!r}")


class GearAPIHandler(APIHandler):
    """mlx-lm's handler with the gearbox's request object, response fields and checks."""

    gear_request: Optional[GearRequest] = None

    def do_POST(self) -> None:
        """mlx-lm's, after reading the body here: a ``Content-Length`` that is not a count gets a
        400 and one above ``--max-request-bytes`` a 413, both without reading on (mlx-lm's would
        read until the client closes, or any size); a body that is not UTF-8 or not JSON gets a
        400 and a log line of its first bytes (mlx-lm's logs it whole, or answers nothing); and
        OpenAI's optional fields given as null are taken as left out."""
        size = self.headers.get("Content-Length")
        limit = getattr(self.response_generator.cli_args, "max_request_bytes", ServerDefaults().max_request_bytes)
        if size is None or self.path not in REQUEST_PATHS:
            return super().do_POST()  # mlx-lm's 404 and 411
        if not size.strip().isdigit():
            return self._refuse(400, f"Invalid Content-Length header: {size[:40]!r}")
        if int(size) > limit:
            return self._refuse(413, f"the request body ({int(size)} bytes) exceeds this server's limit of {limit} "
                                     "bytes (--max-request-bytes)")
        raw = self.rfile.read(int(size))
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            return self._refuse(400, f"the request body is not UTF-8 text ({e.reason} at byte {e.start})")
        except json.JSONDecodeError as e:
            logging.error("invalid JSON in a request body (%s): %r", e, raw[:200])
            return self._refuse(400, f"Invalid JSON in request body: {e}")
        except RecursionError:
            return self._refuse(400, "Invalid JSON in request body: nested too deeply")
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if not (v is None and k in NULLABLE_FIELDS)}
            raw = json.dumps(body).encode()
            self.headers.replace_header("Content-Length", str(len(raw)))
        wire = self.rfile
        self.rfile = io.BytesIO(raw)
        try:
            super().do_POST()
        finally:
            self.rfile = wire

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with mlx-lm's error body and close the connection (its body is unread)."""
        self.close_connection = True
        self._send_json(status, {"error": message})

    def validate_model_parameters(self) -> None:
        check_request_shape(self.body, self.path)
        super().validate_model_parameters()
        cli = self.response_generator.cli_args
        cap = getattr(cli, "max_tokens_cap", cli.max_tokens)
        if cap is not None and self.max_tokens > cap:
            key = "max_completion_tokens" if self.body.get("max_completion_tokens") is not None else "max_tokens"
            raise ValueError(f"{key} {self.max_tokens} exceeds this server's cap of {cap} (--max-tokens)")
        n = self.body.get("n", 1)
        if type(n) is not int or n != 1:  # bool is an int subclass: refused too
            raise ValueError(f"n must be 1: this server answers one choice per request, got {n!r}")
        self.gearbx = request_options(self.body.get("gearbx"), server_options(cli), bool(cli.speculative))
        if self.seed is None:
            self.seed = cli.seed
        check_request_values(self.body, {f: getattr(self, f) for f, _ in SAMPLING_FIELDS}, self.path)
        if isinstance(self.stream_options, dict):  # OpenAI's include_usage defaults to false
            self.stream_options = {**self.stream_options, "include_usage": bool(self.stream_options.get("include_usage"))}

    def handle_chat_completions(self) -> CompletionRequest:
        return self._gear_request(super().handle_chat_completions())

    def handle_text_completions(self) -> CompletionRequest:
        return self._gear_request(super().handle_text_completions())

    def handle_completion(self, request: CompletionRequest, stop_words: List[str]) -> None:
        """mlx-lm's, except that a request the server's shutdown cuts short ends there: a stream
        without ``[DONE]`` (its chunks so far carry no finish reason), and one log line rather
        than the HTTP server's traceback."""
        try:
            super().handle_completion(request, stop_words)
        except ServerStopping as e:
            logging.warning("request cut short: %s", e)
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):  # the client went away mid-answer: its business
            read = len(self.gear_request.records) if self.gear_request is not None else 0
            logging.info("client disconnected before the answer ended (after %d tokens)", read)
            self.close_connection = True

    def _check_client(self) -> None:
        """Before each token: end the answer as a failed write does (mlx-lm's ``finally`` then
        stops the generation) once the client has closed its connection. A streamed answer
        would also meet the close on a write, but a non-streamed one writes nothing before its
        last token: its generation ran on to ``max_tokens`` for nobody, holding the model."""
        if peer_closed(self.connection):
            raise ConnectionResetError("the client closed the connection")

    def _gear_request(self, request: CompletionRequest) -> GearRequest:
        self.gear_request = GearRequest.of(request, self.gearbx)
        self.gear_request.check_client = self._check_client
        self.gear_request.max_tokens_given = any(
            self.body.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
        return self.gear_request

    def _set_completion_headers(self, status_code: int = 200) -> None:
        # mlx-lm answers 404 to every failure of a queued request; answer the request's own status.
        error = self.gear_request.error if self.gear_request is not None else None
        if status_code == 404 and error is not None:  # ValueError: the request's values, as mlx-lm's own checks
            status_code = getattr(error, "status", 400 if isinstance(error, ValueError) else 500)
        super()._set_completion_headers(status_code)

    def generate_response(self, text: str, finish_reason: Optional[str], *args: Any, **kwargs: Any) -> dict:
        response = super().generate_response(text, finish_reason, *args, **kwargs)
        req = self.gear_request
        if req is None:
            return response
        new = req.records[req.sent:]
        req.sent = len(req.records)
        choice = response["choices"][0]
        covered = new if self.stream else req.records
        choice["gearbx"] = {"tokens": [r.extension() for r in covered]}
        if covered and (self.logprobs or self.top_logprobs > 0):
            choice["logprobs"] = {"content": logprobs_content(covered, self.top_logprobs > 0)}
        if "usage" in response and req.usage is not None:
            response["usage"]["gearbx"] = req.usage
        return response

    def completion_usage_response(self, *args: Any, **kwargs: Any) -> dict:
        response = super().completion_usage_response(*args, **kwargs)
        if self.gear_request is not None and self.gear_request.usage is not None:
            response["usage"]["gearbx"] = self.gear_request.usage
        return response

    def handle_health_check(self) -> None:
        gen = self.response_generator
        provider = gen.model_provider
        healthy = gen.is_healthy and provider.loaded.is_set()  # requests sent while loading wait for it
        body = {"status": "ok" if healthy else "loading" if gen.is_healthy else "unavailable",
                "gearbx": {"loaded": provider.loaded.is_set(),
                           "gear": provider.gearbox.manager.gear if provider.gearbox is not None else None,
                           "queued": gen.requests.qsize(),
                           "speculative_plans": {f"{mode} {'greedy' if greedy else 'sampled'}": plan.chosen()
                                                 for (mode, greedy), plan in dict(provider.plans).items()}}}
        self._send_json(200 if healthy else 503, body)

    def handle_models_request(self) -> None:
        provider = self.response_generator.model_provider
        self._send_json(200, {"object": "list", "data": [
            {"id": provider.model_id, "object": "model", "created": self.created, "owned_by": "gearbx_mlx"}]})

    def _send_json(self, status: int, body: Dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
