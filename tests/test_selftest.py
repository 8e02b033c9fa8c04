"""``python -m gearbx_mlx.selftest`` and the kernels' safe first use.

* the selftest's bounds are the kernel tests' own tolerances;
* it passes on this machine and fails, row by row, when every kernel reads
  its weights in the wrong element order (a planted nibble-order bug), in
  every kernel family: the C kernels for real, the GPU bodies through an
  emulation of their launchers where this machine has no GPU;
* a kernel that fails to build, or whose first call disagrees with the
  reference, does not stop ``generate``: one warning names it, the layers fall
  back to MLX's path, and the text is the reference path's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fault_models import tiny_model_folder

from gearbx_mlx import kernelcheck, selftest
from gearbx_mlx.bindings import cpu, gpu, guard, nested_cpu, nested_gpu, packed_gpu
from gearbx_mlx.nested import checks as nested_checks, matmul as nested_matmul
from gearbx_mlx.nested.planes import reference_matmul as nested_reference
from gearbx_mlx.packed import checks, formats, layers
from gearbx_mlx.packed.fused import fuse_modules
from gearbx_mlx.packed.layers import PackedLinear


@pytest.fixture(autouse=True)
def fresh_guard():
    guard.reset()
    yield
    guard.reset()


def c_kernels() -> bool:
    return mx.default_device() == mx.cpu and cpu.available()


# -- an emulated GPU back end: the launchers' interface over the reference ------------


def emulated_launcher(backend, bits, group_size, in_features, out_features, dtype, has_bias, *, splits=(),
                      plant=None, **_):
    """What ``packed_gpu.launcher`` returns, computed by the reference (on ``plant``ed weights)."""

    def run(x, weight, scales, bias=None):
        w = weight if plant is None else plant(weight, bits)
        y = formats.reference_matmul(x, w, scales, bits=bits, group_size=group_size, in_features=in_features,
                                     bias=bias)
        if not splits:
            return y
        b = (0,) + tuple(splits) + (out_features,)
        return [y[..., lo:hi] for lo, hi in zip(b, b[1:])]

    run.kernel_name = f"gbx_gemv_{backend}_emulated_q{bits}_{'mma' if splits else 'simt'}"
    return run


def emulated_gemv(plant=None):
    def gemv(x, weight, scales, bias=None, *, bits, group_size, backend=None, splits=(), **_):
        run = emulated_launcher("cuda", bits, group_size, x.shape[-1], weight.shape[0], x.dtype, bias is not None,
                                splits=splits, plant=plant)
        return run(x, weight, scales, bias)
    return gemv


def emulated_nested_launcher(backend, bits, group_sizes, in_features, out_features, dtype, scale_dtype, has_bias,
                             **_):
    """What ``nested_gpu.launcher`` returns, computed from the dequantized planes in float32."""

    def run(x, arrays, factors, bias=None):
        y = None
        for i, (b, g) in enumerate(zip(bits, group_sizes)):
            w, s, z = arrays[3 * i: 3 * i + 3]  # float32 throughout, as the kernel accumulates
            deq = mx.dequantize(w, s.astype(mx.float32), z.astype(mx.float32), group_size=g, bits=b)
            t = (x.reshape(1, -1).astype(mx.float32) @ deq.T) * factors[i]
            y = t if y is None else y + t
        if bias is not None:
            y = y + bias.astype(mx.float32)
        return y.astype(x.dtype).reshape(*x.shape[:-1], out_features)

    run.kernel_name = f"gbx_nested_{backend}_emulated_{'_'.join(map(str, bits))}"
    return run


def emulated_nested_gemv(x, planes, n, bias=None, **_):
    bits, gs = tuple(p.bits for p in planes[:n]), tuple(p.group_size for p in planes[:n])
    run = emulated_nested_launcher("cuda", bits, gs, x.shape[-1], planes[0].weight.shape[0], x.dtype,
                                   planes[0].scales.dtype, bias is not None)
    return run(x, nested_gpu.plane_arrays(planes, n), nested_gpu.factors_of(planes, n), bias)


@pytest.fixture
def emulated_gpu(monkeypatch):
    """Make the GPU checks and layers run on the CPU through emulated launchers."""
    monkeypatch.setattr(gpu, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(packed_gpu, "gemv", emulated_gemv())
    monkeypatch.setattr(packed_gpu, "launcher", emulated_launcher)
    monkeypatch.setattr(nested_gpu, "nested_gemv", emulated_nested_gemv)
    monkeypatch.setattr(nested_gpu, "launcher", emulated_nested_launcher)
    return monkeypatch


# -- the bounds are the tests' ----------------------------------------------------------


def test_the_bounds_are_the_kernel_tests_tolerances():
    import test_cpu_kernels
    import test_kernels_cuda
    import test_packed

    for mod in (test_packed, test_kernels_cuda):
        assert mod.ACCUM_TOL == kernelcheck.ACCUM_TOL
        assert mod.OUTPUT_RTOL == kernelcheck.OUTPUT_RTOL
    assert test_cpu_kernels.FLOAT_RTOL == kernelcheck.FLOAT_RTOL
    assert test_cpu_kernels.QK == kernelcheck.ACT_BLOCK
    assert [s[:2] for s in checks.SIMT_CASES] == test_kernels_cuda.ODD_SHAPES


def test_bound_and_compare_on_known_numbers():
    x = mx.array([1.0, -2.0, 0.5, 0.0])
    w = mx.array([[1.0, 1.0, 2.0, 4.0], [0.0, -1.0, 0.0, 0.0]])
    ref = w @ x
    b = kernelcheck.gemv_bound(x, w, ref, out_dtype=mx.float16, accum=0.01)
    # 0.01 * sum|w x| + 1e-6 + 2^-10 * |ref|: row 0: 0.01 * 4 + ..., row 1: 0.01 * 2 + ...
    want = [0.01 * 4 + 1e-6 + 2**-10 * 0.0, 0.01 * 2 + 1e-6 + 2**-10 * 2.0]
    assert np.allclose(np.array(b), want, rtol=1e-6)
    ok = kernelcheck.compare(ref + 0.5 * b, ref, b)
    assert ok.passed and ok.ratio == pytest.approx(0.5, rel=1e-5)
    bad = kernelcheck.compare(ref + mx.array([0.0, 3.0]) * b, ref, b)
    assert not bad.passed and bad.ratio == pytest.approx(3.0, rel=1e-5) and bad.tolerance == pytest.approx(want[1])
    nan = kernelcheck.compare(mx.array([float("nan"), 0.0]), ref, b)
    assert not nan.passed
    # int-dot: one block of 32 whose largest |x| is 127 has a step of 1: each input may be off by 1/2.
    xs = mx.concatenate([mx.array([127.0]), mx.zeros((31,))])
    steps = kernelcheck.activation_steps(xs)
    assert steps.shape == (32,) and np.allclose(np.array(steps), 0.5)


def test_planted_nibble_order_swaps_fields():
    q = mx.array([[-7, 7, 0, 1]], dtype=mx.int8)
    p4 = formats.pack(q, 4)
    assert formats.unpack(kernelcheck.swap_nibbles(p4, 4), 4, 4).tolist() == [[7, -7, 1, 0]]
    p8 = formats.pack(mx.array([[1, 2, 3, 4, 5]], dtype=mx.int8), 8)
    assert kernelcheck.swap_nibbles(p8, 8).tolist() == [[2, 1, 4, 3, 5]]


# -- the command line ----------------------------------------------------------------------


def test_selftest_passes_here_and_writes_json(tmp_path):
    """README.md's first-run command as a reader types it (CI runs it here)."""
    out = tmp_path / "selftest.json"
    p = subprocess.run([sys.executable, "-m", "gearbx_mlx.selftest", "--json", str(out)], capture_output=True,
                       text=True, timeout=600)
    text = p.stdout
    assert p.returncode == 0, text + p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and "PASS" in text, text
    assert report["rows"] and all(r["passed"] for r in report["rows"])
    assert report["machine"]["software"]["mlx"] and "kernel" in text and "tolerance" in text
    names = {r["kernel"] for r in report["rows"]}
    assert "PackedLinear decode dispatch" in names
    if c_kernels():
        assert {f"C packed GEMV {p}" for p in checks.C_PATHS} <= names
        assert {(r["kernel"], r["dtype"]) for r in report["rows"]} >= {("C packed GEMV auto", "bfloat16")}
    if gpu.gpu_backend() is None:
        assert {s["name"] for s in report["skipped"]} >= {"packed GEMV int4 SIMT", "packed GEMV int8 SIMT"}


