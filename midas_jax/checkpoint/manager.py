"""Orbax checkpoints of a run: periodic async saves, keep policy, and restores that tell damage from unavailability.

Layout: <workdir>/checkpoints/<step>/{params, state, metadata}. `params` alone is what evaluation
and conversion need; `state` holds the step count and optimizer state; `metadata` is JSON
(metadata.py). orbax commits each save atomically (locally: a temporary directory renamed when
complete; on gs://, given the URL itself: a commit_success marker written last, since an object
store cannot rename a directory), and deletes old saves only after a newer one is committed, so a
kill at any moment leaves the previous good checkpoint in place.

A restore that fails is one of three things (damage.py says which): evidence that the save is damaged
(CorruptCheckpointError: the caller sets it aside and tries the one before); a storage error (HTTP
408/429/5xx, a reset or timed-out connection, refused credentials), retried with exponential backoff
within CheckpointConfig.restore_retries and restore_timeout_s and then StorageUnavailableError, the save
left in place; or anything else, running out of memory included, which stops the run saying what it was,
the save left in place. Listing the saves is retried the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from midas_jax import fs, hosts
from midas_jax.checkpoint import damage
from midas_jax.checkpoint.damage import CorruptCheckpointError, LayoutMismatchError
from midas_jax.configs import CheckpointConfig
from midas_jax.console import say
from midas_jax.errors import ConfigError, FaultError, NonFiniteLossError, StorageUnavailableError
from midas_jax.fs import storage_errors
from midas_jax.fs.paths import refresh
from midas_jax.train_state import StateLayout, TrainState

CHECKPOINT_DIR = "checkpoints"
ITEMS = ("params", "state", "metadata")
QUARANTINE_PREFIX = damage.SET_ASIDE_PREFIX
MAX_BACKOFF_S = 60.0  # the longest wait between two tries of a read that met a storage error
T = TypeVar("T")


class RestoreError(RuntimeError):
  """A restore failed in a way that is neither a storage error nor evidence of damage: the save is left."""


def checkpoint_dir(workdir: str) -> str:
  return fs.join(workdir, CHECKPOINT_DIR)


def _abstract(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@jax.jit
def all_finite(tree) -> jax.Array:
  """Whether every float leaf of `tree` is finite: a restored state that is not was not saved whole."""
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


def say_once(message: str) -> None:
  """A checkpoint line, printed by process 0 only (every process does the same thing)."""
  if jax.process_index() == 0:
    say(f"checkpoint: {message}")


def make_manager(directory: str, config: Optional[CheckpointConfig] = None, read_only: bool = False):
  config = config or CheckpointConfig()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=config.keep, keep_period=config.keep_every, create=not read_only, read_only=read_only,
      enable_async_checkpointing=config.async_save and not read_only, cleanup_tmp_directories=not read_only)
  return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)


def patiently(read: Callable[[], T], url: str, doing: str, config: Optional[CheckpointConfig] = None,
              step: Optional[int] = None, collective: bool = False) -> T:
  """read(), tried again on storage errors with exponential backoff (1, 2, 4, ... s, at most MAX_BACKOFF_S)
  until config.restore_retries retries or config.restore_timeout_s seconds are spent; then
  StorageUnavailableError. Any other error is classified (_not_a_storage_error): never retried.

  doing: what read() does, for messages ("reading the metadata of"); url: what it reads. collective: read()
  is an orbax restore, whose barriers every process must pass in step: in a multi-process job it is not
  tried again here (a retry on one process alone would meet the others' barriers out of order); the
  failure stops the job with status 75, and its supervisor starts it again after a delay.
  """
  config = config or CheckpointConfig()
  alone = collective and hosts.multi_process()
  if alone:
    config = dataclasses.replace(config, restore_retries=0)
  start = time.monotonic()
  for attempt in itertools.count(1):
    try:
      with storage_errors.quiet_clients():  # the error is reported once, below, not as the client's traceback
        return read()
    except CorruptCheckpointError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # the clients raise their own types
      fault = storage_errors.classify(e)
      if fault is None:
        raise _not_a_storage_error(e, url, doing, step) from e
      if not fault.transient:
        raise ConfigError("--workdir", f"{doing} {url}: {storage_errors.describe(fault)}",
                          storage_errors.advice(fault, url)) from e
      spent, wait = time.monotonic() - start, min(2.0 ** (attempt - 1), MAX_BACKOFF_S)
      if attempt > config.restore_retries or spent + wait > config.restore_timeout_s:
        raise StorageUnavailableError(_gave_up(fault, url, doing, step, attempt, spent, config, alone)) from e
      say_once(f"{doing} {url}: {storage_errors.describe(fault)}; trying again in {wait:g} s "
           f"(retry {attempt} of {config.restore_retries})")
      time.sleep(wait)
  raise AssertionError("unreachable")


def _gave_up(fault, url: str, doing: str, step: Optional[int], attempts: int, spent: float,
             config: CheckpointConfig, collective: bool = False) -> str:
  left = (f" The save of step {step} was left as it is: a storage error says nothing about it, and the same "
          "command resumes from it." if step is not None else "")
  if collective:
    return (f"{doing} {url}: {storage_errors.describe(fault)}, after the storage client's own retries ({spent:.0f} s)."
            f"{left} A multi-process job does not try this read again itself (it holds orbax's barriers, which "
            "every process must pass in step): it stops every process with exit status 75, and a supervisor starts "
            f"it again after a delay.\n  fix: {storage_errors.advice(fault, url)}")
  return (f"{doing} {url}: {storage_errors.describe(fault)}. Gave up after {attempts} tries over {spent:.0f} s "
          f"(CheckpointConfig.restore_retries = {config.restore_retries}, restore_timeout_s = "
          f"{config.restore_timeout_s:g}).{left}\n  fix: {storage_errors.advice(fault, url)}; to wait longer "
          "before giving up, raise CheckpointConfig.restore_timeout_s and restore_retries")


def _save_failed(error: BaseException, directory: str, step: Optional[int], stands: Optional[int]) -> Exception:
  """The error a failed save stops the run with: the step that was not saved, and the one a resume uses."""
  url = fs.join(directory, str(step))
  standing = (f"the save of step {stands} stands, and the same command resumes from it" if stands is not None
              else "the newest committed save stands, and the same command resumes from it")
  fault = storage_errors.classify(error)
  if fault is not None and not fault.transient:  # a permission: waiting does not help, so it is bad input
    return ConfigError("--workdir", f"writing the save of step {step} to {url}: {storage_errors.describe(fault)}. "
                       f"That save was not committed (a resume ignores it); {standing}",
                       storage_errors.advice(fault, url))
  if fault is not None:
    return StorageUnavailableError(
        f"writing the save of step {step} to {url}: {storage_errors.describe(fault)}. That save was not committed "
        f"(a resume ignores it); {standing}.\n  fix: {storage_errors.advice(fault, url)}")
  detail = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
  return FaultError(f"the save of step {step} to {url} failed ({detail}). That save was not committed (a resume "
                    f"ignores it); {standing}.\n  fix: see the error above; run the same command again to resume")


def _not_a_storage_error(error: BaseException, url: str, doing: str, step: Optional[int]) -> Exception:
  """Damage when the error is evidence of it; otherwise an error that stops the run and leaves the save."""
  what = f"step {step}" if step is not None else url
  reason = damage.evidence(error)
  if reason is not None:
    return CorruptCheckpointError(f"{what}: {reason}")
  detail = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
  if damage.out_of_memory(error):
    return FaultError(
        f"process {jax.process_index()} ran out of memory {doing} {url} ({detail}). The save was left as it is: "
        "running out of memory says nothing about it.\n  fix: restore on hosts with more memory, or spread the "
        "state over more devices (MeshConfig: a larger fsdp axis), then run the same command again")
  return RestoreError(f"{doing} {url} failed: {detail}. This is no evidence that the save is damaged, so it was "
                      "left as it is; if it is, move it out of the checkpoints folder and run the same command again")


def restore_params(manager, step: int, abstract_params, config: Optional[CheckpointConfig] = None) -> Any:
  """Only the params item of a save (no optimizer state is read)."""
  url = fs.join(str(manager.directory), str(step))
  return patiently(
      lambda: manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))),
      url, "reading the parameters of", config, step, collective=True).params


def restore_metadata(manager, step: int, config: Optional[CheckpointConfig] = None) -> Dict[str, Any]:
  url = fs.join(str(manager.directory), str(step))
  meta = patiently(lambda: manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())),
                   url, "reading the metadata of", config, step, collective=True).metadata
  if not isinstance(meta, dict) or meta.get("step") != step:
    raise CorruptCheckpointError(f"step {step}: metadata does not describe this step")
  return meta


def _layout(tree) -> Dict[str, Tuple[Tuple[int, ...], str]]:
  """{path: (shape, dtype)} of a tree's arrays, paths spelled the same for saved and wanted trees."""
  def name(path) -> str:
    return "/".join(str(next((getattr(k, a) for a in ("name", "key", "idx") if hasattr(k, a)), k)) for k in path)
  return {name(path): (tuple(a.shape), str(a.dtype)) for path, a in jax.tree_util.tree_leaves_with_path(tree)}


def saved_layout(item_dir: epath.Path):
  """The tree of array metadata (shape, dtype) an item was saved with, from orbax's record of it. (A handler
  made per call: making one at import would start jax's backend before jax.distributed.initialize.)"""
  return ocp.StandardCheckpointHandler().metadata(item_dir)


def check_layout(step: int, item: str, saved, wanted) -> None:
  """LayoutMismatchError when the arrays `item` was saved with are not the `wanted` tree's (shape, dtype)."""
  have, want = _layout(saved), _layout(wanted)
  if have == want:
    return
  lines = [f"{k}: missing" for k in sorted(set(want) - set(have))]
  lines += [f"{k}: not in the layout" for k in sorted(set(have) - set(want))]
  lines += [f"{k}: saved {have[k][0]} {have[k][1]}, the layout has {want[k][0]} {want[k][1]}"
            for k in sorted(set(have) & set(want)) if have[k] != want[k]]
  more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
  raise LayoutMismatchError(f"step {step}: the {item} item's arrays are not the layout's: {'; '.join(lines[:3])}{more}")


def _marked(directory: str, steps) -> set:
  """The steps among `steps` whose save carries the damage marker of an interrupted set-aside."""
  return {s for s in steps if damage.is_marked(fs.join(directory, str(s)))}


class _CommitFailures(logging.Filter):
  """The exceptions orbax's async save threads log as they fail, taken from the absl logger.

  orbax keeps the exception for whoever waits next, but in a job of several processes its finalize thread
  takes it and then waits in a barrier for the other processes (which wait in the commit's barrier for this
  one) for as long as orbax's timeout; the exception object is on the log record (exc_info), so it is caught
  here, by the thread's name and the record's exception, never by the message's words.

  A storage fault is reported once, in one line that names the step (_save_failed), so its records are
  dropped, with the tracebacks tensorstore prints for each write still in flight when orbax closed the
  event loop it answers on; any other failure's traceback stays on the screen, where the message points."""

  def __init__(self):
    super().__init__()
    self.caught: List[BaseException] = []
    self.storage_fault = False  # a save met a storage fault: what its threads log after it is its echo

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.levelno >= logging.ERROR and record.exc_info else None
    if error is None or not record.threadName.startswith(_SAVE_THREADS):
      return True
    if record.threadName.startswith("async_save"):
      self.caught.append(error)
    if storage_errors.classify(error) is not None and not self.storage_fault:
      self.storage_fault = True
      _drop_closed_loop_reports()
    return not self.storage_fault


# orbax's threads that write a save's files, and ours that waits for them (its barrier then fails as the peers
# leave)
_SAVE_THREADS = ("async_save", "array_type_handler", "midas-save-wait")


def _drop_closed_loop_reports() -> None:
  """From now on, "Event loop is closed" errors raised in tensorstore's callbacks are not printed (tensorstore
  reports a callback's error as unraisable); every other unraisable error still is."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_closed_loop", False):
    return

  def hook(unraisable):
    if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)

  hook.drops_closed_loop = True
  sys.unraisablehook = hook


class OrbaxCheckpointer:
  """The train loop's Checkpointer (train/checkpointer.py) on an orbax CheckpointManager."""

  def __init__(self, workdir: str, config: CheckpointConfig):
    self.config = config
    self.directory = checkpoint_dir(workdir)
    refresh(self.directory)  # list what is there now, whatever this process listed before
    self._manager = patiently(lambda: make_manager(self.directory, config), self.directory,
                              "listing the saves in", config, collective=True)  # its init has barriers
    self.save_seconds: List[float] = []  # time each save blocked the train loop
    self._writing: Optional[int] = None  # the step of a save started and not yet known to be committed
    self._commit_failures = _CommitFailures()
    self._failed = False  # a save failed and was reported: nothing more to wait for
    logging.getLogger("absl").addFilter(self._commit_failures)

  def steps(self) -> List[int]:
    """Committed saves, newest first (temporary directories of interrupted saves are not listed, nor saves
    whose set-aside was interrupted)."""
    steps = sorted(self._manager.all_steps(), reverse=True)
    marked = patiently(lambda: _marked(self.directory, steps), self.directory, "listing the saves in", self.config)
    return [s for s in steps if s not in marked]

  def set_aside_saves(self) -> List[Tuple[str, str]]:
    """(name, why) of each save set aside as damaged, by this run or an earlier one."""
    return patiently(lambda: damage.set_aside_saves(self.directory), self.directory, "listing the saves in",
                     self.config)

  def metadata(self, step: int) -> Dict[str, Any]:
    return restore_metadata(self._manager, step, self.config)

  def restore(self, layout: StateLayout, step: int) -> TrainState:
    """The state saved at `step`, laid out in `layout`'s shardings (any mesh: orbax reshards)."""
    target = _abstract(layout.abstract, layout.shardings)
    self.metadata(step)
    url = fs.join(self.directory, str(step))
    items = {"params": target.params, "state": {"step": target.step, "opt_state": target.opt_state}}
    for item, wanted in items.items():
      saved = patiently(lambda item=item: saved_layout(epath.Path(url) / item), url,
                        f"reading the layout of the {item} item of", self.config, step)
      check_layout(step, item, saved, wanted)
    restored = patiently(lambda: self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(items["params"]), state=ocp.args.StandardRestore(items["state"]))),
        url, "reading the state of", self.config, step, collective=True)
    state = TrainState(step=restored.state["step"], params=restored.params, opt_state=restored.state["opt_state"])
    if int(state.step) != step or not bool(all_finite(state.params)):
      raise CorruptCheckpointError(f"step {step}: restored state is not the finite state of step {step}")
    return state

  def quarantine(self, step: int, reason: str, alone: bool = False) -> None:
    """Sets a damaged save aside (damage.py: a marker, then a move; never deleted, no byte copied through
    this process), so the next restore looks at the one before.

    Process 0 sets it aside; every process waits for that before looking at the saves again. alone: this
    process sets it aside without waiting for the others (they are not answering; the caller stops the job).
    """
    reason = reason.removeprefix(f"step {step}: ")
    if alone or jax.process_index() == 0:
      where = patiently(lambda: damage.set_aside(self.directory, step, reason), fs.join(self.directory, str(step)),
                        "setting aside", self.config)
      print(f"checkpoint: step {step} is damaged ({reason}); set aside as {where}"
            + ("" if alone else ", trying the previous save"), file=sys.stderr, flush=True)
    if alone:
      return
    hosts.barrier(f"midas_quarantine_{step}")
    refresh(self.directory)  # every process sees process 0's move, not its own earlier listing
    patiently(self._manager.reload, self.directory, "listing the saves in", self.config, collective=True)

  def due(self, step: int) -> bool:
    return bool(self.config.every) and step % self.config.every == 0

  def save(self, state: TrainState, step: int, force: bool = False,
           metadata: Optional[Dict[str, Any]] = None) -> bool:
    """Starts a save of a verified-finite state; returns whether one was started."""
    if not (force or self.due(step)):
      return False
    if step in self._manager.all_steps():
      step_dir = fs.join(self.directory, str(step))
      if not patiently(lambda: damage.is_marked(step_dir), step_dir, "reading", self.config):
        return False  # saved already
      self.quarantine(step, damage.reason(step_dir))  # a set-aside interrupted earlier still holds the step
    if not bool(all_finite(state.params)):
      raise NonFiniteLossError(f"the parameters at step {step} are not finite; not saving them")
    start = time.time()
    if hosts.multi_process():
      self.wait()  # orbax's save waits for the one before too, but unwatched (_wait_watching)
    with self._saving(step):  # it first waits for the save before it, whose failure surfaces here
      self._manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(state.params),
          state=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
          metadata=ocp.args.JsonSave(dict(metadata or {}, step=step))), force=True)
    self._writing = step if self.config.async_save else None
    self.save_seconds.append(time.time() - start)
    say_once(f"saving step {step}" + (" (async)" if self.config.async_save else ""))
    return True

  def wait(self) -> None:
    if self._failed:
      return  # a save failed and was reported already: closing after it waits for nothing
    with self._saving():
      if hosts.multi_process():
        self._wait_watching()
      else:
        self._manager.wait_until_finished()
    self._writing = None

  def _wait_watching(self) -> None:
    """orbax's wait for the async save, on a helper thread, while this thread looks each second for a
    failure of this process's own part of it. Where one process's writes fail, orbax's threads on the
    processes wait in different barriers for each other (the others in the commit's, this one in the
    finalize's) for as long as orbax's timeout; the error, raised here at once, stops every process
    (peers.py) instead."""
    failed: List[BaseException] = []

    def wait():
      try:
        self._manager.wait_until_finished()
      except BaseException as e:  # pylint: disable=broad-except  # handed to the waiting thread
        failed.append(e)

    waiter = threading.Thread(target=wait, name="midas-save-wait", daemon=True)
    waiter.start()
    while waiter.is_alive():
      waiter.join(timeout=1.0)
      if waiter.is_alive() and self._commit_failures.caught:
        raise self._commit_failures.caught[0]
    if failed:
      raise failed[0]

  def close(self) -> None:
    """Waits for the last async save: an unwaited save is lost when the process exits."""
    try:
      self.wait()
      if not self._failed:  # orbax's close waits for the failed save's threads, which wait for the others
        self._manager.close()
    finally:
      if not self._commit_failures.storage_fault:  # else orbax's threads, still running, echo it as they end
        logging.getLogger("absl").removeFilter(self._commit_failures)

  @contextlib.contextmanager
  def _saving(self, starting: Optional[int] = None) -> Iterator[None]:
    """Turns a save that failed (the async one before, failing in orbax's commit thread, or this one)
    into an error that names the step not saved and the save that stands: StorageUnavailableError (status
    75) when the storage did not answer, FaultError otherwise. Nothing is set aside: orbax commits a save
    only once it is whole, and a resume never sees one that is not."""
    try:
      yield
    except (ConfigError, NonFiniteLossError):
      raise
    except Exception as e:  # pylint: disable=broad-except  # orbax and the clients raise their own types
      step = self._writing if self._writing is not None else starting
      self._writing, self._failed = None, True
      raise _save_failed(e, self.directory, step, self._committed_before(step)) from e

  def _committed_before(self, step: Optional[int]) -> Optional[int]:
    try:
      self._manager.reload()
      return max((s for s in self._manager.all_steps() if step is None or s < step), default=None)
    except Exception:  # pylint: disable=broad-except  # the listing fails too in an outage
      return None


def available_steps(workdir: str) -> List[int]:
  """Committed checkpoint steps of a run, oldest first (saves set aside as damaged are not listed)."""
  directory = checkpoint_dir(workdir)
  refresh(directory)  # saves another process committed since this one last looked
  if not fs.isdir(directory):
    return []
  steps = make_manager(directory, read_only=True).all_steps()
  marked = _marked(directory, steps)
  return sorted(s for s in steps if s not in marked)

