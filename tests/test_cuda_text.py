"""The CUDA kernels' text handed to MLX through files (gearbx_mlx/bindings/cuda_text.py): the
files hold exactly the text, the short text MLX hashes names them, a damaged file is rewritten
before use, MLX still finds the shape arguments the body uses, and an unwritable cache falls back
to a private folder. Where MLX has a CUDA GPU, a kernel built through the files runs and matches."""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx
import pytest

from gearbx_mlx.bindings import cuda_text, gpu, nested_gpu, packed_gpu

HAS_CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()


def expand(text: str) -> str:
    """What NVRTC's preprocessor reads: each ``#include "file"`` line replaced by the file."""
    def one(m: re.Match) -> str:
        return Path(m.group(1)).read_text(encoding="utf-8")
    return re.sub(r'^#include "([^"]+)"\n', one, text, flags=re.M)


def real_texts():
    """The header and body of every kernel family, as the package hands them to MLX."""
    yield "nested", nested_gpu.input_names(3, True), *nested_gpu.kernel_sources("cuda", 3, True, compact=True)
    yield "packed", packed_gpu.input_names(True), *packed_gpu.kernel_sources("cuda", True, compact=True)


@pytest.mark.parametrize("family", ["nested", "packed"])
def test_files_hold_the_text_and_the_short_text_names_them(tmp_path, family):
    _, names, header, source = next(t for t in real_texts() if t[0] == family)
    short_header, short_source = cuda_text.include_text("gbx_k", names, header, source, tmp_path)
    assert expand(short_header) == header
    # the body: the marker comment, then exactly the body
    marker, rest = short_source.split("\n", 1) if short_source.startswith("//") else ("", short_source)
    assert expand(rest) == source
    # what MLX hashes on every call is a few hundred bytes, not the 10-25 KB of text
    assert len(short_header) + len(short_source) < 600 < len(header) + len(source)
    assert len(list(tmp_path.iterdir())) == 2


def test_mlx_still_finds_the_shape_arguments_the_body_uses(tmp_path):
    # MLX passes x_shape etc. only where the text it searches contains the name
    source = "int n = w_shape[0];\nint m = keys_strides[1] + keys_ndim; int q = nothing_shape;\n"
    _, short = cuda_text.include_text("k", ["w", "keys", "x"], "", source, tmp_path)
    for used in ("w_shape", "keys_strides", "keys_ndim"):
        assert used in short
    for unused in ("x_shape", "nothing_shape", "w_strides"):
        assert unused not in short
    assert cuda_text.shape_markers(["x"], "y = x[0];") == ""
    # the real packed body reads w_shape: the marker must carry it
    _, names, header, body = next(t for t in real_texts() if t[0] == "packed")
    assert "w_shape" in body and "w_shape" in cuda_text.include_text("p", names, header, body, tmp_path)[1]


def test_a_damaged_or_stale_file_is_rewritten_before_use(tmp_path):
    header, source = "#define A 1\n", "y[0] = A;\n"
    _, short = cuda_text.include_text("k", [], header, source, tmp_path)
    body_file = Path(re.search(r'#include "([^"]+)"', short).group(1))
    body_file.write_text("y[0] = 666;\n")  # same name, other text: never compiled as it is
    again = cuda_text.include_text("k", [], header, source, tmp_path)[1]
    assert again == short and body_file.read_text() == source
    body_file.write_bytes(b"\xff\xfe not text")
    cuda_text.include_text("k", [], header, source, tmp_path)
    assert body_file.read_text() == source
    # another text gets another file: a stale file of an older package is never reused
    other = cuda_text.include_text("k", [], header, "y[0] = 2;\n", tmp_path)[1]
    assert other != short and len([p for p in tmp_path.iterdir() if p.suffix == ".inc"]) == 2


def test_a_cache_that_cannot_hold_the_folder_falls_back_to_a_private_folder(tmp_path):
    cuda_text.text_dir.cache_clear()
    try:
        (tmp_path / cuda_text.FOLDER).write_text("a file where the folder would be")
        folder = cuda_text.text_dir(str(tmp_path))
        assert tmp_path not in folder.parents and folder.is_dir()
        assert os.stat(folder).st_mode & 0o077 == 0  # only this user can plant a kernel there
        assert cuda_text.text_dir(str(tmp_path)) == folder  # one per process
    finally:
        cuda_text.text_dir.cache_clear()


def test_an_unwritable_folder_given_falls_back_for_that_call(tmp_path):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    header, source = cuda_text.include_text("k", [], "#define A 1\n", "y[0] = A;\n", blocked)
    assert expand(header) == "#define A 1\n" and str(blocked) not in header + source


def test_a_cache_path_that_cannot_be_quoted_falls_back(tmp_path):
    cuda_text.text_dir.cache_clear()
    try:
        odd = tmp_path / 'a"b'
        folder = cuda_text.text_dir(str(odd))
        assert '"' not in str(folder)
    finally:
        cuda_text.text_dir.cache_clear()


def test_only_the_cuda_build_goes_through_files(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_text, "include_text", lambda *a, **k: calls.append(a) or ("H", "S"))
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: kw, raising=False)
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: kw)
    gpu.build.cache_clear()
    try:
        built = gpu.build("cuda", "n", ("x",), ("y",), "header", "source")
        assert (built["header"], built["source"]) == ("H", "S") and calls[0][0] == "n"
        metal = gpu.build("metal", "n", ("x",), ("y",), "header", "source")
        assert (metal["header"], metal["source"]) == ("header", "source") and len(calls) == 1
    finally:
        gpu.build.cache_clear()


@pytest.mark.skipif(not HAS_CUDA, reason="MLX has no CUDA GPU on this machine")
def test_a_kernel_built_through_files_runs_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARBX_CACHE", str(tmp_path))
    cuda_text.text_dir.cache_clear()
    gpu.build.cache_clear()
    try:
        kernel = gpu.build("cuda", "gbx_cuda_text_probe", ("x",), ("y",), "#define GBX_TWO 2.0f\n",
                           "int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                           "if (i < x_shape[0]) y[i] = x[i] * GBX_TWO;\n")
        x = mx.arange(1000, dtype=mx.float32)
        (y,) = kernel(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
                      grid=(1024, 1, 1), threadgroup=(256, 1, 1))
        assert mx.array_equal(y, 2 * x).item()
        assert any((tmp_path / cuda_text.FOLDER).iterdir())
    finally:
        cuda_text.text_dir.cache_clear()
        gpu.build.cache_clear()
