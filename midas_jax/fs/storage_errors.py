"""Which exceptions mean "the storage did not answer" rather than "the data is wrong" or "the code is wrong".

A run on a bucket meets errors that say nothing about what is stored: HTTP 408, 429 and 5xx, connections reset
or refused, timeouts, credentials that expired. They pass (an outage ends, a token is refreshed), so a caller
retries them or stops and asks to be run again, but never treats them as evidence about the data: a restore
that sets a good save aside because the bucket answered 503 loses work. Permission refusals (403) are told
apart: they do not pass by waiting.

The clients raise their own types (gcsfs's HttpError, aiohttp's and requests' connection errors,
google-auth's RefreshError) and tensorstore raises ValueError with a status code in its message, so the
classification reads class names, status attributes and tensorstore's status text, and imports none of
those libraries. `classify` walks an exception's causes, as libraries wrap the client's error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
from typing import Iterator, List, Optional

from midas_jax.errors import StorageUnavailableError

UNAVAILABLE = "unavailable"  # transient: the storage did not answer in time, or answered "try again"
CREDENTIALS = "credentials"  # the credentials were refused or could not be refreshed (often an expired token)
DENIED = "denied"  # the credentials lack a permission: waiting does not help

STATUS_URL = {"gs": "https://status.cloud.google.com", "s3": "https://health.aws.amazon.com",
              "az": "https://azure.status.microsoft"}
CLIENT_LOGGERS = ("gcsfs", "fsspec", "google.auth")  # they log tracebacks of errors they then raise
_CLIENT_MODULES = ("gcsfs", "google", "aiohttp", "requests", "urllib3", "botocore", "s3fs", "adlfs", "fsspec",
                   "huggingface_hub", "http", "urllib", "tensorstore")
_CONNECTION_CLASSES = {  # class names (any base) of client errors that mean the request did not get through
    "ClientConnectionError", "ClientPayloadError", "ServerTimeoutError", "ServerDisconnectedError",
    "ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "ChunkedEncodingError", "ProxyError",
    "SSLError", "TransportError", "ChecksumError", "IncompleteRead", "RemoteDisconnected"}
_TS_STATUS = re.compile(r"^([A-Z_]+): ")
_TS_HTTP = re.compile(r"http_response_code='(\d{3})'")
_TS_KINDS = {"UNAVAILABLE": UNAVAILABLE, "DEADLINE_EXCEEDED": UNAVAILABLE, "UNAUTHENTICATED": CREDENTIALS,
             "PERMISSION_DENIED": DENIED}


@dataclasses.dataclass(frozen=True)
class StorageFault:
  """What kind of storage error an exception is, and one line that says it."""
  kind: str
  summary: str

  @property
  def transient(self) -> bool:
    return self.kind != DENIED


def http_kind(status: int) -> Optional[str]:
  if status in (408, 429) or 500 <= status <= 599:
    return UNAVAILABLE
  return {401: CREDENTIALS, 403: DENIED}.get(status)


def _chain(error: BaseException) -> List[BaseException]:
  """The exception, its causes and contexts, and the members of exception groups, each once."""
  seen, out, todo = set(), [], [error]
  while todo and len(out) < 32:
    e = todo.pop(0)
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    out.append(e)
    todo.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])
  return out


def _from_client(e: BaseException) -> bool:
  return any(type(e).__module__.split(".")[0] == m for m in _CLIENT_MODULES) or \
      any(c.__module__.split(".")[0] in _CLIENT_MODULES for c in type(e).__mro__[1:-1])


def _status(e: BaseException) -> Optional[int]:
  """The HTTP status a client's exception carries (gcsfs: .code, google-api-core: .code, aiohttp: .status)."""
  if not _from_client(e):
    return None
  for attr in ("code", "status", "status_code"):
    value = getattr(e, attr, None)
    if isinstance(value, int) and 100 <= value <= 599:
      return value
  return None