def test_an_unwritable_json_path_is_refused_before_the_checks(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(selftest, "selftest", lambda *a, **k: ran.append(1))
    rc = selftest.main(["--quiet", "--json", str(tmp_path / "no" / "s.json")])
    err = capsys.readouterr().err
    assert rc == 2 and not ran and err.startswith("error: --json ") and "does not exist" in err


def test_a_planted_nibble_order_fails_every_row(capsys):
    rc = selftest.main(["--quiet", "--plant", "nibble-order"])
    text = capsys.readouterr().out
    assert rc == 1 and "FAIL (planted fault: nibble-order)" in text
    assert "ok" not in [line.split()[-1] for line in text.splitlines() if "packed" in line.lower()
                        and line.split()[-1] in ("ok", "FAIL")]


def test_bad_arguments_exit_2(capsys):
    assert selftest.main(["--only", "no such kernel"]) == 2
    assert "matches no check" in capsys.readouterr().err


@pytest.mark.parametrize("check", selftest.all_checks(), ids=lambda c: c.name)
def test_every_family_catches_a_planted_nibble_order(check, emulated_gpu):
    """Every check passes on correct kernels and fails every case of a nibble-order bug.

    The C kernels run for real (skipped where not built); the GPU bodies run
    through the emulated launchers here unless this machine has a GPU.
    """
    if check.unavailable() is not None:
        pytest.skip(check.unavailable())
    good = check.check()
    assert good.error is None and good.cases and good.passed, [c for c in good.cases if not c.result.passed][:3]
    planted = check.check(kernelcheck.PLANTS["nibble-order"])
    assert planted.cases and not any(c.result.passed for c in planted.cases)


@pytest.mark.parametrize("check", [c for c in selftest.all_checks() if c.shards > 1], ids=lambda c: c.name)
def test_a_sharded_check_runs_every_case_once_over_its_parts(check, emulated_gpu):
    """The parts of a check a parallel selftest runs in separate processes hold its
    cases between them, each once: the plain run's, in any order."""
    whole = check.check()
    parts = []
    for k in range(check.shards):
        emulated_gpu.setattr(kernelcheck, "_SHARD", [k, check.shards])
        part = check.check()
        assert part.error is None and part.cases, f"part {k} of {check.name} ran nothing"
        parts += part.cases
    assert sorted(parts, key=repr) == sorted(whole.cases, key=repr)


def test_parallel_selftest_matches_the_plain_run_and_still_fails_a_plant():
    """--jobs N runs the checks in N spawned processes: the same rows as one process,
    and a planted fault still fails every row."""
    if not c_kernels():
        pytest.skip("the C kernels are not built here")
    only = "C packed GEMV ref"
    plain = selftest.selftest(only=only, jobs=1)
    parallel = selftest.selftest(only="C packed GEMV", jobs=2)
    assert parallel["jobs"] == 2 and parallel["passed"] and parallel["ran"] == len(checks.C_PATHS)
    assert [r for r in parallel["rows"] if r["kernel"] == "C packed GEMV ref"] == plain["rows"]
    planted = selftest.selftest(plant="nibble-order", only=only, jobs=2)
    assert not planted["passed"] and not any(r["passed"] for r in planted["rows"])


def test_the_selftest_imports_no_mlx_lm_and_the_public_names_still_resolve():
    """The package's public names load on first use: the selftest (and each of its
    worker processes) starts without mlx-lm and what it imports."""
    code = ("import sys, gearbx_mlx.selftest; assert 'mlx_lm' not in sys.modules, 'mlx_lm imported'; "
            "import gearbx_mlx; assert gearbx_mlx.GEARS == ('low', 'mid', 'high') and callable(gearbx_mlx.load); "
            "assert set(gearbx_mlx.__all__) <= set(dir(gearbx_mlx)); from gearbx_mlx import Gearbox, stream_generate")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    import gearbx_mlx

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        gearbx_mlx.no_such_name


def test_jobs_below_one_is_one_clear_error(capsys):
    assert selftest.main(["--jobs", "0"]) == 2
    assert "--jobs must be 1 or more" in capsys.readouterr().err


def test_a_kernel_that_raises_fails_its_check(emulated_gpu):
    def broken(*a, **k):
        raise RuntimeError("[metal::Device] Unable to build metal library from source")

    emulated_gpu.setattr(packed_gpu, "gemv", broken)
    result = checks.CHECKS[0].check()
    assert not result.passed and "Unable to build" in result.error
    rows = kernelcheck.table_rows([result])
    assert rows[0]["passed"] is False and "FAIL" in kernelcheck.format_table(rows)


# -- safe first use ------------------------------------------------------------------------


def guard_warnings(caught) -> list:
    return [w for w in caught if "first-use check" in str(w.message)]


def run_generate(folder: Path, capsys, *extra: str) -> Tuple[int, str, list]:
    """``(exit status, text, the guard's warning lines)`` of one ``generate`` run (warnings
    go to stderr as ``[gearbx] warning: ...`` lines: the CLI prints them itself)."""
    from gearbx_mlx.generate import main

    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            # The packed layers live in the separate store (the nested store, the
            # default for float weights, reads its planes through its own kernels).
            rc = main(["--model", str(folder), "--prompt", "hello there", "--max-tokens", "12", "--kernel",
                       "packed", "--store", "separate", "--scope", "all", "--static-gear", "mid", "--quiet", *extra])
    finally:
        warnings.showwarning = shown
    out, err = capsys.readouterr()
    return rc, out, [line for line in err.splitlines() if "first-use check" in line]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("models"))


