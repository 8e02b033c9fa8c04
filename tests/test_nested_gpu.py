"""The nested-plane GEMV body (metal_kernels/nested_gemv_body.inc) against a
float64 reference of the gear's sum.

Three layers, from anywhere to the GPU:

* argument plumbing (`nested_gpu.launch_spec`, `nested_gemv`'s refusals): every machine;
* the shared body run on the host through the CPU emulation of the GPU
  prelude (metal_kernels/check/host_emulation.h, one std::thread per GPU
  thread, address sanitizer on), and a copy with a planted nibble-order bug
  that must fail: wherever g++ is installed;
* the CUDA twin through `mx.fast.cuda_kernel`: only where MLX has a CUDA GPU.

Tolerances (tests/nested_cases.py): OUTPUT_RTOL of the output dtype plus
ACCUM_RTOL of the sum of |terms| (float32 accumulation in another order).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path
from typing import Tuple

import host_emulation
import mlx.core as mx
import numpy as np
import pytest
from nested_cases import (
    KERNEL_PLAN,
    ODD_SHAPES,
    assert_close,
    intdot_bound,
    make_planes,
    make_x,
    plane_specs,
    reference64,
)

from gearbx_mlx.bindings import gpu, kernel_files, nested_gpu

HAS_CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="MLX has no CUDA GPU on this machine")


# -- argument plumbing (any machine) ----------------------------------------------------


def test_launch_spec_names_every_parameter():
    planes = make_planes(67, 320, ((4, 64), (4, 32), (8, 32)), None, mx.bfloat16)
    x = make_x((320,), mx.bfloat16)
    spec = nested_gpu.launch_spec("cuda", x, planes, 3, True)
    t = nested_gpu.default_tuning(3, 67)
    staged = "shared" if t.stage else "device"  # K = 320 could be staged
    for part in ("cuda", "q4g64_q4g32_q8g32", staged, "bf16", "sbf16", "bias") + (("biased",) if t.biased else ()):
        assert part in spec["name"], (part, spec["name"])
    staged_spec = nested_gpu.launch_spec("cuda", x, planes, 3, True, tuning=dataclasses.replace(t, stage=True))
    assert "_shared_" in staged_spec["name"] and dict(staged_spec["constants"])["SHARED"] is True
    b6_spec = nested_gpu.launch_spec("cuda", x, planes, 3, True, tuning=dataclasses.replace(t, biased6=True))
    assert "_b6_" in b6_spec["name"] and dict(b6_spec["constants"])["BIASED6"] is True
    assert dict(spec["constants"])["BIASED6"] is t.biased6 and ("_b6_" in spec["name"]) is t.biased6
    assert spec["grid"] == (-(-67 // (8 * t.rows)) * 256, 1, 1) and spec["threadgroup"] == (256, 1, 1)
    assert spec["input_names"] == ["x", "w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2", "b2", "factors", "bias"]
    assert spec["output_shapes"] == [(67,)] and spec["output_dtypes"] == [mx.bfloat16]
    consts = dict(spec["constants"])
    assert (consts["B0"], consts["B1"], consts["B2"]) == (4, 4, 8)
    assert (consts["GS0"], consts["GS1"], consts["GS2"]) == (64, 32, 32)
    text = gpu.constants_source("cuda", spec["constants"])
    assert "using T = __nv_bfloat16;" in text and "using S = __nv_bfloat16;" in text
    # A gear of fewer planes, fp16 input, K above the threadgroup-memory limit.
    big = make_planes(9, 6272, (4, 4), 64, mx.float16)
    spec2 = nested_gpu.launch_spec("metal", make_x((1, 6272), mx.float16), big, 1, False)
    assert "device" in spec2["name"] and "q4g64_r" in spec2["name"] and "nobias" in spec2["name"]
    assert spec2["input_names"] == ["x", "w0", "s0", "b0", "factors"] and spec2["output_shapes"] == [(1, 9)]
    assert spec2["name"] != nested_gpu.launch_spec("metal", make_x((1, 6272), mx.float16), big, 2, False)["name"]


def test_where_the_kernel_does_not_apply():
    planes = make_planes(16, 128, (4, 4, 8), 64, mx.bfloat16)
    x = make_x((128,), mx.bfloat16)
    assert nested_gpu.supports((4, 4, 8), (64, 32, 32), 128, 16, mx.bfloat16, mx.bfloat16)
    assert not nested_gpu.supports((4, 3), (64, 64), 128, 16, mx.bfloat16, mx.bfloat16)  # 3-bit plane
    assert nested_gpu.supports((4, 4, 6), (64, 32, 64), 128, 16, mx.bfloat16, mx.bfloat16)  # the default plan
    assert not nested_gpu.supports((4,), (64,), 128, 4, mx.bfloat16, mx.bfloat16)  # O < 8
    assert not nested_gpu.supports((4,), (48,), 144, 16, mx.bfloat16, mx.bfloat16)  # group size
    assert not nested_gpu.supports((4, 4), (64, 128), 192, 16, mx.bfloat16, mx.bfloat16)  # K % a group
    assert not nested_gpu.supports((4, 4, 8, 8), (64,) * 4, 128, 16, mx.bfloat16, mx.bfloat16)
    # nested_gemv says None where it does not apply: no GPU, several rows, odd planes
    assert nested_gpu.nested_gemv(x, planes, 3, backend=None) is None or gpu.gpu_backend() is not None
    assert nested_gpu.nested_gemv(make_x((2, 128), mx.bfloat16), planes, 3, backend="cuda") is None
    assert nested_gpu.nested_gemv(x, make_planes(16, 128, (3,), 64, mx.bfloat16), 1, backend="cuda") is None
    assert nested_gpu.nested_gemv(x, planes, 0, backend="cuda") is None
    with pytest.raises(ValueError, match="one input vector"):
        nested_gpu.launch_spec("cuda", make_x((2, 128), mx.bfloat16), planes, 3, False)
    with pytest.raises(ValueError, match="vec"):
        nested_gpu.launch_spec("cuda", x, planes, 3, False, tuning=nested_gpu.NestedTuning(2, 8))
    with pytest.raises(ValueError, match="ksplit"):
        nested_gpu.launch_spec("cuda", x, planes, 3, False, tuning=nested_gpu.NestedTuning(2, 2, 4))
    split = nested_gpu.launch_spec("cuda", x, planes, 3, False, tuning=nested_gpu.NestedTuning(2, 2, 8))
    assert split["grid"] == (8 * 256, 1, 1) and "_k8_" in split["name"]  # 16 rows, 2 per threadgroup
    with pytest.raises(ValueError, match="even vec"):
        six = make_planes(16, 128, (4, 6), 64, mx.bfloat16)
        nested_gpu.launch_spec("cuda", x, six, 2, False, tuning=nested_gpu.NestedTuning(2, 1))
    assert nested_gpu.launch_spec("cuda", x, six, 1, False, tuning=nested_gpu.NestedTuning(2, 1))  # 4 bits only
    with pytest.raises(ValueError, match="threadgroup-memory"):
        big = make_planes(9, 6272, (4,), 64, mx.bfloat16)
        nested_gpu.launch_spec("cuda", make_x((6272,), mx.bfloat16), big, 1, False, shared=True)
    with pytest.raises(TypeError, match="vec"):  # the launcher's options are tuning and shared, named
        nested_gpu.launcher("cuda", (4,), (64,), 128, 16, mx.bfloat16, mx.bfloat16, False, vec=2)


def test_small_matrices_get_fewer_rows_per_simd_group():
    big = nested_gpu.default_tuning(3, 14336)
    assert big == nested_gpu.TUNING[3]
    for n in (1, 2, 3):
        for out_features in (8, 67, 1024, 4096, 14336):
            t = nested_gpu.default_tuning(n, out_features)
            groups = -(-out_features // (8 * t.rows))
            assert t.vec == nested_gpu.TUNING[n].vec and 1 <= t.rows <= nested_gpu.TUNING[n].rows
            # as many rows as the threadgroup floor allows, never fewer
            assert t.rows == 1 or groups >= nested_gpu.MIN_THREADGROUPS
            assert t.rows == nested_gpu.TUNING[n].rows or -(-out_features // (16 * t.rows)) < nested_gpu.MIN_THREADGROUPS


def test_names_differ_by_source_text(tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_files.source_dir(), copy)
    a = nested_gpu.kernel_sources("cuda", 3, False, copy)
    body = copy / "nested_gemv_body.inc"
    body.write_text(body.read_text() + "\n// edit\n")
    kernel_files.read.cache_clear()
    assert nested_gpu.kernel_sources("cuda", 3, False, copy) != a


# -- the shared body on the host ---------------------------------------------------------

HOST_TYPES = {mx.float32: "float", mx.float16: "gbx_half_t", mx.bfloat16: "gbx_bfloat_t"}

# (plan, x dtype, scale dtype, group size, rows, vec, shared, bias[, ksplit[, xsums[, biased[, int8x[,
# biased6]]]]]); a plan of (bits, group) pairs has per-plane groups (group size None).
HOST_CONFIGS = [
    (KERNEL_PLAN, mx.bfloat16, mx.bfloat16, None, 2, 4, True, True),
    (((4, 128), (8, 32), (4, 64)), mx.float16, mx.float16, None, 4, 2, False, False),
    (KERNEL_PLAN, mx.float16, mx.float32, None, 1, 2, False, False),
    (((6, 32), (4, 128), (8, 64)), mx.float32, mx.bfloat16, None, 2, 4, False, True),
    ((6,), mx.bfloat16, mx.float16, 64, 4, 2, True, False),
    (KERNEL_PLAN, mx.bfloat16, mx.bfloat16, None, 2, 2, True, True, 8),
    ((4, 4), mx.float16, mx.float32, 64, 1, 4, False, False, 8),
    ((8, 6), mx.float32, mx.bfloat16, 32, 4, 2, False, True, 8),
    ((4, 4, 8), mx.bfloat16, mx.bfloat16, 64, 2, 4, True, True),
    ((4, 4, 8), mx.float16, mx.float16, 128, 1, 4, False, False),
    ((4, 4), mx.float32, mx.float32, 32, 4, 2, True, False),
    ((4,), mx.bfloat16, mx.bfloat16, 64, 4, 4, False, True),
    ((8,), mx.float16, mx.float32, 32, 2, 4, True, True),
    ((8, 4), mx.bfloat16, mx.bfloat16, 128, 2, 1, False, False),
    ((4, 4, 8), mx.float32, mx.bfloat16, 32, 1, 2, False, True),
    # x's sums staged beside it: every vec, one and eight SIMD groups a row block
    (KERNEL_PLAN, mx.bfloat16, mx.bfloat16, None, 2, 4, True, True, 1, True),
    ((4, 4), mx.float16, mx.float32, 32, 1, 2, True, False, 8, True),
    ((4, 8), mx.float32, mx.bfloat16, 64, 3, 1, True, True, 1, True),
    # 4-bit codes read biased: staged sums or not, with 6- and 8-bit planes beside them
    (KERNEL_PLAN, mx.bfloat16, mx.bfloat16, None, 2, 4, True, True, 1, True, True),
    (KERNEL_PLAN, mx.float32, mx.float32, None, 1, 2, False, False, 1, False, True),
    ((4, 4), mx.float16, mx.bfloat16, 32, 4, 4, True, False, 8, False, True),
    ((4, 8, 4), mx.bfloat16, mx.float16, 64, 1, 1, True, True, 1, True, True),
    # x rounded to int8 (4-bit planes only): one, two and three planes, one and eight SIMD groups a row
    # block, biased asked for and ignored
    (KERNEL_PLAN[:2], mx.bfloat16, mx.bfloat16, None, 2, 4, False, True, 1, False, False, True),
    ((4, 4), mx.float16, mx.float32, 64, 1, 4, False, False, 8, False, False, True),
    ((4,), mx.float32, mx.bfloat16, 32, 4, 4, False, True, 1, False, True, True),
    ((4, 4, 4), mx.bfloat16, mx.float16, 128, 3, 4, False, False, 1, False, False, True),
    # 6-bit codes read biased: beside biased 4-bit codes or alone, staged sums or not, first or last plane,
    # vec 2 (every chunk's codes start at bit 0 or 16 of a word) and 4, eight SIMD groups a row block
    (KERNEL_PLAN, mx.bfloat16, mx.bfloat16, None, 2, 4, False, False, 1, False, True, False, True),
    (KERNEL_PLAN, mx.float32, mx.float16, None, 1, 2, True, True, 1, True, True, False, True),
    (KERNEL_PLAN, mx.float16, mx.bfloat16, None, 3, 4, True, False, 1, True, False, False, True),
    ((6,), mx.bfloat16, mx.float32, 64, 4, 2, False, True, 8, False, False, False, True),
    ((6, 4, 6), mx.float32, mx.bfloat16, 32, 2, 4, False, False, 1, False, True, False, True),
]


def _host_kernel(i: int, config, directory: Path) -> Tuple[str, str]:
    plan, dtype, sdtype, gs, rows, vec, shared, bias = config[:8]
    ksplit = config[8] if len(config) > 8 else 1
    xsums = config[9] if len(config) > 9 else False
    biased = config[10] if len(config) > 10 else False
    int8x = config[11] if len(config) > 11 else False
    biased6 = config[12] if len(config) > 12 else False
    t, s = HOST_TYPES[dtype], HOST_TYPES[sdtype]
    params = [f"const {t}* x", "const uint32_t* w0", "Shape w0_shape", f"const {s}* s0", f"const {s}* b0"]
    for p in range(1, len(plan)):
        params += [f"const uint32_t* w{p}", f"const {s}* s{p}", f"const {s}* b{p}"]
    params += ["const float* factors"] + ([f"const {t}* bias"] if bias else []) + [f"{t}* y"]
    _, body = nested_gpu.kernel_sources("cuda", len(plan), bias, directory)
    body = body.replace(gpu.backend_files("cuda", directory)[1], "GBX_HOST_ENTRY\n")
    specs = plane_specs(plan, gs)
    consts = nested_gpu.constants(dtype, sdtype, tuple(b for b, _ in specs), tuple(g for _, g in specs),
                                  nested_gpu.NestedTuning(rows, vec, ksplit, xsums, biased, int8x=int8x, biased6=biased6),
                                  shared)
    decl = "".join(
        f"  using {k} = {HOST_TYPES[v]};\n" if isinstance(v, mx.Dtype)
        else f"  constexpr bool {k} = {str(v).lower()};\n" if isinstance(v, bool)
        else f"  constexpr int {k} = {v};\n" for k, v in consts)
    kernel = f"void kernel_{i}({', '.join(params)}) {{\n{decl}{body}\n}}\n"
    args = [f"(const {t}*)f[\"x\"].data()", "(const uint32_t*)f[\"w0\"].data()", "ws",
            f"(const {s}*)f[\"s0\"].data()", f"(const {s}*)f[\"b0\"].data()"]
    for p in range(1, len(plan)):
        args += [f"(const uint32_t*)f[\"w{p}\"].data()", f"(const {s}*)f[\"s{p}\"].data()",
                 f"(const {s}*)f[\"b{p}\"].data()"]
    args += ["(const float*)f[\"factors\"].data()"] + ([f"(const {t}*)f[\"bias\"].data()"] if bias else [])
    args += [f"({t}*)y.data()"]
    per_group = 8 // ksplit * rows  # rows per threadgroup
    groups = f"(O + {per_group - 1}) / {per_group}"
    call = f"    case {i}: gbx_emu_launch({groups}, [&] {{ kernel_{i}({', '.join(args)}); }}); break;"
    return kernel, call


def host_unit(directory: Path, configs) -> str:
    d = Path(directory)
    parts = [(d / kernel_files.FORMAT_HEADER).read_text(), (d / "check/host_emulation.h").read_text(),
             (d / "gemv_common.h").read_text(), (d / "nested_common.h").read_text(),
             "#include <map>\n#include <string>\n#include <cstdio>\n#include <cstdlib>\n"
             "using Shape = std::array<int, 10>;"]
    calls = []
    for i, config in enumerate(configs):
        kernel, call = _host_kernel(i, config, d)
        parts.append(kernel)
        calls.append(call)
    parts.append("""
