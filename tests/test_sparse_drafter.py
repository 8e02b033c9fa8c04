"""The activation-sparse drafter: block gathers against a masked dense reference, dense equivalence, errors."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama, make_tiny_tokenizer
from hypothesis import given, settings, strategies as st
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache

from gearbx_mlx.bindings import sparse_cpu
from gearbx_mlx.speculative.sparse import (
    GATHERS,
    SparseMLP,
    block_major,
    block_mass,
    build_sparse_draft,
    calibrate_keep,
    check_sparsity,
    expert_down,
    ffn_layers,
    hidden,
    masked_down,
    quant_parts,
    sparse_down,
    sparse_module,
    top_blocks,
)


def _quantized_linear(inp: int, out: int, bits: int, group: int, bias: bool, seed: int) -> nn.QuantizedLinear:
    mx.random.seed(seed)
    lin = nn.Linear(inp, out, bias=bias)
    lin.weight = mx.random.normal((out, inp)) * 0.1
    if bias:
        lin.bias = mx.random.normal((out,))
    return nn.QuantizedLinear.from_linear(lin, group_size=group, bits=bits)


@settings(max_examples=40, deadline=None)
@given(out=st.integers(1, 70), blocks=st.integers(1, 9), group=st.sampled_from([32, 64, 128]),
       bits=st.sampled_from([4, 8]), bias=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_sparse_down_matches_masked_dense(out, blocks, group, bits, bias, seed, data):
    """Gathering the kept blocks' packed columns is the dense product with the dropped neurons zeroed."""
    down = _quantized_linear(blocks * group, out, bits, group, bias, seed)
    h = mx.random.normal((1, blocks * group))
    keep = data.draw(st.integers(1, blocks))
    idx = top_blocks(h[0], keep, group)
    assert idx.size == keep
    parts = quant_parts(down)
    want = np.array(masked_down(h, down, idx, group))
    np.testing.assert_allclose(np.array(sparse_down(h, parts, idx)), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(expert_down(h, block_major(parts), parts, idx)), want, rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(2, 12), seed=st.integers(0, 2**16), data=st.data())
def test_top_blocks_are_the_heaviest(blocks, seed, data):
    mx.random.seed(seed)
    h = mx.random.normal((blocks * 64,))
    keep = data.draw(st.integers(1, blocks))
    idx = np.array(top_blocks(h, keep, 64))
    mass = np.array(block_mass(h, 64))
    assert list(idx) == sorted(set(idx.tolist()))
    assert mass[idx].min() >= np.sort(mass)[::-1][keep - 1] - 1e-6


def _quantized_tiny(seed: int = 0):
    model = make_tiny_llama(vocab=64, hidden=128, layers=2, seed=seed)  # FFN of 256 neurons = 4 blocks of 64
    nn.quantize(model, group_size=64, bits=4)
    return model


def test_all_blocks_kept_is_the_dense_drafter():
    model = _quantized_tiny()
    sparse = sparse_module(model, [4, 4])
    ids = mx.array([[1, 5, 9, 2]])
    c1, c2 = make_prompt_cache(model), make_prompt_cache(sparse)
    np.testing.assert_array_equal(np.array(model(ids, cache=c1)), np.array(sparse(ids, cache=c2)))
    for t in (7, 3):
        a, b = model(mx.array([[t]]), cache=c1), sparse(mx.array([[t]]), cache=c2)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather", GATHERS)
