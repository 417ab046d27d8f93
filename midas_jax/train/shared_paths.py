"""Paths every machine of a run must see as one: the workdir and the prepared store.

On several machines a local path names a different folder on each: every host would write its own
checkpoints, a restore would find different saves on different hosts, and a prepared store would
have to be copied to each. So a run on more than one machine takes gs:// URLs for them, or local
paths that TrainerConfig.shared_filesystem declares mounted on every machine (NFS, Filestore, GCS
FUSE). Checked at start, before anything is read or compiled.
"""

from __future__ import annotations

from typing import List, Tuple

from midas_jax import fs
from midas_jax.configs import RunConfig
from midas_jax.errors import ConfigError


def shared_paths(config: RunConfig, workdir: str) -> List[Tuple[str, str]]:
  """(setting, path) of every path the run's machines must see as one."""
  paths = [("--workdir", workdir)]
  if config.data.source == "prepared" and config.data.prepared_dir:
    paths.append(("DataConfig.prepared_dir", config.data.prepared_dir))
  return paths


def check_shared_paths(config: RunConfig, workdir: str, machines: int) -> None:
  """ConfigError naming the first local path of `shared_paths` when the run spans several machines
  and the user has not declared its local paths shared."""
  if machines <= 1 or config.trainer.shared_filesystem:
    return
  for setting, path in shared_paths(config, workdir):
    if not fs.is_remote(path):
      raise ConfigError(setting, f"{path!r} is a local path, but this run's processes are on {machines} machines: "
                        "each would read and write a folder of its own",
                        "use a gs:// URL, or set TrainerConfig.shared_filesystem=True if every machine mounts "
                        "that path from one filesystem (NFS, Filestore, GCS FUSE)")
