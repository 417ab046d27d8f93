"""An HTTP proxy of ours between the storage clients and the GCS emulator (tests/gcs_emulator.py), for
tests that need a bucket as it really behaves: latency on every request, a fraction of requests
answered 503, every request answered 503 for a window (an outage), or requests held (a stall).

The proxy forwards each request to the emulator as it came (method, path, headers, body) and its
answer back; the emulator's own address in an answer (a resumable upload's Location, an object's
mediaLink) is rewritten to the proxy's, so that every later request of that exchange comes through
the proxy too. A fault is decided before a request is forwarded: a 503 is never applied on the
server, as a real front end's 503 before the request reaches storage.

Clients find the proxy through the same variables as the emulator (`environment()`). gcsfs reads
them when a filesystem is created and fsspec keeps that filesystem, so a test points a client at
the proxy in a fresh process (pass `environment()` to the subprocess), or with `installed()`, which
also clears gcsfs's instance cache on the way in and out.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import random
import re
import sys
import threading
import time
import urllib.parse
from typing import Dict, Iterator, List, Optional, Tuple

from gcs_emulator import Emulator, _free_port

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "content-length", "host"}
UNAVAILABLE = json.dumps({"error": {"code": 503, "message": "injected by tests/fault_proxy.py: service unavailable",
                                    "errors": [{"reason": "backendError"}]}}).encode()


class FaultProxy:
  """A proxy in front of `emulator` on 127.0.0.1, with faults set by its attributes (thread-safe to change
  while it serves):

  delay_s: seconds every request waits before it is forwarded (storage latency).
  error_rate: the fraction of requests answered 503 (drawn from a generator seeded with `seed`).
  outage(seconds): every request answered 503 until that many seconds from now.
  stall(seconds): every request held that long before it is forwarded, until `stall` is called with 0.
  only: None, or a regular expression: then the faults above apply only to requests whose path (percent-decoded,
    with its query: `/storage/v1/b/B/o/run/checkpoints/4/params/...`) it matches; the others pass untouched.
  status: what a faulted request is answered with: 503 (the default: unavailable) or e.g. 403 (permission denied).
  Counters: `requests` (all that arrived), `injected` (answered 503 by the proxy); `log` lists every request as
  (method, decoded path, whether it was answered 503 by the proxy).
  """

  def __init__(self, emulator: Emulator, seed: int = 0):
    self.emulator = emulator
    self.port = _free_port()
    self.delay_s = 0.0
    self.error_rate = 0.0
    self.only: Optional[str] = None
    self.status = 503
    self.requests = 0
    self.injected = 0
    self.log: List[Tuple[str, str, bool]] = []
    self._stall_s = 0.0
    self._outage_until = 0.0
    self._random = random.Random(seed)
    self._lock = threading.Lock()
    self._server: Optional[http.server.ThreadingHTTPServer] = None
    self._thread: Optional[threading.Thread] = None

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def environment(self) -> Dict[str, str]:
    """The emulator's client variables, with the proxy's address."""
    return {k: (self.url if v == self.emulator.url else v) for k, v in self.emulator.environment().items()}

  # ------------------------------------------------------------------------- faults

  def outage(self, seconds: float) -> None:
    with self._lock:
      self._outage_until = time.monotonic() + seconds

  def stall(self, seconds: float) -> None:
    with self._lock:
      self._stall_s = seconds

  def clear(self) -> None:
    """No faults: no delay, no errors, no outage, no stall, on any path."""
    with self._lock:
      self.delay_s, self.error_rate, self._stall_s, self._outage_until = 0.0, 0.0, 0.0, 0.0
      self.only, self.status = None, 503

  def _decide(self, method: str = "GET", path: str = "") -> tuple:
    """(seconds to wait, whether to answer 503) for one request, counted and logged."""
    path = urllib.parse.unquote(path)
    with self._lock:
      self.requests += 1
      if self.only is not None and not re.search(self.only, path):
        self.log.append((method, path, False))
        return 0.0, False
      fail = time.monotonic() < self._outage_until or self._random.random() < self.error_rate
      self.injected += fail
      self.log.append((method, path, fail))
      return self.delay_s + self._stall_s, fail

  # ------------------------------------------------------------------------- serving

  def start(self) -> "FaultProxy":
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):  # quiet: the tests read the counters
        pass

      def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
          chunks = []
          while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            chunk = self.rfile.read(size)
            self.rfile.readline()  # the CRLF after the chunk
            if size == 0:
              while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
              return b"".join(chunks)
            chunks.append(chunk)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

      def _answer(self, status: int, headers, body: bytes) -> None:
        self.send_response(status)
        for key, value in headers:
          if key.lower() not in HOP_BY_HOP:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
          self.wfile.write(body)

      def _forward(self) -> None:
        body = self._body()
        wait, fail = proxy._decide(self.command, self.path)
        if wait:
          time.sleep(wait)
        if fail:
          body = UNAVAILABLE if proxy.status == 503 else json.dumps(
              {"error": {"code": proxy.status, "message": f"injected by tests/fault_proxy.py: HTTP {proxy.status}"}}).encode()
          self._answer(proxy.status, [("Content-Type", "application/json")], body)
          return
        upstream = http.client.HTTPConnection("127.0.0.1", proxy.emulator.port, timeout=120)
        try:
          headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
          headers["Host"] = f"127.0.0.1:{proxy.emulator.port}"
          upstream.request(self.command, self.path, body=body, headers=headers)
          response = upstream.getresponse()
          payload = response.read()
        finally:
          upstream.close()
        theirs, ours = proxy.emulator.url.encode(), proxy.url.encode()
        answer_headers = [(k, v.replace(proxy.emulator.url, proxy.url)) for k, v in response.getheaders()]
        self._answer(response.status, answer_headers, payload.replace(theirs, ours))

      do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

    class Server(http.server.ThreadingHTTPServer):
      # socketserver listens with a backlog of 5: a burst of new connections (a store's reads ahead open
      # dozens at once) overflows it, and the kernel drops SYNs that clients resend after 1, 3, 7 s.
      request_queue_size = 1024

      def handle_error(self, request, client_address):  # a client that hung up (it gave up waiting) is no error
        if not isinstance(sys.exc_info()[1], ConnectionError):
          super().handle_error(request, client_address)

    self._server = Server(("127.0.0.1", self.port), Handler)
    self._server.daemon_threads = True
    self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    if self._server is not None:
      self._server.shutdown()
      self._server.server_close()
      self._server = None

  @contextlib.contextmanager
  def installed(self) -> Iterator["FaultProxy"]:
    """This process's storage clients go through the proxy inside the block."""
    import gcsfs  # pylint: disable=import-outside-toplevel
    saved = {k: os.environ.get(k) for k in self.environment()}
    os.environ.update(self.environment())
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
      yield self
    finally:
      for key, value in saved.items():
        if value is None:
          os.environ.pop(key, None)
        else:
          os.environ[key] = value
      gcsfs.GCSFileSystem.clear_instance_cache()
