"""NEON kernels, cross-compiled for AArch64 and run under qemu-aarch64.

Each build runs ``gearbx_mlx/bindings/csrc/test_main.c``, which checks every fast kernel against
the scalar oracles (bit-exact on integer data, within a tolerance on float
data) and reports ``OK`` or ``MISMATCH`` lines.

CI needs the cross tools:
    apt-get update && apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest
from cbuild import build_exe

from gearbx_mlx.bindings import build

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / p for p in build.SOURCES + (build.TEST_DRIVER,)]
CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
APT = "apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"

# In one pytest-xdist worker: the binaries fixture builds every variant once.
pytestmark = [
    pytest.mark.skipif(shutil.which(CC) is None or shutil.which(QEMU) is None, reason=f"needs {CC} and {QEMU} ({APT})"),
    pytest.mark.xdist_group("neon-binaries"),
]

# name -> extra flags; -march=armv8-a builds still carry the dotprod kernels
# (per-function target) and must pick them only where the CPU has dotprod.
BUILDS: Dict[str, List[str]] = {
    "dotprod": ["-march=armv8.2-a+dotprod"],
    "baseline": ["-march=armv8-a"],
    "no_dotprod": ["-march=armv8-a", "-DGEARBX_NO_DOTPROD"],
    "planted_bug": ["-march=armv8.2-a+dotprod", "-DGEARBX_PLANT_NIBBLE_BUG"],
    "planted_bug_no_dotprod": ["-march=armv8-a", "-DGEARBX_NO_DOTPROD", "-DGEARBX_PLANT_NIBBLE_BUG"],
    "planted_six": ["-march=armv8-a", "-DGEARBX_PLANT_SIX_BUG"],
}


@pytest.fixture(scope="session")  # built once per worker (the module runs in one)
def binaries(tmp_path_factory: pytest.TempPathFactory, c_objects: Path) -> Dict[str, Path]:
    out = tmp_path_factory.mktemp("neon")
    built = {}
    for name, flags in BUILDS.items():
        exe = out / f"gbx_{name}"
        r = build_exe(CC, ["-O3", "-std=gnu11", "-static", "-pthread", "-Wall", *flags, *build.include_flags()],
                      SOURCES, exe, c_objects)
        assert r.returncode == 0, f"{' '.join(r.args)}\n{r.stderr}"
        built[name] = exe
    return built


def run(exe: Path, cpu: str = "") -> subprocess.CompletedProcess:
    cmd = [QEMU] + (["-cpu", cpu] if cpu else []) + [str(exe), "--quick"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def isa_line(r: subprocess.CompletedProcess) -> str:
    return r.stdout.splitlines()[0] if r.stdout else ""


def assert_ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"driver failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
    assert "MISMATCH" not in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("OK ")


def test_dotprod_build_matches_reference(binaries: Dict[str, Path]) -> None:
    r = run(binaries["dotprod"])
    assert_ok(r)
    assert "float=neon intdot=neon-dotprod" in isa_line(r)


def test_baseline_build_picks_dotprod_at_run_time(binaries: Dict[str, Path]) -> None:
    r = run(binaries["baseline"])  # qemu's default CPU has dotprod
    assert_ok(r)
    assert "intdot=neon-dotprod" in isa_line(r)


def test_baseline_build_runs_on_cpu_without_dotprod(binaries: Dict[str, Path]) -> None:
    # Cortex-A72 has no sdot: the run-time check must route to vmull/vpadal,
    # and no compiler-made sdot may hide elsewhere (it would be SIGILL here).
    r = run(binaries["baseline"], cpu="cortex-a72")
    assert_ok(r)
    assert "intdot=neon dotprod_compiled=1 dotprod_cpu=0" in isa_line(r)


def test_build_without_dotprod_kernels(binaries: Dict[str, Path]) -> None:
    r = run(binaries["no_dotprod"])
    assert_ok(r)
    assert "intdot=neon dotprod_compiled=0" in isa_line(r)


@pytest.mark.parametrize("name", ["planted_bug", "planted_bug_no_dotprod"])
def test_planted_nibble_order_bug_is_caught(binaries: Dict[str, Path], name: str) -> None:
    r = run(binaries[name])
    assert r.returncode != 0, "a swapped nibble order went unnoticed"
    summary = [ln for ln in r.stdout.splitlines() if ln.startswith("SUMMARY ")]
    # every 4-bit fast path must be caught (packed int4 and nested planes);
    # 8-bit kernels have no nibbles and must pass
    assert any(ln.startswith("SUMMARY float bits=4 ") for ln in summary), r.stdout[-2000:]
    assert any(ln.startswith("SUMMARY intdot bits=4 ") for ln in summary), r.stdout[-2000:]
    assert any(ln.startswith("SUMMARY nested-float bits=4 ") for ln in summary), r.stdout[-2000:]
    assert any(ln.startswith("SUMMARY nested-intdot bits=4 ") for ln in summary), r.stdout[-2000:]
    assert not any(" bits=8 " in ln for ln in summary), r.stdout[-2000:]


def test_planted_six_bit_order_bug_is_caught(binaries: Dict[str, Path]) -> None:
    """Codes of each 3-byte triplet read in reverse by the NEON 6-bit float
    kernel: its cases must fail; the 6-bit intdot planes (the scalar kernel on
    NEON) and every other width must pass."""
    r = run(binaries["planted_six"])
    assert r.returncode != 0, "a reversed 6-bit code order went unnoticed"
    summary = [ln for ln in r.stdout.splitlines() if ln.startswith("SUMMARY ")]
    assert any(ln.startswith("SUMMARY nested-float bits=6 ") for ln in summary), r.stdout[-2000:]
    assert not any("intdot" in ln or " bits=4 " in ln or " bits=8 " in ln for ln in summary), r.stdout[-2000:]
