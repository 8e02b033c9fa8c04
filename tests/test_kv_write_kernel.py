"""The fused KV write kernel (metal_kernels/kv_write_body.inc) against the MLX path.

Three layers, from anywhere to the GPU:

* argument plumbing (`write_kernel.kernel_name`, `write`'s choice, refusals): every machine;
* the shared body run on the host through the CPU emulation of the GPU
  prelude (metal_kernels/check/host_emulation.h, address sanitizer on), and
  copies with planted bugs that must fail: wherever g++ is installed;
* the CUDA twin through `mx.fast.cuda_kernel`: only where MLX has a CUDA GPU.

The oracle is `quantize` of gearbx_mlx.kvcache.quantize (MLX ops). A group
(one scale, one bias, GS codes) must match the oracle's exactly, except
where a float tie flips a rounding (the kernel sums in another order than
MLX's reductions): at most MAX_DIFF_GROUP_FRACTION of the groups may differ,
and in each of them the squared reconstruction error must lie within
RECON_RTOL of the oracle's.

MLX's CPU quantizer (the oracle's first step on the host) is not its GPU
kernel, which the body follows: it rounds half to even where the GPU rounds
half away from zero, and starts a group's maximum at -inf where the GPU
starts it at 0. The groups where the two differ (`rule_groups`: a few per
cent in bfloat16, ties being common in 8-bit mantissas) are held to the GPU
rule instead: min-max bit for bit against `gpu_minmax`, a float32 model of
MLX's GPU kernel (min-max has no sums, so nothing may differ), and least
squares no worse than that grid. On a CUDA GPU the oracle is MLX's own
GPU quantizer and there are no such groups.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import host_emulation
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gearbx_mlx.bindings import gpu, kernel_files
from gearbx_mlx.kvcache import write_kernel
from gearbx_mlx.kvcache.quantize import offset_keys, quantize, quantize_ls

HAS_CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="MLX has no CUDA GPU on this machine")

#: Groups (of keys and values together) whose codes, scale or bias may differ
#: from the oracle's: rounding ties flipped by a sum in another order or, on
#: the CPU, by MLX's round half to even.
MAX_DIFF_GROUP_FRACTION = 0.02
#: In a group that differs: |err_kernel - err_oracle| <= RECON_RTOL * err_oracle
#: (+ RECON_ATOL), err the sum of squared differences between the stored
#: group (codes * scale + bias) and what was quantized.
RECON_RTOL = 0.05


def coarse_scales(bits: int, dtype: mx.Dtype) -> bool:
    """bfloat16 at 6 and 8 bits: its 8-bit mantissa rounds a stored scale by about as much
    as a quantization step, so a tie flipped in the first refit can leave least squares
    on another grid, by 12.7% and 20.7% in one group of two drawn cases. There the
    differing least-squares groups are held in total (RECON_RTOL), not one by one."""
    return dtype == mx.bfloat16 and bits >= 6
RECON_ATOL = 1e-9

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
HOST_TYPES = {mx.float32: "float", mx.float16: "gbx_half_t", mx.bfloat16: "gbx_bfloat_t"}
DTYPE_CODE = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)


# -- cases and comparison ---------------------------------------------------------------


def make_case(shape: Tuple[int, int, int, int], dtype: mx.Dtype, with_offset: bool, seed: int = 0,
              v_dim: Optional[int] = None):
    """Keys with a large per-channel offset (a few channels far out, as k_proj
    biases put them), the offset (float32) or None, and values."""
    b, h, length, d = shape
    rng = np.random.default_rng(seed)
    chan = rng.standard_normal((h, d)).astype(np.float32) * 0.3
    if with_offset:
        far = rng.random((h, d)) < 0.05
        chan = np.where(far, rng.choice([-1.0, 1.0], (h, d)) * rng.uniform(20, 60, (h, d)), chan * 10)
    keys = rng.standard_normal((b, h, length, d)).astype(np.float32) * rng.uniform(0.5, 2.0, (1, h, 1, d))
    keys = keys + chan[None, :, None, :]
    values = rng.standard_normal((b, h, length, v_dim or d)).astype(np.float32)
    offset = None
    if with_offset:
        offset = mx.array((chan + rng.standard_normal((h, d)) * 0.05).astype(np.float32))
    return mx.array(keys).astype(dtype), mx.array(values).astype(dtype), offset


def quantizer_input(keys: mx.array, offset: Optional[mx.array]) -> mx.array:
    """What the quantizer sees of the keys: the offset subtracted in their dtype, as the cache does."""
    return offset_keys(keys, offset)


def unpack_codes(words: mx.array, bits: int) -> np.ndarray:
    """``(..., n)`` codes of MLX's LSB-first bit stream of ``(..., n * bits / 32)`` uint32 words."""
    w = np.ascontiguousarray(np.array(words, dtype=np.uint32))
    stream = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    per = stream.reshape(*w.shape[:-1], -1, bits).astype(np.int64)
    return (per << np.arange(bits)).sum(-1)


