"""Facts about the accelerators, in one table: the TPU generations and how gcloud names their slices
(`v5p-128`, two joined by the data-center network: `2xv5p-128`), each chip's memory, data-center
network bandwidth and dense bf16 peak, a slice's shape and hosts, and the Cloud names that go with them.

Standard library only, importing nothing else of the package: the launchers (launch/*.py) read it
from the checkout, where no package is installed.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import re
from typing import Any, Dict, Optional, Tuple, Union

GIB = 1024 ** 3
HOST_CHIPS = 4  # the chips on each host of a slice that spans several


@dataclasses.dataclass(frozen=True)
class Tpu:
  """One TPU generation."""

  name: str  # the short name: v4, v5p, v5e, v6e
  cores_per_chip: int  # what the number in its accelerator type counts: TensorCores (two a chip) or chips
  torus_dims: int  # its chips' links: a 3-D torus or a 2-D one
  one_host_chips: int  # the largest slice that is a single host
  gke_label: str  # GKE's node label (cloud.google.com/gke-tpu-accelerator)
  runtime: str  # the TPU VM software version it boots (gcloud's --version)
  hbm_bytes: Optional[int] = None  # memory per chip; None: not in this table
  dcn_bytes_per_s: Optional[float] = None  # data-center network bandwidth per chip; None: not in this table
  jax_topology: Optional[Tuple[str, str]] = None  # (jax's topology prefix, chip config): a slice described without it


# DCN: Cloud TPU's system architecture pages: v5p "DCN bandwidth per chip 50 Gbps"; v5e two 100 Gbps NICs
# per 8-chip host.
TPUS: Dict[str, Tpu] = {t.name: t for t in (
    Tpu("v4", 2, 3, 4, "tpu-v4-podslice", "tpu-ubuntu2204-base", 32 * GIB, None, ("v4", "megacore")),
    Tpu("v5p", 2, 3, 4, "tpu-v5p-slice", "v2-alpha-tpuv5", 95 * GIB, 50e9 / 8, ("v5", "megacore")),
    Tpu("v5e", 1, 2, 8, "tpu-v5-lite-podslice", "v2-alpha-tpuv5-lite", 16 * GIB, 2 * 100e9 / 8 / 8,
        ("v5e", "default")),
    Tpu("v6e", 1, 2, 8, "tpu-v6e-slice", "v2-alpha-tpuv6e"),
)}
# Accelerator type names as gcloud spells them (the part before the size), to the generation.
ACCELERATOR_NAMES = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}

GPU_HBM_BYTES = 80 * 10 ** 9  # the 80 GB cards (A100 80GB, H100) that `bench compile --topology=gpu-N` assumes

# Dense bf16 FLOP/s of one chip, the usual MFU denominator, by device_kind. First match wins, on the
# lower-cased device_kind with spaces, dashes and underscores removed, so the more specific names come
# first ("v5lite" before "v5", "h100pcie" before "h100"); the middle column is the chip it names.
_DEVICE_KINDS = (
    ("v4lite", "v4i", None),  # an inference part, not in the table
    ("v4", "v4", 275e12),
    ("v5lite", "v5e", 197e12),  # how JAX names v5e
    ("v5e", "v5e", 197e12),
    ("v5p", "v5p", 459e12),
    ("v5", "v5p", 459e12),  # v5p reports plain "TPU v5"
    ("v6lite", "v6e", 918e12),  # how JAX names v6e (Trillium)
    ("v6e", "v6e", 918e12),
    ("a100", "a100", 312e12),
    ("h100pcie", "h100pcie", 756e12),  # the PCIe card runs at lower clocks and power than SXM
    ("h100", "h100", 989e12),
    ("h200", "h200", 989e12),
)


def _device_kind(kind: str) -> Optional[Tuple[str, str, Optional[float]]]:
  key = kind.lower().replace(" ", "").replace("-", "").replace("_", "")
  return next((row for row in _DEVICE_KINDS if row[0] in key), None)


def chip_of(device_kind: str) -> Optional[str]:
  """The chip a jax device_kind names ('TPU v5 lite' -> 'v5e', 'NVIDIA H100 80GB HBM3' -> 'h100'), or None."""
  row = _device_kind(device_kind)
  return row[1] if row else None


def known_peak_flops(device: Union[Any, str]) -> Optional[float]:
  """Dense bf16 FLOP/s of one accelerator chip, from a jax Device or a device_kind string.

  None for CPUs and for kinds not in the table (measure those instead: device_peak.py).
  """
  if isinstance(device, str):
    kind = device
  else:
    if getattr(device, "platform", None) == "cpu":
      return None
    kind = getattr(device, "device_kind", "")
  row = _device_kind(kind)
  return row[2] if row else None


def dcn_bytes_per_s(device_kind: str) -> Optional[float]:
  """The data-center network bandwidth per chip of a TPU device_kind, or None where not known."""
  tpu = TPUS.get(chip_of(device_kind) or "")
  return tpu.dcn_bytes_per_s if tpu else None


def generation(accelerator: str) -> Optional[str]:
  """'v5p-128' -> 'v5p', 'v5litepod-64' -> 'v5e' (the part before the first dash, as gcloud spells it);
  None for a name that is no TPU this table knows."""
  return ACCELERATOR_NAMES.get(accelerator.split("-", 1)[0])


@dataclasses.dataclass(frozen=True)
class SliceName:
  """A TPU slice as gcloud names it, e.g. `v5p-128`, or `2xv5p-128`: two of them joined by DCN."""

  name: str  # as given
  accelerator: str  # one slice's type, e.g. v5p-128
  tpu: Tpu
  count: int  # the number in the type: TensorCores (v4, v5p) or chips
  slices: int = 1

  @property
  def chips(self) -> int:
    """One slice's chips."""
    return self.count // self.tpu.cores_per_chip


