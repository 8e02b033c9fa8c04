"""Calibration strategies (§4) and their JSON files."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st

from gearbx_mlx.calibration import Calibration, collect_entropies, median_thresholds, percentile_thresholds
from gearbx_mlx.config import CALIBRATION

samples = st.lists(st.floats(0.001, 16.0), min_size=5, max_size=300)


@settings(max_examples=200, deadline=None)
@given(s=samples, v=st.sampled_from([32000, 49152, 151936]))
def test_percentile_band_respects_minimum_width_and_caps(s, v):
    low, high = percentile_thresholds(s, v)
    assert high - low >= CALIBRATION.min_band_percentile - 1e-9
    assert 0 <= low < high
    # Caps apply before widening: low never exceeds its cap.
    assert low <= CALIBRATION.cap_low_frac * math.log2(v) + 1e-9


@settings(max_examples=200, deadline=None)
@given(s=st.lists(st.floats(0.0, 16.0), min_size=1, max_size=300))
def test_median_band_respects_minimum_width(s):
    low, high = median_thresholds(s)
    assert high - low >= CALIBRATION.min_band_median - 1e-9
    assert 0 <= low < high


def test_percentile_values_follow_the_formula():
    s = [float(i) / 100 for i in range(1, 101)]  # 0.01 .. 1.0, below both caps
    low, high = percentile_thresholds(s, 2**40)  # caps far away
    n = len(s)
    assert low == pytest.approx(s[int(n * 0.3) - 1])
    assert high == pytest.approx(s[min(n - 1, int(n * 0.6))])


def test_median_values_follow_the_formula():
    low, high = median_thresholds([1.0, 2.0, 3.0])
    assert (low, high) == pytest.approx((2.0, 5.0))


def test_percentile_needs_five_samples():
    with pytest.raises(ValueError, match="at least 5"):
        percentile_thresholds([1.0, 2.0, 0.0, 0.0], 32000)


def test_json_round_trip_and_bad_files(tmp_path):
    cal = Calibration(low=1.2, high=3.4, strategy="median", n_samples=72, vocab_size=49152, model="m")
    path = cal.save(tmp_path / "cal.json")
    back = Calibration.load(path)
    assert back.thresholds == (1.2, 3.4) and back.strategy == "median" and back.vocab_size == 49152
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a calibration"):
        Calibration.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError):
        Calibration.load(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError):
        Calibration.load(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError):
        cal.save(tmp_path / "no" / "dir" / "cal.json")


class _ByteTokenizer:
    """Bytes as ids; ``eos`` ends a generation (no chat template)."""

    def __init__(self, eos):
        self.eos_token_ids = set(eos)

    def encode(self, text):
        return list(text.encode("utf-8"))


#: Batched and one-prompt-at-a-time decoding multiply in other shapes (measured: 1.1e-5 bits apart
#: on the default model, exactly equal on the tiny one).
BATCHED_ATOL = 1e-4


@pytest.mark.parametrize("stop_early", [False, True])
def test_batched_calibration_gives_the_sequential_samples(stop_early):
    """Prompts of different lengths, rows that end early: the same samples, row after row."""
    model = make_tiny_llama(seed=3)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.2
    prompts = ["a", "three words here", "a somewhat longer prompt than the others"]
    eos = ()
    if stop_early:  # the first greedy token of two prompts ends their generation at once
        eos = tuple(int(mx.argmax(model(mx.array([list(p.encode())]))[0, -1]).item()) for p in prompts[:2])
    tok = _ByteTokenizer(eos)
    seq = collect_entropies(model, tok, prompts, 12, batched=False)
    bat = collect_entropies(model, tok, prompts, 12, batched=True)
    assert len(bat) == len(seq)
    np.testing.assert_allclose(bat, seq, atol=BATCHED_ATOL)
    assert len(seq) == (2 + 2 + 12 if stop_early else 3 * 12)  # an ended row keeps one sample past its end
