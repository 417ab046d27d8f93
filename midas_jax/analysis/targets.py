"""What `midas bench compile` compiles for: this machine's devices, a TPU slice named as gcloud names it
(described by jax without the hardware when libtpu is installed), or GPUs (analytic only)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, List, Optional, Tuple

import jax
from jax.experimental import topologies

from midas_jax import hardware
from midas_jax.errors import ConfigError, require


@dataclasses.dataclass(frozen=True)
class Target:
  """What to compile for. platform: "local" (this machine's devices), "tpu" or "gpu"."""

  name: str
  platform: str
  num_devices: int  # all slices together
  hbm_bytes: Optional[int] = None
  topology: Optional[str] = None  # jax's topology name of one slice, e.g. "v5:4x4x4"
  chip_config: Optional[str] = None
  num_slices: int = 1


def _unknown(name: str) -> ConfigError:
  return ConfigError("--topology", f"unknown topology {name!r}",
                     "use a TPU slice such as v4-64, v5litepod-64, v5p-128, several slices such as "
                     "2xv5p-128, or gpu-N (e.g. gpu-8)")


def parse_target(name: Optional[str]) -> Target:
  """None: this machine's devices. `v4-64`, `v5litepod-64` (or `v5e-64`), `v5p-128`: a TPU slice
  named as gcloud names it (v4 and v5p count TensorCores, two per chip; v5e counts chips);
  `2xv5p-128`: two such slices joined by the data-center network (multi-slice).
  `gpu-8`: N GPUs of 80 GB (analytic only)."""
  if name is None:
    return Target("local", "local", len(jax.devices()))
  written = name.strip().lower()
  gpus = re.fullmatch(r"gpu-(\d+)", written)
  if gpus:
    count = int(gpus.group(1))
    require(count >= 1, "--topology", "needs at least one GPU", "e.g. --topology=gpu-8")
    return Target(name, "gpu", count, hardware.GPU_HBM_BYTES)
  parsed = hardware.parse_slice(written)
  if parsed is None or parsed.tpu.jax_topology is None:  # one jax cannot describe is no target
    raise _unknown(name)
  require(parsed.slices >= 1, "--topology", "needs at least one slice", "e.g. --topology=2xv5p-128")
  tpu, kind = parsed.tpu, parsed.accelerator.split("-")[0]
  require(parsed.count % tpu.cores_per_chip == 0, "--topology", f"{name}: {kind} slices come in multiples of "
          f"{tpu.cores_per_chip}", f"e.g. --topology={kind}-{8 * tpu.cores_per_chip}")
  try:
    shape = hardware.torus_shape(parsed.chips, tpu.torus_dims)
  except ValueError as e:
    raise ConfigError("--topology", str(e), "use a slice size gcloud offers, e.g. v4-64, v5litepod-64, v5p-128") from None
  prefix, chip_config = tpu.jax_topology
  return Target(name, "tpu", parsed.chips * parsed.slices, tpu.hbm_bytes, f"{prefix}:{'x'.join(map(str, shape))}",
                chip_config, parsed.slices)


def tpu_devices(target: Target) -> Tuple[Optional[List[Any]], str]:
  """The slice's devices as jax describes them without the hardware, or (None, why not)."""
  dims = [int(x) for x in target.topology.split(":")[1].split("x")]
  per_host = tuple(min(d, 2) for d in dims) + (1,) * (3 - len(dims))  # 4-chip hosts
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                        chip_config_name=target.chip_config, chips_per_host_bounds=per_host,
                                        num_slices=target.num_slices)
  except Exception as e:  # pylint: disable=broad-except
    return None, f"jax cannot describe a TPU slice on this machine ({str(e).splitlines()[0]})"
  return list(desc.devices), ""
