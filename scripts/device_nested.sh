#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed: the
# kernel tests on CUDA (packed and nested), the C kernels' self-test and
# tests on the host CPU, then the nested benchmarks (CPU, then GPU).
# Everything lands in OUTDIR.
# Usage: scripts/device_nested.sh OUTDIR [--quick] [bench_nested_gpu.py arguments...]
set -uo pipefail
out=${1:?usage: scripts/device_nested.sh OUTDIR [--quick] [bench args...]}
shift
quick=""
if [ "${1:-}" = "--quick" ]; then quick="--quick"; fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())' \
  | tee -a "$out/gpu.txt"
grep -m1 "model name" /proc/cpuinfo | tee "$out/cpu.txt"
grep -m1 -o -w -E "avx512_vnni|avx_vnni|avx512vl|f16c" /proc/cpuinfo | sort -u | tr '\n' ' ' | tee -a "$out/cpu.txt"
echo
# The C kernels on the host CPU: the extension, and the self-test driver.
python3 gearbx_mlx/bindings/build.py 2>&1 | tail -2 | tee "$out/cpu_driver.txt"
cc -O2 -std=gnu11 -pthread -Imetal_kernels gearbx_mlx/bindings/csrc/*.c gearbx_mlx/bindings/csrc/arch/*/*.c -lm -o /tmp/gbx_driver \
  && /tmp/gbx_driver --quick | sed -n '1p;$p' | tee -a "$out/cpu_driver.txt"
# The host emulation of the GPU bodies runs on CPU CI, not here.
python3 -m pytest tests/test_nested_gpu.py tests/test_nested_matmul.py tests/test_nested_cpu.py \
  tests/test_kernels_cuda.py tests/test_packed.py tests/test_fused.py -q -rs -p no:cacheprovider \
  -k "not host_emulated and not planted and not scalar_fallback" 2>&1 | tee "$out/cuda_tests.txt" | tail -15
python3 scripts/bench_nested_kernels.py $quick --out "$out/nested_cpu.json" 2>&1 | tee "$out/bench_cpu.txt" | tail -40
python3 scripts/bench_nested_gpu.py --out "$out/nested_gpu.json" "$@" 2>&1 | tee "$out/bench_gpu.txt" | tail -60
