"""Which BLAS MLX's CPU products run on, and an optimized one for the command lines on Linux.

MLX's Linux CPU wheel links a reference BLAS (``mlx_cpu.libs/libblas-*.so``):
its float32 matrix products run at about one multiply-add per nanosecond, so a
prefill or a speculative verify of ``k + 1`` tokens costs about ``k + 1`` decode
steps. OpenBLAS preloaded (``LD_PRELOAD``) takes MLX's ``cblas_sgemm`` calls
and makes those products several times faster (``benchmarks/results/``).

:func:`optimized` tells whether the BLAS that MLX calls is an optimized one.
:func:`ensure_fast_blas`, called first thing by a command line's ``main``,
restarts the process once with an optimized OpenBLAS preloaded where one is
installed (Debian's ``libopenblas0-pthread``, another distribution's, or the
``cmeel-openblas`` wheel's), else prints one line with the fix. Nothing runs
at import.

Environment:
    GEARBX_NO_BLAS_PRELOAD=1: no restart and no notice.
    GEARBX_OPENBLAS=PATH: the library to preload (tried before the usual places).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import sys
import sysconfig
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TextIO

import mlx.core as mx

#: Set in the restarted process: it must not restart again.
REEXEC_ENV = "GEARBX_BLAS_REEXEC"
#: Set to 1 by a user who wants neither the restart nor the notice.
OPT_OUT_ENV = "GEARBX_NO_BLAS_PRELOAD"
#: A library to preload, tried first.
LIBRARY_ENV = "GEARBX_OPENBLAS"
#: Substrings of a BLAS library's resolved path that name an optimized implementation.
OPTIMIZED_NAMES = ("openblas", "mkl", "blis", "accelerate", "veclib", "armpl", "nvpl", "atlas")
#: The Debian/Ubuntu package whose library the restart preloads.
DEBIAN_PACKAGE = "libopenblas0-pthread"


def _triplet() -> str:
    return f"{platform.machine()}-linux-gnu"


def debian_openblas() -> Path:
    """Where Debian's ``libopenblas0-pthread`` puts the library on this architecture."""
    return Path(f"/usr/lib/{_triplet()}/openblas-pthread/libopenblas.so.0")


def candidates(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Optimized OpenBLAS libraries to preload, best first, whether they exist or not.

    ``$GEARBX_OPENBLAS``, Debian's pthread, OpenMP and serial builds, the
    usual paths of other distributions, and the ``cmeel-openblas`` wheel in
    this interpreter's site folders (its library needs the system's
    ``libgfortran.so.5``; the scipy-openblas wheels prefix their symbols, so
    preloading them changes nothing).
    """
    env = os.environ if environ is None else environ
    out = [Path(env[LIBRARY_ENV])] if env.get(LIBRARY_ENV) else []
    out.append(debian_openblas())
    out += [Path(f"/usr/lib/{_triplet()}/openblas-{v}/libopenblas.so.0") for v in ("openmp", "serial")]
    out += [Path("/usr/lib64/libopenblas.so.0"), Path("/usr/lib/libopenblas.so.0")]
    sites = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    out += [Path(s) / "cmeel.prefix" / "lib" / "libopenblas.so.0" for s in sorted(sites)]
    return out


def loadable(path: Path) -> bool:
    """True if ``path`` exists and the dynamic linker loads it (its own dependencies found)."""
    if not path.is_file():
        return False
    try:
        ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError:
        return False
    return True


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _libdl() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    if hasattr(libc, "dladdr"):
        return libc
    return ctypes.CDLL(ctypes.util.find_library("dl") or "libdl.so.2")


def _library_of(dl: ctypes.CDLL, handle: int | None, symbol: bytes) -> str | None:
    dl.dlsym.restype = ctypes.c_void_p
    dl.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    addr = dl.dlsym(handle, symbol)
    if not addr:
        return None
    info = _DlInfo()
    dl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dl.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def mlx_blas(preloaded: bool = True) -> str | None:
    """The resolved path of the library whose ``cblas_sgemm`` MLX's CPU products call (Linux),
    or None where it cannot be told (another system, or MLX not loaded as a shared library).

    A preloaded library comes first in the dynamic linker's search, so the
    global scope is asked first (unless ``preloaded`` is False: then the
    library MLX links itself), then MLX's own library and what it links.
    """
    if sys.platform != "linux":
        return None
    dl = _libdl()
    found = _library_of(dl, None, b"cblas_sgemm") if preloaded else None  # RTLD_DEFAULT: preloaded, global
    if found:
        return found
    lib = Path(mx.__file__).parent / "lib" / "libmlx.so"
    if not lib.is_file():
        return None
    try:
        handle = ctypes.CDLL(str(lib), mode=os.RTLD_LAZY | getattr(os, "RTLD_NOLOAD", 0))._handle
    except OSError:
        return None
    return _library_of(dl, handle, b"cblas_sgemm")


def shown_path(path: str | None) -> str | None:
    """``path`` as a result file records it: a file of this Python's environment relative to ``<sys.prefix>``."""
    if path and path.startswith(sys.prefix.rstrip("/") + "/"):
        return "<sys.prefix>/" + path[len(sys.prefix.rstrip("/")) + 1:]
    return path


