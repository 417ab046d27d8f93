"""SIGTERM/SIGINT turn into "save and stop at the next step" instead of killing the process.

Preemptible machines get a SIGTERM some seconds before they go away; a user's Ctrl-C is a SIGINT.
Either sets a flag the train loop reads after each step: it saves a checkpoint, waits for it and
exits cleanly. A second SIGINT interrupts at once (the user insists). With several processes the
flag is agreed on by all of them (any process's signal stops all), so they save the same step.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np


class PreemptionGuard:
  """Context manager: while active, `requested()` says whether a stop was asked for."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self._flag = False
    self._previous = {}

  def _handle(self, signum, frame):
    if self._flag and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self._flag = True
    print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint at the end of this step, then "
          "stopping (Ctrl-C again to stop at once)", flush=True)

  def __enter__(self) -> "PreemptionGuard":
    if threading.current_thread() is threading.main_thread():  # handlers can only be set there
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def requested(self, sync: bool = False) -> bool:
    """This process's flag; with sync=True (all processes at the same step) any process's flag."""
    if not sync or jax.process_count() == 1:
      return self._flag
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return bool(np.any(multihost_utils.process_allgather(np.array(self._flag))))
