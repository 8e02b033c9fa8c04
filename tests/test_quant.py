"""Packed formats and the pure-MLX reference (gearbx_mlx.packed.formats)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from gearbx_mlx.packed import formats

#: Slack on the s/2 bound: W/s and q*s are each rounded once in float32.
BOUND_RTOL = 1e-5
#: Reference product vs a float64 numpy product of the same dequantized weights.
MATMUL_RTOL = 1e-5

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = {"float32": (mx.float32, 1e30), "float16": (mx.float16, 6e4),
          "bfloat16": (mx.bfloat16, 1e30)}


@st.composite
def weights(draw):
    """A weight matrix with zero rows, tiny rows and huge outliers, and a format."""
    bits = draw(st.sampled_from(formats.SUPPORTED_BITS))
    group_size = draw(st.sampled_from([None, 32, 64, 128]))
    unit = group_size or 4
    in_features = unit * draw(st.integers(1, 3 if group_size else 40))
    out_features = draw(st.integers(1, 6))
    dtype_name = draw(st.sampled_from(sorted(DTYPES)))
    dtype, limit = DTYPES[dtype_name]
    base = draw(hnp.arrays(np.float32, (out_features, in_features),
                           elements=st.floats(-1e3, 1e3, width=32)))
    scale = np.float32(10.0 ** draw(st.integers(-6, 3)))
    w = base * scale
    zero_rows = draw(st.lists(st.booleans(), min_size=out_features, max_size=out_features))
    w[np.array(zero_rows)] = 0.0
    for _ in range(draw(st.integers(0, 3))):  # huge outliers
        i, j = draw(st.integers(0, out_features - 1)), draw(st.integers(0, in_features - 1))
        w[i, j] = draw(st.sampled_from([-1.0, 1.0])) * min(limit, 1e4 * max(float(scale), 1.0))
    return mx.array(np.clip(w, -limit, limit)).astype(dtype), bits, group_size


@SETTINGS
@given(weights())
def test_every_element_within_half_a_scale_step(case):
    w, bits, group_size = case
    q, scales = formats.quantize(w, bits, group_size)
    out_features, in_features = w.shape
    g = formats.n_groups(in_features, group_size)
    assert q.dtype == mx.int8 and scales.dtype == mx.float32
    assert scales.shape == (out_features, g)
    assert mx.all(mx.abs(q) <= formats.QMAX[bits]).item()
    assert mx.all(scales >= formats.scale_floor(w.dtype)).item()
    s = np.repeat(np.array(scales), in_features // g, axis=1)
    deq = np.array(formats.dequantize(formats.pack(q, bits), scales, bits, group_size, in_features))
    err = np.abs(np.array(w.astype(mx.float32)) - deq)
    assert np.all(err <= s / 2 * (1 + BOUND_RTOL)), float(np.max(err / s))


def test_scale_floors_follow_the_source_dtype():
    z = mx.zeros((2, 64))
    for dtype, floor in ((mx.float32, 1e-8), (mx.float16, 1e-4), (mx.bfloat16, 1e-4)):
        q, s = formats.quantize(z.astype(dtype), 4)
        assert np.allclose(np.array(s), floor) and not mx.any(q).item()


@pytest.mark.parametrize("bits", formats.SUPPORTED_BITS)
@SETTINGS
@given(data=st.data())
def test_pack_unpack_round_trip_is_exact(bits, data):
    qmax = formats.QMAX[bits]
    in_features = 4 * data.draw(st.integers(1, 50))
    out_features = data.draw(st.integers(1, 5))
    q = data.draw(hnp.arrays(np.int8, (out_features, in_features),
                             elements=st.integers(-qmax, qmax)))
    packed = formats.pack(mx.array(q), bits)
    assert packed.shape == formats.packed_shape(out_features, in_features, bits)
    assert packed.dtype == formats.packed_dtype(bits)
    assert np.array_equal(np.array(formats.unpack(packed, bits, in_features)), q)


def test_layouts_match_the_contract():
    q = mx.array([[-7, 7, 0, -1]], dtype=mx.int8)
    # int4: q+8, element j in byte j//2, low nibble for even j.
    assert np.array(formats.pack(q, 4)).tolist() == [[0x01 | (15 << 4), 8 | (7 << 4)]]
    # int2: q+2, four per byte, low bits first.
    t = mx.array([[-1, 0, 1, 1]], dtype=mx.int8)
    assert np.array(formats.pack(t, 2)).tolist() == [[1 | (2 << 2) | (3 << 4) | (3 << 6)]]
    # int6: q+32, four values in three bytes, low bits first.
    v = mx.array([[-31, 31, 0, 5]], dtype=mx.int8)
    word = 1 | (63 << 6) | (32 << 12) | (37 << 18)
    assert np.array(formats.pack(v, 6)).tolist() == [[word & 255, (word >> 8) & 255, word >> 16]]
    # int8: two's complement as is.
    assert np.array(formats.pack(q, 8)).tolist() == [[-7, 7, 0, -1]]


@pytest.mark.parametrize(
    "shape, bits, group_size, error",
    [
        ((4, 64), 3, None, "unsupported bit width"),
        ((4, 63), 4, None, "multiple of 2"),
        ((4, 66), 6, None, "multiple of 4"),
        ((4, 66), 2, None, "multiple of 4"),
        ((4, 96), 4, 64, "not a multiple of group_size"),
        ((4, 96), 4, 48, "group_size must be None"),
    ],
)
def test_bad_formats_raise_value_error(shape, bits, group_size, error):
    with pytest.raises(ValueError, match=error):
        formats.quantize(mx.zeros(shape), bits, group_size)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="2-D"):
        formats.quantize(mx.zeros((64,)), 4)
    with pytest.raises(TypeError, match="floating-point"):
        formats.quantize(mx.zeros((2, 64), dtype=mx.int32), 4)
    packed, scales = formats.quantize_packed(mx.ones((2, 64)), 4)
    with pytest.raises(ValueError, match="shape"):
        formats.unpack(packed, 4, 32)
    with pytest.raises(TypeError, match="uint8"):
        formats.unpack(packed.astype(mx.int8), 4, 64)
    with pytest.raises(ValueError, match="scales"):
        formats.dequantize(packed, scales, 4, 32, 64)
    with pytest.raises(ValueError, match="features"):
        formats.reference_matmul(mx.ones((1, 32)), packed, scales, bits=4, group_size=None,
                               in_features=64)


@pytest.mark.parametrize("bits", formats.SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_reference_matmul_is_dequantize_then_matmul(bits, group_size, dtype):
    rng = np.random.default_rng(bits)
    w = mx.array(rng.standard_normal((67, 96)).astype(np.float32))
    packed, scales = formats.quantize_packed(w, bits, group_size)
    x = mx.array(rng.standard_normal((3, 96)).astype(np.float32)).astype(dtype)
    bias = mx.array(rng.standard_normal(67).astype(np.float32))
    y = formats.reference_matmul(x, packed, scales, bits=bits, group_size=group_size,
                               in_features=96, bias=bias)
    assert y.shape == (3, 67) and y.dtype == dtype
    wd = np.array(formats.dequantize(packed, scales, bits, group_size, 96)).astype(np.float64)
    expect = np.array(x.astype(mx.float32)).astype(np.float64) @ wd.T + np.array(bias)
    rtol = {mx.float32: MATMUL_RTOL, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), expect, rtol=rtol, atol=1e-4)


def test_per_group_error_is_below_per_row_error():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 30.0
    w = mx.array(w).astype(mx.bfloat16)
    for bits in (4, 8):
        row = formats.reconstruction_error(w, bits, None)
        group = formats.reconstruction_error(w, bits, 64)
        assert group["relative_error"] < row["relative_error"]
        assert group["sqnr_db"] > row["sqnr_db"]


def test_fake_quantize_is_what_the_packed_layer_multiplies_by():
    w = mx.random.normal((8, 64)).astype(mx.bfloat16)
    packed, scales = formats.quantize_packed(w, 4, 32)
    fq = formats.fake_quantize_packed(w, 4, 32)
    assert fq.dtype == mx.bfloat16 and fq.shape == w.shape
    assert mx.array_equal(fq, formats.dequantize(packed, scales, 4, 32, 64, mx.bfloat16)).item()
