"""Which exceptions mean "the storage did not answer" rather than "the data is wrong" or "the code is wrong".

A run on a bucket meets errors that say nothing about what is stored: HTTP 408, 429 and 5xx, connections reset
or refused, timeouts, credentials that expired. They pass (an outage ends, a token is refreshed), so a caller
retries them or stops and asks to be run again, but never treats them as evidence about the data: a restore
that sets a good save aside because the bucket answered 503 loses work. Permission refusals (403) are told
apart: they do not pass by waiting.

The clients raise their own types, and the classification reads those and nothing worded: class names (any
base: gcsfs's HttpError, aiohttp's and requests' connection errors, google-auth's RefreshError), HTTP status
attributes (gcsfs, google-api-core, aiohttp, requests), and tensorstore's absl status code with the HTTP status
it attaches as a payload (exception_chain.status_code). It imports none of those libraries. One match on words
is left, where a library gives nothing else (gcsfs's 403, below). `classify` reads every link of an exception
(exception_chain.links), as libraries wrap the client's error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
from typing import Iterator, Optional

from midas_jax.errors import StorageUnavailableError
from midas_jax.exception_chain import links, status_code

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
# tensorstore attaches the HTTP status as an absl payload, which Status::ToString() renders as [key='value'].
_TS_HTTP = re.compile(r"\[http_response_code='(\d{3})'\]")
_TS_TRANSPORT = re.compile(r"\[curl_code='\d+'\]")  # and its transport's error, when no answer came back
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


def _from_client(e: BaseException) -> bool:
  return any(type(e).__module__.split(".")[0] == m for m in _CLIENT_MODULES) or \
      any(c.__module__.split(".")[0] in _CLIENT_MODULES for c in type(e).__mro__[1:-1])


def http_status(e: BaseException) -> Optional[int]:
  """The HTTP status `e` carries: a storage client's status attribute (gcsfs's HttpError and google-api-core:
  .code; aiohttp: .status; requests: .status_code), or the payload tensorstore attaches to its status."""
  if _from_client(e):
    for attr in ("code", "status", "status_code"):
      value = getattr(e, attr, None)
      if isinstance(value, int) and 100 <= value <= 599:
        return value
  if isinstance(e, ValueError) and status_code(e) is not None:
    payload = _TS_HTTP.search(str(e))
    return int(payload.group(1)) if payload else None
  return None


def _one(e: BaseException) -> Optional[StorageFault]:
  text = f"{type(e).__name__}: {e}".strip().rstrip(":")
  status = http_status(e)
  if status is not None and http_kind(status):
    return StorageFault(http_kind(status), f"HTTP {status} ({text})")
  code = status_code(e) if isinstance(e, ValueError) else None
  if code is not None and status is None:  # tensorstore's, with no HTTP answer (one that is no fault's: not ours)
    # A transport error (e.g. ABORTED: its retries spent on a refused connection) says no answer came back.
    kind = UNAVAILABLE if _TS_TRANSPORT.search(str(e)) else _TS_KINDS.get(code)
    return StorageFault(kind, f"{code} ({_short(str(e))})") if kind else None
  # gcsfs (2026.10.1, retry.validate_response) raises a 403 as a builtin OSError whose message is all it
  # gives: no status attribute. Its fixed prefix is matched on that exact type alone.
  if type(e) is OSError and str(e).startswith("Forbidden: "):  # pylint: disable=unidiomatic-typecheck
    return StorageFault(DENIED, f"HTTP 403 ({_short(str(e))})")
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
  for e in links(error):
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
