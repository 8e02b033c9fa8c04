"""The block-sparse GPU body (metal_kernels/sparse_gemv_body.inc), run on the host through the
CUDA prelude's emulation (metal_kernels/check/host_emulation.h): against the pure-MLX reference, over
odd shapes, group sizes, dtypes and kept sets; it never reads a dropped group. Names and sources.
Where MLX has a CUDA GPU, the same cases (and Llama-3-8B's down_proj at several sparsities) run on it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import host_emulation
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from gearbx_mlx.bindings import gpu, kernel_files, sparse_gpu

HAS_CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="MLX has no CUDA GPU on this machine")

HOST_TYPES = {mx.float32: "float", mx.float16: "gbx_half_t", mx.bfloat16: "gbx_bfloat_t"}
#: (x dtype, scale dtype, group size, rows, bias)
HOST_CONFIGS = [
    (mx.float32, mx.float32, 64, 2, False),
    (mx.float16, mx.float16, 128, 1, True),
    (mx.bfloat16, mx.bfloat16, 64, 4, True),
    (mx.float32, mx.float16, 128, 2, False),
]
#: (out, in, kept groups) including rows past a threadgroup's and no group kept.
CASES = [(17, 320, [0, 2, 4]), (70, 1536, list(range(0, 24, 3))), (1, 128, [1]), (33, 256, []),
         (130, 640, list(range(10)))]
#: Relative to sum |w x| over the kept groups: float32 sums in another order, and y rounded to the x dtype.
TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _host_kernel(i: int, config, directory: Path):
    dtype, sdtype, gs, rows, bias = config
    t, s = HOST_TYPES[dtype], HOST_TYPES[sdtype]
    params = [f"const {t}* x", "const uint32_t* w", "Shape w_shape", f"const {s}* s", f"const {s}* b",
              "const uint32_t* blocks", "Shape blocks_shape"] + ([f"const {t}* bias"] if bias else []) + [f"{t}* y"]
    _, body = sparse_gpu.kernel_sources("cuda", bias, directory)
    body = body.replace(gpu.backend_files("cuda", directory)[1], "GBX_HOST_ENTRY\n")
    decl = "".join(f"  using {k} = {HOST_TYPES[v]};\n" if isinstance(v, mx.Dtype) else f"  constexpr int {k} = {v};\n"
                   for k, v in sparse_gpu.constants(dtype, gs, rows))
    kernel = f"void kernel_{i}({', '.join(params)}) {{\n{decl}{body}\n}}\n"
    args = [f"(const {t}*)f[\"x\"].data()", "(const uint32_t*)f[\"w\"].data()", "ws", f"(const {s}*)f[\"s\"].data()",
            f"(const {s}*)f[\"b\"].data()", "(const uint32_t*)f[\"blocks\"].data()", "bs"]
    args += ([f"(const {t}*)f[\"bias\"].data()"] if bias else []) + [f"({t}*)y.data()"]
    call = f"    case {i}: gbx_emu_launch((O + {8 * rows - 1}) / {8 * rows}, [&] {{ kernel_{i}({', '.join(args)}); }}); break;"
    return kernel, call


def host_unit(directory: Path) -> str:
    d = Path(directory)
    parts = [(d / kernel_files.FORMAT_HEADER).read_text(), (d / "check/host_emulation.h").read_text(),
             (d / "gemv_common.h").read_text(),
             "#include <map>\n#include <string>\nusing Shape = std::array<int, 10>;"]
    calls = []
    for i, config in enumerate(HOST_CONFIGS):
        kernel, call = _host_kernel(i, config, d)
        parts.append(kernel)
        calls.append(call)
    parts.append("""
