"""What counts as evidence that a save is damaged, and how a damaged save is set aside.

A save is damaged only on evidence about its bytes: an item missing, metadata that does not describe the
step, arrays whose shapes or dtypes are not the layout's, values that are not finite, a file that cannot be
decoded. A storage error (fs/storage_errors.py) says nothing about the bytes and is never evidence;
neither is a host running out of memory, nor an error nobody recognises: setting a good save aside on
those loses work, and setting every save aside used to start the run again from step 0.

The evidence is read from types and status codes wherever the libraries give them, not from how they word a
message, so that an upgrade that rewords one cannot turn damage into an unrecognised error (a restart loop):
builtin types (a file missing, JSON that does not parse, a read past the end), and the absl status codes
tensorstore raises for the array files (exception_chain.status_code): DATA_LOSS (undecodable), OUT_OF_RANGE
(a file shorter than its index says: emptied, truncated), NOT_FOUND (a file or key missing), and
FAILED_PRECONDITION read from a local file (a compressed value that does not decompress). Where orbax or
tensorstore give nothing but words, the narrowest match on them is kept and names the version it was read
from (_ORBAX_MISSING_ITEM, _ORBAX_SHAPE, _TS_UNDECODABLE); tests/test_damage_types.py makes each error with
the library itself, so an upgrade that changes one fails there.

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
from midas_jax.exception_chain import links, status_code
from midas_jax.fs import storage_errors

MARKER = "midas_damaged.json"
SET_ASIDE_PREFIX = "corrupt-"
_TS_DAMAGE = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND")  # tensorstore: undecodable, past the end, missing
_TS_LOCAL_DAMAGE = ("FAILED_PRECONDITION",)  # tensorstore, with no HTTP status: a value that does not decompress
_BYTE_ERRORS = (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, EOFError)
# Words, where the library gives nothing else. orbax 0.12.8 raises a builtin KeyError for an item the save
# lacks (CompositeCheckpointHandler.restore) and a builtin ValueError for an array stored with another shape
# than its metadata's (serialization.py): no type or code of their own.
_ORBAX_MISSING_ITEM = re.compile(r'^Item "[^"]+" was not found in the checkpoint')
_ORBAX_SHAPE = re.compile(r"^Requested shape: .* is not compatible with the stored shape")
# tensorstore 0.1.86 raises INVALID_ARGUMENT as a ValueError without its code (python/tensorstore/status.cc
# drops it: the type implies it); a zstd stream that does not decode (an OCDBT b-tree node) is one. Its decoders
# word that "Error decoding <what>: ...", matched only on a ValueError that carries no status code.
_TS_UNDECODABLE = re.compile(r"\bError decoding [\w -]+: ")


class CorruptCheckpointError(RuntimeError):
  """Evidence that a save is damaged (an item missing, undecodable bytes, bad metadata, wrong shapes)."""


class LayoutMismatchError(CorruptCheckpointError):
  """A save's arrays are not of the shapes and dtypes of the layout it is restored into: damage, unless the
  config was changed on purpose (an allowed model change), which the caller tells apart."""


def evidence(error: BaseException) -> Optional[str]:
  """What in `error` shows the save is damaged, or None when it shows nothing about the save.

  A storage error is never evidence, even when it wraps one that reads like it (a 503 on a read of a file).
  """
  if storage_errors.classify(error) is not None:
    return None
  for e in links(error):
    found = _evidence(e)
    if found is not None:
      return found
  return None


def _evidence(e: BaseException) -> Optional[str]:
  message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
  if isinstance(e, _BYTE_ERRORS):
    return f"{type(e).__name__}: {_short(message)}"
  if not isinstance(e, ValueError):
    return (f"missing item: {_short(message)}" if type(e) is KeyError  # pylint: disable=unidiomatic-typecheck
            and _ORBAX_MISSING_ITEM.match(message) else None)
  code = status_code(e)
  if code in _TS_DAMAGE or (code in _TS_LOCAL_DAMAGE and storage_errors.http_status(e) is None):
    return _short(message)
  if code is None and (_ORBAX_SHAPE.match(message) or _TS_UNDECODABLE.search(message)):
    return f"{type(e).__name__}: {_short(message)}"
  return None


def out_of_memory(error: BaseException) -> bool:
  """Whether `error` is this host running out of memory (host or accelerator), not a fact about the save:
  a MemoryError, or a runtime error with the RESOURCE_EXHAUSTED status (jax's JaxRuntimeError carries it as
  `error_code_string`; older jaxlib's XlaRuntimeError as its message's prefix). tensorstore's ValueErrors
  are not runtime errors: their RESOURCE_EXHAUSTED is the store's (a 429), which storage_errors reads."""
  return any(isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and status_code(e) == "RESOURCE_EXHAUSTED")
             for e in links(error))


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