def parse_slice(name: str) -> Optional[SliceName]:
  """`[Nx]TYPE-SIZE` with TYPE one of ACCELERATOR_NAMES, as written (callers lower-case where they
  accept any case); None for anything else."""
  m = re.fullmatch(r"(?:(\d+)x)?(([a-z0-9]+)-(\d+))", name)
  if not m or m.group(3) not in ACCELERATOR_NAMES:
    return None
  return SliceName(name, m.group(2), TPUS[ACCELERATOR_NAMES[m.group(3)]], int(m.group(4)), int(m.group(1) or 1))


def torus_shape(chips: int, dims: int) -> Tuple[int, ...]:
  """The shape gcloud gives a slice of `chips` chips (a power of 2): as cubic (3-D) or square (2-D) as
  powers of 2 allow, e.g. 2x2x1, 2x2x2, 2x2x4; 2x2, 2x4, 4x4. ValueError for any other count."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips} chips is not a power of 2")
  shape = [1] * dims
  for i in range(int(math.log2(chips))):  # factors of 2 handed out round-robin
    shape[i % dims] *= 2
  return tuple(sorted(shape, key=lambda n: (n == 1, n)))  # gcloud writes 2x2x1, not 1x2x2


# Chip counts of the slices that have a default topology (GKE's node pools), per torus.
DEFAULT_TOPOLOGY_CHIPS = {3: (4, 8, 16, 32, 64, 128, 256, 512), 2: (1, 4, 8, 16, 32, 64, 128, 256)}


def default_topology(tpu: Tpu, chips: int) -> Optional[str]:
  """A slice's default topology ('4x4x8', '8x8'), or None where it has none."""
  if chips not in DEFAULT_TOPOLOGY_CHIPS[tpu.torus_dims]:
    return None
  return "x".join(map(str, torus_shape(chips, tpu.torus_dims)))


def slice_hosts(tpu: Tpu, chips: int) -> Tuple[int, int]:
  """(hosts, chips per host) of one slice: a single host up to `one_host_chips`, else HOST_CHIPS a host."""
  per_host = chips if chips <= tpu.one_host_chips else HOST_CHIPS
  return chips // per_host, per_host


def cpu_model() -> str:
  """The CPU's model name, with "AMX" where it has matrix tiles (they change bfloat16 results): the
  device kind a CPU run's figures belong to."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      info = f.read()
  except OSError:
    return platform.processor() or platform.machine() or "cpu"
  names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
  flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
  name = names[0] if names else (platform.processor() or "cpu")
  return name + (" (AMX)" if " amx_tile" in flags else "")
