"""The background batch builder: order, errors, and the synchronous mode."""

import threading
import time

import pytest

from midas_jax.data.prefetch import Prefetcher


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_yields_consecutive_steps_in_order(depth):
  p = Prefetcher(lambda s: {"step": s}, start=5, stop=12, depth=depth)
  assert [p.get(s)["step"] for s in range(5, 12)] == list(range(5, 12))
  p.close()


def test_builds_ahead_in_another_thread():
  built = []
  p = Prefetcher(lambda s: built.append((s, threading.current_thread().name)) or s, 0, 10, depth=3)
  deadline = time.time() + 5
  while len(built) < 4 and time.time() < deadline:  # three queued plus one waiting to be queued
    time.sleep(0.01)
  assert [s for s, _ in built[:4]] == [0, 1, 2, 3]
  assert all(name == "midas-prefetch" for _, name in built)
  p.close()


def test_errors_surface_at_the_step_that_failed():
  def make(s):
    if s == 2:
      raise ValueError("bad document")
    return s
  p = Prefetcher(make, 0, 5, depth=2)
  assert p.get(0) == 0 and p.get(1) == 1
  with pytest.raises(ValueError, match="bad document"):
    p.get(2)
  p.close()


def test_steps_must_be_consecutive_and_close_unblocks_the_thread():
  p = Prefetcher(lambda s: s, 0, 1000, depth=1)
  with pytest.raises(ValueError, match="consecutive"):
    p.get(3)
  p.close()
  assert not p._thread.is_alive()  # pylint: disable=protected-access
