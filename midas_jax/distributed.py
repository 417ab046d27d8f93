"""Multi-process start-up: which processes form the job, decided once, before jax touches a device.

Three ways a job can be described, in this order of precedence:
  1. explicit: --coordinator_address, --num_processes, --process_id (or MIDAS_COORDINATOR_ADDRESS,
     MIDAS_NUM_PROCESSES, MIDAS_PROCESS_ID), as the local launcher and hand-made clusters pass them;
  2. SLURM: srun's SLURM_* variables (launch/slurm.py writes the sbatch script);
  3. a Cloud TPU VM: jax reads the worker list from the VM's metadata itself.
Anything else is a single local process, which needs no coordination at all. `plan` only reads
flags and the environment (so it is testable anywhere); `initialize` acts on its answer.

Two waits are settings, because a pod's right values are not a laptop's: --initialization_timeout_s,
how long a process waits for all the others to join (the slowest worker's boot and install), and
--peer_timeout_s, how long a process waits for another at a decision they take together, and at
shutdown, before it gives up on it (hosts.py, peers.py): the bound on how long a slice takes to stop
after one host fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
from typing import Mapping, Optional, Tuple

import jax

from midas_jax import peers
from midas_jax.errors import ConfigError, require

ENV_VARS = {"coordinator_address": "MIDAS_COORDINATOR_ADDRESS", "num_processes": "MIDAS_NUM_PROCESSES",
            "process_id": "MIDAS_PROCESS_ID"}
TIMEOUT_VARS = {"initialization_timeout_s": "MIDAS_INITIALIZATION_TIMEOUT_S", "peer_timeout_s": "MIDAS_PEER_TIMEOUT_S"}
DEFAULT_TIMEOUTS = {"initialization_timeout_s": 600, "peer_timeout_s": 120}
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
# PCI device ids of TPU chips (vendor 0x1ae0, Google): v2/v3, v4, v5p, v5e, v6e. Google's virtual NIC
# shares the vendor id, so the vendor alone does not mean a TPU.
_TPU_PCI_DEVICES = ("0x0027", "0x005e", "0x0062", "0x0063", "0x006f")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How this process joins its job. mode: "single", "explicit", "slurm" or "tpu_vm"."""

  mode: str
  coordinator_address: Optional[str] = None
  num_processes: int = 1
  process_id: int = 0
  local_device_ids: Optional[Tuple[int, ...]] = None
  initialization_timeout_s: int = DEFAULT_TIMEOUTS["initialization_timeout_s"]
  peer_timeout_s: int = DEFAULT_TIMEOUTS["peer_timeout_s"]

  @property
  def multi_process(self) -> bool:
    return self.mode != "single"


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The coordinator flags every multi-process entry point takes."""
  group = parser.add_argument_group("multi-process (auto-detected on Cloud TPU VMs and under SLURM)")
  group.add_argument("--coordinator_address", default=None,
                     help=f"host:port of process 0's coordinator (env {ENV_VARS['coordinator_address']})")
  group.add_argument("--num_processes", type=int, default=None,
                     help=f"processes in the job (env {ENV_VARS['num_processes']})")
  group.add_argument("--process_id", type=int, default=None,
                     help=f"this process's index, 0-based (env {ENV_VARS['process_id']})")
  group.add_argument("--initialization_timeout_s", type=int, default=None,
                     help="seconds a process waits for every other to join: the slowest worker's boot "
                          f"(default {DEFAULT_TIMEOUTS['initialization_timeout_s']}; env "
                          f"{TIMEOUT_VARS['initialization_timeout_s']})")
  group.add_argument("--peer_timeout_s", type=int, default=None,
                     help="seconds a process waits for another at a shared decision or at shutdown before it "
                          "gives up on it; bounds how long the job takes to stop after one process fails "
                          f"(default {DEFAULT_TIMEOUTS['peer_timeout_s']}; env {TIMEOUT_VARS['peer_timeout_s']})")


def _int_setting(flag: str, value) -> Optional[int]:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ConfigError(flag, f"must be an integer, got {value!r}", f"pass {flag}=N") from None


def _explicit(args, environ: Mapping[str, str]) -> Optional[Plan]:
  values = {}
  for name, env in ENV_VARS.items():
    flag_value = getattr(args, name, None) if args is not None else None
    values[name] = flag_value if flag_value is not None else environ.get(env) or None
  if all(v is None for v in values.values()):
    return None
  missing = [f"--{k}" for k, v in values.items() if v is None]
  require(not missing, missing[0] if missing else "--coordinator_address",
          f"a multi-process job needs all three coordinator settings, {', '.join(missing)} missing",
          "pass --coordinator_address=HOST:PORT, --num_processes=N and --process_id=I together "
          "(or none of them for a single process)")
  address = str(values["coordinator_address"])
  host, sep, port = address.rpartition(":")
  require(bool(sep and host and port.isdigit()), "--coordinator_address",
          f"{address!r} is not HOST:PORT", "pass e.g. --coordinator_address=10.0.0.2:8476")
  num = _int_setting("--num_processes", values["num_processes"])
  pid = _int_setting("--process_id", values["process_id"])
  require(num >= 1, "--num_processes", f"must be >= 1, got {num}", "count every process of the job")
  require(0 <= pid < num, "--process_id", f"{pid} is outside [0, {num})",
          "number the processes 0 .. num_processes - 1; process 0 runs the coordinator")
  if num == 1:
    return Plan("single")
  return Plan("explicit", address, num, pid)


def _slurm(environ: Mapping[str, str]) -> Optional[Plan]:
  if not all(v in environ for v in _SLURM_VARS):
    return None
  num = int(environ["SLURM_NTASKS"])
  if num <= 1:  # an interactive allocation, or one task: nothing to coordinate
    return None
  local_ids = None
  tasks_here = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
  gpus_here = environ.get("SLURM_GPUS_ON_NODE")
  if tasks_here == "1" and gpus_here:
    # jax would give each task only the GPU numbered by its local rank; one task per node owns all.
    local_ids = tuple(range(int(gpus_here)))
  return Plan("slurm", None, num, int(environ["SLURM_PROCID"]), local_ids)


def tpu_chips_present(pci_root: str = "/sys/bus/pci/devices") -> bool:
  """True on a Cloud TPU VM: a PCI device with Google's vendor id and a TPU device id."""
  for vendor_file in glob.glob(os.path.join(pci_root, "*", "vendor")):
    try:
      with open(vendor_file) as f:
        vendor = f.read().strip()
      with open(os.path.join(os.path.dirname(vendor_file), "device")) as f:
        device = f.read().strip()
    except OSError:
      continue
    if vendor == "0x1ae0" and device in _TPU_PCI_DEVICES:
      return True
  return False


