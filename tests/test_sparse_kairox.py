"""The sparse drafter's mechanisms: TAM hot sets, the next-layer predictor, the balancer."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st
from mlx_lm.models.cache import make_prompt_cache

from gearbx_mlx.speculative.kairox import Kairox, KairoxOptions, kairox_module
from gearbx_mlx.speculative.kairox_blocks import choose_hot, kept_masks, tam_update, transitions
from gearbx_mlx.speculative.sparse import block_mass, ffn_layers, hidden, masked_down

NB = 8  # tiny llama of hidden 256: an FFN of 512 neurons, 8 blocks of 64


def _model(seed: int = 0, layers: int = 3):
    model = make_tiny_llama(vocab=64, hidden=256, layers=layers, seed=seed)
    nn.quantize(model, group_size=64, bits=4)
    return model


def _state(options: KairoxOptions, keep: int, layers: int = 3, seed: int = 0) -> Kairox:
    rng = np.random.default_rng(seed)
    prior = [rng.random(NB) for _ in range(layers)]
    masks = [rng.random((30, NB)) < 0.5 for _ in range(layers)]
    return Kairox(options, [keep] * layers, [NB] * layers, prior, transitions(masks) if options.predictor else None)


# -- TAM and the hot set -------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(beta=st.floats(0, 0.99), acts=st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1,
                                              max_size=12))
def test_tam_is_the_exponential_average(beta, acts):
    score = mx.zeros((4,))
    for a in acts:
        score = tam_update(score, mx.array(a), beta)
    n = len(acts)
    want = sum((1 - beta) * beta ** (n - 1 - t) * np.array(a, dtype=np.float64) for t, a in enumerate(acts))
    np.testing.assert_allclose(np.array(score), want, rtol=1e-4, atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), n=st.integers(1, 16), size=st.integers(0, 16), min_hits=st.integers(1, 4))
def test_hot_set_respects_budget_and_the_one_hit_filter(data, n, size, min_hits):
    score = np.array(data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
    hits = np.array(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
    hot = choose_hot(score, hits, size, min_hits)
    assert len(hot) <= size and hot == sorted(set(hot))
    assert all(hits[b] >= min_hits and score[b] > 0 for b in hot)
    left = [b for b in range(n) if b not in hot and hits[b] >= min_hits and score[b] > 0]
    if len(hot) < size:
        assert not left  # it is full, or nothing else qualifies
    if hot and left:
        assert min(score[hot]) >= max(score[left])


def test_a_block_seen_once_stays_out_of_the_hot_set():
    state = _state(KairoxOptions(hot="tam", min_hits=2, refresh=4, budget=1.0), keep=4, layers=1)
    state.layers = []
    state.score = [mx.array([1.0, 0.9, 0.8, 0.7, 0, 0, 0, 0])]
    state.hits = [mx.array([1, 3, 2, 0, 0, 0, 0, 0], dtype=mx.int32)]

    class Layer:
        def repack(self):
            pass

    state.layers = [Layer()]
    state.refresh()
    assert state.hot_sets == [[1, 2]]
    assert int(mx.sum(state.hits[0])) == 0  # hits count afresh after each refresh


# -- one step against the masked dense reference ----------------------------------------------


def _reference(mlp, x, keep: int, hot) -> np.ndarray:
    """The dense down_proj with every block but the hot ones and the heaviest others zeroed."""
    h = hidden(mlp, x).reshape(1, -1)
    mass = np.array(block_mass(h[0], 64))
    mass[list(hot)] = -1
    cold = np.argsort(-mass, kind="stable")[: keep - len(hot)]
    kept = sorted(set(hot) | set(cold.tolist()))
    return np.array(masked_down(h, mlp.down_proj, mx.array(kept, dtype=mx.uint32), 64)).reshape(-1)


@settings(max_examples=12, deadline=None)
@given(keep=st.integers(1, NB), hot=st.sampled_from(["off", "static", "tam"]), budget=st.floats(0, 1),
       seed=st.integers(0, 1000))
def test_a_step_is_the_masked_reference(keep, hot, budget, seed):
    """Hot blocks through the packed copy plus the heaviest cold ones gathered: the dense product with the
    other blocks zeroed (whatever the hot set holds)."""
    model = _model(seed % 3)
    state = _state(KairoxOptions(hot=hot, budget=budget, refresh=1, min_hits=1), keep, seed=seed)
    module = kairox_module(model, state)
    cache = make_prompt_cache(module)
    module(mx.array([[1, 2, 3]]), cache=cache)
    for t in (4, 5, 6):  # a few steps: TAM refreshes its hot sets on each
        mx.eval(module(mx.array([[t]]), cache=cache))
    assert all(len(h) <= int(budget * keep) for h in state.hot_sets)
    mx.random.seed(seed)
    x = mx.random.normal((1, 1, 256))
    layer = ffn_layers(module)[1].mlp
    got = np.array(layer(x)).reshape(-1)
    np.testing.assert_allclose(got, _reference(layer, x, keep, state.hot_sets[1]), rtol=1e-4, atol=1e-4)
    assert ffn_layers(module)[1].mlp is layer and ffn_layers(model)[1].mlp is not layer  # a graft, not a change


def test_several_rows_go_dense():
    model = _model(1)
    module = kairox_module(model, _state(KairoxOptions(hot="static", predictor=True), keep=2))
    xs = mx.random.normal((1, 3, 256))
    mlp = ffn_layers(model)[0].mlp
    np.testing.assert_allclose(np.array(ffn_layers(module)[0].mlp(xs)), np.array(mlp(xs)), rtol=1e-5, atol=1e-5)


# -- the predictor -------------------------------------------------------------------------


def _logits(options: KairoxOptions, keep: int, steps=(4, 5, 6, 7)):
    model = _model(2)
    state = _state(options, keep)
    module = kairox_module(model, state)
    cache = make_prompt_cache(module)
    outs = [module(mx.array([[1, 2, 3]]), cache=cache)]
    outs += [module(mx.array([[t]]), cache=cache) for t in steps]
    return [np.array(o) for o in outs], state


def test_predicting_every_block_changes_nothing():
    """Candidates covering every block: gate/up of all blocks, the same drafts as without the predictor,
    and a hit rate of one."""
    want, _ = _logits(KairoxOptions(), keep=3)
    got, state = _logits(KairoxOptions(predictor=True, candidates=NB, audit=True), keep=3)
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert state.read()["predictor_hit_rate"] == 1.0


def test_the_predictor_reads_fewer_gate_up_rows_and_reports_its_hit_rate():
    got, state = _logits(KairoxOptions(predictor=True, candidates=1.0, audit=True), keep=2)
    r = state.summary()
    assert 0 <= r["predictor_hit_rate"] <= 1 and r["layer_steps"] == 4 * 3
    assert all(p.size == 2 for p in state.predicted.values())


def test_transitions_are_conditional_frequencies():
    a = np.array([[1, 0], [1, 1], [0, 1], [1, 0]], dtype=bool)
    b = np.array([[1, 1], [0, 1], [0, 1], [1, 0]], dtype=bool)
    t = transitions([a, b])[0]
    np.testing.assert_allclose(t, [[2 / 3, 2 / 3], [0, 1]])
    masks = kept_masks([mx.array([[3.0, 1.0, 2.0]])], [2])
    assert masks[0].tolist() == [[True, False, True]]


# -- the balancer --------------------------------------------------------------------------


def test_the_balancer_moves_blocks_toward_the_target():
    state = _state(KairoxOptions(balancer=True, target_acceptance=0.6, tolerance=0.1, window=4), keep=4)
    state.dropped = [0.1, 0.5, 0.3]
    state.observe(4, 1)  # acceptance 0.25 < 0.6: the layer dropping the most mass gets a block
    assert state.keep == [4, 5, 4]
    state.observe(2, 2)
    assert state.keep == [4, 5, 4]  # the window is not full yet
    state.observe(2, 2)  # 1.0 > 0.7: the layer dropping the least gives one back
    assert state.keep == [3, 5, 4]
    state.observe(4, 3)  # 0.75: within the band? no, above 0.7
    assert state.keep == [2, 5, 4]
    state.observe(8, 5)  # 0.625: inside [target, target + tolerance], no move
    assert state.keep == [2, 5, 4] and state.summary()["moves"] == 3


@settings(max_examples=40, deadline=None)
@given(rates=st.lists(st.floats(0, 1), min_size=1, max_size=60), seed=st.integers(0, 99))
def test_the_balancer_stays_within_bounds(rates, seed):
    state = _state(KairoxOptions(balancer=True, hot="static", budget=0.5), keep=4, seed=seed)
    rng = np.random.default_rng(seed)
    for r in rates:
        state.dropped = list(rng.random(3))
        state.balance(r)
        assert all(max(1, len(h)) <= k <= NB for k, h in zip(state.keep, state.hot_sets))


def test_off_balancer_ignores_verdicts():
    state = _state(KairoxOptions(), keep=4)
    state.observe(100, 0)
    assert state.keep == [4, 4, 4]


@pytest.mark.parametrize("bad", [dict(hot="lukewarm"), dict(beta=1.0), dict(budget=1.5), dict(min_hits=0),
                                 dict(refresh=0), dict(candidates=0.5), dict(target_acceptance=2.0),
                                 dict(window=0)])
def test_bad_options_are_refused(bad):
    with pytest.raises(ValueError, match="KairoxOptions"):
        KairoxOptions(**bad)


def test_a_large_gap_moves_several_layers():
    state = _state(KairoxOptions(balancer=True, target_acceptance=0.9, tolerance=0.05), keep=4, layers=6)
    state.dropped = [0.6, 0.1, 0.5, 0.2, 0.4, 0.3]
    assert state.balance(0.4) == [0, 2, 4]  # gap 0.5 x 6 layers: the three dropping the most
    assert state.keep == [5, 4, 5, 4, 5, 4]
    assert state.balance(0.9) == []  # within [target, target + tolerance]
