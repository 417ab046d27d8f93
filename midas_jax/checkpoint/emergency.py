"""Emergency checkpoints: a local tier on each host beside the persistent saves (CheckpointConfig.local_dir).

An 8B state (~100 GB) does not reach a bucket within a 30 s Spot notice; each host's share of it reaches
its own local SSD or ramdisk in seconds. So every local_every steps each process also writes its own
shards of the state to <local_dir>/<run>/process_<i>/<step>/ (<run>: a hash of the workdir, so another
run's copies are never read), while the persistent saves under the workdir go on as before
(OrbaxCheckpointer, every `every` steps). A resume takes the newest step complete in either tier. A
local step counts only if every process still holds its part (the processes exchange their lists,
hosts.py): a host whose disk was lost, or replaced, has none, and the job falls back to the newest
persistent save. Local copies no process can use are deleted, not set aside: they are scratch, and the
persistent tier keeps the record.

Why not orbax's emergency CheckpointManager (orbax.checkpoint.experimental.emergency, in the pinned
orbax-checkpoint 0.12.8), which MaxText uses:
- It counts replicas along one mesh axis and needs at least two, each on its own processes. With one
  (one process, or the fsdp layouts this project uses, data = 1) it drops the local directory and is a
  plain persistent manager: no local tier at all.
- With two or more, the first replica writes only the persistent tier and the others only the local one;
  a local restore reads one replica's copy and broadcasts it to the rest, so the state must be whole in
  every replica (pure data parallelism), and the processes of replica 0 never hold a local copy.
- It keeps one `state` item for one abstract state given at construction: no params/state/metadata items
  (evaluation, export and conversion read `params`; a resume reads the metadata first), metadata() and
  delete() raise NotImplementedError, and every growth changes the abstract state (a new manager per stage,
  and per candidate save on restore).
The local tier is therefore this module's own: numpy files and a rename, with no barrier between hosts
(a host writes alone), which orbax's public CheckpointManager does not do (its saves are committed by one
primary process for all of them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from midas_jax import hosts
from midas_jax.checkpoint.damage import CorruptCheckpointError, LayoutMismatchError
from midas_jax.checkpoint.manager import OrbaxCheckpointer, all_finite, say_once
from midas_jax.configs import CheckpointConfig
from midas_jax.errors import ConfigError
from midas_jax.train_state import StateLayout, TrainState

TMP_PREFIX = ".writing-"
SHARDS, LAYOUT, METADATA = "shards.npz", "layout.json", "metadata.json"  # METADATA last: its presence commits


def checkpointer_for(workdir: str, config: CheckpointConfig):
  """The run's checkpointer: with CheckpointConfig.local_dir, the two tiers; otherwise the persistent one."""
  if config.local_dir is None:
    return OrbaxCheckpointer(workdir, config)
  return EmergencyCheckpointer(workdir, config)


def local_root(local_dir: str, workdir: str, process: int) -> str:
  """This process's local tier of the run in `workdir`."""
  run = hashlib.sha256(workdir.rstrip("/").encode()).hexdigest()[:12]
  return os.path.join(local_dir, run, f"process_{process}")


def _names(tree) -> List[str]:
  return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _index(index: Tuple[slice, ...], shape: Tuple[int, ...]) -> List[List[int]]:
  """A shard's place in its array as [start, stop] per dimension."""
  return [[s.start or 0, dim if s.stop is None else s.stop] for s, dim in zip(index, shape)]


