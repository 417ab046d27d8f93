"""Append-only text files (a run's metrics.jsonl) on any path, written without waiting on storage.

A local file is kept open in append mode and flushed at each write: a line is on disk when its write
returns, for the price of a system call. An object store cannot append, and GCS takes about one
update per second to one object, so there the text is kept as numbered parts, `<name>.000000`,
`<name>.000001`, ..., that readers concatenate in order (`read_appended`). write() only hands the
text over in memory; a background thread (fs/background.py) uploads the part being filled every
`flush_seconds`, and a part that reaches `part_chars` is closed and the next one started, so one
upload never exceeds that size however long the run. A part appears whole when its upload completes:
a reader or a killed writer never sees a torn line.

Durability on an object store: a write is stored within `flush_seconds` (5 s by default) plus one
upload while storage answers; flush() stores what was written at once (bounded by its timeout), and
close() stores the rest (retried for up to its timeout). A SIGKILL loses at most the writes since the
last flush() or interval. While storage refuses writes (an outage), they wait in
memory and are retried; past `max_backlog_chars` of them new writes are dropped, and that is said once.
"""

from __future__ import annotations

import re
import threading
from typing import Callable, List, Optional, Tuple

from midas_jax.console import say
from midas_jax.fs import paths
from midas_jax.fs.background import Periodic

FLUSH_SECONDS = 5.0
PART_CHARS = 1 << 20
MAX_BACKLOG_CHARS = 64 << 20
CLOSE_SECONDS = 30.0
MIN_FLUSH_SECONDS = 1.0  # GCS's rate for updates to one object
_NUMBER = re.compile(r"\.(\d{6,})")


def _part_path(path: str, number: int) -> str:
  return f"{path}.{number:06d}"


def _listing(directory: str) -> List[str]:
  """The names in `directory` as storage has them now: gcsfs answers a listing from the ones it made before
  (paths.refresh), through which a long-lived reader would never see a part written since."""
  paths.refresh(directory)
  try:
    return paths.listdir(directory)
  except FileNotFoundError:
    return []


def _parts(path: str) -> List[Tuple[int, str]]:
  """(number, path) of the numbered parts of `path`, in order; the plain file itself comes first, as -1."""
  name = paths.basename(path)
  names = _listing(paths.dirname(path))
  found = [(-1, path)] if name in names else []
  for entry in names:
    match = _NUMBER.fullmatch(entry[len(name):]) if entry.startswith(name) else None
    if match:
      found.append((int(match.group(1)), paths.join(paths.dirname(path), entry)))
  return sorted(found)


def _read_pieces(path: str) -> List[Tuple[int, str, str]]:
  """(number, path, text) of the file and its parts, in the order they concatenate.

  A part removed since it was listed (a restart's filter) is left out.
  """
  pieces = []
  for number, piece in _parts(path):
    try:
      pieces.append((number, piece, paths.read_text(piece)))
    except FileNotFoundError:
      continue
  return pieces


def read_appended(path: str) -> str:
  """The whole text of an appended file: the file itself (if any), then its numbered parts."""
  return "".join(text for _, _, text in _read_pieces(path))


def appended_exists(path: str) -> bool:
  return bool(_parts(path))


def _kept_lines(text: str, keep: Callable[[str], bool]) -> List[str]:
  """The whole lines of `text` that `keep` accepts (a cut-off last line is never kept)."""
  return [line for line in text.splitlines(keepends=True) if line.endswith("\n") and keep(line)]


def _filter_pieces(pieces: List[Tuple[int, str, str]], keep: Callable[[str], bool]) -> List[Tuple[int, str, str]]:
  """Rewrites the pieces that hold refused lines, last first, and deletes those left empty.

  Last first, so that a writer killed half-way leaves what was there less some refused lines, which the
  next filter refuses again. Returns the pieces as they are now (empty ones left out).
  """
  now = []
  for number, piece, text in reversed(pieces):
    kept = "".join(_kept_lines(text, keep))
    if kept != text:
      if kept or number < 0:
        paths.write_text(piece, kept)
      else:
        paths.remove(piece)
    if kept or number < 0:
      now.append((number, piece, kept))
  return now[::-1]


