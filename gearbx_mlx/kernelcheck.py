"""Checking custom kernels against their pure-MLX references: tolerances, bounds, the registry type.

Every custom kernel of the package (the packed GEMV in Metal, CUDA and C, and
the kernels that come after it) has a reference in plain MLX ops. Two callers
compare a kernel with its reference:

* ``python -m gearbx_mlx.selftest`` runs each :class:`KernelCheck` (one kernel
  family on this machine, over a fixed set of shapes and input dtypes) and
  prints one row per family and dtype;
* the first-use guard (:mod:`gearbx_mlx.bindings.guard`) compares a layer's
  first kernel call with the reference on the same input, once per kernel and
  shape.

Both use the bounds here, which are the kernel tests' named tolerances, so a
kernel passes on a user's machine exactly when it would pass the tests.

A family registers its checks by exporting ``CHECKS: List[KernelCheck]`` from
a module of its own (``gearbx_mlx.packed.checks`` for the packed GEMV) and
naming that module in the selftest's suite list; this module imports nothing
but MLX and numpy, so a kernel module of any layer can import it.

Named tolerances (per output element, relative to the products' magnitudes):

  OUTPUT_RTOL[dtype]  one unit in the last place of the output dtype, times
                      |y|: kernel and reference each round their float32
                      result once.
  ACCUM_TOL           float32 accumulation in another order, against an
                      MLX float32 reference, times ``sum_j |w_ij x_j|``.
  FLOAT_RTOL          float32 accumulation against a float64 reference
                      (the C kernels' tests), times ``sum_j |w_ij x_j|``.
  intdot              the C int-dot path rounds each activation to int8 with
                      one scale per block of ACT_BLOCK values: each is off
                      by at most half its block's step, so the bound adds
                      ``sum_j |w_ij| d_b(j) / 2`` with ``d_b = max|x_b| / 127``.
"""

from __future__ import annotations

import importlib
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import mlx.core as mx
import numpy as np

