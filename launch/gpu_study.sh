#!/usr/bin/env bash
# The stacking study on one GPU (gin/experiments/study_stacking_gpu.gin: a baseline ladder and MIDAS at
# 16 tokens per parameter, two seeds, about 7 minutes on an H100 or H200), data generated on the
# machine (the built-in corpus), nothing downloaded:
#
#   bash launch/gpu_study.sh [WORKDIR] [--gin.K=V ...]
#
# 1. Prints the device, its driver, and the versions of python, jax and the packages; installs what the
#    GPU image lacks from the wheels the call carried (launch/gpu_wheelhouse.py), runs this checkout
#    without installing it (the image's jax, not setup.py's range), and sets the memory fraction and the
#    one-GPU XLA flags (launch/gpu_env.sh, shared with launch/gpu_check.sh).
# 2. A smoke run of about 60 seconds into WORKDIR/smoke: the same config at 40 steps, one seed, no
#    extra ladder rungs, 2 test batches, a small corpus. It must pass before the study starts.
#    SMOKE_ONLY=1 stops after it (launch/gpu_check.sh runs that when its budget leaves time).
# 3. The study into WORKDIR (a re-run resumes from its cells).
# 4. Deletes every checkpoint under WORKDIR (KEEP_CHECKPOINTS=1 keeps them), leaving what is small: the
#    study's results.json, study.md, figures and per-cell metrics.
# WORKDIR/gpu_study.log has the device, the versions, each command and its wall seconds, and the
# outputs' size. WORKDIR defaults to runs/study_stacking_gpu. Extra arguments are gin bindings passed
# to both runs (the smoke's own lengths, seeds and test batches win over them); the suite runs this
# script at tiny sizes on the CPU with them. PYTHON picks the interpreter (default: python3, the GPU
# image's); WHEELHOUSE the wheels' folder (default: launch/wheelhouse).
set -euo pipefail
cd "$(dirname "$0")/.."
workdir="${1:-runs/study_stacking_gpu}"
shift || true
source launch/gpu_env.sh
config=gin/experiments/study_stacking_gpu.gin
smoke_bindings=(
  "--gin.StackingStudyConfig.steps=[40]"
  "--gin.StackingStudyConfig.ladder_steps=[]"
  "--gin.StackingStudyConfig.seeds=[0]"
  "--gin.StackingStudyConfig.test_batches=2"
  "--gin.StackingStudyConfig.growth_window=2"
  "--gin.TrainerConfig.eval_batches=1"
  "--gin.DataConfig.corpus_documents=20000"
)
mkdir -p "$workdir"
log="$workdir/gpu_study.log"
say() { echo "$*" | tee -a "$log"; }

gpu_env_paths
gpu_env_memory
gpu_env_install 2>&1 | tee -a "$log"
# Not in a pipeline: the flags it keeps are exported to this shell.
gpu_env_xla_flags >"$workdir/xla_flags.txt" 2>&1 || { tee -a "$log" <"$workdir/xla_flags.txt"; exit 1; }
tee -a "$log" <"$workdir/xla_flags.txt" && rm "$workdir/xla_flags.txt"
say "XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION"
gpu_env_versions 2>&1 | tee -a "$log"

# run_study NAME DIR BINDINGS...: the study into DIR, its command and wall seconds in the log.
run_study() {
  local name="$1" dir="$2"
  shift 2
  local cmd=("$python" -m midas_jax study stacking "--gin_file=$config" "--workdir=$dir"
             "--gin.TrainerConfig.progress_bar=False" "$@")
  say "$name command: ${cmd[*]}"
  local start status
  start=$(date +%s)
  status=0
  "${cmd[@]}" || status=$?
  say "$name wall seconds: $(( $(date +%s) - start )) (exit $status)"
  return "$status"
}

total_start=$(date +%s)
if ! run_study smoke "$workdir/smoke" "$@" "${smoke_bindings[@]}"; then
  say "the smoke run failed: the study was not started"
  exit 1
fi
if [[ "${SMOKE_ONLY:-0}" == 1 ]]; then
  say "SMOKE_ONLY=1: the study was not started; total wall seconds: $(( $(date +%s) - total_start ))"
  exit 0
fi
run_study study "$workdir" "$@"
if [[ "${KEEP_CHECKPOINTS:-0}" != 1 ]]; then
  find "$workdir" -type d -name checkpoints -prune -exec rm -rf {} +
  say "checkpoints deleted (KEEP_CHECKPOINTS=1 keeps them)"
fi
say "total wall seconds: $(( $(date +%s) - total_start ))"
say "outputs: $(du -sh "$workdir" | cut -f1) in $(find "$workdir" -type f | wc -l) files"
