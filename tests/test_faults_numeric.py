"""Fault injection: numbers that are not numbers.

Corrupted weights make every logit NaN. The NaN guard (§10.1) still lets the
sampler pick a token, but the run must not look healthy: each such step is
flagged (``nonfinite`` in the response and the trace), counted
(``nonfinite_steps`` in the summary), and warned about once per generation.
"""

from __future__ import annotations

import importlib
import math
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fault_models import tiny_model_folder

from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.gearbox import Gearbox
from gearbx_mlx.generation import load
from gearbx_mlx.pipeline import stream_generate
from gearbx_mlx.routing import NonFiniteLogitsWarning, RoutingSession
from gearbx_mlx.telemetry.trace import read_trace

generate_cli = importlib.import_module("gearbx_mlx.generate")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("numeric"))


def _poison(model) -> None:
    """One NaN in the last norm: every logit of every step is NaN."""
    w = model.model.norm.weight
    model.model.norm.weight = mx.where(mx.arange(w.shape[0]) == 0, mx.array(math.nan), w)


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_nan_logits_are_flagged_counted_and_warned_once(tiny, temp):
    model, tok, gearbox = load(str(tiny))
    _poison(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = list(stream_generate(model, tok, "Hello the", gearbox, max_tokens=6, temp=temp, seed=1))
    assert len(out) == 6 and all(r.nonfinite for r in out)
    assert all(0 <= r.token < gearbox.vocab_size for r in out)  # the guard still samples a real token
    ours = [w for w in seen if issubclass(w.category, NonFiniteLogitsWarning)]
    assert len(ours) == 1 and "NaN" in str(ours[0].message)
    assert out[-1].session.nonfinite_steps == 6


def test_a_logits_processor_that_returns_nan_is_guarded_flagged_and_warned(tiny):
    """The guard ran before the caller's processors only: a processor returning NaN sampled
    token 0 every step with nonfinite False and no warning."""
    model, tok, gearbox = load(str(tiny))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = list(stream_generate(model, tok, "Hello the", gearbox, max_tokens=4, temp=0.8, seed=1,
                                   logits_processors=[lambda tokens, logits: logits * math.nan]))
    assert len(out) == 4 and all(r.nonfinite for r in out) and out[-1].session.nonfinite_steps == 4
    assert math.isfinite(out[0].entropy)  # the router's entropy is the model's own logits'
    ours = [w for w in seen if issubclass(w.category, NonFiniteLogitsWarning)]
    assert len(ours) == 1 and "logits processor" in str(ours[0].message)


def test_a_logits_processor_that_cuts_the_vocabulary_is_one_error(tiny):
    """A processor returning ``logits[:, :10]`` streamed token 0 silently (mlx-lm's sampler took the cut)."""
    model, tok, gearbox = load(str(tiny))
    with pytest.raises(ValueError, match=r"a logits processor returned logits of shape \(1, 10\); the model's"):
        list(stream_generate(model, tok, "Hello the", gearbox, max_tokens=3,
                             logits_processors=[lambda tokens, logits: logits[:, :10]]))


@pytest.mark.parametrize("token", [10**6, -1])
def test_a_sampler_that_returns_an_id_outside_the_vocabulary_is_one_error(tiny, token):
    """mlx-lm fed such an id to the embedding, and MLX ended the process (a segmentation fault)."""
    model, tok, gearbox = load(str(tiny))
    with pytest.raises(ValueError, match=rf"step 0: the sampler returned token id\(s\) \[{token}\], outside the "
                                         rf"model's vocabulary of {gearbox.vocab_size} ids"):
        list(stream_generate(model, tok, "Hello the", gearbox, max_tokens=4,
                             sampler=lambda logprobs: mx.array([token], dtype=mx.int32)))
    # the model is unharmed: the next generation runs
    assert len(list(stream_generate(model, tok, "Hello the", gearbox, max_tokens=2))) == 2


@pytest.mark.parametrize("returned, what", [(lambda lp: mx.argmax(lp, axis=-1).astype(mx.float32), "float32"),
                                            (lambda lp: 3, "int")])
def test_a_sampler_that_returns_no_integer_ids_is_one_error(tiny, returned, what):
    model, tok, gearbox = load(str(tiny))
    with pytest.raises(TypeError, match=f"a sampler returns an mx.array of integer token ids, got .*{what}"):
        list(stream_generate(model, tok, "Hello the", gearbox, max_tokens=2, sampler=returned))


def test_a_custom_sampler_inside_the_vocabulary_gives_greedy_text(tiny):
    model, tok, gearbox = load(str(tiny))
    greedy = [r.token for r in stream_generate(model, tok, "Hello the", gearbox, max_tokens=6)]
    custom = [r.token for r in stream_generate(model, tok, "Hello the", gearbox, max_tokens=6,
                                               sampler=lambda lp: mx.argmax(lp, axis=-1).astype(mx.int32))]
    assert custom == greedy


def test_healthy_logits_are_not_flagged(tiny):
    model, tok, gearbox = load(str(tiny))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteLogitsWarning)
        out = list(stream_generate(model, tok, "Hello the", gearbox, max_tokens=4))
    assert not any(r.nonfinite for r in out) and out[-1].session.nonfinite_steps == 0


@pytest.mark.parametrize("guard", [True, False])
def test_the_nan_guard_on_the_sampling_path(tiny_llama, guard):
    """What the sampler receives: finite stand-ins with the guard, the raw logits without."""
    gb = Gearbox(tiny_llama, GearboxConfig(nan_guard=guard))
    session = RoutingSession(gb)
    session.start("hi")
    logits = mx.array([[0.5, math.nan, math.inf, -math.inf, 1.0] + [0.0] * 251])
    out = np.array(session.processor(mx.array([1]), logits))
    if guard:
        assert np.isfinite(out).all() and out[0, 1] == 0.0 and out[0, 2] == 1e4 and out[0, 3] == -1e4
    else:
        assert np.isnan(out[0, 1]) and np.isinf(out[0, 2])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        session.commit()
    assert session.records[0].nonfinite and len(seen) == 1
    assert session.records[0].entropy <= math.log2(256) + 1e-6  # the monitor saw a number


def test_the_cli_reports_nonfinite_steps_in_summary_and_trace(tiny, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * math.nan
    mx.save_safetensors(str(broken / "model.safetensors"), weights, metadata={"format": "mlx"})
    trace = tmp_path / "t.jsonl"
    code = generate_cli.main(["--model", str(broken), "--prompt", "Hello the", "--max-tokens", "5",
                              "--trace", str(trace), "--ignore-chat-template"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err
    assert err.count("logits hold NaN") == 1 and "Non-finite logits: 5 steps" in err
    t = read_trace(trace)
    assert t.summary["nonfinite_steps"] == 5 and all(r["nonfinite"] for r in t.tokens)