static std::vector<char> slurp(const std::string& path) { return gbx_host_slurp(path); }
int main(int argc, char** argv) {
  const int config = std::atoi(argv[1]), O = std::atoi(argv[2]);
  const std::string dir = argv[3];
  const int y_bytes = std::atoi(argv[4]);
  std::map<std::string, std::vector<char>> f;
  for (const char* name : {"x", "w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2", "b2", "factors", "bias"})
    f[name] = slurp(dir + "/" + name + ".bin");
  std::vector<char> y(size_t(O) * y_bytes);
  Shape ws{};
  ws[0] = O; ws[1] = int(f["w0"].size() / 4) / O;  // rows, 32-bit words per row
  switch (config) {
""" + "\n".join(calls) + """
    default: return 2;
  }
  gbx_host_spill(dir + "/y.bin", y);
  return 0;
}
""")
    return "\n".join(parts)


def build_host(directory: Path, configs, tag: str) -> Path:
    return host_emulation.build(host_unit(directory, configs), f"nested_{tag}", "nested")


def run_host(binary: Path, tmp_path: Path, i: int, config, planes, x, bias) -> mx.array:
    plan, dtype = config[0], config[1]
    arrays = {"x": x, "factors": nested_gpu.factors_of(planes, len(plan)), "bias": bias}
    for p in range(len(plan)):
        arrays.update({f"w{p}": planes[p].weight, f"s{p}": planes[p].scales, f"b{p}": planes[p].biases})
    for name in ("x", "w0", "s0", "b0", "w1", "s1", "b1", "w2", "s2", "b2", "factors", "bias"):
        a = arrays.get(name)
        (tmp_path / f"{name}.bin").write_bytes(b"" if a is None else bytes(memoryview(a)))
    # An AddressSanitizer binary must load its runtime first: drop any LD_PRELOAD.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out_features = planes[0].weight.shape[0]
    proc = subprocess.run([str(binary), str(i), str(out_features), str(tmp_path), str(dtype.size)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    raw = np.frombuffer((tmp_path / "y.bin").read_bytes(), dtype=np.float32 if dtype == mx.float32 else np.uint16)
    return mx.array(raw) if dtype == mx.float32 else mx.array(raw).view(dtype)


#: The module's tests run in one pytest-xdist worker: host_binary compiles once (tens of
#: seconds), not once per worker that runs one of them.
pytestmark = pytest.mark.xdist_group("nested-gpu-host-binary")


@pytest.fixture(scope="module")
def host_binary() -> Path:
    return build_host(kernel_files.source_dir(), HOST_CONFIGS, "ok")


def host_case(config, shape, seed=0):
    plan, dtype, sdtype, gs, rows, vec, shared, with_bias = config[:8]
    out_features, in_features = shape
    if shared and in_features > kernel_files.format_constant("GBX_SHARED_K"):
        pytest.skip("the threadgroup-memory variant holds K <= GBX_SHARED_K only")
    planes = make_planes(out_features, in_features, plan, gs, sdtype, seed=seed)
    x = make_x((in_features,), dtype, seed=seed + 1)
    bias = make_x((out_features,), dtype, seed=seed + 2) if with_bias else None
    return planes, x, bias


#: Each config at each odd shape it takes (K a multiple of its group; staging only up to GBX_SHARED_K).
HOST_CASES = [(i, shape) for i, cfg in enumerate(HOST_CONFIGS) for shape in ODD_SHAPES
              if all(shape[1] % g == 0 for _, g in plane_specs(cfg[0], cfg[3]))
              and not (cfg[6] and shape[1] > kernel_files.format_constant("GBX_SHARED_K"))]


@pytest.mark.parametrize("config, shape", HOST_CASES)
def test_host_emulated_body_matches_the_reference(host_binary, tmp_path, config, shape):
    cfg = HOST_CONFIGS[config]
    planes, x, bias = host_case(cfg, shape, seed=config)
    y = run_host(host_binary, tmp_path, config, cfg, planes, x, bias)
    want, mag = reference64(x, planes, len(cfg[0]), bias)
    assert_close(y, want, mag, cfg[1], extra=int8x_bound(cfg, x, planes))


def int8x_bound(cfg, x, planes):
    """What rounding x to int8 may add to a config's outputs (None for float activations)."""
    return intdot_bound(x, planes, len(cfg[0])) if len(cfg) > 11 and cfg[11] else None