@pytest.fixture
def reference_text(model_folder, capsys, monkeypatch):
    """The text with no custom kernel at all (every layer on the reference path)."""
    with monkeypatch.context() as m:
        m.setattr(layers, "cpu_backend", lambda: None)
        rc, text, caught = run_generate(model_folder, capsys)
    assert rc == 0 and text.strip() and not caught
    return text


def test_a_kernel_that_fails_to_build_does_not_stop_generate(model_folder, reference_text, capsys, monkeypatch):
    """A GPU back end whose kernels do not compile: one warning, MLX's path, the same text."""
    built = []

    def no_compiler(*args, **kwargs):
        built.append(args[1])
        raise RuntimeError("[metal::Device] Unable to build metal library from source: error: unknown type")

    monkeypatch.setattr(gpu, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(packed_gpu, "build_kernel", no_compiler)
    rc, text, caught = run_generate(model_folder, capsys)
    assert rc == 0 and text == reference_text
    assert built, "the kernel build was never tried"
    assert len(caught) == 1, caught
    msg = caught[0]
    assert "metal packed GEMV" in msg and "failed to build" in msg and "Unable to build metal library" in msg
    assert "python -m gearbx_mlx.selftest" in msg
    assert guard.status()["failed"]


def test_a_kernel_whose_first_call_disagrees_is_dropped(model_folder, reference_text, capsys, monkeypatch):
    """The C kernel reads nibbles in the wrong order: its first call is caught, never used again."""
    if not c_kernels():
        pytest.skip("the C kernels are not built")
    real, calls = cpu.gemv, []

    def wrong_order(packed, scales, x, **kw):
        calls.append(kw["bits"])
        return real(kernelcheck.swap_nibbles(packed, kw["bits"]), scales, x, **kw)

    monkeypatch.setattr(cpu, "gemv", wrong_order)
    rc, text, caught = run_generate(model_folder, capsys)
    assert rc == 0 and text == reference_text
    assert len(caught) == 1 and "gbx_gemv_cpu_q8" in caught[0] and "first result is off by" in caught[0]
    assert len(calls) == 1, "a failed kernel variant was called again"


def test_a_good_kernel_is_checked_once_per_shape(model_folder, capsys, monkeypatch):
    if not c_kernels():
        pytest.skip("the C kernels are not built")
    seen = []
    real = guard._first_call

    def counting(spec, run, *a):
        seen.append((spec.out_features, spec.in_features))
        return real(spec, run, *a)

    monkeypatch.setattr(guard, "_first_call", counting)
    rc, _, caught = run_generate(model_folder, capsys)
    assert rc == 0 and not caught
    assert seen and len(seen) == len(set(seen)), seen  # one check per (kernel, shape), later layers trusted
    assert len(guard.status()["trusted"]) == len(set(seen))


def _packed_siblings(seed: int = 0):
    mx.random.seed(seed)
    mods = {f"attn.{n}": PackedLinear.from_linear(nn.Linear(128, o), bits=4, group_size=64)
            for n, o in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32))}
    return fuse_modules(mods)