def as_f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def group_view(q, x: mx.array, bits: int, group_size: int):
    """(codes (..., G, g), scales (..., G), biases (..., G), x (..., G, g), err (..., G))."""
    codes = unpack_codes(q[0], bits)
    codes = codes.reshape(*codes.shape[:-1], -1, group_size)
    s, b = as_f64(q[1]), as_f64(q[2])
    xg = as_f64(x).reshape(codes.shape)
    err = ((codes * s[..., None] + b[..., None] - xg) ** 2).sum(-1)
    return codes, s, b, xg, err


def rule_groups(x: mx.array, group_size: int, bits: int) -> np.ndarray:
    """``(..., G)`` True where this device's ``mx.quantize`` differs from MLX's GPU rule
    (:func:`gpu_minmax`): on the CPU, groups with a tie that MLX rounds half to
    even there, or without a positive element; on a GPU, none."""
    codes, scale, bias = gpu_minmax(x, group_size, bits)
    w, s, b = mx.quantize(x, group_size=group_size, bits=bits)
    shape = codes.shape[:-1] + (-1, group_size)
    same = (unpack_codes(w, bits).reshape(shape) == codes.reshape(shape)).all(-1)
    same &= as_f64(mx.array(scale).astype(x.dtype)) == as_f64(s)
    same &= as_f64(mx.array(bias).astype(x.dtype)) == as_f64(b)
    return ~same


def model_error(x: mx.array, group_size: int, bits: int) -> np.ndarray:
    """``(..., G)`` squared error of MLX's GPU min-max (:func:`gpu_minmax`), scales and biases as stored."""
    codes, scale, bias = gpu_minmax(x, group_size, bits)
    codes = codes.reshape(*codes.shape[:-1], -1, group_size)
    s = as_f64(mx.array(scale).astype(x.dtype))
    b = as_f64(mx.array(bias).astype(x.dtype))
    return ((codes * s[..., None] + b[..., None] - as_f64(x).reshape(codes.shape)) ** 2).sum(-1)


def check_half(got, want, x: mx.array, bits: int, group_size: int, quantizer: str) -> Tuple[int, int, list]:
    """(groups compared, groups that differ, [(group, error, bound) out of tolerance]) of keys or values.

    Outside :func:`rule_groups` the oracle holds: a group equals the
    oracle's, or its error is within RECON_RTOL of the oracle's. Inside, the
    oracle took MLX's CPU rule and the body its GPU rule: min-max groups are
    compared with :func:`gpu_minmax` bit for bit by the tests, and a
    least-squares group must be no worse than that grid (the refit is kept
    only where it lowers the error) within RECON_RTOL.
    """
    cg, sg, bg, _, eg = group_view(got, x, bits, group_size)
    cw, sw, bw, _, ew = group_view(want, x, bits, group_size)
    same = (cg == cw).all(-1) & (sg == sw) & (bg == bw)
    rule = rule_groups(x, group_size, bits)
    model = model_error(x, group_size, bits)
    too_far = np.where(rule, (eg > (1 + RECON_RTOL) * model + RECON_ATOL) & (quantizer == "ls"),
                       np.abs(eg - ew) > RECON_RTOL * ew + RECON_ATOL) & ~same
    bound = np.where(rule, model, ew)
    if coarse_scales(bits, x.dtype) and quantizer == "ls":
        # Each differing group against its bound (the oracle's error, or MLX's GPU grid
        # where the CPU rule differs), in total.
        got_total, want_total = float(eg[~same].sum()), float(bound[~same].sum())
        too_far = np.zeros_like(too_far)
        if got_total > want_total * (1 + RECON_RTOL) + RECON_ATOL:
            return int((~rule).sum()), int((~same & ~rule).sum()), [("total of differing groups", got_total,
                                                                      want_total)]
    bad = [(tuple(int(i) for i in idx), float(eg[idx]), float(bound[idx])) for idx in zip(*np.nonzero(too_far))]
    return int((~rule).sum()), int((~same & ~rule).sum()), bad


def assert_matches_oracle(got: Tuple[tuple, tuple], keys, values, offset, group_size, bits, quantizer,
                          what: str = "", device: Any = mx.cpu,
                          max_diff: float = MAX_DIFF_GROUP_FRACTION) -> None:
    """Kernel output ``(kq, vq)`` against the MLX path on ``device``, with the named tolerances.

    The host emulation is held to MLX's CPU path (the default device may be a GPU,
    whose fused reductions order sums differently)."""
    with mx.stream(device):
        x = quantizer_input(keys, offset)
        want = (quantize(x, group_size, bits, quantizer), quantize(values, group_size, bits, quantizer))
        _compare(got, want, x, values, group_size, bits, quantizer, what, max_diff)


