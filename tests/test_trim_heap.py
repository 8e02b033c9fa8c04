"""A loaded process hands the C heap's free pages back (``settle_loaded`` -> ``trim_heap``): the
loader's and the tokenizer's freed temporaries no longer count in a run's peak memory."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import pytest

from gearbx_mlx import generation


def _rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_freed_heap_pages_go_back_to_the_system():
    keep, junk = [], []
    for i in range(60_000):  # 60 MB of 1 KB objects: the C heap, not pymalloc's arenas
        junk.append(b"x" * 1000 + bytes([i % 256]))
        if i % 1000 == 0:
            keep.append(b"y" * 1000 + bytes([i % 256]))  # live blocks among them, up to the heap's top
    del junk
    gc.collect()
    before = _rss_mib()
    assert generation.trim_heap()
    assert _rss_mib() < before - 40, (before, _rss_mib())
    assert len(keep) == 60


def test_settle_loaded_trims_the_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(generation.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(generation, "trim_heap", lambda: calls.append("trim") or True)
    generation.settle_loaded()
    assert calls == ["freeze", "trim"]
