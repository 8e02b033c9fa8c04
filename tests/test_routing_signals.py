"""Routing signals, their routers and the routing table (gearbx_mlx.evaluation.signals, .routers,
.signal_study, .signal_table)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays
from mlx.utils import tree_flatten

from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.evaluation import signals
from gearbx_mlx.evaluation.routers import (
    FALLBACK,
    LAGGED,
    SIGNALS,
    SignalPolicy,
    calibrated_sign,
    fit_logistic,
    fit_threshold,
    route_fallback,
    route_lagged,
    route_windows,
    signal_policy,
    top_fraction_labels,
)
from gearbx_mlx.evaluation.signal_study import (
    GearLayers,
    GearRows,
    calibrate,
    final_hidden,
    measure_gears,
    monitor_trace,
    real_runs,
)
from gearbx_mlx.evaluation.signal_table import (
    expected_permutation_kl,
    format_table,
    position_trace,
    routing_table,
    state_values,
    summarize,
    trace_bytes,
)
from gearbx_mlx.evaluation.specs import ModelLayout, PolicySpec
from gearbx_mlx.evaluation.teacher import teacher_forced

ROOT = Path(__file__).resolve().parent.parent
logits_arrays = arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(2, 40)),
                       elements=st.floats(-30, 30, allow_nan=False))


# -- signals ---------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(z=logits_arrays)
def test_signals_stay_in_their_ranges_and_match_float64_definitions(z):
    lp = signals.log_probs(z)
    p = np.exp(lp)
    h, v, m = signals.entropy_bits(lp), signals.varentropy_bits(lp), signals.top_margin(lp)
    assert np.all((h >= 0) & (h <= math.log2(z.shape[1]) + 1e-12))
    assert np.all(v >= 0) and np.all((m >= 0) & (m <= 1))
    s = -lp / math.log(2)
    want_h = (p * s).sum(axis=1)
    np.testing.assert_allclose(h, want_h, atol=1e-9)
    np.testing.assert_allclose(v, (p * (s - want_h[:, None]) ** 2).sum(axis=1), atol=1e-7)
    top = np.sort(p, axis=1)
    np.testing.assert_allclose(m, top[:, -1] - top[:, -2], atol=1e-12)


def test_signals_of_uniform_and_peaked_rows():
    lp = signals.log_probs(np.array([[0.0] * 8, [50.0] + [0.0] * 7]))
    np.testing.assert_allclose(signals.entropy_bits(lp), [3.0, 0.0], atol=1e-9)
    np.testing.assert_allclose(signals.varentropy_bits(lp), [0.0, 0.0], atol=1e-9)
    np.testing.assert_allclose(signals.top_margin(lp), [0.0, 1.0], atol=1e-9)


def test_distribution_signals_in_row_blocks_equal_one_block():
    z = np.random.default_rng(0).normal(size=(70, 33)).astype(np.float32) * 3
    a, b = signals.distribution_signals(z, rows=7), signals.distribution_signals(z, rows=100)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-12)


def test_hidden_norm_and_bad_shapes():
    h = np.random.default_rng(1).normal(size=(5, 16))
    np.testing.assert_allclose(signals.hidden_norm(h), np.linalg.norm(h, axis=1))
    with pytest.raises(ValueError, match="positions"):
        signals.hidden_norm(np.zeros(4))
    with pytest.raises(ValueError, match="vocabulary"):
        signals.log_probs(np.zeros((3, 1)))


# -- rules ---------------------------------------------------------------------------------------


def test_lagged_rule_starts_high_and_follows_the_gear_it_ran_in():
    # The low gear's signal is always high, the high gear's always low: the gears alternate.
    scores = np.array([[1.0] * 6, [-1.0] * 6])
    assert route_lagged(scores, 0.0).tolist() == [True, False, True, False, True, False]
    assert route_lagged(scores, -5.0).all()
    assert route_lagged(scores, 5.0).tolist() == [True] + [False] * 5


def test_lagged_rule_smooths_over_its_window():
    s = np.array([[0.0, 0.0, 3.0, 0.0, 0.0, 0.0]] * 2)
    # step 2's 3.0 lifts the mean of 3 steps to 1.0 for steps 3-5.
    assert route_lagged(s, 0.5, smooth=3).tolist() == [True, False, False, True, True, True]
    assert route_lagged(s, 0.5, smooth=1).tolist() == [True, False, False, True, False, False]


def test_fallback_rule_and_windows():
    assert route_fallback(np.array([0.1, 2.0, 0.5]), 0.4).tolist() == [False, True, True]
    got = route_windows(lambda s: route_lagged(np.zeros((2, s.stop - s.start)), 1.0), 6, 3)
    assert got.tolist() == [True, False, False, True, False, False]  # each window cold-starts high
    with pytest.raises(ValueError, match="divide"):
        route_windows(lambda s: np.zeros(0, dtype=bool), 7, 3)


@given(target=st.floats(0.05, 0.95))
def test_fit_threshold_hits_a_monotone_target(target):
    x = np.linspace(0, 1, 1001)
    th = fit_threshold(lambda t: float((x > t).mean()), target, -1.0, 2.0)
    assert abs((x > th).mean() - target) <= 2e-3


def test_calibrated_sign_and_labels():
    x = np.arange(20.0)
    assert calibrated_sign(x, x ** 2) == 1 and calibrated_sign(-x, x) == -1
    assert calibrated_sign(np.ones(5), x[:5]) == 1
    y = top_fraction_labels(x, 0.25)
    assert y.sum() == 5 and y[-5:].all()
    with pytest.raises(ValueError):
        top_fraction_labels(x, 1.0)


def test_logistic_regression_learns_the_informative_feature():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 4))
    y = (x[:, 2] - 0.2 * x[:, 0] + 0.3 * rng.normal(size=400) > 0).astype(float)
    m = fit_logistic(x, y)
    assert m.weights[2] > 1.0 and abs(m.weights[2]) > 3 * max(abs(m.weights[1]), abs(m.weights[3]))
    assert ((m.score(x) > 0) == y).mean() > 0.8
    with pytest.raises(ValueError, match="0/1"):
        fit_logistic(x, y * 2)


def test_signal_table_names_and_bad_entries():
    assert {"entropy-lagged", "varentropy", "margin", "hidden-norm", "learned", "low-entropy-fallback"} <= set(SIGNALS)
    with pytest.raises(ValueError, match="unknown signal policy 'nope': choose from entropy-lagged"):
        signal_policy("nope")
    with pytest.raises(ValueError, match="feature"):
        SignalPolicy("x", "loudness", LAGGED)
    with pytest.raises(ValueError, match="rule"):
        SignalPolicy("x", "entropy", "sideways")


# -- the table on synthetic rows -----------------------------------------------------------------


def synthetic_rows(n_windows=4, steps=64, seed=0) -> GearRows:
    """Low-gear KL is large exactly where the high gear's (and the low gear's) entropy was large one step before."""
    rng = np.random.default_rng(seed)
    n = n_windows * steps
    ent = rng.uniform(0, 4, size=n)
    low_kl = np.concatenate([[0.1], 0.05 + 0.2 * ent[:-1]]) * rng.uniform(0.9, 1.1, size=n)
    vals = {}
    for g, kl in (("high", np.zeros(n)), ("mid", low_kl / 100), ("low", low_kl)):
        vals[g] = {"kl": kl, "nll": 1.0 + kl, "hits": (kl < 0.5).astype(float), "entropy": ent + (g == "low") * 0.01,
                   "varentropy": rng.uniform(0, 1, size=n), "margin": rng.uniform(0, 1, size=n),
                   "log_hidden_norm": rng.normal(size=n)}
    return GearRows(vals, steps)


COSTS = {"low": 0.5625, "mid": 1.0625, "high": 2.0}


def test_state_values_and_bytes_count_a_fallback_step_as_both_gears():
    rows = synthetic_rows(1, 4)
    v = state_values("lfhm", rows)
    assert v["kl"][1] == 0.0 and v["kl"][0] == rows.values["low"]["kl"][0] and v["kl"][3] == rows.values["mid"]["kl"][3]
    assert trace_bytes("lf", COSTS) == pytest.approx((0.5625 + 0.5625 + 2.0) / 2)
    with pytest.raises(ValueError):
        state_values("lfx?", rows)


def test_expected_permutation_kl_is_the_mean_over_every_permutation():
    rows = synthetic_rows(2, 4)
    trace = "lfhl" + "llhm"
    perms = [["".join(p) for p in set(itertools.permutations(trace[s : s + 4]))] for s in (0, 4)]
    means = np.mean([state_values(a + b, rows)["kl"] for a in perms[0] for b in perms[1]], axis=0)
    np.testing.assert_allclose(expected_permutation_kl(trace, rows), means, rtol=1e-12)


def test_position_trace_spends_the_bytes():
    t = position_trace(1.0625, COSTS, 200, 100)
    assert t[:35] == "h" * 35 and t.count("h") == 70
    assert abs(trace_bytes(t, COSTS) - 1.0625) < (2.0 - 0.5625) / 100


def test_an_informative_signal_beats_its_permutations_and_a_shuffled_one_does_not():
    rows = synthetic_rows(8, 128)
    c = calibrate(signal_policy("entropy-lagged"), synthetic_rows(8, 128, seed=1), COSTS, COSTS["mid"])
    assert abs(c.calibration_fraction - c.target_fraction) < 0.03
    good = summarize("entropy-lagged", c.trace(rows), rows, COSTS)
    assert good["beats_random"] and good["test_random"]["interval"][1] < 0
    shuffled = "".join(np.random.default_rng(3).permutation(list(c.trace(rows))))
    bad = summarize("shuffled", shuffled, rows, COSTS)
    assert not bad["beats_random"]


def test_routing_table_runs_every_policy_at_the_budget():
    table = routing_table(synthetic_rows(4, 64, seed=1), synthetic_rows(4, 64), COSTS, 256)
    names = [r["name"] for r in table["rows"]]
    assert names[:4] == ["static-high", "static-mid", "static-low", "entropy-monitor"] and names[4:] == list(SIGNALS)
    for r in table["rows"][4:]:
        assert 0.75 < r["bytes_vs_static_8bit"] < 1.25, r["name"]
        assert r["rule"] in (LAGGED, FALLBACK) and "test_static_8bit" in r
    assert set(table["learned"]) == {"learned", "learned-fallback"}
    assert "entropy-lagged" in format_table(table)


def test_monitor_trace_cold_starts_high_in_each_window():
    rows = synthetic_rows(2, 16)
    t = monitor_trace(rows, 256, GearboxConfig())
    assert len(t) == 32 and t[0] == "h" and t[16] == "h" and set(t) <= set("lmh")


# -- the passes on a tiny model --------------------------------------------------------------------


def test_final_hidden_is_the_input_of_the_final_norm():
    model = make_tiny_llama()
    ids = mx.array([[1, 5, 9, 3]])
    with final_hidden(model) as seen:
        logits = model(ids)
        h = seen.value
    norm = model.model.norm
    assert type(norm).__name__ == "RMSNorm"
    np.testing.assert_allclose(np.array(model.model.embed_tokens.as_linear(norm(h))), np.array(logits), atol=1e-5)
    with pytest.raises(ValueError, match="final norm"):
        with final_hidden(object()):
            pass


def spread_llama():
    """A tiny llama whose next-token distributions are spread (the default init's are one-hot)."""
    model = make_tiny_llama(seed=1)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.2
    mx.eval(model.parameters())
    return model


def test_measure_gears_chunked_packed_or_in_place_equals_one_pass_and_high_is_the_reference(tmp_path):
    model = spread_llama()
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    loaded = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    config = GearboxConfig(kernel="mlx")
    layout = ModelLayout.of(model, config, 256)
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 256, size=17).tolist() for _ in range(2)]
    a = measure_gears(model, windows, layout, config, max_positions=5)
    b = measure_gears(model, windows, layout, config, max_positions=64, layers=GearLayers(packed=True))
    c = measure_gears(model, windows, layout, config, max_positions=64, layers=GearLayers(reload_from=tmp_path))
    assert a.positions == 32 and a.window_steps == 16
    for g in ("high", "mid", "low"):
        for k, v in a.values[g].items():
            np.testing.assert_allclose(v, b.values[g][k], rtol=2e-3, atol=1e-5, err_msg=f"{g} {k}")
            np.testing.assert_allclose(v, c.values[g][k], rtol=1e-4, atol=1e-6, err_msg=f"{g} {k}")
    for k, v in tree_flatten(model.parameters()):  # the in-place gears left the loaded weights as they were
        assert np.array_equal(np.array(v), loaded[k]), k
    with pytest.raises(ValueError, match="no model"):
        measure_gears(model, windows, layout, config, layers=GearLayers(reload_from=tmp_path / "empty"))
    (tmp_path / "other").mkdir()
    mx.save_safetensors(str(tmp_path / "other" / "model.safetensors"), {"model.norm.weight": mx.ones((128,))})
    with pytest.raises(ValueError, match="cannot be read back"):
        measure_gears(model, windows, layout, config, layers=GearLayers(reload_from=tmp_path / "other"))
    for k, v in tree_flatten(model.parameters()):  # refused before anything was quantized
        assert np.array_equal(np.array(v), loaded[k]), k
    assert not a.values["high"]["kl"].any() and a.values["high"]["hits"].all()
    assert a.values["low"]["kl"].mean() > a.values["mid"]["kl"].mean() > 0
    assert type(model.model.norm).__name__ == "RMSNorm"  # restored
    assert all(type(m).__name__ != "QuantizedLinear" for _, m in model.named_modules())
    # The harness's fake-quantized rows of the same gears give the same numbers.
    specs = [PolicySpec("static-high", "static", "all", "high"), PolicySpec("static-mid/all", "static", "all", "mid"),
             PolicySpec("static-low/all", "static", "all", "low")]
    rows = teacher_forced(model, windows, specs, layout, config, 256)
    for r, g in zip(rows, ("high", "mid", "low")):
        np.testing.assert_allclose(a.values[g]["kl"], r.kl, rtol=2e-3, atol=1e-6, err_msg=g)
        np.testing.assert_allclose(a.values[g]["nll"], r.nll, rtol=1e-4, err_msg=g)
        np.testing.assert_allclose(a.values[g]["entropy"], r.entropy, rtol=1e-4, atol=1e-5, err_msg=g)