def planted_copy(tmp_path: Path, old: str, new: str, changed: str) -> Path:
    """A copy of the kernel sources with ``old`` replaced by ``new`` in nested_common.h."""
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_files.source_dir(), copy)
    helper = copy / "nested_common.h"
    text = helper.read_text()
    assert old in text, f"update the planted bug: {changed} changed"
    helper.write_text(text.replace(old, new))
    return copy


def test_a_planted_int8_pairing_bug_in_the_body_fails(tmp_path):
    """Pair the even codes of every word with the odd inputs in a copy of the
    sources: the int8 gear must then disagree with the reference, beyond the
    int8 rounding's bound."""
    copy = planted_copy(tmp_path, "acc = GBX_DP4A(w & 0x0F0F0F0Fu, xe, acc);",
                        "acc = GBX_DP4A(w & 0x0F0F0F0Fu, xo, acc);", "gbx_idot8_4")
    cfg = next(c for c in HOST_CONFIGS if len(c) > 11 and c[11])
    binary = build_host(copy, [cfg], "bug_i8")
    planes, x, bias = host_case(cfg, (17, 320), seed=7)
    y = run_host(binary, tmp_path, 0, cfg, planes, x, bias)
    want, mag = reference64(x, planes, len(cfg[0]), bias)
    with pytest.raises(AssertionError, match="reference"):
        assert_close(y, want, mag, cfg[1], extra=int8x_bound(cfg, x, planes))


