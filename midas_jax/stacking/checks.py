"""Checks of a RunConfig that need the stacking operators and schedules.

They sit here rather than in configs/ so that the configs import nothing of the package (the
operators and schedules import configs). `schedule_for` runs where a run starts (train/run.py, and
for every arm at once where several are trained: compare.py, the studies), so a bad stacking
setting stops a run before anything is compiled, and the schedule it checks is the one the run uses.

A setting that is legal but almost surely not meant (a warmup longer than the first stage, which
trains the first, shallowest model below the peak rate throughout) is warned about, not refused:
`ScheduleWarning`, once per distinct message; `-W error::midas_jax.stacking.checks.ScheduleWarning`
turns it into an error.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

from midas_jax.configs import RunConfig
from midas_jax.errors import require
from midas_jax.stacking import operators, schedule


class ScheduleWarning(UserWarning):
  """A stacking schedule that runs, but likely not as intended."""


def warmup_problem(config: RunConfig, stage_steps: Sequence[int], first_depth: int) -> Optional[str]:
  """Why the warmup and the first stage clash (None if they do not): the message ScheduleWarning gives."""
  warmup = config.optimizer.warmup_steps
  if warmup <= stage_steps[0]:
    return None
  return (f"OptimizerConfig.warmup_steps={warmup} is longer than the first stage "
          f"({stage_steps[0]} of TrainerConfig.num_steps={config.trainer.num_steps}; stage steps "
          f"{tuple(stage_steps)}), so the {first_depth}-layer "
          f"first stage never trains at the peak learning rate (it ends at {stage_steps[0] / warmup:.0%} of it). "
          f"Lower OptimizerConfig.warmup_steps to at most {stage_steps[0]}, or lengthen the first stage "
          "(StackingConfig.stage_steps or alpha).")


def schedule_for(config: RunConfig) -> schedule.StageSchedule:
  """The run's stage schedule, every growth's provenance map included, computed once and checked:
  ConfigError naming the setting when the stacking settings cannot describe the run, ScheduleWarning
  when they can but likely not as meant."""
  st, layers, num_steps = config.stacking, config.model.num_layers, config.trainer.num_steps
  s = "StackingConfig."
  operators.get_operator(st.operator)
  if st.stage_steps is not None:
    require(sum(st.stage_steps) == num_steps, s + "stage_steps",
            f"{st.stage_steps} sum to {sum(st.stage_steps)}, not TrainerConfig.num_steps={num_steps}",
            "make the stage steps add up to num_steps, or leave stage_steps None for Prop-alpha")
  if st.num_stages > 1:
    _check_blocks(config)
  require(st.trigger is None or config.trainer.eval_every > 0, "TrainerConfig.eval_every",
          f"StackingConfig.trigger={st.trigger!r} grows on the eval loss, but evaluation is off (eval_every=0)",
          "set TrainerConfig.eval_every > 0 (a few evaluations per stage), or StackingConfig.trigger = None")
  stages = schedule.schedule_from_config(st, num_steps, layers)
  if st.num_stages == 1:
    return stages
  problem = warmup_problem(config, stages.stage_steps, stages.depths[0])
  if problem:
    warnings.warn(problem, ScheduleWarning, stacklevel=2)
  if st.lr_schedule == "rewarm":
    rewarm = st.resolved_rewarm_steps(config.optimizer.warmup_steps)
    short = [i + 1 for i, t in enumerate(stages.stage_steps) if i > 0 and t < rewarm]
    require(not short, s + "rewarm_steps",
            f"the re-warmup ({rewarm} steps) is longer than stage(s) {short} (stage steps {stages.stage_steps})",
            "lower StackingConfig.rewarm_steps (0 means OptimizerConfig.warmup_steps), or use fewer stages")
  return stages


def _check_blocks(config: RunConfig) -> None:
  """Stages and block size against the depth: the errors that name the setting to change."""
  st, layers, num_steps = config.stacking, config.model.num_layers, config.trainer.num_steps
  s, k = "StackingConfig.", st.num_stages
  require(k <= num_steps, s + "num_stages", f"{k} stages but only TrainerConfig.num_steps={num_steps}",
          "use at most num_steps stages (every stage needs a step), or train longer")
  if st.block_size is None:
    blocks = k + st.start_blocks - 1
    require(layers % blocks == 0, s + "num_stages",
            f"ModelConfig.num_layers={layers} is not divisible by num_stages + start_blocks - 1 = {blocks}",
            "choose num_stages that divides num_layers, or set StackingConfig.block_size")
  else:
    require(layers % st.block_size == 0, s + "block_size",
            f"block_size={st.block_size} does not divide ModelConfig.num_layers={layers}",
            "choose a block size that divides num_layers")
