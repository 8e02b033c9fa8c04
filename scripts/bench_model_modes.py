#!/usr/bin/env python3
"""Run every generation mode on one named model twice, the first building what it caches: wall and
CPU seconds, peak resident memory against the model's weights, decode speed; print lines, write JSON.

Usage:
  python scripts/bench_model_modes.py --model qwen2.5-coder-1.5b --fresh \\
      --out benchmarks/results/qwen2.5-coder-1.5b_modes.json

Each mode is ``python -m gearbx_mlx.generate`` in a child process, as a user runs it (imports, model
loading and the speculative decision included), with a short generation (``--max-tokens``). The
child's own peak resident set comes from ``os.wait4``. ``--fresh`` first removes the model's nested
planes cache, so each mode's first run builds what it needs and the second reads it back. The
ratios are to the converted model's weight bytes and to the plain run's peak (the loaded model as a
process holds it); the load averages say how busy the machine was (timings on a shared machine are
indicative only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

#: ``(name, generate flags)``, in the order they run.
MODES = (
    ("plain", ["--static-gear", "high"]),
    ("routed-separate", ["--store", "separate"]),
    ("routed-nested", ["--store", "nested"]),
    ("speculative", ["--speculative"]),
)
PROMPT = "Write a Python function that reverses a string."
#: Summary lines kept verbatim (their first word).
KEPT = ("Prompt:", "Generation:", "Peak memory:", "Gears:", "Resident:", "Managed layers:", "Decision", "Drafter:",
        "Blocks:", "Resolved:")


def run_once(cmd: List[str]) -> Dict[str, Any]:
    """One child: wall and CPU seconds, its own peak RSS (``os.wait4``), exit status, kept summary lines."""
    load = os.getloadavg()
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        tic = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fout, stderr=ferr, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - tic
        proc.returncode = os.waitstatus_to_exitcode(status)
        fout.seek(0), ferr.seek(0)
        out, err = fout.read(), ferr.read()
    lines = [ln.strip() for ln in err.splitlines() if ln.strip().startswith(KEPT)]
    gen = next((ln for ln in lines if ln.startswith("Generation:")), "")
    m = re.search(r"([\d.]+) tokens-per-sec", gen)
    return {"returncode": proc.returncode, "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "decode_tokens_per_s": float(m.group(1)) if m else None,
            "load_average_start": [round(x, 2) for x in load], "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "summary": lines, "text": out.strip()[:200], "stderr_tail": err.strip()[-400:] if proc.returncode else ""}


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--fresh", action="store_true", help="remove the model's planes cache first")
    ap.add_argument("--modes", nargs="*", default=[m for m, _ in MODES], help="which modes (default: all)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not out.parent.is_dir():
        ap.error(f"--out directory does not exist: {out.parent}")
    from gearbx_mlx.sources.models import resolve_model  # fetched and converted here, not timed

    folder = Path(resolve_model(args.model))
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if args.fresh:
        shutil.rmtree(folder / "gearbx_planes", ignore_errors=True)
    runs: List[Dict[str, Any]] = []
    for name, flags in MODES:
        if name not in args.modes:
            continue
        cmd = [sys.executable, "-m", "gearbx_mlx.generate", "--model", args.model, "--prompt", PROMPT,
               "--max-tokens", str(args.max_tokens), *flags]
        for attempt in ("first", "second"):
            r = {"mode": name, "run": attempt, "command": " ".join(["python", *cmd[1:]]), **run_once(cmd)}
            r["peak_rss_over_weights"] = round(r["peak_rss_mib"] * 2**20 / weights, 3)
            runs.append(r)
            print(f"{name} ({attempt}): exit {r['returncode']}, {r['wall_s']} s wall, {r['cpu_s']} s CPU, peak "
                  f"{r['peak_rss_mib']} MiB = {r['peak_rss_over_weights']}x the weights, decode "
                  f"{r['decode_tokens_per_s']} tok/s, load {r['load_average_start'][0]}", flush=True)
    plain = [r["peak_rss_mib"] for r in runs if r["mode"] == "plain"]
    for r in runs:
        r["peak_rss_over_plain"] = round(r["peak_rss_mib"] / max(plain), 3) if plain else None
    result = {
        "model": args.model, "weights_bytes": weights, "max_tokens": args.max_tokens, "prompt": PROMPT,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "platform": platform.platform(), "ld_preload": os.environ.get("LD_PRELOAD"),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "runs": runs,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
