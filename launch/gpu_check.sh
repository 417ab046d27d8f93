#!/usr/bin/env bash
# GPU day one: every GPU path of this project measured in one run of at most 8 minutes on one H100 or H200
# that can fetch nothing (docs/benchmarks.md#gpu-day-one). Build the wheels the GPU image lacks here first
# (python launch/gpu_wheelhouse.py: launch/wheelhouse, git-ignored) and carry them with the call:
#
#   bash launch/gpu_check.sh OUT               # on the GPU machine, from the repository root
#   bash launch/gpu_check.sh OUT --dry-run     # on a CPU: every step at a tiny size (the suite runs it;
#                                              # the train step on the dense path only)
#
# Steps, in order, each in the log with its exit status and seconds; a step that fails is reported and the
# rest still run; one that would start with too little of the time budget left is skipped and said:
#   wheels     installs what the image lacks (gin-config, tensorboardX) from $WHEELHOUSE, nothing fetched
#   xla_flags  the memory fraction and MaxText's one-GPU XLA flags (launch/gpu_env.sh says why each); a
#              flag this jaxlib does not know is dropped and said (XLA would stop every process at start)
#   versions   the device, driver, python and package versions
#   attention  `midas bench attention`: dense, flash (Triton), cuDNN and XLA's call against the dense path
#              in float32, output and every gradient, float32 and bfloat16, on packed UL2 rows
#   train_*    `midas bench train` of the paper 1B's layers (gin/experiments/bench_gpu_paper_1b.gin), once
#              per attention path (dot_product, cudnn, flash): step time and MFU against the bf16 peak
#   pytest     the attention and flash kernel tests that compare against the dense path, on the GPU
#   study      if time remains: the GPU stacking study's smoke run (MIDAS against the baseline at 40 steps,
#              launch/gpu_study.sh with SMOKE_ONLY=1); the whole study needs a device call of its own
# Writes to OUT, 8 files at most: gpu_check.log, summary.json (each step's status and seconds, the
# versions, the flags), attention.json, train_dot_product.json, train_cudnn.json, train_flash.json,
# pytest.xml and study.json (each only when its step ran). Exit status: 0 when no step failed, else 1.
#
# Environment: PYTHON (default python3), WHEELHOUSE (default launch/wheelhouse), GPU_CHECK_BUDGET_S
# (default 450: the steps' time budget, seconds), XLA_CLIENT_MEM_FRACTION and XLA_FLAGS (added to ours).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: bash launch/gpu_check.sh OUT [--dry-run]" >&2; exit 2; }
out="" dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) usage ;;
    -*) echo "unknown flag $arg" >&2; usage ;;
    *) [[ -z "$out" ]] || usage; out="$arg" ;;
  esac
done
[[ -n "$out" ]] || usage

source launch/gpu_env.sh
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/gpu_check.log"
: >"$log"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"  # what is not one of OUT's files
steps="$work/steps.tsv"
budget_s="${GPU_CHECK_BUDGET_S:-450}"
start_s=$(date +%s)
say() { echo "$*" | tee -a "$log"; }

# step NAME CAP_S NEED_S CMD...: runs CMD for at most CAP_S seconds, if NEED_S remain of the budget;
# logs its output, exit status and seconds. Never stops the script.
step() {
  local name="$1" cap="$2" need="$3"
  shift 3
  local left=$(( budget_s - ($(date +%s) - start_s) ))
  if (( left < need )); then
    say "== $name: skipped, ${left}s of the budget left and it needs ${need}s"
    printf '%s\tskipped\t0\t%s\n' "$name" "budget" >>"$steps"
    return 0
  fi
  (( cap > left )) && cap=$left
  say "== $name (at most ${cap}s): $*"
  local t0 status
  t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
  local seconds=$(( $(date +%s) - t0 ))
  local verdict=ok
  (( status == 0 )) || verdict=failed
  (( status == 124 || status == 137 )) && verdict=timed_out
  say "== $name: $verdict (exit $status) in ${seconds}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$verdict" "$seconds" "$status" >>"$steps"
}

