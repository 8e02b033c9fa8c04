#!/usr/bin/env python3
"""Syntax- and type-check the Metal kernels (GEMV, nested GEMV, sparse GEMV, KV write) with clang (no Metal compiler needed).

``mx.fast.metal_kernel`` wraps the kernel ``source`` in a generated
``[[kernel]]`` function: one ``const device <dtype>* name [[buffer(i)]]`` per
input, shape buffers for the ``*_shape`` names the source uses, the
thread-position attributes it names (and, given template arguments, which
these kernels do not use, a template and its explicit instantiation). This
script writes that same translation unit, constants included, for every
kernel variant and compiles it with
``clang -fsyntax-only -x c++ -std=c++17 -include metal_kernels/check/metal_stub.h``,
the stub standing in for ``<metal_stdlib>`` and MLX's Metal utils.

With ``--cuda`` it also checks the CUDA twin: compiled for sm_90 by nvcc when
one is on PATH (real CUDA headers, ``check/mlx_cuda_default_header.cuh`` for
MLX's), else by clang's CUDA front end against ``check/cuda_stub.h``.

Exits 0 when everything compiles, 1 on a compile error, 2 when clang is missing
(install it: ``apt-get install -y clang``).

Usage: python scripts/check_metal_syntax.py [--source-dir DIR] [--clang PATH] [--cuda] [-v]
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gearbx_mlx.bindings import gpu, kernel_files, nested_gpu, packed_gpu, sparse_gpu  # noqa: E402  (needs the checkout on sys.path)
from gearbx_mlx.kvcache import write_kernel  # noqa: E402

# MLX's Metal type names (get_type_string) and CUDA type names (dtype_to_cuda_type).
METAL_TYPES = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t",
               "uint8": "uint8_t", "int8": "int8_t", "uint32": "uint32_t"}
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
              "uint8": "uint8_t", "int8": "int8_t", "uint32": "uint32_t"}
# The attributes MLX adds to a Metal kernel's signature when the source names
# them (mlx/backend/metal/custom_kernel: metal_kernel), in MLX's order.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
WARNING_FLAGS = ["-Wall", "-Werror", "-Wno-unknown-attributes", "-Wno-unused-variable",
                 "-Wno-pragma-once-outside-header", "-Wno-unknown-pragmas",
                 "-Wno-unknown-cuda-version"]


def variants() -> List[Tuple[int, Optional[int], bool, str, bool, int]]:
    """(bits, group_size, shared, dtype, has_bias, vec) for every kernel worth checking."""
    return list(itertools.product((4, 8), (None, 64), (True, False),
                                  ("float32", "float16", "bfloat16"), (False, True), (1, 4)))


def _constants(backend: str, bits: int, group_size: Optional[int], shared: bool, dtype: str,
               vec: int) -> str:
    """The constant declarations gearbx_mlx.bindings.packed_gpu puts before the body."""
    import mlx.core as mx

    d = packed_gpu.TUNING[bits]
    t = packed_gpu.Tuning(d.rows, d.unroll, vec)
    consts = packed_gpu.constants(getattr(mx, dtype), bits, group_size, t, shared)
    return gpu.constants_source(backend, consts)


def metal_signature(source: str, fname: str, inputs: Sequence[Tuple[str, str]],
                    outputs: Sequence[Tuple[str, str]]) -> str:
    """The generated Metal kernel around ``source``, as MLX's write_signature builds
    it: one buffer per input (plus the ``*_shape`` etc. buffers the source names),
    one per output, then the thread-position attributes the source names. The
    kernels pass no template arguments (their constants are declared in the
    source), so MLX writes a plain ``[[kernel]]`` function."""
    params = []
    index = 0
    for name, typ in inputs:
        params.append(f"  const device {typ}* {name} [[buffer({index})]]")
        index += 1
        if f"{name}_shape" in source:
            params.append(f"  const constant int* {name}_shape [[buffer({index})]]")
            index += 1
        if f"{name}_strides" in source:
            params.append(f"  const constant int64_t* {name}_strides [[buffer({index})]]")
            index += 1
        if f"{name}_ndim" in source:
            params.append(f"  const constant int& {name}_ndim [[buffer({index})]]")
            index += 1
    for name, typ in outputs:
        params.append(f"  device {typ}* {name} [[buffer({index})]]")
        index += 1
    for attr, kind in METAL_ATTRIBUTES:
        if attr in source:
            params.append(f"  {kind} {attr} [[{attr}]]")
    return f"[[kernel]] void {fname}(\n" + ",\n".join(params) + ") {\n" + source + "\n}\n"


def cuda_signature(source: str, fname: str, inputs: Sequence[Tuple[str, str]],
                   outputs: Sequence[Tuple[str, str]]) -> str:
    """The generated CUDA kernel, as MLX's cuda custom_kernel build_kernel writes it."""
    params = []
    for name, typ in inputs:
        params.append(f"    const {typ}* {name}")
        if f"{name}_shape" in source:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
    params += [f"    {typ}* {name}" for name, typ in outputs]
    return ("namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
            f"__global__ void {fname}(\n" + ",\n".join(params) + ") {\n"
            + source + "\n}\n} // namespace mlx::core::cu\n")


