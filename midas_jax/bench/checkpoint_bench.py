"""`midas bench checkpoint`: what a save costs the train loop, its size, and how long it takes to land.

Trains the config's model at full depth and times, in the same run:
  - the median train step (no save in flight);
  - an async save: how long `save` blocks the loop (the device-to-host copy), and the stall, the
    extra wall time of the `window` steps that follow a save compared with the same steps without
    one (the background write competing with training), in units of one step;
  - a synchronous save (the whole write) and the checkpoint's bytes on disk.
Target (issue #5): an async save stalls training by less than one step.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict

import jax

from midas_jax import fs
from midas_jax.checkpoint.manager import OrbaxCheckpointer
from midas_jax.configs import CheckpointConfig, RunConfig
from midas_jax.train.build import build_stage


def _timed_steps(step_fn, state, batches):
  start = time.perf_counter()
  for b in batches:
    state, metrics = step_fn(state, b)
  jax.block_until_ready((state, metrics))
  return state, time.perf_counter() - start


def run(config: RunConfig, workdir: str, window: int = 3, repeats: int = 3) -> Dict[str, object]:
  """window: steps timed after each save; repeats: saves measured (medians are reported)."""
  build = build_stage(config)
  batches = [build.device_batch(s) for s in range(window)]
  state = build.init_state()
  workdir = fs.absolute(workdir, "--workdir")
  fs.rmtree(workdir)
  blocking, stalls, plain = [], [], []
  with build.context():
    step_fn = build.jit_train_step()
    state, _ = _timed_steps(step_fn, state, batches[:2])  # compile and warm up
    ckpt = OrbaxCheckpointer(fs.join(workdir, "async"), CheckpointConfig(every=0, keep=2, async_save=True))
    ckpt.save(state, 0, force=True)  # untimed: the first save sets up orbax and compiles the finiteness check
    ckpt.wait()
    for i in range(repeats):
      state, base = _timed_steps(step_fn, state, batches)
      plain.append(base / window)
      start = time.perf_counter()
      ckpt.save(state, 2 * i + 1, force=True)
      saved_at = time.perf_counter()
      state, after = _timed_steps(step_fn, state, batches)
      blocking.append(saved_at - start)
      stalls.append((saved_at - start) + after - base)
      ckpt.wait()
    ckpt.close()
    sync = OrbaxCheckpointer(fs.join(workdir, "sync"), CheckpointConfig(every=0, keep=2, async_save=False))
    sync.save(state, 0, force=True)  # untimed, as for the async saves: orbax's one-off set-up
    start = time.perf_counter()
    sync.save(state, 1, force=True)
    sync.close()
    sync_seconds = time.perf_counter() - start
  step_seconds = statistics.median(plain)
  stall = statistics.median(stalls)
  size = fs.tree_size(fs.join(sync.directory, "1"))  # the timed save alone
  return {
      "step_seconds": step_seconds,
      "async_blocking_seconds": statistics.median(blocking),
      "async_stall_seconds": stall,
      "async_stall_steps": stall / step_seconds,
      "sync_save_seconds": sync_seconds,
      "checkpoint_bytes": size,
      "params": sum(x.size for x in jax.tree.leaves(state.params)),
  }


def format_report(r: Dict[str, object]) -> str:
  return "\n".join([
      f"train step            {r['step_seconds']:.3f} s (median, no save in flight)",
      f"checkpoint size       {r['checkpoint_bytes'] / 2**20:.1f} MiB ({r['params'] / 1e6:.1f}M params + optimizer state)",
      f"sync save             {r['sync_save_seconds']:.2f} s",
      f"async save            blocks the loop {r['async_blocking_seconds']:.3f} s, then writes while training goes on",
      f"async stall           {r['async_stall_seconds']:.3f} s = {r['async_stall_steps']:.2f} steps (target < 1)",
  ])
