"""Bring a transformers Llama, Qwen2 or GPT-2 checkpoint into midas_jax as a params-only export.

The result loads with `midas_jax.checkpoint.load_model`, evaluates with our suites, and starts a new
run through `CheckpointConfig.init_from` (the written `imported.gin` binds the model, vocabulary and
init_from). A directory that `midas export --format=hf` wrote round-trips exactly: its midas_jax.json
restores the run's config, step, stage and lineage.

A model trained elsewhere brings its tokenizer: its files are copied into OUT/tokenizer/ and the
run's vocabulary is that tokenizer with its own ids (data/vocab/vocabulary.py). The special tokens it lacks
(pad, sentinels, UL2 mode tokens) take ids above its vocabulary; when the model's embedding has no
rows for them, it gets new rows, each the mean of the trained ones (a neutral start that leaves every
logit of the original ids unchanged), up to a multiple of ModelConfig.vocab_multiple.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import numpy as np

from midas_jax import configs, fs
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.checkpoint import write_params_export
from midas_jax.convert import hf_config, mapping
from midas_jax.convert import tokenizer as tokenizer_lib
from midas_jax.convert import writers
from midas_jax.convert.export import prepare_out_dir
from midas_jax.data.vocab import vocabulary as vocab_lib
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import ConfigError, require
from midas_jax.padding import round_up

GIN_FILE = "imported.gin"
TOKENIZER_DIR = "tokenizer"
_PROVENANCE_KEYS_NOT_CARRIED = ("config", "model_config", "versions", "format", "depth", "exported_format",
                                "unrolled_loop", "source", "exported_dtype")


def _read_safetensors(path: str) -> Dict[str, np.ndarray]:
  from safetensors.numpy import load_file  # lazy: the convert extra (bf16 arrives as ml_dtypes.bfloat16)
  with fs.local_copy(path) as local:
    return load_file(local)


def _read_torch_bin(path: str) -> Dict[str, np.ndarray]:
  import torch  # lazy; weights_only refuses arbitrary pickled objects
  with fs.local_copy(path) as local:
    state = torch.load(local, map_location="cpu", weights_only=True)
  return {k: v.float().numpy() for k, v in state.items()}


def read_hf_weights(hf_dir: str) -> Dict[str, np.ndarray]:
  """The state dict of a transformers directory: safetensors (one file or sharded) or pytorch_model.bin."""
  for name, reader in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", _read_torch_bin)):
    single, index = fs.join(hf_dir, name), fs.join(hf_dir, name + ".index.json")
    if fs.isfile(single):
      return reader(single)
    if fs.isfile(index):
      state: Dict[str, np.ndarray] = {}
      for shard in sorted(set(fs.read_json(index)["weight_map"].values())):
        state.update(reader(fs.join(hf_dir, shard)))
      return state
  raise ConfigError("--hf", f"{hf_dir} has no model.safetensors or pytorch_model.bin (nor a sharded index)",
                    "pass a directory written by save_pretrained")


def read_hf_config(hf_dir: str):
  path = fs.join(hf_dir, "config.json")
  require(fs.isfile(path), "--hf", f"{hf_dir} has no config.json",
          "pass a transformers model directory (save_pretrained writes config.json)")
  from transformers import CONFIG_MAPPING  # lazy: the convert extra; a local read needs no network
  try:
    values = fs.read_json(path)
    kind = values.get("model_type")
    require(kind in CONFIG_MAPPING, "--hf config.json model_type", f"{kind!r} is not a transformers model type",
            f"import one of {hf_config.IMPORTABLE}")
    return CONFIG_MAPPING[kind].from_dict(values)
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError("--hf config.json", f"transformers cannot read it ({e})",
                      "pass the directory of a Llama, Qwen2 or GPT-2 model") from None


def _read_provenance(hf_dir: str) -> Optional[Dict[str, Any]]:
  path = fs.join(hf_dir, writers.PROVENANCE_FILE)
  return fs.read_json(path) if fs.isfile(path) else None


def load_hf(hf_dir: str, base: Optional[configs.ModelConfig] = None) -> Tuple[dict, configs.ModelConfig]:
  """(our params as float32 numpy, the ModelConfig) of a transformers directory."""
  cfg = hf_config.model_config_from_hf(read_hf_config(hf_dir), base)
  return mapping.from_hf_state_dict(read_hf_weights(hf_dir), cfg, source=f"--hf {hf_dir}"), cfg


def fit_vocabulary(params: dict, cfg: configs.ModelConfig, vocab) -> Tuple[dict, configs.ModelConfig, int]:
  """Embedding (and untied head) rows for every id of `vocab`: (params, config, rows added).

  New rows are the mean of the existing ones, so the logits of the original ids do not change.
  """
  if cfg.vocab_size >= vocab.vocab_size:
    return params, cfg, 0
  multiple = configs.ModelConfig.vocab_multiple
  rows = round_up(vocab.vocab_size, multiple)
  added = rows - cfg.vocab_size
  grown = dict(params)
  table = params["embedding"]
  grown["embedding"] = np.concatenate([table, np.repeat(table.mean(0, keepdims=True), added, 0)])
  if "head" in params:  # [d_model, vocab]
    grown["head"] = np.concatenate([params["head"], np.repeat(params["head"].mean(1, keepdims=True), added, 1)], 1)
  return grown, dataclasses.replace(cfg, vocab_size=rows, vocab_multiple=multiple), added


def _foreign_data_config(hf_dir: str, out_dir: str, vocab_size: int,
                         max_seq_len: int) -> Tuple[configs.DataConfig, str]:
  """The vocabulary of a model trained elsewhere: its own tokenizer, or a placeholder without one."""
  seq_len = max(8, min(configs.DataConfig.seq_len, max_seq_len))
  found = tokenizer_lib.import_tokenizer(hf_dir, fs.join(out_dir, TOKENIZER_DIR))
  if found is not None:
    settings, note = found
    return configs.DataConfig(seq_len=seq_len, **settings), note
  base = vocab_lib.NUM_SPECIAL + vocab_lib.NUM_BYTES
  require(vocab_size >= base, "--hf", f"no tokenizer (neither tokenizer.json nor tokenizer.model) and the model's "
          f"{vocab_size} ids are too few for the byte vocabulary ({base})",
          "import a directory that holds the model's tokenizer files")
  extra = min(configs.DataConfig.extra_ids, vocab_size - base)
  return (configs.DataConfig(vocab="byte", extra_ids=extra, seq_len=seq_len),
          "placeholder byte vocabulary: the directory has no tokenizer.json or tokenizer.model; its ids do not "
          "mean what the model was trained on, so set DataConfig to the model's own tokenizer before training or "
          "evaluating on text")


def _own_export_data(saved: configs.DataConfig, hf_dir: str, out_dir: str) -> configs.DataConfig:
  """The exporting run's data config, its tokenizer files copied into out_dir and pointed at there."""
  tok_dir = fs.join(out_dir, TOKENIZER_DIR)
  data = saved
  if saved.tokenizer:
    originals = fs.join(hf_dir, tokenizer_lib.ORIGINALS_DIR)
    tokenizer_lib.copy_tokenizer_files(originals if fs.isdir(originals) else hf_dir, tok_dir)
    data = dataclasses.replace(data, tokenizer=tok_dir)
  if saved.vocab == "sentencepiece" and fs.isfile(fs.join(hf_dir, "tokenizer.model")):
    fs.makedirs(tok_dir)
    fs.copy(fs.join(hf_dir, "tokenizer.model"), fs.join(tok_dir, "tokenizer.model"))
    data = dataclasses.replace(data, spm_model=fs.join(tok_dir, "tokenizer.model"))
  return data


