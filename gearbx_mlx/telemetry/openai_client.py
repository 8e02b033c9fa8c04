"""A small client for OpenAI-compatible completion servers, standard library only.

Speaks to mlx-lm's server, Ollama, llama.cpp's server (and OpenAI-style
services) over ``http.client``: one POST per request, streamed as server-sent
events or answered in one JSON body, with ``logprobs``/``top_logprobs``.

What the servers actually send (checked against mlx-lm 0.32.2's
``mlx_lm/server.py`` and a live ``mlx_lm.server``):

* OpenAI format (llama.cpp, Ollama, vLLM, OpenAI): each streamed chunk holds
  ``choices[0].logprobs.content``, one entry per token of the chunk:
  ``{"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]}``,
  where ``token`` is the sampled token's text.
* mlx-lm 0.32.2 never puts log-probabilities in streamed chunks (only the
  text), so its logprobs need a non-streaming request. There each entry is
  ``dict(top[0], top_logprobs=top)``: the entry's own ``id``/``token`` are
  the *first of the top-k in ``argpartition`` order*, not the sampled token,
  ``token`` is the raw vocabulary piece (``"Ġthere"``), and ``top_logprobs``
  is capped at 11. Such entries (they carry ``id``) are read as "sampled
  token unknown"; with greedy decoding it is the arg-max of the top-k.
* Legacy ``/v1/completions``: ``logprobs = {"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}]}``.

Transport failures raise :class:`ConnectionError` (refused, unreachable,
timeout, HTTP error, a stream cut short); a stream whose content is not what
the protocol says raises :class:`ValueError`. Both name the URL.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

#: (token text or None, token id or None, natural-log probability)
TopEntry = Tuple[Optional[str], Optional[int], float]


@dataclass
class TokenInfo:
    """One generated token as the server reported it."""

    text: Optional[str]  # decoded text of the sampled token; None if unknown
    token_id: Optional[int]  # vocabulary id if the server gives ids and the token is known
    logprob: Optional[float]  # of the sampled token, if known
    top: List[TopEntry] = field(default_factory=list)  # the top-k report


@dataclass
class Chunk:
    """One streamed event (or a whole non-streamed answer)."""

    text: str  # content delta
    tokens: List[TokenInfo]
    finish_reason: Optional[str]
    has_logprobs: bool  # False if the event carried text but no logprobs


# -- URLs -------------------------------------------------------------------------
def api_base(url: str) -> str:
    """Normalise a server URL to its ``.../v1`` base.

    ``http://host:8080``, ``http://host:8080/v1`` and
    ``http://host:8080/v1/chat/completions`` all give ``http://host:8080/v1``.
    """
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"not an http(s) URL: {url!r} (write e.g. http://127.0.0.1:8080)")
    path = parsed.path.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    if not path.endswith("/v1"):
        path += "/v1"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


# -- requests -----------------------------------------------------------------------
class Request:
    """One POST to ``url`` with a JSON body; read it as SSE or as one JSON answer.

    Args:
        connect_timeout: seconds to open the connection (fail fast when the
            server is down or unreachable).
        read_timeout: seconds to wait for each piece of the answer.
        api_key: sent as ``Authorization: Bearer``, if given.
    """

    def __init__(
        self,
        url: str,
        body: Dict[str, Any],
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        api_key: Optional[str] = None,
    ) -> None:
        self.url = url
        self.body = body
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.api_key = api_key
        self._conn: Optional[http.client.HTTPConnection] = None
        self._resp: Optional[http.client.HTTPResponse] = None

    def open(self) -> "Request":
        parsed = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(parsed.hostname, parsed.port, timeout=self.connect_timeout)
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
            detail = self._read_all()[:300].decode("utf-8", "replace").strip()
            status = self._resp.status
            self.close()
            raise HTTPStatusError(status, f"{self.url} answered HTTP {status}: {detail or '(no body)'}")
        return self

    def _send(self, path: str, data: bytes, headers: Dict[str, str]) -> http.client.HTTPResponse:
        """Connect, send, and wait for the status line; every failure as ConnectionError."""
        assert self._conn is not None
        try:
            self._conn.connect()
        except (socket.timeout, TimeoutError):
            raise ConnectionError(
                f"could not connect to {self.url} within {self.connect_timeout} s: is the host up?"
            ) from None
        except ConnectionRefusedError:
            raise ConnectionError(f"connection refused by {self.url}: is the server running on that port?") from None
        except socket.gaierror as e:
            raise ConnectionError(f"cannot resolve the host of {self.url}: {e.strerror}") from None
        except OSError as e:
            raise ConnectionError(f"cannot reach {self.url}: {e}") from None
        try:
            # Connected: from now on wait up to read_timeout for each piece.
            self._conn.sock.settimeout(self.read_timeout)
            self._conn.request("POST", path, body=data, headers=headers)
            return self._conn.getresponse()
        except (socket.timeout, TimeoutError):
            raise ConnectionError(
                f"no answer from {self.url} within {self.read_timeout} s: is the server busy? (--timeout)"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            raise ConnectionError(f"{self.url} closed the connection before answering ({e!r})") from None

    def _read_all(self) -> bytes:
        assert self._resp is not None
        try:
            return self._resp.read()
        except (OSError, http.client.HTTPException):
            return b""

    def json(self) -> Dict[str, Any]:
        """The whole answer as one JSON object."""
        if self._resp is None:
            self.open()
        try:
            raw = self._resp.read()
        except (socket.timeout, TimeoutError):
            raise ConnectionError(f"{self.url} stopped answering (read timeout {self.read_timeout} s)") from None
        except (OSError, http.client.HTTPException) as e:
            raise ConnectionError(f"the answer from {self.url} was cut short: {e}") from None
        finally:
            self.close()
        try:
            out = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed JSON answer from {self.url}: {e.msg} in {raw[:80]!r}") from None
        if not isinstance(out, dict):
            raise ValueError(f"malformed answer from {self.url}: not a JSON object")
        _raise_if_error(out, self.url)
        return out

    def events(self) -> Iterator[Dict[str, Any]]:
        """The JSON objects of a server-sent event stream, until ``[DONE]``.

        Comment lines (``: keepalive``) and ``event:``/``id:`` fields are
        skipped. A stream that ends before ``[DONE]`` and before any
        ``finish_reason`` raises ConnectionError (truncated).
        """
        if self._resp is None:
            self.open()
        data: List[str] = []
        count, finished = 0, False
        try:
            while True:
                try:
                    raw = self._resp.readline()
                except (socket.timeout, TimeoutError):
                    raise ConnectionError(
                        f"{self.url} stopped streaming after {count} events "
                        f"(no data for {self.read_timeout} s)"
                    ) from None
                except (OSError, http.client.HTTPException) as e:
                    raise ConnectionError(f"the stream from {self.url} was cut after {count} events: {e}") from None
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
                    elif name not in ("event", "id", "retry"):
                        raise ValueError(f"malformed SSE line from {self.url} after {count} events: {line[:80]!r}")
                    continue
                if not data:
                    continue
                payload, data = "\n".join(data), []
                if payload.strip() == "[DONE]":
                    return
                count += 1
                try:
                    event = json.loads(payload)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"malformed SSE event {count} from {self.url}: {e.msg} in {payload[:80]!r}"
                    ) from None
                if not isinstance(event, dict):
                    raise ValueError(f"malformed SSE event {count} from {self.url}: not a JSON object")
                _raise_if_error(event, self.url)
                ch = event.get("choices")
                if isinstance(ch, list) and ch and isinstance(ch[0], dict) and ch[0].get("finish_reason"):
                    finished = True
                yield event
        finally:
            self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class HTTPStatusError(ConnectionError):
    """The server answered with an HTTP error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _raise_if_error(obj: Dict[str, Any], url: str) -> None:
    if "error" in obj and "choices" not in obj:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise ConnectionError(f"{url} reported an error: {msg}")


