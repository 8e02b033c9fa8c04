#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed: the kernel
# selftest, then the bench on random-weight models of two shapes. Everything
# lands in OUTDIR (selftest JSON and text, bench JSON and text per shape).
# Usage: scripts/device_bench.sh OUTDIR [--quick]
set -uo pipefail
out=${1:?usage: scripts/device_bench.sh OUTDIR [--quick]}
quick=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())' \
  | tee -a "$out/gpu.txt"
# First run: MLX compiles every kernel variant (NVRTC); the second run shows the time with its disk cache.
python3 -m gearbx_mlx.selftest --json "$out/selftest.json" 2>&1 | tee "$out/selftest.txt"
python3 -m gearbx_mlx.selftest --quiet | tail -1 | tee -a "$out/selftest.txt"
for shape in smollm2-135m llama3-8b; do
  python3 -m gearbx_mlx.bench --shape "$shape" --dtype bfloat16 $quick --out "$out/bench_${shape}.json" 2>&1 \
    | tee "$out/bench_${shape}.txt"
done
python3 -m gearbx_mlx.bench --compare "$out/bench_smollm2-135m.json" "$out/bench_llama3-8b.json" \
  | tee "$out/compare.txt"
