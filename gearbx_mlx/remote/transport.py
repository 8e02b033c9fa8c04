"""One bounded HTTP exchange with a completion server: time, bytes and events all capped.

A server is untrusted input. :class:`Request` sends one POST and reads the
answer as server-sent events or as one JSON body, and whatever the server
does, the exchange ends:

* **no progress for** ``idle_timeout`` **seconds** ends it. Progress is a
  whole SSE event, or the status line of the answer; keep-alive comments and
  bytes trickled into a line that never ends are not progress.
* **a whole answer takes at most** ``deadline`` **seconds**, from the request
  to the last byte.
* **at most** :meth:`Limits.answer_bytes` **bytes** are read per answer, one
  event or line holds at most ``max_event_bytes``, an HTTP error body is read
  to ``max_error_bytes`` only, and a stream may hold at most
  :meth:`Limits.max_events` events. Nothing of the answer is kept beyond the
  event being parsed (a non-streamed answer: its one body, within the budget).

Socket timeouts alone cannot promise this (a read returns as soon as one byte
arrives), so a watchdog thread shuts the socket down when the idle timer or
the deadline runs out; the blocked read then returns and the exchange raises
:class:`ConnectionError` saying which limit ended it.

The API key is sent only over https or to this machine (loopback) unless the
caller allows plain http: a key on a plain-http connection to another host
can be read on the way.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional


@dataclass(frozen=True)
class Limits:
    """Every bound of one request/answer exchange (seconds and bytes)."""

    connect_timeout: float = 5.0  #: to open the TCP (and TLS) connection
    idle_timeout: float = 120.0  #: without progress (``--timeout``)
    deadline: float = 600.0  #: for a whole answer (``--deadline``)
    max_event_bytes: int = 1 << 20  #: one SSE line or event
    max_error_bytes: int = 4096  #: read of an HTTP error body (300 characters are shown)
    base_bytes: int = 1 << 20  #: answer budget: a fixed part ...
    bytes_per_token: int = 32 << 10  #: ... plus this per requested token (top-20 logprobs take ~2 KiB)
    extra_events: int = 64  #: events beyond two per requested token (role, finish, usage events)

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "idle_timeout", "deadline"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("max_event_bytes", "max_error_bytes", "base_bytes", "bytes_per_token", "extra_events"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    def answer_bytes(self, max_tokens: int) -> int:
        """Bytes one answer of up to ``max_tokens`` tokens may take."""
        return self.base_bytes + self.bytes_per_token * max(int(max_tokens), 1)

    def max_events(self, max_tokens: int) -> int:
        """SSE events one answer of up to ``max_tokens`` tokens may hold."""
        return 2 * max(int(max_tokens), 1) + self.extra_events


def is_loopback(host: Optional[str]) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_key_transport(url: str, allow_plain_http: bool = False) -> None:
    """Refuse to send an API key over plain http to another machine, unless allowed.

    Raises:
        ValueError: naming the URL and the two ways out.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "http" and not is_loopback(parsed.hostname) and not allow_plain_http:
        raise ValueError(
            f"--api-key would be sent unencrypted to {parsed.scheme}://{parsed.netloc}: use an https URL, "
            "or pass --allow-plain-http-key if the network to that host is trusted"
        )


