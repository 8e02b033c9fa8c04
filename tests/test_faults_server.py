"""Fault injection: the server client against servers that stall, trickle, never end,
or send oversized and malformed answers (all on 127.0.0.1, see fault_servers.py).

Promises under test: the client ends within ``--timeout`` + 1 s of a server
that makes no progress, within ``--deadline`` + 1 s of one that never
finishes, stops at its own token cap, reads a bounded number of bytes per
answer, keeps the API key off plain-http hosts, and turns every fault into
one ``error:`` line, a non-zero exit and a valid trace.
"""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
from fault_servers import (
    DONE,
    RawServer,
    answer,
    empty_events,
    endless_tokens,
    flood,
    keepalive,
    slow_tokens,
    sse,
    stall,
    token_event,
    trickle_event,
    trickle_status,
)
from hypothesis import given, settings, strategies as st

from gearbx_mlx.remote import cli as remote_cli, session as remote_lib
from gearbx_mlx.remote.openai_client import parse_chunk
from gearbx_mlx.remote.transport import Limits, Request, check_key_transport
from gearbx_mlx.telemetry.trace import read_trace

#: What "ends within --timeout + 1 s" allows on a loaded machine, on top of the limit.
SLACK_S = 1.0
TIMEOUT_S = 0.5


def run_cli(capsys, url: str, *extra: str, trace=None) -> tuple:
    args = ["--variant", url, "--vocab-size", "100", "-p", "hi", "--quiet", *extra]
    if trace is not None:
        args += ["--trace", str(trace)]
    tic = time.monotonic()
    code = remote_cli.main(args)
    seconds = time.monotonic() - tic
    err = capsys.readouterr().err
    return code, seconds, err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- time: stalls, trickles, endless streams --------------------------------------------------------
@pytest.mark.parametrize("behaviour, message", [
    (stall, "no answer from"),  # accepts, never answers
    (trickle_status, "no answer from"),  # a status line one byte at a time
    (keepalive, "no progress"),  # keep-alive comments forever
    (trickle_event, "no progress"),  # an event whose line never ends, one byte at a time
])
def test_a_server_without_progress_is_left_within_the_timeout(tmp_path, capsys, behaviour, message):
    trace = tmp_path / "t.jsonl"
    with RawServer(behaviour) as srv:
        code, seconds, err = run_cli(capsys, srv.url, "--timeout", str(TIMEOUT_S), trace=trace)
    assert code == 1 and seconds < TIMEOUT_S + SLACK_S, (seconds, err)
    assert message in one_error_line(err) and "--timeout" in err
    t = read_trace(trace)
    assert message in t.summary["error"] and t.summary["interrupted"] is False


def test_a_server_that_never_finishes_is_left_at_the_deadline(tmp_path, capsys):
    """Progress every 0.2 s keeps the idle timer happy; the deadline still ends it."""
    trace = tmp_path / "t.jsonl"
    with RawServer(slow_tokens(0.2)) as srv:
        code, seconds, err = run_cli(capsys, srv.url, "--timeout", "5", "--deadline", "1", "-m", "1000",
                                     trace=trace)
    assert code == 1 and 1 <= seconds < 1 + SLACK_S, (seconds, err)
    assert "--deadline" in one_error_line(err)
    t = read_trace(trace)
    assert 2 <= len(t.tokens) <= 10  # the tokens that came before the deadline are kept


