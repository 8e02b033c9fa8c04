"""Build the host emulation of a GPU kernel body: one g++ unit under AddressSanitizer and
UBSan, compiled once per text (the binary is kept in the temporary folder under a name
that holds the text's hash) and skipped with a reason where g++ is not installed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import pytest

#: The flags of every host unit; the optimization level is the caller's.
FLAGS = ("-std=c++20", "-g", "-pthread", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-Wall",
         "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Wno-maybe-uninitialized")


def start(text: str, tag: str, name: str, opt: str = "-O1") -> Tuple[Path, Optional[subprocess.Popen]]:
    """``(binary, compiler process or None where the binary exists)`` of the unit ``text``."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not installed: the host emulation of the kernel body needs it")
    out_dir = Path(tempfile.gettempdir()) / f"gbx_host_{tag}_{hashlib.sha1(text.encode()).hexdigest()[:12]}"
    binary = out_dir / name
    if binary.exists():
        return binary, None
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"{name}.cpp"
    src.write_text(text)
    cmd = [cxx, *FLAGS, opt, "-o", str(binary) + ".tmp", str(src)]
    return binary, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(binary: Path, proc: Optional[subprocess.Popen]) -> Path:
    """Wait for :func:`start`'s compiler; the test fails with its errors if it failed."""
    if proc is not None:
        _, err = proc.communicate()
        assert proc.returncode == 0, err[-4000:]
        Path(str(binary) + ".tmp").rename(binary)
    return binary


def build(text: str, tag: str, name: str, opt: str = "-O1") -> Path:
    """:func:`start` then :func:`finish`: the binary of ``text``."""
    return finish(*start(text, tag, name, opt))