def test_sparse_step_matches_masked_reference(gather):
    """A one-token step of the sparse tree equals the dense tree whose FFNs zero the same blocks.

    The C gather is skipped where it cannot run (no C kernels, another device), as the C kernels' own
    tests are; ``auto`` then takes the block-major copy."""
    model = _quantized_tiny(seed=1)
    mlp = ffn_layers(model)[0].mlp
    c_reason = sparse_cpu.unsupported(quant_parts(mlp.down_proj))
    if gather == "c" and c_reason is not None:
        pytest.skip(f"the C gather cannot run here: {c_reason}")
    x = mx.random.normal((1, 1, 128))
    h = hidden(mlp, x)
    want = masked_down(h.reshape(1, -1), mlp.down_proj, top_blocks(h.reshape(-1), 2, 64), 64)
    sp = SparseMLP(mlp, 2, gather)
    np.testing.assert_allclose(np.array(sp(x)).reshape(-1), np.array(want).reshape(-1), rtol=1e-4, atol=1e-4)
    copies = gather == "experts" or (gather == "auto" and c_reason is not None)  # the block-major copy
    assert (sp.extra_bytes > 0) is copies, (gather, sp.extra_bytes, c_reason)
    with pytest.raises(ValueError, match="gather must be one of"):
        SparseMLP(mlp, 2, "scatter")
    # several rows go dense
    xs = mx.random.normal((1, 3, 128))
    np.testing.assert_allclose(np.array(sp(xs)), np.array(mlp(xs)), rtol=1e-5, atol=1e-5)


def test_calibrated_keep_meets_the_target():
    rng = np.random.default_rng(0)
    masses = [mx.array(np.abs(rng.standard_normal((50, 24))) ** p) for p in (1, 2, 3)]
    for s in (0.25, 0.5, 0.8):
        kept = calibrate_keep(masses, s)
        assert abs(np.mean(kept) - (1 - s)) <= 1 / 24 + 1e-6
        assert kept[2] <= kept[0]  # the more concentrated layer keeps fewer blocks


@pytest.mark.parametrize("bad", [-0.1, 0.96, 1.0, float("nan"), True, "0.5"])
def test_bad_sparsity_is_refused(bad):
    with pytest.raises(ValueError, match=r"draft_sparsity must be in \[0, 0.95\]"):
        check_sparsity(bad)


def test_a_model_without_gate_up_down_is_refused():
    model = make_tiny_llama(vocab=64, hidden=64)
    model.args.model_type = "gpt2"
    with pytest.raises(ValueError, match="needs a gated FFN .* this model is 'gpt2'"):
        ffn_layers(model)
    model.args.model_type = "llama"
    del model.model.layers[1].mlp["up_proj"]
    with pytest.raises(ValueError, match="layer 1"):
        ffn_layers(model)


def test_a_float_down_proj_is_refused():
    model = make_tiny_llama(vocab=64, hidden=64)
    with pytest.raises(ValueError, match="MLX-quantized down_proj"):
        quant_parts(model.model.layers[0].mlp.down_proj)


def test_sparse_drafter_of_the_gearbox_drafter():
    """Over the gearbox's own drafter (nested planes or quantized layers): sparsity 0 is the dense
    drafter's logits, and a sparse one records its kept fraction and reads fewer down_proj bytes."""
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.speculative.draft import build_draft

    model = make_tiny_llama(vocab=64, hidden=128, seed=2)
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    draft = build_draft(model, gb, "low", "all", host=False)
    tokens = list(range(1, 40))
    dense = build_sparse_draft(draft, 0.0, tokens)
    assert dense.sparse["kept_fraction"] == 1.0 and dense.host is None
    ids = mx.array([[3, 1, 4, 1, 5]])
    np.testing.assert_allclose(np.array(draft.module(ids)), np.array(dense.module(ids)), rtol=1e-5, atol=1e-5)
    half = build_sparse_draft(draft, 0.5, tokens, gather="experts")
    assert half.sparse["kept_fraction"] == 0.5
    assert half.sparse["kept_down_bytes"] == half.sparse["down_bytes"] // 2
    assert half.memory["extra_bytes"] == draft.memory["extra_bytes"] + half.sparse["layout_bytes"] > 0