def _packed_io(types: dict, bits: int, dtype: str, has_bias: bool,
               outputs: Sequence[str]) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
    in_types = {"w": types["uint8" if bits == 4 else "int8"], "scales": "float",
                "x": types[dtype], "bias": types[dtype]}
    return ([(n, in_types[n]) for n in packed_gpu.input_names(has_bias)],
            [(o, types[dtype]) for o in outputs])


def metal_kernel_text(source: str, fname: str, bits: int, group_size: Optional[int],
                      shared: bool, dtype: str, has_bias: bool, vec: int = 1,
                      consts: Optional[str] = None, outputs: Sequence[str] = ("y",)) -> str:
    """A packed GEMV kernel as MLX generates it for Metal (constants included)."""
    if consts is None:
        consts = _constants("metal", bits, group_size, shared, dtype, vec)
    ins, outs = _packed_io(METAL_TYPES, bits, dtype, has_bias, outputs)
    return metal_signature(consts + source, fname, ins, outs)


def cuda_kernel_text(source: str, fname: str, bits: int, group_size: Optional[int],
                     shared: bool, dtype: str, has_bias: bool, vec: int = 1,
                     consts: Optional[str] = None, outputs: Sequence[str] = ("y",)) -> str:
    """A packed GEMV kernel as MLX generates it for CUDA (constants included)."""
    if consts is None:
        consts = _constants("cuda", bits, group_size, shared, dtype, vec)
    ins, outs = _packed_io(CUDA_TYPES, bits, dtype, has_bias, outputs)
    return cuda_signature(consts + source, fname, ins, outs)


