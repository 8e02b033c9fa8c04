"""Self-checks of the nested-plane kernels (see :mod:`gearbx_mlx.kernelcheck`).

A gear of ``n`` planes computes ``y = sum_{p<n} 2**-e_p (x @ (s_p q_p + b_p).T)``.
The checks run each kernel that reads planes on this machine against that
sum written out from the stored codes in float64 (the codes read back
through ``mx.dequantize`` with unit scales, so no rounding of the reference's
own), over odd shapes, every gear of the kernels' widest plan, and every
input dtype (the planes' scales in the same dtype; on a GPU each shape in
one of them, in turn: :func:`~gearbx_mlx.kernelcheck.gpu_case_dtypes`):

* GPU (Metal or CUDA): the fused body, all of a gear's planes in one launch;
* CPU: every path of the C kernels (``float``, ``intdot`` and the scalar
  oracles), one activation row and a verify's three;
* the dispatch: ``NestedProduct`` on whatever path this machine takes,
  first-use guard included.

Bounds are the nested tests' (``tests/nested_cases.py``): ``OUTPUT_RTOL``
plus ``FLOAT_RTOL`` times the sum of the terms' magnitudes
(``|s q| |x| + |b| |x|``), plus, on the int8 paths, each activation's half
block step times ``|s q + b|``.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..bindings import cpu, gpu, nested_cpu, nested_gpu
from ..kernelcheck import (
    FLOAT_RTOL,
    Case,
    KernelCheck,
    Plant,
    compare,
    dtype_name,
    gemv_bound,
    gpu_case_dtypes,
    shard_of,
)
from .matmul import NestedProduct, gear_rows
from .planes import DEFAULT_PLAN, Plane, build_planes

DTYPES: Tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
#: The widest plan the kernels read: the default low and mid planes and an
#: 8-bit third plane.
KERNEL_PLAN: Tuple[Tuple[int, int], ...] = ((4, 64), (4, 32), (8, 64))
#: (out, in, plan): rows not a multiple of any split, K with a tail past the
#: last 64-input span, K above the GPU's threadgroup-memory limit, one plan
#: of 32-groups on a K no 64-group divides, and the default plan (its third
#: plane 6 bits).
CASES: Tuple[Tuple[int, int, Tuple[Tuple[int, int], ...]], ...] = (
    (33, 1088, KERNEL_PLAN), (9, 6272, KERNEL_PLAN), (17, 320, KERNEL_PLAN), (67, 96, ((4, 32), (4, 32))),
    (37, 576, DEFAULT_PLAN),
)
C_PATHS: Tuple[str, ...] = ("float", "intdot", "ref", "intdot_ref")


def make_planes(out_features: int, in_features: int, plan: Sequence[Tuple[int, int]], dtype: mx.Dtype,
                seed: int = 0) -> List[Plane]:
    """Planes of a random weight with a few outliers (as the nested tests'), scales in ``dtype``.

    Built once per argument set (the clipping search of each residual plane
    costs a sixth of a second; the C paths and the GPU check ask for the same
    planes): treat them as read-only."""
    return list(_planes_of(out_features, in_features, tuple(tuple(p) for p in plan), dtype, seed))


@functools.lru_cache(maxsize=32)
def _planes_of(out_features: int, in_features: int, plan: Tuple[Tuple[int, int], ...], dtype: mx.Dtype,
               seed: int) -> Tuple[Plane, ...]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02
    w[rng.random(w.shape) < 0.01] *= 10.0
    with mx.stream(mx.cpu):  # on a GPU, no run-time compile of the clipping search per odd shape
        planes = build_planes(mx.array(w).astype(dtype), list(plan))
        mx.eval([a for p in planes for a in p.arrays()])
        return tuple(planes)


def make_x(shape: Tuple[int, ...], dtype: mx.Dtype, seed: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < 0.02] *= 30.0  # activation outliers
    return mx.array(x).astype(dtype)


def plant_planes(planes: Sequence[Plane], plant: Optional[Plant]) -> List[Plane]:
    """The planes as a kernel with a planted element-order fault would read them."""
    if plant is None:
        return list(planes)
    out = []
    for p in planes:
        bad = plant(p.weight.view(mx.uint8), 4 if p.bits == 4 else 8).astype(mx.uint8)
        out.append(Plane(bad.view(mx.uint32).reshape(p.weight.shape), p.scales, p.biases, p.bits, p.group_size,
                         p.exponent))
    return out


def reference64(x: mx.array, planes: Sequence[Plane], n: int, bias: Optional[mx.array] = None) -> np.ndarray:
    """The gear's product in float64 from the stored codes, ``x``'s leading shape + ``(out,)``."""
    w, _ = gear_rows(planes, n)
    k = w.shape[1]
    y = np.array(x.astype(mx.float32)).reshape(-1, k).astype(np.float64) @ np.array(w).astype(np.float64).T
    if bias is not None:
        y = y + np.array(bias.astype(mx.float32)).astype(np.float64)
    return y.reshape(tuple(x.shape[:-1]) + (-1,))


def _case(x: mx.array, y: mx.array, gear: Tuple[Sequence[Plane], int, Sequence[Tuple[int, int]]],
          bias: Optional[mx.array], out_dtype: Optional[mx.Dtype], intdot: bool, extra: Sequence[str]) -> Case:
    """One checked product: ``gear`` is ``(planes, n, plan)``, the first ``n`` planes of ``plan``."""
    planes, n, plan = gear
    mx.eval(y)  # the kernel on its device; the reference and the bound on the CPU
    with mx.stream(mx.cpu):
        w, terms = gear_rows(planes, n)
        ref = reference64(x, planes, n, bias)
        bound = gemv_bound(x, w, mx.array(ref.astype(np.float32)), out_dtype=out_dtype, accum=FLOAT_RTOL,
                           intdot=intdot, terms=terms)
        o, k = w.shape
        label = " ".join([f"{o}x{k}", "/".join(f"{b}g{g}" for b, g in plan[:n])]
                         + (["bias"] if bias is not None else []) + list(extra))
        return Case(label, dtype_name(x.dtype), compare(y, ref, bound))


# -- GPU ---------------------------------------------------------------------------------


def _gpu(plant: Optional[Plant]) -> List[Case]:
    cases = []
    dtypes = gpu_case_dtypes(len(CASES), DTYPES)
    for i, (o, k, plan) in shard_of(CASES):  # all of them, or one part's in a parallel run
        dtype = dtypes[i]
        planes = make_planes(o, k, plan, dtype, seed=i)
        x = make_x((k,), dtype, seed=i)
        bias = make_x((o,), dtype, seed=i + 7) if i % 2 == 0 else None
        # Each gear is a compiled variant: a plan's later shapes check the gear that reads every plane.
        first = all(p != plan for _, _, p in CASES[:i])
        for n in range(1, len(plan) + 1) if first else (len(plan),):
            y = nested_gpu.nested_gemv(x, plant_planes(planes, plant), n, bias)
            if y is None:
                raise ValueError(f"the nested GPU kernel does not take planes {plan[:n]} of ({o}, {k}), {dtype}")
            cases.append(_case(x, y, (planes, n, plan), bias, dtype, False, []))
    return cases


# -- the C kernels -----------------------------------------------------------------------


def _c_path(path: str):
    intdot = path in ("intdot", "intdot_ref")

    def run(plant: Optional[Plant]) -> List[Case]:
        cases = []
        for dtype in DTYPES:
            for i, (o, k, plan) in enumerate(CASES):
                planes = make_planes(o, k, plan, dtype, seed=i)
                prepared = nested_cpu.prepare_nested(plant_planes(planes, plant))
                for rows in ((), (3,)):  # one activation row (decode), three (a verify)
                    x = make_x(rows + (k,), dtype, seed=i)
                    for n in range(1, len(plan) + 1):
                        y = prepared.gemv(x, n, path=path)
                        extra = [f"{rows[0]} rows"] if rows else []
                        cases.append(_case(x, y, (planes, n, plan), None, None, intdot, extra))
        return cases

    return run


def _c_device(path: str) -> str:
    info = cpu.info()
    if not info.get("available"):
        return "cpu C"
    return f"cpu C {info['intdot_isa'] if path == 'intdot' else info['float_isa'] if path == 'float' else 'scalar'}"


# -- the dispatch ------------------------------------------------------------------------


def _dispatch(plant: Optional[Plant]) -> List[Case]:
    """``NestedProduct`` on this machine's path for each gear, first-use guard included."""
    cases = []
    o, k, plan = CASES[0]
    on_gpu = gpu.gpu_backend() is not None
    for i, dtype in enumerate(DTYPES):
        planes = make_planes(o, k, plan, dtype, seed=5)
        product = NestedProduct(plant_planes(planes, plant))
        x = make_x((k,), dtype, seed=5)
        bias = make_x((o,), dtype, seed=6)
        for n in range(1, len(plan) + 1):
            if on_gpu and n != i + 1:  # a GPU compiles each variant: one gear per dtype, in turn
                continue
            path = product.backend_for(x, n, True)
            intdot = (path == "cpu" and product.cpu_path(n) == "intdot") or (
                path in ("metal", "cuda") and product.gpu_int8x(path, n))
            y = product(x, n, bias)
            cases.append(_case(x, y, (planes, n, plan), bias, dtype, intdot, [f"via {path}"]))
    return cases


def _dispatch_device() -> str:
    backend = gpu.gpu_backend()
    return gpu.device_label() if backend else "cpu C" if cpu.available() else str(mx.default_device())


def checks() -> List[KernelCheck]:
    """The nested kernels' checks, in the order the table prints them."""
    out = [KernelCheck("nested GEMV 1-3 planes", "a GPU (Metal or CUDA)", gpu.unavailable, gpu.device_label, _gpu,
                       shards=len(CASES))]
    out += [KernelCheck(f"C nested GEMV {path}", "the C kernels (built at install)", cpu.unavailable,
                        lambda p=path: _c_device(p), _c_path(path)) for path in C_PATHS]
    out.append(KernelCheck("NestedProduct dispatch", "any device", lambda: None, _dispatch_device, _dispatch))
    return out


#: The registry entry of this family (``gearbx_mlx.selftest`` runs every module's ``CHECKS``).
CHECKS: Sequence[KernelCheck] = tuple(checks())

__all__ = ["CASES", "CHECKS", "C_PATHS", "KERNEL_PLAN", "checks", "make_planes", "plant_planes",
           "reference64"]
