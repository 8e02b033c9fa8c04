"""What every GPU kernel of the package shares: back end, text assembly, build.

Each kernel body in ``metal_kernels/`` (the packed GEMV, the nested-plane
GEMV, the KV cache write) is handed to MLX the same way:

* ``header`` = the format header ``gearbx_format.h``, the back end's prelude
  (``prelude_metal.h`` or ``prelude_cuda.cuh``), then the body's common
  helpers;
* ``source`` = its compile-time constants (:func:`constants_source`), its
  preprocessor switches, the back end's entry (``entry_metal.inc`` or
  ``entry_cuda.inc``) and the body;

both stripped of comments (:func:`compact`), then built once per process by
:func:`build` into ``mx.fast.metal_kernel`` or ``mx.fast.cuda_kernel`` (on
CUDA through files that ``#include`` lines name: :mod:`.cuda_text`).
:func:`kernel_text` assembles the text; :func:`gpu_backend` says which back
end the default device has (:func:`unavailable` and :func:`device_label` word it
for the self-test). Nothing is read or compiled at import.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import cuda_text
from .kernel_files import FORMAT_HEADER, read as read_source, source_dir

#: Threads per threadgroup: eight 32-lane SIMD groups (§8.1, §16.2).
THREADS = 256
SIMD_GROUPS = 8
#: Short dtype names in kernel names.
DTYPE_TAG: Dict[mx.Dtype, str] = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}
#: Type names of an input dtype in each back end's kernel language.
TYPE_NAMES: Dict[str, Dict[mx.Dtype, str]] = {
    "metal": {mx.float32: "float", mx.float16: "half", mx.bfloat16: "bfloat16_t"},
    "cuda": {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"},
}
#: ``(prelude, entry)`` file of each back end.
BACKEND_FILES: Dict[str, Tuple[str, str]] = {
    "metal": ("prelude_metal.h", "entry_metal.inc"),
    "cuda": ("prelude_cuda.cuh", "entry_cuda.inc"),
}


@functools.lru_cache(maxsize=None)
def gpu_kind() -> Optional[str]:
    """The GPU back end this MLX build has, if any (fixed for the process)."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def gpu_backend() -> Optional[str]:
    """"metal" or "cuda" when the default device is a GPU with that back end, else None.

    Read at call time: a caller may change the default device between calls.
    """
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    return gpu_kind()


def unavailable() -> Optional[str]:
    """None when the default device is a Metal or CUDA GPU, else why no GPU kernel runs (self-test table)."""
    return None if gpu_backend() is not None else "no Metal or CUDA GPU is MLX's default device here"


def device_label() -> str:
    """``"metal Apple M2"``, ``"cuda NVIDIA H100 ..."``: the back end and the device's name, as far as MLX tells."""
    backend = gpu_backend() or "gpu"
    try:
        name = str(mx.device_info().get("device_name", "")).strip()
    except Exception:  # noqa: BLE001  (older MLX, or no device information)
        name = ""
    return f"{backend} {name}".strip()


def compact(text: str) -> str:
    """Kernel text without comments, indentation or blank lines.

    MLX copies the whole header and source into a new string on every kernel
    call (a decode step makes a few hundred), so shorter text is cheaper.
    """
    out = []
    for line in text.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            out.append(code)
    return "\n".join(out) + "\n"


def backend_files(backend: str, directory: Path) -> Tuple[str, str]:
    """``(header prelude, entry)`` of ``backend``: the format header, then the
    backend's spellings of the ``GBX_*`` macros; and its thread-index entry."""
    if backend not in BACKEND_FILES:
        raise ValueError(f"no GPU kernel for backend {backend!r}: use 'metal' or 'cuda'")
    prelude_file, entry_file = BACKEND_FILES[backend]
    prelude = read_source(directory, FORMAT_HEADER) + "\n" + read_source(directory, prelude_file)
    return prelude, read_source(directory, entry_file)


def kernel_text(
    backend: str,
    commons: Sequence[str],
    switches: Sequence[Tuple[str, int]],
    body: str,
    directory: Optional[Path] = None,
    *,
    compact_text: bool = False,
) -> Tuple[str, str]:
    """``(header, source)`` of one kernel body as handed to MLX.

    Args:
        backend: "metal" or "cuda".
        commons: the body's helper files (``gemv_common.h``, ...), in order, after the prelude.
        switches: ``(GBX_NAME, value)`` preprocessor switches of the body, defined
            before the entry and undefined after the body (an absent input's
            name must not appear in the compiled text).
        body: the body's file (``gemv_body.inc``, ...).
        directory: replaces :func:`~gearbx_mlx.bindings.kernel_files.source_dir`
            (the syntax check compiles a copy with a planted error).
        compact_text: strip comments and indentation (:func:`compact`).
    """
    d = Path(directory) if directory is not None else source_dir()
    prelude, entry = backend_files(backend, d)
    header = "\n".join([prelude] + [read_source(d, name) for name in commons])
    defines = "".join(f"#define {name} {int(value)}\n" for name, value in switches)
    undefs = "".join(f"#undef {name}\n" for name, _ in switches)
    source = defines + entry + read_source(d, body) + undefs
    if compact_text:
        header, source = compact(header), compact(source)
    return header, source


def digest(header: str, source: str) -> str:
    """8 hex digits of the text's hash: a kernel name changes with its source."""
    return hashlib.sha1((header + source).encode()).hexdigest()[:8]


def constants_source(backend: str, consts: List[Tuple[str, object]]) -> str:
    """Declarations of ``consts`` at the top of the kernel body.

    Baked into the source rather than passed as MLX template arguments: a
    decode step launches a few hundred kernels, and each template argument
    costs a conversion on every call. The kernel's name carries every value,
    so two variants never share MLX's cache entry.
    """
    lines = []
    for name, value in consts:
        if isinstance(value, mx.Dtype):
            lines.append(f"  using {name} = {TYPE_NAMES[backend][value]};")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        else:
            lines.append(f"  constexpr int {name} = {int(value)};")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def build(
    backend: str,
    name: str,
    input_names: Tuple[str, ...],
    output_names: Tuple[str, ...],
    header: str,
    source: str,
) -> Callable:
    """The ``mx.fast`` kernel object of one variant, built once per process.

    ``source`` is the compacted body with its constants first; ``name`` must
    carry every baked parameter (MLX caches kernels by name). On CUDA the text
    goes to files that two ``#include`` lines name (:mod:`.cuda_text`: MLX
    hashes the text it is given on every call).
    """
    if backend == "cuda":
        header, source = cuda_text.include_text(name, input_names, header, source)
    kwargs = dict(name=name, input_names=list(input_names), output_names=list(output_names), source=source,
                  header=header, ensure_row_contiguous=True)
    if backend == "metal":
        return mx.fast.metal_kernel(**kwargs)
    if backend == "cuda":
        return mx.fast.cuda_kernel(**kwargs)
    raise ValueError(f"no GPU kernel for backend {backend!r}: use 'metal' or 'cuda'")


__all__ = ["BACKEND_FILES", "DTYPE_TAG", "SIMD_GROUPS", "THREADS", "TYPE_NAMES", "backend_files", "build", "compact",
           "constants_source", "device_label", "digest", "gpu_backend", "gpu_kind", "kernel_text", "unavailable"]
