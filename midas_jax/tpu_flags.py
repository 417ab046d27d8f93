"""libtpu flags for the TPU generation a run is on, set before jax starts its TPU backend.

The TPU compiler overlaps collectives with compute only when asked: FSDP gathers every layer's
weights before it runs, and without these flags each gather waits in line. The groups below are
what MaxText's benchmark recipes and the XLA flag guide set for dense decoder training, chosen per
generation (docs/pods.md#tpu-compiler-flags has each flag with its reason); a flag the user set in
LIBTPU_INIT_ARGS keeps the user's value. libtpu reads LIBTPU_INIT_ARGS once, when the TPU backend
starts, so `apply` runs before anything asks jax for a device (and before jax.distributed starts).

Which generation: MIDAS_TPU_ACCELERATOR (the launchers set it: v5p-128, v5litepod-64, v4-64, v6e-256,
...) or TPU_ACCELERATOR_TYPE; with neither, no flags are set (a CPU, a GPU, or a TPU VM nobody named).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

from midas_jax import hardware
from midas_jax.configs import TPU_FLAGS

ENV = "LIBTPU_INIT_ARGS"
ACCELERATOR_VARS = ("MIDAS_TPU_ACCELERATOR", "TPU_ACCELERATOR_TYPE")


@dataclasses.dataclass(frozen=True)
class FlagGroup:
  name: str
  flags: Tuple[str, ...]
  why: str
  generations: Tuple[str, ...]
  when: str = "always"  # "always", "multislice" (a mesh over DCN) or "offload" (remat_policy='offload')


# The scoped VMEM limit (KiB) per generation, from MaxText's benchmark recipes for dense decoders at
# MAXTEXT; None leaves libtpu's default. Its xla_flags_library.py names 98304 DENSE_VMEM_LIMIT_FLAG.
MAXTEXT = "github.com/AI-Hypercomputer/maxtext@e591f30"
VMEM_LIMIT_KIB = {"v4": None, "v5e": None, "v5p": None, "v6e": 98304}
VMEM_SOURCES = {
    "v4": "src/maxtext/configs/tpu/v4/22b.sh and 52b.sh set none (only the async all-gather and megacore)",
    "v5e": "benchmarks/maxtext_v5e_model_configs.py: llama2-7b-v5e-256, llama2-13b-v5e-256, gpt-3-175b-v5e-256 "
           "set none (only llama3_1-8b-8192-v5e-256, which offloads activations to the host, sets 98304)",
    "v5p": "benchmarks/maxtext_v5p_model_configs.py: llama2_7b_v5p_128, llama2_70b_v5p_128, gpt_3_175b_v5p_128 "
           "set none (only llama3-1-405b-8192-v5p-1024, which offloads activations to the host, sets 98304)",
    "v6e": "benchmarks/maxtext_trillium_model_configs.py: llama2-7b-4096, llama3-8b-8192, gpt-3-175b and "
           "default-32 to default-512 set DENSE_VMEM_LIMIT_FLAG = 98304",
}

GROUPS = (
    FlagGroup("overlap FSDP's all-gathers", (
        "--xla_tpu_enable_async_collective_fusion=true",
        "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
        "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
        "--xla_tpu_overlap_compute_collective_tc=true",
        "--xla_enable_async_all_gather=true"),
        "each layer's weight gather runs during the previous layer's compute (continuation fusion), "
        "not before it", ("v4", "v5e", "v5p", "v6e")),
    FlagGroup("scoped VMEM for dense layers", (f"--xla_tpu_scoped_vmem_limit_kib={VMEM_LIMIT_KIB['v6e']}",),
              "96 MiB of VMEM per op for the large dense matmuls, as every dense recipe for v6e sets (MaxText "
              f"{MAXTEXT}: {VMEM_SOURCES['v6e']}); v4, v5e and v5p keep libtpu's default, as MaxText's dense "
              "recipes for them do (VMEM_SOURCES)", ("v6e",)),
    FlagGroup("overlap the cross-slice all-reduce", (
        "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
        "--xla_tpu_data_parallel_opt_different_sized_ops=true"),
        "the gradient all-reduce over DCN is pipelined with the backward pass, across gradients of "
        "different sizes", ("v4", "v5e", "v5p", "v6e"), when="multislice"),
    FlagGroup("schedule the host transfers of 'offload'", (
        "--xla_tpu_enable_all_experimental_scheduler_features=true",
        "--xla_tpu_enable_scheduler_memory_pressure_tracking=true",
        "--xla_tpu_host_transfer_overlap_limit=24"),
        "the scheduler tracks memory pressure and overlaps the layer inputs' copies to and from the "
        "host with compute", ("v4", "v5e", "v5p", "v6e"), when="offload"),
)


def accelerator_from(environ: Mapping[str, str]) -> Optional[str]:
  for var in ACCELERATOR_VARS:
    if environ.get(var):
      return environ[var]
  return None


def recommended(gen: str, num_slices: int = 1, remat_policy: str = "full") -> List[str]:
  """The flags of every group that applies to generation `gen` and this run, in the table's order."""
  when = {"always": True, "multislice": num_slices > 1, "offload": remat_policy == "offload"}
  return [f for g in GROUPS if gen in g.generations and when[g.when] for f in g.flags]


def _name(flag: str) -> str:
  return flag.split("=", 1)[0]


def merged(user: str, ours: List[str]) -> str:
  """The user's LIBTPU_INIT_ARGS with our flags added where the user did not set the same flag."""
  theirs = user.split()
  named = {_name(f) for f in theirs}
  return " ".join(theirs + [f for f in ours if _name(f) not in named])


def apply(setting: str, num_slices: int = 1, remat_policy: str = "full", accelerator: Optional[str] = None,
          environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, object]:
  """Sets LIBTPU_INIT_ARGS in `environ` (os.environ) for the TPU generation; says what it added.

  setting: MeshConfig.tpu_flags (configs.TPU_FLAGS), "auto" (this table's flags) or "none".
  accelerator: the target's type (bench compile names it); None reads it from the environment.
  """
  assert setting in TPU_FLAGS, setting  # MeshConfig checked it
  environ = os.environ if environ is None else environ
  accelerator = accelerator or accelerator_from(environ)
  gen = hardware.generation(accelerator.strip().lower()) if accelerator else None
  if setting == "none" or gen is None:
    return {"accelerator": accelerator, "generation": gen, "added": []}
  ours = recommended(gen, num_slices, remat_policy)
  user = environ.get(ENV, "")
  environ[ENV] = merged(user, ours)
  added = [f for f in ours if _name(f) not in {_name(u) for u in user.split()}]
  return {"accelerator": accelerator, "generation": gen, "added": added}
