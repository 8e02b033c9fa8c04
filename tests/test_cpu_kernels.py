"""The C CPU kernels (gearbx_mlx.bindings.cpu) against numpy float64 references.

Chain: a numpy reference quantizer/packer of the shared format
(bound test, pack round trip), then every kernel path against a float64
product with named tolerances over odd shapes, and bit-exact agreement of all
paths where the data make every partial sum an exact integer.

Named tolerances:
  FLOAT_RTOL   float path: |y - y64| <= FLOAT_RTOL * sum_j |s q x| (fp32
               accumulation, any summation order, in_features <= 4096).
  intdot       |y - y64| <= sum_j |s q| * d_b(j) / 2 (each activation is off
               by at most half its block step) + FLOAT_RTOL * sum_j |s q x|.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np
import pytest
from cbuild import build_exe
from hypothesis import HealthCheck, given, settings, strategies as st

from gearbx_mlx.bindings import build, cpu

ROOT = Path(__file__).resolve().parent.parent
FLOAT_RTOL = 2e-5
QK = 32
QMAX = {4: 7, 8: 127}
FAST_PATHS = ("auto", "float", "intdot")
ALL_PATHS = FAST_PATHS + ("ref", "intdot_ref")
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# -- numpy reference of the packed format (gearbx_packed.h) --------------------------


def quantize_ref(w: np.ndarray, bits: int, group_size: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row / per-group quantization: q int8 (O, I), scales float32 (O, n_groups)."""
    o, i = w.shape
    g = 1 if group_size is None else i // group_size
    wg = w.astype(np.float32).reshape(o, g, i // g)
    s = np.maximum(np.abs(wg).max(axis=-1) / QMAX[bits], np.float32(1e-8)).astype(np.float32)
    q = np.clip(np.rint(wg / s[..., None]), -QMAX[bits], QMAX[bits]).astype(np.int8)
    return q.reshape(o, i), s


def pack_ref(q: np.ndarray, bits: int) -> np.ndarray:
    """int8: as is. int4: byte j//2 holds element j, low nibble for even j, as q + 8."""
    if bits == 8:
        return np.ascontiguousarray(q.astype(np.int8))
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    return np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4))


def unpack_ref(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed.astype(np.int8)
    lo = (packed & 0x0F).astype(np.int16) - 8
    hi = (packed >> 4).astype(np.int16) - 8
    return np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1).astype(np.int8)