class _Watchdog:
    """Shuts a socket down when the idle timer or the deadline runs out."""

    def __init__(self, sock: socket.socket, idle: float, deadline_at: float) -> None:
        self._sock, self._idle, self._deadline_at = sock, idle, deadline_at
        self._last = time.monotonic()
        self._done = threading.Event()
        self.expired: Optional[str] = None  # "idle" or "deadline" once it fired
        self._thread = threading.Thread(target=self._run, name="gearbx-http-watchdog", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._done.is_set():
            now = time.monotonic()
            idle_at = self._last + self._idle
            until = min(idle_at, self._deadline_at)
            if now >= until:
                self.expired = "deadline" if now >= self._deadline_at else "idle"
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            self._done.wait(min(until - now, 0.25))

    def stop(self) -> None:
        self._done.set()


class HTTPStatusError(ConnectionError):
    """The server answered with an HTTP error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def raise_if_error(obj: Dict[str, Any], url: str) -> None:
    """An answer of the form ``{"error": ...}`` (no ``choices``) as ConnectionError."""
    if "error" in obj and "choices" not in obj:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise ConnectionError(f"{url} reported an error: {str(msg)[:300]}")


class Request:
    """One POST to ``url`` with a JSON body; read it as SSE or as one JSON answer.

    Args:
        limits: the exchange's bounds (:class:`Limits`).
        api_key: sent as ``Authorization: Bearer`` (see :func:`check_key_transport`).
        max_tokens: the answer's token budget, which sizes the byte and event
            budgets (default: the body's ``max_tokens``, else 256).
        allow_plain_http_key: send ``api_key`` over plain http to another host.
    """

    def __init__(
        self,
        url: str,
        body: Dict[str, Any],
        limits: Optional[Limits] = None,
        api_key: Optional[str] = None,
        max_tokens: Optional[int] = None,
        allow_plain_http_key: bool = False,
    ) -> None:
        self.url, self.body = url, body
        self.limits = limits or Limits()
        self.api_key = api_key
        if api_key:
            check_key_transport(url, allow_plain_http_key)
        tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
        self.max_tokens = tokens if isinstance(tokens, int) and tokens > 0 else 256
        self.budget = self.limits.answer_bytes(self.max_tokens)
        self.read = 0  # bytes of the answer read so far
        self._conn: Optional[http.client.HTTPConnection] = None
        self._resp: Optional[http.client.HTTPResponse] = None
        self._dog: Optional[_Watchdog] = None

    # -- opening ----------------------------------------------------------------------
    def open(self) -> "Request":
        parsed = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(parsed.hostname, parsed.port, timeout=self.limits.connect_timeout)
        data = json.dumps(self.body).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(data)),
                   "Accept": "text/event-stream" if self.body.get("stream") else "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            self._resp = self._send(parsed.path, data, headers)
        except ConnectionError:
            self.close()
            raise
        if self._resp.status != 200:
            status = self._resp.status
            detail = self._read_some(self.limits.max_error_bytes)[:300].decode("utf-8", "replace").strip()
            self.close()
            detail = " ".join(detail.split())  # one line, whatever the server sent
            raise HTTPStatusError(status, f"{self.url} answered HTTP {status}: {detail or '(no body)'}")
        return self

    def _send(self, path: str, data: bytes, headers: Dict[str, str]) -> http.client.HTTPResponse:
        """Connect, send, and wait for the status line; every failure as ConnectionError."""
        assert self._conn is not None
        try:
            self._conn.connect()
        except (socket.timeout, TimeoutError):
            raise ConnectionError(
                f"could not connect to {self.url} within {self.limits.connect_timeout:g} s: is the host up? "
                "(--connect-timeout)"
            ) from None
        except ConnectionRefusedError:
            raise ConnectionError(f"connection refused by {self.url}: is the server running on that port?") from None
        except socket.gaierror as e:
            raise ConnectionError(f"cannot resolve the host of {self.url}: {e.strerror}") from None
        except OSError as e:
            raise ConnectionError(f"cannot reach {self.url}: {e}") from None
        sock = self._conn.sock
        # Connected: the watchdog bounds everything from here, whatever the server trickles.
        sock.settimeout(self.limits.idle_timeout)
        self._dog = _Watchdog(sock, self.limits.idle_timeout, time.monotonic() + self.limits.deadline)
        try:
            self._conn.request("POST", path, body=data, headers=headers)
            resp = self._conn.getresponse()
            self._raise_expired()  # headers cut short by the watchdog parse as complete
        except (OSError, http.client.HTTPException) as e:
            self._raise_expired()
            if isinstance(e, (socket.timeout, TimeoutError)):
                raise ConnectionError(self._idle_message("answering")) from None
            raise ConnectionError(f"{self.url} closed the connection before answering ({e!r})") from None
        self._dog.progress()  # the status line and headers are in
        return resp

    # -- limits -----------------------------------------------------------------------
    def _idle_message(self, doing: str) -> str:
        if doing == "answering":
            return (f"no answer from {self.url} within {self.limits.idle_timeout:g} s: "
                    "is the server busy or stuck? (--timeout)")
        return (f"{self.url} made no progress {doing} for {self.limits.idle_timeout:g} s "
                "(keep-alive comments and partial lines do not count): is the server stuck? (--timeout)")

    def _raise_expired(self) -> None:
        """If the watchdog ended the exchange, say which limit did."""
        if self._dog is None or self._dog.expired is None:
            return
        if self._dog.expired == "deadline":
            raise ConnectionError(
                f"{self.url} did not finish its answer within {self.limits.deadline:g} s (--deadline)"
            )
        started = self._resp is not None
        raise ConnectionError(self._idle_message("in its answer" if started else "answering"))

    def _count(self, n: int) -> None:
        self.read += n
        if self.read > self.budget:
            raise ValueError(
                f"the answer from {self.url} exceeds {self.budget / 2**20:.1f} MiB for {self.max_tokens} "
                "tokens: stopped reading (is it a completion server?)"
            )

    def _read_some(self, n: int) -> bytes:
        """Up to ``n`` bytes of the body; b"" on any failure (used for error bodies)."""
        assert self._resp is not None
        try:
            return self._resp.read(n)
        except (OSError, http.client.HTTPException):
            return b""

    # -- reading ----------------------------------------------------------------------
    def json(self) -> Dict[str, Any]:
        """The whole answer as one JSON object (at most :attr:`budget` bytes)."""
        if self._resp is None:
            self.open()
        assert self._resp is not None
        try:
            length = self._resp.getheader("Content-Length")
            if length and length.strip().isdigit() and int(length) > self.budget:
                self._count(int(length))  # raises before reading anything
            parts: List[bytes] = []
            while True:
                try:
                    block = self._resp.read1(1 << 16)
                except (OSError, http.client.HTTPException) as e:
                    self._raise_expired()
                    if isinstance(e, (socket.timeout, TimeoutError)):
                        raise ConnectionError(self._idle_message("in its answer")) from None
                    raise ConnectionError(f"the answer from {self.url} was cut short: {e}") from None
                if not block:
                    self._raise_expired()
                    break
                self._count(len(block))
                parts.append(block)
            raw = b"".join(parts)
        finally:
            self.close()
        try:
            out = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise ValueError(f"malformed JSON answer from {self.url}: {msg} in {raw[:80]!r}") from None
        if not isinstance(out, dict):
            raise ValueError(f"malformed answer from {self.url}: not a JSON object")
        raise_if_error(out, self.url)
        return out

    def _line(self, count: int) -> bytes:
        """One line of the stream (with its newline; b"" at the end of the body)."""
        assert self._resp is not None
        cap = self.limits.max_event_bytes
        try:
            raw = self._resp.readline(cap + 1)
        except (OSError, http.client.HTTPException) as e:
            self._raise_expired()
            if isinstance(e, (socket.timeout, TimeoutError)):
                raise ConnectionError(self._idle_message(f"after {count} events")) from None
            raise ConnectionError(f"the stream from {self.url} was cut after {count} events: {e}") from None
        if not raw.endswith(b"\n"):  # the end of the body, or a line cut short by the watchdog
            self._raise_expired()
        self._count(len(raw))
        if len(raw) > cap and not raw.endswith(b"\n"):
            raise ValueError(f"a line of the stream from {self.url} exceeds {cap} bytes (after {count} events)")
        return raw

    def events(self) -> Iterator[Dict[str, Any]]:
        """The JSON objects of a server-sent event stream, until ``[DONE]``.

        Comment lines (``: keepalive``) and ``event:``/``id:`` fields are
        skipped. A stream that ends before ``[DONE]`` and before any
        ``finish_reason`` raises ConnectionError (truncated). An answer whose
        ``Content-Type`` is JSON is read whole: an ``{"error": ...}`` raises
        ConnectionError with the server's message, anything else is the one event.
        """
        if self._resp is None:
            self.open()
        assert self._dog is not None and self._resp is not None
        ctype = (self._resp.getheader("Content-Type") or "").lower()
        if "json" in ctype and "event-stream" not in ctype:
            # A server that answers a streamed request with one JSON object: its error
            # (raised by json() as the server's own message), or the whole answer at once.
            yield self.json()
            return
        data: List[str] = []
        size, count, finished = 0, 0, False
        max_events = self.limits.max_events(self.max_tokens)
        try:
            while True:
                raw = self._line(count)
                if not raw:  # end of the body
                    if data:
                        raise ValueError(f"the stream from {self.url} ended inside event {count + 1} (truncated)")
                    if not finished:
                        raise ConnectionError(
                            f"the stream from {self.url} ended after {count} events without "
                            "[DONE] or a finish_reason (truncated)"
                        )
                    return
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line:
                    if line.startswith(":"):
                        continue
                    name, _, value = line.partition(":")
                    if name == "data":
                        data.append(value[1:] if value.startswith(" ") else value)
                        size += len(raw)
                        if size > self.limits.max_event_bytes:
                            raise ValueError(
                                f"event {count + 1} from {self.url} exceeds {self.limits.max_event_bytes} bytes"
                            )
                    elif name not in ("event", "id", "retry"):
                        raise ValueError(f"malformed SSE line from {self.url} after {count} events: {line[:80]!r}")
                    continue
                if not data:
                    continue
                payload, data, size = "\n".join(data), [], 0
                self._dog.progress()
                if payload.strip() == "[DONE]":
                    return
                count += 1
                if count > max_events:
                    raise ValueError(
                        f"{self.url} sent more than {max_events} events for at most {self.max_tokens} tokens "
                        "without finishing: stopped reading"
                    )
                try:
                    event = json.loads(payload)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"malformed SSE event {count} from {self.url}: {e.msg} in {payload[:80]!r}"
                    ) from None
                if not isinstance(event, dict):
                    raise ValueError(f"malformed SSE event {count} from {self.url}: not a JSON object")
                raise_if_error(event, self.url)
                ch = event.get("choices")
                if isinstance(ch, list) and ch and isinstance(ch[0], dict) and ch[0].get("finish_reason"):
                    finished = True
                yield event
        finally:
            self.close()

    def close(self) -> None:
        if self._dog is not None:
            self._dog.stop()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
