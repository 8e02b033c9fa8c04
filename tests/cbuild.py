"""Test builds of the C kernels' self-test drivers, each source compiled once per run.

The drivers are built many times over (natively and for AArch64; plain, with a
planted bug, with the pool stalled, scalar only), and most of their sources
read none of the macros that tell those builds apart. As ccache does, a source
is compiled once per distinct preprocessed text, compiler and flags, into a
folder every pytest-xdist worker of the run shares; each build then links
those objects (the folder: the ``c_objects`` fixture of conftest.py). A build
differs from the one-command build only in time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Sequence


def build_exe(cc: str, flags: Sequence[str], sources: Sequence[object], exe: Path, objects: Path,
              libs: Sequence[str] = ("-lm",)) -> subprocess.CompletedProcess:
    """``cc FLAGS SOURCES LIBS -o EXE``, each source compiled (``-c``) only where no build of this
    run compiled the same preprocessed text with the same compiler and flags. Returns the failing
    step's process, or the link's."""
    flags = list(flags)
    compiler = os.path.realpath(shutil.which(cc) or cc)  # cc and gcc may be one compiler
    linked = []
    for src in map(str, sources):
        pre = subprocess.run([cc, *flags, "-E", src], capture_output=True, timeout=300)
        if pre.returncode:
            return subprocess.CompletedProcess(pre.args, pre.returncode, pre.stdout.decode(errors="replace"),
                                               pre.stderr.decode(errors="replace"))
        # The defines are in the preprocessed text wherever they change it, and warnings change no code:
        # neither is in the key.
        codegen = [f for f in flags if not f.startswith(("-D", "-U", "-I", "-W"))]
        key = hashlib.sha256("\0".join([compiler, *codegen, src]).encode() + b"\0" + pre.stdout).hexdigest()[:32]
        obj = objects / f"{key}.o"
        if not obj.exists():
            tmp = objects / f".{key}.{os.getpid()}.o"
            r = subprocess.run([cc, *flags, "-c", src, "-o", str(tmp)], capture_output=True, text=True, timeout=300)
            if r.returncode:
                return r
            os.replace(tmp, obj)  # atomic: a worker building the same object at once loses nothing
        linked.append(str(obj))
    return subprocess.run([cc, *flags, *linked, *libs, "-o", str(exe)], capture_output=True, text=True, timeout=300)