def test_a_planted_nibble_order_bug_in_the_body_fails(tmp_path):
    """Swap the nibbles of every 4-bit word in a copy of the sources: the
    emulated body must then disagree with the reference."""
    copy = planted_copy(tmp_path, "const gbx_f8 q = gbx_unpack4<0>(w.v[j % NW]);",
                        "const gbx_u32 u = w.v[j % NW];\n"
                        "    const gbx_f8 q = gbx_unpack4<0>(((u & 0x0F0F0F0Fu) << 4) | ((u >> 4) & 0x0F0F0F0Fu));",
                        "gbx_dot8")
    cfg = HOST_CONFIGS[0]
    binary = build_host(copy, [cfg], "bug")
    planes, x, bias = host_case(cfg, (17, 320), seed=5)
    y = run_host(binary, tmp_path, 0, cfg, planes, x, bias)
    want, mag = reference64(x, planes, len(cfg[0]), bias)
    with pytest.raises(AssertionError, match="reference"):
        assert_close(y, want, mag, cfg[1])


def test_a_planted_six_bit_order_bug_in_the_body_fails(tmp_path):
    """Read the first two codes of every 6-bit field group in swapped order in
    a copy of the sources: the emulated body must then disagree with the
    reference, and the 4-bit-only gear of the same planes must not."""
    copy = planted_copy(tmp_path, "  q.v[0] = gbx_field<0, 6, 0>(lo);\n  q.v[1] = gbx_field<6, 6, 0>(lo);",
                        "  q.v[0] = gbx_field<6, 6, 0>(lo);\n  q.v[1] = gbx_field<0, 6, 0>(lo);", "gbx_unpack6")
    cfg = HOST_CONFIGS[0]
    low = (cfg[0][:2],) + cfg[1:]
    binary = build_host(copy, [cfg, low], "bug6")
    planes, x, bias = host_case(cfg, (17, 320), seed=6)
    y = run_host(binary, tmp_path, 0, cfg, planes, x, bias)
    want, mag = reference64(x, planes, len(cfg[0]), bias)
    with pytest.raises(AssertionError, match="reference"):
        assert_close(y, want, mag, cfg[1])
    y2 = run_host(binary, tmp_path, 1, low, planes, x, bias)
    want2, mag2 = reference64(x, planes, 2, bias)
    assert_close(y2, want2, mag2, cfg[1])


