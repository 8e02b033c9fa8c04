#!/usr/bin/env bash
# Speculative-decoding benchmarks on an NVIDIA GPU (MLX-CUDA), random weights.
# Run from the checkout root after the mlx / mlx-cuda wheels are installed
# (pip install mlx mlx-cuda-13); writes into $OUT (or
# benchmarks/results). Acceptance on random weights is meaningless: the
# modeled speed-ups use α measured on the real default model on the CPU
# (benchmarks/results/speculative_cpu_packed_openblas.json), passed as ALPHA.
set -u
out=${OUT:-benchmarks/results}
ALPHA=${ALPHA:-"low=0.736 mid=0.972"}
export PYTHONUNBUFFERED=1
# MLX-CUDA hands a multi-row attention call (the verify) over a key length it
# has not seen to cuDNN, which builds a new plan each time: tens of ms per
# block, and a 'Cache thrashing' error after 512 misses. Measured in the first
# H100 run (speculative_h100_smollm2-135m_mlx.json: 45-60 ms per block).
# Off by default here; CUDNN_SDPA=1 keeps MLX's default.
export MLX_CUDA_USE_CUDNN_SDPA=${CUDNN_SDPA:-0}
for shape in smollm2-135m llama3-8b; do
  tokens=128; prompts=3
  [ "$shape" = llama3-8b ] && { tokens=64; prompts=2; }
  for kernel in mlx packed; do
    tag="h100_${shape}_${kernel}"
    echo "=== $tag"
    python3 scripts/bench_speculative.py --shape "$shape" --dtype bfloat16 --kernel "$kernel" \
      --tokens "$tokens" --prompts "$prompts" --reps 3 --alpha $ALPHA --tag "$tag" \
      --out "$out/speculative_${tag}.json" || echo "FAILED: $tag"
  done
done
