"""The machine a result came from: hardware from the OS, software versions, memory bandwidth.

What a bug report or a benchmark needs to be read on another machine:
:func:`hardware` asks the OS (``sysctl`` on macOS, ``/proc`` on Linux,
``nvidia-smi`` where it is installed) and MLX (``mx.device_info()``);
:func:`software` names every version that changes a number; :func:`bandwidth`
measures what MLX reads and copies per second on the default device, the
ceiling of a memory-bound decode step. Every field is best effort: a query
that fails leaves its field out rather than failing the run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..bindings import cpu as cpu_kernels, gpu as gpu_kernels
from ..blas import mlx_blas, shown_path

#: Seconds any one OS query may take.
QUERY_TIMEOUT = 5.0
#: MiB of the bandwidth test's array, on a GPU and on the CPU.
BANDWIDTH_MIB = {"gpu": 512, "cpu": 256}


def _run(args: List[str]) -> Optional[str]:
    """stdout of a short command, or None where it is missing or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=QUERY_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _proc_field(path: str, key: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def hardware() -> Dict[str, Any]:
    """Chip, memory and accelerator, as the OS and MLX report them."""
    out: Dict[str, Any] = {"os": platform.platform(), "arch": platform.machine(), "cpu_count": os.cpu_count()}
    if sys.platform == "darwin":
        out["chip"] = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
        mem = _run(["sysctl", "-n", "hw.memsize"])
        out["memory_bytes"] = int(mem) if mem and mem.isdigit() else None
        out["model"] = _run(["sysctl", "-n", "hw.model"])
        perf = _run(["sysctl", "-n", "hw.perflevel0.physicalcpu"])
        eff = _run(["sysctl", "-n", "hw.perflevel1.physicalcpu"])
        if perf and perf.isdigit():
            out["cpu_cores"] = {"performance": int(perf), "efficiency": int(eff) if eff and eff.isdigit() else 0}
    else:
        out["chip"] = _proc_field("/proc/cpuinfo", "model name")
        mem = _proc_field("/proc/meminfo", "MemTotal")  # "131072 kB"
        out["memory_bytes"] = int(mem.split()[0]) * 1024 if mem and mem.split()[0].isdigit() else None
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if smi:
        out["nvidia"] = [dict(zip(("name", "memory", "driver"), (p.strip() for p in line.split(","))))
                         for line in smi.splitlines() if line.strip()]
    try:
        info = mx.device_info()
        out["mlx_device"] = {k: v for k, v in info.items() if isinstance(v, (int, float, str))}
    except Exception:  # noqa: BLE001  (older MLX; the CPU backend of some builds)
        pass
    return out


def load_average() -> Optional[List[float]]:
    """The OS's 1, 5 and 15 minute load averages (None where it has none): a busy
    machine's speeds are not its own, and a result should say so."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def software() -> Dict[str, Any]:
    """Versions, the MLX back end and device, and the custom kernels this machine can run."""
    c = cpu_kernels.info()
    return {
        "python": platform.python_version(),
        "gearbx_mlx": _version("gearbx-mlx"),
        "mlx": getattr(mx, "__version__", None) or _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "numpy": _version("numpy"),
        "default_device": str(mx.default_device()),
        "gpu_backend": gpu_kernels.gpu_backend(),
        "c_kernels": ({k: c[k] for k in ("float_isa", "intdot_isa", "threads")} if c.get("available")
                      else {"available": False, "error": c.get("error")}),
        "env": {k: os.environ[k] for k in ("LD_PRELOAD", "MLX_CUDA_USE_CUDNN_SDPA", "OMP_NUM_THREADS",
                                           "OPENBLAS_NUM_THREADS") if k in os.environ},
        "blas": blas(),
    }


#: Shared libraries that are a BLAS (or LAPACK on top of one), by file name.
BLAS_FILES = re.compile(r"(^|/)lib(open)?blas|(^|/)liblapack|(^|/)libmkl_|(^|/)libcblas|(^|/)libflexiblas", re.I)


def blas_kind(path: Optional[str]) -> str:
    """The family of a BLAS library file: openblas, mkl, flexiblas, accelerate, reference or unknown."""
    name = os.path.basename(path or "").lower()
    for kind in ("openblas", "mkl", "flexiblas"):
        if kind in name:
            return kind
    if "accelerate" in (path or "").lower() or "veclib" in (path or "").lower():
        return "accelerate"
    if name.startswith(("libblas", "libcblas")):
        return "reference"  # netlib's, as MLX's Linux CPU wheel bundles it
    return "unknown"


def _mapped_libraries(maps: str = "/proc/self/maps") -> List[str]:
    """The BLAS and LAPACK files this process has mapped, in the order they appear (Linux)."""
    seen: List[str] = []
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and BLAS_FILES.search(path) and path not in seen:
                    seen.append(path)
    except OSError:
        pass
    return seen


def blas() -> Dict[str, Any]:
    """The BLAS that MLX's CPU matrix products call here.

    A library preloaded (``LD_PRELOAD``) or loaded globally that defines
    ``cblas_sgemm`` answers every call first; else the one MLX links (its
    Linux CPU wheel bundles netlib's reference BLAS, several times slower in
    float32). On macOS MLX calls Accelerate. Returns ``name`` (openblas, mkl,
    flexiblas, accelerate, reference, unknown), ``library`` (its file),
    ``how`` (how it was found) and ``mapped`` (every BLAS or LAPACK file mapped).
    """
    mapped = _mapped_libraries()
    first = mlx_blas()  # the library that answers MLX's cblas_sgemm (a preloaded one first)
    if first is not None:
        name, library, how = blas_kind(first), first, "the library MLX's cblas_sgemm resolves to"
    elif sys.platform == "darwin":
        name, library, how = "accelerate", None, "MLX on macOS"
    else:
        library = next((p for p in mapped if blas_kind(p) != "unknown" and "lapack" not in os.path.basename(p)), None)
        name, how = blas_kind(library), "mapped (/proc/self/maps)" if library else "none found"
    return {"name": name, "library": shown_path(library), "how": how, "mapped": [shown_path(p) for p in mapped]}


def bandwidth(mib: Optional[int] = None, reps: int = 5) -> Dict[str, Any]:
    """Memory bandwidth MLX reaches on the default device, GB/s (best of ``reps``).

    ``read``: a sum over a float32 array of ``mib`` MiB (bytes read / time);
    ``copy``: ``a + 1`` into a new array (bytes read + written / time). A
    decode step reads every weight once, so ``read`` bounds its tokens/s at
    ``read / bytes per step``. On the CPU back end MLX may reduce on fewer
    threads than the machine has, so ``read`` is what MLX gets, not what the
    memory can give; there ``numpy_read_gb_s`` (numpy's sum of the same
    array) is added.
    """
    kind = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
    mib = mib or BANDWIDTH_MIB[kind]
    n = mib * 2**20 // 4
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)
    best = {"read": float("inf"), "copy": float("inf")}
    ops = {"read": lambda arr: mx.sum(arr), "copy": lambda arr: arr + 1.0}
    for _ in range(reps + 1):  # the first round warms up
        for name, op in ops.items():
            tic = time.perf_counter()
            mx.eval(op(a))
            best[name] = min(best[name], time.perf_counter() - tic)
    nbytes = 4 * n
    out = {"device": kind, "array_mib": mib, "read_gb_s": nbytes / best["read"] / 1e9,
           "copy_gb_s": 2 * nbytes / best["copy"] / 1e9}
    if kind == "cpu":
        # MLX's CPU reductions run well below the memory's speed (a quarter of
        # numpy's on a 2-core x86 server); numpy's sum is the better yardstick
        # of what the C kernels and BLAS can read.
        host = np.asarray(a)
        t = float("inf")
        for _ in range(reps + 1):
            tic = time.perf_counter()
            host.sum()
            t = min(t, time.perf_counter() - tic)
        out["numpy_read_gb_s"] = nbytes / t / 1e9
    return out


def describe(hw: Dict[str, Any], sw: Dict[str, Any]) -> List[str]:
    """A few lines a person reads first: chip, memory, device, versions."""
    mem = hw.get("memory_bytes")
    gpus = ", ".join(f"{g['name']} ({g['memory']})" for g in hw.get("nvidia", []))
    dev = hw.get("mlx_device", {})
    lines = [
        f"Machine: {hw.get('chip') or '?'}, {mem / 2**30:.0f} GiB memory, {hw.get('cpu_count')} CPUs"
        if mem else f"Machine: {hw.get('chip') or '?'}, {hw.get('cpu_count')} CPUs",
        f"OS: {hw.get('os')}" + (f"; NVIDIA: {gpus}" if gpus else ""),
        f"MLX {sw.get('mlx')} (mlx-lm {sw.get('mlx_lm')}), device {sw.get('default_device')}"
        + (f" ({dev.get('device_name') or dev.get('architecture')})" if dev else "")
        + f", GPU kernels: {sw.get('gpu_backend') or 'none'}",
        f"gearbx_mlx {sw.get('gearbx_mlx')}, Python {sw.get('python')}, C kernels: "
        + (f"{sw['c_kernels'].get('intdot_isa')} / {sw['c_kernels'].get('float_isa')}"
           if sw["c_kernels"].get("available", True) else f"not built ({sw['c_kernels'].get('error')})"),
    ]
    return lines


__all__ = ["BANDWIDTH_MIB", "BLAS_FILES", "bandwidth", "blas", "blas_kind", "describe", "hardware", "load_average",
           "software"]


def write_result(path: str, result: Dict[str, Any], command: str, load_before: Optional[List[float]]) -> None:
    """Write a benchmark script's ``result`` as JSON at ``path`` (its folder made), stamped with the
    command that made it, the date (UTC), the machine, the BLAS and the load average before and after."""
    result.update(command=command, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  machine=f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
                  ld_preload=os.environ.get("LD_PRELOAD"), mlx=mx.__version__, blas=blas(),
                  load_average={"before": load_before, "after": load_average()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
