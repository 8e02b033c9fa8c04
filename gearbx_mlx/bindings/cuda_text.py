"""A CUDA kernel's text in files, so that MLX's per-call cost does not grow with it.

MLX's CUDA back end finds a custom kernel's compiled module by a hash of the
kernel's whole text, computed again on every call (``CustomKernel::eval_gpu``:
``std::hash<std::string>{}(source_)``). The package's kernels are 20-25 KB of
text and a decode step calls a few hundred of them, so hashing alone costs
microseconds per call on the host, as much as the rest of a call.

NVRTC reads ``#include`` files from disk. So :func:`include_text` writes the
header and the body to files named by their SHA-1, in a folder of the
package's cache, and hands MLX two ``#include`` lines instead: the compiled
code is the same, the text MLX hashes is a few hundred bytes. A file's content
is compared before every process's first use and rewritten when it differs,
so a damaged or stale file is never compiled; MLX's on-disk PTX cache is keyed
by the short text, which names each file's digest.

MLX decides which ``<input>_shape``, ``_strides`` and ``_ndim`` arguments a
kernel takes by searching its source for those names; the short source keeps
the ones the body uses in a comment line so that the search still finds them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

from ..atomicfile import write_text
from ..sources.cache import cache_dir

#: The folder of the text files inside the package's cache.
FOLDER = "cuda_kernels"
#: Characters a path may not contain to stand inside ``#include "..."``.
_UNQUOTABLE = re.compile(r'["\\\n\r]')


@functools.lru_cache(maxsize=None)
def _private_temp_dir() -> Path:
    """A folder (one per process) only this user can write: where the cache is read-only or its
    path cannot be quoted."""
    return Path(tempfile.mkdtemp(prefix="gearbx_mlx-cuda-"))


@functools.lru_cache(maxsize=None)
def text_dir(base: Optional[str] = None) -> Path:
    """The folder of the kernel text files: ``<cache>/cuda_kernels`` (``base`` replaces the
    package's cache folder), else a private temporary folder for this process."""
    if base is None:
        base = str(cache_dir())
    folder = Path(base) / FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if _UNQUOTABLE.search(str(folder.resolve())) or not os.access(folder, os.W_OK):
            raise PermissionError(folder)
        return folder.resolve()
    except OSError:
        return _private_temp_dir()


def _file_of(folder: Path, stem: str, suffix: str, text: str) -> Path:
    """``folder/<stem>-<sha1>.<suffix>`` holding ``text``, written where absent or different."""
    path = folder / f"{stem}-{hashlib.sha1(text.encode()).hexdigest()[:16]}{suffix}"
    try:
        if path.read_text(encoding="utf-8") == text:
            return path
    except (OSError, UnicodeDecodeError):
        pass
    write_text(path, text)
    return path


def shape_markers(input_names: Sequence[str], source: str) -> str:
    """A comment line naming every ``<input>_shape``/``_strides``/``_ndim`` that ``source`` uses
    (empty if none): MLX passes those arguments only where the text it is given names them."""
    if not input_names:
        return ""
    names = "|".join(re.escape(n) for n in input_names)
    found = sorted(set(re.findall(rf"\b(?:{names})_(?:shape|strides|ndim)\b", source)))
    return f"// uses {' '.join(found)}\n" if found else ""


def include_text(
    name: str, input_names: Sequence[str], header: str, source: str, folder: Optional[Path] = None
) -> Tuple[str, str]:
    """``(header, source)`` to hand to ``mx.fast.cuda_kernel`` in place of the full text: one
    ``#include`` line each, of files in ``folder`` (default :func:`text_dir`) holding the text."""
    def files(where: Path) -> Tuple[Path, Path]:
        return _file_of(where, name, ".cuh", header), _file_of(where, name, ".inc", source)

    try:
        header_file, body_file = files(text_dir() if folder is None else folder)
    except OSError:  # the folder refused a file: this process's private one
        header_file, body_file = files(_private_temp_dir())
    return f'#include "{header_file}"\n', shape_markers(input_names, source) + f'#include "{body_file}"\n'


__all__ = ["FOLDER", "include_text", "shape_markers", "text_dir"]
