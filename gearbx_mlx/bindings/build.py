"""cffi build script (API mode) for the C kernels in ``gearbx_mlx/bindings/csrc/``.

The C sources sit next to this script; they include the one format header,
``metal_kernels/gearbx_format.h``, which is on the include path
(:data:`INCLUDE_DIRS`). Used two ways:

* at install time through ``setup.py`` (``cffi_modules`` names
  :func:`make_ffibuilder`), which builds the extension module
  ``gearbx_mlx.bindings._gearbx_cpu``;
* by hand, to build in place: ``python gearbx_mlx/bindings/build.py`` (or
  ``python setup.py build_ext --inplace``).

Per-platform flags (the C sources pick kernels with ``#if`` and run-time checks):

* x86_64: ``-O3`` only.  The AVX2/FMA kernels carry
  ``__attribute__((target("avx2,fma")))`` and are chosen at run time with
  ``__builtin_cpu_supports``; a global ``-mavx2`` would let the compiler put
  AVX2 into the scalar code too, so no run-time check could protect an old CPU.
* arm64 Linux, GCC: ``-O3`` only.  The ``vdotq_s32`` kernels are compiled per
  function and chosen from HWCAP at run time (a whole-file
  ``-march=armv8.2-a+dotprod`` makes GCC emit ``sdot`` in scalar loops too,
  which faults on a Cortex-A72).  Other compilers: ``-march=armv8.2-a+dotprod``
  when the compiler accepts it and this machine has dotprod.
* arm64 macOS: ``-mcpu=apple-m1``, as ``-Xarch_arm64 -mcpu=apple-m1`` in a
  universal2 build so that the x86_64 half never sees an arm64 flag.

``GEARBX_CPU_CFLAGS`` (space separated) is appended to the flags.
"""

from __future__ import annotations

import importlib.machinery
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from cffi import FFI

MODULE_NAME = "gearbx_mlx.bindings._gearbx_cpu"

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
#: The C sources' folder, relative to the checkout's root.
CSRC = "gearbx_mlx/bindings/csrc"
#: The library's C sources, relative to the checkout's root. Every file is
#: compiled on every platform: each arch/ file guards its body with the
#: instruction set it needs (csrc/internal.h), so a macOS universal2
#: build compiles the same list for both halves.
SOURCES = tuple(f"{CSRC}/{name}" for name in (
    "ref.c", "dispatch.c", "pool.c", "bandwidth.c", "nested.c", "unpack.c",
    "arch/x86/packed.c", "arch/x86/nested.c", "arch/arm/packed.c", "arch/arm/nested.c",
    "sparse.c", "arch/x86/sparse.c", "arch/arm/sparse.c",
))
#: The self-test driver (not in the extension): built by the tests with SOURCES.
TEST_DRIVER = f"{CSRC}/test_main.c"
#: The block-sparse kernels' self-test driver (likewise).
SPARSE_TEST_DRIVER = f"{CSRC}/test_sparse_main.c"
#: Include folders, relative to the root: the C headers, and the format header's folder.
INCLUDE_DIRS = (CSRC, "metal_kernels")
#: Headers a change of which must rebuild the extension.
HEADERS = ("metal_kernels/gearbx_format.h",) + tuple(f"{CSRC}/{name}" for name in (
    "gearbx_cpu.h", "internal.h", "arch/x86/simd.h", "arch/arm/simd.h", "gearbx_sparse.h", "sparse_internal.h",
))