# -- what is in a chunk -----------------------------------------------------------
def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: vocabulary piece char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


def piece_text(piece: str) -> str:
    """Text of a raw vocabulary piece (mlx-lm reports ``convert_ids_to_tokens``).

    Byte-level BPE pieces (``"Ġthe"``) are mapped back to bytes; SentencePiece
    pieces (``"▁the"``) get their spaces back; special tokens stay as they are.
    """
    if piece.startswith("<") and piece.endswith(">"):
        return piece
    if all(ch in _BYTES for ch in piece):
        return bytes(_BYTES[ch] for ch in piece).decode("utf-8", "replace")
    return piece.replace("▁", " ")


def _entry_top(entry: Dict[str, Any]) -> List[TopEntry]:
    top = entry.get("top_logprobs") or []
    out: List[TopEntry] = []
    for t in top:
        if not isinstance(t, dict) or "logprob" not in t:
            raise ValueError(f"top_logprobs entry without a logprob: {str(t)[:80]}")
        out.append((t.get("token"), t.get("id"), float(t["logprob"])))
    return out


def parse_logprobs(choice: Dict[str, Any], greedy: bool) -> List[TokenInfo]:
    """The tokens of one choice's ``logprobs`` (chat or legacy completions form).

    Args:
        choice: ``event["choices"][0]``.
        greedy: the request was greedy (temperature 0), so a token the server
            does not name is the arg-max of its top-k.
    """
    lp = choice.get("logprobs")
    if not lp:
        return []
    if not isinstance(lp, dict):
        raise ValueError(f"logprobs is not an object: {str(lp)[:80]}")
    out: List[TokenInfo] = []
    if "content" in lp:  # chat completions
        for entry in lp["content"] or []:
            if not isinstance(entry, dict):
                raise ValueError(f"logprobs.content entry is not an object: {str(entry)[:80]}")
            top = _entry_top(entry)
            if "id" in entry:
                # mlx-lm: the entry is top[0] in argpartition order, not the sampled token.
                best = max(top, key=lambda t: t[2]) if (greedy and top) else None
                out.append(TokenInfo(
                    piece_text(best[0]) if best and best[0] is not None else None,
                    best[1] if best else None, best[2] if best else None,
                    [(piece_text(t) if t is not None else None, i, p) for t, i, p in top]))
            else:
                logprob = entry.get("logprob")
                out.append(TokenInfo(entry.get("token"), entry.get("id"),
                                     float(logprob) if logprob is not None else None, top))
    elif "tokens" in lp:  # legacy completions
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        for tok, logprob, top in zip(lp["tokens"], lp.get("token_logprobs") or [None] * len(lp["tokens"]), tops):
            entries = [(t, None, float(p)) for t, p in (top or {}).items()]
            out.append(TokenInfo(tok, None, float(logprob) if logprob is not None else None, entries))
    else:
        raise ValueError(f"logprobs in an unknown form (keys {sorted(lp)[:5]})")
    return out


