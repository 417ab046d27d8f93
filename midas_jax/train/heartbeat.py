"""The loop's heartbeat writer: process 0 rewrites WORKDIR/heartbeat.json at every log step.

The record and the rule that calls it stale are midas_jax/heartbeat.py's; `launch/tpu_pod.py watch`
reads the object. A beat only hands the record over in memory: a thread of its own (fs.background)
uploads the newest one, at most every WRITE_SECONDS, so the loop never waits on storage, and a write
that fails is retried there and said once; training goes on whatever storage does. The path layer
writes the object whole (a rename locally, one upload on gs://), so a reader never sees part of it.
On the way out the run records how it ended ("finished", "preempted", "failed: <reason>"), and
close() tries for CLOSE_SECONDS to store it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional

import jax

from midas_jax import fs, heartbeat, peers
from midas_jax.fs.background import Periodic

WRITE_SECONDS = 5.0  # GCS takes about one update per second to one object; a watcher polls in minutes
CLOSE_SECONDS = 10.0  # the last record (how the run ended) is tried this long: a preemption's notice is short


class HeartbeatWriter:
  """beat() at every log step, end() once when the run ends, close() last. Process 0 writes; on the
  others every call does nothing."""

  def __init__(self, workdir: str, log_every: int, close_seconds: float = CLOSE_SECONDS,
               clock: Callable[[], float] = time.time):
    self.path = fs.join(workdir, heartbeat.FILE)
    self.log_every = log_every
    self.close_seconds = close_seconds
    self._clock = clock
    self._step_seconds: Optional[float] = None  # the last measured speed: a window that compiled has none
    self._latest: Optional[dict] = None
    self._written: Optional[dict] = None
    self._lock = threading.Lock()
    self._primary = jax.process_index() == 0
    if self._primary:
      self._attempt, self._host, self._processes = peers.attempt_id(), os.uname().nodename, jax.process_count()
      self._writer = Periodic(self._write, WRITE_SECONDS, what=self.path)

  def beat(self, step: int, stage: int, loss: Optional[float], step_seconds: Optional[float] = None) -> None:
    """The run is at `step` (a log step): queued for the writer thread, never waits."""
    if step_seconds:
      self._step_seconds = float(step_seconds)
    self._set(step, stage, loss, heartbeat.RUNNING)

  def end(self, step: int, status: str) -> None:
    """How the run ended (heartbeat.FINISHED, PREEMPTED, or heartbeat.failed(error)); stored by close()."""
    last = self._latest or {}
    self._set(step, last.get("stage", 0), last.get("loss"), status)

  def _set(self, step: int, stage: int, loss: Optional[float], status: str) -> None:
    if not self._primary:
      return
    rec = heartbeat.record(step, stage, loss, self._step_seconds, self.log_every, self._attempt, self._host,
                           self._processes, self._clock(), status)
    with self._lock:
      self._latest = rec

  def _write(self) -> None:
    with self._lock:
      rec = self._latest
    if rec is not None and rec is not self._written:
      fs.write_json(self.path, rec)
      self._written = rec

  def close(self) -> None:
    if self._primary:
      self._writer.close(self.close_seconds, lost=lambda: f"{self.path}: the last heartbeat was not stored")