def quantize_act_ref(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The int-dot activation quantizer: blocks of 32, d = max|x|/127 in float32,
    q = round-half-even(x * (1/d)) clamped to +-127 (exactly the C oracle)."""
    x = x.astype(np.float32)
    n = x.size
    nb = -(-n // QK)
    q = np.zeros(n, np.int8)
    d = np.zeros(nb, np.float32)
    for b in range(nb):
        xb = x[b * QK:(b + 1) * QK]
        amax = np.float32(np.abs(xb).max())
        db = np.float32(amax / np.float32(127.0))
        inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
        q[b * QK:(b + 1) * QK] = np.clip(np.rint(xb * inv), -127, 127).astype(np.int8)
        d[b] = db
    return q, d


def expand_scales(s: np.ndarray, in_features: int) -> np.ndarray:
    return np.repeat(s.astype(np.float64), in_features // s.shape[1], axis=1)


def product64(q: np.ndarray, s: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (q.astype(np.float64) * expand_scales(s, q.shape[1])) @ x.astype(np.float64)


def abs_terms(q: np.ndarray, s: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (np.abs(q.astype(np.float64)) * expand_scales(s, q.shape[1])) @ np.abs(x.astype(np.float64))


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ext():
    if not cpu.available():
        pytest.skip("C extension not built: `pip install -e .` or `python gearbx_mlx/bindings/build.py`")
    return cpu.require()


@pytest.fixture(params=[0, 1, 2], ids=["best-isa", "plain-avx2", "no-avx512vnni"])
def isa_limit(request, ext):
    """Run each test on the best kernels and (on x86 CPUs that have them) on
    the plain AVX2 and the AVX-VNNI ones; elsewhere the three runs coincide."""
    old = ext.lib.gbx_set_isa_limit(request.param)
    yield request.param
    ext.lib.gbx_set_isa_limit(old)


@pytest.fixture
def split_everything(ext):
    """Let the pool split even tiny products across threads."""
    old = ext.lib.gbx_set_min_work(1)
    yield
    ext.lib.gbx_set_min_work(old)


shapes = st.tuples(
    st.integers(1, 40),                      # out_features
    st.integers(1, 160).map(lambda k: 2 * k),  # in_features (even: int4 needs it)
    st.sampled_from([None, 32, 64, 128]),
    st.sampled_from([4, 8]),
).filter(lambda t: t[2] is None or t[1] % t[2] == 0)


def random_case(o: int, i: int, group: Optional[int], bits: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((o, i)).astype(np.float32)
    x = rng.standard_normal(i).astype(np.float32)
    x[rng.random(i) < 0.02] *= 30.0  # activation outliers
    q, s = quantize_ref(w, bits, group)
    return q, s, pack_ref(q, bits), x


def integer_case(o: int, i: int, group: Optional[int], bits: int, seed: int):
    """Every partial sum is an integer < 2^24 and d_b = 1: exact in float32."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-QMAX[bits], QMAX[bits] + 1, size=(o, i)).astype(np.int8)
    ng = 1 if group is None else i // group
    s = rng.choice(np.array([0.5, 1.0, 2.0], np.float32), size=(o, ng))
    x = rng.integers(-20, 21, size=i).astype(np.float32)
    x[::QK] = rng.choice([-127.0, 127.0], size=x[::QK].size)  # max|x_b| = 127 in every block
    return q, s, pack_ref(q, bits), x


# -- the reference format itself ------------------------------------------------------


@HYP
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_reference_quantizer_bound_and_round_trip(shape, seed) -> None:
    o, i, group, bits = shape
    w = np.random.default_rng(seed).standard_normal((o, i)).astype(np.float32)
    q, s = quantize_ref(w, bits, group)
    assert np.abs(q).max() <= QMAX[bits]
    err = np.abs(w - q * expand_scales(s, i))
    assert np.all(err <= expand_scales(s, i) / 2 * (1 + 1e-5))
    assert np.array_equal(unpack_ref(pack_ref(q, bits), bits), q)


def test_int4_nibble_order_is_low_first() -> None:
    q = np.array([[-7, 7, 0, 1]], np.int8)
    assert pack_ref(q, 4).tolist() == [[(7 + 8) << 4 | (-7 + 8), (1 + 8) << 4 | 8]]


def test_activation_quantizer_matches_c(ext) -> None:
    rng = np.random.default_rng(3)
    for n in (1, 31, 32, 33, 100, 4096 + 7):
        x = rng.standard_normal(n).astype(np.float32) * 3
        x[: min(n, 32)] = np.arange(min(n, 32), dtype=np.float32) - 15.5  # halves: ties
        x[0] = 127.0 if n > 1 else x[0]
        if n > 64:
            x[32:64] = 0.0  # an all-zero block
        q_np, d_np = quantize_act_ref(x)
        nb = d_np.size
        for fn in (ext.lib.gbx_quantize_act_ref, ext.lib.gbx_quantize_act):
            q = np.empty(n, np.int8)
            d = np.empty(nb, np.float32)
            sm = np.empty(nb, np.int32)
            fn(ext.ffi.from_buffer("float[]", x), n, ext.ffi.from_buffer("int8_t[]", q, require_writable=True),
               ext.ffi.from_buffer("float[]", d, require_writable=True),
               ext.ffi.from_buffer("int32_t[]", sm, require_writable=True))
            assert np.array_equal(q, q_np)
            assert np.array_equal(d, d_np)
            assert np.array_equal(sm, np.add.reduceat(q_np.astype(np.int32), np.arange(0, n, QK)))


# -- kernels vs float64 ---------------------------------------------------------------


@HYP
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_all_paths_exact_on_integer_data(ext, isa_limit, split_everything, shape, seed) -> None:
    o, i, group, bits = shape
    q, s, packed, x = integer_case(o, i, group, bits, seed)
    want = product64(q, s, x)
    assert np.abs(want).max() < 2**23
    for path in ALL_PATHS:
        for threads in (1, 2, 3):
            y = cpu.gemv(packed, s, x, bits=bits, group_size=group, in_features=i, path=path, threads=threads)
            assert np.array_equal(np.array(y), want.astype(np.float32)), (path, threads)


@HYP
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_float_paths_match_float64(ext, isa_limit, shape, seed) -> None:
    o, i, group, bits = shape
    q, s, packed, x = random_case(o, i, group, bits, seed)
    want, scale = product64(q, s, x), abs_terms(q, s, x)
    for path in ("float", "ref"):
        y = np.array(cpu.gemv(packed, s, x, bits=bits, group_size=group, in_features=i, path=path))
        assert np.all(np.abs(y - want) <= FLOAT_RTOL * scale + 1e-30), path


@HYP
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_intdot_paths_within_activation_bound(ext, isa_limit, shape, seed) -> None:
    o, i, group, bits = shape
    q, s, packed, x = random_case(o, i, group, bits, seed)
    want, scale = product64(q, s, x), abs_terms(q, s, x)
    _, d = quantize_act_ref(x)
    half_step = np.repeat(d.astype(np.float64), QK)[:i] / 2
    bound = (np.abs(q.astype(np.float64)) * expand_scales(s, i)) @ half_step + FLOAT_RTOL * scale + 1e-30
    y_ref = np.array(cpu.gemv(packed, s, x, bits=bits, group_size=group, in_features=i, path="intdot_ref"))
    assert np.all(np.abs(y_ref - want) <= bound)
    for path in ("intdot", "auto"):
        y = np.array(cpu.gemv(packed, s, x, bits=bits, group_size=group, in_features=i, path=path))
        assert np.all(np.abs(y - want) <= bound), path
        # the fast kernel differs from its oracle only in float summation order
        assert np.all(np.abs(y - y_ref) <= FLOAT_RTOL * scale + 1e-30), path


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("path", FAST_PATHS)
def test_result_does_not_depend_on_threads(ext, split_everything, bits, path) -> None:
    q, s, packed, x = random_case(257, 320, 64, bits, seed=bits)
    ys = [np.array(cpu.gemv(packed, s, x, bits=bits, group_size=64, in_features=320, path=path, threads=t))
          for t in (1, 2, 3, 8)]
    for y in ys[1:]:
        assert np.array_equal(y, ys[0])


def test_large_shape_against_oracles(ext) -> None:
    q, s, packed, x = random_case(1100, 4096, None, 4, seed=7)
    for path, oracle in (("float", "ref"), ("intdot", "intdot_ref")):
        y = np.array(cpu.gemv(packed, s, x, bits=4, group_size=None, in_features=4096, path=path, threads=2))
        y0 = np.array(cpu.gemv(packed, s, x, bits=4, group_size=None, in_features=4096, path=oracle))
        assert np.all(np.abs(y - y0) <= FLOAT_RTOL * abs_terms(q, s, x)), path


# -- the Python wrapper -------------------------------------------------------------


def test_mlx_inputs_transposed_and_low_precision(ext) -> None:
    q, s, packed, x = random_case(48, 256, 32, 4, seed=11)
    want = np.array(cpu.gemv(packed, s, x, bits=4, group_size=32, in_features=256, path="float"))
    # a transposed MLX array: must be read in logical order, not storage order
    p_t = mx.array(np.ascontiguousarray(packed.T)).T
    s_t = mx.array(np.ascontiguousarray(s.T)).T
    y = cpu.gemv(p_t, s_t, mx.array(x), bits=4, group_size=32, in_features=256, path="float")
    assert isinstance(y, mx.array) and y.dtype == mx.float32 and y.shape == (48,)
    assert np.array_equal(np.array(y), want)
    # (1, 1, I) bfloat16 activations (a decode step) are accepted and widened
    xb = mx.array(x).astype(mx.bfloat16)
    y = cpu.gemv(mx.array(packed), mx.array(s), xb.reshape(1, 1, 256), bits=4, group_size=32, in_features=256,
                 path="float")
    want_b = np.array(cpu.gemv(packed, s, np.array(xb.astype(mx.float32)), bits=4, group_size=32, in_features=256,
                               path="float"))
    assert np.array_equal(np.array(y), want_b)
    # a lazy strided slice as x
    x2 = mx.array(np.repeat(x, 2))[::2]
    assert np.array_equal(np.array(cpu.gemv(packed, s, x2, bits=4, group_size=32, in_features=256, path="float")),
                          want)


def test_prepared_weights_and_out(ext) -> None:
    q, s, packed, x = random_case(40, 128, None, 8, seed=5)
    pw = cpu.prepare(mx.array(packed), mx.array(s[:, 0]), bits=8, group_size=None, in_features=128)
    out = mx.zeros((40,), dtype=mx.float32)
    y = pw.gemv(mx.array(x), out=out)
    assert y is out
    assert np.array_equal(np.array(out), np.array(cpu.gemv(packed, s, x, bits=8, group_size=None, in_features=128)))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(bits=3), ValueError, "bits"),
        (dict(group_size=48), ValueError, "group_size"),
        (dict(group_size=128), ValueError, "multiple"),
        (dict(path="fast"), ValueError, "path"),
        (dict(threads=0), ValueError, "threads"),
        (dict(in_features=63), ValueError, "even"),
        (dict(packed_dtype=np.int8), TypeError, "uint8"),
        (dict(scales_shape=(16, 2)), ValueError, "scales"),
        (dict(x_size=65), ValueError, "features"),
        (dict(x_dtype=np.int32), TypeError, "floating"),
        (dict(packed=[[1, 2]]), TypeError, "array"),
    ],
)
def test_errors(ext, kwargs, exc, match) -> None:
    packed = np.full((16, 32), 0x88, np.uint8)
    args = dict(bits=4, group_size=None, in_features=64, path="auto", threads=None)
    args.update({k: v for k, v in kwargs.items() if k in args})
    if "packed_dtype" in kwargs:
        packed = packed.astype(kwargs["packed_dtype"])
    if "packed" in kwargs:
        packed = kwargs["packed"]
    scales = np.ones(kwargs.get("scales_shape", (16, 1)), np.float32)
    x = np.ones(kwargs.get("x_size", 64), kwargs.get("x_dtype", np.float32))
    with pytest.raises(exc, match=match):
        cpu.gemv(packed, scales, x, **args)