def test_an_endless_token_stream_stops_at_max_tokens(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    with RawServer(endless_tokens) as srv:
        args = ["--variant", srv.url, "--vocab-size", "100", "-p", "hi", "-m", "8", "--trace", str(trace)]
        tic = time.monotonic()
        code = remote_cli.main(args)
        seconds = time.monotonic() - tic
    err = capsys.readouterr().err
    assert code == 0 and seconds < 5, seconds
    assert "stopped reading" in err and "Traceback" not in err
    t = read_trace(trace)
    assert len(t.tokens) == 8 and t.summary["generation_tokens"] == 8
    assert t.summary["finish_reason"] == "length"
    assert trace.stat().st_size < 64 * 1024


def test_endless_empty_events_hit_the_event_cap(capsys):
    with RawServer(empty_events) as srv:
        code, seconds, err = run_cli(capsys, srv.url, "-m", "8")
    assert code == 1 and seconds < 5
    assert "events" in one_error_line(err) and "stopped reading" in err


# -- bytes: oversized answers ----------------------------------------------------------------------
def test_an_oversized_body_is_not_read_whole(capsys):
    """100 MB without a declared length: the client stops at its budget, memory stays bounded."""
    limit = Limits().answer_bytes(8)
    with RawServer(flood(100 << 20)) as srv:
        tracemalloc.start()
        try:
            code, seconds, err = run_cli(capsys, srv.url, "-m", "8", "--stream", "off")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert code == 1 and "MiB" in one_error_line(err) and "stopped reading" in err
    assert peak < 4 * limit + (8 << 20), peak  # the budget (and its join), never the 100 MB


def test_a_declared_oversized_body_is_refused_before_reading(capsys):
    with RawServer(flood(100 << 20, declare=True)) as srv:
        code, seconds, err = run_cli(capsys, srv.url, "-m", "8", "--stream", "off")
    assert code == 1 and "exceeds" in one_error_line(err) and seconds < 3


def test_an_endless_sse_line_is_cut_at_the_event_limit(capsys):
    with RawServer(flood(8 << 20, content_type="text/event-stream")) as srv:
        code, seconds, err = run_cli(capsys, srv.url, "-m", "500")
    assert code == 1 and "exceeds" in one_error_line(err) and seconds < 5


def test_a_huge_http_error_body_is_read_to_a_few_kib_and_shown_on_one_line(capsys):
    body = b"line one\nline two\n" + b"y" * (100 << 20)
    with RawServer(lambda peer: peer.send(b"HTTP/1.1 500 X\r\nConnection: close\r\n\r\n") and peer.send(body)) as srv:
        tracemalloc.start()
        try:
            code, seconds, err = run_cli(capsys, srv.url)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    line = one_error_line(err)
    assert code == 1 and "HTTP 500" in line and "line one line two" in line and len(line) < 500
    assert peak < 8 << 20 and seconds < 5


# -- content: malformed answers -------------------------------------------------------------------------
def _event(logprobs: object) -> bytes:
    return sse({"choices": [{"index": 0, "finish_reason": None, "delta": {"content": "a"}, "logprobs": logprobs}]})


@pytest.mark.parametrize("body", [
    _event({"content": [{"token": "a", "logprob": -0.1, "top_logprobs": {"a": -0.1}}]}),  # a dict, not a list
    _event({"content": [{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": [1]}]}]}),
    _event({"content": [{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": 5, "logprob": -1}]}]}),
    _event({"content": [{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": "x"}]}]}),
    _event({"content": [{"token": "a", "logprob": 0.5, "top_logprobs": [{"token": "a", "logprob": 0.5}]}]}),
    _event({"content": 7}),
    _event({"tokens": "abc", "token_logprobs": [-1.0]}),
    _event({"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [["a", -1.0]]}),
    _event({"tokens": ["a", "b"], "token_logprobs": [-1.0]}),
    sse({"choices": [{"delta": {"content": ["a"]}}]}),
    sse({"choices": [{"delta": {"content": "a"}, "finish_reason": 3}]}),
    sse({"error": {"message": "bad\nthing"}}),
    b'data: {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [{"logprob": NaN}]}}]}\n\n',
])
def test_malformed_answers_are_one_error_line_and_a_valid_trace(tmp_path, capsys, body):
    trace = tmp_path / "t.jsonl"
    with RawServer(answer(token_event("ok") + body + DONE)) as srv:
        code, _, err = run_cli(capsys, srv.url, "--stream", "on", trace=trace)
    assert code == 1
    one_error_line(err)
    t = read_trace(trace)
    assert [r["text"] for r in t.tokens] == ["ok"] and t.summary["error"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "delta", "message", "content", "text", "logprobs", "token", "logprob",
                         "top_logprobs", "tokens", "token_logprobs", "id", "finish_reason", "error"]),
        inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(event=JSON, greedy=st.booleans())
def test_parse_chunk_raises_only_value_error(event, greedy):
    try:
        parse_chunk(event, greedy)
    except ValueError:
        pass


@settings(max_examples=100, deadline=None)
@given(logprobs=JSON)
def test_parse_chunk_on_any_logprobs_shape(logprobs):
    try:
        c = parse_chunk({"choices": [{"delta": {"content": "a"}, "logprobs": logprobs}]}, greedy=True)
    except ValueError:
        return
    for tok in c.tokens:  # whatever passes is well typed
        assert all(isinstance(p, float) and p <= 1e-6 for _, _, p in tok.top)


# -- the API key --------------------------------------------------------------------------------------
def test_the_api_key_never_goes_to_a_plain_http_host_unasked(capsys):
    with pytest.raises(ValueError, match="unencrypted"):
        check_key_transport("http://example.com:8080/v1")
    check_key_transport("https://example.com/v1")
    for local in ("http://127.0.0.1:1/v1", "http://localhost:1/v1", "http://[::1]:1/v1"):
        check_key_transport(local)
    check_key_transport("http://example.com/v1", allow_plain_http=True)
    with pytest.raises(ValueError, match="unencrypted"):
        Request("http://10.0.0.1:1/v1/chat/completions", {}, api_key="k")
    # The CLI refuses before connecting (a non-routable address would take the connect timeout).
    tic = time.monotonic()
    code = remote_cli.main(["--variant", "http://10.255.255.1:9", "--vocab-size", "100", "-p", "hi", "--api-key", "k"])
    err = capsys.readouterr().err
    assert code == 1 and "https" in one_error_line(err) and time.monotonic() - tic < 2


def test_the_api_key_goes_to_a_loopback_server(capsys):
    with RawServer(answer(token_event("a") + DONE)) as srv:
        assert remote_cli.main(["--variant", srv.url, "--vocab-size", "100", "-p", "hi", "--quiet",
                                "--api-key", "sekrit"]) == 0
    assert srv.requests[0]["headers"]["authorization"] == "Bearer sekrit"


# -- flags and stdin --------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (("--timeout", "0"), "--timeout must be a positive number"),
    (("--timeout", "-1"), "--timeout must be a positive number"),
    (("--deadline", "nan"), "--deadline must be a positive number"),
    (("--connect-timeout", "inf"), "--connect-timeout must be a positive number"),
    (("--timeout", "1e300"), "--timeout must be a positive number of seconds, at most"),  # was an OverflowError
    (("--connect-timeout", "1e300"), "--connect-timeout must be a positive number of seconds, at most"),
    (("--temp", "-1"), "--temp must be a number >= 0"),
    (("--top-p", "2"), "--top-p must be in (0, 1]"),
    (("--top-k", "0"), "--top-k must be in 1..20"),
    (("--top-k", "21"), "--top-k must be in 1..20"),
    (("-m", "0"), "--max-tokens must be an integer >= 1"),
    (("--thresholds", "1", "1e300"), "above log2(100)"),
    (("--thresholds", "nan", "2"), "--thresholds LOW HIGH must be finite"),
    (("--window", "0"), "window must be an integer from 1 to 1,000,000"),
])
def test_flags_out_of_range_are_one_error_line(capsys, flags, message):
    code = remote_cli.main(["--variant", "http://127.0.0.1:9", "--vocab-size", "100", "-p", "hi", *flags])
    err = capsys.readouterr().err
    assert code == 1 and message in one_error_line(err)


def test_random_bytes_on_stdin_are_one_error_line(capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe\x00bad\x80")))
    code = remote_cli.main(["--variant", "http://127.0.0.1:9", "--vocab-size", "100", "-p", "-"])
    assert code == 1 and "stdin is not UTF-8" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("config", ['{"vocab_size": "49152"}', "[1, 2]", "{not json", '{"vocab_size": 1}'])
def test_a_malformed_model_config_names_its_file(tmp_path, capsys, config):
    (tmp_path / "config.json").write_text(config)
    code = remote_cli.main(["--variant", f"http://127.0.0.1:9,{tmp_path}", "-p", "hi"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 1 and str(tmp_path / "config.json") in line and "--vocab-size" in line


def test_a_good_stream_still_works_after_all_this(tmp_path):
    """The bounds cost nothing to a well-behaved server."""
    with RawServer(answer(token_event("Hi") + token_event("!") + DONE)) as srv:
        s = remote_lib.RemoteSession(remote_lib.parse_variants([srv.url]), 100, max_tokens=2, read_timeout=2)
        res = s.ask("hello")
    assert res.text == "Hi!" and res.tokens == 2 and res.finish_reason == "stop"
    assert json.loads(json.dumps(s.summary()))["generation_tokens"] == 2
