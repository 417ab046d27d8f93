"""A jax.profiler trace of chosen steps, written under the workdir (TrainerConfig.profile_steps).

`profile_steps = (start, stop)` traces the steps start+1 .. stop (the trace starts once `start`
steps are done and stops when `stop` are), into <workdir>/profile/plugins/profile/<run>/, which
TensorBoard's profile plugin and XProf read (`tensorboard --logdir DIR/profile`). The profiler
writes local files only, so for a gs:// workdir the trace is written to a local directory and
copied up when it stops (fs.Mirror). Every process traces its own devices; process 0's trace is
the one kept under the workdir's name, the others' next to it with their process index.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax

from midas_jax import fs

PROFILE_DIR = "profile"


class StepProfiler:
  """Call `after_step(done)` after every step; it starts and stops the trace at the chosen steps."""

  def __init__(self, workdir: str, profile_steps: Optional[Tuple[int, int]], start_step: int = 0):
    self._steps = tuple(profile_steps) if profile_steps else None
    self._mirror = None
    self._workdir = workdir
    if self._steps and start_step > self._steps[0]:
      self._steps = None  # a resumed run past the window does not trace again
    if self._steps and start_step == self._steps[0]:
      self._start()

  @property
  def active(self) -> bool:
    return self._mirror is not None

  def _start(self) -> None:
    name = PROFILE_DIR if jax.process_index() == 0 else f"{PROFILE_DIR}_process_{jax.process_index()}"
    self._mirror = fs.Mirror(fs.join(self._workdir, name))
    jax.profiler.start_trace(self._mirror.local)

  def after_step(self, done: int, block_on=None) -> None:
    if not self._steps:
      return
    start, stop = self._steps
    if done == start and not self.active:
      self._start()
    elif done >= stop and self.active:
      if block_on is not None:
        jax.block_until_ready(block_on)  # the traced steps' device work belongs in the trace
      self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self._mirror.close()
      self._mirror = None
      self._steps = None