def test_info(ext) -> None:
    info = cpu.info()
    assert info["available"] and info["abi_version"] == cpu.ABI_VERSION and info["block"] == QK
    assert info["nested_float_isa"] in ("avx2", "neon", "scalar")
    assert info["nested_intdot_isa"] in ("avx512vnni", "avxvnni", "avx2", "neon-dotprod", "neon", "scalar")
    assert info["float_isa"] in ("avx2", "neon", "scalar")
    assert info["intdot_isa"] in ("avx512vnni", "avxvnni", "avx2", "neon-dotprod", "neon", "scalar")
    assert cpu.set_threads(3) == 3 and cpu.get_threads() == 3
    assert cpu.set_threads(None) == os.cpu_count() or os.cpu_count() > 64


@pytest.fixture
def fresh_loader(monkeypatch):
    """The library not loaded yet; loaded afresh after the test (teardown runs before monkeypatch's)."""
    cpu.reset()
    yield
    cpu.reset()


def test_missing_extension_warns_once_and_reports_unavailable(monkeypatch, fresh_loader) -> None:
    monkeypatch.setitem(sys.modules, "gearbx_mlx.bindings._gearbx_cpu", None)  # import raises ImportError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu.available() is False
        assert cpu.available() is False
        assert cpu.info()["available"] is False
    assert len([w for w in caught if "not built" in str(w.message)]) == 1
    with pytest.raises(RuntimeError, match="not built"):
        cpu.gemv(np.zeros((1, 1), np.uint8), np.ones((1, 1), np.float32), np.ones(2, np.float32), bits=4,
                 group_size=None, in_features=2)


