"""Nested bit planes: the low plane is MLX's 4-bit quantization, each plane
shrinks the error, and the reference product is the sum of quantized products."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st

from gearbx_mlx.nested.planes import (
    DEFAULT_PLAN,
    bits_per_weight,
    build_planes,
    check_plan,
    reconstruct,
    reference_matmul,
    residual_exponent,
)

#: Relative RMS error of each gear's reconstruction on Gaussian weights (measured
#: about 9.1e-2, 5.6e-3 and 1.1e-4 in float32; float16 and bfloat16 alike).
GEAR_REL_RMSE = {1: 0.1, 2: 0.007, 3: 2e-4}
#: Product of x against the summed planes vs against their reconstruction, by dtype.
MATMUL_RTOL = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 8e-2}


def _weights(rows: int, cols: int, dtype, seed: int = 0) -> mx.array:
    mx.random.seed(seed)
    return (mx.random.normal((rows, cols)) * 0.02).astype(dtype)


def _rel_rmse(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(b**2))).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_low_plane_is_mlx_4bit_and_each_plane_shrinks_the_error(dtype):
    w = _weights(96, 320, dtype)
    planes = build_planes(w)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    assert mx.array_equal(planes[0].weight, q) and mx.array_equal(planes[0].scales, s)
    assert mx.array_equal(planes[0].biases, b) and planes[0].exponent == 0
    assert all(p.scales.dtype == dtype and p.biases.dtype == dtype for p in planes)
    errs = [_rel_rmse(reconstruct(planes, n, mx.float32), w) for n in (1, 2, 3)]
    for n, e in zip((1, 2, 3), errs):
        assert e < GEAR_REL_RMSE[n], (n, errs)
    assert errs[0] > errs[1] > errs[2]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows,cols,batch", [(1, 64, 1), (7, 192, 3), (33, 128, 1)])
def test_reference_matmul_is_the_product_with_the_reconstruction(dtype, rows, cols, batch):
    w = _weights(rows, cols, dtype, seed=rows)
    planes = build_planes(w)
    x = mx.random.normal((batch, cols)).astype(dtype)
    bias = mx.random.normal((rows,)).astype(dtype)
    for n in (1, 2, 3):
        y = reference_matmul(x, planes, n, bias)
        assert y.dtype == dtype and y.shape == (batch, rows)
        ref = x.astype(mx.float32) @ reconstruct(planes, n, mx.float32).T + bias.astype(mx.float32)
        err = mx.max(mx.abs(y.astype(mx.float32) - ref)).item() / max(mx.max(mx.abs(ref)).item(), 1e-6)
        assert err < MATMUL_RTOL[dtype], (n, err)


def test_plane_costs_in_bits_per_weight():
    half = build_planes(_weights(8, 256, mx.float16))
    assert [bits_per_weight(half, n) for n in (1, 2, 3)] == [4.5, 9.5, 16.0]
    full = build_planes(_weights(8, 256, mx.float32))
    assert [bits_per_weight(full, n) for n in (1, 2, 3)] == [5.0, 11.0, 18.0]


@settings(max_examples=25, deadline=None)
@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False), st.booleans())
def test_residual_exponent_brings_the_largest_magnitude_to_half_or_more(m, negative):
    r = mx.array([0.0, -m if negative else m], dtype=mx.float32)
    e = residual_exponent(r)
    scaled = abs(float(r[1].item())) * 2.0**e
    assert 0.5 <= scaled < 1.0


def test_residual_exponent_of_zero_and_of_nan():
    assert residual_exponent(mx.zeros((3, 3))) == 0
    with pytest.raises(ValueError, match="NaN or an infinity"):
        residual_exponent(mx.array([1.0, float("nan")]))


@pytest.mark.parametrize("plan,cols,match", [
    ((), 128, "one to three"),
    (DEFAULT_PLAN + ((4, 32),), 128, "one to three"),
    (((4, 64), (7, 32)), 128, "unsupported plane bits"),
    (((4, 48),), 96, "group size must be"),
    (DEFAULT_PLAN, 96, "not a multiple"),
    ((4, 4), 128, "bits, group size"),
])
def test_bad_plans_fail_with_one_clear_error(plan, cols, match):
    with pytest.raises(ValueError, match=match):
        check_plan(plan, cols)


def test_reference_matmul_rejects_a_gear_beyond_its_planes():
    planes = build_planes(_weights(4, 64, mx.float32), plan=((4, 64), (4, 32)))
    with pytest.raises(ValueError, match="1 to 2 planes"):
        reference_matmul(mx.zeros((1, 64)), planes, 3)


# -- the nested store in the precision manager ---------------------------------------------------

import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from conftest import make_tiny_llama  # noqa: E402

from gearbx_mlx.bindings import gpu  # noqa: E402
from gearbx_mlx.config import GearboxConfig  # noqa: E402
from gearbx_mlx.nested.layers import NestedEmbedding, NestedLinear, NestedWeights  # noqa: E402
from gearbx_mlx.precision import PrecisionManager  # noqa: E402

IDS = (1, 5, 9, 42, 7, 3)
#: Mean absolute logit difference of each nested gear from MLX's separate layers
#: of the same bits on the tiny model (low must be equal to float rounding).
LOW_VS_MLX4_ATOL = 1e-4
#: Mean relative logit error of the high gear read from all planes (measured ~6e-4).
PLANES_HIGH_LOGIT_RTOL = 1.5e-3


def _logits(model) -> np.ndarray:
    out = model(mx.array([list(IDS)]))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("scope", ["attention", "all"])
def test_nested_gears_share_their_planes_and_shift_without_quantizing(scope):
    model = make_tiny_llama()
    ref = _logits(model)
    sep = PrecisionManager(make_tiny_llama(), GearboxConfig(scope=scope))
    sep.shift("low")
    mlx_low = _logits(sep.model)
    mgr = PrecisionManager(model, GearboxConfig(scope=scope, store="nested"))
    assert mgr.nested and set(mgr.nested) == set(mgr.paths)
    for gear in ("low", "mid", "high", "mid", "low", "high"):
        rec = mgr.shift(gear)
        assert rec is None or rec.quantize_seconds == 0.0
        got = _logits(model)
        if gear == "low":
            assert np.abs(got - mlx_low).max() < LOW_VS_MLX4_ATOL  # nested low = MLX 4-bit
        elif gear == "high":
            assert np.array_equal(got, ref)  # high = the loaded weights, bit for bit
    assert mgr.quantize_seconds == {}
    low, mid = mgr.cache["low"], mgr.cache["mid"]
    for p in mgr.paths:  # the same arrays under every view
        assert low[p].nested is mid[p].nested and (low[p].n, mid[p].n) == (1, 2)
        assert isinstance(low[p], NestedEmbedding if p.endswith("embed_tokens") else NestedLinear)


def test_nested_mid_is_closer_than_low_and_planes_high_is_near_exact():
    model = make_tiny_llama()
    ref = _logits(model)
    mgr = PrecisionManager(model, GearboxConfig(scope="all", store="nested", high="planes"))
    assert mgr.originals == {} and mgr.gear == "high"
    errs = {}
    for gear in ("low", "mid", "high"):
        mgr.shift(gear)
        errs[gear] = np.abs(_logits(model) - ref).mean() / np.abs(ref).mean()
    assert errs["low"] > errs["mid"] > errs["high"] and errs["high"] < PLANES_HIGH_LOGIT_RTOL, errs


def test_nested_memory_counts_shared_planes_once():
    model = make_tiny_llama(hidden=256)
    sep = PrecisionManager(make_tiny_llama(hidden=256), GearboxConfig(scope="all", store="separate"))
    for g in ("low", "mid", "high"):
        sep.shift(g)
    orig = PrecisionManager(model, GearboxConfig(scope="all", store="nested")).memory()
    planes = PrecisionManager(make_tiny_llama(hidden=256), GearboxConfig(scope="all", store="nested",
                                                                         high="planes")).memory()
    s = sep.memory()
    assert s["resident_total"] == s["low_bytes"] + s["mid_bytes"] + s["high_bytes"]
    # float32 source, float32 scales: planes 5 + 6 (+ 7) bits a weight; originals 32.
    assert orig["resident_total"] < s["resident_total"]
    assert orig["low_bytes"] < orig["mid_bytes"] < orig["high_bytes"]
    assert planes["resident_total"] == planes["high_bytes"] < orig["resident_total"]
    assert planes["resident_total"] / planes["fp16_bytes"] == pytest.approx(18 / 16, rel=0.02)


def test_nested_store_checks_the_planes_for_the_c_kernels_with_the_planes_not_in_a_prefill(monkeypatch):
    """Every matrix's C-kernel state is built with its planes, so a first prefill and its
    decode steps (mlx-lm's prompt time) build none."""
    from gearbx_mlx.bindings import cpu, gpu, nested_cpu

    if not cpu.available() or gpu.gpu_backend() is not None:
        pytest.skip("the C kernels on the CPU device")
    mgr = PrecisionManager(make_tiny_llama(), GearboxConfig(scope="all", store="nested", kernel="packed"))
    built = []
    real = nested_cpu.PreparedNested.__init__
    monkeypatch.setattr(nested_cpu.PreparedNested, "__init__", lambda self, p: built.append(p) or real(self, p))
    for gear in ("mid", "low"):
        mgr.shift(gear)
        _logits(mgr.model)
        out = mgr.model(mx.array([[IDS[0]]]))  # one row: the C GEMV
        mx.eval(out)
    assert built == []


def test_nested_store_of_an_8bit_model_gets_a_real_low_gear():
    model = make_tiny_llama()
    nn.quantize(model, group_size=64, bits=8)
    ref = _logits(model)
    mgr = PrecisionManager(model, GearboxConfig(scope="all", store="nested"))
    assert not mgr.telemetry_only and mgr.source == "quantized-8bit"
    assert all(w.bits == (4, 4) and w.group_sizes == (64, 32) for w in mgr.nested.values())
    mgr.shift("low")
    low = _logits(model)
    mgr.shift("high")
    assert np.array_equal(_logits(model), ref) and not np.array_equal(low, ref)
    assert PrecisionManager(make_tiny_llama(), GearboxConfig()).telemetry_only is False


def test_nested_store_refuses_a_4bit_model_and_foreign_bits():
    model = make_tiny_llama()
    nn.quantize(model, group_size=64, bits=4)
    assert PrecisionManager(model, GearboxConfig()).telemetry_only  # the separate store: telemetry only
    with pytest.raises(ValueError, match="below 8 bits"):
        PrecisionManager(model, GearboxConfig(store="nested"))
    with pytest.raises(ValueError, match="store='separate'"):
        PrecisionManager(make_tiny_llama(), GearboxConfig(store="nested", bits={"low": 3, "mid": 6}))
    with pytest.raises(ValueError, match="store='nested'"):
        GearboxConfig(store="separate", high="planes")


def test_the_default_store_is_nested_for_float_weights_only():
    from gearbx_mlx.resolver import resolve_store as decide

    def resolve_store(config, float_source):
        return decide(config, "float" if float_source else "quantized")[0]

    assert resolve_store(GearboxConfig(), float_source=True) == "nested"
    assert resolve_store(GearboxConfig(), float_source=False) == "separate"  # quantized: telemetry only
    assert resolve_store(GearboxConfig(bits={"low": 3, "mid": 6}), float_source=True) == "separate"
    assert resolve_store(GearboxConfig(high="planes"), float_source=True) == "nested"
    assert resolve_store(GearboxConfig(store="separate"), float_source=True) == "separate"
    assert PrecisionManager(make_tiny_llama(), GearboxConfig()).store == "nested"
    quantized = make_tiny_llama()
    nn.quantize(quantized, group_size=64, bits=8)
    mgr = PrecisionManager(quantized, GearboxConfig())
    assert mgr.store == "separate" and mgr.telemetry_only  # an 8-bit model is re-expressed only when asked


def test_nested_weights_reject_mismatched_planes():
    a = build_planes(_weights(8, 64, mx.float32))
    b = build_planes(_weights(8, 128, mx.float32))
    with pytest.raises(ValueError, match="share its shape"):
        NestedWeights([a[0], b[1]])


# -- the disk cache of the planes ----------------------------------------------------------------

import os  # noqa: E402
import warnings  # noqa: E402

from gearbx_mlx.nested.store import CACHE_FOLDER, PlanesCacheError, load_nested, plan_for, save_nested  # noqa: E402
from gearbx_mlx.sources.entries import write_file_record  # noqa: E402

TWO = DEFAULT_PLAN[:2]


def _model_dir(tmp_path, seed: int = 0):
    """A folder with a weights file, as a loaded model's folder would have."""
    d = tmp_path / f"model{seed}"
    d.mkdir()
    m = make_tiny_llama(seed=seed)
    m.save_weights(str(d / "model.safetensors"))
    return d, m


def _cfg(**kw):
    return GearboxConfig(scope="all", store="nested", **kw)


def test_planes_are_cached_beside_the_model_and_read_back(tmp_path):
    d, m = _model_dir(tmp_path)
    built = PrecisionManager(m, _cfg(), planes_dir=d)
    assert built.planes_origin == "built" and built.planes_file.parent == d / CACHE_FOLDER
    assert built.planes_file.is_file()
    m2 = make_tiny_llama()
    read = PrecisionManager(m2, _cfg(), planes_dir=d)
    assert read.planes_origin == "cache" and read.planes_file == built.planes_file
    for p in built.paths:
        for a, b in zip(built.nested[p].planes, read.nested[p].planes):
            assert mx.array_equal(a.weight, b.weight) and mx.array_equal(a.scales, b.scales)
            assert a.exponent == b.exponent
    # Another plan (high='planes' reads a third plane) is another cache entry.
    third = PrecisionManager(make_tiny_llama(), _cfg(high="planes"), planes_dir=d)
    assert third.planes_origin == "built" and third.planes_file != built.planes_file


def test_a_drafter_of_another_scope_shares_one_manager_and_the_planes_cache(tmp_path):
    """The low and mid drafters of scope all beside an attention-scope gearbox read one
    set of planes, cached beside the model: a second gearbox builds none."""
    from gearbx_mlx.gearbox import Gearbox
    from gearbx_mlx.speculative.draft import build_draft, scope_manager

    d, m = _model_dir(tmp_path)
    box = Gearbox(m, GearboxConfig(scope="attention", store="nested"), planes_dir=d)
    low, mid = build_draft(m, box, "low", "all"), build_draft(m, box, "mid", "all")
    mgr = scope_manager(box, "all")
    assert mgr is scope_manager(box, "all") and mgr is not box.manager and low.scope == mid.scope == "all"
    assert mgr.planes_origin == "built" and mgr.planes_file.parent == d / CACHE_FOLDER
    again = Gearbox(make_tiny_llama(), GearboxConfig(scope="attention", store="nested"), planes_dir=d)
    assert scope_manager(again, "all").planes_origin == "cache"


def test_a_damaged_or_foreign_planes_cache_is_rebuilt_never_trusted(tmp_path):
    d, m = _model_dir(tmp_path)
    first = PrecisionManager(m, _cfg(), planes_dir=d)
    path = first.planes_file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = PrecisionManager(make_tiny_llama(), _cfg(), planes_dir=d)
    assert again.planes_origin == "built" and any("bytes, the record says" in str(w.message) for w in caught)
    assert path.read_bytes() != data[: len(data) // 2]  # rewritten whole
    # New weights: a new key, so the old file is never read for them.
    os.remove(d / "model.safetensors")
    make_tiny_llama(seed=5).save_weights(str(d / "model.safetensors"))
    other = PrecisionManager(make_tiny_llama(seed=5), _cfg(), planes_dir=d)
    assert other.planes_origin == "built" and other.planes_file != path


def test_a_run_that_only_drafts_holds_the_draft_gears_planes_alone(tmp_path):
    d, m = _model_dir(tmp_path)
    cfg = GearboxConfig(scope="attention", store="nested")
    full = PrecisionManager(make_tiny_llama(), cfg, planes_dir=d, draft_scope="all")
    lean = PrecisionManager(m, cfg, planes_dir=d, draft_scope="all", draft_gear="low")
    assert lean.paths == full.paths and len(lean.paths) > len(PrecisionManager(make_tiny_llama(), cfg).paths)
    assert all(w.depth == 1 for w in lean.nested.values()) and all(w.depth == 2 for w in full.nested.values())
    assert lean.memory()["resident_total"] < full.memory()["resident_total"]
    assert lean.planes_file != full.planes_file  # another plan, another cache entry
    for p in lean.paths:  # the planes kept are the very planes of the full build
        assert mx.array_equal(lean.nested[p].planes[0].weight, full.nested[p].planes[0].weight)
    again = PrecisionManager(make_tiny_llama(), cfg, planes_dir=d, draft_scope="all", draft_gear="low")
    assert again.planes_origin == "cache" and again.planes_file == lean.planes_file
    # A mid drafter needs both planes; the planes high gear reads every plane: nothing is left out.
    for kw in ({"draft_gear": "mid"}, {"draft_gear": "low", "config": cfg.replace(high="planes")}):
        mgr = PrecisionManager(make_tiny_llama(), kw.pop("config", cfg), draft_scope="all", **kw)
        assert {w.depth for w in mgr.nested.values()} == {len(plan_for(mgr.config.high, False))}


def test_load_nested_checks_key_shapes_and_plan(tmp_path):
    d, m = _model_dir(tmp_path)
    mgr = PrecisionManager(m, _cfg(), planes_dir=d)
    shapes = {p: w.shape for p, w in mgr.nested.items()}
    key = mgr.planes_file.stem
    assert set(load_nested(mgr.planes_file, key, shapes, TWO)) == set(shapes)
    with pytest.raises(PlanesCacheError, match="other weights"):
        load_nested(mgr.planes_file, "0" * 24, shapes, TWO)
    with pytest.raises(PlanesCacheError, match="lacks"):
        load_nested(mgr.planes_file, key, shapes, DEFAULT_PLAN)
    wrong = {p: (s[0] + 1, s[1]) for p, s in shapes.items()}
    with pytest.raises(PlanesCacheError, match="shape"):
        load_nested(mgr.planes_file, key, wrong, TWO)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(PlanesCacheError, match="no integrity record"):
        load_nested(junk, key, shapes, TWO)
    write_file_record(junk)  # recorded, yet no planes file
    with pytest.raises(PlanesCacheError, match="cannot be read"):
        load_nested(junk, key, shapes, TWO)
    save_nested(tmp_path / "x.safetensors", mgr.nested, key)  # round trip through the writer
    assert set(load_nested(tmp_path / "x.safetensors", key, shapes, TWO)) == set(shapes)


def test_a_read_only_model_folder_caches_elsewhere(tmp_path, monkeypatch):
    d, m = _model_dir(tmp_path)
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path / "cache"))
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).startswith(str(d)) else real(p, mode))
    mgr = PrecisionManager(m, _cfg(), planes_dir=d)
    assert mgr.planes_file.is_relative_to(tmp_path / "cache" / "planes") and mgr.planes_file.is_file()
    assert not (d / CACHE_FOLDER).exists()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gears_nest_in_the_arithmetic_of_the_kernels(dtype):
    """Every kernel forms scales * q + biases in float32 from the stored values.
    Residuals taken from a dequantization rounded to the source dtype nest
    against other values (measured: the high gear's error 5.9e-4 instead of
    under 2e-4 for the default plan, 6e-3 instead of 4e-5 for planes 4/4/8)."""
    from nested_cases import codes, f64

    w = _weights(64, 256, dtype)
    planes = build_planes(w)
    exact = 0.0
    for n, p in enumerate(planes, start=1):
        s = np.repeat(f64(p.scales), p.group_size, axis=1)
        b = np.repeat(f64(p.biases), p.group_size, axis=1)
        exact = exact + 2.0 ** -p.exponent * (s * codes(p) + b)
        ref = f64(w)
        err = np.sqrt(np.mean((exact - ref) ** 2)) / np.sqrt(np.mean(ref**2))
        assert err < GEAR_REL_RMSE[n], (n, err)


