"""Gears of sharded models, in one process (tests/test_distributed_launch.py launches ranks).

A rank's shard is simulated by slicing: MLX's sharded linears over the
one-process group hold whatever weight they are given, so rank ``r`` of ``N``
is the layer with its rows (all-to-sharded) or columns (sharded-to-all)
sliced out. Its gear, built from that slice alone, must compute the rank's
part of the full gear: the ranks' parts concatenated (rows) or summed
(columns) give the full layer's gear, to float rounding.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear
from mlx_lm.models import gemma3_text

from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.distributed import (
    ShardedSumLinear,
    StepExchange,
    check_shardable,
    local_linear,
    model_identity,
    shard_gear,
)
from gearbx_mlx.distributed.exchange import agreement
from gearbx_mlx.distributed.shard import world_sizes
from gearbx_mlx.nested.store import cache_key, plan_for
from gearbx_mlx.precision import PrecisionManager, mlx_quantizer, packed_quantizer
from gearbx_mlx.telemetry.trace import TraceError, TraceWriter, read_trace, token_record

#: Float32 products summed over 2-3 shards against one product over the whole row.
SUM_RTOL, SUM_ATOL = 1e-5, 1e-4


def one_group():
    return mx.distributed.init()  # a process on its own: a group of one


def shard_of(layer: nn.Linear, kind: str, rank: int, ranks: int) -> nn.Module:
    """Rank ``rank``'s layer of ``ranks``: the slice mlx's sharding would give it."""
    out_dims, in_dims = layer.weight.shape
    bias = "bias" in layer
    if kind == "all-to-sharded":
        m = AllToShardedLinear(in_dims, out_dims, bias=bias, group=one_group())
        rows = slice(rank * out_dims // ranks, (rank + 1) * out_dims // ranks)
        m.weight = layer.weight[rows]
        if bias:
            m.bias = layer.bias[rows]
    else:
        m = ShardedToAllLinear(in_dims, out_dims, bias=bias, group=one_group())
        m.weight = layer.weight[:, rank * in_dims // ranks: (rank + 1) * in_dims // ranks]
        if bias:
            m.bias = layer.bias
    return m


@settings(max_examples=20, deadline=None)
@given(ranks=st.sampled_from([2, 3]), group=st.sampled_from([32, 64]), groups=st.integers(1, 3),
       rows=st.integers(1, 5), bits=st.sampled_from([4, 8]), bias=st.booleans(),
       quantizer=st.sampled_from([mlx_quantizer, packed_quantizer]), tokens=st.sampled_from([1, 3]))
def test_shard_gears_add_up_to_the_whole_layers_gear(ranks, group, groups, rows, bits, bias, quantizer, tokens):
    in_dims, out_dims = ranks * group * groups, ranks * 8 * rows  # whole quantization groups per shard
    mx.random.seed(in_dims + out_dims)
    layer = nn.Linear(in_dims, out_dims, bias=bias)
    x = mx.random.normal((tokens, in_dims))
    want = np.array(quantizer(layer, bits, group)(x))
    # all-to-sharded: each rank's rows, no communication
    parts = []
    for r in range(ranks):
        s = shard_of(layer, "all-to-sharded", r, ranks)
        gear = shard_gear(quantizer(local_linear(s), bits, group), s)
        assert not isinstance(gear, ShardedSumLinear)
        parts.append(np.array(gear(x)))
    np.testing.assert_allclose(np.concatenate(parts, axis=-1), want, rtol=SUM_RTOL, atol=SUM_ATOL)
    # sharded-to-all: each rank's columns; the sum over ranks, then the bias once
    total = 0
    for r in range(ranks):
        s = shard_of(layer, "sharded-to-all", r, ranks)
        gear = shard_gear(quantizer(local_linear(s), bits, group), s)
        assert isinstance(gear, ShardedSumLinear) and "bias" not in gear.local
        cols = slice(r * in_dims // ranks, (r + 1) * in_dims // ranks)
        total = total + np.array(gear.local(x[:, cols]))
    if bias:
        total = total + np.array(layer.bias)
    np.testing.assert_allclose(total, want, rtol=SUM_RTOL, atol=SUM_ATOL)


def test_sharded_sum_adds_the_bias_once_after_the_sum():
    layer = nn.Linear(64, 16, bias=True)
    s = shard_of(layer, "sharded-to-all", 0, 1)
    gear = shard_gear(mlx_quantizer(local_linear(s), 8, 32), s)
    x = mx.random.normal((2, 64))
    # A group of one sums nothing: the wrapper is the local product plus the bias, bit for bit.
    assert np.array_equal(np.array(gear(x)), np.array(gear.local(x) + layer.bias))
    assert gear.bias is s.bias  # the whole bias, shared, not a copy


def test_local_linear_shares_the_shard_arrays_and_draws_no_random_numbers():
    s = shard_of(nn.Linear(64, 32, bias=True), "all-to-sharded", 1, 2)
    state = mx.random.state[0]
    mx.eval(state)
    before = np.array(state)
    local = local_linear(s)
    assert local.weight is s.weight and local.bias is s.bias
    assert np.array_equal(np.array(mx.random.state[0]), before)
    with pytest.raises(TypeError, match="not one of MLX's sharded linears"):
        local_linear(nn.Linear(4, 4))


def sharded_copy(seed: int = 0, tie: bool = True):
    """The tiny llama sharded over a group of one: MLX's sharded layers, the whole weights."""
    model = make_tiny_llama(tie=tie, seed=seed)
    model.shard(one_group())
    return model