# What Python sees of csrc/gearbx_cpu.h.  API mode checks it against the
# real header when it compiles, so a drift is a build error, not a crash.
CDEF = """
enum {
    GBX_OK = 0, GBX_E_BITS = -1, GBX_E_GROUP = -2, GBX_E_SHAPE = -3,
    GBX_E_PATH = -4, GBX_E_NOMEM = -5, GBX_E_NULL = -6, GBX_E_THREADS = -7,
    GBX_E_PLANES = -8
};
enum {
    GBX_PATH_AUTO = 0, GBX_PATH_FLOAT = 1, GBX_PATH_INTDOT = 2,
    GBX_PATH_REF = 3, GBX_PATH_INTDOT_REF = 4
};
#define GBX_ABI_VERSION ...
#define GBX_QK ...
#define GBX_MAX_PLANES ...
#define GBX_PLANE_BITS_LO ...
#define GBX_PLANE_BITS_HI ...
#define GBX_PLANE_BITS_6 ...
#define GBX_DTYPE_F32 ...
#define GBX_DTYPE_F16 ...
#define GBX_DTYPE_BF16 ...

typedef struct {
    int abi_version;
    int compiled_avx2;
    int compiled_neon;
    int compiled_dotprod;
    int cpu_avx2;
    int cpu_dotprod;
    int cpu_vnni;
    int threads;
    int max_threads;
    const char *float_isa;
    const char *intdot_isa;
    const char *nested_float_isa;
    const char *nested_intdot_isa;
} gbx_info_t;

typedef struct {
    const uint32_t *codes;
    const void *scales;
    const void *biases;
    int bits;
    int group_size;
    int dtype;
    float factor;
} gbx_plane;

int gbx_gemv(const void *w, const float *scales, const float *x, float *y,
             int out_features, int in_features, int bits, int group_size,
             int path, int nthreads);
int gbx_set_threads(int n);
int gbx_get_threads(void);
int gbx_set_min_work(int weights_per_thread);
int gbx_set_isa_limit(int level);
void gbx_get_info(gbx_info_t *info);
uint64_t gbx_read_bandwidth(const void *buf, size_t bytes, int nthreads);
const char *gbx_strerror(int code);
int gbx_check_args(int out_features, int in_features, int bits, int group_size, int path);
void gbx_quantize_act_ref(const float *x, int n, int8_t *qs, float *d, int32_t *sum);
void gbx_quantize_act(const float *x, int n, int8_t *qs, float *d, int32_t *sum);
int gbx_nested_gemv(const gbx_plane *planes, int n, const float *x, float *y, int m,
                    int out_features, int in_features, int path, int nthreads);
int gbx_check_nested(const gbx_plane *planes, int n, int m, int out_features, int in_features, int path);
int gbx_nested_unpack(const gbx_plane *planes, int n, float *w, int row0, int row1, int out_features,
                      int in_features, int nthreads);
int gbx_sparse_gemv(const gbx_plane *plane, const float *x, const int32_t *blocks, int nkept, float *y,
                    int out_features, int in_features, int path, int nthreads);
int gbx_top_blocks(const float *x, int n, int group_size, int keep, int32_t *blocks);
int gbx_sparse_gemv_top(const gbx_plane *plane, const float *x, int keep, int32_t *blocks, float *y,
                        int out_features, int in_features, int path, int nthreads);
int gbx_check_sparse(const gbx_plane *plane, int out_features, int in_features, int path);
"""


