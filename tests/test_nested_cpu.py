"""The C kernels of the nested planes (gearbx_mlx.bindings.nested_cpu) against a
float64 reference of the gear's sum, over odd shapes, plans, scale dtypes,
paths and several activation rows; their errors; and the self-test driver's
scalar fallback. (The driver's planted nibble-order bug, which the nested
checks must catch too: tests/test_cpu_kernels.py and tests/test_neon_qemu.py.)

Named tolerances (tests/nested_cases.py): float paths within
OUTPUT_RTOL + ACCUM_RTOL * sum|terms|; int8 paths also within
intdot_bound: sum_j |f (s q_j + b)| * d_b(j) / 2, each activation being off
by at most half its block's step (codes and bias term see the same x).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cbuild import build_exe
from hypothesis import given, settings, strategies as st
from nested_cases import (
    ODD_SHAPES,
    PLANS,
    assert_close,
    f64,
    intdot_bound,
    make_planes,
    make_x,
    plan_cases,
    reference64,
)

from gearbx_mlx.bindings import build, cpu, nested_cpu
from gearbx_mlx.nested.planes import quantize_plane, unpack_plane

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not cpu.available(), reason="C extension not built: python gearbx_mlx/bindings/build.py")


def isa_limits() -> list:
    """The best kernels (VNNI products, AVX-512 unpacking, where the CPU has them) and, on x86, also
    the plain AVX2 ones (the same kernels again on an x86 CPU without either)."""
    return [0, 1] if cpu.available() and platform.machine().lower() in ("x86_64", "amd64") else [0]


CASES = plan_cases(PLANS, ODD_SHAPES)


@pytest.mark.parametrize("plan, shape, group_size", CASES)
def test_every_path_matches_the_reference(plan, shape, group_size):
    out_features, in_features = shape
    dtype = (mx.bfloat16, mx.float16, mx.float32)[(len(plan) + (group_size or 0) // 32) % 3]
    planes = make_planes(out_features, in_features, plan, group_size, dtype, seed=in_features)
    prep = nested_cpu.prepare_nested(planes)
    x = make_x((in_features,), mx.float32, seed=group_size or 7)
    for limit in isa_limits():
        with cpu.isa_limit(limit):
            for n in range(1, len(plan) + 1):
                want, mag = reference64(x, planes, n)
                for path in ("float", "auto", "ref"):
                    assert_close(prep.gemv(x, n, path=path), want, mag, mx.float32, what=f"{path} n={n}")
                bound = intdot_bound(x, planes, n)
                for path in ("intdot", "intdot_ref"):
                    assert_close(prep.gemv(x, n, path=path), want, mag, mx.float32, extra=bound,
                                 what=f"{path} n={n}")
                # the fast int8 path computes what its oracle computes, up to summation order
                ref = f64(prep.gemv(x, n, path="intdot_ref"))
                assert_close(prep.gemv(x, n, path="intdot"), ref, mag, mx.float32, what=f"intdot vs oracle n={n}")


@pytest.mark.parametrize("rows", [(2,), (1, 3), (5,)])
def test_several_activation_rows_and_threads(rows):
    planes = make_planes(300, 512, (4, 4, 8), 64, mx.bfloat16, seed=3)
    prep = nested_cpu.prepare_nested(planes)
    x = make_x(rows + (512,), mx.bfloat16, seed=4)
    lib = cpu.require().lib
    old = lib.gbx_set_min_work(1)  # let the pool split even this product
    try:
        for n in (1, 2, 3):
            want, mag = reference64(x, planes, n)
            ys = [prep.gemv(x, n, path="float", threads=t) for t in (1, 2, 3)]
            assert ys[0].shape == rows + (300,) and ys[0].dtype == mx.float32
            assert_close(ys[0], want, mag, mx.float32)
            for y in ys[1:]:  # each row is computed alike on any thread
                assert mx.array_equal(y, ys[0])
            # a row of a batch is the single-row product
            single = prep.gemv(x.reshape(-1, 512)[-1], n, path="intdot")
            batch = prep.gemv(x, n, path="intdot").reshape(-1, 300)[-1]
            assert mx.array_equal(single, batch)
    finally:
        lib.gbx_set_min_work(old)


def test_out_is_written_in_place():
    planes = make_planes(16, 128, (4, 4), 64, mx.float16)
    prep = nested_cpu.prepare_nested(planes)
    x = make_x((1, 128), mx.float16)
    out = mx.zeros((1, 16))
    mx.eval(out)
    assert prep.gemv(x, 2, out=out) is out
    assert mx.array_equal(out, prep.gemv(x, 2))
    with pytest.raises(ValueError, match="out must be"):
        prep.gemv(x, 2, out=mx.zeros((16,)))


def test_bad_arguments_name_what_is_wrong():
    planes = make_planes(16, 128, (4, 4, 8), 64, mx.bfloat16)
    prep = nested_cpu.prepare_nested(planes)
    x = make_x((128,), mx.float32)
    with pytest.raises(ValueError, match="1 to 3 planes"):
        prep.gemv(x, 4)
    with pytest.raises(ValueError, match="1 to 3 planes"):
        prep.gemv(x, 0)
    with pytest.raises(ValueError, match="path"):
        prep.gemv(x, 1, path="fast")
    with pytest.raises(ValueError, match=r"\(\.\.\., 128\)"):
        prep.gemv(make_x((64,), mx.float32), 1)
    with pytest.raises(TypeError, match="floating"):
        prep.gemv(mx.zeros((128,), dtype=mx.int32), 1)
    other = make_planes(16, 192, (4,), 64, mx.bfloat16)
    with pytest.raises(ValueError, match="codes must be"):
        nested_cpu.prepare_nested([planes[0], other[0]])  # another matrix's plane
    three_bits = make_planes(16, 128, (3,), 64, mx.bfloat16)
    with pytest.raises(ValueError, match="4, 6 or 8 bits"):
        nested_cpu.prepare_nested(three_bits)
    mixed = make_planes(16, 128, (4,), 64, mx.float16)[0]
    mixed.biases = mixed.biases.astype(mx.float32)
    with pytest.raises(TypeError, match="share"):
        nested_cpu.prepare_nested([mixed])


def test_prepared_views_are_zero_copy():
    planes = make_planes(16, 128, (4, 8), 64, mx.float32)
    prep = nested_cpu.prepare_nested(planes)
    ffi = cpu.require().ffi
    for k, p in enumerate(planes):
        mx.eval(p.weight)
        assert int(ffi.cast("uintptr_t", prep.table[k].codes)) == np.asarray(p.weight).ctypes.data


# -- the gear as one matrix (the dense product's unpacking) ---------------------------


def mlx_unpack(planes, n: int, rows=None) -> np.ndarray:
    """The oracle: unpack_plane of each plane, summed in plane order in MLX."""
    w = unpack_plane(planes[0])
    for p in planes[1:n]:
        w = w + unpack_plane(p)
    w = np.asarray(w)
    return w if rows is None else w[rows[0]:rows[1]]


@pytest.mark.parametrize("plan, shape, group_size", CASES)
def test_unpack_is_the_mlx_unpacking_bit_for_bit(plan, shape, group_size):
    out_features, in_features = shape
    dtype = (mx.float32, mx.bfloat16, mx.float16)[(len(plan) + (group_size or 0) // 32) % 3]
    planes = make_planes(out_features, in_features, plan, group_size, dtype, seed=out_features)
    prep = nested_cpu.prepare_nested(planes)
    lib = cpu.require().lib
    old = lib.gbx_set_min_work(1)  # let the pool split even these small matrices
    try:
        for limit in isa_limits():
            with cpu.isa_limit(limit):
                for n in range(1, len(plan) + 1):
                    want = mlx_unpack(planes, n)
                    for threads in (1, 2, 3):
                        got = prep.unpack(n, threads=threads)
                        assert got.shape == shape and got.dtype == mx.float32
                        assert np.array_equal(np.asarray(got), want), (limit, n, threads)
                    rows = (out_features // 3, out_features - 1)  # a block of rows
                    assert np.array_equal(np.asarray(prep.unpack(n, rows)), mlx_unpack(planes, n, rows))
    finally:
        lib.gbx_set_min_work(old)


@settings(max_examples=40, deadline=None)
@given(
    out_features=st.integers(1, 41),
    groups=st.integers(1, 5),
    specs=st.lists(st.tuples(st.sampled_from(nested_cpu.NESTED_BITS), st.sampled_from((32, 64, 128))),
                   min_size=1, max_size=3),
    exponents=st.lists(st.integers(0, 12), min_size=3, max_size=3),
    dtype=st.sampled_from((mx.float32, mx.float16, mx.bfloat16)),
    seed=st.integers(0, 2**16),
)
def test_unpack_of_any_planes_is_the_mlx_unpacking(out_features, groups, specs, exponents, dtype, seed):
    in_features = 128 * groups
    w = make_x((out_features, in_features), mx.float32, seed=seed) * 0.05
    planes = [quantize_plane(w, bits, gs, e, dtype) for (bits, gs), e in zip(specs, exponents)]
    prep = nested_cpu.prepare_nested(planes)
    n = len(planes)
    assert np.array_equal(np.asarray(prep.unpack(n)), mlx_unpack(planes, n))
    assert np.array_equal(np.asarray(nested_cpu.nested_unpack(planes, 1)), np.asarray(unpack_plane(planes[0])))


def test_unpack_bad_arguments_name_what_is_wrong():
    planes = make_planes(16, 128, (4, 4), 64, mx.float16)
    prep = nested_cpu.prepare_nested(planes)
    with pytest.raises(ValueError, match="1 to 2 planes"):
        prep.unpack(3)
    with pytest.raises(ValueError, match="rows must satisfy"):
        prep.unpack(1, (5, 17))
    with pytest.raises(ValueError, match="rows must satisfy"):
        prep.unpack(1, (6, 5))
    with pytest.raises(ValueError, match="threads"):
        prep.unpack(1, threads=0)
    assert prep.unpack(1, (4, 4)).shape == (0, 128)
    with pytest.raises(ValueError, match="out must be"):
        prep.unpack(1, out=mx.zeros((16, 64)))
    out = mx.zeros((16, 128))
    assert prep.unpack(2, out=out) is out and np.array_equal(np.asarray(out), mlx_unpack(planes, 2))
    ext = cpu.require()  # the C checks behind the wrapper's
    w = ext.ffi.new("float[]", 16 * 128)
    assert ext.lib.gbx_nested_unpack(prep.table, 1, w, 0, 17, 16, 128, 1) == ext.lib.GBX_E_SHAPE
    assert ext.lib.gbx_nested_unpack(prep.table, 3, w, 0, 16, 16, 128, 1) == ext.lib.GBX_E_PLANES
    assert ext.lib.gbx_nested_unpack(prep.table, 1, ext.ffi.NULL, 0, 16, 16, 128, 1) == ext.lib.GBX_E_NULL


# -- the self-test driver (natively; the NEON builds: test_neon_qemu.py) ---------------


def _driver(tmp_path: Path, objects: Path, *defines: str) -> Path:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "gbx_driver"
    srcs = [ROOT / p for p in build.SOURCES + (build.TEST_DRIVER,)]
    # -O3 as the other native driver builds: the sources no define changes are compiled once for all
    r = build_exe(cc, ["-O3", "-std=gnu11", "-pthread", *defines, *build.include_flags()], srcs, exe, objects)
    assert r.returncode == 0, r.stderr
    return exe


def test_driver_under_address_sanitizer(tmp_path, c_objects):
    """Every kernel's loads and stores inside their buffers (the unpacking's 16-byte loads of 6-bit
    codes among them): the driver's quick run built with AddressSanitizer and UBSan, where each
    plane's codes have only 4 bytes of slack past them."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "gbx_driver_asan"
    srcs = [ROOT / p for p in build.SOURCES + (build.TEST_DRIVER,)]
    flags = ["-O1", "-g", "-std=gnu11", "-pthread", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
             *build.include_flags()]
    r = build_exe(cc, flags, srcs, exe, c_objects)
    if r.returncode and ("asan" in r.stderr.lower() or "ubsan" in r.stderr.lower()):
        pytest.skip(f"the compiler has no sanitizer runtime: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the sanitizer's runtime must load first
    env["ASAN_OPTIONS"] = "detect_leaks=0"
    r = subprocess.run([str(exe), "--quick"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.splitlines()[-1].startswith("OK ")


def test_driver_checks_the_scalar_fallback(tmp_path, c_objects):
    """The kernels of a CPU without SIMD (every arch file's fallback), forced on this one."""
    r = subprocess.run([str(_driver(tmp_path, c_objects, "-DGEARBX_FORCE_SCALAR")), "--quick"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "nested_float=scalar nested_intdot=scalar" in r.stdout.splitlines()[0]