def test_fused_views_use_the_kernels_and_agree_with_the_oracle():
    """A view built with fused=True goes through the matrix's NestedProduct (the C
    kernels on this CPU when built); fused=False always takes the oracle."""
    from gearbx_mlx.nested.layers import make_view

    w = NestedWeights.from_weight(_weights(96, 256, mx.float32, seed=4), mx.zeros((96,)))
    x = mx.random.normal((1, 256))
    for n, tol in ((1, 1e-2), (2, 1e-2), (3, 1e-3)):  # one row: low and mid take int8 activations
        fused, ref = make_view(w, n, False, True), make_view(w, n, False, False)
        a, b = np.array(fused(x)), np.array(ref(x))
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), n
    assert w.product is w.product  # one kernel state per matrix, shared by its views


def test_the_low_gear_is_mlx_4bit_quantized_linear_on_plane_0():
    """Plane 0 is MLX's 4-bit quantization: the low view that calls MLX's kernel reads
    plane 0's very arrays and computes nn.QuantizedLinear's output bit for bit; on the
    CPU a fused low view keeps the C kernels (the resolver's choice)."""
    from gearbx_mlx.nested.layers import make_view

    weight, bias = _weights(96, 256, mx.float32, seed=5), mx.random.normal((96,), key=mx.random.key(3))
    w = NestedWeights.from_weight(weight, bias)
    q = nn.QuantizedLinear.from_linear(nn.Linear(256, 96), group_size=64, bits=4)
    q.weight, q.scales, q.biases = mx.quantize(weight, group_size=64, bits=4)
    q.bias = bias
    x = mx.random.normal((2, 3, 256), key=mx.random.key(4))
    low = make_view(w, 1, False, fused=False)
    assert low.through_mlx and low._mlx_low[0] is w.weights[0] and low._mlx_low[1] is w.scales[0]
    assert mx.array_equal(low(x), q(x)).item()
    assert mx.array_equal(low(x), reference_matmul(x, w.planes, 1, bias)).item()  # the oracle's arithmetic
    assert not make_view(w, 2, False, fused=False).through_mlx  # mid and high keep their product
    assert make_view(w, 1, False, fused=True).through_mlx is (gpu.gpu_backend() is not None)
    table = NestedWeights.from_weight(weight)  # a tied embedding's output projection too
    qe = nn.QuantizedEmbedding(96, 256, group_size=64, bits=4)
    qe.weight, qe.scales, qe.biases = mx.quantize(weight, group_size=64, bits=4)
    emb = make_view(table, 1, True, fused=False)
    assert emb.through_mlx and mx.array_equal(emb.as_linear(x), qe.as_linear(x)).item()
    assert mx.array_equal(emb(mx.array([[3, 95]])), qe(mx.array([[3, 95]]))).item()


