"""The reads of the steps after the one being built, started ahead in threads.

On a remote store a batch's reads cost a round trip (tens of milliseconds) whatever their size, so
building steps one after another would wait one round trip per step. `ReadAhead.get` returns the
read of the step asked for and has the reads of the next `depth` steps of the same stream (a
split, read by one process of so many) running meanwhile. A read depends on its step alone, so a
step built from a read started early is the step built in line: the batch at step s stays a pure
function of s (docs/architecture.md#data-addressed-by-step). Reads ahead of a stream that jumped
elsewhere (a resume, an evaluation starting again at step 0) are dropped unused.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Dict, Hashable


class ReadAhead:
  """read_step(step) for a stream's steps, the next `depth` of them read in `depth` threads (0: in line)."""

  def __init__(self, depth: int):
    self.depth = depth
    self._pool = (concurrent.futures.ThreadPoolExecutor(depth, thread_name_prefix="midas-store-read")
                  if depth else None)
    self._pending: Dict[Hashable, Dict[int, concurrent.futures.Future]] = {}
    self._lock = threading.Lock()

  def get(self, stream: Hashable, step: int, read_step: Callable[[int], Any], last_step: int) -> Any:
    """read_step(step), with the reads of steps step + 1 .. step + depth (at most last_step) started."""
    if self._pool is None:
      return read_step(step)
    with self._lock:
      pending = self._pending.setdefault(stream, {})
      mine = pending.pop(step, None)
      for stale in [s for s in pending if not step < s <= step + self.depth]:
        pending.pop(stale).cancel()
      for later in range(step + 1, min(step + self.depth, last_step) + 1):
        if later not in pending:
          pending[later] = self._pool.submit(read_step, later)
    return mine.result() if mine is not None else read_step(step)

  def close(self, wait: bool = False) -> None:
    """Drops the reads not started; wait: until those running have ended."""
    if self._pool is not None:
      with self._lock:
        self._pending.clear()
      self._pool.shutdown(wait=wait, cancel_futures=True)