#: One unit in the last place of each output dtype, relative to |y| (tests/test_packed.py).
OUTPUT_RTOL: Dict[mx.Dtype, float] = {mx.float32: 2.0**-21, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
#: float32 accumulation in another order, relative to ``sum_j |w_ij x_j|`` (tests/test_packed.py).
ACCUM_TOL = 1e-4
#: float32 accumulation against float64, relative to ``sum_j |w_ij x_j|`` (tests/test_cpu_kernels.py).
FLOAT_RTOL = 2e-5
#: Activations per int8 scale of the C int-dot path.
ACT_BLOCK = 32
#: Absolute floor of every bound (outputs near zero).
ABS_FLOOR = 1e-6

#: A planted fault: ``plant(packed_weights, bits) -> packed_weights`` handed to
#: the kernel while the reference reads the true weights (see :data:`PLANTS`).
Plant = Callable[[mx.array, int], mx.array]


def swap_nibbles(packed: mx.array, bits: int) -> mx.array:
    """The packed weights as a kernel with the wrong element order would read them.

    int4: the two nibbles of every byte swapped (high nibble first instead
    of low); int8: the two bytes of every 16-bit pair swapped. A kernel that
    decodes correct weights in the wrong order computes exactly what a
    correct kernel computes from these.
    """
    if bits == 4:
        u = packed.astype(mx.uint8)
        return ((u & 0xF) << 4) | (u >> 4)
    if bits == 8:
        o, k = packed.shape
        even = k - k % 2
        pairs = packed[:, :even].reshape(o, even // 2, 2)[..., ::-1].reshape(o, even)
        return mx.concatenate([pairs, packed[:, even:]], axis=1) if even < k else pairs
    raise ValueError(f"no planted element-order fault for int{bits}: use 4 or 8")


#: Faults ``selftest --plant NAME`` plants in every check (to show that the checks can fail).
PLANTS: Dict[str, Plant] = {"nibble-order": swap_nibbles}


def gpu_case_dtypes(n_cases: int, dtypes: Sequence[mx.Dtype]) -> List[mx.Dtype]:
    """The one input dtype each of ``n_cases`` GPU cases runs in: ``dtypes`` in turn.

    Every GPU kernel variant (dtype, plan, bias and tuning are baked into its
    source) compiles on its first run, about a second each with CUDA's
    run-time compiler: every case in every dtype compiled some 95 variants
    (127 s of a 130 s self-test on an H200). One dtype per case, in turn,
    keeps every shape, and every dtype where there are as many cases, at a
    third of the compiles.
    """
    return [dtypes[i % len(dtypes)] for i in range(n_cases)]


# -- bounds -------------------------------------------------------------------------


def activation_steps(x: mx.array) -> mx.array:
    """``d_b(j) / 2`` per input ``j``: half the int8 step of its block of :data:`ACT_BLOCK`.

    ``x``: ``(K,)`` or ``(m, K)`` (each row its own blocks); the result has ``x``'s shape.
    """
    k = x.shape[-1]
    xf = mx.abs(x.reshape(-1, k).astype(mx.float32))
    pad = -k % ACT_BLOCK
    if pad:
        xf = mx.concatenate([xf, mx.zeros((xf.shape[0], pad), mx.float32)], axis=1)
    d = mx.max(xf.reshape(xf.shape[0], -1, ACT_BLOCK), axis=2) / 127.0
    return mx.repeat(d / 2, ACT_BLOCK, axis=1)[:, :k].reshape(x.shape)


def gemv_bound(
    x: mx.array,
    w: mx.array,
    ref: mx.array,
    *,
    out_dtype: Optional[mx.Dtype],
    accum: float = ACCUM_TOL,
    intdot: bool = False,
    terms: Optional[mx.array] = None,
) -> mx.array:
    """Largest allowed ``|y - ref|`` per output of ``y = x @ w.T``.

    Args:
        x: ``(K,)`` or ``(m, K)`` (leading dims of size 1 allowed) the input.
        w: ``(O, K)`` the dequantized weights (float32) the kernel multiplies by.
        ref: ``(O,)`` or ``(m, O)`` the reference output, float32.
        out_dtype: the output dtype (its rounding adds ``OUTPUT_RTOL * |ref|``);
            None for a float32 result compared before any cast.
        accum: :data:`ACCUM_TOL` against an MLX float32 reference,
            :data:`FLOAT_RTOL` against a float64 one.
        intdot: add the int8 activation term of the C int-dot path.
        terms: ``(O, K)`` magnitudes of the terms the kernel sums per weight,
            where they exceed ``|w|`` (an affine format sums ``s q`` and ``b``
            apart: ``|s q| + |b|``); default ``|w|``.

    Returns:
        ``ref``'s shape, float32.
    """
    k = w.shape[-1]
    xf = x.reshape(-1, k).astype(mx.float32)
    aw = mx.abs(w.astype(mx.float32))
    mag = mx.abs(xf) @ (aw if terms is None else terms.astype(mx.float32)).T
    bound = accum * mag + ABS_FLOOR
    if out_dtype is not None:
        bound = bound + OUTPUT_RTOL[out_dtype] * mx.abs(ref.astype(mx.float32).reshape(bound.shape))
    if intdot:
        bound = bound + activation_steps(xf) @ aw.T
    return bound.reshape(ref.shape)


@dataclass(frozen=True)
class Comparison:
    """The worst element of one comparison: where ``|y - ref| / bound`` is largest."""

    max_error: float  # |y - ref| at the worst element
    tolerance: float  # the bound there
    ratio: float  # their quotient (<= 1 passes); inf for a non-finite output
    largest_error: float  # the largest |y - ref| anywhere

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0


def compare(y: object, ref: object, bound: object) -> Comparison:
    """Compare ``y`` with ``ref`` elementwise under ``bound`` (arrays of one shape, any of MLX/numpy)."""
    yv = np.asarray(_numpy(y), dtype=np.float64).reshape(-1)
    rv = np.asarray(_numpy(ref), dtype=np.float64).reshape(-1)
    bv = np.asarray(_numpy(bound), dtype=np.float64).reshape(-1)
    if yv.shape != rv.shape or bv.shape != rv.shape:
        raise ValueError(f"compare needs arrays of one size: got {yv.shape}, {rv.shape}, {bv.shape}")
    if yv.size == 0:
        return Comparison(0.0, 0.0, 0.0, 0.0)
    err = np.abs(yv - rv)
    if not np.all(np.isfinite(yv)):
        i = int(np.argmax(~np.isfinite(yv)))
        return Comparison(float("inf"), float(bv[i]), float("inf"), float("inf"))
    ratio = err / bv
    i = int(np.argmax(ratio))
    return Comparison(float(err[i]), float(bv[i]), float(ratio[i]), float(err.max()))


def _numpy(a: object) -> np.ndarray:
    if isinstance(a, mx.array):
        return np.array(a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a)
    return np.asarray(a)


# -- the registry type ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One comparison of a check: a shape, an input dtype, and how it went."""

    shape: str  # e.g. "67x96 g32 bias"
    dtype: str  # the input dtype
    result: Comparison

    def to_dict(self) -> Dict[str, object]:
        r = self.result
        return {"shape": self.shape, "dtype": self.dtype, "max_error": r.max_error, "tolerance": r.tolerance,
                "ratio": r.ratio, "largest_error": r.largest_error, "passed": r.passed}


@dataclass
class CheckResult:
    """What one :class:`KernelCheck` found: its cases, or why it could not run."""

    name: str
    device: str
    cases: List[Case] = field(default_factory=list)
    error: Optional[str] = None  # the kernel raised (a build failure, say): the check fails
    seconds: float = 0.0  # wall time of the check, its kernels' first-run compiles included

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.result.passed for c in self.cases)

    def worst(self, dtype: Optional[str] = None) -> Optional[Case]:
        cases = [c for c in self.cases if dtype is None or c.dtype == dtype]
        return max(cases, key=lambda c: c.result.ratio) if cases else None

    def to_dict(self) -> Dict[str, object]:
        return {"name": self.name, "device": self.device, "passed": self.passed, "error": self.error,
                "seconds": self.seconds, "cases": [c.to_dict() for c in self.cases]}


@dataclass(frozen=True)
class KernelCheck:
    """One kernel family's self-check.

    Attributes:
        name: what the table calls it, e.g. ``"packed GEMV int4 (SIMT)"``.
        needs: the device it needs, in words (``"a GPU (Metal or CUDA)"``, ``"the C kernels"``).
        unavailable: ``() -> None`` where it can run on this machine, else why not.
        device: ``() -> str``, the device it runs on here (``"metal"``, ``"cpu C avx2"``...).
        run: ``(plant) -> List[Case]``; ``plant`` (None normally) corrupts the
            packed weights the kernel reads (:data:`PLANTS`), never the reference's.
    """

    name: str
    needs: str
    unavailable: Callable[[], Optional[str]]
    device: Callable[[], str]
    run: Callable[[Optional[Plant]], List[Case]]
    shards: int = 1  # parts a parallel run may split it into (its run takes :func:`shard_of` of its cases)

    def check(self, plant: Optional[Plant] = None) -> CheckResult:
        """Run the check; an exception from the kernel fails it with the message kept."""
        out = CheckResult(self.name, self.device())
        tic = time.perf_counter()
        try:
            out.cases = list(self.run(plant))
        except Exception as e:  # noqa: BLE001  (a kernel that fails to build or launch is a finding)
            out.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        out.seconds = time.perf_counter() - tic
        return out


def run_checks(
    checks: Sequence[KernelCheck],
    plant: Optional[Plant] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Tuple[List[CheckResult], List[Tuple[KernelCheck, str]]]:
    """Run every check that can run here.

    Returns:
        ``(results, skipped)``: a :class:`CheckResult` per check that ran, and
        ``(check, why not)`` for each one this machine cannot run.
    """
    results: List[CheckResult] = []
    skipped: List[Tuple[KernelCheck, str]] = []
    for i, c in enumerate(checks, 1):
        why = c.unavailable()
        if why is not None:
            skipped.append((c, why))
            continue
        if progress:
            progress(f"[{i}/{len(checks)}] {c.name} ...")
        results.append(c.check(plant))
    return results, skipped


# -- running checks in several processes ---------------------------------------------------

_T = TypeVar("_T")
#: (k, n): this process runs shard k of n of a sharded check (:func:`shard_of`).
_SHARD: List[int] = [0, 1]


def shard_of(items: Sequence[_T]) -> List[Tuple[int, _T]]:
    """``(index, item)`` of the items this process's shard of a check takes:
    every one in a plain run, every n-th from k in shard k of n."""
    k, n = _SHARD
    return [(i, item) for i, item in enumerate(items) if i % n == k]


def _resolve(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def _run_shard(suite: str, index: int, shard: Tuple[int, int], plant: Optional[str],
               status: str) -> Tuple[CheckResult, Dict[str, Any]]:
    """In a worker process: shard ``shard`` of check ``index`` of ``suite()``, and the
    first-use state (``status()``) of the worker afterwards."""
    check = _resolve(suite)()[index]
    _SHARD[:] = shard
    try:
        result = check.check(PLANTS[plant] if plant else None)
    finally:
        _SHARD[:] = [0, 1]
    return result, _resolve(status)()


def _merge(parts: List[Tuple[int, CheckResult]]) -> CheckResult:
    """One check's result from its shards' (in shard order; its time the slowest shard's)."""
    parts = sorted(parts, key=lambda p: p[0])
    out = CheckResult(parts[0][1].name, parts[0][1].device)
    for _, r in parts:
        out.cases += r.cases
        out.error = out.error or r.error
        out.seconds = max(out.seconds, r.seconds)
    return out


def run_checks_parallel(
    suite: str,
    indices: Sequence[int],
    plant: Optional[str],
    jobs: int,
    status: str,
    progress: Optional[Callable[[str], None]] = None,
) -> Tuple[List[CheckResult], List[Tuple[KernelCheck, str]], List[Dict[str, Any]]]:
    """:func:`run_checks` over ``jobs`` worker processes: each check's shards at once.

    A GPU kernel compiles on its first run in each process (CUDA's run-time
    compiler takes seconds per variant, on one CPU core): spread over
    processes, the compiles overlap. ``suite`` and ``status`` name
    ``"module:function"`` (every check, in order; the first-use state), so a
    worker imports them; ``plant`` is a key of :data:`PLANTS`.

    Returns:
        ``(results, skipped, statuses)``: as :func:`run_checks`, and each
        worker task's first-use state.
    """
    checks = _resolve(suite)()
    tasks, skipped = [], []
    for i in indices:
        why = checks[i].unavailable()
        if why is not None:
            skipped.append((checks[i], why))
        else:
            tasks += [(i, (k, checks[i].shards)) for k in range(checks[i].shards)]
    # The sharded (slowest) checks first, then in order.
    tasks.sort(key=lambda t: (-checks[t[0]].shards, t[0], t[1][0]))
    parts: Dict[int, List[Tuple[int, CheckResult]]] = {}
    statuses: List[Dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(tasks))),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_shard, suite, i, shard, plant, status): (i, shard) for i, shard in tasks}
        for done, future in enumerate(as_completed(futures), 1):
            i, (k, n) = futures[future]
            try:
                result, state = future.result()
                statuses.append(state)
            except Exception as e:  # noqa: BLE001  (a worker that died fails its check)
                result = CheckResult(checks[i].name, "-", error=f"worker process failed: {type(e).__name__}: {e}"[:300])
            parts.setdefault(i, []).append((k, result))
            if progress:
                part = f" (part {k + 1}/{n})" if n > 1 else ""
                progress(f"[{done}/{len(tasks)}] {checks[i].name}{part}: {result.seconds:.1f} s")
    return [_merge(parts[i]) for i in indices if i in parts], skipped, statuses


