# Sourced by launch/gpu_check.sh and launch/gpu_study.sh: the environment a run on one NVIDIA GPU gets on a
# machine that can fetch nothing (docs/benchmarks.md#gpu-day-one). Defines functions only; each script
# calls them in its own order.
#
#   gpu_env_paths       this checkout and the wheels' folder on PYTHONPATH: the image's jax, not setup.py's pin
#   gpu_env_install     the wheels the image lacks (launch/gpu_wheelhouse.py), from a folder the call carried
#   gpu_env_memory      XLA's share of the GPU's memory
#   gpu_env_xla_flags   MaxText's XLA flags for one GPU, then drops any this jaxlib does not know
#   gpu_env_versions    the device, driver and package versions (and, given a path, the same as JSON)
#
# Uses $python (default python3: the GPU image's interpreter, /opt/torch/.venv) and $gpu_repo.

gpu_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
GPU_SITE="${GPU_SITE:-${TMPDIR:-/tmp}/midas_gpu_site}"  # where missing wheels are installed
WHEELHOUSE="${WHEELHOUSE:-$gpu_repo/launch/wheelhouse}"  # built here by launch/gpu_wheelhouse.py, carried

gpu_env_paths() {
  # The project from this checkout without `pip install -e .`: setup.py holds jax below what the image has,
  # and pip would try to fetch a jax it may not replace (nothing can be fetched there).
  export PYTHONPATH="$gpu_repo:$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
}

gpu_env_install() {
  "$python" "$gpu_repo/launch/gpu_wheelhouse.py" --install "$WHEELHOUSE" --target "$GPU_SITE"
}

gpu_env_memory() {
  # 90% of the GPU's memory for XLA's pool (jax's default is 75%): the 1B step needs the room, and the rest
  # holds the CUDA context and cuDNN's and cuBLAS's workspaces, which live outside the pool. 0.9 is what
  # NVIDIA's JAX-Toolbox advises (rosetta/docs/GPU_performance.md). jaxlib reads XLA_CLIENT_MEM_FRACTION and
  # refuses it beside the older XLA_PYTHON_CLIENT_MEM_FRACTION, so a caller's value of either is kept under
  # the new name.
  export XLA_CLIENT_MEM_FRACTION="${XLA_CLIENT_MEM_FRACTION:-${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}}"
  unset XLA_PYTHON_CLIENT_MEM_FRACTION
}

# MaxText's XLA flags for its GPU runs (AI-Hypercomputer/maxtext, end_to_end/gpu/a3/test_convergence_1b_params.sh,
# the 1B recipe), those that act on one GPU, each with why:
GPU_XLA_FLAGS=(
  # Schedules the program so that asynchronous work (copies; a multi-GPU run's collectives) overlaps compute.
  --xla_gpu_enable_latency_hiding_scheduler=true
  # Matmuls go to cuBLAS, not to Triton GEMMs XLA generates: MaxText's choice, and no GEMM autotuning in
  # each compile (three 1B train steps compile within the 8 minutes). The Pallas Triton kernels are not GEMMs.
  --xla_gpu_enable_triton_gemm=false
  # The layers are one scanned loop: double buffering overlaps an iteration's loads with the last one's compute.
  --xla_gpu_enable_while_loop_double_buffering=true
  # What the backward pass recomputes is ModelConfig.remat_policy's decision; XLA's own rematerialization
  # would recompute more under memory pressure, so step times would depend on the memory fraction.
  --xla_disable_hlo_passes=rematerialization
)
# Left out: the recipe's collective flags (combine thresholds, pipelined all-gather/reduce-scatter/all-reduce,
# the highest-priority async stream) act on collectives, which one GPU does not run; --xla_gpu_graph_level=0
# is no flag of jaxlib 0.10 or later (an unknown flag stops XLA at start).

gpu_env_xla_flags() {
  # Ours first (those not there already), so that flags the caller set in XLA_FLAGS come later and win.
  local flag ours=()
  for flag in "${GPU_XLA_FLAGS[@]}"; do
    [[ " ${XLA_FLAGS:-} " == *" $flag "* ]] || ours+=("$flag")
  done
  export XLA_FLAGS="${ours[*]}${XLA_FLAGS:+ $XLA_FLAGS}"
  XLA_FLAGS="${XLA_FLAGS# }"
  # An XLA flag this jaxlib does not know stops every process at start ("Unknown flag in XLA_FLAGS");
  # flags come and go between releases, so each unknown one is dropped here, by name, and said.
  local tries output unknown
  for tries in 1 2 3 4 5 6; do
    if output=$("$python" -c "import jax; print('xla flags accepted by jax', jax.__version__, 'on', jax.devices()[0].platform)" 2>&1); then
      echo "$output" | tail -1
      echo "XLA_FLAGS=$XLA_FLAGS"
      return 0
    fi
    unknown=$(echo "$output" | sed -n 's/.*Unknown flags\{0,1\} in XLA_FLAGS: *//p' | head -1)
    if [[ -z "$unknown" ]]; then
      echo "$output" | tail -20
      echo "XLA_FLAGS=$XLA_FLAGS (jax did not start with them; not an unknown flag)"
      return 1
    fi
    local names=" " kept=() dropped=0
    for flag in $unknown; do names+="${flag%%=*} "; done  # compared by name: XLA may quote it without its value
    for flag in $XLA_FLAGS; do
      if [[ "$names" == *" ${flag%%=*} "* ]]; then
        echo "dropped $flag: this jaxlib does not know it"
        dropped=1
      else
        kept+=("$flag")
      fi
    done
    export XLA_FLAGS="${kept[*]}"
    (( dropped )) || { echo "$output" | tail -5; return 1; }
  done
  return 1
}

gpu_env_versions() {
  # gpu_env_versions [JSON]: prints what ran where; with JSON, writes the same there.
  echo "date: $(date -u +%FT%TZ) on $(hostname)"
  echo "commit: $(git -C "$gpu_repo" rev-parse HEAD 2>/dev/null || echo 'not a git checkout')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  else
    echo "nvidia-smi: not found"
  fi
  "$python" - "${1:-}" <<'EOF'
import json
import sys

import jax

from midas_jax.versions import installed

names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax",
         "optax", "orbax-checkpoint", "tensorstore", "numpy", "gin-config", "tensorboardX", "triton", "pytest")
versions = {k: v for k, v in installed(names).items() if v != "not installed" or not k.startswith("jax-cuda")}
devices = jax.devices()
print("devices:", devices)
print("versions:", " ".join(f"{k}={v}" for k, v in versions.items()))
if sys.argv[1]:
  with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump({"platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": len(devices),
               "versions": versions}, f, indent=2)
EOF
}