def assert_ls_as_good_on_gpu(got: Tuple[tuple, tuple], keys, values, offset, group_size, bits,
                             what: str = "", device: Any = mx.gpu) -> None:
    """Least squares on a GPU, where MLX's own path sums in another order (a float32
    scale then differs in its last bit nearly everywhere, and a tie flipped in the
    first refit may lead the alternation to another grid): no group worse than MLX's
    GPU min-max grid beyond RECON_RTOL (the kernel keeps a refit by its float32 error,
    which can misjudge a near tie), and the total error within GPU_TOTAL_RTOL of MLX's
    path."""
    with mx.stream(device):
        x = quantizer_input(keys, offset)
        for g, src, name in ((got[0], x, "keys"), (got[1], values, "values")):
            want = quantize(src, group_size, bits, "ls")
            eg, ew = group_view(g, src, bits, group_size)[4], group_view(want, src, bits, group_size)[4]
            grid = model_error(src, group_size, bits)
            worse = eg > grid * (1 + (RECON_RTOL_8BIT if bits == 8 else RECON_RTOL)) + RECON_ATOL
            assert not worse.any(), f"{what} {name}: {int(worse.sum())} groups worse than MLX's min-max grid"
            assert eg.sum() <= ew.sum() * (1 + GPU_TOTAL_RTOL), \
                f"{what} {name}: total squared error {eg.sum():.6g} against MLX's {ew.sum():.6g}"


def _compare(got, want, x, values, group_size, bits, quantizer, what, max_diff) -> None:
    total, diff, bad = 0, 0, []
    for (g, w, src, name) in ((got[0], want[0], x, "keys"), (got[1], want[1], values, "values")):
        for a, b, part in zip(g, w, ("packed", "scales", "biases")):
            assert a.shape == b.shape and a.dtype == b.dtype, \
                f"{what} {name} {part}: {a.shape} {a.dtype} vs the reference's {b.shape} {b.dtype}"
        n, d, worse = check_half(g, w, src, bits, group_size, quantizer)
        total, diff, bad = total + n, diff + d, bad + [(name,) + e for e in worse]
    assert diff <= max_diff * total, \
        f"{what}: {diff} of {total} groups differ from the reference, more than {max_diff:.0%}"
    assert not bad, f"{what}: groups whose squared error is out of {RECON_RTOL:.0%} of the reference's " \
                    f"(half, group, error, bound): {bad[:5]}"


def _round_away(v: np.ndarray) -> np.ndarray:
    """Round half away from zero, exactly, in float32 (as Metal's round and CUDA's roundf)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= np.float32(0.5), np.sign(v), np.float32(0)).astype(np.float32)


def gpu_minmax(x: mx.array, group_size: int, bits: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX's GPU affine quantize (its Metal and CUDA kernels), modelled in float32 numpy:
    ``(codes (..., n), scales, biases)``, scales and biases as float32 before rounding to x's dtype."""
    f = np.array(x.astype(mx.float32), dtype=np.float32)
    g = f.reshape(*f.shape[:-1], -1, group_size)
    n_bins = np.float32(2**bits - 1)
    w_min = g.min(-1)
    w_max = np.maximum(g.max(-1), np.float32(0))
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.where(side, scale, -scale)
    edge = np.where(side, w_min, w_max)
    q0 = _round_away(edge / scale)
    at_zero = q0 == 0
    scale = np.where(at_zero, scale, edge / np.where(at_zero, 1, q0)).astype(np.float32)
    bias = np.where(at_zero, np.float32(0), edge).astype(np.float32)
    codes = np.minimum(_round_away((g - bias[..., None]) / scale[..., None]), n_bins)
    return codes.reshape(f.shape).astype(np.int64), scale, bias


# -- argument plumbing (any machine) ----------------------------------------------------


def test_names_and_constants_carry_every_parameter():
    name = write_kernel.kernel_name("cuda", 3, 64, "ls", mx.bfloat16, True)
    for part in ("cuda", "q3", "g64", f"ls{write_kernel.LS_ITERS}", "bf16", "_off_"):
        assert part in name, (part, name)
    assert name != write_kernel.kernel_name("cuda", 3, 64, "minmax", mx.bfloat16, True)
    assert name != write_kernel.kernel_name("cuda", 3, 64, "ls", mx.bfloat16, False)
    assert name != write_kernel.kernel_name("metal", 3, 64, "ls", mx.bfloat16, True)
    consts = dict(write_kernel.constants(mx.float16, 5, 32, "ls"))
    assert consts == {"T": mx.float16, "BITS": 5, "GS": 32, "LS": True, "ITERS": write_kernel.LS_ITERS}
    assert "using T = __half;" in gpu.constants_source("cuda", write_kernel.constants(mx.float16, 5, 32, "ls"))
    # The refits are quantize_ls's, and the threadgroup is the header's.
    assert inspect.signature(quantize_ls).parameters["iters"].default == write_kernel.LS_ITERS
    assert write_kernel.threads_per_group() == gpu.THREADS
    assert write_kernel.input_names(True) == ["keys", "values", "key_offset"]
    assert write_kernel.input_names(False) == ["keys", "values"]


def test_names_differ_by_source_text(tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_files.source_dir(), copy)
    a = write_kernel.kernel_sources("cuda", True, copy)
    body = copy / "kv_write_body.inc"
    body.write_text(body.read_text() + "\n// edit\n")
    kernel_files.read.cache_clear()
    assert write_kernel.kernel_sources("cuda", True, copy) != a
    header, source = write_kernel.kernel_sources("metal", False, copy)
    assert "key_offset" not in source.split("#else")[-1] and "#define GBX_KV_OFFSET 0" in source


