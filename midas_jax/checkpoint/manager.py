"""Orbax checkpoints of a run: periodic async saves, keep policy, and restores that skip bad saves.

Layout: <workdir>/checkpoints/<step>/{params, state, metadata}. `params` alone is what evaluation
and conversion need; `state` holds the step count and optimizer state; `metadata` is JSON
(metadata.py). orbax commits each save atomically (locally: a temporary directory renamed when
complete; on gs://, given the URL itself: a commit_success marker written last, since an object
store cannot rename a directory), and deletes old saves only after a newer one is committed, so a
kill at any moment leaves the previous good checkpoint in place.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from midas_jax import fs, hosts
from midas_jax.configs import CheckpointConfig
from midas_jax.console import say
from midas_jax.errors import NonFiniteLossError
from midas_jax.train_state import StateLayout, TrainState

CHECKPOINT_DIR = "checkpoints"
ITEMS = ("params", "state", "metadata")
QUARANTINE_PREFIX = "corrupt-"


class CorruptCheckpointError(RuntimeError):
  """A save that exists on disk but cannot be restored (truncated, missing items, bad metadata)."""


def checkpoint_dir(workdir: str) -> str:
  return fs.join(workdir, CHECKPOINT_DIR)


def _abstract(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


def _say(message: str) -> None:
  if jax.process_index() == 0:
    say(f"checkpoint: {message}")


def make_manager(directory: str, config: Optional[CheckpointConfig] = None, read_only: bool = False):
  config = config or CheckpointConfig()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=config.keep, keep_period=config.keep_every, create=not read_only, read_only=read_only,
      enable_async_checkpointing=config.async_save and not read_only, cleanup_tmp_directories=not read_only)
  return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)


def restore_params(manager, step: int, abstract_params) -> Any:
  """Only the params item of a save (no optimizer state is read)."""
  try:
    return manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))).params
  except Exception as e:  # pylint: disable=broad-except
    raise CorruptCheckpointError(f"step {step}: {type(e).__name__}: {e}") from e


def restore_metadata(manager, step: int) -> Dict[str, Any]:
  try:
    meta = manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())).metadata
  except Exception as e:  # pylint: disable=broad-except
    raise CorruptCheckpointError(f"step {step}: metadata unreadable ({type(e).__name__}: {e})") from e
  if not isinstance(meta, dict) or meta.get("step") != step:
    raise CorruptCheckpointError(f"step {step}: metadata does not describe this step")
  return meta


class OrbaxCheckpointer:
  """The train loop's Checkpointer (train/checkpointer.py) on an orbax CheckpointManager."""

  def __init__(self, workdir: str, config: CheckpointConfig):
    self.config = config
    self.directory = checkpoint_dir(workdir)
    self._manager = make_manager(self.directory, config)
    self.save_seconds: List[float] = []  # time each save blocked the train loop

  def steps(self) -> List[int]:
    """Committed saves, newest first (temporary directories of interrupted saves are not listed)."""
    return sorted(self._manager.all_steps(), reverse=True)

  def metadata(self, step: int) -> Dict[str, Any]:
    return restore_metadata(self._manager, step)

  def restore(self, layout: StateLayout, step: int) -> TrainState:
    """The state saved at `step`, laid out in `layout`'s shardings (any mesh: orbax reshards)."""
    target = _abstract(layout.abstract, layout.shardings)
    self.metadata(step)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(target.params),
          state=ocp.args.StandardRestore({"step": target.step, "opt_state": target.opt_state})))
    except Exception as e:  # pylint: disable=broad-except
      raise CorruptCheckpointError(f"step {step}: {type(e).__name__}: {e}") from e
    state = TrainState(step=restored.state["step"], params=restored.params, opt_state=restored.state["opt_state"])
    if int(state.step) != step or not bool(_all_finite(state.params)):
      raise CorruptCheckpointError(f"step {step}: restored state is not the finite state of step {step}")
    return state

  def quarantine(self, step: int, reason: str) -> None:
    """Moves a bad save aside (never deletes it), so the next restore looks at the one before.

    Process 0 moves it; every process waits for that before looking at the saves again.
    """
    src = fs.join(self.directory, str(step))
    dst = fs.join(self.directory, f"{QUARANTINE_PREFIX}{step}-{int(time.time())}")
    if jax.process_index() == 0:
      print(f"checkpoint: step {step} is unusable ({reason}); moved to {dst}, trying the previous save",
            file=sys.stderr, flush=True)
      if fs.isdir(src):
        fs.rename(src, dst)
    hosts.barrier(f"midas_quarantine_{step}")
    self._manager.reload()

  def due(self, step: int) -> bool:
    return bool(self.config.every) and step % self.config.every == 0

  def save(self, state: TrainState, step: int, force: bool = False,
           metadata: Optional[Dict[str, Any]] = None) -> bool:
    """Starts a save of a verified-finite state; returns whether one was started."""
    if not (force or self.due(step)) or step in self._manager.all_steps():
      return False
    if not bool(_all_finite(state.params)):
      raise NonFiniteLossError(f"the parameters at step {step} are not finite; not saving them")
    start = time.time()
    self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        state=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
        metadata=ocp.args.JsonSave(dict(metadata or {}, step=step))), force=True)
    self.save_seconds.append(time.time() - start)
    _say(f"saving step {step}" + (" (async)" if self.config.async_save else ""))
    return True

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last async save: an unwaited save is lost when the process exits."""
    self._manager.wait_until_finished()
    self._manager.close()


def available_steps(workdir: str) -> List[int]:
  """Committed checkpoint steps of a run, oldest first."""
  directory = checkpoint_dir(workdir)
  if not fs.isdir(directory):
    return []
  return sorted(make_manager(directory, read_only=True).all_steps())

