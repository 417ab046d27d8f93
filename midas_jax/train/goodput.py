"""Where a run's wall time goes: each log line carries the seconds since the previous one, by activity.

The loop times what it waits for (compiling a stage's first step, the next batch, a checkpoint
save, a growth, an evaluation, writing its records) with `Goodput.timing`; what is left of the
wall time is productive training steps (steps are dispatched asynchronously, so their time shows
up wherever the loop next waits on the device, and the remainder is the honest count). `take()`
returns the breakdown since the previous take, `time/<activity>` seconds that add up to the wall
time, and starts the next interval. `midas report` sums them into the run's goodput table.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, Mapping, Sequence

ACTIVITIES: Sequence[str] = ("compile", "data", "checkpoint", "growth", "eval", "logging")
PRODUCTIVE = "step"
PREFIX = "time/"
KEYS: Sequence[str] = tuple(PREFIX + a for a in (PRODUCTIVE,) + tuple(ACTIVITIES))


class Goodput:
  """Seconds per activity since the last `take()`; the rest of the wall time is productive steps."""

  def __init__(self, clock=time.perf_counter):
    self._clock = clock
    self._start = clock()
    self._spent: Dict[str, float] = dict.fromkeys(ACTIVITIES, 0.0)
    self._open = 0  # nested timings (a save inside a growth) count once, for the outer activity

  @contextlib.contextmanager
  def timing(self, activity: str) -> Iterator[None]:
    if activity not in self._spent:
      raise ValueError(f"unknown activity {activity!r}: one of {ACTIVITIES}")
    start = self._clock()
    self._open += 1
    try:
      yield
    finally:
      self._open -= 1
      if not self._open:
        self._spent[activity] += self._clock() - start

  def add(self, activity: str, seconds: float) -> None:
    self._spent[activity] += seconds

  def take(self) -> Dict[str, float]:
    """{time/step, time/compile, ...} in seconds since the previous take (they sum to the wall time)."""
    now = self._clock()
    wall = now - self._start
    waited = sum(self._spent.values())
    out = {PREFIX + PRODUCTIVE: max(wall - waited, 0.0)}
    out.update({PREFIX + a: s for a, s in self._spent.items()})
    self._start, self._spent = now, dict.fromkeys(ACTIVITIES, 0.0)
    return out


def summarize(records: Sequence[Mapping[str, float]]) -> Dict[str, float]:
  """Seconds per activity over a run's records (those carrying time/* keys)."""
  totals = dict.fromkeys(KEYS, 0.0)
  for record in records:
    for key in KEYS:
      totals[key] += float(record.get(key, 0.0) or 0.0)
  return {key[len(PREFIX):]: value for key, value in totals.items()}