def test_where_the_kernel_applies():
    assert write_kernel.supports(4, 64, 128, 128, mx.float16, "ls")
    assert write_kernel.supports(3, 32, 64, 96, mx.bfloat16)
    assert not write_kernel.supports(4, 64, 96, 128, mx.float16)  # 96 % 64
    assert not write_kernel.supports(7, 64, 128, 128, mx.float16)
    assert not write_kernel.supports(4, 48, 96, 96, mx.float16)
    assert not write_kernel.supports(4, 64, 128, 128, mx.int32)
    assert not write_kernel.supports(4, 64, 128, 128, mx.float16, "gptq")


def test_write_takes_the_mlx_path_without_a_gpu():
    keys, values, offset = make_case((1, 3, 5, 64), mx.float16, True, seed=3)
    got = write_kernel.write(keys, values, offset, 32, 4, "ls", use_kernel=False)
    x = quantizer_input(keys, offset)
    want = (quantize(x, 32, 4, "ls"), quantize(values, 32, 4, "ls"))
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert mx.array_equal(a, b)
    if not write_kernel.available():
        auto = write_kernel.write(keys, values, offset, 32, 4, "ls")
        assert all(mx.array_equal(a, b) for g, w in zip(auto, want) for a, b in zip(g, w))
        with pytest.raises(ValueError, match="no GPU"):
            write_kernel.fused_write(keys, values, offset, 32, 4, "ls")


