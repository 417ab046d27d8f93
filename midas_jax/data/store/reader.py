"""Random access into a split of a prepared store, by global token position, in batched ranged reads.

A split is its shards' token streams one after another (global token positions [0, tokens)). The
reader holds one row per shard (where its documents and tokens start) and, per shard it has
touched, the coarse index (one offset per 1024 documents); per-document offsets and tokens stay on
disk and are read as needed: finding the documents under a token range is a bisection in the
coarse index and one read of at most ~1024 offsets, and its tokens are one read. Memory therefore
does not grow with the corpus, beyond 8 bytes per 1024 documents (docs/data.md#how-a-prepared-store-is-read).

On an object store a read costs a round trip, whatever its size, so `read` takes every range a
batch needs at once and fetches them in at most two rounds of concurrent ranged reads
(midas_jax.fs.ranges): the coarse indices of shards not seen before, then the offsets and tokens
of every range together. Every byte position comes from the manifest's counts, so no file is
opened and no metadata is asked for.

A bucket also takes only so many requests a second (GCS: about 5,000 reads per bucket before it scales
up, docs/pods.md#the-stores-request-rate), so the ranges of one round that lie in one file less than
`merge_gap` bytes apart are one request (the rows' offsets reads of a shard mostly are). A request
that meets a transient storage fault (HTTP 408, 429, 5xx, a reset, refused credentials:
midas_jax.fs.storage_errors) after the client's own retries is tried again after a pause that doubles
up to 32 s, with jitter, until `retry_timeout_s` have passed since the round began; then the read
stops the run with StorageUnavailableError (exit status 75: run it again later). Any other error (a 403,
a file shorter than the manifest says) is not tried again.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from midas_jax.data.store import format as store_format
from midas_jax.errors import ConfigError, StorageUnavailableError
from midas_jax.fs import ranges as fs_ranges
from midas_jax.fs import storage_errors

Pieces = Tuple[np.ndarray, np.ndarray, np.ndarray]  # (document in the split, first token used, tokens used)
_EMPTY = np.zeros(0, np.int64)
FIRST_PAUSE_S, LONGEST_PAUSE_S = 1.0, 32.0  # between tries of a failed request: doubling, as GCS advises


class SplitReader:
  """One split of a store: documents and tokens by global token position; safe to call from several threads.

  limit: the ranged reads one call has in flight at most (DataConfig.read_threads). merge_gap: ranges of
  one file less than this many bytes apart are one request (DataConfig.read_merge_gap_bytes; None: every
  range its own request, as before coalescing). retry_timeout_s: how long a round's failed requests are
  tried again (DataConfig.read_retry_timeout_s)."""

  def __init__(self, store: str, shards: List[Dict[str, object]], dtype: np.dtype, limit: int = 64,
               merge_gap: Optional[int] = 256 * 1024, retry_timeout_s: float = 300.0):
    self.store, self.shards, self.dtype, self.limit = store, shards, np.dtype(dtype), limit
    self.merge_gap, self.retry_timeout_s = merge_gap, retry_timeout_s
    self.doc_starts = np.concatenate([[0], np.cumsum([s["documents"] for s in shards])]).astype(np.int64)
    self.token_starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards])]).astype(np.int64)
    self.documents, self.tokens = int(self.doc_starts[-1]), int(self.token_starts[-1])
    self._files = [store_format.shard_files(store, s["name"]) for s in shards]
    self._index: Dict[int, np.ndarray] = {}
    self._lock = threading.Lock()
    self.ranges = 0  # byte ranges asked for: the requests there would be without coalescing
    self.requests = 0  # requests made (after coalescing, tries again included), for benchmarks and tests
    self.retries = 0  # of those, tries again after a transient fault
    self.sleep: Callable[[float], None] = time.sleep  # the pauses between tries, and their clock: tests may
    self.clock: Callable[[], float] = time.monotonic  # count the pauses on a clock of their own instead
    self._jitter = random.Random()  # its own: the global generator's state stays the caller's

  def _fetch(self, wanted: Sequence[Tuple[str, int, int]]) -> List[bytes]:
    """The bytes of each range, coalesced into fewer requests, those that meet a transient fault tried again."""
    if self.merge_gap is None:
      requests, places = list(wanted), [(i, 0) for i in range(len(wanted))]
    else:
      requests, places = fs_ranges.coalesce(wanted, self.merge_gap)
    with self._lock:
      self.ranges += len(wanted)
    try:
      got = self._requests(requests)
    except (EOFError, FileNotFoundError) as e:
      raise ConfigError("DataConfig.prepared_dir", f"{e} (the store changed after the run started)",
                        "prepare the store again") from e
    return fs_ranges.cut(wanted, places, got)

  def _requests(self, requests: List[Tuple[str, int, int]]) -> List[bytes]:
    """Each request's bytes; failed ones tried again while their faults are transient (module doc)."""
    got: List[bytes] = [b""] * len(requests)
    pending, tries, began, pause = list(range(len(requests))), 0, self.clock(), FIRST_PAUSE_S
    while pending:
      with self._lock:
        self.requests += len(pending)
        self.retries += len(pending) if tries else 0
      tries += 1
      with storage_errors.quiet_clients():
        try:
          outcomes = fs_ranges.fetch([requests[i] for i in pending], self.limit)
        except Exception as e:  # pylint: disable=broad-except
          outcomes = [e] * len(pending)  # a local read raises: every pending request met it
      failed = []
      for i, outcome in zip(pending, outcomes):
        if isinstance(outcome, BaseException):
          failed.append((i, outcome))
        else:
          got[i] = outcome
      if not failed:
        break
      error = failed[0][1]
      fault = storage_errors.classify(error)
      for _, e in failed:
        other = storage_errors.classify(e)
        if other is None or not other.transient:
          error, fault = e, other
          break
      if fault is None or not fault.transient:
        raise error
      waited = self.clock() - began
      wait = pause * self._jitter.uniform(0.5, 1.0)  # jitter: the hosts of a slice do not come back in step
      if waited + wait > self.retry_timeout_s:
        raise self._gave_up(error, tries, waited) from error
      self.sleep(wait)
      pause = min(2 * pause, LONGEST_PAUSE_S)
      pending = [i for i, _ in failed]
    return got

  def _gave_up(self, error: BaseException, tries: int, waited: float) -> StorageUnavailableError:
    said, _, fix = str(storage_errors.unavailable(error, self.store, "reading the prepared store")).partition("\n")
    return StorageUnavailableError(
        f"{said}. Gave up after {tries} tries over {waited:.0f} s (DataConfig.read_retry_timeout_s = "
        f"{self.retry_timeout_s:g}), each on top of the storage client's own retries; nothing was trained on the "
        f"batch not read, so the same command run later resumes from the last save\n{fix}; a bucket that answers "
        "429 is still scaling up to the slice's request rate (docs/pods.md#the-stores-request-rate): a longer "
        "DataConfig.read_retry_timeout_s waits it out")

  def _load_indices(self, shards) -> None:
    """The coarse index of every shard in `shards` not read before, in one round."""
    with self._lock:
      missing = sorted(s for s in set(shards) if s not in self._index)
    if not missing:
      return
    nbytes = [store_format.index_length(self.shards[s]["documents"]) * 8 for s in missing]
    got = self._fetch([(self._files[s]["index"], 0, n) for s, n in zip(missing, nbytes)])
    with self._lock:
      for s, data in zip(missing, got):
        self._index[s] = np.frombuffer(data, store_format.OFFSET_DTYPE)

  def load_every_index(self) -> None:
    """The coarse index of every shard, in one round: what a long run holds after its first steps (benchmarks
    count the requests of the steps after)."""
    self._load_indices(range(len(self.shards)))

  def _segments(self, ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int, int]]:
    """(range, shard, local start, local stop) for each shard's part of each global range."""
    out = []
    for i, (start, stop) in enumerate(ranges):
      shard = int(np.searchsorted(self.token_starts, start, side="right")) - 1
      while start < stop:
        base, end = int(self.token_starts[shard]), min(stop, int(self.token_starts[shard + 1]))
        out.append((i, shard, start - base, end - base))
        start, shard = end, shard + 1
    return out

  def read(self, ranges: Sequence[Tuple[int, int]]) -> List[Tuple[Pieces, np.ndarray]]:
    """For each global token range [start, stop): the documents under it and how much of each lies
    there (pieces, in order), and its tokens as int32."""
    segments = self._segments(ranges)
    self._load_indices(s for _, s, _, _ in segments)
    every, wanted, firsts = store_format.INDEX_EVERY, [], []
    for _, shard, start, stop in segments:
      index = self._index[shard]
      g0 = int(np.searchsorted(index, start, side="right")) - 1
      g1 = int(np.searchsorted(index, stop - 1, side="right")) - 1
      first, last = g0 * every, min((g1 + 1) * every, self.shards[shard]["documents"])
      wanted.append((self._files[shard]["offsets"], first * 8, (last + 1) * 8))
      wanted.append((self._files[shard]["tokens"], start * self.dtype.itemsize, stop * self.dtype.itemsize))
      firsts.append(first)
    got = self._fetch(wanted)
    parts: List[List[Tuple[Pieces, np.ndarray]]] = [[] for _ in ranges]
    for k, (i, shard, start, stop) in enumerate(segments):
      offsets = np.frombuffer(got[2 * k], store_format.OFFSET_DTYPE)
      d0 = int(np.searchsorted(offsets, start, side="right")) - 1
      d1 = int(np.searchsorted(offsets, stop - 1, side="right")) - 1
      bounds = offsets[d0:d1 + 2]
      lo, hi = np.maximum(bounds[:-1], start), np.minimum(bounds[1:], stop)
      docs = firsts[k] + np.arange(d0, d1 + 1) + self.doc_starts[shard]
      parts[i].append(((docs, lo - bounds[:-1], hi - lo), np.frombuffer(got[2 * k + 1], self.dtype)))
    return [_joined(p) for p in parts]

  def pieces(self, start: int, stop: int) -> Pieces:
    """The documents under global tokens [start, stop) and how much of each lies there:
    (document index in the split, first token used within the document, tokens used), in order."""
    return self.read([(start, stop)])[0][0]

  def read_tokens(self, start: int, stop: int) -> np.ndarray:
    """Global tokens [start, stop) as int32."""
    return self.read([(start, stop)])[0][1]


def _joined(parts: List[Tuple[Pieces, np.ndarray]]) -> Tuple[Pieces, np.ndarray]:
  if not parts:
    return (_EMPTY, _EMPTY, _EMPTY), np.zeros(0, np.int32)
  pieces = tuple(np.concatenate([p[0][k] for p in parts]).astype(np.int64) for k in range(3))
  return pieces, np.concatenate([p[1] for p in parts]).astype(np.int32)
