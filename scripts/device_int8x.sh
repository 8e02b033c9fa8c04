#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed: the mid
# gear with x rounded to int8 (NestedTuning.int8x) against its float split.
#   phase t: the CUDA tests of the int8 split, of every split and of the bound
#            launches; then the mid gear's splits at Llama-3-8B's four shapes,
#            float (x from device memory) and int8, against MLX's products
#            (scripts/sweep_nested_gemv_gpu.py --int8x --device-only).
#   phase d: decode tok/s of bf16, MLX 4- and 8-bit and the nested gears as
#            the package builds them on a GPU, the mid gear both ways,
#            ROUNDS rounds interleaved (scripts/bench_nested_gpu.py).
#   phase p: an Nsight Compute profile of the mid kernel both ways and MLX's
#            8-bit product at SHAPE (scripts/profile_gemv_kernels.py).
#   phase g: decode of MLX 8-bit and the mid gear, 3 rounds, once for each
#            size of MLX's CUDA graphs given (MLX_MAX_OPS_PER_BUFFER: nodes
#            per graph, MLX's default 20), to see whether the graphs' count
#            paces the host's encoding of a step (about 4 minutes each).
# Everything lands in OUTDIR.
# Usage: scripts/device_int8x.sh t|d|p|g OUTDIR [ROUNDS|SHAPE|NODES...]
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
start_phase "usage: scripts/device_int8x.sh t|d|p|g OUTDIR [ROUNDS|SHAPE|NODES...]" "" "$@"
case "$phase" in
  t)
    timeout "${TEST_LIMIT_S:-240}" $py -m pytest tests/test_nested_gpu.py -q -rs -p no:cacheprovider -n0 \
      -k "cuda_int8x or cuda_every_tuning or cuda_bound_launches" > "$out/cuda_tests.txt" 2>&1
    tail -3 "$out/cuda_tests.txt"
    timeout "${SWEEP_LIMIT_S:-240}" $py scripts/sweep_nested_gemv_gpu.py --gears mid --int8x --device-only \
      --out "$out/sweep.json" 2>&1 | tee "$out/sweep.txt" | grep -v "^  "
    ;;
  d)
    rounds=${3:-5}
    timeout "${DECODE_LIMIT_S:-540}" $py scripts/bench_nested_gpu.py --skip-sweep --skip-gemv --skip-host \
      --rounds "$rounds" --out "$out/gears.json" \
      --variants bf16 mlx-4 mlx-8 nested-low-grp-blockc nested-mid-grp-blockc-f32x nested-mid-grp-blockc-i8 \
      nested-high-grp-blockc 2>&1 | tee "$out/gears.txt" | grep -v "^  r"
    nvidia-smi -q -d CLOCK,PERFORMANCE,POWER > "$out/gpu_clocks.txt" 2>&1
    ;;
  p)
    shape=${3:-4096x4096}
    timeout "${PROFILE_LIMIT_S:-200}" ncu --clock-control none --kernel-name regex:"gbx_nested|qmv|gemv|gemm" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats $py scripts/profile_gemv_kernels.py --shape "$shape" \
      > "$out/ncu_$shape.txt" 2>&1
    echo "ncu exit status: $?"
    grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Issue|Achieved Occupancy|Registers Per|^planes|^MLX|^bf16" \
      "$out/ncu_$shape.txt" | cut -c1-120 | head -60
    ;;
  g)
    shift 2
    for nodes in "${@:-20}"; do
      MLX_MAX_OPS_PER_BUFFER=$nodes timeout "${GRAPH_LIMIT_S:-300}" $py scripts/bench_nested_gpu.py --skip-sweep \
        --skip-gemv --skip-host --rounds 3 --out "$out/graph_nodes_$nodes.json" \
        --variants mlx-8 nested-mid-grp-blockc 2>&1 | tee "$out/graph_nodes_$nodes.txt" | grep "decode\|target"
    done
    ;;
  *) echo "phase is t, d, p or g" >&2; exit 2 ;;
esac
