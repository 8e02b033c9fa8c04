"""gearbx_mlx.heap: glibc keeps large blocks in its heap inside the block, and is left as its
dynamic rule leaves it afterwards; a C library without the calls is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any, List, Tuple

import pytest

from gearbx_mlx import heap


class FakeLibc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: List[Tuple[str, int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return self.answer

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad, 0))
        return 1


AFTER = [("mallopt", heap.M_MMAP_MAX, heap.DEFAULT_MMAP_MAX),
         ("mallopt", heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_AFTER),
         ("mallopt", heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD_AFTER),
         ("malloc_trim", 0, 0)]


def test_settings_inside_the_block_and_after_it() -> None:
    lib = FakeLibc()
    with heap.reuse_large_buffers(lib) as on:
        assert on
        assert lib.calls == [("mallopt", heap.M_MMAP_MAX, 0), ("mallopt", heap.M_TRIM_THRESHOLD, heap.INT_MAX)]
    assert lib.calls[2:] == AFTER


def test_an_error_in_the_block_still_gives_the_memory_back() -> None:
    lib = FakeLibc()
    with pytest.raises(RuntimeError, match="quantizer failed"):
        with heap.reuse_large_buffers(lib):
            raise RuntimeError("quantizer failed")
    assert lib.calls[2:] == AFTER


def test_a_refused_setting_says_so_and_restores() -> None:
    lib = FakeLibc(answer=0)
    with heap.reuse_large_buffers(lib) as on:
        assert not on
    assert lib.calls[-4:] == AFTER


def test_no_glibc_changes_nothing(monkeypatch: Any) -> None:
    monkeypatch.setattr(heap, "glibc", lambda: None)
    with heap.reuse_large_buffers() as on:
        assert not on


CHILD = textwrap.dedent("""
    import ctypes, resource
    from gearbx_mlx import heap

    libc = heap.glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    SIZE = 64 << 20  # above glibc's largest mmap threshold, as MLX's arrays of a large weight are

    def faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(6):  # an array made, written and freed, as each step of a loop does
            p = libc.malloc(SIZE)
            ctypes.memset(p, 1, SIZE)
            libc.free(p)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    plain = faults()
    with heap.reuse_large_buffers() as on:
        inside = faults()
    print(on, plain, inside)
""")


@pytest.mark.skipif(heap.glibc() is None, reason="needs glibc")
def test_large_arrays_made_again_reuse_mapped_memory() -> None:
    """Real glibc, in a child (the settings are process-wide): six 64 MiB blocks fault in every
    page each by default, and about one block's pages inside the block."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    on, plain, inside = out.stdout.split()
    assert on == "True"
    pages = (64 << 20) // 4096
    assert int(plain) >= 5 * pages, out.stdout
    assert int(inside) <= 2 * pages, out.stdout
