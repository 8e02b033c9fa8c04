"""The BLAS check of gearbx_mlx.blas: which library MLX's products call, the one
restart onto an optimized OpenBLAS, the notice where none is installed, the
loop guard and the opt-out. Real processes: a child restarts itself for real."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gearbx_mlx import blas

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the restart is for Linux")


def test_the_library_mlx_calls_is_found_and_named():
    path = blas.mlx_blas()
    if sys.platform != "linux":
        assert path is None and blas.optimized() is (sys.platform == "darwin")
        return
    assert path is not None and Path(path).is_file()
    assert blas.optimized() is blas.is_optimized_path(path)
    assert blas.is_optimized_path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so")
    assert not blas.is_optimized_path("/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0")


def _call(env, libraries, fast=False):
    calls, out = [], io.StringIO()
    got = blas.ensure_fast_blas(None, environ=env, execv=lambda exe, argv: calls.append((exe, argv)),
                                stream=out, libraries=libraries, is_fast=lambda: fast)
    return got, calls, out.getvalue()


@linux_only
def test_restarts_with_the_library_preloaded_where_it_exists(tmp_path):
    lib = blas.debian_openblas()
    if not blas.loadable(lib):
        pytest.skip(f"{lib} is not installed")
    env = {"LD_PRELOAD": "/other.so"}
    got, calls, text = _call(env, [tmp_path / "missing.so", lib])
    assert got == "restarted" and text == ""
    assert env["LD_PRELOAD"] == f"{lib}:/other.so" and env[blas.REEXEC_ENV] == "1"
    (exe, argv), = calls
    assert exe == sys.executable and argv[0] == sys.executable and argv[1:] == list(sys.orig_argv[1:])


@linux_only
@pytest.mark.parametrize("preload", [None, "/other.so"])
def test_a_restart_the_system_refuses_runs_on_with_the_notice(preload):
    """execv's PermissionError (an unprivileged user, a sandbox) was a traceback."""
    lib = blas.debian_openblas()
    if not blas.loadable(lib):
        pytest.skip(f"{lib} is not installed")
    env = {} if preload is None else {"LD_PRELOAD": preload}
    out = io.StringIO()

    def refused(exe, argv):
        raise PermissionError(13, "Permission denied")

    got = blas.ensure_fast_blas(None, environ=env, execv=refused, stream=out, libraries=[lib], is_fast=lambda: False)
    assert got == "notice" and out.getvalue().count("\n") == 1
    assert env == ({} if preload is None else {"LD_PRELOAD": preload})  # as it was


@linux_only
def test_prints_one_notice_where_no_library_exists(tmp_path):
    env = {}
    got, calls, text = _call(env, [tmp_path / "missing.so", tmp_path / "also-missing.so.0"])
    assert got == "notice" and calls == [] and "LD_PRELOAD" not in env
    assert text.count("\n") == 1 and f"apt-get install {blas.DEBIAN_PACKAGE}" in text
    assert f"LD_PRELOAD={blas.debian_openblas()}" in text and blas.OPT_OUT_ENV in text


@linux_only
def test_a_library_that_does_not_load_is_skipped(tmp_path):
    bad = tmp_path / "libopenblas.so.0"
    bad.write_bytes(b"not an ELF file")
    got, calls, _ = _call({}, [bad])
    assert got == "notice" and calls == []


@linux_only
def test_the_restarted_process_never_restarts_again():
    lib = blas.debian_openblas()
    got, calls, text = _call({blas.REEXEC_ENV: "1"}, [lib])
    assert got == "notice" and calls == [] and blas.DEBIAN_PACKAGE in text


@linux_only
def test_opt_out_fast_blas_and_in_process_calls_do_nothing(tmp_path):
    lib = blas.debian_openblas()
    assert _call({blas.OPT_OUT_ENV: "1"}, [lib]) == ("opted out", [], "")
    assert _call({}, [lib], fast=True) == ("fast", [], "")
    calls = []
    assert blas.ensure_fast_blas(["--prompt", "x"], environ={}, execv=lambda *a: calls.append(a),
                                 libraries=[lib], is_fast=lambda: False) == "in-process"
    assert calls == []


def test_candidates_put_the_users_library_first():
    got = blas.candidates({blas.LIBRARY_ENV: "/opt/mine/libopenblas.so"})
    assert got[0] == Path("/opt/mine/libopenblas.so") and got[1] == blas.debian_openblas()
    assert blas.candidates({})[0] == blas.debian_openblas()


CHILD = textwrap.dedent("""
    import os, sys
    from gearbx_mlx import blas
    print("start", os.environ.get(blas.REEXEC_ENV, "-"), flush=True)
    print("result", blas.ensure_fast_blas(), blas.optimized(), flush=True)
""")


def _child(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.OPT_OUT_ENV, blas.REEXEC_ENV)}
    env["PYTHONPATH"] = str(Path(blas.__file__).resolve().parent.parent)
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", CHILD], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines(), out.stderr


@linux_only
def test_a_real_process_restarts_once_onto_openblas():
    lib = blas.debian_openblas()
    if not blas.loadable(lib) or blas.is_optimized_path(blas.mlx_blas(preloaded=False) or "openblas"):
        pytest.skip(f"{lib} is not installed, or MLX links an optimized BLAS itself")
    lines, err = _child()
    assert lines == ["start -", "start 1", "result fast True"], (lines, err)
    assert blas.DEBIAN_PACKAGE not in err


@linux_only
def test_a_preload_that_brings_no_optimized_blas_restarts_once_then_notes():
    """The loop guard, for real: the library offered is MLX's own reference BLAS."""
    reference = blas.mlx_blas(preloaded=False)
    if reference is None or blas.is_optimized_path(reference):
        pytest.skip("MLX links an optimized BLAS itself")
    lines, err = _child(**{blas.LIBRARY_ENV: reference})
    assert lines == ["start -", "start 1", "result notice False"], (lines, err)
    assert err.count(blas.DEBIAN_PACKAGE) == 1
    lines, err = _child(**{blas.LIBRARY_ENV: reference, blas.OPT_OUT_ENV: "1"})
    assert lines == ["start -", "result opted out False"] and err == ""
