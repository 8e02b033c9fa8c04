"""Where the GPU kernel sources live, and the constants of their one format header.

The checkout keeps them in a top-level ``metal_kernels/`` folder:
``metal_kernels/gearbx_format.h`` (the weight formats and shared constants,
valid C, Metal and CUDA) and the Metal bodies with their CUDA twins, read at
run time. A wheel ships the folder as ``gearbx_mlx/metal_kernels``
(``pyproject.toml``), where :func:`source_dir` finds it. The C kernels
(``gearbx_mlx/bindings/csrc/``) include the same header at build time.

Python takes the shared constants from the header (:func:`format_constants`)
rather than repeating them; nothing is read until a caller asks.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Dict, Optional

#: The format header, relative to :func:`source_dir`.
FORMAT_HEADER = "gearbx_format.h"
#: The folder's name, in the checkout and in the installed package.
FOLDER = "metal_kernels"
#: A file every complete source folder has (the GPU loader reads it).
_MARKER = Path("gemv_body.inc")

# `#define NAME <integer>` with an optional trailing comment: the only
# definitions Python reads (function-like macros and expressions are C's own).
_DEFINE = re.compile(r"^\s*#\s*define\s+(GBX_[A-Z0-9_]+)\s+(-?(?:0[xX][0-9a-fA-F]+|\d+))\s*(?://.*)?$")


@functools.lru_cache(maxsize=None)
def source_dir() -> Path:
    """The ``metal_kernels`` folder: inside the installed package, or the checkout's (cached)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / FOLDER, package.parent / FOLDER):
        if (candidate / _MARKER).is_file() and (candidate / FORMAT_HEADER).is_file():
            return candidate
    raise FileNotFoundError(
        f"kernel sources ({_MARKER.as_posix()} and {FORMAT_HEADER}) not found next to gearbx_mlx: "
        f"reinstall the package; the wheel must ship {FOLDER}/ as gearbx_mlx/{FOLDER}"
    )


@functools.lru_cache(maxsize=None)
def read(directory: Path, name: str) -> str:
    """The text of ``directory / name`` (cached: the GPU loaders read each file once)."""
    return (Path(directory) / name).read_text()


def parse_defines(text: str) -> Dict[str, int]:
    """``{name: value}`` of every ``#define GBX_NAME <integer>`` in C text."""
    out: Dict[str, int] = {}
    for line in text.splitlines():
        m = _DEFINE.match(line)
        if m:
            out[m.group(1)] = int(m.group(2), 0)
    return out


@functools.lru_cache(maxsize=None)
def _constants(directory: Path) -> Dict[str, int]:
    return parse_defines(read(directory, FORMAT_HEADER))


def format_constants(directory: Optional[Path] = None) -> Dict[str, int]:
    """The integer constants of ``gearbx_format.h`` (``{"GBX_SHARED_K": 6144, ...}``)."""
    return dict(_constants(Path(directory) if directory is not None else source_dir()))


def format_constant(name: str) -> int:
    """One constant of ``gearbx_format.h``; ``KeyError`` names what is there."""
    constants = _constants(source_dir())
    try:
        return constants[name]
    except KeyError:
        raise KeyError(f"{name} is not an integer #define of {FORMAT_HEADER}; it has {sorted(constants)}") from None
