"""One dispatch for the nested gears (gearbx_mlx.nested.matmul): the C kernels
on the CPU for a few rows, the fused GPU kernel for one row on a GPU, the
oracle or one BLAS product of the dequantized gear elsewhere; every path gives the gear's product (float64 reference,
tests/nested_cases.py tolerances)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from nested_cases import ODD_SHAPES, PLANS, assert_close, make_planes, make_x, plan_cases, reference64

from gearbx_mlx import blas
from gearbx_mlx.bindings import cpu, gpu, guard, nested_cpu, nested_gpu
from gearbx_mlx.nested import matmul, planes as planes_module
from gearbx_mlx.nested.matmul import NestedKernelConfig, NestedProduct, nested_matmul
from gearbx_mlx.nested.planes import DEFAULT_PLAN, dense_matmul, quantize_plane, unpack_plane

needs_cpu_ext = pytest.mark.skipif(not cpu.available(), reason="C extension not built")
on_cpu_device = pytest.mark.skipif(gpu.gpu_backend() is not None, reason="the default device is a GPU")

#: The oracle's own error (one quantized_matmul per plane in the input dtype), relative to sum|terms|.
ORACLE_RTOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}


@needs_cpu_ext
@on_cpu_device
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("lead", [(), (1,), (1, 3), (2, 2)])
def test_cpu_device_takes_the_c_kernels_for_a_few_rows(dtype, lead):
    planes = make_planes(40, 192, (4, 4, 8), 64, dtype)
    prod = NestedProduct(planes)
    x = make_x(lead + (192,), dtype)
    bias = make_x((40,), dtype, seed=7)
    assert prod.backend_for(x, 3) == "cpu"
    one_row = x.size == 192
    for n in (2, 3):  # float32 activations: within float32 summation of the reference
        y = prod(x, n, bias)
        assert y.shape == lead + (40,) and y.dtype == dtype
        want, mag = reference64(x, planes, n, bias)
        # the mid gear's one row takes int8 activations (about max|x_b| / 254 per input)
        assert_close(y, want, mag, dtype, **({"rtol": 5e-3} if n == 2 and one_row else {}))


@needs_cpu_ext
@on_cpu_device
def test_the_low_gear_uses_int8_activations_and_stays_within_their_bound():
    planes = make_planes(40, 192, (4, 4, 8), 64, mx.float32)
    prod = NestedProduct(planes)
    assert [prod.cpu_path(n) for n in (1, 2, 3)] == ["intdot", "intdot", "float"]
    assert [prod.cpu_path(n, rows=4) for n in (1, 2, 3)] == ["intdot", "float", "float"]
    x = make_x((192,), mx.float32)
    y = prod(x, 1)
    assert mx.array_equal(y, prod.cpu_prepared().gemv(x, 1, path="intdot"))
    assert not mx.array_equal(y, prod.cpu_prepared().gemv(x, 1, path="float"))  # the int8 rounding shows
    want, mag = reference64(x, planes, 1)
    assert_close(y, want, mag, mx.float32, rtol=5e-3)  # int8 activations: about max|x_b| / 254 per input
    lone8 = NestedProduct(make_planes(40, 192, (8,), 64, mx.float32))
    assert lone8.cpu_path(1) == "float"  # a lone 8-bit plane is a high-precision layer


@needs_cpu_ext
@on_cpu_device
def test_the_mid_gear_takes_int8_activations_for_one_row_only():
    """A decode step of the mid gear computes as the separate store's 8-bit mid gear does (int8
    activations); a few rows (a verify, a short prefill chunk) keep float32 activations, as there."""
    planes = make_planes(40, 192, (4, 4, 8), 64, mx.float32)
    prod = NestedProduct(planes)
    x = make_x((192,), mx.float32)
    prepared = prod.cpu_prepared()
    assert mx.array_equal(prod(x, 2), prepared.gemv(x, 2, path="intdot"))
    assert not mx.array_equal(prod(x, 2), prepared.gemv(x, 2, path="float"))
    rows = make_x((3, 192), mx.float32)
    assert mx.array_equal(prod(rows, 2), prepared.gemv(rows, 2, path="float"))
    floats = NestedProduct(planes, NestedKernelConfig(intdot_one_row_plans=()))
    assert mx.array_equal(floats(x, 2), prepared.gemv(x, 2, path="float"))


@needs_cpu_ext
@on_cpu_device
def test_a_prefill_and_the_decode_after_it_check_the_planes_for_the_c_kernels_once(monkeypatch):
    """The dense product of a prefill chunk and the C GEMV of the steps after it read the same
    planes: one PreparedNested per matrix serves both (checking planes costs as much as a small
    product's unpacking, and the first decode step is inside mlx-lm's prompt time)."""
    built = []
    real = nested_cpu.PreparedNested.__init__
    monkeypatch.setattr(nested_cpu.PreparedNested, "__init__", lambda self, p: built.append(len(p)) or real(self, p))
    monkeypatch.setattr(blas, "optimized", lambda: True)
    planes = make_planes(24, 128, (4, 4, 8), 64, mx.float32)
    prod = NestedProduct(planes, NestedKernelConfig(cpu_max_rows=2))
    x = make_x((5, 128), mx.float32)
    for n in (1, 2, 3):
        assert prod.backend_for(x, n) == "dense" and prod.backend_for(x[:1], n) == "cpu"
        dense, one = prod(x, n), prod(x[:1], n)
        want, mag = reference64(x, planes, n)
        assert_close(dense, want, mag, mx.float32)
        assert_close(one, want[:1], mag[:1], mx.float32, **({"rtol": 5e-3} if n < 3 else {}))  # n<3: int8 x
    assert built == [3]


@needs_cpu_ext
@on_cpu_device
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_many_rows_take_the_kernels_on_a_reference_blas_and_one_blas_product_on_an_optimized_one(
        monkeypatch, dtype):
    planes = make_planes(24, 128, (4, 4, 8), 64, dtype)
    x = make_x((2, 3, 128), dtype)  # more rows than cpu_max_rows
    bias = make_x((24,), dtype, seed=7)
    monkeypatch.setattr(blas, "optimized", lambda: False)
    prod = NestedProduct(planes, NestedKernelConfig(cpu_max_rows=2))
    assert prod.backend_for(x, 3) == "cpu"
    monkeypatch.setattr(blas, "optimized", lambda: True)
    assert prod.backend_for(x[0, :2], 3) == "cpu"  # up to cpu_max_rows: the kernels still
    seen = []
    real = matmul.dense_matmul
    monkeypatch.setattr(matmul, "dense_matmul", lambda *a, **k: seen.append(a[2]) or real(*a, **k))
    for n in (1, 2, 3):
        assert prod.backend_for(x, n) == "dense"
        y = prod(x, n, bias)
        assert y.shape == (2, 3, 24) and y.dtype == dtype
        want, mag = reference64(x, planes, n, bias)
        assert_close(y, want, mag, dtype)  # float32 sums: within the kernels' own bound
    assert seen == [1, 2, 3]


@on_cpu_device
def test_dense_product_in_blocks_of_rows_is_the_whole_product(monkeypatch):
    planes = make_planes(40, 128, tuple(DEFAULT_PLAN), None, mx.float32)
    x = make_x((5, 128), mx.float32)
    whole = dense_matmul(x, planes, 3)
    monkeypatch.setattr(planes_module, "DENSE_BLOCK_ELEMENTS", 128 * 7)  # 7 output rows a block, a tail of 5
    # The same sums, blocked: equal up to the BLAS's own rounding (an optimized BLAS picks
    # its kernels by shape, so the last bit may differ between block sizes).
    np.testing.assert_allclose(np.asarray(dense_matmul(x, planes, 3)), np.asarray(whole), rtol=1e-6, atol=1e-6)
    want, mag = reference64(x, planes, 3)
    assert_close(whole, want, mag, mx.float32)
    with pytest.raises(ValueError, match="1 to 3 planes"):
        dense_matmul(x, planes, 4)


def test_dense_product_in_blocks_unpacks_one_block_at_a_time(monkeypatch):
    rows, cols, per_block = 4096, 256, 256  # 16 blocks of 256 KiB of float32 weights
    planes = make_planes(rows, cols, tuple(DEFAULT_PLAN[:2]), None, mx.float32)
    x = make_x((31, cols), mx.float32)
    monkeypatch.setattr(planes_module, "DENSE_BLOCK_ELEMENTS", per_block * cols)
    mx.eval(dense_matmul(x, planes, 2))  # warm: compiled kernels, buffers
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(dense_matmul(x, planes, 2))
    # A block's weights and its unpacking's temporaries (about ten blocks' bytes with two
    # planes), never the whole matrix's float32 weights at once (16 blocks; 41 blocks' bytes
    # when MLX was free to unpack every block before the first product).
    assert mx.get_peak_memory() - base < rows * cols * 4


@needs_cpu_ext
@on_cpu_device
@pytest.mark.parametrize("plan, shape, group_size", plan_cases(PLANS, ODD_SHAPES[:2] + [(40, 128)]))
def test_dense_product_unpacks_in_c_to_the_mlx_unpacking(monkeypatch, plan, shape, group_size):
    """The C unpacking gives the MLX one's weights bit for bit, so the same BLAS product, and
    that is the gear's product within float32 summation; a matrix of several blocks keeps
    MLX's lazy unpacking."""
    out_features, in_features = shape
    dtype = (mx.float32, mx.bfloat16)[len(plan) % 2]
    planes = make_planes(out_features, in_features, plan, group_size, dtype, seed=in_features)
    x = make_x((3, in_features), dtype)
    calls = []
    real = nested_cpu.PreparedNested.unpack
    monkeypatch.setattr(nested_cpu.PreparedNested, "unpack", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    for n in range(1, len(plan) + 1):
        y = dense_matmul(x, planes, n)
        want, mag = reference64(x, planes, n)
        assert_close(y, want, mag, dtype)
        with monkeypatch.context() as m:
            m.setattr(cpu, "available", lambda: False)  # no extension: the MLX unpacking
            assert mx.array_equal(dense_matmul(x, planes, n), y).item()
        with monkeypatch.context() as m:
            m.setattr(planes_module, "DENSE_BLOCK_ELEMENTS", in_features * 7)  # 7 rows a block, and a tail
            assert_close(dense_matmul(x, planes, n), want, mag, dtype)
    assert calls == list(range(1, len(plan) + 1))  # the blocked products did not reach the C unpacking


@needs_cpu_ext
@on_cpu_device
def test_dense_products_sharing_scratch_weights_and_prepared_planes_stay_right():
    """Products of one shape unpack into the same scratch matrix: each is evaluated before the
    next rewrites it. The planes' C tables are kept per first plane, and rebuilt when a plane's
    arrays change."""
    a = make_planes(40, 128, tuple(DEFAULT_PLAN), None, mx.float32, seed=1)
    b = make_planes(40, 128, tuple(DEFAULT_PLAN), None, mx.float32, seed=2)
    x = make_x((4, 128), mx.float32)
    ya, yb = dense_matmul(x, a, 2), dense_matmul(x, b, 2)
    for planes, y in ((a, ya), (b, yb)):
        want, mag = reference64(x, planes, 2)
        assert_close(y, want, mag, mx.float32)
    assert mx.array_equal(dense_matmul(x, a, 2), ya).item()  # the kept table
    a[1].weight, a[1].scales, a[1].biases = b[1].weight, b[1].scales, b[1].biases  # another residual
    want, mag = reference64(x, a, 2)
    assert_close(dense_matmul(x, a, 2), want, mag, mx.float32)


@on_cpu_device
@needs_cpu_ext  # the C kernels' unpacking and backends are what it checks
def test_dense_unpacking_on_the_caller_or_the_pool_gives_the_same_product(monkeypatch):
    """The dense path's unpacking threads (NestedKernelConfig.dense_unpack_threads) change who
    unpacks, never the product; a matrix of several blocks (no C unpacking) reserves nothing."""
    monkeypatch.setattr(blas, "optimized", lambda: True)
    planes = make_planes(72, 128, tuple(DEFAULT_PLAN), None, mx.float32, seed=3)
    x = make_x((12, 128), mx.float32)
    calls = []
    real = nested_cpu.PreparedNested.unpack
    monkeypatch.setattr(nested_cpu.PreparedNested, "unpack",
                        lambda self, *a, **k: calls.append(k.get("threads")) or real(self, *a, **k))
    products = {}
    for threads in (1, None, 3):
        product = NestedProduct(planes, NestedKernelConfig(dense_unpack_threads=threads))
        assert product.backend_for(x, 2) == "dense"
        assert product.reserve_dense()
        products[threads] = product(x, 2)
    assert calls == [1, None, 3]
    assert mx.array_equal(products[1], products[None]).item() and mx.array_equal(products[1], products[3]).item()
    want, mag = reference64(x, planes, 2)
    assert_close(products[1], want, mag, mx.float32)
    monkeypatch.setattr(blas, "optimized", lambda: False)  # the C kernels take every row: no scratch
    assert not NestedProduct(planes).reserve_dense()
    monkeypatch.setattr(blas, "optimized", lambda: True)
    monkeypatch.setattr(planes_module, "DENSE_BLOCK_ELEMENTS", 8 * 128)  # 72 rows: nine blocks
    assert not NestedProduct(planes).reserve_dense()


@on_cpu_device
def test_dense_product_of_planes_no_kernel_reads_takes_the_mlx_unpacking(monkeypatch):
    planes = make_planes(24, 128, DEFAULT_PLAN[:2] + ((5, 64),), None, mx.float16)
    x = make_x((3, 128), mx.float16)
    monkeypatch.setattr(nested_cpu, "prepare_nested", lambda *a: pytest.fail("5-bit planes reached the C kernels"))
    want, mag = reference64(x, planes, 3)
    assert_close(dense_matmul(x, planes, 3), want, mag, mx.float16)


@on_cpu_device
@needs_cpu_ext  # the C kernels' unpacking and backends are what it checks
def test_the_oracle_takes_what_the_kernels_do_not(monkeypatch):
    planes = make_planes(24, 128, (4, 4, 8), 64, mx.float16)
    x = make_x((3, 128), mx.float16)
    three_bits = make_planes(24, 128, (3,), 64, mx.float16)
    assert NestedProduct(three_bits).backend_for(x[0], 1) == "reference"
    # The package's default plan (a 6-bit third plane): every gear takes the C kernels.
    default = NestedProduct(make_planes(24, 128, tuple(DEFAULT_PLAN), None, mx.float16))
    assert [default.backend_for(x[0], n) for n in (1, 2, 3)] == ["cpu", "cpu", "cpu"]
    want, mag = reference64(x[0], default.planes, 3)
    assert_close(default(x[0], 3), want, mag, mx.float16)
    # A third plane no kernel reads (5 bits): the gears below it keep the
    # kernels, the top gear takes the oracle.
    five = NestedProduct(make_planes(24, 128, DEFAULT_PLAN[:2] + ((5, 64),), None, mx.float16))
    assert [five.backend_for(x[0], n) for n in (1, 2, 3)] == ["cpu", "cpu", "reference"]
    want, mag = reference64(x[0], five.planes, 3)
    assert_close(five(x[0], 3), want, mag, mx.float16, rtol=ORACLE_RTOL[mx.float16])
    monkeypatch.setattr(matmul, "cpu_backend", lambda: None)  # the extension is not built
    bare = NestedProduct(planes)
    assert bare.backend_for(x[0], 3) == "reference"
    want, mag = reference64(x[0], planes, 3)
    assert_close(bare(x[0], 3), want, mag, mx.float16, rtol=ORACLE_RTOL[mx.float16])
    # Several rows without the kernels: one BLAS product of the dequantized gear.
    for fast in (False, True):
        monkeypatch.setattr(blas, "optimized", lambda f=fast: f)
        assert bare.backend_for(x, 3) == "dense"
        want, mag = reference64(x, planes, 3)
        assert_close(bare(x, 3), want, mag, mx.float16)


def test_a_gpu_device_takes_the_fused_kernel_for_one_row(monkeypatch):
    """The GPU branch with a recording launcher: what it is handed, and when."""
    calls = []

    def fake_launcher(backend, bits, gs, k, o, dtype, sdtype, has_bias, tuning=None, shared=None):
        def kernel(inputs, grid, threadgroup, output_shapes, output_dtypes):
            # inputs: x, the planes' arrays, factors, [bias]
            calls.append((backend, bits, dtype, len(inputs) - 2 - has_bias, inputs[-1 - has_bias].tolist(), has_bias))
            return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]
        return nested_gpu.Launcher(kernel, (256, 1, 1), (256, 1, 1), dtype, o, has_bias)

    monkeypatch.setattr(gpu, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(nested_gpu, "launcher", fake_launcher)
    # The recording kernel returns zeros, which the first-use check would drop
    # for the oracle (tests/test_selftest.py tests that): trust it here.
    monkeypatch.setattr(guard, "guarded", lambda spec, build, settle: build())
    planes = make_planes(24, 128, (4, 4, 8), 64, mx.bfloat16)
    prod = NestedProduct(planes)
    x = make_x((1, 128), mx.bfloat16)
    assert prod.backend_for(x, 2) == "cuda"
    y = prod(x, 2, mx.ones((24,), dtype=mx.float32))
    assert y.shape == (1, 24) and y.dtype == mx.bfloat16
    f = [2.0 ** -p.exponent for p in planes[:2]]
    assert calls == [("cuda", (4, 4), mx.bfloat16, 6, f, True)]
    # Later calls take the bound path: no dispatch, and the output keeps x's leading dims.
    monkeypatch.setattr(prod, "backend_for", lambda *a: pytest.fail("the bound call re-dispatched"))
    assert prod(x[0], 2, mx.ones((24,), dtype=mx.float32)).shape == (24,)
    assert prod(x, 2, mx.ones((24,), dtype=mx.bfloat16)).shape == (1, 24) and len(calls) == 3
    # Another default device than the one bound: dispatch again.
    prod._fast_device = mx.Device(mx.gpu, 7)
    monkeypatch.undo()
    monkeypatch.setattr(gpu, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(nested_gpu, "launcher", fake_launcher)
    seen = []
    real = prod.backend_for
    monkeypatch.setattr(prod, "backend_for", lambda *a: seen.append(1) or real(*a))
    prod(x, 2, mx.ones((24,), dtype=mx.bfloat16))
    assert seen == [1] and len(calls) == 4 and prod._fast_device == mx.default_device()
    # several rows (prefill) and planes no kernel reads take the oracle
    assert prod.backend_for(make_x((2, 128), mx.bfloat16), 3) == "reference"
    assert NestedProduct(make_planes(24, 128, (3,), 64, mx.bfloat16)).backend_for(x, 1) == "reference"


def test_bad_arguments():
    planes = make_planes(16, 128, (4, 4), 64, mx.float32)
    with pytest.raises(ValueError, match="1 to 2 planes"):
        nested_matmul(make_x((128,), mx.float32), planes, 3)
    with pytest.raises(ValueError, match="expects 128"):
        nested_matmul(make_x((64,), mx.float32), planes, 1)
    with pytest.raises(ValueError, match="1 to 3 planes"):
        NestedProduct(planes * 2)


@needs_cpu_ext
@on_cpu_device
def test_nested_matmul_is_the_cached_product():
    planes = make_planes(16, 128, (4, 4, 8), 32, mx.float32)
    x = make_x((128,), mx.float32)
    assert np.array_equal(np.asarray(nested_matmul(x, planes, 3)), np.asarray(NestedProduct(planes)(x, 3)))


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_unpacked_planes_are_the_dequantized_planes(bits, dtype):
    """The dense product's unpacking (bytes, element-wise) gives exactly Plane.dequantize's values."""
    w = make_x((37, 256), mx.float32)
    for group, exponent in ((32, 0), (64, 5), (128, 0)):
        p = quantize_plane(w, bits, group, exponent, dtype)
        assert np.array_equal(np.asarray(unpack_plane(p)), np.asarray(p.dequantize())), (group, exponent)