def test_a_planted_biased_six_bit_pairing_bug_in_the_body_fails(tmp_path):
    """Bring the wrong pair of 6-bit codes into place for the odd chunks' last
    pair in a copy of the sources: the gear read with biased 6-bit codes must
    then disagree with the reference, and the same planes read unbiased must not."""
    copy = planted_copy(tmp_path, "    p[3] = hi >> 9;", "    p[3] = hi << 3;", "gbx_dot8_biased6")
    cfg = next(c for c in HOST_CONFIGS if len(c) > 12 and c[12])
    plain = cfg[:12]
    binary = build_host(copy, [cfg, plain], "bug_b6")
    planes, x, bias = host_case(cfg, (17, 320), seed=8)
    want, mag = reference64(x, planes, len(cfg[0]), bias)
    y = run_host(binary, tmp_path, 0, cfg, planes, x, bias)
    with pytest.raises(AssertionError, match="reference"):
        assert_close(y, want, mag, cfg[1])
    assert_close(run_host(binary, tmp_path, 1, plain, planes, x, bias), want, mag, cfg[1])


# -- the CUDA twin (only with a CUDA GPU) -------------------------------------------------

CUDA_CONFIGS = [(plan, dtype, gs) for plan in ((4, 4, 8), (4, 4, 6), (4, 4), (4,), (6,), (8,))
                for dtype, gs in ((mx.bfloat16, 64), (mx.float16, 32), (mx.float32, 128))]