def table_rows(results: Sequence[CheckResult]) -> List[Dict[str, object]]:
    """One row per check and input dtype: its worst case (largest error over its bound)."""
    rows: List[Dict[str, object]] = []
    for r in results:
        if r.error is not None or not r.cases:
            rows.append({"kernel": r.name, "device": r.device, "dtype": "-", "cases": len(r.cases),
                         "worst": r.error or "no cases", "max_error": None, "tolerance": None, "passed": r.passed})
            continue
        for dtype in dict.fromkeys(c.dtype for c in r.cases):
            cases = [c for c in r.cases if c.dtype == dtype]
            w = max(cases, key=lambda c: c.result.ratio)
            rows.append({"kernel": r.name, "device": r.device, "dtype": dtype, "cases": len(cases),
                         "worst": w.shape, "max_error": w.result.max_error, "tolerance": w.result.tolerance,
                         "passed": all(c.result.passed for c in cases)})
    return rows


def format_table(rows: Sequence[Dict[str, object]]) -> str:
    """The selftest's table: kernel, device, dtype, shapes (count and the worst), error, tolerance, pass."""
    head = ("kernel", "device", "dtype", "shapes", "worst shape", "max err", "tolerance", "pass")
    body = []
    for r in rows:
        err, tol = r["max_error"], r["tolerance"]
        body.append((str(r["kernel"]), str(r["device"]), str(r["dtype"]), str(r["cases"]), str(r["worst"]),
                     "-" if err is None else f"{err:.3g}", "-" if tol is None else f"{tol:.3g}",
                     "ok" if r["passed"] else "FAIL"))
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    return "\n".join(lines)


