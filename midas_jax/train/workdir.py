"""A run's output folder: created and proven writable before any data is read or anything compiled."""

from __future__ import annotations

import os

import jax

from midas_jax import fs
from midas_jax.errors import ConfigError


def prepare_workdir(workdir: str) -> str:
  """Creates the workdir and checks it is writable; returns it absolute (a URL is kept as it is).

  A gs:// URL is checked by writing a probe, as a local folder is.
  """
  if not workdir:
    raise ConfigError("--workdir", "no workdir given", "pass --workdir=DIR or gs://BUCKET/DIR (created if missing)")
  workdir = fs.absolute(workdir, "--workdir")
  try:
    fs.makedirs(workdir)
    # one probe per process: hosts may share a workdir
    probe = fs.join(workdir, f".write_test.{jax.process_index()}.{os.getpid()}")
    fs.write_text(probe, "ok")
    fs.remove(probe)
  except Exception as e:  # pylint: disable=broad-except  # gcsfs and google-auth raise their own types
    reason = getattr(e, "strerror", None) or f"{type(e).__name__}: {e}"
    raise ConfigError("--workdir", f"cannot write to {workdir} ({reason})",
                      "choose a directory (or a bucket and credentials) you can write to") from None
  return workdir
