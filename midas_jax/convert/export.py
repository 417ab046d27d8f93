"""Export a model at its current depth (a run's checkpoint or a params-only export) to a format."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from midas_jax import fs
from midas_jax.checkpoint import load_model
from midas_jax.checkpoint import metadata as metadata_lib
from midas_jax.configs import ModelConfig, RunConfig
from midas_jax.convert import hf_config, shards, writers
from midas_jax.data.vocab.factory import make_vocabulary
from midas_jax.errors import require
from midas_jax.model import layer_order


def unroll_loop(params: Mapping, cfg: ModelConfig) -> Tuple[dict, ModelConfig]:
  """A looped model as the plain stack it computes: each application of the loop becomes a layer copy."""
  order = layer_order.order_for(cfg)
  if order is None:
    return dict(params), cfg

  def gather(tree):
    return {k: gather(v) if isinstance(v, Mapping) else np.asarray(v)[order] for k, v in tree.items()}

  unrolled = dataclasses.replace(cfg, num_layers=len(order), loop_start=0, loop_size=0, loop_repeats=1)
  return {**params, "layers": gather(params["layers"])}, unrolled


def prepare_out_dir(out_dir: str, flag: str = "--out") -> str:
  """Creates out_dir; refuses a file or a non-empty directory (nothing is ever overwritten)."""
  out_dir = fs.absolute(out_dir, flag)
  require(not fs.isfile(out_dir), flag, f"{out_dir} is a file", "pass a directory path")
  require(not (fs.isdir(out_dir) and fs.listdir(out_dir)), flag, f"{out_dir} is not empty",
          "choose a new directory: conversion never overwrites files")
  fs.makedirs(out_dir)
  return out_dir


def write_export(params: Mapping, model_config: ModelConfig, run_config: RunConfig, out_dir: str,
                  fmt: str = "hf", provenance: Optional[Dict[str, Any]] = None, dtype: str = "float32",
                  max_shard_size=shards.DEFAULT_MAX_SHARD_SIZE) -> List[str]:
  """Writes `params` of `model_config` (the current depth) in `fmt`; returns the file names written.

  run_config is the run's config (its data config names the vocabulary); provenance (step, stage,
  lineage, ...) is recorded in midas_jax.json so `midas import` can restore the run's settings.
  dtype ("float32" or "bfloat16") is the weights' dtype in hf and torch exports (npz keeps float32);
  max_shard_size ("5GB", "500MiB" or bytes) splits hf weights into shards with an index.
  """
  require(fmt in writers.FORMATS, "--format", f"unknown format {fmt!r}", f"use one of {writers.FORMATS}")
  shards.numpy_dtype(dtype)
  require(fmt != "npz" or dtype == "float32", "--dtype", "npz exports keep float32", "drop --dtype for npz")
  shard_bytes = shards.parse_size(max_shard_size)
  params, cfg = unroll_loop(params, model_config)
  if fmt != "npz":
    hf_config.check_exportable(cfg)
  if fmt == "hf":
    ids = make_vocabulary(run_config.data).vocab_size
    require(ids <= cfg.vocab_size, "DataConfig", f"the vocabulary has {ids} ids, more than the model's "
            f"{cfg.vocab_size} embedding rows", "export with the data config the model was trained with")
  out_dir = prepare_out_dir(out_dir)
  provenance = dict(provenance or {})
  provenance.update(depth=cfg.num_layers, exported_format=fmt, unrolled_loop=cfg is not model_config,
                    exported_dtype=dtype)
  provenance.setdefault("step", 0)
  provenance.setdefault("stage", 1)
  provenance["config"] = metadata_lib.config_to_dict(run_config)
  provenance["model_config"] = dataclasses.asdict(cfg)
  writers.write_provenance(out_dir, provenance)
  if fmt == "hf":
    return writers.write_hf(out_dir, params, cfg, run_config, provenance, dtype, shard_bytes)
  if fmt == "torch":
    return writers.write_torch(out_dir, params, cfg, run_config.objectives, provenance, dtype)
  return writers.write_npz(out_dir, params, cfg, provenance)


def export_model(path: str, out_dir: str, fmt: str = "hf", step: Optional[int] = None, dtype: str = "float32",
                 max_shard_size=shards.DEFAULT_MAX_SHARD_SIZE) -> List[str]:
  """Loads a run's workdir (latest good checkpoint, or `step`) or a params-only export, and exports it."""
  require(fmt in writers.FORMATS, "--format", f"unknown format {fmt!r}", f"use one of {writers.FORMATS}")
  shards.numpy_dtype(dtype)
  shards.parse_size(max_shard_size)
  loaded = load_model(path, step)
  provenance = {k: v for k, v in loaded.metadata.items() if k not in ("config",)}
  provenance.update(source=fs.absolute(path, "--workdir"), step=loaded.step, stage=loaded.stage)
  return write_export(loaded.params, loaded.model_config, loaded.config, out_dir, fmt, provenance, dtype,
                       max_shard_size)
