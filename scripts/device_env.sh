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