def test_a_static_high_gear_builds_no_planes_until_another_gear_is_asked_for():
    model = make_tiny_llama()
    mgr = PrecisionManager(model, GearboxConfig(static_gear="high", store="nested"))
    assert mgr.nested is None and set(mgr.cache) == {"high"}  # nothing built for gears it never enters
    mgr.shift("low")  # a policy that does enter one (say, a server request) builds every gear then
    assert mgr.nested is not None and set(mgr.cache) == {"high", "mid", "low"}
    mgr.shift("high")


def test_no_gear_reads_more_than_the_high_gear_on_an_mlx_8bit_model():
    """On an MLX 8-bit model the mid planes (4+4 bits and their scales) outweigh the loaded 8-bit
    layers: the mid gear then runs the high gear's modules, and the resolution says why."""
    model = make_tiny_llama(hidden=128)
    nn.quantize(model, group_size=64, bits=8)
    mgr = PrecisionManager(model, GearboxConfig(store="nested", scope="all"))
    step = mgr.step_bytes()
    assert step["mid"] <= step["high"] and step["low"] < step["high"]
    assert mgr.cache["mid"] is mgr.cache["high"] and "mid" in dict(mgr.resolution.why)
    assert mgr.managed_bytes_scope_all > 0  # what --scope all manages here is not 0%