def translation_unit(backend: str, directory: Path, has_bias: bool) -> str:
    """One file holding every variant of one source (bias on or off) for ``backend``."""
    # Compacted, as gearbx_mlx.bindings.packed_gpu hands the text to MLX.
    header, source = packed_gpu.kernel_sources(backend, has_bias, directory, compact=True)
    parts = [header]
    for bits, gs, shared, dtype, bias, vec in variants():
        if bias != has_bias:
            continue
        fname = (f"custom_kernel_gbx_q{bits}_{'row' if gs is None else gs}_"
                 f"{'shared' if shared else 'device'}_{dtype}_v{vec}")
        build = metal_kernel_text if backend == "metal" else cuda_kernel_text
        parts.append(build(source, fname, bits, gs, shared, dtype, has_bias, vec))
    # The matrix-unit body: every 16-bit dtype and group setting, one and three outputs.
    import mlx.core as mx

    for dtype, gs, splits in mma_variants():
        _, mma_source = packed_gpu.kernel_sources(backend, has_bias, directory, mma=True,
                                               n_out=len(splits) + 1, compact=True)
        consts = gpu.constants_source(
            backend, packed_gpu.mma_constants(getattr(mx, dtype), gs, packed_gpu.MMA_UNROLL, splits))
        fname = (f"custom_kernel_gbx_mma_q4_{'row' if gs is None else gs}_{dtype}_"
                 f"o{len(splits) + 1}")
        build = metal_kernel_text if backend == "metal" else cuda_kernel_text
        parts.append(build(mma_source, fname, 4, gs, False, dtype, has_bias, 1, consts,
                           packed_gpu.output_names(len(splits) + 1)))
    # The nested-plane body: every plan, the dtypes and both staging variants.
    nested_header, _ = nested_gpu.kernel_sources(backend, 1, has_bias, directory, compact=True)
    parts.append(nested_header[len(header):] if nested_header.startswith(header) else nested_header)
    types = METAL_TYPES if backend == "metal" else CUDA_TYPES
    signature = metal_signature if backend == "metal" else cuda_signature
    for bits, dtype, sdtype, gs, shared, vec in nested_variants():
        _, nsource = nested_gpu.kernel_sources(backend, len(bits), has_bias, directory, compact=True)
        groups = (gs,) + (32,) * (len(bits) - 1)  # per-plane groups: the residual planes' 32
        consts = gpu.constants_source(backend, nested_gpu.constants(
            getattr(mx, dtype), getattr(mx, sdtype), bits, groups,
            nested_gpu.NestedTuning(2, vec, 8 if shared else 1, shared, True), shared))  # both row splits, x's sums, biased
        ins = [(n, {"x": types[dtype], "factors": "float", "bias": types[dtype]}.get(
            n, "uint32_t" if n.startswith("w") else types[sdtype]))
            for n in nested_gpu.input_names(len(bits), has_bias)]
        fname = (f"custom_kernel_gbx_nested_{'_'.join(map(str, bits))}_g{gs}_{dtype}_s{sdtype}_"
                 f"{'shared' if shared else 'device'}_v{vec}")
        parts.append(signature(consts + nsource, fname, ins, [("y", types[dtype])]))
        if backend == "cuda" and nested_gpu.int8x_applies(backend, bits, 4096, vec) and not shared:
            consts = gpu.constants_source(backend, nested_gpu.constants(
                getattr(mx, dtype), getattr(mx, sdtype), bits, groups,
                nested_gpu.NestedTuning(2, vec, int8x=True), False))  # x rounded to int8 (CUDA only)
            parts.append(signature(consts + nsource, fname + "_i8x", ins, [("y", types[dtype])]))
    # The block-sparse body: both group sizes, every x and scale dtype, one and four rows.
    for dtype, sdtype, gs, rows in sparse_variants():
        _, ssource = sparse_gpu.kernel_sources(backend, has_bias, directory, compact=True)
        consts = gpu.constants_source(backend, sparse_gpu.constants(getattr(mx, dtype), gs, rows))
        ins = [(n, {"x": types[dtype], "bias": types[dtype], "w": "uint32_t", "blocks": "uint32_t"}.get(
            n, types[sdtype])) for n in sparse_gpu.input_names(has_bias)]
        fname = f"custom_kernel_gbx_sparse_g{gs}_{dtype}_s{sdtype}_r{rows}"
        parts.append(signature(consts + ssource, fname, ins, [("y", types[dtype])]))
    # The KV write body: every bit width, dtype and quantizer, the offset with the bias.
    kv_header, _ = write_kernel.kernel_sources(backend, has_bias, directory, compact=True)
    assert kv_header.startswith(header), "the KV write header extends the GEMV header"
    parts.append(kv_header[len(header):])
    for bits, gs, dtype, quantizer in kv_variants():
        _, kv_source = write_kernel.kernel_sources(backend, has_bias, directory, compact=True)
        consts = gpu.constants_source(backend, write_kernel.constants(getattr(mx, dtype), bits, gs, quantizer))
        ins = [(n, "float" if n == "key_offset" else types[dtype]) for n in write_kernel.input_names(has_bias)]
        outs = [(n, types["uint32"] if n.endswith("w") else types[dtype]) for n in write_kernel.output_names()]
        fname = f"custom_kernel_gbx_kvwrite_q{bits}_g{gs}_{dtype}_{quantizer}"
        parts.append(signature(consts + kv_source, fname, ins, outs))
    return "\n".join(parts)


def kv_variants() -> List[Tuple[int, int, str, str]]:
    """(bits, group size, dtype, quantizer) of the KV write kernels checked: every
    bit width, dtype and quantizer, the group sizes taken in turn."""
    combos = itertools.product((2, 3, 4, 5, 6, 8), ("float32", "float16", "bfloat16"), ("minmax", "ls"))
    return [(bits, (32, 64, 128)[i % 3], dtype, q) for i, (bits, dtype, q) in enumerate(combos)]


def nested_variants() -> List[Tuple[Tuple[int, ...], str, str, int, bool, int]]:
    """(plane bits, x dtype, scale dtype, group size, shared, vec) of the nested kernels checked."""
    plans = ((4,), (6,), (8,), (4, 4), (4, 4, 8), (4, 4, 6))
    dtypes = (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("float16", "float32"))
    return [(bits, dt, sdt, gs, shared, vec) for bits in plans for dt, sdt in dtypes
            for gs, shared, vec in ((64, True, 4), (32, False, 2), (128, False, 4))]