CUDA_CONFIGS += [(KERNEL_PLAN, mx.bfloat16, None), (((4, 128), (8, 32), (4, 64)), mx.float16, None)]
CUDA_CASES = [(plan, dtype, gs, shape) for plan, dtype, gs in CUDA_CONFIGS for shape in ODD_SHAPES + [(4096, 4096)]
              if all(shape[1] % g == 0 for _, g in plane_specs(plan, gs))]


def _case_id(plan, dtype, group_size, shape) -> str:
    """e.g. q4q4q6-bfloat16-g64-4096x4096, so a device run can pick cases with -k."""
    bits = "".join(f"q{b}" for b, _ in plane_specs(plan, group_size))
    return f"{bits}-{str(dtype).split('.')[-1]}-g{group_size}-{shape[0]}x{shape[1]}"


@needs_cuda
@pytest.mark.parametrize("plan, dtype, group_size, shape", CUDA_CASES, ids=[_case_id(*c) for c in CUDA_CASES])
def test_cuda_nested_gemv_matches_the_reference(plan, dtype, group_size, shape):
    out_features, in_features = shape
    planes = make_planes(out_features, in_features, plan, group_size, dtype, seed=len(plan))
    x = make_x((1, in_features), dtype)
    bias = make_x((out_features,), dtype, seed=3)
    for n in range(1, len(plan) + 1):
        for b in (None, bias):
            y = nested_gpu.nested_gemv(x, planes, n, b, backend="cuda")
            assert y is not None and y.shape == (1, out_features) and y.dtype == dtype
            want, mag = reference64(x, planes, n, b)
            assert_close(y, want, mag, dtype, what=f"cuda n={n}")


