#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed: the nested
# GEMV's work splits at Llama-3-8B's shapes against MLX's products
# (scripts/sweep_nested_gemv_gpu.py); then decode tok/s of the baselines and
# the nested gears as the package builds them on a GPU, with the mid and high
# gears at the sweep's best split for 28672x4096 (the stacked gate/up product,
# most of a block's bytes), ROUNDS rounds interleaved. With CUDA_TESTS=1 the
# nested GEMV's CUDA tests run first (about ten minutes on an H100); with
# PROFILE=1 an Nsight Compute profile of the mid and high kernels and MLX's
# 8-bit and bf16 products at 28672x4096 (scripts/profile_gemv_kernels.py)
# runs last. Everything lands in OUTDIR.
# Usage: scripts/device_gemv_sweep.sh OUTDIR [ROUNDS]
set -uo pipefail
out=${1:?usage: scripts/device_gemv_sweep.sh OUTDIR [ROUNDS]}
rounds=${2:-5}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  $py -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
  grep -m1 "model name" /proc/cpuinfo; cat /proc/loadavg
} 2>&1 | tee "$out/env.txt"
if [ "${CUDA_TESTS:-0}" = 1 ]; then
  $py -m pytest tests/test_nested_gpu.py -q -rs -p no:cacheprovider -n0 -k "cuda and not host_emulated" \
    > "$out/cuda_tests.txt" 2>&1
  tail -2 "$out/cuda_tests.txt"
fi
timeout "${SWEEP_LIMIT_S:-300}" $py scripts/sweep_nested_gemv_gpu.py --out "$out/sweep.json" 2>&1 | tee "$out/sweep.txt" \
  | grep -v "^  "
best=$($py - "$out/sweep.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1])).get("summary", [])
for r in rows:
    if r["shape"] == "28672x4096":
        rows_, vec, shared, xsums, biased = r["best"]
        print(f"{r['gear']}={rows_},{vec},1,{int(xsums)},{int(biased)},{int(shared)}", end=" ")
PY
)
echo "decode with --tuning $best"
if [ "$rounds" -gt 0 ]; then
  timeout "${DECODE_LIMIT_S:-330}" $py scripts/bench_nested_gpu.py --skip-sweep --skip-gemv --skip-host \
    --rounds "$rounds" --out "$out/gears.json" --tuning $best \
    --variants bf16 mlx-4 mlx-8 nested-low-grp-blockc nested-mid-grp-blockc nested-high-grp-blockc \
    2>&1 | tee "$out/gears.txt" | grep -v "^  r"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  timeout "${PROFILE_LIMIT_S:-150}" ncu --clock-control none --kernel-name regex:"gbx_nested|qmv|gemv|gemm" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats $py scripts/profile_gemv_kernels.py > "$out/ncu.txt" 2>&1
  echo "ncu exit status: $?"
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Issue|Achieved Occupancy|Registers Per|^planes|^MLX|^bf16" \
    "$out/ncu.txt" | cut -c1-120 | head -80
fi
