"""Decisions every process of a multi-process job must take together (one process: trivial).

A restore reads the same step on every process, or the collective reads would mix states or hang;
a bad save is moved aside by one process while the others wait, or they would race to move it.

Each decision is an exchange through the key-value store of jax's distributed client, never a device
collective: every process posts its value under a key of its own and reads every other's, waiting at
most peers.settings.timeout_s for each. A process that does not answer in time (it failed, or it is
stuck in a collective a failed peer never joined) makes the exchange raise PeerTimeoutError on every
process that waited, rather than hang; peers.py then stops the whole job with one status. The
exchanges of one name are numbered in the order a process makes them, and every process makes them in
the same order, so a key names one decision; names keep apart the decisions taken on different
threads (the next stage's build runs on a background thread while the loop trains). Used at start-up and around saves, never per step.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from typing import Any, Dict, List

import jax

from midas_jax import peers
from midas_jax.errors import FaultError

_made: Dict[str, int] = {}  # exchanges made so far, by name
_lock = threading.Lock()  # the next stage is built on a background thread, which takes decisions too


class PeerTimeoutError(FaultError):
  """Another process did not reach a decision every process takes together within the timeout."""


def multi_process() -> bool:
  return jax.process_count() > 1


def exchange(name: str, value: Any) -> List[Any]:
  """Every process's `value` (JSON-able), in process order, the same list on every process."""
  if not multi_process():
    return [value]
  kv = peers.client()
  with _lock:
    count = _made[name] = _made.get(name, 0) + 1
  key = f"midas/decide/{name}/{count}"
  kv.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
  deadline = time.monotonic() + peers.settings.timeout_s
  values = []
  for process in range(jax.process_count()):
    left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
    try:
      values.append(json.loads(kv.blocking_key_value_get(f"{key}/{process}", left_ms)))
    except Exception as e:  # pylint: disable=broad-except  # jax raises its own runtime error on a timeout
      raise PeerTimeoutError(
          f"process {process} did not reach '{name}' within {peers.settings.timeout_s:g} s (it failed, or is "
          f"waiting on a process that did; {type(e).__name__}: {' '.join(str(e).split())[:200]})\n  fix: see the "
          f"log of process {process}; if its host is only slow, raise --peer_timeout_s") from e
  return values


def from_process_0(value: int) -> int:
  """Process 0's `value` on every process."""
  return int(exchange("from_process_0", int(value))[0])


def all_true(flag: bool) -> bool:
  """Whether `flag` holds on every process."""
  return all(exchange("all_true", bool(flag)))


def barrier(name: str) -> None:
  """Waits until every process has reached the barrier called `name`."""
  exchange(f"barrier/{name}", None)


def machine_count() -> int:
  """How many machines the processes run on, told apart by host name (processes on one machine share
  its filesystem; processes on several see only what they mount in common)."""
  name = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:16]
  return len(set(exchange("machine", name)))