def test_compiled_launch_is_the_bound_launch():
    """nested_gpu.compiled keeps run(x, shape, bias)'s signature and results, retraced
    per input shape (here around an element-wise stand-in for the kernel)."""
    calls = []

    def run(x, shape, bias):
        calls.append(shape)
        y = x * 2.0 + 1.0
        return y if bias is None else y + bias.astype(x.dtype)

    for has_bias in (False, True):
        fast = nested_gpu.compiled(run, has_bias)
        for shape in ((1, 1, 8), (1, 8), (1, 1, 8)):
            x = mx.random.normal(shape)
            bias = mx.arange(8, dtype=mx.float16) if has_bias else None
            assert mx.array_equal(fast(x, x.shape, bias), run(x, x.shape, bias)).item()
    assert calls.count((1, 1, 8)) == 2 * (1 + 2)  # per bias: one trace of the shape, two direct calls


@needs_cuda
@pytest.mark.parametrize("plan", [KERNEL_PLAN, (4, 4, 8)])
def test_cuda_bound_launches_match_the_reference(plan):
    """The decode path: NestedProduct binds each gear's launcher on the first
    call and launches it directly after; every call must still be the gear (a
    gear the default config rounds to int8, under the int8 bound)."""
    from gearbx_mlx.nested.matmul import DEFAULT_CONFIG, NestedProduct

    for shape in ((1024, 4096), (67, 320)):
        planes = make_planes(*shape, plan, 64 if isinstance(plan[0], int) else None, mx.bfloat16, seed=11)
        prod = NestedProduct(planes)
        bias = make_x((shape[0],), mx.bfloat16, seed=4)
        for n in (1, 2, 3):
            for k in range(3):
                x = make_x((1, 1, shape[1]), mx.bfloat16, seed=20 + k)
                b = bias if k % 2 else None
                y = prod(x, n, b)
                want, mag = reference64(x, planes, n, b)
                bits = tuple(p.bits for p in planes[:n])
                i8 = bits in DEFAULT_CONFIG.gpu_int8x_plans and nested_gpu.int8x_applies("cuda", bits, shape[1], 4)
                assert_close(y, want, mag, mx.bfloat16, extra=intdot_bound(x, planes, n) if i8 else None,
                             what=f"bound {shape} n={n} call {k}")


@needs_cuda
@pytest.mark.parametrize("tuning", [nested_gpu.NestedTuning(1, 4), nested_gpu.NestedTuning(4, 2),
                                    nested_gpu.NestedTuning(2, 1), nested_gpu.NestedTuning(8, 4),
                                    nested_gpu.NestedTuning(2, 2, 8), nested_gpu.NestedTuning(4, 1, 8),
                                    nested_gpu.NestedTuning(2, 4, 1, True), nested_gpu.NestedTuning(1, 2, 8, True),
                                    nested_gpu.NestedTuning(2, 4, 1, True, True),
                                    nested_gpu.NestedTuning(4, 2, 1, False, True),
                                    nested_gpu.NestedTuning(2, 4, 1, False, True, False, biased6=True),
                                    nested_gpu.NestedTuning(1, 2, 8, True, False, biased6=True)])
def test_cuda_every_tuning(tuning):
    # an odd vec takes no 6-bit plane: the same plan with an 8-bit third plane
    plan = KERNEL_PLAN if tuning.vec % 2 == 0 else KERNEL_PLAN[:2] + ((8, 64),)
    for shape in [s for s in ODD_SHAPES if s[1] % 64 == 0]:  # the plan's groups divide K
        planes = make_planes(*shape, plan, None, mx.bfloat16)
        x = make_x((shape[1],), mx.bfloat16)
        for shared in ((None, False) if shape[1] <= 6144 else (None,)):
            y = nested_gpu.nested_gemv(x, planes, 3, backend="cuda", tuning=tuning, shared=shared)
            want, mag = reference64(x, planes, 3)
            assert_close(y, want, mag, mx.bfloat16, what=str(tuning))



# -- int8 activations (NestedTuning.int8x) --------------------------------------------------

I8_PLANS = [((4, 64), (4, 32)), (4,), (4, 4, 4)]