skip() {  # skip NAME REASON
  say "== $1: skipped, $2"
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$steps"
}

if (( dry_run )); then
  export JAX_PLATFORMS=cpu
  say "dry run on the CPU: every step at a tiny size"
else
  # The GPU or nothing: a CPU fallback would time the wrong machine and run the tests' CPU paths.
  export JAX_PLATFORMS=cuda
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
gpu_env_paths
gpu_env_memory

step wheels 60 0 bash -c "source launch/gpu_env.sh && gpu_env_install"
# In this shell, so that the flags it keeps reach every later step.
say "== xla_flags: XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION"
t0=$(date +%s)
gpu_env_xla_flags >"$work/xla_flags.txt" 2>&1  # not in a pipeline: its exports must stay in this shell
flags_status=$?
tee -a "$log" <"$work/xla_flags.txt"
printf '%s\t%s\t%s\t%s\n' xla_flags "$([[ $flags_status == 0 ]] && echo ok || echo failed)" \
  "$(( $(date +%s) - t0 ))" "$flags_status" >>"$steps"
# After the flags: an XLA flag this jaxlib does not know would stop it at start.
step versions 60 0 bash -c "source launch/gpu_env.sh && gpu_env_versions '$work/versions.json'"

midas=("$python" -m midas_jax)
if (( dry_run )); then
  attention_args=(--shape=2,64,4,2,16 --repeats=1)
  # The 1B's config with 1 layer of width 32 on rows of 32 tokens, float32 (no bfloat16 matmul check on the CPU).
  train_args=(--steps=2 --warmup=1 --peak_size=32 --gin.ModelConfig.num_layers=1 --gin.ModelConfig.d_model=32
              --gin.ModelConfig.num_heads=2 --gin.ModelConfig.d_ff=64 --gin.ModelConfig.vocab_size=512
              "--gin.ModelConfig.dtype='float32'" --gin.DataConfig.seq_len=32 --gin.DataConfig.batch_size=2
              --gin.TrainerConfig.loss_chunk=0 --gin.DataConfig.corpus_documents=100)
else
  attention_args=()
  train_args=(--steps=5 --warmup=2)  # warm-up: the compile and one step; five timed steps
fi
step attention 150 60 "${midas[@]}" bench attention "${attention_args[@]}" --json="$out/attention.json"

for attention in dot_product cudnn flash; do
  if (( dry_run )) && [[ "$attention" == cudnn ]]; then
    skip "train_$attention" "cuDNN needs an NVIDIA GPU (dry run)"
    continue
  elif (( dry_run )) && [[ "$attention" == flash ]]; then  # the suite's seconds: the same line as dot_product's
    skip "train_$attention" "the interpreted kernels ran in the attention step (dry run)"
    continue
  fi
  step "train_$attention" 150 60 "${midas[@]}" bench train --gin_file=gin/experiments/bench_gpu_paper_1b.gin \
    "--gin.ModelConfig.attention='$attention'" "${train_args[@]}" --json="$out/train_$attention.json"
done

# The tests that compare the fused paths with the dense one, in this process alone: pytest.ini's addopts carry
# `-n 2 --dist loadfile` (two workers would each take the memory fraction of one GPU), so `-o addopts=` drops
# them (`-p no:xdist` beside them stops pytest: "unrecognized arguments"). JAX_DEFAULT_MATMUL_PRECISION=highest:
# the tests' float32 bounds (1e-5) assume float32 matmuls, which a GPU otherwise runs in TF32.
pytest_args=(-o addopts= -m "not slow" -q -rfE --durations=10 -p no:cacheprovider --junitxml="$out/pytest.xml"
             tests/test_flash_kernel.py tests/test_attention.py tests/test_cudnn_attention.py -k "dense or visit")
