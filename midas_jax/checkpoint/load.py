"""Loading a model for eval or conversion: its parameters, without the optimizer, and what it is.

`load_model` reads a run's workdir (its latest good checkpoint, or a chosen step) or a params-only
export (a directory with `params/`, an orbax PyTree of the model's parameters, and `metadata.json`,
the same metadata as a checkpoint: config, stage, depth, lineage, versions; export.py writes it),
always without touching optimizer state, onto one device as float32 NumPy arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from midas_jax import fs
from midas_jax.checkpoint import manager as manager_lib
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.configs import ModelConfig, RunConfig
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.data.vocab.vocabulary import Vocabulary
from midas_jax.errors import ConfigError
from midas_jax.model import Decoder, dummy_batch

PARAMS_DIR = "params"  # a params-only export's layout
METADATA_FILE = "metadata.json"


@dataclasses.dataclass
class LoadedModel:
  params: Any  # Decoder(model_config)'s unboxed "params", NumPy arrays
  model_config: ModelConfig  # vocab_size filled in, num_layers = the depth at this step
  config: RunConfig
  step: int
  stage: int
  metadata: Dict[str, Any]

  @property
  def vocab(self) -> Vocabulary:
    return make_vocabulary(self.config.data)


def abstract_params(model_config: ModelConfig, device=None):
  """Shapes and dtypes of Decoder(model_config)'s params, placed on one device."""
  shapes = jax.eval_shape(lambda: nn.unbox(Decoder(model_config).init(jax.random.key(0), dummy_batch(1, 8))["params"]))
  sharding = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), shapes)


def model_config_of(metadata: Dict[str, Any]) -> tuple:
  """(RunConfig, ModelConfig at the saved depth) from checkpoint or export metadata."""
  config = metadata_lib.config_from_dict(metadata["config"])
  model = config.model if metadata.get("depth") is None else dataclasses.replace(config.model, num_layers=metadata["depth"])
  return config, model


def is_params_export(path: str) -> bool:
  return fs.isfile(fs.join(path, METADATA_FILE)) and fs.isdir(fs.join(path, PARAMS_DIR))


def _load_export(path: str) -> LoadedModel:
  meta = fs.read_json(fs.join(path, METADATA_FILE))
  config, model = model_config_of(meta)
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(fs.join(path, PARAMS_DIR), abstract_params(model))
  return LoadedModel(jax.tree.map(np.asarray, params), model, config, int(meta["step"]), int(meta.get("stage", 1)), meta)


def _load_from_run(workdir: str, step: Optional[int]) -> LoadedModel:
  directory = manager_lib.checkpoint_dir(workdir)
  manager = manager_lib.make_manager(directory, read_only=True)
  steps = sorted(manager.all_steps(), reverse=True)
  if step is not None:
    if step not in steps:
      raise ConfigError("--step", f"no checkpoint of step {step} in {directory} (have {sorted(steps)})",
                        "pass one of the saved steps, or omit --step for the latest")
    steps = [step]
  errors = []
  for s in steps:  # newest first: a bad latest save falls back to the one before
    try:
      meta = manager_lib.restore_metadata(manager, s)
      config, model = model_config_of(meta)
      params = manager_lib.restore_params(manager, s, abstract_params(model))
      return LoadedModel(jax.tree.map(np.asarray, params), model, config, s, int(meta.get("stage", 1)), meta)
    except manager_lib.CorruptCheckpointError as e:
      errors.append(str(e))
  raise ConfigError("--workdir", f"no usable checkpoint in {directory}" + (f" ({'; '.join(errors)})" if errors else ""),
                    "pass the --workdir of a `midas train` run that saved a checkpoint, or a params-only export")


def load_model(path: str, step: Optional[int] = None) -> LoadedModel:
  """A run's workdir (latest good checkpoint, or `step`) or a params-only export, params only."""
  path = fs.absolute(path, "--workdir")
  if is_params_export(path):
    return _load_export(path)
  if fs.isdir(manager_lib.checkpoint_dir(path)):
    return _load_from_run(path, step)
  raise ConfigError("--workdir", f"{path} is neither a run with checkpoints nor a params-only export",
                    "pass a `midas train` workdir (it has checkpoints/) or a directory written by "
                    "`midas export --format=params`")
