"""Safe first use of the custom kernels: check once, fall back to MLX, warn once.

A custom kernel that fails to build (a Metal or CUDA compile error on a chip
the kernel was never run on, a C library that will not load) or whose first
result disagrees with the reference must not stop a generation.
:class:`~gearbx_mlx.packed.layers.KernelRuntime` hands every new kernel
launcher through :func:`guarded`:

* a launcher that raises while it is built is never used;
* the first call of a launcher is evaluated at once (MLX compiles GPU kernels
  on first evaluation, so a compile error surfaces here) and its output on a
  sample of rows (:func:`~gearbx_mlx.kernelcheck.sample_rows`) is compared
  with :func:`~gearbx_mlx.packed.formats.reference_matmul` on the same input
  and rows, under the kernel tests' bounds (:mod:`gearbx_mlx.kernelcheck`);
* once a kernel variant passes for a layer shape it is trusted for that shape
  in this process: later layers of that shape get the bare launcher, with no
  check and no wrapper on the decode path.

On a failure the layer returns the reference result for that call, and it and
every later layer of the same kernel variant take MLX's path (the §7.1 dequant
cache or the reference), slower but correct. One ``RuntimeWarning`` per kernel
family names the kernel and what went wrong and asks the user to run
``python -m gearbx_mlx.selftest`` and share its output; :func:`status` lists
every failure (the bench writes it into its JSON).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import mlx.core as mx

from ..kernelcheck import compare, gemv_bound, sample_rows
from ..packed import formats

#: What the warning asks of the user.
ASK = ("packed layers of this kind use MLX's path instead (same results, slower). Please run "
       "`python -m gearbx_mlx.selftest` and share its output (README, 'First run on a Mac').")

_lock = threading.Lock()
_trusted: Set[Tuple[str, int, int]] = set()  # (kernel name, out_features, in_features)
_failed: Dict[str, str] = {}  # kernel name -> what went wrong
_warned: Set[str] = set()  # families already warned about


@dataclass(frozen=True)
class KernelSpec:
    """The layer a launcher computes: its format, shape and output splits.

    ``family`` names the kernel in the warning (``"metal packed GEMV"``);
    ``intdot``: the kernel rounds its activations to int8 (the C int-dot path).

    A launcher is called ``run(x, *arrays)``. For the packed format the
    arrays are ``(weight, scales, bias)`` and the reference is
    :mod:`~gearbx_mlx.packed.formats`'; another format (the nested planes,
    say) gives its own two functions of the same arrays:

    * ``rows_of(rows, *arrays) -> (w, bias[, terms])``: the float32 weights
      of the given output rows, ``(len(rows), in_features)``, their bias or
      None, and optionally the magnitudes of the terms the kernel sums
      (:func:`~gearbx_mlx.kernelcheck.gemv_bound`'s ``terms``);
    * ``reference(x, *arrays) -> y``: the whole output, as the launcher
      returns it (a list with ``splits``).
    """

    family: str
    bits: int
    group_size: Optional[int]
    in_features: int
    out_features: int
    splits: Tuple[int, ...] = ()
    intdot: bool = False
    rows_of: Optional[Callable[..., Tuple[mx.array, Optional[mx.array]]]] = None
    reference: Optional[Callable[..., Any]] = None


def guarded(spec: KernelSpec, build: Callable[[], Callable[..., Any]],
            settle: Callable[[Any], None]) -> Any:
    """A launcher for ``spec`` that checks its own first call, or False when the kernel is off.

    Args:
        build: makes the bare launcher ``run(x, weight, scales, bias) -> y``
            (a list of outputs with ``spec.splits``); may raise.
        settle: called once with the bare launcher after its first call
            passes, or False after it fails; the caller stores it in place of
            the wrapper, so the check costs nothing after the first call.

    Returns:
        The bare launcher (the kernel variant is trusted for this shape), a
        checking wrapper with the launcher's signature, or False.
    """
    try:
        run = build()
    except Exception as e:  # noqa: BLE001  (any build failure means: use MLX)
        _fail(spec.family, spec.family, f"it failed to build ({_short(e)})")
        return False
    name = getattr(run, "kernel_name", spec.family)
    shape = (name, spec.out_features, spec.in_features)
    with _lock:
        if name in _failed:
            return False
        if shape in _trusted:
            return run

    def first_call(x: mx.array, *arrays: Optional[mx.array]) -> Any:
        ok, why, out = _first_call(spec, run, x, arrays)
        if ok:
            with _lock:
                _trusted.add(shape)
            settle(run)
            return out
        _fail(spec.family, name, why)
        settle(False)
        return reference(spec, x, *arrays)

    return first_call


def _packed_rows(spec: KernelSpec, rows: mx.array, weight: mx.array, scales: mx.array,
                 bias: Optional[mx.array] = None) -> Tuple[mx.array, Optional[mx.array]]:
    w = formats.dequantize(mx.take(weight, rows, axis=0), mx.take(scales, rows, axis=0), spec.bits,
                           spec.group_size, spec.in_features)
    return w, None if bias is None else mx.take(bias, rows)


def _first_call(spec: KernelSpec, run: Callable[..., Any], x: mx.array,
                arrays: Tuple[Optional[mx.array], ...]) -> Tuple[bool, str, Any]:
    """``(passed, what went wrong, output)`` of the launcher's first call."""
    try:
        out = run(x, *arrays)
        mx.eval(out)
    except Exception as e:  # noqa: BLE001  (a compile or launch error surfaces at evaluation)
        return False, f"its first call raised ({_short(e)})", None
    y = mx.concatenate(out, axis=-1) if isinstance(out, (list, tuple)) else out
    # The check on the CPU: a few rows, and on a GPU each new shape and dtype of these
    # reference operations would be one more run-time compile on the first call.
    with mx.stream(mx.cpu):
        rows = mx.array(sample_rows(spec.out_features, spec.splits))
        got = spec.rows_of(rows, *arrays) if spec.rows_of else _packed_rows(spec, rows, *arrays)
        w, b, terms = (tuple(got) + (None,))[:3]
        x2 = x.reshape(-1, spec.in_features)  # one input row, or a few (a verify)
        ref = x2.astype(mx.float32) @ w.T
        if b is not None:
            ref = ref + b.astype(mx.float32)
        bound = gemv_bound(x2, w, ref, out_dtype=x.dtype, intdot=spec.intdot, terms=terms)
        result = compare(mx.take(y.reshape(-1, spec.out_features), rows, axis=1), ref, bound)
    if result.passed:
        return True, "", out
    return False, (f"its first result is off by {result.max_error:.3g} where the tests allow "
                   f"{result.tolerance:.3g}"), out


def reference(spec: KernelSpec, x: mx.array, *arrays: Optional[mx.array]) -> Any:
    """What the launcher should have returned, from the pure-MLX reference."""
    if spec.reference is not None:
        return spec.reference(x, *arrays)
    weight, scales, bias = (list(arrays) + [None])[:3]
    y = formats.reference_matmul(x, weight, scales, bits=spec.bits, group_size=spec.group_size,
                                 in_features=spec.in_features, bias=bias)
    if not spec.splits:
        return y
    bounds = (0,) + spec.splits + (spec.out_features,)
    return [y[..., a:b] for a, b in zip(bounds, bounds[1:])]


def _fail(family: str, name: str, why: str) -> None:
    with _lock:
        _failed[name] = why
        first = family not in _warned
        _warned.add(family)
    if first:
        kernel = family if name == family else f"{family} kernel {name}"
        warnings.warn(f"gearbx_mlx: the {kernel} failed its first-use check on this machine: {why}; {ASK}",
                      RuntimeWarning, stacklevel=4)


def record_failure(family: str, name: str, why: str) -> None:
    """Record that kernel ``name`` of ``family`` failed a first-use check made by its caller (a kernel
    checked outside :func:`guarded`, e.g. against a scalar C oracle): listed by :func:`failed` and
    :func:`status`, and one warning per family, as for the guarded kernels."""
    _fail(family, name, why)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def failed() -> Dict[str, str]:
    """``{kernel name: what went wrong}`` of every kernel that failed its first use."""
    with _lock:
        return dict(_failed)


def status() -> Dict[str, Any]:
    """What the guard has seen in this process (JSON-ready)."""
    with _lock:
        return {"trusted": sorted(f"{n} {o}x{k}" for n, o, k in _trusted), "failed": dict(_failed),
                "warned": sorted(_warned)}


def family_failed(prefix: str) -> List[str]:
    """Names of failed kernels whose family starts with ``prefix`` (e.g. ``"gbx_gemv_cpu"``)."""
    return [n for n in failed() if n.startswith(prefix)]


def reset() -> None:
    """Forget every check, failure and warning (tests; a process that rebuilt its kernels)."""
    with _lock:
        _trusted.clear()
        _failed.clear()
        _warned.clear()


__all__ = ["ASK", "KernelSpec", "failed", "family_failed", "guarded", "reference", "reset", "status"]