def _target_archs() -> list[str]:
    """Architectures this build compiles for (several for a macOS universal2 build)."""
    archflags = os.environ.get("ARCHFLAGS", "")
    if sys.platform == "darwin" and "-arch" in archflags:
        words = shlex.split(archflags)
        return [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-arch"]
    host = os.environ.get("_PYTHON_HOST_PLATFORM", "")  # set by cross-building tools
    if host:
        tail = host.rsplit("-", 1)[-1]
        if tail == "universal2":
            return ["arm64", "x86_64"]
        return [tail]
    return [platform.machine()]


def _is_arm64(arch: str) -> bool:
    return arch.lower() in ("arm64", "aarch64")


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _compiler_is_gcc(cc: list[str]) -> bool:
    try:
        out = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" not in out.lower() and ("gcc" in out.lower() or "free software foundation" in out.lower())


def _compiler_accepts(cc: list[str], flags: list[str]) -> bool:
    tmp = tempfile.mkdtemp(prefix="gearbx_flagcheck_")
    try:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("int main(void) { return 0; }\n")
        r = subprocess.run(cc + flags + ["-c", src, "-o", os.path.join(tmp, "t.o")], capture_output=True, timeout=60)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cpu_has_dotprod() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "asimddp" in f.read()
    except OSError:
        return False


def compile_flags() -> tuple[list[str], list[str]]:
    """(extra_compile_args, extra_link_args) for this platform and target."""
    if sys.platform == "win32":
        return ["/O2"], []  # MSVC: scalar kernels, no pool (see GEARBX_NO_THREADS)
    cflags = ["-O3", "-std=gnu11", "-DNDEBUG"]
    ldflags: list[str] = []
    if sys.platform.startswith("linux"):
        cflags.append("-pthread")
        ldflags.append("-pthread")
    archs = _target_archs()
    if sys.platform == "darwin":
        if any(_is_arm64(a) for a in archs):
            cflags += ["-mcpu=apple-m1"] if len(archs) == 1 else ["-Xarch_arm64", "-mcpu=apple-m1"]
    elif len(archs) == 1 and _is_arm64(archs[0]):
        cc = _compiler()
        dot = ["-march=armv8.2-a+dotprod"]
        if not _compiler_is_gcc(cc) and _cpu_has_dotprod() and _compiler_accepts(cc, dot):
            cflags += dot
    cflags += shlex.split(os.environ.get("GEARBX_CPU_CFLAGS", ""))
    return cflags, ldflags


def include_flags() -> list[str]:
    """``-I`` flags of :data:`INCLUDE_DIRS`, absolute, for a compiler run by hand (the self-test driver)."""
    return [f"-I{os.path.join(_ROOT, d)}" for d in INCLUDE_DIRS]


def make_ffibuilder(absolute_paths: bool = False) -> FFI:
    """setuptools wants source paths relative to setup.py (the cwd of a build);
    ``FFI.compile`` changes directory, so building by hand needs absolute ones."""
    cflags, ldflags = compile_flags()

    def path(p: str) -> str:
        return os.path.join(_ROOT, p) if absolute_paths else os.path.relpath(os.path.join(_ROOT, p))

    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        MODULE_NAME,
        '#include "gearbx_cpu.h"\n#include "gearbx_sparse.h"\n',
        sources=[path(s) for s in SOURCES],
        include_dirs=[path(d) for d in INCLUDE_DIRS],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
        depends=[path(h) for h in HEADERS],
    )
    return ffi


def build_in_place() -> str:
    """Compile the extension next to this file (``_gearbx_cpu.abi3.so``); returns its path."""
    ffibuilder = make_ffibuilder(absolute_paths=True)
    build_tmp = os.path.join(_ROOT, "build", "cffi_tmp")
    os.makedirs(build_tmp, exist_ok=True)
    so = ffibuilder.compile(tmpdir=build_tmp, verbose=False)
    for old in os.listdir(_HERE):  # e.g. an abi3 build from pip: one of them would shadow the other
        if old.startswith("_gearbx_cpu.") and old.endswith((".so", ".pyd")):
            os.remove(os.path.join(_HERE, old))
    # Same file name as a pip build (cffi modules use the limited API where
    # they can), so the two replace each other instead of one shadowing.
    name = os.path.basename(so)
    if ".abi3.so" in importlib.machinery.EXTENSION_SUFFIXES and not hasattr(sys, "gettotalrefcount") \
            and not sysconfig.get_config_var("Py_GIL_DISABLED"):
        name = "_gearbx_cpu.abi3.so"
    dest = os.path.join(_HERE, name)
    shutil.copy2(so, dest)
    return dest


if __name__ == "__main__":
    print(f"built {os.path.relpath(build_in_place(), _ROOT)}")
