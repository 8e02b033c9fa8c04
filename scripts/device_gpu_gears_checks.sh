#!/usr/bin/env bash
# Two phases of one visit to an NVIDIA machine with MLX's CUDA backend
# installed (python3 finds mlx, mlx-lm and gearbx_mlx; run from the checkout
# root). Everything lands in OUTDIR.
#
#   a: the C kernels built; python -m gearbx_mlx.selftest as a user runs it
#      (parallel by default on CUDA), timed from the command's start; then
#      decode tok/s of the plain baselines (bf16, MLX 4-bit, MLX 8-bit) and
#      the nested gears as the package builds them on a GPU (fused groups,
#      compiled block steps), ROUNDS rounds interleaved, with the GPU's clocks
#      and the host's load after every run.
#   b: GEMV per product on Llama-3-8B's two largest shapes (every gear, MLX
#      4/8-bit, bf16) and the mid gear's tunings there; the block-sparse
#      body's CUDA tests; selftest with --jobs 1 (the sequential run, same
#      machine); python -m gearbx_mlx.bench on the Llama-3-8B shape.
#   c: the C kernels built; the block-sparse body's CUDA tests; selftest as a
#      user runs it and with --jobs 1, each in a fresh MLX kernel cache.
#   d: as a's decode, with the low gear through the fused kernel too.
#
# Usage: scripts/device_gpu_gears_checks.sh a|b|c|d OUTDIR [ROUNDS]
set -uo pipefail
phase=${1:?usage: scripts/device_gpu_gears_checks.sh a|b|c|d OUTDIR [ROUNDS]}
out=${2:?usage: scripts/device_gpu_gears_checks.sh a|b|c|d OUTDIR [ROUNDS]}
rounds=${3:-5}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if [ "$phase" = a ]; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit --format=csv
    $py -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
    grep -m1 "model name" /proc/cpuinfo; nproc; cat /proc/loadavg
  } 2>&1 | tee "$out/env.txt"
  $py gearbx_mlx/bindings/build.py 2>&1 | tail -1 | tee -a "$out/env.txt"
  timeout 150 $py scripts/time_command.py --out "$out/selftest_time.json" -- \
    $py -m gearbx_mlx.selftest --json "$out/selftest.json" > "$out/selftest.txt" 2>&1
  echo "selftest exit status: $?" | tee -a "$out/selftest.txt"
  tail -3 "$out/selftest.txt"
  timeout "${DECODE_LIMIT_S:-400}" $py scripts/bench_nested_gpu.py --skip-sweep --skip-gemv --skip-host \
    --rounds "$rounds" --out "$out/gears.json" \
    --variants bf16 mlx-4 mlx-8 nested-low-grp-blockc nested-mid-grp-blockc nested-high-grp-blockc \
    2>&1 | tee "$out/gears.txt" | grep -v "^  repeat"
  nvidia-smi -q -d CLOCK,PERFORMANCE > "$out/gpu_clocks.txt" 2>&1
elif [ "$phase" = b ]; then
  timeout "${GEMV_LIMIT_S:-120}" $py scripts/bench_nested_gpu.py --skip-host --skip-decode --sweep-gears mid \
    --sweep-shapes 28672x4096 4096x14336 --shapes 28672x4096 4096x14336 \
    --formats nested-low nested-mid nested-high mlx-4 mlx-8 bf16 --out "$out/gemv.json" 2>&1 | tee "$out/gemv.txt"
  $py -m pytest tests/test_sparse_gpu.py -q -rs -p no:cacheprovider -n0 -k cuda --durations=10 \
    > "$out/sparse_cuda_tests.txt" 2>&1
  echo "pytest exit status: $?" | tee -a "$out/sparse_cuda_tests.txt"
  tail -3 "$out/sparse_cuda_tests.txt"
  timeout 150 $py scripts/time_command.py --out "$out/selftest_jobs1_time.json" -- \
    $py -m gearbx_mlx.selftest --jobs 1 --json "$out/selftest_jobs1.json" > "$out/selftest_jobs1.txt" 2>&1
  echo "selftest exit status: $?" | tee -a "$out/selftest_jobs1.txt"
  tail -2 "$out/selftest_jobs1.txt"
  timeout "${BENCH_LIMIT_S:-230}" $py -m gearbx_mlx.bench --shape llama3-8b --dtype bfloat16 --rounds 5 \
    --budget "${BENCH_BUDGET_S:-200}" --out "$out/bench_llama3-8b.json" 2>&1 | tee "$out/bench_llama3-8b.txt" | tail -25
elif [ "$phase" = c ]; then
  $py gearbx_mlx/bindings/build.py 2>&1 | tail -1 | tee "$out/build.txt"
  $py -m pytest tests/test_sparse_gpu.py -q -rs -p no:cacheprovider -n0 -k cuda --durations=10 \
    > "$out/sparse_cuda_tests.txt" 2>&1
  echo "pytest exit status: $?" | tee -a "$out/sparse_cuda_tests.txt"
  tail -3 "$out/sparse_cuda_tests.txt"
  for jobs in default 1; do
    flag=$([ "$jobs" = default ] || echo "--jobs $jobs")
    MLX_PTX_CACHE_DIR=$(mktemp -d) timeout 200 $py scripts/time_command.py --out "$out/selftest_jobs${jobs}_time.json" -- \
      $py -m gearbx_mlx.selftest $flag --json "$out/selftest_jobs${jobs}.json" > "$out/selftest_jobs${jobs}.txt" 2>&1
    echo "selftest exit status: $?" | tee -a "$out/selftest_jobs${jobs}.txt"
    tail -2 "$out/selftest_jobs${jobs}.txt"
  done
elif [ "$phase" = d ]; then
  timeout "${DECODE_LIMIT_S:-400}" $py scripts/bench_nested_gpu.py --skip-sweep --skip-gemv --skip-host \
    --rounds "$rounds" --out "$out/gears.json" \
    --variants bf16 mlx-4 mlx-8 nested-low-grp-blockc nested-mid-grp-blockc nested-high-grp-blockc \
    nested-low-fused-grp-blockc 2>&1 | tee "$out/gears.txt" | grep -v "^  repeat"
else
  echo "usage: scripts/device_gpu_gears_checks.sh a|b|c|d OUTDIR [ROUNDS]" >&2
  exit 2
fi