@pytest.mark.parametrize("plant", [None, "nibble-order"])
def test_fused_launch_is_checked_and_falls_back(emulated_gpu, plant):
    """The 3-output launch of a fused q/k/v group: trusted when right; when wrong,
    one warning and every member's output is still the reference's."""
    p = kernelcheck.PLANTS.get(plant) if plant else None
    emulated_gpu.setattr(packed_gpu, "launcher",
                         lambda *a, **kw: emulated_launcher(*a, **kw, plant=p if kw.get("splits") else None))
    fused = _packed_siblings()
    x = mx.random.normal((1, 1, 128)).astype(mx.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fused[f"attn.{n}"](x) for n in ("q_proj", "k_proj", "v_proj")]
        again = [fused[f"attn.{n}"](x + 1) for n in ("q_proj", "k_proj", "v_proj")]
    for m, y in zip(fused.values(), outs):
        ref = formats.reference_matmul(x, m.weight, m.scales, bits=4, group_size=64, in_features=128, bias=m.bias)
        assert mx.allclose(y.astype(mx.float32), ref.astype(mx.float32), atol=0.05).item()
    assert all(a.shape == b.shape for a, b in zip(outs, again))
    ours = guard_warnings(caught)
    if plant is None:
        assert not ours and any("mma" in t for t in guard.status()["trusted"])
    else:
        assert len(ours) == 1 and "gbx_gemv_cuda_emulated_q4_mma" in str(ours[0].message)


