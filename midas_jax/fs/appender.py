"""Files written a line at a time (a run's metrics.jsonl), durable after every write, on any path.

A local file is kept open in append mode and flushed after each write. An object store has no
appends, so there the whole text is kept and uploaded again after each write: the object is
replaced at once (an upload is atomic), so a reader or a killed writer never sees a torn file.
Each upload costs one request of the file's size; metrics files stay in the megabytes.
"""

from __future__ import annotations

from typing import List, Optional

from midas_jax.fs import paths


class Appender:
  """Appends text to `path`; what was there already is kept (`initial` replaces it if given)."""

  def __init__(self, path: str, initial: Optional[str] = None):
    self.path = paths.check(path, "path")
    self._remote = paths.is_remote(self.path)
    if initial is not None:
      paths.write_text(self.path, initial)
    self._chunks: List[str] = []
    self._file = None
    if self._remote:
      self._chunks = [paths.read_text(self.path)] if paths.exists(self.path) else []
    else:
      paths.makedirs(paths.dirname(self.path))
      self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with

  def write(self, text: str) -> None:
    if self._file is not None:
      self._file.write(text)
      self._file.flush()
      return
    if self._chunks is None:
      raise RuntimeError(f"write to {self.path} after close()")
    self._chunks.append(text)
    paths.write_text(self.path, "".join(self._chunks))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    self._chunks = None