def _one(e: BaseException) -> Optional[StorageFault]:
  text = f"{type(e).__name__}: {e}".strip().rstrip(":")
  status = _status(e)
  if status is not None and http_kind(status):
    return StorageFault(http_kind(status), f"HTTP {status} ({text})")
  message = str(e)
  ts_status = _TS_STATUS.match(message)
  if isinstance(e, ValueError) and ts_status:  # tensorstore: "UNAVAILABLE: ...", with the HTTP code when it had one
    http = _TS_HTTP.search(message)
    kind = http_kind(int(http.group(1))) if http else _TS_KINDS.get(ts_status.group(1))
    return StorageFault(kind, f"{ts_status.group(1)} ({_short(message)})") if kind else None
  if type(e).__name__ == "OSError" and message.startswith("Forbidden: "):  # how gcsfs raises a 403
    return StorageFault(DENIED, f"HTTP 403 ({_short(message)})")
  names = {c.__name__ for c in type(e).__mro__}
  if "RefreshError" in names or "DefaultCredentialsError" in names:
    return StorageFault(CREDENTIALS, text)
  if _from_client(e) and names & _CONNECTION_CLASSES:
    return StorageFault(UNAVAILABLE, text)
  if isinstance(e, (ConnectionError, TimeoutError)):  # resets, refusals, broken pipes, socket and asyncio timeouts
    return StorageFault(UNAVAILABLE, text)
  if isinstance(e, PermissionError):
    return StorageFault(DENIED, text)
  return None


def _short(message: str, limit: int = 300) -> str:
  line = " ".join(message.split())
  return line if len(line) <= limit else line[:limit] + " ..."


def classify(error: BaseException) -> Optional[StorageFault]:
  """The storage fault `error` is (or wraps), or None when it is not a storage error."""
  for e in _chain(error):
    fault = _one(e)
    if fault is not None:
      return fault
  return None


def advice(fault: StorageFault, url: str) -> str:
  """What a user does about `fault` on the storage of `url`."""
  scheme = url.split("://", 1)[0] if "://" in url else ""
  status = f" and the provider's status page ({STATUS_URL[scheme]})" if scheme in STATUS_URL else ""
  if fault.kind == CREDENTIALS:
    return ("refresh the credentials (on a VM its service account; elsewhere `gcloud auth application-default "
            "login` or GOOGLE_APPLICATION_CREDENTIALS), then run the same command again")
  if fault.kind == DENIED:
    return "give the credentials access to the bucket (e.g. roles/storage.objectAdmin), or choose another path"
  return f"this is usually transient: run the same command again in a few minutes; check the network{status}"


def describe(fault: StorageFault) -> str:
  if fault.kind == CREDENTIALS:
    return f"the storage refused the credentials: {fault.summary}"
  if fault.kind == DENIED:
    return f"the storage refused access: {fault.summary}"
  return f"the storage is unavailable: {fault.summary}"


def unavailable(error: BaseException, url: str, doing: str) -> Optional[StorageUnavailableError]:
  """The error to stop with when `doing` something to `url` (e.g. "writing to") met a transient storage
  fault; None when `error` is something else (a permission refusal included), which the caller reports."""
  fault = classify(error)
  if fault is None or not fault.transient:
    return None
  return StorageUnavailableError(f"{doing} {url}: {describe(fault)}\n  fix: {advice(fault, url)}")


@contextlib.contextmanager
def quiet_clients() -> Iterator[None]:
  """Inside the block the storage clients' own error logs are dropped (gcsfs logs the traceback of an error
  it is about to raise): the caller reports the error once, in its own words. Blocks may overlap (threads):
  the logs come back when the last one ends."""
  with _QUIET_LOCK:
    if not _QUIET["depth"]:
      _QUIET["levels"] = [(log, log.level) for log in map(logging.getLogger, CLIENT_LOGGERS)]
      for log, _ in _QUIET["levels"]:
        log.setLevel(logging.CRITICAL + 1)
    _QUIET["depth"] += 1
  try:
    yield
  finally:
    with _QUIET_LOCK:
      _QUIET["depth"] -= 1
      if not _QUIET["depth"]:
        for log, level in _QUIET["levels"]:
          log.setLevel(level)


_QUIET_LOCK = threading.Lock()
_QUIET = {"depth": 0, "levels": []}
