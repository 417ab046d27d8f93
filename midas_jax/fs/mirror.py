"""A local directory that a library writes into, copied to a remote one as it changes, off the caller's thread.

For writers that only write local files and keep them open (tensorboardX's event files,
jax.profiler's traces): they write into `Mirror.local`, and a background thread (fs/background.py)
uploads every file that is new or has grown, at most once per `min_interval` seconds, retrying what
storage refuses. For a local target, `local` is the target itself and nothing is copied. The mirror
is for outputs that can be rebuilt or lost without harm (a run's curves, traces): a run killed
between two uploads loses what the last one had not sent; close() sends the rest.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict, Tuple

from midas_jax.fs import paths
from midas_jax.fs.background import Periodic

CLOSE_SECONDS = 600.0  # a profile trace can be hundreds of MB; an exit waits this long at most


class Mirror:
  """`local` is where to write; its changes reach `target` within `min_interval` s (plus the upload)."""

  def __init__(self, target: str, min_interval: float = 10.0):
    self.target = paths.check(target, "path")
    self.remote = paths.is_remote(self.target)
    self._sent: Dict[str, Tuple[int, int]] = {}
    self._uploader = None
    if self.remote:
      self.local = tempfile.mkdtemp(prefix="midas_mirror_")
      self._uploader = Periodic(self._sync, max(min_interval, 1.0), what=f"the mirror of {self.target}")
    else:
      paths.makedirs(self.target)
      self.local = self.target

  def _sync(self) -> None:
    """Uploads what changed since the last upload (on the uploader's thread); raises what storage refused."""
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

  def close(self, timeout: float = CLOSE_SECONDS) -> bool:
    """A last upload (tried for up to `timeout` s); the local copy of a remote target is removed."""
    if self._uploader is None:
      return True
    uploader, self._uploader = self._uploader, None
    sent = uploader.close(timeout, lost=lambda: f"{self.target}: the last changes could not be copied there")
    shutil.rmtree(self.local, ignore_errors=True)
    return sent