def tiny_gemma3(seed: int = 0):
    """A tiny mlx-lm ``gemma3_text`` model: a GeGLU FFN of 256 neurons (4 blocks of 64), tied embedding."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=128, num_hidden_layers=2,
                                 intermediate_size=256, num_attention_heads=2, head_dim=64,
                                 num_key_value_heads=1, vocab_size=64, sliding_window=16,
                                 sliding_window_pattern=2)
    model = gemma3_text.Model(args)
    model.update(tree_map(lambda a: mx.random.normal(a.shape) * 0.2 if a.ndim > 1 else a, model.parameters()))
    mx.eval(model.parameters())
    return model


def test_a_gemma3_drafter_uses_its_own_activation_and_stays_exact():
    """Gemma 3's FFN is GeGLU: the sparse drafter's hidden activation is ``gelu_approx(gate) * up`` (a
    SwiGLU one would differ), every block kept gives the dense drafter's logits, and greedy speculative
    decoding with a sparse drafter gives the high gear's tokens."""
    from mlx_lm.generate import generate_step

    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.pipeline import stream_speculative_generate
    from gearbx_mlx.speculative.decode import SpeculativeConfig
    from gearbx_mlx.speculative.draft import build_draft
    from gearbx_mlx.speculative.sparse import geglu, glu_of

    model = tiny_gemma3(seed=4)
    mlp = ffn_layers(model)[0].mlp
    x = mx.random.normal((1, 3, 128))
    assert glu_of(mlp) is geglu
    want = nn.gelu_approx(mlp.gate_proj(x)) * mlp.up_proj(x)
    np.testing.assert_allclose(np.array(hidden(mlp, x)), np.array(want), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.array(nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x)), np.array(want), atol=1e-3)

    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    draft = build_draft(model, gb, "low", "all", host=False)
    tokens = list(range(1, 40))
    ids = mx.array([[3, 1, 4, 1, 5]])
    dense = build_sparse_draft(draft, 0.0, tokens)
    np.testing.assert_allclose(np.array(draft.module(ids)), np.array(dense.module(ids)), rtol=1e-5, atol=1e-5)
    prompt = [5, 9, 2, 6, 5, 3]
    plain = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=12), range(12))]
    got = [r.token for r in stream_speculative_generate(model, make_tiny_tokenizer(64), prompt, gb, max_tokens=12,
                                                        config=SpeculativeConfig(max_draft=3, draft_sparsity=0.5))]
    assert got == plain[: len(got)] and len(got) == 12
    from gearbx_mlx.speculative.decode import get_draft

    drafter = get_draft(model, gb, "low", "all", 0.5, make_tiny_tokenizer(64))
    assert drafter.sparse["kept_fraction"] < 1  # it drafted sparsely, not densely


# -- plumbing: the config, the CLI, the default model ------------------------------------


def test_config_refuses_a_bad_sparsity():
    from gearbx_mlx.speculative.decode import SpeculativeConfig

    assert SpeculativeConfig().draft_sparsity is None
    with pytest.raises(ValueError, match="draft_sparsity"):
        SpeculativeConfig(draft_sparsity=0.99)


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "force", "--draft-sparsity", "1.2"], "argument --draft-sparsity: expected 'auto', a fraction"),
    (["--speculative", "force", "--draft-sparsity", "x"], "argument --draft-sparsity: expected 'auto', a fraction"),
    (["--draft-sparsity", "auto"], "error: --draft-sparsity sets the speculative drafter: add --speculative"),
    (["--speculative", "--draft-gear", "mid", "--draft-sparsity", "auto"], "drop --draft-gear mid"),
    (["--draft-sparsity", "0.5"], "error: --draft-sparsity sets the speculative drafter: add --speculative"),
    (["--speculative", "force", "--draft-gear", "mid", "--draft-sparsity", "0.5"], "drop --draft-gear mid"),
])
def test_cli_refuses_bad_sparsity_before_loading(argv, message, capsys):
    """One error line, and nothing loads (the flags are checked first)."""
    from gearbx_mlx.generate import main

    try:
        code = main(["--prompt", "hi", "--model", "/nonexistent/model", *argv])
    except SystemExit as e:  # argparse's own error exit
        code = e.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "nonexistent" not in err


