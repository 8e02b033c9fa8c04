"""The router inside mlx-lm's loop: lag, records, state after a stream."""

from __future__ import annotations

import numpy as np
import pytest
from switch_policy import SwitchAt

import gearbx_mlx
from gearbx_mlx.policies import StaticPolicy

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


def run(model, tok, gearbox, policy, lag, n=7):
    """``n`` tokens: the switch below shows by step 5 (k + 1 + lag, k = 3, lag <= 1)."""
    out = list(gearbx_mlx.stream_generate(model, tok, PROMPT, gearbox, policy=policy, lag=lag, max_tokens=n))
    return out, [np.array(r.logprobs) for r in out]


@pytest.fixture(scope="module")
def high_reference(default_model):
    """The static high gear's log-probabilities: the same at every lag (nothing to route)."""
    model, tok, gearbox = default_model
    return run(model, tok, gearbox, StaticPolicy("high"), 0)[1]


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 1])
def test_measured_lag_between_decision_and_effect(default_model, high_reference, lag):
    model, tok, gearbox = default_model
    ref = high_reference
    k = 3
    out, got = run(model, tok, gearbox, SwitchAt(k), lag)
    changed = [i for i in range(len(ref)) if not np.array_equal(ref[i], got[i])]
    # The decision made after seeing step k first changes step k + 1 + lag.
    assert changed and changed[0] == k + 1 + lag
    assert [r.gear for r in out][: k + 1 + lag] == ["high"] * (k + 1 + lag)
    assert out[k + 1 + lag].gear == "low" and out[k + 1 + lag].shifted
    assert gearbox.manager.gear == "high"  # restored when the stream ended


@pytest.mark.slow
def test_stream_fields_and_consistent_state(default_model):
    model, tok, gearbox = default_model
    gearbox.set_thresholds(2.0, 4.0)
    try:
        out = list(gearbx_mlx.stream_generate(model, tok, PROMPT, gearbox, max_tokens=32))
    finally:
        gearbox.set_thresholds(*gearbox.default_thresholds())
    assert len(out) == out[-1].generation_tokens
    assert out[-1].finish_reason in ("length", "stop")
    gears = [r.gear for r in out]
    assert sum(r.shifted for r in out) == sum(1 for a, b in zip(gears, gears[1:]) if a != b)
    assert all(0 <= r.entropy <= np.log2(gearbox.vocab_size) for r in out)
    assert gearbox.manager.gear == "high"
    installed = gearbox.manager.installed()
    assert all(installed[p] is gearbox.manager.originals[p] for p in installed)


def test_empty_prompt_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="empty"):
        next(gearbx_mlx.stream_generate(tiny_llama, None, "   "))


class Alternate:
    """Two steps in one gear, two in the other: both gears on known steps."""

    name = "alternate"

    def initial(self, suggested: str) -> str:
        return "high"

    def next_gear(self, step, seen) -> str:
        return "low" if (step // 2) % 2 == 0 else "high"


#: A routed decode step against the same step replayed by hand (float32).
REPLAY_ATOL = 1e-5


@pytest.mark.parametrize("lag", [0, 1])
def test_recorded_gear_produced_the_recorded_entropy(lag):
    """The truth, replayed by hand: feeding each position through the gear
    recorded with it (the KV cache keeps each earlier position's own gear)
    gives the recorded entropy; feeding the same step through the other gear
    does not. This is the attribution analyze's per-gear statistics use."""
    import mlx.core as mx
    from conftest import make_tiny_llama, make_tiny_tokenizer
    from mlx_lm.models.cache import make_prompt_cache

    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.entropy import entropy_bits
    from gearbx_mlx.gearbox import Gearbox

    # Untied: a moderate-entropy output, where 4-bit weights move the entropy measurably.
    model, tok = make_tiny_llama(vocab=512, hidden=64, tie=False), make_tiny_tokenizer(512)
    gb = Gearbox(model, GearboxConfig(scope="all"))
    prompt = "t5 t9 t33 t100"
    out = list(gearbx_mlx.stream_generate(model, tok, prompt, gb, policy=Alternate(), lag=lag, max_tokens=12))
    assert {"low", "high"} <= {r.gear for r in out} and any(r.shifted for r in out)
    cache = make_prompt_cache(model)
    for n, r in enumerate(out):
        x = mx.array([list(tok.encode(prompt)) if n == 0 else [out[n - 1].token]])
        other = "low" if r.gear == "high" else "high"
        gb.manager.shift(other)  # a probe, rolled back
        h_other = entropy_bits(model(x, cache=cache)[:, -1]).item()
        for c in cache:
            c.trim(x.shape[1])
        gb.manager.shift(r.gear)
        h_own = entropy_bits(model(x, cache=cache)[:, -1]).item()
        assert abs(r.entropy - h_own) < REPLAY_ATOL, (n, r.gear, r.entropy, h_own, h_other)
        assert abs(r.entropy - h_other) > 10 * REPLAY_ATOL, (n, r.gear, r.entropy, h_own, h_other)
        # The decision read from this entropy governs the pass 1 + lag tokens later.
        if n + 1 + lag < len(out):
            assert out[n + 1 + lag].gear == r.next_gear
    gb.manager.shift("high")