def _gin_value(value: Any) -> str:
  return repr(tuple(value) if isinstance(value, list) else value)


def write_gin(out_dir: str, config: configs.RunConfig, depth: int) -> str:
  """imported.gin: the model, vocabulary and init_from bindings a new run needs to start from OUT."""
  model = dataclasses.replace(config.model, num_layers=depth)
  lines = [f"# Start a run from the model imported into {out_dir}:",
           f"#   midas train --gin_file=<experiment>.gin --gin_file={fs.join(out_dir, GIN_FILE)} --workdir=RUN",
           "# The first stage's model must have this shape. To grow it, set ModelConfig.num_layers to the final",
           f"# depth and start the stages at this one: StackingConfig.start_blocks = {depth} // block_size",
           "# (docs/stacking.md#grow-a-pretrained-model)."]
  lines += [f"ModelConfig.{f.name} = {_gin_value(getattr(model, f.name))}" for f in dataclasses.fields(model)]
  for name in ("vocab", "spm_model", "tokenizer", "extra_ids"):
    lines.append(f"DataConfig.{name} = {_gin_value(getattr(config.data, name))}")
  lines.append(f"CheckpointConfig.init_from = {out_dir!r}")
  path = fs.join(out_dir, GIN_FILE)
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
  provenance = _read_provenance(hf_dir)
  out_dir = prepare_out_dir(out_dir, "--workdir")
  metadata: Dict[str, Any] = {"imported_from": source}
  if provenance is not None:  # written by `midas export`: restore the run's settings
    saved = metadata_lib.config_from_dict(provenance["config"])
    at_depth = configs.ModelConfig(**provenance["model_config"]) if "model_config" in provenance else saved.model
    params, model = load_hf(hf_dir, base=at_depth)
    data = _own_export_data(saved.data, hf_dir, out_dir)
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
    vocab = make_vocabulary(data)
    params, model, added = fit_vocabulary(params, model, vocab)
    config = configs.RunConfig(model=model, data=data)
    metadata.update(tokenizer=note, vocabulary=vocab.special_ids(), step=0, stage=1)
    if added:
      metadata["embedding_rows_added"] = added
  metadata["depth"] = model.num_layers
  write_params_export(out_dir, params, config, metadata)
  write_gin(out_dir, config, model.num_layers)
  return config, metadata
