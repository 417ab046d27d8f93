"""Storage latency added to a benchmark (`midas bench data --storage_latency_ms`), and the requests counted.

A store next to its hosts answers in a few milliseconds; a bucket in another region, or one under
load, in tens. The figure that matters is whether the reader keeps up when every request costs
that long, so `added` makes every HTTP request of this process's gs:// client (gcsfs, through
fsspec's configuration) wait `seconds` after its answer's headers arrive, holding its connection
as a slow answer would, and counts the requests and their time. It works the same against a real
bucket and against an emulator, and needs nothing between the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Iterator

import aiohttp
import fsspec.config

_PROTOCOL = "gs"


@dataclasses.dataclass
class Requests:
  """HTTP requests made inside the block, and their seconds from sent to answered (latency included)."""
  count: int = 0
  seconds: float = 0.0


@contextlib.contextmanager
def added(seconds: float) -> Iterator[Requests]:
  """Every gs:// request of a client made inside the block waits `seconds` more; yields the counters.

  Clients made before the block are left as they are: fsspec keys its cached clients by their
  settings, so the block's own settings give a fresh client, and the old one is used again after it.
  """
  counted, inside = Requests(), [True]  # a client made inside lives on (etils caches its own): it stops waiting

  async def start(session, context, params):
    del session, params
    context.sent = time.perf_counter()

  async def end(session, context, params):
    del session, params
    if not inside[0]:
      return
    if seconds > 0:
      await asyncio.sleep(seconds)
    counted.count += 1
    counted.seconds += time.perf_counter() - context.sent

  trace = aiohttp.TraceConfig()
  trace.on_request_start.append(start)
  trace.on_request_end.append(end)
  saved = fsspec.config.conf.get(_PROTOCOL)
  ours = dict(saved or {})
  ours["session_kwargs"] = dict(ours.get("session_kwargs", {}), trace_configs=[trace])
  fsspec.config.conf[_PROTOCOL] = ours
  try:
    yield counted
  finally:
    inside[0] = False
    if saved is None:
      fsspec.config.conf.pop(_PROTOCOL, None)
    else:
      fsspec.config.conf[_PROTOCOL] = saved
