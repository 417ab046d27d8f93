"""Many byte ranges of many files in one call, a whole file in one request, a folder's file sizes from one listing.

A reader of a large store on an object store waits on round trips, not on bytes: a ranged GET
costs tens of milliseconds whatever its size, and opening a file through gcsfs costs a metadata
request before the first byte. So the ranges a caller needs are fetched together, as concurrent
ranged GETs over the client's connection pool (fsspec's cat_ranges: gcsfs on gs://), with no open
and no metadata request per file: the caller knows every range from its own records. `limit`
bounds the requests one call has in flight. Local files are read in line (pread), which costs
microseconds. Both kinds of path go through the same two functions (docs/architecture.md#paths-are-urls).
"""

from __future__ import annotations

import collections
import os
import posixpath
from typing import Dict, List, Sequence, Tuple

import fsspec

from midas_jax.fs.paths import check, is_remote

Range = Tuple[str, int, int]  # (path, first byte, byte after the last)


def read_ranges(ranges: Sequence[Range], limit: int = 64) -> List[bytes]:
  """The bytes [start, stop) of each (path, start, stop), in order. A range past its file's end is an
  EOFError and a missing file a FileNotFoundError, each naming the path; storage errors pass through
  (after the client's own retries)."""
  out: List[bytes] = [b""] * len(ranges)
  remote = [i for i, (path, _, _) in enumerate(ranges) if is_remote(path)]
  local = [i for i, (path, _, _) in enumerate(ranges) if not is_remote(path)]
  if remote:
    filesystem, _ = fsspec.core.url_to_fs(check(ranges[remote[0]][0], "path"))
    got = filesystem.cat_ranges([fsspec.core.strip_protocol(ranges[i][0]) for i in remote],
                                [ranges[i][1] for i in remote], [ranges[i][2] for i in remote],
                                batch_size=limit, on_error="return")
    for i, data in zip(remote, got):
      if isinstance(data, BaseException):
        raise data
      out[i] = data
  by_file = collections.defaultdict(list)
  for i in local:
    by_file[ranges[i][0]].append(i)
  for path, indices in by_file.items():
    with open(check(path, "path"), "rb") as f:
      for i in indices:
        out[i] = os.pread(f.fileno(), ranges[i][2] - ranges[i][1], ranges[i][1])
  for (path, start, stop), data in zip(ranges, out):
    if len(data) != stop - start:
      raise EOFError(f"{path!r} ends before byte {stop:,}")
  return out


def read_file(path: str) -> bytes:
  """A whole file in one request (no metadata request first, as an open would make); FileNotFoundError
  if it is not there."""
  path = check(path, "path")
  if not is_remote(path):
    with open(path, "rb") as f:
      return f.read()
  filesystem, stripped = fsspec.core.url_to_fs(path)
  return filesystem.cat_file(stripped)


def file_sizes(directory: str) -> Dict[str, int]:
  """{name: bytes} of the files directly in `directory`, from one listing ({} if it does not exist)."""
  directory = check(directory, "path")
  if not is_remote(directory):
    if not os.path.isdir(directory):
      return {}
    with os.scandir(directory) as entries:
      return {e.name: e.stat().st_size for e in entries if e.is_file()}
  filesystem, path = fsspec.core.url_to_fs(directory)
  try:
    listing = filesystem.ls(path, detail=True, refresh=True)
  except FileNotFoundError:
    return {}
  return {posixpath.basename(e["name"].rstrip("/")): int(e["size"]) for e in listing if e.get("type") == "file"}
