"""Entropy in bits and the gear monitor (§3)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gearbx_mlx.config import GEAR_INDEX, GearboxConfig
from gearbx_mlx.entropy import EntropyMonitor, classify, entropy_bits, scaled_thresholds

#: float32 entropy vs a float64 reference, in bits.
ENTROPY_ATOL = 2e-4


def ref_entropy(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(p > 0, p * np.log2(p), 0.0)
    return -t.sum(axis=-1)


@settings(max_examples=60, deadline=None)
@given(
    v=st.integers(2, 5000),
    rows=st.integers(1, 3),
    scale=st.floats(0.01, 60.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_entropy_matches_float64_and_is_bounded(v, rows, scale, seed):
    z = np.random.default_rng(seed).normal(size=(rows, v)).astype(np.float32) * scale
    h = np.array(entropy_bits(mx.array(z)))
    assert h.dtype == np.float32
    assert np.all(h >= 0) and np.all(h <= math.log2(v) + 1e-5)
    np.testing.assert_allclose(h, ref_entropy(z), atol=ENTROPY_ATOL, rtol=1e-4)


def test_entropy_of_bf16_logits_is_computed_in_float32():
    z = np.random.default_rng(1).normal(size=(4, 49152)).astype(np.float32) * 8
    zb = mx.array(z).astype(mx.bfloat16)
    h = np.array(entropy_bits(zb))
    # The reference sees the same bf16 values, upcast exactly.
    np.testing.assert_allclose(h, ref_entropy(np.array(zb.astype(mx.float32))), atol=ENTROPY_ATOL)


def test_extremes_and_non_finite_logits():
    v = 1000
    uniform = mx.zeros((1, v))
    assert abs(entropy_bits(uniform).item() - math.log2(v)) < 1e-4
    peaked = mx.array([[0.0] * (v - 1) + [1e4]])
    assert entropy_bits(peaked).item() < 1e-4
    bad = mx.array([[float("nan"), float("inf"), -float("inf"), 1.0]])
    h = entropy_bits(bad).item()
    assert math.isfinite(h) and 0 <= h <= 2


def test_vocab_scaling():
    c = GearboxConfig()
    assert scaled_thresholds(c, 32768) == pytest.approx((1.8, 3.5))
    low, high = scaled_thresholds(c, 151936)
    s = math.log2(151936) / 15
    assert (low, high) == pytest.approx((1.8 * s, 3.5 * s))
    assert scaled_thresholds(c.replace(scale_thresholds=False), 151936) == (1.8, 3.5)


def fresh(**kw) -> EntropyMonitor:
    cfg = GearboxConfig(window=1, min_gear_duration=1, hysteresis=0.0, **kw)
    return EntropyMonitor(32768, cfg, initial_gear="mid")


@settings(max_examples=100, deadline=None)
@given(a=st.floats(0, 15), b=st.floats(0, 15))
def test_routing_is_monotone_in_smoothed_entropy(a, b):
    lo, hi = sorted((a, b))
    assert GEAR_INDEX[fresh().push(lo).gear] <= GEAR_INDEX[fresh().push(hi).gear]


@settings(max_examples=50, deadline=None)
@given(seq=st.lists(st.floats(0, 15), min_size=1, max_size=40))
def test_monitor_is_deterministic(seq):
    a, b = EntropyMonitor(49152), EntropyMonitor(49152)
    assert [a.push(h) for h in seq] == [b.push(h) for h in seq]


def count_shifts(monitor: EntropyMonitor, trace) -> int:
    gears = [monitor.push(h).gear for h in trace]
    return sum(1 for x, y in zip(gears, gears[1:]) if x != y)


def test_hysteresis_and_min_duration_suppress_oscillation():
    # Entropy alternating just across the low threshold (1.8 bits at 32K).
    trace = [1.75, 1.85] * 20
    bare = GearboxConfig(window=1, hysteresis=0.0, min_gear_duration=1)
    n_bare = count_shifts(EntropyMonitor(32768, bare, initial_gear="low"), trace)
    assert n_bare >= 30  # oscillates nearly every step
    hyst = bare.replace(hysteresis=0.1)
    assert count_shifts(EntropyMonitor(32768, hyst, initial_gear="low"), trace) == 0
    dur = bare.replace(min_gear_duration=5)
    n_dur = count_shifts(EntropyMonitor(32768, dur, initial_gear="low"), trace)
    assert n_dur <= len(trace) // 5 + 1


def test_min_duration_holds_gear_for_that_many_steps():
    m = EntropyMonitor(32768, GearboxConfig(window=1, hysteresis=0.0, min_gear_duration=4), initial_gear="high")
    gears = [m.push(h).gear for h in [0.1, 9.0, 9.0, 9.0, 9.0, 0.1]]
    # Shift to low at once (initial gear counts as held), then held 4 steps.
    assert gears == ["low", "low", "low", "low", "high", "high"]


def test_catastrophic_entropy_forces_high_even_within_min_duration():
    v = 32768
    m = EntropyMonitor(v, GearboxConfig(window=1, min_gear_duration=50), initial_gear="high")
    assert m.push(0.1).gear == "low"  # now held for 1 of 50 steps
    huge = 0.95 * math.log2(v)
    assert m.push(huge).gear == "low"  # one value is not enough
    step = m.push(huge)
    assert step.catastrophic and step.gear == "high"


def test_slope_and_prediction():
    m = EntropyMonitor(32768, GearboxConfig(window=3, lookahead=2))
    for h in (1.0, 2.0):
        m.push(h)
    s = m.push(3.0)
    assert s.smoothed == pytest.approx(2.0)
    assert s.slope == pytest.approx(1.0)
    assert s.predicted == pytest.approx(4.0)
    assert s.predicted_gear == classify(4.0, m.low, m.high) == "high"


@pytest.mark.parametrize(
    "kw",
    [
        {"low_threshold": 3.0, "high_threshold": 2.0},
        {"window": 0},
        {"bits": {"low": 7, "mid": 8}},
        {"scope": "mlp"},
        {"lag": 2},
        {"static_gear": "turbo"},
    ],
)
def test_bad_config_is_one_clear_error(kw):
    with pytest.raises(ValueError):
        GearboxConfig(**kw)


def test_inverted_thresholds_on_monitor():
    with pytest.raises(ValueError, match="wrong order"):
        EntropyMonitor(1000, thresholds=(3.0, 1.0))
