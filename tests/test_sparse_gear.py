"""The sparse low gear of routed decoding, and its evaluation rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_llama, make_tiny_tokenizer
from hypothesis import given, settings, strategies as st

from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.gearbox import Gearbox
from gearbx_mlx.speculative.sparse import ffn_layers, hidden, masked_down, top_blocks
from gearbx_mlx.speculative.sparse_gear import (
    SparseGearMLP,
    install_sparse_gear,
    remove_sparse_gear,
    row_mask,
    set_teacher,
)


def _setup(seed: int = 0):
    model = make_tiny_llama(vocab=64, hidden=256, seed=seed)  # 8 blocks of 64 per FFN
    gb = Gearbox(model, GearboxConfig(scope="all", kernel="mlx"), vocab_size=64)
    return model, gb


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), keep=st.integers(1, 8), seed=st.integers(0, 999))
def test_row_mask_keeps_each_rows_heaviest_blocks(rows, keep, seed):
    mx.random.seed(seed)
    h = mx.random.normal((rows, 8 * 64))
    mask = np.array(row_mask(h, keep, 64)).reshape(rows, 8, 64)[:, :, 0]
    for r in range(rows):
        want = np.zeros(8)
        want[np.array(top_blocks(h[r], keep, 64))] = 1
        np.testing.assert_array_equal(mask[r], want)


def test_the_low_gear_step_is_sparse_and_the_others_dense():
    model, gb = _setup(1)
    info = install_sparse_gear(model, gb, 0.5, list(range(1, 30)))
    assert 0 < info["kept_fraction"] < 1 and gb.manager.gear == "high"
    layer = ffn_layers(model)[0]
    assert isinstance(layer.mlp, SparseGearMLP)
    x = mx.random.normal((1, 1, 256))
    mlp = layer.mlp
    np.testing.assert_allclose(np.array(mlp(x)), np.array(mlp.down_proj(hidden(mlp, x))), rtol=1e-5, atol=1e-5)
    gb.manager.shift("low")
    h = hidden(mlp, x).reshape(1, -1)
    want = masked_down(h, mlp.down_proj, top_blocks(h[0], mlp.keep, 64), 64)
    np.testing.assert_allclose(np.array(mlp(x)).reshape(-1), np.array(want).reshape(-1), rtol=1e-4, atol=1e-4)
    xs = mx.random.normal((1, 3, 256))
    np.testing.assert_allclose(np.array(mlp(xs)), np.array(mlp.down_proj(hidden(mlp, xs))), rtol=1e-5, atol=1e-5)
    set_teacher(model, True)  # every row masked by its own blocks: each row as its own one-token step
    rows = [np.array(mlp(xs[:, i : i + 1])).reshape(-1) for i in range(3)]
    np.testing.assert_allclose(np.array(mlp(xs))[0], np.stack(rows), rtol=1e-4, atol=1e-4)
    gb.manager.shift("high")
    remove_sparse_gear(model)
    assert not any(isinstance(layer.mlp, SparseGearMLP) for layer in ffn_layers(model))


def test_routed_decoding_with_the_sparse_low_gear_runs_and_differs_only_in_the_low_gear():
    from gearbx_mlx.pipeline import stream_generate
    from gearbx_mlx.policies import make_policy

    model, gb = _setup(2)
    tok = make_tiny_tokenizer(64)
    ids = [5, 9, 2, 7, 3]

    def run(gear):
        return [r.token for r in stream_generate(model, tok, ids, gb, policy=make_policy(gear), max_tokens=8)]

    high, low = run("high"), run("low")
    install_sparse_gear(model, gb, 0.9, list(range(1, 30)))
    try:
        assert run("high") == high
        sparse_low = run("low")
        assert len(sparse_low) == len(low)
    finally:
        remove_sparse_gear(model)
    assert run("low") == low


def test_evaluation_rows_of_the_sparse_gear():
    from gearbx_mlx.evaluation.sparse_gear import sparse_gear_rows

    model = make_tiny_llama(vocab=64, hidden=256, seed=3)
    tok = make_tiny_tokenizer(64)
    windows = [[1, 5, 9, 2, 7, 3, 8, 4], [6, 2, 9, 3, 5, 1, 7, 2]]
    before = np.array(model(mx.array([windows[0]])))
    out = sparse_gear_rows(model, tok, windows, [0.25, 0.75], 64)
    rows = {r["name"]: r for r in out["rows"]}
    assert list(rows) == ["static-high", "static-low", "static-low-sparse-0.25", "static-low-sparse-0.75"]
    assert rows["static-high"]["kl"] == pytest.approx(0, abs=1e-5) and rows["static-high"]["agreement"] == 1
    assert rows["static-low-sparse-0.75"]["bytes_per_token"] < rows["static-low-sparse-0.25"]["bytes_per_token"] \
        < rows["static-low"]["bytes_per_token"] < rows["static-high"]["bytes_per_token"]
    assert rows["static-low-sparse-0.75"]["kl"] > rows["static-low"]["kl"] >= 0
    np.testing.assert_array_equal(np.array(model(mx.array([windows[0]]))), before)  # the model as it was


def test_a_model_without_a_gated_ffn_is_refused():
    from gearbx_mlx.evaluation.sparse_gear import sparse_gear_rows

    model = make_tiny_llama(vocab=64, hidden=64)
    model.args.model_type = "gpt2"
    with pytest.raises(ValueError, match="gated FFN"):
        sparse_gear_rows(model, make_tiny_tokenizer(64), [[1, 2, 3]], [0.5], 64)


@pytest.mark.parametrize("argv, message", [
    (["--sparse-gear", "1.2"], "error: --sparse-gear must be in [0, 0.95]"),
    (["--sparse-gear", "0.5", "--speculative"], "use --draft-sparsity"),
    (["--sparse-gear", "0.5", "--static-gear", "mid"], "--static-gear mid never uses it"),
])
def test_cli_refuses_bad_sparse_gear_before_loading(argv, message, capsys):
    from gearbx_mlx.generate import main

    code = main(["--prompt", "hi", "--model", "/nonexistent/model", *argv])
    err = capsys.readouterr().err
    assert code not in (0, None) and message in err and "Traceback" not in err and "nonexistent" not in err


def test_the_sparse_gear_table_renders_every_row():
    from gearbx_mlx.evaluation.sparse_gear import sparse_gear_table

    rows = [{"name": "static-high", "kl": 0.0, "agreement": 1.0, "perplexity": 9.5, "bytes_per_token": 2e6},
            {"name": "static-low-sparse-0.5", "kl": 0.31, "agreement": 0.6, "perplexity": 12.0,
             "bytes_per_token": 1e6, "kept_fraction": 0.5}]
    text = sparse_gear_table({"rows": rows})
    assert "static-low-sparse-0.5" in text and "0.3100" in text and " 0.50 " in text
