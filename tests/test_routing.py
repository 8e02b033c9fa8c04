"""The router inside mlx-lm's loop: lag, records, state after a stream."""

from __future__ import annotations

import numpy as np
import pytest

import gearbx_mlx
from gearbx_mlx.policies import StaticPolicy

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


class SwitchAt:
    """High until step ``k`` has been seen, then low."""

    name = "switch"

    def __init__(self, k: int) -> None:
        self.k = k

    def initial(self, suggested: str) -> str:
        return "high"

    def next_gear(self, step, seen) -> str:
        return "low" if step >= self.k else "high"


def run(model, tok, gearbox, policy, lag, n=10):
    out = list(gearbx_mlx.stream_generate(model, tok, PROMPT, gearbox, policy=policy, lag=lag, max_tokens=n))
    return out, [np.array(r.logprobs) for r in out]


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 1])
def test_measured_lag_between_decision_and_effect(default_model, lag):
    model, tok, gearbox = default_model
    _, ref = run(model, tok, gearbox, StaticPolicy("high"), lag)
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
