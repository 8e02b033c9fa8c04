"""The packed GEMV kernel body against the reference (dequantize, then matmul).

Three layers, from anywhere to the GPU:

* argument plumbing (`packed_gpu.launch_spec`): every machine;
* the shared kernel body run on the host through a CPU emulation of the GPU
  prelude (metal_kernels/check/host_emulation.h, one std::thread per GPU
  thread, address sanitizer on): wherever g++ is installed;
* the CUDA twin through `mx.fast.cuda_kernel` and `PackedLinear`: only where
  MLX has a CUDA GPU (skipped with a reason elsewhere).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional, Tuple

import host_emulation
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from gearbx_mlx.bindings import gpu, kernel_files, packed_gpu
from gearbx_mlx.packed import formats
from gearbx_mlx.packed.layers import PackedLinear, backend_for

#: One unit in the last place of each output dtype, relative to |y|: kernel and
#: reference each round their float32 result once, to neighbouring values at worst.
OUTPUT_RTOL = {mx.float32: 2.0**-21, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
#: float32 accumulation in another order, relative to sum_j |q_ij s x_j|.
ACCUM_TOL = 1e-4
#: Odd shapes (out, in): fewer words than lanes, a tail past the last full
#: step, rows not a multiple of the rows per threadgroup, and K above the
#: threadgroup-memory limit (the last two take every group size).
ODD_SHAPES: List[Tuple[int, int]] = [(67, 96), (33, 4104), (37, 1152), (9, 6272)]

HAS_CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="MLX has no CUDA GPU on this machine")


def make_case(
    out_features: int, in_features: int, bits: int, group_size: Optional[int],
    dtype: mx.Dtype, with_bias: bool, seed: int = 0,
):
    """Random weights with outliers, their packed form, an input and a bias."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 20.0  # a few outliers per row
    packed, scales = formats.quantize_packed(mx.array(w).astype(mx.bfloat16), bits, group_size)
    x = mx.array(rng.standard_normal(in_features).astype(np.float32)).astype(dtype)
    bias = mx.array(rng.standard_normal(out_features).astype(np.float32)).astype(dtype) if with_bias else None
    return packed, scales, x, bias


def assert_close_to_reference(y, packed, scales, x, bias, bits, group_size):
    """Check y against the oracle with the named tolerances."""
    in_features = x.shape[-1]
    ref = formats.reference_matmul(x, packed, scales, bits=bits, group_size=group_size,
                                 in_features=in_features, bias=bias)
    w = formats.dequantize(packed, scales, bits, group_size, in_features)
    magnitude = mx.abs(x.astype(mx.float32)) @ mx.abs(w).T
    y32, ref32 = np.array(y.astype(mx.float32)), np.array(ref.astype(mx.float32))
    bound = OUTPUT_RTOL[x.dtype] * np.abs(ref32) + ACCUM_TOL * np.array(magnitude) + 1e-6
    err = np.abs(y32 - ref32)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (
        f"row {worst}: kernel {y32[worst]} vs reference {ref32[worst]} (bound {bound[worst]})"
    )


