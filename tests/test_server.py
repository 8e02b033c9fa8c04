"""``python -m gearbx_mlx.server`` end to end: a real server process on the default model.

One server (module fixture, started with ``--speculative``) answers most
tests; its greedy tokens are held to the package's own generation in this
process, on a gearbox with the server's settings. A second server process
takes a request while its model loads and is stopped with SIGINT. All
traffic goes to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest

# One worker runs the module, and its server and reference model are built once for it (session scope:
# pytest tears module fixtures down whenever the worker runs another module's test in between).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("server")]

ROOT = Path(__file__).resolve().parent.parent
SERVER_FLAGS = ["--speculative", "--max-tokens", "64"]
N = 6  # tokens per request: two gear changes in the dynamic policy, three speculative blocks
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
TEXT = "The three primary colours are"
#: request ``gearbx`` objects and the package policy each must equal
POLICIES = {
    "high": {"gear": "high", "speculative": "off"},
    "dynamic": {"gear": "dynamic", "speculative": "off"},
    "speculative": {"gear": "dynamic", "speculative": "force"},
}
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy: 127.0.0.1 only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           # the server on the BLAS of this process: its outputs are compared with the package's
           # here, and another BLAS sums in another order (a near-tie of the argmax can flip)
           "GEARBX_NO_BLAS_PRELOAD": "1"}
    # stderr to a file: a pipe nobody reads would block the server once full
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "gearbx_mlx.server", "--port", str(port), *flags],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
    proc.err = err  # type: ignore[attr-defined]
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    proc.err.seek(0)  # type: ignore[attr-defined]
    return proc.err.read()  # type: ignore[attr-defined]


def request(port: int, path: str, body: Any = None, raw: Optional[bytes] = None,
            timeout: float = 300) -> Tuple[int, Dict[str, Any]]:
    """``(status, JSON body)`` of a GET (no body) or POST."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(port: int) -> Optional[Dict[str, Any]]:
    try:
        return request(port, "/health", timeout=5)[1]
    except (OSError, json.JSONDecodeError):
        return None


def wait_until(check: Any, seconds: float, what: str) -> Any:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")


def stop(proc: subprocess.Popen) -> Tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode, stderr_of(proc)


