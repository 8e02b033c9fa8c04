#!/usr/bin/env python3
"""Time one command as a user runs it: wall and CPU seconds, peak memory, load; print a line, write JSON.

Usage:
  python scripts/time_command.py --out benchmarks/results/NAME.json -- python -m gearbx_mlx.evaluate --tokens 512

The command runs in a child process from this directory, imports and model
loading included; CPU seconds are the child's user + system time over all
its threads, and the load averages before and after say how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command to time after --")
    out = Path(args.out)
    if not out.parent.is_dir():
        ap.error(f"--out directory does not exist: {out.parent}")
    load_start, started = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tic = time.perf_counter()
    proc = subprocess.run(cmd, check=False)
    wall = time.perf_counter() - tic
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {
        "command": " ".join(cmd), "returncode": proc.returncode, "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "load_average_start": load_start, "load_average_end": os.getloadavg(), "started_utc": started,
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform(),
        "ld_preload": os.environ.get("LD_PRELOAD"),
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['command']}: exit {proc.returncode}, {result['wall_s']} s wall, {result['cpu_s']} s CPU, "
          f"peak {result['peak_rss_mib']} MiB, load {load_start[0]:.2f} -> {result['load_average_end'][0]:.2f}; "
          f"wrote {out}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
