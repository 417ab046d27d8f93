"""Timing an input pipeline on one core, and what training consumes: shared by `midas bench data`'s
in-memory (data_bench.py) and prepared-store (store_bench.py) measurements."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Callable, Dict, Iterator, Optional, Tuple

import jax
import numpy as np

from midas_jax.train.build import StageBuild

TARGET_VS_TRAINING = 5.0


@contextlib.contextmanager
def one_core() -> Iterator[Optional[int]]:
  """Pins every thread of this process to one CPU (the lowest allowed) for the block.

  Pinning all tasks, not just this thread, matters for TF: its pools may already exist, and a pool
  thread that stayed free would let tf.data use a second core. Yields None where affinity is not
  supported (then the figures are for however many cores the OS gives).
  """
  if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
    yield None
    return
  main_mask = os.sched_getaffinity(0)
  cpu = min(main_mask)
  before = {}
  for tid in _threads():
    try:
      before[tid] = os.sched_getaffinity(tid)
      os.sched_setaffinity(tid, {cpu})
    except OSError:  # the thread ended meanwhile
      pass
  try:
    yield cpu
  finally:
    for tid in _threads():  # includes threads started inside the block, which inherited the pin
      try:
        os.sched_setaffinity(tid, before.get(tid, main_mask))
      except OSError:
        pass


def _threads():
  return [int(t) for t in os.listdir("/proc/self/task")]


def timed(produce: Callable[[], Tuple[int, int, int]], seconds: float, warmup_seconds: float) -> Dict[str, float]:
  """Calls produce() (-> items, slots, real tokens) for warmup_seconds, then counts for ~seconds."""
  t_end = time.perf_counter() + warmup_seconds
  produce()  # at least once, so the first call's one-off costs are never timed
  calls, items, slots, real = 1, 0, 0, 0
  while time.perf_counter() < t_end:
    produce()
    calls += 1
  t0, cpu0 = time.perf_counter(), time.process_time()
  while True:
    n, s, r = produce()
    calls, items, slots, real = calls + 1, items + n, slots + s, real + r
    elapsed = time.perf_counter() - t0
    if elapsed >= seconds:
      break
  # CPU seconds of all threads per wall second: <= 1 confirms one core (other threads included).
  cpu_seconds = time.process_time() - cpu0
  return {"seconds": elapsed, "calls": calls, "items": items, "slots": slots, "real_tokens": real,
          "cores_used": cpu_seconds / elapsed, "cpu_seconds": cpu_seconds}


def measure_ours(pipeline, seconds: float, warmup_seconds: float, process_count: int = 1) -> Dict[str, float]:
  """Process 0's rows of consecutive steps, as one of process_count hosts builds them."""
  step = iter(range(1 << 62))
  shape = (pipeline.config.batch_size // process_count, pipeline.config.seq_len)

  def produce():
    batch = pipeline.batch(next(step), "train", 0, process_count)
    return shape[0], shape[0] * shape[1], int(np.count_nonzero(batch["segment_ids"]))

  m = timed(produce, seconds, warmup_seconds)
  return {"tokens_per_second": m["slots"] / m["seconds"],
          "real_tokens_per_second": m["real_tokens"] / m["seconds"],
          "rows_per_second": m["items"] / m["seconds"],
          "packing_efficiency": m["real_tokens"] / m["slots"],
          "seconds": m["seconds"], "cores_used": m["cores_used"], "batches": m["calls"],
          "real_tokens_per_cpu_second": m["real_tokens"] / m["cpu_seconds"]}



def measure_training(build: StageBuild, steps: int = 5, warmup: int = 2) -> Dict[str, float]:
  """Slots per second that `steps` train steps of the config consume (median step, all cores)."""
  data = build.config.data
  batches = [build.device_batch(s) for s in range(warmup + steps)]
  state = build.init_state()
  times = []
  with build.context():
    step_fn = build.jit_train_step()
    for i, b in enumerate(batches):
      t0 = time.perf_counter()
      state, metrics = step_fn(state, b)
      jax.block_until_ready(metrics["loss"])
      if i >= warmup:
        times.append(time.perf_counter() - t0)
  step_seconds = statistics.median(times)
  return {"tokens_per_second": data.batch_size * data.seq_len / step_seconds,
          "step_seconds": step_seconds, "steps": steps, "source": "measured"}