class _Part:
  """One numbered part: its text as chunks (joined at upload), how many of them are stored."""

  def __init__(self, number: int, text: str = ""):
    self.number = number
    self.chunks = [text] if text else []
    self.chars = len(text)
    self.stored = len(self.chunks)


class Appender:
  """Appends text to `path` after what is there already.

  keep: a restart's filter: the lines already there that it refuses are removed first (their file or
  part rewritten), and `kept` holds the lines it accepted. Parts are used on an object store, or where
  parts exist already (a copy of such a run).
  """

  def __init__(self, path: str, keep: Optional[Callable[[str], bool]] = None,
               flush_seconds: float = FLUSH_SECONDS, part_chars: int = PART_CHARS,
               max_backlog_chars: int = MAX_BACKLOG_CHARS):
    self.path = paths.check(path, "path")
    self.kept: List[str] = []
    self.dropped = 0  # writes refused because too many were waiting for storage
    self._part_chars, self._max_backlog = part_chars, max_backlog_chars
    self._file = None
    self._uploader = None
    if keep is None:
      last = [(n, piece, None) for n, piece in _parts(self.path) if n >= 0][-1:]
    else:
      pieces = _filter_pieces(_read_pieces(self.path), keep)
      self.kept = [line for _, _, text in pieces for line in text.splitlines(keepends=True)]
      last = [piece for piece in pieces if piece[0] >= 0][-1:]
    if not paths.is_remote(self.path) and not last:
      paths.makedirs(paths.dirname(self.path))
      self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
      return
    number, text = 0, ""
    if last:  # the last part is continued
      number, piece, text = last[0]
      text = paths.read_text(piece) if text is None else text
    if len(text) >= part_chars:
      number, text = number + 1, ""
    self._parts = [_Part(number, text)]
    self._backlog = 0  # characters written and not yet stored
    self._lock = threading.Lock()
    self._uploader = Periodic(self._store, max(flush_seconds, MIN_FLUSH_SECONDS), what=self.path)

  def write(self, text: str) -> None:
    if self._file is not None:
      self._file.write(text)
      self._file.flush()
      return
    if self._uploader is None:
      raise RuntimeError(f"write to {self.path} after close()")
    with self._lock:
      if self._backlog + len(text) > self._max_backlog:
        self.dropped += 1
        first = self.dropped == 1
      else:
        first = False
        part = self._parts[-1]
        if part.chars and part.chars + len(text) > self._part_chars:
          part = _Part(part.number + 1)
          self._parts.append(part)
        part.chunks.append(text)
        part.chars += len(text)
        self._backlog += len(text)
    if first:
      say(f"{self.path}: {self._backlog / 1e6:.1f} MB of writes are waiting for storage; "
          "further writes are dropped until it takes them")

  def _store(self) -> None:
    """Uploads every part with text not yet stored, in order (on the uploader's thread)."""
    with self._lock:
      todo = [(part, part.chunks[:]) for part in self._parts if part.stored < len(part.chunks)]
    for part, chunks in todo:
      paths.write_text(_part_path(self.path, part.number), "".join(chunks))
      with self._lock:
        self._backlog -= sum(len(c) for c in chunks[part.stored:])
        part.stored = len(chunks)
        while len(self._parts) > 1 and self._parts[0].stored == len(self._parts[0].chunks):
          self._parts.pop(0)  # a full part, stored: no longer needed in memory

  def flush(self, timeout: float) -> bool:
    """Stores what was written so far now, waiting up to `timeout` s on an object store; whether it was
    stored (if not, it stays queued). A local file is flushed at every write already."""
    return self._uploader is None or self._uploader.flush(timeout)

  def close(self, timeout: float = CLOSE_SECONDS) -> bool:
    """Stores what is left (for up to `timeout` s on an object store); whether everything was stored."""
    if self._file is not None:
      self._file.close()
      self._file = None
      return True
    if self._uploader is None:
      return True
    uploader, self._uploader = self._uploader, None
    stored = uploader.close(timeout, lost=lambda: f"{self.path}: {self._backlog} characters of writes could not be "
                                                  "stored before exit")
    if self.dropped:
      say(f"{self.path}: {self.dropped} writes were dropped while storage was refusing them")
    return stored and not self.dropped