int main(int argc, char** argv) {
  const int config = std::atoi(argv[1]), O = std::atoi(argv[2]);
  const std::string dir = argv[3];
  const int y_bytes = std::atoi(argv[4]);
  std::map<std::string, std::vector<char>> f;
  for (const char* name : {"x", "w", "s", "b", "blocks", "bias"})
    f[name] = gbx_host_slurp(dir + "/" + name + ".bin");
  std::vector<char> y(size_t(O) * y_bytes);
  Shape ws{}, bs{};
  ws[0] = O; ws[1] = int(f["w"].size() / 4) / O;
  bs[0] = int(f["blocks"].size() / 4);
  switch (config) {
""" + "\n".join(calls) + """
    default: return 2;
  }
  gbx_host_spill(dir + "/y.bin", y);
  return 0;
}
""")
    return "\n".join(parts)


#: The module's tests run in one pytest-xdist worker: the binary compiles once.
pytestmark = pytest.mark.xdist_group("sparse-gpu-host-binary")


@pytest.fixture(scope="module")
def host_binary() -> Path:
    return host_emulation.build(host_unit(kernel_files.source_dir()), "sparse", "sparse")


def _parts(out: int, inp: int, config, seed: int):
    dtype, sdtype, gs, _, bias = config
    mx.random.seed(seed)
    lin = nn.Linear(inp, out, bias=bias)
    q = nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=4)
    from gearbx_mlx.speculative.sparse import QuantParts

    return QuantParts(q.weight, q.scales.astype(sdtype), q.biases.astype(sdtype),
                      q.bias.astype(dtype) if bias else None, 4, gs)


def run_host(binary: Path, tmp: Path, i: int, parts, x: mx.array, blocks: np.ndarray) -> np.ndarray:
    arrays = {"x": x, "w": parts.weight, "s": parts.scales, "b": parts.biases,
              "blocks": mx.array(blocks.astype(np.uint32)), "bias": parts.bias}
    for name, a in arrays.items():
        if a is not None:
            mx.eval(a)
        (tmp / f"{name}.bin").write_bytes(b"" if a is None else bytes(memoryview(a)))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the sanitizer's runtime loads first
    out = parts.weight.shape[0]
    proc = subprocess.run([str(binary), str(i), str(out), str(tmp), str(x.dtype.size)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    raw = (tmp / "y.bin").read_bytes()
    y = mx.array(np.frombuffer(raw, np.float32)) if x.dtype == mx.float32 else \
        mx.array(np.frombuffer(raw, np.uint16)).view(x.dtype)
    return np.array(y.astype(mx.float32))


def _check(y: np.ndarray, parts, x: mx.array, blocks: np.ndarray, dtype) -> None:
    with mx.stream(mx.cpu):  # MLX's CUDA quantized_matmul takes no float32 activations
        _check_here(y, parts, x, blocks, dtype)


def _check_here(y: np.ndarray, parts, x: mx.array, blocks: np.ndarray, dtype) -> None:
    xf = x.astype(mx.float32).reshape(1, -1)
    ref32 = sparse_gpu.reference(xf, parts, mx.array(blocks.astype(np.uint32))) if blocks.size else (
        parts.bias.astype(mx.float32).reshape(1, -1) if parts.bias is not None else mx.zeros((1, y.size)))
    w = np.abs(np.array(mx.dequantize(parts.weight, parts.scales.astype(mx.float32),
                                      parts.biases.astype(mx.float32), group_size=parts.group_size, bits=4)))
    mask = np.zeros(w.shape[1], np.float32)
    for g in blocks:
        mask[g * parts.group_size:(g + 1) * parts.group_size] = 1
    mag = w @ (np.abs(np.array(xf)).reshape(-1) * mask) + (np.abs(np.array(ref32)).reshape(-1))
    assert (np.abs(y - np.array(ref32).reshape(-1)) <= TOL[dtype] * mag + 1e-6).all()


@pytest.mark.parametrize("config", range(len(HOST_CONFIGS)))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_host_emulated_body_matches_the_reference(host_binary, tmp_path, config, case):
    cfg = HOST_CONFIGS[config]
    out, inp, kept = CASES[case]
    if inp % cfg[2]:
        pytest.skip(f"K={inp} is not a multiple of group {cfg[2]}")
    blocks = np.array([g for g in kept if g < inp // cfg[2]], np.int64)
    parts = _parts(out, inp, cfg, seed=config * 10 + case)
    x = mx.random.normal((inp,), key=mx.random.key(case)).astype(cfg[0])
    _check(run_host(host_binary, tmp_path, config, parts, x, blocks), parts, x, blocks, cfg[0])


def test_host_emulated_body_never_reads_a_dropped_group(host_binary, tmp_path):
    """NaN scales and biases in every dropped group change nothing."""
    cfg = HOST_CONFIGS[0]
    parts = _parts(40, 512, cfg, seed=3)
    blocks = np.array([1, 4, 6])
    x = mx.random.normal((512,), key=mx.random.key(9))
    want = run_host(host_binary, tmp_path, 0, parts, x, blocks)
    s, b = np.array(parts.scales), np.array(parts.biases)
    drop = np.setdiff1d(np.arange(8), blocks)
    s[:, drop], b[:, drop] = np.nan, np.nan
    poisoned = type(parts)(parts.weight, mx.array(s), mx.array(b), None, 4, 64)
    np.testing.assert_array_equal(run_host(host_binary, tmp_path, 0, poisoned, x, blocks), want)


def test_kernel_names_carry_every_parameter():
    names = {sparse_gpu.kernel_name(b, g, r, d, s, bias) for b in ("metal", "cuda") for g in (64, 128)
             for r in (1, 2) for d in (mx.float16, mx.float32) for s in (mx.float16,) for bias in (False, True)}
    assert len(names) == 32
    assert sparse_gpu.launch_spec(17, 2) == {"grid": (2 * 256, 1, 1), "threadgroup": (256, 1, 1)}


def test_unsupported_weights_and_no_gpu_fall_back():
    parts = _parts(8, 256, (mx.float32, mx.float32, 64, 2, False), seed=0)
    assert sparse_gpu.unsupported(parts, mx.float32) is None
    assert "4-bit" in sparse_gpu.unsupported(type(parts)(parts.weight, parts.scales, parts.biases, None, 8, 64),
                                             mx.float32)
    if gpu.gpu_backend() is None:  # the CPU: the caller takes the reference
        assert sparse_gpu.sparse_gemv(mx.zeros((1, 256)), parts, mx.array([0, 2])) is None


# -- on a CUDA GPU ---------------------------------------------------------------------


def _blocks(kept, inp: int, gs: int) -> np.ndarray:
    return np.array([g for g in kept if g < inp // gs], np.int64)


@needs_cuda
@pytest.mark.parametrize("config", range(len(HOST_CONFIGS)))
def test_cuda_body_matches_the_reference(config):
    """Every odd case of the host emulation, on the GPU, one compiled variant per config."""
    cfg = HOST_CONFIGS[config]
    ran = 0
    for case, (out, inp, kept) in enumerate(CASES):
        if inp % cfg[2]:
            continue
        blocks = _blocks(kept, inp, cfg[2])
        parts = _parts(out, inp, cfg, seed=config * 10 + case)
        x = mx.random.normal((inp,), key=mx.random.key(case)).astype(cfg[0])
        y = sparse_gpu.sparse_gemv(x.reshape(1, -1), parts, mx.array(blocks.astype(np.uint32)), rows=cfg[3])
        assert y is not None and y.shape == (1, out) and y.dtype == cfg[0], (case, y)
        _check(np.array(y.astype(mx.float32)).reshape(-1), parts, x, blocks, cfg[0])
        ran += 1
    assert ran


@needs_cuda
@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.5, 0.9])
def test_cuda_body_on_the_llama3_down_proj(sparsity):
    """Llama-3-8B's down_proj (4096 x 14336, g64, bfloat16) over a random kept set."""
    cfg = (mx.bfloat16, mx.bfloat16, 64, sparse_gpu.ROWS, False)
    parts = _parts(4096, 14336, cfg, seed=7)
    nb = 14336 // 64
    rng = np.random.default_rng(int(sparsity * 100))
    blocks = np.sort(rng.choice(nb, size=max(1, round(nb * (1 - sparsity))), replace=False))
    x = mx.random.normal((14336,), key=mx.random.key(5)).astype(mx.bfloat16)
    y = sparse_gpu.sparse_gemv(x.reshape(1, -1), parts, mx.array(blocks.astype(np.uint32)))
    assert y is not None
    _check(np.array(y.astype(mx.float32)).reshape(-1), parts, x, blocks, mx.bfloat16)


@needs_cuda
def test_cuda_body_never_reads_a_dropped_group():
    cfg = HOST_CONFIGS[0]
    parts = _parts(40, 512, cfg, seed=3)
    blocks = mx.array(np.array([1, 4, 6], np.uint32))
    x = mx.random.normal((1, 512), key=mx.random.key(9))
    want = np.array(sparse_gpu.sparse_gemv(x, parts, blocks))
    s, b = np.array(parts.scales), np.array(parts.biases)
    drop = np.setdiff1d(np.arange(8), [1, 4, 6])
    s[:, drop], b[:, drop] = np.nan, np.nan
    poisoned = type(parts)(parts.weight, mx.array(s), mx.array(b), None, 4, 64)
    np.testing.assert_array_equal(np.array(sparse_gpu.sparse_gemv(x, poisoned, blocks)), want)
