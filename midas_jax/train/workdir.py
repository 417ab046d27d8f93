"""A run's output folder: created and proven writable before any data is read or anything compiled."""

from __future__ import annotations

import os

import jax

from midas_jax import fs
from midas_jax.errors import ConfigError
from midas_jax.fs import storage_errors


def prepare_workdir(workdir: str) -> str:
  """Creates the workdir and checks it is writable; returns it absolute (a URL is kept as it is).

  A gs:// URL is checked by writing a probe, as a local folder is. A probe that meets a storage outage
  (HTTP 5xx/429/408, a reset or timed-out connection, an expired token) stops the run as that
  (StorageUnavailableError: run it again later), not as a directory it cannot write to.
  """
  if not workdir:
    raise ConfigError("--workdir", "no workdir given", "pass --workdir=DIR or gs://BUCKET/DIR (created if missing)")
  workdir = fs.absolute(workdir, "--workdir")
  try:
    with storage_errors.quiet_clients():  # the error below says it once, without the client's logged traceback
      fs.makedirs(workdir)
      # one probe per process: hosts may share a workdir
      probe = fs.join(workdir, f".write_test.{jax.process_index()}.{os.getpid()}")
      fs.write_text(probe, "ok")
      fs.remove(probe)
  except Exception as e:  # pylint: disable=broad-except  # gcsfs and google-auth raise their own types
    outage = storage_errors.unavailable(e, workdir, "--workdir: writing to")
    if outage is not None:  # an outage or an expired token is not a permission problem
      raise outage from None
    reason = getattr(e, "strerror", None) or f"{type(e).__name__}: {e}"
    raise ConfigError("--workdir", f"cannot write to {workdir} ({reason})",
                      "choose a directory (or a bucket and credentials) you can write to") from None
  return workdir