def is_optimized_path(path: str) -> bool:
    """True if a BLAS library's path names an optimized implementation (:data:`OPTIMIZED_NAMES`)."""
    low = path.lower()
    return any(name in low for name in OPTIMIZED_NAMES)


@functools.cache
def optimized() -> bool:
    """True if MLX's CPU float32 products run on an optimized BLAS (read once per process).

    macOS: Accelerate, always. Linux: by the library that provides MLX's
    ``cblas_sgemm`` (:func:`mlx_blas`). Elsewhere, or where that cannot be
    told: False.
    """
    if sys.platform == "darwin":
        return True
    path = mlx_blas()
    return path is not None and is_optimized_path(path)


def notice() -> str:
    """The one line that tells a Linux user how to get the fast BLAS."""
    return (f"[gearbx] note: MLX is using a reference BLAS, so prefill and speculative decoding on the CPU run "
            f"several times slower than they can; fix: apt-get install {DEBIAN_PACKAGE} (used automatically "
            f"from then on), or run with LD_PRELOAD={debian_openblas()} ({OPT_OUT_ENV}=1 hides this)")


def ensure_fast_blas(
    argv: Sequence[str] | None = None,
    *,
    environ: MutableMapping[str, str] | None = None,
    execv: Callable[[str, list[str]], object] = os.execv,
    stream: TextIO | None = None,
    libraries: Sequence[Path] | None = None,
    is_fast: Callable[[], bool] | None = None,
) -> str:
    """Restart this process once with an optimized OpenBLAS preloaded, where MLX would
    otherwise use a reference BLAS on Linux; call it first in a command line's ``main``.

    Args:
        argv: the command line's arguments as ``main`` got them: ``None`` when
            run as a program (the restart repeats the interpreter's own
            command line, ``sys.orig_argv``); a list (``main([...])`` called
            from Python) means an in-process call, which is never restarted.
        environ, execv, stream, libraries, is_fast: the process environment,
            ``os.execv``, ``sys.stderr``, :func:`candidates` and
            :func:`optimized` (tests replace them).

    Returns:
        What it did: ``"fast"`` (the BLAS is optimized, or not Linux),
        ``"opted out"``, ``"in-process"``, ``"notice"``, or (where ``execv``
        returns, in tests) ``"restarted"``.
    """
    env = os.environ if environ is None else environ
    if sys.platform != "linux" or env.get(OPT_OUT_ENV, "") not in ("", "0"):
        return "fast" if sys.platform != "linux" else "opted out"
    if argv is not None:
        return "in-process"
    if (is_fast or optimized)():
        return "fast"
    out = sys.stderr if stream is None else stream
    if not env.get(REEXEC_ENV):
        for lib in candidates(env) if libraries is None else libraries:
            if loadable(Path(lib)):
                pre = env.get("LD_PRELOAD")
                env["LD_PRELOAD"] = f"{lib}:{pre}" if pre else str(lib)
                env[REEXEC_ENV] = "1"
                out.flush()
                cmd = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
                try:
                    execv(sys.executable, [sys.executable, *cmd[1:]])
                except OSError:  # the interpreter cannot be run again (permissions, a sandbox): run as is
                    if pre is None:
                        env.pop("LD_PRELOAD", None)
                    else:
                        env["LD_PRELOAD"] = pre
                    env.pop(REEXEC_ENV, None)
                    break
                return "restarted"
    print(notice(), file=out, flush=True)
    return "notice"


__all__ = [
    "LIBRARY_ENV",
    "OPT_OUT_ENV",
    "REEXEC_ENV",
    "candidates",
    "debian_openblas",
    "ensure_fast_blas",
    "is_optimized_path",
    "loadable",
    "mlx_blas",
    "notice",
    "optimized",
]
