#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and MLX's CUDA backend installed: the CUDA
# kernels handed to MLX as #include lines of files (gearbx_mlx/bindings/
# cuda_text.py) against their whole text (MLX hashes the text it is given on
# every call).
#   phase t: the file route's tests and the nested kernels' CUDA tests, built
#            through the files.
#   phase e: host microseconds per graph node (scripts/bench_gpu_encode.py) of
#            a one-input kernel with 0-48 KiB of text, and of the package's
#            mid-gear product, from files and from its whole text.
#   phase d: decode tok/s and host time per step of MLX 8-bit and the nested
#            mid and high gears (Llama-3-8B shape, random weights), ROUNDS
#            rounds, once with the whole text and once through the files.
#   phase f: decode of bf16, MLX 4- and 8-bit and the three nested gears,
#            ROUNDS rounds interleaved, through the files (the package as
#            installed).
# Everything lands in OUTDIR.
# Usage: scripts/device_cuda_text.sh t|e|d|f OUTDIR [ROUNDS]
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
start_phase "usage: scripts/device_cuda_text.sh t|e|d|f OUTDIR [ROUNDS]" 3 "$@"
decode() {  # decode NAME [FLAGS...] -- VARIANTS...
  local name=$1; shift
  local flags=()
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  timeout "${DECODE_LIMIT_S:-280}" $py scripts/bench_nested_gpu.py --skip-sweep --skip-gemv --skip-host \
    --rounds "$rounds" --out "$out/$name.json" "${flags[@]}" --variants "$@" 2>&1 | tee "$out/$name.txt" \
    | grep "decode\|target\|Error"
}
case "$phase" in
  t)
    timeout 60 $py -m pytest tests/test_cuda_text.py -q -rs -p no:cacheprovider -n0 > "$out/cuda_text_tests.txt" 2>&1
    tail -3 "$out/cuda_text_tests.txt"
    timeout "${TEST_LIMIT_S:-200}" $py -m pytest tests/test_nested_gpu.py -q -rs -p no:cacheprovider -n0 \
      -k "cuda_bound_launches or cuda_every_tuning" > "$out/cuda_tests.txt" 2>&1
    tail -3 "$out/cuda_tests.txt"
    ;;
  e)
    timeout 150 $py scripts/bench_gpu_encode.py --inputs 1 --text-kb 8 24 48 --package --rounds 20 \
      --out "$out/encode_files.json" 2>&1 | tee "$out/encode_files.txt"
    timeout 100 $py scripts/bench_gpu_encode.py --inputs 1 --package --inline-text --rounds 20 \
      --out "$out/encode_inline.json" 2>&1 | tee "$out/encode_inline.txt"
    ;;
  d)
    decode decode_inline --inline-cuda-text -- mlx-8 nested-mid-grp-blockc nested-high-grp-blockc
    decode decode_files -- mlx-8 nested-mid-grp-blockc nested-high-grp-blockc
    ;;
  f)
    DECODE_LIMIT_S=${DECODE_LIMIT_S:-560} decode gears -- bf16 mlx-4 mlx-8 nested-low-grp-blockc \
      nested-mid-grp-blockc nested-high-grp-blockc
    nvidia-smi -q -d CLOCK,PERFORMANCE,POWER > "$out/gpu_clocks.txt" 2>&1
    ;;
  *) echo "phase is t, e, d or f" >&2; exit 2 ;;
esac
