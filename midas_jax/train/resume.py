"""Where a run starts: its latest good checkpoint, an initial-parameters export, or step 0.

Saves are tried newest first. One that shows evidence of damage (checkpoint/damage.py) is reported and
set aside (never deleted), and the one before it is tried. A storage error, running out of memory or an
error nobody recognises stops the run with that error and sets nothing aside: none says anything about
the save, and the same command run later restores it. When saves exist and every one is damaged, the run
stops listing them and why, unless CheckpointConfig.on_no_usable_save = 'start_fresh' lets it start from
step 0; saves set aside by an earlier attempt count, so running the same command again never starts over
without being asked. A save written under a different config is refused before anything is compiled,
unless the differences are allowed (metadata.check_resumable).

In a multi-process job the processes agree (hosts.py, through the coordinator's key-value store, never a
device collective): every one tries the step process 0 names; a failure on any process stops it at once,
and peers.py stops every other one with its status, whatever orbax collective they wait in; a save counts
as good only if it restored on all of them, and a damaged one is set aside by process 0 alone while the
others wait, so all of them continue from the same step. A process that finds damage while the others do
not answer (they wait in a restore barrier its failed read never joined) sets the save aside itself, the
first to claim it in the store, and stops the job with status 76: started again, it resumes from the
save before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import jax

from midas_jax import fs, hosts, peers
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.checkpoint.damage import CorruptCheckpointError, LayoutMismatchError
from midas_jax.checkpoint.load import load_model
from midas_jax.console import say
from midas_jax.errors import ConfigError, RestartNeededError
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
    found, problem, failure = _restore(controller, checkpointer, step, resolved_config, allow_config_changes)
    if failure is not None:  # stops every process (peers.py), the save left in place
      raise failure
    try:
      problems = hosts.exchange(f"restore/{step}", problem)
    except hosts.PeerTimeoutError as e:
      if problem is None:
        raise
      raise _set_aside_alone(checkpointer, step, problem, e) from e
    problem = next((p for p in problems if p is not None), None)
    if problem is None:
      meta, state, stage, accepted = found
      controller.growths = list(meta.get("growths", []))
      return Start(step, state, stage, tuple(accepted))
    checkpointer.quarantine(step, problem)
  _no_usable_save(controller.config.checkpoint.on_no_usable_save, checkpointer)
  state, stage = _initial_state(controller, controller.config.checkpoint.init_from)
  return Start(0, state, stage)


def _set_aside_alone(checkpointer: Checkpointer, step: int, problem: str,
                     silence: Exception) -> RestartNeededError:
  """This process found damage and the others did not answer: the first such process to claim the save in
  the coordinator's store sets it aside; returns the error every such process stops with (status 76)."""
  kv = peers.client()
  try:
    kv.key_value_set(f"midas/set_aside/{step}", str(jax.process_index()))  # refused if another claimed it
    claimed = True
  except Exception:  # pylint: disable=broad-except
    claimed = False
  if claimed:
    checkpointer.quarantine(step, problem, alone=True)
  return RestartNeededError(
      f"the save of step {step} is damaged ({problem}) and the other processes did not answer ({silence}); it "
      f"was set aside{'' if claimed else ' by another process'}, so the job stops and, started again, resumes "
      "from the save before it\n  fix: none needed: a supervisor restarts exit status 76 at once; by hand, run "
      "the same command again")


def _no_usable_save(policy: str, checkpointer: Checkpointer) -> None:
  """Stops the run when saves exist but none could be used, unless `policy` is 'start_fresh'."""
  refused = checkpointer.set_aside_saves()
  if not refused:
    return
  listing = "\n  ".join(f"{name}: {why}" for name, why in refused)
  if policy != "start_fresh":
    raise ConfigError("CheckpointConfig.on_no_usable_save",
                      f"the workdir has saves but none can be used; each was set aside as damaged:\n  {listing}",
                      "to start this run again from step 0 (or CheckpointConfig.init_from), set "
                      "--gin.CheckpointConfig.on_no_usable_save=\"'start_fresh'\" (the set-aside saves stay "
                      "where they are); or restore a good copy of a save into the checkpoints folder")
  if jax.process_index() == 0:
    say(f"checkpoint: no usable save ({len(refused)} set aside as damaged); starting from step 0 as "
        "CheckpointConfig.on_no_usable_save = 'start_fresh' asks")


def _restore(controller: StageController, checkpointer: Checkpointer, step: int, resolved_config: Dict[str, Any],
             allow_config_changes: Sequence[str]):
  """(found, problem, failure): found is (metadata, state, stage, accepted changes) when the save restored;
  problem says why the save is damaged; failure is an error that is not damage (a storage error, out of
  memory, anything unrecognised), raised by the caller once every process knows."""
  accepted: List[str] = []
  try:
    meta = checkpointer.metadata(step)
    if not isinstance(meta.get("config"), dict):
      raise CorruptCheckpointError(f"step {step}: the metadata has no config")
    accepted = metadata_lib.check_resumable(meta["config"], resolved_config, allow_config_changes)
    _check_depth(controller, meta, step)
    stage = controller.stage(int(meta.get("stage", 1)))
    state = checkpointer.restore(stage.build.layout, step)
  except LayoutMismatchError as e:
    changed = _model_changes(accepted)
    if changed:  # the arrays differ because the config was changed on purpose, not because the save is damaged
      return None, None, ConfigError("--allow_config_changes", f"{e}, as the allowed changes {changed} change "
                                     "the model's arrays", "resume with the saved model settings, or start a new "
                                     "run in a new --workdir (CheckpointConfig.init_from can start it from an export)")
    return None, str(e), None
  except CorruptCheckpointError as e:
    return None, str(e), None
  except Exception as e:  # pylint: disable=broad-except  # a config error or a fault: stop every process with it
    return None, None, e
  return (meta, state, stage, accepted), None, None


def _model_changes(accepted: Sequence[str]) -> List[str]:
  """The accepted config changes (lines "key: old -> new") to model settings that shape its arrays."""
  keys = [line.split(":")[0] for line in accepted]
  return [k for k in keys if k.startswith("model.") and not any(k.startswith(p) for p in metadata_lib.OPERATIONAL)]
