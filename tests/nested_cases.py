"""Cases and a float64 reference for the nested-plane kernels (C, GPU body, dispatch).

The reference is ``gearbx_mlx.nested.planes.reference_matmul``'s sum written
out in numpy float64 from the stored bits (codes unpacked from the uint32
words, scales and biases exactly as stored), so it carries no rounding of its
own: a kernel's error against it is the kernel's alone.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from gearbx_mlx.kernelcheck import ACT_BLOCK
from gearbx_mlx.nested.planes import build_planes

#: float32 accumulation in any order, relative to the sum of |terms|
#: (|f s q x| + |f b xsum| over planes and groups), K <= 8192.
ACCUM_RTOL = 2e-5
#: One unit in the last place of each output dtype, relative to |y|.
OUTPUT_RTOL = {mx.float32: 2.0**-21, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
#: The package's default plan (4 bits at 64, 4 at 32, 6 at 64): the widest
#: plan the kernels read with per-plane groups.
KERNEL_PLAN: Tuple[Tuple[int, int], ...] = ((4, 64), (4, 32), (6, 64))
#: Plans of planes: bits alone (every plane at the case's group size), or
#: (bits, group size) per plane. KERNEL_PLAN, its first two planes, the same
#: with an 8-bit third plane, planes 4/4/8, single 4-, 6- and 8-bit planes
#: (plain MLX layers), an 8-bit first plane, a 6-bit first plane at group 32,
#: and groups that shrink and grow.
PLANS: List[tuple] = [KERNEL_PLAN, KERNEL_PLAN[:2], ((4, 64), (4, 32), (8, 64)), (4, 4, 8), (4,), (6,), (8,),
                      (8, 4), ((6, 32), (4, 128), (8, 64)), ((4, 128), (8, 32), (4, 64))]


def plane_specs(plan: tuple, group_size: Optional[int]) -> List[Tuple[int, int]]:
    """``(bits, group size)`` per plane of ``plan`` (bits alone take ``group_size``)."""
    return [p if isinstance(p, tuple) else (p, group_size) for p in plan]


def plan_cases(plans: Sequence[tuple], shapes: Sequence[Tuple[int, int]]) -> List[tuple]:
    """``(plan, shape, group size)`` of each plan at each shape its groups divide
    (a per-plane plan once, with group size None)."""
    out = []
    for plan in plans:
        for gs in ((None,) if isinstance(plan[0], tuple) else (32, 64, 128)):
            for shape in shapes:
                if all(shape[1] % g == 0 for _, g in plane_specs(plan, gs)):
                    out.append((plan, shape, gs))
    return out
#: Odd shapes (out, in): rows not a multiple of any split, K with a tail past
#: the last 64-input span, K above the GPU's threadgroup-memory limit.
ODD_SHAPES: List[Tuple[int, int]] = [(67, 96), (33, 1088), (9, 6272), (17, 320)]


def f64(a: mx.array) -> np.ndarray:
    """An MLX float array as float64, bit-exactly (bfloat16 through its bits)."""
    if a.dtype == mx.bfloat16:
        bits = np.asarray(a.view(mx.uint16)).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(a.astype(mx.float32)).astype(np.float64)


def codes(plane) -> np.ndarray:
    """``(out, in)`` unsigned codes of a plane: MLX packs each row as a
    little-endian bit stream (code j at bits j*bits .. j*bits+bits-1; for 6 bits
    that is four codes in three bytes)."""
    w = np.ascontiguousarray(np.asarray(plane.weight).astype("<u4"))
    bits = np.unpackbits(w.view(np.uint8), axis=1, bitorder="little")
    bits = bits.reshape(w.shape[0], -1, plane.bits).astype(np.int64)
    return (bits << np.arange(plane.bits)).sum(-1).astype(np.float64)


def reference64(x: mx.array, planes: Sequence, n: int, bias: Optional[mx.array] = None):
    """``(y, magnitude)``: the gear's product in float64, ``(..., out)``, and the
    sum of |terms| per output (the scale of float32 summation error)."""
    xs = f64(x).reshape(-1, x.shape[-1])
    y = np.zeros((xs.shape[0], planes[0].weight.shape[0]))
    mag = np.zeros_like(y)
    for p in planes[:n]:
        gs = p.group_size
        f = 2.0 ** -p.exponent
        s = np.repeat(f64(p.scales), gs, axis=1)
        b = np.repeat(f64(p.biases), gs, axis=1)
        q = codes(p)
        y += f * (xs @ (s * q + b).T)
        xsum = np.abs(xs.reshape(xs.shape[0], -1, gs).sum(-1))  # |sum of x| per group
        mag += f * (np.abs(xs) @ np.abs(s * q).T + xsum @ np.abs(f64(p.biases)).T)
    if bias is not None:
        y += f64(bias)
    lead = tuple(x.shape[:-1])
    return y.reshape(lead + (-1,)), mag.reshape(lead + (-1,))


def make_planes(out_features: int, in_features: int, plan: tuple, group_size: Optional[int],
                dtype: mx.Dtype, seed: int = 0):
    """Planes of a random weight with a few outliers, in ``dtype`` (plan: see :data:`PLANS`)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02
    w[rng.random(w.shape) < 0.01] *= 10.0
    return build_planes(mx.array(w).astype(dtype), plane_specs(plan, group_size))


def make_x(shape: Tuple[int, ...], dtype: mx.Dtype, seed: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < 0.02] *= 20.0  # activation outliers
    return mx.array(x).astype(dtype)


def assert_close(y: mx.array, want: np.ndarray, magnitude: np.ndarray, dtype: mx.Dtype,
                 rtol: float = ACCUM_RTOL, extra: Optional[np.ndarray] = None, what: str = "kernel") -> None:
    """|y - want| <= OUTPUT_RTOL[dtype] |want| + rtol * magnitude (+ extra)."""
    got = f64(y).reshape(want.shape)
    bound = OUTPUT_RTOL[dtype] * np.abs(want) + rtol * magnitude + 1e-7
    if extra is not None:
        bound = bound + extra
    err = np.abs(got - want)
    worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    assert np.all(err <= bound), (
        f"{what}: output {worst}: {got[worst]} vs reference {want[worst]} (error {err[worst]:.3g}, "
        f"bound {bound[worst]:.3g})")


def intdot_bound(x: mx.array, planes, n: int) -> np.ndarray:
    """Largest error the int8 activations can add: sum_j |f (s q_j + b)| * d_b(j) / 2."""
    xs = f64(x).reshape(-1, x.shape[-1]).astype(np.float32)
    blocks = xs.reshape(xs.shape[0], -1, ACT_BLOCK)
    step = (np.abs(blocks).max(-1) / np.float32(127.0)).astype(np.float64)  # d_b
    half = np.repeat(step / 2, ACT_BLOCK, axis=1)  # (m, in)
    out = np.zeros((xs.shape[0], planes[0].weight.shape[0]))
    for p in planes[:n]:
        s = np.repeat(f64(p.scales), p.group_size, axis=1)
        b = np.repeat(f64(p.biases), p.group_size, axis=1)
        out += 2.0 ** -p.exponent * (half @ np.abs(s * codes(p) + b).T)
    return out.reshape(tuple(x.shape[:-1]) + (-1,))
