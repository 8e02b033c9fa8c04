#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed (pip install
# mlx mlx-cuda-13): how MLX reads a quantized cache there (the probe), the KV
# tests and the fused write kernel's tests on the GPU, the write kernel against
# the MLX ops, then decode tokens/s at 1K and 4K tokens of context on a
# Llama-3-8B shape with random weights in float16: the float16 cache, mlx-lm's
# affine 4-bit cache, and the rotated 4-bit cache (its writes through the fused
# kernel, through MLX ops, and with MLX's min-max scales), in rounds within one
# process.
# Usage: scripts/device_kv.sh OUTDIR [--quick]
set -uo pipefail
out=${1:?usage: scripts/device_kv.sh OUTDIR [--quick]}
quick=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Prefill chunks meet new key lengths; cuDNN would build a plan for each.
export MLX_CUDA_USE_CUDNN_SDPA=${CUDNN_SDPA:-0}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())' \
  | tee -a "$out/gpu.txt"
python3 scripts/eval_kv.py probe float16 2>&1 | tee "$out/kv_probe.txt"
python3 -m pytest tests/test_kvcache.py tests/test_kv_generation.py tests/test_kv_write_kernel.py -q -rs \
  -p no:cacheprovider -m "not slow" 2>&1 | tee "$out/kv_tests.txt" | tail -8
rounds=5; [ "$quick" = "--quick" ] && rounds=1
python3 scripts/bench_kv_write.py --rounds "$rounds" --out "$out/kv_write_gpu.json" 2>&1 | tee "$out/kv_write.txt"
caches=float,affine-4-g64,kv-4-g64,kv-4-g64+ops,kv-4-g64+minmax
if [ "$quick" = "--quick" ]; then
  python3 scripts/eval_kv.py speed --shape llama3-8b --dtype float16 --quick --caches "$caches" \
    --out "$out/kv_speed_llama3-8b_gpu_quick.json" 2>&1 | tee "$out/kv_speed.txt"
else
  python3 scripts/eval_kv.py speed --shape llama3-8b --dtype float16 --contexts 1024,4096 --steps 32 --repeats 3 \
    --caches "$caches" --out "$out/kv_speed_llama3-8b_gpu.json" 2>&1 | tee "$out/kv_speed.txt"
fi
