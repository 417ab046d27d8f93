"""Builds the next batches in a background thread, so the device never waits for data.

Batches are addressed by step (pipeline.py), so the thread simply computes steps start, start + 1,
... ahead of the consumer; there is no iterator state to save or restore.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Prefetcher:
  """Yields make_batch(step) for consecutive steps, computed up to `depth` steps ahead."""

  def __init__(self, make_batch: Callable[[int], Any], start: int, stop: int, depth: int = 2):
    self._next = start
    self._make_batch = make_batch
    self._thread = None
    if depth == 0:  # synchronous: each batch is built when asked for
      return
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(make_batch, start, stop), daemon=True,
                                    name="midas-prefetch")
    self._thread.start()

  def _run(self, make_batch, start, stop):
    for step in range(start, stop):
      try:
        item = (step, make_batch(step), None)
      except BaseException as e:  # pylint: disable=broad-except
        item = (step, None, e)
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if self._stop.is_set() or item[2] is not None:
        return

  def get(self, step: int) -> Any:
    if step != self._next:
      raise ValueError(f"prefetcher expected step {self._next}, got {step}: steps must be consecutive")
    if self._thread is None:
      self._next += 1
      return self._make_batch(step)
    got, batch, error = self._queue.get()
    assert got == step
    if error is not None:
      raise error
    self._next += 1
    return batch

  def close(self) -> None:
    if self._thread is not None:
      self._stop.set()
      self._thread.join(timeout=5)