def test_cli_refuses_a_model_without_a_gated_ffn():
    import argparse

    from gearbx_mlx.speculative.cli import check_sparse_model

    model = make_tiny_llama(vocab=64, hidden=64)
    model.args.model_type = "gpt2"
    with pytest.raises(ValueError, match="^--draft-sparsity: the sparse drafter needs a gated FFN"):
        check_sparse_model(argparse.Namespace(draft_sparsity=0.5), model)
    check_sparse_model(argparse.Namespace(draft_sparsity=None), model)  # off: no check


#: The chat prompt of the default-model exactness tests, and the tokens they compare: exactness
#: holds token by token, and 8 tokens are 2 or more blocks of 3 drafts (a sparse drafter's
#: rejections make more); a sparse drafter's step and its build cost more than the dense one's.
SPARSE_PROMPT = "Describe a walk along a river on an autumn morning."
SPARSE_TOKENS = 8
#: The default-model exactness tests share their high-gear reference: one worker runs both.
SPARSE_DEFAULT_MODEL = pytest.mark.xdist_group("sparse-drafter-default-model")


@pytest.fixture(scope="module")
def sparse_prompt(default_model):
    """The prompt's token ids and the high gear's first SPARSE_TOKENS greedy tokens, decoded once
    for both tests."""
    from mlx_lm.generate import generate_step

    from gearbx_mlx.chat import encode_chat

    model, tok, _ = default_model
    ids = encode_chat(tok, SPARSE_PROMPT)
    steps = generate_step(mx.array(ids), model, max_tokens=SPARSE_TOKENS)
    return ids, [int(t) for (t, _), _ in zip(steps, range(SPARSE_TOKENS))]


@SPARSE_DEFAULT_MODEL
def test_greedy_output_is_the_high_gears_with_the_sparse_drafter(default_model, sparse_prompt):
    """Exactness is the promise: 8 tokens at three sparsities, token for token the high gear's;
    the drafters keep fewer blocks the sparser they are."""
    from gearbx_mlx.pipeline import stream_speculative_generate
    from gearbx_mlx.speculative.decode import SpeculativeConfig, get_draft

    model, tok, gearbox = default_model
    ids, want = sparse_prompt
    seen = []
    for sparsity in (0.5, 0.9, 0.25):
        config = SpeculativeConfig(max_draft=3, draft_sparsity=sparsity)
        got = [r.token for r in stream_speculative_generate(model, tok, ids, gearbox, config=config,
                                                            max_tokens=SPARSE_TOKENS)]
        assert got == want[: len(got)], sparsity
        assert len(got) == SPARSE_TOKENS or got[-1] in tok.eos_token_ids
        drafter = get_draft(model, gearbox, "low", "all", config.draft_sparsity, tok)
        seen.append(drafter.sparse["kept_fraction"])
    assert seen[1] < seen[0] < seen[2] < 1


def test_trace_header_and_summary_give_the_kept_fraction():
    """A run on a tiny model through the one pipeline: exact, and the kept fraction is in the record."""
    from conftest import make_tiny_tokenizer
    from mlx_lm.generate import generate_step

    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.pipeline import stream_speculative_generate
    from gearbx_mlx.speculative.cli import speculative_lines

    model = make_tiny_llama(vocab=64, hidden=128, seed=4)
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    tok = make_tiny_tokenizer(64)
    ids = [5, 9, 2, 7, 3]
    want = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=12), range(12))]
    got, last, responses = [], None, []
    for r in stream_speculative_generate(model, tok, ids, gb, max_draft=3, draft_sparsity=0.5, max_tokens=12):
        got.append(r.token)
        responses.append(r)
        last = r
    assert got == want[: len(got)]
    drafter = last.run.header()["speculative"]["drafter"]
    assert drafter["path"] == "mlx" and drafter["kept_fraction"] == 0.5
    assert {r.kept_fraction for r in responses if r.drafted} == {0.5}  # per token, for the trace
    assert all(r.hot_hit_rate is None for r in responses)  # no hot set
    summary = last.run.summary(last)
    assert any("keep 50.0% of down_proj's 64-neuron blocks" in line for line in speculative_lines(summary))


