"""Misbehaving HTTP servers on 127.0.0.1 for the fault-injection tests.

:class:`RawServer` accepts connections on a free loopback port, reads each
request (headers and body) and hands the socket to a *behaviour*, a function
that writes whatever it likes: a stall, a trickle, an endless stream, an
oversized or malformed body. Every loop a behaviour runs is bounded in count
and in time (:data:`MAX_SECONDS`), and a client that hangs up ends it (the
next write fails), so no test can hang on a server.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, Dict, List, Optional

#: No behaviour runs longer than this, whatever it was asked to do.
MAX_SECONDS = 20.0
#: Connections one server accepts before it stops listening.
MAX_CONNECTIONS = 16


class Peer:
    """The server's side of one connection, as a behaviour sees it."""

    def __init__(self, conn: socket.socket, stop: threading.Event) -> None:
        self.conn, self._stop = conn, stop
        self.deadline = time.monotonic() + MAX_SECONDS

    def alive(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self.deadline

    def send(self, data: bytes) -> bool:
        """Write ``data``; False once the client is gone or time is up."""
        if not self.alive():
            return False
        try:
            self.conn.sendall(data)
            return True
        except OSError:
            return False

    def wait(self, seconds: float) -> bool:
        """Sleep (stop-aware); False once time is up."""
        return not self._stop.wait(seconds) and self.alive()


Behaviour = Callable[[Peer], None]


class RawServer:
    """A loopback TCP server that runs ``behaviour`` for each HTTP request."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.requests: List[Dict[str, object]] = []
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self._sock.settimeout(0.05)  # how often the accept loop sees the stop: each test's exit waits for it
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads: List[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "RawServer":
        self._accept.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._accept.join(5)
        for t in self._threads:
            t.join(5)
        self._sock.close()

    def _serve(self) -> None:
        accepted = 0
        while not self._stop.is_set() and accepted < MAX_CONNECTIONS:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            accepted += 1
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            f = conn.makefile("rb")
            request = f.readline(65536).decode("latin-1").strip()
            headers: Dict[str, str] = {}
            for _ in range(100):
                line = f.readline(65536).decode("latin-1").strip()
                if not line:
                    break
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            body = f.read(min(int(headers.get("content-length", "0") or 0), 1 << 20))
            self.requests.append({"request": request, "headers": headers, "body": json.loads(body or b"{}")})
            self.behaviour(Peer(conn, self._stop))
        except (OSError, ValueError):
            pass
        finally:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


# -- pieces of answers ------------------------------------------------------------------------
def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def token_event(text: str, logprob: float = -0.2, finish: Optional[str] = None) -> bytes:
    return sse({"choices": [{"index": 0, "finish_reason": finish, "delta": {"content": text},
                             "logprobs": {"content": [{"token": text, "logprob": logprob, "top_logprobs": [
                                 {"token": text, "logprob": logprob}, {"token": "x", "logprob": -2.0}]}]}}]})


DONE = sse({"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}]}) + b"data: [DONE]\n\n"


def status(code: int = 200, content_type: str = "text/event-stream", length: Optional[int] = None) -> bytes:
    head = f"HTTP/1.1 {code} X\r\nContent-Type: {content_type}\r\nConnection: close\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


# -- behaviours ---------------------------------------------------------------------------------
def answer(body: bytes, code: int = 200, content_type: str = "text/event-stream") -> Behaviour:
    """A complete answer, then the connection closes."""
    return lambda peer: peer.send(status(code, content_type) + body)


def stall(peer: Peer) -> None:
    """Accept the request and say nothing."""
    peer.wait(MAX_SECONDS)


def trickle_status(peer: Peer) -> None:
    """The status line one byte at a time, never finished."""
    for b in b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Slow: " + b"a" * 10_000:
        if not peer.send(bytes([b])) or not peer.wait(0.05):
            return


def keepalive(peer: Peer) -> None:
    """A stream of keep-alive comments and nothing else."""
    peer.send(status())
    for _ in range(100_000):
        if not peer.send(b": keepalive\n\n") or not peer.wait(0.05):
            return


def trickle_event(peer: Peer) -> None:
    """One event whose bytes arrive one at a time and whose line never ends."""
    peer.send(status() + token_event("Hi"))
    for _ in range(100_000):
        if not peer.send(b"d") or not peer.wait(0.05):
            return


def endless_tokens(peer: Peer) -> None:
    """Token events as fast as the client reads, never a finish."""
    peer.send(status())
    ev = token_event("tok")
    for _ in range(1_000_000):
        if not peer.send(ev * 16):
            return


def empty_events(peer: Peer) -> None:
    """Valid events that carry nothing, as fast as the client reads."""
    peer.send(status())
    ev = sse({"choices": []})
    for _ in range(1_000_000):
        if not peer.send(ev * 16):
            return


def slow_tokens(every: float) -> Behaviour:
    """A valid token every ``every`` seconds, never a finish."""
    def behave(peer: Peer) -> None:
        peer.send(status())
        for _ in range(100_000):
            if not peer.send(token_event("t")) or not peer.wait(every):
                return
    return behave


def flood(total: int, code: int = 200, content_type: str = "application/json", declare: bool = False) -> Behaviour:
    """``total`` bytes of body, sent as fast as the client reads (no newline in them)."""
    def behave(peer: Peer) -> None:
        peer.send(status(code, content_type, total if declare else None))
        block = b"x" * (1 << 16)
        for _ in range(total // len(block)):
            if not peer.send(block):
                return
    return behave
