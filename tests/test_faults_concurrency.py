"""Fault injection: two generations on one gearbox at once.

A gearbox's gear, routing hooks and KV transform are its model's state, so a
second generation while one is set up or streaming (in another thread, or a
stream of the same thread not yet finished) is refused with one clear error,
and the first one's text is untouched. A run given up in any way (a loop left
early, a refusal during set-up, a prepared run dropped unstreamed) gives the
gearbox back.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fault_models import tiny_model_folder

from gearbx_mlx.generation import load
from gearbx_mlx.pipeline import prepare, stream_generate

BUSY = "already generating"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder: Path = tiny_model_folder(tmp_path_factory.mktemp("concurrency"))
    return load(str(folder))


def text(loaded, prompt="abc", **kw) -> str:
    model, tok, gb = loaded
    return "".join(r.text for r in stream_generate(model, tok, prompt, gb, max_tokens=8, **kw))


@pytest.mark.parametrize("mode", [None, "plain"])
def test_a_second_stream_while_one_runs_in_this_thread_is_refused(loaded, mode):
    model, tok, gb = loaded
    alone = text(loaded, speculative=mode)
    first = stream_generate(model, tok, "abc", gb, max_tokens=8, speculative=mode)
    got = [next(first).text]
    with pytest.raises(RuntimeError, match=BUSY):
        next(stream_generate(model, tok, "xyz", gb, max_tokens=4))
    got += [r.text for r in first]  # the first stream carries on as if alone
    assert "".join(got) == alone
    assert text(loaded, speculative=mode) == alone  # and the gearbox is free again


def test_threads_on_one_gearbox_get_its_text_or_the_error(loaded):
    alone = text(loaded)
    outs, errors = [], []
    start = threading.Barrier(4)

    def work():
        start.wait()
        try:
            outs.append(text(loaded))
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) + len(errors) == 4 and outs and all(o == alone for o in outs)
    assert all(BUSY in e for e in errors)
    assert text(loaded) == alone


def test_a_run_given_up_gives_the_gearbox_back(loaded):
    model, tok, gb = loaded
    alone = text(loaded)
    for _ in stream_generate(model, tok, "abc", gb, max_tokens=8):
        break  # a loop left early: the stream is closed when it is dropped
    with pytest.raises(ValueError):
        prepare(model, tok, "abc", gb, policy="no-such-policy")  # refused before any change
    with pytest.raises(ValueError, match="quantized attention"):
        prepare(model, tok, "abc", gb, kv_bits=4)  # refused once the KV option is being applied
    run = prepare(model, tok, "abc", gb, policy="low")  # the low gear from the first token
    assert gb.busy.locked() and gb.manager.gear == "low"
    del run  # dropped unstreamed and unclosed
    assert not gb.busy.locked() and gb.manager.gear == "high"
    assert text(loaded) == alone  # the model is the loaded one