@SPARSE_DEFAULT_MODEL
def test_greedy_output_is_the_high_gears_with_every_sparse_mechanism(default_model, sparse_prompt):
    """TAM hot sets, the next-layer predictor and the balancer change what is drafted, never what is
    emitted (8 tokens: each mechanism has acted by then, which the summary's counts assert)."""
    from gearbx_mlx.pipeline import stream_speculative_generate
    from gearbx_mlx.speculative.decode import SpeculativeConfig, get_draft
    from gearbx_mlx.speculative.kairox import KairoxOptions

    model, tok, gearbox = default_model
    options = KairoxOptions(hot="tam", refresh=2, min_hits=1, predictor=True, audit=True, balancer=True,
                            window=2, target_acceptance=0.9)
    ids, want = sparse_prompt
    n = SPARSE_TOKENS
    config = SpeculativeConfig(max_draft=3, draft_sparsity=0.5, sparse_options=options)
    got = [r.token for r in stream_speculative_generate(model, tok, ids, gearbox, config=config, max_tokens=n)]
    assert got == want[: len(got)] and (len(got) == n or got[-1] in tok.eos_token_ids)
    state = get_draft(model, gearbox, "low", "all", 0.5, tok, options).kairox
    s = state.summary()
    assert s["refreshes"] > 0 and s["hot_hit_rate"] is not None and 0 <= s["predictor_hit_rate"] <= 1
    assert s["moves"] > 0  # a target of 0.9 is out of reach: the balancer added blocks
    assert SpeculativeConfig(sparse_options=dataclasses.asdict(options)).sparse_options == options


def test_auto_sparsity_is_decided_at_the_start_and_stays_exact():
    """``auto``: the dense and the sparse drafters are all measured, the best modeled one drafts, the
    candidates are in the plan, the output is the high gear's, and the per-token trace has the kept fraction."""
    from conftest import make_tiny_tokenizer
    from mlx_lm.generate import generate_step

    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.pipeline import stream_speculative_generate
    from gearbx_mlx.speculative.decode import SpeculativeConfig
    from gearbx_mlx.speculative.kairox import KairoxOptions
    from gearbx_mlx.speculative.sparse_plan import AUTO_SPARSITIES
    from gearbx_mlx.telemetry.trace import speculative_record

    model = make_tiny_llama(vocab=64, hidden=256, seed=5)
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    tok = make_tiny_tokenizer(64)
    ids = [5, 9, 2, 7, 3, 8, 1, 4, 6, 2, 9, 3]
    want = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=10), range(10))]
    config = SpeculativeConfig(mode="force", max_draft=2, draft_sparsity="auto",
                               sparse_options=KairoxOptions(hot="static"))
    out = list(stream_speculative_generate(model, tok, ids, gb, config=config, mode="force", max_tokens=10))
    assert [r.token for r in out] == want[: len(out)]
    plan = out[-1].run.plan
    cands = plan.extra["sparse_candidates"]
    assert set(cands) == {"dense", *(f"{s:g}" for s in AUTO_SPARSITIES)}
    best = max(cands.values(), key=lambda c: c["speedup"])
    assert plan.best_speedup == best["speedup"]
    chosen = plan.extra["draft_sparsity"]
    drafted = [r for r in out if r.drafted]
    if chosen is None:
        assert all(r.kept_fraction is None for r in out)
    else:
        kept = [r.kept_fraction for r in drafted if r.kept_fraction is not None]  # None: no one-token step
        assert kept and all(0 < k < 1 for k in kept)
        record = speculative_record(next(r for r in drafted if r.kept_fraction is not None))
        assert "kept_fraction" in record and "hot_hit_rate" in record