def sparse_variants() -> List[Tuple[str, str, int, int]]:
    """(x dtype, scale dtype, group size, rows) of the block-sparse kernels checked."""
    dtypes = (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("float16", "float32"))
    return [(dt, sdt, gs, rows) for dt, sdt in dtypes for gs in (64, 128) for rows in (1, 4)]


def mma_variants() -> List[Tuple[str, Optional[int], Tuple[int, ...]]]:
    """(dtype, group_size, splits) of the matrix-unit kernels worth checking."""
    return list(itertools.product(("float16", "bfloat16"), (None, 64), ((), (64, 128))))


def find_clang(explicit: Optional[str]) -> Optional[str]:
    if explicit:
        return explicit
    for name in ("clang", "clang++", "clang-18", "clang-17", "clang-16", "clang-15", "clang-14"):
        path = shutil.which(name)
        if path:
            return path
    return None


def compile_unit(clang: str, backend: str, text: str, workdir: Path, stub_dir: Path,
                 tag: str, nvcc: Optional[str] = None) -> Tuple[bool, str]:
    path = workdir / f"gbx_{backend}_{tag}.{'cpp' if backend == 'metal' else 'cu'}"
    path.write_text(text)
    if backend == "metal":
        cmd = [clang, "-fsyntax-only", "-x", "c++", "-std=c++17",
               "-include", str(stub_dir / "metal_stub.h"), *WARNING_FLAGS, str(path)]
    elif nvcc:
        # A real compile for the H100's architecture; ptxas reports registers
        # and spills (-v), which a kernel change should not make worse.
        cmd = [nvcc, "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(path) + ".cubin",
               "-Xptxas", "-v", "-Werror", "all-warnings",
               "-include", str(stub_dir / "mlx_cuda_default_header.cuh"), str(path)]
    else:
        cmd = [clang, "-fsyntax-only", "-x", "cuda", "-std=c++17", "--cuda-device-only",
               "--cuda-gpu-arch=sm_80", "-nocudainc", "-nocudalib",
               "-include", str(stub_dir / "cuda_stub.h"), *WARNING_FLAGS, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode == 0, " ".join(cmd) + "\n" + proc.stdout + proc.stderr


def check(directory: Path, clang: str, backends: Sequence[str], verbose: bool = False,
          nvcc: Optional[str] = None) -> int:
    stub_dir = Path(directory) / "check"
    failures = 0
    with tempfile.TemporaryDirectory(prefix="gbx_syntax_") as tmp:
        for backend in backends:
            for has_bias in (False, True):
                tag = "bias" if has_bias else "nobias"
                text = translation_unit(backend, Path(directory), has_bias)
                ok, log = compile_unit(clang, backend, text, Path(tmp), stub_dir, tag, nvcc)
                n = (sum(1 for v in variants() if v[4] == has_bias) + len(mma_variants())
                     + len(nested_variants()) + len(sparse_variants()) + len(kv_variants()))
                how = "nvcc sm_90" if backend == "cuda" and nvcc else "clang"
                print(f"{'ok  ' if ok else 'FAIL'} {backend:5s} {tag:6s} ({n} kernels, {how})")
                if not ok or verbose:
                    print(re.sub(r"\n{3,}", "\n\n", log))
                failures += not ok
    return 1 if failures else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source-dir", type=Path, default=None,
                    help="kernel sources: the metal_kernels/ folder of gearbx_format.h and the bodies (default: the package's)")
    ap.add_argument("--clang", default=None, help="clang executable (default: search PATH)")
    ap.add_argument("--cuda", action="store_true",
                    help="also check the CUDA twin (with nvcc if on PATH, else clang)")
    ap.add_argument("--no-nvcc", action="store_true", help="check the CUDA twin with clang")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    clang = find_clang(args.clang)
    if clang is None:
        print("clang not found: install it (apt-get install -y clang)", file=sys.stderr)
        return 2
    directory = args.source_dir or kernel_files.source_dir()
    backends = ["metal"] + (["cuda"] if args.cuda else [])
    nvcc = None if args.no_nvcc else shutil.which("nvcc")
    return check(directory, clang, backends, args.verbose, nvcc)


if __name__ == "__main__":
    sys.exit(main())