def shape_label(out_features: int, in_features: int, group_size: Optional[int], bias: bool,
                extra: Sequence[str] = ()) -> str:
    """``"67x96 g32 bias"``: the shape of a GEMV case as the table prints it."""
    parts = [f"{out_features}x{in_features}", "row" if group_size is None else f"g{group_size}"]
    parts += ["bias"] if bias else []
    return " ".join(parts + list(extra))


def dtype_name(dtype: mx.Dtype) -> str:
    return {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype, str(dtype))


def sample_rows(out_features: int, bounds: Tuple[int, ...] = (), width: int = 32) -> List[int]:
    """Rows a first-use check compares: the first, middle and last ``width``, and
    ``width // 4`` each side of every boundary in ``bounds`` (split outputs)."""
    rows = set(range(min(width, out_features)))
    mid = out_features // 2
    rows |= set(range(max(0, mid - width // 2), min(out_features, mid + width // 2)))
    rows |= set(range(max(0, out_features - width), out_features))
    for b in bounds:
        rows |= set(range(max(0, b - width // 4), min(out_features, b + width // 4)))
    return sorted(rows)


__all__ = [
    "ABS_FLOOR", "ACCUM_TOL", "ACT_BLOCK", "Case", "CheckResult", "Comparison", "FLOAT_RTOL", "KernelCheck",
    "OUTPUT_RTOL", "PLANTS", "Plant", "activation_steps", "compare", "dtype_name", "format_table", "gemv_bound",
    "run_checks", "run_checks_parallel", "sample_rows", "shape_label", "shard_of", "swap_nibbles", "table_rows",
]
