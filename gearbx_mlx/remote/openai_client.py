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
the protocol says raises :class:`ValueError`. Both name the URL. The exchange
itself, bounded in time, bytes and events, is :mod:`.transport`'s
:class:`Request`; this module reads what it returns, checking every field's
type (a server is untrusted input).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .transport import HTTPStatusError, Limits, Request, raise_if_error

__all__ = [
    "Chunk", "HTTPStatusError", "Limits", "Request", "TokenInfo", "api_base", "free_port", "local_mlx_server",
    "parse_chunk", "parse_logprobs", "piece_text", "raise_if_error",
]

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


def _logprob(x: Any, where: str) -> float:
    """A log-probability: a number <= 0 (-inf is probability 0; NaN is refused)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{where}: logprob is not a number: {str(x)[:80]}")
    v = float(x)
    if math.isnan(v) or v > 1e-6:
        raise ValueError(f"{where}: not a log-probability: {v}")
    return v


def _opt_str(x: Any, where: str) -> Optional[str]:
    if x is not None and not isinstance(x, str):
        raise ValueError(f"{where}: token is not text: {str(x)[:80]}")
    return x


def _opt_id(x: Any, where: str) -> Optional[int]:
    if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
        raise ValueError(f"{where}: token id is not a non-negative integer: {str(x)[:80]}")
    return x


def _list(x: Any, where: str) -> List[Any]:
    if x is None:
        return []
    if not isinstance(x, list):
        raise ValueError(f"{where} is not a list: {str(x)[:80]}")
    return x


def _entry_top(entry: Dict[str, Any]) -> List[TopEntry]:
    out: List[TopEntry] = []
    for t in _list(entry.get("top_logprobs"), "top_logprobs"):
        if not isinstance(t, dict) or "logprob" not in t:
            raise ValueError(f"top_logprobs entry without a logprob: {str(t)[:80]}")
        out.append((_opt_str(t.get("token"), "top_logprobs"), _opt_id(t.get("id"), "top_logprobs"),
                    _logprob(t["logprob"], "top_logprobs")))
    return out


def parse_logprobs(choice: Dict[str, Any], greedy: bool) -> List[TokenInfo]:
    """The tokens of one choice's ``logprobs`` (chat or legacy completions form).

    Args:
        choice: ``event["choices"][0]``.
        greedy: the request was greedy (temperature 0), so a token the server
            does not name is the arg-max of its top-k.

    Raises:
        ValueError: a field of the wrong type or value (NaN, a positive log-probability).
    """
    lp = choice.get("logprobs")
    if not lp:
        return []
    if not isinstance(lp, dict):
        raise ValueError(f"logprobs is not an object: {str(lp)[:80]}")
    out: List[TokenInfo] = []
    if "content" in lp:  # chat completions
        for entry in _list(lp["content"], "logprobs.content"):
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
                out.append(TokenInfo(_opt_str(entry.get("token"), "logprobs.content"),
                                     _opt_id(entry.get("id"), "logprobs.content"),
                                     _logprob(logprob, "logprobs.content") if logprob is not None else None, top))
    elif "tokens" in lp:  # legacy completions
        tokens = _list(lp["tokens"], "logprobs.tokens")
        n = len(tokens)
        values = _list(lp.get("token_logprobs"), "logprobs.token_logprobs") or [None] * n
        tops = _list(lp.get("top_logprobs"), "logprobs.top_logprobs") or [None] * n
        if len(values) != n or len(tops) != n:
            raise ValueError(f"logprobs has {n} tokens but {len(values)} token_logprobs and {len(tops)} top_logprobs")
        for tok, logprob, top in zip(tokens, values, tops):
            if top is not None and not isinstance(top, dict):
                raise ValueError(f"logprobs.top_logprobs entry is not an object: {str(top)[:80]}")
            entries = [(_opt_str(t, "logprobs.top_logprobs"), None, _logprob(p, "logprobs.top_logprobs"))
                       for t, p in (top or {}).items()]
            out.append(TokenInfo(_opt_str(tok, "logprobs.tokens"), None,
                                 _logprob(logprob, "logprobs.token_logprobs") if logprob is not None else None,
                                 entries))
    else:
        raise ValueError(f"logprobs in an unknown form (keys {sorted(lp)[:5]})")
    return out


def parse_chunk(event: Dict[str, Any], greedy: bool) -> Chunk:
    """Text, tokens and finish reason of one streamed event or whole answer.

    Raises:
        ValueError: the event is not what the protocol says (any field of the
            wrong type); never another exception, whatever the JSON holds.
    """
    if not isinstance(event, dict):
        raise ValueError(f"an answer that is not a JSON object: {str(event)[:80]}")
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
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise ValueError(f"finish_reason is not text: {str(finish)[:80]}")
    tokens = parse_logprobs(choice, greedy)
    return Chunk(text, tokens, finish, bool(tokens) or not text)


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
