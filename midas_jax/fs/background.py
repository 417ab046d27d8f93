"""Storage work done on a thread of its own, every few seconds, so that the caller never waits on storage.

For the writers of a run that must not hold up its training loop (metrics.jsonl, the TensorBoard
mirror): the caller hands its data over in memory and returns; this thread uploads it at a bounded
rate (GCS takes about one update per second to one object), retries a failure after a pause that
grows to `max_pause`, and says once, on stdout, when storage has refused it for `warn_after` seconds
(and once when it writes again). flush() asks for an attempt now and waits a bounded time for it
(a run does so at a checkpoint save: see train/run.py). close() keeps trying for a bounded time
only, so neither an exit nor a preemption's short notice waits out an outage.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from midas_jax.console import say
from midas_jax.fs import storage_errors


def one_line(error: BaseException, limit: int = 200) -> str:
  """An error in one short line, for a log line."""
  text = " ".join(f"{type(error).__name__}: {error}".split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


class Periodic:
  """Calls `work()` on a daemon thread every `interval` s until close(); `work` raises to say it failed.

  what: how the lines this prints name the work (e.g. the file it writes).
  """

  def __init__(self, work: Callable[[], None], interval: float, what: str, max_pause: float = 30.0,
               warn_after: float = 60.0):
    self._work = work
    self.interval = interval
    self.what = what
    self.max_pause = max(max_pause, interval)
    self.warn_after = warn_after
    self.error: Optional[BaseException] = None  # the last attempt's failure; None once one succeeds
    self._failing_since: Optional[float] = None
    self._warned = False
    self._closing = False
    self._deadline = 0.0
    self._wake = threading.Event()
    self._done = threading.Condition()
    self._begun = 0  # attempts begun so far
    self._succeeded = 0  # the number of the last attempt that succeeded
    self._thread = threading.Thread(target=self._loop, name=f"midas-writer {what}", daemon=True)
    self._thread.start()

  def _attempt(self) -> bool:
    with self._done:
      self._begun += 1
      number = self._begun
    try:
      self._work()
    except Exception as e:  # pylint: disable=broad-except  # retried, never raised into the run; said below
      now = time.monotonic()
      self.error = e
      self._failing_since = self._failing_since or now
      if not self._warned and storage_errors.classify(e) is None and not isinstance(e, OSError):
        self._warned = True  # not the storage refusing: a fault of this process, said at once
        say(f"{self.what}: writing failed with an error that is not a storage error ({one_line(e)}); "
            "retried in the background while training goes on")
      elif not self._warned and now - self._failing_since >= self.warn_after:
        self._warned = True
        say(f"{self.what}: storage has refused writes for {now - self._failing_since:.0f} s ({one_line(e)}); "
            "they are kept in memory and retried in the background while training goes on")
      return False
    if self._warned:
      say(f"{self.what}: writing again after {time.monotonic() - self._failing_since:.0f} s")
    self.error, self._failing_since, self._warned = None, None, False
    with self._done:
      self._succeeded = number
      self._done.notify_all()
    return True

  def _loop(self) -> None:
    pause = self.interval
    while not self._closing:
      self._wake.wait(pause)
      self._wake.clear()  # before the attempt: a flush() asked for during it wakes the next one at once
      if self._closing:
        break
      pause = self.interval if self._attempt() else min(2 * pause, self.max_pause)
    pause = 0.25  # closing: what is left, tried until it is written or the deadline passes
    while not self._attempt() and time.monotonic() + pause < self._deadline:
      time.sleep(pause)
      pause = min(2 * pause, 4.0)

  def flush(self, timeout: float) -> bool:
    """Asks for an attempt now; waits up to `timeout` s for one begun after this call to succeed, and
    says whether one did (on False the work stays queued and is retried as usual)."""
    deadline = time.monotonic() + timeout
    with self._done:
      wanted = self._begun + 1
      self._wake.set()
      while self._succeeded < wanted and not self._closing:
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._done.wait(left)
      return self._succeeded >= wanted

  def close(self, timeout: float, lost: Optional[Callable[[], str]] = None) -> bool:
    """A last attempt (retried for up to `timeout` s) after what is in flight; whether it succeeded.

    lost: when it did not, what was not written (asked then), said in one line with why."""
    if self._thread.is_alive() and not self._closing:
      self._deadline = time.monotonic() + timeout
      self._closing = True
      self._wake.set()
    self._thread.join(max(self._deadline - time.monotonic(), 0.0))
    done = not self._thread.is_alive() and self.error is None
    if not done and lost is not None:
      say(lost() + (f" ({one_line(self.error)})" if self.error else " (storage did not answer in time)"))
    return done