def logits_of(model, ids=(1, 5, 9, 42, 7)):
    out = model(mx.array([list(ids)]))
    mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("store", ["separate", "nested"])
@pytest.mark.parametrize("scope", ["attention", "all"])
def test_a_sharded_model_gets_every_gear_of_the_plain_one(store, scope):
    plain, sharded = make_tiny_llama(), sharded_copy()
    config = GearboxConfig(scope=scope, store=store, kernel="mlx")
    a, b = PrecisionManager(plain, config), PrecisionManager(sharded, config)
    assert a.paths == b.paths and a.paths
    for gear in ("low", "mid", "high"):
        a.shift(gear)
        b.shift(gear)
        np.testing.assert_allclose(logits_of(sharded), logits_of(plain), rtol=1e-5, atol=1e-5)
    assert a.memory() == b.memory()
    b.shift("low")
    kinds = {p.rsplit(".", 1)[-1]: type(m).__name__ for p, m in b.installed().items()}
    assert kinds["o_proj"] == "ShardedSumLinear" and kinds["q_proj"] != "ShardedSumLinear"


def test_check_shardable_names_the_world_sizes_that_work():
    model = make_tiny_llama()  # 4 heads, 2 key/value heads
    check_shardable(model, 2)
    assert world_sizes(model) == [2]
    with pytest.raises(ValueError, match=r"3 ranks do not divide the model's 4 attention heads and 2 key/value "
                                         r"heads.*launch -n 2"):
        check_shardable(model, 3)
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=1,
                                 intermediate_size=128, num_attention_heads=2, head_dim=32,
                                 num_key_value_heads=2, vocab_size=64)
    with pytest.raises(ValueError, match=r"'gemma3_text' model has no shard\(\)"):
        check_shardable(gemma3_text.Model(args), 2)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_the_exchange_returns_rank_0s_values_bit_for_bit(data):
    dtype = data.draw(st.sampled_from([mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint32, mx.int64,
                                       mx.bool_, mx.uint8]))
    shape = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2)))
    raw = np.frombuffer(data.draw(st.binary(min_size=64, max_size=64)), np.uint8)
    n = int(np.prod(shape)) if shape else 1
    if dtype == mx.bool_:
        value = mx.array(raw[:n].reshape(shape) % 2 == 1)
    else:
        words = mx.array(np.resize(raw, n * dtype.size).view(np.uint8))
        value = mx.view(words, dtype).reshape(shape)
    h = mx.array(float(data.draw(st.floats(allow_nan=True, width=32))), dtype=mx.float32)
    ex = StepExchange(one_group())
    shared = ex.share(value, h)
    got, got_h = shared.values
    assert got.dtype == value.dtype and got.shape == value.shape
    assert np.array_equal(np.array(mx.view(got.reshape(-1), mx.uint8) if dtype.size > 1 else got),
                          np.array(mx.view(value.reshape(-1), mx.uint8) if dtype.size > 1 else value))
    assert np.array_equal(np.array(mx.view(got_h, mx.uint32)), np.array(mx.view(h, mx.uint32)))  # NaN bits too
    assert ex.count == 1 and shared.rows().shape == (1, sum(shared.widths))


def test_agreement_compares_every_rank_with_rank_0():
    rows = np.array([[1, 2, 3], [1, 2, 4]], np.uint32)
    assert agreement(rows, [slice(0, 2), slice(2, 3)]) == (True, False)


def test_model_identity_sees_one_changed_weight_and_is_kept():
    a, b = make_tiny_llama(seed=0), make_tiny_llama(seed=0)
    assert model_identity(a) == model_identity(b)
    c = make_tiny_llama(seed=0)
    w = np.array(c.model.norm.weight)
    w[3] = np.nextafter(w[3], np.float32(2))  # one bit of one replicated weight
    c.model.norm.weight = mx.array(w)
    assert model_identity(c) != model_identity(a)
    d = make_tiny_llama(seed=0)
    first = model_identity(d)
    d.model.norm.weight = d.model.norm.weight + 1  # later changes do not move it: as first seen
    assert model_identity(d) == first


def test_planes_cache_keys_differ_per_shard_and_stay_for_one_process():
    plan = plan_for("original", False, 64)
    base = cache_key("f" * 64, ["a.b"], plan)
    assert base == cache_key("f" * 64, ["a.b"], plan, (0, 1))
    keys = {cache_key("f" * 64, ["a.b"], plan, (r, 2)) for r in range(2)}
    assert len(keys) == 2 and base not in keys


class _Resp:
    index, token, text, entropy, smoothed_entropy, predicted_entropy = 0, 5, "x", 1.0, 1.0, 1.0
    gear, next_gear, shifted, shift_seconds, step_seconds, nonfinite = "low", "low", False, 0.0, 0.01, False
    rank_gears, ranks_agree, exchange_seconds = ["low", "low"], True, 2e-5


def test_trace_records_every_ranks_gear_and_rejects_a_bad_agreement_field(tmp_path):
    rec = token_record(_Resp())
    assert rec["rank_gears"] == ["low", "low"] and rec["ranks_agree"] is True and rec["exchange_seconds"] == 2e-5
    single = _Resp()
    single.rank_gears = None
    assert "rank_gears" not in token_record(single)  # one process: no such fields
    path = tmp_path / "t.jsonl"
    with TraceWriter(path) as w:
        w.header(vocab_size=256)
        w.token(**rec)
    assert read_trace(path).tokens[0]["rank_gears"] == ["low", "low"]
    lines = path.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["ranks_agree"] = "yes"
    path.write_text(lines[0] + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceError, match="'ranks_agree' must be true or false"):
        read_trace(path)
