"""Bring a transformers Llama or GPT-2 checkpoint into midas_jax as a params-only export.

The result loads with `midas_jax.checkpoint.load_model`, evaluates with our suites, and starts a new
run through `CheckpointConfig.init_from` (the written `imported.gin` binds the model, vocabulary and
init_from). A directory that `midas export --format=hf` wrote round-trips exactly: its midas_jax.json
restores the run's config, step, stage and lineage.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

from midas_jax import configs, fs
from midas_jax.convert import hf_config, mapping, writers
from midas_jax.convert.export import prepare_out_dir
from midas_jax.data import vocab as vocab_lib
from midas_jax.errors import ConfigError, require

GIN_FILE = "imported.gin"
_PROVENANCE_KEYS_NOT_CARRIED = ("config", "model_config", "versions", "format", "depth", "exported_format",
                                "unrolled_loop", "source", "exported_to")


def gin_path(out_dir: str) -> str:
  return fs.join(out_dir, GIN_FILE)


def _read_safetensors(path: str) -> Dict[str, np.ndarray]:
  from safetensors.numpy import load_file  # lazy: the convert extra (bf16 arrives as ml_dtypes.bfloat16)
  return load_file(path)


def _read_torch_bin(path: str) -> Dict[str, np.ndarray]:
  import torch  # lazy; weights_only refuses arbitrary pickled objects
  state = torch.load(path, map_location="cpu", weights_only=True)
  return {k: v.float().numpy() for k, v in state.items()}


def read_hf_weights(hf_dir: str) -> Dict[str, np.ndarray]:
  """The state dict of a transformers directory: safetensors (one file or sharded) or pytorch_model.bin."""
  for name, reader in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", _read_torch_bin)):
    single, index = os.path.join(hf_dir, name), os.path.join(hf_dir, name + ".index.json")
    if os.path.isfile(single):
      return reader(single)
    if os.path.isfile(index):
      with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
      state: Dict[str, np.ndarray] = {}
      for shard in shards:
        state.update(reader(os.path.join(hf_dir, shard)))
      return state
  raise ConfigError("--hf", f"{hf_dir} has no model.safetensors or pytorch_model.bin (nor a sharded index)",
                    "pass a directory written by save_pretrained")


def read_hf_config(hf_dir: str):
  require(os.path.isfile(os.path.join(hf_dir, "config.json")), "--hf", f"{hf_dir} has no config.json",
          "pass a transformers model directory (save_pretrained writes config.json)")
  from transformers import AutoConfig  # lazy: the convert extra; a local directory needs no network
  try:
    return AutoConfig.from_pretrained(hf_dir)
  except (ValueError, KeyError, OSError) as e:
    raise ConfigError("--hf config.json", f"transformers cannot read it ({e})",
                      "pass the directory of a Llama or GPT-2 model") from None


def _read_provenance(hf_dir: str) -> Optional[Dict[str, Any]]:
  path = os.path.join(hf_dir, writers.PROVENANCE_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def load_hf(hf_dir: str, base: Optional[configs.ModelConfig] = None) -> Tuple[dict, configs.ModelConfig]:
  """(our params as float32 numpy, the ModelConfig) of a transformers directory."""
  cfg = hf_config.model_config_from_hf(read_hf_config(hf_dir), base)
  return mapping.from_hf_state_dict(read_hf_weights(hf_dir), cfg, source=f"--hf {hf_dir}"), cfg


def _foreign_data_config(hf_dir: str, out_dir: str, vocab_size: int,
                         max_seq_len: int) -> Tuple[configs.DataConfig, str]:
  """A vocabulary for a model trained elsewhere: its SentencePiece model if it has our id layout."""
  seq_len = max(8, min(configs.DataConfig.seq_len, max_seq_len))
  spm = os.path.join(hf_dir, "tokenizer.model")
  reason = "the directory has no tokenizer.model"
  if os.path.isfile(spm):
    try:
      pieces = vocab_lib.SentencePieceVocabulary(spm, extra_ids=0).vocab_size
    except ConfigError as e:
      pieces, reason = None, f"its tokenizer.model does not fit ours ({e.problem})"
    if pieces is not None and pieces <= vocab_size:
      local = fs.join(out_dir, "tokenizer.model")
      fs.copy(spm, local)
      extra = min(configs.DataConfig.extra_ids, vocab_size - pieces)
      return (configs.DataConfig(vocab="sentencepiece", spm_model=local, extra_ids=extra, seq_len=seq_len),
              f"SentencePiece {local} with {extra} extra ids")
    if pieces is not None:
      reason = f"its tokenizer.model has {pieces} pieces, more than the model's {vocab_size} ids"
  base = vocab_lib.NUM_SPECIAL + vocab_lib.NUM_BYTES
  require(vocab_size >= base, "--hf", f"no usable tokenizer ({reason}) and the model's {vocab_size} ids are too "
          f"few for the byte vocabulary ({base})", "import a model whose tokenizer.model has pad 0, eos 1, unk 2")
  extra = min(configs.DataConfig.extra_ids, vocab_size - base)
  return (configs.DataConfig(vocab="byte", extra_ids=extra, seq_len=seq_len),
          f"placeholder byte vocabulary: {reason}; its ids do not mean what the model was trained on, so "
          "set DataConfig to the model's own tokenizer before training or evaluating on text")


def _gin_value(value: Any) -> str:
  return repr(tuple(value) if isinstance(value, list) else value)


def write_gin(out_dir: str, config: configs.RunConfig, depth: int) -> str:
  """imported.gin: the model, vocabulary and init_from bindings a new run needs to start from OUT."""
  model = dataclasses.replace(config.model, num_layers=depth)
  lines = [f"# Start a run from the model imported into {out_dir}:",
           f"#   midas train --gin_file=<experiment>.gin --gin_file={gin_path(out_dir)} --workdir=RUN",
           "# The first stage's model must have this shape (a growing run starts at its first stage's depth)."]
  lines += [f"ModelConfig.{f.name} = {_gin_value(getattr(model, f.name))}" for f in dataclasses.fields(model)]
  for name in ("vocab", "spm_model", "extra_ids"):
    lines.append(f"DataConfig.{name} = {_gin_value(getattr(config.data, name))}")
  lines.append(f"CheckpointConfig.init_from = {out_dir!r}")
  path = gin_path(out_dir)
  fs.write_text(path, "\n".join(lines) + "\n")
  return path


def import_hf(hf_dir: str, out_dir: str) -> Tuple[configs.RunConfig, Dict[str, Any]]:
  """Writes a params-only export of the transformers model in hf_dir to out_dir.

  Returns (the RunConfig recorded with it, its metadata). The model's depth is the HF layer count.
  Either directory may be a gs:// URL.
  """
  source = fs.absolute(hf_dir, "--hf")
  require(fs.isdir(source), "--hf", f"{source} is not a directory", "pass a transformers model directory")
  with fs.local_tree(source) as local:  # transformers and safetensors read local files only
    return _import_local(local, source, out_dir)


def _import_local(hf_dir: str, source: str, out_dir: str) -> Tuple[configs.RunConfig, Dict[str, Any]]:
  from midas_jax.checkpoint import write_params_export  # pylint: disable=import-outside-toplevel
  from midas_jax.checkpoint import metadata as metadata_lib  # pylint: disable=import-outside-toplevel
  provenance = _read_provenance(hf_dir)
  out_dir = prepare_out_dir(out_dir, "--workdir")
  metadata: Dict[str, Any] = {"imported_from": source}
  if provenance is not None:  # written by `midas export`: restore the run's settings
    saved = metadata_lib.config_from_dict(provenance["config"])
    at_depth = configs.ModelConfig(**provenance["model_config"]) if "model_config" in provenance else saved.model
    params, model = load_hf(hf_dir, base=at_depth)
    data = saved.data
    if data.vocab == "sentencepiece" and os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
      data = dataclasses.replace(data, spm_model=fs.join(out_dir, "tokenizer.model"))
      fs.copy(os.path.join(hf_dir, "tokenizer.model"), data.spm_model)
    metadata.update({k: v for k, v in provenance.items() if k not in _PROVENANCE_KEYS_NOT_CARRIED})
    metadata["tokenizer"] = f"the exporting run's ({data.vocab})"
    if model == at_depth and model.loop_repeats == saved.model.loop_repeats:
      config = dataclasses.replace(saved, data=data)  # exact: the run's config, at the exported depth
    else:  # an unrolled looped model, or an edited config.json: a model of its own, not a stage of that run
      config = dataclasses.replace(saved, data=data, model=model, stacking=configs.StackingConfig())
      metadata["stage"] = 1
  else:
    params, model = load_hf(hf_dir)
    data, note = _foreign_data_config(hf_dir, out_dir, model.vocab_size, model.max_seq_len)
    config = configs.RunConfig(model=model, data=data)
    metadata.update(tokenizer=note, step=0, stage=1)
  metadata["depth"] = model.num_layers
  write_params_export(out_dir, params, config, metadata)
  write_gin(out_dir, config, model.num_layers)
  return config, metadata
