"""`midas bench preemption`: what asking "stop after this step?" every step costs a train step.

The train loop asks train/preemption.py after every step, so that a SIGTERM to any process stops
all of them at the same step. This times, in the same run and interleaved, blocks of train steps
without the check, with it, and (for comparison) with a collective per step instead (an allgather
of the flag, what agreeing without jax's preemption service takes). It also times the check alone.
Run it on several processes to see the multi-host cost, e.g. 2 x 4 simulated CPU devices:

  python launch/local.py --num_processes=2 -- bench preemption --gin_file=gin/experiments/midas_cpu.gin
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import jax
import numpy as np
from jax.experimental import multihost_utils

from midas_jax.configs import RunConfig
from midas_jax.train.build import build_stage
from midas_jax.train.preemption import PreemptionGuard


def _allgather_flag(_step: int) -> bool:
  return bool(np.any(multihost_utils.process_allgather(np.array(False))))


def run(config: RunConfig, steps: int = 20, repeats: int = 5, calls: int = 2000) -> Dict[str, object]:
  """steps: train steps per timed block; repeats: blocks per variant (medians are reported)."""
  build = build_stage(config)
  batches = [build.device_batch(s) for s in range(2)]
  state = build.init_state()
  counter = [0]  # the step ids given to the check only ever grow, as in training
  with build.context(), PreemptionGuard() as guard:
    step_fn = build.jit_train_step()

    def block(check: Callable[[int], bool]) -> float:
      nonlocal state
      start = time.perf_counter()
      for i in range(steps):
        state, metrics = step_fn(state, batches[i % 2])
        counter[0] += 1
        if check(counter[0]):
          raise RuntimeError("a stop was requested during the benchmark")
      jax.block_until_ready((state, metrics))
      return (time.perf_counter() - start) / steps

    variants = {"none": lambda _: False, "check": guard.stop_after, "allgather": _allgather_flag}
    block(variants["none"])  # compile and warm up
    times = {name: [] for name in variants}
    for _ in range(repeats):
      for name, check in variants.items():
        times[name].append(block(check))
    start = time.perf_counter()
    for _ in range(calls):
      counter[0] += 1
      guard.stop_after(counter[0])
    call_seconds = (time.perf_counter() - start) / calls
    agreed = guard.agreed
  without, with_check, collective = (statistics.median(times[n]) for n in variants)
  return {"processes": jax.process_count(), "devices": jax.device_count(), "agreed_by_service": agreed,
          "step_seconds_without_check": without, "step_seconds_with_check": with_check,
          "step_seconds_with_allgather": collective, "check_overhead_fraction": with_check / without - 1.0,
          "allgather_overhead_fraction": collective / without - 1.0, "check_call_seconds": call_seconds,
          "steps_per_block": steps, "blocks": repeats}


def format_report(r: Dict[str, object]) -> str:
  how = ("jax's preemption service (reached_preemption_sync_point)" if r["agreed_by_service"]
         else "this process's signal flag")
  return "\n".join([
      f"{r['processes']} process(es), {r['devices']} devices; the per-step check reads {how}",
      f"train step without the check   {r['step_seconds_without_check'] * 1e3:.2f} ms (median of {r['blocks']} "
      f"blocks of {r['steps_per_block']})",
      f"train step with the check      {r['step_seconds_with_check'] * 1e3:.2f} ms "
      f"({100 * r['check_overhead_fraction']:+.1f}%)",
      f"with an allgather per step     {r['step_seconds_with_allgather'] * 1e3:.2f} ms "
      f"({100 * r['allgather_overhead_fraction']:+.1f}%)",
      f"the check alone                {r['check_call_seconds'] * 1e6:.1f} us per call",
  ])
