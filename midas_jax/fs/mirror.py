"""A local directory that a library writes into, copied to a remote one as it changes.

For writers that only write local files and keep them open (tensorboardX's event files,
jax.profiler's traces): they write into `Mirror.local`, and `sync()` uploads every file that is new
or has grown since the last upload. For a local target, `local` is the target itself and nothing
is copied. The mirror is for outputs that can be rebuilt or lost without harm (a run's curves,
traces): a run killed between two syncs loses what the last sync had not sent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Dict, Tuple

from midas_jax.fs import paths


class Mirror:
  """`local` is where to write; `sync()` copies it to `target` at most every `min_interval` s."""

  def __init__(self, target: str, min_interval: float = 10.0):
    self.target = paths.check(target, "path")
    self.remote = paths.is_remote(self.target)
    self.min_interval = min_interval
    self._sent: Dict[str, Tuple[int, int]] = {}
    self._last = 0.0
    if self.remote:
      self.local = tempfile.mkdtemp(prefix="midas_mirror_")
    else:
      paths.makedirs(self.target)
      self.local = self.target

  def sync(self, force: bool = False) -> int:
    """Uploads what changed; returns the number of files sent."""
    if not self.remote or (not force and time.time() - self._last < self.min_interval):
      return 0
    sent = 0
    for root, _, files in os.walk(self.local):
      for name in files:
        local = os.path.join(root, name)
        stat = os.stat(local)
        key = (stat.st_size, stat.st_mtime_ns)
        if self._sent.get(local) == key:
          continue
        rel = os.path.relpath(local, self.local).replace(os.sep, "/")
        paths.copy(local, paths.join(self.target, rel))
        self._sent[local] = key
        sent += 1
    self._last = time.time()
    return sent

  def close(self) -> None:
    """A last sync; the local copy of a remote target is removed."""
    if self.remote and os.path.isdir(self.local):
      self.sync(force=True)
      shutil.rmtree(self.local, ignore_errors=True)