def test_int8x_applies_to_cuda_four_bit_planes_only():
    planes = make_planes(67, 320, I8_PLANS[0], None, mx.bfloat16)
    x = make_x((320,), mx.bfloat16)
    t = nested_gpu.int8x_tuning(2, 67)
    assert t.int8x and t.vec == 4 and t.rows == nested_gpu.default_tuning(2, 67).rows
    spec = nested_gpu.launch_spec("cuda", x, planes, 2, True, tuning=dataclasses.replace(t, biased=True))
    consts = dict(spec["constants"])
    assert "_i8x_" in spec["name"] and "_device_" in spec["name"]
    assert consts["INT8X"] is True and consts["SHARED"] is False and consts["BIASED"] is False
    assert dict(nested_gpu.launch_spec("cuda", x, planes, 2, True)["constants"])["INT8X"] is False  # never by default
    with pytest.raises(ValueError, match="int8 activations"):  # no integer dot product on Apple GPUs
        nested_gpu.launch_spec("metal", x, planes, 2, True, tuning=t)
    with pytest.raises(ValueError, match="int8 activations"):  # a 6-bit plane
        nested_gpu.launch_spec("cuda", x, make_planes(67, 320, KERNEL_PLAN, None, mx.bfloat16), 3, True, tuning=t)
    with pytest.raises(ValueError, match="int8 activations"):  # vec 2: two steps would share a chunk
        nested_gpu.launch_spec("cuda", x, planes, 2, True, tuning=dataclasses.replace(t, vec=2))
    with pytest.raises(ValueError, match="float staging"):
        nested_gpu.launch_spec("cuda", x, planes, 2, True, tuning=t, shared=True)
    big_k = kernel_files.format_constant("GBX_INT8_K") + 64
    assert not nested_gpu.int8x_applies("cuda", (4, 4), big_k, 4)
    assert nested_gpu.int8x_applies("cuda", (4, 4), big_k - 64, 4)


def test_the_kernel_config_asks_for_int8x_per_gear(monkeypatch):
    """NestedKernelConfig.gpu_int8x_plans picks the gears whose CUDA launch rounds x to
    int8, and the first-use guard then checks them under the int8 bound."""
    from gearbx_mlx.bindings import guard
    from gearbx_mlx.nested.matmul import DEFAULT_CONFIG, NestedProduct

    launched, specs = [], []
    monkeypatch.setattr(nested_gpu, "launcher", lambda *a, **k: launched.append(k.get("tuning")) or object())
    monkeypatch.setattr(guard, "guarded", lambda spec, build, settle: specs.append(spec) or build())
    config = dataclasses.replace(DEFAULT_CONFIG, gpu_int8x_plans=((4, 4),))
    planes = make_planes(67, 320, ((4, 64), (4, 32), (6, 64)), None, mx.bfloat16)
    for backend, want in (("cuda", [False, True, False]), ("metal", [False, False, False])):
        launched.clear()
        specs.clear()
        prod = NestedProduct(planes, config)
        for n in (1, 2, 3):
            prod._gpu_launcher(backend, mx.bfloat16, n, False)
        assert [bool(t and t.int8x) for t in launched] == want, backend
        assert [s.intdot for s in specs] == want, backend
    launched.clear()
    NestedProduct(planes)._gpu_launcher("cuda", mx.bfloat16, 2, False)  # the default: the mid gear's 4 + 4 bits
    assert [t.int8x for t in launched] == [(4, 4) in DEFAULT_CONFIG.gpu_int8x_plans]
    launched.clear()
    NestedProduct(planes, dataclasses.replace(DEFAULT_CONFIG, gpu_int8x_plans=()))._gpu_launcher(
        "cuda", mx.bfloat16, 2, False)
    assert launched == [None]  # float activations where no plan asks for int8


@needs_cuda
@pytest.mark.parametrize("i", range(len(I8_PLANS)))
def test_cuda_int8x_matches_the_reference(i):
    """Each plan at every odd shape and four splits, one dtype per plan (each split a
    compile), with and without a bias by turns."""
    plan, dtype = I8_PLANS[i], (mx.bfloat16, mx.float16, mx.float32)[i]
    gs = None if isinstance(plan[0], tuple) else 64
    n = len(plan)
    for shape in [s for s in ODD_SHAPES if all(s[1] % g == 0 for _, g in plane_specs(plan, gs))]:
        planes = make_planes(*shape, plan, gs, dtype, seed=n)
        x = make_x((shape[1],), dtype, seed=n + 1)
        bias = make_x((shape[0],), dtype, seed=n + 2)
        for k, (rows, ksplit) in enumerate(((1, 1), (2, 1), (4, 1), (2, 8))):
            t = dataclasses.replace(nested_gpu.int8x_tuning(n, shape[0]), rows=rows, ksplit=ksplit)
            b = bias if k % 2 else None
            y = nested_gpu.nested_gemv(x, planes, n, b, backend="cuda", tuning=t)
            want, mag = reference64(x, planes, n, b)
            assert_close(y, want, mag, dtype, extra=intdot_bound(x, planes, n), what=f"cuda int8x {t} {shape}")
