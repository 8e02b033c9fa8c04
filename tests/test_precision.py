"""Precision manager (§6): discovery, lazy quantization, swaps, memory, source check."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama
from hypothesis import given, settings, strategies as st

from gearbx_mlx import precision
from gearbx_mlx.config import GearboxConfig
from gearbx_mlx.precision import PrecisionManager, discover, is_prequantized
from gearbx_mlx.sourcecheck import check_weights


def logits(model, ids=(1, 5, 9, 42, 7)):
    out = model(mx.array([list(ids)]))
    mx.eval(out)
    return np.array(out)


def test_discovery_attention_vs_all(tiny_llama):
    att, _ = discover(tiny_llama, "attention", 64)
    assert att == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "koqv"]
    assert all("self_attn" in p for p in att)
    alls, _ = discover(tiny_llama, "all", 64)
    assert "model.embed_tokens" in alls  # tied output projection
    assert any("mlp" in p for p in alls)
    untied = make_tiny_llama(tie=False)
    alls2, _ = discover(untied, "all", 64)
    assert "lm_head" in alls2 and "model.embed_tokens" not in alls2


def test_discovery_sorts_by_layer_index():
    m = make_tiny_llama(layers=12, hidden=64)
    paths, _ = discover(m, "attention", 64)
    layers = [int(p.split(".")[2]) for p in paths]
    assert layers == sorted(layers) and layers[-1] == 11


def test_layers_not_divisible_by_group_are_skipped():
    m = make_tiny_llama(hidden=96)  # 96 % 64 != 0
    paths, skipped = discover(m, "attention", 64)
    assert paths == [] and skipped and "not a multiple of 64" in skipped[0]


@pytest.mark.parametrize("scope", ["attention", "all"])
def test_high_gear_is_bit_identical_and_restores_the_same_objects(tiny_llama, scope):
    ref = logits(tiny_llama)
    mgr = PrecisionManager(tiny_llama, GearboxConfig(scope=scope))
    before = mgr.installed()
    for gear in ("low", "mid", "low", "high"):
        mgr.shift(gear)
        if gear != "high":
            assert not np.array_equal(logits(tiny_llama), ref)
    assert np.array_equal(logits(tiny_llama), ref)
    after = mgr.installed()
    assert all(after[p] is before[p] for p in before)


@settings(max_examples=25, deadline=None)
@given(seq=st.lists(st.sampled_from(["low", "mid", "high"]), min_size=1, max_size=8))
def test_swaps_are_idempotent(seq):
    model = make_tiny_llama(hidden=64, layers=1)
    mgr = PrecisionManager(model, GearboxConfig(store="separate", kernel="mlx"))
    for g in seq:
        mgr.shift(g)
        installed = mgr.installed()
        assert mgr.shift(g) is None  # a second shift to the same gear does nothing
        assert mgr.installed() == installed
        kinds = {type(m) for m in installed.values()}
        assert kinds == ({nn.Linear} if g == "high" else {nn.QuantizedLinear})
        if g != "high":
            bits = {m.bits for m in installed.values()}
            assert bits == {4 if g == "low" else 8}


def test_lazy_quantization_cache_and_memory(tiny_llama):
    mgr = PrecisionManager(tiny_llama, GearboxConfig(store="separate"))
    assert set(mgr.cache) == {"high"}  # the separate store quantizes nothing at load (§6.2)
    r = mgr.shift("low")
    assert r.first_entry and r.quantize_seconds > 0 and set(mgr.cache) == {"high", "low"}
    mgr.shift("high")
    r = mgr.shift("low")
    assert not r.first_entry and r.quantize_seconds == 0
    mem = mgr.memory()
    assert mem["low_bytes"] < mem["high_bytes"] / 4  # 4-bit + scales vs float32
    assert mem["active_bytes"] == mem["low_bytes"]
    assert mem["resident_total"] == mem["low_bytes"] + mem["high_bytes"]  # nothing offloaded


def test_a_long_lived_manager_keeps_its_counts_not_a_record_per_shift(tiny_llama, monkeypatch):
    """A server's manager shifts for ever: it keeps the latest SHIFTS_KEPT records and the
    counts and total swap time of every shift."""
    monkeypatch.setattr(precision, "SHIFTS_KEPT", 8)
    mgr = PrecisionManager(tiny_llama, GearboxConfig(store="separate"))
    for i in range(30):
        mgr.shift(("low", "mid", "high")[i % 3])
    s = mgr.summary()
    assert len(mgr.history) == 8 and s["shifts"] == 30
    assert s["entries"]["low"]["entries"] == 10 and len(mgr.swaps["low"]) == 8
    assert s["swap_seconds"] >= sum(r.seconds - r.quantize_seconds for r in mgr.history) > 0
    mgr.shift("high", record=False)
    assert mgr.summary()["shifts"] == 30


def test_telemetry_only_for_prequantized_models(tiny_llama):
    nn.quantize(tiny_llama, group_size=64, bits=4)
    assert is_prequantized(tiny_llama)
    ref = logits(tiny_llama)
    mgr = PrecisionManager(tiny_llama, GearboxConfig())
    assert mgr.telemetry_only and mgr.paths == []
    mgr.shift("low")
    mgr.shift("mid")
    assert mgr.gear == "mid" and np.array_equal(logits(tiny_llama), ref)


def test_unsupported_bits_and_unknown_gear(tiny_llama):
    with pytest.raises(ValueError, match="unsupported bit width"):
        GearboxConfig(bits={"low": 1, "mid": 8})
    mgr = PrecisionManager(tiny_llama, GearboxConfig())
    with pytest.raises(ValueError, match="unknown gear"):
        mgr.shift("turbo")


def test_source_check_flags_dequantized_weights_only():
    rng = np.random.default_rng(0)
    floats = [rng.normal(size=(64, 512)).astype(np.float32) * 0.02 for _ in range(4)]
    assert not check_weights(floats).suspected
    bf16 = [np.array(mx.array(w).astype(mx.bfloat16).astype(mx.float32)) for w in floats]
    assert not check_weights(bf16).suspected
    for bits in (4, 8):
        deq = []
        for w in floats:
            q = mx.quantize(mx.array(w), group_size=64, bits=bits)
            deq.append(np.array(mx.dequantize(*q, group_size=64, bits=bits).astype(mx.float16).astype(mx.float32)))
        c = check_weights(deq)
        assert c.suspected and c.estimated_bits == bits, c


@pytest.mark.slow
def test_default_model_triggers_double_quantization_warning(default_model):
    _, _, gearbox = default_model
    check = gearbox.source_check()
    assert check.suspected and check.estimated_bits == 4


def test_the_nested_store_makes_each_kernels_first_use_check_at_load_not_in_the_first_prompt(
        tiny_llama, monkeypatch):
    """On the CPU each C kernel checks its first call against the reference (bindings.guard):
    the nested store makes those calls for every gear when it builds its planes at load, so the
    first prompt's steps run trusted kernels."""
    from gearbx_mlx.bindings import cpu, gpu, guard

    if not cpu.available() or gpu.gpu_backend() is not None:
        pytest.skip("the C kernels on the CPU device")
    checks = []
    real = guard._first_call
    monkeypatch.setattr(guard, "_first_call", lambda spec, *a: checks.append(spec.family) or real(spec, *a))
    mgr = PrecisionManager(tiny_llama, GearboxConfig(scope="all", store="nested", kernel="packed"))
    made = len(checks)
    assert made > 0 and all(f.startswith("C ") for f in checks), checks
    for gear in ("low", "mid", "high", "low"):
        mgr.shift(gear)
        mx.eval(tiny_llama(mx.array([[3]])))
    assert len(checks) == made, checks[made:]
