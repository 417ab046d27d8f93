"""Where a run starts: its latest good checkpoint, an initial-parameters export, or step 0.

Saves are tried newest first. One that cannot be read is reported and moved aside (never deleted),
and the one before it is tried. A save written under a different config is refused before anything
is compiled, unless the differences are allowed (metadata.check_resumable).

In a multi-process job the processes agree (hosts.py): every one tries the step process 0
names, a save counts as good only if it restored on all of them, and a bad one is moved aside by
process 0 alone while the others wait, so all of them continue from the same step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Sequence, Tuple

import jax

from midas_jax import fs, hosts
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.checkpoint.export import load_model
from midas_jax.checkpoint.manager import CorruptCheckpointError
from midas_jax.errors import ConfigError
from midas_jax.train.checkpointer import Checkpointer
from midas_jax.train.stages import Stage, StageController
from midas_jax.train_state import TrainState


@dataclasses.dataclass
class Start:
  step: int
  state: TrainState
  stage: Stage
  accepted_changes: Tuple[str, ...] = ()


def _check_depth(controller: StageController, meta: Dict[str, Any], step: int) -> None:
  stage = int(meta.get("stage", 1))
  depth = controller.schedule.depths[stage - 1] if stage <= controller.schedule.num_stages else None
  if depth != meta.get("depth"):
    raise ConfigError("StackingConfig", f"the checkpoint of step {step} is stage {stage} at depth "
                      f"{meta.get('depth')}, which the current stage schedule does not have (its depths: "
                      f"{list(controller.schedule.depths)})", "resume with the stacking settings the run was saved with")
  if controller.schedule.stage_at(step) < stage:
    raise ConfigError("StackingConfig", f"the current schedule puts step {step} in stage "
                      f"{controller.schedule.stage_at(step)}, before the checkpoint's stage {stage}",
                      "resume with the stacking and num_steps settings the run was saved with")


def _initial_state(controller: StageController, init_from: str) -> Tuple[TrainState, Stage]:
  stage = controller.stage(1)
  if not init_from:
    return stage.build.init_state(), stage
  loaded = load_model(fs.check(init_from, "CheckpointConfig.init_from"))
  want = jax.tree.map(lambda a: (a.shape, str(a.dtype)), stage.build.layout.abstract.params)
  have = jax.tree.map(lambda a: (a.shape, str(a.dtype)), loaded.params)
  if want != have:
    fix = "start from an export of the same model shape, or set ModelConfig to match it"
    depth, block = loaded.model_config.num_layers, controller.block_size
    if depth != stage.depth and depth % block == 0:  # e.g. growing an imported model from its own depth
      fix = (f"to grow the {depth}-layer model, start the stages at its depth: StackingConfig.start_blocks = "
             f"{depth // block} (blocks of {block} layers)")
    raise ConfigError("CheckpointConfig.init_from", f"the parameters in {init_from} do not fit the first "
                      f"stage's model (depth {stage.depth}): {loaded.model_config} vs {stage.build.model_config}",
                      fix)
  return stage.build.init_state_from_params(loaded.params), stage


def start(controller: StageController, checkpointer: Checkpointer, resolved_config: Dict[str, Any],
          allow_config_changes: Sequence[str] = ()) -> Start:
  """The state a run continues from; controller.growths gets the growths done before it."""
  tried = set()
  while True:
    candidates = [s for s in checkpointer.steps() if s not in tried]
    step = hosts.from_process_0(candidates[0] if candidates else -1)
    if step < 0:
      break
    tried.add(step)
    found, problem = _restore(controller, checkpointer, step, resolved_config, allow_config_changes)
    if hosts.all_true(problem is None):
      meta, state, stage, accepted = found
      controller.growths = list(meta.get("growths", []))
      return Start(step, state, stage, tuple(accepted))
    checkpointer.quarantine(step, problem or "it could not be restored on another process")
  state, stage = _initial_state(controller, controller.config.checkpoint.init_from)
  return Start(0, state, stage)


def _restore(controller: StageController, checkpointer: Checkpointer, step: int, resolved_config: Dict[str, Any],
             allow_config_changes: Sequence[str]):
  """((metadata, state, stage, accepted changes), None), or (None, why the save is unusable)."""
  try:
    meta = checkpointer.metadata(step)
    if not isinstance(meta.get("config"), dict):
      raise CorruptCheckpointError(f"step {step}: the metadata has no config")
    accepted = metadata_lib.check_resumable(meta["config"], resolved_config, allow_config_changes)
    _check_depth(controller, meta, step)
    stage = controller.stage(int(meta.get("stage", 1)))
    state = checkpointer.restore(stage.build.layout, step)
  except CorruptCheckpointError as e:
    return None, str(e)
  return (meta, state, stage, accepted), None