def sse(port: int, path: str, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """The JSON events of a streamed POST, up to ``[DONE]``."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return
                yield json.loads(line[len("data: "):])


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def server() -> Iterator[int]:
    port = free_port()
    proc = start_server(port, *SERVER_FLAGS)
    PROCESSES[port] = proc
    try:
        wait_until(lambda: proc.poll() is not None or (health(port) or {}).get("gearbx", {}).get("loaded"),
                   180, "the server to load")
        assert proc.poll() is None, stderr_of(proc)
        yield port
    finally:
        stop(proc)


#: The session server's process by port (its log is read by a test).
PROCESSES: Dict[int, subprocess.Popen] = {}


@pytest.fixture(scope="session")
def reference() -> Tuple[Any, Any, Any]:
    """The model, tokenizer and gearbox as the server builds them (the same flags)."""
    from gearbx_mlx.generate import gearbox_config
    from gearbx_mlx.generation import load
    from gearbx_mlx.server.options import build_parser

    args = build_parser().parse_args(SERVER_FLAGS)
    return load(config=gearbox_config(args), draft_scope=args.draft_scope if args.speculative else None)


_REFS: Dict[Tuple[str, Tuple[int, ...], int], List[Any]] = {}


def package_tokens(reference: Any, ids: List[int], policy: str, n: int = N) -> List[Any]:
    """The package's greedy responses (speculative decoding: the high gear's, which it must equal)."""
    from gearbx_mlx.pipeline import stream_generate
    from gearbx_mlx.policies import make_policy

    key = (policy, tuple(ids), n)
    if key not in _REFS:
        model, tokenizer, gearbox = reference
        gear = None if policy == "dynamic" else "high"
        _REFS[key] = list(stream_generate(model, tokenizer, ids, gearbox, policy=make_policy(gear), max_tokens=n))
    return _REFS[key]


def chat_ids(reference: Any, messages: List[Dict[str, str]] = MESSAGES) -> List[int]:
    return list(reference[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def openai_client(port: int) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300,
                         http_client=openai.DefaultHttpxClient(trust_env=False))  # 127.0.0.1 only: no proxy


def ext_tokens(choice: Dict[str, Any]) -> List[Dict[str, Any]]:
    return choice["gearbx"]["tokens"]


# -- equal to the package's generation ----------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_chat_equals_package(server: int, reference: Any, policy: str) -> None:
    client = openai_client(server)
    out = client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=N, temperature=0,
                                         extra_body={"gearbx": POLICIES[policy]})
    want = package_tokens(reference, chat_ids(reference), "dynamic" if policy == "dynamic" else "high")
    ext = ext_tokens(out.choices[0].model_extra)
    assert [t["token"] for t in ext] == [r.token for r in want]
    assert out.choices[0].message.content == "".join(r.text for r in want)
    if policy == "dynamic":  # the same gear at every step as the package chose
        assert [t["gear"] for t in ext] == [r.gear for r in want]
    if policy == "speculative":
        assert all(t["drafted"] is not None for t in ext)
        assert any(t["accepted"] for t in ext) or out.usage.model_extra["gearbx"]["accepted_drafts"] == 0
    usage = out.usage.model_extra["gearbx"]
    assert sum(usage["tokens_per_gear"].values()) == out.usage.completion_tokens == N
    assert usage["weight_bytes_read"] > 0


@pytest.mark.parametrize("policy", ["high", "dynamic"])
def test_text_completion_equals_package(server: int, reference: Any, policy: str) -> None:
    status, out = request(server, "/v1/completions", {"prompt": TEXT, "max_tokens": N, "temperature": 0,
                                                      "gearbx": POLICIES[policy]})
    assert status == 200, out
    want = package_tokens(reference, list(reference[1].encode(TEXT)), policy)
    assert [t["token"] for t in ext_tokens(out["choices"][0])] == [r.token for r in want]
    assert out["choices"][0]["text"] == "".join(r.text for r in want)


def test_streams_reassemble(server: int, reference: Any) -> None:
    """A streamed chat (openai) and a streamed speculative text completion (plain HTTP)
    reassemble to the package's text and tokens, every chunk carrying its tokens' gears."""
    client = openai_client(server)
    chunks = list(client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=N,
                                                 temperature=0, stream=True,
                                                 extra_body={"gearbx": POLICIES["dynamic"]}))
    want = package_tokens(reference, chat_ids(reference), "dynamic")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    toks = [t for c in chunks if c.choices for t in ext_tokens(c.choices[0].model_extra)]
    assert text == "".join(r.text for r in want)
    assert [(t["token"], t["gear"]) for t in toks] == [(r.token, r.gear) for r in want]

    events = list(sse(server, "/v1/completions", {"prompt": TEXT, "max_tokens": N, "temperature": 0,
                                                  "gearbx": POLICIES["speculative"],
                                                  "stream_options": {"include_usage": True}}))
    want = package_tokens(reference, list(reference[1].encode(TEXT)), "high")
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "".join(r.text for r in want)
    assert [t["token"] for e in events if e["choices"] for t in ext_tokens(e["choices"][0])] == [
        r.token for r in want]
    assert events[-1]["usage"]["gearbx"]["speculative"] == "force"
    # the decision of the first "force" request is kept and reused
    assert "force greedy" in health(server)["gearbx"]["speculative_plans"]


def test_top_logprobs_match(server: int, reference: Any) -> None:
    status, out = request(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": N, "temperature": 0, "logprobs": True, "top_logprobs": 3,
        "gearbx": POLICIES["high"]})
    assert status == 200, out
    want = package_tokens(reference, chat_ids(reference), "high")
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == len(want)
    for got, r in zip(content, want, strict=True):
        lp = np.array(r.logprobs)
        top = sorted((-float(lp[i]), int(i)) for i in np.argsort(lp)[-3:])
        got_top = sorted((-t["logprob"], t["id"]) for t in got["top_logprobs"])
        assert [i for _, i in got_top] == [i for _, i in top]
        assert [lp for lp, _ in got_top] == pytest.approx([lp for lp, _ in top], abs=1e-4)
        # the entry is the chosen token's, its top tokens most likely first
        assert got["id"] == r.token and got["logprob"] == pytest.approx(float(lp[r.token]), abs=1e-4)
        assert [t["logprob"] for t in got["top_logprobs"]] == sorted((t["logprob"] for t in got["top_logprobs"]),
                                                                     reverse=True)


# -- faults ---------------------------------------------------------------------------------


def test_client_disconnect_mid_stream(server: int, reference: Any) -> None:
    """The server finishes with the dropped stream, shifts back to the loaded weights and serves on."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": 64, "stream": True, "gearbx": POLICIES["dynamic"]})
    sock = socket.create_connection(("127.0.0.1", server), timeout=300)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    stream = sock.makefile("rb")
    assert stream.readline().split()[1] == b"200"
    seen = 0
    while seen < 3:  # a few chunks, then hang up
        line = stream.readline()
        assert line, "the stream ended early"
        seen += line.startswith(b"data: ")
    stream.close()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    wait_until(lambda: (h := health(server)) and h["gearbx"]["gear"] == "high" and h["gearbx"]["queued"] == 0,
               120, "the gearbox back in the high gear")
    log = stderr_of(PROCESSES[server])
    assert "BrokenPipeError" not in log and "ConnectionResetError" not in log, log[-2000:]
    test_chat_equals_package(server, reference, "high")
    test_chat_equals_package(server, reference, "dynamic")


