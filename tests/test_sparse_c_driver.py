"""The block-sparse C kernels' self-test driver (csrc/test_sparse_main.c): every fast path against its
scalar oracle, built for this machine and, cross-compiled, for AArch64 under qemu (NEON, with and
without dotprod); a planted nibble-order bug must fail both."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest
from cbuild import build_exe

from gearbx_mlx.bindings import build

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [str(ROOT / p) for p in build.SOURCES + (build.SPARSE_TEST_DRIVER,)]
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"


def _build(tmp: Path, objects: Path, cc: str, name: str, flags: List[str]) -> Path:
    exe = tmp / name
    r = build_exe(cc, ["-O3", "-std=gnu11", "-pthread", "-Wall", *flags, *build.include_flags()], SOURCES, exe, objects)
    assert r.returncode == 0, f"{' '.join(r.args)}\n{r.stderr[-3000:]}"
    return exe


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("gcc") is None or platform.system() != "Linux", reason="needs gcc on Linux")
@pytest.mark.parametrize("planted", [False, True])
def test_host_build_matches_its_oracles(tmp_path, c_objects, planted):
    exe = _build(tmp_path, c_objects, "gcc", "sparse", ["-DGEARBX_PLANT_NIBBLE_BUG"] if planted else [])
    r = _run([str(exe)])
    if planted:
        assert r.returncode == 1 and "MISMATCH" in r.stdout
    else:
        assert r.returncode == 0 and "MISMATCH" not in r.stdout, r.stdout[-3000:]
        assert r.stdout.strip().splitlines()[-1].startswith("OK ")


@pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which(QEMU) is None, reason=f"needs {CROSS} and {QEMU}")
@pytest.mark.parametrize("flags, cpu, isa, planted", [
    (["-march=armv8.2-a+dotprod"], "max", "neon-dotprod", False),
    (["-march=armv8-a"], "cortex-a72", "intdot neon", False),
    (["-march=armv8-a", "-DGEARBX_NO_DOTPROD"], "max", "intdot neon", False),
    (["-march=armv8.2-a+dotprod", "-DGEARBX_PLANT_NIBBLE_BUG"], "max", "neon-dotprod", True),
])
def test_neon_build_matches_its_oracles_under_qemu(tmp_path, c_objects, flags, cpu, isa, planted):
    exe = _build(tmp_path, c_objects, CROSS, "sparse_arm", ["-static", *flags])
    r = _run([QEMU, "-cpu", cpu, str(exe)])
    assert isa in r.stdout.splitlines()[0]
    if planted:
        assert r.returncode == 1 and "MISMATCH" in r.stdout
    else:
        assert r.returncode == 0 and "MISMATCH" not in r.stdout, r.stdout[-3000:]
