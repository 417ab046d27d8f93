"""SIGTERM/SIGINT turn into "save and stop after this step" instead of killing the process.

Preemptible machines get a SIGTERM some seconds before they go away; a user's Ctrl-C is a SIGINT.
The train loop asks `stop_after(step)` after every step; when it says yes the loop saves a
checkpoint, waits for it and exits cleanly. A second SIGINT interrupts at once (the user insists).

One process: a Python signal handler sets a flag that the next `stop_after` returns.

Several processes (jax.distributed): every process must stop at the same step, or the collective
save would hang. jax's preemption service (on by default in jax.distributed) catches SIGTERM in
any process, tells every process through the coordinator, and agrees on a step (the largest step
any process had reached, plus one); `reached_preemption_sync_point(step)` turns true at that step on
all of them. Asking costs a local flag read per step, no collective, so it is asked every step.
Python must not install its own SIGTERM handler then (it would replace jax's), and a SIGINT is
passed on as a SIGTERM to this process, so Ctrl-C on one process takes the same path.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils


def _service_active() -> bool:
  """Whether jax.distributed runs with its preemption service (multi-process jobs).

  jax.distributed.initialize starts the service's sync manager when `jax_enable_preemption_service` is on (the
  default); without jax.distributed there is none, and reached_preemption_sync_point would always say no.
  """
  return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


class PreemptionGuard:
  """Context manager: while active, `stop_after(step)` says whether to save and stop after `step`."""

  def __init__(self):
    self._flag = False
    self._previous = {}
    self._agreed = False  # set in __enter__: whether jax's preemption service decides

  def _handle(self, signum, frame):
    del frame
    if self._flag and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self._flag = True
    if self._agreed:  # hand the notice to jax's service, which tells the other processes
      signal.raise_signal(signal.SIGTERM)
    print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this step, then "
          "stopping (Ctrl-C again to stop at once)", flush=True)

  def __enter__(self) -> "PreemptionGuard":
    self._agreed = jax.process_count() > 1 and _service_active()
    handled = (signal.SIGINT,) if self._agreed else (signal.SIGTERM, signal.SIGINT)
    if threading.current_thread() is threading.main_thread():  # handlers can only be set there
      for sig in handled:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  @property
  def agreed(self) -> bool:
    """True when the stop step is agreed across processes by jax's preemption service."""
    return self._agreed

  def stop_after(self, step: int) -> bool:
    """Whether to save and stop after `step` (on every process at the same step)."""
    if self._agreed:
      return bool(multihost_utils.reached_preemption_sync_point(step))
    if jax.process_count() > 1:  # the service was turned off: an allgather, which waits for the step
      return bool(np.any(multihost_utils.process_allgather(np.array(self._flag))))
    return self._flag
