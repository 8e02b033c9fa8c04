"""metal_kernels/gearbx_format.h is the one definition of the weight formats.

It compiles as C and C++ (the C kernels; Metal and CUDA are C++, checked by
tests/test_metal_syntax.py), its static assertions fire on a broken constant,
and what Python states of the same formats agrees with it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from gearbx_mlx.bindings import kernel_files, nested_cpu, nested_gpu, packed_gpu
from gearbx_mlx.nested import planes
from gearbx_mlx.packed import formats

HEADER = kernel_files.source_dir() / kernel_files.FORMAT_HEADER


@pytest.fixture(scope="module")
def consts():
    return kernel_files.format_constants()


def test_packed_formats_agree_with_python(consts):
    assert consts["GBX_QMAX_INT4"] == formats.QMAX[4]
    assert consts["GBX_QMAX_INT8"] == formats.QMAX[8]
    assert consts["GBX_INT4_OFFSET"] == formats.OFFSET[4]
    lo, hi = consts["GBX_GROUP_MIN"], consts["GBX_GROUP_MAX"]
    powers = tuple(g for g in (1 << k for k in range(12)) if lo <= g <= hi)
    assert formats.GROUP_SIZES == powers == planes.GROUP_SIZES


def test_plane_constants_agree_with_python(consts):
    n = consts["GBX_MAX_PLANES"]
    planes.check_plan(((4, 64),) * n, 128)
    with pytest.raises(ValueError, match="one to three"):
        planes.check_plan(((4, 64),) * (n + 1), 128)
    kernel_bits = (consts["GBX_PLANE_BITS_LO"], consts["GBX_PLANE_BITS_6"], consts["GBX_PLANE_BITS_HI"])
    # every back end reads the same widths, and the default plan's among them
    assert tuple(sorted(kernel_bits)) == nested_cpu.NESTED_BITS == nested_gpu.NESTED_BITS
    assert all(b in kernel_bits for b, _ in planes.DEFAULT_PLAN)
    for bits in kernel_bits:
        assert bits in planes.PLANE_BITS
        w = mx.zeros((1, 64))
        q, _, _ = mx.quantize(w, group_size=64, bits=bits)
        assert q.dtype == mx.uint32 and q.shape[1] * consts["GBX_WORD_BITS"] == 64 * bits


def test_gpu_limits_come_from_the_header(consts):
    assert packed_gpu.SHARED_K == consts["GBX_SHARED_K"]
    assert packed_gpu.MMA_MAX_K == consts["GBX_MMA_MAX_K"]
    assert packed_gpu.supports_mma(4, None, consts["GBX_MMA_MAX_K"], 64, mx.bfloat16)
    assert not packed_gpu.supports_mma(4, None, consts["GBX_MMA_MAX_K"] + 64, 64, mx.bfloat16)
    with pytest.raises(AttributeError):
        packed_gpu.NOT_A_LIMIT  # noqa: B018


def test_parse_defines_reads_integers_only():
    text = "#define GBX_A 12 // a comment\n  #  define GBX_B 0x10\n#define GBX_F(x) (x)\n#define GBX_E (GBX_A + 1)\n"
    assert kernel_files.parse_defines(text) == {"GBX_A": 12, "GBX_B": 16}
    with pytest.raises(KeyError, match="GBX_NOPE"):
        kernel_files.format_constant("GBX_NOPE")


def test_gpu_header_starts_with_the_format():
    for backend in ("metal", "cuda"):
        header, _ = packed_gpu.kernel_sources(backend, False)
        assert header.startswith(HEADER.read_text())


def _compile(compiler: str, lang: list, text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    src = tmp_path / "t.c"
    src.write_text(text)
    return subprocess.run([compiler, *lang, "-fsyntax-only", "-Wall", "-Werror", str(src)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("compiler, lang", [("gcc", ["-x", "c", "-std=c11"]), ("g++", ["-x", "c++", "-std=c++14"])])
def test_header_compiles_alone_and_its_assertions_fire(tmp_path, compiler, lang):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    text = HEADER.read_text()
    ok = _compile(compiler, lang, text + "\nint gbx_probe = GBX_INT4_LO(0x9F) + GBX_INT4_HI(0x9F);\n", tmp_path)
    assert ok.returncode == 0, ok.stderr
    # A storage offset that no longer matches the int4 range must not build.
    broken = text.replace("#define GBX_INT4_OFFSET 8", "#define GBX_INT4_OFFSET 9")
    assert broken != text
    bad = _compile(compiler, lang, broken, tmp_path)
    assert bad.returncode != 0 and "int4 storage" in bad.stderr
