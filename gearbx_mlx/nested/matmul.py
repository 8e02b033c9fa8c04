"""The product of a nested gear, through the fastest kernel that applies, chosen per call.

A gear reads the first ``n`` planes of a matrix (:mod:`.planes`) and computes
``x @ (deq(p0) + ... + deq(p_{n-1})).T (+ bias)``. Three implementations, in
this order (:meth:`NestedProduct.backend_for` tells which a call takes):

1. one input row on a GPU device: the fused kernel of
   :mod:`gearbx_mlx.bindings.nested_gpu` (Metal, or its CUDA twin), every plane
   of the gear in one launch;
2. on the CPU device, when the extension is built: the C kernels of
   :mod:`gearbx_mlx.bindings.nested_cpu` for up to ``cpu_max_rows`` input rows
   (decode, a speculative verify of a few tokens), and for any number of
   rows where MLX's BLAS is a reference one (:func:`gearbx_mlx.blas.optimized`:
   its products are about ten times slower than these kernels); float32
   activations, except for the gears listed in ``intdot_plans`` (int8
   activations: faster, and their error is small next to the gear's own)
   and, for one input row (a decode step), in ``intdot_one_row_plans``;
3. on the CPU device, more rows than that (a long prefill on an optimized
   BLAS, or any rows without the C kernels): :func:`.planes.dense_matmul`,
   the gear dequantized once and one BLAS product. MLX's CPU
   ``quantized_matmul`` runs without BLAS at about one multiply-add per
   nanosecond, whatever the scales' dtype (``scripts/bench_qmm_cpu.py``), and
   the oracle makes one per plane;
4. everywhere else (one row without the kernels, prefill on a GPU, other
   plane widths): the oracle :func:`.planes.reference_matmul`, one
   ``mx.quantized_matmul`` per plane.

A layer (``NestedLinear``) keeps one :class:`NestedProduct` per matrix: it
checks the planes and builds the kernels' state once (the precision manager
has it built with the planes, on the CPU: not in the first prefill), the C
GEMV and the dense path's unpacking share it, and a gear shift only changes
``n``. Each kernel's first call per gear and shape checks itself
against the oracle (:mod:`gearbx_mlx.bindings.guard`); one that fails to build
or disagrees is dropped for the oracle, with one warning. :func:`nested_matmul` is the same product without the cache.
The planes are treated as immutable once a product has used them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx

from .. import blas
from ..bindings import gpu, guard, nested_cpu, nested_gpu
from ..mlx_tables import GROUP_SIZES, QUANT_BITS
from ..packed.layers import cpu_backend
from .planes import Plane, build_planes, dense_matmul, reference_matmul, reserve_dense_scratch

#: Names :meth:`NestedProduct.backend_for` returns.
BACKENDS = ("metal", "cuda", "cpu", "dense", "reference")


@dataclass(frozen=True)
class NestedKernelConfig:
    """Where each kernel is used.

    intdot_plans: the bits of the planes read by the gears whose CPU product
        quantizes activations to int8. A lone 4-bit plane (the low gear; 9%
        relative weight error) only: int8 activations add about 0.5% relative
        error (``scripts/bench_nested_kernels.py`` measures both per gear),
        which would double the mid gear's and swamp the high gear's.
    intdot_one_row_plans: the same for one input row only: the mid gear's
        planes (4 + 4 bits), whose one-row product (a decode step, and the
        prompt's last token) then computes as the separate store's 8-bit mid
        gear does (its C GEMV takes int8 activations), at 0.6x the float
        path's time. Teacher-forced step by step, int8 activations add about
        3.5e-3 nats of KL to the mid gear in either store
        (``scripts/bench_mid_activations.py``), a hundredth of the low gear's.
        More rows (a prefill chunk, a verify) keep float32 activations, as
        the separate store's do.
    cpu_max_rows: the most input rows the C kernels take in one call where
        MLX's BLAS is optimized: they re-read each weight row from cache once
        per input row, and their float path slows past a few rows. On a
        reference BLAS they take every row count.
    """

    intdot_plans: Tuple[Tuple[int, ...], ...] = ((4,),)
    intdot_one_row_plans: Tuple[Tuple[int, ...], ...] = ((4, 4),)
    cpu_max_rows: int = 8
    #: Threads of the dense path's C unpacking (None: the C kernels' count). Its pool
    #: workers sleep as soon as the unpacking is done (an unpacking job does not keep
    #: them spinning for a next call as a decode GEMV does), so they leave the CPUs to
    #: the BLAS product that follows; on two CPUs that was ahead of unpacking on the
    #: calling thread alone (``scripts/bench_prefill_inprocess.py``, docs/BENCHMARKS.md,
    #: prompt tokens/s).
    dense_unpack_threads: Optional[int] = None
    gpu_low_mlx: bool = True
    gpu_compile: bool = True
    #: The bits of the planes read by the gears whose one-token GPU product rounds
    #: x to int8 (:attr:`gearbx_mlx.bindings.nested_gpu.NestedTuning.int8x`: one step
    #: per 32 inputs, as the CPU's int-dot path; the first-use guard's bound counts
    #: it) where the GPU has a 4-way integer dot product (CUDA; Metal keeps float
    #: activations): the mid gear's, as :attr:`intdot_one_row_plans` on the CPU. Its
    #: product took 0.81-0.92x the float split's time at Llama-3-8B's four shapes on
    #: an H200 (docs/BENCHMARKS.md, the mid kernel with int8 activations).
    gpu_int8x_plans: Tuple[Tuple[int, ...], ...] = ((4, 4),)
    #: On a GPU, the precision manager reads each fused group (q/k/v, gate/up) of a
    #: gear in one launch (:mod:`.fused`) and compiles each block's one-token step
    #: per gear (:mod:`gearbx_mlx.blockstep`): docs/BENCHMARKS.md, the GPU gears.
    gpu_fuse_groups: bool = True
    gpu_block_steps: bool = True


DEFAULT_CONFIG = NestedKernelConfig()


def low_gear_through_mlx(plane: Plane, fused: bool, config: NestedKernelConfig = DEFAULT_CONFIG) -> bool:
    """True if a low-gear view of ``plane`` (plane 0) calls ``mx.quantized_matmul`` directly.

    Plane 0 is MLX's own quantization (``mx.quantize``: codes, scales and
    biases; factor 1), so a lone plane-0 product is ``nn.QuantizedLinear``'s,
    bit for bit. It is taken where the kernel choice leaves it to MLX
    (``fused=False``: the oracle, which is this very call) and on a GPU default
    device (``config.gpu_low_mlx``). On the CPU a fused view keeps the C
    kernels that the resolver chose. Decided when the view is built.
    """
    if plane.exponent or plane.bits not in QUANT_BITS or plane.group_size not in GROUP_SIZES:
        return False
    return not fused or (config.gpu_low_mlx and gpu.gpu_backend() is not None)


class NestedProduct:
    """The planes of one ``(out, in)`` matrix and the cached state of their kernels.

    Args:
        planes: one to three :class:`.planes.Plane` of the matrix, low gear first.
        config: where each kernel is used (:data:`DEFAULT_CONFIG`).
    """

    def __init__(self, planes: Sequence[Plane], config: NestedKernelConfig = DEFAULT_CONFIG) -> None:
        if not 1 <= len(planes) <= 3:
            raise ValueError(f"a nested matrix has 1 to 3 planes, got {len(planes)}")
        self.planes = list(planes)
        self.config = config
        self.out_features, self.in_features = planes[0].shape
        self._prepared: Optional[nested_cpu.PreparedNested] = None
        self._cpu_ok: Optional[bool] = None
        self._gpu: Dict[tuple, object] = {}  # (backend, dtype, n, bias) -> launcher or False
        # (n, path) -> the C kernels' run(x), or False after a failed first use
        self._cpu: Dict[Tuple[int, str], object] = {}
        # (dtype, n, bias) -> run(x, shape, bias): the one-token GPU call with
        # everything but x and the bias bound, valid while the default device
        # is self._fast_device (a decode step makes hundreds of these calls)
        self._fast: Dict[tuple, Callable[[mx.array, tuple, Optional[mx.array]], mx.array]] = {}
        self._fast_device: Optional[mx.Device] = None

    # -- which path ---------------------------------------------------------------

    def _rows(self, x: mx.array) -> int:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the matrix expects {self.in_features}")
        return x.size // self.in_features

    def _gpu_launcher(self, backend: str, dtype: mx.Dtype, n: int, has_bias: bool):
        key = (backend, dtype, n, has_bias)
        run = self._gpu.get(key)
        if run is None:
            used = self.planes[:n]
            bits, gs = tuple(p.bits for p in used), tuple(p.group_size for p in used)
            sdt = used[0].scales.dtype
            uniform = all(p.scales.dtype == sdt and p.biases.dtype == sdt for p in used)
            ok = uniform and nested_gpu.supports(bits, gs, self.in_features, self.out_features, dtype, sdt)
            int8x = self.gpu_int8x(backend, n)
            tuning = nested_gpu.int8x_tuning(n, self.out_features) if int8x else None

            def settle(r: object) -> None:
                self._gpu[key] = r
                self._fast.pop((dtype, n, has_bias), None)  # rebound to the bare launcher on the next call

            run = ok and guard.guarded(
                self._spec(f"{backend} nested GEMV", n, int8x),
                lambda: nested_gpu.launcher(backend, bits, gs, self.in_features, self.out_features, dtype, sdt,
                                            has_bias, tuning=tuning), settle)
            self._gpu[key] = run
        return run

    def gpu_int8x(self, backend: str, n: int) -> bool:
        """True if the one-token product of the gear of ``n`` planes on ``backend`` rounds x to
        int8 (:attr:`NestedKernelConfig.gpu_int8x_plans`, where the GPU can)."""
        bits = tuple(p.bits for p in self.planes[:n])
        return bits in self.config.gpu_int8x_plans and nested_gpu.int8x_applies(backend, bits, self.in_features, 4)

    def _spec(self, family: str, n: int, intdot: bool) -> guard.KernelSpec:
        """What the first-use guard checks a kernel of the gear of ``n`` planes against."""
        planes = self.planes[:n]

        def rows_of(rows: mx.array, *args: object) -> Tuple[mx.array, Optional[mx.array], mx.array]:
            bias = args[-1] if len(args) == 3 else None  # the GPU launcher's (arrays, factors, bias)
            w, terms = gear_rows(planes, len(planes), rows)
            return w, None if bias is None else mx.take(bias, rows), terms

        def reference(x: mx.array, *args: object) -> mx.array:
            bias = args[-1] if len(args) == 3 else None
            y = reference_matmul(x.reshape(-1, self.in_features), planes, len(planes), bias)
            return y.reshape(*x.shape[:-1], self.out_features)

        return guard.KernelSpec(family, 0, None, self.in_features, self.out_features, intdot=intdot,
                                rows_of=rows_of, reference=reference)

    def _cpu_launcher(self, n: int, path: str):
        """The C kernels' ``run(x) -> y`` (float32, no bias) for the gear of ``n`` planes on
        ``path`` (:meth:`cpu_path`), or False."""
        key = (n, path)
        run = self._cpu.get(key)
        if run is None:
            prepared = self._prepared
            plan = "_".join(f"{p.bits}g{p.group_size}" for p in self.planes[:n])

            def build():
                def gemv(x: mx.array) -> mx.array:
                    return prepared.gemv(x, n, path=path)

                gemv.kernel_name = f"gbx_nested_cpu_{plan}_{path}"
                return gemv

            run = guard.guarded(self._spec("C nested GEMV", n, path == "intdot"), build,
                                lambda r: self._cpu.__setitem__(key, r))
            self._cpu[key] = run
        return run

    def cpu_prepared(self) -> Optional[nested_cpu.PreparedNested]:
        """The leading planes the C kernels read (4, 6 or 8 bits), checked on first
        use; None where none are or the extension is not built. A gear of more
        planes than it holds takes the oracle."""
        if self._cpu_ok is None:
            k = 0
            while k < len(self.planes) and self.planes[k].bits in nested_cpu.NESTED_BITS and self.planes[k].group_size in GROUP_SIZES:
                k += 1
            self._cpu_ok = k > 0 and cpu_backend() is not None
            if self._cpu_ok:
                self._prepared = nested_cpu.prepare_nested(self.planes[:k])
        return self._prepared

    def reserve_dense(self) -> bool:
        """Where a prefill of this matrix takes the dense path with the C unpacking (the CPU
        device, an optimized BLAS, the kernels built), allocate the float32 matrix it unpacks
        into now (:func:`.planes.reserve_dense_scratch`) rather than in the first prefill.
        Returns True where it did."""
        if mx.default_device().type != mx.DeviceType.cpu or not blas.optimized() or self.cpu_prepared() is None:
            return False
        return reserve_dense_scratch(self.out_features, self.in_features)

    def _host_prepared(self) -> Optional[nested_cpu.PreparedNested]:
        """:meth:`cpu_prepared` on the CPU device (one state for the C GEMV and the dense path's
        unpacking, built once), else None."""
        return self.cpu_prepared() if mx.default_device().type == mx.DeviceType.cpu else None

    def backend_for(self, x: mx.array, n: int, has_bias: bool = False) -> str:
        """Which path ``self(x, n)`` takes now (see the module docstring)."""
        rows = self._rows(x)
        backend = gpu.gpu_backend()
        if backend is not None:
            if rows == 1 and self._gpu_launcher(backend, x.dtype, n, has_bias):
                return backend
            return "reference"
        few = rows <= self.config.cpu_max_rows or not blas.optimized()
        prepared = self.cpu_prepared() if few else None
        if prepared is not None and n <= prepared.n_planes:
            return "cpu"
        return "dense" if rows > 1 else "reference"

    def cpu_path(self, n: int, rows: int = 1) -> str:
        """The C kernels' path for the gear of ``n`` planes and ``rows`` input rows: "intdot" or "float"."""
        bits = tuple(p.bits for p in self.planes[:n])
        one_row = rows == 1 and bits in self.config.intdot_one_row_plans
        return "intdot" if one_row or bits in self.config.intdot_plans else "float"

    # -- the product --------------------------------------------------------------

    def _bind_gpu(self, backend: str, dtype: mx.Dtype, n: int, has_bias: bool):
        run = self._gpu_launcher(backend, dtype, n, has_bias).bound(
            nested_gpu.plane_arrays(self.planes, n), nested_gpu.factors_of(self.planes, n))
        if self.config.gpu_compile:
            run = nested_gpu.compiled(run, has_bias)
        device = mx.default_device()
        if self._fast_device is None or device != self._fast_device:  # another device: rebind everything
            self._fast.clear()
            self._fast_device = device
        self._fast[(dtype, n, has_bias)] = run
        return run

    def __call__(self, x: mx.array, n: int, bias: Optional[mx.array] = None) -> mx.array:
        """``(..., in)`` -> ``(..., out)`` in ``x.dtype``: the gear of the first ``n`` planes."""
        # Decode on a GPU first: a step makes hundreds of these calls, and on a
        # fast GPU the host's time per call is the decode speed. So only the
        # cheapest reads (an nanobind enum compare or x.shape costs ~1 us):
        # the device by identity, one shape tuple, one dict read.
        if self._fast and x.size == self.in_features and mx.default_device() == self._fast_device:
            fast = self._fast.get((x.dtype, n, bias is not None))
            if fast is not None:
                shape = x.shape
                if shape[-1] == self.in_features:
                    return fast(x, shape, bias)
        if not 1 <= n <= len(self.planes):
            raise ValueError(f"a gear reads 1 to {len(self.planes)} planes, got {n}")
        path = self.backend_for(x, n, bias is not None)
        if path in ("metal", "cuda"):
            run = self._gpu_launcher(path, x.dtype, n, bias is not None)
            if not hasattr(run, "bound"):  # the first-use check's wrapper: one call, then settled
                if bias is not None and bias.dtype != x.dtype:
                    bias = bias.astype(x.dtype)
                return run(x, nested_gpu.plane_arrays(self.planes, n), nested_gpu.factors_of(self.planes, n), bias)
            return self._bind_gpu(path, x.dtype, n, bias is not None)(x, x.shape, bias)
        run = self._cpu_launcher(n, self.cpu_path(n, x.size // self.in_features)) if path == "cpu" else False
        if run:
            y = run(x)
            if bias is not None:
                y = y + bias.astype(mx.float32)
            return y.astype(x.dtype)
        if path == "dense":
            return dense_matmul(x, self.planes, n, bias, prepared=self._host_prepared(),
                                unpack_threads=self.config.dense_unpack_threads)
        if x.ndim == 1:  # MLX's CUDA quantized_matmul wants a matrix
            return reference_matmul(x[None], self.planes, n, bias)[0]
        return reference_matmul(x, self.planes, n, bias)


def gear_rows(planes: Sequence[Plane], n: int, rows: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """``(w, terms)`` of the first ``n`` planes, float32 ``(rows, in)`` (all rows if None).

    ``w = sum f (s q + b)``, the gear's weights formed from the stored codes
    (read back through ``mx.dequantize`` with unit scales: exact); ``terms =
    sum f (|s q| + |b|)``, the magnitudes a kernel's float32 sums carry
    (:func:`gearbx_mlx.kernelcheck.gemv_bound`).
    """
    w = terms = None
    for p in planes[:n]:
        code, scales, biases = (p.weight, p.scales, p.biases) if rows is None else (
            mx.take(p.weight, rows, axis=0), mx.take(p.scales, rows, axis=0), mx.take(p.biases, rows, axis=0))
        q = mx.dequantize(code, mx.ones(scales.shape, mx.float32), mx.zeros(scales.shape, mx.float32),
                          group_size=p.group_size, bits=p.bits)
        s = mx.repeat(scales.astype(mx.float32), p.group_size, axis=1)
        b = mx.repeat(biases.astype(mx.float32), p.group_size, axis=1)
        wp, tp = p.factor * (s * q + b), p.factor * (mx.abs(s * q) + mx.abs(b))
        w, terms = (wp, tp) if w is None else (w + wp, terms + tp)
    return w, terms


def nested_kernels_trusted() -> bool:
    """True if the C nested kernels pass a first-use check on a small odd matrix of each plane width.

    For callers that read planes through the C kernels without a
    :class:`NestedProduct` (the speculative drafter's host step).
    """
    if cpu_backend() is None:
        return False
    w = mx.random.normal((37, 128), key=mx.random.key(11)) * 0.02  # explicit keys: the caller's stream is untouched
    x = mx.random.normal((128,), key=mx.random.key(12))
    from_planes = build_planes(w, ((4, 64), (4, 32), (8, 64)))
    product = NestedProduct(from_planes)
    for n in (1, 2, 3):
        product(x, n)
    return not guard.family_failed("gbx_nested_cpu")


def nested_matmul(
    x: mx.array, planes: Sequence[Plane], n: int, bias: Optional[mx.array] = None, *,
    config: NestedKernelConfig = DEFAULT_CONFIG,
) -> mx.array:
    """``x @ (deq(p0) + ... + deq(p_{n-1})).T (+ bias)`` through the best kernel for it now.

    Args:
        x: ``(..., in)``, float32, float16 or bfloat16.
        planes: the matrix's planes (:func:`.planes.build_planes`); ``n`` are read.
        bias: ``(out,)`` or None.
    Returns:
        ``(..., out)`` in ``x.dtype``.

    Builds the kernels' state on every call: a layer keeps a :class:`NestedProduct`.
    """
    return NestedProduct(planes, config)(x, n, bias)
