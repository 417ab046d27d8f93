#!/usr/bin/env bash
# The stacking length study on one GPU (gin/experiments/study_stacking_gpu.gin), data generated on the
# machine (the built-in corpus), nothing downloaded:
#
#   bash launch/gpu_study.sh [WORKDIR] [--gin.K=V ...]
#
# WORKDIR defaults to runs/study_stacking_gpu; a re-run resumes from its cells.jsonl. Extra arguments
# are gin bindings (the suite's CPU smoke test runs this script at tiny sizes with them). Writes
# WORKDIR/study.md (the tables), study.json, the figures under WORKDIR/study/, and WORKDIR/gpu_study.log
# with the device, the command and its wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
workdir="${1:-runs/study_stacking_gpu}"
shift || true
python="${PYTHON:-python}"
mkdir -p "$workdir"
log="$workdir/gpu_study.log"
{
  echo "start: $(date -u +%FT%TZ)"
  "$python" -c "import jax; print('devices:', jax.devices())"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  echo "command: $python -m midas_jax study stacking --gin_file=gin/experiments/study_stacking_gpu.gin --workdir=$workdir $*"
} | tee -a "$log"
start=$(date +%s)
"$python" -m midas_jax study stacking --gin_file=gin/experiments/study_stacking_gpu.gin --workdir="$workdir" \
  --gin.TrainerConfig.progress_bar=False "$@"
echo "wall seconds: $(( $(date +%s) - start ))" | tee -a "$log"