def test_auto_sparsity_needs_the_decision():
    from gearbx_mlx.speculative.decode import SpeculativeConfig

    with pytest.raises(ValueError, match="draft_sparsity='auto' is chosen by the start-of-run decision"):
        SpeculativeConfig(draft_sparsity="auto")
    assert SpeculativeConfig(draft_sparsity="auto", mode="auto").draft_sparsity == "auto"


# -- thresholds saved in the calibration file ------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), sparsity=st.sampled_from([0.25, 0.5, 0.7, 0.9]))
def test_saved_thresholds_give_the_measured_kept_fractions(seed, sparsity):
    """The curves saved in a calibration file solve a target sparsity as the masses themselves do."""
    from gearbx_mlx.speculative.sparse import keep_from_curves, threshold_curves

    rng = np.random.default_rng(seed)
    masses = [mx.array(np.abs(rng.standard_normal((40, 24))) ** p) for p in (1, 2, 3)]
    curves = threshold_curves(masses, 64)
    got, want = keep_from_curves(curves, sparsity), calibrate_keep(masses, sparsity)
    assert abs(np.mean(got) - (1 - sparsity)) <= 1 / 24 + 1e-6
    np.testing.assert_allclose(got, want, atol=2 / 24)


def test_saved_thresholds_of_another_model_are_refused():
    from gearbx_mlx.speculative.sparse import check_curves, threshold_curves

    curves = threshold_curves([mx.ones((4, 6)), mx.ones((4, 6))], 64)
    check_curves(curves, [6, 6], 64)
    with pytest.raises(ValueError, match="a calibration of another model"):
        check_curves(curves, [6, 6, 6], 64)
    with pytest.raises(ValueError, match="damaged"):
        check_curves({**curves, "kept": [[0.5]]}, [6, 6], 64)


def test_the_gearbox_drafter_uses_saved_thresholds():
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.speculative.draft import build_draft
    from gearbx_mlx.speculative.sparse import layer_masses, threshold_curves

    model = make_tiny_llama(vocab=64, hidden=256, seed=2)
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    draft = build_draft(model, gb, "low", "all", host=False)
    tokens = list(range(1, 40))
    curves = threshold_curves(layer_masses(draft.module, tokens, 64), 64)
    a = build_sparse_draft(draft, 0.5, tokens)
    b = build_sparse_draft(draft, 0.5, [1, 2], thresholds=curves)  # the tokens are not read
    assert b.sparse["thresholds"] == "calibration" and a.sparse["thresholds"] == "measured at start"
    assert abs(a.sparse["kept_fraction"] - b.sparse["kept_fraction"]) <= 1 / 8


def test_a_calibration_file_without_sparse_thresholds_is_refused_before_loading(tmp_path, capsys):
    from gearbx_mlx.calibration import Calibration
    from gearbx_mlx.generate import main

    path = Calibration(low=1.0, high=3.0, strategy="median", n_samples=4, vocab_size=64).save(tmp_path / "c.json")
    code = main(["--prompt", "hi", "--model", "/nonexistent/model", "--calibration", str(path),
                 "--speculative", "--draft-sparsity", "0.5"])
    err = capsys.readouterr().err
    assert code not in (0, None)
    assert f"error: --calibration {path} has no sparse-drafter thresholds" in err
    assert "Traceback" not in err and "nonexistent" not in err


@pytest.mark.parametrize("flag, sparse", [("0.5", 0.5), ("auto", None)])
def test_the_server_builds_the_drafter_asked_for(monkeypatch, flag, sparse):
    """``--draft-sparsity`` reaches the server: S builds the sparse drafter at load, ``auto`` leaves the
    choice to the first request's decision."""
    from conftest import make_tiny_tokenizer

    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.server import provider as provider_module
    from gearbx_mlx.server.options import build_parser

    model = make_tiny_llama(vocab=64, hidden=128, seed=6)
    config = GearboxConfig(scope="all", kernel="mlx")
    gb = Gearbox(model, config, vocab_size=64)
    monkeypatch.setattr(provider_module, "load", lambda *a, **k: (model, make_tiny_tokenizer(64), gb))
    args = build_parser().parse_args(["--speculative", "--draft-sparsity", flag])
    p = provider_module.GearModelProvider(args, config)
    p.load_default()
    assert p.speculative.draft_sparsity == (sparse if sparse is not None else "auto")
    if sparse is None:
        assert p.draft is None
    else:
        assert p.draft.sparse["sparsity"] == 0.5


