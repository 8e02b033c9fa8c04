"""The Metal syntax check (scripts/check_metal_syntax.py) passes, and can fail.

Skipped where clang is missing; CI installs it (apt-get install -y clang).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gearbx_mlx.bindings import kernel_files

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_metal_syntax.py"

pytestmark = pytest.mark.skipif(shutil.which("clang") is None,
                                reason="clang not installed (apt-get install -y clang)")


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=300)


def planted_copy(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of the kernel sources with one edit in file `name` (relative to metal_kernels/)."""
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_files.source_dir(), copy)
    text = (copy / name).read_text()
    assert old in text, f"{old!r} not in {name}: update the test"
    (copy / name).write_text(text.replace(old, new, 1))
    return copy


def test_metal_sources_compile():
    proc = run_check()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok   metal" in proc.stdout


def test_cuda_twin_compiles_with_clang():
    proc = run_check("--cuda", "--no-nvcc")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_planted_syntax_error_in_the_body_fails(tmp_path):
    # Drop the semicolon after the declaration of K.
    copy = planted_copy(tmp_path, "gemv_body.inc", "gbx_words * GBX_EPW;", "gbx_words * GBX_EPW")
    proc = run_check("--source-dir", str(copy))
    assert proc.returncode == 1
    assert "FAIL metal" in proc.stdout and "error" in proc.stdout


def test_a_planted_error_in_the_nested_body_fails(tmp_path):
    # Read a plane the kernel has no buffer for: the nested body is checked too.
    copy = planted_copy(tmp_path, "nested_gemv_body.inc", "const GBX_DEVICE S* gbx_s0 = s0;",
                        "const GBX_DEVICE S* gbx_s0 = s9;")
    proc = run_check("--source-dir", str(copy))
    assert proc.returncode == 1 and "s9" in proc.stdout


def test_a_planted_type_error_in_the_metal_prelude_fails(tmp_path):
    # A Metal spelling that does not exist: the prelude is checked too.
    copy = planted_copy(tmp_path, "prelude_metal.h", "metal::simd_sum(v)", "metal::simd_summ(v)")
    proc = run_check("--source-dir", str(copy))
    assert proc.returncode == 1 and "simd_summ" in proc.stdout


@pytest.mark.slow
def test_built_wheel_ships_the_kernel_sources(tmp_path):
    """metal_kernels/ is top level in the checkout: the wheel must carry what the
    GPU loaders read (the format header and the bodies) as gearbx_mlx/metal_kernels."""
    import os
    import zipfile

    env = dict(os.environ, GEARBX_NO_CPU_EXT="1")
    proc = subprocess.run(
        # Build isolation, as a user's pip would: a fresh venv's setuptools may
        # lack bdist_wheel.
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
         "-q", "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("from gearbx_mlx.bindings import kernel_files, packed_gpu; d = kernel_files.source_dir(); "
            "assert str(d).startswith(%r), d; packed_gpu.kernel_sources('metal', True); "
            "packed_gpu.kernel_sources('cuda', False); packed_gpu.kernel_sources('metal', False, mma=True); "
            "from gearbx_mlx.bindings import nested_gpu; nested_gpu.kernel_sources('cuda', 3, True); "
            "print(d)" % str(site))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(env, PYTHONPATH=str(site)), timeout=120)
    assert run.returncode == 0, run.stderr
    proc = run_check("--source-dir", run.stdout.strip())
    assert proc.returncode == 0, proc.stdout
