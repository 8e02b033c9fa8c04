"""``python -m gearbx_mlx.analyze TRACE.jsonl [...]``: summarise and compare traces.

The command line over :mod:`gearbx_mlx.telemetry.analyze`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import launch
from .atomicfile import check_directory, check_target
from .console import CommandParser, error_line
from .plotting import require_matplotlib
from .telemetry.analyze import analyze, format_table, load_traces, write_csv
from .telemetry.plots import plot_all
from .telemetry.trace import TraceError


# -- command line -------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m gearbx_mlx.analyze",
        description="Summarise gearbx traces: gears, shifts, entropy quantiles, timing; "
        "several traces side by side.",
    )
    p.add_argument("traces", nargs="+", metavar="TRACE.jsonl")
    p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    p.add_argument("--plots", metavar="DIR", help="write PNGs (routing trace, entropy by gear); needs matplotlib")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch.started()  # Ctrl-C raises KeyboardInterrupt again: this command handles it from here
    args = build_parser().parse_args(argv)
    try:
        plots_dir = None
        if args.plots is not None:  # before the traces are read: a bad folder is found before any output
            require_matplotlib()
            plots_dir = check_directory(args.plots, "--plots")
        csv_path = check_target(args.csv, "--csv", example="routing.csv") if args.csv is not None else None
        result = analyze(args.traces)
        print(format_table(result))
        if csv_path is not None:
            write_csv(result, csv_path)
            print(f"wrote {csv_path}", file=sys.stderr)
        if plots_dir is not None:
            for f in plot_all([t for p in args.traces for t in load_traces(p)], result, plots_dir):
                print(f"wrote {f}", file=sys.stderr)
    except (TraceError, ValueError, FileNotFoundError, ImportError, OSError) as e:
        print(error_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
