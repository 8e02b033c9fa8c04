"""The server backend: entropy bounds, the SSE client, errors, and a real mlx_lm.server."""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, List

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gearbx_mlx.chat import encode_chat
from gearbx_mlx.remote import cli as remote_cli, session as remote_lib
from gearbx_mlx.remote.bounds import entropy_bounds, max_slack
from gearbx_mlx.remote.openai_client import api_base, free_port, local_mlx_server, parse_chunk, piece_text
from gearbx_mlx.telemetry.trace import read_trace

#: Entropies from the server (KV-cached decode) and from one local forward
#: pass differ by float32 rounding only.
BITS_TOL = 2e-3
SERVER_START_S = 90


def exact_entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


# -- the bounds ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(v=st.integers(20, 400), k=st.integers(1, 12), temp=st.floats(0.1, 5.0), seed=st.integers(0, 10**6))
def test_bounds_bracket_the_exact_entropy(v, k, temp, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(v) * temp
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = np.sort(p)[::-1][:k]
    b = entropy_bounds(np.log(top).tolist(), v)
    h = exact_entropy(p)
    assert 0 <= b.lower <= h + 1e-9 <= b.upper + 2e-9 <= math.log2(v) + 3e-9
    assert b.slack <= max_slack(b.residual, top.min(), v, k) + 1e-9


def test_bounds_edge_cases():
    b = entropy_bounds([0.0], 10)  # all mass on one token
    assert b.lower == b.upper == 0.0
    b = entropy_bounds([math.log(0.5), math.log(0.5)], 4)  # nothing left over
    assert b.lower == pytest.approx(1.0) and b.upper == pytest.approx(1.0)
    assert entropy_bounds([math.log(0.25)] * 2, 4).lower == pytest.approx(2.0)  # tail must be 2 x 0.25
    with pytest.raises(ValueError, match="top_logprobs"):
        entropy_bounds([], 10)
    with pytest.raises(ValueError, match="vocab-size"):
        entropy_bounds([-1.0, -2.0], 1)


# -- parsing ----------------------------------------------------------------------------------
def test_api_base_and_variants():
    assert api_base("http://h:8080") == "http://h:8080/v1"
    assert api_base("http://h:8080/v1/") == "http://h:8080/v1"
    assert api_base("https://h/v1/chat/completions") == "https://h/v1"
    with pytest.raises(ValueError, match="http"):
        api_base("h:8080")
    v = remote_lib.parse_variants(["low=http://a:1,small", "high=http://b:2/v1,big"])
    assert v["low"].model == "small" and v["high"].url == "http://b:2/v1"
    assert remote_lib.variant_for(v, "mid").gear == "high"  # the nearest more precise
    assert set(remote_lib.parse_variants(["http://a:1"])) == {"low", "mid", "high"}
    with pytest.raises(ValueError, match="gear"):
        remote_lib.parse_variants(["fast=http://a:1"])


def test_parse_chunk_openai_and_mlx_lm_forms():
    openai = {"choices": [{"delta": {"content": " the"}, "finish_reason": None, "logprobs": {"content": [
        {"token": " the", "logprob": -0.1, "top_logprobs": [{"token": " the", "logprob": -0.1},
                                                            {"token": " a", "logprob": -2.5}]}]}}]}
    c = parse_chunk(openai, greedy=False)
    assert c.text == " the" and c.tokens[0].text == " the" and len(c.tokens[0].top) == 2
    # mlx-lm 0.32.2: the entry is top[0] in argpartition order, not the sampled token.
    mlx = {"choices": [{"message": {"content": "!"}, "finish_reason": "stop", "logprobs": {"content": [
        {"id": 28, "token": ",", "logprob": -0.96, "top_logprobs": [
            {"id": 28, "token": ",", "logprob": -0.96}, {"id": 17, "token": "!", "logprob": -0.74},
            {"id": 665, "token": "\u0120there", "logprob": -3.0}]}]}}]}
    assert parse_chunk(mlx, greedy=True).tokens[0].token_id == 17
    unknown = parse_chunk(mlx, greedy=False).tokens[0]
    assert unknown.token_id is None and unknown.text is None and len(unknown.top) == 3
    assert piece_text("\u0120there") == " there" and piece_text("\u2581the") == " the"
    # text without logprobs: what mlx-lm streams
    assert not parse_chunk({"choices": [{"delta": {"content": "Hi"}}]}, True).has_logprobs


# -- errors -------------------------------------------------------------------------------------
def test_unreachable_server_fails_fast(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    tic = time.perf_counter()
    code = remote_cli.main(["--variant", f"http://127.0.0.1:{free_port()}", "--vocab-size", "100",
                            "-p", "hi", "--trace", str(trace), "--quiet"])
    assert code == 1 and time.perf_counter() - tic < 10
    err = capsys.readouterr().err
    assert "error: connection refused" in err and "Traceback" not in err
    t = read_trace(trace)
    assert t.tokens == [] and "refused" in t.summary["error"]
    assert remote_cli.main(["--variant", f"http://127.0.0.1:{free_port()}", "--vocab-size", "100", "-p", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # not quiet: no summary of no tokens, the error alone
    assert "==========" not in err and err[-1].startswith("error: connection refused"), err


def test_the_command_line_runs_as_a_module_and_as_gearbx_remote():
    """``python -m gearbx_mlx.remote`` and the ``gearbx-remote`` entry point reach the same ``main``."""
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    module, name = scripts["gearbx-remote"].split(":")
    assert getattr(importlib.import_module(module), name) is remote_cli.main
    out = subprocess.run([sys.executable, "-m", "gearbx_mlx.remote", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--variant" in out.stdout and "python -m gearbx_mlx.remote" in out.stdout


def test_missing_vocab_size_is_a_clear_error(capsys):
    assert remote_cli.main(["--variant", "http://127.0.0.1:9", "-p", "hi"]) == 1
    assert "--vocab-size" in capsys.readouterr().err


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def token_event(text: str) -> bytes:
    return sse({"choices": [{"index": 0, "finish_reason": None, "delta": {"content": text},
                             "logprobs": {"content": [{"token": text, "logprob": -0.2, "top_logprobs": [
                                 {"token": text, "logprob": -0.2}, {"token": "x", "logprob": -2.0}]}]}}]})


class FakeServer:
    """An http.server in a thread that answers every POST with ``body`` (then closes)."""

    def __init__(self, body: bytes, status: int = 200, delay: float = 0.0,
                 content_type: str = "text/event-stream") -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests += 1
                time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.requests = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True  # a handler still sleeping does not hold the test
        self.httpd.block_on_close = False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # polled every 0.05 s (not http.server's 0.5 s): shutdown() waits for the poll, once per test
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("tail, message", [
    (b"data: {\"choices\": [{\"delta\"\n\n", "malformed SSE event 3"),  # not JSON
    (b"", "truncated"),  # the connection closes with no [DONE] and no finish_reason
    (b"data: {\"choices\": [{\"delta\": {\"content\"", "truncated"),  # cut inside an event
])
def test_bad_stream_gives_clear_error_and_keeps_partial_trace(tmp_path, capsys, tail, message):
    trace = tmp_path / "t.jsonl"
    with FakeServer(token_event("Hello") + token_event(" world") + tail) as srv:
        code = remote_cli.main(["--variant", srv.url, "--vocab-size", "100", "-p", "hi", "--trace", str(trace)])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err
    t = read_trace(trace)
    assert [r["text"] for r in t.tokens] == ["Hello", " world"]
    assert t.summary["error"] and message in t.summary["error"]
    assert all(r["entropy"] <= r["entropy_upper"] for r in t.tokens)


def test_silent_server_times_out(capsys):
    with FakeServer(b"", delay=5.0) as srv:
        tic = time.perf_counter()
        code = remote_cli.main(["--variant", srv.url, "--vocab-size", "100", "-p", "hi", "--timeout", "0.5"])
        assert code == 1 and time.perf_counter() - tic < 4
    assert "no answer from" in capsys.readouterr().err


def test_http_error_status_is_reported(capsys):
    with FakeServer(b'{"error": "model not found"}', status=500) as srv:
        assert remote_cli.main(["--variant", srv.url, "--vocab-size", "100", "-p", "hi"]) == 1
    assert "HTTP 500" in capsys.readouterr().err


def test_a_json_error_answering_a_stream_is_the_servers_message(tmp_path, capsys):
    """Some servers answer a streamed request that they refuse with one JSON error object
    (status 200, Content-Type JSON): its message is reported, not "malformed SSE"."""
    trace = tmp_path / "t.jsonl"
    body = b'{"error": {"message": "model \'big\' not found", "type": "invalid_request_error"}}'
    with FakeServer(body, content_type="application/json") as srv:
        code = remote_cli.main(["--variant", srv.url, "--vocab-size", "100", "-p", "hi", "--trace", str(trace)])
    err = capsys.readouterr().err
    assert code == 1 and "reported an error: model 'big' not found" in err and "SSE" not in err, err
    assert "not found" in read_trace(trace).summary["error"]


def test_a_whole_json_answer_to_a_streamed_request_is_read(capsys):
    """A server that ignores ``stream`` and answers with one JSON object: the answer is used."""
    answer = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "Hi"},
                           "logprobs": {"content": [{"token": "Hi", "logprob": -0.2, "top_logprobs": [
                               {"token": "Hi", "logprob": -0.2}, {"token": "x", "logprob": -2.0}]}]}}]}
    with FakeServer(json.dumps(answer).encode(), content_type="application/json; charset=utf-8") as srv:
        s = remote_lib.RemoteSession(remote_lib.parse_variants([srv.url]), 100)
        result = s.ask("hello")
    assert result.text == "Hi" and result.tokens == 1 and srv.requests == 1


def test_streamed_session_routes_per_prompt(tmp_path):
    done = sse({"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}]}) + b"data: [DONE]\n\n"
    with FakeServer(token_event("Hi") + token_event("!") + done) as srv:
        s = remote_lib.RemoteSession(remote_lib.parse_variants([srv.url]), 100)
        first = s.ask("hello there")
        second = s.ask("Solve x^2 + 3x = 10 and prove the result.")
    assert first.classifier_gear == "low" and first.text == "Hi!" and first.tokens == 2
    assert second.variant == "high" and second.session_gear is not None
    assert [r["prompt"] for r in s.records] == [0, 0, 1, 1]
    assert s.summary()["tokens_per_variant"] == {"low": 2, "mid": 0, "high": 2}


# -- a real mlx_lm.server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlx_server() -> Iterator[str]:
    """``mlx_lm.server`` with the default model on a free port; always stopped."""
    from gearbx_mlx.sources.models import default_model_path

    model = str(default_model_path())
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(local_mlx_server(model, SERVER_START_S))
        except RuntimeError as e:
            pytest.fail(str(e))
        yield url, model


@pytest.mark.slow
def test_bounds_hold_against_a_real_server(mlx_server, default_model, tmp_path):
    import mlx.core as mx

    from gearbx_mlx.entropy import entropy_bits

    url, model_dir = mlx_server
    prompt = "Name three colours of the rainbow."
    trace = tmp_path / "remote.jsonl"
    code = remote_cli.main(["--variant", f"{url},{model_dir}", "-p", prompt, "-m", "8",
                            "--top-k", "10", "--trace", str(trace), "--quiet"])
    assert code == 0
    t = read_trace(trace)
    assert t.header["entropy_is_lower_bound"] and t.header["top_k"] == 10
    assert t.header["vocab_size"] == 49152 and t.summary["error"] is None
    ids: List[int] = [r["token"] for r in t.tokens]
    assert len(ids) >= 4 and all(isinstance(i, int) for i in ids)

    # Teacher-force the server's greedy tokens through the same model here.
    model, tok, _ = default_model
    prefix = encode_chat(tok, prompt)
    logits = model(mx.array(prefix + ids[:-1])[None])[0, len(prefix) - 1:]
    exact = entropy_bits(logits).tolist()
    assert mx.argmax(logits, axis=-1).tolist() == ids  # the same greedy continuation
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    kth = mx.sort(probs, axis=-1)[:, -10].tolist()  # the 10th largest probability, exactly
    for r, h, pk in zip(t.tokens, exact, kth):
        assert r["entropy"] <= h + BITS_TOL, (r, h)
        assert h <= r["entropy_upper"] + BITS_TOL, (r, h)
        # The truth is within the slack k leaves: r log2((V - k) p_k / r) above the lower bound.
        assert h - r["entropy"] <= max_slack(r["residual_mass"], pk, 49152, 10) + BITS_TOL, (r, h)


def test_session_options_by_keyword_or_object_and_bad_ones_named():
    from gearbx_mlx.remote import RemoteSession, SessionOptions, parse_variants

    variants = parse_variants(["http://127.0.0.1:9"])
    by_kw = RemoteSession(variants, 100, max_tokens=3, top_k=4)
    by_obj = RemoteSession(variants, 100, options=SessionOptions(max_tokens=3, top_k=4))
    assert by_kw.options == by_obj.options and by_kw.options.max_tokens == 3 and by_obj.options.top_k == 4
    with pytest.raises(TypeError, match="RemoteSession: .*topk"):
        RemoteSession(variants, 100, topk=4)
    for bad, words in [({"top_k": 0}, "top_k must be in 1..20"), ({"stream": "yes"}, "stream must be"),
                       ({"max_tokens": True}, "max_tokens must be an integer")]:
        with pytest.raises(ValueError, match=words):
            RemoteSession(variants, 100, **bad)
