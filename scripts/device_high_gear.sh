#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed: the high
# gear's product with its 6-bit plane's codes read biased
# (NestedTuning.biased6) against the package's split.
#   phase s: the CUDA tests of the splits with biased 6-bit codes, then the
#            high gear's splits at Llama-3-8B's four shapes, rows 2 and 4,
#            with and without biased 6-bit codes (each checked against the
#            reference first; scripts/sweep_nested_gemv_gpu.py --biased6).
#   phase d: decode tok/s of bf16 and the high gear as the package builds it
#            on a GPU, with and without biased 6-bit codes, ROUNDS rounds
#            interleaved (Llama-3-8B shape, random weights).
# Everything lands in OUTDIR.
# Usage: scripts/device_high_gear.sh s|d OUTDIR [ROUNDS]
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
start_phase "usage: scripts/device_high_gear.sh s|d OUTDIR [ROUNDS]" 5 "$@"
case "$phase" in
  s)
    timeout "${TEST_LIMIT_S:-150}" $py -m pytest tests/test_nested_gpu.py -q -rs -p no:cacheprovider -n0 \
      -k "cuda_every_tuning and (tuning10 or tuning11)" > "$out/cuda_tests_biased6.txt" 2>&1
    tail -3 "$out/cuda_tests_biased6.txt"
    timeout "${SWEEP_LIMIT_S:-300}" $py scripts/sweep_nested_gemv_gpu.py --gears high --rows 2 4 --vecs 4 --biased6 \
      --out "$out/sweep_high_biased6.json" 2>&1 | tee "$out/sweep_high_biased6.txt" | grep -v "^  "
    ;;
  d)
    timeout "${DECODE_LIMIT_S:-400}" $py scripts/bench_nested_gpu.py --skip-sweep --skip-gemv --skip-host \
      --rounds "$rounds" --out "$out/decode_high_biased6.json" \
      --variants bf16 nested-high-grp-blockc nested-high-grp-blockc-b6 2>&1 | tee "$out/decode_high_biased6.txt" \
      | grep "decode\|target\|Error"
    nvidia-smi -q -d CLOCK,PERFORMANCE,POWER > "$out/gpu_clocks.txt" 2>&1
    ;;
  *) echo "phase is s or d" >&2; exit 2 ;;
esac