class LocalTier:
  """One process's own shards of the state, one directory per step, written on a background thread."""

  def __init__(self, root: str, keep: int):
    self.root, self.keep = root, keep
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):  # a write a kill interrupted
      if name.startswith(TMP_PREFIX):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    self._thread: Optional[threading.Thread] = None
    self._error: Optional[Tuple[int, BaseException]] = None

  def steps(self) -> List[int]:
    """Complete local saves, newest first."""
    return sorted((int(n) for n in os.listdir(self.root)
                   if n.isdigit() and os.path.exists(os.path.join(self.root, n, METADATA))), reverse=True)

  def drop(self, step: int) -> None:
    shutil.rmtree(os.path.join(self.root, str(step)), ignore_errors=True)

  def save(self, state: TrainState, step: int, metadata: Dict[str, Any]) -> None:
    """Copies this process's shards to host memory now (the loop may donate the state's buffers next
    step), and writes them on a thread; the save before it is waited for first."""
    self.wait()
    arrays, layout = {}, []
    for i, (name, leaf) in enumerate(zip(_names(state), jax.tree.leaves(state))):
      seen, places = set(), []
      for shard in leaf.addressable_shards:
        place = _index(shard.index, leaf.shape)
        if str(place) in seen:  # a copy another local device holds too
          continue
        seen.add(str(place))
        data = np.asarray(shard.data)
        arrays[f"{i}_{len(places)}"] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        places.append(place)
      layout.append({"name": name, "shape": list(leaf.shape), "dtype": str(leaf.dtype), "shards": places})
    meta = dict(metadata, step=step)
    self._thread = threading.Thread(target=self._write, args=(step, arrays, layout, meta),
                                    name="midas-local-save", daemon=True)
    self._thread.start()

  def _write(self, step: int, arrays, layout, meta) -> None:
    try:
      tmp, final = os.path.join(self.root, f"{TMP_PREFIX}{step}"), os.path.join(self.root, str(step))
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
      np.savez(os.path.join(tmp, SHARDS), **arrays)
      with open(os.path.join(tmp, LAYOUT), "w") as f:
        json.dump(layout, f)
      with open(os.path.join(tmp, METADATA), "w") as f:
        json.dump(meta, f)
      shutil.rmtree(final, ignore_errors=True)  # a copy of this step from an earlier attempt
      os.rename(tmp, final)
      for old in self.steps()[self.keep:]:
        self.drop(old)
    except BaseException as e:  # pylint: disable=broad-except  # raised on the loop's thread by wait()
      self._error = (step, e)

  def wait(self) -> None:
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      step, error = self._error
      self._error = None
      raise ConfigError("CheckpointConfig.local_dir", f"writing the local save of step {step} to {self.root} "
                        f"failed ({type(error).__name__}: {error}); the persistent saves are unaffected",
                        "give local_dir a disk with room for this host's share of the state, times local_keep "
                        "+ 1, or set local_dir = None") from error

  def metadata(self, step: int) -> Dict[str, Any]:
    try:
      with open(os.path.join(self.root, str(step), METADATA)) as f:
        meta = json.load(f)
    except (OSError, ValueError) as e:
      raise CorruptCheckpointError(f"step {step}: the local copy's metadata does not read ({e})") from e
    if not isinstance(meta, dict) or meta.get("step") != step:
      raise CorruptCheckpointError(f"step {step}: the local copy's metadata does not describe this step")
    return meta

  def restore(self, layout: StateLayout, step: int) -> TrainState:
    """This process's shards, put on its devices as `layout` lays them out: the saved and wanted arrays
    must match (LayoutMismatchError), and every shard this process needs must be in its copy."""
    directory = os.path.join(self.root, str(step))
    try:
      with open(os.path.join(directory, LAYOUT)) as f:
        saved = json.load(f)
      files = np.load(os.path.join(directory, SHARDS))
    except (OSError, ValueError) as e:
      raise CorruptCheckpointError(f"step {step}: the local copy does not read ({e})") from e
    wanted = jax.tree.leaves(layout.abstract)
    have = [(s["name"], tuple(s["shape"]), s["dtype"]) for s in saved]
    want = [(n, tuple(a.shape), str(a.dtype)) for n, a in zip(_names(layout.abstract), wanted)]
    if have != want:
      diff = next(f"{h} saved, {w} wanted" for h, w in zip(have + [None] * len(want), want + [None] * len(have))
                  if h != w)
      raise LayoutMismatchError(f"step {step}: the local copy's arrays are not the layout's: {diff}")
    leaves = []
    with files:
      for i, (entry, abstract, sharding) in enumerate(zip(saved, wanted, jax.tree.leaves(layout.shardings))):
        places = {str(p): j for j, p in enumerate(entry["shards"])}
        buffers = []
        for device, index in sharding.addressable_devices_indices_map(abstract.shape).items():
          j = places.get(str(_index(index, abstract.shape)))
          if j is None:
            raise CorruptCheckpointError(f"step {step}: the local copy of process {jax.process_index()} lacks "
                                         f"the part of {entry['name']} its devices hold now (the devices were laid "
                                         "out differently when it was saved)")
          shape = tuple(b - a for a, b in _index(index, abstract.shape))
          try:
            data = files[f"{i}_{j}"].view(jnp.dtype(entry["dtype"])).reshape(shape)
          except (OSError, ValueError, KeyError) as e:
            raise CorruptCheckpointError(f"step {step}: the local copy of {entry['name']} does not read ({e})") from e
          buffers.append(jax.device_put(data, device))
        leaves.append(jax.make_array_from_single_device_arrays(abstract.shape, sharding, buffers))
    return jax.tree.unflatten(jax.tree.structure(layout.abstract), leaves)