(( dry_run )) && pytest_args+=(--collect-only)
step pytest 150 60 env JAX_DEFAULT_MATMUL_PRECISION=highest "$python" -m pytest "${pytest_args[@]}"

if (( dry_run )); then
  # launch/gpu_study.sh itself runs at tiny sizes in tests/test_study_length.py: here its config is read.
  step study 60 0 "$python" -c "from midas_jax.commands.study_commands import stacking_study_from_gin as f; \
run, study, _ = f(['gin/experiments/study_stacking_gpu.gin'], []); print('study config:', study.arms, study.steps)"
elif [[ -f gin/experiments/study_stacking_gpu.gin ]]; then
  step study 240 150 env SMOKE_ONLY=1 KEEP_CHECKPOINTS=0 bash launch/gpu_study.sh "$work/study"
  [[ -f "$work/study/smoke/results.json" ]] && cp "$work/study/smoke/results.json" "$out/study.json"
else
  skip study "no gin/experiments/study_stacking_gpu.gin"
fi

"$python" - "$steps" "$work/versions.json" "$out/summary.json" "$budget_s" "$(( $(date +%s) - start_s ))" \
  "$dry_run" <<'EOF' 2>&1 | tee -a "$log"
import json
import os
import sys

steps_path, versions_path, summary_path, budget, wall, dry_run = sys.argv[1:]
steps = []
with open(steps_path, encoding="utf-8") as f:
  for line in f:
    name, verdict, seconds, detail = line.rstrip("\n").split("\t")
    steps.append({"step": name, "status": verdict, "seconds": int(seconds), "detail": detail})
out = os.path.dirname(summary_path)


def read(name):
  path = os.path.join(out, name)
  return json.load(open(path, encoding="utf-8")) if os.path.exists(path) else None


versions = json.load(open(versions_path, encoding="utf-8")) if os.path.exists(versions_path) else None
# The figures a closing note quotes: each attention path's largest error relative to the reference (or why
# it has none), and each train step's time and MFU.
figures = {"attention": {}, "train": {}}
for case in (read("attention.json") or {}).get("cases", []):
  s = case["shape"]
  key = f"{case['dtype']} {s['batch']}x{s['length']} heads {s['heads']}/{s['kv_heads']}x{s['head_dim']}"
  figures["attention"][key] = {path: max(r["relative_error"].values()) if "relative_error" in r else r["status"]
                               for path, r in case["paths"].items()}
for name in sorted(os.listdir(out)):
  if name.startswith("train_") and name.endswith(".json"):
    r = read(name)
    figures["train"][name[len("train_"):-len(".json")]] = {
        "device": r["device"], "step_seconds_median": r["step_seconds_median"], "mfu": r["mfu"],
        "mfu_denominator": r["mfu_denominator"], "tokens_per_second": r["tokens_per_second"]}
summary = {"dry_run": dry_run == "1", "budget_seconds": int(budget), "wall_seconds": int(wall), "steps": steps,
           "figures": figures, "versions": versions, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "xla_client_mem_fraction": os.environ.get("XLA_CLIENT_MEM_FRACTION", ""),
           "failed": [s["step"] for s in steps if s["status"] in ("failed", "timed_out")]}
with open(summary_path, "w", encoding="utf-8") as f:
  json.dump(summary, f, indent=2)
for s in steps:
  print(f"{s['step']:<18} {s['status']:<9} {s['seconds']:>4} s  {s['detail']}")
for path, r in figures["train"].items():
  print(f"train {path:<12} {r['step_seconds_median'] * 1e3:9.1f} ms a step, MFU {r['mfu']:.1%} ({r['mfu_denominator']})")
print(f"wall {wall} s of a {budget} s budget; failed: {', '.join(summary['failed']) or 'none'}")
EOF
rm -rf "$work"
[[ -f "$out/summary.json" ]] || exit 1
"$python" -c "import json, sys; sys.exit(1 if json.load(open(sys.argv[1]))['failed'] else 0)" "$out/summary.json"
