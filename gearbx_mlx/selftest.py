"""``python -m gearbx_mlx.selftest``: run every custom kernel this machine can run against its reference.

The kernels of each family (:data:`SUITES`, each a module's ``CHECKS``; see
:mod:`gearbx_mlx.kernelcheck`) run over fixed shapes, odd ones included, and
every input dtype they take, and are compared with the pure-MLX reference
under the tolerances of the kernel tests. One table, one row per kernel and
dtype; the exit status is 1 if any row fails or a packed layer's first-use
check failed in this process, else 0. No model is downloaded.

This is the output to share when something looks wrong on a new machine:
``--json FILE`` writes the same results, with the machine, as JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

from . import launch
from .atomicfile import check_target, write_text
from .bindings import gpu, guard
from .console import USER_ERRORS, CommandParser, exit_status, show_warning
from .evaluation.machine import describe, hardware, software
from .jsonsafe import dumps
from .kernelcheck import PLANTS, KernelCheck, format_table, run_checks, run_checks_parallel, table_rows
from .nested import checks as nested_checks
from .packed import checks as packed_checks

#: Every family's checks. A new kernel family adds its module's ``CHECKS`` here.
SUITES: Sequence[Sequence[KernelCheck]] = (packed_checks.CHECKS, nested_checks.CHECKS)
#: Version of the ``--json`` layout.
FORMAT_VERSION = 1
#: Most worker processes of a parallel run (``--jobs``; each holds a GPU context).
MAX_JOBS = 8


def all_checks() -> List[KernelCheck]:
    return [c for suite in SUITES for c in suite]


def default_jobs() -> int:
    """Worker processes by default: on CUDA, whose run-time compiler takes seconds per
    kernel variant on one CPU core, up to :data:`MAX_JOBS` (half the CPUs); else 1."""
    if gpu.gpu_backend() != "cuda":
        return 1
    return max(1, min(MAX_JOBS, (os.cpu_count() or 2) // 2))


def _merged_status(statuses: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The first-use guard's state of this process and every worker's, as one."""
    out = guard.status()
    for s in statuses:
        out["trusted"] = sorted(set(out["trusted"]) | set(s["trusted"]))
        out["failed"].update(s["failed"])
        out["warned"] = sorted(set(out["warned"]) | set(s["warned"]))
    return out


def selftest(plant: Optional[str] = None, only: Optional[str] = None, progress: Any = None,
             jobs: Optional[int] = None) -> Dict[str, Any]:
    """Run the checks; the JSON-ready report (``passed``, ``rows``, ``checks``, ``skipped``, ``machine``).

    Args:
        plant: a fault of :data:`~gearbx_mlx.kernelcheck.PLANTS` to plant in
            every kernel's input (the run must then fail: it shows the checks
            can fail).
        only: run only the checks whose name contains this text.
        progress: called with a line before each check (after each, in a parallel run).
        jobs: worker processes (1: every check in this one); default :func:`default_jobs`.

    Raises:
        ValueError: an unknown plant, ``only`` matching no check, or ``jobs`` below 1.
    """
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"--plant must be one of {sorted(PLANTS)}, got {plant!r}")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be 1 or more, got {jobs}")
    indices = [i for i, c in enumerate(all_checks()) if only is None or only.lower() in c.name.lower()]
    if not indices:
        raise ValueError(f"--only {only!r} matches no check; the checks are: "
                         + ", ".join(c.name for c in all_checks()))
    jobs = default_jobs() if jobs is None else jobs
    tic = time.perf_counter()
    if jobs > 1:
        results, skipped, statuses = run_checks_parallel("gearbx_mlx.selftest:all_checks", indices, plant, jobs,
                                                         f"{guard.__name__}:status", progress)
    else:
        chosen = [all_checks()[i] for i in indices]
        results, skipped = run_checks(chosen, PLANTS[plant] if plant else None, progress)
        statuses = []
    first_use = _merged_status(statuses)
    rows = table_rows(results)
    passed = all(r.passed for r in results) and not first_use["failed"]
    return {
        "format_version": FORMAT_VERSION,
        "passed": passed,
        "ran": len(results),
        "seconds": time.perf_counter() - tic,
        "jobs": jobs,
        "plant": plant,
        "machine": {"hardware": hardware(), "software": software()},
        "rows": rows,
        "checks": [r.to_dict() for r in results],
        "skipped": [{"name": c.name, "needs": c.needs, "why": why} for c, why in skipped],
        "first_use": first_use,
    }


def format_report(report: Dict[str, Any]) -> str:
    m = report["machine"]
    lines = describe(m["hardware"], m["software"]) + [""]
    if report["rows"]:
        lines.append(format_table(report["rows"]))
    else:
        lines.append("No custom kernel can run on this machine: every layer uses MLX's own path.")
    for s in report["skipped"]:
        lines.append(f"skipped: {s['name']} (needs {s['needs']}: {s['why']})")
    for name, why in report["first_use"]["failed"].items():
        lines.append(f"first-use check failed: {name}: {why}")
    failed = sum(not r["passed"] for r in report["rows"])
    verdict = ("PASS" if report["passed"] else "FAIL") + (f" (planted fault: {report['plant']})"
                                                         if report["plant"] else "")
    lines.append(f"{verdict}: {len(report['rows']) - failed} of {len(report['rows'])} rows within tolerance, "
                 f"{report['ran']} kernel checks in {report['seconds']:.1f} s.")
    if not report["passed"] and not report["plant"]:
        lines.append("Please share this output (or the file of --json) with the gearbx_mlx maintainers; "
                     "generation still works, through MLX's own kernels where ours failed.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m gearbx_mlx.selftest",
        description="Run every custom kernel this machine can run (Metal or CUDA on a GPU, the C kernels on "
                    "the CPU) against the pure-MLX reference, over odd shapes and every input dtype. Exits 1 "
                    "on any failure. No model download; well under a minute.",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results and the machine as JSON")
    p.add_argument("--only", metavar="TEXT", help="run only the checks whose name contains TEXT")
    p.add_argument("--plant", choices=sorted(PLANTS),
                   help="corrupt every kernel's packed weights (not the reference's): the run must FAIL, "
                        "which shows that the checks can fail")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="worker processes that run the checks at once (default: on CUDA, whose run-time "
                        f"compiles take seconds per kernel, half the CPUs up to {MAX_JOBS}; else 1)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch.started()  # Ctrl-C raises KeyboardInterrupt again: this command handles it from here
    args = build_parser().parse_args(argv)
    warnings.showwarning = show_warning
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        path = check_target(args.json, "--json") if args.json else None  # before the checks, not after
        report = selftest(args.plant, args.only, progress, args.jobs)
        print(format_report(report))
        if path is not None:
            write_text(path, dumps(report, indent=1, default=str) + "\n")
            print(f"wrote {path}", file=sys.stderr)
    except USER_ERRORS as e:
        return exit_status(e)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