def test_guarded_returns_the_bare_launcher_once_trusted():
    spec = guard.KernelSpec("test GEMV", 8, None, 64, 16)
    packed, scales, x, _ = checks.make_case(16, 64, 8, None, mx.float32, False)
    runs: list = []
    settled: list = []

    def build():
        run = emulated_launcher("test", 8, None, 64, 16, mx.float32, False)
        runs.append(run)
        return run

    first = guard.guarded(spec, build, settled.append)
    assert first is not runs[0]  # a checking wrapper
    y = first(x, packed, scales)
    assert settled == [runs[0]] and mx.allclose(y, runs[0](x, packed, scales)).item()
    assert guard.guarded(spec, build, settled.append) is runs[1]  # trusted: the bare launcher


def test_cpu_kernels_trusted_probe(monkeypatch):
    if not c_kernels():
        assert layers.cpu_kernels_trusted() is False
        return
    assert layers.cpu_kernels_trusted() is True
    guard.reset()
    real = cpu.gemv
    monkeypatch.setattr(cpu, "gemv", lambda p, s, x, **kw: real(kernelcheck.swap_nibbles(p, kw["bits"]), s, x, **kw))
    with pytest.warns(RuntimeWarning, match="first-use check"):
        assert layers.cpu_kernels_trusted() is False


