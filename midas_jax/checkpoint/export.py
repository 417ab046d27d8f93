"""Parameters without the optimizer, exported: a params-only export of any Decoder's parameters, or of a
run's checkpoint.

The export is a directory with `params/` (an orbax PyTree of the model's parameters) and `metadata.json`
(the same metadata as a checkpoint: config, stage, depth, lineage, versions); load.py's `load_model`
reads it back.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from midas_jax import fs
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.checkpoint.load import METADATA_FILE, PARAMS_DIR, load_model
from midas_jax.configs import RunConfig
from midas_jax.errors import ConfigError


def write_params_export(out_dir: str, params, config: RunConfig, metadata: Optional[Dict[str, Any]] = None) -> str:
  """Writes `params` (any pytree of arrays laid out as Decoder's) and metadata to out_dir."""
  out_dir = fs.absolute(out_dir, "--out")
  if fs.exists(fs.join(out_dir, PARAMS_DIR)):
    raise ConfigError("--out", f"{out_dir} already holds an export", "choose a new output directory")
  fs.makedirs(out_dir)
  meta = dict(metadata or {})
  meta.setdefault("step", 0)
  meta.setdefault("stage", 1)
  meta.setdefault("depth", config.model.num_layers)
  meta["config"] = metadata_lib.config_to_dict(config)
  meta["versions"] = metadata_lib.package_versions()
  meta["format"] = metadata_lib.FORMAT_VERSION
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(fs.join(out_dir, PARAMS_DIR), jax.tree.map(np.asarray, params))
  if jax.process_index() == 0:
    fs.write_json(fs.join(out_dir, METADATA_FILE), meta)
  return out_dir


def export_run_params(workdir: str, out_dir: str, step: Optional[int] = None) -> str:
  """A run's checkpoint (latest, or `step`) as a params-only export."""
  model = load_model(workdir, step)
  return write_params_export(out_dir, model.params, model.config, model.metadata)