class EmergencyCheckpointer:
  """The train loop's Checkpointer (train/checkpointer.py) with two tiers: each host's local copies
  (LocalTier, every local_every steps) and the persistent saves (OrbaxCheckpointer, unchanged)."""

  def __init__(self, workdir: str, config: CheckpointConfig):
    self.config = config
    self.persistent = OrbaxCheckpointer(workdir, config)
    self.local = LocalTier(local_root(config.local_dir, workdir, jax.process_index()), config.local_keep)
    self.save_seconds: List[float] = []
    self._usable: Set[int] = set()  # local steps every process holds, as of the last steps()
    self._resumed_at = 0  # the step restored; local copies past it are from an attempt that did not last
    self._saved_yet = False
    self._last_local: Optional[int] = None  # the step of the newest local save this run started

  def steps(self) -> List[int]:
    """Steps complete in either tier, newest first, the same on every process: a local step counts only
    if every process holds its copy; this process's copies that the others lack are deleted."""
    mine = self.local.steps()
    everyone = hosts.exchange("local_steps", mine)
    self._usable = set(mine).intersection(*map(set, everyone))
    for step in set(mine) - self._usable:
      self.local.drop(step)
    return sorted(self._usable | set(self.persistent.steps()), reverse=True)

  def set_aside_saves(self) -> List[Tuple[str, str]]:
    return self.persistent.set_aside_saves()

  def metadata(self, step: int) -> Dict[str, Any]:
    return self.local.metadata(step) if step in self._usable else self.persistent.metadata(step)

  def restore(self, layout: StateLayout, step: int) -> TrainState:
    if step not in self._usable:
      state = self.persistent.restore(layout, step)
    else:
      self.local.metadata(step)
      state = self.local.restore(layout, step)
      if int(state.step) != step or not bool(all_finite(state.params)):
        raise CorruptCheckpointError(f"step {step}: the local copy is not the finite state of step {step}")
      say_once(f"restored step {step} from the local copies")
    self._resumed_at = step
    return state

  def quarantine(self, step: int, reason: str, alone: bool = False) -> None:
    """A damaged local copy is deleted on every process (each its own; the persistent save of the same
    step, if any, is tried next); a damaged persistent save is set aside as before."""
    if step not in self._usable:
      self.persistent.quarantine(step, reason, alone)
      return
    self.local.drop(step)
    self._usable.discard(step)
    say_once(f"the local copy of step {step} cannot be used ({reason.removeprefix(f'step {step}: ')}); deleted")

  def due(self, step: int) -> bool:
    return self.persistent.due(step) or step % self.config.local_every == 0

  def save(self, state: TrainState, step: int, force: bool = False,
           metadata: Optional[Dict[str, Any]] = None) -> bool:
    """The local copy first (it lands in seconds, even on a preemption's notice), then the persistent save
    if due; returns whether either was started."""
    start = time.time()
    if not self._saved_yet:  # copies past the restored step belong to an attempt this one replaces
      self._saved_yet = True
      for old in self.local.steps():
        if old > self._resumed_at:
          self.local.drop(old)
    local = ((force or step % self.config.local_every == 0) and step != self._last_local
             and step not in self.local.steps())
    if local:
      self.local.save(state, step, dict(metadata or {}))
      self._last_local = step
    persistent = self.persistent.save(state, step, force=force, metadata=metadata)
    if local or persistent:
      self.save_seconds.append(time.time() - start)
      if local:
        say_once(f"saving step {step} locally")
    return local or persistent

  def wait(self) -> None:
    self.local.wait()
    self.persistent.wait()

  def close(self) -> None:
    try:
      self.local.wait()
    finally:
      self.persistent.close()
