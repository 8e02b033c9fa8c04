"""Large MLX arrays reused from the heap instead of mapped afresh, for loops that make many of them.

MLX's CPU backend takes every array's memory from ``malloc``. glibc serves a
block above its mmap threshold (which grows with the blocks freed, up to
32 MiB on 64-bit Linux) with a fresh ``mmap`` and returns it with ``munmap``
when it is freed, so each new array larger than that costs a page fault and
the zeroing of every 4 KiB page. mlx-lm's GPTQ updates a layer's float32
weight column by column, and each update is a new array of the whole weight
(55 MB for a 8960x1536 matrix): with glibc's defaults, two thirds of its CPU
time went into the kernel's page faults (``scripts/bench_heap_reuse.py``).

:func:`reuse_large_buffers` makes glibc serve every block from its heap and
keep freed memory there while a block of such work runs (``mallopt``:
``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` at its largest), then returns the free
memory to the system (``malloc_trim``) and leaves glibc as its dynamic rule
would after large blocks: blocks up to 32 MiB from the heap and a trim
threshold of twice that. The arithmetic is the same; only where the memory
comes from changes. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from typing import Any, Iterator, Optional

#: glibc's ``mallopt`` parameters (``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
#: glibc's default most blocks served by ``mmap`` at once.
DEFAULT_MMAP_MAX = 65536
#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): where its
#: dynamic rule ends up after large blocks are freed, and where this module leaves it.
MMAP_THRESHOLD_AFTER = 32 << 20
#: The trim threshold glibc's dynamic rule pairs with that mmap threshold (twice it).
TRIM_THRESHOLD_AFTER = 2 * MMAP_THRESHOLD_AFTER
#: The largest value ``mallopt`` takes (a C ``int``): free memory kept at the heap's top.
INT_MAX = 2**31 - 1


@functools.lru_cache(maxsize=1)
def glibc() -> Optional[Any]:
    """The C library where it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(lib, name) for name in ("mallopt", "malloc_trim", "gnu_get_libc_version")):
        return None
    lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.mallopt.restype = ctypes.c_int
    lib.malloc_trim.argtypes = [ctypes.c_size_t]
    lib.malloc_trim.restype = ctypes.c_int
    return lib


@contextlib.contextmanager
def reuse_large_buffers(libc: Optional[Any] = None) -> Iterator[bool]:
    """While the block runs, glibc serves every allocation from its heap and keeps what is
    freed there, so that large arrays made again and again reuse memory that is already
    mapped; afterwards the free memory goes back to the system.

    Args:
        libc: the C library (default :func:`glibc`; tests pass a stand-in).

    Yields:
        Whether the heap is in that mode (False where the C library is not glibc or
        refused a setting: the block then runs with the allocator as it was).
    """
    lib = glibc() if libc is None else libc
    if lib is None:
        yield False
        return
    on = lib.mallopt(M_MMAP_MAX, 0) == 1 and lib.mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
    try:
        yield on
    finally:
        lib.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER)
        lib.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_AFTER)
        lib.malloc_trim(0)


__all__ = ["glibc", "reuse_large_buffers"]