# -- argument plumbing (any machine) --------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_launch_spec_names_every_parameter(bits):
    packed, scales, x, bias = make_case(67, 96, bits, 32, mx.bfloat16, True)
    spec = packed_gpu.launch_spec("cuda", x, packed, scales, bias, bits=bits, group_size=32)
    name = spec["name"]
    for part in (f"q{bits}", "g32", "shared", "bf16", "bias", "cuda"):
        assert part in name
    rows = packed_gpu.TUNING[bits].rows
    assert spec["grid"] == (-(-67 // (8 * rows)) * 256, 1, 1)
    assert spec["threadgroup"] == (256, 1, 1)
    assert spec["output_shapes"] == [(67,)] and spec["output_dtypes"] == [mx.bfloat16]
    assert [n for n, _ in spec["constants"]] == ["T", "BITS", "GS", "ROWS", "UNROLL", "VEC",
                                                 "SHARED"]
    text = gpu.constants_source("cuda", spec["constants"])
    assert "using T = __nv_bfloat16;" in text and f"constexpr int BITS = {bits};" in text
    # Above the threadgroup-memory limit the device-memory variant is chosen.
    packed, scales, x, _ = make_case(9, 6272, bits, None, mx.float16, False)
    spec = packed_gpu.launch_spec("metal", x, packed, scales, None, bits=bits, group_size=None,
                               mma=False)
    assert "device" in spec["name"] and "nobias" in spec["name"] and "row" in spec["name"]
    assert dict(spec["constants"])["SHARED"] is False
    assert "using T = half;" in gpu.constants_source("metal", spec["constants"])


def test_launch_spec_refuses_unsupported_layers():
    packed, scales, x, _ = make_case(8, 64, 6, None, mx.float32, False)
    with pytest.raises(ValueError, match="reference"):
        packed_gpu.launch_spec("cuda", x, packed, scales, None, bits=6, group_size=None)
    assert not packed_gpu.supports(4, None, 36, 64, mx.float32)  # K % 8
    assert not packed_gpu.supports(8, None, 64, 4, mx.float32)   # O < 8
    assert packed_gpu.supports(8, 64, 128, 8, mx.bfloat16)


def test_kernel_names_differ_by_source_text(tmp_path):
    """Names carry a hash of the text: an edited kernel never hits a stale cache."""
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_files.source_dir(), copy)
    a = packed_gpu.kernel_sources("cuda", False, copy)
    body = copy / "gemv_body.inc"
    body.write_text(body.read_text() + "\n// edit\n")
    kernel_files.read.cache_clear()
    b = packed_gpu.kernel_sources("cuda", False, copy)
    assert a != b


# -- the shared body on the host (wherever g++ is) ---------------------------------------

HOST_DTYPES = {mx.float32: "float", mx.float16: "gbx_half_t", mx.bfloat16: "gbx_bfloat_t"}
W_TYPES = {4: "uint8_t", 8: "int8_t"}

# (bits, group_size, rows, unroll, vec, shared, dtype, bias)
HOST_CONFIGS = [
    (4, None, 2, 4, 1, True, mx.bfloat16, True),
    (4, None, 2, 4, 4, False, mx.bfloat16, True),
    (4, 32, 2, 4, 4, True, mx.float16, False),
    (4, 128, 4, 2, 1, False, mx.float32, True),
    (4, 64, 1, 1, 4, False, mx.float16, False),
    (8, None, 2, 4, 4, True, mx.float32, False),
    (8, None, 1, 4, 1, False, mx.bfloat16, True),
    (8, 64, 2, 4, 1, True, mx.bfloat16, True),
    (8, 32, 4, 2, 4, False, mx.float16, False),
]

# Matrix-unit body: (dtype, group_size, unroll, bias, splits); emulated lane by
# lane as on Metal. Shapes need K % 64 == 0 (the dispatcher sends others to
# the SIMT body): one iteration only, rows not a multiple of 16, K at the
# threadgroup-memory limit.
MMA_HOST_CONFIGS = [
    (mx.bfloat16, None, 4, True, ()),
    (mx.float16, None, 1, False, (5,)),
    (mx.bfloat16, 64, 2, False, (3, 20)),
    (mx.float16, 128, 4, True, ()),
]
MMA_SHAPES: List[Tuple[int, int]] = [(37, 1152), (9, 6272), (67, 576), (16, 64),
                                     (41, packed_gpu.MMA_MAX_K)]


def _mma_host_kernels(first_case: int) -> Tuple[List[str], List[str]]:
    """Host-emulated matrix-unit kernels, numbered from ``first_case``."""
    parts, calls = [], []
    d = kernel_files.source_dir()
    for j, (dtype, gs, unroll, bias, splits) in enumerate(MMA_HOST_CONFIGS):
        i = first_case + j
        t = HOST_DTYPES[dtype]
        params = ["const uint8_t* w", "Shape w_shape", "const float* scales", f"const {t}* x"]
        params += [f"const {t}* bias"] if bias else []
        params += [f"{t}* {name}" for name in packed_gpu.output_names(len(splits) + 1)]
        _, body = packed_gpu.kernel_sources("cuda", bias, mma=True, n_out=len(splits) + 1)
        body = body.replace(gpu.backend_files("cuda", d)[1], "GBX_HOST_ENTRY\n")
        consts = "".join(f"  constexpr int OUT{k + 1} = {b};\n" for k, b in enumerate(splits))
        parts.append(
            f"void kernel_{i}({', '.join(params)}) {{\n"
            f"  using T = {t};\n  constexpr int GS = {gs or 0};\n"
            f"  constexpr int UNROLL = {unroll};\n{consts}{body}\n}}\n"
        )
        # The outputs are consecutive slices of one buffer: y1 starts at row OUT1.
        args = "(const uint8_t*)w.data(), ws, (const float*)s.data(), (const X_T*)x.data(), "
        args += "(const X_T*)b.data(), " if bias else ""
        args += ", ".join(["(X_T*)y.data()"] + [f"(X_T*)y.data() + {b}" for b in splits])
        args = args.replace("X_T", t)
        calls.append(
            f"    case {i}: gbx_emu_launch((O + 15) / 16, [&] {{ kernel_{i}({args}); }}); break;"
        )
    return parts, calls


def _host_unit() -> str:
    d = kernel_files.source_dir()
    parts = [
        (d / kernel_files.FORMAT_HEADER).read_text(),
        (d / "check" / "host_emulation.h").read_text(),
        (d / "gemv_common.h").read_text(),
        "using Shape = std::array<int, 10>;",
    ]
    calls = []
    for i, (bits, gs, rows, unroll, vec, shared, dtype, bias) in enumerate(HOST_CONFIGS):
        t = HOST_DTYPES[dtype]
        params = [f"const {W_TYPES[bits]}* w", "Shape w_shape", "const float* scales",
                  f"const {t}* x"]
        params += [f"const {t}* bias"] if bias else []
        params += [f"{t}* y"]
        _, body = packed_gpu.kernel_sources("cuda", bias)
        body = body.replace(gpu.backend_files("cuda", d)[1], "GBX_HOST_ENTRY\n")
        parts.append(
            f"void kernel_{i}({', '.join(params)}) {{\n"
            f"  using T = {t};\n  constexpr int BITS = {bits};\n"
            f"  constexpr int GS = {gs or 0};\n  constexpr int ROWS = {rows};\n"
            f"  constexpr int UNROLL = {unroll};\n  constexpr int VEC = {vec};\n"
            f"  constexpr bool SHARED = {str(shared).lower()};\n"
            f"{body}\n}}\n"
        )
        args = "(const W_T*)w.data(), ws, (const float*)s.data(), (const X_T*)x.data(), "
        args += "(const X_T*)b.data(), " if bias else ""
        args += "(X_T*)y.data()"
        args = args.replace("W_T", W_TYPES[bits]).replace("X_T", t)
        calls.append(
            f"    case {i}: gbx_emu_launch(n_groups_for({rows}), [&] {{ kernel_{i}({args}); }}); break;"
        )
    mma_parts, mma_calls = _mma_host_kernels(len(HOST_CONFIGS))
    parts += mma_parts
    calls += mma_calls
    parts.append(
        """
#include <cstdio>
#include <cstdlib>
static std::vector<char> slurp(const char* dir, const char* name) {
  return gbx_host_slurp(std::string(dir) + "/" + name);
}
int main(int argc, char** argv) {
  const int config = std::atoi(argv[1]), O = std::atoi(argv[2]), K = std::atoi(argv[3]);
  const char* dir = argv[4];
  const int y_bytes = std::atoi(argv[5]);
  std::vector<char> w = slurp(dir, "w.bin"), s = slurp(dir, "scales.bin");
  std::vector<char> x = slurp(dir, "x.bin"), b = slurp(dir, "bias.bin");
  std::vector<char> y(size_t(O) * y_bytes);
  Shape ws{};
  ws[0] = O; ws[1] = int(w.size()) / O;  // rows, bytes per row
  auto n_groups_for = [&](int rows) { return (O + 8 * rows - 1) / (8 * rows); };
  switch (config) {
"""
        + "\n".join(calls)
        + """
    default: return 2;
  }
  gbx_host_spill(std::string(dir) + "/y.bin", y);
  return 0;
}
"""
    )
    return "\n".join(parts)


#: The module's tests run in one pytest-xdist worker: host_binary compiles once (tens of
#: seconds), not once per worker that runs one of them.
pytestmark = pytest.mark.xdist_group("cuda-host-binary")


@pytest.fixture(scope="module")
def host_binary() -> Path:
    return host_emulation.build(_host_unit(), "gemv", "gemv")


@pytest.mark.parametrize("config", range(len(HOST_CONFIGS)))
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_host_emulated_body_matches_reference(host_binary, tmp_path, config, shape):
    bits, gs, rows, unroll, vec, shared, dtype, with_bias = HOST_CONFIGS[config]
    out_features, in_features = shape
    if gs is not None and in_features % gs:
        pytest.skip(f"K={in_features} is not a multiple of group {gs}")
    if shared and in_features > packed_gpu.SHARED_K:
        pytest.skip("the threadgroup-memory variant holds K <= SHARED_K only")
    if vec == 4 and (in_features * bits // 8) % 16:
        pytest.skip("16-byte loads need rows of whole 16-byte chunks (the dispatcher uses vec=1)")
    packed, scales, x, bias = make_case(out_features, in_features, bits, gs, dtype,
                                        with_bias, seed=config)
    for name, arr in (("w", packed), ("scales", scales), ("x", x), ("bias", bias)):
        data = b"" if arr is None else bytes(memoryview(arr))
        (tmp_path / f"{name}.bin").write_bytes(data)
    item = dtype.size
    # An AddressSanitizer binary must load its runtime first: drop any
    # LD_PRELOAD (CI preloads OpenBLAS for MLX's float32 products).
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run(
        [str(host_binary), str(config), str(out_features), str(in_features), str(tmp_path),
         str(item)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    raw = np.frombuffer((tmp_path / "y.bin").read_bytes(), dtype=np.uint16 if item == 2 else np.float32)
    if dtype == mx.float32:
        y = mx.array(raw)
    else:
        y = mx.array(raw.view(np.uint16)).view(dtype)
    assert_close_to_reference(y, packed, scales, x, bias, bits, gs)


def mma_case(config: int, shape: Tuple[int, int]):
    """The case of MMA_HOST_CONFIGS[config] at ``shape``, or a skip where it does not apply."""
    dtype, gs, _, with_bias, splits = MMA_HOST_CONFIGS[config]
    out_features, in_features = shape
    if gs is not None and in_features % gs:
        pytest.skip(f"K={in_features} is not a multiple of group {gs}")
    if splits and splits[-1] >= out_features:
        pytest.skip("the output boundaries lie past the rows")
    assert packed_gpu.supports_mma(4, gs, in_features, out_features, dtype)
    return make_case(out_features, in_features, 4, gs, dtype, with_bias, seed=config)


@pytest.mark.parametrize("config", range(len(MMA_HOST_CONFIGS)))
@pytest.mark.parametrize("shape", MMA_SHAPES)
def test_host_emulated_mma_body_matches_reference(host_binary, tmp_path, config, shape):
    dtype, gs, _, with_bias, splits = MMA_HOST_CONFIGS[config]
    out_features, in_features = shape
    packed, scales, x, bias = mma_case(config, shape)
    for name, arr in (("w", packed), ("scales", scales), ("x", x), ("bias", bias)):
        data = b"" if arr is None else bytes(memoryview(arr))
        (tmp_path / f"{name}.bin").write_bytes(data)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run(
        [str(host_binary), str(len(HOST_CONFIGS) + config), str(out_features), str(in_features),
         str(tmp_path), "2"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    raw = np.frombuffer((tmp_path / "y.bin").read_bytes(), dtype=np.uint16)
    y = mx.array(raw).view(dtype)
    assert_close_to_reference(y, packed, scales, x, bias, 4, gs)


def test_mma_variant_is_chosen_where_it_applies():
    assert packed_gpu.supports_mma(4, None, 4096, 4096, mx.bfloat16)
    assert packed_gpu.supports_mma(4, 128, 14336, 4096, mx.float16)
    assert not packed_gpu.supports_mma(4, None, 4096, 4096, mx.float32)   # 16-bit inputs only
    assert not packed_gpu.supports_mma(8, None, 4096, 4096, mx.bfloat16)  # int4 only
    assert not packed_gpu.supports_mma(4, 32, 4096, 4096, mx.bfloat16)    # groups of 64k
    assert not packed_gpu.supports_mma(4, None, 4104, 64, mx.bfloat16)    # K % 64
    assert not packed_gpu.supports_mma(4, None, packed_gpu.MMA_MAX_K + 64, 64, mx.bfloat16)
    packed, scales, x, _ = make_case(37, 1152, 4, None, mx.bfloat16, False)
    spec = packed_gpu.launch_spec("cuda", x, packed, scales, None, bits=4, group_size=None)
    assert spec["mma"] and "mma" in spec["name"]
    assert spec["grid"] == (-(-37 // 16) * 256, 1, 1)
    assert [n for n, _ in spec["constants"]] == ["T", "GS", "UNROLL"]
    split = packed_gpu.launch_spec("cuda", x, packed, scales, None, bits=4, group_size=None,
                                splits=(8, 30))
    assert split["output_shapes"] == [(8,), (22,), (7,)] and split["n_out"] == 3
    assert split["name"] != spec["name"]
    assert dict(split["constants"])["OUT2"] == 30
    for bad in ((0,), (30, 8), (37,), (1, 2, 3)):
        with pytest.raises(ValueError, match="splits"):
            packed_gpu.launch_spec("cuda", x, packed, scales, None, bits=4, group_size=None,
                                splits=bad)
    simt = packed_gpu.launch_spec("cuda", x, packed, scales, None, bits=4, group_size=None,
                               mma=False)
    assert not simt["mma"] and "mma" not in simt["name"]
    with pytest.raises(TypeError, match="rows"):  # options are Variant's fields, named
        packed_gpu.launch_spec("cuda", x, packed, scales, None, bits=4, group_size=None, rows=2)
    assert packed_gpu.launch_spec("cuda", x, packed, scales, None, bits=4, group_size=None,
                                  splits=[8, 30])["name"] == split["name"]  # a list of bounds reads as a tuple


# -- the CUDA twin (only with a CUDA GPU) -----------------------------------------------------


# Each (bits, group size) meets every dtype once and both bias settings, without
# compiling the full product of variants (NVRTC takes ~0.5 s a kernel).
CUDA_CONFIGS = [
    (bits, gs, dtype, with_bias)
    for bits in (4, 8)
    for i, gs in enumerate((None, 32, 64, 128))
    for dtype, with_bias in [((mx.float32, mx.float16, mx.bfloat16)[i % 3], i % 2 == 0),
                             ((mx.bfloat16, mx.float32, mx.float16)[i % 3], i % 2 == 1)]
]


@needs_cuda
@pytest.mark.parametrize("bits, group_size, dtype, with_bias", CUDA_CONFIGS)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_cuda_gemv_matches_reference(bits, group_size, dtype, with_bias, shape):
    out_features, in_features = shape
    if group_size is not None and in_features % group_size:
        pytest.skip(f"K={in_features} is not a multiple of group {group_size}")
    packed, scales, x, bias = make_case(out_features, in_features, bits, group_size,
                                        dtype, with_bias)
    y = packed_gpu.gemv(x, packed, scales, bias, bits=bits, group_size=group_size,
                     backend="cuda")
    assert y.shape == (out_features,) and y.dtype == dtype
    assert_close_to_reference(y, packed, scales, x, bias, bits, group_size)


@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tuning", [packed_gpu.Tuning(1, 1), packed_gpu.Tuning(4, 2), packed_gpu.Tuning(2, 8),
                                    packed_gpu.Tuning(2, 2, 4), packed_gpu.Tuning(4, 1, 4)])
def test_cuda_gemv_every_tuning(bits, tuning):
    for shape in ODD_SHAPES + [(300, 4096)]:
        packed, scales, x, bias = make_case(*shape, bits, None, mx.bfloat16, True)
        y = packed_gpu.gemv(x, packed, scales, bias, bits=bits, group_size=None,
                         backend="cuda", tuning=tuning)
        assert_close_to_reference(y, packed, scales, x, bias, bits, None)


@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_packed_linear_runs_the_cuda_twin(bits):
    lin = nn.Linear(4104, 33, bias=True)
    lin.set_dtype(mx.bfloat16)
    layer = PackedLinear.from_linear(lin, bits=bits)
    x = mx.random.normal((1, 1, 4104)).astype(mx.bfloat16)
    assert backend_for(x, bits, 4104, 33) == "cuda"
    y = layer(x)
    assert y.shape == (1, 1, 33)
    assert_close_to_reference(y.reshape(-1), layer.weight, layer.scales, x.reshape(-1),
                              layer.bias, bits, None)


@needs_cuda
@pytest.mark.parametrize("config", range(len(MMA_HOST_CONFIGS)))
@pytest.mark.parametrize("shape", MMA_SHAPES)
def test_cuda_mma_gemv_matches_reference(config, shape):
    dtype, gs, unroll, with_bias, splits = MMA_HOST_CONFIGS[config]
    out_features = shape[0]
    packed, scales, x, bias = mma_case(config, shape)
    y = packed_gpu.gemv(x, packed, scales, bias, bits=4, group_size=gs, backend="cuda", mma=True,
                     tuning=packed_gpu.Tuning(packed_gpu.MMA_ROWS, unroll), splits=splits)
    if splits:
        assert [t.shape[-1] for t in y] == [b - a for a, b in
                                            zip((0,) + splits, splits + (out_features,))]
        y = mx.concatenate(y, axis=-1)
    assert y.shape == (out_features,) and y.dtype == dtype
    assert_close_to_reference(y, packed, scales, x, bias, 4, gs)


@needs_cuda
def test_fused_members_match_separate_layers_on_cuda():
    from mlx.utils import tree_unflatten

    from gearbx_mlx.packed.fused import FusedPackedLinear, fuse_plan

    parent = nn.Module()
    sizes = {"q_proj": 256, "k_proj": 64, "v_proj": 64}
    for name, n in sizes.items():
        lin = nn.Linear(576, n, bias=False)
        lin.set_dtype(mx.bfloat16)
        setattr(parent, name, PackedLinear.from_linear(lin, bits=4))
    separate = {n: getattr(parent, n) for n in sizes}
    x = mx.random.normal((1, 1, 576)).astype(mx.bfloat16)
    want = {n: m(x) for n, m in separate.items()}
    parent.update_modules(tree_unflatten(fuse_plan(parent)))
    assert isinstance(parent.k_proj, FusedPackedLinear)
    got = {n: getattr(parent, n)(x) for n in sizes}
    for n in sizes:
        assert got[n].shape == want[n].shape
        # Same kernel body, same k order: the fused launch equals the separate ones.
        assert mx.array_equal(got[n], want[n]), n
