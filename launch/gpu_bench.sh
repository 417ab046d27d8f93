#!/usr/bin/env bash
# One NVIDIA GPU, before `attention='auto'` may take our Triton kernels there: the attention paths'
# tests run on the device (the Triton build of the flash kernels and cuDNN's kernel, against the dense
# path), then the paper 1B's train step is timed once per path with MFU against the chip's bf16 peak
# (gin/experiments/bench_gpu_paper_1b.gin). Nothing is downloaded; install first, in a venv:
#
#   pip install -c requirements/constraints.txt -e '.[test,cuda12]'
#   bash launch/gpu_bench.sh [OUT]          # OUT defaults to runs/gpu_bench
#
# Writes OUT/gpu_bench.log (device, test results, each step's report) and OUT/train_<attention>.json.
# A failing path is logged and the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_bench}"
python="${PYTHON:-python}"
mkdir -p "$out"
log="$out/gpu_bench.log"
export JAX_PLATFORMS=cuda  # the tests' conftest would otherwise pick the CPU and the Pallas interpreter
{
  echo "start: $(date -u +%FT%TZ)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee -a "$log"
echo "== attention tests on the GPU" | tee -a "$log"
"$python" -m pytest -p no:xdist -q tests/test_flash_kernel.py tests/test_attention.py tests/test_cudnn_attention.py \
  2>&1 | tee -a "$log"
for attention in dot_product cudnn flash; do
  echo "== bench train, attention=$attention" | tee -a "$log"
  "$python" -m midas_jax bench train --gin_file=gin/experiments/bench_gpu_paper_1b.gin \
    --gin.ModelConfig.attention="'$attention'" --steps=10 --warmup=3 --json="$out/train_$attention.json" \
    2>&1 | tee -a "$log" || echo "attention=$attention failed" | tee -a "$log"
done
echo "end: $(date -u +%FT%TZ)" | tee -a "$log"