def test_import_has_no_side_effects() -> None:
    code = ("import sys, gearbx_mlx, gearbx_mlx.bindings.cpu; "
            "assert 'gearbx_mlx.bindings._gearbx_cpu' not in sys.modules, 'extension loaded at import'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr


def test_packing_matches_gearbx_quant(ext) -> None:
    quant = pytest.importorskip("gearbx_mlx.packed.formats")
    rng = np.random.default_rng(9)
    w = rng.standard_normal((24, 128)).astype(np.float32)
    x = rng.standard_normal(128).astype(np.float32)
    for bits in (4, 8):
        for group in (None, 32, 128):
            q_m, s_m = quant.quantize(mx.array(w), bits, group)
            packed_m = quant.pack(q_m, bits)
            q_r, s_r = quantize_ref(w, bits, group)
            assert np.allclose(np.array(s_m), s_r, rtol=1e-6)
            # rounding ties may differ between the two quantizers; the packing may not
            assert np.array_equal(np.array(packed_m), pack_ref(np.array(q_m), bits))
            assert np.mean(np.array(q_m) == q_r) > 0.999
            y = np.array(cpu.gemv(packed_m, s_m, mx.array(x), bits=bits, group_size=group, in_features=128,
                                  path="float"))
            y_m = np.array(quant.reference_matmul(mx.array(x)[None], packed_m, s_m, bits=bits, group_size=group,
                                                  in_features=128))[0]
            assert np.allclose(y, y_m, rtol=1e-4, atol=1e-4 * np.abs(y_m).max())


# -- the C self-test driver, natively (the NEON builds: test_neon_qemu.py) -----------


def _native_cc() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _build_driver(tmp_path: Path, objects: Path, *defines: str) -> Path:
    cc = _native_cc()
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "gbx_driver"
    srcs = [ROOT / p for p in build.SOURCES + (build.TEST_DRIVER,)]
    r = build_exe(cc, ["-O3", "-std=gnu11", "-pthread", *defines, *build.include_flags()], srcs, exe, objects)
    assert r.returncode == 0, r.stderr
    return exe


def test_c_driver_native(tmp_path, c_objects) -> None:
    r = subprocess.run([str(_build_driver(tmp_path, c_objects)), "--quick"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("OK ")


def test_c_driver_native_catches_planted_nibble_bug(tmp_path, c_objects) -> None:
    exe = _build_driver(tmp_path, c_objects, "-DGEARBX_PLANT_NIBBLE_BUG")
    r = subprocess.run([str(exe), "--quick"], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "SUMMARY float bits=4" in r.stdout and "SUMMARY intdot bits=4" in r.stdout
    # the nested-plane kernels read MLX's nibbles in the same order: caught too
    assert "SUMMARY nested-float bits=4" in r.stdout and "SUMMARY nested-intdot bits=4" in r.stdout
    assert " bits=8 " not in r.stdout  # 8-bit kernels have no nibbles to swap


def test_c_driver_native_catches_planted_six_bit_order_bug(tmp_path, c_objects) -> None:
    """Reverse the order of the four codes of each 3-byte triplet in the fast
    6-bit kernels: every nested case with a 6-bit plane must fail, on both
    paths, and nothing else."""
    exe = _build_driver(tmp_path, c_objects, "-DGEARBX_PLANT_SIX_BUG")
    r = subprocess.run([str(exe), "--quick"], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "SUMMARY nested-float bits=6" in r.stdout and "SUMMARY nested-intdot bits=6" in r.stdout
    assert " bits=4 " not in r.stdout and " bits=8 " not in r.stdout


def test_c_driver_pool_stress(tmp_path, c_objects) -> None:
    """Back-to-back split products with changing chunk counts, in a build that
    stalls threads inside the pool's hand-off windows (-DGEARBX_STRESS_POOL).
    A late worker of a finished job once claimed a chunk of the next one and
    inflated its done count, so a call returned while a worker still ran one
    of its chunks: rows left unwritten, then a segfault on freed buffers."""
    exe = _build_driver(tmp_path, c_objects, "-DGEARBX_STRESS_POOL")
    r = subprocess.run([str(exe), "--pool-stress", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("OK ")