def test_script_rejects_an_unknown_signal_in_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_routing_signals.py"), "--signals", "nope"],
                       capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: --signals: unknown signal policy 'nope': choose from " + ", ".join(SIGNALS)]


def test_script_rejects_a_missing_text_before_loading_a_model(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_routing_signals.py"), "--model", "no-such-model",
                        "--text", str(tmp_path / "missing.txt")],
                       capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: text file not found") and "missing.txt" in lines[0]


def test_real_runs_replay_a_trace_and_its_permutations():
    model = spread_llama()
    config = GearboxConfig(kernel="mlx")
    layout = ModelLayout.of(model, config, 256)
    rng = np.random.default_rng(2)
    windows = [rng.integers(0, 256, size=9).tolist() for _ in range(2)]
    rows = measure_gears(model, windows, layout, config)
    got = real_runs(model, windows, layout, config, 256, "l" * 16, permutations=2)
    # A static trace is what re-selection assumes, so the real run equals it; its permutations are itself.
    assert got["sequences"] == ["l" * 16] * 3
    np.testing.assert_allclose(got["mean_kl"], [rows.values["low"]["kl"].mean()] * 3, rtol=1e-4)
    mixed = real_runs(model, windows, layout, config, 256, "fllllllh" * 2, permutations=3, seed=1)
    assert mixed["sequences"][0] == "hllllllh" * 2
    assert all(sorted(s[:8]) == sorted("hllllllh") and sorted(s[8:]) == sorted("hllllllh") for s in mixed["sequences"])
    with pytest.raises(ValueError, match="trace of 16"):
        real_runs(model, windows, layout, config, 256, "lx")
