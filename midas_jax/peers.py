"""A host that fails tells the others why, and every host of the job stops within a bounded time.

jax's collectives have no timeout. A host that raises while the others wait in a collective (orbax's
restore or save barrier, a train step) leaves them waiting until the coordination service's heartbeat
gives up and aborts them (status 134), or, with long heartbeats, hangs the slice. So a failure is not
left to the collectives. The failing process writes its exit status and reason under
`midas/failed/<process>` in the key-value store of jax's distributed client (the coordinator's, reached
over its own RPCs, not the devices' transport) and leaves through `jax.distributed.shutdown`, which
waits for every process. Every process runs a watchdog thread that reads that folder each second; on
the first entry it prints the failing host's reason, joins the shutdown and exits with the failing
host's status, whatever its main thread is blocked in. No process writes anything on the way out, so a
save that was being written stays uncommitted, and a resume ignores it.

`settings.timeout_s` bounds every wait here and the agreements of hosts.py (distributed.py sets it from
--peer_timeout_s): the longest one host waits for another before it gives up on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import uuid
from typing import Optional, Tuple

import jax
from jax._src import distributed as _jax_distributed  # jax has no public handle on its client

FAILED = "midas/failed/"


@dataclasses.dataclass
class Settings:
  timeout_s: float = 120.0  # how long a host waits for another in an agreement or at shutdown
  poll_s: float = 1.0  # how often the watchdog looks for a failure


settings = Settings()
_announced = threading.Event()  # this process has failed: its main thread leaves, not the watchdog
_watchdog: Optional[threading.Thread] = None
_attempt: Optional[str] = None


def client():
  """jax's distributed client, or None in a single process (or before jax.distributed.initialize)."""
  return _jax_distributed.global_state.client


def active() -> bool:
  return jax.process_count() > 1 and client() is not None


def announce(status: int, reason: str) -> None:
  """Tells every other process that this one stops with `status`, and why (first line kept short)."""
  _announced.set()
  kv = client()
  if kv is None:
    return
  record = json.dumps({"status": int(status), "reason": reason[:2000], "host": os.uname().nodename})
  try:
    kv.key_value_set(f"{FAILED}{jax.process_index()}", record, allow_overwrite=True)
  except Exception as e:  # pylint: disable=broad-except  # the coordinator itself is gone: nobody to tell
    print(f"midas: could not tell the other processes why this one stops ({type(e).__name__}: {e})",
          file=sys.stderr, flush=True)


def attempt_id() -> str:
  """One id for this start of the job, the same on every process (process 0's, shared through the store):
  tells a failure recorded by another process of this attempt from one of the attempt before."""
  global _attempt
  if _attempt is None:
    kv = client() if jax.process_count() > 1 else None
    if kv is None:
      _attempt = uuid.uuid4().hex
    elif jax.process_index() == 0:
      _attempt = uuid.uuid4().hex
      kv.key_value_set("midas/attempt", _attempt)
    else:
      _attempt = kv.blocking_key_value_get("midas/attempt", int(settings.timeout_s * 1000))
  return _attempt


def failure_of_another() -> Optional[Tuple[int, int, str]]:
  """(process, status, reason) of the lowest-numbered other process that announced a failure, or None."""
  kv = client()
  if kv is None:
    return None
  mine = jax.process_index()
  found = []
  for key, value in kv.key_value_dir_get(FAILED):
    process = int(key.rsplit("/", 1)[-1])
    if process != mine:
      record = json.loads(value)
      found.append((process, int(record["status"]), str(record["reason"])))
  return min(found) if found else None


def leave() -> None:
  """jax.distributed.shutdown: returns once every process has reached it (or settings.timeout_s passed).

  The shutdown cancels what background threads still wait for (orbax's barriers): their errors from then
  on are consequences of the stop already reported, so they are not printed."""
  threading.excepthook = lambda args: None
  try:
    jax.distributed.shutdown()
  except Exception as e:  # pylint: disable=broad-except  # a peer already gone: nothing left to wait for
    print(f"midas: shutting down the distributed client: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def start_watchdog() -> None:
  """Starts the thread that stops this process when another one announces a failure (once per process)."""
  global _watchdog
  if _watchdog is not None or not active():
    return
  _watchdog = threading.Thread(target=_watch, name="midas-peer-watchdog", daemon=True)
  _watchdog.start()


def _watch() -> None:
  while True:
    time.sleep(settings.poll_s)
    if _announced.is_set():
      return  # this process failed itself: its main thread announces, leaves and exits
    try:
      failure = failure_of_another()
    except Exception:  # pylint: disable=broad-except  # the coordinator is gone: jax's own heartbeat takes over
      return
    if failure is not None and not _announced.is_set():
      process, status, reason = failure
      print(f"midas: stopped: process {process} failed, so this process (process {jax.process_index()}) stops "
            f"too, with the same exit status {status}. Its reason:\n  {reason}", file=sys.stderr, flush=True)
      leave()
      sys.stdout.flush()
      os._exit(status)  # pylint: disable=protected-access  # the main thread may be blocked in a collective
