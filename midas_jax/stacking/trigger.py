"""Growth on a trigger: the next stage starts when the held-out loss stops improving, not at a fixed step.

With StackingConfig.trigger = "plateau" a stage ends once it has run min_stage_steps and the eval loss
improved by less than plateau_fraction (relative) over its last plateau_window evaluations, or once it
has run max_stage_steps. Only evaluations of the current stage count: a growth starts the history anew.
The last stage has no trigger; TrainerConfig.num_steps stays the cap on compute, so a run whose stages
do not all fit ends at the depth it reached. The decision (`growth_due`) is a pure function of the
stage's length and eval history; `GrowthTrigger` holds that history, and goes into every checkpoint's
metadata so a resume continues the same window (docs/stacking.md#growth-on-a-trigger).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

from midas_jax.configs import StackingConfig

PLATEAU = "plateau"
MAX_STAGE_STEPS = "max_stage_steps"
TRIGGERS = (PLATEAU,)


def plateaued(losses: Sequence[float], fraction: float, window: int) -> bool:
  """Whether the last `window` evaluations improved the loss by less than `fraction` of the loss before them.

  Needs window + 1 evaluations; a non-finite loss never counts as a plateau (the run's guard handles it).
  """
  if len(losses) <= window:
    return False
  before, now = float(losses[-1 - window]), float(losses[-1])
  if not (math.isfinite(before) and math.isfinite(now)):
    return False
  return before - now < fraction * abs(before)


def growth_due(stage_steps_run: int, losses: Sequence[float], fraction: float, window: int,
               min_steps: int, max_steps: Optional[int]) -> Optional[str]:
  """Why the current stage should end after `stage_steps_run` of its steps, or None: MAX_STAGE_STEPS once it
  has run max_steps, PLATEAU once it has run min_steps and its eval `losses` plateaued."""
  if max_steps is not None and stage_steps_run >= max_steps:
    return MAX_STAGE_STEPS
  if stage_steps_run >= min_steps and plateaued(losses, fraction, window):
    return PLATEAU
  return None


@dataclasses.dataclass
class GrowthTrigger:
  """The current stage's start and eval history, and a decided growth not yet taken (`pending`)."""

  stacking: StackingConfig
  num_stages: int
  stage_start: int = 0
  losses: List[List[float]] = dataclasses.field(default_factory=list)  # [step, loss] of this stage's evals
  pending: Optional[str] = None

  def observe(self, step: int, loss: float, stage: int) -> Optional[str]:
    """Adds an evaluation of `stage` at `step`; returns this process's decision (the caller shares process 0's)."""
    self.losses.append([int(step), float(loss)])
    return self._decide(step, stage)

  def _decide(self, step: int, stage: int) -> Optional[str]:
    if stage >= self.num_stages:
      return None
    st = self.stacking
    return growth_due(step - self.stage_start, [l for _, l in self.losses], st.plateau_fraction,
                      st.plateau_window, st.min_stage_steps, st.max_stage_steps)

  def due(self, step: int, stage: int) -> Optional[str]:
    """Why the model grows just before `step`, or None: the shared plateau decision, or the stage's max length
    (a function of the step alone, the same on every process)."""
    if stage >= self.num_stages:
      return None
    max_steps = self.stacking.max_stage_steps
    if max_steps is not None and step - self.stage_start >= max_steps:
      return MAX_STAGE_STEPS
    return self.pending

  def grown(self, step: int) -> None:
    self.stage_start, self.losses, self.pending = step, [], None

  def to_dict(self) -> Dict[str, Any]:
    return {"stage_start": self.stage_start, "losses": [list(x) for x in self.losses], "pending": self.pending}

  def restore(self, saved: Dict[str, Any]) -> None:
    self.stage_start = int(saved.get("stage_start", 0))
    self.losses = [[int(s), float(l)] for s, l in saved.get("losses", [])]
    self.pending = saved.get("pending")