@pytest.mark.parametrize("broken", [False, True])
def test_guard_takes_another_formats_reference(broken):
    """A kernel family with its own format (arrays, rows, reference), as the nested planes' will be."""
    w = mx.random.normal((40, 64), key=mx.random.key(3))
    x = mx.random.normal((64,), key=mx.random.key(4))
    spec = guard.KernelSpec("dense test GEMV", 16, None, 64, 40,
                            rows_of=lambda rows, weight: (mx.take(weight, rows, axis=0), None),
                            reference=lambda x, weight: weight @ x)

    def build():
        run = (lambda x, weight: (weight @ x)[::-1]) if broken else (lambda x, weight: weight @ x)
        run.kernel_name = "dense_test"
        return run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = guard.guarded(spec, build, lambda r: None)(x, w)
    assert mx.allclose(y, w @ x, atol=1e-4).item()  # right either way: the reference stood in
    assert bool(guard_warnings(caught)) is broken and ("dense_test" in guard.failed()) is broken


# -- the nested planes' kernels ----------------------------------------------------------


def test_selftest_runs_the_nested_family():
    assert nested_checks.CHECKS[0] in selftest.all_checks()
    assert {c.name for c in nested_checks.CHECKS} >= {"nested GEMV 1-3 planes", "C nested GEMV intdot"}


def test_the_nested_dispatch_passes_without_the_c_kernels(monkeypatch):
    """Without the C kernels a one-row product takes the pure-MLX oracle, whose half-precision inputs MLX's
    CPU quantized_matmul summed in their own dtype (errors 30x the bound): the oracle multiplies in float32."""
    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU device's reference path")
    monkeypatch.setattr(gpu, "gpu_backend", lambda: None)
    monkeypatch.setattr(nested_matmul, "cpu_backend", lambda: None)  # the extension is not built
    report = selftest.selftest(only="NestedProduct dispatch", jobs=1)
    rows = report["rows"]
    assert {r["dtype"] for r in rows} == {"float32", "float16", "bfloat16"}
    assert all(r["passed"] and r["worst"].endswith("via reference") for r in rows), rows


