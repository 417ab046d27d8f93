"""Many byte ranges of many files in one call, a whole file in one request, a folder's file sizes from one listing.

A reader of a large store on an object store waits on round trips, not on bytes: a ranged GET
costs tens of milliseconds whatever its size, and opening a file through gcsfs costs a metadata
request before the first byte. So the ranges a caller needs are fetched together, as concurrent
ranged GETs over the client's connection pool (fsspec's cat_ranges: gcsfs on gs://), with no open
and no metadata request per file: the caller knows every range from its own records. `limit`
bounds the requests one call has in flight. Local files are read in line (pread), which costs
microseconds. Both kinds of path go through the same two functions (docs/architecture.md#paths-are-urls).

A bucket also limits the requests it takes per second (GCS: about 5,000 reads a second per bucket before
it scales up), so ranges of one file that lie close together are better fetched as one: `coalesce`
plans the requests, `cut` takes each range's bytes back out of them, and `fetch` reports each request's
outcome (bytes or the error) so that a caller can try the failed ones again.
"""

from __future__ import annotations

import collections
import os
import posixpath
from typing import Dict, List, Sequence, Tuple, Union

import fsspec

from midas_jax.fs.paths import check, is_remote

Range = Tuple[str, int, int]  # (path, first byte, byte after the last)
Place = Tuple[int, int]  # (the request that holds a range, where the range starts in the request's bytes)


def read_ranges(ranges: Sequence[Range], limit: int = 64) -> List[bytes]:
  """The bytes [start, stop) of each (path, start, stop), in order, one request each. A range past its
  file's end is an EOFError and a missing file a FileNotFoundError, each naming the path; storage errors
  pass through (after the client's own retries)."""
  out = fetch(ranges, limit)
  for data in out:
    if isinstance(data, BaseException):
      raise data
  return out  # type: ignore[return-value]


def fetch(ranges: Sequence[Range], limit: int = 64) -> List[Union[bytes, BaseException]]:
  """The bytes of each range, or the error its request met (a remote range's; a local read's error is
  raised): read_ranges for a caller that tries the failed requests again. A range past its file's end
  is an EOFError naming the path."""
  out: List[Union[bytes, BaseException]] = [b""] * len(ranges)
  remote = [i for i, (path, _, _) in enumerate(ranges) if is_remote(path)]
  local = [i for i, (path, _, _) in enumerate(ranges) if not is_remote(path)]
  if remote:
    filesystem, _ = fsspec.core.url_to_fs(check(ranges[remote[0]][0], "path"))
    got = filesystem.cat_ranges([fsspec.core.strip_protocol(ranges[i][0]) for i in remote],
                                [ranges[i][1] for i in remote], [ranges[i][2] for i in remote],
                                batch_size=limit, on_error="return")
    for i, data in zip(remote, got):
      out[i] = data
  by_file = collections.defaultdict(list)
  for i in local:
    by_file[ranges[i][0]].append(i)
  for path, indices in by_file.items():
    with open(check(path, "path"), "rb") as f:
      for i in indices:
        out[i] = os.pread(f.fileno(), ranges[i][2] - ranges[i][1], ranges[i][1])
  for k, ((path, start, stop), data) in enumerate(zip(ranges, out)):
    if not isinstance(data, BaseException) and len(data) != stop - start:
      out[k] = EOFError(f"{path!r} ends before byte {stop:,}")
  return out


def coalesce(ranges: Sequence[Range], gap: int) -> Tuple[List[Range], List[Place]]:
  """The requests that fetch `ranges` when ranges of one file that overlap, touch or lie less than `gap`
  bytes apart are read as one (the bytes between them read and dropped), and where each range lies in
  them: (requests, per range (request, offset)). Requests come in order of file and position; a
  range past its file's end stays past it (the request that holds it ends where the range does)."""
  order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1], ranges[i][2]))
  requests: List[List] = []
  members: List[List[int]] = []
  for i in order:
    path, start, stop = ranges[i]
    last = requests[-1] if requests else None
    if last is not None and last[0] == path and start - last[2] < max(gap, 1):
      last[2] = max(last[2], stop)
      members[-1].append(i)
    else:
      requests.append([path, start, stop])
      members.append([i])
  places: List[Place] = [(0, 0)] * len(ranges)
  for r, (request, held) in enumerate(zip(requests, members)):
    for i in held:
      places[i] = (r, ranges[i][1] - request[1])
  return [tuple(r) for r in requests], places  # type: ignore[misc]


def cut(ranges: Sequence[Range], places: Sequence[Place], got: Sequence[bytes]) -> List[bytes]:
  """Each range's bytes, taken out of the requests' bytes `got` at its place (from coalesce)."""
  def one(r: int, at: int, size: int) -> bytes:
    whole = got[r]
    return whole if at == 0 and size == len(whole) else bytes(memoryview(whole)[at:at + size])
  return [one(r, at, stop - start) for (_, start, stop), (r, at) in zip(ranges, places)]


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
