#!/usr/bin/env bash
# On a machine with a GPU and MLX's CUDA (or Metal) backend, the package on
# PYTHONPATH: the KV write kernel's tests (the CUDA twin against MLX's own
# quantizer; the host emulation too where g++ is installed), then its
# benchmark against the MLX ops. Everything lands in $OUT (default ./out).
# Usage: OUT=DIR scripts/device_kv_write.sh [bench_kv_write.py arguments...]
set -uo pipefail
out=${OUT:-./out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null || true; } \
  | tee "$out/gpu.txt"
$py -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(),
"cuda:", getattr(mx, "cuda", None) is not None and mx.cuda.is_available(), "metal:", mx.metal.is_available())' \
  | tee -a "$out/gpu.txt"
$py -m pytest -q -rs -p no:cacheprovider tests/test_kv_write_kernel.py 2>&1 | tee "$out/kv_write_tests.txt" | tail -15
test_rc=${PIPESTATUS[0]}
$py scripts/bench_kv_write.py --out "$out/kv_write_bench.json" "$@" 2>&1 | tee "$out/kv_write_bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "tests exit $test_rc, bench exit $bench_rc" | tee -a "$out/gpu.txt"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
