"""Decisions every process of a multi-process job must take together (one process: trivial).

A restore reads the same step on every process, or the collective reads would mix states or hang;
a bad save is moved aside by one process while the others wait, or they would race to move it.
Each helper is one small collective over jax.distributed, used at start-up only, never per step.
"""

from __future__ import annotations

import hashlib
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils


def multi_process() -> bool:
  return jax.process_count() > 1


def from_process_0(value: int) -> int:
  """Process 0's `value` on every process."""
  if not multi_process():
    return int(value)
  return int(multihost_utils.broadcast_one_to_all(np.array(value, np.int32)))


def all_true(flag: bool) -> bool:
  """Whether `flag` holds on every process."""
  if not multi_process():
    return bool(flag)
  return bool(np.all(multihost_utils.process_allgather(np.array(bool(flag)))))


def barrier(name: str) -> None:
  """Waits until every process has reached the barrier called `name`."""
  if multi_process():
    multihost_utils.sync_global_devices(name)


def machine_count() -> int:
  """How many machines the processes run on, told apart by host name (processes on one machine share
  its filesystem; processes on several see only what they mount in common)."""
  if not multi_process():
    return 1
  name = np.frombuffer(hashlib.sha256(socket.gethostname().encode()).digest()[:4], np.int32)[0]
  return len(set(np.asarray(multihost_utils.process_allgather(np.array(name))).ravel().tolist()))
