#!/usr/bin/env bash
# The bench's warm-up runs on an NVIDIA machine with MLX's CUDA backend installed
# (python3 finds mlx, mlx-lm and gearbx_mlx; set PYTHONPATH before): one round of
# `python -m gearbx_mlx.bench --shape llama3-8b --quick`, with the default warm-up
# (on a GPU: every row once, untimed), then without it (--no-warmup), then with it
# again. The first run meets MLX's kernel caches empty; a row that the warm-up
# spares a first use runs at its speed in both runs with it. Run from the checkout
# root; everything lands in OUTDIR.
#
# Usage: scripts/device_bench_warmup.sh OUTDIR
#   OUTDIR/env.txt                         GPU, driver, MLX and its device
#   OUTDIR/bench_{warm,cold,warm2}.{txt,json}
set -uo pipefail
out=${1:?usage: scripts/device_bench_warmup.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
limit=${STEP_LIMIT_S:-170}
. "$(dirname "$0")/device_env.sh"
write_device_env "$out/env.txt"
$py gearbx_mlx/bindings/build.py 2>&1 | tail -1 | tee -a "$out/env.txt"
for run in warm cold warm2; do
  flag=""
  [ "$run" = cold ] && flag="--no-warmup"
  timeout "$limit" $py -m gearbx_mlx.bench --shape llama3-8b --quick $flag --out "$out/bench_$run.json" \
    2>&1 | tee "$out/bench_$run.txt"
  echo "bench exit status: ${PIPESTATUS[0]}" | tee -a "$out/bench_$run.txt"
done