def test_a_nested_c_kernel_that_disagrees_is_dropped_for_the_oracle(monkeypatch):
    if not c_kernels():
        pytest.skip("the C kernels are not built")
    planes = nested_checks.make_planes(33, 1088, nested_checks.KERNEL_PLAN, mx.float32)
    calls = []
    real = nested_cpu.PreparedNested.gemv

    def wrong(self, x, n=None, **kw):
        calls.append(n)
        return real(self, x, n, **kw)[..., ::-1]  # rows in the wrong order

    monkeypatch.setattr(nested_cpu.PreparedNested, "gemv", wrong)
    product = nested_matmul.NestedProduct(planes)
    x = nested_checks.make_x((1088,), mx.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ys = [product(x, 2) for _ in range(3)]
    want = nested_reference(x[None], planes, 2)[0]
    assert all(mx.allclose(y, want, atol=1e-5).item() for y in ys)
    assert calls == [2], "a failed kernel was called again"
    assert len(guard_warnings(caught)) == 1 and "gbx_nested_cpu_4g64_4g32_intdot" in str(caught[-1].message)
    assert nested_matmul.nested_kernels_trusted() is False


def test_nested_gpu_launch_is_checked_and_falls_back(emulated_gpu):
    planes = nested_checks.make_planes(33, 1088, nested_checks.KERNEL_PLAN, mx.bfloat16)
    product = nested_matmul.NestedProduct(planes)
    x = nested_checks.make_x((1088,), mx.bfloat16)
    y = product(x, 3)
    assert guard.status()["trusted"] and not guard.failed()

    def rows_reversed(*a, **k):
        run = emulated_nested_launcher(*a, **k)
        return lambda *args: run(*args)[..., ::-1]

    guard.reset()
    emulated_gpu.setattr(nested_gpu, "launcher", rows_reversed)
    bad = nested_matmul.NestedProduct(planes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = [bad(x, 3) for _ in range(2)]
    want = nested_reference(x[None], planes, 3)[0]  # the oracle stood in, on the first call and after
    assert all(mx.array_equal(a, want).item() for a in again) and y.shape == want.shape
    assert len(guard_warnings(caught)) == 1 and "cuda nested GEMV" in str(caught[0].message)
    assert bad.backend_for(x, 3) == "reference"


def test_a_nested_kernel_that_fails_to_build_does_not_stop_generate(model_folder, capsys, monkeypatch):
    """The nested store on a GPU back end whose nested kernel does not compile: one
    warning naming it, the oracle's path, and the text of a run with no custom kernel."""
    with monkeypatch.context() as m:  # the text with every product on the oracle
        m.setattr(nested_matmul.NestedProduct, "backend_for", lambda self, x, n, has_bias=False: "reference")
        rc, want, caught = run_generate(model_folder, capsys, "--store", "nested")
    assert rc == 0 and want.strip() and not caught
    built = []

    def no_compiler(backend, name, *args):
        built.append(name)
        raise RuntimeError("[metal::Device] Unable to build metal library from source: error: unknown type")

    monkeypatch.setattr(gpu, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(nested_gpu, "build_kernel", no_compiler)
    monkeypatch.setattr(nested_gpu, "launcher", nested_gpu.launcher.__wrapped__)  # no launcher cached by others
    rc, text, caught = run_generate(model_folder, capsys, "--store", "nested")
    assert rc == 0 and text == want
    assert built, "the nested kernel build was never tried"
    assert len(caught) == 1, caught
    assert "metal nested GEMV" in caught[0] and "failed to build" in caught[0] and "Unable to build" in caught[0]
    assert "python -m gearbx_mlx.selftest" in caught[0]
    assert all("nested" in name for name in guard.failed())


def test_gpu_dispatch_reuses_the_families_kernels():
    """On a GPU the dispatch check builds no kernel of its own: each of its layers runs a
    variant (by name) that the SIMT and matrix-unit checks before it already ran."""

    def name(o, k, bits, gs, dtype, **variant):
        packed, scales, x, b = checks.make_case(o, k, bits, gs, dtype, True, seed=bits)
        return packed_gpu.launch_spec("cuda", x, packed, scales, b, bits=bits, group_size=gs, **variant)["name"]

    built = set()
    for (o, k, gs, bias), dtype in zip(checks.SIMT_CASES, kernelcheck.gpu_case_dtypes(len(checks.SIMT_CASES),
                                                                                       checks.DTYPES)):
        built |= {name(o, k, bits, gs, dtype, mma=False) for bits in (4, 8) if bias}
    for (o, k, gs, bias), dtype in zip(checks.MMA_CASES, kernelcheck.gpu_case_dtypes(len(checks.MMA_CASES),
                                                                                     packed_gpu.MMA_DTYPES)):
        built |= {name(o, k, 4, gs, dtype, mma=True)} if bias else set()
    runs = checks.gpu_dispatch_cases()
    assert [r[0] for r in runs] == list(checks.DTYPES) and {r[1] for r in runs} == {4, 8}
    for dtype, bits, o, k, gs in runs:
        assert name(o, k, bits, gs, dtype) in built  # PackedLinear's own choice of variant


def test_nested_check_planes_are_built_once():
    a = nested_checks.make_planes(17, 320, nested_checks.KERNEL_PLAN, mx.float16, seed=2)
    b = nested_checks.make_planes(17, 320, list(nested_checks.KERNEL_PLAN), mx.float16, seed=2)
    assert a is not b and all(p is q for p, q in zip(a, b))
    assert nested_checks.make_planes(17, 320, nested_checks.KERNEL_PLAN, mx.bfloat16, seed=2)[0] is not a[0]