def parse_chunk(event: Dict[str, Any], greedy: bool) -> Chunk:
    """Text, tokens and finish reason of one streamed event or whole answer."""
    choices = event.get("choices")
    if not isinstance(choices, list):
        raise ValueError(f"an answer without 'choices': {json.dumps(event)[:120]}")
    if not choices:  # e.g. a usage-only event
        return Chunk("", [], None, True)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise ValueError(f"choices[0] is not an object: {str(choice)[:80]}")
    msg = choice.get("delta") or choice.get("message") or {}
    text = msg.get("content") if isinstance(msg, dict) else None
    if text is None:
        text = choice.get("text") or ""
    if not isinstance(text, str):
        raise ValueError(f"content is not text: {str(text)[:80]}")
    tokens = parse_logprobs(choice, greedy)
    return Chunk(text, tokens, choice.get("finish_reason"), bool(tokens) or not text)


# -- a local mlx_lm.server (tests and scripts) ---------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_mlx_server(model: str, start_timeout: float = 90.0) -> Iterator[str]:
    """Run ``mlx_lm.server`` for ``model`` on a free local port; yield its base URL.

    The hub is never contacted (``HF_HUB_OFFLINE=1``). The server is always
    stopped on exit.

    Raises:
        RuntimeError: the server exited, or did not answer ``/health`` within
            ``start_timeout`` seconds.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited with {proc.returncode} before it served")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlx_lm.server did not answer within {start_timeout:g} s")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
