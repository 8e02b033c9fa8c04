# Sourced by the device scripts: what may differ between two runs of the same code.
# write_device_env FILE: the GPU (name, memory, driver, clocks), MLX and its device,
# the host CPU and its load average, into FILE. Uses $py (default python3).
write_device_env() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    ${py:-python3} -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
    grep -m1 "model name" /proc/cpuinfo; cat /proc/loadavg
  } > "$1" 2>&1
}

# start_phase USAGE DEFAULT_ROUNDS "$@": the prologue of the phase scripts. Sets phase, out and
# rounds from PHASE OUTDIR [ROUNDS] (stops with USAGE where one is missing) and py; makes OUTDIR,
# keeps Python's output unbuffered and writes the environment to OUTDIR/env_PHASE.txt.
start_phase() {
  usage=$1; local default_rounds=$2; shift 2
  phase=${1:?$usage}; out=${2:?$usage}; rounds=${3:-$default_rounds}
  py=${PYTHON:-python3}
  mkdir -p "$out" && export PYTHONUNBUFFERED=1
  write_device_env "$out/env_$phase.txt"
}
