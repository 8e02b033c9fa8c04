#!/usr/bin/env bash
# The two first-run commands on this machine, their outputs kept in OUTDIR:
# python -m gearbx_mlx.selftest, then python -m gearbx_mlx.bench. On a CPU the
# bench runs the default model; where nvidia-smi finds a GPU it runs random-weight
# models of two shapes (--shape smollm2-135m and llama3-8b; such a machine may
# have no network to fetch the default model). Run from the checkout root.
# Usage: scripts/bench_machine.sh OUTDIR TAG [--quick]
#   writes OUTDIR/selftest_TAG.{json,txt} and OUTDIR/bench_TAG[_SHAPE].{json,txt}
set -uo pipefail
out=${1:?usage: scripts/bench_machine.sh OUTDIR TAG [--quick]}
tag=${2:?usage: scripts/bench_machine.sh OUTDIR TAG [--quick]}
quick=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
# The first run compiles every GPU kernel variant; MLX caches them, so the
# second run (its last line) shows the time a user sees from then on.
$py -m gearbx_mlx.selftest --json "$out/selftest_$tag.json" 2>&1 | tee "$out/selftest_$tag.txt"
$py -m gearbx_mlx.selftest --quiet | tail -1 | tee -a "$out/selftest_$tag.txt"
if command -v nvidia-smi >/dev/null 2>&1; then
  for shape in smollm2-135m llama3-8b; do
    $py -m gearbx_mlx.bench --shape "$shape" --dtype bfloat16 $quick --out "$out/bench_${tag}_$shape.json" 2>&1 \
      | tee "$out/bench_${tag}_$shape.txt"
  done
else
  $py -m gearbx_mlx.bench $quick --out "$out/bench_$tag.json" 2>&1 | tee "$out/bench_$tag.txt"
fi