def test_client_disconnect_before_a_whole_answer(server: int, reference: Any) -> None:
    """A non-streamed answer is written only at its end: its client hanging up mid-generation
    still stops the generation at the next token (one log line, no traceback), so the next
    request does not wait for tokens generated for nobody."""
    gone = "client disconnected before the answer ended"
    prefilled = re.compile(r"Prompt processing progress: (\d+)/\1$", re.M)  # mlx-lm's, with the first token
    log = stderr_of(PROCESSES[server])
    before, started = log.count(gone), len(prefilled.findall(log))
    cap = int(SERVER_FLAGS[SERVER_FLAGS.index("--max-tokens") + 1])
    body = json.dumps({"prompt": TEXT, "max_tokens": cap, "gearbx": POLICIES["dynamic"]})
    with socket.create_connection(("127.0.0.1", server), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        wait_until(lambda: len(prefilled.findall(stderr_of(PROCESSES[server]))) > started, 60, "the first token")
    # queued behind the abandoned request: served once that generation stops
    test_text_completion_equals_package(server, reference, "high")
    wait_until(lambda: stderr_of(PROCESSES[server]).count(gone) > before, 10, "the disconnect's log line")
    log = stderr_of(PROCESSES[server])
    lines = [line for line in log.splitlines() if gone in line][before:]
    assert len(lines) == 1, lines
    read = re.search(r"\(after (\d+) tokens\)", lines[0])
    assert read and int(read[1]) < cap, lines  # the answer was cut short
    assert "Traceback" not in log and "ConnectionResetError" not in log, log[-2000:]


def test_malformed_json_is_400(server: int) -> None:
    status, out = request(server, "/v1/chat/completions", raw=b'{"messages": [{"role": ')
    assert status == 400 and "Invalid JSON" in out["error"]


@pytest.mark.parametrize("body, status, words", [
    ({"max_tokens": 65}, 400, "exceeds this server's cap of 64"),
    ({"gearbx": {"gear": "fast"}}, 400, "gearbx.gear must be one of"),
    ({"gearbx": {"thresholds": [3, 1]}}, 400, "gearbx.thresholds"),
    ({"gearbx": {"thresholds": [1, 99], "speculative": "off"}}, 400, "above log2(vocabulary)"),
    ({"gearbx": {"thresholds": [1, 2]}}, 400, "give speculative 'off'"),  # this server's requests draft by default
    ({"top_k": 10**9, "temperature": 0.7}, 400, "top_k must be below the vocabulary size"),
    ({"top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"temperature": float("nan")}, 400, "temperature must be a number >= 0"),
    ({"seed": -1}, 400, "seed must be an integer in [0, 2**64)"),
    ({"seed": 2**70}, 400, "seed must be an integer in [0, 2**64)"),
    ({"stop": 5}, 400, "stop must be a string or a list of strings"),
    ({"gearbx": {"gear": "low", "speculative": "auto"}}, 400, "cannot be combined with speculative"),
    ({"gearbx": "high"}, 400, "gearbx must be an object"),
    ({"n": 2}, 400, "n must be 1"),
    ({"n": "1"}, 400, "n must be 1"),
    ({"model": "gpt-4o"}, 404, "is not served here"),
    # accepted by mlx-lm's checks, then failed after the 200 (closed connection, stream without [DONE])
    ({"max_tokens": True}, 400, "max_tokens must be an integer, got true"),
    ({"max_completion_tokens": True}, 400, "max_completion_tokens must be an integer"),
    ({"stream": True, "stream_options": "yes"}, 400, "stream_options must be an object"),
    ({"messages": "hi"}, 400, "messages must be a list of objects"),
    ({"messages": [{"role": "user", "content": "\ud800 hi"}]}, 400,
     "messages[0].content is not valid Unicode text"),
    # accepted by mlx-lm, then misread: NaN logits, an index past the logits, free text for JSON
    ({"frequency_penalty": 3}, 400, "frequency_penalty must be a number in [-2, 2], got 3"),
    ({"presence_penalty": float("nan")}, 400, "presence_penalty must be a number in [-2, 2]"),
    ({"repetition_penalty": float("inf")}, 400, "repetition_penalty must be a finite number >= 0 (0 = off), got inf"),
    ({"logit_bias": {"5": float("nan")}}, 400, "logit_bias values must be finite numbers"),
    ({"logit_bias": {"99999999": 1.0}}, 400, "logit_bias keys must be token ids in [0, 49152), got 99999999"),
    ({"response_format": {"type": "json_object"}}, 400, 'response_format "json_object" is not supported'),
])
def test_refused_requests(server: int, body: Dict[str, Any], status: int, words: str) -> None:
    got, out = request(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert got == status and words in out["error"], out


def test_openai_range_penalties_a_text_response_format_and_a_logit_bias_are_served(server: int) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, "gearbx": POLICIES["high"], "frequency_penalty": -1.5,
            "presence_penalty": 2, "repetition_penalty": 0, "response_format": {"type": "text"},
            "logit_bias": {"11": -5}}  # repetition_penalty 0: mlx-lm's own default, off
    status, out = request(server, "/v1/chat/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


def test_a_refused_sample_setting_leaves_later_sampled_requests_working(server: int) -> None:
    """A top_k past the vocabulary, raised inside mlx-lm's compiled sampler, left MLX's random
    state a traced placeholder: every later sampled request without a seed then failed. It is
    refused before generation now."""
    body = {"messages": MESSAGES, "max_tokens": 2, "gearbx": POLICIES["high"]}
    assert request(server, "/v1/chat/completions", {**body, "temperature": 0.7, "top_k": 10**9})[0] == 400
    for stream in (False, True):
        if stream:
            events = list(sse(server, "/v1/chat/completions", {**body, "temperature": 0.7}))
            assert events and events[-1]["choices"][0]["finish_reason"] == "length"
        else:
            status, out = request(server, "/v1/chat/completions", {**body, "temperature": 0.7})
            assert status == 200 and out["usage"]["completion_tokens"] == 2, out


@pytest.mark.parametrize("prompt", [["a", "b"], None, 5])
def test_a_text_completion_prompt_must_be_a_string(server: int, prompt: Any) -> None:
    got, out = request(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert got == 400 and "prompt must be a string" in out["error"], out


def test_a_stream_keeps_the_connection_alive_through_a_long_prefill(server: int) -> None:
    """mlx-lm's ``: keepalive done/total`` lines come while the prompt is processed, before the first token."""
    body = json.dumps({"prompt": "sky " * 520, "max_tokens": 1, "stream": True, "gearbx": POLICIES["high"]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=300) as r:
        lines = [line.decode().strip() for line in r]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    keepalive = [line for line in lines[:first_data] if line.startswith(": keepalive ")]
    assert keepalive, lines[:5]
    done, total = map(int, keepalive[-1].split()[-1].split("/"))
    assert done == total > 512  # more than one prefill chunk


def test_over_the_context_is_400(server: int) -> None:
    got, out = request(server, "/v1/completions", {"prompt": "sky " * 8200, "max_tokens": 8})
    assert got == 400 and "exceed the model's context of 8192 tokens" in out["error"], out


def test_unknown_model_via_openai(server: int) -> None:
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):
        openai_client(server).chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)


def test_unknown_fields_are_ignored(server: int, reference: Any) -> None:
    got, out = request(server, "/v1/completions", {"prompt": TEXT, "max_tokens": N, "user": "x", "frobnicate": 1,
                                                   "gearbx": {**POLICIES["high"], "colour": "blue"}})
    assert got == 200, out
    want = package_tokens(reference, list(reference[1].encode(TEXT)), "high")
    assert out["choices"][0]["text"] == "".join(r.text for r in want)


def test_models_lists_the_served_model(server: int, reference: Any) -> None:
    got, out = request(server, "/v1/models")
    assert got == 200 and [m["id"] for m in out["data"]] == [reference[2].model_name]


def test_eight_concurrent_clients(server: int, reference: Any) -> None:
    """Eight clients at once are served one by one (FIFO); each gets its sequential greedy tokens:
    the first tokens of the package's answer to its prompt and policy. Chat and text completions
    in the high gear and the dynamic policy, two clients each (the references are the equality
    tests' own: a shorter answer is the start of the longer one)."""
    n = 3
    jobs = [(chat, policy) for chat in (True, False) for policy in ("high", "dynamic")] * 2
    results: Dict[int, Any] = {}

    def run(i: int, chat: bool, policy: str) -> None:
        path, prompt = ("/v1/chat/completions", {"messages": MESSAGES}) if chat else ("/v1/completions",
                                                                                      {"prompt": TEXT})
        results[i] = request(server, path, {**prompt, "max_tokens": n, "temperature": 0, "gearbx": POLICIES[policy]})

    threads = [threading.Thread(target=run, args=(i, chat, policy)) for i, (chat, policy) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(results) == 8
    for i, (chat, policy) in enumerate(jobs):
        status, out = results[i]
        assert status == 200, out
        ids = chat_ids(reference) if chat else list(reference[1].encode(TEXT))
        want = package_tokens(reference, ids, policy)[:n]
        assert [t["token"] for t in ext_tokens(out["choices"][0])] == [r.token for r in want], (chat, policy)


def test_request_while_loading_then_sigint() -> None:
    """A request sent while the model loads waits for it; SIGINT mid-stream stops the server cleanly (130)."""
    port = free_port()
    proc = start_server(port, "--max-tokens", "64")
    try:
        first = wait_until(lambda: proc.poll() is not None or health(port), 120, "the HTTP server")
        assert proc.poll() is None, stderr_of(proc)
        assert first["gearbx"]["loaded"] is False  # the model is still loading
        status, out = request(port, "/v1/completions", {"prompt": TEXT, "max_tokens": 4})
        assert status == 200 and out["usage"]["completion_tokens"] == 4
        body = json.dumps({"prompt": TEXT, "max_tokens": 64, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        queued: Dict[str, Any] = {}

        def second_request() -> None:  # waits in the queue behind the stream
            try:
                queued["answer"] = request(port, "/v1/completions", {"prompt": TEXT, "max_tokens": 4}, timeout=60)
            except OSError as e:
                queued["answer"] = e

        with _OPENER.open(req, timeout=300) as r:
            while not r.readline().startswith(b"data: "):
                pass  # generating now
            waiter = threading.Thread(target=second_request)
            waiter.start()
            wait_until(lambda: (health(port) or {}).get("gearbx", {}).get("queued") == 1, 30, "the queued request")
            proc.send_signal(signal.SIGINT)
            rc, err = stop(proc)
            waiter.join(60)
            rest = []
            try:
                rest += [line.decode().strip() for line in r]
            except (http.client.IncompleteRead, OSError):
                pass
        assert rc == 130, err
        assert "Traceback" not in err
        # the cut stream ends without a finish reason or [DONE]: not to be taken for a whole answer
        data = [line[len("data: "):] for line in rest if line.startswith("data: ")]
        assert "[DONE]" not in data, rest
        assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data), rest
        # the request still queued is answered 503, not left to a closed connection
        status, body = queued["answer"]
        assert status == 503 and "shutting down" in body["error"], queued
    finally:
        stop(proc)


def test_bad_flag_is_one_error_line(monkeypatch: Any, capsys: Any) -> None:
    """The first case as a command (its whole stderr is the one line); the others through the
    command's ``main`` in this process, the same checks without a process start each."""
    import warnings

    from gearbx_mlx.server import app

    cases = [(["--window", "0"], "error: --window must be an integer from 1 to 1,000,000, got 0"),
             (["--kv-bits", "4", "--max-kv-size", "64"], "error: --max-kv-size (a rotating window"),
             (["--host", "256.1.1.1"], "error: --host 256.1.1.1: no such address"),
             (["--max-tokens", "-1"], "error: --max-tokens must be >= 1 for the server")]
    (flags, line), rest = cases[0], cases[1:]
    proc = start_server(free_port(), *flags)
    rc = proc.wait(timeout=120)
    err = stderr_of(proc).strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith(line), err
    monkeypatch.setattr(app, "serve", lambda args: pytest.fail(f"served despite {args}"))
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() sets its own
    for flags, line in rest:
        rc = app.main(["--port", str(free_port()), *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and err[0].startswith(line), (flags, err)


def test_a_taken_port_is_one_error_line_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = start_server(port, "--host", "127.0.0.1")
        rc = proc.wait(timeout=120)
    err = stderr_of(proc).strip().splitlines()
    assert rc == 1 and err[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}: "), err
    assert "Traceback" not in "\n".join(err)


def test_model_that_fails_to_load_stops_the_server() -> None:
    """The model loads after the HTTP server is up: a missing one stops it, exit 1, the error last."""
    proc = start_server(free_port(), "--model", str(ROOT / "no-such-model"))
    rc = proc.wait(timeout=120)
    err = stderr_of(proc).strip().splitlines()
    assert rc == 1 and err[-1].startswith("error: model path not found"), err
    assert "Traceback" not in "\n".join(err)


def test_a_load_that_fails_while_the_generator_is_built_still_exits_1(monkeypatch: Any, capsys: Any) -> None:
    """The loading thread's interrupt can land before the HTTP server is up: still exit 1 and the error."""
    from gearbx_mlx.server import app
    from gearbx_mlx.server.options import build_parser

    class SlowToBuild(app.GearResponseGenerator):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)  # starts the thread whose load fails at once
            end = time.monotonic() + 30
            while time.monotonic() < end:  # the interrupt lands here: short sleeps, as the interrupt the
                time.sleep(0.05)  # thread sends is seen between two of them (it does not cut one short)

    served: List[bool] = []
    monkeypatch.setattr(app, "GearResponseGenerator", SlowToBuild)
    monkeypatch.setattr(app, "_run_http_server", lambda *a, **k: served.append(True))
    args = build_parser().parse_args(["--model", str(ROOT / "no-such-model")])
    assert app.serve(args) == 1 and not served
    assert capsys.readouterr().err.strip().startswith("error: model path not found")


# -- the request object, flags and byte count without a server --------------------------------


def test_request_options() -> None:
    from gearbx_mlx.server.options import GearOptions, request_options

    default = GearOptions(gear="dynamic", speculative="auto")
    assert request_options(None, default, True) == default
    assert request_options({"gear": "high", "speculative": False}, default, True) == GearOptions("high", None, "off")
    assert request_options({"gear": None, "speculative": None}, default, True) == GearOptions("dynamic", None, "off")
    assert request_options({"thresholds": [0.5, 3], "speculative": "off"}, default, True).thresholds == (0.5, 3.0)
    for value, words in [
        ({"thresholds": [0.5, 3]}, "give speculative 'off'"),  # the server's default here drafts
        ({"speculative": "always"}, "gearbx.speculative must be one of off, auto, force"),
        ({"thresholds": [1, float("nan")]}, "two finite numbers"),
        ({"thresholds": [True, 2]}, "two finite numbers"),
        ({"gear": "low", "thresholds": [1, 2], "speculative": "off"}, "apply to the dynamic policy"),
        ([], "gearbx must be an object"),
    ]:
        with pytest.raises(ValueError, match=words):
            request_options(value, default, True)
    with pytest.raises(ValueError, match="needs a server started with --speculative"):
        request_options({"speculative": "force"}, GearOptions(), False)


def test_unknown_gearbx_keys_are_ignored() -> None:
    from hypothesis import given, settings, strategies as st

    from gearbx_mlx.server.options import GearOptions, request_options

    known = {"gear", "thresholds", "speculative"}

    @settings(max_examples=50, deadline=None)
    @given(st.dictionaries(st.text(min_size=1).filter(lambda k: k not in known),
                           st.one_of(st.none(), st.integers(), st.text()), max_size=4))
    def check(extra: Dict[str, Any]) -> None:
        assert request_options({**extra, "gear": "mid"}, GearOptions(), False) == GearOptions("mid", None, "off")

    check()


def test_server_flags() -> None:
    from gearbx_mlx.server.options import build_parser

    p = build_parser()
    args = p.parse_args(["--static-gear", "high", "--kv-bits", "4", "--port", "0"])
    assert (args.host, args.port, args.static_gear, args.kv_bits, args.prompt_cache_size) == (
        "127.0.0.1", 0, "high", 4, 10)
    for flag in ("--prompt", "--trace", "--quiet"):  # one prompt's flags: not a server's
        with pytest.raises(SystemExit):
            p.parse_args([flag, "x"] if flag != "--quiet" else [flag])


def test_max_tokens_is_mlx_lms_default_and_a_cap_only_when_given() -> None:
    """Without --max-tokens a request that names none gets mlx_lm.server's 512 and may ask for more
    (the model's context is the limit); --max-tokens N is the default and the cap."""
    from gearbx_mlx.server.options import build_parser, check_max_tokens

    args = build_parser().parse_args([])
    check_max_tokens(args)
    assert (args.max_tokens, args.max_tokens_cap) == (512, None)
    args = build_parser().parse_args(["--max-tokens", "64"])
    check_max_tokens(args)
    assert (args.max_tokens, args.max_tokens_cap) == (64, 64)
    args = build_parser().parse_args(["--max-tokens", "0"])
    with pytest.raises(ValueError, match="--max-tokens must be >= 1"):
        check_max_tokens(args)


def test_weight_bytes() -> None:
    from gearbx_mlx.server.generator import Response, weight_bytes

    step = {"low": 1.0, "mid": 2.0, "high": 5.0}
    routed = [Response("", 1, 0.0, None, (), gear=g) for g in ("low", "high", "mid")]
    assert weight_bytes(routed, step, None) == 8
    # two blocks: 2 drafts (both accepted, then the high gear's bonus token) and 1 draft (rejected)
    spec = [Response("", 1, 0.0, None, (), gear=g, drafted=d, block=b)
            for g, d, b in [("low", 2, 0), ("low", 2, 0), ("high", 2, 0), ("high", 1, 1)]]
    assert weight_bytes(spec, step, "low") == (2 * 1 + 5) + (1 * 1 + 5)


def test_a_warning_and_an_error_line_are_each_one_write(monkeypatch: Any) -> None:
    """The server's warning (HTTP thread) and its load error (main thread) went out as text and
    newline apart, so a line written in between joined them: ``...checks.error: model path not
    found``. Each line is now one write."""
    from gearbx_mlx import console

    writes: List[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    console.show_warning("mlx_lm.server is not recommended", UserWarning, "x.py", 1)
    console.say(argparse.Namespace(rank=0), "note")
    console.stderr_line(console.error_line(FileNotFoundError("model path not found: x")))
    assert writes == ["[gearbx] warning: mlx_lm.server is not recommended\n", "[gearbx] note\n",
                      "error: model path not found: x\n"]


def test_a_request_without_max_tokens_gets_what_the_context_leaves() -> None:
    """The cap (--max-tokens) is the default, shortened to fit the context after the prompt; an
    explicit max_tokens past the context is refused; so are an empty prompt and a top_k past the
    vocabulary (checked on the generation thread, before anything is sent)."""
    from types import SimpleNamespace

    from gearbx_mlx.server.generator import GearResponseGenerator
    from gearbx_mlx.server.options import GearOptions
    from gearbx_mlx.server.provider import RequestError

    gen = GearResponseGenerator.__new__(GearResponseGenerator)
    gen.model_provider = SimpleNamespace(context_length=100, gearbox=SimpleNamespace(vocab_size=1000))

    def args(max_tokens: int, top_k: int = 0) -> Any:
        return SimpleNamespace(max_tokens=max_tokens, sampling=SimpleNamespace(top_k=top_k, xtc_probability=0.0),
                               logits=SimpleNamespace())

    a = args(256)
    gen._check([1] * 40, a, GearOptions(), max_tokens_given=False)
    assert a.max_tokens == 60
    a = args(20)
    gen._check([1] * 40, a, GearOptions(), max_tokens_given=False)
    assert a.max_tokens == 20
    for prompt, a, words in (([1] * 40, args(256), "exceed the model's context of 100"),
                             ([], args(4), "the prompt has no tokens"),
                             ([1], args(4, top_k=1000), "top_k must be below the vocabulary size (1000)")):
        with pytest.raises(RequestError, match=re.escape(words)):
            gen._check(prompt, a, GearOptions(), max_tokens_given=True)


def test_usage_names_the_thresholds_that_routed_the_request(server: int) -> None:
    """A dynamic request's thresholds (its own or the server's); none for a static gear or a draft."""
    base = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    cases = [({"gear": "dynamic", "speculative": "off", "thresholds": [0.5, 3]}, [0.5, 3.0]),
             ({"gear": "low", "speculative": "off"}, None), ({"speculative": "force"}, None)]
    for gearbx, want in cases:
        status, out = request(server, "/v1/chat/completions", {**base, "gearbx": gearbx})
        assert status == 200, out
        assert out["usage"]["gearbx"]["options"]["thresholds"] == want, gearbx
    status, out = request(server, "/v1/chat/completions", {**base, "gearbx": {"speculative": "off"}})
    low, high = out["usage"]["gearbx"]["options"]["thresholds"]
    assert 0 <= low < high


def test_stream_options_without_include_usage_is_openais_false(server: int) -> None:
    """``stream_options: {}`` raised a KeyError in mlx-lm's handler: the stream ended without [DONE]."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "stream": True,
                       "stream_options": {}, "gearbx": POLICIES["high"]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=300) as r:
        data = [line.decode().strip()[len("data: "):] for line in r if line.startswith(b"data: ")]
    assert data[-1] == "[DONE]", data
    events = [json.loads(d) for d in data[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)


#: The request of the stop-string cases, without its stop.
STOP_BODY = {"messages": MESSAGES, "max_tokens": 12, "gearbx": POLICIES["high"]}


@pytest.fixture(scope="session")
def whole_answer(server: int) -> str:
    """The greedy answer to STOP_BODY without a stop: asked for once, for both stop-string cases."""
    return request(server, "/v1/chat/completions", STOP_BODY)[1]["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_that_spans_tokens_ends_the_answer(server: int, whole_answer: str, stream: bool) -> None:
    """mlx-lm matches stop words by their own tokenization: a stop that is part of a word, or a
    word without the space the model's token carries, never matched the model's tokens; its text
    was cut out of the middle and the answer ran on to its length."""
    body, full = STOP_BODY, whole_answer
    words = full.split(" ")
    assert len(words) > 6, full
    stop = words[4][1:] if len(words[4]) > 2 else words[4]  # a word without its space, cut: not a token
    assert stop and stop in full, (stop, full)
    if stream:
        events = list(sse(server, "/v1/chat/completions", {**body, "stop": [stop]}))
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    else:
        choice = request(server, "/v1/chat/completions", {**body, "stop": stop})[1]["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    # the answer ends where the stop string begins, as OpenAI's does: the text before it in the
    # token that completes it is kept
    assert finish == "stop" and text == full[:full.index(stop)], (text, full, stop)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_a_token_keeps_the_tokens_text_before_it(server: int, whole_answer: str,
                                                                      stream: bool) -> None:
    """A one-letter stop string sits inside a token (or right after its space): the text before it
    in that token was dropped with the token."""
    full = whole_answer
    stop = next(c for c in "aeiou" if c in full)
    body = {**STOP_BODY, "stop": stop}
    if stream:
        events = list(sse(server, "/v1/chat/completions", body))
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    else:
        text = request(server, "/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
    assert text == full[:full.index(stop)], (text, full, stop)


# -- hostile requests: refused before any work, the server stays up ------------------------


def raw_post(port: int, head: str, body: bytes = b"", timeout: float = 60) -> Tuple[int, str]:
    """``(status, body text)`` of a POST written byte for byte (headers ``head``, then ``body``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode() + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.read().decode()


def test_image_parts_are_refused_before_their_url_is_fetched(server: int) -> None:
    """A text model's server answers an image part with a 400 and never fetches its URL."""
    import http.server

    hits: List[str] = []

    class Listener(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    web = http.server.HTTPServer(("127.0.0.1", 0), Listener)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{web.server_address[1]}/secret.txt"
        for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "input_image", "image_url": url}):
            body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], "max_tokens": 2}
            status, out = request(server, "/v1/chat/completions", body)
            assert status == 400 and "only text parts are supported" in out["error"], out
        assert hits == []
    finally:
        web.shutdown()


@pytest.mark.parametrize("messages, words", [
    ([{"content": "hi"}], "messages[0] needs a role"),
    ([{"role": "user", "content": 42}], "messages[0].content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0] needs a text"),
    ([{"role": "user", "content": ["hi"]}], "only text parts are supported"),
])
def test_ill_formed_messages_are_400(server: int, messages: Any, words: str) -> None:
    status, out = request(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400 and words in out["error"], out


def test_bodies_the_server_cannot_read_are_refused_and_it_stays_up(server: int) -> None:
    """A Content-Length that is no count, a body past --max-request-bytes (not read: refused from its
    header), and bytes that are not UTF-8 each get one error status; a huge invalid body is not
    copied into the log."""
    status, text = raw_post(server, "Content-Type: application/json\r\nContent-Length: -1\r\n")
    assert status == 400 and "Invalid Content-Length" in text, text
    status, text = raw_post(server, f"Content-Type: application/json\r\nContent-Length: {2**40}\r\n")
    assert status == 413 and "--max-request-bytes" in text, text
    bad = b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'
    status, text = raw_post(server, f"Content-Length: {len(bad)}\r\n", bad)
    assert status == 400 and "not UTF-8" in text, text
    junk = b'{"a": "' + b"y" * 200_000
    status, text = raw_post(server, f"Content-Length: {len(junk)}\r\n", junk)
    assert status == 400 and "Invalid JSON" in text, text
    assert "y" * 1000 not in stderr_of(PROCESSES[server])
    deep = b"[" * 100_000
    status, text = raw_post(server, f"Content-Length: {len(deep)}\r\n", deep)
    assert status == 400 and "nested too deeply" in text, text
    status, out = request(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


def test_null_optional_fields_are_left_out(server: int) -> None:
    """OpenAI lets these be null (the client libraries send them so): taken as not given."""
    body = {"messages": MESSAGES, "max_tokens": 2, "n": None, "temperature": None, "top_p": None, "stop": None,
            "seed": None, "logprobs": None, "stream": None, "frequency_penalty": None, "user": None}
    status, out = request(server, "/v1/chat/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


def test_penalties_under_auto_decode_plainly_and_force_refuses_them(server: int) -> None:
    """This server's requests draft with ``auto`` by default; a penalty makes ``auto`` decode plainly
    in the high gear (no drafts), where ``force`` still gets a 400."""
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "frequency_penalty": 0.5}
    status, out = request(server, "/v1/chat/completions", body)
    assert status == 200, out
    tokens = out["choices"][0]["gearbx"]["tokens"]
    assert len(tokens) == 3 and all(t["gear"] == "high" and t["drafted"] is None for t in tokens), tokens
    status, out = request(server, "/v1/chat/completions", {**body, "gearbx": {"speculative": "force"}})
    assert status == 400 and "cannot be combined with speculative decoding" in out["error"], out


def test_a_client_gone_during_a_long_prefill_stops_it(server: int) -> None:
    """A client that closes its connection while its prompt is processed stops the prefill at the next
    chunk (or before it starts): the prompt is never finished, and the next request is served."""
    log = stderr_of(PROCESSES[server])
    before = log.count("client disconnected")
    body = json.dumps({"prompt": "sky " * 3000, "max_tokens": 4, "stream": True, "gearbx": POLICIES["high"]})
    with socket.create_connection(("127.0.0.1", server), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        assert sock.recv(12).startswith(b"HTTP/1.")  # the stream's headers: the request left the queue
    status, out = request(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 2, "gearbx": POLICIES["high"]})
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    log = stderr_of(PROCESSES[server])
    assert log.count("client disconnected") > before, log[-2000:]
    totals = {int(t) for d, t in re.findall(r"Prompt processing progress: (\d+)/(\d+)", log) if int(t) > 3000}
    finished = {int(t) for d, t in re.findall(r"Prompt processing progress: (\d+)/(\d+)", log) if d == t}
    assert not totals & finished, "the abandoned prompt was processed to its end"
    assert "Traceback" not in log, log[-2000:]