def test_write_launches_the_kernel_on_a_gpu(monkeypatch):
    """What write() hands MLX on a GPU, with a stand-in for the compiled kernel:
    the inputs (offset as float32), one thread a group in whole threadgroups,
    and the outputs' shapes and dtypes; and where it takes the MLX ops instead."""
    calls = []

    def fake_build(backend, name, has_offset, consts_source):
        def kernel(inputs, grid, threadgroup, output_shapes, output_dtypes):
            calls.append(dict(name=name, inputs=inputs, grid=grid, threadgroup=threadgroup, consts=consts_source))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        return kernel

    for f in (write_kernel.launcher, write_kernel._kernel_for):
        f.cache_clear()
    monkeypatch.setattr(write_kernel, "build_kernel", fake_build)
    monkeypatch.setattr(gpu, "gpu_backend", lambda: "cuda")
    try:
        keys, values, offset = make_case((2, 3, 5, 128), mx.bfloat16, True, v_dim=64)
        kq, vq = write_kernel.write(keys, values, offset.astype(mx.float16), 32, 3, "ls")
        (call,) = calls
        assert "q3_g32_ls2_bf16_off" in call["name"] and "constexpr int BITS = 3;" in call["consts"]
        assert call["inputs"][0] is keys and call["inputs"][1] is values and call["inputs"][2].dtype == mx.float32
        groups = 2 * 3 * 5 * (128 + 64) // 32
        assert call["threadgroup"] == (gpu.THREADS, 1, 1) and call["grid"] == (-(-groups // 256) * 256, 1, 1)
        assert [a.shape for a in kq] == [(2, 3, 5, 12), (2, 3, 5, 4), (2, 3, 5, 4)]
        assert [a.shape for a in vq] == [(2, 3, 5, 6), (2, 3, 5, 2), (2, 3, 5, 2)]
        assert [a.dtype for a in kq + vq] == [mx.uint32, mx.bfloat16, mx.bfloat16] * 2
        write_kernel.write(keys, values, None, 64, 4, "minmax")
        assert len(calls) == 2 and len(calls[1]["inputs"]) == 2 and "_nooff_" in calls[1]["name"]
        # where the kernel does not apply, the MLX ops (no launch)
        write_kernel.write(keys, values.astype(mx.float16), None, 32, 4, "minmax")  # two dtypes
        write_kernel.write(keys, values, None, 32, 4, "minmax", use_kernel=False)
        write_kernel.write(keys[:, :, :0], values[:, :, :0], None, 32, 4, "minmax")
        assert len(calls) == 2
        with pytest.raises(ValueError, match="no KV write kernel"):
            write_kernel.write(keys, values, None, 128, 4, "minmax", use_kernel=True)
    finally:
        for f in (write_kernel.launcher, write_kernel._kernel_for):
            f.cache_clear()


def test_refusals():
    keys, values, offset = make_case((1, 3, 2, 64), mx.float32, True)
    with pytest.raises(ValueError, match="n_kv_heads, head_dim"):
        write_kernel.reference_write(keys, values, offset[:2], 32, 4, "minmax")
    with pytest.raises(ValueError, match="same B"):
        write_kernel.reference_write(keys, values[:, :2], None, 32, 4, "minmax")
    with pytest.raises(ValueError, match="one dtype"):
        write_kernel.fused_write(keys, values.astype(mx.float16), None, 32, 4, "minmax", backend="cuda")
    with pytest.raises(ValueError, match="quantizer"):
        write_kernel.fused_write(keys, values, None, 32, 4, "gptq", backend="cuda")
    with pytest.raises(ValueError):
        write_kernel.fused_write(keys, values, None, 48, 4, "minmax", backend="cuda")
    with pytest.raises(ValueError, match="no KV write kernel"):
        write_kernel.fused_write(keys.astype(mx.float32), values, None, 128, 4, "minmax", backend="cuda")


def test_the_gpu_model_is_mlx_quantize_away_from_ties():
    """The float32 model of MLX's GPU min-max agrees with mx.quantize here,
    except at the rule differences the docstring names (ties, all-negative groups)."""
    keys, _, offset = make_case((2, 8, 17, 128), mx.float32, True, seed=1)
    x = quantizer_input(keys, offset)
    codes, scale, bias = gpu_minmax(x, 64, 4)
    w, s, b = mx.quantize(x, group_size=64, bits=4)
    assert np.array_equal(unpack_codes(w, 4), codes)
    assert np.array_equal(np.array(s), scale) and np.array_equal(np.array(b), bias)


def test_the_wheel_ships_the_kernel_files():
    """pyproject's package data (metal_kernels/ as gearbx_mlx/metal_kernels) takes the body and its header."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parent.parent
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["gearbx_mlx.metal_kernels"]
    for name in ("kv_write_body.inc", "kv_write_common.h"):
        assert (root / "metal_kernels" / name).is_file()
        assert any(Path(name).match(pat) for pat in patterns), (name, patterns)


# -- the shared body on the host ---------------------------------------------------------


def _host_function(directory: Path, has_offset: bool) -> str:
    _, source = write_kernel.kernel_sources("cuda", has_offset, directory)
    entry = gpu.backend_files("cuda", directory)[1]
    assert entry in source
    source = source.replace(entry, "GBX_HOST_ENTRY\n")
    names = [n for n, _ in write_kernel.constants(mx.float32, 4, 64, "ls")]
    assert names == ["T", "BITS", "GS", "LS", "ITERS"], "update the host harness: the constants changed"
    params = ["const T_* keys", "const T_* values"] + (["const float* key_offset"] if has_offset else [])
    params += ["Shape keys_shape", "Shape values_shape", "uint32_t* kw", "T_* ks", "T_* kb", "uint32_t* vw",
               "T_* vs", "T_* vb"]
    return (f"template <typename T_, int BITS_, int GS_, bool LS_>\n"
            f"void kv_write_off{int(has_offset)}({', '.join(params)}) {{\n"
            f"  using T = T_;\n  constexpr int BITS = BITS_;\n  constexpr int GS = GS_;\n"
            f"  constexpr bool LS = LS_;\n  constexpr int ITERS = {write_kernel.LS_ITERS};\n{source}\n}}\n")


_HOST_MAIN = r"""
static std::vector<char> slurp(const std::string& path) { return gbx_host_slurp(path); }
static void spill(const std::string& path, const void* p, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(p, 1, n, f);
  std::fclose(f);
}
struct Args { int dtype, bits, gs, ls, off, B, H, L, Dk, Dv; std::string dir; };

template <typename T, int BITS, int GS, bool LS>
int run_case(const Args& a) {
  // Exact-size buffers: the sanitizer sees any read or write past them.
  const size_t rows = size_t(a.B) * a.H * a.L;
  std::vector<char> kf = slurp(a.dir + "/keys.bin"), vf = slurp(a.dir + "/values.bin");
  std::vector<char> of = slurp(a.dir + "/offset.bin");
  if (a.Dk % GS || a.Dv % GS) return 3;
  if (kf.size() != rows * a.Dk * sizeof(T) || vf.size() != rows * a.Dv * sizeof(T)) return 3;
  if (a.off && of.size() != size_t(a.H) * a.Dk * 4) return 3;
  std::vector<T> keys(rows * a.Dk), values(rows * a.Dv);
  std::memcpy(keys.data(), kf.data(), kf.size());
  std::memcpy(values.data(), vf.data(), vf.size());
  std::vector<float> offset(a.off ? size_t(a.H) * a.Dk : 0);
  if (a.off) std::memcpy(offset.data(), of.data(), of.size());
  std::vector<uint32_t> kw(rows * a.Dk * BITS / 32), vw(rows * a.Dv * BITS / 32);
  std::vector<T> ks(rows * a.Dk / GS), kb(ks.size()), vs(rows * a.Dv / GS), vb(vs.size());
  Shape kshape{}, vshape{};
  kshape[0] = a.B; kshape[1] = a.H; kshape[2] = a.L; kshape[3] = a.Dk;
  vshape[0] = a.B; vshape[1] = a.H; vshape[2] = a.L; vshape[3] = a.Dv;
  const size_t groups = rows * (a.Dk + a.Dv) / GS;
  const int n_tg = int((groups + GBX_KV_THREADS - 1) / GBX_KV_THREADS);
  gbx_emu_launch(n_tg, [&] {
    if (a.off)
      kv_write_off1<T, BITS, GS, LS>(keys.data(), values.data(), offset.data(), kshape, vshape, kw.data(),
                                     ks.data(), kb.data(), vw.data(), vs.data(), vb.data());
    else
      kv_write_off0<T, BITS, GS, LS>(keys.data(), values.data(), kshape, vshape, kw.data(), ks.data(),
                                     kb.data(), vw.data(), vs.data(), vb.data());
  });
  spill(a.dir + "/kw.bin", kw.data(), kw.size() * 4);
  spill(a.dir + "/vw.bin", vw.data(), vw.size() * 4);
  spill(a.dir + "/ks.bin", ks.data(), ks.size() * sizeof(T));
  spill(a.dir + "/kb.bin", kb.data(), kb.size() * sizeof(T));
  spill(a.dir + "/vs.bin", vs.data(), vs.size() * sizeof(T));
  spill(a.dir + "/vb.bin", vb.data(), vb.size() * sizeof(T));
  return 0;
}
template <typename T, int BITS, int GS>
int run_ls(const Args& a) { return a.ls ? run_case<T, BITS, GS, true>(a) : run_case<T, BITS, GS, false>(a); }
"""


def _dispatch(dtypes, bits, groups) -> str:
    """main() and the switches down to run_ls, instantiated for these variants only."""
    gs_cases = "".join(f"    case {g}: return run_ls<T, BITS, {g}>(a);\n" for g in groups)
    bit_cases = "".join(f"    case {b}: return run_gs<T, {b}>(a);\n" for b in bits)
    dt_cases = "".join(f"    case {DTYPE_CODE[d]}: return run_bits<{HOST_TYPES[d]}>(a);\n" for d in dtypes)
    return ("template <typename T, int BITS>\nint run_gs(const Args& a) {\n  switch (a.gs) {\n" + gs_cases
            + "  }\n  return 2;\n}\ntemplate <typename T>\nint run_bits(const Args& a) {\n  switch (a.bits) {\n"
            + bit_cases + "  }\n  return 2;\n}\nint main(int argc, char** argv) {\n  if (argc != 12) return 2;\n"
            "  Args a;\n  int* fields[] = {&a.dtype, &a.bits, &a.gs, &a.ls, &a.off, &a.B, &a.H, &a.L, &a.Dk, &a.Dv};\n"
            "  for (int i = 0; i < 10; ++i) *fields[i] = std::atoi(argv[i + 1]);\n  a.dir = argv[11];\n"
            "  switch (a.dtype) {\n" + dt_cases + "  }\n  return 2;\n}\n")


def host_unit(directory: Path, dtypes=DTYPES, bits=BITS, groups=GROUPS) -> str:
    """One C++ file: the emulated prelude, the helpers, the body (with and
    without the offset) and a driver for these dtypes, bit widths and groups."""
    d = Path(directory)
    parts = [(d / kernel_files.FORMAT_HEADER).read_text(), (d / "check/host_emulation.h").read_text(),
             "#include <cstdio>\n#include <cstdlib>\n#include <string>\nusing Shape = std::array<int, 10>;",
             (d / "gemv_common.h").read_text(), (d / "kv_write_common.h").read_text(),
             _host_function(d, False), _host_function(d, True), _HOST_MAIN, _dispatch(dtypes, bits, groups)]
    return "\n".join(parts)


def build_host(directory: Path, tag: str, dtypes=DTYPES, bits=BITS, groups=GROUPS) -> Dict[mx.Dtype, Path]:
    """``{dtype: binary}``: one binary a dtype, compiled side by side (-O0: the
    216 variants compile in a fraction of -O1's time; the sanitizers stay on)."""
    jobs = [host_emulation.start(host_unit(directory, (dtype,), bits, groups), f"kvwrite_{tag}", "kvwrite", "-O0")
            for dtype in dtypes]
    return {dtype: host_emulation.finish(*job) for dtype, job in zip(dtypes, jobs)}


def _load(path: Path, dtype: mx.Dtype, shape: tuple) -> mx.array:
    raw = path.read_bytes()
    if dtype == mx.uint32:
        return mx.array(np.frombuffer(raw, dtype=np.uint32).reshape(shape))
    if dtype == mx.float32:
        return mx.array(np.frombuffer(raw, dtype=np.float32).reshape(shape))
    return mx.array(np.frombuffer(raw, dtype=np.uint16).reshape(shape)).view(dtype)


def run_host(binaries: Dict[mx.Dtype, Path], work: Path, keys: mx.array, values: mx.array, offset: Optional[mx.array],
             group_size: int, bits: int, quantizer: str) -> Tuple[tuple, tuple]:
    """The body on the host: ``(kq, vq)`` as :func:`write_kernel.fused_write` returns them."""
    work.mkdir(parents=True, exist_ok=True)
    mx.eval(keys, values)
    (work / "keys.bin").write_bytes(bytes(memoryview(keys)))
    (work / "values.bin").write_bytes(bytes(memoryview(values)))
    (work / "offset.bin").write_bytes(b"" if offset is None else bytes(memoryview(offset.astype(mx.float32))))
    b, h, length, dk = keys.shape
    dv = values.shape[3]
    args = [DTYPE_CODE[keys.dtype], bits, group_size, int(quantizer == "ls"), int(offset is not None),
            b, h, length, dk, dv]
    # An AddressSanitizer binary must load its runtime first: drop any LD_PRELOAD.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([str(binaries[keys.dtype]), *map(str, args), str(work)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, f"host kernel exited {proc.returncode}: {proc.stderr[-4000:]}"
    out = []
    for prefix, d in (("k", dk), ("v", dv)):
        lead = (b, h, length)
        out.append((_load(work / f"{prefix}w.bin", mx.uint32, lead + (d * bits // 32,)),
                    _load(work / f"{prefix}s.bin", keys.dtype, lead + (d // group_size,)),
                    _load(work / f"{prefix}b.bin", keys.dtype, lead + (d // group_size,))))
    return out[0], out[1]


#: The module's tests run in one pytest-xdist worker: host_binary compiles once (tens of
#: seconds), not once per worker that runs one of them.
pytestmark = pytest.mark.xdist_group("kv-write-host-binary")


@pytest.fixture(scope="module")
def host_binary() -> Dict[mx.Dtype, Path]:
    return build_host(kernel_files.source_dir(), "ok")


#: Every bit width x group x dtype once, each at its own odd shape, offset and quantizer.
SWEEP = [(bits, gs, dtype) for bits in BITS for gs in GROUPS for dtype in DTYPES]
SHAPES = [(1, 1, 1), (2, 3, 5), (1, 8, 17), (2, 1, 17), (1, 3, 1), (2, 8, 5)]


def _sweep_id(case) -> str:
    bits, gs, dtype = case
    return f"q{bits}-g{gs}-{str(dtype).split('.')[-1]}"


@pytest.mark.parametrize("case", SWEEP, ids=[_sweep_id(c) for c in SWEEP])
def test_host_emulated_body_matches_the_oracle(host_binary, tmp_path, case):
    bits, gs, dtype = case
    i = SWEEP.index(case)
    b, h, length = SHAPES[i % len(SHAPES)]
    d = 128 if gs == 128 or i % 2 else 64
    with_offset = i % 3 != 0
    keys, values, offset = make_case((b, h, length, d), dtype, with_offset, seed=i)
    for quantizer in ("minmax", "ls"):
        got = run_host(host_binary, tmp_path / quantizer, keys, values, offset, gs, bits, quantizer)
        assert_matches_oracle(got, keys, values, offset, gs, bits, quantizer,
                              what=f"{_sweep_id(case)} {quantizer} shape {(b, h, length, d)} offset={with_offset}")
        if quantizer == "minmax":
            # No sums in min-max: the body is MLX's GPU kernel bit for bit.
            for q, src in zip(got, (quantizer_input(keys, offset), values)):
                codes, scale, bias = gpu_minmax(src, gs, bits)
                assert np.array_equal(unpack_codes(q[0], bits), codes)
                assert mx.array_equal(q[1], mx.array(scale).astype(dtype))
                assert mx.array_equal(q[2], mx.array(bias).astype(dtype))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bits=st.sampled_from(BITS), gs=st.sampled_from(GROUPS), dtype=st.sampled_from(DTYPES),
       b=st.integers(1, 2), h=st.sampled_from((1, 3, 8)), length=st.sampled_from((1, 5, 17)),
       d=st.sampled_from((64, 128)), v_more=st.sampled_from((0, 1)), with_offset=st.booleans(),
       quantizer=st.sampled_from(("minmax", "ls")), seed=st.integers(0, 2**16))
def test_host_emulated_body_on_drawn_cases(host_binary, tmp_path, bits, gs, dtype, b, h, length, d, v_more,
                                           with_offset, quantizer, seed):
    gs = min(gs, d)  # groups divide head_dim
    v_extra = v_more * gs  # values one group wider than keys, or as wide
    keys, values, offset = make_case((b, h, length, d), dtype, with_offset, seed=seed, v_dim=d + v_extra)
    work = tmp_path / f"case{seed}_{bits}_{gs}"
    got = run_host(host_binary, work, keys, values, offset, gs, bits, quantizer)
    assert_matches_oracle(got, keys, values, offset, gs, bits, quantizer,
                          what=f"q{bits} g{gs} {dtype} {quantizer} {(b, h, length, d, d + v_extra)}")


def test_min_max_follows_the_gpu_rule(host_binary, tmp_path):
    """Groups without a positive element: MLX's GPU kernels start the maximum at
    0 (its CPU quantizer does not); the body follows the GPU, bit for bit."""
    keys, values, _ = make_case((1, 3, 5, 64), mx.float16, False, seed=9)
    keys = -mx.abs(keys) - 0.5  # every key group negative
    values = mx.abs(values) + 0.25  # every value group positive
    for bits in (3, 4, 8):
        got = run_host(host_binary, tmp_path / f"q{bits}", keys, values, None, 32, bits, "minmax")
        for q, src in zip(got, (keys, values)):
            codes, scale, bias = gpu_minmax(src, 32, bits)
            assert np.array_equal(unpack_codes(q[0], bits), codes)
            assert mx.array_equal(q[1], mx.array(scale).astype(mx.float16))
            assert mx.array_equal(q[2], mx.array(bias).astype(mx.float16))
        # the rule matters: the CPU's grid differs on the negative keys
        assert not mx.array_equal(got[0][1], mx.quantize(keys, group_size=32, bits=bits, stream=mx.cpu)[1])


def _planted(tmp_path: Path, name: str, old: str, new: str, tag: str) -> Path:
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_files.source_dir(), copy)
    path = copy / name
    text = path.read_text()
    assert old in text, f"update the planted bug: {name} changed"
    path.write_text(text.replace(old, new))
    return build_host(copy, tag, (mx.float16,), (4,), (64,))


PLANTS = {
    # Swap the codes of neighbouring elements as they are packed.
    "swap": ("kv_write_common.h", "refit ? gbx_kv_code_ls<BITS>(v.v[i], s, b)\n"
                                  "                            : gbx_kv_code_minmax<BITS>(v.v[i], scale, bias)",
             "refit ? gbx_kv_code_ls<BITS>(v.v[i ^ 1], s, b)\n"
             "                            : gbx_kv_code_minmax<BITS>(v.v[i ^ 1], scale, bias)"),
    # Quantize the keys without their offset.
    "offset": ("kv_write_body.inc", "gbx_kv_quantize_group<T, BITS, GS, LS, ITERS, true>",
               "gbx_kv_quantize_group<T, BITS, GS, LS, ITERS, false>"),
    # Never refit (least squares left as min-max).
    "refit": ("kv_write_common.h", "if (det > 1e-6f) {", "if (det > 1e30f) {"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_bug_in_the_body_fails(tmp_path, plant):
    name, old, new = PLANTS[plant]
    binary = _planted(tmp_path, name, old, new, f"bug_{plant}")
    keys, values, offset = make_case((1, 3, 5, 128), mx.float16, True, seed=11)
    quantizer = "ls" if plant == "refit" else "minmax"
    got = run_host(binary, tmp_path / "run", keys, values, offset, 64, 4, quantizer)
    with pytest.raises(AssertionError, match="reference"):
        assert_matches_oracle(got, keys, values, offset, 64, 4, quantizer, what=f"planted {plant}")


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang not installed (apt-get install -y clang)")
def test_the_syntax_check_compiles_the_body(tmp_path):
    """scripts/check_metal_syntax.py compiles the KV write body: a name with no
    buffer behind it (in the variant without the offset) must fail it."""
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_files.source_dir(), copy)
    body = copy / "kv_write_body.inc"
    old = "gbx_kv_quantize_group<T, BITS, GS, LS, ITERS, false>(keys + gbx_gid * GS, nullptr,"
    assert old in body.read_text(), "update the planted error: kv_write_body.inc changed"
    body.write_text(body.read_text().replace(old, old.replace("nullptr", "key_offset9")))
    script = Path(__file__).resolve().parent.parent / "scripts" / "check_metal_syntax.py"
    proc = subprocess.run([sys.executable, str(script), "--source-dir", str(copy)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "FAIL metal nobias" in proc.stdout and "key_offset9" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-2000:]


# -- the CUDA twin (only with a CUDA GPU) -------------------------------------------------

#: Every width at group 64 in float16, the other groups and dtypes at 4 bits (each case
#: compiles its own kernel through NVRTC, seconds apiece).
CUDA_CASES = sorted({(bits, 64, mx.float16, q) for bits in BITS for q in ("minmax", "ls")}
                    | {(4, gs, dtype, q) for gs in GROUPS for dtype in DTYPES for q in ("minmax", "ls")},
                    key=str)
#: Least squares on a GPU: the kernel's total squared error over MLX's path's, at most.
GPU_TOTAL_RTOL = 0.01
#: At 8 bits a group's error is near what float16's rounding of its scale adds, and a
#: refit judged by the kernel's float32 error can miss MLX's min-max grid by more
#: (measured on an H200: at most 7.4% in 13 of 8,192 float16 groups; total +0.13%).
RECON_RTOL_8BIT = 0.10


@needs_cuda
@pytest.mark.parametrize("bits, gs, dtype, quantizer", CUDA_CASES,
                         ids=[f"q{b}-g{g}-{str(d).split('.')[-1]}-{q}" for b, g, d, q in CUDA_CASES])
def test_cuda_fused_write_matches_the_oracle(bits, gs, dtype, quantizer):
    i = CUDA_CASES.index((bits, gs, dtype, quantizer))
    for shape, with_offset in (((1, 8, 1, 128), True), ((2, 3, 17, 128), False), ((1, 8, 512, 128), True)):
        keys, values, offset = make_case(shape, dtype, with_offset, seed=i)
        got = write_kernel.fused_write(keys, values, offset, gs, bits, quantizer, backend="cuda")
        if quantizer == "ls":
            assert_ls_as_good_on_gpu(got, keys, values, offset, gs, bits, what=f"cuda {shape}")
        if quantizer == "minmax":
            # MLX's own CUDA quantize, bit for bit (min-max has no sums).
            want = write_kernel.reference_write(keys, values, offset, gs, bits, quantizer)
            for g, w in zip(got, want):
                for a, b in zip(g, w):
                    assert mx.array_equal(a, b)


@needs_cuda
def test_cuda_write_picks_the_kernel_and_keeps_odd_head_dims():
    assert write_kernel.available()
    keys, values, offset = make_case((1, 3, 5, 64), mx.bfloat16, True, seed=4, v_dim=128)
    got = write_kernel.write(keys, values, offset, 64, 4, "ls")
    assert_ls_as_good_on_gpu(got, keys, values, offset, 64, 4, what="cuda write")
    # a non-contiguous view (heads and steps transposed), as a model's projections give
    kt = (keys.swapaxes(1, 2) * 1).swapaxes(1, 2)
    assert kt.shape == keys.shape
    got_t = write_kernel.write(kt, values, offset, 64, 4, "ls")
    for g, w in zip(got_t, got):
        assert all(mx.array_equal(a, b) for a, b in zip(g, w))