def _timeouts(args, environ: Mapping[str, str]) -> dict:
  out = {}
  for name, env in TIMEOUT_VARS.items():
    flag_value = getattr(args, name, None) if args is not None else None
    value = _int_setting(f"--{name}", flag_value if flag_value is not None else environ.get(env))
    value = DEFAULT_TIMEOUTS[name] if value is None else value
    require(value >= 1, f"--{name}", f"must be at least 1 second, got {value}", f"pass --{name}=SECONDS")
    out[name] = value
  return out


def plan(args: Optional[argparse.Namespace] = None, environ: Optional[Mapping[str, str]] = None,
         on_tpu_vm: Optional[bool] = None) -> Plan:
  """Decides how this process joins its job from flags and the environment alone."""
  environ = os.environ if environ is None else environ
  timeouts = _timeouts(args, environ)
  found = _explicit(args, environ) or _slurm(environ)
  if found is None:
    found = Plan("tpu_vm") if (tpu_chips_present() if on_tpu_vm is None else on_tpu_vm) else Plan("single")
  return dataclasses.replace(found, **timeouts)


def initialize(args: Optional[argparse.Namespace] = None) -> Plan:
  """Joins the job `plan` describes (jax.distributed.initialize); a single process does nothing.

  Call it before anything asks jax for its devices. Safe to call twice.
  """
  decided = plan(args)
  if not decided.multi_process:
    return decided
  if jax.distributed.is_initialized():
    return decided
  peers.settings.timeout_s = decided.peer_timeout_s
  kwargs = {"initialization_timeout": decided.initialization_timeout_s,
            "shutdown_timeout_seconds": decided.peer_timeout_s}
  if decided.mode == "slurm" and decided.local_device_ids is not None:
    kwargs["local_device_ids"] = list(decided.local_device_ids)
  if decided.mode == "explicit":
    kwargs.update(coordinator_address=decided.coordinator_address, num_processes=decided.num_processes,
                  process_id=decided.process_id)
  # tpu_vm: jax reads the workers from the TPU VM's metadata; slurm: from the SLURM_* variables.
  jax.distributed.initialize(**kwargs)
  peers.attempt_id()  # shared now, while every process is known to be up
  peers.start_watchdog()
  return decided
