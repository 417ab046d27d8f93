"""Random access into a split of a prepared store, by global token position, in ranged reads.

A split is its shards' token streams one after another (global token positions [0, tokens)). The
reader holds one row per shard (where its documents and tokens start) and, per shard it has
touched, the coarse index (one offset per 1024 documents); per-document offsets and tokens stay on
disk and are read as needed: finding the documents under a token range is a bisection in the
coarse index and one read of at most ~1024 offsets, and its tokens are one read. Memory therefore
does not grow with the corpus, beyond 8 bytes per 1024 documents (docs/data.md#how-a-prepared-store-is-read).

Files are read through midas_jax.fs (open, seek, read), so a store on gs:// reads like a local one.
Each file is opened on first use and kept open, up to MAX_OPEN files (least recently used closed).
"""

from __future__ import annotations

import collections
import threading
from typing import Dict, List, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.data.store import format as store_format
from midas_jax.errors import ConfigError

MAX_OPEN = 128


class FilePool:
  """Ranged reads of files through midas_jax.fs; safe to call from several threads."""

  def __init__(self, max_open: int = MAX_OPEN):
    self._max_open = max_open
    self._open: "collections.OrderedDict[str, Tuple[object, threading.Lock]]" = collections.OrderedDict()
    self._lock = threading.Lock()

  def _handle(self, path: str):
    with self._lock:
      if path in self._open:
        self._open.move_to_end(path)
        return self._open[path]
      entry = (fs.as_epath(path).open("rb"), threading.Lock())
      self._open[path] = entry
      while len(self._open) > self._max_open:
        _, (old, old_lock) = self._open.popitem(last=False)
        with old_lock:
          old.close()
      return entry

  def read(self, path: str, offset: int, nbytes: int) -> bytes:
    while True:
      f, lock = self._handle(path)
      with lock:
        if f.closed:  # evicted by another thread meanwhile: open it again
          continue
        f.seek(offset)
        data = f.read(nbytes)
      break
    if len(data) != nbytes:
      raise ConfigError("DataConfig.prepared_dir", f"{path!r} ends before byte {offset + nbytes:,} (the file "
                        "was truncated after the run started)", "prepare the store again")
    return data

  def close(self) -> None:
    with self._lock:
      for f, lock in self._open.values():
        with lock:
          f.close()
      self._open.clear()


class SplitReader:
  """One split of a store: documents and tokens by global token position."""

  def __init__(self, store: str, shards: List[Dict[str, object]], dtype: np.dtype, pool: FilePool):
    self.store, self.shards, self.dtype, self.pool = store, shards, np.dtype(dtype), pool
    self.doc_starts = np.concatenate([[0], np.cumsum([s["documents"] for s in shards])]).astype(np.int64)
    self.token_starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards])]).astype(np.int64)
    self.documents, self.tokens = int(self.doc_starts[-1]), int(self.token_starts[-1])
    self._files = [store_format.shard_files(store, s["name"]) for s in shards]
    self._index: Dict[int, np.ndarray] = {}
    self._index_lock = threading.Lock()

  def _coarse(self, shard: int) -> np.ndarray:
    with self._index_lock:
      if shard not in self._index:
        n = store_format.index_length(self.shards[shard]["documents"])
        self._index[shard] = self._array(self._files[shard]["index"], 0, n, store_format.OFFSET_DTYPE)
      return self._index[shard]

  def _array(self, path: str, first: int, count: int, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(self.pool.read(path, first * dtype.itemsize, count * dtype.itemsize), dtype)

  def _shard_documents(self, shard: int, start: int, stop: int) -> Tuple[np.ndarray, np.ndarray]:
    """(index in the shard, start offset) of each document overlapping local tokens [start, stop),
    and the end offset of the last: one read of the offsets between two coarse index entries."""
    index, every = self._coarse(shard), store_format.INDEX_EVERY
    g0 = int(np.searchsorted(index, start, side="right")) - 1
    g1 = int(np.searchsorted(index, stop - 1, side="right")) - 1
    first, last = g0 * every, min((g1 + 1) * every, self.shards[shard]["documents"])
    offsets = self._array(self._files[shard]["offsets"], first, last - first + 1, store_format.OFFSET_DTYPE)
    d0 = int(np.searchsorted(offsets, start, side="right")) - 1
    d1 = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
    return first + np.arange(d0, d1 + 1), offsets[d0:d1 + 2]

  def pieces(self, start: int, stop: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documents under global tokens [start, stop) and how much of each lies there:
    (document index in the split, first token used within the document, tokens used), in order."""
    docs, firsts, sizes = [], [], []
    shard = int(np.searchsorted(self.token_starts, start, side="right")) - 1
    while start < stop:
      base = int(self.token_starts[shard])
      local_stop = min(stop, int(self.token_starts[shard + 1])) - base
      index, bounds = self._shard_documents(shard, start - base, local_stop)
      lo = np.maximum(bounds[:-1], start - base)
      hi = np.minimum(bounds[1:], local_stop)
      docs.append(index + self.doc_starts[shard])
      firsts.append(lo - bounds[:-1])
      sizes.append(hi - lo)
      start, shard = base + local_stop, shard + 1
    return tuple(np.concatenate(a).astype(np.int64) for a in (docs, firsts, sizes))

  def read_tokens(self, start: int, stop: int) -> np.ndarray:
    """Global tokens [start, stop) as int32."""
    parts = []
    shard = int(np.searchsorted(self.token_starts, start, side="right")) - 1
    while start < stop:
      base = int(self.token_starts[shard])
      end = min(stop, int(self.token_starts[shard + 1]))
      parts.append(self._array(self._files[shard]["tokens"], start - base, end - start, self.dtype))
      start, shard = end, shard + 1
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
