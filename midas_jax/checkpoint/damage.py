"""What counts as evidence that a save is damaged, and how a damaged save is set aside.

A save is damaged only on evidence about its bytes: an item missing, metadata that does not describe the
step, arrays whose shapes or dtypes are not the layout's, values that are not finite, a file that cannot be
decoded (tensorstore's DATA_LOSS, a read past the end of an emptied or truncated file, a zstd or JSON
decode error). A storage error (fs/storage_errors.py) says nothing about the bytes and is never evidence;
neither is a host running out of memory, nor an error nobody recognises: setting a good save aside on
those loses work, and setting every save aside used to start the run again from step 0.

A damaged save is set aside, never deleted: a marker (MARKER, which says why) is written into its
directory, so that listings skip it at once, and the directory is then moved to `corrupt-<step>-<time>`
beside it by a rename (on a bucket the store moves each object itself: no byte passes through this
process). If the move is interrupted, the marker still keeps the save out of the listings.
"""

from __future__ import annotations

import json
import re
import time
from typing import Dict, List, Optional, Tuple

from midas_jax import fs
from midas_jax.fs import storage_errors

MARKER = "midas_damaged.json"
SET_ASIDE_PREFIX = "corrupt-"
_TS_DAMAGE = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND")  # tensorstore: undecodable, past the end, missing
_DECODE_WORDS = re.compile(r"zstd|checksum|crc32c|decompress|corrupt|unexpected end|error decoding|error parsing",
                           re.I)
_MISSING_ITEM = re.compile(r'Item "[^"]+" was not found in the checkpoint')
_SHAPE = re.compile(r"Requested shape: .* is not compatible with the stored shape")


class CorruptCheckpointError(RuntimeError):
  """Evidence that a save is damaged (an item missing, undecodable bytes, bad metadata, wrong shapes)."""


class LayoutMismatchError(CorruptCheckpointError):
  """A save's arrays are not of the shapes and dtypes of the layout it is restored into: damage, unless the
  config was changed on purpose (an allowed model change), which the caller tells apart."""


def _chain(error: BaseException) -> List[BaseException]:
  out, e = [], error
  while e is not None and len(out) < 16 and e not in out:
    out.append(e)
    e = e.__cause__ or e.__context__
  return out


def evidence(error: BaseException) -> Optional[str]:
  """What in `error` shows the save is damaged, or None when it shows nothing about the save.

  A storage error is never evidence, even when it wraps one that reads like it (a 503 on a read of a file).
  """
  if storage_errors.classify(error) is not None:
    return None
  for e in _chain(error):
    message = str(e)
    status = message.split(":", 1)[0]
    if isinstance(e, ValueError) and status in _TS_DAMAGE:
      return _short(message)
    if isinstance(e, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, EOFError)):
      return f"{type(e).__name__}: {_short(message)}"
    if isinstance(e, KeyError) and _MISSING_ITEM.search(message):
      return f"missing item: {_short(message)}"
    if isinstance(e, ValueError) and (_SHAPE.search(message) or _DECODE_WORDS.search(message)):
      return f"{type(e).__name__}: {_short(message)}"
  return None


def out_of_memory(error: BaseException) -> bool:
  """Whether `error` is this host running out of memory (host or accelerator), not a fact about the save."""
  for e in _chain(error):
    if isinstance(e, MemoryError):
      return True
    message = str(e)
    if "RESOURCE_EXHAUSTED" in message and re.search(r"memory|\bOOM\b|allocat", message, re.I):
      return True
  return False


def _short(message: str, limit: int = 400) -> str:
  line = " ".join(message.split())
  return line if len(line) <= limit else line[:limit] + " ..."


def is_marked(step_dir: str) -> bool:
  """Whether a save carries the marker of a set-aside that did not finish (the move was interrupted)."""
  return fs.exists(fs.join(step_dir, MARKER))


def set_aside(directory: str, step: int, why: str) -> str:
  """Marks the save of `step` under `directory` damaged, then moves it beside; returns where it went."""
  src = fs.join(directory, str(step))
  dst = fs.join(directory, f"{SET_ASIDE_PREFIX}{step}-{int(time.time())}")
  fs.write_json(fs.join(src, MARKER), {"step": step, "reason": why, "time": time.time(), "moved_to": dst})
  fs.rename(src, dst)
  return dst


def set_aside_saves(directory: str) -> List[Tuple[str, str]]:
  """(name, why) of each save set aside under `directory`, oldest first, read from their markers."""
  if not fs.isdir(directory):
    return []
  found = []
  for name in fs.listdir(directory):
    if name.startswith(SET_ASIDE_PREFIX):
      found.append((name, reason(fs.join(directory, name))))
  return found


def reason(path: str) -> str:
  """Why the save at `path` was set aside, as its marker says."""
  try:
    record: Dict = fs.read_json(fs.join(path, MARKER))
    return str(record.get("reason", "no reason recorded"))
  except (OSError, ValueError):  # set aside before markers existed, or the marker is unreadable
    return "set aside earlier (no readable marker)"