def test_auto_reads_a_sparse_drafters_alpha_off_one_token_steps():
    """A sparse drafter's prefill is dense: its α for the decision comes from one-token steps over the
    prompt's last positions; keeping every block, those are the dense drafter's statistics."""
    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.speculative.draft import build_draft
    from gearbx_mlx.speculative.sparse_plan import STEPPED_POSITIONS, stepped_measurement

    model = make_tiny_llama(vocab=64, hidden=256, seed=7)
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    draft = build_draft(model, gb, "low", "all", host=False)
    ids = [int(t) for t in np.random.default_rng(0).integers(1, 64, 50)]
    dense = stepped_measurement(model, draft, ids, 2)
    every = stepped_measurement(model, build_sparse_draft(draft, 0.0, ids), ids, 2)
    assert dense.positions == every.positions == STEPPED_POSITIONS
    assert dense.stats.agree == every.stats.agree
    np.testing.assert_allclose(dense.stats.draft_entropy, every.stats.draft_entropy, rtol=1e-3, atol=1e-3)
    sparse = stepped_measurement(model, build_sparse_draft(draft, 0.75, ids), ids, 2)
    assert sparse.positions == STEPPED_POSITIONS
    assert sparse.stats.draft_entropy != dense.stats.draft_entropy  # its own one-token steps, not the prefill's


def test_a_fixed_sparsity_decision_measures_the_sparse_drafter_itself():
    """``--draft-sparsity S`` with the decision: α from the sparse drafter's own one-token steps, not a
    saved calibration of the dense drafter."""
    from conftest import make_tiny_tokenizer

    from gearbx_mlx.config import GearboxConfig
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.pipeline import stream_speculative_generate
    from gearbx_mlx.speculative.calibration import CALIBRATION_KEY
    from gearbx_mlx.speculative.sparse_plan import STEPPED_POSITIONS

    model = make_tiny_llama(vocab=64, hidden=256, seed=8)
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    gb.calibrate(make_tiny_tokenizer(64), "median", prompts=["t1 t2 t3 t4", "t5 t6 t7"])
    gb.calibration.extra[CALIBRATION_KEY] = {"low": {"alpha_greedy": 0.99, "alpha_sampled": 0.99, "n_samples": 9,
                                                      "stop_bits": 1.0, "max_draft": 2}}
    ids = [int(t) for t in np.random.default_rng(1).integers(1, 64, 45)]
    out = list(stream_speculative_generate(model, make_tiny_tokenizer(64), ids, gb, draft_sparsity=0.5,
                                           mode="force", max_draft=2, max_tokens=4))
    plan = out[-1].run.plan
    assert plan.alpha_source == f"measured on {STEPPED_POSITIONS} prompt positions" and plan.alpha != 0.99


def test_the_configs_mode_stands_unless_a_keyword_overrides_it(monkeypatch):
    """``stream_speculative_generate(config=SpeculativeConfig(mode="force"))`` decodes in
    ``force``: a ``mode`` keyword left out does not reset the config's mode."""
    from gearbx_mlx import pipeline
    from gearbx_mlx.speculative.decode import SpeculativeConfig

    seen = []
    monkeypatch.setattr(pipeline, "stream_generate", lambda *a, speculative, **kw: seen.append(speculative.mode))
    for call, want in (({"config": SpeculativeConfig(mode="force")}, "force"),
                       ({"config": SpeculativeConfig(mode="force"), "mode": "auto"}, "auto"),
                       ({"config": SpeculativeConfig(mode="auto"), "plain": True}, "plain"),
                       ({}, None)):
        pipeline.stream_speculative_generate(None, None, [1], **call)
        assert seen[-1] == want, call
