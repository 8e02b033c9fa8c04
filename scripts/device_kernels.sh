#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed:
# the CUDA kernel tests, then the kernel benchmark. Everything lands in OUTDIR.
# Usage: scripts/device_kernels.sh OUTDIR [bench_kernels.py arguments...]
set -uo pipefail
out=${1:?usage: scripts/device_kernels.sh OUTDIR [bench args...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())' | tee -a "$out/gpu.txt"
# The host emulation of the body runs wherever g++ is: on CPU CI, not here.
python3 -m pytest tests/test_kernels_cuda.py tests/test_packed.py tests/test_fused.py -q -rs -p no:cacheprovider \
  -k "not host_emulated" 2>&1 | tee "$out/cuda_tests.txt"
python3 scripts/bench_kernels.py --out "$out/kernels.json" "$@" 2>&1 | tee "$out/bench.txt"
