#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed: decode
# tok/s of the nested gears against MLX's (Llama-3-8B shape, random weights,
# bfloat16), in interleaved rounds: as installed by the package, with each
# fused group (q/k/v, gate/up) in one launch (-grp), and with each block's
# one-token step in two compiled calls (-blockc; for the baselines too).
# Everything lands in OUTDIR.
# Usage: scripts/device_gears.sh OUTDIR [ROUNDS]
set -uo pipefail
out=${1:?usage: scripts/device_gears.sh OUTDIR [ROUNDS]}
rounds=${2:-5}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())' \
  | tee -a "$out/gpu.txt"
python3 scripts/bench_nested_gpu.py --skip-sweep --skip-gemv --skip-host --rounds "$rounds" --out "$out/gears.json" \
  --variants bf16 mlx-4 mlx-8 nested-low nested-mid nested-high nested-low-grp nested-mid-grp nested-high-grp \
  nested-mid-blockc nested-high-blockc nested-low-grp-blockc nested-mid-grp-blockc nested-high-grp-blockc \
  bf16-blockc mlx-4-blockc mlx-8-blockc 2>&1 | tee "$out/gears.txt" | grep -v "^  round"
